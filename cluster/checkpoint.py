"""Checkpoints: an HF folder + DeepSpeed optimizer state + trainer_state.json, written atomically, last K kept."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

STATE_FILE = "trainer_state.json"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def save_checkpoint(run_dir: Path, step: int, write_model: Callable[[str], None], state: dict[str, Any],
                    keep_last: int) -> Path:
    """Write into a hidden temporary folder, then rename: a crash mid-save leaves earlier checkpoints intact."""
    final = checkpoint_dir(run_dir, step)
    tmp = final.parent / f".{final.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    write_model(str(tmp))
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    kept = sorted(p for p in final.parent.glob("step_*") if p.is_dir())
    for old in kept[:-keep_last]:
        shutil.rmtree(old)
    return final


def read_state(ckpt: Path) -> dict[str, Any]:
    f = ckpt / STATE_FILE
    if not f.is_file():
        raise FileNotFoundError(f"{ckpt} is not a qgrpo checkpoint (no {STATE_FILE}); pass a checkpoints/step_* folder")
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
