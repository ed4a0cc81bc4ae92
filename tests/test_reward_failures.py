"""Failing rewards are loud (cluster/run/rewarding.py RewardHealth): a warning line per step with counts per entry,
the tracebacks in RUN_DIR/reward_errors.log, the failures in the end-of-run summary, and a reward that fails on every
call stops the run after rewards.max_failed_steps steps even under rewards.on_error = "zero". Real runs of the tiny
model through Ray."""
import json
import sys
import textwrap
from pathlib import Path

import pytest

from qgrpo.cluster.run.rewarding import RewardHealth
from qgrpo.rollout.rewards.scoring import CallResult, RewardEntry, Scores, combine

ROOT = Path(__file__).resolve().parents[1]
LISTCOMP = "<listcomp>" if sys.version_info < (3, 12) else "broken"  # 3.12 runs a comprehension in its function

REWARDS = textwrap.dedent('''
    CALLS = []

    def broken(completions, references, **kwargs):
        share = 8 // len(completions)  # 0 on a batch larger than the 8 stand-ins `check` calls it on
        return [1.0 / share for c in completions]

    def flaky(completions, **kwargs):
        if len(completions) > 8:  # a real step's batch, not check's stand-ins
            CALLS.append(1)
            if len(CALLS) == 1:  # the first call of each worker process fails
                raise RuntimeError("the grader's cache was cold")
        return [0.5] * len(completions)
''')


def _train(main, tmp_path, tiny_model_path, *sets):
    return main(["train", str(ROOT / "configs" / "tiny.toml"), "--set", f"model.path='{tiny_model_path}'",
                 "--set", f"run.output_dir='{tmp_path / 'runs'}'", "--set", "run.progress=false",
                 "--set", "run.eval=false", "--set", "run.save_every=0", *[a for s in sets for a in ("--set", s)]])


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
def test_a_reward_failing_on_every_call_stops_the_run_under_zero(ray_session, tiny_model_path, tmp_path,
                                                                 monkeypatch, capsys):
    from qgrpo.cluster.cli.app import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text(REWARDS)
    rc = _train(main, tmp_path, tiny_model_path, "run.steps=5", "rewards.on_error='zero'",
                "rewards.max_failed_steps=2",
                "rewards.functions=[{name='correct'}, {function='mine.py:broken', weight=0.5}]")
    err = capsys.readouterr().err
    assert rc != 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    line = f"{tmp_path / 'mine.py'}:6 in {LISTCOMP}: return [1.0 / share for c in completions]"
    # each step says so on the terminal, with the counts and the user's line
    for step in (1, 2):
        assert (f"qgrpo: warning: step {step}: reward 'broken' (rewards.functions[1]) failed on 256 of 256 "
                f"completions (ZeroDivisionError: float division by zero at {line})") in err
    assert ("reward 'broken' (rewards.functions[1]) failed on every call for 2 steps in a row (ZeroDivisionError: "
            f"float division by zero at {line}); tracebacks in {run_dir / 'reward_errors.log'}") in err
    assert "the run stopped at step 2" in err
    rows = _lines(run_dir)
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # the failed entry has no mean (not a 0.000 score); the one that worked has its own
        assert r["reward/errors"] == 256 and r["reward/errors/broken"] == 256 and "reward/broken" not in r
        assert 0.0 <= r["reward/correct"] <= 1.0 and "reward/errors/correct" not in r
    events = [r for r in rows if r.get("event") == "reward_errors"]
    assert [(e["step"], e["label"], e["failed"], e["of"], e["where"]) for e in events] == \
        [(1, "broken", 256, 256, line), (2, "broken", 256, 256, line)]
    log = (run_dir / "reward_errors.log").read_text()
    assert log.count("Traceback (most recent call last)") == 1  # one traceback per distinct error
    assert f'File "{tmp_path / "mine.py"}", line 6' in log and "ZeroDivisionError: float division by zero" in log


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
def test_a_reward_that_fails_once_is_counted_and_summarised(ray_session, tiny_model_path, tmp_path, monkeypatch,
                                                           capsys):
    from qgrpo.cluster.cli.app import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text(REWARDS)
    rc = _train(main, tmp_path, tiny_model_path, "run.steps=3", "rewards.on_error='zero'",
                "rewards.functions=[{name='correct'}, {function='mine.py:flaky', weight=0.5}]")
    err = capsys.readouterr().err
    assert rc == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    steps = [r for r in _lines(run_dir) if "reward/mean" in r]
    assert [r.get("reward/errors/flaky", 0) for r in steps] == [256, 0, 0]
    assert "reward/flaky" not in steps[0] and [r["reward/flaky"] for r in steps[1:]] == [0.5, 0.5]
    assert ("  warning: reward 'flaky' (rewards.functions[1]) failed on 256 of 768 completions in 1 step "
            "(RuntimeError: the grader's cache was cold at ") in err
    assert f"tracebacks in {run_dir}/reward_errors.log" in err


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
def test_fail_names_the_users_line_and_the_log(ray_session, tiny_model_path, tmp_path, monkeypatch, capsys):
    from qgrpo.cluster.cli.app import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text(REWARDS)
    rc = _train(main, tmp_path, tiny_model_path, "run.steps=2",
                "rewards.functions=[{name='correct'}, {function='mine.py:broken', weight=0.5}]")
    err = capsys.readouterr().err
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert rc != 0
    assert (f"ZeroDivisionError: float division by zero (at {tmp_path / 'mine.py'}:6 in {LISTCOMP}: return "
            "[1.0 / share for c in completions]); fix it, or set rewards.on_error") in err
    assert f"tracebacks in {run_dir / 'reward_errors.log'}" in err


def test_health_counts_steps_of_every_call_failing_and_resets_on_success(tmp_path):
    """The streak rule without Ray: only a step where every call of the entry failed counts towards the stop."""
    import pytest

    from qgrpo.cluster.run.supervisor import RunFailed

    entries = [RewardEntry("ok", 1.0, "builtin", "correct", 5.0, field="rewards.functions[0]"),
               RewardEntry("bad", 1.0, "function", "m.py:f", 5.0, field="rewards.functions[1]")]
    health = RewardHealth(entries, 2, tmp_path)

    def step(n: int, failed_calls: int) -> list[dict]:
        scores = Scores(4)
        scores.add(CallResult("ok", [1.0] * 4), 0, 4)
        for k in range(2):  # two calls of 2 completions each
            r = CallResult("bad", None, "ValueError: x", where="m.py:3 in f: x", trace="Traceback ...") \
                if k < failed_calls else CallResult("bad", [0.0, 0.0])
            scores.add(r, 2 * k, 2 * k + 2)
        health.record(scores, n)
        totals, metrics = combine(entries, scores, ["a", "a", "b", "b"], "zero")
        assert metrics["reward/errors"] == metrics.get("reward/errors/bad", 0) == 2 * failed_calls
        return health.end_step(n)

    assert [e["failed"] for e in step(1, 2)] == [4]
    assert [e["failed"] for e in step(2, 1)] == [2]  # one call of two failed: the streak restarts
    step(3, 2)
    health.stop_if_broken()  # one step in a row so far
    step(4, 2)
    with pytest.raises(RunFailed, match=r"reward 'bad' \(rewards.functions\[1\]\) failed on every call for 2 steps"):
        health.stop_if_broken()
    assert health.failures()["bad"]["failed"] == 4 + 2 + 4 + 4 and health.failures()["bad"]["steps"] == 4
    assert "ok" not in health.failures()
    assert (tmp_path / "reward_errors.log").read_text().count("Traceback ...") == 1
