"""IndexControl: the one place that says which index version the routers serve (see IndexPointer)."""

from __future__ import annotations

from ray import serve

from deployments.config import index_app_name
from serving.index_pointer import ActiveIndex, IndexPointer


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000,
                  graceful_shutdown_timeout_s=2)
class IndexControl:
    """Routers poll `poll`; `shardserve swap` calls `activate` and waits for `drained`.

    The pointer lives in this replica's memory: if Serve restarts it, routers fall back to the
    index in the application's config (re-run the swap, or put the new index in the config).
    """

    def __init__(self, args: dict):
        main_app = serve.get_replica_context().app_name
        self.args = args  # the application's settings: a swapped-in version is deployed with them
        self.pointer = IndexPointer(ActiveIndex(0, args["index"], index_app_name(main_app), ""))

    def poll(self, replica: str, generation: int, old_in_flight: int) -> dict:
        """A router's heartbeat: records what it serves, returns what it should serve."""
        self.pointer.report(replica, generation, old_in_flight)
        return self.pointer.active.__dict__

    def activate(self, index: str, app: str, version: str) -> dict:
        return self.pointer.activate(index, app, version).__dict__

    def drained(self, generation: int) -> bool:
        return self.pointer.drained(generation)

    def describe(self) -> dict:
        return {**self.pointer.describe(), "args": self.args}
