"""The GRPO loss and its variants, with the corrections for quantized rollouts (pure torch; no heavy imports).

Shapes: every per-token tensor is [B, T] aligned with `input_ids[B, T]`: the value at position j is the log-prob
of token j given tokens < j. `mask` [B, T] is 1 on completion tokens and 0 on prompt and padding positions.
`advantages` is [B], one per sequence.

The loss, per completion token t of sequence i (docs/algorithms.md gives each choice with its source):

    pg_t    = the policy term of algo.policy_loss (learner/objective/losses.py): GRPO's clipped surrogate on
              rho_t = pi_theta/pi_old by default; GSPO, CISPO or SAPO
    w_t     = the sampler correction from r = pi_old/mu at is_level (token, sequence, geometric), truncated, masked
              or rejected at [is_floor, is_cap] (learner/objective/corrections.py); TIS min(r_t, 2) by default;
              x M2PO's second-moment token mask with m2_threshold > 0 (off by default)
    top_t   = the top-entropy token mask (optional; every completion token without it)
    keep_t  = DeepSeek-V3.2's off-policy sequence mask (optional) x top_t
    loss_t  = keep_t w_t pg_t + kl_coeff KL_t (x rho_t with kl_bias_correction) - entropy_coeff top_t H_t
    loss    = sum_t loss_t * weight_t                                 weight_t from aggregation_weights()

The aggregation is a per-token weight so that micro-batches and data-parallel ranks, each given the *global*
counts, add up exactly to the loss of the whole batch. Masks drop tokens from the sum, not from the count (as TRL).

Values at masked positions are never read: they are replaced by 0 before any arithmetic, so padding filled with
-inf or NaN (as some generators return for prompt positions) cannot leak NaN into the loss or its gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qgrpo.learner.objective.corrections import (
    effective_sample_size,
    offpolicy_sequence_keep,
    sampler_weights,
    second_moment_keep,
    top_entropy_keep,
)
from qgrpo.learner.objective.losses import policy_term
from qgrpo.learner.objective.options import AGGREGATIONS, IS_CAP_MIN, IS_MODES, KL_ESTIMATORS
from qgrpo.learner.objective.settings import ObjectiveSettings


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


def importance_weights(old_logp: Tensor, mu_logp: Tensor, *, mode: str, cap: float, floor: float = 0.0) -> Tensor:
    """Per-token weight r = exp(old_logp - mu_logp) = pi_old / mu at the token level (corrections.sampler_weights):

    truncate: clamp(r, floor, cap)  (FlashRL truncated importance sampling, TIS);
    mask:     r inside [floor, cap], else 0.0  (masked IS; IcePop with floor 0.5, cap 5);
    reject:   1.0 inside [floor, cap], else 0.0  (drop the tokens the sampler got badly wrong, no reweighting);
    none:     1.0 (treat mu as pi_old).
    Always detached (no gradient), float32 (or float64 if given), the shape of the inputs.
    """
    _check_choice("is_mode", mode, IS_MODES)
    _check_cap(cap)
    old, mu = old_logp.detach(), mu_logp.detach()
    flat = old.reshape(1, -1), mu.reshape(1, -1)
    m = torch.ones_like(flat[0], dtype=torch.bool)
    return sampler_weights(*flat, m, level="token", mode=mode, cap=cap, floor=floor).weight.reshape(old.shape)


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
    cfg: ObjectiveSettings,
    entropy: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss of the module docstring: cfg.policy_loss's term, the sampler correction, the optional masks, the KL
    to a reference and the entropy bonus, aggregated by `weights`.

    logp [B, T]: current policy log-probs (requires grad). old_logp [B, T]: pi_old, the learner's policy before
    this batch's updates. mu_logp [B, T]: the sampler that generated the tokens (quantized generator).
    ref_logp [B, T] or None (then the KL term is 0). advantages [B]. mask [B, T] float or bool.
    weights [B, T] from aggregation_weights(), which sets the normalisation (token-, sequence-mean or constant).
    entropy [B, T] or None: the policy's per-token entropy (core/scoring.py, with_entropy=True); required when
    cfg.entropy_coeff > 0 or cfg.top_entropy_quantile < 1, logged whenever given.

    The sampler correction and the masks multiply the policy term only, except the top-entropy mask, which also
    masks the entropy bonus. Arithmetic is float32 (inputs are upcast; the gradient flows back to logp and entropy in
    their own dtype). old_logp, mu_logp, ref_logp and advantages are detached.

    Returns (loss, stats); stats are detached 0-dim sums over masked tokens (and sequences) so callers can add them
    across micro-batches and ranks (merge_stats; *_max / *_min keys combine by max / min), then call finalize_stats.
    """
    _check_shapes(logp, advantages, old_logp=old_logp, mu_logp=mu_logp, mask=mask, weights=weights,
                  ref_logp=ref_logp, entropy=entropy)
    if entropy is None and cfg.needs_entropy:
        raise ValueError("grpo_loss: entropy_coeff > 0 or top_entropy_quantile < 1 needs the per-token entropy")
    m = mask != 0
    # Zero every masked position before use: padding may hold -inf/NaN, and 0 * inf would be NaN even under a
    # zero weight. torch.where passes no gradient to the masked entries of logp.
    logp_ = torch.where(m, logp.float(), 0.0)
    old = torch.where(m, old_logp.detach().float(), 0.0)
    mu = torch.where(m, mu_logp.detach().float(), 0.0)
    adv = advantages.detach().float()[:, None]  # [B, 1]
    ent = torch.where(m, entropy.float(), 0.0) if entropy is not None else None

    pg, clipped_low, clipped_high = policy_term(cfg.policy_loss, logp_, old, adv, m, cfg.loss_params)
    sw = sampler_weights(old, mu, m, level=cfg.is_level, mode=cfg.is_mode, cap=cfg.is_cap, floor=cfg.is_floor)
    keep_seq = (offpolicy_sequence_keep(logp_, mu, adv, m, cfg.offpolicy_mask_kl) if cfg.offpolicy_mask_kl > 0
                else torch.ones_like(adv, dtype=torch.bool))
    keep_tok = top_entropy_keep(ent, m, cfg.top_entropy_quantile) if ent is not None else m
    keep_m2 = second_moment_keep(old, mu, m, cfg.m2_threshold) if cfg.m2_threshold > 0 else None
    keep = keep_seq & keep_tok if keep_m2 is None else keep_seq & keep_tok & keep_m2
    token_loss = sw.weight * pg * keep

    if ref_logp is not None:
        ref = torch.where(m, ref_logp.detach().float(), 0.0)
        kl = kl_penalty(logp_, ref, cfg.kl_estimator)
        if cfg.kl_bias_correction:  # rho keeps its gradient, as TRL's coef_1
            kl = kl * torch.exp(logp_ - old)
        if cfg.kl_coeff != 0.0:
            token_loss = token_loss + cfg.kl_coeff * kl
        kl_sum = torch.where(m, kl.detach(), 0.0).sum()
    else:
        kl_sum = torch.zeros((), device=logp.device)
    if cfg.entropy_coeff > 0:
        token_loss = token_loss - cfg.entropy_coeff * ent * keep_tok

    loss = torch.where(m, token_loss * weights.float(), 0.0).sum()
    with torch.no_grad():
        stats = _loss_stats(m, keep_seq, keep_tok, sw, clipped_low, clipped_high, kl_sum, ent)
        stats.update(mismatch_stats(old, mu, m))
        if keep_m2 is not None:
            stats.update(second_moment_stats(old, mu, m, keep_m2))
    return loss, stats


def second_moment_stats(old: Tensor, mu: Tensor, m: Tensor, keep: Tensor) -> dict[str, Tensor]:
    """What M2PO's mask did (corrections.second_moment_keep), as sums over the tokens of `m`, with d = log(pi_old/mu):
    m2_sum (d^2 over every token), m2_kept_sum and m2_kept (d^2 over the kept tokens, and their count), m2_masked
    (tokens masked). Detached 0-dim float32 tensors."""
    d2 = torch.where(m, old.detach().float() - mu.detach().float(), 0.0).square()
    return {"m2_sum": d2.sum(), "m2_kept_sum": torch.where(keep, d2, 0.0).sum(), "m2_kept": keep.sum().float(),
            "m2_masked": (m & ~keep).sum().float()}


def _loss_stats(m: Tensor, keep_seq: Tensor, keep_tok: Tensor, sw, clipped_low: Tensor, clipped_high: Tensor,
                kl_sum: Tensor, ent: Tensor | None) -> dict[str, Tensor]:
    """grpo_loss's sums (see finalize_stats for what each becomes)."""
    def count(x: Tensor) -> Tensor:
        return x.sum().float()

    has = m.any(dim=1)  # sequences with tokens
    ess = effective_sample_size(sw.units)
    off = sw.truncated | sw.masked
    return {
        "tokens": count(m), "sequences": count(has),
        "clipped_low": count(clipped_low), "clipped_high": count(clipped_high), "kl_sum": kl_sum,
        "is_weight_sum": sw.weight.sum(), "is_capped": count(m & off),
        "is_truncated": count(sw.truncated), "is_truncated_seqs": count(sw.truncated.any(dim=1)),
        "is_masked": count(sw.masked), "is_masked_seqs": count(has & ~(m & ~sw.masked).any(dim=1)),
        "ess_w_sum": ess[0], "ess_w_sq_sum": ess[1], "ess_n": ess[2],
        "offpolicy_masked_seqs": count(has & ~keep_seq[:, 0]),
        "entropy_sum": ent.sum() if ent is not None else torch.zeros((), device=m.device),
        "entropy_tokens": count(m) if ent is not None else torch.zeros((), device=m.device),
        "entropy_masked": count(m & ~keep_tok),
    }


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
                                 (CISPO: any token whose ratio passed cispo_cap; GSPO: tokens of clipped sequences)
      kl                         kl_sum / tokens: mean per-token KL(pi_theta || ref) estimate
      is_weight_mean             is_weight_sum / tokens: mean sampler weight after truncation / masking
      is_capped_frac             share of tokens truncated or masked by the sampler correction
      mismatch/log_ratio_mean    mean log(pi_old / mu) over sampled tokens
      mismatch/log_ratio_max     max  log(pi_old / mu)
      mismatch/log_ratio_min     min  log(pi_old / mu)
      mismatch/kl_mu_old         mean k3 estimate of KL(mu || pi_old)
      mismatch/truncated_token_frac, mismatch/truncated_seq_frac   tokens truncated; sequences with one truncated
      mismatch/masked_token_frac, mismatch/masked_seq_frac         tokens masked or rejected; sequences with all
      mismatch/ess               (sum w)^2 / (n sum w^2) of the sampler weights, per token or per sequence (is_level)
      mismatch/offpolicy_masked_seq_frac  sequences dropped by the off-policy sequence mask
      entropy/mean               mean token entropy of the policy (only when grpo_loss was given the entropy)
      entropy/masked_token_frac  tokens left out of the policy term by top_entropy_quantile
      mismatch/m2, mismatch/m2_kept, mismatch/m2_masked_token_frac   only with algo.m2_threshold > 0: the second moment
                                 mean (log pi_old/mu)^2 over every token, over the tokens M2PO's mask kept (<= the
                                 threshold, 0 with none kept), and the share of tokens it masked
    With no tokens every value is 0.0.
    """
    tokens = float(sums["tokens"])
    seqs = max(float(sums.get("sequences", 0.0)), 1.0)

    def mean(key: str, over: float = tokens) -> float:
        return float(sums.get(key, 0.0)) / over if tokens > 0 else 0.0

    w, w2 = float(sums.get("ess_w_sum", 0.0)), float(sums.get("ess_w_sq_sum", 0.0))
    out = {
        "tokens": tokens,
        "clip_frac_low": mean("clipped_low"),
        "clip_frac_high": mean("clipped_high"),
        "kl": mean("kl_sum"),
        "is_weight_mean": mean("is_weight_sum"),
        "is_capped_frac": mean("is_capped"),
        "mismatch/log_ratio_mean": mean("log_ratio_sum"),
        "mismatch/log_ratio_max": float(sums["log_ratio_max"]) if tokens > 0 else 0.0,
        "mismatch/log_ratio_min": float(sums["log_ratio_min"]) if tokens > 0 else 0.0,
        "mismatch/kl_mu_old": mean("kl_mu_old_sum"),
        "mismatch/truncated_token_frac": mean("is_truncated"),
        "mismatch/truncated_seq_frac": mean("is_truncated_seqs", seqs),
        "mismatch/masked_token_frac": mean("is_masked"),
        "mismatch/masked_seq_frac": mean("is_masked_seqs", seqs),
        "mismatch/ess": w * w / (float(sums.get("ess_n", 0.0)) * w2) if w2 > 0 else 0.0,
        "mismatch/offpolicy_masked_seq_frac": mean("offpolicy_masked_seqs", seqs),
        "entropy/masked_token_frac": mean("entropy_masked"),
    }
    if float(sums.get("entropy_tokens", 0.0)) > 0:
        out["entropy/mean"] = float(sums["entropy_sum"]) / float(sums["entropy_tokens"])
    if "m2_sum" in sums:
        kept = float(sums["m2_kept"])
        out["mismatch/m2"] = mean("m2_sum")
        out["mismatch/m2_kept"] = float(sums["m2_kept_sum"]) / kept if kept > 0 else 0.0
        out["mismatch/m2_masked_token_frac"] = mean("m2_masked")
    return out
