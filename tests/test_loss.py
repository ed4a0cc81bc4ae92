"""GRPO loss pieces on hand-computed numbers (ratios of exactly e, clips of exactly 1.28 and 0.9)."""

import math

import pytest
import torch

from qgrpo.learner.objective.loss import (
    AGGREGATIONS,
    aggregation_weights,
    finalize_stats,
    grpo_loss,
    importance_weights,
    kl_penalty,
    merge_stats,
    mismatch_stats,
)
from qgrpo.learner.objective.settings import objective_settings

E = math.e


def t(x, **kw):
    return torch.tensor(x, dtype=torch.float32, **kw)


# ---------------------------------------------------------------- KL estimators


def test_kl_estimators_hand_values():
    # d = ref - logp = +1 and -1.
    logp = t([0.0, 1.0])
    ref = t([1.0, 0.0])
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), t([-1.0, 1.0]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), t([0.5, 0.5]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), t([E - 2.0, 1.0 / E]))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_zero_when_equal(estimator):
    logp = torch.randn(3, 5)
    assert torch.equal(kl_penalty(logp, logp.clone(), estimator), torch.zeros(3, 5))


def test_kl_unknown_estimator():
    with pytest.raises(ValueError, match=r"kl_estimator must be one of \('k1', 'k2', 'k3'\)"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


# ---------------------------------------------------------------- importance weights


def test_tis_truncates_at_cap_and_passes_values_below():
    r = t([0.1, 0.5, 1.0, 1.5, 1.99, 2.5, 40.0])
    mu = torch.randn(7)
    old = mu + r.log()
    w = importance_weights(old, mu, mode="truncate", cap=2.0)
    torch.testing.assert_close(w, t([0.1, 0.5, 1.0, 1.5, 1.99, 2.0, 2.0]))
    w3 = importance_weights(old, mu, mode="truncate", cap=3.0)
    torch.testing.assert_close(w3, t([0.1, 0.5, 1.0, 1.5, 1.99, 2.5, 3.0]))


def test_mask_keeps_the_ratio_inside_and_reject_keeps_one():
    r = t([0.1, 0.4, 0.6, 1.0, 1.9, 2.1, 40.0])
    mu = torch.zeros(7)
    w = importance_weights(r.log(), mu, mode="mask", cap=2.0, floor=0.5)  # masked IS (TRL *_mask, IcePop)
    torch.testing.assert_close(w, t([0.0, 0.0, 0.6, 1.0, 1.9, 0.0, 0.0]))
    w = importance_weights(r.log(), mu, mode="reject", cap=2.0, floor=0.5)  # rejection: no reweighting
    assert torch.equal(w, t([0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]))
    w = importance_weights(r.log(), mu, mode="mask", cap=2.0)  # no floor
    torch.testing.assert_close(w, t([0.1, 0.4, 0.6, 1.0, 1.9, 0.0, 0.0]))
    w = importance_weights(r.log(), mu, mode="truncate", cap=2.0, floor=0.5)  # truncation from below too
    torch.testing.assert_close(w, t([0.5, 0.5, 0.6, 1.0, 1.9, 2.0, 2.0]))


def test_none_mode_is_one():
    w = importance_weights(t([3.0, -2.0]), t([0.0, 0.0]), mode="none", cap=2.0)
    assert torch.equal(w, t([1.0, 1.0]))


@pytest.mark.parametrize("mode", ["truncate", "mask", "reject", "none"])
def test_importance_weights_carry_no_grad(mode):
    old = torch.randn(2, 4, requires_grad=True)
    mu = torch.randn(2, 4, requires_grad=True)
    w = importance_weights(old, mu, mode=mode, cap=2.0)
    assert not w.requires_grad and w.grad_fn is None


def test_importance_weights_bad_args():
    with pytest.raises(ValueError, match="is_mode must be one of"):
        importance_weights(torch.zeros(1), torch.zeros(1), mode="clip", cap=2.0)
    with pytest.raises(ValueError, match="is_cap"):
        importance_weights(torch.zeros(1), torch.zeros(1), mode="truncate", cap=0.5)


# ---------------------------------------------------------------- clipped surrogate

# One completion token per row (column 1); column 0 is a prompt position.
MASK2 = t([[0.0, 1.0]])


def _one_token(log_rho: float, adv: float, log_is: float = 0.0, weight: float = 1.0, cfg=None):
    """logp - old = log_rho, old - mu = log_is, on a single completion token. Returns (loss, grad at token, stats)."""
    old = t([[-3.0, -1.0]])
    logp = (old + t([[0.0, log_rho]])).requires_grad_()
    mu = old - t([[0.0, log_is]])
    w = MASK2 * weight
    cfg = cfg or objective_settings(clip_low=0.1, clip_high=0.28, kl_coeff=0.0)
    loss, stats = grpo_loss(logp, old, mu, None, t([adv]), MASK2, w, cfg)
    loss.backward()
    return loss.item(), logp.grad[0, 1].item(), stats


def test_clip_high_positive_advantage():
    # rho = e > 1 + 0.28: -min(e * 1, 1.28 * 1) = -1.28, and the clipped branch has no gradient.
    loss, grad, stats = _one_token(1.0, 1.0)
    assert loss == pytest.approx(-1.28)
    assert grad == 0.0
    assert stats["clipped_high"].item() == 1 and stats["clipped_low"].item() == 0


def test_clip_low_negative_advantage():
    # rho = 1/e < 1 - 0.1, A = -2: -min(-2/e, 0.9 * -2) = 1.8, no gradient.
    loss, grad, stats = _one_token(-1.0, -2.0)
    assert loss == pytest.approx(1.8)
    assert grad == 0.0
    assert stats["clipped_low"].item() == 1 and stats["clipped_high"].item() == 0


def test_pessimistic_side_is_not_clipped():
    # A > 0 with rho = 1/e below the floor, and A < 0 with rho = e above the ceiling, keep rho * A and its gradient.
    loss, grad, stats = _one_token(-1.0, 1.0)
    assert loss == pytest.approx(-1.0 / E) and grad == pytest.approx(-1.0 / E)
    assert stats["clipped_low"].item() == 0 and stats["clipped_high"].item() == 0
    loss, grad, stats = _one_token(1.0, -1.0)
    assert loss == pytest.approx(E) and grad == pytest.approx(E)
    assert stats["clipped_low"].item() == 0 and stats["clipped_high"].item() == 0


@pytest.mark.parametrize("log_rho", [0.0, math.log(1.1), math.log(0.95)])
@pytest.mark.parametrize("adv", [1.5, -0.5])
def test_unclipped_gradient_is_minus_a_rho_wis_weight(log_rho, adv):
    # old - mu = log 1.5 -> w_is = 1.5 (below C = 2); aggregation weight 0.25.
    loss, grad, _ = _one_token(log_rho, adv, log_is=math.log(1.5), weight=0.25)
    rho = math.exp(log_rho)
    assert loss == pytest.approx(-adv * rho * 1.5 * 0.25, rel=1e-5)
    assert grad == pytest.approx(-adv * rho * 1.5 * 0.25, rel=1e-5)


def test_truncated_is_weight_scales_the_surrogate():
    # old - mu = 1 -> r = e, truncated to C = 2; rho = 1, A = 1: loss = -2.
    loss, grad, stats = _one_token(0.0, 1.0, log_is=1.0)
    assert loss == pytest.approx(-2.0) and grad == pytest.approx(-2.0)
    assert stats["is_capped"].item() == 1 and stats["is_weight_sum"].item() == pytest.approx(2.0)
    cfg = objective_settings(clip_low=0.1, clip_high=0.28, is_mode="mask", kl_coeff=0.0)
    loss, grad, stats = _one_token(0.0, 1.0, log_is=1.0, cfg=cfg)  # r = e outside [0, 2]: token dropped
    assert loss == 0.0 and grad == 0.0 and stats["is_capped"].item() == 1
    cfg = objective_settings(is_mode="none", kl_coeff=0.0)
    loss, _, stats = _one_token(0.0, 1.0, log_is=1.0, cfg=cfg)
    assert loss == pytest.approx(-1.0) and stats["is_capped"].item() == 0


def test_is_weight_multiplies_pg_term_only():
    # rho = 1, A = 1, w_is = 2 (truncated e), ref with d = ref - logp = 1 -> k3 = e - 2, kl_coeff = 0.5.
    old = t([[0.0, -1.0]])
    logp = old.clone().requires_grad_()
    mu = old - t([[0.0, 1.0]])
    ref = old + t([[0.0, 1.0]])
    cfg = objective_settings(kl_coeff=0.5, kl_estimator="k3")
    loss, stats = grpo_loss(logp, old, mu, ref, t([1.0]), MASK2, MASK2, cfg)
    assert loss.item() == pytest.approx(-2.0 + 0.5 * (E - 2.0))
    assert stats["kl_sum"].item() == pytest.approx(E - 2.0)
    loss.backward()
    # d/dlogp: PG -A * rho * w_is = -2; KL 0.5 * (1 - e^d) = 0.5 * (1 - e).
    assert logp.grad[0, 1].item() == pytest.approx(-2.0 + 0.5 * (1.0 - E))


# ---------------------------------------------------------------- aggregation

# Ragged lengths 3, 1, 0 in a [3, 4] batch (column 0 is the prompt).
RAGGED = t([[0, 1, 1, 1], [0, 0, 1, 0], [0, 0, 0, 0]])


def test_aggregation_weights_hand_values():
    w = aggregation_weights(RAGGED, "token_mean")
    torch.testing.assert_close(w, RAGGED / 4)
    w = aggregation_weights(RAGGED, "seq_mean")
    torch.testing.assert_close(w, t([[0, 1 / 9, 1 / 9, 1 / 9], [0, 0, 1 / 3, 0], [0, 0, 0, 0]]))
    w = aggregation_weights(RAGGED, "constant")
    torch.testing.assert_close(w, RAGGED / 12)
    w = aggregation_weights(RAGGED.bool(), "constant", num_sequences=6, max_len=6)
    torch.testing.assert_close(w, RAGGED / 36)
    w = aggregation_weights(RAGGED, "token_mean", num_tokens=10)
    torch.testing.assert_close(w, RAGGED / 10)


@pytest.mark.parametrize(
    "mode, expected",
    [
        # surrogate per token is -A_i (rho = 1, no IS, no KL); A = [1, -2, 5].
        ("token_mean", -(3 * 1 + 1 * -2) / 4),  # all tokens equal: -0.25
        ("seq_mean", -(1 + -2 + 0) / 3),  # per-sequence means, then mean over 3 rows: 1/3
        ("constant", -(3 * 1 + 1 * -2) / (3 * 4)),  # / (num_sequences * T): -1/12
    ],
)
def test_aggregation_end_to_end(mode, expected):
    logp = torch.randn(3, 4, requires_grad=True)
    old = logp.detach()
    loss, stats = grpo_loss(
        logp, old, old, None, t([1.0, -2.0, 5.0]), RAGGED, aggregation_weights(RAGGED, mode),
        objective_settings(kl_coeff=0.0),
    )
    assert loss.item() == pytest.approx(expected)
    assert stats["tokens"].item() == 4


def test_aggregation_bad_args():
    with pytest.raises(ValueError, match="aggregation must be one of"):
        aggregation_weights(RAGGED, "sum")
    with pytest.raises(ValueError, match="num_sequences"):
        aggregation_weights(RAGGED, "seq_mean", num_sequences=2)
    with pytest.raises(ValueError, match="max_len"):
        aggregation_weights(RAGGED, "constant", max_len=0)
    with pytest.raises(ValueError, match="num_tokens"):
        aggregation_weights(RAGGED, "token_mean", num_tokens=-1)


def _random_batch(B=6, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [5, 1, 0, 3, 6, 2][:B]
    mask = torch.zeros(B, T)
    for i, n in enumerate(lens):
        mask[i, T - n :] = 1.0
    old = -torch.rand(B, T, generator=g) * 3
    logp = old + 0.3 * torch.randn(B, T, generator=g)  # some tokens clip with eps 0.2
    mu = old + 0.5 * torch.randn(B, T, generator=g)  # some IS weights truncate at 2
    ref = old + 0.2 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    return logp, old, mu, ref, adv, mask


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_micro_batches_add_up_to_whole_batch(mode):
    logp, old, mu, ref, adv, mask = _random_batch()
    cfg = objective_settings(clip_high=0.28, kl_coeff=0.1)
    full_logp = logp.clone().requires_grad_()
    full, full_stats = grpo_loss(full_logp, old, mu, ref, adv, mask, aggregation_weights(mask, mode), cfg)
    full.backward()

    glob = dict(num_sequences=6, num_tokens=mask.sum(), max_len=7)
    split_logp = logp.clone().requires_grad_()
    total, naive, stats = 0.0, 0.0, {}
    for sl in (slice(0, 3), slice(3, 6)):
        part, s = grpo_loss(
            split_logp[sl], old[sl], mu[sl], ref[sl], adv[sl], mask[sl],
            aggregation_weights(mask[sl], mode, **glob), cfg,
        )
        local, _ = grpo_loss(
            logp[sl], old[sl], mu[sl], ref[sl], adv[sl], mask[sl], aggregation_weights(mask[sl], mode), cfg
        )
        total, naive, stats = total + part, naive + local, merge_stats(stats, s)
    total.backward()

    torch.testing.assert_close(total, full)
    torch.testing.assert_close(split_logp.grad, full_logp.grad)
    assert abs(naive.item() - full.item()) > 1e-4  # local counts would be wrong: the check can fail
    for k, v in full_stats.items():
        torch.testing.assert_close(torch.as_tensor(stats[k]), v, msg=k)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_masked_tokens_get_zero_gradient_even_with_garbage(mode):
    logp, old, mu, ref, adv, mask = _random_batch()
    pad = mask == 0
    # Garbage at prompt/padding positions, as some generators fill them.
    logp = logp.masked_fill(pad, 100.0).requires_grad_()  # exp(100) overflows float32
    old = old.masked_fill(pad, float("-inf"))
    mu = mu.masked_fill(pad, float("nan"))
    ref = ref.masked_fill(pad, float("inf"))
    w = aggregation_weights(mask, mode)
    loss, stats = grpo_loss(logp, old, mu, ref, adv, mask, w, objective_settings(kl_coeff=0.1))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(torch.as_tensor(v)) for v in stats.values())
    assert torch.isfinite(logp.grad).all()
    assert torch.equal(logp.grad[pad], torch.zeros(int(pad.sum())))
    assert (logp.grad[~pad] != 0).any()


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_adds_nothing_when_ref_equals_policy(estimator):
    logp, old, mu, _, adv, mask = _random_batch()
    w = aggregation_weights(mask, "token_mean")
    base_logp = logp.clone().requires_grad_()
    base, _ = grpo_loss(base_logp, old, mu, None, adv, mask, w, objective_settings(kl_coeff=0.0))
    kl_logp = logp.clone().requires_grad_()
    cfg = objective_settings(kl_coeff=0.5, kl_estimator=estimator)
    with_kl, stats = grpo_loss(kl_logp, old, mu, logp.detach(), adv, mask, w, cfg)
    assert with_kl.item() == base.item()
    assert stats["kl_sum"].item() == 0.0
    if estimator != "k1":  # k1 = logp - ref has gradient 1 even at 0; k2, k3 are flat there
        base.backward()
        with_kl.backward()
        torch.testing.assert_close(kl_logp.grad, base_logp.grad)


def test_kl_term_is_not_zero_when_ref_differs():
    logp, old, mu, ref, adv, mask = _random_batch()
    w = aggregation_weights(mask, "token_mean")
    base, _ = grpo_loss(logp, old, mu, None, adv, mask, w, objective_settings(kl_coeff=0.0))
    with_kl, _ = grpo_loss(logp, old, mu, ref, adv, mask, w, objective_settings(kl_coeff=0.5))
    assert with_kl.item() > base.item()  # k3 >= 0 and > 0 where ref != logp


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_no_nan_with_zero_length_rows(mode):
    mask = t([[0, 0, 0], [0, 1, 1], [0, 0, 0]])
    logp = torch.randn(3, 3, requires_grad=True)
    loss, stats = grpo_loss(
        logp, logp.detach(), logp.detach(), None, t([1.0, 2.0, 3.0]), mask, aggregation_weights(mask, mode),
        objective_settings(kl_coeff=0.0),
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert logp.grad[0].abs().sum() == 0 and logp.grad[2].abs().sum() == 0
    # A batch with no completion tokens at all: loss 0, gradient 0, finite stats.
    empty = torch.zeros(2, 3)
    logp = torch.randn(2, 3, requires_grad=True)
    loss, stats = grpo_loss(
        logp, logp.detach(), logp.detach(), logp.detach(), t([1.0, -1.0]), empty,
        aggregation_weights(empty, mode), objective_settings(kl_coeff=0.1),
    )
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros(2, 3))
    assert all(v == 0.0 for v in finalize_stats(stats).values())


def test_grpo_loss_shape_errors():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(z, z, z, None, torch.zeros(2, 1), z, z, objective_settings(kl_coeff=0.0))
    with pytest.raises(ValueError, match="mu_logp"):
        grpo_loss(z, z, torch.zeros(2, 4), None, torch.zeros(2), z, z, objective_settings(kl_coeff=0.0))


def test_config_reports_every_error_at_once():
    """The loss's settings are checked once, by the config, every problem reported together."""
    from qgrpo.cluster.config.schema import ConfigError, load_config
    from tests.helpers import TINY

    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["algo.clip_low=1.5", "algo.kl_estimator='k4'", "algo.is_mode='clip'", "algo.is_cap=0.5",
                           "algo.kl_coeff=-1.0"], check_environment=False)
    msg = str(err.value)
    for needle in ("algo.clip_low", "algo.kl_estimator", "algo.is_mode", "algo.is_cap", "algo.kl_coeff",
                   "truncate, mask, reject or none", "5 problems"):
        assert needle in msg


# ---------------------------------------------------------------- mismatch and stats


def test_mismatch_stats_hand_values():
    mask = t([[0, 1, 1], [0, 1, 0]])
    mu = torch.randn(2, 3)
    old = mu + t([[100.0, 1.0, -0.5], [-100.0, 0.0, 7.0]])  # masked positions hold extreme values
    s = mismatch_stats(old, mu, mask)
    assert s["log_ratio_sum"].item() == pytest.approx(0.5, abs=1e-5)
    assert s["log_ratio_max"].item() == pytest.approx(1.0, abs=1e-5)
    assert s["log_ratio_min"].item() == pytest.approx(-0.5, abs=1e-5)
    # r - 1 - log r with r = e, e^-0.5, 1.
    expected_kl = (E - 2.0) + (math.exp(-0.5) - 0.5) + 0.0
    assert s["kl_mu_old_sum"].item() == pytest.approx(expected_kl, abs=1e-5)


def test_finalize_stats_keys_and_values():
    # Two rows, one completion token each: row 0 clips high (rho = e, A = 1), row 1 clips low (rho = 1/e, A = -1).
    # old - mu = [1, -0.5]: w_is = [2 (truncated from e), e^-0.5]. ref = logp: kl 0.
    mask = t([[0, 1], [0, 1]])
    old = t([[0.0, -1.0], [0.0, -2.0]])
    logp = old + t([[0.0, 1.0], [0.0, -1.0]])
    mu = old - t([[0.0, 1.0], [0.0, -0.5]])
    _, stats = grpo_loss(logp, old, mu, logp, t([1.0, -1.0]), mask, mask / 2, objective_settings(kl_coeff=0.1))
    out = finalize_stats(stats)
    assert set(out) == {
        "tokens", "clip_frac_low", "clip_frac_high", "kl", "is_weight_mean", "is_capped_frac",
        "mismatch/log_ratio_mean", "mismatch/log_ratio_max", "mismatch/log_ratio_min", "mismatch/kl_mu_old",
        "mismatch/truncated_token_frac", "mismatch/truncated_seq_frac", "mismatch/masked_token_frac",
        "mismatch/masked_seq_frac", "mismatch/ess", "mismatch/offpolicy_masked_seq_frac", "entropy/masked_token_frac",
    }
    assert all(isinstance(v, float) for v in out.values())
    expected = {
        "tokens": 2.0,
        "clip_frac_low": 0.5,
        "clip_frac_high": 0.5,
        "kl": 0.0,
        "is_weight_mean": (2.0 + math.exp(-0.5)) / 2,
        "is_capped_frac": 0.5,
        "mismatch/log_ratio_mean": 0.25,
        "mismatch/log_ratio_max": 1.0,
        "mismatch/log_ratio_min": -0.5,
        "mismatch/kl_mu_old": ((E - 2.0) + (math.exp(-0.5) - 0.5)) / 2,
        "mismatch/truncated_token_frac": 0.5,
        "mismatch/truncated_seq_frac": 0.5,
        "mismatch/masked_token_frac": 0.0,
        "mismatch/masked_seq_frac": 0.0,
        # weights 2 and e^-0.5: (2 + e^-0.5)^2 / (2 (4 + e^-1))
        "mismatch/ess": (2.0 + math.exp(-0.5)) ** 2 / (2 * (4.0 + math.exp(-1.0))),
        "mismatch/offpolicy_masked_seq_frac": 0.0,
        "entropy/masked_token_frac": 0.0,
    }
    for k, v in expected.items():
        assert out[k] == pytest.approx(v, abs=1e-6), k


def test_merge_stats_combines_max_and_min():
    a = {"tokens": torch.tensor(2.0), "log_ratio_max": torch.tensor(0.5), "log_ratio_min": torch.tensor(-0.1)}
    b = {"tokens": torch.tensor(3.0), "log_ratio_max": torch.tensor(0.2), "log_ratio_min": torch.tensor(-0.4)}
    m = merge_stats(merge_stats({}, a), b)
    assert m["tokens"].item() == 5.0
    assert m["log_ratio_max"].item() == 0.5
    assert m["log_ratio_min"].item() == pytest.approx(-0.4)
