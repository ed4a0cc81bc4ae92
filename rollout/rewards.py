"""Reward functions: plain callables `(completion_text, reference) -> float`, combined with weights.

Two families: `correct` / `exact` / `integer_format` read a bare integer (the tiny digit-sum model), and
`answer_correct` / `answer_format` / `lenient_correct` read the answer from `<answer>...</answer>` tags, the format the
task instruction asks for (rollout/tasks.py).

A reward function that raises is reported with the prompt id; `on_error="zero"` scores it 0 and counts it instead.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Callable

RewardFn = Callable[[str, str], float]
ON_ERROR = ("fail", "zero")  # rewards.on_error: what a reward function that raises does (WeightedRewards.score)

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


# ---------------------------------------------------------------------------------------------------------------
# Answers inside <answer>...</answer>

# A block is an opening tag, text without further answer tags, and a closing tag: in "<answer><answer>7</answer>"
# only the inner pair is a block, so nested or unclosed tags never swallow a later block. Tags are case-sensitive.
_BLOCK = re.compile(r"<answer>((?:(?!</?answer>).)*)</answer>", re.DOTALL)
# A number: optional sign, digits with optional thousands commas (1,234), optional decimals; or .5
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|[-+]?\.\d+")
_WHOLE_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[-+]?\.\d+")


def extract_answer(text: str | None) -> str | None:
    """Content of the last well-formed `<answer>...</answer>` block, stripped; None if there is none.

    `"<answer>3</answer> no, <answer> 4 </answer>"` -> "4"; `"<answer>4"` -> None; `"<answer></answer>"` -> "".
    """
    if not text:
        return None
    blocks = _BLOCK.findall(text)
    return blocks[-1].strip() if blocks else None


def last_number(text: str | None) -> str | None:
    """The last number in the text ("1,234", "-3", "7.5"), or None."""
    found = _NUMBER.findall(text or "")
    return found[-1] if found else None


def _as_number(s: str) -> Decimal | None:
    s = s.strip()
    if not _WHOLE_NUMBER.fullmatch(s):
        return None
    try:
        return Decimal(s.replace(",", ""))
    except InvalidOperation:
        return None


def _normalise(s: str) -> str:
    # whitespace collapsed, case folded, one trailing full stop dropped ("Paris." == "paris")
    s = " ".join(s.split()).casefold()
    return s[:-1].rstrip() if s.endswith(".") else s


def answers_match(answer: str | None, reference: str | None) -> bool:
    """Numbers compare by value ("7.0" == "7", "1,234" == "1234", "+3" == "3"), exactly (no tolerance); anything
    else compares as text after `_normalise`. A number with words around it ("7 apples") is text, so it does not
    match "7"."""
    if answer is None or reference is None:
        return False
    a, r = _as_number(answer), _as_number(str(reference))
    if a is not None and r is not None:
        return a == r
    a_text, r_text = _normalise(answer), _normalise(str(reference))
    return bool(a_text) and a_text == r_text


def answer_correct(completion: str, reference: str) -> float:
    """1 if the answer in the last `<answer>` block matches the reference (see `answers_match`); 0 without tags."""
    return float(answers_match(extract_answer(completion), reference))


def answer_format(completion: str, reference: str) -> float:
    """1 for exactly one non-empty `<answer>...</answer>` block and no stray answer tags; 0.5 when blocks are present
    but the format is off (empty, several, or extra unmatched tags); 0 without a well-formed block."""
    if not completion:
        return 0.0
    blocks = _BLOCK.findall(completion)
    if not blocks:
        return 0.0
    single = len(blocks) == 1 and completion.count("<answer>") == 1 and completion.count("</answer>") == 1
    return 1.0 if single and blocks[0].strip() else 0.5


def lenient_answer(text: str | None) -> str | None:
    """The answer in the last `<answer>` block, or without tags the last number in the text."""
    got = extract_answer(text)
    return last_number(text) if got is None else got


def lenient_correct(completion: str, reference: str) -> float:
    """Like `answer_correct`, but without tags the last number in the completion is the answer (an untrained model
    rarely uses the tags; this is the "lenient" accuracy of the baseline measurements). Present but empty tags
    give 0."""
    return float(answers_match(lenient_answer(completion), reference))


# The answer a correctness reward reads from a completion (None: no answer), and a completion it reads as a given
# answer. Answer statistics and the majority baseline (rollout/answer_stats.py) go through these, so they see answers
# exactly as the reward does.
ANSWER_READERS: dict[str, Callable[[str], str | None]] = {
    "correct": extract_integer,
    "exact": str.strip,
    "answer_correct": extract_answer,
    "lenient_correct": lenient_answer,
}


def completion_with_answer(metric: str, answer: str) -> str:
    """A completion that `metric` reads as `answer`: tagged for the <answer> rewards, the bare answer otherwise."""
    return f"<answer>{answer}</answer>" if metric in ("answer_correct", "lenient_correct") else answer


def answer_key(answer: str | None) -> str | None:
    """The form under which two answers count as the same one: numbers by value ("7.0", "+7" -> "7"), other text as
    `answers_match` normalises it; None for no answer or an empty one."""
    if answer is None:
        return None
    number = _as_number(answer)
    if number is not None:
        return format(number.normalize() + 0, "f")  # + 0: "-0" is "0"
    return _normalise(answer) or None


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "correct": correct,
    "exact": exact,
    "integer_format": integer_format,
    "answer_correct": answer_correct,
    "answer_format": answer_format,
    "lenient_correct": lenient_correct,
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
