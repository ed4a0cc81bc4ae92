"""What this machine's processor computes natively, and what that means for a run.

On a CPU, bf16 matrix products are fast only with hardware bf16 (AVX512-BF16 or AMX-BF16). Without it torch and oneDNN
convert each block to float32 and back: measured on an AVX2-only AMD EPYC, 7.5 GFLOP/s in bf16 against 44 in fp32 on
a 512x576x1536 product, and the default job's first step took 577 s instead of 12. So the roles that compute with the
policy in torch (the learner, the reference, the torch generator) choose their compute dtype here:

- `compute_dtype(setting, device)`: "bf16" or "fp32" forced, or "auto" by the device: bf16 where it computes it
  natively, fp32 elsewhere, with the reason in words. A local run's CPU roles do better: their own work is timed in
  each precision the flags allow and the faster taken per role (cluster/run/compute_auto.py), since native bf16 can
  still be slower than fp32 (a Xeon with AVX512-BF16 and no AMX); what is decided here is what a role falls back to
  where nothing was timed (a cluster's nodes, a GPU, `qgrpo serve`). The weights the learner streams and saves stay
  bf16 either way (learner/engine.py), so receivers and checkpoints are the same on every machine.
- `isa()`: what the processor offers, as torch and oneDNN will use it: the cpuid flags, less what the environment
  caps (`ATEN_CPU_CAPABILITY` for torch's own kernels, `ONEDNN_MAX_CPU_ISA` for oneDNN's products). Setting both to
  AVX2 on an AVX-512 machine makes it behave, and be judged, as an AVX2-only one.
- `wait_env(wait)`: the environment of an OpenMP wait policy for a process (`rollout.cpu_wait` and the learner's and
  the reference's).
- `matmul_rates()`: bf16 and fp32 product rates measured in about a second, for the preflight line that tells a user
  whether a run takes minutes or hours (cluster/config/machine.py: step_estimate, for the stages no role timed).
"""
from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from functools import lru_cache

# torch is imported inside the functions: the config schema takes COMPUTE_DTYPES from here without loading torch.
COMPUTE_DTYPES = ("auto", "bf16", "fp32")
ROLE_COMPUTE_DTYPES = ("",) + COMPUTE_DTYPES  # [learner|reference|rollout].compute_dtype; "": model.compute_dtype's

# rollout.cpu_wait: what libgomp's idle threads do between two parallel regions. "passive": they sleep, and each
# next region waits for them to wake (about 0.1 ms on a cloud VM; a decode step at few rows is hundreds of regions).
# "spin": they spin GOMP_SPINCOUNT times first, then sleep. Spinning threads take the cores from any other busy process
# on them (bench/omp_wait.py; docs/performance.md, "OpenMP's wait between parallel regions"): at 2,000 spins a 0.5B
# int8 decode step at 1 row ran 1.37x faster alone and 1.54x slower beside a learner on the same 2 cores; 20,000 and
# 200,000 spins gained little more alone (1.39x, 1.45x) and cost 4.9x and 16x beside the learner.
CPU_WAITS = ("passive", "spin")
CPU_WAIT_SETTINGS = ("auto",) + CPU_WAITS  # [rollout|learner|reference].cpu_wait; "auto": cluster/run/cpu_waits.py
SPIN_COUNT = 2000  # ~20 us at libgomp's reckoning of 100,000 spins a millisecond (within 5x by CPU)


def wait_env(wait: str = "passive") -> dict[str, str]:
    """The environment of `wait` (CPU_WAITS). GOMP_SPINCOUNT, when set, is libgomp's spin count whatever
    OMP_WAIT_POLICY says, so both waits set it: neither is undone by what the driver's environment passes on."""
    if wait not in CPU_WAITS:
        raise ValueError(f"cpu_wait {wait!r}: one of {CPU_WAITS}")
    return {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0" if wait == "passive" else str(SPIN_COUNT)}


def current_wait() -> str:
    """The CPU_WAITS value this process started with (its environment's; libgomp read it at load)."""
    return "spin" if os.environ.get("GOMP_SPINCOUNT", "0").strip() not in ("", "0") else "passive"


def torch_dtype(name: str):
    """torch.bfloat16 for "bf16", torch.float32 for "fp32"."""
    import torch

    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]

# oneDNN's ISA names from least to most capable (ONEDNN_MAX_CPU_ISA); bf16 products are native from AVX512_CORE_BF16.
_ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
                "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX10_1_512_AMX", "AVX512_CORE_AMX",
                "AVX10_1_512_AMX_FP16", "AVX512_CORE_AMX_FP16")
_ONEDNN_BF16 = _ONEDNN_ISAS.index("AVX512_CORE_BF16")
_ONEDNN_AVX512 = _ONEDNN_ISAS.index("AVX512_CORE")


@dataclass(frozen=True)
class ISA:
    """The processor as torch will use it."""

    arch: str  # platform.machine(): x86_64, aarch64, arm64
    name: str  # the model name the OS reports ("" when unknown)
    capability: str  # torch.backends.cpu.get_cpu_capability(): AVX512, AVX2, DEFAULT, SVE256 ...
    avx512: bool  # AVX-512 usable by torch and oneDNN
    native_bf16: bool | None  # hardware bf16 products (AVX512-BF16 or AMX-BF16, ARM BF16); None: not known
    amx: bool  # AMX tiles (Intel Sapphire Rapids and later)
    capped_by: str  # the environment variables that lowered what the flags offer ("" when none)

    def words(self) -> str:
        """'AMD EPYC, AVX2 (capped by ATEN_CPU_CAPABILITY), no native bf16' and the like."""
        bf16 = {True: "native bf16" + (" (AMX)" if self.amx else " (AVX512-BF16)" if self.arch == "x86_64" else ""),
                False: "no native bf16", None: "bf16 support unknown"}[self.native_bf16]
        cap = f" (capped by {self.capped_by})" if self.capped_by else ""
        return f"{self.name or self.arch}, {self.capability}{cap}, {bf16}"


def _flags() -> tuple[set[str], str]:
    """(cpuid flags, model name) from /proc/cpuinfo; empty where there is none (macOS)."""
    flags: set[str] = set()
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("flags", "Features") and not flags:
                    flags = set(value.split())
                elif key == "model name" and not name:
                    name = value.strip()
    except OSError:
        pass
    return flags, name


def _onednn_cap(env: dict) -> int | None:
    """The index of ONEDNN_MAX_CPU_ISA (or its old name DNNL_MAX_CPU_ISA) in _ONEDNN_ISAS; None when unset or ALL."""
    value = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    return _ONEDNN_ISAS.index(value) if value in _ONEDNN_ISAS else None


def isa_from(flags: set[str], capability: str, env: dict, arch: str = "x86_64", name: str = "") -> ISA:
    """The ISA record from cpuid flags, torch's capability and the environment (a pure function: tests feed it)."""
    if arch not in ("x86_64", "AMD64"):
        # ARM: the BF16 extension shows as "bf16" in /proc/cpuinfo's Features; macOS has no such file (unknown).
        return ISA(arch, name, capability, False, ("bf16" in flags) if flags else None, False, "")
    capped = []
    onednn = _onednn_cap(env)
    aten_avx512 = capability.upper().startswith("AVX512")
    if not aten_avx512 and "avx512f" in flags and env.get("ATEN_CPU_CAPABILITY"):
        capped.append("ATEN_CPU_CAPABILITY")
    if onednn is not None and onednn < _ONEDNN_BF16 and ({"avx512_bf16", "amx_bf16"} & flags):
        capped.append("ONEDNN_MAX_CPU_ISA")
    avx512 = "avx512f" in flags and aten_avx512 and (onednn is None or onednn >= _ONEDNN_AVX512)
    amx = "amx_bf16" in flags and "amx_tile" in flags and (onednn is None or onednn >= _ONEDNN_ISAS.index(
        "AVX10_1_512_AMX"))
    bf16 = avx512 and ("avx512_bf16" in flags or amx) and (onednn is None or onednn >= _ONEDNN_BF16)
    return ISA(arch, name, capability, avx512, bf16, amx, " and ".join(capped))


@lru_cache(maxsize=1)
def isa() -> ISA:
    """This process's processor, as torch and oneDNN will use it."""
    import torch

    flags, name = _flags()
    return isa_from(flags, torch.backends.cpu.get_cpu_capability(), dict(os.environ), platform.machine(), name)


def compute_dtype(setting: str, device="cpu", cpu: ISA | None = None) -> tuple[str, str]:
    """("bf16" | "fp32", why) for `setting` ("auto", "bf16", "fp32") on `device`: what the learner, the reference and
    the torch generator compute in there. "auto" takes bf16 where the device has it natively, fp32 elsewhere."""
    if setting not in COMPUTE_DTYPES:
        raise ValueError(f"model.compute_dtype: {setting!r} is not one of {', '.join(COMPUTE_DTYPES)}")
    if setting != "auto":
        return setting, f"model.compute_dtype = \"{setting}\""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return "bf16", f"auto: {torch.cuda.get_device_name(device)} computes bf16 natively"
        return "fp32", (f"auto: {torch.cuda.get_device_name(device)} has no native bf16 (compute capability "
                        f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))} < 8.0)")
    if device.type != "cpu":  # mps and the like: what the device offers is torch's to know
        return "bf16", f"auto: bf16 on {device.type}"
    cpu = cpu or isa()
    if cpu.native_bf16 is None:  # unknown flags (macOS): the measurement decides
        rates = matmul_rates(0.3)
        faster = "bf16" if rates["bf16"] >= rates["fp32"] else "fp32"
        return faster, (f"auto: this CPU's bf16 support is not listed; measured bf16 {rates['bf16']:.0f} vs fp32 "
                        f"{rates['fp32']:.0f} GFLOP/s")
    if cpu.native_bf16:
        return "bf16", f"auto: {cpu.words()}"
    return "fp32", f"auto: {cpu.words()}: bf16 products would be emulated, several times slower than fp32"


def matmul_rates(seconds: float = 1.0, m: int = 512, k: int = 576, n: int = 1536) -> dict[str, float]:
    """GFLOP/s of [m, k] x [k, n] products in bf16 and in fp32 on this process's threads, each measured for about
    seconds / 2 after one warm-up product (at least two products each)."""
    import torch

    out = {}
    for name in ("bf16", "fp32"):
        dtype = torch_dtype(name)
        a = torch.randn(m, k).to(dtype)
        b = torch.randn(k, n).to(dtype)
        a @ b
        count, t0 = 0, time.perf_counter()
        while count < 2 or time.perf_counter() - t0 < seconds / 2:
            a @ b
            count += 1
        out[name] = 2.0 * m * k * n * count / (time.perf_counter() - t0) / 1e9
    return out
