"""Held-out accuracy: greedy completions of the task's eval split, scored by a correctness reward, with how diverse
the answers were (rollout/answer_stats.py).

During training the rollout actors answer (at their own precision, recorded with the result); `qgrpo eval` builds a
generator in-process for any checkpoint or model folder.
"""
from __future__ import annotations

from qgrpo.core.records import GroupRollout, PromptItem, SamplingParams
from qgrpo.rollout.answer_stats import eval_answer_stats, hollow_warnings, majority_baseline
from qgrpo.rollout.rewards.scoring import score_texts

# The first of these configured is the accuracy metric (verifiers first: they know the task's answers best).
ACCURACY_REWARDS = ("rg_score", "math_verify", "answer_correct", "correct", "exact")


def accuracy_reward(rewards_cfg) -> str:
    """The built-in reward that scores held-out accuracy: rewards.eval_metric, else the first of ACCURACY_REWARDS
    configured, else lenient_correct (the answer in tags, or the last number): a run whose rewards are all the user's
    own still gets a held-out number, read the way most answers are written."""
    if rewards_cfg.eval_metric:
        return rewards_cfg.eval_metric
    configured = [s.name for s in rewards_cfg.functions]
    return next((name for name in ACCURACY_REWARDS if name in configured), "lenient_correct")


def eval_items(task, n: int) -> list[PromptItem]:
    return [task.item(i) for i in range(n)]


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(group_size=1, max_new_tokens=max_new_tokens, temperature=0.0, seed=0)


def score_eval(groups: list[GroupRollout], metric: str) -> dict:
    texts, items = [g.completions[0].text for g in groups], [g.item for g in groups]
    out = {k: sum(score_texts(name, texts, items)) / len(groups)
           for k, name in (("accuracy", metric), ("lenient_accuracy", "lenient_correct"))}
    out.update(n=len(groups), metric=metric, precision=groups[0].precision, **eval_answer_stats(groups, metric),
               samples=[{"prompt": g.item.prompt, "reference": g.item.reference, "completion": g.completions[0].text}
                        for g in groups[:3]])
    return out


def evaluate_model(model_path: str, task, n: int, max_new_tokens: int, metric: str = "correct",
                   precision: str = "bf16", batch: int = 32, chat_template: bool = True, backend: str = "torch",
                   options: dict | None = None, train_task=None) -> dict:
    """In-process evaluation of a checkpoint or model folder (used by `qgrpo eval`), on any registered backend.
    With `train_task` (the train split) the result also holds the majority baseline and the warnings
    (rollout/answer_stats.py)."""
    from qgrpo.rollout.backends import make_generator

    gen = make_generator(backend, model_path=model_path, precision=precision,
                         generator_id=f"eval-{backend}-{precision}",
                         chat_template=chat_template, **(options or {}))
    items = eval_items(task, n)
    groups = []
    for i in range(0, n, batch):
        groups += gen.generate(items[i:i + batch], greedy(max_new_tokens))
    res = score_eval(groups, metric)
    if train_task is not None:
        res["baseline"] = majority_baseline(train_task, items, metric)
        res["warnings"] = hollow_warnings(res, res["baseline"])
    return res
