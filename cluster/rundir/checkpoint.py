"""Checkpoints: an HF folder + DeepSpeed optimizer state + trainer_state.json.

A checkpoint is complete when its folder is named step_NNNNNN: it is written under a hidden temporary name, every file
and folder is fsynced, trainer_state.json is written last, and only then is it renamed into place. Re-saving a step
swaps the new folder in (the old one is set aside first and removed after). A kill -9 at any point leaves every
earlier checkpoint loadable; `clean_stray` (run before each save and on resume) removes half-written folders and
puts back a set-aside one whose replacement never landed.

On a URI (core/storage.py) there is no rename: the learner ranks upload their parts into step_NNNNNN/ itself, and
trainer_state.json, which the driver writes last, is what makes it complete; a folder without it is an interrupted
save, ignored and then removed by `clean_stray`. Either way the driver first checks that the model files are where
it looks: a local run_dir that the learner's node does not share is refused before anything is marked complete.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from qgrpo.core import faults, storage

STATE_FILE = "trainer_state.json"
_STEP = re.compile(r"step_(\d+)$")


_MODEL_FILES = ("config.json", "model.safetensors")


class CheckpointError(storage.StorageError):
    """A checkpoint that cannot be made complete; every earlier checkpoint is left as it was."""


def checkpoint_dir(run_dir, step: int):
    """run_dir/checkpoints/step_NNNNNN: a Path, or a URI for a URI run."""
    return storage.join(run_dir, "checkpoints", f"step_{step:06d}")


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


def clean_stray(ckpt_root) -> list[str]:
    """Remove `.step_N.tmp` folders of interrupted saves; restore `.step_N.old` when its replacement never landed.
    Returns what it did, one line each."""
    if storage.is_uri(ckpt_root):
        return _clean_stray_uri(ckpt_root)
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


def _clean_stray_uri(root: str) -> list[str]:
    done: list[str] = []
    names = storage.listdir(root)
    for n in names:
        if _STEP.match(n) and not storage.is_file(storage.join(root, n, STATE_FILE)):
            storage.delete(storage.join(root, n))
            done.append(f"removed the interrupted save {n}")
    for n in names:
        if n.startswith(".step_") and n.endswith(".old"):
            final = n[1:-len(".old")]
            if storage.is_file(storage.join(root, final, STATE_FILE)):
                storage.delete(storage.join(root, n))
            else:
                storage.move(storage.join(root, n), storage.join(root, final))
                done.append(f"restored {final}, whose re-save was interrupted")
    return done


def complete_checkpoints(run_dir) -> list[tuple[int, Any]]:
    """(step, folder) of every complete checkpoint of a run, oldest first (folders are URIs for a URI run)."""
    root = storage.join(run_dir, "checkpoints")
    found = []
    for n in storage.listdir(root):
        m = _STEP.match(n)
        if m and storage.is_file(storage.join(root, n, STATE_FILE)):
            found.append((int(m.group(1)), storage.join(root, n)))
    return sorted(found)


def _check_model_files(folder, step: int) -> None:
    """The learner's rank 0 wrote the model files into `folder` on its own node; the driver must see them there, or
    the checkpoint would be split between nodes (model on one, trainer_state.json on another). The partial folder is
    removed; earlier checkpoints are untouched."""
    names = set(storage.listdir(folder))
    # model.safetensors.index.json stands for a sharded save; adapter_model.safetensors for learner.mode lora/qlora
    missing = [f for f in _MODEL_FILES if f not in names and not (f == "model.safetensors" and (
        "model.safetensors.index.json" in names or "adapter_model.safetensors" in names))]
    if not missing:
        return
    storage.delete(folder)
    where = ("rank 0's upload did not arrive there" if storage.is_uri(folder) else
             "the learner wrote them on its node, which does not share this folder with the driver's node")
    raise CheckpointError(
        f"checkpoint at step {step}: {', '.join(missing)} not found in {folder} after the learners saved ({where}). "
        "run.output_dir must be on storage shared by all nodes (the same path mounted on each), or a URI every node "
        "can write to, e.g. run.output_dir='s3://bucket/runs' (or gs://, hdfs://); earlier checkpoints are intact")


def save_checkpoint(run_dir, step: int, write_model: Callable[[str], None], state: dict[str, Any],
                    keep_last: int):
    """Write checkpoint `step` (write_model fills the folder it is given; trainer_state.json, `state` as JSON, comes
    last: the driver's is CheckpointState.to_dict()), then keep the newest `keep_last` up to this step (a resumed run
    has already set its abandoned future aside)."""
    final = checkpoint_dir(run_dir, step)
    clean_stray(storage.parent(final))
    (_save_uri if storage.is_uri(final) else _save_local)(final, step, write_model, json.dumps(state, indent=2))
    older = [p for s, p in complete_checkpoints(run_dir) if s < step]
    for p in older[:max(len(older) - (keep_last - 1), 0)]:
        storage.delete(p)
    return final


def _save_uri(final: str, step: int, write_model: Callable[[str], None], state: str) -> None:
    old = storage.join(storage.parent(final), f".{storage.name(final)}.old")
    if storage.exists(final):  # a re-save: the complete copy stays aside until the new one is complete
        storage.move(final, old)
    write_model(final)
    _check_model_files(final, step)
    if faults.fires("save.kill", step):
        os.killpg(os.getpgid(0), signal.SIGKILL)
    storage.write_text(storage.join(final, STATE_FILE), state)
    if storage.exists(old):
        storage.delete(old)


def _save_local(final: Path, step: int, write_model: Callable[[str], None], state: str) -> None:
    tmp = final.parent / f".{final.name}.tmp"
    tmp.mkdir(parents=True)
    write_model(str(tmp))
    _check_model_files(tmp, step)
    if faults.fires("save.kill", step):  # a drill: the whole run dies in the middle of a checkpoint write
        os.killpg(os.getpgid(0), signal.SIGKILL)
    (tmp / STATE_FILE).write_text(state)
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


@dataclass
class CheckpointState:
    """What the driver saves as trainer_state.json, and reads back to resume: the keys on disk are these field names
    (older run directories lack the later ones, which `from_dict` fills in)."""

    step: int  # learner steps done (the checkpoint is checkpoints/step_NNNNNN of this step)
    policy_version: int  # optimizer updates applied: the learner's version after `step`
    cursor: int = 0  # the prompt sampler's cursor after the prompts of `step` (a resume draws on from there)
    published_version: int | None = None  # the version the rollout actors held at the save (None: policy_version)
    model_path: str = ""  # the run's initial model (the reference), as resolved when the run started
    guard: dict[str, Any] | None = None  # the precision ladder's state (PrecisionLadder.state()); None: at its start
    rollout_precision: str = ""  # the generators' precision at the save (guard["rollout_precision"] with a guard)
    config: dict[str, Any] = field(default_factory=dict)  # the run's whole config as a dict (`qgrpo eval` reads it)

    def __post_init__(self):
        if self.published_version is None:
            self.published_version = self.policy_version

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CheckpointState":
        """The state of trainer_state.json as read; keys it does not know (none so far) are left out."""
        known = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        return cls(**known)

    @classmethod
    def read(cls, ckpt) -> "CheckpointState":
        return cls.from_dict(read_state(ckpt))


def read_state(ckpt) -> dict[str, Any]:
    """trainer_state.json of checkpoint `ckpt` (a folder or URI) as JSON; CheckpointState.read gives it typed."""
    f = storage.join(ckpt, STATE_FILE)
    if not storage.is_file(f):
        raise FileNotFoundError(f"{ckpt} is not a qgrpo checkpoint (no {STATE_FILE}); pass a run directory or "
                                "one of its checkpoints/step_* folders")
    return json.loads(storage.read_text(f))


_ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "intermediate_size", "num_key_value_heads")


def check_same_model(ckpt, model_path: str) -> None:
    """A checkpoint from another model is refused before any expensive work."""
    a = json.loads(storage.read_text(storage.join(ckpt, "config.json")))
    b = json.loads((Path(model_path) / "config.json").read_text())
    diff = [f"{k}: checkpoint {a.get(k)!r} vs model.path {b.get(k)!r}" for k in _ARCH_KEYS if a.get(k) != b.get(k)]
    if diff:
        raise ValueError(f"checkpoint {ckpt} is from another model than model.path={model_path} ("
                         + "; ".join(diff) + "); resume with the config that produced it")
