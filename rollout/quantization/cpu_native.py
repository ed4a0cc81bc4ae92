"""qgrpo's own CPU kernels for weight-only int8 and int4 products at a decode step's few rows
(rollout/quantization/csrc/w8a16_cpu.cpp, rollout/quantization/csrc/w4a16_cpu.cpp).

torch's `_weight_int8pack_mm` decodes the weight again for every block of 4 rows, so its time grows with the rows: at
8 rows of a [8960, 1536] weight it was slower than the bf16 product it is meant to beat. This kernel reads each weight
byte once per call for all of the call's rows, and multiplies in integers: the activations are rounded to int16 with a
scale per row and block of 256 inputs (a rounding 100x finer than the bf16 torch's kernel rounds them to), the products
are summed exactly in int32 (vpmaddwd on AVX2, vpdpwssd on AVX-512 VNNI) and scaled into float32.

torch's `_weight_int4pack_mm_for_cpu` has the same habit. The int4 kernel works on torch's own packing of the weight
(so nothing is stored twice and torch's kernel stays the fallback): it decodes a chunk of one block of output rows once
into int16 pairs that stay in L1, and multiplies every row of the call with them, in the same integer arithmetic
(activations as int16 with a scale per row and group, the group's zero term from the float sum of its inputs).

The sources are compiled at first use into one library with the system's C++ compiler (``$CXX``, else g++, c++ or
clang++; a few seconds, no torch headers) in the qgrpo cache (``kernels/``, named by a digest of the sources, the
compiler and the flags), under a file lock so that the rollout actors of one machine build it once. Where it cannot
run (no compiler, the build fails, not x86-64, no AVX2 and FMA) ``available()`` is False with the reason in
``why_not()``, and the int8 and int4 products go through torch's kernels as before. ``QGRPO_CPU_KERNEL=torch`` keeps
torch's kernels on purpose (to compare, or to rule these out).

The instruction set follows torch's: on a CPU with AVX-512 VNNI, the AVX-512 path unless ATEN_CPU_CAPABILITY caps
torch below AVX-512 (then the AVX2 path, so that a capped run behaves as an AVX2-only CPU would).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
from contextlib import contextmanager
from pathlib import Path

import torch

from qgrpo.core.cpu import current_wait

SOURCES = tuple(Path(__file__).resolve().parent / "csrc" / name for name in ("w8a16_cpu.cpp", "w4a16_cpu.cpp"))
INT4_GROUPS = (32, 64, 128, 256)  # the group sizes the int4 kernel takes
INT4_BLOCKS = (32, 64)  # and the blocks of output rows of torch's "lanes" packing
FLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp", "-std=c++17"]
ENV_SWITCH, OFF = "QGRPO_CPU_KERNEL", "torch"  # QGRPO_CPU_KERNEL=torch: never this kernel
ISA_AVX2, ISA_VNNI = 2, 5  # the codes qg_w8a16_mm takes
# Bytes ahead of each int8 weight row being read that the int8 kernel asks the memory for (0: none; see the comment at
# the top of w8a16_cpu.cpp). Read at every call: bench/model_ladder.py's int8/noprefetch variant sets it to 0.
INT8_PREFETCH = 1024
# int8 products of at most SMALL_ROWS rows and a weight under SMALL_BYTES bytes run on one thread while the process's
# idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE, no GOMP_SPINCOUNT: rollout.cpu_wait = "passive"): waking the
# other thread costs more than it saves on a small weight (docs/performance.md, "The decode step's small operations on
# one thread"). 0: never. int4's products keep every thread: decoding the nibbles is compute, and one thread lost at 8
# rows.
SMALL_BYTES = 0 if current_wait() == "spin" else 2_000_000
SMALL_ROWS = 16
_STATE: dict = {}  # "lib", "isa", "why" once loaded or refused
_WORK = threading.local()  # each thread's work space for the kernels (`_work`), grown as calls need


def isa_code() -> tuple[int | None, str]:
    """(the kernel's instruction-set code for this process, or None; in words)."""
    from qgrpo.core.cpu import _flags, isa

    if platform.machine() not in ("x86_64", "AMD64"):
        return None, f"{platform.machine()} is not x86-64"
    flags, _ = _flags()
    if not {"avx2", "fma"} <= flags:
        return None, "this CPU has no AVX2 and FMA"
    if isa().avx512 and {"avx512bw", "avx512_vnni"} <= flags:
        return ISA_VNNI, "AVX-512 VNNI"
    return ISA_AVX2, "AVX2" + (f" (capped by {isa().capped_by})" if isa().capped_by else "")


def available() -> bool:
    """Whether int8 products can go through this kernel in this process (built and loaded on first ask)."""
    return _load() is not None


def why_not() -> str:
    """Why `available()` is False ("" when it is True)."""
    _load()
    return _STATE.get("why", "")


def describe() -> str:
    """'qgrpo w8a16 (AVX-512 VNNI)' or "torch's _weight_int8pack_mm (why)": the int8 kernel this process uses
    (cpu_kernels.describe("int4") says which int4 kernel)."""
    if available():
        return f"qgrpo w8a16 ({isa_words()})"
    return f"torch's _weight_int8pack_mm ({why_not()})"


def isa_words() -> str:
    """The instruction set the kernels run on here, in words ("" where they do not run)."""
    return _STATE.get("isa_words", "") if available() else ""


@contextmanager
def torch_kernel():
    """Within it, int8 and int4 products take torch's kernels in this process, as under QGRPO_CPU_KERNEL=torch (a
    bench's side-by-side variant)."""
    _load()
    held = dict(_STATE)
    _STATE.update(lib=None, why=f"{ENV_SWITCH}=torch (cpu_native.torch_kernel)")
    try:
        yield
    finally:
        _STATE.clear()
        _STATE.update(held)


def _load():
    if "lib" in _STATE:
        return _STATE["lib"]
    lib, why = None, ""
    if os.environ.get(ENV_SWITCH, "").strip().lower() == OFF:
        why = f"{ENV_SWITCH}=torch"
    else:
        code, words = isa_code()
        if code is None:
            why = words
        else:
            try:
                lib = _build_and_open()
                _STATE["isa"], _STATE["isa_words"] = code, words
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                why = f"the kernel could not be built here: {e}"
    _STATE["lib"], _STATE["why"] = lib, why
    return lib


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise RuntimeError("no C++ compiler ($CXX, g++, c++ or clang++) on PATH")


def _build_and_open():
    from qgrpo.core.storage import cache_root

    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    sources = b"".join(src.read_bytes() for src in SOURCES)
    digest = hashlib.sha256(sources + version.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    folder = cache_root() / "kernels"
    path = folder / f"qgrpo_cpu-{digest}.so"
    if not path.is_file():
        import fcntl

        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"{path.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the machine's other processes wait for one build
            if not path.is_file():
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                done = subprocess.run([cxx, *FLAGS, *map(str, SOURCES), "-o", str(tmp)], capture_output=True, text=True,
                                      timeout=300)
                if done.returncode != 0:
                    tmp.unlink(missing_ok=True)
                    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
                    raise RuntimeError(f"{Path(cxx).name} exited {done.returncode}: {' | '.join(tail)}")
                tmp.replace(path)
    lib = ctypes.CDLL(str(path))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.qg_w8a16_mm.argtypes = [p, i64, i64, p, p, i64, p, p, ctypes.c_int, ctypes.c_int, i64]
    lib.qg_w8a16_mm.restype = ctypes.c_int
    lib.qg_w8a16_workspace.argtypes = [i64, i64]
    lib.qg_w8a16_workspace.restype = i64
    lib.qg_w4a16_mm.argtypes = [p, i64, i64, p, p, i64, i64, i64, p, p, ctypes.c_int, ctypes.c_int]
    lib.qg_w4a16_mm.restype = ctypes.c_int
    lib.qg_w4a16_workspace.argtypes = [i64, i64, i64]
    lib.qg_w4a16_workspace.restype = i64
    return lib


def tag() -> str:
    """'qgrpo-<digest of the kernels' sources>' where they run in this process, else 'torch': the routes file keys its
    measured crossovers by it, so that other kernels (or a changed one) are measured afresh."""
    if not available():
        return "torch"
    return "qgrpo-" + hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES)).hexdigest()[:8]


def takes(k: int) -> bool:
    """Whether a product with `k` inputs can go through the kernel here (it works in blocks of 32 inputs)."""
    return k % 32 == 0 and available()


def _work(nbytes: int) -> int:
    """The address of at least `nbytes` of this thread's work space: kept between calls (a decode step makes hundreds
    of small products, whose time an allocation each would add to), grown when a call needs more."""
    held = getattr(_WORK, "buffer", None)
    if held is None or held.numel() < nbytes:
        held = _WORK.buffer = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
    return held.data_ptr()


def _threads(rows: int, weight_bytes: int) -> int:
    """The threads of a product of `rows` rows by a weight of `weight_bytes` bytes: torch's count, or one (SMALL_*)."""
    return 1 if weight_bytes < SMALL_BYTES and rows <= SMALL_ROWS else torch.get_num_threads()


def _float32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.contiguous().float()


def w8a16_mm(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [rows, K] times the int8 weight `qdata` [N, K] with per-row `scale` [N]: float32 out. Needs `takes(K)`."""
    lib = _load()
    x = _float32(x)
    rows, k = x.shape
    n = qdata.shape[0]
    q = qdata if qdata.is_contiguous() else qdata.contiguous()
    s = _float32(scale)
    out = torch.empty(rows, n, dtype=torch.float32)
    code = lib.qg_w8a16_mm(x.data_ptr(), rows, k, q.data_ptr(), s.data_ptr(), n, out.data_ptr(),
                           _work(lib.qg_w8a16_workspace(rows, k)), _STATE["isa"], _threads(rows, q.numel()),
                           INT8_PREFETCH)
    if code != 0:
        raise RuntimeError(f"qg_w8a16_mm returned {code} for x {tuple(x.shape)}, weight {tuple(q.shape)}")
    return out


def takes_int4(n: int, k: int, group: int, layout: tuple[str, int] | None) -> bool:
    """Whether an int4 product of the weight [n, k] (groups of `group`), packed by this torch in `layout`
    (cpu_kernels.int4_layout), can go through the int4 kernel here: torch's "lanes" packing in whole blocks."""
    return (layout is not None and layout[0] == "lanes" and layout[1] in INT4_BLOCKS and n % layout[1] == 0
            and group in INT4_GROUPS and k % group == 0 and available())


def w4a16_mm(x: torch.Tensor, qdata: torch.Tensor, scale_and_zero: torch.Tensor, n: int, group: int,
             block: int) -> torch.Tensor:
    """x [rows, K] times the int4 weight [n, K] as torch packs it for `_weight_int4pack_mm_for_cpu` (uint8 `qdata`
    in blocks of `block` output rows, bf16 (scale, zero) pairs [K / group, n, 2]): float32 out. Needs
    `takes_int4`."""
    lib = _load()
    x = _float32(x)
    rows, k = x.shape
    q = qdata if qdata.is_contiguous() else qdata.contiguous()
    sz = scale_and_zero if scale_and_zero.is_contiguous() else scale_and_zero.contiguous()
    if sz.dtype != torch.bfloat16 or tuple(sz.shape) != (k // group, n, 2) or q.numel() * 2 != n * k:
        raise ValueError(f"w4a16_mm: expected bf16 scale/zero pairs [{k // group}, {n}, 2] and {n * k // 2} packed "
                         f"bytes, got {sz.dtype} {tuple(sz.shape)} and {q.numel()}")
    out = torch.empty(rows, n, dtype=torch.float32)
    code = lib.qg_w4a16_mm(x.data_ptr(), rows, k, q.data_ptr(), sz.data_ptr(), n, group, block, out.data_ptr(),
                           _work(lib.qg_w4a16_workspace(rows, k, group)), _STATE["isa"], torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"qg_w4a16_mm returned {code} for x {tuple(x.shape)}, weight [{n}, {k}], group {group}, "
                           f"block {block}")
    return out
