"""M2PO's second-moment mask (algo.m2_threshold; learner/objective/corrections.py: second_moment_keep) on
hand-computed numbers: which tokens it masks, the loss and its gradient with the mask composed with the sampler
correction, the second moment after masking within the threshold, nothing masked when already within it, non-finite
log-ratios never kept, its metrics, and the default leaving the loss as it was."""

import math

import pytest
import torch

from qgrpo.learner.objective.corrections import second_moment_keep
from qgrpo.learner.objective.loss import aggregation_weights, finalize_stats, grpo_loss, merge_stats
from qgrpo.learner.objective.settings import objective_settings


def t(x):
    return torch.tensor(x, dtype=torch.float32)


# Two sequences, column 0 the prompt (its values are padding and must never count). On the four completion tokens
# d = log pi_old - log mu = [0.1, -0.3] and [0.5, 0.0]: d^2 = 0.01, 0.09, 0.25, 0, so M2 = 0.35 / 4 = 0.0875.
# Sorted: 0, 0.01, 0.09, 0.25, running means 0, 0.005, 0.0333, 0.0875.
MASK = t([[0, 1, 1], [0, 1, 1]])
M = MASK != 0
OLD = t([[0.0, -1.0, -2.0], [0.0, -0.5, -1.5]])
D = t([[0.0, 0.1, -0.3], [0.0, 0.5, 0.0]])
MU = torch.where(M, OLD - D, t([[float("nan")], [-float("inf")]]).expand(2, 3))


def test_masks_the_largest_squared_log_ratios_until_within_the_threshold():
    # tau = 0.04: the three smallest have mean 0.1 / 3 = 0.0333 <= 0.04, all four 0.0875 > 0.04: mask d = 0.5 only.
    assert second_moment_keep(OLD, MU, M, 0.04).tolist() == [[False, True, True], [False, False, True]]
    # tau = 0.03: 0.0333 > 0.03, the two smallest 0.005 <= 0.03: mask d = 0.5 and d = -0.3.
    assert second_moment_keep(OLD, MU, M, 0.03).tolist() == [[False, True, False], [False, False, True]]
    # tau = 0.004: only d = 0 (mean 0); tau = 0.0875 and above: M2 is within it already, nothing masked.
    assert second_moment_keep(OLD, MU, M, 0.004).tolist() == [[False, False, False], [False, False, True]]
    for tau in (0.0875, 0.09, 1.0):
        assert torch.equal(second_moment_keep(OLD, MU, M, tau), M)
    # "Within" includes equality: d = 0.5 and 0 (exact in binary) have M2 = 0.125 exactly
    old, mu, m = t([[-1.0, -1.0]]), t([[-1.5, -1.0]]), torch.ones(1, 2, dtype=torch.bool)
    assert second_moment_keep(old, mu, m, 0.125).tolist() == [[True, True]]
    assert second_moment_keep(old, mu, m, 0.124).tolist() == [[False, True]]


def test_loss_and_gradient_with_the_mask_on_top_of_tis():
    # rho = 1 (logp = pi_old), A = [1, -1], token_mean over 4 tokens, TIS min(e^d, 2): without the mask the loss is
    # -(e^0.1 + e^-0.3) / 4 + (e^0.5 + 1) / 4; with tau = 0.04 the d = 0.5 token drops out of the policy term.
    w = aggregation_weights(MASK, "token_mean")
    adv = t([1.0, -1.0])
    got = {}
    for tau in (0.0, 0.04):
        cfg = objective_settings(m2_threshold=tau, kl_coeff=0.0)
        logp = OLD.clone().requires_grad_()
        loss, stats = grpo_loss(logp, OLD, MU, None, adv, MASK, w, cfg)
        loss.backward()
        got[tau] = loss.item(), logp.grad, stats
    base = -(math.exp(0.1) + math.exp(-0.3)) / 4
    assert got[0.0][0] == pytest.approx(base + (math.exp(0.5) + 1) / 4, rel=1e-6)
    assert got[0.04][0] == pytest.approx(base + 1 / 4, rel=1e-6)
    # d(-A w rho)/d logp = -A w on each kept token; 0 on the masked one and on the prompt
    torch.testing.assert_close(got[0.04][1], t([[0, -math.exp(0.1) / 4, -math.exp(-0.3) / 4], [0, 0, 0.25]]))
    assert got[0.0][1][1, 1].item() == pytest.approx(math.exp(0.5) / 4, rel=1e-6)
    out = finalize_stats(got[0.04][2])
    assert out["mismatch/m2"] == pytest.approx(0.0875, rel=1e-5)
    assert out["mismatch/m2_kept"] == pytest.approx(0.1 / 3, rel=1e-5)
    assert out["mismatch/m2_masked_token_frac"] == pytest.approx(0.25)
    # The sampler correction's own statistics are unchanged by the mask (it is counted apart)
    base_out = finalize_stats(got[0.0][2])
    assert "mismatch/m2" not in base_out
    for key, value in base_out.items():
        assert out[key] == pytest.approx(value), key


def test_composes_with_mask_mode_and_is_off_for_the_kl_and_entropy_terms():
    # Masked IS at [0.8, 2] drops d = -0.3 (r = 0.74) and keeps d = 0.5 (r = 1.65); M2 at tau = 0.04 drops d = 0.5:
    # both are out, the d = 0.1 and d = 0 tokens keep their weights e^0.1 and 1.
    w = aggregation_weights(MASK, "token_mean")
    cfg = objective_settings(m2_threshold=0.04, is_mode="mask", is_floor=0.8, is_cap=2.0, kl_coeff=1.0,
                             entropy_coeff=0.5)
    logp = OLD.clone().requires_grad_()
    ent = t([[0.0, 1.0, 2.0], [0.0, 3.0, 4.0]])
    loss, _ = grpo_loss(logp, OLD, MU, OLD, t([1.0, -1.0]), MASK, w, cfg, entropy=ent)
    # KL 0 at ref = logp; the entropy bonus covers every token, masked or not: -0.5 (1 + 2 + 3 + 4) / 4
    assert loss.item() == pytest.approx(-math.exp(0.1) / 4 + 1 / 4 - 0.5 * 10 / 4, rel=1e-6)


def test_second_moment_after_masking_is_within_the_threshold():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        old = -torch.rand(8, 40, generator=g) * 4
        mu = old + (0.05 + trial * 0.03) * torch.randn(8, 40, generator=g)
        m = torch.rand(8, 40, generator=g) > 0.2
        d2 = (old.double() - mu.double()).square()
        for tau in (0.01, 0.04, 0.2):
            keep = second_moment_keep(old, mu, m, tau)
            assert not (keep & ~m).any()
            if keep.any():
                assert d2[keep].mean().item() <= tau
            if d2[m].mean().item() <= tau:
                assert torch.equal(keep, m)  # within the threshold already: nothing masked
                continue
            # As few as it takes: every masked token has a d^2 at least that of every kept one, and keeping the
            # smallest masked one as well would put the second moment above the threshold.
            masked = d2[m & ~keep]
            assert masked.min() >= (d2[keep].max() if keep.any() else 0)
            assert (d2[keep].sum() + masked.min()) / (keep.sum() + 1) > tau


def test_non_finite_log_ratios_are_never_kept_and_move_no_other_decision():
    bad = MU.clone()
    bad[0, 1] = float("nan")  # the d = 0.1 token
    keep = second_moment_keep(OLD, bad, M, 0.04)
    # The other three (0.09, 0.25, 0): with 0.25 their mean is 0.113 > 0.04; without it 0.045 > 0.04; 0 alone kept.
    assert keep.tolist() == [[False, False, False], [False, False, True]]
    for value in (float("inf"), -float("inf")):
        bad[0, 1] = value
        assert torch.equal(second_moment_keep(OLD, bad, M, 0.04), keep)
    # A huge tau keeps every finite token, never the non-finite one
    assert second_moment_keep(OLD, bad, M, 1e30).tolist() == [[False, False, True], [False, True, True]]
    # Every token beyond the threshold alone: all masked, the kept second moment reads 0, never NaN
    far = OLD - 1.0
    assert not second_moment_keep(OLD, far, M, 0.5).any()
    cfg = objective_settings(m2_threshold=0.5, kl_coeff=0.0)
    loss, stats = grpo_loss(OLD, OLD, far, None, t([1.0, -1.0]), MASK, MASK / 4, cfg)
    out = finalize_stats(stats)
    assert loss.item() == 0.0 and out["mismatch/m2_kept"] == 0.0 and out["mismatch/m2_masked_token_frac"] == 1.0
    assert out["mismatch/m2"] == pytest.approx(1.0)


def test_no_tokens_masks_nothing_and_metrics_add_over_micro_batches():
    none = torch.zeros(2, 3, dtype=torch.bool)
    assert not second_moment_keep(OLD, MU, none, 0.04).any()
    cfg = objective_settings(m2_threshold=0.04, kl_coeff=0.0)
    w = aggregation_weights(MASK, "token_mean", num_tokens=8.0)
    _, a = grpo_loss(OLD, OLD, MU, None, t([1.0, -1.0]), MASK, w, cfg)  # masks 1 of 4, M2 0.0875
    _, b = grpo_loss(OLD, OLD, OLD, None, t([1.0, -1.0]), MASK, w, cfg)  # no mismatch: masks none, M2 0
    out = finalize_stats(merge_stats(a, b))
    assert out["mismatch/m2"] == pytest.approx(0.35 / 8, rel=1e-5)
    assert out["mismatch/m2_kept"] == pytest.approx(0.1 / 7, rel=1e-5)
    assert out["mismatch/m2_masked_token_frac"] == pytest.approx(1 / 8)


def test_default_is_off_and_leaves_the_loss_unchanged():
    assert objective_settings().m2_threshold == 0.0
    w = aggregation_weights(MASK, "token_mean")
    loss_default, stats_default = grpo_loss(OLD, OLD, MU, None, t([1.0, -1.0]), MASK, w, objective_settings())
    # A threshold the batch is within masks nothing: the same loss, with the M2 metrics added
    loss_within, stats_within = grpo_loss(OLD, OLD, MU, None, t([1.0, -1.0]), MASK, w,
                                          objective_settings(m2_threshold=1.0))
    assert loss_within.item() == loss_default.item()
    assert set(stats_within) - set(stats_default) == {"m2_sum", "m2_kept_sum", "m2_kept", "m2_masked"}
    assert finalize_stats(stats_within)["mismatch/m2_masked_token_frac"] == 0.0
