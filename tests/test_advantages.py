"""Group advantages: hand-computed values, constant groups, looped vs vectorised, input errors."""

import math
import statistics

import pytest
import torch

from qgrpo.learner.objective.advantages import group_advantages


def test_std_hand_computed():
    # Row 0: mean 2, unbiased std sqrt((1+0+1)/2) = 1 -> [-1, 0, 1] (a biased std, sqrt(2/3), would give +-1.22).
    # Row 1: mean 5, deviations [-3, -1, 4], unbiased var (9+1+16)/2 = 13.
    r = torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 9.0]])
    adv = group_advantages(r, scale="std", eps=0.0)
    s13 = math.sqrt(13.0)
    expected = torch.tensor([[-1.0, 0.0, 1.0], [-3 / s13, -1 / s13, 4 / s13]])
    assert adv.dtype == torch.float32 and adv.shape == (2, 3)
    torch.testing.assert_close(adv, expected)


def test_std_eps_is_added_to_std():
    r = torch.tensor([[1.0, 2.0, 3.0]])  # std exactly 1
    adv = group_advantages(r, scale="std", eps=0.5)
    torch.testing.assert_close(adv, torch.tensor([[-1 / 1.5, 0.0, 1 / 1.5]]))


def test_none_hand_computed():
    r = torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 9.0]])
    adv = group_advantages(r, scale="none")
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 0.0, 1.0], [-3.0, -1.0, 4.0]]))


def test_integer_and_binary_rewards():
    # [0, 1]: mean 0.5, unbiased std sqrt(0.5) -> -+ 0.5 / sqrt(0.5) = -+ sqrt(0.5).
    adv = group_advantages(torch.tensor([[0, 1]]), eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([[-math.sqrt(0.5), math.sqrt(0.5)]]))


@pytest.mark.parametrize("scale", ["std", "none"])
@pytest.mark.parametrize("eps", [1e-6, 0.0])
@pytest.mark.parametrize(
    "row",
    [[5.0] * 4, [0.0] * 8, [0.1] * 8, [0.1] * 3, [0.7] * 6, [-1e6] * 2],
)
def test_constant_group_is_exactly_zero(scale, eps, row):
    r = torch.tensor([row], dtype=torch.float64)
    adv = group_advantages(r, scale=scale, eps=eps)
    assert torch.isfinite(adv).all()
    assert torch.equal(adv, torch.zeros_like(adv, dtype=torch.float32))


def test_constant_group_zero_is_not_luck():
    # Precondition that makes the test above meaningful: in float64, 0.1 * 3 minus its mean is not 0, and with
    # eps=0 dividing by the tiny std would give O(1) garbage.
    r = torch.tensor([[0.1] * 3], dtype=torch.float64)
    assert (r - r.mean(dim=1, keepdim=True)).abs().max() > 0
    assert torch.equal(group_advantages(r, eps=0.0), torch.zeros(1, 3))


def test_mixed_batch_constant_and_varied_groups():
    r = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0], [0.1, 0.1, 0.1, 0.1]], dtype=torch.float64)
    adv = group_advantages(r, eps=0.0)
    # Row 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3) -> +- 0.5 * sqrt(3) = +- sqrt(3)/2.
    h = math.sqrt(3.0) / 2
    torch.testing.assert_close(adv, torch.tensor([[0.0] * 4, [-h, h, -h, h], [0.0] * 4]))
    assert torch.equal(adv[0], torch.zeros(4)) and torch.equal(adv[2], torch.zeros(4))


def _looped(rewards: list[list[float]], scale: str, eps: float) -> list[list[float]]:
    out = []
    for group in rewards:
        if all(x == group[0] for x in group):
            out.append([0.0] * len(group))
            continue
        mu = statistics.mean(group)
        div = statistics.stdev(group) + eps if scale == "std" else 1.0
        out.append([(x - mu) / div for x in group])
    return out


@pytest.mark.parametrize("scale", ["std", "none"])
def test_looped_matches_vectorised(scale):
    g = torch.Generator().manual_seed(0)
    r = torch.randn(32, 8, generator=g, dtype=torch.float64)
    r[::5] = torch.randint(0, 3, (1,), generator=g).double()  # some constant groups
    r[1::7] = torch.randint(0, 2, (5, 8), generator=g).double()  # binary rewards, as from a verifier
    expected = torch.tensor(_looped(r.tolist(), scale, 1e-6), dtype=torch.float32)
    torch.testing.assert_close(group_advantages(r, scale=scale, eps=1e-6), expected)


@pytest.mark.parametrize(
    "rewards, kwargs, match",
    [
        (torch.zeros(4), {}, "2-D"),
        (torch.zeros(2, 3, 4), {}, "2-D"),
        (torch.zeros(3, 1), {}, "group_size"),
        (torch.tensor([[0.0, float("nan")]]), {}, "finite"),
        (torch.tensor([[0.0, 1.0], [float("inf"), 1.0]]), {}, r"finite.*rewards\[1, 0\]"),
        (torch.zeros(2, 2), {"scale": "mad"}, "scale must be one of"),
        (torch.zeros(2, 2), {"eps": -1e-3}, "eps"),
        (torch.zeros(2, 2), {"eps": float("nan")}, "eps"),
    ],
)
def test_errors(rewards, kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, **kwargs)
