"""bench/agent_endpoint.py, the endpoint against the in-process episode loop: its --quick run end to end in a process
of its own, and a strict JSON with every figure the tables show, finite and positive."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROUTES = {"in-process", "generate", "chat", "chat (openai SDK)"}


def _reject(name: str):
    raise AssertionError(f"{name} in the JSON")


def _positive(x, where: str) -> None:
    assert isinstance(x, (int, float)) and math.isfinite(x) and x > 0, (where, x)


@pytest.mark.slow  # `make test-slow` (docs/testing.md)
@pytest.mark.heavy  # ~30 s: a model load and a served endpoint in a subprocess
def test_quick_run_measures_every_route_and_session_count(tmp_path):
    out = tmp_path / "agent_endpoint.json"
    cmd = [sys.executable, str(ROOT / "bench" / "agent_endpoint.py"), "--quick", "--out", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(out.read_text(), parse_constant=_reject)  # no NaN / Infinity anywhere
    for key in ("bench", "command", "machine", "model", "precision", "versions", "per_call", "concurrency", "table"):
        assert res[key], key
    assert res["command"].startswith(".venv/bin/python bench/agent_endpoint.py --quick")
    assert res["fixed_length"] and "published" not in p.stdout  # --publish only when asked

    rows = {(r["route"], r["max_tokens"]) for r in res["per_call"]}
    assert rows == {(route, 2) for route in ROUTES}
    for r in res["per_call"]:
        where = r["route"]
        assert r["calls"] == 3 and r["tokens_mean"] == 2  # every call sampled exactly its max_tokens
        for k in ("p50", "p99", "mean"):
            _positive(r["ms"][k], where)
            _positive(r["ms_per_token"][k], where)
            _positive(r["generator_ms"][k], where)
        if r["route"] == "in-process":
            assert "overhead_ms" not in r
            continue
        for k in ("p50", "p99", "paired_p50", "per_token_p50"):
            assert math.isfinite(r["overhead_ms"][k]), (where, k)  # a difference: either sign under load
        for part in ("front", "engine", "generator"):
            _positive(r["split_ms"][part]["p50"], f"{where} {part}")

    assert [c["sessions"] for c in res["concurrency"]] == [1, 3]
    for c in res["concurrency"]:
        for side in ("in_process", "endpoint"):
            s = c[side]
            assert s["calls"] == 2 * c["sessions"] and s["completion_tokens"] == 2 * s["calls"], (side, s)
            for k in ("wall_s", "tokens_per_s", "calls_per_s", "mean_batch", "generator_busy"):
                _positive(s[k], f"{c['sessions']} {side} {k}")
            assert 1 <= s["mean_batch"] <= c["sessions"]
        assert c["in_process"]["batches"] == 2  # one continue_ids batch per turn
        assert c["endpoint"]["forks"] == 0  # every call extended its session's conversation
        _positive(c["endpoint_over_in_process"], "ratio")
    assert res["table"] in p.stdout
