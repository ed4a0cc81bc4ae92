"""LoRA adapters beside a generator's quantized base (sync.adapters_only): each targeted linear of the served model is
wrapped so that its output is base(x) + (x A^T) B^T in bf16, B already scaled by alpha / r on the learner's side.

The wrapper calls the module it wraps and never touches its weights, so it works over any quantized linear (torchao
int8 / int4, bitsandbytes NF4) and the quantized base is never rebuilt at an adapters sync. Only the error of the base
differs from the merged path: there the generator quantizes W + B A, here it quantizes W alone and adds B A exactly
(up to bf16), which is at least as close to the learner's policy.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from qgrpo.rollout.backends.common import WeightMismatchError, check_stream

SUFFIXES = (".lora_A", ".lora_B")


class LoraDelta(nn.Module):
    """`base` (any module mapping [..., in] to [..., out]) plus the low-rank term (x A^T) B^T."""

    def __init__(self, base: nn.Module, rank: int, in_features: int, out_features: int, device: torch.device):
        super().__init__()
        self.base = base
        self.register_buffer("lora_A", torch.zeros(rank, in_features, dtype=torch.bfloat16, device=device))
        self.register_buffer("lora_B", torch.zeros(out_features, rank, dtype=torch.bfloat16, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        delta = nn.functional.linear(nn.functional.linear(x.to(self.lora_A.dtype), self.lora_A), self.lora_B)
        return y + delta.to(y.dtype)


def expected_shapes(linears: dict[str, tuple[int, int]], wrapped: dict[str, LoraDelta],
                    received: list[tuple[str, torch.Tensor]]) -> dict[str, tuple[int, ...]]:
    """{name: shape} an adapters stream must hold: the wrapped layers' once wrapped; before that, A [r, in] and
    B [out, r] of every linear layer (`linears`: {name: (out, in)} of the bf16 model) the stream names, r read from
    the stream's first lora_A."""
    if wrapped:
        return {f"{n}{s}": tuple(getattr(w, s[1:]).shape) for n, w in wrapped.items() for s in SUFFIXES}
    return stream_shapes(linears, received)


def stream_shapes(linears: dict[str, tuple[int, int]],
                  received: list[tuple[str, torch.Tensor]]) -> dict[str, tuple[int, ...]]:
    """{name: shape} of a first adapters stream, for a model whose linear layers have weights of the shapes
    `linears` ({layer name: (out, in)}): A [r, in] and B [out, r] of every layer the stream names, r read from its
    first lora_A. WeightMismatchError for a name that is not `<linear>.lora_A` / `<linear>.lora_B`."""
    ranks = [t.shape[0] for n, t in received if n.endswith(".lora_A") and t.dim() == 2]
    if not ranks:
        raise WeightMismatchError("an adapters update without any lora_A tensor; is the stream a full model?")
    shapes = {}
    for name, _ in received:
        base, dot, leaf = name.rpartition(".")
        if f"{dot}{leaf}" not in SUFFIXES or base not in linears:
            raise WeightMismatchError(f"received adapter {name!r}, which names no linear layer of this model "
                                      "(expected <linear>.lora_A / <linear>.lora_B); is the stream from another model?")
        out_f, in_f = linears[base]
        shapes[f"{base}.lora_A"], shapes[f"{base}.lora_B"] = (ranks[0], in_f), (out_f, ranks[0])
    return shapes


def unwrap(model: nn.Module, wrapped: dict[str, LoraDelta]) -> dict[str, LoraDelta]:
    """Put each wrapped layer's own module back in its place (a full update replaces the adapters); returns {}."""
    modules = dict(model.named_modules())
    for name, w in wrapped.items():
        parent, _, leaf = name.rpartition(".")
        setattr(modules[parent] if parent else model, leaf, w.base)
    return {}


def load_adapters(model: nn.Module, linears: dict[str, tuple[int, int]], wrapped: dict[str, LoraDelta],
                  named_tensors: Iterable[tuple[str, torch.Tensor]], device: torch.device) -> dict[str, LoraDelta]:
    """Check the whole stream (WeightMismatchError on an unknown name, a wrong shape, a name twice or missing), then
    wrap the named linears of `model` on the first call and copy A, B in place. Returns the wrappers by layer name."""
    received = list(named_tensors)
    received = list(check_stream(expected_shapes(linears, wrapped, received), received))
    tensors = dict(received)
    if not wrapped:
        modules = dict(model.named_modules())
        for name in sorted({n.rpartition(".")[0] for n in tensors}):
            (r, in_f), (out_f, _) = tensors[f"{name}.lora_A"].shape, tensors[f"{name}.lora_B"].shape
            parent, _, leaf = name.rpartition(".")
            wrapped[name] = LoraDelta(modules[name], r, in_f, out_f, device)
            setattr(modules[parent] if parent else model, leaf, wrapped[name])
    with torch.no_grad():
        for name, w in wrapped.items():
            w.lora_A.copy_(tensors[f"{name}.lora_A"])
            w.lora_B.copy_(tensors[f"{name}.lora_B"])
    return wrapped
