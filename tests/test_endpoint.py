"""The OpenAI-compatible endpoint (rollout/endpoint/) over real SmolLM2 generators in this process (serve_local, no
Ray): its routes and errors, how a session is named, how a session's calls are stitched by exact tokens into a tree,
the token identity of the training row it gives (the learner's log-probs of the row equal the generator's), the
server-sent events, a weight update landing inside a call, and admission. Generators are real; nothing is mocked."""
from __future__ import annotations

import json
import math
import threading
import time

import httpx
import pytest

from qgrpo.rollout.modeling.models import resolve_model_path

MODEL = "qgrpo-policy"
MAX_MODEL_LEN = 1024
TOOLS = [{"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
QUESTION = [{"role": "user", "content": "What is 12*13? Use the calculator."}]


# --- the generators and endpoints, one each for the module ---
@pytest.fixture(scope="module")
def path():
    return resolve_model_path("builtin:smollm2-135m-instruct", None)


@pytest.fixture(scope="module")
def int8(path):
    from qgrpo.rollout.backends import make_generator

    return make_generator("torch", model_path=path, precision="int8", generator_id="t0", seed=0)


@pytest.fixture(scope="module")
def ep(int8):
    from qgrpo.rollout.endpoint.local import serve_local

    local = serve_local([int8], max_tokens=8, max_model_len=MAX_MODEL_LEN)
    yield local
    local.close()


class Gated:
    """A generator behind the rollout actor's UpdateGate, as RolloutActor.complete runs it (actors/rollout_actor.py):
    each call holds the gate, and a load sent meanwhile runs at the decode loop's next step boundary."""

    def __init__(self, gen):
        from qgrpo.actors.update_gate import UpdateGate

        self.gen, self.gate = gen, UpdateGate(gen)

    def continue_ids(self, sequences, sampling):
        return self.gate.call(lambda: self.gen.continue_ids(sequences, sampling))

    def __getattr__(self, name):
        return getattr(self.gen, name)


@pytest.fixture(scope="module")
def bf16(path):
    """SmolLM2 at bf16, computing in bf16 (as the learner scores), behind an UpdateGate."""
    from qgrpo.rollout.backends import make_generator

    return Gated(make_generator("torch", model_path=path, precision="bf16", compute_dtype="bf16",
                                generator_id="b0", seed=0))


@pytest.fixture(scope="module")
def bep(bf16):
    from qgrpo.rollout.endpoint.local import serve_local

    local = serve_local([bf16], max_tokens=16)
    yield local
    local.close()


@pytest.fixture(scope="module")
def learner(path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


# --- HTTP ---
def post(url: str, body, sid: str | None = None, headers: dict | None = None, timeout: float = 60) -> httpx.Response:
    h = {"Authorization": f"Bearer {sid}"} if sid else {}
    h.update(headers or {})
    if isinstance(body, (bytes, str)):
        return httpx.post(url, content=body, headers={"Content-Type": "application/json", **h}, timeout=timeout)
    return httpx.post(url, json=body, headers=h, timeout=timeout)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def chat(ep, sid: str, messages, **kw) -> dict:
    return ok(post(f"{ep.base_url}/chat/completions", {"model": MODEL, "messages": messages, **kw}, sid))


def generate(ep, sid: str, ids: list[int], max_tokens: int = 4, **params) -> dict:
    return ok(post(f"{ep.address}/inference/v1/generate",
                   {"token_ids": ids, "sampling_params": {"max_tokens": max_tokens, **params}}, sid))


def record(ep, sid: str) -> dict:
    return ok(httpx.get(f"{ep.address}/v1/sessions/{sid}", timeout=10))


def check_choice(choice: dict, logprobs: list[float]) -> None:
    """Token ids, one finite log-prob <= 0 each, and weight-version spans tiling the output tokens."""
    ids = choice["token_ids"]
    assert ids and all(isinstance(t, int) for t in ids)
    assert len(logprobs) == len(ids)
    assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs)
    spans = choice["weight_versions"]
    assert spans[0]["start"] == 0 and spans[-1]["end"] == len(ids)
    assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:]))
    assert all(isinstance(s["version"], str) for s in spans)


def check_qgrpo(out: dict, sid: str, precision: str = "int8") -> dict:
    q = out["qgrpo"]
    # the parser that ran: hermes on a chat answer (SmolLM2's tokenizer has no response_template), none on the others
    parser = "hermes" if out["object"] == "chat.completion" else None
    assert q["precision"] == precision and q["session"] == sid and q["tool_parser"] == parser
    assert out["id"] == f"qgrpo-{q['call_id']}" and q["call_id"].startswith(f"{sid}:")
    assert q["weight_versions"] == out["choices"][0]["weight_versions"]
    assert {"parent", "branch", "fork"} <= set(q)
    assert out["usage"]["prompt_tokens"] == len(out["prompt_token_ids"])
    assert out["usage"]["completion_tokens"] == len(out["choices"][0]["token_ids"])
    return q


def end_of(out: dict) -> list[int]:
    """A call's prompt ids then its sampled ids: what the next call of its conversation begins with."""
    return out["prompt_token_ids"] + out["choices"][0]["token_ids"]


# --- 1. routes and errors ---
def test_each_route_answers_with_tokens_logprobs_versions_and_the_qgrpo_block(ep):
    sid = "routes"
    c = chat(ep, sid, QUESTION, tools=TOOLS, max_tokens=6)
    (choice,) = c["choices"]
    assert c["object"] == "chat.completion" and c["model"] == MODEL and choice["message"]["role"] == "assistant"
    check_choice(choice, [x["logprob"] for x in choice["logprobs"]["content"]])
    assert len(choice["token_ids"]) <= 6 and choice["finish_reason"] in ("stop", "length", "tool_calls")
    q = check_qgrpo(c, sid)
    assert q["parent"] is None and q["branch"] == q["call_id"] and q["fork"] is None

    text = ok(post(f"{ep.base_url}/completions", {"model": MODEL, "prompt": "1+1=", "max_tokens": 4}, sid))
    (choice,) = text["choices"]
    assert text["object"] == "text_completion" and isinstance(choice["text"], str)
    check_choice(choice, choice["logprobs"]["token_logprobs"])
    assert choice["prompt_token_ids"] == text["prompt_token_ids"] == ep.endpoint.renderer.encode_text("1+1=")
    assert choice["logprobs"]["tokens"] == [ep.endpoint.tokenizer.decode([t]) for t in choice["token_ids"]]
    check_qgrpo(text, sid)

    ids = text["prompt_token_ids"][:2] + [28, 33]  # a token-id prompt
    tok = ok(post(f"{ep.base_url}/completions", {"model": MODEL, "prompt": ids, "max_tokens": 3}, sid))
    assert tok["prompt_token_ids"] == ids
    check_choice(tok["choices"][0], tok["choices"][0]["logprobs"]["token_logprobs"])

    g = generate(ep, sid, ids, 3)
    assert g["object"] == "generate" and g["output_mode"] == "tokens" and g["prompt_token_ids"] == ids
    (choice,) = g["choices"]
    assert [x["token_id"] for x in choice["logprobs"]["content"]] == choice["token_ids"]
    check_choice(choice, [x["logprob"] for x in choice["logprobs"]["content"]])
    check_qgrpo(g, sid)

    for url in (f"{ep.base_url}/models", f"{ep.session_url(sid)}/models"):
        (m,) = ok(httpx.get(url, timeout=10))["data"]
        assert m["id"] == MODEL and m["max_model_len"] == MAX_MODEL_LEN

    rec = record(ep, sid)
    assert rec["session"] == sid and rec["stats"]["calls"] == 4
    assert [c["route"] for c in rec["calls"]] == ["chat", "completions", "completions", "generate"]
    last = rec["calls"][-1]
    assert last["token_ids"] == g["choices"][0]["token_ids"] and last["prompt_token_ids"] == ids
    assert last["logprobs"] == [x["logprob"] for x in g["choices"][0]["logprobs"]["content"]]
    assert last["weight_versions"] == [{"version": "0", "first": 0}]
    assert httpx.get(f"{ep.address}/v1/sessions/nobody", timeout=10).status_code == 404


def _refused(r: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    if code:
        assert err["code"] == code
    return err


def test_refused_requests_name_the_field(ep):
    sid = "errors"
    chat_url, gen_url = f"{ep.base_url}/chat/completions", f"{ep.address}/inference/v1/generate"
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 2}
    err = _refused(post(chat_url, {**body, "model": "gpt-4"}, sid), 404, "model", "model_not_found")
    assert MODEL in err["message"] and err["type"] == "not_found_error"
    _refused(post(f"{ep.base_url}/completions", {"model": "gpt-4", "prompt": "x"}, sid), 404, "model")
    errors = record(ep, sid)["stats"]["errors"]
    assert len(errors) == 2 and all("'gpt-4'" in e for e in errors)
    assert len(ep.endpoint.book.get(sid).errors) == 2

    _refused(post(chat_url, {**body, "n": 2}, sid), 400, "n")
    _refused(post(chat_url, {**body, "stop": ["\n"]}, sid), 400, "stop")
    _refused(post(chat_url, {**body, "top_logprobs": 3, "logprobs": True}, sid), 400, "top_logprobs")
    _refused(post(chat_url, {**body, "tool_choice": "required", "tools": TOOLS}, sid), 400, "tool_choice")
    _refused(post(chat_url, {**body, "temperature": "hot"}, sid), 400, "temperature")
    _refused(post(chat_url, {**body, "max_tokens": 0.5}, sid), 400, "max_tokens")
    _refused(post(chat_url, {**body, "messages": "hello"}, sid), 400, "messages")
    _refused(post(chat_url, {**body, "messages": [{"role": "robot", "content": "x"}]}, sid), 400, "messages[0]")
    _refused(post(chat_url, {**body, "tools": [{"type": "retrieval"}]}, sid), 400, "tools")
    _refused(post(gen_url, {"token_ids": [1, 2], "sampling_params": {"n": 2}}, sid), 400, "sampling_params.n")
    _refused(post(gen_url, {"token_ids": "1 2"}, sid), 400, "token_ids")
    _refused(post(f"{ep.base_url}/completions", {"model": MODEL, "prompt": [[1], [2]]}, sid), 400, "prompt")
    err = _refused(post(chat_url, b'{"model": "qgrpo-policy", "messages": [', sid), 400, None)
    assert "JSON" in err["message"]
    _refused(post(chat_url, b"[1, 2]", sid), 400, None)
    # a prompt longer than the model serves
    err = _refused(post(gen_url, {"token_ids": [28] * (MAX_MODEL_LEN + 1)}, sid), 400, "token_ids")
    assert str(MAX_MODEL_LEN) in err["message"]
    long = [{"role": "user", "content": "one two three " * MAX_MODEL_LEN}]
    _refused(post(chat_url, {**body, "messages": long}, sid), 400, "messages")
    assert record(ep, sid)["stats"]["calls"] == 0  # nothing refused was sampled


# --- 2. naming a session ---
def test_the_three_ways_to_name_a_session_land_in_one_record(ep):
    sid = "named"
    a = ok(post(f"{ep.session_url(sid)}/chat/completions",
                {"model": MODEL, "messages": QUESTION, "max_tokens": 1}, "some-other-key"))  # the URL wins
    b = ok(post(f"{ep.base_url}/completions", {"model": MODEL, "prompt": "2+2=", "max_tokens": 1}, "another-key",
                {"X-Session-ID": sid}))  # the header wins over the key
    c = generate(ep, sid, [28, 33, 28], 1)  # the API key
    d = ok(post(f"{ep.session_url(sid).removesuffix('/v1')}/inference/v1/generate",
                {"token_ids": [28, 34], "sampling_params": {"max_tokens": 1}}))
    assert [x["qgrpo"]["session"] for x in (a, b, c, d)] == [sid] * 4
    s = ep.endpoint.book.get(sid)
    assert [call.id for call in s.calls] == [x["qgrpo"]["call_id"] for x in (a, b, c, d)]
    assert [call.route for call in s.calls] == ["chat", "completions", "generate", "generate"]
    assert ep.endpoint.book.get("some-other-key") is None and ep.endpoint.book.get("another-key") is None
    assert record(ep, sid)["stats"]["calls"] == 4


# --- 3. stitching ---
def test_a_call_that_extends_the_conversation_is_its_child_token_for_token(ep):
    from qgrpo.rollout.endpoint.chat import Renderer
    from qgrpo.rollout.environments.tools import schemas_prompt
    from qgrpo.rollout.episodes import assistant_tail, environment_turn_ids

    tok = ep.endpoint.tokenizer
    sid = "stitch"
    first = chat(ep, sid, QUESTION, tools=TOOLS, max_tokens=12)
    answer = first["choices"][0]["message"]
    messages = QUESTION + [answer, {"role": "tool", "tool_call_id": "call-1", "content": "156"}]
    second = chat(ep, sid, messages, tools=TOOLS, max_tokens=6)
    q1, q2 = first["qgrpo"], second["qgrpo"]
    assert q2["parent"] == q1["call_id"] and q2["branch"] == q1["call_id"] and q2["fork"] is None
    head = end_of(first)
    assert second["prompt_token_ids"][:len(head)] == head  # the first call's tokens exactly, as sampled
    tail = second["prompt_token_ids"][len(head):]
    # the tail is the episode loop's rendering of the new message (SmolLM2's template ignores tools=: the schemas
    # are in a system message first)
    stop_text = tok.decode([ep.endpoint.stop_ids[0]])
    sampled = tok.decode(first["choices"][0]["token_ids"], skip_special_tokens=True)
    history = [{"role": "system", "content": schemas_prompt(TOOLS)}, *QUESTION,
               {"role": "assistant", "content": sampled}]
    stopped = first["choices"][0]["finish_reason"] in ("stop", "tool_calls")
    want = environment_turn_ids(tok, history, [{"role": "tool", "content": "156"}], None,
                                assistant_tail(tok, stop_text), stop_text, stopped)
    assert tail == want
    assert first["prompt_token_ids"] == Renderer(tok, ep.endpoint.stop_ids).prompt(QUESTION, TOOLS)

    # the second answer edited before it is sent back: a new root, with the reason
    answer2 = second["choices"][0]["message"]
    edited = {**answer2, "content": (answer2.get("content") or "") + " (edited)"}
    user = {"role": "user", "content": "And 2+2?"}
    fork = chat(ep, sid, messages + [edited, user], tools=TOOLS, max_tokens=2)
    qf = fork["qgrpo"]
    assert qf["parent"] is None and qf["branch"] == qf["call_id"]
    assert qf["fork"] == f"the answer of call {q2['call_id']} was not sent back as returned"

    # sent back as returned: a grandchild of the first call, the whole history reused
    third = chat(ep, sid, messages + [answer2, user], tools=TOOLS, max_tokens=2)
    assert third["qgrpo"]["parent"] == q2["call_id"] and third["qgrpo"]["branch"] == q1["call_id"]
    assert third["prompt_token_ids"][:len(end_of(second))] == end_of(second)
    stats = ep.endpoint.book.get(sid).stats()
    assert stats["calls"] == 4 and stats["branches"] == 2 and stats["forks"] == 1
    assert stats["fork_reasons"] == [qf["fork"]]


def test_token_in_calls_stitch_by_token_prefix(ep):
    sid = "tokens"
    root = generate(ep, sid, ep.endpoint.renderer.prompt(QUESTION, []), 4)
    rid = root["qgrpo"]["call_id"]
    assert len(root["choices"][0]["token_ids"]) >= 2
    child = generate(ep, sid, end_of(root) + [198, 28], 2)
    assert child["qgrpo"]["parent"] == rid and child["qgrpo"]["fork"] is None
    assert child["prompt_token_ids"][:len(end_of(root))] == end_of(root)
    # a second call extending the same parent: a second branch
    sibling = generate(ep, sid, end_of(root) + [198, 29], 2)
    assert sibling["qgrpo"]["parent"] == rid and sibling["qgrpo"]["branch"] == rid
    # one token changed inside the root's sampled tokens: a fork, a new root, with the token named
    changed = end_of(root)
    k = len(root["prompt_token_ids"]) + 1
    changed[k] = 28 if changed[k] != 28 else 29
    fork = generate(ep, sid, changed, 2)
    qf = fork["qgrpo"]
    assert qf["parent"] is None and qf["branch"] == qf["call_id"] and f"token {k} differs" in qf["fork"]
    stats = ep.endpoint.book.get(sid).stats()
    assert stats["calls"] == 4
    assert stats["branches"] == 3  # child, sibling, and the fork's own root
    assert stats["forks"] == 2  # the sibling (a parent's second child) and the rewritten history
    assert stats["fork_reasons"] == [qf["fork"]]
    # the main branch is the one with the most sampled tokens, ties by the order the calls were issued: root + child
    # (not the fork, the last call); the fork is a branch of its own; the sibling's branch is root + its own tail
    from qgrpo.rollout.endpoint.sessions import branch_row

    s = ep.endpoint.book.get(sid)
    main = branch_row(s)
    assert main.calls == 2 and main.prompt_ids + main.completion.token_ids == end_of(child)
    assert [c.id for c in s.branches()] == [child["qgrpo"]["call_id"], sibling["qgrpo"]["call_id"], qf["call_id"]]
    b = branch_row(s, s.call(qf["call_id"]))
    assert b.prompt_ids == changed and b.calls == 1
    b = branch_row(s, s.call(sibling["qgrpo"]["call_id"]))
    assert b.prompt_ids + b.completion.token_ids == end_of(sibling) and b.calls == 2


# --- 4. token identity of the training row (the acceptance test) ---
@pytest.mark.heavy  # a bf16 generator and a bf16 learner forward on the CPU
def test_the_training_row_is_the_sampled_tokens_and_the_learner_scores_them_as_the_generator(bep, learner):
    import torch

    from qgrpo.core.scoring import token_logprobs
    from qgrpo.rollout.endpoint.sessions import branch_row

    sid = "identity"
    turns = [{"role": "tool", "tool_call_id": "c1", "content": "156"},
             {"role": "user", "content": "Thanks. Now explain how you got it, briefly."}]
    messages, outs = list(QUESTION), []
    for k in range(3):
        out = chat(bep, sid, messages, max_tokens=12, temperature=1.0, seed=7 + k)
        assert out["qgrpo"]["precision"] == "bf16"
        assert out["qgrpo"]["parent"] == (outs[-1]["qgrpo"]["call_id"] if outs else None)
        outs.append(out)
        if k < 2:
            messages += [out["choices"][0]["message"], turns[k]]

    # (a) the row, rebuilt from the HTTP answers alone: the first prompt, then each call's sampled ids, with the
    # tokens rendered between them (each call's prompt past the call before's end)
    ids, mask, lps = [], [], []
    prev = None
    for out in outs:
        if prev is not None:
            assert out["prompt_token_ids"][:len(end_of(prev))] == end_of(prev)
            tail = out["prompt_token_ids"][len(end_of(prev)):]
            assert tail
            ids, mask, lps = ids + tail, mask + [0] * len(tail), lps + [0.0] * len(tail)
        sampled = out["choices"][0]["token_ids"]
        ids, mask = ids + sampled, mask + [1] * len(sampled)
        lps += [x["logprob"] for x in out["choices"][0]["logprobs"]["content"]]
        prev = out
    row = branch_row(bep.endpoint.book.get(sid))
    assert row.calls == 3 and row.prompt_ids == outs[0]["prompt_token_ids"]
    assert row.completion.token_ids == ids
    assert row.prompt_ids + row.completion.token_ids == end_of(outs[-1])  # the last call was fed all of it
    # (b) the loss mask is 1 exactly on the sampled tokens; their log-probs are the generator's
    assert row.completion.model_mask == mask
    assert row.completion.logprobs == lps
    assert [t["role"] for t in row.completion.turns] == ["assistant", "tool", "assistant", "user", "assistant"]

    # (c) the learner's bf16 log-probs of the row (one forward) equal the generator's on every sampled token
    p = len(row.prompt_ids)
    full = torch.tensor([row.prompt_ids + row.completion.token_ids])
    with torch.no_grad():
        scored = token_logprobs(learner, full)[0].float()
    m = torch.tensor(mask, dtype=torch.bool)
    want = torch.tensor(lps)[m]
    got = scored[p:p + len(ids)][m]
    assert torch.isfinite(got).all() and len(got) >= 12
    gap = (got - want).abs()
    # bf16 rounding between a KV-cached decode and one full forward (tests/test_episodes.py's bound)
    assert gap.mean() < 0.05 and gap.max() < 0.5, (gap.mean(), gap.max())
    off = (scored[p - 1:p - 1 + len(ids)][m] - want).abs()  # a control: the row one token off
    assert off.mean() > 1.0, off.mean()


# --- 5. server-sent events ---
def _events(r: httpx.Response) -> list:
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    lines = [x for x in r.text.split("\n\n") if x.strip()]
    assert all(x.startswith("data: ") for x in lines) and lines[-1] == "data: [DONE]"
    return [json.loads(x[len("data: "):]) for x in lines[:-1]]


def test_streamed_answers_replay_the_call_as_server_sent_events(ep):
    sid = "stream"
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 6, "seed": 3, "temperature": 1.0}
    events = _events(post(f"{ep.base_url}/chat/completions",
                          {**body, "stream": True, "stream_options": {"include_usage": True}}, sid))
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    *chunks, usage = events
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(chunks[-1]["choices"][0]["token_ids"])
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    call = ep.endpoint.book.get(sid).call(final["qgrpo"]["call_id"])
    assert final["choices"][0]["token_ids"] == call.ids and final["prompt_token_ids"] == call.prompt_ids
    assert content == call.text
    streamed_lps = [x["logprob"] for c in chunks for x in ((c["choices"][0].get("logprobs") or {}).get("content")
                                                           or [])]
    assert streamed_lps == call.logprobs
    # the same call unstreamed (same seed, same prompt, alone in its batch): the same answer
    plain = chat(ep, "stream-plain", **{k: v for k, v in body.items() if k != "model"})
    assert plain["choices"][0]["message"]["content"] == content
    assert plain["choices"][0]["token_ids"] == call.ids

    events = _events(post(f"{ep.base_url}/completions",
                          {"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 4, "stream": True}, sid))
    assert all(e["object"] == "text_completion" for e in events)  # no usage chunk unless asked
    call = ep.endpoint.book.get(sid).calls[-1]
    assert "".join(e["choices"][0]["text"] for e in events) == call.text
    assert events[-1]["choices"][0]["token_ids"] == call.ids and events[-1]["qgrpo"]["call_id"] == call.id


# --- 6. an in-flight weight update ---
def test_an_update_landing_during_a_call_splits_its_weight_versions(bep, bf16, learner):
    """The generator behind the UpdateGate (built in this process as the rollout actor builds it): a load sent while
    a call decodes runs at the next step boundary, and the answer's spans say which tokens each version sampled."""
    from qgrpo.rollout.endpoint.sessions import branch_row

    gate, gen = bf16.gate, bf16.gen
    weights = [(n, p.detach().clone()) for n, p in learner.named_parameters()]  # the same values, a new version
    version = gen.policy_version
    out: dict = {}
    gate.delay = 0.05  # a decode step every 50 ms at least: the call lasts long enough for the load to land in it
    try:
        t = threading.Thread(target=lambda: out.setdefault("r", post(
            f"{bep.base_url}/completions", {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 12,
                                            "temperature": 0}, "inflight")))
        t.start()
        deadline = time.monotonic() + 30
        while not gate.busy and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.15)  # a few steps in
        gate.load(lambda: gen.load_weights(version + 1, weights))
        t.join(60)
    finally:
        gate.delay = 0.0
    assert gate.applied_mid_call == 1 and gen.policy_version == version + 1
    res = ok(out["r"])
    choice = res["choices"][0]
    n = len(choice["token_ids"])
    spans = choice["weight_versions"]
    assert [s["version"] for s in spans] == [str(version), str(version + 1)], spans
    k = spans[1]["start"]
    assert spans == [{"version": str(version), "start": 0, "end": k},
                     {"version": str(version + 1), "start": k, "end": n}] and 0 < k < n
    assert res["qgrpo"]["weight_versions"] == spans
    (rec,) = record(bep, "inflight")["calls"]
    assert rec["weight_versions"] == [{"version": str(version), "first": 0}, {"version": str(version + 1), "first": k}]
    row = branch_row(bep.endpoint.book.get("inflight"))
    assert row.versions == [version] * k + [version + 1] * (n - k)


# --- 7. admission ---
def test_a_session_past_max_sessions_is_refused_429_until_one_closes(int8):
    from qgrpo.rollout.endpoint.admission import Admission
    from qgrpo.rollout.endpoint.local import serve_local

    local = serve_local([int8], max_tokens=2, admission=Admission(max_sessions=1, wait_s=0.3))
    try:
        url = f"{local.address}/inference/v1/generate"
        body = {"token_ids": [28, 33, 28], "sampling_params": {"max_tokens": 1}}
        assert post(url, body, "first").status_code == 200
        assert post(url, body, "first").status_code == 200  # its own session again: admitted
        t0 = time.monotonic()
        r = post(url, body, "second")
        assert r.status_code == 429 and time.monotonic() - t0 >= 0.3
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert local.endpoint.stats()["refused"] == 1
        assert local.endpoint.close("first") is not None
        second = ok(post(url, body, "second"))
        assert second["qgrpo"]["session"] == "second"
    finally:
        local.close()
