"""The learner's optimizer: torch's AdamW (or bitsandbytes' 8-bit one) with a guard that can refuse a step, bf16
weights over fp32 masters for a learner that computes in fp32 (model.compute_dtype), and the LR schedule that
advances only with steps really taken. DeepSpeed calls `step` at the accumulation boundary (learner/engine.py)."""
from __future__ import annotations

import math

import torch

from qgrpo.core.devices import collective_device


class OptimizerGuard:
    """A mixin for an optimizer that can refuse a step. DeepSpeed calls it on the fp32 master weights at the
    accumulation boundary; when `veto` is set, or any gradient on any rank is non-finite, it returns without touching
    weights or moments, so the bf16 weights DeepSpeed copies back from the masters are bit-identical. The decision is
    all-reduced, so every rank takes it together. `applied` says whether the last boundary really stepped."""

    veto: str = ""
    enabled: bool = True
    applied: bool = False
    reason: str = ""

    @torch.no_grad()
    def step(self, closure=None):
        if not self.enabled:
            self.applied = True
            return super().step(closure)
        # On the device the process group serves (NCCL: CUDA only), even at world size 1.
        bad = torch.tensor([0.0 if self.veto else 1.0], device=collective_device())
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        # One pass over every gradient (per-tensor norms in one foreach call): the total norm is finite exactly when
        # every gradient is (a per-tensor isfinite().all() was ~3 x 272 small operators a step on SmolLM2-135M).
        if not self.veto and grads and not torch.isfinite(torch.nn.utils.get_total_norm(grads, foreach=True)):
            bad[0] = 0.0
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MIN)
        if bad.item() < 1.0:
            self.applied, self.reason = False, self.veto or "grad_norm"
            return None
        self.applied, self.reason = True, ""
        return super().step(closure)


class Bf16Weights:
    """A mixin that gives an fp32 learner the bf16 learner's weights: the tensors it steps on (the model's, or ZeRO's
    partitions of them) hold bf16 values in fp32, and their unrounded fp32 masters live here, as DeepSpeed's bf16 mode
    keeps bf16 weights and fp32 masters. Without it an fp32 learner is another algorithm at the same learning rate:
    an Adam step of lr 1e-5 moves every weight, where in bf16 most such steps round away until the master has moved
    half a bf16 spacing (measured on the default job: KL to the reference 2.2 at step 3 and held-out accuracy 9 -> 15%
    in fp32 without it, against 9 -> 71% in bf16). Off (`round_weights` False) it changes nothing. The masters are
    part of the optimizer's state dict (checkpoints), as "bf16_masters"."""

    round_weights: bool = False

    def _masters(self) -> dict:
        if not hasattr(self, "_master_of"):
            self._master_of = {}
        return self._master_of

    @torch.no_grad()
    def step(self, closure=None):
        if not self.round_weights:
            return super().step(closure)
        masters, held = self._masters(), []
        for group in self.param_groups:
            for p in group["params"]:
                held.append((p, p.data))
                p.data = masters.setdefault(p, p.data.clone())  # the first master: the bf16 values it starts from
        try:
            return super().step(closure)
        finally:
            for p, w in held:
                masters[p] = p.data
                w.copy_(p.data.to(torch.bfloat16))  # round to bf16, held in fp32
                p.data = w

    def state_dict(self):
        out = super().state_dict()
        if self.round_weights:
            order = [p for g in self.param_groups for p in g["params"]]
            out["bf16_masters"] = [self._masters().get(p, p.data).clone() for p in order]
        return out

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        saved = state_dict.pop("bf16_masters", None)
        super().load_state_dict(state_dict)
        if self.round_weights and saved is not None:
            order = [p for g in self.param_groups for p in g["params"]]
            self._masters().update({p: m.to(p.device, p.dtype) for p, m in zip(order, saved)})


class GuardedAdamW(OptimizerGuard, Bf16Weights, torch.optim.AdamW):
    """torch's AdamW with the guard (and bf16 weights over fp32 masters when asked)."""


def guarded_optimizer(kind: str, params, round_weights: bool = False, **kwargs) -> OptimizerGuard:
    """learner.optimizer: "adamw" (torch) or "adamw8bit" (bitsandbytes' blockwise 8-bit moments; tensors under 4,096
    elements keep 32-bit moments, as bitsandbytes does), both with the guard. `round_weights`: an fp32 learner's
    weights are kept at bf16 values over fp32 masters (Bf16Weights)."""
    if kind == "adamw8bit":
        import bitsandbytes as bnb

        cls = type("GuardedAdamW8bit", (OptimizerGuard, Bf16Weights, bnb.optim.AdamW8bit), {})
        opt = cls(params, **kwargs)
    else:
        params = list(params)
        # torch's fused AdamW (one kernel over all tensors, CPU and CUDA) where every tensor allows it: the default
        # single-tensor loop runs ~10 operators per tensor, 4-5x slower on SmolLM2-135M's 272 (bench/learner_ops.py).
        fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
        opt = GuardedAdamW(params, fused=fused, **kwargs)
    opt.round_weights = round_weights
    return opt


def lr_factor(update: int, warmup_steps: int, schedule: str = "constant", total_updates: int = 0) -> float:
    """The learning rate of optimizer update `update` (0-based) over the configured lr: a linear warm-up ramp
    ((update + 1) / warmup_steps, up to 1), times 1 ("constant") or, for "cosine", (1 + cos(pi * update / total)) / 2,
    which decays towards 0 at the last update (MLX-GRPO's cosine_decay times its warm-up)."""
    warm = min(1.0, (update + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    if schedule == "cosine" and total_updates > 0:
        return warm * 0.5 * (1.0 + math.cos(math.pi * min(update, total_updates) / total_updates))
    return warm


class GuardedLambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """The LR schedule advances only with optimizer steps that were really taken."""

    def step(self, epoch=None):
        if getattr(self.optimizer, "applied", True) or self.last_epoch < 0:
            super().step(epoch)
