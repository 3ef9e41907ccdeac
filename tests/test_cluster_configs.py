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
    start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in start
    assert "RAY_SERVE_ENABLE_HA_PROXY=1" in start and "RAY_SERVE_THROUGHPUT_OPTIMIZED=1" in start
    assert "0.0.0.0" not in (CONFIGS / name).read_text()
