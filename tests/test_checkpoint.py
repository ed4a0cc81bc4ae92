"""Checkpoints on disk: atomic writes and re-saves, interrupted saves cleaned up, newest-complete selection, the
abandoned future of a resumed run set aside, and loading that never runs code from a checkpoint folder."""
import json
import os
import pickle

import pytest

from qgrpo.cluster.rundir.checkpoint import STATE_FILE, clean_stray, complete_checkpoints, save_checkpoint
from qgrpo.cluster.rundir.resume import earlier_evals, find_checkpoint, set_aside_future


def _writer(tag: str):
    """Stands in for the learners' save: the model files the driver checks for before completing a checkpoint."""
    def write(out: str) -> None:
        with open(os.path.join(out, "model.safetensors"), "w") as f:
            f.write(tag)
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write("{}")
    return write


def test_save_resave_prune_and_clean(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, _writer(f"v{step}"), {"step": step}, keep_last=2)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2, 3]
    # Re-saving a step replaces it whole.
    path = save_checkpoint(tmp_path, 3, _writer("again"), {"step": 3, "again": True}, keep_last=2)
    assert (path / "model.safetensors").read_text() == "again" and json.loads((path / STATE_FILE).read_text())["again"]
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2, 3]
    # A save killed mid-write leaves a hidden .tmp folder; a re-save killed between its two renames leaves .old.
    root = tmp_path / "checkpoints"
    (root / ".step_000004.tmp").mkdir()
    (root / ".step_000004.tmp" / "model.safetensors").write_text("half")
    (root / "step_000003").rename(root / ".step_000003.old")
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2]
    assert find_checkpoint(tmp_path) == root / "step_000003"  # cleaned: the set-aside step 3 is back, .tmp gone
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000003"]
    assert clean_stray(root) == []


def test_incomplete_checkpoint_is_never_picked(tmp_path):
    save_checkpoint(tmp_path, 5, _writer("v5"), {"step": 5}, keep_last=3)
    (tmp_path / "checkpoints" / "step_000010").mkdir()  # no trainer_state.json: not complete
    assert find_checkpoint(tmp_path).name == "step_000005"
    (tmp_path / "empty-run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match="no complete checkpoint"):
        find_checkpoint(tmp_path / "empty-run")
    with pytest.raises(ValueError, match="neither a run directory nor a checkpoint"):
        find_checkpoint(tmp_path / "checkpoints")


def test_set_aside_future(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step, _writer(f"v{step}"), {"step": step}, keep_last=5)
    (tmp_path / "rollouts").mkdir()
    pq.write_table(pa.table({"step": [1, 2]}), tmp_path / "rollouts" / "steps_000001-000002.parquet")
    pq.write_table(pa.table({"step": [3, 3, 4, 5]}), tmp_path / "rollouts" / "steps_000003-000005.parquet")
    pq.write_table(pa.table({"step": [6]}), tmp_path / "rollouts" / "steps_000006-000006.parquet")
    lines = [{"event": "start"}, {"event": "eval", "step": 0, "accuracy": 0.1, "n": 5}] + \
        [{"step": s, "reward/mean": s / 10} for s in range(1, 7)] + [{"event": "eval", "step": 6, "accuracy": 0.9}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines) + '{"step": 7, "cut sh')

    aside = set_aside_future(tmp_path, 4)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2, 4]
    assert (aside / "checkpoints" / "step_000006" / STATE_FILE).is_file()
    kept = pq.read_table(tmp_path / "rollouts").column("step").to_pylist()
    assert sorted(kept) == [1, 2, 3, 3, 4]
    assert sorted(pq.read_table(aside / "rollouts").column("step").to_pylist()) == [5, 6]
    steps = [json.loads(l).get("step") for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [None, 0, 1, 2, 3, 4]
    assert len((aside / "metrics.jsonl").read_text().splitlines()) == 4  # steps 5, 6, the eval at 6, the cut line
    assert earlier_evals(tmp_path, 4) == {0: {"accuracy": 0.1, "n": 5}}
    assert set_aside_future(tmp_path, 4) is None  # nothing left after step 4


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_optimizer_state_loads_without_unpickling_code(tmp_path, monkeypatch):
    """DeepSpeed's own loader would run this file's payload; the learner's loader refuses it."""
    import torch

    from qgrpo.learner.engine import _safe_checkpoint_engine

    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.zeros(2)}, "extra": _Boom()}, bad)
    with pytest.raises(pickle.UnpicklingError):
        _safe_checkpoint_engine().load(str(bad))
    assert not (tmp_path / "pwned").exists()
    good = tmp_path / "good.pt"
    torch.save({"module": {"w": torch.ones(2)}, "step": 3}, good)
    assert _safe_checkpoint_engine().load(str(good))["step"] == 3
