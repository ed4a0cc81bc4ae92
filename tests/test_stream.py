"""Asynchronous rollouts with a staleness bound (cluster/run/stream.py, algo.max_staleness; the bound by hand is in
tests/test_staleness.py): the config's refusals, and real runs of configs/tiny.toml through Ray, where a synchronous
run and a stream at staleness 2 train on the same prompts in the same steps, the stream's groups are never staler than
the bound, and a rollout actor beyond a step's prompts generates later steps' prompts; a stream's checkpoint snapshot
taken up by a resumed stream over a stand-in pool."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from qgrpo.cluster.config.schema import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


@pytest.mark.parametrize("other, words", [
    ("algo.overlap=true", "algo.max_staleness: cannot run with algo.overlap"),
    ("algo.dynamic_sampling=true", "algo.max_staleness: cannot run with algo.dynamic_sampling"),
])
def test_the_stream_refuses_what_it_cannot_run_with(other, words):
    with pytest.raises(ConfigError, match=words):
        load_config(str(TINY), ["algo.max_staleness=1", other])
    with pytest.raises(ConfigError, match="algo.max_staleness"):
        load_config(str(TINY), ["algo.max_staleness=-1"])
    assert load_config(str(TINY), ["algo.max_staleness=1"]).algo.max_staleness == 1


def _train(tiny_model_path: str, tmp_path: Path, name: str, *sets: str) -> Path:
    from qgrpo.cluster.cli.app import main

    cache = Path(tiny_model_path).parents[1]
    out = tmp_path / name
    args = [f"model.cache_dir='{cache}'", f"run.output_dir='{out}'", "run.progress=false", "run.eval=false",
            "run.steps=5", "rollout.num_actors=2", "rollout.prompts_per_step=1", "rollout.group_size=8", *sets]
    assert main(["train", str(TINY), *(x for s in args for x in ("--set", s))]) == 0
    (run_dir,) = out.iterdir()
    return run_dir


def _steps(run_dir: Path) -> list[dict]:
    return [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "time/step" in m]


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
def test_a_stream_trains_on_the_prompts_of_a_synchronous_run_within_its_bound(ray_session, tiny_model_path,
                                                                               tmp_path, monkeypatch, faults):
    """... and its syncs land inside the completions in flight: the stream's actors decode at 0.25 s a step (the
    fault rollout.slow_decode), so a chunk outlasts the learner's step and the sync after it."""
    import pyarrow.parquet as pq

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    sync = _train(tiny_model_path, tmp_path, "sync")
    faults("rollout.slow_decode@1+")
    stream = _train(tiny_model_path, tmp_path, "stream", "algo.max_staleness=2")

    def by_step(run_dir: Path) -> dict[int, list]:
        rows = pq.read_table(run_dir / "rollouts").to_pylist()
        return {s: sorted({r["prompt_id"] for r in rows if r["step"] == s}) for s in range(1, 6)}

    # Nothing lost, nothing twice: the same prompts, in the same steps, as the synchronous run
    assert by_step(stream) == by_step(sync)
    assert all("stream/wait_s" not in m for m in _steps(sync))
    rows = pq.read_table(stream / "rollouts").to_pylist()
    for m in _steps(stream):
        assert 0 <= m["stream/staleness_max"] <= 2 and m["stream/wait_s"] >= 0
        versions = {r["policy_version"] for r in rows if r["step"] == m["step"]}
        assert all(m["policy_version"] - 1 - v <= 2 for v in versions)  # the learner trained on from version - 1
    # The stream ran ahead: the groups of later steps were sampled before the syncs they would have waited for
    assert max(m["stream/staleness_max"] for m in _steps(stream)) >= 1
    # In-flight updates: completions that span two versions, every token within the bound, all tokens counted
    steps = _steps(stream)
    assert sum(m["stream/mixed_completions"] for m in steps) > 0
    assert any(r["last_version"] > r["policy_version"] for r in rows)  # the rollouts table says which ones
    for m in steps:
        ages = {int(k.removeprefix("stream/tokens_age")): n for k, n in m.items() if k.startswith("stream/tokens_age")}
        assert ages and min(ages) >= 0 and max(ages) <= 2
        assert sum(ages.values()) == round(m["rollout/completion_len"] * 8)  # one prompt of group_size 8
        if m["stream/mixed_completions"]:  # the tokens' versions reached the learner: its staleness is their mean
            mean = sum(k * n for k, n in ages.items()) / sum(ages.values())
            assert m["rollout/staleness"] == pytest.approx(mean, abs=1e-6)
    # One prompt per step, two actors: the second generated later steps' prompts (no actor sat idle by design)
    assert len({r["generator_id"] for r in rows}) == 2


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
def test_a_killed_rollout_actor_in_a_stream_loses_and_repeats_no_prompt(ray_session, tiny_model_path, tmp_path,
                                                                        faults, monkeypatch):
    """One of two rollout actors SIGKILLs its process inside generate at generator step 2 while the stream runs
    ahead; its chunk goes again, first, to a live actor. Every prompt of every step is trained on exactly
    group_size times and none twice across steps."""
    from collections import Counter

    import pyarrow.parquet as pq

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    faults("rollout.kill@2")
    run_dir = _train(tiny_model_path, tmp_path, "killed", "algo.max_staleness=1", "rollout.prompts_per_step=4")
    rows = pq.read_table(run_dir / "rollouts").to_pylist()
    per_step = {s: Counter(r["prompt_id"] for r in rows if r["step"] == s) for s in range(1, 6)}
    for step, counts in per_step.items():
        assert len(counts) == 4 and set(counts.values()) == {8}, (step, counts)
    assert len({p for c in per_step.values() for p in c}) == 20
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if e.get("event", "").startswith("rollout_actor_")] == \
        ["rollout_actor_failed", "rollout_actor_replaced"]
    assert all(m["stream/staleness_max"] <= 1 for m in _steps(run_dir))


@pytest.mark.ray  # a qgrpo process of its own
@pytest.mark.slow  # 90-140 s; the synchronous kill-while-checkpointing test (tests/test_faults.py) stays in make test
def test_a_stream_killed_mid_run_resumes_without_skipping_or_repeating_a_prompt(tiny_model_path, tmp_path):
    """The whole streamed run (driver, Ray, actors) is SIGKILLed while writing step 4's checkpoint, with later
    steps' groups generated ahead; `--resume` continues from step 2's checkpoint, taking up the groups it held
    (rollout_buffer.json) and generating the rest again, and steps 1-5 train on the same prompts as a synchronous
    run would: nothing is skipped or repeated."""
    import os
    import signal
    import sys

    import pyarrow.parquet as pq

    from qgrpo.rollout.data.tasks import PromptSampler, make_task
    from tests.test_faults import _run_own_group

    cache = Path(tiny_model_path).parents[1]
    base = [f"model.cache_dir='{cache}'", "run.progress=false", "run.eval=false", "run.steps=5", "run.save_every=2",
            "rollout.num_actors=2", "rollout.prompts_per_step=2", "rollout.group_size=4"]

    def args(out: Path, *sets: str) -> list[str]:
        return ["train", str(TINY), *(x for s in (*base, f"run.output_dir='{out}'", *sets) for x in ("--set", s))]

    env = {**os.environ, "PYTHONWARNINGS": "ignore", "QGRPO_FAULTS_STATE": str(tmp_path)}
    env.pop("RAY_ADDRESS", None)
    proc = _run_own_group([sys.executable, "-m", "qgrpo", *args(tmp_path / "stream", "algo.max_staleness=2")],
                          {**env, "QGRPO_FAULTS": "save.kill@4"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    (run_dir,) = (tmp_path / "stream").iterdir()
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_000002"]
    buffer = json.loads((run_dir / "checkpoints" / "step_000002" / "rollout_buffer.json").read_text())
    proc = _run_own_group([sys.executable, "-m", "qgrpo", "train", "--resume", str(run_dir)],
                          {**env, "QGRPO_FAULTS": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [m["step"] for m in _steps(run_dir)] == [1, 2, 3, 4, 5]
    # the steps drawn ahead of the checkpoint were taken up from it, with the groups generated by then
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (restored,) = [e for e in events if e.get("event") == "stream_restored"]
    assert restored["steps"] == sorted(int(k) + 1 for k in buffer["steps"]) and min(restored["steps"]) >= 3
    assert restored["groups"] == sum(len(d["groups"]) for e in buffer["steps"].values() for d in e["done"].values())
    # What a synchronous run trains on: the task's prompts in order, prompts_per_step a step
    cfg = load_config(str(TINY), base)
    sampler = PromptSampler(make_task(cfg.task, cfg.run.seed))
    expected = {s: sorted(i.prompt_id for i in sampler.next(2)) * 4 for s in range(1, 6)}
    rows = pq.read_table(run_dir / "rollouts").to_pylist()
    assert {s: sorted(r["prompt_id"] for r in rows if r["step"] == s) for s in range(1, 6)} == \
        {s: sorted(ids) for s, ids in expected.items()}  # each prompt once, in its step, group_size times


def _fake_generate(calls: list):
    """A rollout actor's generate for the stream alone: one single-token group per prompt, sampled by the weights of
    the step before (policy_version = step - 1), its call logged."""

    def generate(items, sampling, step):
        from qgrpo.core.records import Completion, GenerationStats, GroupRollout

        calls.append((step, [i.prompt_id for i in items]))
        groups = [GroupRollout(item=i, prompt_ids=[1, 2], completions=[Completion([5], [-0.25], "stop", "5")],
                               policy_version=step - 1, generator_id="fake", precision="int8") for i in items]
        return groups, GenerationStats("fake", 0.01, len(items), step - 1)

    return generate


def _stream(calls: list, start: int, buffer=None):
    from qgrpo.cluster.run.stream import RolloutStream
    from qgrpo.learner.objective.staleness import admission
    from qgrpo.rollout.data.tasks import PromptSampler, make_task
    from tests.helpers import FakePool

    cfg = load_config(str(TINY), ["rollout.prompts_per_step=4", "rollout.group_size=2"])
    sampler = PromptSampler(make_task(cfg.task, cfg.run.seed), cursor=4 * start)
    return RolloutStream(FakePool(_fake_generate(calls), actors=2), sampler, cfg.rollout, seed=0,
                         rule=admission(2, 1), start_step=start, published=start, steps=6,
                         buffer=buffer), sampler


def test_a_checkpoint_holds_the_stream_and_a_resume_trains_on_its_groups_as_sampled():
    """After step 0 is taken, the stream's snapshot holds steps 1 and 2 (drawn ahead at staleness 2): their prompts
    and the groups generated, as JSON. A stream resumed from it generates again only the chunk the snapshot lacked
    (one of step 2's, left out as if in flight at the save), takes steps 1 and 2 with the very groups of the first
    stream, and draws step 3's prompts from where the first stream stopped drawing."""
    import json
    import time as clock

    from qgrpo.rollout.data.tasks import PromptSampler, make_task

    calls: list = []
    first, _ = _stream(calls, 0)
    try:
        deadline = clock.monotonic() + 30
        with first.cv:  # steps 0-2 are admitted at once (S = 2): wait until all their chunks are in
            while any(len(first.done.get((s, 0), {})) < 2 for s in range(3)):
                first.cv.wait(0.1)
                assert clock.monotonic() < deadline
        first.take(0)
        with first.cv:
            missing = first.done[(2, 0)].pop(1)  # as if in flight at the save
            before = {s: [g for k in sorted(first.done[(s, 0)]) for g in first.done[(s, 0)][k].groups] for s in (1, 2)}
        snap = json.loads(json.dumps(first.snapshot()))  # JSON-safe, as the checkpoint writes it
    finally:
        first.close()
    assert sorted(snap["steps"]) == ["1", "2"] and snap["cursor"] == 12 and snap["next_step"] == 3
    assert sorted(snap["steps"]["2"]["done"]) == ["0"]
    calls.clear()
    second, _ = _stream(calls, 1, snap)
    try:
        assert second.restored == 4 + 2
        got = {s: second.take(s).groups for s in (1, 2, 3)}
    finally:
        second.close()
    assert [(g.item, g.completions, g.policy_version) for g in got[1]] == \
        [(g.item, g.completions, g.policy_version) for g in before[1]]  # trained on as sampled
    assert got[2][:2] == before[2] and [g.item for g in got[2][2:]] == [g.item for g in missing.groups]
    # generated again: step 2's missing chunk (the actors' 1-based step 3) and step 3's two chunks, nothing else
    assert sorted(c for c in calls if c[0] == 3) == [(3, [g.item.prompt_id for g in missing.groups])]
    assert {c[0] for c in calls} == {3, 4}
    task = make_task(load_config(str(TINY)).task, 0)
    assert [g.item.prompt_id for g in got[3]] == [i.prompt_id for i in PromptSampler(task, cursor=12).next(4)]
