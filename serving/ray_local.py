"""Connect to Ray, or start a local one with the fast Serve ingress settings this project relies on."""

from __future__ import annotations

import os

# Measured on a 2-core machine (DESIGN.md): Serve's HAProxy ingress + throughput-optimised mode cut
# no-op latency ~6x vs the default proxy. They are read when Ray's processes start, so they must be in
# the environment before ray.init()/`ray start` launches them.
FAST_INGRESS_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
}


def apply_fast_ingress_env() -> None:
    for key, value in FAST_INGRESS_ENV.items():
        os.environ.setdefault(key, value)


def ensure_ray(num_cpus: int | None = None, fast_ingress: bool = True, dashboard: bool = False) -> bool:
    """Join the cluster in RAY_ADDRESS / a running local one, else start one. True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    if fast_ingress:
        apply_fast_ingress_env()
    if os.environ.get("RAY_ADDRESS") or _local_cluster_running():
        ray.init(address="auto", log_to_driver=False)
        return False
    ray.init(num_cpus=num_cpus, include_dashboard=dashboard, log_to_driver=False,
             configure_logging=False)
    return True


def _local_cluster_running() -> bool:
    try:
        from ray._private.services import find_gcs_addresses

        return bool(find_gcs_addresses())
    except Exception:
        return False
