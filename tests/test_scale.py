"""`qgrpo scale RUN_DIR --rollout-actors N` while a run goes: 1 -> 2 -> 1 rollout actors at step boundaries. Every
prompt of every step is generated and scored exactly once, the added actor's first rollouts carry the policy version
the other actor samples with (the current published weights), and after the scale-down only one actor generates.
The generation time per step before and after the scale-up is printed (on two cores two actors share the same
cores: reported, not asserted)."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.ray  # runs `qgrpo train` in subprocesses: left out of `make test-fast`

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, GROUP, STEPS = 8, 8, 14


def _records(run_dir: Path) -> list[dict]:
    f = run_dir / "metrics.jsonl"
    if not f.is_file():
        return []
    out = []
    for line in f.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return out


def _wait(proc, run_dir_of, until, what: str, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run_dir = run_dir_of()
        if run_dir is not None and until(_records(run_dir)):
            return run_dir
        assert proc.poll() is None, f"the run ended before {what}"
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _scale(run_dir: Path, n: int) -> None:
    r = subprocess.run([sys.executable, "-m", "qgrpo", "scale", str(run_dir), "--rollout-actors", str(n)],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "next step boundary" in r.stderr, r.stderr


@contextlib.contextmanager
def _training(sets: list[str], env: dict, log_path: Path):
    """`qgrpo train configs/tiny.toml` with `sets`, in a process group of its own (its Ray head and actors join it);
    whatever happens, that group and only that group is killed afterwards, so a failing test leaves no process."""
    log = log_path.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "qgrpo", "train", "configs/tiny.toml",
                             *[a for s in sets for a in ("--set", s)]], cwd=ROOT, stderr=log, stdout=log, env=env,
                            start_new_session=True)
    try:
        yield proc
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        log.close()


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
def test_scale_rollout_actors_up_and_down_during_a_run(tiny_model_path, tmp_path):
    out = tmp_path / "runs"
    sets = [f"model.path='{tiny_model_path}'", f"run.output_dir='{out}'", f"run.steps={STEPS}", "run.progress=false",
            "run.eval=false", "run.tensorboard=false", f"rollout.prompts_per_step={PROMPTS}",
            f"rollout.group_size={GROUP}", "run.rollouts_flush_every=1", "guard.enabled=false"]
    # A tiny step takes under 0.1 s on a fast CPU, less than `qgrpo scale` needs to start: each step sleeps 1 s
    # first (the driver.slow fault), so that each request lands a known number of steps before the run ends.
    env = {**os.environ, "QGRPO_FAULTS": "driver.slow@1+"}
    run_dir_of = lambda: next((p for p in out.iterdir() if p.is_dir()), None) if out.is_dir() else None  # noqa: E731
    steps = lambda recs: [m["step"] for m in recs if "reward/mean" in m]  # noqa: E731
    scales = lambda recs: [m for m in recs if m.get("event") == "scale"]  # noqa: E731
    with _training(sets, env, tmp_path / "stderr.txt") as proc:
        run_dir = _wait(proc, run_dir_of, lambda r: len(steps(r)) >= 2, "step 2")
        _scale(run_dir, 2)
        _wait(proc, run_dir_of, lambda r: scales(r) and len([s for s in steps(r) if s > scales(r)[0]["step"]]) >= 2,
              "two steps with two actors")
        _scale(run_dir, 1)
        _wait(proc, run_dir_of, lambda r: len(scales(r)) == 2, "the scale-down")
        assert proc.wait(timeout=900) == 0, (tmp_path / "stderr.txt").read_text()[-4000:]

    recs = _records(run_dir)
    up, down = scales(recs)
    assert (up["from"], up["to"], down["from"], down["to"]) == (1, 2, 2, 1) and "refused" not in up
    assert up["step"] < down["step"] < STEPS
    rows = pq.read_table(run_dir / "rollouts").to_pylist()
    per_step = {}
    for r in rows:
        per_step.setdefault(r["step"], []).append(r)
    assert sorted(per_step) == list(range(1, STEPS + 1))
    for step, rs in per_step.items():  # every prompt exactly once, with its whole group
        assert Counter(r["prompt_id"] for r in rs) == {p: GROUP for p in {r["prompt_id"] for r in rs}}
        assert len({r["prompt_id"] for r in rs}) == PROMPTS
    ids = Counter(r["prompt_id"] for r in rows)
    assert set(ids.values()) == {GROUP}  # no prompt of one step was generated again at another
    # Steps are numbered from 1; a scale event at loop index k applies before step k + 1 is generated.
    first_two, after_down = up["step"] + 1, down["step"] + 1
    for step in range(first_two, after_down):
        gens = {r["generator_id"] for r in per_step[step]}
        assert gens == {"torch-0", "torch-1"}, (step, gens)
    new_first = per_step[first_two]
    versions = {r["generator_id"]: {r["policy_version"] for r in new_first if r["generator_id"] == g}
                for r in new_first for g in [r["generator_id"]]}
    assert versions["torch-1"] == versions["torch-0"] == {first_two - 1}, versions  # update_every = 1
    assert up["started"][0]["version"] == first_two - 1
    for step in range(after_down, STEPS + 1):
        assert {r["generator_id"] for r in per_step[step]} == {"torch-0"}
    gen = {m["step"]: m["time/generate"] for m in recs if "time/generate" in m}
    actors = {m["step"]: m["rollout/actors"] for m in recs if "rollout/actors" in m}
    print(f"\ngenerate s/step: one actor {gen[first_two - 1]:.2f} (step {first_two - 1}), two actors "
          f"{gen[first_two + 1]:.2f} (step {first_two + 1}); actors per step {actors}")


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
def test_actors_added_to_a_running_stream_take_prompts_from_its_queue(tiny_model_path, tmp_path):
    """algo.max_staleness = 1: `qgrpo scale` 1 -> 2 while the stream runs ahead. The stream settles (its call in
    flight comes in), the actor is added, and the new actor takes chunks from the queue: it generates later steps'
    prompts; every prompt of every step is still generated exactly once, and no group is staler than the bound."""
    out, steps_n = tmp_path / "runs", 8
    sets = [f"model.path='{tiny_model_path}'", f"run.output_dir='{out}'", f"run.steps={steps_n}",
            "run.progress=false", "run.eval=false", "run.tensorboard=false", "rollout.prompts_per_step=4",
            f"rollout.group_size={GROUP}", "run.rollouts_flush_every=1", "guard.enabled=false", "algo.max_staleness=1"]
    env = {**os.environ, "QGRPO_FAULTS": "driver.slow@1+"}  # 1 s a step: the request lands before the run ends
    env.pop("RAY_ADDRESS", None)
    run_dir_of = lambda: next((p for p in out.iterdir() if p.is_dir()), None) if out.is_dir() else None  # noqa: E731
    with _training(sets, env, tmp_path / "stderr.txt") as proc:
        run_dir = _wait(proc, run_dir_of, lambda r: len([m for m in r if "reward/mean" in m]) >= 2, "step 2")
        _scale(run_dir, 2)
        assert proc.wait(timeout=900) == 0, (tmp_path / "stderr.txt").read_text()[-4000:]
    recs = _records(run_dir)
    (up,) = [m for m in recs if m.get("event") == "scale"]
    assert (up["from"], up["to"]) == (1, 2) and "refused" not in up
    rows = pq.read_table(run_dir / "rollouts").to_pylist()
    for step in range(1, steps_n + 1):
        assert Counter(r["prompt_id"] for r in rows if r["step"] == step) == \
            {p: GROUP for p in {r["prompt_id"] for r in rows if r["step"] == step}}
        assert len({r["prompt_id"] for r in rows if r["step"] == step}) == 4
    assert set(Counter(r["prompt_id"] for r in rows).values()) == {GROUP}
    assert any(r["generator_id"] == "torch-1" for r in rows if r["step"] > up["step"])
    assert all(m["stream/staleness_max"] <= 1 for m in recs if "stream/staleness_max" in m)
