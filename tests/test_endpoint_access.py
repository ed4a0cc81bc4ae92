"""Who may call the endpoint (rollout/endpoint/auth.py, admission.py, serving.py) and how much, and what its answers
say beyond the tokens: the run's key (401 without it or with another run's, 404 for another run's session; /health's
counters only with it), the body limit (413, with and without Content-Length), the per-session call limit,
per-client sessions and idle expiry (`qgrpo serve`), the request models' refusals (protocol.py), tool-call parsing
(parsers.py: an unclosed call, tool_choice "none", a tokenizer's own response_template and its hermes fallback, Llama
3's JSON calls), the reasoning split and the stitching after it, and a capped call's qgrpo.max_tokens block with the
session's capped/cut/tool-offer counts.

Everything goes over HTTP to the real app served by uvicorn (serve_local). The generators are SmolLM2-135M-Instruct
at int8 (real sampling), or `Scripted`: a backend that samples turns written in advance through the same tokenizer
and stop tokens, so that a test can hold a <think> block, a tool call or a call cut inside it whatever the small
model would write. The endpoint, its sessions, the chat template and the tokenizer are the real ones."""
from __future__ import annotations

import copy
import json
import secrets
import time

import httpx
import pytest

from qgrpo.core.records import Completion
from qgrpo.rollout.modeling.models import resolve_model_path

MODEL = "qgrpo-policy"
TOOLS = [{"type": "function", "function": {
    "name": "count_letters", "description": "Count a word's letters",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}]
QUESTION = [{"role": "user", "content": "How many letters has lakiwaki?"}]
CALL = '<tool_call>{"name": "count_letters", "arguments": {"word": "lakiwaki"}}</tool_call>'


@pytest.fixture(scope="module")
def int8():
    from qgrpo.rollout.backends import make_generator

    path = resolve_model_path("builtin:smollm2-135m-instruct", None)
    return make_generator("torch", model_path=path, precision="int8", generator_id="access", seed=0)


class Scripted:
    """A backend whose turns are written in advance: each sequence it is given samples the next script's tokens
    (the tokenizer's ids of the text, then the stop token), log-prob -0.5 each, cut at max_new_tokens ("length")."""

    precision, policy_version = "bf16", 0

    def __init__(self, tokenizer, stop_ids: list[int]):
        self.tokenizer, self.stop_ids = tokenizer, stop_ids
        self.scripts: list[str] = []

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.stop_ids[0]]

    def continue_ids(self, sequences, sampling):
        out = []
        for _ in sequences:
            ids = self.ids(self.scripts.pop(0))
            n = min(len(ids), sampling.max_new_tokens)
            out.append(Completion(ids[:n], [-0.5] * n, "stop" if n == len(ids) else "length",
                                  self.tokenizer.decode(ids[:n], skip_special_tokens=True)))
        return out


@pytest.fixture(scope="module")
def scripted(int8):
    from qgrpo.rollout.endpoint.local import serve_local

    gen = Scripted(int8.tokenizer, int8.stop_ids)
    local = serve_local([gen], max_tokens=64, max_model_len=512)
    local.gen = gen
    yield local
    local.close()


def post(url: str, body, key: str | None = None, headers: dict | None = None, **kw) -> httpx.Response:
    h = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url, json=body, headers={**h, **(headers or {})}, timeout=60, **kw)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def chat(local, sid: str, messages, script: str | None = None, **kw) -> dict:
    if script is not None:
        local.gen.scripts.append(script)
    return ok(post(f"{local.session_url(sid)}/chat/completions", {"model": MODEL, "messages": messages, **kw}))


def refused(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    return err


# --- 1. the run's key ---
def test_a_keyed_endpoint_answers_only_calls_with_its_key_and_its_sessions(int8):
    from qgrpo.rollout.endpoint.local import serve_local
    from qgrpo.rollout.endpoint.sessions import SessionBook

    key, other_run = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    local = serve_local([int8], max_tokens=2, api_key=key, book=SessionBook(open_sessions=False))
    try:
        local.endpoint.open("s0-0-0-0", 0, {})
        url = f"{local.session_url('s0-0-0-0')}/chat/completions"
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 1}
        err = refused(post(url, body), 401, "invalid_api_key")
        assert err["type"] == "authentication_error" and err["param"] is None
        assert "no API key" in err["message"] and "client.api_key" in err["message"]
        assert "qgrpo serve" in err["message"] and "--api-key" in err["message"]
        err = refused(post(url, body, other_run), 401, "invalid_api_key")  # another run's key
        assert "wrong API key" in err["message"]
        refused(post(url, body, headers={"Authorization": key}), 401, "invalid_api_key")  # not a bearer header
        for path in ("/v1/models", "/v1/sessions/s0-0-0-0", "/v1/responses"):
            refused(httpx.get(f"{local.address}{path}", timeout=10), 401, "invalid_api_key")
        # health needs no key, and says only that the endpoint is alive without it; with it, its counters too
        assert ok(httpx.get(f"{local.address}/health", timeout=10)) == {"status": "ok"}
        assert ok(httpx.get(f"{local.address}/health", headers={"Authorization": f"Bearer {other_run}"},
                            timeout=10)) == {"status": "ok"}
        assert local.endpoint.book.get("s0-0-0-0").calls == []  # nothing refused was sampled

        out = ok(post(url, body, key))
        assert out["qgrpo"]["session"] == "s0-0-0-0"
        health = ok(httpx.get(f"{local.address}/health", headers={"Authorization": f"Bearer {key}"}, timeout=10))
        assert health["status"] == "ok" and health["calls"] == 1 and health["open_sessions"] == 1
        # the right key and another run's session: not opened by this run
        refused(post(f"{local.session_url('s0-0-0-1-another-run')}/chat/completions", body, key), 404,
                "session_not_found")
        # the key names no session: the plain base URL is a session of this client, which the run did not open
        err = refused(post(f"{local.base_url}/chat/completions", body, key), 404, "session_not_found")
        assert key not in err["message"]
        assert local.endpoint.book.get(key) is None
        out = ok(post(f"{local.base_url}/chat/completions", body, key, {"X-Session-ID": "s0-0-0-0"}))
        assert out["qgrpo"]["session"] == "s0-0-0-0" and len(local.endpoint.book.get("s0-0-0-0").calls) == 2
    finally:
        local.close()


# --- 2. per-client sessions, the call limit, idle expiry (qgrpo serve's bounds) ---
def test_calls_naming_no_session_get_their_own_clients_session(int8):
    from qgrpo.rollout.endpoint.local import serve_local

    local = serve_local([int8], max_tokens=2)
    try:
        url = f"{local.base_url}/completions"
        body = {"model": MODEL, "prompt": "1+1=", "max_tokens": 1}
        here = [ok(post(url, body))["qgrpo"]["session"] for _ in range(2)]
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=60) as other:
            there = ok(other.post(url, json=body))["qgrpo"]["session"]
        assert here[0] == here[1] and here[0] != there  # each client's calls in one session, not another's
        assert all(s.startswith("client-") and len(s) == len("client-") + 24 for s in (here[0], there))
        assert "default" not in local.endpoint.book.sessions
        assert [len(local.endpoint.book.get(s).calls) for s in (here[0], there)] == [2, 1]
        # without a run key, a bearer key still names a session (as before)
        assert ok(post(url, body, "my-session"))["qgrpo"]["session"] == "my-session"
        assert ok(httpx.get(f"{local.address}/health", timeout=10))["calls"] == 4  # no key set: counters to all
    finally:
        local.close()

    key = secrets.token_urlsafe(32)
    local = serve_local([int8], max_tokens=2, api_key=key)  # qgrpo serve beyond loopback: a key, any session
    try:
        url = f"{local.base_url}/completions"
        sid = ok(post(url, body, key))["qgrpo"]["session"]
        assert sid.startswith("client-") and key not in sid and local.endpoint.book.get(key) is None
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=60) as other:
            assert ok(other.post(url, json=body, headers={"Authorization": f"Bearer {key}"}))["qgrpo"]["session"] \
                not in (sid, key)
    finally:
        local.close()


def test_a_session_past_max_session_calls_is_refused_naming_the_setting(int8):
    from qgrpo.rollout.endpoint.local import serve_local

    local = serve_local([int8], max_tokens=2, max_session_calls=2)
    try:
        url = f"{local.address}/inference/v1/generate"
        body = {"token_ids": [28, 33, 28], "sampling_params": {"max_tokens": 1}}
        for _ in range(2):
            ok(post(url, body, headers={"X-Session-ID": "busy"}))
        err = refused(post(url, body, headers={"X-Session-ID": "busy"}), 400, "max_session_calls")
        assert "2 calls" in err["message"] and "--max-session-calls" in err["message"]
        assert len(local.endpoint.book.get("busy").calls) == 2
        ok(post(url, body, headers={"X-Session-ID": "another"}))  # another session is not held by it
    finally:
        local.close()


def test_served_sessions_idle_past_idle_s_are_closed_and_unpinned(int8):
    from qgrpo.rollout.endpoint.local import serve_local

    local = serve_local([int8], max_tokens=2, idle_s=2.0)
    try:
        ep = local.endpoint
        ep.open("run-episode", 0, {})  # a run's session: never expired here
        body = {"model": MODEL, "prompt": "1+1=", "max_tokens": 1}
        ok(post(f"{local.session_url('idle')}/completions", body))
        assert ep.book.get("idle") is not None and ep.load == [2]
        time.sleep(0.2)
        ok(post(f"{local.session_url('fresh')}/completions", body))
        assert ep.book.get("idle") is not None  # idle under 2 s: kept
        time.sleep(1.2)
        ok(post(f"{local.session_url('fresh')}/completions", body))
        time.sleep(1.2)
        ok(post(f"{local.session_url('fresh')}/completions", body))
        assert ep.book.get("idle") is None and ep.book.get("fresh") is not None  # its calls keep it
        assert ep.book.get("run-episode") is not None and ep.load == [2]
        assert httpx.get(f"{local.address}/v1/sessions/idle", timeout=10).status_code == 404
    finally:
        local.close()


# --- 3. the body limit ---
def test_an_oversized_body_is_refused_413_with_or_without_content_length(int8):
    from qgrpo.rollout.endpoint.local import serve_local

    local = serve_local([int8], max_tokens=2, max_body_bytes=4096)
    try:
        url = f"{local.base_url}/completions"
        big = {"model": MODEL, "prompt": "x " * 4000, "max_tokens": 1}
        err = refused(post(url, big, "sized"), 413, "request_too_large")
        assert "4096 bytes" in err["message"] and "--max-body-mb" in err["message"]

        data = json.dumps(big).encode()

        def chunks():
            for k in range(0, len(data), 1000):
                yield data[k:k + 1000]
        r = httpx.post(url, content=chunks(), headers={"Content-Type": "application/json"}, timeout=60)
        assert "content-length" not in r.request.headers and r.request.headers["transfer-encoding"] == "chunked"
        refused(r, 413, "request_too_large")
        # the server goes on answering, and a body under the limit (chunked too) is served
        small = json.dumps({"model": MODEL, "prompt": "1+1=", "max_tokens": 1}).encode()
        ok(httpx.post(url, content=iter([small[:10], small[10:]]), headers={"Content-Type": "application/json"},
                      timeout=60))
        ok(post(url, {"model": MODEL, "prompt": "1+1=", "max_tokens": 1}, "sized"))
        assert local.endpoint.book.get("sized").errors == []  # refused before any session was named
    finally:
        local.close()


# --- 4. the request models ---
def test_the_request_models_refuse_with_the_field_named(scripted):
    url = f"{scripted.session_url('models')}/chat/completions"
    gen_url = f"{scripted.address}/sessions/models/inference/v1/generate"
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 2}
    cases = [(url, {**body, "max_tokens": True}, "max_tokens"), (url, {**body, "top_p": 0}, "top_p"),
             (url, {**body, "temperature": 11}, "temperature"), (url, {**body, "seed": "7"}, "seed"),
             (url, {**body, "response_format": {"type": "json_object"}}, "response_format"),
             (url, {**body, "stream": "yes"}, "stream"), (url, {k: v for k, v in body.items() if k != "messages"},
                                                          "messages"),
             (gen_url, {"token_ids": [1, -2]}, "token_ids"), (gen_url, {"token_ids": [1], "sampling_params": []},
                                                              "sampling_params"),
             (gen_url, {"token_ids": [1], "sampling_params": {"stop_token_ids": ["\n"]}},
              "sampling_params.stop_token_ids"),
             (gen_url, {"token_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature")]
    for target, b, param in cases:
        r = post(target, b)
        assert r.status_code == 400, (param, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["message"].startswith(param) and err["type"] == "invalid_request_error"
    # fields the endpoint does not read are allowed (OpenAI clients send many)
    scripted.gen.scripts.append("fine")
    out = ok(post(url, {**body, "user": "u1", "metadata": {"a": "b"}, "parallel_tool_calls": False,
                        "frequency_penalty": 0, "logprobs": True}))
    assert out["choices"][0]["message"]["content"] == "fine"


# --- 5. tool calls and reasoning ---
def test_an_unclosed_tool_call_is_a_parse_failure_kept_as_content(scripted):
    from qgrpo.rollout.environments.tools import parse_tool_calls

    cut = '<tool_call>{"name": "count_letters", "arguments": {"word": "lakiw'
    (error,) = parse_tool_calls(cut)
    assert isinstance(error, str) and "not closed" in error
    assert parse_tool_calls(CALL + " " + cut)[0] == {"name": "count_letters", "arguments": {"word": "lakiwaki"}}

    before = scripted.endpoint.counts["tool_parse_failures"]
    scripted.gen.scripts.append(CALL)
    n = len(scripted.gen.ids(cut)) - 1  # max_tokens cuts the call inside its argument
    out = chat(scripted, "cut-call", QUESTION, tools=TOOLS, max_tokens=n)
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == scripted.gen.tokenizer.decode(choice["token_ids"])
    assert choice["message"]["content"].startswith('<tool_call>{"name": "count_letters"')
    stats = scripted.endpoint.book.get("cut-call").stats()
    assert stats["tool_parse_failures"] == 1 and stats["tool_calls"] == 0 and stats["cut_calls"] == 1
    assert scripted.endpoint.counts["tool_parse_failures"] == before + 1


def test_tool_choice_none_parses_no_tool_calls(scripted):
    out = chat(scripted, "choice", QUESTION, CALL, tools=TOOLS, tool_choice="none")
    msg = out["choices"][0]["message"]
    assert "tool_calls" not in msg and msg["content"] == CALL and out["choices"][0]["finish_reason"] == "stop"
    out = chat(scripted, "choice", QUESTION, "Let me count. " + CALL, tools=TOOLS)  # "auto": parsed
    msg = out["choices"][0]["message"]
    assert out["choices"][0]["finish_reason"] == "tool_calls" and msg["content"] == "Let me count."
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "count_letters" and call["function"]["arguments"] == '{"word": "lakiwaki"}'
    stats = scripted.endpoint.book.get("choice").stats()
    assert stats["tool_calls"] == 1 and stats["tool_offers"] == 1  # "none" offered no tools


def test_reasoning_is_returned_apart_and_later_calls_still_stitch(scripted):
    sid, text = "think", "<think>Eight letters: l-a-k-i-w-a-k-i.</think>\n\nIt has 8 letters."
    first = chat(scripted, sid, QUESTION, text)
    choice = first["choices"][0]
    msg = choice["message"]
    assert msg["reasoning_content"] == "Eight letters: l-a-k-i-w-a-k-i." and msg["content"] == "It has 8 letters."
    assert choice["token_ids"] == scripted.gen.ids(text)  # the training tokens are the sampled ones, think included
    call = scripted.endpoint.book.get(sid).call(first["qgrpo"]["call_id"])
    assert call.text == text
    follow = {"role": "user", "content": "And backwards?"}
    echoes = {"as returned": msg, "without reasoning_content": {"role": "assistant", "content": msg["content"]},
              "with the think block in content": {"role": "assistant", "content": text}}
    for how, echo in echoes.items():
        out = chat(scripted, sid, QUESTION + [echo, follow], "ikawikal")
        assert out["qgrpo"]["parent"] == first["qgrpo"]["call_id"], how
        assert out["prompt_token_ids"][:len(first["prompt_token_ids"]) + len(choice["token_ids"])] \
            == first["prompt_token_ids"] + choice["token_ids"], how
    # streamed: the reasoning in a delta of its own, as vLLM streams it
    scripted.gen.scripts.append(text)
    r = httpx.post(f"{scripted.session_url('think-stream')}/chat/completions",
                   json={"model": MODEL, "messages": QUESTION, "stream": True}, timeout=60)
    deltas = [json.loads(x[len("data: "):])["choices"][0]["delta"] for x in r.text.split("\n\n")
              if x.startswith("data: {") and json.loads(x[len("data: "):])["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
    # a think block cut by max_tokens: all reasoning, no content
    out = chat(scripted, "think-cut", QUESTION, "<think>Eight letters: l-a-k", max_tokens=4)
    msg = out["choices"][0]["message"]
    assert msg["content"] is None and msg["reasoning_content"] and out["choices"][0]["finish_reason"] == "length"


def test_a_tokenizers_response_template_parses_its_turns(int8):
    """transformers' tokenizer.parse_response, where the tokenizer has a response_template; the hermes parse where
    it cannot parse a turn (a call cut by max_tokens)."""
    from qgrpo.rollout.endpoint.local import serve_local

    tok = copy.deepcopy(int8.tokenizer)
    tok.response_template = {"start_anchor": "<|im_start|>assistant\n", "fields": {
        "reasoning_content": {"open": "<think>", "close": "</think>"},
        "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "content": "json", "repeats": True},
        "content": {}}}
    gen = Scripted(tok, int8.stop_ids)
    local = serve_local([gen], max_tokens=64, max_model_len=512)
    local.gen = gen
    try:
        out = chat(local, "own", QUESTION, "<think>count</think>Counting. " + CALL, tools=TOOLS)
        msg = out["choices"][0]["message"]
        assert out["qgrpo"]["tool_parser"] == "response_template"
        assert msg["reasoning_content"] == "count" and msg["content"] == "Counting."
        assert [c["function"]["name"] for c in msg["tool_calls"]] == ["count_letters"]
        assert out["choices"][0]["finish_reason"] == "tool_calls"
        cut = '<tool_call>{"name": "count_letters", "arguments": {"word": "lakiw'
        out = chat(local, "own", QUESTION, CALL, tools=TOOLS, max_tokens=len(gen.ids(cut)) - 1)
        assert "tool_calls" not in out["choices"][0]["message"]
        assert out["qgrpo"]["tool_parser"] == "hermes"  # the fallback that ran, not the template's parser
        assert local.endpoint.book.get("own").stats()["tool_parse_failures"] == 1
        rec = ok(httpx.get(f"{local.address}/v1/sessions/own", timeout=10))
        assert [c["tool_parser"] for c in rec["calls"]] == ["response_template", "hermes"]
    finally:
        local.close()


def test_an_endpoint_given_the_llama3_parser_parses_its_calls_and_counts_a_broken_one(int8):
    from qgrpo.rollout.endpoint.local import serve_local

    gen = Scripted(int8.tokenizer, int8.stop_ids)
    local = serve_local([gen], max_tokens=64, max_model_len=512, tool_parser="llama3_json")
    local.gen = gen
    try:
        call = '{"name": "count_letters", "parameters": {"word": "lakiwaki"}}'
        out = chat(local, "llama", QUESTION, "<|python_tag|>" + call, tools=TOOLS)
        msg = out["choices"][0]["message"]
        assert out["qgrpo"]["tool_parser"] == "llama3_json" and out["choices"][0]["finish_reason"] == "tool_calls"
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
            [("count_letters", {"word": "lakiwaki"})] and msg["content"] is None
        out = chat(local, "llama", QUESTION, CALL, tools=TOOLS)  # hermes text: content to this parser
        assert "tool_calls" not in out["choices"][0]["message"] and out["choices"][0]["message"]["content"] == CALL
        out = chat(local, "llama", QUESTION, call, tools=TOOLS, max_tokens=len(gen.ids(call)) - 4)  # cut inside
        assert "tool_calls" not in out["choices"][0]["message"] and out["choices"][0]["finish_reason"] == "length"
        stats = local.endpoint.book.get("llama").stats()
        assert (stats["tool_calls"], stats["tool_parse_failures"]) == (1, 1)
        assert local.endpoint.counts["tool_parse_failures"] == 1
    finally:
        local.close()
    with pytest.raises(ValueError, match="tool_parser 'mistral' is not a parser"):
        serve_local([gen], tool_parser="mistral")


# --- 6. capped calls ---
def test_a_capped_call_says_so_and_the_session_counts_capped_and_cut_calls(scripted):
    ep = scripted.endpoint
    long = "one two three four five six seven eight nine ten eleven twelve"
    ep.open("capped", 0, {"max_tokens": 3})  # environment.turn_tokens = 3
    out = chat(scripted, "capped", QUESTION, long, max_tokens=8)
    assert out["qgrpo"]["max_tokens"] == {"asked": 8, "granted": 3, "cap": "environment.turn_tokens"}
    assert len(out["choices"][0]["token_ids"]) == 3 and out["choices"][0]["finish_reason"] == "length"
    out = chat(scripted, "capped", QUESTION, "ok", max_tokens=2)
    assert out["qgrpo"]["max_tokens"] == {"asked": 2, "granted": 2, "cap": None}
    stats = ep.book.get("capped").stats()
    assert (stats["capped_calls"], stats["cut_calls"], stats["tool_offers"]) == (1, 1, 0)

    prompt = ep.renderer.prompt(QUESTION, [])
    ep.open("context", 0, {"max_context": len(prompt) + 2})
    out = chat(scripted, "context", QUESTION, long, max_tokens=8)
    assert out["qgrpo"]["max_tokens"] == {"asked": 8, "granted": 2, "cap": "environment.max_context"}

    near = [28] * (ep.max_model_len - 3)  # 3 tokens of room left in max_model_len
    scripted.gen.scripts.append(long)
    g = ok(post(f"{scripted.address}/sessions/model-len/inference/v1/generate",
                {"token_ids": near, "sampling_params": {"max_tokens": 10}}))
    assert g["qgrpo"]["max_tokens"] == {"asked": 10, "granted": 3, "cap": "the model's max_model_len"}
    rec = ok(httpx.get(f"{scripted.address}/v1/sessions/model-len", timeout=10))
    assert rec["stats"]["capped_calls"] == 1 and rec["stats"]["cut_calls"] == 1


# --- 7. qgrpo serve's access options ---
def test_serve_makes_a_key_beyond_loopback_and_takes_its_bounds(monkeypatch, capsys):
    import types

    from qgrpo.cluster.cli.app import _parser
    from qgrpo.cluster.cli.serve import KEY_ENV, Refused, _say_serving, access, loopback

    monkeypatch.delenv(KEY_ENV, raising=False)
    args = _parser().parse_args(["serve", "configs/tiny.toml"])
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert loopback(host) and access(args, host).api_key is None
    made = access(args, "0.0.0.0")
    assert made.generated and len(made.api_key) >= 43 and access(args, "0.0.0.0").api_key != made.api_key
    assert made.kwargs() == {"api_key": made.api_key, "max_body_bytes": 8 * 2**20, "max_session_calls": 1000,
                             "idle_s": 600.0}
    given = access(_parser().parse_args(["serve", "c.toml", "--api-key", "k1", "--max-body-mb", "0.5",
                                         "--max-session-calls", "3", "--session-idle-s", "0"]), "0.0.0.0")
    assert not given.generated and given.kwargs() == {"api_key": "k1", "max_body_bytes": 2**19,
                                                      "max_session_calls": 3, "idle_s": 0.0}
    monkeypatch.setenv(KEY_ENV, "k2")
    assert access(args, "127.0.0.1").api_key == "k2" and not access(args, "0.0.0.0").generated
    for bad in (["--max-body-mb", "0"], ["--max-session-calls", "-1"], ["--session-idle-s", "-5"]):
        with pytest.raises(Refused, match=bad[0]):
            access(_parser().parse_args(["serve", "c.toml", *bad]), "127.0.0.1")

    ro = types.SimpleNamespace(max_new_tokens=8, backend="torch", precision="int8", num_actors=1)
    served = types.SimpleNamespace(cfg=types.SimpleNamespace(rollout=ro), source="configs/tiny.toml")
    _say_serving(served, MODEL, "http://10.0.0.1:8000", made)
    out, err = capsys.readouterr()
    assert made.api_key in err and "http://10.0.0.1:8000/v1" in err and made.api_key not in out
    assert f"Authorization: Bearer ${KEY_ENV}" in out and "base URL: http://10.0.0.1:8000/v1" in out
