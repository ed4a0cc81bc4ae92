"""Each step's data, built once, as values: rollouts -> scored rollouts -> train batch.

    rollouts  the step's groups from the run's rollout supply (cluster/run/supply.py), or the rounds of DAPO's
              dynamic sampling asked of it (cluster/run/sampling.py); with a handle on their rewards
    scored    the groups with their rewards (shaped by algo.overlong_buffer) and the reward metrics
    batch     the packed tokens, the reference's log-probs, the advantages (algo.advantage_scale) and the truncated
              completions left out (algo.overlong_filter): the learner's TrainBatch, made once

Nothing is changed in place: each stage returns new records (cluster/run/rewarding.py's Scored,
learner/objective's shape_groups and with_advantages, learner/batch.py's PackedRollouts). The reward workers score
the completions while the driver packs them and the reference scores them (their tokens do not depend on the
rewards); the advantages follow once the rewards are back. Under dynamic sampling the rewards decide which groups
stay, so they are in before the reference sees the batch, through the same path.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from qgrpo.cluster.run.rewarding import Scored
from qgrpo.cluster.run.sampling import dynamic_rollouts
from qgrpo.cluster.run.supply import StepRollouts
from qgrpo.learner.batch import TrainBatch, advantages_of, pack_rollouts
from qgrpo.learner.objective.advantages import with_advantages
from qgrpo.learner.objective.shaping import shape_groups, truncated

PAD_ID = 0  # right padding is never attended to (causal attention), so any valid id will do


@dataclass(frozen=True)
class StepData:
    """What one step trains on and reports."""

    rollouts: StepRollouts  # the groups trained on (rewards and advantages in), the step's fresh sample, its stats
    batch: TrainBatch
    reward_metrics: dict  # of the step's fresh sample (dynamic sampling: its first round), and the filter's


class Scoring:
    """Step `step`'s rewards (1-based): the reward pool's (`pool.submit(groups, step).result()` -> Scored), shaped
    by algo.overlong_buffer. `submit` returns at once; `result()` waits."""

    def __init__(self, pool, cfg, step: int):
        self.pool, self.max_new_tokens, self.algo, self.step = pool, cfg.rollout.max_new_tokens, cfg.algo, step

    def submit(self, groups) -> "Scoring.Pending":
        return Scoring.Pending(self, self.pool.submit(groups, self.step))

    def __call__(self, groups) -> Scored:
        return self.submit(groups).result()

    class Pending:
        def __init__(self, scoring: "Scoring", pending):
            self.scoring, self.pending = scoring, pending

        def result(self) -> Scored:
            scored, s = self.pending.result(), self.scoring
            groups, shaping = shape_groups(scored.groups, s.max_new_tokens, s.algo.overlong_buffer,
                                           s.algo.overlong_penalty)
            return Scored(groups, {**scored.metrics, **shaping})


@dataclass(frozen=True)
class _Done:
    scored: Scored

    def result(self) -> Scored:
        return self.scored


def step_rollouts(run, step: int, clock) -> tuple[StepRollouts, object]:
    """Where step `step`'s groups come from, and a handle whose `result()` is their Scored: the step's own prompts
    with their rewards in flight, or (algo.dynamic_sampling) the groups kept from the rounds, already scored."""
    cfg, scoring = run.cfg, Scoring(run.rewards, run.cfg, step + 1)
    if cfg.algo.dynamic_sampling:
        rollouts, metrics = dynamic_rollouts(run.supply, scoring, cfg.rollout.prompts_per_step,
                                             cfg.algo.dynamic_sampling_rounds, step, clock)
        return rollouts, _Done(Scored(rollouts.groups, metrics))
    rollouts = run.supply.take(step)
    clock.lap("generate")
    return rollouts, scoring.submit(rollouts.groups)


def step_data(run, step: int, clock) -> StepData:
    """Step `step`'s rollouts, scored, and its train batch (`run`: the driver's TrainingRun: cfg, supply, rewards,
    workers). Laps of `clock`: generate, rewards (dynamic sampling: per round), pack, reference, then rewards again
    for the wait on the rewards and the advantages."""
    algo = run.cfg.algo
    rollouts, rewards = step_rollouts(run, step, clock)
    packed = pack_rollouts(rollouts.groups, PAD_ID, run.cfg.rollout.max_new_tokens)
    clock.lap("pack")
    ref_logp = run.workers.reference_logprobs(packed) if run.workers.reference is not None else None
    clock.lap("reference")
    scored = rewards.result()
    groups, metrics = with_advantages(scored.groups, algo.advantage_scale), dict(scored.metrics)
    if algo.overlong_filter:
        cut = truncated(groups)
        packed = packed.without(cut)
        metrics["overlong/filtered_frac"] = sum(cut) / len(cut)
    batch = packed.train_batch(advantages_of(groups), ref_logp)
    clock.lap("rewards")
    return StepData(dataclasses.replace(rollouts, groups=groups), batch, metrics)
