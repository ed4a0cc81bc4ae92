"""What the terminal says about a run, each tested on its own without Ray: the second signal's exit line with and
without a checkpoint (cluster/run/stopping.py), lines written while the progress bar is up (cluster/rundir/runlog.py),
and how a run got its rollouts and how stale a stream's were, in the end summary (cluster/cli/summary.py) and the
report (cluster/report), from a metrics.jsonl written here."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

from qgrpo.cluster.report.run_data import RunData, load_metrics, stream_stats
from qgrpo.cluster.run.stopping import StopRequest
from qgrpo.learner.objective.staleness import rollout_mode

# ---------------------------------------------------------------------------------------------------- second signal


def _checkpoint(run: Path, step: int) -> Path:
    folder = run / "checkpoints" / f"step_{step:06d}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text("{}")
    return folder


def test_what_a_second_signal_says_is_left(tmp_path):
    stop = StopRequest()
    assert "was not created yet" in stop.left_behind()
    run = tmp_path / "run"
    run.mkdir()
    stop.run_root = run
    said = stop.left_behind()
    assert "no checkpoint was written yet" in said and "keeps its last" not in said
    (run / "checkpoints" / "step_000002").mkdir(parents=True)  # a partial one (no trainer_state.json) is not counted
    assert "no checkpoint was written yet" in stop.left_behind()
    _checkpoint(run, 1)
    last = _checkpoint(run, 3)
    said = stop.left_behind()
    assert f"keeps its last complete checkpoint, {last}" in said and f"train --resume {run}" in said


def _signalled_twice(tmp_path: Path, root: str) -> subprocess.CompletedProcess:
    """A process that installs the handlers, sets run_root and receives SIGTERM twice: its stderr and status."""
    code = textwrap.dedent(f"""
        import os, signal, time
        from qgrpo.cluster.run.stopping import StopRequest
        stop = StopRequest()
        stop.install()
        stop.run_root = {root!r} or None
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)


def test_a_second_signal_before_the_first_checkpoint_says_there_is_none(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    out = _signalled_twice(tmp_path, str(run))
    assert out.returncode == 128 + signal.SIGTERM, out.stderr
    assert "SIGTERM again: exiting at once (no checkpoint was written yet" in out.stderr, out.stderr
    assert "keeps its last complete checkpoint" not in out.stderr
    ckpt = _checkpoint(run, 4)
    out = _signalled_twice(tmp_path, str(run))
    assert f"keeps its last complete checkpoint, {ckpt}; resume with: " in out.stderr, out.stderr
    assert "was not created yet" in _signalled_twice(tmp_path, "").stderr


# ---------------------------------------------------------------------------------------------------- progress bar


def test_lines_written_while_the_bar_is_up_start_on_their_own_line(tmp_path):
    """A plain print to stderr, a Python warning and a logged warning: each starts after the bar was cleared (a
    carriage return and blanks) and the bar is drawn again after it; sys.stderr is put back at close."""
    code = textwrap.dedent(f"""
        import sys, warnings
        from pathlib import Path
        from qgrpo.cluster.rundir.runlog import RunLog
        before = sys.stderr
        log = RunLog(Path({str(tmp_path)!r}), 3, 0, True, False, terminal=True)  # stderr is a pipe here
        log.progress({{"reward/mean": 0.5, "perf/gen_tokens_per_s": 10.0}})
        print("PLAIN LINE", file=sys.stderr)
        warnings.warn("PY WARNING")
        log.write({{"event": "warning", "step": 1, "message": "warning: LOGGED"}})
        log.close()
        assert sys.stderr is before
    """)
    env = {**os.environ, "PYTHONWARNINGS": "always"}  # `make test` exports PYTHONWARNINGS=ignore
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60, env=env)  # bytes: keep \r
    err = out.stderr.decode()
    assert out.returncode == 0, err
    for text in ("PLAIN LINE", "UserWarning: PY WARNING", "qgrpo: warning: step 1: LOGGED"):
        i = err.index(text)
        start = err.rfind("\n", 0, i) + 1
        before = err[start:i]
        assert before == "" or before.split("\r")[-1].strip() == "" or before.split("\r")[-1].startswith("<string>"), \
            (text, repr(before))
        after = err[i:].split("\n", 1)[1]
        assert after.lstrip("\r").startswith("grpo:"), (text, repr(after[:80]))  # the bar drawn again


# ---------------------------------------------------------------------------------------------------- streaming


def _metrics(run: Path, streamed: bool) -> None:
    lines = [{"time": 1.0, "event": "start", "step": 0}]
    for step in (1, 2, 3):
        m = {"time": 1.0 + step, "step": step, "reward/mean": 0.1 * step}
        if streamed:
            m.update({"stream/wait_s": [4.0, 1.0, 1.0][step - 1], "stream/staleness_mean": [0.0, 0.5, 1.0][step - 1],
                      "stream/staleness_max": [0, 1, 1][step - 1], "stream/tokens_age0": [100, 60, 0][step - 1],
                      "stream/tokens_age1": [0, 40, 100][step - 1], "stream/mixed_completions": [0, 2, 1][step - 1]})
        lines.append(m)
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_stream_stats_sum_up_the_stream_metrics(tmp_path):
    _metrics(tmp_path, streamed=True)
    data = RunData()
    load_metrics(tmp_path / "metrics.jsonl", data)
    s = stream_stats(data.steps)
    assert (s.steps, s.staleness_mean, s.staleness_max) == (3, 0.5, 1.0)
    assert (s.tokens_by_age, s.mixed_completions, s.wait_mean_s, s.wait_total_s) == ({0: 160, 1: 140}, 3, 2.0, 6.0)
    words = s.words()
    assert "staleness mean 0.50, max 1 versions over 3 steps" in words
    assert "tokens 160 (53%) at age 0, 140 (47%) at age 1" in words
    assert "waited 2.00 s a step (6.0 s in all)" in words
    _metrics(tmp_path, streamed=False)
    data = RunData()
    load_metrics(tmp_path / "metrics.jsonl", data)
    assert stream_stats(data.steps) is None


def test_rollout_mode_words():
    assert rollout_mode(0, False, 1).startswith("synchronous") and "1 rollout actor" in rollout_mode(0, False, 1)
    assert "one step off" in rollout_mode(0, True, 2) and "2 rollout actors" in rollout_mode(0, True, 2)
    assert "algo.max_staleness = 3: rollouts at most 3 syncs stale" in rollout_mode(3, False, 2)
    assert rollout_mode(None, None, None).startswith("synchronous")


def _cfg(max_staleness: int, overlap: bool, actors: int):
    return SimpleNamespace(algo=SimpleNamespace(max_staleness=max_staleness, overlap=overlap),
                           rollout=SimpleNamespace(num_actors=actors))


def test_the_end_summary_says_the_run_streamed_and_how_stale(tmp_path):
    from qgrpo.cluster.cli.summary import summary

    _metrics(tmp_path, streamed=True)
    result = {"last": {"step": 3, "reward/mean": 0.3}, "evals": {}, "checkpoint": str(tmp_path / "ckpt")}
    text = summary(result, tmp_path, 60.0, _cfg(1, False, 2), tmp_path)
    assert "rollouts:         a stream (algo.max_staleness = 1: rollouts at most 1 sync stale), 2 rollout actors" \
        in text
    assert "streamed:         staleness mean 0.50, max 1" in text
    assert f"report {tmp_path}" in text and "tensorboard" not in text  # no tensorboard folder in this run
    (tmp_path / "tensorboard").mkdir()
    assert f"--logdir {tmp_path}/tensorboard" in summary(result, tmp_path, 60.0, _cfg(1, False, 2), tmp_path)
    _metrics(tmp_path, streamed=False)
    text = summary(result, tmp_path, 60.0, _cfg(0, False, 1), tmp_path)
    assert "rollouts:         synchronous" in text and "streamed:" not in text


def test_the_report_lists_the_stream_settings_and_staleness(tmp_path):
    from qgrpo.cluster.report.build import report

    _metrics(tmp_path, streamed=True)
    (tmp_path / "config.toml").write_text('[run]\nname = "s"\nsteps = 3\n[rollout]\nnum_actors = 2\n'
                                          '[algo]\nmax_staleness = 1\n')
    md = (report(tmp_path) / "summary.md").read_text()
    assert "| rollout.num_actors | 2 |" in md and "| algo.max_staleness | 1 |" in md
    assert "## Rollouts" in md and "- Mode: a stream (algo.max_staleness = 1" in md
    assert "- Streamed: staleness mean 0.50, max 1 versions over 3 steps; tokens 160 (53%) at age 0" in md
