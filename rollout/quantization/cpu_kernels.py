"""Which route a CPU int8 or int4 product takes, measured per weight shape on this machine, and the int4 dequantizer.

torch's CPU kernels for weight-only int8 and int4 (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) read
the quantized weight inside the kernel, which pays at a decode step's few rows, but they decode the weight again for
every block of 4 rows: their time grows with the rows. A product of many rows (a prefill) is faster as one plain
product on the weight decoded once into the activations' dtype. On a 2-core Xeon with AMX:

- int8, [8960, 1536] alone: 0.75 ms through the kernel against 1.31 ms in bf16 at 1 row, but 1.98 against 1.19 at 8
  rows (bench/gpu_matmuls.py --device cpu);
- int4, Qwen2.5-0.5B's shape: a 2,048-token prefill at 146 tokens/s with every product through the kernel, 612 with
  the weight decoded past the kernel's rows (bf16: 714; bench/model_ladder.py).

qgrpo's own int8 and int4 kernels (rollout/quantization/cpu_native.py) read the weight once per call for all rows, which
moves the crossovers up without removing them (at many rows a bf16 product on AMX or AVX512-BF16 still wins); where they
are built, `int8_kernel` and `int4_kernel` are they, else torch's. So the rows up to which each kernel wins are
measured, for each weight shape
and activation dtype, at the first product of that shape (``cpu_int8_rows``, ``cpu_int4_rows``; a few ms for int8,
2-4 s for an int4 [8960, 1536] on 2 cores). The routes round differently, so a measure is kept in a file of the cache
(``ROUTES_FILE``, core/measured.py; under a key of the CPU model, kernel capability, thread count, torch version and
qgrpo's kernels) that every later process on the machine reads: a run resumed, or its actor replaced, samples through
the same routes as before. The first record of a shape holds.

The int4 dequantizer (``int4_dequantize``) unpacks torch's CPU packing, whose layout depends on the kernel's vector
width (the comment above ``weight_to_int4pack_kernel`` in aten/src/ATen/native/cpu/int4mm_kernel.cpp): blocks of
64 (AVX-512) or 32 (AVX2, the scalar build) output rows, each stored as [K, block / 2] bytes. In a whole block on
AVX-512 and AVX2 the low nibbles hold the block's first half of rows and the high nibbles its second half ("lanes");
in the scalar build, and in the tail after the last whole block, a byte holds two neighbouring rows ("pairs"). Which
layout this process's torch packs is found once, by unpacking a probe weight and comparing with the kernel's own
product on the identity (``int4_layout``); if none matches, every int4 product stays on the kernel.
"""

from __future__ import annotations

import time

import torch

from qgrpo.core import measured
from qgrpo.rollout.quantization import cpu_native

ROUTES_FILE = "cpu_int8_rows.json"  # under the cache root (core/storage.py: cache_root), by machine key
ROW_STEPS = (1, 2, 4, 8, 16, 32, 64)  # the row counts at which the int8 routes are compared
INT4_ROW_STEPS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # and the int4 routes
INT8_KERNEL_MAX_ROWS = 64  # never more rows through the int8 kernel, whatever is measured
# nor through qgrpo's int4 kernel: its cost per row stays flat past a few rows (compute-bound) while the decoded
# route's falls, and the measure's probe weight, hot in cache, favours the kernel at many rows. A 256-token prefill of
# Qwen2.5-1.5B's shape through it ran at 0.47-0.68x the speed of the decoded route on an AVX2-capped Xeon
# (bench/published/model_ladder_cpu_w4a16_avx2*.json, prefill columns).
INT4_KERNEL_MAX_ROWS = 64
TORCH_INT8_K = 16  # torch 2.13's _weight_int8pack_mm crashes (SIGSEGV) on inputs K not a multiple of this
# Weights of at most this many values take qgrpo's int8 kernel up to INT8_KERNEL_MAX_ROWS rows, unmeasured: either
# route costs microseconds there, so a measured crossover is noise, and one route keeps a sequence's numbers from
# depending on how many rows share its batch (a prefill of one prompt or of many; tests/test_backend_contract.py).
SMALL_INT8_WEIGHT = 1 << 19
_ROWS: dict[tuple, int] = {}  # (format, N, K, group, activation dtype[, own int8 kernel]) -> the most rows through it
_LAYOUTS = (("lanes", 64), ("lanes", 32), ("pairs", 32), ("pairs", 64))
_LAYOUT: list = []  # [the layout found] once looked for; [None]: none matched
# Output rows decoded at a time: a [K, 512] slice stays in cache (4096 took twice the time at [8192, 2048]), and a
# large head is never decoded whole.
INT4_CHUNK = 512


def cpu_int8_rows(n: int, k: int, dtype: torch.dtype) -> int:
    """The most rows (of ROW_STEPS, up to INT8_KERNEL_MAX_ROWS; 0: none) for which `_weight_int8pack_mm` beat
    torchao's arithmetic (cast, product in `dtype`, scale) on a random int8 weight [n, k] on this CPU, in this
    process's threads: what this machine's routes file holds for it, else measured now (about 1-60 ms) and added."""
    if k % TORCH_INT8_K and not cpu_native.takes(k):
        return 0
    if n * k <= SMALL_INT8_WEIGHT and cpu_native.takes(k):
        return INT8_KERNEL_MAX_ROWS
    return _kernel_rows(("int8", n, k, None, dtype, cpu_native.available()), f"{n}x{k}:{_name(dtype)}",
                        lambda: _measure_int8_rows(n, k, dtype))


def cpu_int4_rows(n: int, k: int, group: int, dtype: torch.dtype) -> int:
    """The most rows (of INT4_ROW_STEPS) for which `int4_kernel` (qgrpo's or torch's) beat decoding the int4 weight
    [n, k] (group `group`) once into `dtype` and one plain product, on this CPU in this process's threads; the largest
    step when the kernel won at every step, or when no dequantizer layout matched this torch (the kernel then takes
    every product: see `int4_product`). Recorded and read as `cpu_int8_rows`'."""
    if int4_layout() is None:
        return INT4_ROW_STEPS[-1]
    rows = _kernel_rows(("int4", n, k, group, dtype, cpu_native.available()),
                        f"int4:{n}x{k}:g{group}:{_name(dtype)}", lambda: _measure_int4_rows(n, k, group, dtype))
    if cpu_native.takes_int4(n, k, group, int4_layout()):
        return min(rows, INT4_KERNEL_MAX_ROWS)
    return rows


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _kernel_rows(key: tuple, name: str, measure) -> int:
    if key not in _ROWS:
        machine = _machine()
        recorded = measured.recall(ROUTES_FILE, machine, name)
        if recorded is None:
            measured.remember(ROUTES_FILE, machine, name, measure())
            recorded = measured.recall(ROUTES_FILE, machine, name)  # another process's record, made first, holds
        _ROWS[key] = int(recorded)
    return _ROWS[key]


def _machine() -> str:
    """The routes file's machine key (core/measured.py): the CPU model, the kernels' capability (AVX-512, or AVX2
    where ATEN_CPU_CAPABILITY caps it: other kernels, other crossovers), torch's thread count and version, and the
    tag of qgrpo's own kernels."""
    return measured.machine_key(torch.get_num_threads(), f"kernels {cpu_native.tag()}")


def _seconds(fn) -> float:
    """Median of 3 calls, after one."""
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[1]


def _climb(steps, k: int, dtype: torch.dtype, kernel, other) -> int:
    """Rows up `steps` while `kernel(x)` is at most as slow as `other(x)`; the last such rows. The kernel's cost per
    row only grows, so the first loss ends the climb."""
    g = torch.Generator().manual_seed(0)
    best = 0
    with torch.no_grad():
        for rows in steps:
            x = torch.randn(rows, k, generator=g).to(dtype)
            if _seconds(lambda x=x: kernel(x)) > _seconds(lambda x=x: other(x)):
                break
            best = rows
    return best


def _measure_int8_rows(n: int, k: int, dtype: torch.dtype) -> int:
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, generator=g) / 127
    return _climb([r for r in ROW_STEPS if r <= INT8_KERNEL_MAX_ROWS], k, dtype, lambda x: int8_kernel(x, q, scale),
                  lambda x: torch.nn.functional.linear(x, q.to(x.dtype)) * scale.to(x.dtype))


def int8_kernel(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [rows, K] through qgrpo's own int8 kernel where it runs here (rollout/quantization/cpu_native.py: every weight
    byte read once for all rows, integer products), else through torch's `_weight_int8pack_mm`; in x's dtype out. Into
    torch's, float32 activations (model.compute_dtype) enter as bf16, as on every machine: its float32 path ran 13x
    slower than its bf16 one on an AVX2 CPU, and rounding to bf16 is far inside int8's own error."""
    if cpu_native.takes(x.shape[-1]):
        return cpu_native.w8a16_mm(x, qdata, scale).to(x.dtype)
    return torch._weight_int8pack_mm(x.to(torch.bfloat16), qdata, scale.to(torch.bfloat16)).to(x.dtype)


def describe(fmt: str) -> str:
    """The kernel this process's CPU `fmt` ("int8" or "int4") products take at a decode step's rows, in words:
    qgrpo's (and on which instruction set) or torch's and why (what `qgrpo check` and the benches print)."""
    if fmt == "int8":
        return cpu_native.describe()
    layout = int4_layout()
    if cpu_native.available() and layout is not None and layout[0] == "lanes":
        return f"qgrpo w4a16 ({cpu_native.isa_words()})"
    why = cpu_native.why_not() or ("this torch's int4 packing is one qgrpo cannot read" if layout is None else
                                   f"this torch packs int4 as {layout[0]}, the kernel reads lanes")
    return f"torch's _weight_int4pack_mm_for_cpu ({why})"


# --- int4 -----------------------------------------------------------------------------------------------------------

def _probe_int4(n: int, k: int, group: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU packing of random int4 codes [n, k] and random (scale, zero) pairs [k / group, n, 2] in bf16."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    sz = torch.stack([torch.rand(k // group, n, generator=g) + 0.5, torch.randn(k // group, n, generator=g)], -1)
    return packed, sz.to(torch.bfloat16)


def int4_layout() -> tuple[str, int] | None:
    """The packing this process's torch uses, (kind, block), found once by unpacking a probe (80 rows: full blocks
    and a tail of 16 at either block width) and comparing with the kernel's product on the identity; None if no known
    layout matches."""
    if not _LAYOUT:
        found = None
        try:
            packed, sz = _probe_int4(80, 128, 64)
            eye = torch.eye(128, dtype=torch.bfloat16)
            want = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, 64, sz)  # [K, N]: the decoded weight
            for layout in _LAYOUTS:
                got = _decode(packed, sz, 80, 128, 64, torch.bfloat16, layout)
                if (got.float() - want.float()).abs().max() <= 0.01 * want.float().abs().max():
                    found = layout
                    break
        except (RuntimeError, ValueError):  # a build without the CPU int4 kernel
            found = None
        _LAYOUT.append(found)
    return _LAYOUT[0]


def int4_dequantize(qdata: torch.Tensor, scale_and_zero: torch.Tensor, n: int, k: int, group: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """The int4 weight packed for `_weight_int4pack_mm_for_cpu` (uint8 [n, k / 2], (scale, zero) pairs
    [k / group, n, 2]) decoded into `dtype`, transposed: [k, n], each value (code - 8) * scale + zero computed in
    float32 as the kernel computes it, then rounded once."""
    layout = int4_layout()
    if layout is None:
        raise RuntimeError("int4_dequantize: this torch packs int4 in a layout we do not know (see int4_layout)")
    return _decode(qdata, scale_and_zero, n, k, group, dtype, layout)


def _decode(qdata, sz, n, k, group, dtype, layout) -> torch.Tensor:
    return torch.cat([_dequantize(qdata, sz, k, group, dtype, layout, a, b) for a, b in _spans(n, layout[1])], 1)


def _spans(n: int, block: int) -> list[tuple[int, int]]:
    """[a, b) column spans decoded at a time: INT4_CHUNK rows of whole blocks, then the tail (under a block)."""
    full = n // block * block
    chunk = max(block, INT4_CHUNK // block * block)
    return [(a, min(a + chunk, full)) for a in range(0, full, chunk)] + ([(full, n)] if full < n else [])


def _dequantize(qdata, sz, k, group, dtype, layout, a: int, b: int) -> torch.Tensor:
    """Rows [a, b) of the weight decoded, [k, b - a]: whole blocks, or the tail after the last whole block."""
    kind, block = layout
    cols = b - a
    if cols % block == 0:  # whole blocks, each [K, block / 2] bytes
        raw = qdata[a:b].reshape(cols // block, k, block // 2)
        if kind == "lanes":  # low nibbles: the block's first half of rows, high: the second
            codes = torch.cat([raw & 15, raw >> 4], -1)
        else:  # a byte holds two neighbouring rows
            codes = torch.stack([raw & 15, raw >> 4], -1).reshape(cols // block, k, block)
        codes = codes.transpose(0, 1).reshape(k, cols)
    else:  # the tail: [K, cols / 2] bytes, two neighbouring rows in a byte
        raw = qdata[a:b].reshape(k, cols // 2)
        codes = torch.stack([raw & 15, raw >> 4], -1).reshape(k, cols)
    s = sz[:, a:b, 0].float().unsqueeze(1)  # [K / group, 1, cols]
    z = sz[:, a:b, 1].float().unsqueeze(1)
    w = codes.view(k // group, group, cols).float().sub_(8).mul_(s).add_(z)
    return w.view(k, cols).to(dtype)


def int4_product(x: torch.Tensor, qdata: torch.Tensor, scale_and_zero: torch.Tensor, n: int, group: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] times the CPU-packed int4 weight [n, K] (+ bias), in x's dtype: through `int4_kernel` up to the rows
    measured faster there (`cpu_int4_rows`), else the weight decoded INT4_CHUNK rows at a time into x's dtype (float32
    where the model computes in float32: no bf16 product emulated), each slice one plain product."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    if int4_layout() is None or rows <= cpu_int4_rows(n, k, group, x.dtype):
        y = int4_kernel(x2, qdata, scale_and_zero, group)[:, :n]
    else:
        y = _decoded_product(x2, qdata, scale_and_zero, n, group)
    y = y.reshape(*x.shape[:-1], n)
    return y if bias is None else y + bias


def _decoded_product(x2: torch.Tensor, qdata: torch.Tensor, sz: torch.Tensor, n: int, group: int) -> torch.Tensor:
    """x2 [rows, K] times the int4 weight decoded INT4_CHUNK output rows at a time into x2's dtype."""
    layout = int4_layout()
    y = torch.empty(x2.shape[0], n, dtype=x2.dtype)
    for a, b in _spans(n, layout[1]):
        y[:, a:b] = x2 @ _dequantize(qdata, sz, x2.shape[1], group, x2.dtype, layout, a, b)
    return y


def _measure_int4_rows(n: int, k: int, group: int, dtype: torch.dtype) -> int:
    """The climb against the route a product past the kernel's rows takes (`_decoded_product`)."""
    packed, sz = _probe_int4(n, k, group)
    steps = INT4_ROW_STEPS
    if cpu_native.takes_int4(n, k, group, int4_layout()):
        steps = [r for r in INT4_ROW_STEPS if r <= INT4_KERNEL_MAX_ROWS]
    return _climb(steps, k, dtype, lambda x: int4_kernel(x, packed, sz, group),
                  lambda x: _decoded_product(x, packed, sz, n, group))


def int4_kernel(x: torch.Tensor, qdata: torch.Tensor, scale_and_zero: torch.Tensor, group: int) -> torch.Tensor:
    """x [rows, K] through qgrpo's own int4 kernel where it takes this weight (rollout/quantization/cpu_native.py:
    torch's packing decoded once per call for all rows, integer products), else through `_weight_int4pack_mm_for_cpu`;
    in x's dtype out. torch's kernel multiplies in the dtype of its (bf16) scales, so float32 activations
    (model.compute_dtype) enter it as bf16."""
    n, layout = scale_and_zero.shape[1], int4_layout()
    if cpu_native.takes_int4(n, x.shape[-1], group, layout):
        return cpu_native.w4a16_mm(x, qdata, scale_and_zero, n, group, layout[1]).to(x.dtype)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(scale_and_zero.dtype).contiguous(), qdata, group,
                                                      scale_and_zero).to(x.dtype)
