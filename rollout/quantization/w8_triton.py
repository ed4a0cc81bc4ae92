"""A weight-only 8-bit matmul for CUDA that reads the 8-bit weight itself: y = (x @ W^T) * scale (+ bias), where W
holds int8 or float8_e4m3fn codes [N, K] with one scale per row.

Why: torchao's weight-only int8 linear (``Int8Tensor``) casts the whole int8 weight to the activation dtype at every
call, so each product writes and reads a bf16 copy of the weight: more bytes than the bf16 model moves, and on an H200
int8 decode ran slower than bf16. fp8's W8A8 product (``torch._scaled_mm``) reads fp8 bytes but first quantizes the
activations per token, five kernels of its own per product, and on an H200 fp8 decode ran at about half bf16's speed: a
decode step's few rows make a product bound by the weight's bytes and by kernel launches, not by arithmetic. This Triton
kernel loads the 8-bit codes tile by tile, converts them to bf16 in registers, accumulates ``x @ w^T`` in fp32 with
``tl.dot``, then applies the per-row fp32 scale and the bias and stores bf16. Meant for decode-sized products
(rollout/quantization/quant.py routes int8's at most ``INT8PACK_ROWS`` rows here, rollout/quantization/fp8.py fp8's at
most ``FP8_WEIGHT_ONLY_ROWS`` where ``FP8_DECODE = "weight_only"``); larger ones are compute-bound and keep their own
paths. fp8 codes need a GPU whose Triton converts float8_e4m3fn (Ada or Hopper, compute capability >= 8.9, which fp8
requires anyway).

Layout: one program per (N tile, M tile, K split). When the N x M tiles alone would leave the GPU's multiprocessors
idle (the narrow projections of a decode step), K is split: each split writes its fp32 partial sums to a workspace
[splits, M, N] and a second small kernel sums the splits and applies the scale and the bias (deterministic, no
atomics). Only long-stable Triton APIs are used (program_id, arange, load / store with masks, dot, trans, cdiv) so it
runs on Triton 3.x. No host syncs: a launch is capturable in a CUDA graph, once each shape has run before capture
(Triton compiles a kernel per constexpr config, per code dtype and per specialization of its integer arguments at the
first call).

Importing this module needs neither Triton nor a GPU (without Triton, ``available()`` is False). With
``TRITON_INTERPRET=1`` set before Triton's import, the same kernel runs on CPU tensors through Triton's interpreter
(tests/test_w8_triton.py); its bf16 ``tl.dot`` and 8-bit -> bf16 casts work on raw bits, so there the dot runs in
fp32.
"""

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: available() is False and the kernel is never defined
    triton = tl = None

BLOCK_K = 128
MAX_ROWS = 64  # the most rows one call takes (BLOCK_M grows to 64 with the rows); more go through cast-and-mm
LAUNCHES = [0]  # kernels launched from Python so far (bench/gpu_speed.py's ops_per_step; ATen does not see them)


# Triton's interpreter is on: its own jitted helpers (tl.zeros, ...) are built as interpreted or compiled functions
# when Triton is imported, by TRITON_INTERPRET then, so the flag must be set before the first import of Triton.
_INTERPRET = tl is not None and os.environ.get("TRITON_INTERPRET", "") == "1"


@functools.lru_cache(maxsize=1)
def _cuda() -> bool:
    return torch.cuda.is_available()


def available() -> bool:
    """Whether ``w8_linear`` can run: Triton importable and a CUDA device, or Triton's interpreter requested
    (``TRITON_INTERPRET=1``, CPU tensors; for tests)."""
    return tl is not None and (_INTERPRET or _cuda())


if tl is not None:
    @triton.jit
    def _w8_mm(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk,
                 stride_ym, stride_yn,
                 HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, K_STEPS: tl.constexpr, DOT_F32: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        # int64 row offsets: N * K of a large vocabulary projection comes close to 2**31
        w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
        x_rows = x_ptr + rm[:, None] * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # K_STEPS whole BLOCK_K steps per split (a constexpr trip count: Triton 3.6's interpreter can't loop to a
        # runtime bound); only K itself is ragged
        k_start = pid_k * (K_STEPS * BLOCK_K)
        for step in range(K_STEPS):
            kk = k_start + step * BLOCK_K + rk
            k_ok = kk < K
            x = tl.load(x_rows + kk[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            # other=0.0, not 0: Triton's interpreter cannot cast an integer 0 to float8_e4m3fn
            w = tl.load(w_rows + kk[None, :] * stride_wk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if DOT_F32:  # Triton's interpreter: its bf16 dot and 8-bit -> bf16 casts work on raw bits
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
            else:
                acc += tl.dot(x, tl.trans(w.to(tl.bfloat16)))
        out_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn
        out_ok = m_ok[:, None] & n_ok[None, :]
        if SPLIT_K == 1:
            scale = tl.load(s_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            out = acc * scale[None, :]
            if HAS_BIAS:
                out += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, out.to(tl.bfloat16), mask=out_ok)
        else:  # fp32 partial sums into this split's slice of the workspace [SPLIT_K, M, N]; _splitk_sum ends it
            tl.store(out_ptrs + pid_k * M * N, acc, mask=out_ok)

    @triton.jit
    def _splitk_sum(ws_ptr, s_ptr, b_ptr, y_ptr, M, N,
                    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
        # y[M, N] (bf16, contiguous) = the sum of the SPLIT_K partial sums in ws [SPLIT_K, M, N] * scale (+ bias)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < M * N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in range(SPLIT_K):
            acc += tl.load(ws_ptr + i * M * N + offs, mask=ok, other=0.0)
        col = offs % N
        out = acc * tl.load(s_ptr + col, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            out += tl.load(b_ptr + col, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, out.to(tl.bfloat16), mask=ok)


@functools.lru_cache(maxsize=8)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _config(rows: int, n: int, k: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, SPLIT_K, k_per_split) for an [rows, k] x [n, k]^T product.

    BLOCK_M: rows rounded up to a power of two in [16, 64] (tl.dot's least tile is 16; one M tile reads the weight
    once). BLOCK_N: 32, so that more programs share a layer's weight, except for a vocabulary head (N >= 65536): 64, or
    128 at 64 rows. K is split until about two programs per multiprocessor run (``_split``). Chosen from a sweep of
    tile configs on an H200 (L2-cold, in CUDA graphs; Triton 3.6) at Qwen2.5-1.5B's shapes, M = 1 and 64.
    """
    block_m = min(MAX_ROWS, max(16, 1 << (rows - 1).bit_length()))
    block_n = 32 if n < 65536 else (128 if block_m == 64 else 64)
    tiles = -(-n // block_n) * -(-rows // block_m)
    sms = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    return (block_m, block_n) + _split(tiles, k, BLOCK_K, sms)


def _split(tiles: int, k: int, block_k: int, sms: int) -> tuple[int, int]:
    """(SPLIT_K, k_per_split): K cut into slices of whole BLOCK_K steps, >= 2 steps each, until `tiles` programs per
    slice fill about 2 * `sms` programs; no slice is empty."""
    steps = -(-k // block_k)
    split = max(1, min(steps // 2, -(-2 * sms // tiles)))
    per_split = -(-steps // split) * block_k
    return -(-k // per_split), per_split


CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)


def w8_linear(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = (x @ qdata^T) * scale (+ bias), in bf16, reading the 8-bit weight directly.

    x: bf16 [..., K]; qdata: int8 or float8_e4m3fn codes [N, K] (any strides); scale: [N] or [N, 1] per output row
    (fp32 or bf16, read as fp32); bias: [N] or None. Accumulates in fp32; returns bf16 [..., N] on x's device. Any
    number of rows works, but it is built for few (decode): more than ``MAX_ROWS`` rows are tiled 64 at a time and
    re-read the weight per tile.
    """
    if x.dtype != torch.bfloat16 or qdata.dtype not in CODE_DTYPES or qdata.dim() != 2:
        raise ValueError(f"w8_linear: needs bf16 x and a 2-D int8 or float8_e4m3fn weight, got x {x.dtype}, "
                         f"weight {qdata.dtype} {tuple(qdata.shape)}")
    n, k = qdata.shape
    if x.shape[-1] != k or scale.numel() != n or (bias is not None and bias.numel() != n):
        raise ValueError(f"w8_linear: shapes don't match: x {tuple(x.shape)}, weight {tuple(qdata.shape)}, "
                         f"scale {tuple(scale.shape)}, bias {None if bias is None else tuple(bias.shape)}")
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    scale = scale.reshape(n)
    if rows == 0:
        return x.new_empty(*x.shape[:-1], n)
    y = _launch(x2, qdata, scale, bias, *_config(rows, n, k, x.device))
    return y.reshape(*x.shape[:-1], n)


def _launch(x2: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, block_m: int,
            block_n: int, split: int, per_split: int, block_k: int = BLOCK_K, num_warps: int = 4,
            num_stages: int = 3) -> torch.Tensor:
    """The kernel launches for x2 [M, K] under a given tile config: y [M, N] bf16. With SPLIT_K > 1 the partial sums
    go to an fp32 workspace [SPLIT_K, M, N] and a second small kernel sums them, scales and adds the bias."""
    rows, (n, k) = x2.shape[0], qdata.shape
    grid = (-(-n // block_n), -(-rows // block_m), split)
    y = torch.empty(rows, n, device=x2.device, dtype=torch.bfloat16)
    ws = y if split == 1 else torch.empty(split, rows, n, device=x2.device, dtype=torch.float32)
    b = bias if bias is not None else scale  # any pointer: HAS_BIAS=False never reads it
    LAUNCHES[0] += 1 + (split > 1)
    _w8_mm[grid](x2, qdata, scale, b, ws, rows, n, k, x2.stride(0), x2.stride(1), qdata.stride(0),
                   qdata.stride(1), ws.stride(-2), ws.stride(-1),
                   HAS_BIAS=bias is not None, SPLIT_K=split, K_STEPS=per_split // block_k, DOT_F32=_INTERPRET,
                   BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    if split > 1:
        block = 1024
        _splitk_sum[(-(-rows * n // block),)](ws, scale, b, y, rows, n, HAS_BIAS=bias is not None, SPLIT_K=split,
                                               BLOCK=block)
    return y


def reference(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product in float32 with plain torch ops: (x @ qdata^T) * scale (+ bias), shape [..., N]."""
    y = (x.float() @ qdata.float().t()) * scale.float().reshape(-1)
    return y if bias is None else y + bias.float()
