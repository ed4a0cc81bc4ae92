"""GRPO loss with truncated importance sampling for quantized rollouts (pure torch; no heavy imports).

Shapes: every per-token tensor is [B, T] aligned with `input_ids[B, T]`: the value at position j is the log-prob
of token j given tokens < j. `mask` [B, T] is 1 on completion tokens and 0 on prompt and padding positions.
`advantages` is [B], one per sequence.

The loss, per completion token t of sequence i:

    rho_t   = exp(logp - old_logp)                                   pi_theta / pi_old
    w_t     = min(exp(old_logp - mu_logp), C)                         pi_old / mu, TIS (FlashRL); or mask / none
    surr_t  = -min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) A_i)    PPO/GRPO clip, DAPO clip-higher
    loss_t  = w_t surr_t + kl_coeff * KL_t                            KL_t: k1/k2/k3 estimate of KL(pi_theta || ref)
    loss    = sum_t loss_t * weight_t                                 weight_t from aggregation_weights()

The aggregation is a per-token weight so that micro-batches and data-parallel ranks, each given the *global*
counts, add up exactly to the loss of the whole batch.

Values at masked positions are never read: they are replaced by 0 before any arithmetic, so padding filled with
-inf or NaN (as some generators return for prompt positions) cannot leak NaN into the loss or its gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qgrpo.learner.options import AGGREGATIONS, IS_CAP_MIN, IS_MODES, KL_ESTIMATORS


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _check_cap(cap: float) -> None:
    if not cap >= IS_CAP_MIN:  # also rejects NaN; inf is allowed (untruncated IS)
        raise ValueError(f"is_cap must be >= {IS_CAP_MIN:g} (the ratio bound C; [1/C, C] must contain 1), got {cap!r}")


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Per-token sample estimate of KL(pi || ref), tokens sampled from pi (Schulman, "Approximating KL divergence").

    With d = ref_logp - logp:  k1 = -d  (unbiased, can be negative);  k2 = 0.5 d^2  (biased, low variance);
    k3 = exp(d) - d - 1  (unbiased, >= 0; the GRPO paper's choice). k3 uses expm1 for accuracy near d = 0.
    Returns [B, T] in the dtype of `logp`; gradient flows through both arguments as given.
    """
    _check_choice("kl_estimator", estimator, KL_ESTIMATORS)
    d = ref_logp - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    return torch.expm1(d) - d


def importance_weights(old_logp: Tensor, mu_logp: Tensor, *, mode: str, cap: float) -> Tensor:
    """Per-token weight correcting the sampler/learner mismatch, r = exp(old_logp - mu_logp) = pi_old / mu.

    truncate: min(r, cap)  (FlashRL truncated importance sampling, TIS);
    mask:     1.0 where 1/cap <= r <= cap, else 0.0  (drop tokens the sampler got badly wrong; no reweighting);
    none:     1.0 (treat mu as pi_old).
    Always detached (no gradient), float32 (or float64 if given), shape [B, T].
    """
    _check_choice("is_mode", mode, IS_MODES)
    _check_cap(cap)
    old = old_logp.detach()
    mu = mu_logp.detach()
    dtype = torch.promote_types(torch.promote_types(old.dtype, mu.dtype), torch.float32)
    r = torch.exp(old.to(dtype) - mu.to(dtype))
    if mode == "truncate":
        return r.clamp(max=cap)
    if mode == "mask":
        return ((r >= 1.0 / cap) & (r <= cap)).to(dtype)
    return torch.ones_like(r)


def aggregation_weights(
    mask: Tensor,
    mode: str,
    *,
    num_sequences: int | None = None,
    num_tokens: float | Tensor | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Per-token weights w [B, T] (float32) so that loss = (token_loss * w).sum() realises the aggregation.

    token_mean (DAPO):          w = mask / num_tokens                       every token counts the same
    seq_mean   (original GRPO): w = mask / (len_i * num_sequences)          mean over tokens, then over sequences
    constant   (Dr. GRPO):      w = mask / (num_sequences * max_len)        a fixed normaliser: no length bias

    len_i is the masked length of row i. num_sequences and num_tokens default to this batch's own counts (B and
    mask.sum()), max_len to T. Pass the global values (whole step, all ranks) so that micro-batches and
    data-parallel ranks add up exactly to the loss of the whole batch; for "constant" pass the maximum
    completion length, since T here also spans the prompt. num_tokens may be a tensor (e.g. an all-reduced count).
    Rows with zero length, and a batch with no tokens at all, get weight 0, never NaN.
    """
    _check_choice("aggregation", mode, AGGREGATIONS)
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D [B, T], got shape {tuple(mask.shape)}")
    B, T = mask.shape
    if num_sequences is None:
        num_sequences = B
    elif num_sequences < B:
        raise ValueError(f"num_sequences ({num_sequences}) is the global sequence count; it cannot be smaller "
                         f"than this micro-batch's {B} rows")
    if max_len is None:
        max_len = T
    elif max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if num_tokens is not None and not isinstance(num_tokens, Tensor) and not num_tokens >= 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens!r}")

    m = mask.to(torch.float32)
    if mode == "token_mean":
        total = m.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=torch.float32, device=m.device)
        # total is 0 only when there are no tokens, so every numerator is 0 too: divide by 1 instead.
        return m / torch.where(total > 0, total, torch.ones_like(total))
    if mode == "seq_mean":
        lens = m.sum(dim=1, keepdim=True)  # [B, 1]
        lens = torch.where(lens > 0, lens, torch.ones_like(lens))
        return m / (lens * max(num_sequences, 1))
    return m / (max(num_sequences, 1) * max_len)


@dataclass(frozen=True)
class GRPOLossConfig:
    """Knobs of grpo_loss. Invalid values raise one ValueError listing every problem."""

    clip_low: float = 0.2  # eps_low: ratio floor 1 - clip_low when A < 0
    clip_high: float = 0.2  # eps_high: ratio ceiling 1 + clip_high when A > 0 (DAPO clip-higher uses 0.28)
    kl_coeff: float = 0.0  # weight of the per-token KL(pi_theta || ref); 0 disables the term (still logged)
    kl_estimator: str = "k3"  # one of KL_ESTIMATORS
    is_mode: str = "truncate"  # one of IS_MODES: how pi_old / mu corrects the quantized sampler
    is_cap: float = 2.0  # C: truncate at C, or mask outside [1/C, C]

    def __post_init__(self) -> None:
        errors = []
        if not 0.0 <= self.clip_low < 1.0:
            errors.append(f"clip_low must be in [0, 1) so that 1 - clip_low > 0, got {self.clip_low!r}")
        if not self.clip_high >= 0.0:
            errors.append(f"clip_high must be >= 0, got {self.clip_high!r}")
        if not self.kl_coeff >= 0.0:
            errors.append(f"kl_coeff must be >= 0, got {self.kl_coeff!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            errors.append(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.is_mode not in IS_MODES:
            errors.append(f"is_mode must be one of {IS_MODES}, got {self.is_mode!r}")
        if not self.is_cap >= IS_CAP_MIN:
            errors.append(f"is_cap must be >= {IS_CAP_MIN:g}, got {self.is_cap!r}")
        if errors:
            raise ValueError("invalid GRPOLossConfig:\n  " + "\n  ".join(errors))


def mismatch_stats(old_logp: Tensor, mu_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """How far the sampler mu is from pi_old on the sampled tokens; detached 0-dim float32 tensors.

    With l = old_logp - mu_logp = log(pi_old / mu) on masked tokens:
      log_ratio_sum, log_ratio_max, log_ratio_min: sum / max / min of l (max is -inf, min +inf with no tokens,
        the identities for combining; see merge_stats);
      kl_mu_old_sum: sum of r - 1 - log r with r = exp(l): the k3 estimate of KL(mu || pi_old). Samples come
        from mu, so each term is >= 0 and the mean is unbiased.
    """
    m = mask != 0
    old = torch.where(m, old_logp.detach().float(), 0.0)
    mu = torch.where(m, mu_logp.detach().float(), 0.0)
    lr = old - mu  # 0 at masked positions
    inf = torch.tensor(float("inf"), device=lr.device)
    return {
        "log_ratio_sum": lr.sum(),
        "log_ratio_max": torch.where(m, lr, -inf).max(),
        "log_ratio_min": torch.where(m, lr, inf).min(),
        "kl_mu_old_sum": (torch.expm1(lr) - lr).sum(),
    }


def _check_shapes(logp: Tensor, advantages: Tensor, **named: Tensor | None) -> None:
    """Every [B, T] input has logp's shape and advantages is [B]; None (no reference) is skipped."""
    if logp.dim() != 2:
        raise ValueError(f"logp must be 2-D [B, T], got shape {tuple(logp.shape)}")
    shape = logp.shape
    for name, t in named.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} must have the shape of logp {tuple(shape)}, got {tuple(t.shape)}")
    if advantages.shape != shape[:1]:
        raise ValueError(f"advantages must be [B] = [{shape[0]}] (one per sequence), got {tuple(advantages.shape)}")


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    mu_logp: Tensor,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    weights: Tensor,
    cfg: GRPOLossConfig,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped GRPO surrogate (DeepSeekMath GRPO, DAPO clip-higher) with TIS (FlashRL) and KL to a reference.

    logp [B, T]: current policy log-probs (requires grad). old_logp [B, T]: pi_old, the learner's policy before
    this batch's updates. mu_logp [B, T]: the sampler that generated the tokens (quantized generator).
    ref_logp [B, T] or None (then the KL term is 0). advantages [B]. mask [B, T] float or bool.
    weights [B, T] from aggregation_weights(), which sets the normalisation (token-, sequence-mean or constant).

        rho = exp(logp - old_logp); surr = -min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A)
        token_loss = w_is * surr + kl_coeff * kl,  w_is = importance_weights(old_logp, mu_logp)
        loss = (token_loss * weights).sum() over masked tokens

    The IS weight multiplies the policy-gradient term only. Arithmetic is float32 (inputs are upcast; the gradient
    flows back to logp in its own dtype). old_logp, mu_logp, ref_logp and advantages are detached.

    Returns (loss, stats); stats are detached 0-dim sums over masked tokens so callers can add them across
    micro-batches and ranks (merge_stats; *_max / *_min keys combine by max / min), then call finalize_stats:
      tokens, clipped_low (rho < 1 - clip_low and A < 0), clipped_high (rho > 1 + clip_high and A > 0),
      kl_sum (0 without a reference), is_weight_sum, is_capped (tokens truncated in "truncate" mode / masked out
      in "mask" mode; always 0 in "none"), and log_ratio_sum, log_ratio_max, log_ratio_min, kl_mu_old_sum from
      mismatch_stats.
    """
    _check_shapes(logp, advantages, old_logp=old_logp, mu_logp=mu_logp, mask=mask, weights=weights,
                  ref_logp=ref_logp)
    m = mask != 0
    # Zero every masked position before use: padding may hold -inf/NaN, and 0 * inf would be NaN even under a
    # zero weight. torch.where passes no gradient to the masked entries of logp.
    logp_ = torch.where(m, logp.float(), 0.0)
    old = torch.where(m, old_logp.detach().float(), 0.0)
    mu = torch.where(m, mu_logp.detach().float(), 0.0)
    adv = advantages.detach().float()[:, None]  # [B, 1]

    rho = torch.exp(logp_ - old)
    lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    surr = -torch.minimum(rho * adv, rho.clamp(lo, hi) * adv)  # [B, T]
    w_is = importance_weights(old, mu, mode=cfg.is_mode, cap=cfg.is_cap)
    token_loss = w_is * surr

    if ref_logp is not None:
        ref = torch.where(m, ref_logp.detach().float(), 0.0)
        kl = kl_penalty(logp_, ref, cfg.kl_estimator)
        if cfg.kl_coeff != 0.0:
            token_loss = token_loss + cfg.kl_coeff * kl
        kl_sum = torch.where(m, kl.detach(), 0.0).sum()
    else:
        kl_sum = torch.zeros((), device=logp.device)

    loss = torch.where(m, token_loss * weights.float(), 0.0).sum()

    with torch.no_grad():
        rho_d = rho.detach()
        if cfg.is_mode == "truncate":
            capped = torch.exp(old - mu) > cfg.is_cap
        elif cfg.is_mode == "mask":
            capped = w_is == 0
        else:
            capped = torch.zeros_like(m)
        stats = {
            "tokens": m.sum().float(),
            "clipped_low": (m & (rho_d < lo) & (adv < 0)).sum().float(),
            "clipped_high": (m & (rho_d > hi) & (adv > 0)).sum().float(),
            "kl_sum": kl_sum,
            "is_weight_sum": torch.where(m, w_is, 0.0).sum(),
            "is_capped": (m & capped).sum().float(),
            **mismatch_stats(old, mu, m),
        }
    return loss, stats


def merge_stats(total: dict[str, Tensor | float], new: dict[str, Tensor | float]) -> dict[str, Tensor | float]:
    """Combine two stats dicts from grpo_loss (micro-batches, or ranks gathered): keys ending in _max / _min by
    max / min, all others by sum. Returns a new dict; an empty `total` simply returns a copy of `new`."""
    out = dict(total)
    for k, v in new.items():
        if k not in out:
            out[k] = v
        elif k.endswith("_max"):
            out[k] = torch.maximum(torch.as_tensor(out[k]), torch.as_tensor(v))
        elif k.endswith("_min"):
            out[k] = torch.minimum(torch.as_tensor(out[k]), torch.as_tensor(v))
        else:
            out[k] = out[k] + v
    return out


def finalize_stats(sums: dict[str, Tensor | float]) -> dict[str, float]:
    """Turn summed stats (from grpo_loss, combined with merge_stats) into per-token metrics, as Python floats.

    Keys:
      tokens                     number of completion tokens
      clip_frac_low              clipped_low / tokens: tokens where A < 0 and the ratio fell below 1 - clip_low
      clip_frac_high             clipped_high / tokens: tokens where A > 0 and the ratio rose above 1 + clip_high
      kl                         kl_sum / tokens: mean per-token KL(pi_theta || ref) estimate
      is_weight_mean             is_weight_sum / tokens: mean importance weight pi_old / mu after truncation/mask
      is_capped_frac             is_capped / tokens: share of tokens truncated or masked out
      mismatch/log_ratio_mean    mean log(pi_old / mu) over sampled tokens
      mismatch/log_ratio_max     max  log(pi_old / mu)
      mismatch/log_ratio_min     min  log(pi_old / mu)
      mismatch/kl_mu_old         mean k3 estimate of KL(mu || pi_old)
    With no tokens every value is 0.0.
    """
    tokens = float(sums["tokens"])
    if tokens <= 0:
        keys = ("clip_frac_low", "clip_frac_high", "kl", "is_weight_mean", "is_capped_frac",
                "mismatch/log_ratio_mean", "mismatch/log_ratio_max", "mismatch/log_ratio_min", "mismatch/kl_mu_old")
        return {"tokens": 0.0, **{k: 0.0 for k in keys}}

    def mean(key: str) -> float:
        return float(sums[key]) / tokens

    return {
        "tokens": tokens,
        "clip_frac_low": mean("clipped_low"),
        "clip_frac_high": mean("clipped_high"),
        "kl": mean("kl_sum"),
        "is_weight_mean": mean("is_weight_sum"),
        "is_capped_frac": mean("is_capped"),
        "mismatch/log_ratio_mean": mean("log_ratio_sum"),
        "mismatch/log_ratio_max": float(sums["log_ratio_max"]),
        "mismatch/log_ratio_min": float(sums["log_ratio_min"]),
        "mismatch/kl_mu_old": mean("kl_mu_old_sum"),
    }
