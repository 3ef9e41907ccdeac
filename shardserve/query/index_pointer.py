"""Which index version the routers serve: a generation-numbered pointer plus router acknowledgements.

Plain Python (the IndexControl deployment wraps it), so the swap protocol is testable without Ray:
the swap moves the pointer, every router replica picks it up on its next poll and reports back the
generation it now serves and how many requests it still holds on older generations; the old index
is removed only when every live router reports the new generation with nothing old in flight.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass, field

import orjson

from shardserve.errors import BadArgument, ShardserveError


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

    def activate(self, index: str, app: str, version: str, expected_generation: int | None = None
                 ) -> ActiveIndex:
        """Point every router at a new index; the current one becomes `previous`. With
        `expected_generation`, a compare-and-set: refused when another swap moved the pointer since
        the caller read it (two swaps at once would otherwise leave one's app orphaned)."""
        if expected_generation is not None and expected_generation != self.active.generation:
            raise SwapConflict(f"the index pointer moved to generation {self.active.generation} "
                               f"(another swap) since this swap read generation {expected_generation}")
        self.previous = self.active
        self.active = ActiveIndex(self.active.generation + 1, index, app, version)
        return self.active

    def report(self, replica: str, generation: int, old_in_flight: int, now: float | None = None) -> None:
        """A router's heartbeat. A router ahead of the pointer (the pointer was lost or reset, e.g. a
        corrupt stored one) would ignore it: the pointer moves past it, so every router follows."""
        self.routers[replica] = RouterReport(generation, old_in_flight,
                                             time.monotonic() if now is None else now)
        if generation > self.active.generation:
            self.active = dataclasses.replace(self.active, generation=generation + 1)

    def live_routers(self, now: float | None = None) -> dict[str, RouterReport]:
        """Routers heard from recently: a replica that stopped reporting is gone, not lagging."""
        now = time.monotonic() if now is None else now
        return {r: rep for r, rep in self.routers.items() if now - rep.seen_at <= self.stale_after_s}

    def drained(self, generation: int, now: float | None = None) -> bool:
        """Every live router serves `generation` (or newer) and holds no request on an older one."""
        live = self.live_routers(now)
        return bool(live) and all(rep.generation >= generation and rep.old_in_flight == 0
                                  for rep in live.values())

    def stored(self, config_index: str) -> bytes:
        """What is kept in Ray's KV store, so a restarted IndexControl resumes at this generation."""
        return orjson.dumps({"config_index": config_index, "active": asdict(self.active),
                             "previous": asdict(self.previous) if self.previous else None})

    def restore(self, stored: bytes, config_index: str) -> bool:
        """Take back a `stored` pointer of the same configured index (False: another index's, left
        alone); a stored value that is not one raises ShardserveError saying how to recover."""
        try:
            state = orjson.loads(stored)
            if state["config_index"] != config_index:
                return False
            active = ActiveIndex(**state["active"])
            previous = ActiveIndex(**state["previous"]) if state["previous"] else None
            if not all(isinstance(a.generation, int) and a.generation >= 0
                       for a in (active, *([previous] if previous else []))):
                raise BadArgument("generation must be a non-negative integer")
        except (ValueError, TypeError, KeyError) as exc:
            raise ShardserveError(f"the stored index pointer is corrupt ({type(exc).__name__}: {exc}); "
                                  "deploy again with `shardserve serve` (it starts from the configured "
                                  "index and rewrites the pointer)") from None
        self.active, self.previous = active, previous
        return True

    def describe(self, now: float | None = None) -> dict:
        return {"active": asdict(self.active),
                "previous": asdict(self.previous) if self.previous else None,
                "routers": {r: asdict(rep) for r, rep in self.live_routers(now).items()}}


class SwapConflict(ShardserveError):
    """Another swap moved the pointer first."""
