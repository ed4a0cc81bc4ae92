"""Ray actor that scores batches with the configured reward functions (cluster/run/rewarding.py runs a pool of them).

It loads every function once, when it starts: a user's file that does not import, or a function it does not have,
fails the run's first step with the entry named. It imports no torch, so it starts in about a second.
"""
from __future__ import annotations

import ray

from qgrpo.rollout.rewards.calls import signature_problems
from qgrpo.rollout.rewards.scoring import CallResult, RewardEntry, make_callable, score_batch


@ray.remote
class RewardWorker:
    def __init__(self, entries: list[RewardEntry]):
        from qgrpo.actors.common import quiet_libraries

        quiet_libraries()  # before the user's files are imported (they may import torch or DeepSpeed)
        self.entries = entries
        self.fns = {e.label: make_callable(e) for e in entries if e.kind != "model"}
        problems = [p for e in entries if e.kind == "function"
                    for p in signature_problems(self.fns[e.label], f"{e.field}.function")]
        if problems:
            raise ValueError("; ".join(problems))

    def score(self, kwargs: dict[str, list]) -> list[CallResult]:
        return score_batch(self.entries, self.fns, kwargs)

    def ready(self) -> bool:
        return True
