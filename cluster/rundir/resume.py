"""Resuming a run as one run: pick the newest complete checkpoint, set aside what the abandoned run wrote after it.

After `qgrpo train --resume RUN_DIR` the run directory reads as if the run had never stopped: metrics.jsonl and the
rollout Parquet files hold each step once, checkpoints after the resumed step are gone from checkpoints/. Nothing is
deleted: what came after the checkpoint moves to RUN_DIR/abandoned/after_step_NNNNNN-TIME/ (same layout).
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

from qgrpo.cluster.rundir.checkpoint import STATE_FILE, clean_stray, complete_checkpoints
from qgrpo.core import storage

_ROLLOUT_FILE = re.compile(r"steps_(\d+)-(\d+)\.parquet$")


def find_checkpoint(target):
    """A checkpoint folder as given, or the newest complete checkpoint of a run directory (paths or URIs).
    Raises ValueError."""
    join = storage.join
    if storage.is_file(join(target, STATE_FILE)):
        return target
    if storage.exists(join(target, "checkpoints")) or storage.is_file(join(target, "metrics.jsonl")):
        clean_stray(join(target, "checkpoints"))
        found = complete_checkpoints(target)
        if not found:
            raise ValueError(f"{target} has no complete checkpoint to resume from (checkpoints are written every "
                             "run.save_every steps); start a new run")
        return found[-1][1]
    raise ValueError(f"{target} is neither a run directory nor a checkpoint folder (no {STATE_FILE}); pass "
                     "runs/NAME-TIME or runs/NAME-TIME/checkpoints/step_NNNNNN")


def set_aside_future(run_dir: Path, step: int, root=None) -> Path | str | None:
    """Move everything the run wrote after `step` under RUN_DIR/abandoned/; returns that folder (None if nothing).
    `root`: where the run's checkpoints are when `run_dir` is a URI run's staging copy (core/storage.py)."""
    aside = run_dir / "abandoned" / f"after_step_{step:06d}-{time.strftime('%Y%m%d-%H%M%S')}"
    moved = False

    def target(sub: str) -> Path:
        nonlocal moved
        moved = True
        (aside / sub).mkdir(parents=True, exist_ok=True)
        return aside / sub

    root = run_dir if root is None else root
    for s, p in complete_checkpoints(root):
        if s > step:
            into = target("checkpoints") / storage.name(p)  # a URI run: the same place on the URI
            storage.move(p, storage.join(root, *into.relative_to(run_dir).parts) if storage.is_uri(root) else into)
    for p in sorted((run_dir / "rollouts").glob("steps_*.parquet")):
        m = _ROLLOUT_FILE.match(p.name)
        first, last = int(m.group(1)), int(m.group(2))
        if first > step:
            p.rename(target("rollouts") / p.name)
        elif last > step:  # a file that spans the resumed step: keep its first part, set the rest aside
            import pyarrow.compute as pc
            import pyarrow.parquet as pq

            table = pq.read_table(p)
            keep = pc.less_equal(table["step"], step)
            pq.write_table(table.filter(pc.invert(keep)), target("rollouts") / p.name)
            tmp = p.parent / f".steps_{first:06d}-{step:06d}.parquet.tmp"
            pq.write_table(table.filter(keep), tmp)
            tmp.rename(p.parent / f"steps_{first:06d}-{step:06d}.parquet")
            p.unlink()
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        keep_lines, later = [], []
        for line in metrics.read_text().splitlines(keepends=True):
            try:
                s = json.loads(line).get("step")
            except ValueError:  # a line cut short by a kill: it belongs to the abandoned tail
                s = step + 1
            (later if isinstance(s, int) and s > step else keep_lines).append(line)
        if later:
            (target(".") / "metrics.jsonl").write_text("".join(later))
            tmp = run_dir / ".metrics.jsonl.tmp"
            tmp.write_text("".join(keep_lines))
            tmp.replace(metrics)
    if moved and storage.is_uri(root):  # where the run's record of it is (the staging copy goes once mirrored)
        return storage.join(root, *aside.relative_to(run_dir).parts)
    return aside if moved else None


def earlier_evals(run_dir: Path, step: int) -> dict[int, dict]:
    """Held-out evaluations the run logged up to `step` (its real step-0 figures among them)."""
    evals: dict[int, dict] = {}
    metrics = run_dir / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.is_file() else ():
        rec = json.loads(line)
        if rec.get("event") == "eval" and rec.get("step", step + 1) <= step:
            evals[rec["step"]] = {k: v for k, v in rec.items() if k not in ("event", "step", "split", "time")}
    return evals
