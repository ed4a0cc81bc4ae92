"""Reward functions of this example's own, named in config.toml as
{function = "examples/own_rewards/rewards.py:NAME", weight = ...}.

qgrpo calls each function once per batch of completions, with keyword arguments whose values are lists holding one
entry per completion (a prompt's row is repeated for each of its group_size completions): `completions` (the texts),
`completion_ids` (the sampled token ids), `references` (the answer column), `prompts`, `item_ids`, `finish_reasons`,
and every column of the dataset row under its own name, here `question`, `answer` and `tolerance`. A function returns
one float per completion, or None where it does not apply. `**kwargs` takes the keywords a function does not use.

qgrpo reads this file in the driver and ships its source to the reward workers, so it is self-contained: the standard
library only, no imports of files beside it. `qgrpo check` imports it and checks each signature against the dataset's
columns (a required `tolerance` parameter needs a `tolerance` column), so a typo fails before anything starts.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# The last <answer>...</answer> block (no answer tag inside it); the instruction in config.toml asks for one.
ANSWER_BLOCK = re.compile(r"<answer>((?:(?!</?answer>).)*)</answer>", re.DOTALL)
# A number: a sign, digits with optional thousands commas (1,609), optional decimals (2.54), or a bare .5
NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|[-+]?\.\d+")

# length_penalty: completions up to BUDGET_TOKENS tokens are free; each token past it costs PENALTY_PER_TOKEN. With
# rollout.max_new_tokens = 48 a completion cut at the limit scores -16 * 0.0625 = -1.0 here, -0.1 after the weight
# of 0.1 in config.toml: enough to prefer the shorter of two right answers, too little to outweigh a right answer (1.0).
BUDGET_TOKENS = 32
PENALTY_PER_TOKEN = 0.0625


def _number(text: str | None) -> Decimal | None:
    """The last number in `text` as an exact decimal ("1,609" -> 1609), or None. Decimals, not floats: with floats
    2.6 - 2.5 is 0.10000000000000009, which a tolerance of 0.1 would refuse."""
    found = NUMBER.findall(text or "")
    if not found:
        return None
    try:
        return Decimal(found[-1].replace(",", ""))
    except InvalidOperation:
        return None


def read_answer(completion: str) -> Decimal | None:
    """The number in the last <answer> block; without any block, the last number in the completion (an untrained
    model seldom uses the tags at first: this still rewards a right number). A block without a number is no answer."""
    blocks = ANSWER_BLOCK.findall(completion or "")
    return _number(blocks[-1] if blocks else completion)


def within_tolerance(completions: list[str], references: list[str], tolerance: list, **kwargs) -> list[float | None]:
    """1.0 when the completion's answer is within the row's own `tolerance` column of the reference answer
    (|answer - reference| <= tolerance, in the reference's units), else 0.0. A row whose tolerance is null (or that
    lacks the column) needs the exact value (2.50 and 2.5 are the same value). A reference that is not a number:
    None, this function does not apply (the other rewards still score that completion)."""
    out: list[float | None] = []
    for completion, reference, tol in zip(completions, references, tolerance, strict=True):
        ref = _number(str(reference)) if NUMBER.fullmatch(str(reference).strip()) else None
        if ref is None:
            out.append(None)
            continue
        got = read_answer(completion)
        allowed = Decimal(str(tol)) if tol is not None else Decimal(0)  # str(): 0.1 the decimal, not the float
        out.append(float(got is not None and abs(got - ref) <= abs(allowed)))
    return out


def length_penalty(completion_ids: list[list[int]], **kwargs) -> list[float]:
    """A small negative reward per token above a budget: -PENALTY_PER_TOKEN * (tokens - BUDGET_TOKENS), 0.0 up to
    BUDGET_TOKENS tokens. Counts sampled tokens (completion_ids), not characters, so it measures what generation costs.
    Its mean is logged as reward/length_penalty (0 = nothing over budget)."""
    return [-PENALTY_PER_TOKEN * max(0, len(ids) - BUDGET_TOKENS) for ids in completion_ids]
