"""One supervisor for every process a run replaces: the rollout actors (cluster/run/workers.py), and the endpoint and
the agent runner behind agent episodes (cluster/run/agents.py). The policy, written once:

- a call has a deadline; past it the process is hung and the run ends (StageTimeout), since it would hang again;
- a failed call is counted against its process's failures in a row (actors/ray_errors.py says what the error means);
  past `faults.max_replacements` in a row the run ends (RunFailed, naming the last cause);
- a process that is gone is replaced, and its work sent again; work that failed in a live process is sent again;
- an answer starts the failures in a row again from 0.

The endpoint's link (actors/pool_link.py) follows the same policy in the endpoint's process and reports what it saw;
the pool counts those reports here. Every failure and replacement is an event for the run log.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray

from qgrpo.actors.ray_errors import cause_of, fault_of


class RunFailed(RuntimeError):
    """A fault the run cannot survive; the message names the stage, the actor and the cause."""


class StageTimeout(RunFailed):
    pass


def gather(calls: dict, seconds: float, stage: str, setting: str) -> dict:
    """{ref: actor name} -> {ref: result} by a deadline. A call still running then raises StageTimeout; a failed
    call raises RunFailed naming the actor (for the learner and the reference: the run cannot go on without them)."""
    out, pending, deadline = {}, list(calls), time.monotonic() + seconds
    while pending:  # one at a time, so a failure is reported at once, not after the other ranks' deadline
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
        if not ready:
            names = ", ".join(calls[r] for r in pending)
            raise StageTimeout(f"{stage}: {names} did not finish within {seconds:.0f} s; raise {setting} if that is "
                               "too short for this model, or look for a hung process")
        try:
            out[ready[0]] = ray.get(ready[0])
        except ray.exceptions.RayError as e:
            raise RunFailed(f"{stage}: {calls[ready[0]]} failed ({cause_of(e)})") from None
    return out


class Supervisor:
    """The failures in a row of each supervised process (a key: a pool slot, "endpoint", "runner"), within
    `limit` (faults.max_replacements); `events`: the run log's list, appended to."""

    def __init__(self, limit: int, events: list[dict]):
        self.limit, self.events = limit, events
        self.in_a_row: dict = {}

    def served(self, key) -> None:
        """The process answered: its failures in a row start again."""
        self.in_a_row[key] = 0

    def failing(self, key) -> bool:
        """The process failed its last call (a free actor that has not is preferred)."""
        return self.in_a_row.get(key, 0) > 0

    def failed(self, key, name: str, cause: str, stage: str, event: str, **detail) -> None:
        """Count a failure of `name` (its `event`, with `detail`, logged); raise RunFailed past the limit."""
        n = self.in_a_row[key] = self.in_a_row.get(key, 0) + 1
        self.events.append({"event": event, "stage": stage, "actor": name, "cause": cause, **detail,
                            "failures_in_a_row": n})
        if n > self.limit:
            held = detail.get("prompt_ids")
            raise RunFailed(f"{stage}: {name} failed {n} times in a row (faults.max_replacements = {self.limit}); "
                            f"last cause: {cause}" + (f"; it held prompts {', '.join(held) or '(none)'}"
                                                      if held is not None else ""))

    def settle(self, key, get: Callable[[], Any], *, name: str, stage: str, event: str,
               replace: Callable[[str], None], work: bool = True, **detail) -> tuple[bool, Any]:
        """(True, the call's result), or (False, None) where it failed: the failure counted (RunFailed past the
        limit), a process that is gone replaced (`replace(cause)`); the caller sends the work again. An error that
        is no process's fault propagates (it ends the run). Only an answer that is `work` done (a chunk, not a
        bookkeeping call such as opening sessions) starts the failures in a row again."""
        try:
            out = get()
        except ray.exceptions.RayError as e:
            fault = fault_of(e)
            if fault is None:
                raise
            self.failed(key, name, fault.cause, stage, event, **detail)
            if fault.gone:
                replace(fault.cause)
            return False, None
        if work:
            self.served(key)
        return True, out

    def overdue(self, late: list[str], seconds: float, stage: str, setting: str) -> None:
        """Calls past their deadline (`late`: what each held): the process is hung; the run ends."""
        if late:
            raise StageTimeout(f"{stage}: no result within {seconds:.0f} s ({'; '.join(late)}); raise {setting} if "
                               "that is too slow, or look for a hung process")


def get_within(ref, seconds: float, stage: str):
    """`ray.get` within `seconds`; past them the process is hung (StageTimeout ends the run)."""
    try:
        return ray.get(ref, timeout=seconds)
    except ray.exceptions.GetTimeoutError:
        raise StageTimeout(f"{stage}: no answer within {seconds:.0f} s; look for a hung process") from None
