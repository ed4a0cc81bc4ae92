"""Quantization-aware learning (``learner.fake_quant = "rollout"``): the learner's linear layers compute with their
weights rounded onto the rollout generators' grid (core/grids.py), so the policy being optimised, pi_theta, is the
one the generators sample from; the gradient passes straight through the rounding to the bf16 weights (the
straight-through estimator: d(fq(w))/dw = 1), which stay the learner's and are what a sync sends.

The rounding is the generators' own round-to-nearest (the codes the tests check against torchao's and the int8 handed
to vLLM). With ``sync.requantize = "stochastic"`` or ``"error_feedback"`` the generators serve other codes than
these, so there pi_old and mu differ again by the actor's rounding. Follows NeMo-RL's QARL, verl's NVFP4 QAT and
slime's INT4 QAT, which train with the rollout format simulated in the forward pass.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from qgrpo.core.grids import Grid, decode, encode


def fake_quantize(w: torch.Tensor, grid: Grid) -> torch.Tensor:
    """`w` rounded to nearest on `grid` in the forward pass, the identity in the backward pass."""
    with torch.no_grad():
        q = decode(grid, encode(grid, w.detach())).to(w.dtype)
    return q + (w - w.detach())  # exactly q forward (w - w is 0), gradient 1 to w


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, fake_quantize(self.weight, self._qgrpo_grid), self.bias)


def fake_quant_layers(model: nn.Module, grid: Grid, head: bool, tied_head: bool = False) -> list[str]:
    """Make the model's plain nn.Linear layers compute with fake-quantized weights, in place: those whose weight fits
    the grid, the output head only when `head` (the torch generator quantizes an untied head, vLLM's int8 never), and
    a head tied to the input embedding only when `tied_head` (the torch generator's quantize_head: the head's product
    then computes with the rounded shared weight, the embedding lookup with the weight itself). Returns the layers'
    names."""
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = out is not None and emb is not None and out.weight is emb.weight
    names = []
    for name, m in model.named_modules():
        if type(m) is not nn.Linear or not grid.fits(tuple(m.weight.shape)):
            continue
        if m is out and ((tied and not tied_head) or (not tied and not head)):
            continue
        m._qgrpo_grid = grid
        m.forward = types.MethodType(_forward, m)
        names.append(name)
    return names
