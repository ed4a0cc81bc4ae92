"""Held-out accuracy's judge: which reward says a greedy answer is correct, and how.

`rewards.eval_metric` names a built-in (one that reads one answer per completion: EVAL_METRICS) or any entry of
rewards.functions by its label: a function of the user's own, a URL, the reward model, a built-in entry. A score at or
above `rewards.eval_threshold` counts as correct (a 0/1 reward is unaffected by any threshold in (0, 1]). Left empty,
the judge is the first accuracy built-in among rewards.functions that can read the references (a number reader such
as `correct` is skipped when they are words), else `lenient_correct` for numeric references and `text_match` for the
rest: a run whose rewards are all the user's own still gets a held-out number a user would accept.

Answer statistics and the majority baseline (rollout/answer_stats.py) read answers and write a given answer as a
completion through the judge, so they see answers exactly as it does; a non-built-in judge reads the answer as
`text_match` does (the <answer> block, else the whole completion).
"""
from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Callable, Sequence

from qgrpo.rollout.rewards.builtin import (
    ANSWER_READERS,
    EVAL_METRICS,
    NUMBER_READERS,
    completion_with_answer,
    text_answer,
)

# The first of these configured is the default judge (verifiers first: they know the task's answers best)
ACCURACY_REWARDS = ("rg_score", "math_verify", "answer_correct", "correct", "exact")
# (prompts, completions, histories) -> one score per completion: the [reward_model] actors, or a classifier in-process
ModelScorer = Callable[[list, list, list], list]


class JudgeError(RuntimeError):
    """The judge could not score the held-out answers (a user's function raised, a URL did not answer)."""


def is_number(text) -> bool:
    try:
        Decimal(str(text).strip().replace(",", ""))
        return True
    except (InvalidOperation, ValueError):
        return False


def numeric(references: Sequence) -> bool:
    """Every reference (there is at least one) reads as a number."""
    refs = [r for r in references if r is not None]
    return bool(refs) and all(is_number(r) for r in refs)


@dataclass
class Judge:
    name: str  # what results and messages call it: a built-in's name, or a rewards.functions entry's label
    builtin: str = ""  # the built-in that scores it; "" for a user function, a URL or the reward model
    entry: object = None  # the RewardEntry (rollout/rewards/scoring.py) of a non-built-in judge
    threshold: float = 0.5
    why: str = ""  # how it was chosen, for `check`
    model: ModelScorer | None = None  # scores a "model" entry
    _fn: Callable | None = None

    def read(self, text: str) -> str | None:
        """The answer of a completion as this judge reads it."""
        return ANSWER_READERS.get(self.builtin, text_answer)(text)

    def as_completion(self, answer: str) -> str:
        """A completion this judge reads as `answer`."""
        return completion_with_answer(self.builtin, answer) if self.builtin else answer

    def describe(self) -> str:
        kind = (f"built-in {self.builtin}" if self.builtin and self.builtin == self.name else
                f"{self.entry.field} ({self.entry.kind})" if self.entry is not None else self.name)
        why = f"; {self.why}" if self.why else ""
        return f"{self.name} ({kind}; correct when its score >= {self.threshold:g}){why}"

    def scores(self, texts: list[str], items: list) -> list[float | None]:
        """The judge's score of each text, `items[i]` (a PromptItem) its row. Raises JudgeError."""
        from qgrpo.core.records import Completion
        from qgrpo.rollout.rewards.calls import reward_kwargs
        from qgrpo.rollout.rewards.scoring import call_with_deadline, make_callable, score_texts

        if self.builtin:
            return list(score_texts(self.builtin, texts, items))
        if self.entry.kind == "model":
            if self.model is None:
                raise JudgeError(f"rewards.eval_metric = {self.name!r} is the reward model, which is not loaded here")
            return list(self.model([it.prompt for it in items], texts, [list(it.history) for it in items]))
        if self._fn is None:
            self._fn = make_callable(self.entry)
        result = call_with_deadline(self.name, self._fn, reward_kwargs(items, [Completion([], [], "stop", t)
                                                                             for t in texts]), self.entry.timeout_s)
        if result.values is None:
            at = f" (at {result.where})" if result.where else ""
            raise JudgeError(f"rewards.eval_metric = {self.name!r} ({self.entry.field}) failed on the held-out "
                             f"answers: {result.error}{at}")
        return result.values

    def correct(self, texts: list[str], items: list) -> list[float]:
        """1.0 for each text the judge scores at or above the threshold, else 0.0 (None: not applicable, 0.0)."""
        return [float(s is not None and s >= self.threshold) for s in self.scores(texts, items)]

    def sample_accuracy(self, groups: list) -> float | None:
        """The share of a step's completions (GroupRollouts, scored) this judge counts correct. A judge that is a
        rewards.functions entry was already scored by the reward workers: its scores of the step are read back, not
        computed again; a built-in that is not an entry judges the texts here. None where there are no scores (an
        entry whose calls failed)."""
        if self.builtin and not all(self.name in g.scores for g in groups):
            texts, items = zip(*[(c.text, g.item) for g in groups for c in g.completions])
            return sum(self.correct(list(texts), list(items))) / len(texts)
        values = [v for g in groups for v in g.scores.get(self.name, [])]
        if not values or all(v is None for v in values):
            return None
        return sum(v is not None and v >= self.threshold for v in values) / len(values)


def builtin_judge(name: str, threshold: float = 0.5) -> Judge:
    return Judge(name, builtin=name, threshold=threshold)


def as_judge(metric: "str | Judge") -> Judge:
    """A judge from a built-in's name (tests and older callers pass names)."""
    return metric if isinstance(metric, Judge) else builtin_judge(metric)


def choose_judge(rewards_cfg, references: Sequence | None = None, model: ModelScorer | None = None) -> Judge:
    """The judge of held-out accuracy (the rule is in the module docstring). `references`: some of the task's
    references (None: unknown, taken as numeric)."""
    from qgrpo.rollout.rewards.scoring import entry_label, make_entry

    threshold = rewards_cfg.eval_threshold
    words = references is not None and not numeric(references)
    name = rewards_cfg.eval_metric
    if name:
        labels = [entry_label(s) for s in rewards_cfg.functions]
        entry = make_entry(rewards_cfg, labels.index(name)) if name in labels else None
        if entry is not None and entry.kind != "builtin":
            return Judge(name, entry=entry, threshold=threshold, why="rewards.eval_metric", model=model)
        builtin = entry.target if entry is not None else name
        return Judge(name, builtin=builtin, threshold=threshold, why="rewards.eval_metric")
    configured = [s.name for s in rewards_cfg.functions if s.name]
    for name in ACCURACY_REWARDS:
        if name in configured and not (words and name in NUMBER_READERS):
            return Judge(name, builtin=name, threshold=threshold, why="the first accuracy reward of rewards.functions")
    fallback = "text_match" if words else "lenient_correct"
    why = ("the references are words" if words else "the references are numbers") + ", and rewards.functions has " \
        "no accuracy reward that reads them; set rewards.eval_metric to name another"
    return Judge(fallback, builtin=fallback, threshold=threshold, why=why)


def judge_problems(judge: Judge, references: Sequence) -> list[str]:
    """Warnings for `check`: a number-reading judge named on references that are words."""
    words = [r for r in references if r is not None and not is_number(r)]
    if judge.builtin in NUMBER_READERS and words:
        return [f"held-out accuracy is scored by {judge.name}, which reads numbers, but {len(words)} of "
                f"{len(references)} references are words (e.g. {str(words[0])[:40]!r}): it can never count them "
                "correct; set rewards.eval_metric = \"text_match\" or the label of a reward of your own"]
    return []


__all__ = ["ACCURACY_REWARDS", "EVAL_METRICS", "Judge", "JudgeError", "as_judge", "builtin_judge", "choose_judge",
           "judge_problems", "numeric"]
