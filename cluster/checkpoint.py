"""Checkpoints: an HF folder + DeepSpeed optimizer state + trainer_state.json.

A checkpoint is complete when its folder is named step_NNNNNN: it is written under a hidden temporary name, every file
and folder is fsynced, trainer_state.json is written last, and only then is it renamed into place. Re-saving a step
swaps the new folder in (the old one is set aside first and removed after). A kill -9 at any point leaves every
earlier checkpoint loadable; `clean_stray` (run before each save and on resume) removes half-written folders and
puts back a set-aside one whose replacement never landed.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any, Callable

from core import faults

STATE_FILE = "trainer_state.json"
_STEP = re.compile(r"step_(\d+)$")


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def clean_stray(ckpt_root: Path) -> list[str]:
    """Remove `.step_N.tmp` folders of interrupted saves; restore `.step_N.old` when its replacement never landed.
    Returns what it did, one line each."""
    done: list[str] = []
    if not ckpt_root.is_dir():
        return done
    for p in sorted(ckpt_root.glob(".step_*.tmp")):
        shutil.rmtree(p)
        done.append(f"removed the interrupted save {p.name}")
    for p in sorted(ckpt_root.glob(".step_*.old")):
        final = ckpt_root / p.name[1:-len(".old")]
        if final.exists():
            shutil.rmtree(p)
        else:
            p.rename(final)
            done.append(f"restored {final.name}, whose re-save was interrupted")
    return done


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint of a run, oldest first."""
    root = run_dir / "checkpoints"
    found = []
    for p in root.glob("step_*") if root.is_dir() else ():
        m = _STEP.match(p.name)
        if m and p.is_dir() and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def save_checkpoint(run_dir: Path, step: int, write_model: Callable[[str], None], state: dict[str, Any],
                    keep_last: int) -> Path:
    final = checkpoint_dir(run_dir, step)
    clean_stray(final.parent)
    tmp = final.parent / f".{final.name}.tmp"
    tmp.mkdir(parents=True)
    write_model(str(tmp))
    if faults.fires("save.kill", step):  # a drill: the whole run dies in the middle of a checkpoint write
        os.killpg(os.getpgid(0), signal.SIGKILL)
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
    _fsync_tree(tmp)
    if final.exists():
        old = final.parent / f".{final.name}.old"
        final.rename(old)
        tmp.rename(final)
        _fsync_dir(final.parent)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
        _fsync_dir(final.parent)
    # Keep the newest `keep_last` up to this step (a resumed run has already set its abandoned future aside).
    older = [p for s, p in complete_checkpoints(run_dir) if s < step]
    for p in older[:max(len(older) - (keep_last - 1), 0)]:
        shutil.rmtree(p)
    return final


def read_state(ckpt: Path) -> dict[str, Any]:
    f = ckpt / STATE_FILE
    if not f.is_file():
        raise FileNotFoundError(f"{ckpt} is not a qgrpo checkpoint (no {STATE_FILE}); pass a run directory or "
                                "one of its checkpoints/step_* folders")
    return json.loads(f.read_text())


_ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "intermediate_size", "num_key_value_heads")


def check_same_model(ckpt: Path, model_path: str) -> None:
    """A checkpoint from another model is refused before any expensive work."""
    a = json.loads((ckpt / "config.json").read_text())
    b = json.loads((Path(model_path) / "config.json").read_text())
    diff = [f"{k}: checkpoint {a.get(k)!r} vs model.path {b.get(k)!r}" for k in _ARCH_KEYS if a.get(k) != b.get(k)]
    if diff:
        raise ValueError(f"checkpoint {ckpt} is from another model than model.path={model_path} ("
                         + "; ".join(diff) + "); resume with the config that produced it")
