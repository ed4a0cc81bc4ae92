"""The HTTP front: OpenAI's chat and completions routes, vLLM's token-in route and the model list, over the sessions
(sessions.py) and the batched generators (engine.py). Engine-agnostic: `run` samples on a rollout actor or a local
generator, whichever backend it holds.

Routes, each also under /sessions/{SID}/ (a per-session base URL: http://HOST:PORT/sessions/SID/v1):
- POST /v1/chat/completions: messages (and function `tools`) rendered by the model's chat template, the session's
  earlier calls reused token for token and only the new messages rendered, off the event loop; the model's tool calls
  parsed into `tool_calls` (chat.py). `stream: true` is answered by replaying the finished generation as server-sent
  events (one content delta, the tool calls, the end).
- POST /v1/completions: a prompt as text or token ids.
- POST /inference/v1/generate: vLLM's token-in, token-out schema (token_ids + sampling_params -> choices[].token_ids,
  logprobs.content[].{token_id, logprob}, weight_versions), as `renderers` and verifiers' TrainClient call it.
- GET /v1/models: the one model served, with max_model_len.
- GET /v1/sessions/{SID}: the session's calls and branches (what the training row will be).

Every answer carries the prompt's token ids (`prompt_token_ids`), the completion's (`choices[].token_ids`), each
sampled token's log-prob from the quantized generator that sampled it (`choices[].logprobs`), the weight-version spans
(`choices[].weight_versions`, vLLM's shape: [{"version", "start", "end"}] over output tokens) and a `qgrpo` block:
precision, session, call id, parent call, branch (the branch's root call), why the call forked, if it did, how its
parent was found (`linked_by`: "tool_call_id", "response_id", "messages" or "tokens") and whether the client sent the
parent's answer back with other text (`edited`: the prompt keeps the sampled ids).

Request bodies are checked by one pydantic model per route (protocol.py); a refusal names the field.

Access (`Endpoint(api_key=...)`): with a key, every route but GET /health needs `Authorization: Bearer KEY` (else 401
invalid_api_key), and a session is named only by its base URL's SID or the X-Session-ID header. Without one (`qgrpo
serve` on loopback), the bearer key names a session too, as before. A call naming no session gets one of its own
client's (named from its address and key, salted: not guessable from outside), never a shared one. A body over
`max_body_bytes` is answered 413 (its Content-Length, and the bytes actually read); a session past
`max_session_calls` calls 400; served sessions idle past `idle_s` are closed.

Admission (`Admission`): while the rollout actors change (a resize, a replacement) a call waits; a new session past
`max_sessions` waits for room; either answers 429 with Retry-After after `wait_s`.
"""
from __future__ import annotations

import asyncio
import contextvars
import hashlib
import hmac
import json
import math
import secrets
import time

from qgrpo.rollout.endpoint.chat import (
    TEMPLATE_PARSER,
    TOOL_PARSER,
    Renderer,
    RequestError,
    assistant_message,
    canonical,
    prompt_of_completion,
    template_parse,
    token_text,
    tool_schemas,
)
from qgrpo.rollout.endpoint.engine import Batcher, Run, Sample
from qgrpo.rollout.endpoint.protocol import ChatRequest, CompletionRequest, GenerateRequest, Sampling, parse
from qgrpo.rollout.endpoint.sessions import Call, Session, SessionBook, chain
from qgrpo.rollout.episodes import EpisodeError

MAX_SERVED_SESSIONS = 10_000  # `qgrpo serve` keeps this many sessions' records (the oldest go first)
# the call this request's task is serving, on its way to the batcher (Endpoint.arrive / settle)
_TICKET: contextvars.ContextVar[list | None] = contextvars.ContextVar("qgrpo_endpoint_ticket", default=None)
MAX_BODY_BYTES = 8 * 2**20  # a request body past this is refused 413 (`qgrpo serve --max-body-mb`)
KEY_SOURCE = ("during a run, the agent's client is given the run's key as its API key (client.api_key); `qgrpo "
              "serve` prints the key it generated when it started, or takes it from --api-key (QGRPO_API_KEY)")


class Admission:
    """When a call may sample: not while paused (the actors change); a new session only while fewer than
    `max_sessions` are open (0: no bound). Waits up to `wait_s`, then the call is answered 429."""

    def __init__(self, max_sessions: int = 0, wait_s: float = 30.0):
        self.max_sessions, self.wait_s = max_sessions, wait_s
        self.paused = False
        self.active: set[str] = set()
        self.refused = 0

    async def enter(self, sid: str) -> bool:
        deadline = time.monotonic() + self.wait_s
        while self.paused or (sid not in self.active and self.max_sessions
                              and len(self.active) >= self.max_sessions):
            if time.monotonic() >= deadline:
                self.refused += 1
                return False
            await asyncio.sleep(0.02)
        self.active.add(sid)
        return True

    def leave(self, sid: str) -> None:
        self.active.discard(sid)


class Endpoint:
    """The endpoint's state: the model it serves, its sessions, its batcher and counters."""

    def __init__(self, *, model: str, tokenizer, stop_ids: list[int], run: Run, slots: int, precision: str,
                 max_model_len: int, max_tokens: int, chat_template: bool = True, book: SessionBook | None = None,
                 admission: Admission | None = None, version=lambda: 0, defaults: dict | None = None,
                 vocab_size: int = 0, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                 max_session_calls: int = 0, idle_s: float = 0.0):
        """`api_key`: the run's secret every route but GET /health asks for (None: none, loopback only);
        `max_body_bytes`: the largest request body; `max_session_calls`: calls one session may make (0: no bound;
        a run's episodes are bounded by their limits, environment.max_turns); `idle_s`: a served session (one a call
        opened, not the run) with no call for this long is closed, its actor pin freed (0: never)."""
        self.model, self.tokenizer, self.run, self.slots, self.precision = model, tokenizer, run, slots, precision
        self.max_model_len, self.max_tokens = max_model_len, max_tokens
        self.vocab_size = vocab_size or len(tokenizer)  # token ids past it are refused (the model has no such row)
        self.renderer = Renderer(tokenizer, stop_ids, chat_template)
        self.stop_ids = stop_ids
        self.book = book or SessionBook(open_sessions=True)
        self.admission = admission or Admission()
        self.version = version
        # the sampling a call gets for what it leaves out (a run's: rollout.temperature, top_p, top_k)
        self.defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, **(defaults or {})}
        self.batcher: Batcher | None = None
        self.counts = {"calls": 0, "refused": 0, "forks": 0, "tool_calls": 0, "tool_parse_failures": 0,
                       "model_tokens": 0, "edited_answers": 0}
        self.load = [0] * slots  # sessions pinned per slot
        self.coming = [0] * slots  # calls received per slot, not yet queued in the batcher (`arrive`)
        self.api_key, self.max_body_bytes = api_key or None, max_body_bytes
        self.max_session_calls, self.idle_s = max_session_calls, idle_s
        self.salt = secrets.token_bytes(16)  # names the sessions of calls that name none
        self.seen: dict[str, float] = {}  # session -> its last call's time (idle expiry)
        self.busy: dict[str, int] = {}  # session -> calls in flight (never expired under them)
        self.swept = 0.0
        self.tool_parser = TEMPLATE_PARSER if getattr(tokenizer, "response_template", None) else TOOL_PARSER

    # --- sessions ---
    def session_id(self, request, path_sid: str | None) -> str:
        """The per-session path's SID, else the X-Session-ID header; else, without a run key, the bearer key; else a
        session of the calling client's own."""
        if path_sid:
            return path_sid
        sid = request.headers.get("x-session-id")
        if sid:
            return sid
        key = bearer(request.headers.get("authorization", ""))
        if key and not self.api_key:
            return key
        return self.client_session(request.client.host if request.client else "", key)

    def client_session(self, host: str, key: str) -> str:
        """The session of a client that names none: from its address and key, salted by this endpoint's secret."""
        digest = hmac.new(self.salt, f"{host}\0{key}".encode(), hashlib.sha256).hexdigest()
        return f"client-{digest[:24]}"

    def authorized(self, header: str) -> bool:
        """The request's `Authorization` header carries this endpoint's key (always, without a key)."""
        if not self.api_key:
            return True
        return hmac.compare_digest(bearer(header).encode(), self.api_key.encode())

    def expire(self, now: float | None = None) -> list[str]:
        """Close the served sessions idle past `idle_s` (none with a call in flight; none a run opened)."""
        now = time.monotonic() if now is None else now
        if not self.idle_s or now - self.swept < min(1.0, self.idle_s / 4):
            return []
        self.swept = now
        gone = [sid for sid, s in list(self.book.sessions.items())
                if s.step is None and not self.busy.get(sid) and now - self.seen.get(sid, s.opened) > self.idle_s]
        for sid in gone:
            self.close(sid)
        return gone

    def session(self, sid: str) -> Session:
        self.expire()
        s = self.book.get(sid)
        if s is None:
            if not self.book.open_sessions:
                raise RequestError(f"no open session {sid!r}: during a run, an agent is given its base URL and API "
                                   "key by the run (the client configuration its function receives)", None, 404,
                                   "session_not_found")
            if len(self.book.sessions) >= MAX_SERVED_SESSIONS:
                self.close(next(iter(self.book.sessions)))
            s = self.open(sid)
        self.seen[sid] = time.monotonic()
        return s

    def open(self, sid: str, step: int | None = None, limits: dict | None = None) -> Session:
        """A session pinned to the least loaded slot; `limits` (a run's episode): max_calls, max_context,
        max_tokens per call, greedy (held-out evaluation samples at temperature 0 whatever the agent asks)."""
        slot = min(range(self.slots), key=lambda k: self.load[k])
        s = self.book.open(sid, step, slot, limits)
        if s.slot == slot:
            self.load[slot] += 1
        return s

    def close(self, sid: str) -> Session | None:
        s = self.book.close(sid)
        if s is not None and 0 <= s.slot < self.slots:
            self.load[s.slot] -= 1
        self.admission.leave(sid)
        self.seen.pop(sid, None)
        return s

    def repin(self, slots: int) -> None:
        """The rollout actors changed (`slots` of them now): open sessions move to live ones."""
        self.slots, self.load, self.coming = slots, [0] * slots, [0] * slots
        for s in self.book.sessions.values():
            s.slot = min(range(slots), key=lambda k: self.load[k])
            self.load[s.slot] += 1
        if self.batcher is not None:
            self.batcher.close()
            self.batcher = None

    # --- sampling one call ---
    def _check_model(self, name, session: Session, required: bool = True) -> None:
        if name is None and not required:
            return
        if name != self.model:
            message = (f"model {name!r} is not served here; this endpoint serves {self.model!r} (GET /v1/models), "
                       "the model the run trains")
            session.errors.append(message)
            raise RequestError(message, "model", 404, "model_not_found")

    def check_ids(self, ids: list[int], field: str) -> list[int]:
        """Token ids given by a client (whole numbers, checked by the request's model): ids the model's vocabulary
        has."""
        for k, t in enumerate(ids):
            if t >= self.vocab_size:
                raise RequestError(f"{field}[{k}]: {t!r} is not a token id of this model (0 to "
                                   f"{self.vocab_size - 1})", field)
        return list(ids)

    def sampling(self, req: Sampling, prompt_len: int, field: str = "messages") -> dict:
        """max_tokens (as asked; `_limit` grants it), temperature, top_p, top_k, seed of a checked request, the
        endpoint's defaults for what it leaves out."""
        if self.max_model_len - prompt_len <= 0:
            raise RequestError(f"the prompt is {prompt_len} tokens; the model serves {self.max_model_len} "
                               "(max_model_len) prompt and completion together", field)
        out = {"max_tokens": req.asked_tokens() or self.max_tokens}
        for name in ("temperature", "top_p", "top_k"):
            v = getattr(req, name)
            out[name] = self.defaults[name] if v is None else v
        out["top_k"] = max(int(out["top_k"]), 0)
        out["temperature"] = float(out["temperature"])
        out["seed"] = req.seed
        return out

    def _limit(self, session: Session, prompt_ids: list[int], sampling: dict, call: Call | None = None) -> dict:
        """A run's episode limits (environment.max_turns, max_context, turn_tokens) and the endpoint's
        (max_session_calls, the model's max_model_len): a call past them is refused and ends the episode (its finish
        says which); a call asking more tokens than they leave is granted fewer, and its Call says so."""
        lim = session.limits
        if lim.get("max_calls") and len(session.calls) >= lim["max_calls"]:
            session.ended = session.ended or "max_turns"
            raise RequestError(f"this episode has made its {lim['max_calls']} calls (environment.max_turns); it "
                               "ends here", None, 400, "max_turns")
        if self.max_session_calls and len(session.calls) >= self.max_session_calls:
            raise RequestError(f"this session has made its {self.max_session_calls} calls, the endpoint's limit per "
                               "session (max_session_calls; `qgrpo serve --max-session-calls N` raises it); start "
                               "another session (another session id)", None, 400, "max_session_calls")
        caps = []
        if lim.get("max_tokens"):
            caps.append((lim["max_tokens"], "environment.turn_tokens"))
        if lim.get("max_context"):
            room = lim["max_context"] - len(prompt_ids)
            if room <= 0:
                session.ended = session.ended or "context"
                raise RequestError(f"this episode's conversation is {len(prompt_ids)} tokens, "
                                   f"environment.max_context is {lim['max_context']}; it ends here", "messages", 400,
                                   "context")
            caps.append((room, "environment.max_context"))
        caps.append((self.max_model_len - len(prompt_ids), "the model's max_model_len"))
        asked = sampling["max_tokens"]
        granted, cap = min(caps, key=lambda c: c[0])
        if granted >= asked:
            granted, cap = asked, ""
        if call is not None:
            call.asked_tokens, call.granted_tokens, call.token_cap = asked, granted, cap
        sampling = {**sampling, "max_tokens": granted}
        if lim.get("greedy"):
            sampling = {**sampling, "temperature": 0.0, "top_p": 1.0, "top_k": 0}
        return sampling

    async def sample(self, session: Session, prompt_ids: list[int], sampling: dict, call: Call | None = None
                     ) -> Sample:
        sampling = self._limit(session, prompt_ids, sampling, call)
        if not await self.admission.enter(session.id):
            self.counts["refused"] += 1
            raise RequestError("the endpoint is at capacity (sessions are admitted as room frees up, or the rollout "
                               "actors are being changed); retry after the Retry-After seconds", None, 429,
                               "rate_limit_exceeded")
        if self.batcher is None:
            self.batcher = Batcher(self.run, self.slots, self.stop_ids,
                                   lambda slot: self.coming[slot] if slot < len(self.coming) else 0)
        self.settle(_TICKET.get())  # queued now: no longer on its way
        return await self.batcher.sample(max(session.slot, 0), prompt_ids, **sampling)

    def arrive(self, session: Session) -> list:
        """A call received for `session`, on its way to the batcher (read, rendered): counted per slot, so that the
        batcher waits for it (engine.py: GATHER_COMING_MAX_S). Returns its ticket for `settle`."""
        slot = max(session.slot, 0)
        if slot < len(self.coming):
            self.coming[slot] += 1
        return [slot, True]

    def settle(self, ticket: list | None) -> None:
        """The call of `ticket` is queued, or failed before it was: no longer counted as coming."""
        if ticket and ticket[1]:
            ticket[1] = False
            if ticket[0] < len(self.coming):
                self.coming[ticket[0]] = max(self.coming[ticket[0]] - 1, 0)

    def record(self, session: Session, call: Call, sample: Sample, t0: float) -> Call:
        call.ids, call.logprobs, call.spans, call.finish = sample.ids, sample.logprobs, sample.spans, sample.finish
        call.text = self.renderer.decode(sample.ids)
        call.precision, call.started, call.seconds = self.precision, t0, time.monotonic() - t0
        sibling = call.parent is not None and bool(session.kids.get(call.parent))
        session.add(call)
        self.counts["calls"] += 1
        self.counts["forks"] += bool(call.fork) + sibling  # as Session.stats counts them
        self.counts["edited_answers"] += call.edited
        self.counts["model_tokens"] += len(sample.ids)
        return call

    # --- the routes' work ---
    async def chat(self, session: Session, body: dict) -> tuple[Call, dict]:
        req = parse(ChatRequest, body)
        self._check_model(req.model, session)
        messages = req.messages
        offer = req.tool_choice != "none"
        schemas = tool_schemas(req.tools) if offer else []
        tools = json.dumps(schemas, sort_keys=True)
        canon = [canonical(m, k) for k, m in enumerate(messages)]
        parent, j, how, edited = session.chat_parent(canon, tools, issued_ids(messages))
        call_id = self.book.next_call_id(session.id)
        fork, tail = "", None
        if parent is not None:
            new = messages[j + 1:]

            def history(p=parent):  # only for a template the bridge cannot render apart
                return [_as_message(m) for m in session.messages_of(p)] + [{"role": "assistant", "content": p.text}]
            try:
                tail = await asyncio.to_thread(self.renderer.tail, new, schemas, parent.stopped, history)
            except EpisodeError:  # a template that renders no turn apart and re-renders earlier turns: a fork
                parent, fork = None, (f"the chat template renders call {parent.id}'s conversation differently once "
                                      "new messages follow it")
        if parent is None:
            tail = await asyncio.to_thread(self.renderer.prompt, messages, schemas)
            new, j, how, edited = messages, -1, "", False
            fork = fork or session.fork_reason("chat", canon, None)
        call = Call(call_id, parent.id if parent else None, "chat", tail, base=parent.chunks if parent else (),
                    new_messages=canon[j + 1:], echoed=canon[j] if edited else None, n_messages=len(canon),
                    key=chain(tools, canon)[-1], tools=tools, fork=fork, linked_by=how, edited=edited,
                    tail_messages=[_as_message(c) for c in canon[j + 1:]])
        prompt = call.prompt_ids
        t0 = time.monotonic()
        sample = await self.sample(session, prompt, self.sampling(req, len(prompt)), call)
        self.record(session, call, sample, t0)
        own = template_parse(self.tokenizer, call.text, prompt, schemas) if offer else None
        message, parsed, failed = assistant_message(call.text, call_id.replace(":", "-"), offer, own)
        call.answer = canonical(message, 0)
        session.answered(call, [c["id"] for c in message.get("tool_calls") or ()] + [f"qgrpo-{call.id}"])
        call.tool_calls, call.tool_parse_failures = parsed, failed
        self.counts["tool_calls"] += len(parsed)
        self.counts["tool_parse_failures"] += failed
        finish = "tool_calls" if parsed and sample.finish == "stop" else sample.finish
        choice = {"index": 0, "message": message, "finish_reason": finish,
                  "logprobs": {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                           for t, lp in zip(token_text(self.tokenizer, sample.ids), sample.logprobs)]},
                  "token_ids": sample.ids, "weight_versions": spans_json(sample)}
        return call, self._response("chat.completion", call, sample, [choice], prompt)

    async def completions(self, session: Session, body: dict) -> tuple[Call, dict]:
        req = parse(CompletionRequest, body)
        self._check_model(req.model, session)
        prompt = prompt_of_completion(self.renderer, req.prompt)
        if not isinstance(req.prompt, str):
            self.check_ids(prompt, "prompt")
        call, sample = await self._token_call(session, "completions", prompt,
                                              self.sampling(req, len(prompt), field="prompt"))
        texts = token_text(self.tokenizer, sample.ids)
        offsets = [sum(len(t) for t in texts[:k]) for k in range(len(texts))]
        choice = {"index": 0, "text": call.text, "finish_reason": sample.finish,
                  "logprobs": {"tokens": texts, "token_logprobs": sample.logprobs, "top_logprobs": None,
                               "text_offset": offsets},
                  "token_ids": sample.ids, "prompt_token_ids": prompt, "weight_versions": spans_json(sample)}
        return call, self._response("text_completion", call, sample, [choice])

    async def generate(self, session: Session, body: dict) -> tuple[Call, dict]:
        req = parse(GenerateRequest, body)
        self._check_model(req.model, session, required=False)
        ids = self.check_ids(req.token_ids, "token_ids")
        params = req.sampling_params
        call, sample = await self._token_call(session, "generate", ids, self.sampling(params, len(ids), "token_ids"),
                                              set(params.stop_token_ids or ()))
        choice = {"index": 0, "finish_reason": sample.finish, "stop_reason": None, "token_ids": sample.ids,
                  "logprobs": {"content": [{"token": f"token_id:{t}", "token_id": t, "logprob": lp, "top_logprobs": []}
                                           for t, lp in zip(sample.ids, sample.logprobs)]},
                  "weight_versions": spans_json(sample)}
        out = self._response("generate", call, sample, [choice])
        out["request_id"] = str(req.request_id or call.id)
        out["output_mode"] = "tokens"
        return call, out

    async def _token_call(self, session: Session, route: str, prompt: list[int], sampling: dict,
                          stops: set[int] = frozenset()) -> tuple[Call, Sample]:
        """A token-in call; `stops`: the client's own stop tokens besides the model's (renderers send them), where
        the sample is cut (the tokens up to there are exactly those sampled)."""
        parent = session.token_parent(prompt)
        fork = "" if parent is not None else session.fork_reason(route, None, prompt)
        cut = parent.prompt_len + len(parent.ids) if parent is not None else 0
        call = Call(self.book.next_call_id(session.id), parent.id if parent else None, route, prompt[cut:],
                    base=parent.chunks if parent else (), fork=fork, linked_by="tokens" if parent else "")
        if parent is not None:
            call.tail_messages = [{"role": "user", "content": self.renderer.decode(call.own)}]
        t0 = time.monotonic()
        sample = await self.sample(session, prompt, sampling, call)
        end = next((i + 1 for i, t in enumerate(sample.ids) if t in stops), None)
        if end is not None and end < len(sample.ids):
            sample = Sample(sample.ids[:end], sample.logprobs[:end], [p for p in sample.spans if p[0] < end] or
                            sample.spans[:1], "stop", sample.seconds)
        return self.record(session, call, sample, t0), sample

    def _response(self, kind: str, call: Call, sample: Sample, choices: list[dict],
                  prompt: list[int] | None = None) -> dict:
        session = call.id.rsplit(":", 1)[0]
        root = call
        s = self.book.get(session)
        if s is not None:
            root = s.path(call)[0]
        return {"id": f"qgrpo-{call.id}", "object": kind, "created": int(time.time()), "model": self.model,
                "choices": choices, "prompt_token_ids": call.prompt_ids if prompt is None else prompt,
                "usage": {"prompt_tokens": call.prompt_len, "completion_tokens": len(sample.ids),
                          "total_tokens": call.prompt_len + len(sample.ids)},
                "system_fingerprint": f"qgrpo-{self.precision}",
                "qgrpo": {"precision": self.precision, "session": session, "call_id": call.id,
                          "parent": call.parent, "branch": root.id, "fork": call.fork or None,
                          "linked_by": call.linked_by or None, "edited": call.edited,
                          "weight_versions": spans_json(sample), "tool_parser": self.tool_parser,
                          "max_tokens": {"asked": call.asked_tokens, "granted": call.granted_tokens,
                                         "cap": call.token_cap or None}}}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "qgrpo",
                                            "root": self.model, "max_model_len": self.max_model_len}]}

    def stats(self) -> dict:
        return {**self.counts, "precision": self.precision, "open_sessions": len(self.book.sessions),
                "refused": self.counts["refused"] + 0}


def bearer(header: str) -> str:
    """The key of an `Authorization: Bearer KEY` header ("" without one)."""
    return header[7:].strip() if header[:7].lower() == "bearer " else ""


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


def spans_json(sample: Sample) -> list[dict]:
    """vLLM's weight_versions: [{"version": str, "start", "end"}] over the output tokens."""
    pts = sample.spans
    out = []
    for k, (first, v) in enumerate(pts):
        end = pts[k + 1][0] if k + 1 < len(pts) else len(sample.ids)
        if end > first or not out:
            out.append({"version": str(v), "start": first, "end": end})
    return out


def session_json(s: Session) -> dict:
    """A session's record: its calls (ids, parents, token counts, forks) and branch statistics."""
    return {"session": s.id, "step": s.step, "stats": s.stats(),
            "calls": [{"id": c.id, "parent": c.parent, "route": c.route, "prompt_tokens": c.prompt_len,
                       "completion_tokens": len(c.ids), "finish": c.finish, "fork": c.fork or None,
                       "linked_by": c.linked_by or None, "edited": c.edited,
                       "tool_calls": c.tool_calls, "prompt_token_ids": c.prompt_ids, "token_ids": c.ids,
                       "logprobs": c.logprobs, "weight_versions": [{"version": str(v), "first": f}
                                                                   for f, v in c.spans]} for c in s.calls]}


# --- Starlette app ---
def app(endpoint: Endpoint):
    """The ASGI app of `endpoint`."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def error(e: RequestError) -> JSONResponse:
        headers = {"Retry-After": str(max(1, math.ceil(endpoint.admission.wait_s / 10)))} if e.status == 429 else None
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 429: "rate_limit_error"}.get(e.status, "error")
        return JSONResponse({"error": {"message": str(e), "type": kind, "param": e.param, "code": e.code}},
                            status_code=e.status, headers=headers)

    def too_large() -> RequestError:
        mb = endpoint.max_body_bytes / 2**20
        return RequestError(f"the request body is over {endpoint.max_body_bytes} bytes ({mb:g} MiB), the endpoint's "
                            "limit (max_body_bytes; `qgrpo serve --max-body-mb N` raises it)", None, 413,
                            "request_too_large")

    async def read_json(request) -> dict:
        """The body, read up to the limit: its Content-Length first, then the bytes as they come (a chunked body
        has none)."""
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > endpoint.max_body_bytes:
            raise too_large()
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > endpoint.max_body_bytes:
                raise too_large()
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RequestError("the body is not JSON", None) from None
        if not isinstance(body, dict):
            raise RequestError("the body is a JSON object", None)
        return body

    def route(fn, stream_kind: str | None = None):
        async def handler(request):
            session = None
            try:
                body = await read_json(request)
                session = endpoint.session(endpoint.session_id(request, request.path_params.get("sid")))
                endpoint.busy[session.id] = endpoint.busy.get(session.id, 0) + 1
                ticket = endpoint.arrive(session)
                held = _TICKET.set(ticket)
                try:
                    call, out = await fn(session, body)
                finally:
                    endpoint.settle(ticket)
                    _TICKET.reset(held)
                    endpoint.seen[session.id] = time.monotonic()
                    if endpoint.busy.get(session.id, 0) <= 1:
                        endpoint.busy.pop(session.id, None)
                    else:
                        endpoint.busy[session.id] -= 1
            except RequestError as e:
                if session is not None and e.code not in ("max_turns", "context", "model_not_found"):
                    session.errors.append(str(e))  # a refused call fails its episode, loudly, even if the agent goes on
                return error(e)
            except Exception as e:  # noqa: BLE001 - a failure of ours or of the generator: an OpenAI-shaped 500
                return error(RequestError(f"the endpoint failed on this call: {type(e).__name__}: {e}", None, 500,
                                          "internal_error"))
            if stream_kind and body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return StreamingResponse(_replay(out, stream_kind, include_usage), media_type="text/event-stream")
            return JSONResponse(out)
        return handler

    async def models(request):
        return JSONResponse(endpoint.models())

    async def session_record(request):
        s = endpoint.book.get(request.path_params["sid"])
        if s is None:
            return error(RequestError(f"no open session {request.path_params['sid']!r}", None, 404, "not_found"))
        return JSONResponse(session_json(s))

    async def health(request):
        return JSONResponse({"status": "ok", **endpoint.stats()})

    routes = []
    for prefix in ("", "/sessions/{sid}"):
        routes += [Route(f"{prefix}/v1/chat/completions", route(endpoint.chat, "chat"), methods=["POST"]),
                   Route(f"{prefix}/v1/completions", route(endpoint.completions, "text"), methods=["POST"]),
                   Route(f"{prefix}/inference/v1/generate", route(endpoint.generate), methods=["POST"]),
                   Route(f"{prefix}/v1/models", models, methods=["GET"])]
    async def not_served(request):
        path = request.url.path
        what = ("the Responses API" if path.endswith("/responses") else "Anthropic's Messages API"
                if path.endswith("/messages") else f"{request.method} {path}")
        return error(RequestError(f"{what} is not served here; the routes are /v1/chat/completions, /v1/completions, "
                                  "/inference/v1/generate and /v1/models (docs/agents.md)", None, 404, "not_found"))

    routes += [Route("/v1/sessions/{sid}", session_record, methods=["GET"]), Route("/health", health),
               Route("/{path:path}", not_served, methods=["GET", "POST", "PUT", "DELETE"])]
    inner = Starlette(routes=routes)

    async def guarded(scope, receive, send):
        """Every route but GET /health asks for the endpoint's key (when it has one)."""
        if scope["type"] == "http" and endpoint.api_key and scope["path"] != "/health":
            header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), "")
            if not endpoint.authorized(header):
                what = "a wrong API key" if bearer(header) else "no API key (Authorization: Bearer KEY)"
                refusal = RequestError(f"this endpoint asks for its key; the call gave {what}. Where the key comes "
                                       f"from: {KEY_SOURCE}", None, 401, "invalid_api_key")
                await error(refusal)(scope, receive, send)
                return
        await inner(scope, receive, send)
    return guarded


async def _replay(out: dict, kind: str, include_usage: bool):
    """A finished answer as OpenAI's server-sent events: the role, the reasoning and the content in one delta each,
    the tool calls, the finish (with the token ids and the qgrpo block), the usage when asked, then [DONE]."""
    base = {"id": out["id"], "created": out["created"], "model": out["model"],
            "system_fingerprint": out["system_fingerprint"]}
    choice = out["choices"][0]
    extra = {"token_ids": choice["token_ids"], "weight_versions": choice["weight_versions"]}
    if kind == "chat":
        obj = "chat.completion.chunk"
        msg = choice["message"]
        deltas = [{"role": "assistant", "content": ""}]
        if msg.get("reasoning_content"):
            deltas.append({"reasoning_content": msg["reasoning_content"]})
        if msg.get("content"):
            deltas.append({"content": msg["content"]})
        if msg.get("tool_calls"):
            deltas.append({"tool_calls": [{"index": k, **c} for k, c in enumerate(msg["tool_calls"])]})
        chunks = [{"index": 0, "delta": d, "finish_reason": None, "logprobs": None} for d in deltas]
        chunks[-1 if len(chunks) > 1 else 0] = {**chunks[-1], "logprobs": choice["logprobs"]}
        chunks.append({"index": 0, "delta": {}, "finish_reason": choice["finish_reason"], "logprobs": None, **extra})
    else:
        obj = "text_completion"
        chunks = [{"index": 0, "text": choice["text"], "finish_reason": None, "logprobs": choice["logprobs"]},
                  {"index": 0, "text": "", "finish_reason": choice["finish_reason"], "logprobs": None, **extra}]
    for k, c in enumerate(chunks):
        event = {**base, "object": obj, "choices": [c]}
        if k == len(chunks) - 1:
            event.update(prompt_token_ids=out["prompt_token_ids"], qgrpo=out["qgrpo"])
        yield f"data: {json.dumps(event)}\n\n"
    if include_usage:
        yield f"data: {json.dumps({**base, 'object': obj, 'choices': [], 'usage': out['usage']})}\n\n"
    yield "data: [DONE]\n\n"
