"""Fault injection for drills and for the tests that prove the run survives faults.

    QGRPO_FAULTS="rollout.kill@3,learner.nan_loss@5+"   QGRPO_FAULTS_STATE=/some/dir

An entry `POINT@STEP` fires once, the first time POINT is reached at learner step STEP (1-based), in whichever process
reaches it first: the claim is a file created exclusively under QGRPO_FAULTS_STATE, so a replaced actor does not fire
it again. `POINT@STEP+` fires every time POINT is reached at STEP or later. The points:

    rollout.kill       the rollout actor SIGKILLs its own process inside generate, or inside an endpoint call
                       (complete) of that step (a preempted node, an OOM kill)
    rollout.hang       the rollout actor sleeps inside generate and never returns
    rollout.nan        the rollout actor returns NaN sampler log-probs for its first completion
    rollout.slow_decode  the rollout actor's decode loop sleeps SLOW_DECODE_SECONDS at every step boundary of the
                       call (generators that stop between steps: a generation long enough for a sync to land in it)
    learner.nan_loss   learner rank 0 multiplies its loss by NaN (the other ranks stay finite)
    learner.kill       learner rank 0 SIGKILLs its own process at the start of its step
    save.kill          the driver SIGKILLs its whole process group after the model files of a checkpoint are written
                       and before the checkpoint is complete
    endpoint.kill      the endpoint actor SIGKILLs its own process at the first call after that step's agent
                       sessions open (calls and episodes in flight)
    agent_runner.kill  the agent runner SIGKILLs its own process when the first episode of a batch of that step
                       ends (the batch's other episodes in flight)
    agent_runner.kill_eval  the same in a held-out evaluation's batch after that many steps (STEP 0: the one
                       before training)
    driver.slow        the driver sleeps SLOW_SECONDS before the step (a slow cluster: a drill of `qgrpo scale`
                       needs steps long enough for its request to land between two of them)

Nothing fires unless QGRPO_FAULTS is set. The driver passes both variables on to every actor it creates.
"""
from __future__ import annotations

import os
import tempfile

ENV = "QGRPO_FAULTS"
STATE_ENV = "QGRPO_FAULTS_STATE"
POINTS = ("rollout.kill", "rollout.hang", "rollout.nan", "rollout.slow_decode", "learner.nan_loss", "learner.kill",
          "save.kill", "driver.slow", "endpoint.kill", "agent_runner.kill",
          "agent_runner.kill_eval")
SLOW_SECONDS = 1.0
SLOW_DECODE_SECONDS = 0.25


def env() -> dict[str, str]:
    """The variables to hand to an actor process so that it sees the same faults."""
    return {k: os.environ[k] for k in (ENV, STATE_ENV) if k in os.environ}


def parse(spec: str) -> list[tuple[str, int, bool]]:
    """[(point, step, repeat)]; raises ValueError naming the bad entry."""
    out = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        point, _, at = entry.partition("@")
        repeat = at.endswith("+")
        if point not in POINTS or not at.rstrip("+").isdigit():
            raise ValueError(f"{ENV}: bad entry {entry!r}; expected POINT@STEP or POINT@STEP+ with POINT one of "
                             f"{', '.join(POINTS)}")
        out.append((point, int(at.rstrip("+")), repeat))
    return out


def fires(point: str, step: int) -> bool:
    spec = os.environ.get(ENV, "")
    if not spec:
        return False
    for name, at, repeat in parse(spec):
        if name != point:
            continue
        if repeat and step >= at:
            return True
        if not repeat and step == at:
            state = os.environ.get(STATE_ENV) or tempfile.gettempdir()
            try:
                os.close(os.open(os.path.join(state, f"qgrpo-fault-{name}@{at}"), os.O_CREAT | os.O_EXCL))
                return True
            except FileExistsError:
                return False
    return False
