"""Weight-only quantization of a HF causal LM's nn.Linear layers for CPU rollouts.

Which library path each precision uses (torch 2.13 CPU, torchao 0.18, bitsandbytes 0.50, all measured here):

- bf16: no-op.
- int8: torchao ``Int8WeightOnlyConfig`` (per output channel). Storage: int8 ``qdata`` [N, K], fp32 scale and int8
  zero point per row (~8 bits/weight). Its linear dequantizes the weight to bf16 then runs a bf16 matmul.
- int4: torchao ``PrototypeInt4WeightOnlyConfig(group_size)`` -> ``Int4OpaqueTensor``: asymmetric int4, two
  nibbles per byte in uint8 ``qdata`` [N, K/2] plus bf16 (scale, zero) pairs [K/group, N, 2] (~4.5 bits/weight at
  group 64); matmul by torch's own CPU kernel ``aten._weight_int4pack_mm_for_cpu``. Rejected, measured:
  ``Int4WeightOnlyConfig`` PLAIN / PRESHUFFLED ("Requires mslk"), PLAIN_INT32 ("does not support device cpu"),
  TILE_PACKED_TO_4D (needs CUDA); ``IntxWeightOnlyConfig(int4, PerGroup(64))`` runs but keeps each int4 value
  unpacked in an int8 byte (~8.5 bits/weight) and was less accurate (symmetric).
- nf4: bitsandbytes ``Linear4bit`` (quant_type nf4, blocksize = group_size, no double quantization). On CPUs with
  AVX512-BF16 bnb repacks the weight at the first no-grad forward to uint8 [N, K/2] + bf16 absmax per block
  (~4.25 bits/weight); we trigger that repack here so storage and speed don't change after the first rollout.

Layers left in bf16 (counted as ``bf16_linears`` by ``quant_config_summary``):
- int4 / nf4: layers whose ``in_features`` is not divisible by ``group_size`` (groups run along in_features), and
  layers whose ``out_features`` is not a multiple of 16 (int4) / 32 (nf4): the CPU packers refuse those shapes.
- all precisions: ``lm_head`` when its weight is tied to the input embedding (quantizing it would break the tie).

torchao / bitsandbytes are imported inside the functions: importing this module loads neither.
"""

from __future__ import annotations

import torch
from torch import nn

from rollout.backends import TORCH_PRECISIONS as PRECISIONS  # declared by the backend registry

# out_features must be a multiple of this, else the layer stays bf16 (measured: the packers raise otherwise).
_OUT_MULTIPLE = {"int4": 16,  # aten._convert_weight_to_int4pack_for_cpu: "expect N to be dividable by 16"
                 "nf4": 32}  # bnb's CPU repack (_convert_weight_packed_for_cpu) asserts N % 32 == 0


def _tied_lm_head(model: nn.Module) -> nn.Module | None:
    """The output projection if it shares its weight with the input embedding, else None."""
    get_out = getattr(model, "get_output_embeddings", None)
    get_in = getattr(model, "get_input_embeddings", None)
    if get_out is None or get_in is None:
        return None
    out, emb = get_out(), get_in()
    if out is None or emb is None:
        return None
    if out.weight is emb.weight or out.weight.data_ptr() == emb.weight.data_ptr():
        return out
    return None


def _to_quantize(model: nn.Module, precision: str, group_size: int) -> list[tuple[str, nn.Linear]]:
    """(name, module) of the plain bf16 nn.Linear layers this precision will quantize."""
    skip = _tied_lm_head(model)
    chosen = []
    for name, m in model.named_modules():
        if type(m) is not nn.Linear or m is skip:
            continue
        if precision in ("int4", "nf4") and m.in_features % group_size:
            continue
        if m.out_features % _OUT_MULTIPLE.get(precision, 1):
            continue
        chosen.append((name, m))
    return chosen


def quantize_model(model: nn.Module, precision: str, group_size: int = 64) -> nn.Module:
    """Quantize the nn.Linear layers of a HF causal LM (bf16 weights, on CPU) in place and return it.

    bf16: no-op. int8: torchao weight-only int8 per output channel. int4: torchao weight-only int4, group-wise along
    in_features with ``group_size`` (32, 64 or 128; 64 default, like MLX's nn.quantize). nf4: bitsandbytes NF4
    ``Linear4bit`` with blocks of ``group_size`` weights along in_features.
    Layers whose in_features is not divisible by group_size stay bf16 (int4, nf4), as do layers whose out_features is
    not a multiple of 16 (int4) / 32 (nf4), and a tied lm_head (all precisions). Activations stay bf16; ``model(input_ids)`` and
    ``model.generate`` keep working on CPU. Meant to be called on a fresh copy of a bf16 model:
    ``quantize_model(copy.deepcopy(bf16_model), precision)``; a model is quantized once.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    previous = getattr(model, "_qgrpo_quant", None)
    if previous is not None and previous[0] != "bf16":
        raise ValueError(f"model is already quantized ({previous[0]}); quantize a deepcopy of the bf16 model")
    model._qgrpo_quant = (precision, group_size)
    if precision == "bf16":
        return model
    layers = _to_quantize(model, precision, group_size)
    if precision == "nf4":
        _quantize_nf4(model, layers, group_size)
        return model

    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig

    # set_inductor_config=False: we never torch.compile here; don't change global inductor settings.
    if precision == "int8":
        config = Int8WeightOnlyConfig(set_inductor_config=False)
    else:
        config = PrototypeInt4WeightOnlyConfig(group_size=group_size, set_inductor_config=False)
    chosen = {id(m) for _, m in layers}
    quantize_(model, config, filter_fn=lambda m, fqn: id(m) in chosen)
    return model


def _quantize_nf4(model: nn.Module, layers: list[tuple[str, nn.Linear]], group_size: int) -> None:
    import bitsandbytes as bnb

    for name, lin in layers:
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                              compute_dtype=torch.bfloat16, compress_statistics=False, quant_type="nf4",
                              device="meta")
        # .to("cpu") of an unquantized Params4bit is bnb's public way to quantize it.
        q.weight = bnb.nn.Params4bit(lin.weight.data.contiguous(), requires_grad=False, blocksize=group_size,
                                     compress_statistics=False, quant_type="nf4", module=q).to("cpu")
        q.quant_state = q.weight.quant_state
        if lin.bias is not None:
            q.bias = nn.Parameter(lin.bias.data, requires_grad=False)
        # Trigger bnb's one-time CPU repack (it happens at the first eval no-grad forward) now, so bytes and speed
        # are what rollouts will see and the repack isn't paid inside generation.
        was_training = q.training
        q.eval()
        with torch.no_grad():
            q(torch.zeros(1, lin.in_features, dtype=torch.bfloat16))
        q.train(was_training)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, q)


def _storage_tensors(w: torch.Tensor):
    """The plain tensors that really hold a (possibly quantized) weight."""
    if hasattr(w, "__tensor_flatten__"):  # torchao tensor subclass: its inner tensors (qdata, scales, zeros)
        names, _ = w.__tensor_flatten__()
        for n in names:
            yield from _storage_tensors(getattr(w, n))
        return
    yield w
    qs = getattr(w, "quant_state", None)  # bitsandbytes Params4bit: packed data + quant_state (absmax, code, ...)
    if qs is not None:
        for t in (qs.absmax, qs.code, getattr(qs, "offset", None)):
            if isinstance(t, torch.Tensor):
                yield t
        if getattr(qs, "nested", False):
            yield qs.state2.absmax
            yield qs.state2.code


def _linears(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, nn.Linear)]  # bnb Linear4bit subclasses nn.Linear


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes held by the weights of the linear layers (packed data + scales + zero points), measured as the sizes of
    the storages of the tensors that hold them, each storage counted once (biases not included).
    A tied lm_head counts: it stays bf16 and its storage is the embedding's."""
    seen, total = set(), 0
    for m in _linears(model):
        for t in _storage_tensors(m.weight):
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
    return total


def _is_quantized(w: torch.Tensor) -> bool:
    return type(w) not in (torch.Tensor, nn.Parameter)  # torchao subclass or bnb Params4bit


def quant_config_summary(model: nn.Module) -> dict:
    """e.g. {"precision": "int4", "quantized_linears": 14, "bf16_linears": 1, "group_size": 64}"""
    precision, group_size = getattr(model, "_qgrpo_quant", ("bf16", None))
    lins = _linears(model)
    n_q = sum(_is_quantized(m.weight) for m in lins)
    return {"precision": precision, "quantized_linears": n_q, "bf16_linears": len(lins) - n_q,
            "group_size": group_size if precision in ("int4", "nf4") else None}


def int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization per output channel (row) of a [N, K] weight, computed in float32:
    scale = max|w_row| / 127, q = round(w / scale) in [-127, 127]. Returns (q int8 [N, K], scale float32 [N, 1]);
    q * scale reconstructs w within scale / 2 per element. The layout vLLM's compressed-tensors W8A8 int8 loads."""
    w = w.detach().float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale
