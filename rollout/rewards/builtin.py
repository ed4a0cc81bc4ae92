"""The built-in rewards. Each is a reward function of the calling convention (rollout/rewards/calls.py):
`fn(completions, references, **kwargs) -> list[float]`, one value per completion, so a built-in and a user's own
function are called, timed and combined the same way.

Two families: `correct` / `exact` / `integer_format` read a bare integer (the tiny digit-sum model), and
`answer_correct` / `answer_format` / `lenient_correct` read the answer from `<answer>...</answer>` tags, the format the
presets' instruction asks for. Each is built from a per-completion check `(completion, reference) -> float` kept in
`CHECKS`, which answer statistics and the majority baseline use on single answers.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Callable

Check = Callable[[str, str], float]  # (completion text, reference) -> score
# rewards.eval_metric: built-ins that read one answer per completion, so held-out accuracy is their mean
EVAL_METRICS = ("rg_score", "math_verify", "answer_correct", "lenient_correct", "text_match", "correct", "exact")
NUMBER_READERS = ("correct", "integer_format")  # read integers only: can never score a word answer such as "Brussels"
ON_ERROR = ("fail", "zero")  # rewards.on_error: a reward call that raises, hangs or returns garbage

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


def text_answer(text: str | None) -> str | None:
    """The answer in the last `<answer>` block, or without tags the whole completion, stripped; None if empty."""
    got = extract_answer(text)
    got = (text or "").strip() if got is None else got
    return got or None


def text_match(completion: str, reference: str) -> float:
    """1 if the answer (the last `<answer>` block, or without tags the whole completion) is the reference
    (`answers_match`: numbers by value, text ignoring case, spacing and a final full stop) or names it as a whole
    phrase: "The capital of Belgium is Brussels." matches "Brussels", "Brusselsprout" does not. An empty reference
    never matches. The held-out accuracy of a task whose references are words, unless rewards.eval_metric says."""
    answer, ref = text_answer(completion), _normalise(str(reference or ""))
    if answer is None or not ref:
        return 0.0
    if answers_match(answer, reference):
        return 1.0
    return float(re.search(rf"(?<!\w){re.escape(ref)}(?!\w)", " ".join(answer.split()).casefold()) is not None)


# The answer a correctness reward reads from a completion (None: no answer), and a completion it reads as a given
# answer. Answer statistics and the majority baseline (rollout/answer_stats.py) go through these, so they see answers
# exactly as the reward does.
ANSWER_READERS: dict[str, Callable[[str], str | None]] = {
    "correct": extract_integer,
    "exact": str.strip,
    "answer_correct": extract_answer,
    "lenient_correct": lenient_answer,
    "rg_score": extract_answer,
    "math_verify": extract_answer,
    "text_match": text_answer,
}


def completion_with_answer(metric: str, answer: str) -> str:
    """A completion that `metric` reads as `answer`: tagged for the <answer> rewards, the bare answer otherwise."""
    tagged = ("answer_correct", "lenient_correct", "rg_score", "math_verify")
    return f"<answer>{answer}</answer>" if metric in tagged else answer


def answer_key(answer: str | None) -> str | None:
    """The form under which two answers count as the same one: numbers by value ("7.0", "+7" -> "7"), other text as
    `answers_match` normalises it; None for no answer or an empty one."""
    if answer is None:
        return None
    number = _as_number(answer)
    if number is not None:
        return format(number.normalize() + 0, "f")  # + 0: "-0" is "0"
    return _normalise(answer) or None


def batched(check: Check) -> Callable[..., list[float]]:
    """The per-completion `check` as a reward function of the calling convention. A completion is read in either
    shape (a string, or a chat row's [{"role": "assistant", "content": TEXT}]: calls.completion_text)."""
    from qgrpo.rollout.rewards.calls import completion_text

    def reward(completions: list, references: list[str], **kwargs) -> list[float]:
        return [float(check(completion_text(c), r)) for c, r in zip(completions, references, strict=True)]

    reward.__name__, reward.__qualname__, reward.__doc__ = check.__name__, check.__name__, check.__doc__
    return reward


CHECKS: dict[str, Check] = {
    "correct": correct,
    "exact": exact,
    "integer_format": integer_format,
    "answer_correct": answer_correct,
    "answer_format": answer_format,
    "lenient_correct": lenient_correct,
    "text_match": text_match,
}
def environment(env_scores: list | None = None, **kwargs) -> list[float | None]:
    """The environment's own score of each multi-turn trajectory ([environment], rollout/episodes.py); None (not
    applicable) for a completion that no environment scored."""
    if env_scores is None:
        return [None] * len(kwargs.get("completions", []))
    return [None if s is None else float(s) for s in env_scores]


# name -> reward function; verifiers (rollout/rewards/verifiers.py) and "reward_model" join it in rewards/__init__.py
REWARD_FUNCTIONS: dict[str, Callable[..., list]] = {name: batched(check) for name, check in CHECKS.items()}
REWARD_FUNCTIONS["environment"] = environment


class RewardError(RuntimeError):
    """A reward that failed under rewards.on_error = "fail": says which function, which prompt and what to do.
    `failure` is the failed call (rollout/rewards/scoring.py's CallResult, its traceback included), if one was."""

    def __init__(self, message: str, failure=None):
        super().__init__(message)
        self.failure = failure
