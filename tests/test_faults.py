"""Runs that survive, on real Ray and real DeepSpeed with the tiny model: a rollout actor killed mid-step is replaced
and no prompt is lost or scored twice; a replacement that keeps dying, or a generator that hangs, ends the run with a
message naming the stage and the actor; the precision guard skips poisoned steps on every rank and climbs the ladder,
which survives a resume; a resumed run repeats the uninterrupted run's metrics bit for bit; a run killed while
writing a checkpoint resumes from the previous one. Faults are injected with core/faults.py (QGRPO_FAULTS)."""
import json
import os
import signal
import subprocess
import sys
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from qgrpo.cluster.cli.app import main
from qgrpo.cluster.config.schema import load_config
from qgrpo.core.invocation import qgrpo_command
from tests.helpers import ROOT, read_metrics, run_dir_in, step_metrics, train_args


def test_killed_rollout_actor_is_replaced_and_no_prompt_is_lost(torch_smoke_run):
    """One of two rollout actors SIGKILLs its own process inside generate at step 2 (it holds half the step's
    prompts) in the shared 30-step run (tests/conftest.py: torch_smoke_run). The run finishes; every prompt of every
    step is in the Parquet output exactly group_size times."""
    import pyarrow.parquet as pq

    run_dir = torch_smoke_run
    cfg = load_config(run_dir / "config.toml")
    prompts, group = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    rows = pq.read_table(run_dir / "rollouts").to_pylist()
    per_step = {s: Counter(r["prompt_id"] for r in rows if r["step"] == s) for s in range(1, cfg.run.steps + 1)}
    for step, counts in per_step.items():
        assert len(counts) == prompts and set(counts.values()) == {group}, (step, counts)
    # no prompt repeated across steps 1-3, the kill's step and those around it
    assert len({p for s in (1, 2, 3) for p in per_step[s]}) == 3 * prompts
    events = read_metrics(run_dir)
    failed = [e for e in events if e.get("event") == "rollout_actor_failed"]
    replaced = [e for e in events if e.get("event") == "rollout_actor_replaced"]
    assert len(failed) == 1 and failed[0]["step"] == 2 and len(failed[0]["prompt_ids"]) == prompts // 2
    assert "ActorDiedError" in failed[0]["cause"] or "died" in failed[0]["cause"]
    assert len(replaced) == 1 and replaced[0]["replacement"].endswith(".1")
    # The replacement loaded the published weights (version 1) before it generated anything.
    assert replaced[0]["weights_version"] == 1
    by_step = {m["step"]: m for m in step_metrics(run_dir)}
    assert by_step[3]["rollout/policy_versions"] == [2] and by_step[3]["policy_version"] == 3
    assert {r["generator_id"] for r in rows if r["step"] == 3} == {"torch-0", replaced[0]["replacement"]} or \
        {r["generator_id"] for r in rows if r["step"] == 3} == {"torch-1", replaced[0]["replacement"]}


def test_guard_skips_poisoned_steps_and_climbs_the_ladder_in_the_shared_run(torch_smoke_run):
    """The shared run's step 10 has a NaN loss, its step 11 NaN sampler log-probs: both are skipped (the policy
    version stays), the rollouts climb int4 -> int8 -> bf16, the run trains on, and the final checkpoint keeps the
    rung. Two learner ranks skipping together, and the rung surviving a resume: the slow test below."""
    by_step = {m["step"]: m for m in step_metrics(torch_smoke_run)}
    assert [s for s, m in by_step.items() if m["guard/skipped"]] == [10, 11]
    assert by_step[10]["guard/reason"] == "loss" and by_step[11]["guard/reason"] == "sampler_logprobs"
    assert [by_step[s]["guard/rollout_bits"] for s in (9, 10, 11, 12, 30)] == [4, 8, 16, 16, 16]
    assert [by_step[s]["policy_version"] for s in (9, 10, 11, 12)] == [9, 9, 9, 10]
    ladder = [e for e in read_metrics(torch_smoke_run) if e.get("event") == "ladder"]
    assert [(e["step"], e["rollout_precision"]) for e in ladder] == [(10, "int8"), (11, "bf16")]
    (last,) = (torch_smoke_run / "checkpoints").iterdir()
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["guard"]["rollout_precision"] == "bf16" and state["guard"]["skipped_total"] == 2


@pytest.mark.slow  # a whole run each, as are the next six: `make test-slow`
def test_actor_that_keeps_dying_ends_the_run_clearly(ray_session, tiny_model_path, tmp_path, faults, capsys):
    faults("rollout.kill@2+")
    out = tmp_path / "runs"
    rc = main(train_args(tiny_model_path, out, "run.steps=3", "run.save_every=1", "faults.max_replacements=1"))
    err = capsys.readouterr().err
    assert rc == 1
    assert "generate at step 2: rollout actor torch-0.1 failed 2 times in a row" in err
    assert "faults.max_replacements = 1" in err
    assert "digit_sum-train-8" in err  # the prompt ids it held
    assert "--resume" in err and "step_000001" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_hung_generator_fails_within_its_deadline(ray_session, tiny_model_path, tmp_path, faults, capsys):
    faults("rollout.hang@2")
    out = tmp_path / "runs"
    rc = main(train_args(tiny_model_path, out, "run.steps=3", "faults.generate_timeout_s=10"))
    err = capsys.readouterr().err
    assert rc == 1
    assert "generate at step 2: no result within 10 s (torch-0 held digit_sum-train-8" in err
    assert "faults.generate_timeout_s" in err
    failed = [e for e in read_metrics(run_dir_in(out)) if e.get("event") == "failed"]
    assert len(failed) == 1 and failed[0]["step"] == 2


@pytest.mark.slow
def test_dead_learner_ends_the_run_with_how_to_resume(ray_session, tiny_model_path, tmp_path, faults, capsys):
    faults("learner.kill@3")
    out = tmp_path / "runs"
    assert main(train_args(tiny_model_path, out, "run.steps=4", "run.save_every=2")) == 1
    err = capsys.readouterr().err
    assert "learner step 3: learner rank 0 failed (" in err and "Traceback" not in err
    run_dir = run_dir_in(out)
    # the command as this process would run it (core/invocation.py: .venv/bin/qgrpo when the venv is not on PATH)
    assert f"from its last complete checkpoint (step_000002) with: {qgrpo_command('train', '--resume', run_dir)}" in err
    assert main(["train", "--resume", str(run_dir)]) == 0
    assert [m["step"] for m in step_metrics(run_dir)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_guard_skips_poisoned_steps_on_every_rank_and_climbs_the_ladder(ray_session, tiny_model_path, tmp_path,
                                                                         faults):
    """Two learner ranks; at step 2 only rank 0's loss is NaN, at step 3 the sampler's log-probs are. Both steps are
    skipped by both ranks together (weights bit-identical across them), int4 -> int8 -> bf16, the run finishes, and
    the rung is in the metrics and the checkpoint and survives a resume."""
    faults("learner.nan_loss@2,rollout.nan@3")
    out = tmp_path / "runs"
    assert main(train_args(tiny_model_path, out, "run.steps=4", "run.save_every=1", "run.keep_last=10",
                      "learner.world_size=2", "rollout.precision='int4'")) == 0
    run_dir = run_dir_in(out)
    by_step = {m["step"]: m for m in step_metrics(run_dir)}
    assert [by_step[s]["guard/skipped"] for s in (1, 2, 3, 4)] == [0, 1, 1, 0]
    assert by_step[2]["guard/reason"] == "loss" and by_step[3]["guard/reason"] == "sampler_logprobs"
    assert [by_step[s]["guard/rollout_bits"] for s in (1, 2, 3, 4)] == [4, 8, 16, 16]
    assert [by_step[s]["policy_version"] for s in (1, 2, 3, 4)] == [1, 1, 1, 2]
    ckpt = run_dir / "checkpoints"
    w = {s: load_file(str(ckpt / f"step_{s:06d}" / "model.safetensors")) for s in (1, 2, 3, 4)}
    assert all(torch.equal(w[1][k], w[2][k]) and torch.equal(w[1][k], w[3][k]) for k in w[1])
    assert any(not torch.equal(w[3][k], w[4][k]) for k in w[1])
    state = json.loads((ckpt / "step_000003" / "trainer_state.json").read_text())
    assert state["guard"]["rollout_precision"] == "bf16" and state["guard"]["skipped_total"] == 2
    ladder = [e for e in read_metrics(run_dir) if e.get("event") == "ladder"]
    assert [(e["step"], e["rollout_precision"]) for e in ladder] == [(2, "int8"), (3, "bf16")]

    assert main(["train", "--resume", str(run_dir), "--set", "run.steps=5"]) == 0
    resumed = [e for e in read_metrics(run_dir) if e.get("event") == "resume"]
    assert resumed[-1]["rollout_precision"] == "bf16"
    assert {g["precision"] for g in resumed[-1]["generators"]} == {"bf16"}
    assert step_metrics(run_dir)[-1]["step"] == 5 and step_metrics(run_dir)[-1]["rollout/precision"] == "bf16"


@pytest.mark.slow
def test_guard_stops_a_run_with_nothing_left_to_step_up(ray_session, tiny_model_path, tmp_path, faults, capsys):
    faults("learner.nan_loss@2+")
    out = tmp_path / "runs"
    rc = main(train_args(tiny_model_path, out, "run.steps=5", "rollout.precision='bf16'", "guard.max_skips_at_top=2"))
    err = capsys.readouterr().err
    assert rc == 1 and "precision guard: 2 steps in a row skipped, the last at step 3 (loss)" in err
    assert "run stopped at step 3" in err


@pytest.mark.slow
def test_resumed_run_repeats_the_uninterrupted_metrics_exactly(ray_session, tiny_model_path, tmp_path):
    """A 6-step run, then the same run resumed from its step-3 checkpoint: steps 4-6 come out bit-identical (reward,
    loss, KL, grad norm, mismatch), with the Adam moments restored (re-initialised moments change step 4's update and
    so steps 5-6); the abandoned steps are set aside, the run directory holds each step once."""
    import pyarrow.parquet as pq

    out = tmp_path / "runs"
    assert main(train_args(tiny_model_path, out, "run.steps=6", "run.save_every=3", "learner.lr=3e-3")) == 0
    run_dir = run_dir_in(out)
    first = {m["step"]: m for m in step_metrics(run_dir)}
    final_first = load_file(str(run_dir / "checkpoints" / "step_000006" / "model.safetensors"))
    assert main(["train", "--resume", str(run_dir / "checkpoints" / "step_000003")]) == 0
    again = {m["step"]: m for m in step_metrics(run_dir)}
    assert sorted(again) == [1, 2, 3, 4, 5, 6]
    for s in (4, 5, 6):
        for key in ("reward/mean", "loss/total", "loss/kl", "loss/grad_norm", "mismatch/kl_mu_old", "loss/lr"):
            assert again[s][key] == first[s][key], (s, key, again[s][key], first[s][key])
    final_again = load_file(str(run_dir / "checkpoints" / "step_000006" / "model.safetensors"))
    assert all(torch.equal(final_first[k], final_again[k]) for k in final_first)
    (aside,) = (run_dir / "abandoned").iterdir()
    assert [json.loads(l)["step"] for l in (aside / "metrics.jsonl").read_text().splitlines()
            if "reward/mean" in l] == [4, 5, 6]
    assert (aside / "checkpoints" / "step_000006").is_dir()
    steps = Counter(pq.read_table(run_dir / "rollouts").column("step").to_pylist())
    assert steps == {s: 64 for s in range(1, 7)}


def _run_own_group(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    """Run a qgrpo process in a process group of its own (its Ray head and actors join it) and, whatever happens,
    kill that group and only that group afterwards, so a failing test leaves no process behind."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.slow
@pytest.mark.ray  # a qgrpo process of its own
def test_kill_during_checkpoint_write_then_resume(tiny_model_path, tmp_path):
    """The whole run (driver, Ray, actors: one process group) is SIGKILLed after step 4's model files are written
    and before the checkpoint is complete; `--resume RUN_DIR` continues from step 2 and completes."""
    out = tmp_path / "runs"
    env = {**os.environ, "QGRPO_FAULTS": "save.kill@4", "QGRPO_FAULTS_STATE": str(tmp_path),
           "PYTHONWARNINGS": "ignore"}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "qgrpo", *train_args(tiny_model_path, out, "run.steps=5", "run.save_every=2")]
    proc = _run_own_group(cmd, env)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    run_dir = run_dir_in(out)
    ckpts = run_dir / "checkpoints"
    assert (ckpts / ".step_000004.tmp" / "model.safetensors").is_file()  # killed mid-write
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000002"]
    proc = _run_own_group([sys.executable, "-m", "qgrpo", "train", "--resume", str(run_dir)],
                          {**env, "QGRPO_FAULTS": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resuming from" in proc.stderr and "step_000002" in proc.stderr
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000004", "step_000005"]
    assert [m["step"] for m in step_metrics(run_dir)] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("setting, field", [
    ("learner.world_size=0", "learner.world_size"),
    ("rollout.max_new_tokens=100000", "rollout.max_new_tokens"),
    ("rollout.max_new_tokens=200", "rollout.max_new_tokens"),
    ("task.name='rg:basic_arithmetic'", "task.name"),
    ("rollout.num_actors=64", "rollout.num_actors"),
    ("run.output_dir='{tmp}/a-file/runs'", "run.output_dir"),
    ("faults.generate_timeout_s=0", "faults.generate_timeout_s"),
    ("run.save_every=3", "run.save_every"),
])
def test_values_that_would_hang_or_train_on_garbage_exit_2_before_ray_starts(tiny_model_path, tmp_path, monkeypatch,
                                                                             capsys, setting, field):
    """Each is refused with the field named, before Ray starts, any actor exists or a run directory is written."""
    import ray

    import qgrpo.cluster.run.driver

    def never(*a, **k):
        raise AssertionError("Ray or the driver was started for an invalid run")

    monkeypatch.setattr(ray, "init", never)
    monkeypatch.setattr(qgrpo.cluster.run.driver, "train", never)
    (tmp_path / "a-file").write_text("not a folder")
    out = tmp_path / "runs"
    extra = [setting.format(tmp=tmp_path)] + (["algo.update_every=2"] if field == "run.save_every" else [])
    assert main(train_args(tiny_model_path, out, *extra)) == 2  # a later --set wins: this case's output_dir
    err = capsys.readouterr().err
    assert f"  - {field}:" in err, err
    assert not out.exists() and "Traceback" not in err
