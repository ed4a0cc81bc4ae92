"""Triton kernels for the fused decode step (torch_fused.py): fewer, larger kernels per layer on CUDA.

A replayed decode step at a few rows costs about what its kernels cost one after another, a few microseconds each
however little each computes (torch_fused.py's docstring has the figures). Per decoder layer these kernels do in one
launch what torch ops do in several:

- ``add_rms_norm``: the residual sum and the next RMSNorm (2 kernels -> 1, twice per layer). The sum is rounded to
  the stream's dtype before the norm reads it, as ``x = x + r`` then the model's norm (float32 inside) would.
- ``silu_mul``: SwiGLU's ``silu(gate) * up`` over the joint gate/up product (2 -> 1); float32 inside, one rounding.
- ``rope_write``: the rotary embedding of the query and key heads (HF's ``x * cos + rotate_half(x) * sin``, float32
  inside) and the write of the rotated keys and the values into their cache column (3 -> 1).
- ``attend``: GQA attention of one new query per row over the whole cache, the additive float32 mask ``bias``
  included, with an online softmax (4 -> 1: scores, mask, softmax, weighted sum). Products in bf16 with float32
  accumulation on a GPU; the probabilities are rounded to the cache's dtype before the product with the values, as
  the torch step does.

Each wrapper falls back to nothing: ``torch_fused`` decides once per model (``FusedLayers``) whether it uses them,
after ``self_check`` ran each kernel at the model's shapes on its device against the torch ops it replaces. A kernel
that fails to compile or disagrees leaves the torch ops in place, and ``decode_info()["kernels"]`` says why. No
kernel synchronizes with the host or branches on data outside the GPU, so a step that uses them is captured in a
CUDA graph like the rest. With ``TRITON_INTERPRET=1`` set before Triton's import they run on CPU tensors in Triton's
interpreter (tests/test_w8_triton.py runs the fused decode there); its bf16 products work on raw bits, so there the
products run in float32 (``DOT_F32``).
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: available() is False and no kernel is defined
    triton = tl = None

_INTERPRET = tl is not None and os.environ.get("TRITON_INTERPRET", "") == "1"
ATTEND_BLOCK_T = 64  # cache columns per step of attend's loop
LAUNCHES = [0]  # kernels launched from Python so far (bench/gpu_speed.py's ops_per_step; ATen does not see them)


def available(device: torch.device) -> bool:
    """Whether the kernels can run on `device`: Triton and a CUDA device, or Triton's interpreter on the CPU."""
    return tl is not None and (device.type == "cuda" or (_INTERPRET and device.type == "cpu"))


if tl is not None:
    @triton.jit
    def _add_rms_norm(x_ptr, r_ptr, w_ptr, sum_ptr, out_ptr, n, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        ok = offs < n
        x = tl.load(x_ptr + row * n + offs, mask=ok, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * n + offs, mask=ok, other=0.0).to(tl.float32)
        s = (x + r).to(sum_ptr.dtype.element_ty)  # the residual stream, rounded as `x + r` rounds it
        tl.store(sum_ptr + row * n + offs, s, mask=ok)
        sf = s.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(sf * sf, axis=0) / n + eps)
        w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n + offs, (sf * inv * w).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul(y_ptr, out_ptr, n, stride_y, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n
        g = tl.load(y_ptr + row * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(y_ptr + row * stride_y + n + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n + cols, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rope_write(y_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, col_ptr, stride_y, stride_c, stride_kb, stride_kh,
                    stride_kt, QH: tl.constexpr, KVH: tl.constexpr, HALF: tl.constexpr):
        # program (row, head): heads [0, QH) are queries, [QH, QH + KVH) keys (both rotated), then KVH values
        row = tl.program_id(0)
        head = tl.program_id(1)
        d = tl.arange(0, HALF)
        src = y_ptr + row * stride_y + head * (2 * HALF)
        x1 = tl.load(src + d).to(tl.float32)
        x2 = tl.load(src + HALF + d).to(tl.float32)
        col = tl.load(col_ptr)
        if head < QH + KVH:
            c = tl.load(cos_ptr + row * stride_c + d).to(tl.float32)  # cos and sin repeat over the two halves
            s = tl.load(sin_ptr + row * stride_c + d).to(tl.float32)
            o1 = x1 * c - x2 * s
            o2 = x2 * c + x1 * s
            if head < QH:
                dst = q_ptr + (row * QH + head) * (2 * HALF)
            else:
                dst = k_ptr + row * stride_kb + (head - QH) * stride_kh + col * stride_kt
        else:
            o1 = x1
            o2 = x2
            dst = v_ptr + row * stride_kb + (head - QH - KVH) * stride_kh + col * stride_kt
        tl.store(dst + d, o1.to(dst.dtype.element_ty))
        tl.store(dst + HALF + d, o2.to(dst.dtype.element_ty))

    @triton.jit
    def _attend(q_ptr, k_ptr, v_ptr, bias_ptr, o_ptr, scale, width, n_blocks, stride_kb, stride_kh, stride_kt,
                stride_bias, KVH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr,
                BLOCK_T: tl.constexpr, DOT_F32: tl.constexpr):
        # program (row, kv head): its G query heads (padded to GP rows for tl.dot) over every cache column
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        g = tl.arange(0, GP)
        d = tl.arange(0, HD)
        g_ok = g < G
        q_rows = q_ptr + (row * KVH * G + kvh * G + g)[:, None] * HD + d[None, :]
        q = tl.load(q_rows, mask=g_ok[:, None], other=0.0)
        m = tl.full((GP,), -1.0e30, dtype=tl.float32)  # finite: a block of masked (-inf) columns gives exp(-inf) = 0
        den = tl.zeros((GP,), dtype=tl.float32)
        acc = tl.zeros((GP, HD), dtype=tl.float32)
        kv = row * stride_kb + kvh * stride_kh
        for i in range(0, n_blocks):
            t = i * BLOCK_T + tl.arange(0, BLOCK_T)
            t_ok = t < width
            k = tl.load(k_ptr + kv + t[:, None] * stride_kt + d[None, :], mask=t_ok[:, None], other=0.0)
            v = tl.load(v_ptr + kv + t[:, None] * stride_kt + d[None, :], mask=t_ok[:, None], other=0.0)
            if DOT_F32:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale + tl.load(bias_ptr + row * stride_bias + t, mask=t_ok, other=float("-inf"))[None, :]
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            den = den * alpha + tl.sum(p, axis=1)
            pv = p.to(v.dtype)  # the probabilities in the cache's dtype, as the torch step's product takes them
            if DOT_F32:
                acc = acc * alpha[:, None] + tl.dot(pv.to(tl.float32), v.to(tl.float32))
            else:
                acc = acc * alpha[:, None] + tl.dot(pv, v)
            m = m_new
        out = o_ptr + (row * KVH * G + kvh * G + g)[:, None] * HD + d[None, :]
        tl.store(out, (acc / den[:, None]).to(o_ptr.dtype.element_ty), mask=g_ok[:, None])


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + r, rms_norm(x + r) * weight) for x, r [..., n] of one dtype: the new residual stream and the next layer
    norm's output, in one kernel."""
    n = x.shape[-1]
    x2, r2 = x.reshape(-1, n), r.reshape(-1, n)
    s, out = torch.empty_like(x2), torch.empty_like(x2)
    LAUNCHES[0] += 1
    _add_rms_norm[(x2.shape[0],)](x2, r2, weight, s, out, n, eps, BLOCK=triton.next_power_of_2(n))
    return s.view(x.shape), out.view(x.shape)


def silu_mul(y: torch.Tensor) -> torch.Tensor:
    """silu(y[..., :n]) * y[..., n:] for the joint gate/up product y [..., 2n] (rows may be strided)."""
    n = y.shape[-1] // 2
    y2 = y.reshape(-1, 2 * n)
    out = y.new_empty(y2.shape[0], n)
    block = 1024
    LAUNCHES[0] += 1
    _silu_mul[(y2.shape[0], triton.cdiv(n, block))](y2, out, n, y2.stride(0), BLOCK=block)
    return out.view(*y.shape[:-1], n)


def rope_write(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               col: torch.Tensor, q_heads: int, kv_heads: int) -> torch.Tensor:
    """From the joint q/k/v product y [b, 1, (q_heads + 2 kv_heads) * hd]: the rotated queries [b, q_heads, hd], and the
    rotated keys and the values written into column `col` (a 1-element tensor) of keys / values [b, kv, width, hd].
    cos / sin: [b, 1, hd], as the model's rotary embedding gives them. Qwen3's query and key heads are RMS-normed in y
    before (torch_fused.step): this kernel rotates what it is given."""
    b, hd = y.shape[0], keys.shape[-1]
    y2 = y.reshape(b, -1)
    c2, s2 = cos.reshape(b, hd), sin.reshape(b, hd)
    q = y.new_empty(b, q_heads, hd)
    LAUNCHES[0] += 1
    _rope_write[(b, q_heads + 2 * kv_heads)](y2, c2, s2, q, keys, values, col, y2.stride(0), c2.stride(0),
                                             keys.stride(0), keys.stride(1), keys.stride(2),
                                             QH=q_heads, KVH=kv_heads, HALF=hd // 2)
    return q


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v for one query per row: q [b, q_heads, hd], keys / values [b, kv, width, hd]
    (one layout, values' strides equal keys'), bias float32 [b, 1, 1, width]; [b, q_heads, hd] in q's dtype."""
    b, q_heads, hd = q.shape
    kv_heads, width = keys.shape[1], keys.shape[2]
    g = q_heads // kv_heads
    out = torch.empty_like(q)
    LAUNCHES[0] += 1
    _attend[(b, kv_heads)](q, keys, values, bias, out, scale, width, triton.cdiv(width, ATTEND_BLOCK_T),
                           keys.stride(0), keys.stride(1), keys.stride(2), bias.stride(0),
                           KVH=kv_heads, G=g, GP=max(16, triton.next_power_of_2(g)), HD=hd, BLOCK_T=ATTEND_BLOCK_T,
                           DOT_F32=_INTERPRET)
    return out


_CHECKED: dict[tuple, str | None] = {}


def self_check(model, q_heads: int, kv_heads: int, head_dim: int) -> str | None:
    """None where every kernel, run at `model`'s shapes on its device, computes what the torch ops it replaces do
    (within the rounding of the model's dtype); else why not (a compile error, a mismatch). Once per device, shapes
    and dtype in a process."""
    emb = model.model.embed_tokens.weight
    layer = model.model.layers[0]
    hidden, inter = emb.shape[1], layer.mlp.gate_proj.out_features
    key = (str(emb.device), emb.dtype, hidden, inter, q_heads, kv_heads, head_dim)
    if key not in _CHECKED:
        try:
            _CHECKED[key] = _check(model, q_heads, kv_heads, head_dim, hidden, inter)
        except Exception as e:  # noqa: BLE001 - a kernel that fails to compile or run leaves the torch ops in place
            _CHECKED[key] = f"self-check failed: {type(e).__name__}: {str(e)[:300]}"
    return _CHECKED[key]


@torch.no_grad()
def _check(model, q_heads: int, kv_heads: int, head_dim: int, hidden: int, inter: int) -> str | None:
    emb = model.model.embed_tokens.weight
    dev, dt = emb.device, emb.dtype
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=dev, dtype=dt)

    def off(name, got, want) -> str | None:
        got, want = got.float(), want.float()
        err = (got - want).abs().max().item()
        tol = 2e-2 * want.abs().max().item() + 1e-3
        return None if err <= tol else f"self-check: {name} differs from the torch ops by {err:.3g} (bound {tol:.3g})"

    b, width, col = 3, 2 * ATTEND_BLOCK_T + 5, 70
    norm = model.model.layers[0].post_attention_layernorm
    x, r = rand(b, 1, hidden), rand(b, 1, hidden)
    s, h = add_rms_norm(x, r, norm.weight, norm.variance_epsilon)
    want_s = x + r
    want_h = torch.nn.functional.rms_norm(want_s.float(), (hidden,), norm.weight.float(), norm.variance_epsilon)
    y = rand(b, 1, 2 * inter)
    want_a = torch.nn.functional.silu(y[..., :inter].float()) * y[..., inter:].float()
    heads = q_heads + 2 * kv_heads
    y_qkv = rand(b, 1, heads * head_dim)
    pos = torch.tensor([[3], [40], [col]], device=dev)
    cos, sin = model.model.rotary_emb(y_qkv, pos)
    keys, values = rand(b, kv_heads, width, head_dim), rand(b, kv_heads, width, head_dim)
    k0, v0 = keys.clone(), values.clone()
    q = rope_write(y_qkv, cos, sin, keys, values, torch.tensor([col], device=dev), q_heads, kv_heads)
    parts = y_qkv.float().reshape(b, heads, head_dim)
    half = head_dim // 2
    rotated = parts * cos.float() + torch.cat([-parts[..., half:], parts[..., :half]], -1) * sin.float()
    k0[:, :, col], v0[:, :, col] = rotated[:, q_heads:q_heads + kv_heads].to(dt), parts[:, q_heads + kv_heads:].to(dt)
    bias = torch.zeros(b, 1, 1, width, device=dev)
    bias[0, ..., 50:] = float("-inf")  # a row that attends to fewer columns than a block holds
    bias[1, ..., ATTEND_BLOCK_T:2 * ATTEND_BLOCK_T] = float("-inf")  # a whole block masked
    scale = head_dim ** -0.5
    o = attend(q, keys, values, bias, scale)
    g = q_heads // kv_heads
    scores = q.float().reshape(b, kv_heads, g, head_dim) @ keys.float().transpose(-1, -2) * scale + bias
    want_o = (scores.softmax(-1) @ values.float()).reshape(b, q_heads, head_dim)
    checks = [("add_rms_norm's sum", s, want_s), ("add_rms_norm's norm", h, want_h), ("silu_mul", silu_mul(y), want_a),
              ("rope_write's queries", q, rotated[:, :q_heads]), ("rope_write's keys", keys, k0),
              ("rope_write's values", values, v0), ("attend", o, want_o)]
    for name, got, want in checks:
        if not torch.isfinite(got).all():
            return f"self-check: {name} is not finite"
        why = off(name, got, want)
        if why:
            return why
    return None
