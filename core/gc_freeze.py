"""Move what a serving process allocated while warming up out of the garbage collector's way.

Serve already runs gc.collect() + gc.freeze() when a replica's constructor returns
(RAY_SERVE_FREEZE_GC_ON_STARTUP), but the first requests still allocate long-lived objects
(connections, links, caches, lazily imported modules) that every full collection walks again.
`WarmupFreeze(n)` freezes once more after the n-th request; its effect on CPU per request is
measured in loadtests/records/hygiene.json.
"""

from __future__ import annotations

import gc


class WarmupFreeze:
    """Call `tick()` once per request: on the n-th, collect and freeze once (0 = never)."""

    def __init__(self, after_requests: int):
        self.remaining = after_requests if after_requests > 0 else -1

    def tick(self) -> bool:
        """True on the call that froze the heap."""
        if self.remaining <= 0:
            return False
        self.remaining -= 1
        if self.remaining:
            return False
        self.remaining = -1
        gc.collect()
        gc.freeze()
        return True
