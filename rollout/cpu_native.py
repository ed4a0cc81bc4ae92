"""qgrpo's own CPU kernel for weight-only int8 products at a decode step's few rows (rollout/csrc/w8a16_cpu.cpp).

torch's `_weight_int8pack_mm` decodes the weight again for every block of 4 rows, so its time grows with the rows: at
8 rows of a [8960, 1536] weight it was slower than the bf16 product it is meant to beat. This kernel reads each weight
byte once per call for all of the call's rows, and multiplies in integers: the activations are rounded to int16 with a
scale per row and block of 256 inputs (a rounding 100x finer than the bf16 torch's kernel rounds them to), the products
are summed exactly in int32 (vpmaddwd on AVX2, vpdpwssd on AVX-512 VNNI) and scaled into float32.

The source is compiled at first use with the system's C++ compiler (``$CXX``, else g++, c++ or clang++; about a
second, no torch headers) into the qgrpo cache (``kernels/``, named by a digest of the source, the compiler and the
flags), under a file lock so that the rollout actors of one machine build it once. Where it cannot run (no compiler,
the build fails, not x86-64, no AVX2 and FMA) ``available()`` is False with the reason in ``why_not()``, and the
int8 products go through torch's kernel as before. ``QGRPO_CPU_KERNEL=torch`` keeps torch's kernel on purpose (to
compare, or to rule this one out).

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
from contextlib import contextmanager
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "csrc" / "w8a16_cpu.cpp"
FLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp", "-std=c++17"]
ENV_SWITCH, OFF = "QGRPO_CPU_KERNEL", "torch"  # QGRPO_CPU_KERNEL=torch: never this kernel
ISA_AVX2, ISA_VNNI = 2, 5  # the codes qg_w8a16_mm takes
_STATE: dict = {}  # "lib", "isa", "why" once loaded or refused


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
    """'qgrpo w8a16 (AVX-512 VNNI)' or "torch's _weight_int8pack_mm (why)": the int8 kernel this process uses."""
    if available():
        return f"qgrpo w8a16 ({_STATE['isa_words']})"
    return f"torch's _weight_int8pack_mm ({why_not()})"


@contextmanager
def torch_kernel():
    """Within it, int8 products take torch's kernel in this process, as under QGRPO_CPU_KERNEL=torch (a bench's
    side-by-side variant)."""
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
    digest = hashlib.sha256(SOURCE.read_bytes() + version.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    folder = cache_root() / "kernels"
    path = folder / f"w8a16_cpu-{digest}.so"
    if not path.is_file():
        import fcntl

        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"{path.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the machine's other processes wait for one build
            if not path.is_file():
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                done = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True,
                                      timeout=300)
                if done.returncode != 0:
                    tmp.unlink(missing_ok=True)
                    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
                    raise RuntimeError(f"{Path(cxx).name} exited {done.returncode}: {' | '.join(tail)}")
                tmp.replace(path)
    lib = ctypes.CDLL(str(path))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.qg_w8a16_mm.argtypes = [p, i64, i64, p, p, i64, p, p, ctypes.c_int, ctypes.c_int]
    lib.qg_w8a16_mm.restype = ctypes.c_int
    lib.qg_w8a16_workspace.argtypes = [i64, i64]
    lib.qg_w8a16_workspace.restype = i64
    return lib


def takes(k: int) -> bool:
    """Whether a product with `k` inputs can go through the kernel here (it works in blocks of 32 inputs)."""
    return k % 32 == 0 and available()


def w8a16_mm(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [rows, K] times the int8 weight `qdata` [N, K] with per-row `scale` [N]: float32 out. Needs `takes(K)`."""
    lib = _load()
    x = x.contiguous().float()
    rows, k = x.shape
    n = qdata.shape[0]
    q = qdata.contiguous()
    s = scale.contiguous().float()
    out = torch.empty(rows, n, dtype=torch.float32)
    work = torch.empty(lib.qg_w8a16_workspace(rows, k), dtype=torch.uint8)
    code = lib.qg_w8a16_mm(x.data_ptr(), rows, k, q.data_ptr(), s.data_ptr(), n, out.data_ptr(), work.data_ptr(),
                           _STATE["isa"], torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"qg_w8a16_mm returned {code} for x {tuple(x.shape)}, weight {tuple(q.shape)}")
    return out
