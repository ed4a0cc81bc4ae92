"""Reward functions: plain callables `(completion_text, reference) -> float`, combined with weights.

A reward function that raises is reported with the prompt id; `on_error="zero"` scores it 0 and counts it instead.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

RewardFn = Callable[[str, str], float]

_INT = re.compile(r"-?\d+")


def extract_integer(text: str) -> str | None:
    """The first integer in the completion, or None."""
    m = _INT.search(text)
    return m.group(0) if m else None


def correct(completion: str, reference: str) -> float:
    """1 if the first integer of the completion equals the reference answer."""
    got = extract_integer(completion)
    return float(got is not None and got.lstrip("0") == reference.strip().lstrip("0"))


def exact(completion: str, reference: str) -> float:
    """1 if the whole completion (stripped) is the reference: the answer and nothing else."""
    return float(completion.strip() == reference.strip())


def integer_format(completion: str, reference: str) -> float:
    """1 if the completion is just an integer."""
    return float(re.fullmatch(r"\s*-?\d+\s*", completion) is not None)


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "correct": correct,
    "exact": exact,
    "integer_format": integer_format,
}


class RewardError(RuntimeError):
    pass


@dataclass
class WeightedRewards:
    """Sum of weighted reward functions. Keeps per-function means for logging and counts failures."""

    fns: list[tuple[str, RewardFn, float]]
    on_error: str = "fail"
    errors: int = 0

    @classmethod
    def from_config(cls, rewards_cfg) -> "WeightedRewards":
        fns = [(s.name, REWARD_FUNCTIONS[s.name], s.weight) for s in rewards_cfg.functions]
        return cls(fns=fns, on_error=rewards_cfg.on_error)

    def score(self, completion: str, reference: str, prompt_id: str) -> tuple[float, dict[str, float]]:
        total, parts = 0.0, {}
        for name, fn, weight in self.fns:
            try:
                value = float(fn(completion, reference))
                if not math.isfinite(value):
                    raise ValueError(f"returned {value}")
            except Exception as e:  # a user's reward function may raise anything
                if self.on_error == "fail":
                    raise RewardError(
                        f"reward function {name!r} failed on prompt {prompt_id!r} ({type(e).__name__}: {e}); "
                        "fix the function, or set rewards.on_error='zero' to score such completions 0 and count them"
                    ) from e
                self.errors += 1
                value = 0.0
            parts[name] = value
            total += weight * value
        return total, parts
