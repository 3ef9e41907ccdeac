"""`shardserve serve-config` output runs unchanged under `serve run`, and answers like in-process."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest
import yaml

from deployments.config import AppArgs
from index_build.job import build_index
from loadtests.served import Server
from serving.evaluate import sharded_search
from shardserve.data.datasets import load_dataset
from shardserve.query.searcher import load_all_shards
from shardserve.runtime.procfs import interrupt
from tests.conftest import SERVE_PORT as PORT
from tests.conftest import run_cli

pytestmark = pytest.mark.slow


def test_generated_config_is_valid_serve_schema(tmp_path: Path) -> None:
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load(run_cli("serve-config", str(tmp_path), "--port", "9001").stdout)
    ServeDeploySchema.model_validate(config)
    shards, router = config["applications"]
    assert (shards["name"], shards["import_path"], shards["route_prefix"]) == (
        "shardserve-index", "deployments.app:build_index_app", None)
    assert (router["name"], router["import_path"], router["route_prefix"]) == (
        "shardserve", "deployments.app:build_app", "/")
    assert shards["args"] == router["args"]
    AppArgs.model_validate(router["args"])  # every arg is a known field
    assert config["http_options"] == {"host": "127.0.0.1", "port": 9001}


def test_trace_flags_become_app_args_and_a_bad_ratio_is_one_line(tmp_path: Path) -> None:
    url = "http://127.0.0.1:4318/v1/traces"
    config = yaml.safe_load(run_cli("serve-config", str(tmp_path), "--trace-endpoint", url,
                                    "--trace-ratio", "0.25").stdout)
    for app in config["applications"]:
        assert (app["args"]["trace_endpoint"], app["args"]["trace_ratio"]) == (url, 0.25)
    refused = run_cli("serve-config", str(tmp_path), "--trace-ratio", "2")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "[0, 1]" in refused.stderr
    refused = run_cli("serve-config", str(tmp_path), "--trace-endpoint", "127.0.0.1:4318")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "http(s) URL" in refused.stderr


@pytest.mark.release  # the schema test above checks the config on every CI run
def test_serve_run_of_generated_config(ray_cluster, tmp_path: Path) -> None:
    index = tmp_path / "idx"
    build_index("fashion-mnist", 2, "IVF64,Flat", str(index), limit=5000, backend="ray")
    generated = run_cli("serve-config", str(index), "--port", str(PORT))
    assert generated.returncode == 0, generated.stderr
    config_path = tmp_path / "serve.yaml"
    config_path.write_text(generated.stdout)

    address = ray_cluster.get_runtime_context().gcs_address
    serve_exe = Path(sys.executable).parent / "serve"
    process = subprocess.Popen([str(serve_exe), "run", "--address", address, str(config_path)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        from deployments.run import wait_until_healthy

        wait_until_healthy(f"http://127.0.0.1:{PORT}", timeout_s=180)
        queries = load_dataset("fashion-mnist", num_queries=5).queries
        manifest, searchers = load_all_shards(str(index))
        _, expected = sharded_search(searchers, queries, 10, {"nprobe": 4}, manifest.metric)
        response = httpx.post(f"http://127.0.0.1:{PORT}/v1/search", timeout=30, content=orjson.dumps(
            {"vectors": queries, "k": 10, "params": {"nprobe": 4}}, option=orjson.OPT_SERIALIZE_NUMPY))
        assert response.status_code == 200, response.text
        assert [r["ids"] for r in response.json()["results"]] == expected.tolist()
        assert response.json()["index"] == manifest.index_version
    finally:
        interrupt(process, timeout_s=60)
        time.sleep(1)


def test_ctrl_c_on_serve_joined_to_a_cluster_stops_only_its_own_apps(ray_cluster, small_index: Path) -> None:
    """`shardserve serve` that joined someone's cluster (RAY_ADDRESS) deletes, on Ctrl-C, only the
    apps it deployed: another app on that cluster keeps serving, and the cluster keeps running."""
    from ray import serve

    from deployments.run import deploy, undeploy

    index = small_index
    bystander = deploy(str(index), port=PORT, app_name="bystander", route_prefix="/bystander",
                       shard_num_cpus=0.1, router_num_cpus=0.1)
    server = Server(index, PORT, flags=("--address", ray_cluster.get_runtime_context().gcs_address))
    try:
        server.wait_for(lambda: "shardserve" in serve.status().applications and server.healthy(),
                        "the joined server's apps, healthy", timeout_s=180, interval_s=0.2)
        assert interrupt(server.process, timeout_s=180) == 0, server.output()
        apps = serve.status().applications
        assert not [name for name in apps if name.startswith("shardserve")], list(apps)
        assert apps["bystander"].status == "RUNNING"
        assert httpx.get(f"{bystander}/v1/health", timeout=10).status_code == 200
        assert ray_cluster.is_initialized()
    finally:
        if server.process.poll() is None:
            interrupt(server.process, timeout_s=0.1)
        undeploy("shardserve")
        undeploy("bystander")


def test_deploy_without_serve_http_needs_and_returns_the_router_door(ray_cluster, small_index: Path,
                                                                   tmp_path: Path) -> None:
    """`shardserve serve`'s deploy behind its edge (serve_http=False): it needs the door's port, and
    the URL it waits on and returns is the router's door."""
    from deployments.run import deploy, undeploy
    from shardserve.runtime.ports import free_port

    with pytest.raises(ValueError, match="front_port"):
        deploy(str(tmp_path / "unused"), serve_http=False)
    index = small_index
    door = free_port()
    try:
        url = deploy(str(index), app_name="doorOnly", serve_http=False, front_port=door,
                     shard_num_cpus=0.1, router_num_cpus=0.1)
        assert url == f"http://127.0.0.1:{door}"
        body = orjson.dumps({"vector": load_dataset("fashion-mnist", num_queries=1).queries[0], "k": 3},
                            option=orjson.OPT_SERIALIZE_NUMPY)
        response = httpx.post(f"{url}/v1/search", content=body, timeout=30)
        assert response.status_code == 200 and len(response.json()["ids"]) == 3, response.text
    finally:
        undeploy("doorOnly")
