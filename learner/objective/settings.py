"""The objective's settings (plain Python, no torch): one record, `ObjectiveSettings`, whose knobs are the [algo]
section of a config. Each knob declares here, once, its default, its bounds or allowed values and its description;
cluster/config/training.py generates the [algo] section from these declarations and from every registered policy
loss's parameters (learner/objective/losses.py), so [algo], `--set algo.KEY=...` and docs/reference/config.md follow
the code without a second copy. Values are validated once, by the config; the learner takes them as given.

`objective_settings(**keys)` builds the record from [algo]'s flat keys (a validated config's section, or a test's
keywords): the shared knobs by name, the chosen policy loss's parameters from their prefixed keys (`cispo_cap` is
CISPO's `cap`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from qgrpo.learner.objective.knobs import REGISTERED, knob, knobs
from qgrpo.learner.objective.losses import LOSSES, PolicyLoss, loss_keys
from qgrpo.learner.objective.options import AGGREGATIONS, IS_CAP_MIN, IS_LEVELS, IS_MODES, KL_ESTIMATORS, SCALES


@dataclass(frozen=True)
class ObjectiveSettings:
    """[algo]: what is optimised, from group advantages to the loss's aggregation, and how stale its data may be."""

    # Advantages and what enters them (learner/objective/advantages.py, shaping.py, groups.py)
    advantage_scale: str = knob("std", """"std" (GRPO: rewards minus the group mean, over the group's std) or "none"
        (Dr. GRPO: no std scaling).""", choices=SCALES, template="must be {quoted}")
    overlong_buffer: int = knob(0, """DAPO's overlong reward shaping: completions within this many tokens of
        rollout.max_new_tokens lose up to overlong_penalty, linearly in how far into the buffer they ran (0 = off).""",
                                ge=0, why="0 = off")
    overlong_penalty: float = knob(1.0, "The penalty of a completion that reached rollout.max_new_tokens under "
                                   "overlong_buffer (DAPO: 1).", gt=0)
    overlong_filter: bool = knob(False, """DAPO's overlong filtering: completions cut at rollout.max_new_tokens (finish
        reason "length") are left out of the loss (TRL's mask_truncated_completions).""")
    dynamic_sampling: bool = knob(False, """DAPO's dynamic sampling: groups whose rewards are all equal (no learning
        signal) are dropped and more prompts are generated until the batch has rollout.prompts_per_step groups with
        signal, at most dynamic_sampling_rounds generation rounds per step.""")
    dynamic_sampling_rounds: int = knob(3, """The most generation rounds of a step under dynamic_sampling, its first
        included. When they run out the batch is filled with dropped groups (advantage 0: they add only the KL term),
        so every step has the same size.""", ge=2, why="the first round is the step's own prompts")
    # The policy term (learner/objective/losses.py): its parameters are the registered loss's own
    policy_loss: str = knob("grpo", "The policy-gradient term (docs/algorithms.md).", choices=REGISTERED)
    # The KL to the reference
    kl_coeff: float = knob(0.005, "Weight of the KL-to-reference term; 0 disables the reference actor.", ge=0)
    kl_estimator: str = knob("k3", """Per-token estimate of KL(pi_theta || ref): k1 (unbiased), k2 (low variance) or k3
        (unbiased, >= 0).""", choices=KL_ESTIMATORS)
    kl_bias_correction: bool = knob(False, """Multiply the per-token KL estimate by pi_theta/pi_old (DeepSeek-V3.2;
        TRL's use_bias_correction_kl), so it estimates the KL of the policy being trained, not of the one that
        sampled. Needs kl_coeff > 0.""")
    # Aggregation (learner/objective/loss.py: aggregation_weights)
    loss_agg: str = knob("token_mean", """How token losses add up: token_mean (DAPO), seq_mean (GRPO) or constant (Dr.
        GRPO).""", choices=AGGREGATIONS)
    # The sampler correction and masks (learner/objective/corrections.py)
    is_level: str = knob("token", """Where the sampler correction r = pi_old/mu is taken: "token" (each token's own r),
        "sequence" (the product of the sequence's r: TRL's sequence_* modes) or "geometric" (the product's geometric
        mean, exp(mean log r): verl's Geo-RS with is_mode = "reject").""", choices=IS_LEVELS)
    is_mode: str = knob("truncate", """What the bounds [is_floor, is_cap] do to r: "truncate" (weight clamp(r,
        is_floor, is_cap): TIS), "mask" (weight r inside the bounds, 0 outside: TRL's *_mask, IcePop), "reject"
        (weight 1 inside, 0 outside: rejection sampling, Geo-RS) or "none" (weight 1: mu is taken as pi_old).""",
                        choices=IS_MODES)
    is_cap: float = knob(2.0, "C, the upper bound of r (inf = none). TIS: 2; TRL's default (sequence mask): 3; "
                         "IcePop: 5.", ge=IS_CAP_MIN, why="C in min(pi_old/mu, C); [is_floor, C] must contain 1")
    is_floor: float = knob(0.0, "The lower bound of r (0 = none). IcePop: 0.5.", ge=0, le=1,
                           why="[is_floor, is_cap] must contain 1")
    offpolicy_mask_kl: float = knob(0.0, """DeepSeek-V3.2's off-policy sequence masking: drop each sequence of negative
        advantage whose mean per-token log(mu/pi_theta) is above this (0 = off; DeepSeek and TRL suggest values such
        as 0.5).""", ge=0, why="0 = off")
    m2_threshold: float = knob(0.0, """M2PO's second-moment mask, for stale rollouts (max_staleness, overlap,
        update_every > 1): while the mean of (log pi_old/mu)^2 over a micro-batch's completion tokens is above this,
        the tokens of largest (log pi_old/mu)^2 are left out of the policy term, on top of the is_mode correction
        (0 = off; AReaL's M2PO example uses 0.04).""", ge=0, why="0 = off")
    entropy_coeff: float = knob(0.0, """Entropy bonus: subtract coeff x the policy's token entropy, aggregated as
        loss_agg over every completion token (with top_entropy_quantile < 1: the top-entropy tokens only), from the
        loss. No other mask touches it (offpolicy_mask_kl, m2_threshold and the sampler correction weigh the policy
        term only).""", ge=0)
    top_entropy_quantile: float = knob(1.0, """Train the policy term on the highest-entropy tokens only: the top q of
        each micro-batch's completion tokens by entropy (1 = every token; "Beyond the 80/20 rule" uses 0.2). The KL
        term still covers every token.""", gt=0, le=1)
    # How stale the data may be (learner/objective/staleness.py, the learner's updates)
    update_every: int = knob(1, "Generators get new weights every N learner steps (1 = on-policy up to quantization).",
                             ge=1, why="1 = sync after every step")
    updates_per_batch: int = knob(1, "Optimizer updates on each batch (> 1 makes the clip matter).", ge=1)
    overlap: bool = knob(False, """One-step-off-policy, an alias: max_staleness = 1 with step k+1's prompts drawn
        when the learner takes step k, so they are generated while it trains on step k, by weights one update behind
        (a sync in flight reaches them between two decode steps). Corrected by the importance weights (is_mode);
        staleness is recorded per token. Pays off when generators and learner have their own devices or nodes.""")
    max_staleness: int = knob(0, """Asynchronous rollouts (cluster/run/supply.py): the rollout actors generate
        continuously, up to this many weight syncs ahead of the learner, which trains on each step's groups as soon
        as they are in. 0 = synchronous (each step's rollouts are generated after the previous step's sync). A group
        is never trained on more than max_staleness syncs after the weights that sampled it; the importance weights
        (is_mode) correct for it as they do for quantization.""", ge=0, why="0 = synchronous")
    # The chosen policy loss's parameters (an instance of its registered dataclass; None: its defaults)
    params: Any = None

    @property
    def loss(self) -> PolicyLoss:
        """The registered policy loss named by policy_loss."""
        if self.policy_loss not in LOSSES:
            raise ValueError(f"policy_loss must be one of {tuple(LOSSES)}, got {self.policy_loss!r}")
        return LOSSES[self.policy_loss]

    @property
    def loss_params(self) -> Any:
        """The policy loss's parameters: `params`, or its dataclass's defaults."""
        return self.params if self.params is not None else self.loss.params()

    @property
    def needs_entropy(self) -> bool:
        """Whether the loss itself reads the per-token entropy (it is logged either way when given)."""
        return self.entropy_coeff > 0 or self.top_entropy_quantile < 1.0


SHARED = tuple(f.name for f in knobs(ObjectiveSettings))


def objective_settings(**keys: Any) -> ObjectiveSettings:
    """The record from [algo]'s flat keys (any subset; the rest take their defaults). Keys of registered losses other
    than the chosen one are accepted and not used, as [algo] holds them all. Raises TypeError for a key no knob and no
    registered loss declares, ValueError for an unregistered policy_loss."""
    extra = set(keys) - set(SHARED) - set(loss_keys())
    if extra:
        raise TypeError(f"unknown [algo] keys {sorted(extra)}: not a knob of ObjectiveSettings nor a parameter of a "
                        f"registered policy loss ({', '.join(LOSSES)})")
    settings = ObjectiveSettings(**{k: v for k, v in keys.items() if k in SHARED})
    spec = settings.loss
    given = {f.name: keys[spec.prefix + f.name] for f in knobs(spec.params) if spec.prefix + f.name in keys}
    return dataclasses.replace(settings, params=spec.params(**given))
