"""Agent episodes survive the death of each process behind them, on real Ray with the tiny model, the processes
killed with SIGKILL mid-episode by core/faults.py's drills:

- a rollout actor dies inside an agent's call: the pool counts it and replaces it, the endpoint sends the call again
  to the replacement, and the episode goes on (nothing failed, nothing played again);
- the agent runner dies with a batch's episodes in flight: a new runner plays them again from their start;
- the endpoint actor dies with calls in flight: a new endpoint starts (RUN_DIR/endpoint.json rewritten) and the
  episodes are played again from their start, in new sessions;
- an endpoint that dies at every start ends the run at the step, naming faults.max_replacements, with how to resume
  and no traceback; the resumed run trains each step once.

The agent path has no pump of its own; no raw rollout-actor handle is used outside the pool (tests/test_layers.py).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from tests.test_agents import AGENTS, ROOT, _config


@pytest.fixture(scope="module")
def agents_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("agents") / "my_agents.py"
    path.write_text(AGENTS)
    return path


def _train(cfg: Path, out: Path, faults: str, state: Path, *sets: str, resume: Path | None = None):
    from qgrpo.core.invocation import qgrpo_command

    args = ["train", str(cfg)] + (["--resume", str(resume)] if resume else [])
    cmd = qgrpo_command(*args, "--set", f"run.output_dir={out}", "--set", "run.progress=false",
                        *[x for s in sets for x in ("--set", s)]).split()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "QGRPO_FAULTS": faults,
           "QGRPO_FAULTS_STATE": str(state)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)


def _records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
@pytest.mark.ray
def test_each_process_behind_an_agent_dies_mid_episode_and_the_run_loses_nothing(tmp_path, agents_file):
    """Step 2: the rollout actor dies inside a call; step 3: the agent runner dies; step 4: the endpoint dies."""
    import pyarrow.parquet as pq

    cfg = _config(tmp_path, agents_file, "good", steps=4)
    state = tmp_path / "faults"
    state.mkdir()
    proc = _train(cfg, tmp_path / "runs", "rollout.kill@2,agent_runner.kill@3,endpoint.kill@4", state)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    run = next((tmp_path / "runs").iterdir())
    records = _records(run)
    steps = {m["step"]: m for m in records if "loss/total" in m}
    assert sorted(steps) == [1, 2, 3, 4]
    assert all(m["agent/failed_episodes"] == 0 for m in steps.values()), steps
    events = [e for e in records if "event" in e]

    def at(name: str) -> list[dict]:
        return [e for e in events if e["event"] == name]

    # the rollout actor: counted and replaced, the call sent again to the replacement; no episode played again
    (failed,) = at("rollout_actor_failed")
    assert failed["step"] == 2 and failed["stage"] == "an agent's call to the endpoint"
    assert "ActorDiedError" in failed["cause"] or "died" in failed["cause"]
    (replaced,) = at("rollout_actor_replaced")
    assert replaced["replacement"].endswith(".1") and replaced["weights_version"] == 1
    assert steps[2]["agent/replayed_episodes"] == 0 and steps[2]["agent/calls"] >= 4
    # the runner: a new one, the batch's episodes played again
    assert [e["step"] for e in at("runner_failed")] == [3] and len(at("agent_runner_restarted")) == 1
    assert steps[3]["agent/replayed_episodes"] >= 1
    # the endpoint: a new one on a new port, written to endpoint.json, the episodes in flight played again
    assert [e["step"] for e in at("endpoint_failed")] == [4]
    (restarted,) = at("endpoint_restarted")
    (first,) = at("endpoint")
    assert restarted["address"] != first["address"]
    assert json.loads((run / "endpoint.json").read_text())["address"] == restarted["address"]
    assert steps[4]["agent/replayed_episodes"] >= 1
    # every step trained on each of its rows' episodes exactly once, none failed
    rows = pq.read_table(run / "rollouts").to_pylist()
    per_step = {s: Counter(r["prompt_id"] for r in rows if r["step"] == s) for s in steps}
    assert all(len(c) == 2 and set(c.values()) == {2} for c in per_step.values()), per_step
    assert not [r for r in rows if r["finish_reason"] == "env_error"]


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
@pytest.mark.ray
def test_an_endpoint_that_keeps_dying_stops_the_run_with_how_to_resume(tmp_path, agents_file):
    cfg = _config(tmp_path, agents_file, "good", steps=3)
    state = tmp_path / "faults"
    state.mkdir()
    out = tmp_path / "runs"
    proc = _train(cfg, out, "endpoint.kill@2+", state, "faults.max_replacements=1", "run.save_every=1")
    assert proc.returncode == 1, proc.stderr[-4000:]
    err = proc.stderr
    assert "the endpoint actor failed 2 times in a row (faults.max_replacements = 1)" in err
    assert "--resume" in err and "step_000001" in err and "Traceback" not in err
    run = next(out.iterdir())
    assert [m["step"] for m in _records(run) if "loss/total" in m] == [1]
    # resumed without the fault: steps 2 and 3 trained once each, step 1 not again
    resume = re.search(r"--resume (\S+)", err).group(1)
    again = _train(cfg, out, "", state, "run.save_every=1", resume=Path(resume))
    assert again.returncode == 0, again.stderr[-4000:]
    assert [m["step"] for m in _records(run) if "loss/total" in m] == [1, 2, 3]


def test_the_agent_path_has_no_pump_of_its_own():
    """The agent source is dispatched to by the stream's pump (no thread, pump or take of its own); that nothing but
    the pool and its link reaches a rollout actor is tests/test_layers.py's back-door check."""
    agents = (ROOT / "cluster" / "run" / "agents.py").read_text()
    assert "threading" not in agents and "def _pump" not in agents and "def take" not in agents
    driver = (ROOT / "cluster" / "run" / "driver.py").read_text()
    assert "is_agent(cfg.environment.name)" not in driver and "AgentEpisodes" not in driver
