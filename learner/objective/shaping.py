"""Reward shaping by completion length (plain Python: no Ray, no torch).

DAPO's soft overlong punishment (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
eq. 13): a completion that runs into the last `buffer` tokens before `max_new_tokens` loses reward linearly in how
far into that stretch it ran, so the policy learns to finish before the cut instead of being rewarded for answers the
cut may have spoiled. With L_max = max_new_tokens, L_cache = buffer, P = penalty and |y| the completion's length:

    R_length(y) = 0                                    |y| <= L_max - L_cache
                = -P * (|y| - (L_max - L_cache)) / L_cache    L_max - L_cache < |y| <= L_max
                = -P                                   |y| > L_max

The penalty is added to the completion's reward before the group's advantages are computed (`shape_groups`).
DAPO's overlong filtering (`without_truncated`) leaves the completions cut at max_new_tokens out of the loss.
Both return new values; nothing given is changed.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from qgrpo.core.records import GroupRollout


def overlong_penalties(lengths: Sequence[int], max_new_tokens: int, buffer: int, penalty: float) -> list[float]:
    """The soft overlong punishment (DAPO eq. 13) of each completion length, in tokens: 0 up to
    max_new_tokens - buffer, then falling linearly to -penalty at max_new_tokens (and -penalty beyond).
    `buffer` 0 turns it off (every penalty is 0). Raises ValueError for a buffer outside [0, max_new_tokens) or a
    penalty that is not a positive finite number."""
    if not 0 <= buffer < max_new_tokens:
        raise ValueError(f"buffer must be in [0, max_new_tokens = {max_new_tokens}), got {buffer}")
    if not 0 < penalty < float("inf"):  # also rejects NaN
        raise ValueError(f"penalty must be a positive finite number, got {penalty!r}")
    if buffer == 0:
        return [0.0] * len(lengths)
    start = max_new_tokens - buffer  # the longest completion that goes unpunished
    return [-penalty * min(n - start, buffer) / buffer if n > start else 0.0 for n in lengths]


def shape_groups(groups: list[GroupRollout], max_new_tokens: int, buffer: int,
                 penalty: float) -> tuple[list[GroupRollout], dict]:
    """The groups with the overlong penalty added to every completion's reward (new values), and the metrics
    `overlong/penalized_frac` (share of completions penalised) and `overlong/penalty_mean` (over every completion);
    the groups as given and no metrics when `buffer` is 0 (off)."""
    if buffer <= 0:
        return groups, {}
    out, pens = [], []
    for g in groups:
        p = overlong_penalties([len(c.token_ids) for c in g.completions], max_new_tokens, buffer, penalty)
        out.append(dataclasses.replace(g, rewards=[r + x for r, x in zip(g.rewards, p, strict=True)]))
        pens += p
    return out, {"overlong/penalized_frac": sum(x < 0 for x in pens) / len(pens),
                 "overlong/penalty_mean": sum(pens) / len(pens)}


def truncated(groups: list[GroupRollout]) -> list[bool]:
    """Per completion, in the groups' order: whether it was cut at max_new_tokens (finish reason "length"); DAPO's
    overlong filtering leaves these out of the loss (learner/batch.py: PackedRollouts.without)."""
    return [c.finish_reason == "length" for g in groups for c in g.completions]
