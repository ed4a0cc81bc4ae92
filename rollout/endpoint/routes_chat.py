"""POST /v1/chat/completions: messages (and function `tools`) rendered by the model's chat template, the session's
earlier calls reused token for token and only the new messages rendered, off the event loop (chat.py); the model's
tool calls parsed into `tool_calls` by the endpoint's parser (parsers.py). `stream: true` is answered by replaying the
finished generation as server-sent events (`events`: the role, the reasoning and the content in one delta each, the
tool calls, the finish with the token ids and the qgrpo block, the usage when asked, then [DONE])."""
from __future__ import annotations

import asyncio
import json
import time

from qgrpo.rollout.endpoint import parsers
from qgrpo.rollout.endpoint.chat import canonical, token_text, tool_schemas
from qgrpo.rollout.endpoint.protocol import (
    ChatAnswer,
    ChatChoice,
    ChatChunkChoice,
    ChatDelta,
    ChatLogprob,
    ChatLogprobs,
    ChatRequest,
    Chunk,
    parse,
)
from qgrpo.rollout.endpoint.serving import Endpoint, weight_spans
from qgrpo.rollout.endpoint.sessions import Call, Session, chain
from qgrpo.rollout.episodes import EpisodeError


async def chat(ep: Endpoint, session: Session, body: dict) -> tuple[Call, ChatAnswer]:
    req = parse(ChatRequest, body)
    ep.check_model(req.model, session)
    messages = req.messages
    offer = req.tool_choice != "none"
    schemas = tool_schemas(req.tools) if offer else []
    tools = json.dumps(schemas, sort_keys=True)
    canon = [canonical(m, k) for k, m in enumerate(messages)]
    parent, j, how, edited = session.chat_parent(canon, tools, issued_ids(messages))
    call_id = ep.book.next_call_id(session.id)
    fork, tail = "", None
    if parent is not None:
        new = messages[j + 1:]

        def history(p=parent):  # only for a template the bridge cannot render apart
            return [_as_message(m) for m in session.messages_of(p)] + [{"role": "assistant", "content": p.text}]
        try:
            tail = await asyncio.to_thread(ep.renderer.tail, new, schemas, parent.stopped, history)
        except EpisodeError:  # a template that renders no turn apart and re-renders earlier turns: a fork
            parent, fork = None, (f"the chat template renders call {parent.id}'s conversation differently once "
                                  "new messages follow it")
    if parent is None:
        tail = await asyncio.to_thread(ep.renderer.prompt, messages, schemas)
        new, j, how, edited = messages, -1, "", False
        fork = fork or session.fork_reason("chat", canon, None)
    call = Call(call_id, parent.id if parent else None, "chat", tail, base=parent.chunks if parent else (),
                new_messages=canon[j + 1:], echoed=canon[j] if edited else None, n_messages=len(canon),
                key=chain(tools, canon)[-1], tools=tools, fork=fork, linked_by=how, edited=edited,
                tail_messages=[_as_message(c) for c in canon[j + 1:]])
    prompt = call.prompt_ids
    t0 = time.monotonic()
    sample, grant = await ep.sample(session, prompt, ep.sampling(req, len(prompt)))
    ep.record(session, call, sample, grant, t0)
    out = parsers.parse(ep.tool_parser, call.text, call_id.replace(":", "-"), offer, ep.tokenizer, prompt, schemas)
    message = out.message
    issued = [c.id for c in message.tool_calls or ()] + [f"qgrpo-{call.id}"]
    session.answered(call, canonical(message.model_dump(), 0), issued, out.calls, out.failed, out.parser)
    ep.counts["tool_calls"] += len(out.calls)
    ep.counts["tool_parse_failures"] += out.failed
    finish = "tool_calls" if out.calls and sample.finish == "stop" else sample.finish
    logprobs = ChatLogprobs(content=[ChatLogprob(token=t, logprob=lp, bytes=list(t.encode()))
                                     for t, lp in zip(token_text(ep.tokenizer, sample.ids), sample.logprobs)])
    choice = ChatChoice(message=message, finish_reason=finish, logprobs=logprobs, token_ids=sample.ids,
                        weight_versions=weight_spans(sample))
    return call, ChatAnswer(choices=[choice], **ep.answer(call, sample, prompt))


def events(out: ChatAnswer, include_usage: bool):
    """The answer as OpenAI's chat.completion.chunk events (protocol.Chunk), each a server-sent event's text."""
    choice, msg = out.choices[0], out.choices[0].message
    deltas = [ChatDelta(role="assistant", content="")]
    if msg.reasoning_content:
        deltas.append(ChatDelta(reasoning_content=msg.reasoning_content))
    if msg.content:
        deltas.append(ChatDelta(content=msg.content))
    if msg.tool_calls:
        deltas.append(ChatDelta(tool_calls=[c.model_copy(update={"index": k}) for k, c in enumerate(msg.tool_calls)]))
    chunks = [ChatChunkChoice(delta=d) for d in deltas]
    chunks[-1].logprobs = choice.logprobs
    chunks.append(ChatChunkChoice(delta=ChatDelta(), finish_reason=choice.finish_reason, token_ids=choice.token_ids,
                                  weight_versions=choice.weight_versions))
    return replay(out, "chat.completion.chunk", chunks, include_usage)


def replay(out, kind: str, choices: list, include_usage: bool):
    """Server-sent events of one chunk per choice (the last with the prompt ids and the qgrpo block), the usage chunk
    when asked, then [DONE]."""
    base = {"id": out.id, "object": kind, "created": out.created, "model": out.model,
            "system_fingerprint": out.system_fingerprint}
    for k, c in enumerate(choices):
        last = {"prompt_token_ids": out.prompt_token_ids, "qgrpo": out.qgrpo} if k == len(choices) - 1 else {}
        yield f"data: {Chunk(**base, choices=[c], **last).model_dump_json()}\n\n"
    if include_usage:
        yield f"data: {Chunk(**base, choices=[], usage=out.usage).model_dump_json()}\n\n"
    yield "data: [DONE]\n\n"


def issued_ids(messages: list) -> list[tuple[str, str]]:
    """The ids the last assistant message of a request carries that the endpoint may have issued: its tool calls'
    ids ("tool_call_id"), and its own `id` (an answer's id, "qgrpo-CALL", sent back by a client that keeps it)."""
    last = next((m for m in reversed(messages) if isinstance(m, dict) and m.get("role") == "assistant"), None)
    if last is None:
        return []
    out = [("tool_call_id", c["id"]) for c in last.get("tool_calls") or () if isinstance(c, dict)
           and isinstance(c.get("id"), str)]
    if isinstance(last.get("id"), str):
        out.append(("response_id", last["id"]))
    return out


def _as_message(canon: tuple) -> dict:
    role, text, calls, name = canon
    msg = {"role": role, "content": text}
    if calls:
        msg["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    return msg
