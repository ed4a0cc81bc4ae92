"""Held-out accuracy: greedy completions of the task's eval split, scored by a correctness reward.

During training the rollout actors answer (at their own precision, recorded with the result); `qgrpo eval` builds a
generator in-process for any checkpoint or model folder.
"""
from __future__ import annotations

from typing import Callable

from core.records import GroupRollout, PromptItem, SamplingParams
from rollout.rewards import REWARD_FUNCTIONS

ACCURACY_REWARDS = ("answer_correct", "correct", "exact")  # first one configured is the accuracy metric


def accuracy_reward(configured: list[str]) -> str:
    for name in ACCURACY_REWARDS:
        if name in configured:
            return name
    return "correct"


def eval_items(task, n: int) -> list[PromptItem]:
    return [task.item(i) for i in range(n)]


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(group_size=1, max_new_tokens=max_new_tokens, temperature=0.0, seed=0)


def score_eval(groups: list[GroupRollout], metric: str) -> dict:
    fns: dict[str, Callable[[str, str], float]] = {"accuracy": REWARD_FUNCTIONS[metric]}
    if "lenient_correct" in REWARD_FUNCTIONS:
        fns["lenient_accuracy"] = REWARD_FUNCTIONS["lenient_correct"]
    out = {k: sum(fn(g.completions[0].text, g.item.reference) for g in groups) / len(groups) for k, fn in fns.items()}
    out.update(n=len(groups), metric=metric, precision=groups[0].precision,
               samples=[{"prompt": g.item.prompt, "reference": g.item.reference, "completion": g.completions[0].text}
                        for g in groups[:3]])
    return out


def evaluate_model(model_path: str, task, n: int, max_new_tokens: int, metric: str = "correct",
                   precision: str = "bf16", batch: int = 32, chat_template: bool = True, backend: str = "torch",
                   options: dict | None = None) -> dict:
    """In-process evaluation of a checkpoint or model folder (used by `qgrpo eval`), on any registered backend."""
    from rollout.backends import make_generator

    gen = make_generator(backend, model_path=model_path, precision=precision, generator_id=f"eval-{backend}-{precision}",
                         chat_template=chat_template, **(options or {}))
    items = eval_items(task, n)
    groups = []
    for i in range(0, n, batch):
        groups += gen.generate(items[i:i + batch], greedy(max_new_tokens))
    return score_eval(groups, metric)
