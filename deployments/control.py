"""IndexControl: the one place that says which index version the routers serve (see IndexPointer)."""

from __future__ import annotations

import logging

from ray import serve

from deployments.config import index_app_name
from shardserve.errors import ShardserveError
from shardserve.query.index_pointer import ActiveIndex, IndexPointer
from shardserve.runtime.ray_private import kv_delete, kv_get, kv_put

logger = logging.getLogger("ray.serve")


def _pointer_key(main_app: str) -> str:
    return f"pointer/{main_app}"


def forget_pointer(main_app: str) -> None:
    """A fresh deployment (or an undeploy) of `main_app` drops the stored pointer."""
    kv_delete(_pointer_key(main_app))


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000,
                  graceful_shutdown_timeout_s=2)
class IndexControl:
    """Routers poll `poll`; `shardserve swap` calls `activate` and waits for `drained`.

    The pointer is stored in Ray's GCS key-value store at every swap, and a restarted replica
    takes it from there: routers keep serving the swapped-in version, and the next swap's
    generation is higher than every router's (a pointer back at generation 0 would be ignored by
    them). A stored pointer is used only for the same configured index and while its app exists.
    """

    def __init__(self, args: dict):
        self.main_app = serve.get_replica_context().app_name
        self.args = args  # the application's settings: a swapped-in version is deployed with them
        self.pointer = IndexPointer(ActiveIndex(0, args["index"], index_app_name(self.main_app), ""))
        self._restore()

    def _restore(self) -> None:
        stored = kv_get(_pointer_key(self.main_app))
        if not stored:
            return
        kept = IndexPointer(self.pointer.active)
        try:
            if not kept.restore(stored, self.args["index"]):
                return  # the app was redeployed with another index: start from it
        except ShardserveError as exc:  # serve the configured index; the next swap rewrites it
            logger.error("%s: serving the configured index %s at generation 0", exc, self.args["index"])
            forget_pointer(self.main_app)
            return
        if kept.active.app not in serve.status().applications:
            logger.warning("stored index pointer names a deleted app %s: ignored", kept.active.app)
            return
        self.pointer.active, self.pointer.previous = kept.active, kept.previous
        logger.info("index pointer restored at generation %d (%s)", kept.active.generation, kept.active.app)

    def _store(self) -> None:
        kv_put(_pointer_key(self.main_app), self.pointer.stored(self.args["index"]))

    def poll(self, replica: str, generation: int, old_in_flight: int) -> dict:
        """A router's heartbeat: records what it serves, returns what it should serve."""
        self.pointer.report(replica, generation, old_in_flight)
        return self.pointer.active.__dict__

    def activate(self, index: str, app: str, version: str, expected_generation: int | None = None) -> dict:
        """Compare-and-set: SwapConflict when the pointer is no longer at `expected_generation`."""
        active = self.pointer.activate(index, app, version, expected_generation)
        self._store()  # before any router can see it: a restart never goes back a generation
        return active.__dict__

    def drained(self, generation: int) -> bool:
        return self.pointer.drained(generation)

    def describe(self) -> dict:
        return {**self.pointer.describe(), "args": self.args}
