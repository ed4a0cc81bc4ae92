"""Stitching a session's calls into training rows (rollout/endpoint/sessions.py, chat.py, routes_chat.py) with a real
tokenizer and real chat templates: SmolLM2's (append-only) and a Qwen3-style one written onto SmolLM2's tokenizer
(`<think>` of earlier assistant turns dropped once a user turn follows, as Qwen3's template does), and the training
rows an episode's branches give (rollout/agents/rows.py: episode_group under environment.branches).

The model's turns are scripted (`Scripted`: a generator writing given texts, tokenized by the real tokenizer), so a
reasoning block is in the sampled ids whatever an untrained model would write; the endpoint, its sessions, the
template rendering and the tokenizer are the real ones, over HTTP."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from qgrpo.core.records import Completion, PromptItem
from qgrpo.rollout.modeling.models import resolve_model_path

MODEL = "qgrpo-policy"

# Qwen3's chat template as it renders messages (its tools part left out): an assistant turn's reasoning, the
# <think>...</think> block of its content, is dropped for every assistant turn before the last user query.
QWEN3_STYLE = """
{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string
          and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}{%- set content = message.content %}
    {%- else %}{%- set content = '' %}{%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n'
                + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
""".strip()


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path("builtin:smollm2-135m-instruct", None))


@pytest.fixture(scope="module")
def qwen3_style():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path("builtin:smollm2-135m-instruct", None))
    tok.chat_template = QWEN3_STYLE
    return tok


class Scripted:
    """A generator whose turns are given texts (the tokenizer's ids, then its stop token): `script(prompt_ids)`
    says what to write after a prompt. `delay(prompt_ids)`: seconds to wait before answering (concurrent calls)."""

    precision = "bf16"
    policy_version = 0

    def __init__(self, tokenizer, script, delay=lambda ids: 0.0):
        self.tokenizer, self.script, self.delay = tokenizer, script, delay
        self.stop_ids = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        self.prompts: list[list[int]] = []

    def continue_ids(self, sequences, sampling):
        out = []
        for ids in sequences:
            time.sleep(self.delay(ids))
            self.prompts.append(list(ids))
            text = self.script(ids)
            toks = list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + self.stop_ids
            toks = toks[:sampling.max_new_tokens]
            out.append(Completion(token_ids=toks, logprobs=[-0.25] * len(toks),
                                  finish_reason="stop" if toks[-1] in self.stop_ids else "length", text=text))
        return out


def serve(gen):
    from qgrpo.rollout.endpoint.local import serve_local

    return serve_local([gen], max_tokens=64, max_model_len=2048)


def chat(ep, sid: str, messages, **kw) -> dict:
    r = httpx.post(f"{ep.session_url(sid)}/chat/completions", json={"model": MODEL, "messages": messages, **kw},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def end_of(out: dict) -> list[int]:
    return out["prompt_token_ids"] + out["choices"][0]["token_ids"]


def reasoning_turn(ids) -> str:
    return f"<think>\nThe user asked something; {len(ids)} tokens so far.\n</think>\n\nHere is my answer {len(ids)}."


def play_three_user_turns(ep, sid: str) -> list[dict]:
    """An episode of three user turns, each answer sent back as the client got it (its reasoning_content apart)."""
    messages, outs = [{"role": "user", "content": "What is 2+2?"}], []
    for k, follow in enumerate(["Why?", "Say it in French."]):
        outs.append(chat(ep, sid, messages))
        messages += [outs[-1]["choices"][0]["message"], {"role": "user", "content": follow}]
    outs.append(chat(ep, sid, messages))
    return outs


def trained_turns(ep, sid: str) -> int:
    """The assistant turns of the session's training row (its main branch): the turns that train."""
    from qgrpo.rollout.endpoint.sessions import branch_row

    row = branch_row(ep.endpoint.book.get(sid))
    return sum(t["role"] == "assistant" for t in row.completion.turns)


# --- 1. the append-only bridge ---
def test_a_template_that_drops_past_reasoning_trains_every_turn(qwen3_style):
    ep = serve(Scripted(qwen3_style, reasoning_turn))
    try:
        outs = play_three_user_turns(ep, "reasoning")
        assert "<think>" in ep.endpoint.book.get("reasoning").calls[0].text  # the reasoning is in the sampled ids
        assert [o["qgrpo"]["fork"] for o in outs] == [None, None, None]
        assert outs[1]["qgrpo"]["parent"] == outs[0]["qgrpo"]["call_id"]
        assert outs[2]["qgrpo"]["parent"] == outs[1]["qgrpo"]["call_id"]
        for a, b in zip(outs, outs[1:]):  # each prompt begins with the call before's ids, verbatim
            assert b["prompt_token_ids"][:len(end_of(a))] == end_of(a)
        # the whole conversation rendered by the template drops the first answers' reasoning: not what was sampled
        whole = qwen3_style.apply_chat_template(
            [{"role": "user", "content": "What is 2+2?"},
             {"role": "assistant", "content": ep.endpoint.book.get("reasoning").calls[0].text},
             {"role": "user", "content": "Why?"}], tokenize=False, add_generation_prompt=True)
        assert "<think>" not in whole
        # the bridge's tail: the template's own rendering of the new user turn after an assistant turn
        tail = outs[1]["prompt_token_ids"][len(end_of(outs[0])):]
        assert qwen3_style.decode(tail) == "\n<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n"
        assert trained_turns(ep, "reasoning") == 3
    finally:
        ep.close()


@pytest.mark.parametrize("stopped", [True, False])
def test_the_bridge_agrees_with_the_whole_rendering_where_the_template_is_append_only(smol, stopped):
    """SmolLM2's template is append-only: the tail rendered apart (a placeholder turn, then the new messages) is,
    token for token, the whole conversation's rendering less the history's (the episode loop's)."""
    from qgrpo.rollout.endpoint.chat import Renderer
    from qgrpo.rollout.episodes import assistant_tail, environment_turn_ids

    stop_ids = [smol.convert_tokens_to_ids("<|im_end|>")]
    r = Renderer(smol, stop_ids)
    stop_text = smol.decode(stop_ids)
    tools = [{"type": "function", "function": {"name": "calculate", "parameters": {"type": "object"}}}]
    history = [{"role": "user", "content": "What is 12*13?"}, {"role": "assistant", "content": "Let me  see.\n"}]
    news = [[{"role": "user", "content": "Go on."}],
            [{"role": "tool", "content": "156"}],
            [{"role": "tool", "content": "156"}, {"role": "tool", "content": "12"},
             {"role": "user", "content": "  and now?  "}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]]
    for schemas in ([], tools):
        for new in news:
            got = r.tail(new, schemas, stopped)
            past = r.messages(history, schemas)
            want = environment_turn_ids(smol, past, r.messages(new, schemas, tools_message=False), None,
                                        assistant_tail(smol, stop_text), stop_text, stopped)
            assert got == want, (new, smol.decode(got), smol.decode(want))
            assert smol.decode(got).startswith("" if stopped else stop_text)


def in_order(*texts):
    """A script writing `texts` one call after another."""
    it = iter(texts)
    return lambda ids: next(it)


TOOLS = [{"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "12*13"}}</tool_call>'
QUESTION = [{"role": "user", "content": "What is 12*13?"}]


def session(ep, sid: str):
    return ep.endpoint.book.get(sid)


# --- 2. linking by what the endpoint issued, then by messages compared loosely ---
def test_a_client_that_reformats_whitespace_or_the_reasoning_block_still_continues(smol, qwen3_style):
    ep = serve(Scripted(smol, in_order("  The answer:\n\n  156.  ", "Because 12*13 = 156.", "ok")))
    try:
        first = chat(ep, "ws", QUESTION)
        sent = {"role": "assistant", "content": " ".join(first["choices"][0]["message"]["content"].split())}
        assert sent["content"] != first["choices"][0]["message"]["content"]  # the client re-wrapped the text
        second = chat(ep, "ws", QUESTION + [sent, {"role": "user", "content": "Why?"}])
        q = second["qgrpo"]
        assert q["parent"] == first["qgrpo"]["call_id"] and q["fork"] is None and q["linked_by"] == "messages"
        assert second["prompt_token_ids"][:len(end_of(first))] == end_of(first) and not q["edited"]
        # a real edit, with no id the endpoint issued: a fork, with its reason
        edited = {"role": "assistant", "content": "Because I said so."}
        third = chat(ep, "ws", QUESTION + [sent, {"role": "user", "content": "Why?"}, edited,
                                           {"role": "user", "content": "Sure?"}])
        assert third["qgrpo"]["parent"] is None
        assert third["qgrpo"]["fork"] == f"the answer of call {q['call_id']} was not sent back as returned"
    finally:
        ep.close()

    ep = serve(Scripted(qwen3_style, reasoning_turn))
    try:
        first = chat(ep, "think", QUESTION)
        msg = first["choices"][0]["message"]
        assert msg["reasoning_content"] and "<think>" not in (msg["content"] or "")
        # one client sends the reasoning back inside the content, another leaves it out
        with_think = {"role": "assistant", "content": f"<think>\n{msg['reasoning_content']}\n</think>\n\n"
                                                      f"{msg['content']}"}
        for k, sent in enumerate([with_think, {"role": "assistant", "content": msg["content"]}]):
            out = chat(ep, "think", QUESTION + [sent, {"role": "user", "content": f"And {k}?"}])
            assert out["qgrpo"]["parent"] == first["qgrpo"]["call_id"] and out["qgrpo"]["fork"] is None
            assert out["prompt_token_ids"][:len(end_of(first))] == end_of(first)
    finally:
        ep.close()


def test_issued_ids_link_an_answer_the_client_edited_and_the_prompt_keeps_the_sampled_ids(smol):
    ep = serve(Scripted(smol, in_order(CALL, "It is 156.", "Done.", "Again.")))
    try:
        first = chat(ep, "ids", QUESTION, tools=TOOLS)
        msg = first["choices"][0]["message"]
        (tc,) = msg["tool_calls"]
        # the client keeps the tool call (and its id) but writes its own text beside it
        sent = {**msg, "content": "Let me use the calculator."}
        second = chat(ep, "ids", QUESTION + [sent, {"role": "tool", "tool_call_id": tc["id"], "content": "156"}],
                      tools=TOOLS)
        q = second["qgrpo"]
        assert q["parent"] == first["qgrpo"]["call_id"] and q["fork"] is None
        assert q["linked_by"] == "tool_call_id" and q["edited"] is True
        assert second["prompt_token_ids"][:len(end_of(first))] == end_of(first)  # what the model really wrote
        # the answer's id sent back with the message (a client that keeps it), the text rewritten
        history = QUESTION + [sent, {"role": "tool", "tool_call_id": tc["id"], "content": "156"}]
        third = chat(ep, "ids", history + [{"role": "assistant", "content": "156, I think.", "id": second["id"]},
                                           {"role": "user", "content": "Thanks."}], tools=TOOLS)
        q3 = third["qgrpo"]
        assert q3["parent"] == q["call_id"] and q3["linked_by"] == "response_id" and q3["edited"] is True
        assert third["prompt_token_ids"][:len(end_of(second))] == end_of(second)
        # an issued id whose history the client rewrote: not a continuation (the prompt would not be what it sent)
        fourth = chat(ep, "ids", [{"role": "user", "content": "What is 13*12?"}, sent,
                                  {"role": "tool", "tool_call_id": tc["id"], "content": "156"}], tools=TOOLS)
        assert fourth["qgrpo"]["parent"] is None and "history differs" in fourth["qgrpo"]["fork"]
        st = session(ep, "ids").stats()
        assert st["edited_answers"] == 2 and st["forks"] == 1 and st["fork_kinds"] == {"history": 1}
        assert ep.endpoint.stats()["edited_answers"] == 2
    finally:
        ep.close()


# --- 3. which branches train: environment.branches ---
def forked_session(ep, sid: str):
    """Root -> child (the conversation continued), then a call with history the client rewrote (a new root)."""
    first = chat(ep, sid, QUESTION)
    chat(ep, sid, QUESTION + [first["choices"][0]["message"], {"role": "user", "content": "Why?"}])
    chat(ep, sid, [{"role": "user", "content": "Summary: 156. Anything else?"}])
    return session(ep, sid)


def test_branches_main_trains_the_main_branch_and_drop_leaves_out_an_episode_that_forked(smol):
    from qgrpo.rollout.agents.contract import Outcome
    from qgrpo.rollout.agents.rows import branch_counts, episode_group
    from qgrpo.rollout.endpoint.sessions import branch_row

    texts = ["It is 156, as twelve times thirteen is that.", "Because 12*13 is 156.", "No."]
    ep = serve(Scripted(smol, in_order(*texts, *texts)))
    try:
        forked, straight = forked_session(ep, "forked"), None
        first = chat(ep, "straight", QUESTION)
        chat(ep, "straight", QUESTION + [first["choices"][0]["message"], {"role": "user", "content": "Why?"}])
        straight = session(ep, "straight")
    finally:
        ep.close()
    # the main branch: root + child (more sampled tokens than the later root), though the later root finished last
    main = forked.main()
    assert main.id == forked.calls[1].id and forked.calls[-1].parent is None
    assert branch_counts(forked, "main") == {"trained_calls": 2, "untrained_calls": 1, "dropped": 0}
    assert branch_counts(forked, "drop") == {"trained_calls": 0, "untrained_calls": 3, "dropped": 1}
    assert branch_counts(straight, "drop") == {"trained_calls": 2, "untrained_calls": 0, "dropped": 0}

    item = PromptItem("r0", "What is 12*13?", "156")
    outcomes = [Outcome("forked", reward=1.0), Outcome("straight", reward=0.0)]
    for branches in ("main", "drop"):
        group, problems = episode_group(item, outcomes, [forked, straight], 0, "t", "bf16", [], branches)
        assert problems == [] and len(group.completions) == 2  # the group keeps its G rows
        row = branch_row(forked)
        a, b = group.completions
        assert group.prompt_ids + a.token_ids == row.prompt_ids + row.completion.token_ids
        assert a.env_score == 1.0 and b.env_score == 0.0
        assert sum(b.mask()) == sum(len(c.ids) for c in straight.calls)
        assert sum(a.mask()) == (sum(len(c.ids) for c in forked.path(main)) if branches == "main" else 0)
    with pytest.raises(ValueError, match="environment.branches"):
        episode_group(item, outcomes, [forked, straight], 0, "t", "bf16", [], "all")


def test_environment_branches_is_a_checked_setting():
    from qgrpo.cluster.config.schema import Config, validate

    cfg = Config()
    assert cfg.environment.branches == "main"
    cfg.environment.branches = "drop"
    assert any(p.startswith("environment.branches: 'drop' is read for agent programs only") for p in validate(cfg))
    cfg.environment.name = "agent:agent.py:play"
    assert not [p for p in validate(cfg) if p.startswith("environment.branches")]


# --- 4. calls on no trained branch: in the step's metrics, and a warning past a quarter ---
def test_a_step_where_a_quarter_of_the_calls_trained_nothing_warns_naming_the_causes_and_the_setting():
    from qgrpo.cluster.run.env_health import SignalWatch

    watch = SignalWatch(agent=True, branches="main")
    calm = {"agent/calls": 12, "agent/untrained_calls": 3, "agent/forks_history": 1}  # exactly a quarter: no warning
    assert [e for e in watch.end_step(1, calm) if e.get("kind") == "untrained_calls"] == []
    bad = {"agent/calls": 12, "agent/untrained_calls": 7, "agent/forks_history": 2, "agent/forks_second_child": 3,
           "agent/dropped_episodes": 0}
    (event,) = [e for e in watch.end_step(2, bad) if e.get("kind") == "untrained_calls"]
    assert event["causes"] == ["second_child", "history"]
    msg = event["message"]
    assert msg.startswith("7 of the 12 agent calls this step are on no trained branch (agent/untrained_calls)")
    assert "environment.branches = \"main\"" in msg and "rewrote, trimmed or summarised" in msg
    assert msg.index("agent/forks_second_child 3") < msg.index("agent/forks_history 2")
    assert [e for e in watch.end_step(3, bad) if e.get("kind") == "untrained_calls"] == []  # once per streak
    assert watch.end_step(4, calm) == [] and len(watch.end_step(5, bad)) == 1  # a new streak warns again
    drop = SignalWatch(agent=True, branches="drop")
    (event,) = drop.end_step(1, {**bad, "agent/dropped_episodes": 2})
    assert "environment.branches = \"drop\"" in event["message"] and "agent/dropped_episodes 2" in event["message"]


@pytest.mark.parametrize("branches", ["main", "drop"])
def test_the_step_metrics_count_the_calls_on_no_trained_branch(smol, branches):
    """AgentEpisodes._groups (cluster/run/agents.py) over real sessions: agent/untrained_calls, the forks by kind,
    and the warning they give."""
    import types

    from qgrpo.cluster.config.schema import Config
    from qgrpo.cluster.run.agents import AgentEpisodes, EpisodeCall
    from qgrpo.cluster.run.env_health import SignalWatch
    from qgrpo.rollout.agents.contract import Outcome

    texts = ["It is 156, as twelve times thirteen is that.", "Because 12*13 is 156.", "No."]
    ep = serve(Scripted(smol, in_order(*texts, *texts)))
    try:
        forked_session(ep, "f")
        first = chat(ep, "s", QUESTION)
        chat(ep, "s", QUESTION + [first["choices"][0]["message"], {"role": "user", "content": "Why?"}])
        sessions = {"f": session(ep, "f"), "s": session(ep, "s")}
    finally:
        ep.close()
    cfg = Config()
    cfg.environment.name, cfg.environment.branches = "agent:agent.py:play", branches
    pool = types.SimpleNamespace(precision="bf16", version=lambda: 0)
    runs = types.SimpleNamespace(cfg=cfg, pool=pool, replayed={}, _prompt=lambda item: [])
    call = EpisodeCall(None, 0, ("r0",), 1, time.monotonic(), 60.0, items=[PromptItem("r0", "What is 12*13?", "156")],
                       sids=["f", "s"], runner="runner")
    result = AgentEpisodes._groups(runs, call, [Outcome("f", 1.0), Outcome("s", 0.0)], sessions)
    groups, m = result.groups, result.metrics
    assert len(groups) == 1 and len(groups[0].completions) == 2
    assert m["agent/calls"] == 5 and m["agent/forks_history"] == 1 and m["agent/untrained_branches"] == 1
    assert m["agent/forks_template"] == m["agent/forks_answer"] == m["agent/forks_second_child"] == 0  # no gaps
    assert m["agent/untrained_calls"] == (1 if branches == "main" else 3)
    assert m["agent/dropped_episodes"] == (0 if branches == "main" else 1)
    warned = [e for e in SignalWatch.of(cfg).end_step(1, m) if e.get("kind") == "untrained_calls"]
    assert len(warned) == (0 if branches == "main" else 1)  # 1 of 5 calls is under a quarter; 3 of 5 is not
    if warned:
        assert "environment.branches = \"drop\"" in warned[0]["message"] and warned[0]["causes"] == ["history"]


# --- 5. calls of one session in flight together ---
def test_concurrent_calls_train_the_same_branch_whichever_finished_last(smol):
    """Two calls continuing one answer, sent together: the longer answer's branch trains, whether it was sent (and
    finished) first or last."""
    from qgrpo.rollout.endpoint.sessions import branch_row

    def script(ids):
        text = smol.decode(ids)
        return ("A long and careful explanation of why it is one hundred fifty-six." if "Explain" in text[-60:]
                else "Yes." if "Sure" in text[-60:] else "156.")
    # the generator takes its time on every prompt: the second call arrives while the first is sampled
    gen = Scripted(smol, script, delay=lambda ids: 0.3)
    ep = serve(gen)
    try:
        mains = {}
        for sid, order in (("long-first", ["Explain.", "Sure?"]), ("long-last", ["Sure?", "Explain."])):
            first = chat(ep, sid, QUESTION)
            answer = first["choices"][0]["message"]
            outs: dict = {}
            threads = [threading.Thread(target=lambda u=u: outs.setdefault(u, chat(
                ep, sid, QUESTION + [answer, {"role": "user", "content": u}]))) for u in order]
            for t in threads:
                t.start()
                time.sleep(0.05)
            for t in threads:
                t.join(60)
            s = session(ep, sid)
            a, b = (s.call(outs[u]["qgrpo"]["call_id"]) for u in order)
            assert a.started < b.started < a.started + a.seconds  # in flight together
            assert [c.id for c in s.calls][-1] == b.id  # the one sent last finished last
            assert a.parent == b.parent == first["qgrpo"]["call_id"]
            st = s.stats()
            assert st["branches"] == 2 and st["forks"] == 1 and st["second_children"] == 1
            row = branch_row(s)
            mains[sid] = row.completion.turns[-1]["content"]
            assert row.calls == 2
        assert mains["long-first"] == mains["long-last"] and mains["long-first"].startswith("A long and careful")
    finally:
        ep.close()


# --- 6. cost linear in the calls ---
def test_a_call_keeps_only_its_own_ids_and_renders_only_the_new_messages_off_the_event_loop(smol):
    """A stitched call's prompt is its parent's chunks (the same lists, not copies) and its own tail; the template
    renders only the new messages (a placeholder turn and them), never the history, and not on the event loop's
    thread; every answer still carries the whole prompt."""
    renders: list[tuple[int, str]] = []
    original = smol.apply_chat_template

    def counted(messages, *args, **kwargs):
        renders.append((len(messages), threading.current_thread().name))
        return original(messages, *args, **kwargs)

    smol.apply_chat_template = counted
    try:
        ep = serve(Scripted(smol, lambda ids: f"Turn at {len(ids)}."))
        try:
            messages, outs, per_call = list(QUESTION), [], []
            for k in range(8):
                before = len(renders)
                outs.append(chat(ep, "linear", messages))
                per_call.append([n for n, _ in renders[before:]])
                messages += [outs[-1]["choices"][0]["message"], {"role": "user", "content": f"More {k}."}]
            loop_thread = ep.thread.name
        finally:
            ep.close()
    finally:
        smol.apply_chat_template = original
    s = session(ep, "linear")
    calls = s.calls
    for parent, child in zip(calls, calls[1:]):
        assert child.parent == parent.id
        assert len(child.base) == len(parent.base) + 2
        assert all(x is y for x, y in zip(child.base, parent.chunks))  # shared, not copied
        assert child.own == child.prompt_ids[parent.prompt_len + len(parent.ids):]
    for out, c in zip(outs, calls):
        assert out["prompt_token_ids"] == c.prompt_ids and out["usage"]["prompt_tokens"] == len(c.prompt_ids)
    # the first call renders its conversation; each later one a placeholder turn and its one new message, however
    # long the conversation has grown
    assert per_call[0][-1] == 1  # the question (after the template's probe of its own turn's end)
    assert per_call[1:] == [[3]] * 7, per_call
    assert renders and all(name != loop_thread for _, name in renders)


# A template whose turns end with a blank line, not the stop token: the bridge cannot find the placeholder turn's end,
# so the whole conversation is rendered. With `drop`, the last assistant turn is rendered with its reasoning block
# and earlier ones without, as Qwen3's template does (the endpoint's history carries no reasoning: an empty block)
BLANK_LINE = """
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if drop and message.role == 'assistant' and loop.last %}
        {%- set content = '<think>\\n\\n</think>\\n\\n' + content %}
    {%- endif %}
    {{- message.role + ': ' + content + '\\n\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}
""".strip()


@pytest.mark.parametrize("drop", [False, True])
def test_a_template_the_bridge_cannot_split_is_rendered_whole_and_forks_only_where_it_rewrites(drop):
    from transformers import AutoTokenizer

    from qgrpo.rollout.endpoint.chat import Renderer

    tok = AutoTokenizer.from_pretrained(resolve_model_path("builtin:smollm2-135m-instruct", None))
    tok.chat_template = BLANK_LINE.replace("drop and", "true and" if drop else "false and")
    ep = serve(Scripted(tok, reasoning_turn))
    try:
        first = chat(ep, "blank", QUESTION)
        second = chat(ep, "blank", QUESTION + [first["choices"][0]["message"], {"role": "user", "content": "Why?"}])
    finally:
        ep.close()
    q = second["qgrpo"]
    if drop:
        assert q["parent"] is None and q["fork"] == (f"the chat template renders call {first['qgrpo']['call_id']}'s "
                                                     "conversation differently once new messages follow it")
        st = session(ep, "blank").stats()
        assert st["fork_kinds"] == {"template": 1} and st["main_calls"] == 1
    else:
        assert q["parent"] == first["qgrpo"]["call_id"] and q["fork"] is None
        tail = second["prompt_token_ids"][len(end_of(first)):]
        # the whole rendering with the new message less the one without (the episode loop's environment_turn_ids)
        assert tok.decode(tail) == "user: Why?\n\nassistant: "
        r = Renderer(tok, [tok.convert_tokens_to_ids("<|im_end|>")])
        assert tail == r.tail([{"role": "user", "content": "Why?"}], [], True, lambda: [
            *QUESTION, {"role": "assistant", "content": session(ep, "blank").calls[0].text}])
