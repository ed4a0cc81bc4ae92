"""The decode step that CUDA graphs replay (torch_graphs.py), written for few kernels.

On a GPU a replayed step costs about what its kernels cost one after another, each a few microseconds however little
it computes: the static decoder's step (torch_decode.py: `_fixed_step`) ran about 1,340 kernels for 28 layers on an
H200, 3.4-3.9 ms of kernel time where the weights take 0.7 ms to read. This step computes the same function with
fewer operators (`bench/gpu_speed.py` counts them, `ops_per_step`, on any device):

- **Fused projections.** Where a layer's q, k and v projections (and its MLP's gate and up projections) are plain
  bf16 `nn.Linear`s, their weights are moved into one buffer and each projection's parameter becomes a view of its
  rows, so one product computes all three and a weight sync (which copies into the parameters) updates the buffer.
  Quantized or adapter-wrapped projections stay separate products.
- **Rotary embedding as one product.** q*cos + rotate_half(q)*sin is q @ (diag(cos) + R diag(sin)) with R the fixed
  signed permutation of rotate_half: one [head_dim x head_dim] matrix per row and step, built once per step for all
  layers, applied to the query and key heads together with one batched product (one rounding instead of three).
- **Norms** through `torch.nn.functional.rms_norm` (one fused kernel on CUDA; float32 inside, as the model's norm).
- **Attention** scores scaled and masked in one `torch.add(bias, scores, alpha=scale)`.

The logits agree with the model's forward to bf16 rounding (tests/test_torch_graphs.py checks every sampled token's
log-prob against the served model's forward).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def _plain(lin) -> bool:
    """A bf16 `nn.Linear` whose weight is a plain tensor (not quantized, not wrapped with adapters)."""
    return (type(lin) is nn.Linear and type(lin.weight) in (torch.Tensor, nn.Parameter)  # torchao's are subclasses
            and lin.weight.dtype == torch.bfloat16)


def fuse(linears: list) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One weight buffer [sum of outs, in] (and bias) for plain linears of the same input: each linear's parameters
    become views of their rows (a copy into a parameter writes the buffer). Kept as it is where they still are such
    views; None where the linears cannot be fused (not plain, inputs differ, some with bias and some without)."""
    if not all(_plain(lin) for lin in linears) or len({lin.in_features for lin in linears}) != 1:
        return None
    biased = {lin.bias is not None for lin in linears}
    if len(biased) != 1:
        return None
    biased = biased.pop()
    held = getattr(linears[0], "_qgrpo_fused", None)
    if held is not None and _views_of(linears, *held):
        return held
    with torch.no_grad():
        buf = torch.cat([lin.weight.data for lin in linears])
        bias = torch.cat([lin.bias.data for lin in linears]) if biased else None
        off = 0
        for lin in linears:
            n = lin.out_features
            lin.weight.data = buf[off:off + n]
            if bias is not None:
                lin.bias.data = bias[off:off + n]
            lin._qgrpo_fused = (buf, bias)
            off += n
    return buf, bias


def _views_of(linears: list, buf: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the linears' parameters are still the rows of `buf` (and `bias`), in order."""
    off = 0
    for lin in linears:
        n = lin.out_features
        if getattr(lin, "_qgrpo_fused", (None,))[0] is not buf or lin.weight.data_ptr() != buf[off].data_ptr():
            return False
        if bias is not None and (lin.bias is None or lin.bias.data_ptr() != bias[off].data_ptr()):
            return False
        off += n
    return off == buf.shape[0]


class FusedLayers:
    """Each decoder layer's projections as this step computes them: fused buffers where `fuse` could make them, else
    the modules. Made again when the model's modules or weights moved (GraphDecoder's fingerprint)."""

    def __init__(self, model, q_heads: int, kv_heads: int, head_dim: int):
        self.layers = []
        for layer in model.model.layers:
            att, mlp = layer.self_attn, layer.mlp
            self.layers.append((layer, fuse([att.q_proj, att.k_proj, att.v_proj]),
                                fuse([mlp.gate_proj, mlp.up_proj])))
        self.q, self.kv, self.hd = q_heads * head_dim, kv_heads * head_dim, head_dim
        half = head_dim // 2
        emb = model.model.embed_tokens.weight
        r = torch.zeros(head_dim, head_dim)
        r[torch.arange(half) + half, torch.arange(half)] = -1.0  # rotate_half: out_i = -x_{i+h} for i < h
        r[torch.arange(half), torch.arange(half) + half] = 1.0  # and x_{i-h} for i >= h
        self.rotate = r.to(device=emb.device, dtype=emb.dtype)  # on the device: no copy inside a captured step


def _norm(module, x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)


def step(model, fused: FusedLayers, tokens, col, pos, keys, values, bias, q_heads, kv_heads, head_dim, scale):
    """One decode step, as `torch_decode._fixed_step` (same arguments and result: float32 logits [rows, vocab]), with
    the fused products of the module docstring."""
    m = model.model
    x = m.embed_tokens(tokens[:, None])  # [b, 1, hidden]
    b, g, hd = x.shape[0], q_heads // kv_heads, head_dim
    cos, sin = m.rotary_emb(x, pos[:, None])  # [b, 1, hd] each, in x's dtype
    rot = torch.diag_embed(cos[:, 0]) + fused.rotate * sin  # [b, hd, hd]: x @ rot = x*cos + rotate_half(x)*sin
    bias.index_fill_(-1, col, 0.0)
    nq, nkv = fused.q, fused.kv
    for i, (layer, qkv, gate_up) in enumerate(fused.layers):
        att = layer.self_attn
        h = _norm(layer.input_layernorm, x)
        if qkv is not None:
            y = F.linear(h, *qkv)  # [b, 1, nq + 2 nkv]
            qk, v = y[..., :nq + nkv], y[..., nq + nkv:]
        else:
            qk, v = torch.cat([att.q_proj(h), att.k_proj(h)], -1), att.v_proj(h)
        qk = torch.bmm(qk.reshape(b, q_heads + kv_heads, hd), rot)  # rotary on query and key heads at once
        q, k = qk[:, :q_heads], qk[:, q_heads:]
        keys[i].index_copy_(2, col, k.unsqueeze(2))
        values[i].index_copy_(2, col, v.reshape(b, kv_heads, 1, hd))
        scores = torch.add(bias, torch.matmul(q.reshape(b, kv_heads, g, hd), keys[i].transpose(-1, -2)), alpha=scale)
        o = torch.matmul(scores.softmax(-1).to(values[i].dtype), values[i])  # [b, kv, g, hd]
        x = x + att.o_proj(o.reshape(b, 1, q_heads * hd))
        h = _norm(layer.post_attention_layernorm, x)
        mlp = layer.mlp
        if gate_up is not None:
            y = F.linear(h, *gate_up)
            half = y.shape[-1] // 2
            a = mlp.act_fn(y[..., :half]) * y[..., half:]
        else:
            a = mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h)
        x = x + mlp.down_proj(a)
    return model.lm_head(_norm(m.norm, x))[:, 0].float()
