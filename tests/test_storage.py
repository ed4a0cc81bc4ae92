"""Run directories and checkpoints on a URI (core/storage.py). The URIs here are file:// ones on a local folder:
they go through the same pyarrow calls as s3:// or gs:// (FileSystem.from_uri, get_file_info, copy_files, streams);
what they cannot show is an object store's latency, consistency and credentials. The local folder behind a file://
URI is read directly to check what landed there.

Unit tests: node-local copies under concurrency, the log mirror (only changes, never a file the run did not write),
checkpoint completeness on a URI, and a run_dir the learner's node does not share refused before a checkpoint is
split. End to end on real Ray and DeepSpeed: a run whose output_dir is a URI, resumed from it."""
import json
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qgrpo.cluster.cli.app import main
from qgrpo.cluster.config.schema import ConfigError, load_config
from qgrpo.cluster.rundir.checkpoint import (
    STATE_FILE,
    CheckpointError,
    complete_checkpoints,
    read_state,
    save_checkpoint,
)
from qgrpo.cluster.rundir.resume import find_checkpoint
from qgrpo.core import storage
from qgrpo.core.cpu import compute_dtype
from qgrpo.core.invocation import qgrpo_command
from tests.helpers import TINY, random_batch, read_metrics, run_dir_in, start_ranks, step_metrics, train_args


def _uri(path: Path) -> str:
    return f"file://{path}"


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def test_paths_and_uris():
    assert storage.is_uri("s3://bucket/runs") and storage.is_uri("file:///data") and not storage.is_uri("runs/x")
    assert storage.join("s3://b/runs/", "r1", "checkpoints") == "s3://b/runs/r1/checkpoints"
    assert storage.join("s3://b/runs?region=eu-west-1", "r1") == "s3://b/runs/r1?region=eu-west-1"
    assert storage.parent("gs://b/runs/r1/checkpoints/step_000002") == "gs://b/runs/r1/checkpoints"
    assert storage.name("gs://b/runs/r1/") == "r1"
    assert storage.join(Path("/a"), "b") == Path("/a/b")


def test_move_and_delete_on_a_uri(tmp_path):
    """A checkpoint set aside by a resume: copied under a folder that does not exist yet, then removed."""
    (tmp_path / "step_000004").mkdir()
    (tmp_path / "step_000004" / STATE_FILE).write_text("{}")
    storage.move(_uri(tmp_path / "step_000004"), _uri(tmp_path / "abandoned" / "after" / "step_000004"))
    assert _tree(tmp_path) == {f"abandoned/after/step_000004/{STATE_FILE}": "{}"}
    storage.delete(_uri(tmp_path / "abandoned"))
    assert list(tmp_path.iterdir()) == [] and not storage.exists(_uri(tmp_path / "abandoned"))


@pytest.mark.parametrize("value, message", [
    ("foo://bucket/runs", "has the scheme 'foo', which pyarrow's filesystems do not open"),
    ("file://runs", "a file URI names an absolute path"),
])
def test_output_dir_uri_is_checked_at_config_time(value, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [f"run.output_dir='{value}'"])
    assert f"run.output_dir: {value!r}" in str(e.value) and message in str(e.value)
    assert load_config(TINY, ["run.output_dir='s3://bucket/runs'"]).run.output_dir == "s3://bucket/runs"  # no network


def test_output_dir_uri_needs_the_filesystem_in_this_pyarrow(monkeypatch):
    import pyarrow.fs

    monkeypatch.delattr(pyarrow.fs, "GcsFileSystem")
    with pytest.raises(ConfigError, match=r"run.output_dir: 'gs://b/runs' needs pyarrow.fs.GcsFileSystem"):
        load_config(TINY, ["run.output_dir='gs://b/runs'"])


def test_localize_downloads_once_per_content_even_when_two_processes_race(tmp_path, monkeypatch):
    """Two actors of one node ask for the same checkpoint at once: both download (held until both have a copy, so
    the race really happens), one rename wins, both get the same complete folder, no temporary copy is left."""
    monkeypatch.setenv("QGRPO_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "remote" / "step_000002"
    (src / "optimizer").mkdir(parents=True)
    (src / "model.safetensors").write_text("weights")
    (src / "config.json").write_text("{}")
    (src / "optimizer" / "shard.pt").write_text("moments")
    both = threading.Barrier(2)
    real_download = storage.download

    def download_then_wait(*a, **k):
        out = real_download(*a, **k)
        both.wait(timeout=30)
        return out

    monkeypatch.setattr(storage, "download", download_then_wait)
    got: list[str] = []
    threads = [threading.Thread(target=lambda: got.append(storage.localize(_uri(src)))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(got) == 2 and got[0] == got[1]
    assert _tree(Path(got[0])) == _tree(src)
    assert [p.name for p in (tmp_path / "cache" / "remote").iterdir()] == [Path(got[0]).name]  # no temporary left
    monkeypatch.setattr(storage, "download", real_download)

    assert storage.localize(_uri(src)) == got[0]  # cached
    light = Path(storage.localize(_uri(src), skip=("optimizer",)))
    assert sorted(_tree(light)) == ["config.json", "model.safetensors"]
    (src / "model.safetensors").write_text("re-saved weights")  # the same URI, new content: never served stale
    again = storage.localize(_uri(src))
    assert again != got[0] and Path(again, "model.safetensors").read_text() == "re-saved weights"
    assert storage.localize(str(src)) == str(src)  # a path is used where it is


def test_mirror_uploads_only_changes_and_never_deletes_files_the_run_did_not_write(tmp_path, monkeypatch):
    monkeypatch.setenv("QGRPO_CACHE", str(tmp_path / "cache"))
    remote = tmp_path / "bucket" / "runs"
    (remote / "someone-else").mkdir(parents=True)
    (remote / "someone-else" / "metrics.jsonl").write_text("theirs\n")
    run = storage.RunDir.create(_uri(remote), "tiny-1")
    assert run.root == _uri(remote / "tiny-1") and run.local.name == "tiny-1" and not (remote / "tiny-1").exists()
    (run.local / "rollouts").mkdir()
    (run.local / "metrics.jsonl").write_text('{"step": 1}\n')
    (run.local / "rollouts" / "steps_000001-000001.parquet").write_text("rows 1")
    (run.local / "rollouts" / ".steps_000002-000002.parquet.tmp").write_text("half-written")
    assert run.sync() == ["metrics.jsonl", "rollouts/steps_000001-000001.parquet"]
    (remote / "tiny-1" / "NOTES.md").write_text("a user's note")  # on the URI, not written by the run
    assert run.sync() == []
    with (run.local / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2}\n')
    assert run.sync() == ["metrics.jsonl"]
    assert (remote / "tiny-1" / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert not (remote / "tiny-1" / "rollouts" / ".steps_000002-000002.parquet.tmp").exists()
    # A resume moves a staged file aside: it moves on the URI too (uploaded there first, then removed).
    (run.local / "abandoned").mkdir()
    (run.local / "rollouts" / "steps_000001-000001.parquet").rename(run.local / "abandoned" / "steps.parquet")
    assert run.sync() == ["abandoned/steps.parquet"]
    assert sorted(_tree(remote)) == ["someone-else/metrics.jsonl", "tiny-1/NOTES.md", "tiny-1/abandoned/steps.parquet",
                                     "tiny-1/metrics.jsonl"]
    staging = run.local.parent
    run.close()
    assert not staging.exists()  # everything it held is on the URI
    again = storage.RunDir.resume(_uri(remote / "tiny-1"))  # logs come down; nothing to upload until they change
    assert _tree(again.local) == {k.removeprefix("tiny-1/"): v for k, v in _tree(remote).items()
                                  if k.startswith("tiny-1/") and "abandoned" not in k}
    assert again.sync() == []
    with pytest.raises(FileExistsError):
        storage.RunDir.create(_uri(remote), "tiny-1")


def test_logs_that_cannot_reach_the_uri_are_kept_and_said_where(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QGRPO_CACHE", str(tmp_path / "cache"))
    run = storage.RunDir.create(_uri(tmp_path / "bucket"), "tiny-1")
    (run.local / "metrics.jsonl").write_text('{"step": 1}\n')

    def unreachable(*a, **k):
        raise OSError("When uploading part: AWS Error NETWORK_CONNECTION")

    monkeypatch.setattr(storage, "upload", unreachable)
    with pytest.raises(storage.StorageError, match=f"they are kept in {run.local}"):
        run.close()  # the run itself went well: its end says the logs did not arrive
    run.close(failing=True)  # another error is on its way out: this one is printed, not raised over it
    assert f"they are kept in {run.local}" in capsys.readouterr().err
    assert (run.local / "metrics.jsonl").is_file() and not (tmp_path / "bucket").exists()


def _model_writer(tag: str):
    """Stands in for the learner ranks: each writes its part node-locally and uploads it (actors/learner_actor.py)."""
    def write(out: str) -> None:
        with storage.staged(out) as local:
            Path(local, "optimizer").mkdir(parents=True)
            Path(local, "model.safetensors").write_text(tag)
            Path(local, "config.json").write_text("{}")
            Path(local, "optimizer", "rank0.pt").write_text(tag)
    return write


def test_checkpoints_on_a_uri_are_complete_only_with_trainer_state(tmp_path, monkeypatch):
    monkeypatch.setenv("QGRPO_CACHE", str(tmp_path / "cache"))
    run, local = _uri(tmp_path / "run"), tmp_path / "run" / "checkpoints"
    for step in (1, 2, 3):
        path = save_checkpoint(run, step, _model_writer(f"v{step}"), {"step": step}, keep_last=2)
        assert path == f"{run}/checkpoints/step_{step:06d}"
    assert complete_checkpoints(run) == [(2, f"{run}/checkpoints/step_000002"), (3, f"{run}/checkpoints/step_000003")]
    assert sorted(_tree(local / "step_000003")) == ["config.json", "model.safetensors", "optimizer/rank0.pt",
                                                     STATE_FILE]
    assert read_state(f"{run}/checkpoints/step_000003") == {"step": 3}
    # Every part uploaded but the driver never wrote trainer_state.json (killed): incomplete, ignored, cleaned.
    _model_writer("v4")(f"{run}/checkpoints/step_000004")
    assert [s for s, _ in complete_checkpoints(run)] == [2, 3]
    assert find_checkpoint(run) == f"{run}/checkpoints/step_000003"
    assert not (local / "step_000004").exists()
    # A re-save keeps the complete copy aside until the new one is complete; an interrupted one is put back.
    save_checkpoint(run, 3, _model_writer("again"), {"step": 3, "again": True}, keep_last=2)
    assert (local / "step_000003" / "model.safetensors").read_text() == "again"
    (local / "step_000003").rename(local / ".step_000003.old")
    _model_writer("half")(f"{run}/checkpoints/step_000003")
    assert find_checkpoint(run) == f"{run}/checkpoints/step_000003"
    assert (local / "step_000003" / "model.safetensors").read_text() == "again"
    assert sorted(p.name for p in local.iterdir()) == ["step_000002", "step_000003"]


@pytest.mark.parametrize("where", ["path", "uri"])
def test_output_dir_the_learner_does_not_share_fails_before_a_checkpoint_is_split(tmp_path, monkeypatch, where):
    """The learner's rank 0 saves into run_dir on ITS node; when the driver's node does not see those files there,
    the save is refused with what to do, and earlier checkpoints stay as they were."""
    monkeypatch.setenv("QGRPO_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run" if where == "path" else _uri(tmp_path / "run")
    save_checkpoint(run, 2, _model_writer("v2"), {"step": 2}, keep_last=1)
    other_node = tmp_path / "learner-node"

    def write_elsewhere(out: str) -> None:  # what a learner on another node, without shared storage, leaves behind
        _model_writer("v4")(str(other_node / Path(out).name))

    with pytest.raises(CheckpointError) as e:
        save_checkpoint(run, 4, write_elsewhere, {"step": 4}, keep_last=1)
    msg = str(e.value)
    assert "checkpoint at step 4: config.json, model.safetensors not found in" in msg
    assert "run.output_dir must be on storage shared by all nodes" in msg and "s3://" in msg
    assert [s for s, _ in complete_checkpoints(run)] == [2]
    assert read_state(storage.join(run, "checkpoints", "step_000002")) == {"step": 2}
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000002"]


# ---------------------------------------------------------------------------------------------------------------------
# End to end: real Ray, real DeepSpeed, the tiny model.

def _staging_dir(err: str) -> Path:
    return Path(err.split("(logs staged in ", 1)[1].split(")", 1)[0])


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
def test_every_learner_rank_uploads_its_part_and_loads_it_back(ray_session, tiny_model_path, tmp_path):
    """Two learner ranks under ZeRO-1 (an optimizer shard each) save a checkpoint to a URI the way Workers.save
    does: rank 0's model files and both shards land there; then both ranks load it back through their node's copy."""
    import ray

    ranks = start_ranks(tiny_model_path, 2, 1, str(tmp_path / "ext"))
    try:
        ray.get([a.train_step.remote(random_batch(32).shard(i, 2)) for i, a in enumerate(ranks)])
        run = _uri(tmp_path / "bucket" / "run")
        save_checkpoint(run, 1, lambda out: ray.get([a.save.remote(out) for a in ranks]), {"step": 1}, keep_last=1)
        # DeepSpeed names a bf16 learner's ZeRO shards bf16_zero_*, an fp32 one's zero_* (model.compute_dtype)
        zero = "bf16_zero" if compute_dtype("auto", "cpu")[0] == "bf16" else "zero"
        ckpt = tmp_path / "bucket" / "run" / "checkpoints" / "step_000001"
        files = {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file()}
        assert {"config.json", "model.safetensors", "tokenizer.json", STATE_FILE,
                "optimizer/state/mp_rank_00_model_states.pt",
                f"optimizer/state/{zero}_pp_rank_0_mp_rank_00_optim_states.pt",  # uploaded by rank 0
                f"optimizer/state/{zero}_pp_rank_1_mp_rank_00_optim_states.pt"} <= files, files  # by rank 1
        ray.get([a.load.remote(f"{run}/checkpoints/step_000001", 1) for a in ranks])
        assert ray.get([a.version.remote() for a in ranks]) == [1, 1]
    finally:
        for a in ranks:
            ray.kill(a)


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
def test_uri_run_holds_everything_and_resumes_exactly(ray_session, tiny_model_path, tmp_path, capsys):
    """A 4-step run writes to a file:// URI; then the same run resumed from its step-2 checkpoint URI repeats steps
    3-4 bit for bit (the learner's Adam moments and the generators' weights come from the URI)."""
    import pyarrow.parquet as pq

    out = tmp_path / "bucket"
    assert main(train_args(tiny_model_path, _uri(out), "run.steps=4", "run.save_every=2", "learner.lr=3e-3")) == 0
    err = capsys.readouterr().err
    assert not _staging_dir(err).exists()  # every staged log reached the URI, so the staging copy is gone
    run_dir = run_dir_in(out)
    run = _uri(run_dir)
    assert f"final checkpoint: {run}/checkpoints/step_000004" in err
    assert load_config(run_dir / "config.toml").run.output_dir == _uri(out)
    first = {m["step"]: m for m in step_metrics(run_dir)}
    assert sorted(first) == [1, 2, 3, 4]
    assert [e["path"] for e in read_metrics(run_dir) if e.get("event") == "checkpoint"] == \
        [f"{run}/checkpoints/step_000002", f"{run}/checkpoints/step_000004"]  # the last one synced at the end
    ckpt = run_dir / "checkpoints" / "step_000004"
    files = {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file()}
    assert {"config.json", "model.safetensors", "tokenizer.json", STATE_FILE,
            "optimizer/state/mp_rank_00_model_states.pt"} <= files, files
    assert [s for s, _ in complete_checkpoints(run)] == [2, 4]
    final_first = load_file(str(ckpt / "model.safetensors"))

    assert main(["train", "--resume", f"{run}/checkpoints/step_000002"]) == 0
    again = {m["step"]: m for m in step_metrics(run_dir)}
    assert sorted(again) == [1, 2, 3, 4]
    for s in (3, 4):
        for key in ("reward/mean", "loss/total", "loss/kl", "loss/grad_norm", "mismatch/kl_mu_old", "loss/lr"):
            assert again[s][key] == first[s][key], (s, key, again[s][key], first[s][key])
    final_again = load_file(str(ckpt / "model.safetensors"))
    assert all(torch.equal(final_first[k], final_again[k]) for k in final_first)
    (aside,) = (run_dir / "abandoned").iterdir()  # what the first run wrote after step 2, moved aside on the URI
    resumed = [e for e in read_metrics(run_dir) if e.get("event") == "resume"]
    assert [e["set_aside"] for e in resumed] == [f"{run}/abandoned/{aside.name}"]
    assert (aside / "checkpoints" / "step_000004" / STATE_FILE).is_file()
    assert [json.loads(l)["step"] for l in (aside / "metrics.jsonl").read_text().splitlines()
            if "reward/mean" in l] == [3, 4]
    assert Counter(pq.read_table(run_dir / "rollouts").column("step").to_pylist()) == {s: 64 for s in (1, 2, 3, 4)}


@pytest.mark.slow  # ~1 min; `make test-slow`
def test_failed_uri_run_leaves_its_logs_there_and_resumes_from_the_run_uri(ray_session, tiny_model_path, tmp_path,
                                                                            faults, capsys):
    faults("learner.kill@3")
    out = tmp_path / "bucket"
    assert main(train_args(tiny_model_path, _uri(out), "run.steps=3", "run.save_every=2")) == 1
    run_dir = run_dir_in(out)
    run = _uri(run_dir)
    err = capsys.readouterr().err
    assert f"(step_000002) with: {qgrpo_command('train', '--resume', run)}" in err
    assert [e["step"] for e in read_metrics(run_dir) if e.get("event") == "failed"] == [3]  # mirrored on failure
    assert [s for s, _ in complete_checkpoints(run)] == [2]

    faults("")
    assert main(["train", "--resume", run]) == 0
    assert "resuming from " + f"{run}/checkpoints/step_000002" in capsys.readouterr().err
    assert [m["step"] for m in step_metrics(run_dir)] == [1, 2, 3]
    assert [s for s, _ in complete_checkpoints(run)] == [2, 3]
    assert main(["report", run]) == 0
    assert (run_dir / "report" / "summary.md").is_file() and (run_dir / "report" / "reward.png").is_file()
    capsys.readouterr()
    assert main(["eval", f"{run}/checkpoints/step_000003", "-n", "4"]) == 0  # with the run config it carries
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["n"] == 4
