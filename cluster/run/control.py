"""Controls a running job reads at each step boundary: `qgrpo scale RUN_DIR --rollout-actors N`.

The request is a small file in the run directory (RUN_DIR/control.json, written atomically; on a URI run, the object
at RUN_URI/control.json), the one handle a user already has on a run wherever its driver runs. The driver
reads it between steps, when no prompt is in flight, and logs what it did as a `scale` event in metrics.jsonl. The
file stays: it is the wanted number of rollout actors, also after a resume.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from qgrpo.core import storage

CONTROL_FILE = "control.json"


def request_rollout_actors(run_dir: Path | str, n: int) -> str:
    """Ask the run in `run_dir` (a folder or URI) to run `n` rollout actors from its next step on. Raises ValueError."""
    if n < 1:
        raise ValueError(f"--rollout-actors: must be >= 1, got {n}")
    if not storage.is_file(storage.join(run_dir, "config.toml")):
        raise ValueError(f"{run_dir} is not a qgrpo run directory (no config.toml); pass runs/NAME-TIME")
    text = json.dumps({"rollout_actors": n, "requested_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    path = storage.join(run_dir, CONTROL_FILE)
    if storage.is_uri(run_dir):
        storage.write_text(path, text)  # an object appears whole or not at all
    else:
        tmp = Path(run_dir) / f".{CONTROL_FILE}.{os.getpid()}.tmp"
        tmp.write_text(text)
        tmp.replace(path)
    return str(path)


def wanted_rollout_actors(run_dir: Path | str) -> int | None:
    """The number of rollout actors asked for, or None (no request, or a file that is not a valid request)."""
    try:
        n = json.loads(storage.read_text(storage.join(run_dir, CONTROL_FILE))).get("rollout_actors")
    except (OSError, ValueError, AttributeError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None
