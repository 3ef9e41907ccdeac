"""Stage timing in the `with Timeit("stage"):` style: every long stage logs how long it took."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("shardserve")


@contextmanager
def timed(stage: str, timings: dict[str, float] | None = None) -> Iterator[None]:
    """Log the stage's wall time and, when given a dict, record it there under `stage`."""
    start = time.perf_counter()
    log.info("%s ...", stage)
    try:
        yield
    finally:
        seconds = time.perf_counter() - start
        log.info("%s took %.2f s", stage, seconds)
        if timings is not None:
            timings[stage] = round(seconds, 3)
