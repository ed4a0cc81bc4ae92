"""Reward shaping by completion length (plain Python: no Ray, no torch).

DAPO's soft overlong punishment (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
eq. 13): a completion that runs into the last `buffer` tokens before `max_new_tokens` loses reward linearly in how
far into that stretch it ran, so the policy learns to finish before the cut instead of being rewarded for answers the
cut may have spoiled. With L_max = max_new_tokens, L_cache = buffer, P = penalty and |y| the completion's length:

    R_length(y) = 0                                    |y| <= L_max - L_cache
                = -P * (|y| - (L_max - L_cache)) / L_cache    L_max - L_cache < |y| <= L_max
                = -P                                   |y| > L_max

The penalty is added to the completion's reward before the group's advantages are computed (cluster/run/driver.py).
"""
from __future__ import annotations

from collections.abc import Sequence


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
