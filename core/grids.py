"""The uniform grids that weight-only quantized formats round onto, emulated in float32, so that a rollout actor can
choose each weight's code itself (stochastic rounding, error feedback) and count the codes an update changed.

A grid holds one scale per row of a [out_features, in_features] weight, or per group of `group` consecutive weights
along a row. Two families:

- symmetric: scale = absmax / divisor, value(q) = q * scale, q in [qmin, qmax]. torchao's int8 weight-only
  (``Int8WeightOnlyConfig``: ``choose_qparams_affine`` SYMMETRIC over [-128, 127], i.e. divisor 127.5, per row) and
  the int8 this project writes for vLLM (``rollout.quant.int8_per_channel``: divisor 127, q in [-127, 127]).
- affine: scale = (max - min) / (qmax - qmin), value(q) = min + q * scale. torchao's int4 in both its layouts (CPU
  opaque, CUDA tile-packed) chooses "tinygemm" parameters: zero = min + 8 scale and value(q) = (q - 8) scale + zero,
  which is the same grid, q in [0, 15], per group along in_features.

A backend computes the grid again from the weights it is handed, and rounds to nearest. So a weight can be given the
code chosen here by handing over the grid point itself (`handed`): the grid's setters (each row's absmax, each group's
min and max) are handed over unchanged, so the backend finds the same scale and offset; every other weight lies on a
grid point, half a step from either rounding boundary, where differences of the emulation (torchao's int4 computes
its scale and zero in bf16: relative 2^-9) cannot change the code. tests/test_requantize.py checks the codes the
torchao layers really store, and the int8 that vLLM is given.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROUNDINGS = ("nearest", "stochastic")


@dataclass(frozen=True)
class Grid:
    family: str  # "symmetric" or "affine"
    qmin: int
    qmax: int
    group: int = 0  # weights per group along a row; 0 = the whole row
    divisor: float = 0.0  # symmetric: scale = absmax / divisor
    eps: float = 1e-6  # the smallest scale (a constant row or group)
    dtype: torch.dtype = torch.float32  # the dtype the backend computes scale and offset in (torchao: the weight's)

    def __post_init__(self):
        if self.family not in ("symmetric", "affine"):
            raise ValueError(f"Grid.family must be 'symmetric' or 'affine', got {self.family!r}")
        if self.family == "symmetric" and self.divisor <= 0:
            raise ValueError("a symmetric Grid needs divisor > 0")

    @property
    def inner(self) -> tuple[int, int]:
        """The codes a weight that does not set the grid may take: a symmetric grid's codes beyond +-divisor would
        stand for a value larger than the absmax (torchao int8's -128 is -128/127.5 absmax) and move the scale."""
        if self.family == "symmetric":
            d = math.floor(self.divisor)
            return max(self.qmin, -d), min(self.qmax, d)
        return self.qmin, self.qmax

    def fits(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == 2 and (not self.group or shape[1] % self.group == 0)


@dataclass
class Encoded:
    """Codes of one weight on its grid, the grid's parameters, and which weights set them."""

    codes: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, n_groups, 1]
    offset: torch.Tensor  # float32 [N, n_groups, 1] (0 for a symmetric grid)
    setters: torch.Tensor  # bool [N, K]


def _grouped(grid: Grid, w: torch.Tensor) -> torch.Tensor:
    if not grid.fits(tuple(w.shape)):
        raise ValueError(f"a weight of shape {tuple(w.shape)} does not fit a grid of group {grid.group}")
    return w.reshape(w.shape[0], -1, grid.group or w.shape[1])


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bits as integers of its element size (a view): comparing those takes a fraction of a bf16 comparison's
    time on a CPU."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def parameters(grid: Grid, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale, offset [N, n, 1] float32, setters bool [N, n, g], x [N, n, g]) of a weight grouped [N, n, g]: x is
    (w - offset) / scale as the backend computes it before rounding to nearest. The same torch operations as the
    backend, in `grid.dtype` (torchao computes its int8 scales, and its int4 scales, zeros and x, in the weight's
    bf16)."""
    v = w.to(grid.dtype)
    if grid.family == "symmetric":
        a = v.abs()
        amax = a.amax(-1, keepdim=True)
        scale = (amax / grid.divisor).clamp(min=grid.eps).float()
        # setters: |w| == absmax, compared as the bits of non-negative numbers (equal values, equal bits)
        return scale, torch.zeros_like(scale), bits(a) == bits(amax), w.float() / scale
    lo, hi = v.amin(-1, keepdim=True), v.amax(-1, keepdim=True)
    scale = ((hi - lo) / (grid.qmax - grid.qmin)).clamp(min=grid.eps)
    mid = (grid.qmax + grid.qmin + 1) / 2  # torchao's tinygemm zero: min + mid * scale, value = (q - mid) scale + zero
    zero = lo + scale * mid
    x = ((v - (zero - scale * mid)) / scale).float()
    return scale.float(), zero.float() - mid * scale.float(), (v == lo) | (v == hi), x


def encode(grid: Grid, w: torch.Tensor, rounding: str = "nearest", generator: torch.Generator | None = None,
           frame: torch.Tensor | None = None) -> Encoded:
    """The code of every weight of `w` [N, K] (any float dtype).

    nearest: round((w - offset) / scale) as the backend computes it. stochastic: floor(x + u) with x in float32 and
    u ~ U[0, 1) drawn from `generator`, so E[value(q)] = w for a weight inside the grid (x - floor(x) is the chance of
    rounding up). The grid is computed from `frame` when given (the weights the backend will see: error feedback hands
    over bf16(w + residual) at the setters), else from `w`. Setters always take the nearest code the backend gives
    them; the other weights are kept inside `grid.inner`.
    """
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    seen = _grouped(grid, frame if frame is not None else w)
    scale, offset, setters, x_seen = parameters(grid, seen)
    at_setters = torch.round(x_seen[setters]).clamp_(grid.qmin, grid.qmax)
    if frame is None and rounding == "nearest":
        q = x_seen.round_()  # x_seen is parameters' own temporary: rounded in place (a sync encodes ~100M weights)
    else:
        x = (_grouped(grid, w.float()) - offset) / scale
        q = torch.round(x) if rounding == "nearest" else \
            torch.floor(x + torch.rand(x.shape, generator=generator, dtype=x.dtype))
    lo, hi = grid.inner
    q = q.clamp_(lo, hi).masked_scatter_(setters, at_setters)  # both in the mask's row-major order
    return Encoded(q.to(torch.int8).reshape(w.shape), scale, offset, setters.reshape(w.shape))


def decode(grid: Grid, enc: Encoded) -> torch.Tensor:
    """float32 [N, K]: value(q) = offset + q * scale."""
    q = _grouped(grid, enc.codes.float())  # a new tensor: scaled in place
    return q.mul_(enc.scale).add_(enc.offset).reshape(enc.codes.shape)


def handed(grid: Grid, frame: torch.Tensor, enc: Encoded, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The tensor to hand the backend so that its round-to-nearest stores `enc.codes`: the setters' own values (from
    `frame`, the weights the grid was computed from), every other weight its grid point."""
    return torch.where(enc.setters, frame.to(dtype), decode(grid, enc).to(dtype))
