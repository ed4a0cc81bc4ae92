"""Multi-turn rollouts in a real run: the guessing-game example (examples/guess_number) trains two steps through Ray
(rollout actors with their environment workers, reward workers, reference, DeepSpeed learner). What each trajectory
holds reaches the rollouts Parquet and the step's metrics, and the learner trains on the model's tokens only."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]
GUESS = ROOT / "examples" / "guess_number" / "config.toml"


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
def test_the_guessing_game_trains_two_steps(ray_session, tiny_model_path, tmp_path, monkeypatch):
    from qgrpo.cluster.cli.app import main

    monkeypatch.chdir(tmp_path)  # the config's paths are read against its own folder
    cache = Path(tiny_model_path).parents[1]
    out = tmp_path / "runs"
    rc = main(["train", str(GUESS), "--set", "run.steps=2", "--set", f"run.output_dir='{out}'",
               "--set", f"model.cache_dir='{cache}'", "--set", "run.progress=false",
               "--set", "rollout.prompts_per_step=4", "--set", "rollout.group_size=4"])
    assert rc == 0
    (run_dir,) = out.iterdir()
    steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert 1.0 <= m["episode/turns"] <= 5.0 and m["episode/env_tokens"] > 0
        finishes = sum(m[f"episode/finish_{r}"] for r in ("stop", "length", "max_turns", "context", "env_error"))
        assert finishes == pytest.approx(1.0) and m["episode/finish_env_error"] == 0.0
        assert m["reward/errors"] == 0 and "reward/environment" in m and m["time/env"] >= 0
        # the learner's tokens are the model's, as rollout/completion_len counts them: environment turns left out
        assert m["loss/tokens"] == pytest.approx(m["rollout/completion_len"] * 16)
    rows = pq.read_table(run_dir / "rollouts").to_pylist()
    assert len(rows) == 2 * 4 * 4
    for r in rows:
        turns = json.loads(r["turns"])
        assert turns[0]["role"] == "assistant" and r["finish_reason"] in ("stop", "length", "max_turns", "context")
        model = sum(t["end"] - t["start"] for t in turns if t["role"] == "assistant")
        assert r["num_tokens"] == model  # the model's tokens only
        assert r["completion"] == next(t["content"] for t in reversed(turns) if t["role"] == "assistant")
        if r["finish_reason"] in ("stop", "length"):  # found: the last guess is the hidden digit (a cut turn too)
            assert r["reward_environment"] > 0
    assert (run_dir / "checkpoints" / "step_000002" / "model.safetensors").is_file()
    # The held-out games are played too (greedy), each trajectory's turns kept with its score
    evals = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if m.get("event") == "eval"]
    assert [e["step"] for e in evals] == [0, 2]
    answers = [json.loads(line) for line in (run_dir / "evals" / "step_000002.jsonl").read_text().splitlines()]
    assert len(answers) == 20 and all(a["turns"][0]["role"] == "assistant" for a in answers)
    assert evals[1]["accuracy"] == sum(a["correct"] for a in answers) / 20
    from qgrpo.cluster.report.build import report as build_report

    report = build_report(run_dir)
    assert (report / "episodes.png").stat().st_size > 0 and "episodes.png" in (report / "summary.md").read_text()
