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


def test_cloud_edge_listens_on_the_private_address_and_only_the_vpc_may_reach_it() -> None:
    import ipaddress

    config = yaml.safe_load((CONFIGS / "cluster.yaml").read_text())
    start = " ".join(config["head_start_ray_commands"])
    assert "--listen \"$(hostname -I | awk '{print $1}'):8000\"" in start  # not loopback: clients reach it
    assert "SHARDSERVE_API_KEY" in start  # the optional key reaches the edge's config
    rules = config["provider"]["security_group"]["IpPermissions"]
    assert [(rule["FromPort"], rule["ToPort"]) for rule in rules] == [(8000, 8000)]  # nothing else opened
    for rule in rules:
        assert all(ipaddress.ip_network(r["CidrIp"]).is_private for r in rule["IpRanges"])
