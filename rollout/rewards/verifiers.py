"""Verifiers out of the box: reasoning-gym's own scorer (`rg_score`) and a math answer verifier (`math_verify`).

Both are reward functions of the calling convention (rollout/rewards/calls.py) and return None for a row they do not
apply to, so they can be listed for a mixed dataset. They read completions in either shape (strings, or a chat row's
[{"role": "assistant", "content": TEXT}]). reasoning_gym, math_verify and sympy are imported on first call:
importing qgrpo.rollout.rewards stays light.
"""
from __future__ import annotations

import functools
import json
import logging
import re
import threading
from decimal import Decimal, InvalidOperation
from typing import Any, Callable

from qgrpo.rollout.rewards.builtin import extract_answer
from qgrpo.rollout.rewards.calls import completion_text

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------------------------
# reasoning-gym

_RG_KEYS = {"task": str, "params": dict, "seed": int, "index": int, "size": int}


@functools.lru_cache(maxsize=32)
def _rg_dataset(task: str, size: int, seed: int, params_json: str):
    """One reasoning-gym dataset per (task, size, seed, params): entries are generated on access, so a cached dataset
    costs little, and rebuilding it for every call would repeat its setup (word lists, configs)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=size, seed=seed, **json.loads(params_json))


def _checked_rg_entry(entry: Any, i: int) -> dict:
    if not isinstance(entry, dict) or any(not isinstance(entry.get(k), t) or isinstance(entry.get(k), bool)
                                          for k, t in _RG_KEYS.items()):
        keys = ", ".join(f"{k}: {t.__name__}" for k, t in _RG_KEYS.items())
        raise ValueError(f"rg_score: rg_entry of completion {i} is {str(entry)[:120]!r}; expected {{{keys}}} as the "
                         "rg: tasks write it (rollout/data/tasks.py RGTask)")
    return entry


def _rg_rebuilt(entry: dict, i: int, question: Any) -> tuple[Any, dict]:
    """(dataset, entry) that `entry` names; a rebuilt question that differs from the row's `question` column means
    the entry cannot be rebuilt faithfully (params that do not survive JSON), which would score against the wrong
    answer, so it raises instead."""
    params_json = json.dumps(entry["params"], sort_keys=True)
    try:
        ds = _rg_dataset(entry["task"], entry["size"], entry["seed"], params_json)
        rebuilt = ds[entry["index"]]
    except Exception as e:
        raise ValueError(f"rg_score: cannot rebuild reasoning-gym entry {entry} of completion {i} "
                         f"({type(e).__name__}: {e})") from e
    if isinstance(question, str) and rebuilt.get("question") != question:
        raise ValueError(f"rg_score: the rebuilt entry {entry} of completion {i} asks a different question than the "
                         f"row ({str(rebuilt.get('question'))[:80]!r} vs {question[:80]!r}); its params do not "
                         "rebuild the dataset that made the row")
    return ds, rebuilt


def rg_score(completions: list, rg_entry: list[dict | None], **kwargs) -> list[float | None]:
    """reasoning-gym's own `score_answer` for the answer in the completion's last `<answer>` block: tasks whose
    answers are not numbers, several correct answers (countdown) and partial credit (spell_backward) score as the
    task defines. No block -> `score_answer(None, entry)` (0 for the tasks seen). None for a row without `rg_entry`
    (not a reasoning-gym row). A scorer that raises on a malformed answer scores it 0, as reasoning-gym's scorers
    themselves do for answers they cannot read."""
    questions = kwargs.get("question") or [None] * len(completions)
    out: list[float | None] = []
    seen: dict[str, tuple[Any, dict]] = {}  # a prompt's G completions share one rebuilt entry
    for i, (text, entry) in enumerate(zip(completions, rg_entry, strict=True)):
        if entry is None:
            out.append(None)
            continue
        key = json.dumps(_checked_rg_entry(entry, i), sort_keys=True)
        if key not in seen:
            seen[key] = _rg_rebuilt(entry, i, questions[i])
        ds, rebuilt = seen[key]
        answer = extract_answer(completion_text(text))
        try:
            score = ds.score_answer(answer, rebuilt)
        except Exception as e:
            log.warning("rg_score: %s score_answer raised %s on %r; scored 0", entry["task"], type(e).__name__,
                        str(answer)[:80])
            score = 0.0
        out.append(float(score))
    return out


# ---------------------------------------------------------------------------------------------------------------
# math-verify

FLOAT_ROUNDING = 6  # math_verify.verify's float_rounding: decimals both sides are rounded to when one is a decimal
NUMERIC_PRECISION = 15  # its numeric_precision: significant digits of a symbolic difference evaluated to test == 0
_FLOAT_DIGITS = 15  # the precision of the Floats math_verify's parser makes (53 bits)
MV_TIMEOUT_S = 5  # math_verify's own signal-based time limit, used only in the main thread

_DELIMITED = ("$", "\\(", "\\[", "\\boxed")
# A plain number: sign, digits with optional thousands commas, decimals, exponent ("-1,234.5", "1e-7", ".5")
_PLAIN_NUMBER = re.compile(r"\s*[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?\s*")
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_WORD = re.compile(r"[A-Za-z]{2,}")
_MATH_WORDS = frozenset({"pi", "sqrt", "sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp", "oo", "inf"})


class _TimeoutNotice(logging.Filter):
    """Drops math_verify's "Timeout is disabled" warning: off the main thread the pool's deadline
    (rewards.timeout_s) is the time limit, so the warning would only alarm."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_TimeoutNotice())


def _plain_number(text: str):
    """A sympy Float for a plain number ("1,234", "1e-7", "10"), else None. math_verify reads "1e-7" as 1 (plain)
    or e - 7 (LaTeX); and its tolerance applies only when one side is a decimal, so an integer reference becomes a
    decimal too: "7" then accepts "7.0000001" as it accepts "7.0"."""
    if not _PLAIN_NUMBER.fullmatch(text):
        return None
    try:
        value = Decimal(text.strip().replace(",", ""))
    except InvalidOperation:
        return None
    import sympy

    if value == value.to_integral_value() and len(value.as_tuple().digits) > _FLOAT_DIGITS:
        return sympy.Integer(int(value))  # too long for a Float to hold exactly: compared exactly
    # sympy Floats of different precisions never compare equal, so every decimal gets math_verify's own (53 bits)
    return sympy.Float(format(value, "f"), _FLOAT_DIGITS)


def _looks_like_text(reference: str) -> bool:
    """A reference without digits with a word in it ("Paris", "\\text{blue}") is not math: as LaTeX it would parse
    to a product of symbols, and "Prias" would then equal "Paris"."""
    if any(c.isdigit() for c in reference):
        return False
    return any(w.lower() not in _MATH_WORDS for w in _WORD.findall(_LATEX_COMMAND.sub(" ", reference)))


def _timeouts() -> dict[str, int | None]:
    # math_verify's limit is signal.alarm, which only the main thread may set (elsewhere parse and verify raise
    # ValueError); the reward pool calls functions in worker threads, under its own deadline instead.
    return {"parsing_timeout": MV_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None}


def _parsed(text: str, whole: bool = False) -> list:
    """math_verify's parse of `text`. A plain number is read by `_plain_number`. A bare expression ("\\sqrt{2}",
    "(1, 2)", "x=2") is wrapped in $...$, since without delimiters math_verify skips "\\sqrt{2}" and reads "(1, 2)"
    as 2. A whole completion (`whole`) is searched as it is, \\boxed{} first."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    number = None if whole else _plain_number(text)
    if number is not None:
        return [number]
    latex = LatexExtractionConfig(boxed_match_priority=0) if whole else LatexExtractionConfig()
    configs = [latex, ExprExtractionConfig()]
    delimited = whole or any(d in text for d in _DELIMITED)
    found = parse(text if delimited else f"${text}$", configs, **_timeouts())
    if not delimited and not _has_math(found):  # "**7**": not LaTeX, but the plain reader finds the 7
        found = parse(text, configs, **_timeouts())
    return found


def _has_math(parsed: list) -> bool:
    return any(not isinstance(p, str) for p in parsed)


def math_verifier(float_rounding: int = FLOAT_ROUNDING, numeric_precision: int = NUMERIC_PRECISION) -> Callable:
    """A `math_verify` reward with other precision settings, e.g. `loose = math_verifier(float_rounding=3)` in a
    user's reward file."""

    def math_verify(completions: list, references: list[str], **kwargs) -> list[float | None]:
        """1.0 if the answer equals the reference as math (math-verify: LaTeX, fractions, sets, intervals, equations
        "x=2" vs "2", percentages), else 0.0; None where the reference is not math (does not parse, or is text).

        The answer is the last `<answer>` block, else the whole completion (its \\boxed{} first). Equality: symbolic
        (1/2 == \\frac{1}{2} == 0.5); when either side is a decimal both are rounded to `float_rounding` decimals and
        compared (6: 0.1 == 0.1000004 but not 0.1000006; 1/3 == 0.3333333, not 0.333; a plain-number reference
        counts as a decimal, so "10" accepts 10.0000001); otherwise a symbolic difference evaluated to
        `numeric_precision` digits must be 0. Time: math_verify's own 5 s limit in the main thread; in a worker
        thread (the reward pool) that limit cannot work (signal.alarm), and the pool's deadline bounds the call."""
        from math_verify import verify

        golds: dict[str, list | None] = {}
        out: list[float | None] = []
        for text, reference in zip(completions, references, strict=True):
            ref = "" if reference is None else str(reference)
            if ref not in golds:
                gold = None if not ref.strip() or _looks_like_text(ref) else _parsed(ref)
                golds[ref] = gold if gold and _has_math(gold) else None
            gold = golds[ref]
            if gold is None:
                out.append(None)
                continue
            text = completion_text(text)
            block = extract_answer(text)
            answer = _parsed(block) if block is not None else _parsed(text or "", whole=True)
            timeout = _timeouts()["parsing_timeout"]
            ok = bool(answer) and verify(gold, answer, float_rounding=float_rounding,
                                         numeric_precision=numeric_precision, timeout_seconds=timeout)
            out.append(1.0 if ok else 0.0)
        return out

    return math_verify


math_verify = math_verifier()
