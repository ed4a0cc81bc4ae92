"""The decode step that CUDA graphs replay (torch_graphs.py), written for few kernels.

On a GPU a replayed step costs about what its kernels cost one after another, each a few microseconds however little
it computes: the static decoder's step (torch_decode.py: `_fixed_step`) ran about 1,340 kernels for 28 layers on an
H200, 3.4-3.9 ms of kernel time where the weights take 0.7 ms to read. This step computes the same function with
fewer operators (`bench/gpu_speed.py` counts them, `ops_per_step`, on any device); on an H200 it ran 330 kernels at
8 rows (1.64 ms) instead of 1,373 (3.60 ms) and decoded bf16 2.0-2.2x faster:

- **Fused projections.** Where a layer's q, k and v projections (and its MLP's gate and up projections) are plain
  float `nn.Linear`s, fp8 `Fp8Linear`s or torchao int8 on its direct route, their weights (codes and scales) are
  moved into one buffer and each projection's tensors become views of its rows, so one product computes all three
  and a weight sync (which copies into those tensors) updates the buffer (int8's and fp8's joint products then
  run one weight-only kernel, rollout/quantization/w8_triton.py). int4, nf4 and adapter-wrapped projections stay
  separate products.
- **Rotary embedding as one product.** q*cos + rotate_half(q)*sin is q @ (diag(cos) + R diag(sin)) with R the fixed
  signed permutation of rotate_half: one [head_dim x head_dim] matrix per row and step, built once per step for all
  layers, applied to the query and key heads together with one batched product (one rounding instead of three).
- **Norms** through `torch.nn.functional.rms_norm` (one fused kernel on CUDA; float32 inside, as the model's norm).
  Qwen3's per-head query and key norms (`self_attn.q_norm`, `k_norm`, over head_dim, before the rotary) are two more
  of them on the joint product's query and key heads, and one concatenation with its values.
- **Attention** scores scaled and masked in one `torch.add(bias, scores, alpha=scale)`.
- **Triton kernels** (triton_step.py), where they passed their self-check on the model's device (`FusedLayers.kernels`):
  the residual sum with the next norm, SwiGLU, rotary with the cache write and attention each in one kernel, in place
  of the torch ops above: 293 operators a step for 28 layers instead of 520.

The logits agree with the model's forward to bf16 rounding (tests/test_torch_graphs.py checks every sampled token's
log-prob against the served model's forward).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def _plain(lin) -> bool:
    """An `nn.Linear` whose weight is a plain floating tensor (not quantized, not wrapped with adapters): bf16, or
    float32 where the model computes in it (model.compute_dtype on a CPU without native bf16). A layer packed for
    oneDNN (rollout/backends/onednn.py: its weight on the meta device) is not: it multiplies in its own forward."""
    return (type(lin) is nn.Linear and type(lin.weight) in (torch.Tensor, nn.Parameter)  # torchao's are subclasses
            and lin.weight.dtype.is_floating_point and lin.weight.device.type != "meta")


def _kind(lin) -> str | None:
    """"float", "fp8" or "int8" (torchao's int8 on the direct route: `quant._int8_direct`) for a projection `fuse`
    can join with others of its kind, else None."""
    from qgrpo.rollout.quantization.fp8 import Fp8Linear

    if _plain(lin):
        return "float"
    if type(lin) is Fp8Linear:
        return "fp8"
    return "int8" if type(lin) is nn.Linear and "_int8" in lin.__dict__ else None


def _tensors(lin, kind: str) -> list[torch.Tensor]:
    """The tensors of a projection that a joint product reads: bf16's weight, fp8's codes and scales, int8's codes
    and per-row scales (torchao's `qdata` and `scale`)."""
    if kind == "float":
        return [lin.weight.data]
    if kind == "fp8":
        return [lin.weight, lin.scale]
    return [lin.weight.qdata, lin.weight.scale.reshape(-1)]


def _repoint(lin, kind: str, views: list[torch.Tensor]) -> None:
    """Make the projection's tensors `views` (rows of the joint ones), keeping their shapes."""
    if kind == "float":
        lin.weight.data = views[0]
    elif kind == "fp8":
        lin.weight, lin.scale = views
    else:
        from qgrpo.rollout.quantization.quant import _int8_direct

        w = lin.weight
        w.qdata, w.scale = views[0], views[1].view(w.scale.shape)
        _int8_direct(lin)  # its direct route reads the new (view) tensors


def fuse(linears: list) -> tuple | None:
    """One product for projections of the same input: ("float", weight [sum of outs, in], bias) for plain linears
    (`_plain`), ("fp8" | "int8", codes, row scales, bias) for Fp8Linears | torchao int8 on its direct route (`_kind`).
    Each projection's tensors become row views of the joint
    ones, so a copy into them (a sync) writes the joint buffers. Kept as it is where they still are such views; None
    where the projections cannot be joined (another kind, mixed kinds, inputs differ, some with bias and some
    without)."""
    kinds = {_kind(lin) for lin in linears}
    if len(kinds) != 1 or None in kinds or len({(lin.in_features, lin.weight.dtype) for lin in linears}) != 1:
        return None
    biased = {lin.bias is not None for lin in linears}
    if len(biased) != 1:
        return None
    kind, biased = kinds.pop(), biased.pop()
    held = getattr(linears[0], "_qgrpo_fused", None)
    if held is not None and _views_of(linears, held):
        return held
    with torch.no_grad():
        parts = [_tensors(lin, kind) for lin in linears]
        joint = [torch.cat([p[i] for p in parts]) for i in range(len(parts[0]))]
        bias = torch.cat([lin.bias.data for lin in linears]) if biased else None
        spec = (kind, *joint, bias)
        off = 0
        for lin in linears:
            rows = slice(off, off + lin.out_features)
            _repoint(lin, kind, [t[rows] for t in joint])
            if bias is not None:
                lin.bias.data = bias[rows]
            lin._qgrpo_fused = spec
            off += lin.out_features
    return spec


def _views_of(linears: list, spec: tuple) -> bool:
    """Whether the projections' tensors are still the rows of the joint ones of `spec`, in order."""
    kind, *joint, bias = spec
    off = 0
    for lin in linears:
        if getattr(lin, "_qgrpo_fused", None) is not spec:
            return False
        for mine, t in zip(_tensors(lin, kind), joint):
            if mine.data_ptr() != t[off].data_ptr():
                return False
        if bias is not None and (lin.bias is None or lin.bias.data_ptr() != bias[off].data_ptr()):
            return False
        off += lin.out_features
    return off == joint[0].shape[0]


def _project(h: torch.Tensor, spec: tuple) -> torch.Tensor:
    """The joint product of `fuse`'s projections."""
    if spec[0] == "float":
        return F.linear(h, spec[1], spec[2])
    from qgrpo.rollout.quantization.fp8 import fp8_linear
    from qgrpo.rollout.quantization.quant import int8_product

    return (fp8_linear if spec[0] == "fp8" else int8_product)(h, *spec[1:])


# Whether the step may use triton_step's kernels where they pass their self-check (bench/gpu_speed.py's loop
# "graphs_fused_torch" turns them off to compare).
KERNELS = True


class FusedLayers:
    """Each decoder layer's projections as this step computes them: fused buffers where `fuse` could make them, else
    the modules; and whether the step runs triton_step's kernels (`kernels`; `kernels_why` says why not). Made again
    when the model's modules or weights moved (GraphDecoder's fingerprint)."""

    def __init__(self, model, q_heads: int, kv_heads: int, head_dim: int):
        self.layers = []
        for layer in model.model.layers:
            att, mlp = layer.self_attn, layer.mlp
            self.layers.append((layer, fuse([att.q_proj, att.k_proj, att.v_proj]),
                                fuse([mlp.gate_proj, mlp.up_proj])))
        self.q, self.kv, self.hd = q_heads * head_dim, kv_heads * head_dim, head_dim
        self.kernels_why = _kernels_refused(model, q_heads, kv_heads, head_dim)
        self.kernels = self.kernels_why is None
        half = head_dim // 2
        emb = model.model.embed_tokens.weight
        r = torch.zeros(head_dim, head_dim)
        r[torch.arange(half) + half, torch.arange(half)] = -1.0  # rotate_half: out_i = -x_{i+h} for i < h
        r[torch.arange(half), torch.arange(half) + half] = 1.0  # and x_{i-h} for i >= h
        self.rotate = r.to(device=emb.device, dtype=emb.dtype)  # on the device: no copy inside a captured step


def _kernels_refused(model, q_heads: int, kv_heads: int, head_dim: int) -> str | None:
    """Why the step runs torch ops instead of triton_step's kernels, or None: they run where Triton can run them on
    the model's device, its MLPs are SwiGLU, its shapes suit them and `triton_step.self_check` passed there."""
    from qgrpo.rollout.backends import triton_step

    emb = model.model.embed_tokens.weight
    if not KERNELS:
        return "off (torch_fused.KERNELS)"
    if not triton_step.available(emb.device):
        return f"no Triton for {emb.device.type} tensors"
    if any(type(layer.mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation") for layer in model.model.layers):
        return "an MLP's activation is not SiLU"  # torch's nn.SiLU or transformers' own
    return triton_step.self_check(model, q_heads, kv_heads, head_dim)


def _norm(module, x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)


def _add_norm(fused: FusedLayers, x: torch.Tensor, r: torch.Tensor, module) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + r, `module`'s RMSNorm of it): one kernel where the step runs triton_step's."""
    if fused.kernels:
        from qgrpo.rollout.backends import triton_step

        return triton_step.add_rms_norm(x, r, module.weight, module.variance_epsilon)
    x = x + r
    return x, _norm(module, x)


def step(model, fused: FusedLayers, tokens, col, pos, keys, values, bias, q_heads, kv_heads, head_dim, scale):
    """One decode step, as `torch_decode._fixed_step` (same arguments and result: float32 logits [rows, vocab]), with
    the fused products of the module docstring, and triton_step's kernels where `fused.kernels`."""
    m = model.model
    x = m.embed_tokens(tokens[:, None])  # [b, 1, hidden]
    b, g, hd = x.shape[0], q_heads // kv_heads, head_dim
    cos, sin = m.rotary_emb(x, pos[:, None])  # [b, 1, hd] each, in x's dtype
    kernels = fused.kernels
    if kernels:
        from qgrpo.rollout.backends import triton_step
    else:
        rot = torch.diag_embed(cos[:, 0]) + fused.rotate * sin  # [b, hd, hd]: x @ rot = x*cos + rotate_half(x)*sin
    bias.index_fill_(-1, col, 0.0)
    nq, nkv = fused.q, fused.kv
    norms = [layer.input_layernorm for layer, _, _ in fused.layers[1:]] + [m.norm]  # after each layer's residual
    h = _norm(fused.layers[0][0].input_layernorm, x)
    for i, (layer, qkv, gate_up) in enumerate(fused.layers):
        att = layer.self_attn
        if qkv is not None:
            y = _project(h, qkv)  # [b, 1, nq + 2 nkv]
        else:
            y = torch.cat([att.q_proj(h), att.k_proj(h), att.v_proj(h)], -1)
        if getattr(att, "q_norm", None) is not None:  # Qwen3: query and key heads RMS-normed before the rotary
            heads = y[..., :nq + nkv].view(b, q_heads + kv_heads, hd)
            y = torch.cat([_norm(att.q_norm, heads[:, :q_heads]).reshape(b, 1, nq),
                           _norm(att.k_norm, heads[:, q_heads:]).reshape(b, 1, nkv), y[..., nq + nkv:]], -1)
        if kernels:
            q = triton_step.rope_write(y, cos, sin, keys[i], values[i], col, q_heads, kv_heads)
            o = triton_step.attend(q, keys[i], values[i], bias, scale)  # [b, q_heads, hd]
        else:
            qk, v = y[..., :nq + nkv], y[..., nq + nkv:]
            qk = torch.bmm(qk.reshape(b, q_heads + kv_heads, hd), rot)  # rotary on query and key heads at once
            q, k = qk[:, :q_heads], qk[:, q_heads:]
            keys[i].index_copy_(2, col, k.unsqueeze(2))
            values[i].index_copy_(2, col, v.reshape(b, kv_heads, 1, hd))
            scores = torch.add(bias, torch.matmul(q.reshape(b, kv_heads, g, hd), keys[i].transpose(-1, -2)),
                               alpha=scale)
            o = torch.matmul(scores.softmax(-1).to(values[i].dtype), values[i])  # [b, kv, g, hd]
        x, h = _add_norm(fused, x, att.o_proj(o.reshape(b, 1, q_heads * hd)), layer.post_attention_layernorm)
        mlp = layer.mlp
        if gate_up is not None:
            y = _project(h, gate_up)
            half = y.shape[-1] // 2
            a = triton_step.silu_mul(y) if kernels else mlp.act_fn(y[..., :half]) * y[..., half:]
        else:
            a = mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h)
        x, h = _add_norm(fused, x, mlp.down_proj(a), norms[i])
    return model.lm_head(h)[:, 0].float()
