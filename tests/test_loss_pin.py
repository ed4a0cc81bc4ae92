"""The loss is the same function of its inputs as before the objective moved to learner/objective/: on fixed batches,
for each policy loss and each correction, mask and aggregation, the loss value, its gradients and its logged
statistics equal those the loss gave before the move (tests/data/loss_pin.json, written by the old code), within
float32 rounding (rtol 1e-5, atol 1e-7: the same arithmetic, on another CPU's vector width)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from qgrpo.learner.objective.loss import aggregation_weights, finalize_stats, grpo_loss, merge_stats
from qgrpo.learner.objective.settings import objective_settings

CASES = json.loads((Path(__file__).parent / "data" / "loss_pin.json").read_text())["cases"]


def _batch(seed: int) -> tuple[torch.Tensor, ...]:
    """The batch the pinned values were computed on: 6 sequences of 9 positions, ragged completion masks."""
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 9
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mu = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp + 0.25 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    ent = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    mask = torch.zeros(B, T)
    for i in range(B):
        mask[i, 2 + i % 3: T - (i % 2)] = 1
    return logp.float(), old.float(), mu.float(), ref.float(), adv.float(), mask, ent.float()


def _close(got: float, want: float) -> bool:
    return not math.isnan(got) and math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-7)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['settings']}-seed{c['seed']}")
def test_loss_equal_to_before_the_move(case):
    cfg = objective_settings(**case["settings"])
    logp, old, mu, ref, adv, mask, ent = _batch(case["seed"])
    logp.requires_grad_(True)
    ent.requires_grad_(True)
    w = aggregation_weights(mask, cfg.loss_agg, max_len=9)
    loss, stats = grpo_loss(logp, old, mu, ref, adv, mask, w, cfg, entropy=ent)
    loss.backward()
    assert _close(loss.item(), case["loss"]), (loss.item(), case["loss"])
    for got, want in zip(logp.grad.double().flatten().tolist(), case["grad_logp"], strict=True):
        assert _close(got, want), (got, want)
    if case["grad_entropy"] is None:
        assert ent.grad is None
    else:
        for got, want in zip(ent.grad.double().flatten().tolist(), case["grad_entropy"], strict=True):
            assert _close(got, want), (got, want)
    got_stats = finalize_stats(merge_stats({}, stats))
    assert sorted(got_stats) == sorted(case["stats"])
    for key, want in case["stats"].items():
        assert _close(got_stats[key], want), (key, got_stats[key], want)
