"""The policy losses (GSPO, CISPO, SAPO), the sampler corrections at the token, sequence and geometric levels, the
off-policy sequence mask, the top-entropy mask, the entropy bonus and the KL bias correction, on hand-computed numbers:
values and gradients, every branch, and each one reducing to plain GRPO where it should."""

import math

import pytest
import torch

from qgrpo.learner.objective.corrections import (
    effective_sample_size,
    log_ratios,
    offpolicy_sequence_keep,
    sampler_weights,
    top_entropy_keep,
)
from qgrpo.learner.objective.loss import aggregation_weights, finalize_stats, grpo_loss
from qgrpo.learner.objective.losses import CISPOParams, Clip, SAPOParams, cispo_term, grpo_term, gspo_term, sapo_term
from qgrpo.learner.objective.settings import objective_settings
from tests.helpers import TINY


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# Two sequences: row 0 has completion tokens at columns 1 and 2, row 1 at column 1 only (column 0 is the prompt).
MASK = t([[0, 1, 1], [0, 1, 0]])
M = MASK != 0


PARAMS = {grpo_term: Clip, gspo_term: Clip, cispo_term: CISPOParams, sapo_term: SAPOParams}


def _run(fn, log_rho, adv, *args, old=None):
    """fn's loss summed over tokens, its gradient w.r.t. logp, and its clip flags; logp = old + log_rho."""
    old = t([[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]]) if old is None else old
    logp = torch.where(M, old + t(log_rho), 0.0).requires_grad_()
    loss, low, high = fn(logp, torch.where(M, old, 0.0), t(adv)[:, None], M, PARAMS[fn](*args))
    total = torch.where(M, loss, 0.0).sum()
    total.backward()
    return total.item(), logp.grad, low, high


# ---------------------------------------------------------------- policy terms


def test_gspo_clips_the_geometric_mean_ratio_of_each_sequence():
    # Row 0: log-ratios 0.1 and 0.3 -> s = e^0.2 = 1.2214 > 1.2 with A = 1: clipped at 1.2, no gradient.
    # Row 1: log-ratio -0.1 -> s = e^-0.1 with A = -1, inside [0.8, 1.2]: loss -A s = e^-0.1 on its one token.
    total, grad, low, high = _run(gspo_term, [[0, 0.1, 0.3], [0, -0.1, 0]], [1.0, -1.0], 0.2, 0.2)
    assert total == pytest.approx(2 * -1.2 + math.exp(-0.1), rel=1e-6)
    torch.testing.assert_close(grad[0], t([0, 0, 0]))
    # d(-A s)/d logp_t = -A s / |y| = e^-0.1 for the one token of row 1
    assert grad[1, 1].item() == pytest.approx(math.exp(-0.1), rel=1e-6)
    assert high.tolist() == [[False, True, True], [False, False, False]] and not low.any()


def test_gspo_gradient_reaches_every_token_through_the_mean():
    # Row 0 inside the clip (s = e^0.05, A = 2): each of its 2 tokens gets -A s / 2 of gradient per token of loss,
    # and the loss sits on both tokens: d/dlogp_t = 2 * (-A s / 2) = -A s.
    _, grad, _, _ = _run(gspo_term, [[0, 0.0, 0.1], [0, 0.0, 0]], [2.0, 0.0], 0.2, 0.2)
    s = math.exp(0.05)
    torch.testing.assert_close(grad[0, 1:], t([-2 * s, -2 * s]))


def test_cispo_weight_is_clipped_and_stop_gradient():
    # Token ratios e^0.5 (cap 1.5 -> 1.5), e^-0.5 (no cap), e^2 on row 1 (-> 1.5); A = 2 and -1.
    old = t([[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]])
    total, grad, low, high = _run(cispo_term, [[0, 0.5, -0.5], [0, 2.0, 0]], [2.0, -1.0], 1.5, old=old)
    logp = [-1.0 + 0.5, -2.0 - 0.5, -0.5 + 2.0]
    w = [1.5, math.exp(-0.5), 1.5]
    expected = -w[0] * 2 * logp[0] - w[1] * 2 * logp[1] - w[2] * -1 * logp[2]
    assert total == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(grad, t([[0, -3.0, -2 * w[1]], [0, 1.5, 0]]))  # -w A: no ratio in the gradient
    assert high.tolist() == [[False, True, False], [False, True, False]] and not low.any()


def test_sapo_soft_gate_values_and_slopes():
    # Row 0: rho = e^0.2, A = 1, tau 1; row 1: rho = e^0.2, A = -1, tau 1.05.
    total, grad, low, high = _run(sapo_term, [[0, 0.2, 0.0], [0, 0.2, 0]], [1.0, -1.0], 1.0, 1.05)
    rho = math.exp(0.2)
    s_pos, s_neg = sigmoid(rho - 1), sigmoid(1.05 * (rho - 1))
    expected = -4 * s_pos - 4 * sigmoid(0.0) + 4 * s_neg / 1.05
    assert total == pytest.approx(expected, rel=1e-6)
    # d/dlogp (-A f(rho)) = -A 4 s (1 - s) rho; at rho = 1: -A (f'(1) = 1)
    assert grad[0, 1].item() == pytest.approx(-4 * s_pos * (1 - s_pos) * rho, rel=1e-5)
    assert grad[0, 2].item() == pytest.approx(-1.0, rel=1e-6)
    assert grad[1, 1].item() == pytest.approx(4 * s_neg * (1 - s_neg) * rho, rel=1e-5)
    assert not low.any() and not high.any()


@pytest.mark.parametrize("policy_loss", ["gspo", "cispo", "sapo"])
def test_every_policy_loss_has_the_grpo_gradient_at_ratio_one(policy_loss):
    """On the first pass over a batch (pi_theta = pi_old) and no mismatch (mu = pi_old), each loss's gradient is
    GRPO's under the same aggregation."""
    torch.manual_seed(0)
    mask = (torch.rand(4, 6) > 0.3).float()
    mask[:, 0] = 0
    mask[:, 1] = 1
    old = -torch.rand(4, 6) * 3
    adv = torch.randn(4)
    agg = "seq_mean" if policy_loss == "gspo" else "token_mean"
    weights = aggregation_weights(mask, agg)
    grads = []
    for cfg in (objective_settings(kl_coeff=0.0), objective_settings(policy_loss=policy_loss, kl_coeff=0.0)):
        logp = old.clone().requires_grad_()
        loss, _ = grpo_loss(logp, old, old, None, adv, mask, weights, cfg)
        loss.backward()
        grads.append(logp.grad)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)


def test_grpo_term_flags():
    _, _, low, high = _run(grpo_term, [[0, 0.5, -0.5], [0, -0.5, 0]], [1.0, -1.0], 0.2, 0.28)
    assert high.tolist() == [[False, True, False], [False, False, False]]
    assert low.tolist() == [[False, False, False], [False, True, False]]


# ---------------------------------------------------------------- sampler corrections

OLD = t([[0.0, -1.0, -1.0, -1.0], [0.0, -2.0, 0.0, 0.0]])
MASK3 = t([[0, 1, 1, 1], [0, 1, 0, 0]]) != 0
# log r = old - mu: row 0 [0.5, 0.5, -0.2] (sum 0.8, mean 0.8/3), row 1 [0.1]
MU = OLD - t([[0.0, 0.5, 0.5, -0.2], [0.0, 0.1, 0.0, 0.0]])


def test_log_ratios_at_each_level():
    torch.testing.assert_close(log_ratios(OLD, MU, MASK3, "token"), t([[0, 0.5, 0.5, -0.2], [0, 0.1, 0, 0]]))
    torch.testing.assert_close(log_ratios(OLD, MU, MASK3, "sequence")[:, 1], t([0.8, 0.1]))
    torch.testing.assert_close(log_ratios(OLD, MU, MASK3, "geometric")[:, 1], t([0.8 / 3, 0.1]))


@pytest.mark.parametrize("level,mode,floor,cap,row0,row1", [
    # sequence: R = e^0.8 = 2.2255, e^0.1
    ("sequence", "truncate", 0.0, 2.0, [2.0] * 3, math.exp(0.1)),
    ("sequence", "mask", 0.0, 3.0, [math.exp(0.8)] * 3, math.exp(0.1)),  # TRL's default: sequence_mask, cap 3
    ("sequence", "mask", 0.0, 2.0, [0.0] * 3, math.exp(0.1)),
    # geometric: e^(0.8/3) = 1.3056
    ("geometric", "reject", 0.999, 1.001, [0.0] * 3, 0.0),  # Geo-RS with tight bounds rejects both
    ("geometric", "reject", 0.5, 2.0, [1.0] * 3, 1.0),
    ("geometric", "truncate", 0.0, 1.2, [1.2] * 3, math.exp(0.1)),
    # token, IcePop: [0.5, 5]
    ("token", "mask", 0.5, 5.0, [math.exp(0.5), math.exp(0.5), math.exp(-0.2)], math.exp(0.1)),
    ("token", "mask", 0.9, 5.0, [math.exp(0.5), math.exp(0.5), 0.0], math.exp(0.1)),
])
def test_sampler_weights_hand_values(level, mode, floor, cap, row0, row1):
    sw = sampler_weights(OLD, MU, MASK3, level=level, mode=mode, cap=cap, floor=floor)
    torch.testing.assert_close(sw.weight, t([[0.0, *row0], [0.0, row1, 0.0, 0.0]]), atol=1e-6, rtol=1e-5)
    assert not sw.weight.requires_grad
    assert len(sw.units) == (4 if level == "token" else 2)  # tokens, or one weight per sequence


def test_sampler_weight_flags_and_stats():
    sw = sampler_weights(OLD, MU, MASK3, level="sequence", mode="mask", cap=2.0, floor=0.0)
    assert sw.masked.tolist() == [[False, True, True, True], [False, False, False, False]]
    assert not sw.truncated.any()
    sw = sampler_weights(OLD, MU, MASK3, level="token", mode="truncate", cap=1.5, floor=0.9)
    # r = e^0.5 = 1.65 (truncated twice), e^-0.2 = 0.82 (truncated from below), e^0.1 (kept)
    assert sw.truncated.tolist() == [[False, True, True, True], [False, False, False, False]]
    torch.testing.assert_close(sw.weight[0, 1:], t([1.5, 1.5, 0.9]))
    w, w2, n = effective_sample_size(sw.units)
    assert n.item() == 4 and w.item() == pytest.approx(3.9 + math.exp(0.1), rel=1e-6)
    assert w2.item() == pytest.approx(2.25 * 2 + 0.81 + math.exp(0.2), rel=1e-6)


def test_sequence_level_products_stay_finite():
    old = torch.zeros(1, 300)
    mu = torch.full((1, 300), -1.0)  # log r = 1 on 300 tokens: prod r = e^300, beyond float32
    m = torch.ones(1, 300, dtype=torch.bool)
    for mode in ("truncate", "mask", "reject"):
        w = sampler_weights(old, mu, m, level="sequence", mode=mode, cap=3.0, floor=0.0).weight
        assert torch.isfinite(w).all()
    loss, _ = grpo_loss(old.requires_grad_(), old, mu, None, t([1.0]), m.float(), m.float() / 300,
                        objective_settings(is_level="sequence", is_mode="truncate", is_cap=float("inf"), kl_coeff=0.0))
    assert torch.isfinite(loss)


def test_loss_applies_the_sequence_correction_to_every_token():
    # Row 0 masked (R = e^0.8 > 2), row 1 weighted e^0.1; rho = 1, A = [1, 1]: loss = -(0 + e^0.1) / 4 tokens.
    mask = MASK3.float()
    w = aggregation_weights(mask, "token_mean")
    cfg = objective_settings(is_level="sequence", is_mode="mask", is_cap=2.0, kl_coeff=0.0)
    logp = OLD.clone().requires_grad_()
    loss, stats = grpo_loss(logp, OLD, MU, None, t([1.0, 1.0]), mask, w, cfg)
    assert loss.item() == pytest.approx(-math.exp(0.1) / 4, rel=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad[0], t([0, 0, 0, 0]))
    out = finalize_stats(stats)
    assert out["mismatch/masked_token_frac"] == pytest.approx(0.75)
    assert out["mismatch/masked_seq_frac"] == pytest.approx(0.5)
    assert out["mismatch/ess"] == pytest.approx(1 / 2)  # weights (0, e^0.1): (e^0.1)^2 / (2 e^0.2)


def test_no_mismatch_means_no_correction():
    for level in ("token", "sequence", "geometric"):
        for mode in ("truncate", "mask", "reject"):
            sw = sampler_weights(OLD, OLD, MASK3, level=level, mode=mode, cap=2.0, floor=0.5)
            assert torch.equal(sw.weight, MASK3.float()) and not (sw.truncated.any() or sw.masked.any())
            assert effective_sample_size(sw.units)[0].item() == len(sw.units)


# ---------------------------------------------------------------- off-policy mask, entropy, KL correction


def test_offpolicy_mask_drops_negative_drifted_sequences_only():
    # Per-token log(mu / pi_theta): row 0 mean 0.6 (A < 0: dropped), row 1 0.6 (A > 0: kept), row 2 0.1 (kept)
    logp = t([[0, -1.0, -1.0], [0, -1.0, 0], [0, -1.0, 0]])
    mu = logp + t([[0, 0.4, 0.8], [0, 0.6, 0], [0, 0.1, 0]])
    m = t([[0, 1, 1], [0, 1, 0], [0, 1, 0]]) != 0
    keep = offpolicy_sequence_keep(logp, mu, t([-1.0, 1.0, -1.0])[:, None], m, 0.5)
    assert keep[:, 0].tolist() == [False, True, True]
    cfg = objective_settings(offpolicy_mask_kl=0.5, is_mode="none", kl_coeff=0.0)
    lp = logp.clone().requires_grad_()
    loss, stats = grpo_loss(lp, logp, mu, None, t([-1.0, 1.0, -1.0]), m.float(), m.float() / 4, cfg)
    loss.backward()
    torch.testing.assert_close(lp.grad, t([[0, 0, 0], [0, -0.25, 0], [0, 0.25, 0]]))
    assert finalize_stats(stats)["mismatch/offpolicy_masked_seq_frac"] == pytest.approx(1 / 3)


def test_top_entropy_quantile_keeps_the_high_entropy_tokens():
    m = t([[0, 1, 1], [0, 1, 1]]) != 0
    h = t([[9.0, 0.1, 0.9], [9.0, 0.5, 1.3]])  # column 0 is not a token: its value must not count
    keep = top_entropy_keep(h, m, 0.5)  # median of (0.1, 0.5, 0.9, 1.3) = 0.7
    assert keep.tolist() == [[False, False, True], [False, False, True]]
    assert torch.equal(top_entropy_keep(h, m, 1.0), m)
    # In the loss: the policy term only on the kept tokens; the KL term on all of them.
    old = t([[0, -1.0, -1.0], [0, -1.0, -1.0]])
    ref = old + 0.5
    cfg = objective_settings(top_entropy_quantile=0.5, kl_coeff=1.0)
    lp = old.clone().requires_grad_()
    loss, stats = grpo_loss(lp, old, old, ref, t([1.0, 1.0]), m.float(), m.float() / 4, cfg, entropy=h)
    loss.backward()
    kl_grad = (1 - math.exp(0.5)) / 4  # d k3(ref - logp)/d logp = 1 - e^d, d = 0.5
    torch.testing.assert_close(lp.grad, t([[0, kl_grad, kl_grad - 0.25], [0, kl_grad, kl_grad - 0.25]]))
    out = finalize_stats(stats)
    assert out["entropy/masked_token_frac"] == pytest.approx(0.5)
    assert out["entropy/mean"] == pytest.approx((0.1 + 0.9 + 0.5 + 1.3) / 4)


def test_entropy_bonus_value_and_gradient():
    m = t([[0, 1, 1]])
    old = t([[0, -1.0, -2.0]])
    h = t([[0.0, 2.0, 4.0]]).requires_grad_()
    w = m / 2
    base, _ = grpo_loss(old, old, old, None, t([0.0]), m, w, objective_settings(kl_coeff=0.0), entropy=h.detach())
    loss, _ = grpo_loss(old, old, old, None, t([0.0]), m, w, objective_settings(entropy_coeff=0.1, kl_coeff=0.0),
                        entropy=h)
    assert (loss - base).item() == pytest.approx(-0.1 * (2.0 + 4.0) / 2)
    loss.backward()
    torch.testing.assert_close(h.grad, t([[0, -0.05, -0.05]]))
    with pytest.raises(ValueError, match="needs the per-token entropy"):
        grpo_loss(old, old, old, None, t([0.0]), m, w, objective_settings(entropy_coeff=0.1, kl_coeff=0.0))


def test_kl_bias_correction_multiplies_by_the_ratio_with_its_gradient():
    # One token: logp - old = 0.3 (rho = e^0.3), d = ref - logp = 0.4, A = 0: only the KL term (coeff 1).
    m = t([[0, 1]])
    old = t([[0.0, -1.0]])
    logp = (old + t([[0, 0.3]])).requires_grad_()
    ref = logp.detach() + t([[0, 0.4]])
    cfg = objective_settings(kl_coeff=1.0, kl_bias_correction=True)
    loss, _ = grpo_loss(logp, old, old, ref, t([0.0]), m, m, cfg)
    rho, d = math.exp(0.3), 0.4
    k3 = math.exp(d) - d - 1
    assert loss.item() == pytest.approx(rho * k3, rel=1e-6)
    loss.backward()
    # d/dlogp [rho k3] = rho k3 + rho (1 - e^d)
    assert logp.grad[0, 1].item() == pytest.approx(rho * k3 + rho * (1 - math.exp(d)), rel=1e-5)
    # At rho = 1 and d = 0 it is the plain k3: value and gradient 0.
    plain, _ = grpo_loss(old, old, old, old, t([0.0]), m, m, cfg)
    assert plain.item() == 0.0


def test_config_rejects_unknown_choices_and_bounds():
    """The objective's settings are validated once, by the config ([algo] is generated from their declarations)."""
    from qgrpo.cluster.config.schema import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["algo.policy_loss='ppo'", "algo.is_level='chunk'", "algo.is_floor=1.5",
                           "algo.top_entropy_quantile=0.0", "algo.cispo_cap=0.5"], check_environment=False)
    for needle in ("algo.policy_loss: must be grpo, gspo, cispo or sapo", "algo.is_level", "algo.is_floor",
                   "algo.top_entropy_quantile", "algo.cispo_cap: must be >= 1"):
        assert needle in str(err.value)
    with pytest.raises(TypeError, match="ppo_cap"):
        objective_settings(ppo_cap=1.0)  # a key nothing declares
    with pytest.raises(ValueError, match="policy_loss must be one of"):
        objective_settings(policy_loss="ppo")
