"""What a rollout actor does with the bf16 weights of a sync before its generator re-quantizes them
(``sync.requantize``), and whether its quantized copy follows the learner at all (update visibility).

At the learning rates RL uses, one step changes a weight by far less than a step of an int8 or int4 grid, so a
generator that rounds every received weight to nearest keeps most of its codes from sync to sync (QuRL, ICLR 2026).
Three modes, each on the grid the generator's own format rounds onto (core/grids.py), which the caller passes in: its
backend's spec declares it (rollout/backends: `served_grid`), so this module needs nothing of the backends built on it.

- ``nearest``: the weights are handed over as received; the backend rounds to nearest (what every backend does).
- ``stochastic``: each weight's code is floor(w / scale + u), u ~ U[0, 1), so the served value is w in expectation
  (unbiased) and a small update moves a code with a chance proportional to its size. The draws are seeded by the
  weight version and the tensor's name: every actor serves the same model, and a version re-sent is re-served
  identically.
- ``error_feedback``: the actor keeps each weight's rounding residual r = (w + r_prev) - served and adds it to the
  next version before rounding to nearest: updates too small for a code accumulate until they move one, and the
  served weights' running sum stays within a grid step of the received ones' (the drift is bounded by the residual,
  at most half a step). Costs 4 bytes per quantized weight in the actor; a restarted actor starts again from zero.

Visibility, measured at every sync against the previous version over the quantized weights (`Requantizer.stats`):
``code_change_frac`` (share of codes changed), ``bf16_change_frac`` (share of received bf16 weights changed) and
``update_norm_ratio`` = ||dq|| / ||dw|| with dq = served_new - served_old and dw = w_new - w_old (0 when the
generator stands still; above 1 when codes move by whole steps where the bf16 weights moved by less), and
``update_projection`` = <dq, dw> / ||dw||^2, the share of the bf16 update the served weights took up along its
direction (1: they follow it, 0: they stand still). NaN when nothing changed. The previous version's codes and bf16
weights are kept: 3 bytes per measured weight in each actor.

In ``nearest`` mode the weights are handed over untouched and only measured, so the measurement may be a sample:
every ``row_stride``-th row of each quantized tensor (the actor's: VISIBILITY_ROW_STRIDE), closer where that would
leave fewer than VISIBILITY_MIN_ROWS rows (a small model's tensors are measured whole). A grid's scales are per row
or per group along a row, so a row's codes do not depend on the other rows: the sampled rows' codes are exactly the
served ones, and the shares and ratios are estimates over a fixed, evenly spread set of rows. Measured in full, the
rounding and comparison ran on the actor's CPU over every weight: 8.8 s of each sync of a 1.5B model's int8 rollouts
on a 16-core GPU machine (bench/published/gpu_step.json), while the step's generation took 0.2 s. The other two modes
change the served weights and always round every weight.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Iterable

import torch

from qgrpo.core.grids import Encoded, Grid, bits, decode, encode, handed
from qgrpo.rollout.options import REQUANTIZE_MODES

VISIBILITY_KEYS = ("code_change_frac", "bf16_change_frac", "update_norm_ratio", "update_projection")
VISIBILITY_ROW_STRIDE = 32  # nearest: every 32nd row of each quantized tensor is measured
VISIBILITY_MIN_ROWS = 64  # ... but at least this many rows of it (all of them where it has fewer)


@dataclass
class _Kept:
    """One quantized tensor as last served: its received bf16 weights, codes and grid, and the residual."""

    weight: torch.Tensor  # bf16, as received
    codes: Encoded  # setters dropped (decode needs codes, scale and offset only)
    residual: torch.Tensor | None  # float32, error_feedback only


@dataclass
class Prepared:
    """A sync's tensors to hand the generator, and the state that becomes the actor's once they are loaded."""

    tensors: list[tuple[str, torch.Tensor]]
    kept: dict[str, _Kept]
    stats: dict[str, float] = field(default_factory=dict)


class Requantizer:
    def __init__(self, mode: str, grids: dict[str, Grid], initial: Iterable[tuple[str, torch.Tensor]] = (),
                 row_stride: int = 1):
        """`grids`: the generator's quantized tensors by name; `initial`: their weights as the generator loaded them
        (visibility from the first sync on, and error feedback's first residual); may be empty. `row_stride`: in
        nearest mode, measure every row_stride-th row only (the module doc); the other modes round every row."""
        if mode not in REQUANTIZE_MODES:
            raise ValueError(f"sync.requantize must be one of {REQUANTIZE_MODES}, got {mode!r}")
        if mode != "nearest" and not grids:
            raise ValueError(f"sync.requantize = {mode!r}: this generator's format has no emulated grid (its backend's "
                             "spec says which formats have one: BackendSpec.grids); set sync.requantize = \"nearest\"")
        if row_stride < 1:
            raise ValueError(f"row_stride must be >= 1, got {row_stride}")
        self.mode, self.grids = mode, grids
        self.stride = row_stride if mode == "nearest" else 1
        self.kept: dict[str, _Kept] = {}
        for name, w in initial:
            if name in grids and grids[name].fits(tuple(w.shape)):
                w = self._rows(w.to(torch.bfloat16))
                self.kept[name] = self._kept(name, w, encode(grids[name], w), w.float())

    def _rows(self, w: torch.Tensor) -> torch.Tensor:
        """The rows of `w` that are rounded and measured (all of them but in nearest mode with a stride): every
        stride-th row, or closer so that at least VISIBILITY_MIN_ROWS are."""
        step = min(self.stride, max(1, w.shape[0] // VISIBILITY_MIN_ROWS))
        return w if step == 1 else w[::step]

    def _kept(self, name: str, w: torch.Tensor, enc: Encoded, target: torch.Tensor) -> _Kept:
        residual = target - decode(self.grids[name], enc) if self.mode == "error_feedback" else None
        return _Kept(w.clone(), Encoded(enc.codes, enc.scale, enc.offset, setters=torch.empty(0)), residual)

    def prepare(self, version: int, received: list[tuple[str, torch.Tensor]]) -> Prepared:
        """The tensors to hand the generator for `version` (the quantized ones re-rounded by the mode, the rest as
        received) and the visibility against the previous version. Changes nothing until `commit`."""
        out, kept, sums = [], {}, [0, 0, 0, 0.0, 0.0, 0.0]  # changed codes, changed bf16, weights, dq.dq, dw.dw, dq.dw
        for name, w in received:
            grid = self.grids.get(name)
            if grid is None or not grid.fits(tuple(w.shape)):
                out.append((name, w))
                continue
            prev = self.kept.get(name)
            if self.mode == "nearest":  # handed over as received; measured on its sampled rows
                out.append((name, w))
                w = self._rows(w)
                enc, target = encode(grid, w), w.float()
            else:
                enc, hand, target = self._round(version, name, grid, w, prev)
                out.append((name, hand))
            kept[name] = self._kept(name, w, enc, target)
            if prev is not None and prev.weight.shape == w.shape:
                _add_visibility(sums, grid, w, enc, prev)
        return Prepared(out, kept, _visibility(sums))

    def _round(self, version: int, name: str, grid: Grid, w: torch.Tensor, prev: _Kept | None):
        """(codes, tensor to hand over, the value the residual is measured against) of one quantized weight, in
        the modes that re-round it (stochastic, error_feedback)."""
        if self.mode == "stochastic":
            rng = torch.Generator().manual_seed(zlib.crc32(f"{version}/{name}".encode()))
            enc = encode(grid, w, "stochastic", rng)
            return enc, handed(grid, w, enc, w.dtype), w.float()
        target = w.float() + (prev.residual if prev is not None and prev.residual is not None else 0.0)
        frame = target.to(w.dtype)  # what the backend will see at the setters
        enc = encode(grid, target, "nearest", frame=frame)
        return enc, handed(grid, frame, enc, w.dtype), target

    def commit(self, prepared: Prepared) -> dict[str, float]:
        """The generator loaded `prepared.tensors`: their state becomes the actor's. Returns the visibility."""
        self.kept.update(prepared.kept)
        return prepared.stats


def _add_visibility(sums: list, grid: Grid, w: torch.Tensor, enc: Encoded, prev: _Kept) -> None:
    sums[0] += int(torch.count_nonzero(enc.codes != prev.codes.codes))
    # a weight changed when its bits did
    sums[1] += int(torch.count_nonzero(bits(w) != bits(prev.weight)) if w.dtype == prev.weight.dtype
                   else torch.count_nonzero(w != prev.weight))
    sums[2] += w.numel()
    # float32 products summed per tensor (differences of bf16 weights and of grid values are exact in float32; the
    # sums' rounding is far below what these diagnostics resolve), accumulated over tensors in Python floats
    dq = decode(grid, enc).sub_(decode(grid, prev.codes)).view(-1)
    dw = w.to(torch.float32, copy=True).sub_(prev.weight.float()).view(-1)
    sums[3] += float(torch.dot(dq, dq))
    sums[4] += float(torch.dot(dw, dw))
    sums[5] += float(torch.dot(dq, dw))


def _visibility(sums: list) -> dict[str, float]:
    changed, changed_bf16, n, dq2, dw2, dqdw = sums
    if not n:
        return {k: math.nan for k in VISIBILITY_KEYS}
    return {"code_change_frac": changed / n, "bf16_change_frac": changed_bf16 / n,
            "update_norm_ratio": math.sqrt(dq2) / math.sqrt(dw2) if dw2 > 0 else math.nan,
            "update_projection": dqdw / dw2 if dw2 > 0 else math.nan}
