"""Failing environments are loud and runs that cannot learn say why (cluster/run/env_health.py): hand-made groups of
trajectories through `EnvHealth` (a warning per step with failures naming the error and the user's line, each
distinct traceback once in RUN_DIR/env_errors.log, RunFailed after environment.max_failed_steps steps of every
trajectory failing) and metrics through `SignalWatch` (no reward spread, no tool called, once per streak); the end
summary's and the report's lines built from them. A real run through Ray: an environment that raises on most turns
warns at every step and stops the run."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from qgrpo.cluster.cli.summary import summary
from qgrpo.cluster.report.failures import env_failures, failures_section
from qgrpo.cluster.report.run_data import RunData
from qgrpo.cluster.run.env_health import ERROR_LOG, EnvHealth, SignalWatch, drop_traces
from qgrpo.cluster.run.supervisor import RunFailed
from qgrpo.core.records import Completion, GroupRollout, PromptItem

ROOT = Path(__file__).resolve().parents[1]
WHERE = "env.py:12 in step: int(turn)"


def _trajectory(finish: str, error: str = "ValueError: invalid literal for int() with base 10: 'x'",
                trace: str | None = None) -> Completion:
    turns = [{"role": "assistant", "content": "x", "start": 0, "end": 1, "tool_calls": [], "error": None}]
    if finish == "env_error":
        turns.append({"role": "user", "content": f"[environment error] {error}", "start": 1, "end": 1,
                      "tool_calls": [], "error": error, "where": WHERE, "call": "step"})
        if trace:
            turns[-1]["trace"] = trace
    return Completion([5], [-0.1], finish, "x", model_mask=[1], turns=turns, env_score=0.0)


def _groups(*finishes: str, trace: str | None = "Traceback (most recent call last):\n  ...\nValueError") -> list:
    comps, traced = [], False
    for f in finishes:
        comps.append(_trajectory(f, trace=trace if f == "env_error" and not traced else None))
        traced = traced or f == "env_error"
    return [GroupRollout(PromptItem("row0", "guess", "7"), [1, 2], comps, 0, "g", "bf16")]


def test_every_step_with_failures_warns_and_a_run_of_all_failing_steps_stops(tmp_path):
    health = EnvHealth("/data/env.py:Guess", max_failed_steps=2, on_error="end", run_dir=tmp_path)
    (event,) = health.end_step(1, _groups("env_error", "env_error", "stop", "env_error"))
    assert (event["event"], event["failed"], event["of"], event["where"], event["log"]) == \
        ("env_errors", 3, 4, WHERE, ERROR_LOG)
    assert event["message"] == (
        "environment env.py:Guess failed on 3 of 4 trajectories (ValueError: invalid literal for int() with base 10: "
        f"'x' at {WHERE}); they ended as \"env_error\" with a score of 0 (environment.on_error = \"end\"); step() "
        "must answer any text the model can write, e.g. with a message telling the model what was wrong, rather "
        f"than raise; tracebacks in {tmp_path / ERROR_LOG}")
    health.stop_if_broken()  # one trajectory was answered: no streak
    assert health.end_step(2, _groups("env_error", "env_error"))
    health.stop_if_broken()  # 1 step of every trajectory failing, of 2
    assert health.end_step(3, _groups("stop", "max_turns")) == []  # a step without failures ends the streak
    health.end_step(4, _groups("env_error", "env_error"))
    health.stop_if_broken()
    health.end_step(5, _groups("env_error", "env_error"))
    with pytest.raises(RunFailed, match=r"environment env.py:Guess failed on every trajectory for 2 steps in a row "
                                        r"\(ValueError: .* at env.py:12 in step: int\(turn\)\); tracebacks in .*"
                                        r"environment.max_failed_steps = 2 stops"):
        health.stop_if_broken()
    log = (tmp_path / ERROR_LOG).read_text()
    assert log.count("Traceback (most recent call last)") == 1 and log.startswith(
        "step 1: environment env.py:Guess (step): ValueError: invalid literal")  # each distinct error once
    assert health.failures() == {"name": "env.py:Guess", "failed": 9, "of": 12, "steps": 4,
                                 "error": "ValueError: invalid literal for int() with base 10: 'x'", "where": WHERE}


def test_zero_never_stops_and_single_turn_runs_have_no_health(tmp_path):
    health = EnvHealth("env.py:Guess", max_failed_steps=0, on_error="end", run_dir=None)
    for step in range(1, 6):
        assert health.end_step(step, _groups("env_error"))
        health.stop_if_broken()
    single = [GroupRollout(PromptItem("row0", "q", "7"), [1], [Completion([5], [-0.1], "length", "x")], 0, "g",
                           "bf16")]
    assert health.end_step(6, single) == [] and health.failures()["steps"] == 5


def test_the_traceback_stays_out_of_the_rollouts():
    groups = _groups("env_error", "env_error")
    drop_traces(groups)
    assert all("trace" not in c.turns[-1] and c.turns[-1]["where"] == WHERE for c in groups[0].completions)


def test_no_signal_and_no_tool_calls_warn_once_per_streak_naming_the_tools():
    watch = SignalWatch(["calculate"], turn_tokens=48, steps=3)
    flat = {"reward/mean": 0.0, "reward/groups_with_signal": 0.0, "episode/turns": 1.0,
            "episode/called_tool_frac": 0.0, "episode/finish_length": 0.25}
    assert watch.end_step(1, flat) == [] and watch.end_step(2, flat) == []
    events = watch.end_step(3, flat)
    assert [e["kind"] for e in events] == ["no_signal", "no_tool_calls"]
    assert events[0]["message"].startswith("no group had a reward spread for 3 steps in a row "
                                           "(reward/groups_with_signal 0.0 (reward/mean 0.000)): every completion")
    assert "25% of the trajectories ended on a turn cut at environment.turn_tokens (48)" in events[0]["message"]
    tools = events[1]["message"]
    assert tools.startswith("no trajectory called the tool 'calculate' for 3 steps in a row")
    assert "worked exchanges in the prompt" in tools and "environment.turn_tokens (48 tokens now)" in tools
    assert "reads the wrong column" in tools and events[1]["tools"] == ["calculate"]
    assert watch.end_step(4, flat) == []  # once per streak
    assert watch.end_step(5, {**flat, "reward/groups_with_signal": 0.5, "episode/called_tool_frac": 0.1}) == []
    assert [e["kind"] for e in watch.end_step(8, flat) + watch.end_step(9, flat) + watch.end_step(10, flat)] == \
        ["no_signal", "no_tool_calls"]  # a new streak warns again
    assert SignalWatch([], steps=1).end_step(1, {"episode/called_tool_frac": 0.0}) == []  # no tools: no call to miss


def test_the_end_summary_and_the_report_list_environment_failures(tmp_path):
    health = EnvHealth("env.py:Guess", max_failed_steps=3, on_error="end", run_dir=tmp_path)
    events = [{"step": s, **e} for s in (1, 2) for e in health.end_step(s, _groups("env_error", "stop"))]
    result = {"last": {"step": 2, "reward/mean": 0.5}, "evals": {}, "checkpoint": "ckpt",
              "reward_failures": {}, "env_failures": health.failures()}
    text = summary(result, tmp_path, 60.0)
    assert (f"  warning: environment env.py:Guess failed on 2 of 4 trajectories in 2 steps (ValueError: invalid "
            f"literal for int() with base 10: 'x' at {WHERE}); they ended as \"env_error\" with a score of 0; "
            f"tracebacks in {tmp_path}/env_errors.log") in text
    data = RunData(steps=[{"step": 1, "episode/finish_env_error": 0.5}, {"step": 2, "episode/finish_env_error": 0.5},
                          {"step": 3, "episode/finish_env_error": 0.0}], events=json.loads(json.dumps(events)))
    assert env_failures(data).steps == [1, 2]
    md = "\n".join(failures_section(data, tmp_path))
    assert "## Environment failures" in md and "## Reward failures" not in md
    assert "- Trajectories failed: 2 of 4 in the steps with failures" in md
    assert "- Steps with failures: 2 of 3 (steps 1-2)" in md
    assert f"| ValueError: invalid literal for int() with base 10: 'x' | {WHERE} |" in md
    assert f"Tracebacks: `{tmp_path / ERROR_LOG}`" in md
    assert failures_section(RunData(steps=[{"step": 1, "episode/finish_env_error": 0.0}]), tmp_path) == []


BROKEN_ENV = textwrap.dedent('''
    from qgrpo.rollout.environments import Environment, StepResult

    ANSWERED = []  # steps answered by this process: `qgrpo check`'s probe is answered, a worker's later turns are not


    class Flaky(Environment):
        def reset(self, row):
            return [{"role": "user", "content": str(row["prompt"])}]

        def step(self, turn):
            ANSWERED.append(turn)
            if len(ANSWERED) > 6:
                raise ConnectionError("the game server dropped the connection")
            return StepResult([], done=True, reward=1.0)
''')


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
@pytest.mark.heavy  # 30 s: a real run through Ray
def test_an_environment_raising_on_most_turns_warns_every_step_and_stops(ray_session, tiny_model_path, tmp_path,
                                                                         monkeypatch, capsys):
    from qgrpo.cluster.cli.app import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "flaky.py").write_text(BROKEN_ENV)
    cache = Path(tiny_model_path).parents[1]
    rc = main(["train", str(ROOT / "examples" / "guess_number" / "config.toml"), "--set", "run.steps=5",
               "--set", f"run.output_dir='{tmp_path / 'runs'}'", "--set", f"model.cache_dir='{cache}'",
               "--set", "run.progress=false", "--set", "run.eval=false", "--set", "run.save_every=0",
               "--set", "rollout.prompts_per_step=4", "--set", "rollout.group_size=4",
               "--set", f"environment.name='{tmp_path / 'flaky.py'}:Flaky'", "--set", "environment.params={}",
               "--set", "environment.max_failed_steps=2"])
    err = capsys.readouterr().err
    assert rc != 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    line = f"{tmp_path / 'flaky.py'}:14 in step: raise ConnectionError(\"the game server dropped the connection\")"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [r for r in rows if r.get("event") == "env_errors"]
    # step 1: the worker's first 6 steps answered, the other 10 trajectories failed; steps 2 and 3: all 16
    assert [(e["step"], e["failed"], e["of"], e["where"]) for e in events] == \
        [(1, 10, 16, line), (2, 16, 16, line), (3, 16, 16, line)]
    for e in events:
        assert (f"qgrpo: warning: step {e['step']}: environment flaky.py:Flaky failed on {e['failed']} of 16 "
                f"trajectories (ConnectionError: the game server dropped the connection at {line})") in err
    assert ("environment flaky.py:Flaky failed on every trajectory for 2 steps in a row (ConnectionError: the game "
            f"server dropped the connection at {line}); tracebacks in {run_dir / ERROR_LOG}") in err
    assert "the run stopped at step 3" in err
    log = (run_dir / ERROR_LOG).read_text()
    assert log.count("Traceback (most recent call last)") == 1 and f'File "{tmp_path / "flaky.py"}", line 14' in log
    steps = [r for r in rows if "episode/finish_env_error" in r]
    assert [r["episode/finish_env_error"] for r in steps] == [10 / 16, 1.0, 1.0]
