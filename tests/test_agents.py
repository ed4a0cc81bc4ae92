"""Agent programs as a rollout source (rollout/agents/, cluster/run/agents.py): ordinary async functions given a
dataset row and a client configuration, run against the endpoint (rollout/endpoint) over real generators.

- Each way an agent can fail (it raises, hangs, blocks on a thread, sends a foreign model name, never calls the
  endpoint, returns something that is not a reward) is an Outcome naming the cause (and the user's line), and its
  episode scores 0 with finish "env_error"; an episode the endpoint ended at a limit (environment.max_turns) is a
  truncated one, not a failure.
- `qgrpo check` plays one episode against the base model and refuses an agent that fails, naming its file and line.
- A whole `qgrpo train` of an agent on Ray: the endpoint's address in RUN_DIR/endpoint.json, the episodes' rows
  trained (multi-turn, loss mask on sampled tokens), agent/* metrics, and failing episodes counted, not fatal.
- Behind the Ray endpoint, a weight sync that lands during an agent's call is applied between two decode steps: the
  answer's spans cover both versions; while the endpoint is paused, calls wait and are answered 429 (Retry-After).
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from qgrpo.core.records import PromptItem

ROOT = Path(__file__).resolve().parents[1]

AGENTS = '''
import asyncio, json, time, urllib.request


def _post(client, body, model=None):
    body = {"model": model or client.model, **body}
    req = urllib.request.Request(client.base_url + "/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {client.api_key}"})
    return json.loads(urllib.request.urlopen(req, timeout=60).read())


async def good(row, client):
    first = await asyncio.to_thread(_post, client, {"prompt": row["prompt"], "max_tokens": 2})
    ids = first["prompt_token_ids"] + first["choices"][0]["token_ids"]
    await asyncio.to_thread(_post, client, {"prompt": ids + ids[:1], "max_tokens": 2})
    return 1.0 if row["answer"] in first["choices"][0]["text"] else 0.5


async def raises(row, client):
    await asyncio.to_thread(_post, client, {"prompt": row["prompt"], "max_tokens": 2})
    value = {}["missing"]  # the line the error names
    return value


async def hangs(row, client):
    await asyncio.sleep(1000)


def blocks(row, client):
    time.sleep(1000)


async def foreign(row, client):
    await asyncio.to_thread(_post, client, {"prompt": row["prompt"], "max_tokens": 2}, "gpt-4o")


async def silent(row, client):
    return 1.0


async def text(row, client):
    await asyncio.to_thread(_post, client, {"prompt": row["prompt"], "max_tokens": 2})
    return "right"


async def talkative(row, client):
    ids = None
    for _ in range(5):
        out = await asyncio.to_thread(_post, client, {"prompt": ids or row["prompt"], "max_tokens": 2})
        ids = out["prompt_token_ids"] + out["choices"][0]["token_ids"]
    return 1.0


async def some_fail(row, client):
    if client.session_id.split("-")[2:3] == ["1"]:  # a run's sessions are s<step>-<row>-<episode>-<n>
        raise RuntimeError("this agent fails on the second episode of each row")
    return await good(row, client)


async def some_fail_later(row, client):
    """some_fail, step k's training episodes 3 (k - 1) s late: later steps' are in flight during an evaluation."""
    if client.session_id.startswith("s"):
        await asyncio.sleep(3 * (int(client.session_id.split("-")[0][1:]) - 1))
    return await some_fail(row, client)
'''


@pytest.fixture(scope="module")
def agents_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("agents") / "my_agents.py"
    path.write_text(AGENTS)
    return path


@pytest.fixture(scope="module")
def served(tiny_model_path):
    from qgrpo.rollout.backends import make_generator
    from qgrpo.rollout.endpoint.local import serve_local

    gen = make_generator("torch", model_path=tiny_model_path, precision="int8", generator_id="agents-t0", seed=0)
    ep = serve_local([gen], max_tokens=4)
    yield ep, gen
    ep.close()


def _play(served, agents_file, name: str, item: PromptItem, timeout_s: float = 30.0, limits: dict | None = None):
    from qgrpo.rollout.agents.contract import AgentClient, load_agent, play
    from qgrpo.rollout.agents.rows import episode_group
    from qgrpo.rollout.environments.contract import row_of
    from qgrpo.rollout.environments.loader import environment_spec

    ep, gen = served
    fn = load_agent(environment_spec(f"agent:{agents_file}:{name}"))
    sid = f"{name}-{time.monotonic_ns()}"
    ep.endpoint.open(sid, 0, limits)
    outcome = asyncio.run(play(fn, row_of(item), AgentClient(ep.session_url(sid), sid, ep.endpoint.model, sid),
                               timeout_s))
    session = ep.endpoint.close(sid)
    group, problems = episode_group(item, [outcome], [session], 0, "t", "int8", gen.tokenizer(item.prompt)["input_ids"])
    return outcome, group.completions[0], problems


ITEM = PromptItem("p0", "2+3=", "5")


def test_a_good_agent_is_one_stitched_row_with_its_reward(served, agents_file):
    outcome, comp, problems = _play(served, agents_file, "good", ITEM)
    assert not problems and outcome.reward in (0.5, 1.0) and comp.env_score == outcome.reward
    assert comp.finish_reason in ("stop", "length")
    assert sum(t["role"] == "assistant" for t in comp.turns) == 2  # the second call extended the first
    assert comp.model_tokens == sum(t["end"] - t["start"] for t in comp.turns if t["role"] == "assistant")
    assert len(comp.token_ids) == len(comp.logprobs) == len(comp.model_mask) == len(comp.token_versions)


@pytest.mark.parametrize("name,cause", [
    ("raises", "KeyError: 'missing'"),
    ("hangs", "did not finish within environment.episode_timeout_s = 1 s"),
    ("blocks", "did not finish within environment.episode_timeout_s = 1 s"),
    ("foreign", "not served here"),
    ("silent", "never called the endpoint"),
    ("text", "return the episode's reward (a finite number) or None"),
])
def test_each_failing_agent_is_an_episode_that_scores_zero_with_its_cause(served, agents_file, name, cause):
    outcome, comp, problems = _play(served, agents_file, name, ITEM, timeout_s=1.0)
    assert len(problems) == 1 and cause in problems[0], problems
    assert comp.finish_reason == "env_error" and comp.env_score == 0.0
    last = comp.turns[-1]
    assert last["error"] and cause in problems[0]
    if name == "raises":  # the user's own line, and the traceback for env_errors.log
        assert f"{Path(agents_file).name}:" in problems[0] and 'value = {}["missing"]' in problems[0]
        assert "Traceback" in last["trace"]


def test_an_episode_ended_by_max_turns_is_truncated_not_failed(served, agents_file):
    outcome, comp, problems = _play(served, agents_file, "talkative", ITEM, limits={"max_calls": 2})
    assert outcome.error and not problems  # the agent saw the refusal; the episode is cut, not failed
    assert comp.finish_reason == "max_turns" and comp.env_score == 0.0
    assert sum(t["role"] == "assistant" for t in comp.turns) == 2


def _config(folder: Path, agents_file: Path, name: str, **over) -> Path:
    data = (ROOT / "configs" / "tiny.toml").read_text()
    data = data.replace("steps = 300", f"steps = {over.get('steps', 2)}").replace("eval = true", "eval = false")
    data = data.replace("save_every = 50", "save_every = 0")
    data = data.replace("prompts_per_step = 16", "prompts_per_step = 2").replace("group_size = 16", "group_size = 2")
    data += (f'\n[environment]\nname = "agent:{agents_file}:{name}"\nmax_turns = 4\nmax_context = 64\n'
             f'episode_timeout_s = 60\non_error = "end"\n')
    path = folder / f"{name}.toml"
    path.write_text(data)
    return path


def test_check_refuses_an_agent_that_fails_naming_its_line(tmp_path, agents_file, capsys):
    from qgrpo.cluster.cli.app import main

    rc = main(["check", str(_config(tmp_path, agents_file, "raises"))])
    out = capsys.readouterr()
    err = out.out + out.err
    assert rc == 2, err
    assert "the agent failed on train row" in err and "KeyError: 'missing'" in err
    assert f"{agents_file.name}:" in err and "Traceback" not in err


def test_check_plays_one_episode_of_a_good_agent(tmp_path, agents_file, capsys):
    from qgrpo.cluster.cli.app import main

    rc = main(["check", str(_config(tmp_path, agents_file, "good"))])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "one episode: 2 calls" in out.out + out.err


def test_check_plays_its_episode_on_the_runs_backend(tmp_path, agents_file, monkeypatch):
    """check's episode is generated by the run's rollout.backend with its settings, not by a fixed one: a backend of
    another name (served by the configured one's generator) is the one asked for."""
    import dataclasses

    from qgrpo.cluster.config.schema import load_config
    from qgrpo.rollout import backends
    from qgrpo.rollout.agents.probe import probe_agent
    from qgrpo.rollout.data.tasks import make_task

    cfg = load_config(str(_config(tmp_path, agents_file, "good")))
    served = cfg.rollout.backend
    monkeypatch.setitem(backends.REGISTRY, "other", dataclasses.replace(backends.REGISTRY[served], name="other",
                                                                        options=None))
    object.__setattr__(cfg.rollout, "backend", "other")
    made, real = [], backends.make_generator

    def recording(backend, **kwargs):
        made.append((backend, kwargs))
        return real(served, **kwargs)

    monkeypatch.setattr(backends, "make_generator", recording)
    out = probe_agent(cfg, make_task(cfg.task, cfg.run.seed).item(0))
    assert [b for b, _ in made] == ["other"], made
    options = backends.backend_options("other", cfg.rollout, cfg.compute_dtype_of("rollout"))
    assert made[0][1]["precision"] == "bf16" and options.items() <= made[0][1].items()
    assert out.problems == [] and out.found.startswith("one episode: 2 calls"), out


@pytest.mark.ray
@pytest.mark.parametrize("staleness", [pytest.param(0, marks=pytest.mark.slow), pytest.param(1, marks=pytest.mark.slow),
                                       2])
def test_a_run_trains_on_agent_episodes_and_counts_the_failed_ones(tmp_path, agents_file, staleness):
    """S = 0: each step's episodes start after the sync before it, all on one version. S = 1: the next step's
    sessions open while the learner trains (the bound kept by when they open), its tokens at most 1 version old.
    S = 2, the pool's one owner: a held-out evaluation after every step goes through the stream's pump beside the
    training chunks in flight, and the agent runner killed during the one after step 1 costs no training chunk:
    its episodes (held-out and training) are played again, each step's rows trained exactly once, none failed as
    blocked."""
    from qgrpo.cluster.run.agents import BLOCKED
    from qgrpo.core.invocation import qgrpo_command

    steps = {0: 2, 1: 3, 2: 3}[staleness]
    cfg = _config(tmp_path, agents_file, "some_fail_later" if staleness == 2 else "some_fail", steps=steps)
    sets = ["algo.max_staleness=" + str(staleness)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    if staleness == 2:
        sets += ["run.eval=true", "run.eval_every=1", "task.eval_size=2"]
        env.update({"QGRPO_FAULTS": "agent_runner.kill_eval@1", "QGRPO_FAULTS_STATE": str(tmp_path)})
    cmd = qgrpo_command("train", str(cfg), "--set", f"run.output_dir={tmp_path / 'runs'}",
                        "--set", "run.progress=false", *[x for s in sets for x in ("--set", s)]).split()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = next((tmp_path / "runs").iterdir())
    info = json.loads((run / "endpoint.json").read_text())
    assert info["base_url"].startswith("http://127.0.0.1:") and info["model"] == "qgrpo-policy"
    assert "agents call the endpoint at http://127.0.0.1:" in proc.stderr
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in records if "loss/total" in m]
    assert [m["step"] for m in steps] == list(range(1, len(steps) + 1)) and len(steps) == (2 if staleness == 0 else 3)
    for m in steps:
        if staleness == 0:
            assert m["rollout/policy_versions"] == [m["step"] - 1]  # one version, the last sync's
        else:
            assert m["rollout/staleness"] <= staleness
            assert all(v >= m["step"] - 1 - staleness for v in m["rollout/policy_versions"])
        assert m["agent/calls"] >= 2
        assert m["agent/forks"] == 0 and m["agent/failed_episodes"] == 2 and m["episode/finish_env_error"] == 0.5
    import pyarrow.parquet as pq

    rows = pq.read_table(run / "rollouts").to_pylist()
    good = [r for r in rows if r["finish_reason"] != "env_error"]
    assert good and all(r["num_tokens"] > 0 and json.loads(r["turns"])[0]["role"] == "assistant" for r in good)
    assert sum(r["finish_reason"] == "env_error" for r in rows) == 2 * len(steps)
    errors = (run / "env_errors.log").read_text()
    assert "this agent fails on the second episode of each row" in errors
    if staleness == 2:
        per_step = {s: Counter(r["prompt_id"] for r in rows if r["step"] == s) for s in (1, 2, 3)}
        assert all(len(c) == 2 and set(c.values()) == {2} for c in per_step.values()), per_step  # each row once
        assert BLOCKED[:40] not in errors
        assert [e["step"] for e in records if e.get("event") == "eval"] == [0, 1, 2, 3]
        events = [e for e in records if "event" in e]
        # killed in the evaluation after step 1: logged with the next step's events
        assert [e["step"] for e in events if e["event"] == "runner_failed"] == [2]
        assert len([e for e in events if e["event"] == "agent_runner_restarted"]) == 1
        assert sum(m["agent/replayed_episodes"] for m in steps) >= 1  # a later step's episodes were in flight


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
@pytest.mark.ray
def test_a_sync_during_an_agents_call_spans_two_versions_and_a_paused_endpoint_answers_429(ray_session,
                                                                                          tiny_model_path, tmp_path):
    import ray
    from transformers import AutoTokenizer

    from qgrpo.actors.endpoint_actor import EndpointActor
    from qgrpo.actors.rollout_actor import RolloutActor
    from qgrpo.actors.weights import ObjectStoreTransport
    from qgrpo.rollout.backends import make_generator
    from qgrpo.rollout.backends.common import probe_ids

    sys.path.insert(0, str(ROOT / "tests"))
    from test_inflight_updates import _two_token_head

    env = {"QGRPO_FAULTS": "rollout.slow_decode@1+", "QGRPO_FAULTS_STATE": str(tmp_path)}
    actor = RolloutActor.options(runtime_env={"env_vars": env}).remote(
        "torch", dict(model_path=tiny_model_path, precision="int8", generator_id="agent-inflight"), 1)
    endpoint = EndpointActor.remote("tiny", tiny_model_path, [actor], open_sessions=True, wait_s=0.5)
    try:
        address = ray.get(endpoint.start.remote(), timeout=120)
        new = _two_token_head(tiny_model_path)
        probe = probe_ids(AutoTokenizer.from_pretrained(tiny_model_path))
        twin = make_generator("torch", model_path=tiny_model_path, precision="int8", generator_id="twin")
        twin.load_weights(1, new)
        update = ObjectStoreTransport(1 << 12).publish(1, new, probe_ids=probe, probe_logprobs=twin.score(probe))
        body = json.dumps({"model": "tiny", "prompt": "1+2=", "max_tokens": 12, "temperature": 1.0}).encode()
        request = urllib.request.Request(f"{address}/sessions/a/v1/completions", body,
                                         {"Content-Type": "application/json"})
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(lambda: json.loads(urllib.request.urlopen(request, timeout=120).read()))
            time.sleep(1.0)  # a few decode steps in (0.25 s each)
            assert ray.get(actor.load_weights.remote(update), timeout=60).version == 1
            assert not answer.done(), "the sync waited for the whole call"
            out = answer.result(timeout=120)
        spans = out["choices"][0]["weight_versions"]
        assert [s["version"] for s in spans] == ["0", "1"] and spans[0]["start"] == 0
        assert spans[0]["end"] == spans[1]["start"] > 0 and spans[1]["end"] == len(out["choices"][0]["token_ids"])
        assert out["qgrpo"]["weight_versions"] == spans
        # admission: while the actors change, a call waits, then 429 with Retry-After; resumed, it is served
        ray.get(endpoint.pause.remote())
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(f"{address}/sessions/b/v1/completions", body,
                                                          {"Content-Type": "application/json"}), timeout=60)
        assert refused.value.code == 429 and int(refused.value.headers["Retry-After"]) >= 1
        ray.get(endpoint.resume.remote())
        again = json.loads(urllib.request.urlopen(urllib.request.Request(
            f"{address}/sessions/b/v1/completions", body, {"Content-Type": "application/json"}), timeout=120).read())
        assert again["choices"][0]["weight_versions"] == [{"version": "1", "start": 0,
                                                           "end": len(again["choices"][0]["token_ids"])}]
        assert ray.get(endpoint.stats.remote())["refused"] == 1
    finally:
        ray.kill(endpoint)
        ray.kill(actor)


def test_tool_calls_that_do_not_parse_at_a_precision_warn():
    from qgrpo.cluster.run.env_health import tool_parse_warnings

    (w,) = tool_parse_warnings(3, {"agent/tool_parse_failures_int4": 5, "agent/tool_calls_int4": 3})
    assert w["kind"] == "tool_parse_failures" and w["precision"] == "int4" and "5 of the 8 tool calls" in w["message"]
    # no measurement of the format this step: precision is one possible cause, after temperature and the model
    causes = w["message"].split("possible causes: ")[1]
    assert causes.index("rollout.temperature = 1") < causes.index("the model") < causes.index("int4 format (not "
                                                                                              "measured")
    # the step's mismatch says how far the format moved the samples: named unlikely below QUIET_MISMATCH, first above
    quiet = {"agent/tool_parse_failures_int8": 13, "agent/tool_calls_int8": 25, "mismatch/kl_mu_old": 0.002}
    (w,) = tool_parse_warnings(4, quiet, temperature=1.0, model="builtin:smollm2-135m-instruct")
    assert "the int8 format, unlikely: the sampler and the BF16 policy differ by 0.0020 nats" in w["message"]
    assert "(builtin:smollm2-135m-instruct)" in w["message"] and w["mismatch_kl"] == 0.002
    (w,) = tool_parse_warnings(4, {**quiet, "mismatch/kl_mu_old": 0.08}, temperature=0.6)
    assert w["message"].split("possible causes: ")[1].startswith("the int8 format: the sampler and the BF16 policy "
                                                                  "differ by 0.0800")
    assert "at 1 a small model" not in w["message"]  # a low temperature is no suspect worth a hint
    (w,) = tool_parse_warnings(4, {"agent/tool_parse_failures_bf16": 13, "agent/tool_calls_bf16": 25})
    assert "bf16 format" not in w["message"] and "mismatch" not in w["message"]  # unquantized: precision is no cause
    assert tool_parse_warnings(3, {"agent/tool_parse_failures_int8": 1, "agent/tool_calls_int8": 30}) == []
    assert tool_parse_warnings(3, {"agent/tool_parse_failures_int8": 2, "agent/tool_calls_int8": 30}) == []


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_clients_own_stop_tokens_cut_the_sample_and_other_dialects_are_refused_in_openais_shape(served):
    ep, gen = served
    body = {"token_ids": gen.tokenizer("2+3=")["input_ids"], "sampling_params": {"max_tokens": 4, "temperature": 0}}
    _, whole = _post(f"{ep.address}/sessions/stops/inference/v1/generate", body)
    ids = whole["choices"][0]["token_ids"]
    assert len(ids) == 4
    body["sampling_params"]["stop_token_ids"] = [ids[1]]
    _, cut = _post(f"{ep.address}/sessions/stops2/inference/v1/generate", body)
    k = ids.index(ids[1]) + 1
    assert cut["choices"][0]["token_ids"] == ids[:k] and cut["choices"][0]["finish_reason"] == "stop"
    assert len(cut["choices"][0]["logprobs"]["content"]) == k
    for path, what in (("/v1/responses", "the Responses API"), ("/v1/messages", "Anthropic's Messages API")):
        status, err = _post(ep.address + path, {"model": ep.endpoint.model, "input": "hi"})
        assert status == 404 and err["error"]["message"].startswith(f"{what} is not served here")


def test_dynamic_sampling_is_refused_for_an_agent_before_anything_starts(tmp_path, agents_file):
    from qgrpo.cluster.config.schema import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(str(_config(tmp_path, agents_file, "good")), ["algo.dynamic_sampling=true"])
    assert any(p.startswith("algo.dynamic_sampling: not served for agent programs") for p in e.value.problems)
