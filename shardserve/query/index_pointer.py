"""Which index version the routers serve: a generation-numbered pointer plus router acknowledgements.

Plain Python (the IndexControl deployment wraps it), so the swap protocol is testable without Ray:
the swap moves the pointer, every router replica picks it up on its next poll and reports back the
generation it now serves and how many requests it still holds on older generations; the old index
is removed only when every live router reports the new generation with nothing old in flight.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class ActiveIndex:
    generation: int
    index: str  # directory or URI of the manifest
    app: str  # the Serve application holding its shard deployments
    version: str  # the manifest's index_version ("" until known)


@dataclass
class RouterReport:
    generation: int
    old_in_flight: int
    seen_at: float


@dataclass
class IndexPointer:
    """Active index, the one before it (for rollback), and what each router replica last reported."""

    active: ActiveIndex
    previous: ActiveIndex | None = None
    routers: dict[str, RouterReport] = field(default_factory=dict)
    stale_after_s: float = 5.0

    def activate(self, index: str, app: str, version: str) -> ActiveIndex:
        """Point every router at a new index; the current one becomes `previous`."""
        self.previous = self.active
        self.active = ActiveIndex(self.active.generation + 1, index, app, version)
        return self.active

    def report(self, replica: str, generation: int, old_in_flight: int, now: float | None = None) -> None:
        self.routers[replica] = RouterReport(generation, old_in_flight,
                                             time.monotonic() if now is None else now)

    def live_routers(self, now: float | None = None) -> dict[str, RouterReport]:
        """Routers heard from recently: a replica that stopped reporting is gone, not lagging."""
        now = time.monotonic() if now is None else now
        return {r: rep for r, rep in self.routers.items() if now - rep.seen_at <= self.stale_after_s}

    def drained(self, generation: int, now: float | None = None) -> bool:
        """Every live router serves `generation` (or newer) and holds no request on an older one."""
        live = self.live_routers(now)
        return bool(live) and all(rep.generation >= generation and rep.old_in_flight == 0
                                  for rep in live.values())

    def describe(self, now: float | None = None) -> dict:
        return {"active": asdict(self.active),
                "previous": asdict(self.previous) if self.previous else None,
                "routers": {r: asdict(rep) for r, rep in self.live_routers(now).items()}}
