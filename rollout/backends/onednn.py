"""float32 products on oneDNN's blocked weights: the torch generator's unquantized linears on a CPU that computes in
float32 (model.compute_dtype, core/cpu.py: no native bf16).

`F.linear` on a float32 weight calls MKL's sgemm, which reads the weight at a fraction of the memory bandwidth from
2 rows up: on a 2-core AVX2-only EPYC, Qwen2.5-1.5B's gate/up product at 2 rows took 8.7 ms through it against 3.1 ms
through oneDNN's inner product on the weight reordered once into oneDNN's blocked layout (1.38-2.87x at 2 and 8 rows,
1.02-1.23x at 1; bench/gpu_matmuls.py, routes `fp32` and `fp32/onednn`). That reordering is what torch's inductor
does to a frozen float32 linear on a CPU (`torch.ops.mkldnn._reorder_linear_weight`, `_linear_pointwise`).

`pack_linears` gives each plain float32 linear of a served model its weight in that layout (an opaque oneDNN tensor,
`module._onednn`) and a forward that multiplies by it. The layer's own weight becomes a tensor on the meta device of
the same shape, so the memory is held once; where the weight is shared with another module (an lm_head tied to the
embedding), the other module keeps the tensor and the layer holds its packed copy besides (the head's bytes once
more). New weights reach a packed layer through `repack` only: the generator's full update calls it for each one
(rollout/backends/torch_backend.py). The values are the received bf16 values in float32, as before; only the order of
the sums differs (a product within 1e-5 of a float64 product, relative to its largest output: tests/test_onednn.py).
"""
from __future__ import annotations

import torch
from torch import nn


def available() -> bool:
    """Whether this torch has oneDNN's linear on the CPU."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight")


def packable(module: nn.Module) -> bool:
    """A plain nn.Linear (not a quantized one, not one whose forward another module replaced) with a float32 weight on
    the CPU."""
    w = getattr(module, "weight", None)
    return (type(module) is nn.Linear and type(w) in (torch.Tensor, nn.Parameter) and w.dtype == torch.float32
            and w.device.type == "cpu" and "forward" not in vars(module))


def _forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32:
        return _forward(self, x.float()).to(x.dtype)
    return torch.ops.mkldnn._linear_pointwise(x, self._onednn, self.bias, "none", [], "")


def repack(module: nn.Module, weight: torch.Tensor) -> None:
    """`weight` ([out, in], any float dtype and device) becomes the packed layer's weight."""
    shape = (module.out_features, module.in_features)
    if tuple(weight.shape) != shape:
        raise ValueError(f"oneDNN linear: the layer is {list(shape)}, got a weight of shape {list(weight.shape)}")
    w = weight.detach().to(device="cpu", dtype=torch.float32).contiguous()
    module._onednn = torch.ops.mkldnn._reorder_linear_weight(w, None)


def pack_linears(model: nn.Module) -> dict[str, list[nn.Module]]:
    """Pack every `packable` linear of `model` in place (the module docstring). Returns, for each name in
    `model.named_parameters()` (as named before packing) whose tensor a packed layer multiplies by, those layers: an
    update of that name goes to `repack` for each. A name whose tensor another module still holds (a tied embedding's)
    must also be copied into that tensor, as before."""
    names = {}
    for name, p in model.named_parameters():  # a tied head's weight is named after the embedding, which comes first
        names.setdefault(id(p), name)
    packed: dict[str, list[nn.Module]] = {}
    for m in list(model.modules()):
        if not packable(m):
            continue
        w = m.weight
        repack(m, w)
        # The layer's weight: the same shape on the meta device (no memory). An unshared tensor is freed with it; a
        # shared one stays with its other holder.
        m.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)
        m.forward = _forward.__get__(m)
        packed.setdefault(names[id(w)], []).append(m)
    return packed


def served_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with each packed layer's weight read back from oneDNN's layout (exactly the float32 values
    it multiplies by) in place of its meta tensor: what the model serves, for checks."""
    state = model.state_dict()
    for name, m in model.named_modules():
        if hasattr(m, "_onednn"):
            state[f"{name}.weight" if name else "weight"] = m._onednn.to_dense()
    return state
