"""The policy-gradient term of the loss: a registry of policy losses, `algo.policy_loss` naming one (no torch import
at module level: the terms use tensor methods, so the config can list the losses without loading torch).

A policy loss is one function and one registry entry with its own parameters dataclass:

    @dataclass(frozen=True)
    class MyParams:
        scale: float = knob(1.0, "What scale does.", gt=0)

    @register_loss("mine", MyParams, summary="what it is, after whom")
    def mine_term(logp, old, adv, m, p: MyParams) -> tuple[Tensor, Tensor, Tensor]: ...

and [algo] gains `policy_loss = "mine"` and `mine_scale` (the prefix is the loss's name and "_" unless given), with
`--set` and the config reference, because cluster/config/training.py generates [algo] from this registry. Add its
paragraph to docs/algorithms.md.

Every term takes, on the completion tokens of a batch:
    logp [B, T]  log pi_theta (carries the gradient), old [B, T]  log pi_old, adv [B, 1], m [B, T] bool (tokens),
    p  its parameters,
with logp and old already 0 at masked positions (learner/objective/loss.py zeroes them), and returns
    (per-token loss [B, T], clipped_low [B, T] bool, clipped_high [B, T] bool),
the loss before the sampler correction, the KL term and the aggregation weights, which loss.py applies alike to all.
rho = pi_theta / pi_old is exactly 1 on the first pass over a batch (pi_old is the policy the batch arrives at), so
with algo.updates_per_batch = 1 and no overlap every term below has the gradient of plain GRPO, -A grad log pi
(tests/test_objectives.py checks it); they part ways once the policy moves away from pi_old within a batch.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qgrpo.learner.objective.knobs import knob, knobs

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss: its term, its parameters' dataclass and where they sit in [algo]."""

    name: str
    term: Callable[..., tuple]  # (logp, old, adv, m, params) -> (loss, clipped_low, clipped_high)
    params: type  # a frozen dataclass whose fields are declared with `knob`
    prefix: str  # [algo] key of parameter F: prefix + F
    summary: str  # one line for the reference: what it is
    loss_agg: str | None = None  # the aggregation it is defined with (a config rule holds [algo].loss_agg to it)


LOSSES: dict[str, PolicyLoss] = {}
_VERSION = [0]  # bumped by every (un)registration: the config regenerates [algo] when it changes


def version() -> int:
    """A number that changes whenever a loss is registered or removed."""
    return _VERSION[0]


def loss_keys() -> dict[str, tuple[PolicyLoss, dataclasses.Field]]:
    """Every [algo] key a registered loss declares -> (the first loss declaring it, its field)."""
    keys: dict[str, tuple[PolicyLoss, dataclasses.Field]] = {}
    for spec in LOSSES.values():
        for f in knobs(spec.params):
            keys.setdefault(spec.prefix + f.name, (spec, f))
    return keys


def register_loss(name: str, params: type, *, summary: str, prefix: str | None = None,
                  loss_agg: str | None = None) -> Callable[[Callable], Callable]:
    """Decorator: register `term` as policy loss `name` with its parameters' dataclass `params` (fields declared with
    `knob`), whose field F is the [algo] key `prefix + F` (prefix: `name + "_"` unless given). Two losses may share a
    parameters dataclass (and prefix); a key declared twice with different meanings is refused."""
    key_prefix = f"{name}_" if prefix is None else prefix

    def add(term: Callable) -> Callable:
        if name in LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        if not dataclasses.is_dataclass(params) or not all("doc" in f.metadata for f in dataclasses.fields(params)):
            raise TypeError(f"policy loss {name!r}: params must be a dataclass whose fields are declared with knob()")
        taken = loss_keys()
        for f in knobs(params):
            other = taken.get(key_prefix + f.name)
            if other is not None and other[0].params is not params:
                raise ValueError(f"policy loss {name!r}: [algo] key {key_prefix + f.name!r} is already "
                                 f"{other[0].name!r}'s; give its parameters another prefix")
        LOSSES[name] = PolicyLoss(name, term, params, key_prefix, " ".join(summary.split()), loss_agg)
        _VERSION[0] += 1
        return term

    return add


def unregister_loss(name: str) -> None:
    """Remove a registered loss (a test's own)."""
    del LOSSES[name]
    _VERSION[0] += 1


def policy_term(name: str, logp: Tensor, old: Tensor, adv: Tensor, m: Tensor, params: Any) -> tuple:
    """The term of the registered loss `name` with its parameters."""
    return LOSSES[name].term(logp, old, adv, m, params)


@dataclass(frozen=True)
class Clip:
    """The clip range of PPO's surrogate, shared by "grpo" and "gspo"."""

    low: float = knob(0.2, """eps_low of the clipped surrogate (the ratio floor is 1 - clip_low); at most clip_high.
        GSPO's paper uses 3e-4.""", ge=0, lt=1)
    high: float = knob(0.2, "eps_high of the clipped surrogate (DAPO's clip-higher uses 0.28; GSPO's paper 4e-4).",
                       ge=0)


@dataclass(frozen=True)
class CISPOParams:
    cap: float = knob(5.0, """policy_loss = "cispo": the cap eps_max of its stop-gradient weight min(pi_theta/pi_old,
        cap) (ScaleRL: 5).""", ge=1, why="the weight min(ratio, cap) must be able to reach 1")


@dataclass(frozen=True)
class SAPOParams:
    tau_pos: float = knob(1.0, """policy_loss = "sapo": the gate's temperature for tokens of positive advantage (SAPO's
        paper: 1.0).""", gt=0)
    tau_neg: float = knob(1.05, """policy_loss = "sapo": the gate's temperature for tokens of zero or negative advantage
        (SAPO's paper: 1.05).""", gt=0)


@register_loss("grpo", Clip, prefix="clip_", summary="""PPO/GRPO's clip of each token's ratio pi_theta/pi_old
    (DeepSeekMath; DAPO's clip-higher when clip_high > clip_low)""")
def grpo_term(logp: Tensor, old: Tensor, adv: Tensor, m: Tensor, p: Clip) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's clipped surrogate on each token's ratio (DeepSeekMath GRPO; DAPO's clip-higher when clip_high >
    clip_low):

        rho_t = exp(logp_t - old_t);   loss_t = -min(rho_t A, clip(rho_t, 1 - clip_low, 1 + clip_high) A)

    clipped_low: tokens with A < 0 whose ratio fell below 1 - clip_low; clipped_high: A > 0 and above 1 + clip_high
    (where the clip takes the gradient away)."""
    rho = (logp - old).exp()
    lo, hi = 1.0 - p.low, 1.0 + p.high
    loss = -(rho * adv).minimum(rho.clamp(lo, hi) * adv)
    rho_d = rho.detach()
    return loss, m & (rho_d < lo) & (adv < 0), m & (rho_d > hi) & (adv > 0)


@register_loss("gspo", Clip, prefix="clip_", loss_agg="seq_mean", summary="""GSPO: the clip acts on the sequence's
    geometric-mean ratio; needs loss_agg = "seq_mean" """)
def gspo_term(logp: Tensor, old: Tensor, adv: Tensor, m: Tensor, p: Clip) -> tuple[Tensor, Tensor, Tensor]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): one ratio per sequence, the geometric mean of
    its tokens' ratios, clipped as in PPO:

        s_i    = exp( (1/|y_i|) sum_t (logp_t - old_t) )
        loss_i = -min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)

    loss_i is put on every token of sequence i (the gradient reaches each token through the mean), so the sequence
    average of GSPO's objective is loss_agg = "seq_mean" (registered as its aggregation: a config rule). The paper
    clips at 3e-4 / 4e-4: a mean of log-ratios moves far less than one token's. Clipped flags mark every token of a
    clipped sequence."""
    lens = m.sum(dim=1, keepdim=True).clamp(min=1)
    s = ((logp - old).where(m, 0.0).sum(dim=1, keepdim=True) / lens).exp()  # [B, 1]
    lo, hi = 1.0 - p.low, 1.0 + p.high
    loss = (-(s * adv).minimum(s.clamp(lo, hi) * adv)).expand_as(logp)
    s_d = s.detach()
    return loss, m & (s_d < lo) & (adv < 0), m & (s_d > hi) & (adv > 0)


@register_loss("cispo", CISPOParams, summary="""CISPO: -sg(min(ratio, cispo_cap)) A log pi, every token keeps a
    gradient""")
def cispo_term(logp: Tensor, old: Tensor, adv: Tensor, m: Tensor, p: CISPOParams) -> tuple[Tensor, Tensor, Tensor]:
    """CISPO (MiniMax-M1, 2025; as in ScaleRL and TRL): REINFORCE with a clipped, stop-gradient importance weight,
    so no token loses its gradient to the clip (PPO's clip zeroes it):

        loss_t = -sg(min(rho_t, cap)) A log pi_theta(y_t),   rho_t = exp(logp_t - old_t)

    Its value is not PPO's surrogate (it is -w A log pi); its gradient is -min(rho_t, cap) A grad log pi. clipped_high:
    tokens whose ratio passed the cap, whatever the sign of A; nothing is clipped below."""
    rho = (logp - old).exp().detach()
    loss = -rho.clamp(max=p.cap) * adv * logp
    return loss, m.new_zeros(m.shape), m & (rho > p.cap)


@register_loss("sapo", SAPOParams, summary="""SAPO: a soft sigmoid gate instead of the hard clip; under the default
    loss_agg = "token_mean" its sequences weigh by their length, "seq_mean" is the paper's per-sequence mean""")
def sapo_term(logp: Tensor, old: Tensor, adv: Tensor, m: Tensor, p: SAPOParams) -> tuple[Tensor, Tensor, Tensor]:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization"): PPO's hard clip replaced by a soft gate,

        f(rho) = sigmoid(tau (rho - 1)) * 4 / tau,   loss_t = -f(rho_t) A,   tau = tau_pos if A > 0 else tau_neg

    f'(1) = 1, so at rho = 1 the gradient is GRPO's; away from 1 it fades smoothly (f'(rho) = 4 sigma (1 - sigma)),
    faster for negative advantages (tau_neg > tau_pos). No token is clipped outright: both flags are all False."""
    rho = (logp - old).exp()
    tau = adv.new_full(adv.shape, p.tau_neg).masked_fill(adv > 0, p.tau_pos)
    loss = -(tau * (rho - 1.0)).sigmoid() * (4.0 / tau) * adv
    none = m.new_zeros(m.shape)
    return loss, none, none
