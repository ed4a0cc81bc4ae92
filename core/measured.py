"""Measurements kept per machine in the qgrpo cache: what a run decides by timing on this machine (the int8 kernels'
row routes, rollout/quantization/cpu_kernels.py; the CPU roles' compute precision, cluster/run/compute_auto.py) is timed
once and read back by later runs.

A file under the cache root (core/storage.py: cache_root) maps a machine key to {key: value}. The machine key holds
what changes a timing: the processor's name, the kernels' capability as torch uses it (an environment cap such as
ATEN_CPU_CAPABILITY changes it), whether bf16 is native, the thread count and torch's version, plus the caller's
`extra` (its own kernels' tag). Writes are atomic (a temporary file renamed); the first record of a key holds, and a
file that cannot be read or written leaves the measurement to the process that made it.
"""
from __future__ import annotations

import json
import os


def machine_key(threads: int, extra: str = "") -> str:
    """This machine as a timing sees it, at `threads` torch threads."""
    import torch

    from qgrpo.core.cpu import isa

    cpu = isa()
    bf16 = {True: "native bf16", False: "emulated bf16", None: "bf16 unknown"}[cpu.native_bf16]
    return (f"{cpu.name or 'cpu'} | {cpu.capability} | {bf16} | {threads} threads | torch {torch.__version__}"
            + (f" | {extra}" if extra else ""))


def _path(file: str):
    from qgrpo.core.storage import cache_root

    return cache_root() / file


def _read(file: str) -> dict:
    path = _path(file)
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def recall(file: str, machine: str, key: str):
    """The value kept for `key` on `machine`, or None."""
    return _read(file).get(machine, {}).get(key)


def recalled(file: str, machine: str) -> dict:
    """Everything kept for `machine`."""
    return dict(_read(file).get(machine, {}))


def remember(file: str, machine: str, key: str, value) -> None:
    """Keep `value` for `key` on `machine` unless another process kept one first."""
    data = _read(file)
    kept = data.setdefault(machine, {})
    if key in kept:
        return
    kept[key] = value
    path = _path(file)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
    except OSError:
        pass


__all__ = ["machine_key", "recall", "recalled", "remember"]
