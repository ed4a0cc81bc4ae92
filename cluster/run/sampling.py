"""Where a step's groups come from under DAPO's dynamic sampling (Yu et al. 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale"), `algo.dynamic_sampling`: after the step's own prompts are generated and
scored, groups without signal (all rewards equal, after the overlong shaping) are dropped and more prompts are drawn,
generated and scored, until rollout.prompts_per_step groups with signal are in hand or `algo.dynamic_sampling_rounds`
rounds (the first included) have run. How many prompts a round draws and which groups the batch keeps is the
objective's policy (learner/objective/groups.py); this module runs the rounds against the generators and rewards.
The rewards decide which groups stay, so they are in before the reference sees the batch (cluster/run/step_data.py).
"""
from __future__ import annotations

from collections.abc import Callable

from qgrpo.cluster.run.rewarding import Scored
from qgrpo.cluster.run.supply import RolloutSupply, StepRollouts
from qgrpo.core.records import GroupRollout
from qgrpo.learner.objective.groups import has_signal, prompts_to_draw, select_groups


def dynamic_rollouts(supply: RolloutSupply, score: Callable[[list[GroupRollout]], Scored], want: int, max_rounds: int,
                     step: int, clock) -> tuple[StepRollouts, dict]:
    """Step `step`'s rollouts under dynamic sampling: `want` groups (the rollout.prompts_per_step), those with
    signal first, from at most `max_rounds` rounds of generation. `supply`: the run's (cluster/run/supply.py);
    `score(groups)` returns them with their rewards (shaped) and their reward metrics; `clock` the step's
    StageClock (laps "generate" and "rewards" add up over the rounds).

    Returns the rollouts, scored (`cursor`: after every prompt drawn this step; `stats`: every round's generations),
    and the metrics: the reward metrics of the FIRST round only, the step's own fresh sample of the policy (the batch
    kept is biased towards groups with mixed results, so its accuracy would read near 50% whatever the policy does),
    and `dynamic/dropped_group_frac`, `dynamic/extra_prompts`, `dynamic/rounds`, `dynamic/topped_up`."""
    first = supply.take(step)
    clock.lap("generate")
    # The step's reward metrics are this first round's: the policy's own sample. Those of the batch kept would be
    # biased towards groups of mixed results (accuracy near 50%), so later rounds' are not logged.
    scored = score(first.groups)
    metrics, first_groups = dict(scored.metrics), scored.groups
    clock.lap("rewards")
    groups, stats, cursor, seconds, rounds = list(first_groups), list(first.stats), first.cursor, first.seconds, 1
    while rounds < max_rounds:
        kept = sum(has_signal(g.rewards) for g in groups)
        if kept >= want:
            break
        more = supply.more(step, prompts_to_draw(want - kept, kept, len(groups), want), rounds)
        clock.lap("generate")
        later = score(more.groups)
        clock.lap("rewards")
        if "reward/workers_replaced" in later.metrics:  # a running count: the last round's is the step's
            metrics["reward/workers_replaced"] = later.metrics["reward/workers_replaced"]
        groups += later.groups
        stats += more.stats
        cursor, seconds, rounds = more.cursor, seconds + more.seconds, rounds + 1
    chosen, topped_up = select_groups([g.rewards for g in groups], want)
    dropped = sum(not has_signal(g.rewards) for g in groups)
    metrics.update({"dynamic/dropped_group_frac": dropped / len(groups), "dynamic/extra_prompts": len(groups) - want,
                    "dynamic/rounds": rounds, "dynamic/topped_up": topped_up})
    return StepRollouts([groups[i] for i in chosen], stats, cursor, first_round=first_groups,
                        generate_seconds=seconds), metrics
