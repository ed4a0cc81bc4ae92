"""Group-relative advantages for GRPO (pure torch; no heavy imports).

Each prompt is sampled G times; a completion's advantage is its reward relative to its own group:

    scale="std"  (GRPO, DeepSeekMath):  A_i = (r_i - mean(r)) / (std(r) + eps), std unbiased (divides by G - 1)
    scale="none" (Dr. GRPO):            A_i =  r_i - mean(r)

Dr. GRPO drops the std because dividing by it up-weights groups that are nearly all right or all wrong.
A group whose rewards are all equal carries no learning signal: its advantages are set to exactly 0 (not left to
r - mean rounding, which for rewards such as 0.1 is not 0 in floating point), and never NaN, whatever eps is.
"""

from __future__ import annotations

import dataclasses

import torch

from qgrpo.core.records import GroupRollout
from qgrpo.learner.objective.options import SCALES


def group_advantages(rewards: torch.Tensor, *, scale: str = "std", eps: float = 1e-6) -> torch.Tensor:
    """rewards [P, G] (P prompts, G completions each) -> advantages [P, G], float32.

    scale="std": GRPO, (r - mean) / (std + eps), std the sample std (unbiased, as DeepSeekMath and TRL).
    scale="none": Dr. GRPO, r - mean (no std scaling).
    A group whose rewards are all equal gets exactly 0 for every member, never NaN (also with eps=0).
    Computed in float64 and returned as float32 on the input's device.

    Raises ValueError naming the problem for: non-2D input, G < 2, non-finite rewards, unknown scale, negative
    or non-finite eps.
    """
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if not (eps >= 0.0 and eps != float("inf")):  # also rejects NaN
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    r = torch.as_tensor(rewards)
    if r.dim() != 2:
        raise ValueError(f"rewards must be 2-D [prompts, group_size], got shape {tuple(r.shape)}")
    if r.shape[1] < 2:
        raise ValueError(f"group_size (rewards.shape[1]) must be >= 2 to compare completions, got {r.shape[1]}")
    r = r.to(torch.float64)
    finite = torch.isfinite(r)
    if not bool(finite.all()):
        bad = (~finite).nonzero()[0].tolist()
        raise ValueError(f"rewards must be finite; rewards[{bad[0]}, {bad[1]}] = {r[bad[0], bad[1]].item()}")

    adv = r - r.mean(dim=1, keepdim=True)  # [P, G]
    if scale == "std":
        std = r.std(dim=1, keepdim=True, correction=1)  # [P, 1]
        # Constant groups are zeroed below; give them a harmless divisor so eps=0 cannot make 0/0.
        denom = torch.where(std > 0, std + eps, torch.ones_like(std))
        adv = adv / denom
    constant = (r == r[:, :1]).all(dim=1, keepdim=True)  # [P, 1] exact equality: no tolerance to tune
    adv = torch.where(constant, torch.zeros_like(adv), adv)
    return adv.to(torch.float32)


def with_advantages(groups: list[GroupRollout], scale: str) -> list[GroupRollout]:
    """The groups with their advantages (new values), each relative to its own group's rewards."""
    adv = group_advantages(torch.tensor([g.rewards for g in groups], dtype=torch.float32), scale=scale)  # [groups, G]
    return [dataclasses.replace(g, advantages=a) for g, a in zip(groups, adv.tolist(), strict=True)]
