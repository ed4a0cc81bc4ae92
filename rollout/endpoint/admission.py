"""When a call may sample (`Admission`), and the calls on their way to the batcher (`Arrivals`).

Admission: while the rollout actors change (a resize, a replacement) a call waits; a new session past `max_sessions`
waits for room; either is answered 429 with Retry-After after `wait_s` (the endpoint counts those: `refused`).

Arrivals: a call received for a session, read and rendered before it is queued, is counted for the slot its session
is pinned to, so that the batcher waits for it (engine.py: GATHER_COMING_MAX_S).
"""
from __future__ import annotations

import asyncio
import contextvars
import time

# the call this request's task is serving, on its way to the batcher (Arrivals.arrive / settle)
_TICKET: contextvars.ContextVar[list | None] = contextvars.ContextVar("qgrpo_endpoint_ticket", default=None)


class Admission:
    """When a call may sample: not while paused (the actors change); a new session only while fewer than
    `max_sessions` are open (0: no bound). Waits up to `wait_s`, then the call is answered 429."""

    def __init__(self, max_sessions: int = 0, wait_s: float = 30.0):
        self.max_sessions, self.wait_s = max_sessions, wait_s
        self.paused = False
        self.active: set[str] = set()

    async def enter(self, sid: str) -> bool:
        deadline = time.monotonic() + self.wait_s
        while self.paused or (sid not in self.active and self.max_sessions
                              and len(self.active) >= self.max_sessions):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        self.active.add(sid)
        return True

    def leave(self, sid: str) -> None:
        self.active.discard(sid)


class Arrivals:
    """Calls received per slot and not yet queued in the batcher."""

    def __init__(self, slots: int):
        self.coming = [0] * slots

    def reset(self, slots: int) -> None:
        self.coming = [0] * slots

    def __call__(self, slot: int) -> int:
        """The calls coming for `slot` (the batcher's `coming`)."""
        return self.coming[slot] if slot < len(self.coming) else 0

    def arrive(self, slot: int) -> contextvars.Token:
        """A call received for `slot`: counted until `settle`, and held as this task's ticket."""
        slot = max(slot, 0)
        if slot < len(self.coming):
            self.coming[slot] += 1
        return _TICKET.set([slot, True])

    def settle(self, ticket: list | None = None) -> None:
        """This task's call (or `ticket`'s) is queued, or failed before it was: no longer counted as coming."""
        ticket = ticket if ticket is not None else _TICKET.get()
        if ticket and ticket[1]:
            ticket[1] = False
            if ticket[0] < len(self.coming):
                self.coming[ticket[0]] = max(self.coming[ticket[0]] - 1, 0)

    def done(self, held: contextvars.Token) -> None:
        """The request's task is done with its call: settled, and the ticket dropped."""
        self.settle()
        _TICKET.reset(held)
