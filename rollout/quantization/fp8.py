"""fp8 layers for the torch generator on CUDA (rollout/quantization/quant.py's ``torch.fp8_scaled_mm`` path):
float8_e4m3fn weights with one float32 scale per row, and the two ways a product reads them.

- **A decode step's rows** (the default ``FP8_DECODE = "weight_only"``; CUDA, bf16 activations, at most
  ``FP8_WEIGHT_ONLY_ROWS`` rows, Triton at hand): the weight-only kernel of rollout/quantization/w8_triton.py. It reads
  the fp8 codes, converts them to bf16 in registers and accumulates in fp32: the activations stay bf16. Why: such a
  product is bound by the weight's bytes and by kernel launches, not by arithmetic. The W8A8 product below spends four
  kernels quantizing the activations before its one product. On an H200 (bench/gpu_speed.py, the fused step in CUDA
  graphs, a 1.3B model) fp8 decoded 4,643 / 10,214 / 24,849 tokens/s at 8 / 16 / 64 rows this way against 2,166 / 3,590
  / 15,866 through W8A8; alone (bench/gpu_matmuls.py) the weight-only product of the fused gate/up projection at 8 rows
  took 14.8 us against W8A8's 27.0 and bf16's 18.1. Weight-only is also the more exact of the two (only the weight is
  rounded), so fp8's bounds against the bf16 model hold a fortiori.
- **Every other call** (prefill, more rows, float32 activations; every call with ``FP8_DECODE = "scaled_mm"``): W8A8,
  the activations quantized per token (absmax scaling) and the product on float8 tensor cores by
  ``torch._scaled_mm`` (row-wise scales, bf16 out), where its arithmetic rate pays.

Both read the layer's live codes and scales, so a weight sync that copies into them (rollout/quantization/quant.py:
``requantize_in_place``) changes what a captured CUDA graph computes. Neither has a host synchronisation or a branch
on data. Not served on CPU (torch 2.13's CPU ``_scaled_mm`` is slow): tests run the W8A8 numerics there, and the
weight-only kernel through Triton's interpreter (tests/test_quant.py, tests/test_w8_triton.py).
"""

from __future__ import annotations

import torch
from torch import nn

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value (it has no infinity: larger values would become NaN)
# How a decode step's fp8 products run on CUDA: "weight_only" (rollout/quantization/w8_triton.py, at most
# FP8_WEIGHT_ONLY_ROWS bf16 rows; measured faster on an H200 at 8-64 rows, above) or "scaled_mm" (W8A8 for every call).
FP8_DECODE = "weight_only"
FP8_WEIGHT_ONLY_ROWS = 64
# A token's scale maps its largest magnitude to just under 448, so that the quotient never rounds past the largest
# finite e4m3fn value (a cast beyond it gives NaN) and no clamp is needed: one kernel fewer per product.
_ACT_SCALE = (1.0 + 2.0 ** -10) / FP8_MAX


class Fp8Linear(nn.Module):
    """A linear layer in fp8: float8_e4m3fn weight [out, in] with one float32 scale per row (row absmax / 448); its
    product is ``fp8_linear`` (W8A8 through ``torch._scaled_mm``, or weight-only for a decode step's rows on CUDA)
    and the bias is added in the input's dtype. The weight and its scale are buffers, not parameters: ``compute_in``
    (rollout/backends/compute.py) casts floating parameters to the compute dtype, which would turn the codes back into
    bf16 or float32 (``model.to(dtype)`` / ``.float()`` would cast them too: change a quantized model's compute dtype
    with compute_in only). The forward has no host synchronisation and no branch on data, so it can run inside a CUDA
    graph; `requantize_in_place` writes new codes and scales into the same tensors."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """`weight`: the bf16 (or float32) weight [out, in] to quantize, on the layer's device; `bias` [out] or None."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        codes, scale = fp8_per_row(weight)
        self.register_buffer("weight", codes)
        self.register_buffer("scale", scale)
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias.detach(), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def weight_only_takes(x: torch.Tensor) -> bool:
    """Whether `fp8_linear` runs x through the weight-only kernel: off the CPU, ``FP8_DECODE == "weight_only"``, bf16,
    at most FP8_WEIGHT_ONLY_ROWS rows, and Triton able to run it."""
    if x.device.type == "cpu" or FP8_DECODE != "weight_only" or x.dtype != torch.bfloat16 \
            or x.numel() // max(1, x.shape[-1]) > FP8_WEIGHT_ONLY_ROWS:
        return False
    from qgrpo.rollout.quantization import w8_triton

    return w8_triton.available()


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (bf16 or float32) times float8_e4m3fn codes `weight` [N, K] with row scales `scale` [N], then
    `bias`; in x's dtype, [..., N]. Where `weight_only_takes` x: the weight-only kernel, one or two kernels.
    Otherwise W8A8: the activations quantized per token (absmax scaling, float32), the product in
    ``torch._scaled_mm`` with row-wise scales, bf16 out: six kernels. No host synchronisation (CUDA graphs)."""
    if weight_only_takes(x):
        from qgrpo.rollout.quantization import w8_triton

        return w8_triton.w8_linear(x, weight, scale, bias)
    rows = x.reshape(-1, x.shape[-1])
    s = torch.linalg.vector_norm(rows, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    s = s.mul_(_ACT_SCALE).clamp_(min=1e-12)  # [M, 1] per-token scale
    xq = torch.div(rows, s).to(torch.float8_e4m3fn)
    # mat2 column-major: the transpose of the row-major [N, K] codes, as _scaled_mm wants it
    y = torch._scaled_mm(xq, weight.t(), scale_a=s, scale_b=scale.view(1, -1), out_dtype=torch.bfloat16).to(x.dtype)
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def fp8_per_row(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn codes [N, K] and float32 scales [N] of a [N, K] weight, computed in float32: scale = max|w_row| /
    448 (at least 1e-12), codes = w / scale rounded to nearest by the cast, after clamping to +-448 (e4m3fn has no
    infinity). codes * scale reconstructs each weight within 2^-4 of its magnitude (3 mantissa bits), or, where its
    code is below 2^-6 (subnormal), within 2^-10 of the scale."""
    w = w.detach().float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_fp8(model: nn.Module, layers: list[tuple[str, nn.Linear]]) -> None:
    """Each listed nn.Linear replaced by an Fp8Linear of its weight (and its bias), one layer at a time."""
    for name, lin in layers:
        q = Fp8Linear(lin.weight.data, lin.bias)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, q)
