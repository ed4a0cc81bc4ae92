"""Ctrl-C and SIGTERM stop a run, on real Ray and DeepSpeed with the tiny model (cluster/run/stopping.py): the first
signal stops at the next step boundary, checkpointed where a checkpoint is exact, Ray and its processes gone, with one
line naming the step, the latest checkpoint and the resume command, and exit status 130 (SIGINT) or 143 (SIGTERM); a
second signal exits at once. One run goes through all of it, each stop resumed with `qgrpo train --resume RUN_DIR`:

  1. SIGINT to the whole process group (what a terminal's Ctrl-C does) during step 2, a multiple of algo.update_every
     (2) but not of run.save_every (4): the stop itself writes checkpoints/step_000002;
  2. resumed, SIGTERM to the qgrpo process alone (what `timeout` sends) during step 5, after step 4's checkpoint: a
     checkpoint at step 5 would not be exact (the generators hold step 4's weights), so step_000004 is named;
  3. resumed, two SIGINTs in quick succession: the run exits at once, no Ray process of it left;
  4. resumed again, it runs to the end: every step logged and sampled exactly once.

Each step of the stopped runs sleeps 1 s first (the driver.slow fault), so that a signal lands inside a known step;
the assertions hold whichever step it lands in."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest

from qgrpo.cluster.rundir.checkpoint import complete_checkpoints

pytestmark = pytest.mark.ray  # runs `qgrpo train` in subprocesses: left out of `make test-fast`

ROOT = Path(__file__).resolve().parents[1]
STEPS, PROMPTS, GROUP = 8, 8, 8
# the resume command starts as qgrpo was started (core/invocation.py): qgrpo, .venv/bin/qgrpo, python -m qgrpo
STOP_LINE = re.compile(r"^qgrpo: stopped at step (\d+) of (\d+) \((SIG\w+)\); checkpoint (\S+) is the latest; resume "
                       r"with: (?:\S+ -m )?\S*qgrpo train --resume (\S+)$", re.M)
RAY_NOISE = ("Traceback", "logging.cc", "SIGTERM received", "KeyboardInterrupt", "*** ")


def _records(run_dir: Path | None) -> list[dict]:
    f = run_dir / "metrics.jsonl" if run_dir else None
    out = []
    for line in f.read_text().splitlines() if f and f.is_file() else ():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return out


def _steps(run_dir: Path) -> list[int]:
    return _steps_in(_records(run_dir))


def _steps_in(records: list[dict]) -> list[int]:
    return [m["step"] for m in records if "reward/mean" in m]


def _since(records: list[dict], run: "Run") -> list[dict]:
    """The records since `run` started or resumed the run (before that: what a stopped one wrote)."""
    starts = [i for i, m in enumerate(records) if m.get("event") in ("start", "resume") and m["time"] >= run.wall]
    return records[starts[-1]:] if starts else []


class Run:
    """One `qgrpo train` process in a process group of its own (Ray's processes join it), its stderr in a file."""

    def __init__(self, tmp: Path, args: list[str], slow: bool, name: str):
        self.err_path = tmp / f"{name}.stderr"
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "QGRPO_FAULTS": "driver.slow@1+" if slow else "",
               "QGRPO_FAULTS_STATE": str(tmp)}
        env.pop("RAY_ADDRESS", None)
        with self.err_path.open("w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "qgrpo", "train", *args], cwd=ROOT, env=env,
                                         start_new_session=True, stdout=subprocess.DEVNULL, stderr=err)
        self.started, self.wall = time.monotonic(), time.time()

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    def wait_for(self, what: str, until, run_dir_of, timeout: float = 300) -> Path:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run_dir = run_dir_of()
            if run_dir is not None and until(_records(run_dir)):
                return run_dir
            assert self.proc.poll() is None, f"the run ended before {what}:\n{self.stderr[-3000:]}"
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}:\n{self.stderr[-3000:]}")

    def processes(self) -> list[psutil.Process]:
        """Everything under the qgrpo process now: Ray's GCS, raylet, agents and the actors' workers."""
        return psutil.Process(self.proc.pid).children(recursive=True)

    def finish(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.kill_group()

    def kill_group(self) -> None:
        """Whatever happened, nothing of this run's process group is left behind."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def _all_gone(processes: list[psutil.Process], timeout: float = 15) -> list[str]:
    """The processes still alive (zombies count as gone) after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return [" ".join(p.cmdline())[:80] for p in alive]
        time.sleep(0.2)


def _clean_stderr(err: str) -> None:
    for noise in RAY_NOISE:
        assert noise not in err, f"{noise!r} in stderr:\n{err[-3000:]}"


def _stopped(run: Run, run_dir: Path, processes: list[psutil.Process], signame: str, status: int) -> int:
    """The checks of a run a first signal stopped; returns the step it stopped at."""
    assert run.finish() == status, run.stderr[-3000:]
    err = run.stderr
    _clean_stderr(err)
    assert err.count(f"qgrpo: {signame}: stopping after the step in progress") == 1, err[-3000:]
    (line,) = STOP_LINE.findall(err)
    step, of, name, ckpt, resume = line
    assert (int(of), name, resume) == (STEPS, signame, str(run_dir)), line
    assert err.rstrip().endswith(resume), "the stop line is the last line"
    step = int(step)
    assert _steps(run_dir)[-1] == step  # the step in progress finished and was logged
    latest_step, latest = complete_checkpoints(run_dir)[-1]
    assert Path(ckpt) == latest and latest_step == step - step % 2, (line, latest_step)  # update_every = 2
    assert (latest / "model.safetensors").is_file()
    stopped = [m for m in _records(run_dir) if m.get("event") == "stopped"]
    assert stopped[-1]["step"] == step and stopped[-1]["signal"] == signame
    assert _all_gone(processes) == []
    return step


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
def test_signals_stop_a_run_that_resumes_to_the_end(tiny_model_path, tmp_path):
    out = tmp_path / "runs"
    sets = [f"model.path='{tiny_model_path}'", f"run.output_dir='{out}'", f"run.steps={STEPS}", "run.progress=false",
            "run.eval=false", "run.tensorboard=false", f"rollout.prompts_per_step={PROMPTS}",
            f"rollout.group_size={GROUP}", "run.rollouts_flush_every=1", "algo.update_every=2", "run.save_every=4"]
    run_dir_of = lambda: next((p for p in out.iterdir() if p.is_dir()), None) if out.is_dir() else None  # noqa: E731
    timings = {}

    # 1. Ctrl-C: SIGINT to the process group while step 2 runs; the stop writes step 2's checkpoint.
    run = Run(tmp_path, ["configs/tiny.toml", *[a for s in sets for a in ("--set", s)]], True, "sigint")
    try:
        run_dir = run.wait_for("step 1", lambda r: _steps_in(_since(r, run)), run_dir_of)
        processes = run.processes()
        t = time.monotonic()
        os.killpg(run.proc.pid, signal.SIGINT)
        step = _stopped(run, run_dir, processes, "SIGINT", 130)
        timings["SIGINT"] = (time.monotonic() - run.started, time.monotonic() - t)
    finally:
        run.kill_group()
    if step % 2 == 0 and step % 4:  # the usual case, step 2: nothing but the stop wrote it
        assert any(m.get("event") == "checkpoint" and m["step"] == step for m in _records(run_dir))

    # 2. SIGTERM to the qgrpo process alone, after step 4's checkpoint: stopped at step 5, step 4 is the latest.
    run = Run(tmp_path, ["--resume", str(run_dir)], True, "sigterm")
    try:
        run.wait_for("step 4's checkpoint", lambda r: any(m.get("event") == "checkpoint" and m["step"] == 4
                                                          for m in _since(r, run)), run_dir_of)
        processes = run.processes()
        t = time.monotonic()
        os.kill(run.proc.pid, signal.SIGTERM)
        step = _stopped(run, run_dir, processes, "SIGTERM", 143)
        timings["SIGTERM"] = (time.monotonic() - run.started, time.monotonic() - t)
    finally:
        run.kill_group()
    assert "resuming from" in run.stderr

    # 3. Two signals: the run exits at once, with the second's status and nothing of Ray left.
    run = Run(tmp_path, ["--resume", str(run_dir)], True, "twice")
    try:
        run.wait_for("a step after the resume", lambda r: _steps_in(_since(r, run)), run_dir_of)
        processes = run.processes()
        t = time.monotonic()
        os.killpg(run.proc.pid, signal.SIGINT)
        time.sleep(0.1)
        os.killpg(run.proc.pid, signal.SIGINT)
        assert run.proc.wait(timeout=10) == 130, run.stderr[-3000:]
        timings["twice"] = (time.monotonic() - run.started, time.monotonic() - t)
        err = run.stderr
        _clean_stderr(err)
        assert "qgrpo: SIGINT again: exiting at once" in err and not STOP_LINE.search(err), err[-3000:]
        assert _all_gone(processes) == []
    finally:
        run.kill_group()

    # 4. Resumed once more, the run finishes: each step once in metrics.jsonl and in the rollouts.
    run = Run(tmp_path, ["--resume", str(run_dir)], False, "end")
    t = time.monotonic()
    assert run.finish() == 0, run.stderr[-3000:]
    timings["end"] = (time.monotonic() - t, 0.0)
    _clean_stderr(run.stderr)
    assert _steps(run_dir) == list(range(1, STEPS + 1))
    assert Counter(pq.read_table(run_dir / "rollouts").column("step").to_pylist()) == {
        s: PROMPTS * GROUP for s in range(1, STEPS + 1)}
    assert complete_checkpoints(run_dir)[-1][0] == STEPS
    print("\nseconds (whole run, from the signal to the exit): "
          + "; ".join(f"{k} {a:.1f}, {b:.1f}" for k, (a, b) in timings.items()))


def test_the_first_signal_only_asks_and_the_handlers_are_put_back():
    """In this process: a first SIGTERM sets the flag (the handler returns, so a wait in Ray would go on), the
    handlers before `handling()` are back after it, and the stop line names the step, checkpoint and command."""
    from qgrpo.cluster.run.stopping import StopRequest, stop_line

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    stop = StopRequest()
    with stop.handling():
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs between bytecodes
        assert stop.requested and (stop.name, stop.status) == ("SIGTERM", 143)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    assert STOP_LINE.fullmatch(stop_line(stop, 5, 8, "runs/r", "runs/r/checkpoints/step_000004")).groups() == (
        "5", "8", "SIGTERM", "runs/r/checkpoints/step_000004", "runs/r")
    assert "nothing to resume" in stop_line(stop, 0, 8, "runs/r", None)
