"""What a step trains on, after DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
Scale"): dynamic sampling, overlong reward shaping and overlong filtering.

**Dynamic sampling** (`algo.dynamic_sampling`): a group whose rewards are all equal (after the overlong shaping) has
advantages 0 and teaches nothing but the KL term. After the step's own prompts are generated and scored, such groups
are dropped and more prompts are drawn, generated and scored, until rollout.prompts_per_step groups with signal are
in hand or `algo.dynamic_sampling_rounds` rounds (the first included) have run. Each extra round draws
ceil(missing / keep_rate) prompts, keep_rate being the share of this step's groups so far that had signal (at least
1/4, so a round asks for at most 4x what is missing), and never more than prompts_per_step. The batch is the first
prompts_per_step groups with signal in generation order; when the rounds run out first it is filled with dropped
groups (advantage 0), so every step has the same number of groups and the learner ranks split it evenly.
The rewards decide which groups stay, so they are scored before the reference sees the batch (the parallel path of
cluster/run/driver.py's `scored_batch` cannot be used).

**Overlong shaping** (`algo.overlong_buffer`): rollout/rewards/shaping.py's penalty is added to every reward before
the advantages. **Overlong filtering** (`algo.overlong_filter`): completions cut at rollout.max_new_tokens are left
out of the loss (their rows of the completion mask are zeroed; TRL's mask_truncated_completions).

The selection (`has_signal`, `select_groups`, `prompts_to_draw`) is plain Python, testable without Ray.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

from qgrpo.cluster.run.overlap import StepRollouts
from qgrpo.core.records import GroupRollout
from qgrpo.learner.batch import TrainBatch
from qgrpo.rollout.rewards.shaping import overlong_penalties

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


def shape_rewards(groups: list[GroupRollout], max_new_tokens: int, buffer: int, penalty: float) -> dict:
    """Add the overlong penalty (rollout/rewards/shaping.py) to every completion's reward, in place, and return
    `overlong/penalized_frac` (share of completions penalised) and `overlong/penalty_mean` (over every completion);
    nothing when `buffer` is 0 (off)."""
    if buffer <= 0:
        return {}
    pens = []
    for g in groups:
        p = overlong_penalties([len(c.token_ids) for c in g.completions], max_new_tokens, buffer, penalty)
        g.rewards = [r + x for r, x in zip(g.rewards, p, strict=True)]
        pens += p
    return {"overlong/penalized_frac": sum(x < 0 for x in pens) / len(pens),
            "overlong/penalty_mean": sum(pens) / len(pens)}


def filter_truncated(batch: TrainBatch, groups: list[GroupRollout]) -> tuple[TrainBatch, dict]:
    """`batch` (packed from `groups`, a row per completion in their order) with the completions cut at
    max_new_tokens (finish reason "length") left out of the loss: their mask rows zeroed and the global token count
    recomputed (the sequence count stays: seq_mean and constant aggregation divide by every sequence, as TRL does).
    With every row left out the learner's weights are 0 and the loss is 0, not NaN. `overlong/filtered_frac`: the
    share left out."""
    cut = torch.tensor([c.finish_reason == "length" for g in groups for c in g.completions], dtype=torch.bool)
    if cut.shape[0] != len(batch):
        raise ValueError(f"filter_truncated: {cut.shape[0]} completions for a batch of {len(batch)} rows")
    mask = batch.completion_mask.clone()
    mask[cut] = 0.0
    out = dataclasses.replace(batch, completion_mask=mask, total_tokens=float(mask.sum()))
    return out, {"overlong/filtered_frac": float(cut.float().mean())}


def dynamic_rollouts(source, score: Callable[[list[GroupRollout]], dict], want: int, max_rounds: int, step: int,
                     steps: int, clock) -> tuple[StepRollouts, dict]:
    """Step `step`'s rollouts under dynamic sampling: `want` groups (the rollout.prompts_per_step), those with
    signal first, from at most `max_rounds` rounds of generation. `source`: cluster/run/overlap.py's RolloutSource;
    `score(groups)` fills the groups' rewards (shaped) and returns their reward metrics; `clock` the step's
    StageClock (laps "generate" and "rewards" add up over the rounds).

    Returns the rollouts (`cursor`: after every prompt drawn this step; `stats`: every round's generations) and the
    metrics: the reward metrics of the FIRST round only, the step's own fresh sample of the policy (the batch kept is
    biased towards groups with mixed results, so its accuracy would read near 50% whatever the policy does), and
    `dynamic/dropped_group_frac`, `dynamic/extra_prompts`, `dynamic/rounds`, `dynamic/topped_up`."""
    first = source.take(step, steps)
    clock.lap("generate")
    # The step's reward metrics are this first round's: the policy's own sample. Those of the batch kept would be
    # biased towards groups of mixed results (accuracy near 50%), so later rounds' are not logged.
    metrics = score(first.groups)
    clock.lap("rewards")
    groups, stats, cursor, seconds, rounds = list(first.groups), list(first.stats), first.cursor, first.seconds, 1
    while rounds < max_rounds:
        kept = sum(has_signal(g.rewards) for g in groups)
        if kept >= want:
            break
        more = source.more(step, prompts_to_draw(want - kept, kept, len(groups), want), rounds)
        clock.lap("generate")
        later = score(more.groups)
        clock.lap("rewards")
        if "reward/workers_replaced" in later:  # a running count: the last round's is the step's
            metrics["reward/workers_replaced"] = later["reward/workers_replaced"]
        groups += more.groups
        stats += more.stats
        cursor, seconds, rounds = more.cursor, seconds + more.seconds, rounds + 1
    chosen, topped_up = select_groups([g.rewards for g in groups], want)
    dropped = sum(not has_signal(g.rewards) for g in groups)
    metrics.update({"dynamic/dropped_group_frac": dropped / len(groups), "dynamic/extra_prompts": len(groups) - want,
                    "dynamic/rounds": rounds, "dynamic/topped_up": topped_up})
    return StepRollouts([groups[i] for i in chosen], stats, cursor, first_round=list(first.groups),
                        generate_seconds=seconds), metrics
