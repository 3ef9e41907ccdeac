"""`shardserve swap`: replace the served index with no failed request.

1. deploy the new version as its own Serve application beside the serving one (no HTTP route);
2. recall gate: eval queries through the new version's shards (same fan-out and merge as the
   router) against exact ground truth; below `gate_min_recall` the new app is deleted and the old
   one never stopped serving;
3. switch: IndexControl's pointer moves one generation; each router replica picks it up on its next
   poll (one attribute assignment, so a request is answered by one version, never a mix);
4. drain: wait until every live router serves the new generation with no request on the old one,
   then delete the old application (unless kept for `--rollback`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time

import numpy as np

from deployments.config import INDEX_INGRESS, AppArgs, index_app_name
from shardserve.data.datasets import Dataset, load_dataset
from shardserve.data.groundtruth import (
    GROUND_TRUTH_K,
    exact_search,
    graded_as,
    ground_truth,
    recall_at_k,
    without_self,
)
from shardserve.errors import ShardserveError
from shardserve.index.indexes import index_from_bytes, stored_points, supported_params
from shardserve.index.manifest import Manifest, Published, read_manifest, read_shard_checked
from shardserve.index.storage import Location
from shardserve.query.index_pointer import SwapConflict
from shardserve.runtime.background import run_on_loop
from shardserve.runtime.ray_private import delete_app_nowait, run_app

logger = logging.getLogger(__name__)
CONTROL = "IndexControl"


class GateFailed(ShardserveError):
    """The new index's recall is below the configured threshold; the old one keeps serving."""


def gate_recall(manifest: Manifest, dataset_spec: str | None, queries: int, location: Location | None = None
                ) -> tuple[np.ndarray, Dataset, np.ndarray]:
    """Eval's queries and exact ground truth of the data the index was built from (checked by
    fingerprint, so a gate can never grade an index against the wrong data).

    A compacted version (index_build.compact, at `location`) holds what the writes left: its truth
    is computed over its own points, the vectors its shards store, when its kind stores them as
    they are (flat codes). Otherwise it is graded against its lineage's data, where the rows the
    writes deleted count as misses and the points they added are unknown: heavy churn lowers its
    recall, and the swap may need --min-recall or a rebuild."""
    rows = int(manifest.build.params.get("dataset_rows", manifest.num_vectors))
    dataset = load_dataset(dataset_spec or manifest.dataset.name, limit=rows, **manifest.dataset.columns())
    if dataset.fingerprint() != manifest.dataset.fingerprint:
        raise ShardserveError(
            f"the recall gate needs the dataset the index was built from ({manifest.dataset.name}, "
            f"{rows} vectors): pass it with --dataset")
    dataset = graded_as(dataset, manifest.metric)  # after the fingerprint check: that is the data's
    truth = ground_truth(dataset)[:queries]
    own = None if dataset.query_rows is None else dataset.query_rows[:queries]
    held_out = dataclasses.replace(dataset, queries=dataset.queries[:queries], query_rows=own)
    if location is not None and "compacted_from" in manifest.build.params:
        live = _live_points(manifest, location)
        if live is not None:
            held_out, truth = _graded_on(held_out, *live)
    return held_out.queries, held_out, truth


def _live_points(manifest: Manifest, location: Location) -> tuple[np.ndarray, np.ndarray] | None:
    """Every point the version's shards store (ids, vectors), or None when they store codes."""
    parts = []
    for entry in manifest.shards:
        points = stored_points(index_from_bytes(read_shard_checked(location, entry)))
        if points is None:
            return None
        parts.append(points)
    return np.concatenate([ids for ids, _ in parts]), np.concatenate([vectors for _, vectors in parts])


def _graded_on(held_out: Dataset, ids: np.ndarray, vectors: np.ndarray) -> tuple[Dataset, np.ndarray]:
    """The eval queries as a dataset over these points, and their exact top-k ids' rows in it (a
    base-only source's query leaves its own point out, when the writes kept it)."""
    live = Dataset(f"{held_out.name} (compacted)", vectors, held_out.queries, held_out.metric, ids=ids)
    own_ids = held_out.self_ids()
    own = None if own_ids is None else live.rows_of(own_ids)
    live = dataclasses.replace(live, query_rows=own)
    _, truth = exact_search(vectors, held_out.queries, GROUND_TRUTH_K, held_out.metric, exclude=own)
    return live, truth


def _check_headroom(args: AppArgs, manifest: Manifest) -> None:
    """The new version runs beside the old until the switch: refuse early if it cannot be placed,
    rather than leave its replicas pending forever."""
    import ray

    replicas = (args.shard_autoscaling or {}).get("min_replicas", args.replicas_per_shard)
    need = len(manifest.shards) * max(replicas, 1) * args.shard_num_cpus
    free = ray.available_resources().get("CPU", 0.0)
    if need > free + 1e-9:
        raise ShardserveError(
            f"the new version needs {need:g} CPUs beside the serving one, the cluster has {free:g} "
            "free: add a node (or start Ray with more --num-cpus), or lower shard_num_cpus")


async def _wait_ready(app: str, timeout_s: float) -> dict:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            handle = serve.get_deployment_handle(INDEX_INGRESS, app)
            return await asyncio.wait_for(handle.info.remote(), 10.0)
        except Exception as exc:  # shards still loading
            last = exc
            await asyncio.sleep(0.5)
    raise ShardserveError(f"index app {app} not ready after {timeout_s:.0f} s ({last})")


async def _gate(app: str, manifest: Manifest, args: AppArgs, dataset_spec: str | None) -> float:
    from ray import serve

    queries, held_out, truth = await asyncio.to_thread(gate_recall, manifest, dataset_spec,
                                                       args.gate_queries, Location.parse(args.index))
    supported = supported_params(manifest.index_factory, manifest.dim, manifest.metric)
    params = {name: value for name, value in args.gate_params.items() if name in supported}
    handle = serve.get_deployment_handle(INDEX_INGRESS, app)
    own = held_out.self_ids()  # base-only data: queries are indexed rows, their own hit is dropped
    found = []
    for start in range(0, len(queries), 100):
        found.append(await handle.search.remote(queries[start:start + 100], args.gate_k + (own is not None),
                                                params))
    found_ids = without_self(np.concatenate(found), own, args.gate_k)
    return recall_at_k(found_ids, held_out, args.gate_k, truth)


async def _running(app: str) -> bool:
    """Deployed and not on its way out (a replaced version's app is deleted without waiting)."""
    from ray import serve

    status = (await asyncio.to_thread(serve.status)).applications.get(app)
    return status is not None and status.status == "RUNNING"


async def _describe(control, timeout_s: float) -> dict:
    """The pointer's state; waits out an IndexControl replica that Serve is restarting."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await asyncio.wait_for(control.describe.remote(), 10.0)
        except Exception as exc:
            if time.monotonic() > deadline:
                raise ShardserveError(f"the index pointer (IndexControl) is not answering: {exc}") from None
            await asyncio.sleep(0.5)


async def _swap(new_index: str, app_name: str, dataset_spec: str | None, min_recall: float | None,
                keep_previous: bool, skip_gate: bool, timeout_s: float) -> dict:
    from ray import serve

    from deployments.index_version import index_app

    timings: dict[str, float] = {}
    published = await asyncio.to_thread(Published.open, new_index)
    new_index = published.version.uri  # its version, not its directory
    control = serve.get_deployment_handle(CONTROL, app_name)
    state = await _describe(control, timeout_s=60.0)
    args = AppArgs.model_validate({**state["args"], "index": new_index})
    active = state["active"]
    old = read_manifest(Location.parse(active["index"]))
    new = published.manifest
    if (new.dim, new.metric) != (old.dim, old.metric):
        raise ShardserveError(f"the new index takes dim {new.dim} {new.metric} vectors, clients send "
                              f"dim {old.dim} {old.metric}: not swappable")
    if new.index_version == old.index_version and new_index == active["index"]:
        raise ShardserveError(f"index {new.index_version} at {new_index} is already being served")
    previous = state["previous"]
    started = time.perf_counter()
    if previous and previous["index"] == new_index and await _running(previous["app"]):
        new_app = previous["app"]  # rollback to a version kept deployed (--keep-previous): reuse it
        await _wait_ready(new_app, timeout_s)
    else:
        # Named by version and generation: never the name of an app still being deleted (Serve
        # drains an ingress ~30 s), whose cached handles would keep pointing at dead replicas.
        # and by this swap alone (a concurrent swap to the same version must not redeploy or
        # delete this one's app)
        new_app = (f"{index_app_name(app_name, new.index_version)}-g{active['generation'] + 1}"
                   f"-{secrets.token_hex(3)}")
        _check_headroom(args, new)
        await asyncio.to_thread(run_app, index_app(args.model_dump(), None, published), new_app, None, False)
        try:
            await _wait_ready(new_app, timeout_s)
        except ShardserveError:
            await asyncio.to_thread(delete_app_nowait, new_app)
            raise
    timings["deploy_s"] = round(time.perf_counter() - started, 2)

    recall = None
    threshold = args.gate_min_recall if min_recall is None else min_recall
    if not skip_gate:
        started = time.perf_counter()
        try:
            recall = round(await _gate(new_app, new, args, dataset_spec), 5)
        except BaseException:  # the gate could not run: the new version must not linger
            await asyncio.to_thread(delete_app_nowait, new_app)
            raise
        timings["gate_s"] = round(time.perf_counter() - started, 2)
        if recall < threshold:
            await asyncio.to_thread(delete_app_nowait, new_app)
            raise GateFailed(f"recall@{args.gate_k} of {new.index_version} is {recall:.4f} < "
                             f"{threshold} on {args.gate_queries} eval queries: rolled back "
                             f"(deleted {new_app}); {old.index_version} still serving")

    started = time.perf_counter()
    try:  # compare-and-set against the generation this swap started from
        pointer = await control.activate.remote(new_index, new_app, new.index_version, active["generation"])
    except Exception as exc:
        cause = getattr(exc, "cause", None) or exc  # the replica's own error, not Ray's wrapper
        # delete the new app only when the pointer surely does not name it (a lost compare-and-set,
        # or the pointer read back naming others): never left deployed unreferenced, never the live one
        lost = isinstance(exc, SwapConflict) or isinstance(cause, SwapConflict)
        named: set = set()
        if not lost:
            now = await _describe(control, timeout_s=60.0)
            named = {now["active"]["app"], (now["previous"] or {}).get("app")}
        if new_app not in named and new_app != (previous or {}).get("app"):
            await asyncio.to_thread(delete_app_nowait, new_app)
        raise ShardserveError(f"swap to {new.index_version} not activated: {cause}") from None
    while not await control.drained.remote(pointer["generation"]):
        if time.perf_counter() - started > timeout_s:
            raise ShardserveError(f"routers did not drain generation {active['generation']} within "
                                  f"{timeout_s:.0f} s; both versions left deployed")
        await asyncio.sleep(0.1)
    timings["switch_and_drain_s"] = round(time.perf_counter() - started, 2)
    if not keep_previous:
        # Routers no longer send it anything (drained above); do not wait out Serve's teardown
        # (an ingress replica lingers RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S, 30 s).
        await asyncio.to_thread(delete_app_nowait, active["app"])
    return {"old_version": old.index_version, "new_version": new.index_version,
            "old_app": active["app"], "new_app": new_app, "generation": pointer["generation"],
            "recall": recall, "min_recall": None if skip_gate else threshold, "k": args.gate_k,
            "gate_queries": None if skip_gate else args.gate_queries,
            "removed_old": not keep_previous, "seconds": timings}


def swap_index(new_index: str, app_name: str = "shardserve", dataset_spec: str | None = None,
               min_recall: float | None = None, keep_previous: bool = False, skip_gate: bool = False,
               timeout_s: float = 300.0) -> dict:
    """Swap the index `app_name` serves to `new_index` (see the module docstring); a report dict."""
    if "://" not in new_index:
        import os

        new_index = os.path.abspath(new_index)
    return run_on_loop(_swap(new_index, app_name, dataset_spec, min_recall, keep_previous, skip_gate,
                      timeout_s))


def rollback(app_name: str = "shardserve", timeout_s: float = 300.0) -> dict:
    """Serve the index that was active before the last swap again (no gate: it served before)."""
    from ray import serve

    async def previous() -> dict | None:
        return (await serve.get_deployment_handle(CONTROL, app_name).describe.remote())["previous"]

    before = run_on_loop(previous())
    if before is None:
        raise ShardserveError(f"{app_name} has not been swapped: nothing to roll back to")
    return swap_index(before["index"], app_name, skip_gate=True, timeout_s=timeout_s)
