"""Zero-downtime index swap on real Serve under a real vegeta load; the recall gate refuses a bad index."""

from __future__ import annotations

from pathlib import Path

import httpx
import orjson
import pytest

from index_build.job import build_index
from loadtests.served import wait_for
from shardserve.data.datasets import load_dataset
from shardserve.index.manifest import read_manifest
from shardserve.index.storage import Location
from tests.conftest import SERVE_PORT as PORT

pytestmark = pytest.mark.slow
APP = "swap"
LIMIT = 5000


def _version(index: Path) -> str:
    return read_manifest(Location.parse(str(index))).index_version


def _replicas(app: str, deployment: str) -> set[str]:
    import ray

    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{app}#{deployment}#")}


def _kill_replica(app: str, deployment: str) -> None:
    """Kill the deployment's (one) replica actor; return once Serve has started its replacement.

    Waiting only for the old actor to vanish is not enough: Serve's controller notices a dead
    replica at its next health check, and until then handles (and /v1/health) may still count it."""
    import ray

    [name] = _replicas(app, deployment)
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    wait_for(lambda: _replicas(app, deployment) - {name}, f"Serve replacing {name}", timeout_s=60,
             interval_s=0.5)


def _restart_router(app: str) -> None:
    """Kill the router's replica; wait until Serve has replaced it and it is healthy."""
    from deployments.run import wait_until_healthy

    _kill_replica(app, "Router")
    wait_until_healthy(f"http://127.0.0.1:{PORT}/{app}", timeout_s=120)


def _fully_answered(url: str, body: bytes, timeout_s: float = 60.0) -> dict:
    """The first answer every shard took part in: a restarted replica is reached once the router's
    handle and shard link have followed it (a second or so after it is up), not at once."""
    def full() -> dict:
        answer = httpx.post(f"{url}/v1/search", content=body, timeout=30).json()
        coverage = answer["coverage"]
        return answer if coverage["answered"] == coverage["shards"] else {}

    return wait_for(full, "an answer every shard took part in", timeout_s=timeout_s, interval_s=0.5)


def test_swap_under_load_then_gate_refuses_bad_index(ray_cluster, tmp_path: Path) -> None:
    from deployments.run import deploy, shard_replicas, undeploy
    from deployments.swap import GateFailed, rollback, swap_index
    from loadtests.during import swap_under_load

    old, new, bad = tmp_path / "old", tmp_path / "new", tmp_path / "bad"
    build_index("fashion-mnist", 2, "IVF64,Flat", str(old), limit=LIMIT, backend="local")
    build_index("fashion-mnist", 2, "IVF64,Flat", str(new), limit=LIMIT, backend="local", seed=99)
    build_index("fashion-mnist", 2, "IVF64,PQ4", str(bad), limit=LIMIT, backend="local")
    versions = {_version(old), _version(new)}
    assert len(versions) == 2

    url = deploy(str(old), port=PORT, app_name=APP, route_prefix=f"/{APP}", gate_params={"nprobe": 16},
                 shard_num_cpus=0.1, router_num_cpus=0.1)
    try:
        record = swap_under_load(url, str(new), rate=80, duration_s=25, lead_s=3,
                                 params={"nprobe": 16}, app_name=APP)
        result = record["result"]
        assert result["requests"] >= 80 * 25 * 0.95
        assert result["non_2xx"] == 0 and result["lost"] == 0, result["status_codes"]
        assert set(result["index_versions"]) == versions  # both served, nothing else
        assert record["swap"]["recall"] >= 0.9 and record["swap"]["removed_old"]
        done = result["events_s"]["swap_done"]
        after = [s for s in result["timeline"] if s["second"] > done + 1]
        assert after and all(f"v:{_version(old)[:8]}" not in s for s in after)
        assert record["index_after"]["version"] == _version(new)

        _restart_router(APP)  # a router replica started after the swap serves the new version
        body = orjson.dumps({"vector": load_dataset("fashion-mnist", num_queries=1).queries[0], "k": 5},
                            option=orjson.OPT_SERIALIZE_NUMPY)
        answer = httpx.post(f"{url}/v1/search", content=body, timeout=10)
        assert answer.status_code == 200 and answer.json()["index"] == _version(new)

        with pytest.raises(GateFailed, match="still serving"):
            swap_index(str(bad), app_name=APP)
        answer = httpx.post(f"{url}/v1/search", content=body, timeout=10)
        assert answer.status_code == 200 and answer.json()["index"] == _version(new)
        from ray import serve

        # both refused and replaced versions' apps are deleted
        wait_for(lambda: len([a for a in serve.status().applications if a.startswith(APP)]) <= 2,
                 "the refused and the replaced versions' apps deleted", timeout_s=60, interval_s=0.5)
        apps = sorted(a for a in serve.status().applications if a.startswith(APP))
        assert len(apps) == 2 and apps[0] == APP and apps[1].startswith(f"{APP}-index-{_version(new)[:12]}-g")
        assert set(shard_replicas(APP)) == {"shard-000", "shard-001"}

        # --keep-previous, then rollback on command: back to the kept version, reusing its app
        back = swap_index(str(old), app_name=APP, keep_previous=True)
        assert back["new_version"] == _version(old) and not back["removed_old"]
        undo = rollback(APP)
        assert undo["new_app"] == back["old_app"] and undo["new_version"] == _version(new)
        answer = httpx.post(f"{url}/v1/search", content=body, timeout=10)
        assert answer.status_code == 200 and answer.json()["index"] == _version(new)

        # The pointer survives an IndexControl restart: generations keep rising, every router
        # follows the next swap (a pointer back at generation 0 was ignored by the routers).
        generation = undo["generation"]
        _kill_replica(APP, "IndexControl")  # its pointer must survive
        third = swap_index(str(old), app_name=APP, skip_gate=True)
        assert third["generation"] == generation + 1 and third["new_version"] == _version(old)
        answers = [httpx.post(f"{url}/v1/search", content=body, timeout=10) for _ in range(10)]
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        assert {a.json()["index"] for a in answers} == {_version(old)}
    finally:
        undeploy(APP)


def test_rebuild_in_place_never_reaches_a_running_deployment(ray_cluster, tmp_path: Path) -> None:
    """`build --force` into the directory being served publishes a new version beside the old one; a
    shard replica restarted afterwards still serves the version its deployment was made for."""
    from deployments.run import deploy, undeploy, wait_until_healthy

    index, app = tmp_path / "idx", "rebuilt"
    build_index("fashion-mnist", 2, "IVF64,Flat", str(index), limit=LIMIT, backend="local")
    served = _version(index)
    url = deploy(str(index), port=PORT, app_name=app, route_prefix=f"/{app}", shard_num_cpus=0.1,
                 router_num_cpus=0.1)
    body = orjson.dumps({"vectors": load_dataset("fashion-mnist", num_queries=20).queries, "k": 10,
                         "params": {"nprobe": 8}}, option=orjson.OPT_SERIALIZE_NUMPY)
    try:
        before = httpx.post(f"{url}/v1/search", content=body, timeout=30).json()
        build_index("fashion-mnist", 3, "IVF64,Flat", str(index), limit=LIMIT, backend="local",
                    force=True, seed=7)  # another shard count: mixing would duplicate ids
        assert _version(index) != served
        _kill_replica(f"{app}-index", "shard-001")
        wait_until_healthy(url, timeout_s=120)
        after = _fully_answered(url, body)
        assert after["index"] == served
        assert [r["ids"] for r in after["results"]] == [r["ids"] for r in before["results"]]
    finally:
        undeploy(app)
