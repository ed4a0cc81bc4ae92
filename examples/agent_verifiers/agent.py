"""guess_game.py's verifiers v1 environment as a qgrpo agent program: each episode is one game played by verifiers'
own stack (run_episode.py, a subprocess of `.venv-verifiers/bin/python`: verifiers 0.4.0 pins openai<3, which the
main venv does not hold), whose TrainClient renders each turn to token ids itself and posts them to the endpoint's
`POST /inference/v1/generate` at the episode's per-session base URL. The game's reward is the episode's reward.

After the game the agent reads the endpoint's record of its session (`GET {address}/v1/sessions/{SID}`) and compares
it with verifiers' trace, turn by turn: each turn's prompt ids and completion ids must be a recorded call's
prompt_token_ids and token_ids, and its log-probs the call's within LOGPROB_TOL; every recorded call must be a turn.
Any disagreement raises AgreementError (naming the turn and the first differing token), so the run counts the episode
as failed (agent/failed_episodes) and never trains tokens that verifiers did not see. `compare()` is the check.

    import asyncio, types
    client = types.SimpleNamespace(base_url="http://127.0.0.1:8000/sessions/s1/v1", api_key="s1",
                                   model="qgrpo-policy", session_id="s1")
    asyncio.run(verifiers_agent({"secret": 7, "high": 10, "max_guesses": 3}, client))
"""
from __future__ import annotations

import asyncio
import json
import os
from functools import lru_cache
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]  # the repository: examples/agent_verifiers/agent.py
VF_PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"
RUN_EPISODE = HERE / "run_episode.py"

MODEL = "builtin:smollm2-135m-instruct"  # config.toml's model.path: the tokenizer verifiers renders with
TOKENIZER_VAR = "QGRPO_VF_TOKENIZER"  # a tokenizer folder that overrides MODEL's
TURN_TOKENS = 16  # max_tokens of one turn (config.toml: environment.turn_tokens)
TEMPERATURE = 1.0  # config.toml: rollout.temperature (run_episode.py always sends one; held-out sessions are greedy)
LOGPROB_TOL = 1e-4
CALL_TIMEOUT_S = 240.0  # read timeout of one of verifiers' calls (the episode's deadline is environment's)


class AgreementError(RuntimeError):
    """verifiers' trace and the endpoint's record of the session differ."""


@lru_cache(maxsize=1)
def tokenizer_folder() -> str:
    """The served model's tokenizer folder. verifiers' TrainClient tokenizes the prompts itself, so it needs the
    tokenizer of the model behind the endpoint, which an agent is not told (only a base URL and a model *name*). This
    example is about verifiers *through qgrpo*, and the agent runner has qgrpo importable, so it resolves config.toml's
    model the way qgrpo does (a builtin is a local folder, no hub); a run of another model sets QGRPO_VF_TOKENIZER
    (a local Ray cluster's workers inherit the environment of `qgrpo train`)."""
    folder = os.environ.get(TOKENIZER_VAR)
    if folder:
        return folder
    from qgrpo.rollout.modeling.models import resolve_model_path

    return str(resolve_model_path(MODEL, ""))


def game_of(row: dict) -> dict:
    """What guess_game.make_task reads of a row: the secret (the row's "secret", else its answer), the range, the
    number of guesses."""
    secret = row["secret"] if row.get("secret") is not None else row["answer"]
    game = {"secret": int(secret)}
    for key in ("high", "max_guesses"):
        if row.get(key) is not None:
            game[key] = int(row[key])
    return game


def session_address(base_url: str, session_id: str) -> str:
    """The endpoint's address: the per-session base URL less /sessions/SID/v1 (or a plain base URL less /v1)."""
    base = base_url.rstrip("/")
    for tail in (f"/sessions/{session_id}/v1", "/v1"):
        if base.endswith(tail):
            return base[:-len(tail)]
    raise ValueError(f"{base_url!r} is not an endpoint base URL (http://HOST:PORT/sessions/SID/v1)")


# ---------------------------------------------------------------------------------------------------------------------
# The comparison


def _first_difference(a: list[int], b: list[int]) -> int:
    """The first index where `a` and `b` differ (the shorter's length when one is a prefix of the other; the
    common length when they are equal)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _token_mismatch(k: int, prompt: list[int], completion: list[int], calls: list[dict]) -> dict:
    """Turn `k` matched no call: its first differing token against the call it comes closest to."""
    if not calls:
        return {"turn": k, "kind": "no call", "call": None, "where": None, "index": None, "verifiers": None,
                "endpoint": None}
    ours = prompt + completion
    best, at = None, -1
    for c in calls:
        i = _first_difference(ours, list(c["prompt_token_ids"]) + list(c["token_ids"]))
        if i > at:
            best, at = c, i
    theirs = list(best["prompt_token_ids"]) + list(best["token_ids"])
    if ours == theirs:  # the same tokens, split elsewhere between prompt and completion
        at = min(len(prompt), len(best["prompt_token_ids"]))
        return {"turn": k, "kind": "split", "call": best["id"], "where": "prompt", "index": at,
                "verifiers": len(prompt), "endpoint": len(best["prompt_token_ids"])}
    where, index = ("prompt", at) if at < len(prompt) else ("completion", at - len(prompt))
    return {"turn": k, "kind": "token", "call": best["id"], "where": where, "index": index,
            "verifiers": ours[at] if at < len(ours) else None, "endpoint": theirs[at] if at < len(theirs) else None}


def _logprob_mismatch(k: int, logprobs: list[float], call: dict, tol: float) -> dict | None:
    theirs = list(call["logprobs"])
    if len(logprobs) != len(theirs):
        return {"turn": k, "kind": "logprob count", "call": call["id"], "where": "completion", "index": None,
                "verifiers": len(logprobs), "endpoint": len(theirs)}
    for i, (a, b) in enumerate(zip(logprobs, theirs)):
        if not abs(float(a) - float(b)) <= tol:  # NaN disagrees too
            return {"turn": k, "kind": "logprob", "call": call["id"], "where": "completion", "index": i,
                    "verifiers": a, "endpoint": b}
    return None


def compare(trace_turns: list[dict], record: dict | list[dict], tol: float = LOGPROB_TOL) -> dict:
    """verifiers' turns (run_episode.py's "turns": prompt_ids, completion_ids, logprobs) against the endpoint's record
    of the session (GET /v1/sessions/SID: {"calls": [...]}, or the calls themselves). Each turn must be a distinct
    recorded call with the same prompt_token_ids and token_ids, and log-probs within `tol`.

    Returns {"turns", "agreeing" (turns that agree), "calls" (recorded), "unmatched_calls" (recorded calls that are
    no turn), "first_mismatch" (None, or {"turn", "kind": "token" | "split" | "no call" | "logprob" | "logprob count",
    "call", "where": "prompt" | "completion", "index", "verifiers", "endpoint"}), "ok" (some turns, all agreeing, no
    call left over)}."""
    calls = list(record["calls"] if isinstance(record, dict) else record)
    free = list(range(len(calls)))
    agreeing, first = 0, None
    for k, turn in enumerate(trace_turns):
        prompt, completion = list(turn["prompt_ids"]), list(turn["completion_ids"])
        hit = next((j for j in free if list(calls[j]["prompt_token_ids"]) == prompt
                    and list(calls[j]["token_ids"]) == completion), None)
        if hit is None:
            why = _token_mismatch(k, prompt, completion, [calls[j] for j in free] or calls)
        else:
            free.remove(hit)
            why = _logprob_mismatch(k, list(turn["logprobs"]), calls[hit], tol)
        if why is None:
            agreeing += 1
        elif first is None:
            first = why
    turns = len(trace_turns)
    return {"turns": turns, "agreeing": agreeing, "calls": len(calls), "unmatched_calls": len(free),
            "first_mismatch": first, "ok": turns > 0 and agreeing == turns and not free}


def describe(result: dict) -> str:
    """compare()'s result in words, for an error message."""
    head = (f"{result['agreeing']} of {result['turns']} verifiers turns agree with the endpoint's "
            f"{result['calls']} recorded calls")
    m = result["first_mismatch"]
    if m is None:
        if result["turns"] == 0:
            return head + " (verifiers recorded no turn)"
        return head + f"; {result['unmatched_calls']} recorded calls are no verifiers turn"
    if m["kind"] == "no call":
        return head + f"; turn {m['turn']}: the endpoint recorded no call"
    if m["kind"] == "split":
        return head + (f"; turn {m['turn']} (call {m['call']}): the same tokens, but verifiers' prompt is "
                       f"{m['verifiers']} tokens and the endpoint's {m['endpoint']}")
    if m["kind"] == "logprob count":
        return head + (f"; turn {m['turn']} (call {m['call']}): {m['verifiers']} log-probs in verifiers' trace, "
                       f"{m['endpoint']} recorded")
    what = "log-prob" if m["kind"] == "logprob" else "token"
    return head + (f"; turn {m['turn']}: first differing {what} at {m['where']} index {m['index']} (closest call "
                   f"{m['call']}): verifiers {m['verifiers']}, endpoint {m['endpoint']}")


# ---------------------------------------------------------------------------------------------------------------------
# The episode


def verifiers_python() -> Path:
    if not VF_PYTHON.exists():
        raise FileNotFoundError(f"{VF_PYTHON} is missing: make install creates .venv-verifiers (verifiers 0.4.0 and "
                                "renderers, which pin openai<3)")
    return VF_PYTHON


async def _play(game: dict, client, max_tokens: int, temperature: float) -> dict:
    """One game through run_episode.py: its JSON result (episodes[0] has "reward", "errors", "turns")."""
    cmd = [str(verifiers_python()), str(RUN_EPISODE), "--base-url", client.base_url, "--model", client.model,
           "--tokenizer", tokenizer_folder(), "--row", json.dumps(game), "--n", "1", "--api-key", client.api_key,
           "--max-tokens", str(max_tokens), "--temperature", str(temperature), "--timeout", str(CALL_TIMEOUT_S)]
    # The verifiers venv is its own: nothing of the main venv's (or Ray's) import path may leak into it.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                stdin=asyncio.subprocess.DEVNULL, env=env, cwd=str(HERE))
    try:
        out, err = await proc.communicate()
    finally:  # the episode's deadline (or the run's end) cancelled it: the game goes with it
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    lines = [ln for ln in out.decode(errors="replace").splitlines() if ln.startswith("{")]
    tail = err.decode(errors="replace").strip()[-1500:]
    if not lines:
        raise RuntimeError(f"run_episode.py printed no result (exit {proc.returncode}): {tail}")
    result = json.loads(lines[-1])
    episode = result["episodes"][0]
    if episode["errors"] or not episode["ok"] or proc.returncode:
        raise RuntimeError(f"the verifiers episode failed (exit {proc.returncode}): "
                           f"{'; '.join(episode['errors']) or tail}")
    return episode


async def _record(client) -> dict:
    import httpx

    address = session_address(client.base_url, client.session_id)
    # The run's endpoint asks every route but /health for the run's key: the session's record too.
    key = getattr(client, "api_key", None)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(timeout=60, headers=headers) as http:
        r = await http.get(f"{address}/v1/sessions/{client.session_id}")
    if r.status_code != 200:
        raise RuntimeError(f"GET {address}/v1/sessions/{client.session_id}: {r.status_code} {r.text[:300]}")
    return r.json()


async def verifiers_agent(row: dict, client, *, max_tokens: int = TURN_TOKENS,
                          temperature: float = TEMPERATURE) -> float:
    """One game of guess_game.py for `row` ({"secret" (or "answer"), "high"?, "max_guesses"?}) played by verifiers
    against `client` (base_url: the session's, http://HOST:PORT/sessions/SID/v1; api_key; model; session_id): the
    game's reward, 1.0 when a guess hit the number. Raises AgreementError when verifiers' trace and the endpoint's
    record of the session differ (compare())."""
    episode = await _play(game_of(row), client, max_tokens, temperature)
    result = compare(episode["turns"], await _record(client))
    if not result["ok"]:
        raise AgreementError(describe(result))
    return float(episode["reward"])
