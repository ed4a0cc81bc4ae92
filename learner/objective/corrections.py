"""Corrections and masks applied to the policy term (pure torch; no heavy imports): the sampler/learner mismatch
weight, M2PO's second-moment token mask, DeepSeek-V3.2's off-policy sequence mask, and the top-entropy token mask. All
are detached: they scale or drop tokens' gradients, they never carry one.

Inputs are [B, T] float32 with masked positions already 0 (learner/objective/loss.py zeroes them) and `m` [B, T] bool.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# A sequence-level log-ratio is a sum over tokens: clamp it so that exp() stays finite in float32 (exp(80) ~ 5.5e34)
# and 0 * inf can never make NaN; a ratio that far out is truncated or masked by any bound anyway.
LOG_RATIO_BOUND = 80.0


@dataclass
class SamplerWeights:
    """What `sampler_weights` decided: the weight of each token, and which tokens and sequences it changed."""

    weight: Tensor  # [B, T] float32: multiplies the policy term of each token (0 at masked positions)
    truncated: Tensor  # [B, T] bool: tokens whose weight was clamped to a bound ("truncate")
    masked: Tensor  # [B, T] bool: tokens whose weight is 0 because r fell outside the bounds ("mask", "reject")
    units: Tensor  # [N] float32: the weights of the units they are taken on (tokens, or one per sequence): for the ESS


def log_ratios(old: Tensor, mu: Tensor, m: Tensor, level: str) -> Tensor:
    """log r at `level`, [B, T] (a sequence's value repeated on its tokens), r = pi_old / mu:

        token:      log r_t = old_t - mu_t
        sequence:   sum_t log r_t          (r = prod_t r_t: TRL's sequence_truncate / sequence_mask)
        geometric:  (1/|y|) sum_t log r_t  (r = the geometric mean of the r_t: verl's Geo-RS)
    """
    lr = torch.where(m, old - mu, 0.0)
    if level == "token":
        return lr
    total = lr.sum(dim=1, keepdim=True)
    if level == "geometric":
        total = total / m.sum(dim=1, keepdim=True).clamp(min=1)
    return total.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).expand_as(lr)


def sampler_weights(old: Tensor, mu: Tensor, m: Tensor, *, level: str, mode: str, cap: float,
                    floor: float) -> SamplerWeights:
    """The weight correcting for tokens sampled from mu (a quantized generator, or older weights) instead of pi_old:
    r at `level` (log_ratios), then, with the bounds [floor, cap] (floor 0: none; cap inf: none):

        truncate:  w = clamp(r, floor, cap)              truncated IS (FlashRL's TIS at the token level)
        mask:      w = r inside [floor, cap], else 0     masked IS (TRL's *_mask; IcePop: token, [0.5, 5])
        reject:    w = 1 inside [floor, cap], else 0     rejection sampling (verl's Geo-RS: geometric level)
        none:      w = 1                                 mu is taken as pi_old

    Float32 (or wider if given), detached; 0 at masked positions."""
    dtype = torch.promote_types(torch.promote_types(old.dtype, mu.dtype), torch.float32)
    lr = log_ratios(old.detach().to(dtype), mu.detach().to(dtype), m, level)
    r = torch.exp(lr.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    inside = (r >= floor) & (r <= cap)
    no = torch.zeros_like(m)
    if mode == "truncate":
        w, truncated, masked = r.clamp(min=floor, max=cap), m & ~inside, no
    elif mode == "mask":
        w, truncated, masked = torch.where(inside, r, 0.0), no, m & ~inside
    elif mode == "reject":
        w, truncated, masked = inside.to(dtype), no, m & ~inside
    else:
        w, truncated, masked = torch.ones_like(r), no, no
    # One weight per token, or per sequence (its value, repeated on every position before masking)
    units = w[m] if level == "token" else w[m.any(dim=1), 0]
    return SamplerWeights(torch.where(m, w, 0.0), truncated, masked, units)


def effective_sample_size(units: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(sum w, sum w^2, n) of the weights, to be added over micro-batches and ranks; the normalised effective sample
    size is then (sum w)^2 / (n sum w^2), in (0, 1]: 1 when every weight is equal, 1/n when one weight carries all
    (Kong's ESS, as verl reports it). A batch whose weights are all 0 has ESS 0."""
    u = units.detach().float()
    return u.sum(), (u * u).sum(), torch.tensor(float(u.numel()), device=u.device)


def second_moment_keep(old: Tensor, mu: Tensor, m: Tensor, threshold: float) -> Tensor:
    """M2PO's second-moment mask (Zheng et al. 2025, "Prosperity before Collapse", arXiv 2510.01161; AReaL's
    m2_threshold). With d_t = log r_t = log pi_old_t - log mu_t on the tokens of `m` (one micro-batch's), the second
    moment M2 = mean_t d_t^2 is brought within `threshold` by masking the tokens of largest d_t^2, as few as it takes:

        keep the k tokens of smallest d_t^2, k the largest with  (1/k) sum of those k values <= threshold

    so nothing is masked when M2 <= threshold already, and the kept tokens' M2 is <= threshold. Sorted ascending, the
    running mean of the values never decreases, so k is the length of its run at or below the threshold. Unlike a bound
    on each r_t (sampler_weights), how far one token may be off depends on the rest of the batch: only the outliers
    that carry the second moment are cut, and a batch that is stale throughout loses more.

    A token whose d_t is not finite counts as d_t^2 = inf: it is never kept, and the other tokens' decisions are those
    they would be without it. When even the smallest d_t^2 is above the threshold every token is masked. Computed in
    float64, ties broken by position (a stable sort), so the mask is the same on every run. Returns [B, T] bool, False
    off `m`."""
    d = old.detach().double() - mu.detach().double()
    sq = torch.where(torch.isfinite(d), d * d, torch.inf)[m]
    keep = torch.zeros_like(m)
    if sq.numel() == 0:
        return keep
    values, order = torch.sort(sq, stable=True)
    running = values.cumsum(0) / torch.arange(1, values.numel() + 1, device=values.device, dtype=values.dtype)
    k = int((running <= threshold).to(torch.int32).cumprod(0).sum())  # the leading run within it (one host sync)
    kept = torch.zeros_like(sq, dtype=torch.bool)
    kept[order[:k]] = True
    keep[m] = kept
    return keep


def offpolicy_sequence_keep(logp: Tensor, mu: Tensor, adv: Tensor, m: Tensor, threshold: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence masking (TRL's off_policy_mask_threshold): a sequence of negative
    advantage that the policy being trained has drifted far from is dropped,

        keep_i = A_i >= 0  or  (1/|y_i|) sum_t (log mu_t - log pi_theta_t) <= threshold,

    with log pi_theta detached: the drift is measured from the sampler mu, so quantization and staleness both count.
    Returns [B, 1] bool."""
    d = torch.where(m, mu.detach() - logp.detach(), 0.0).sum(dim=1, keepdim=True)
    kl = d / m.sum(dim=1, keepdim=True).clamp(min=1)
    return (adv >= 0) | (kl <= threshold)


def top_entropy_keep(entropy: Tensor, m: Tensor, quantile: float) -> Tensor:
    """The highest-entropy `quantile` of the tokens ("Beyond the 80/20 Rule", Wang et al. 2025; TRL's
    top_entropy_quantile): keep_t = H_t >= the (1 - quantile) quantile of H over the tokens of `m` (this micro-batch's).
    quantile = 1 keeps every token. Returns [B, T] bool, False off `m`."""
    if quantile >= 1.0:
        return m.clone()
    h = entropy.detach().float()
    values = h[m]
    if values.numel() == 0:
        return torch.zeros_like(m)
    return m & (h >= torch.quantile(values, 1.0 - quantile))
