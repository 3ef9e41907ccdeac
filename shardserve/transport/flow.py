"""What the HTTP door and the shard link share about one connection: when it reads, and when it ends.

Why one module: both are plain asyncio Protocols facing peers that may stall on purpose, and both
had their own copy of the same timer and pause/resume code, which drifted apart (the door armed no
timer at all in some states). Here each connection has exactly one timer, and its deadline is a
function of the connection's state, evaluated whenever the state may have changed:

- a deadline is absolute: it is fixed when its state begins (a frame's first byte, a request's
  first byte, the moment writes paused) and nothing the peer sends later moves it, so a peer that
  trickles a byte at a time cannot extend it;
- every state has one (a connection with no deadline is one a peer can hold forever);
- the timer is lazy: a deadline that moves later leaves the armed handle alone, and when that fires
  early it re-arms for the current deadline; a receive costs no timer churn in the common case.

FlowControl follows uvicorn's (`uvicorn.protocols.http.flow_control`): pause and resume are
idempotent, and reading stays paused while the peer does not read what is written to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

Action = Callable[[], None]
# The current state's deadline (loop time) and what to do when it passes; None: nothing pending
# (the connection is gone).
Due = Callable[[], tuple[float, Action] | None]


class Deadline:
    """One connection's timer. `due()` names the deadline of its current state; call `update()`
    after anything that may change the state. When the timer fires, `due()` is asked again: its
    action runs only if that deadline has passed, else the timer re-arms for it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, due: Due):
        self.loop, self.due = loop, due
        self.handle: asyncio.TimerHandle | None = None

    def update(self) -> None:
        found = self.due()
        if found is None:
            return self.cancel()
        when = found[0]
        if self.handle is None or self.handle.when() > when:  # must fire sooner than armed
            self.cancel()
            self.handle = self.loop.call_at(when, self._fire)

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def _fire(self) -> None:
        self.handle = None
        found = self.due()
        if found is None:
            return
        when, action = found
        if when > self.loop.time():  # the state moved on since this was armed
            self.handle = self.loop.call_at(when, self._fire)
            return
        action()


class FlowControl:
    """Reading and writing pauses of one transport. The owner says whether it wants to read
    (`want_reading`); reading is paused regardless while writes are (the peer reads nothing, so
    taking more requests from it would only queue more answers)."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self.transport, self.loop = transport, loop
        self.read_paused = False
        self.write_paused = False
        self.write_paused_at = 0.0  # loop time writes last paused

    def want_reading(self, want: bool) -> None:
        if want and not self.write_paused:
            self.resume_reading()
        else:
            self.pause_reading()

    def pause_reading(self) -> None:
        if not self.read_paused and not self.transport.is_closing():
            self.read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused and not self.transport.is_closing():
            self.read_paused = False
            self.transport.resume_reading()

    def pause_writing(self) -> None:
        if not self.write_paused:
            self.write_paused = True
            self.write_paused_at = self.loop.time()
            self.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False  # the owner decides whether to read again (want_reading)


class PeerPaced(asyncio.Protocol):
    """A connection that stops taking requests while its peer does not read the answers: asyncio's
    write-side callbacks, shared by the HTTP door and the shard link. The subclass holds `flow` (None
    until connected), its `deadline`, and `_flow()`, which answers what is ready or reads on."""

    flow: FlowControl | None
    deadline: Deadline

    def _flow(self) -> None:
        raise NotImplementedError

    def pause_writing(self) -> None:
        if self.flow is not None:
            self.flow.pause_writing()
            self.deadline.update()  # a paused peer has its own deadline

    def resume_writing(self) -> None:
        if self.flow is not None:
            self.flow.resume_writing()
            self._flow()
