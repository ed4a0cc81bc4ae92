"""Which groups a step trains on (plain Python): DAPO's dynamic sampling as a policy of where groups come from.

A group whose rewards are all equal has advantages exactly 0 and teaches nothing but the KL term. Under
`algo.dynamic_sampling` such groups are dropped and more prompts drawn, until rollout.prompts_per_step groups with
signal are in hand or `algo.dynamic_sampling_rounds` rounds have run (cluster/run/sampling.py drives the rounds).
Each extra round draws ceil(missing / keep_rate) prompts, keep_rate being the share of this step's groups so far
that had signal (at least KEEP_RATE_FLOOR), and never more than prompts_per_step. The batch is the first
prompts_per_step groups with signal in generation order, filled with dropped groups when the rounds run out, so
every step has the same number of groups.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

KEEP_RATE_FLOOR = 0.25  # an extra round asks for at most 1 / KEEP_RATE_FLOOR times the groups still missing


def has_signal(rewards: Sequence[float]) -> bool:
    """A group teaches something only if its rewards differ (equal rewards: advantages exactly 0)."""
    return max(rewards) > min(rewards)


def select_groups(rewards: Sequence[Sequence[float]], want: int) -> tuple[list[int], int]:
    """The groups of a step's batch, by index into `rewards` (every group generated this step, in generation
    order, each its G rewards): the first `want` groups with signal; when fewer have signal, the first groups without
    signal fill the batch up to `want`. Returns (indices in generation order, how many filled in without signal)."""
    signal = [i for i, r in enumerate(rewards) if has_signal(r)][:want]
    flat = [i for i, r in enumerate(rewards) if not has_signal(r)][:want - len(signal)]
    return sorted(signal + flat), len(flat)


def prompts_to_draw(missing: int, kept: int, generated: int, cap: int) -> int:
    """Prompts an extra round draws: ceil(missing / keep_rate), keep_rate = kept / generated (the share of this
    step's groups so far with signal) but at least KEEP_RATE_FLOOR, and at most `cap` (rollout.prompts_per_step)."""
    if missing <= 0:
        return 0
    rate = max(kept / generated if generated else 0.0, KEEP_RATE_FLOOR)
    # kept / generated exactly where it is above the floor: ceil(missing * generated / kept) in integers
    n = -(-missing * generated // kept) if rate > KEEP_RATE_FLOOR else math.ceil(missing / KEEP_RATE_FLOOR)
    return min(n, cap)
