"""Every `SHARDSERVE_*` environment setting, in one place: its name, its default, what it does, and a
typed accessor. The product modules read these settings only through this module.

Each accessor reads the environment when it is called, never at import: the tests and the CLI set
these variables after the modules are imported, and a Ray worker inherits its node's environment.

This is the bottom layer: it imports nothing of the project's.
"""

from __future__ import annotations

import os
from pathlib import Path

from shardserve.errors import BadArgument

# --- Data -------------------------------------------------------------------------------------------

#: Directory of the Fashion-MNIST IDX files (`fashion-mnist` as a dataset name).
FASHION_MNIST_ENV = "SHARDSERVE_FASHION_MNIST"
#: Where Debian's dataset-fashion-mnist installs them (`make data`).
FASHION_MNIST_DEFAULT = "/usr/share/datasets/fashion-mnist"


def fashion_mnist_dir() -> Path:
    """$SHARDSERVE_FASHION_MNIST, else FASHION_MNIST_DEFAULT."""
    return Path(os.environ.get(FASHION_MNIST_ENV, FASHION_MNIST_DEFAULT))


# --- Node cache -------------------------------------------------------------------------------------

#: The node's cache directory: shards of a remote index and exact ground truth, downloaded or
#: computed once. Default: $XDG_CACHE_HOME/shardserve, else ~/.cache/shardserve.
CACHE_ENV = "SHARDSERVE_CACHE_DIR"


def cache_dir() -> str:
    """$SHARDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/shardserve, else ~/.cache/shardserve (an empty
    value counts as unset)."""
    return os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "shardserve")


# --- Write log ----------------------------------------------------------------------------------------

#: redis://HOST:PORT[/DB]: the write log of every index lives in this Redis (a cluster: the log
#: outlives any Ray node). Unset: a SQLite file beside a local index's manifest, and no writes to
#: an index on remote storage. Every node must carry the same value.
WRITE_LOG_ENV = "SHARDSERVE_WRITE_LOG"
#: A file holding that Redis's password (never in the URL). Unset: no password.
PASSWORD_FILE_ENV = "SHARDSERVE_WRITE_LOG_PASSWORD_FILE"


def write_log_url() -> str | None:
    """$SHARDSERVE_WRITE_LOG, or None when unset or empty."""
    return os.environ.get(WRITE_LOG_ENV) or None


def write_log_password_file() -> Path | None:
    """The file $SHARDSERVE_WRITE_LOG_PASSWORD_FILE names, or None when unset or empty."""
    path = os.environ.get(PASSWORD_FILE_ENV)
    return Path(path) if path else None


# --- Serving --------------------------------------------------------------------------------------------

#: The key the edge wants on every request but the health check (`shardserve serve`). Unset: no key.
#: `serve` reads it, then removes it from its own environment before Ray starts, so that no Ray
#: process inherits it (forget_api_key).
API_KEY_ENV = "SHARDSERVE_API_KEY"


def api_key() -> str | None:
    """$SHARDSERVE_API_KEY, or None when unset or empty."""
    return os.environ.get(API_KEY_ENV) or None


def forget_api_key() -> None:
    """Remove SHARDSERVE_API_KEY from this process's environment (and so from its children's)."""
    os.environ.pop(API_KEY_ENV, None)


#: Set by `shardserve serve` itself (not by a user): every process it starts inherits this mark, with
#: a value of the command's own, which is how a stop finds them all.
SERVE_MARK_ENV = "SHARDSERVE_SERVE_MARK"


def set_serve_mark(mark: str) -> None:
    """Put `mark` in this process's environment, for every process it starts to inherit."""
    os.environ[SERVE_MARK_ENV] = mark


def serve_mark() -> str | None:
    """This process's serve mark, or None."""
    return os.environ.get(SERVE_MARK_ENV)


# --- Tracing ----------------------------------------------------------------------------------------------

#: The OTLP/HTTP traces URL this node's replicas export spans to (e.g. a collector or Jaeger on the
#: node: http://127.0.0.1:4318/v1/traces), when the app's arguments name none. Unset: no tracing.
TRACE_ENDPOINT_ENV = "SHARDSERVE_TRACE_ENDPOINT"
#: The share of requests without a `traceparent` that are traced, in [0, 1] (default 0: only those
#: whose caller's `traceparent` says sampled).
TRACE_RATIO_ENV = "SHARDSERVE_TRACE_RATIO"


def trace_endpoint() -> str | None:
    """$SHARDSERVE_TRACE_ENDPOINT, or None when unset or empty."""
    return os.environ.get(TRACE_ENDPOINT_ENV) or None


def trace_ratio() -> float:
    """$SHARDSERVE_TRACE_RATIO as a number, 0 when unset or empty."""
    value = os.environ.get(TRACE_RATIO_ENV) or "0"
    try:
        return float(value)
    except ValueError:
        raise BadArgument(f"{TRACE_RATIO_ENV} must be a number in [0, 1], got {value!r}") from None
