"""What a failed call to an actor means, in one place: the fault policy's reading of Ray's errors, and the one line
that names a remote error in events, warnings and the run's last message.

Three outcomes, whoever made the call (the rollout pool, the endpoint's link to it, the agent episodes, `qgrpo
serve`):
- the process is gone (Ray's actor errors, a crashed worker, a dead node): the caller counts the failure, replaces
  the process and sends the work again;
- the work failed in a live process (an exception raised by the task): counted, the work sent again elsewhere or
  failed, the process kept;
- anything else Ray raises (a lost object, a full object store, a failed runtime environment, Ray itself) is not a
  fault of one process: the run ends at the step with how to resume (cluster/run/driver.py).
A call past its deadline (a hung process) is the caller's to judge: it holds the deadline.
"""
from __future__ import annotations

from dataclasses import dataclass

import ray

# The process behind the call is gone (died, crashed, killed for memory, its node lost): replace it.
GONE = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
        ray.exceptions.OutOfMemoryError)


@dataclass(frozen=True)
class Fault:
    cause: str  # one line: the error's type and its message's last line (cause_of)
    gone: bool  # the process died: replace it before the work is sent again


def cause_of(err: BaseException) -> str:
    """A remote error in one line, 300 characters: its type and, where it carries a remote traceback (a task's
    error, an actor whose constructor raised), that traceback's last line (the exception raised there), else its
    message's first line."""
    text = str(err)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    remote = isinstance(err, ray.exceptions.RayTaskError) or getattr(err, "actor_init_failed", False)
    text = (lines[-1] if remote else lines[0]) if lines else ""
    return f"{type(err).__name__}: {text[:300]}" if text else type(err).__name__


def fault_of(err: BaseException) -> Fault | None:
    """The fault a supervised call's error is (a lost process, or work that failed in a live one); None for an
    error that is no one process's fault (the caller lets it end the run)."""
    if isinstance(err, GONE):
        return Fault(cause_of(err), gone=True)
    if isinstance(err, ray.exceptions.RayTaskError):
        return Fault(cause_of(err), gone=False)
    return None
