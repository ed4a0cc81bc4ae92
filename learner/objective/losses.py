"""The policy-gradient term of the loss, one function per `algo.policy_loss` (pure torch; no heavy imports).

Every function takes, on the completion tokens of a batch:
    logp [B, T]  log pi_theta (carries the gradient), old [B, T]  log pi_old, adv [B, 1], m [B, T] bool (tokens),
with logp and old already 0 at masked positions (learner/loss.py zeroes them), and returns
    (per-token loss [B, T], clipped_low [B, T] bool, clipped_high [B, T] bool),
the loss before the sampler correction, the KL term and the aggregation weights, which loss.py applies alike to all.
rho = pi_theta / pi_old is exactly 1 on the first pass over a batch (pi_old is the policy the batch arrives at), so
with algo.updates_per_batch = 1 and no overlap every term below has the gradient of plain GRPO, -A grad log pi
(tests/test_objectives.py checks it); they part ways once the policy moves away from pi_old within a batch.
"""
from __future__ import annotations

import torch
from torch import Tensor


def grpo_term(logp: Tensor, old: Tensor, adv: Tensor, m: Tensor, clip_low: float,
              clip_high: float) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's clipped surrogate on each token's ratio (DeepSeekMath GRPO; DAPO's clip-higher when clip_high >
    clip_low):

        rho_t = exp(logp_t - old_t);   loss_t = -min(rho_t A, clip(rho_t, 1 - clip_low, 1 + clip_high) A)

    clipped_low: tokens with A < 0 whose ratio fell below 1 - clip_low; clipped_high: A > 0 and above 1 + clip_high
    (where the clip takes the gradient away)."""
    rho = torch.exp(logp - old)
    lo, hi = 1.0 - clip_low, 1.0 + clip_high
    loss = -torch.minimum(rho * adv, rho.clamp(lo, hi) * adv)
    rho_d = rho.detach()
    return loss, m & (rho_d < lo) & (adv < 0), m & (rho_d > hi) & (adv > 0)


def gspo_term(logp: Tensor, old: Tensor, adv: Tensor, m: Tensor, clip_low: float,
              clip_high: float) -> tuple[Tensor, Tensor, Tensor]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): one ratio per sequence, the geometric mean of
    its tokens' ratios, clipped as in PPO:

        s_i    = exp( (1/|y_i|) sum_t (logp_t - old_t) )
        loss_i = -min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)

    loss_i is put on every token of sequence i (the gradient reaches each token through the mean), so the sequence
    average of GSPO's objective is loss_agg = "seq_mean" (a config rule). The paper clips at 3e-4 / 4e-4: a mean of
    log-ratios moves far less than one token's. Clipped flags mark every token of a clipped sequence."""
    lens = m.sum(dim=1, keepdim=True).clamp(min=1)
    s = torch.exp(torch.where(m, logp - old, 0.0).sum(dim=1, keepdim=True) / lens)  # [B, 1]
    lo, hi = 1.0 - clip_low, 1.0 + clip_high
    loss = (-torch.minimum(s * adv, s.clamp(lo, hi) * adv)).expand_as(logp)
    s_d = s.detach()
    return loss, m & (s_d < lo) & (adv < 0), m & (s_d > hi) & (adv > 0)


def cispo_term(logp: Tensor, old: Tensor, adv: Tensor, m: Tensor, cap: float) -> tuple[Tensor, Tensor, Tensor]:
    """CISPO (MiniMax-M1, 2025; as in ScaleRL and TRL): REINFORCE with a clipped, stop-gradient importance weight,
    so no token loses its gradient to the clip (PPO's clip zeroes it):

        loss_t = -sg(min(rho_t, cap)) A log pi_theta(y_t),   rho_t = exp(logp_t - old_t)

    Its value is not PPO's surrogate (it is -w A log pi); its gradient is -min(rho_t, cap) A grad log pi. clipped_high:
    tokens whose ratio passed the cap, whatever the sign of A; nothing is clipped below."""
    rho = torch.exp(logp - old).detach()
    loss = -rho.clamp(max=cap) * adv * logp
    return loss, torch.zeros_like(m), m & (rho > cap)


def sapo_term(logp: Tensor, old: Tensor, adv: Tensor, m: Tensor, tau_pos: float,
              tau_neg: float) -> tuple[Tensor, Tensor, Tensor]:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization"): PPO's hard clip replaced by a soft gate,

        f(rho) = sigmoid(tau (rho - 1)) * 4 / tau,   loss_t = -f(rho_t) A,   tau = tau_pos if A > 0 else tau_neg

    f'(1) = 1, so at rho = 1 the gradient is GRPO's; away from 1 it fades smoothly (f'(rho) = 4 sigma (1 - sigma)),
    faster for negative advantages (tau_neg > tau_pos). No token is clipped outright: both flags are all False."""
    rho = torch.exp(logp - old)
    tau = torch.where(adv > 0, tau_pos, tau_neg)
    loss = -torch.sigmoid(tau * (rho - 1.0)) * (4.0 / tau) * adv
    none = torch.zeros_like(m)
    return loss, none, none


def policy_term(name: str, logp: Tensor, old: Tensor, adv: Tensor, m: Tensor, cfg) -> tuple[Tensor, Tensor, Tensor]:
    """The term `name` (algo.policy_loss) with its settings from `cfg` (learner.loss.GRPOLossConfig)."""
    if name == "gspo":
        return gspo_term(logp, old, adv, m, cfg.clip_low, cfg.clip_high)
    if name == "cispo":
        return cispo_term(logp, old, adv, m, cfg.cispo_cap)
    if name == "sapo":
        return sapo_term(logp, old, adv, m, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    return grpo_term(logp, old, adv, m, cfg.clip_low, cfg.clip_high)
