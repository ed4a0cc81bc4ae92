"""A served model's compute dtype (model.compute_dtype, core/cpu.py): where bf16 products are emulated (a CPU without
AVX512-BF16 or AMX), the torch generator and the reference compute in float32 on the same weights.

`compute_in(model, torch.float32)` casts the model's plain floating parameters and buffers, whose bf16 values float32
holds exactly, so the weights served are the ones received; quantized weights (torchao tensor subclasses, bitsandbytes
Params4bit) keep their codes and scales, and their layers take float32 activations:
- int8: torch's int8 kernel and torchao's arithmetic take float32 inputs as they are (rollout/quantization/quant.py);
- int4 (CPU): torch's int4 kernel multiplies in the dtype of its bf16 scales, so a decode step's rows enter it as bf16
  and leave as float32, while more rows are multiplied by the weight decoded into float32
  (rollout/quantization/cpu_kernels.py: int4_product); a layer torchao's linear still runs (no known packing) gets its
  input cast to bf16 and its output back;
- nf4: bitsandbytes computes in the dtype its layer is told (`compute_dtype`).
A quantized model is quantized first, from its bf16 weights, as everywhere: the codes are those of a bf16 generator.
"""
from __future__ import annotations

import torch
from torch import nn


def _plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter) and t.is_floating_point()


def _int4_in_bf16(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(x.to(torch.bfloat16), self.weight,
                                None if self.bias is None else self.bias.to(torch.bfloat16)).to(x.dtype)


def compute_in(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Make `model` compute in `dtype` (torch.float32 or torch.bfloat16), in place; see the module docstring. Called
    again after a sync re-quantized layers in place (a new layer or weight takes the dtype too)."""
    for p in model.parameters():  # deduplicated: a tied head and embedding stay one tensor
        if _plain(p) and p.dtype != dtype:
            p.data = p.data.to(dtype)
    for module in model.modules():
        for name, b in list(module.named_buffers(recurse=False)):
            if _plain(b) and b.dtype == torch.bfloat16 and dtype != torch.bfloat16:
                setattr(module, name, b.to(dtype))
        w = getattr(module, "weight", None)
        if type(module).__name__ == "Linear4bit":
            module.compute_dtype = dtype
        elif isinstance(module, nn.Linear) and type(w).__name__ == "Int4OpaqueTensor" and dtype != torch.bfloat16 \
                and "forward" not in vars(module):  # quant.py's int4 forward takes float32 itself
            module.forward = _int4_in_bf16.__get__(module)
    model.config.dtype = dtype
    return model
