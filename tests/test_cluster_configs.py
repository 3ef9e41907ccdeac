"""Cluster launcher configs validate against the schema shipped with Ray and keep ports private."""

from pathlib import Path

import pytest
import yaml

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster.local.yaml"])
def test_cluster_config_is_valid_and_private(name: str) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((CONFIGS / name).read_text())
    validate_config(prepare_config(config))  # raises on a schema violation
    from shardserve.runtime.ray_session import SERVING_NODE_ENV

    start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in start
    for commands in ("head_start_ray_commands", "worker_start_ray_commands"):  # every node's Ray
        text = " ".join(config[commands])
        assert all(f"{key}={value}" in text for key, value in SERVING_NODE_ENV.items()), commands
    assert "0.0.0.0" not in (CONFIGS / name).read_text()


def test_cloud_edges_run_on_the_serving_workers_and_only_the_vpc_reaches_them() -> None:
    import ipaddress

    config = yaml.safe_load((CONFIGS / "cluster.yaml").read_text())
    workers = " ".join(config["worker_start_ray_commands"])
    private = "--listen \"$(hostname -I | awk '{print $1}'):8000\""  # not loopback: clients reach it
    assert private in workers
    assert "SHARDSERVE_API_KEY" in workers  # the optional key reaches each edge's config
    assert "edge-config" not in " ".join(config["head_start_ray_commands"])  # off the request path
    rules = config["provider"]["security_group"]["IpPermissions"]
    assert [(rule["FromPort"], rule["ToPort"]) for rule in rules] == [(8000, 8000)]  # nothing else opened
    for rule in rules:
        assert all(ipaddress.ip_network(r["CidrIp"]).is_private for r in rule["IpRanges"])


def test_cloud_head_keeps_its_state_in_redis_runs_no_replica_and_workers_wait_for_it() -> None:
    config = yaml.safe_load((CONFIGS / "cluster.yaml").read_text())
    head = " ".join(config["head_start_ray_commands"])
    assert "--num-cpus=0" in head and config["available_node_types"]["head"]["resources"] == {"CPU": 0}
    assert "test -s ~/shardserve-redis-address && test -s ~/shardserve-redis-password &&" in head
    assert 'RAY_REDIS_ADDRESS="$(cat ~/shardserve-redis-address)"' in head
    assert "RAY_external_storage_namespace=" in head
    assert '--redis-password="$(cat ~/shardserve-redis-password)"' in head  # read on the head only
    workers = " ".join(config["worker_start_ray_commands"])
    assert "RAY_gcs_rpc_server_reconnect_timeout_s=600" in workers
    # the write log in the same Redis, its password read from a file (never in the URL or the config)
    assert 'SHARDSERVE_WRITE_LOG="redis://$(cat ~/shardserve-redis-address)/0"' in workers
    assert 'SHARDSERVE_WRITE_LOG_PASSWORD_FILE="$HOME/shardserve-redis-password"' in workers
    serving = [t for t in config["available_node_types"].values() if "serving" in t["resources"]]
    assert serving and all(t["min_workers"] >= 2 for t in serving)  # routers on >= 2 nodes


def test_cloud_embedders_have_nodes_of_their_own() -> None:
    """An embedding node type (resource embed_host) that the deploy example sends embedder replicas
    to, and a GPU type marked untested; the embedder's resources are an AppArgs field."""
    from deployments.config import AppArgs

    text = (CONFIGS / "cluster.yaml").read_text()
    config = yaml.safe_load(text)
    types = config["available_node_types"]
    assert types["embedding_worker"]["resources"] == {"embed_host": 8}
    assert "UNTESTED" in text and "onnxruntime-gpu" in text
    assert "embed_gpu" in types["embedding_gpu_worker"]["resources"]
    assert 'embedder_resources={"embed_host":1}' in text
    assert AppArgs(index="x", embedder_resources={"embed_host": 1}).embedder_resources == {"embed_host": 1}
