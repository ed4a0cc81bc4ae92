"""Prompt sources. A task is indexable: `item(i)` is a pure function of (task settings, seed, i), so the data cursor
of a run is one integer and resuming needs nothing else.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Protocol

from rollout.records import PromptItem


class Task(Protocol):
    name: str

    def item(self, index: int) -> PromptItem: ...


@dataclass(frozen=True)
class DigitSum:
    """`3+4=` -> `7`. Small enough that a randomly initialised tiny model can learn it with GRPO in minutes, so the
    whole loop can be tested end to end without a model hub. Held-out data uses another seed (`split`)."""

    seed: int = 0
    max_operand: int = 9
    num_operands: int = 2
    split: str = "train"
    name: str = "digit_sum"

    def item(self, index: int) -> PromptItem:
        rng = random.Random(f"{self.name}/{self.split}/{self.seed}/{index}")
        xs = [rng.randint(0, self.max_operand) for _ in range(self.num_operands)]
        return PromptItem(
            prompt_id=f"{self.name}-{self.split}-{index}",
            prompt="+".join(map(str, xs)) + "=",
            reference=str(sum(xs)),
        )


# name -> factory(seed, task config section)
TASKS: dict[str, Callable[..., Task]] = {
    "digit_sum": lambda seed, cfg, split="train": DigitSum(
        seed=seed, max_operand=cfg.max_operand, num_operands=cfg.num_operands, split=split
    ),
}


def make_task(task_cfg, seed: int, split: str = "train") -> Task:
    return TASKS[task_cfg.name](seed, task_cfg, split)


class PromptSampler:
    """Hands out prompts in order; `cursor` is the index of the next one (saved in checkpoints)."""

    def __init__(self, task: Task, cursor: int = 0):
        self.task = task
        self.cursor = cursor

    def next(self, n: int) -> list[PromptItem]:
        items = [self.task.item(self.cursor + i) for i in range(n)]
        self.cursor += n
        return items
