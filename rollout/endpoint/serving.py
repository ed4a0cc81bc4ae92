"""The endpoint's state and the work every route shares (`Endpoint`): the model it serves, its sessions (sessions.py
owns their changes), admission (admission.py), access (auth.py), the batcher (engine.py), the tool-call parser
(parsers.py) and the counters; the checks of what depends on the served model, the limits that grant a call its
tokens, sampling one call, and the parts of an answer every route returns (the usage, the `qgrpo` block). The routes
are routes_chat.py, routes_completions.py and routes_tokens.py; server.py assembles the app.

Limits: a run's episode limits (environment.max_turns, max_context, turn_tokens) and the endpoint's
(`max_session_calls`, the model's max_model_len): a call past them is refused and ends the episode (the session's
`ended` says which); a call asking more tokens than they leave is granted fewer, and its answer says so
(`qgrpo.max_tokens`). Served sessions idle past `idle_s` are closed.
"""
from __future__ import annotations

import time

from qgrpo.rollout.endpoint import parsers
from qgrpo.rollout.endpoint.admission import Admission, Arrivals
from qgrpo.rollout.endpoint.auth import MAX_BODY_BYTES, Access
from qgrpo.rollout.endpoint.chat import Renderer, RequestError
from qgrpo.rollout.endpoint.engine import Batcher, Run, Sample
from qgrpo.rollout.endpoint.protocol import (
    CallRecord,
    Health,
    ModelCard,
    ModelList,
    Qgrpo,
    Sampling,
    SessionRecord,
    TokenGrant,
    Usage,
    WeightSpan,
)
from qgrpo.rollout.endpoint.sessions import Call, Session, SessionBook

MAX_SERVED_SESSIONS = 10_000  # `qgrpo serve` keeps this many sessions' records (the oldest go first)


class Endpoint:
    """The endpoint's state: the model it serves, its sessions, its batcher and counters."""

    def __init__(self, *, model: str, tokenizer, stop_ids: list[int], run: Run, slots: int, precision: str,
                 max_model_len: int, max_tokens: int, chat_template: bool = True, book: SessionBook | None = None,
                 admission: Admission | None = None, defaults: dict | None = None, vocab_size: int = 0,
                 api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES, max_session_calls: int = 0,
                 idle_s: float = 0.0, tool_parser: str | None = None):
        """`api_key`: the run's secret every route but GET /health asks for (None: none, loopback only);
        `max_body_bytes`: the largest request body; `max_session_calls`: calls one session may make (0: no bound;
        a run's episodes are bounded by their limits, environment.max_turns); `idle_s`: a served session (one a call
        opened, not the run) with no call for this long is closed, its actor pin freed (0: never); `tool_parser`: a
        parser of parsers.PARSERS (None: the tokenizer's response_template where it has one, else hermes)."""
        self.model, self.tokenizer, self.run, self.slots, self.precision = model, tokenizer, run, slots, precision
        self.max_model_len, self.max_tokens = max_model_len, max_tokens
        self.vocab_size = vocab_size or len(tokenizer)  # token ids past it are refused (the model has no such row)
        self.renderer = Renderer(tokenizer, stop_ids, chat_template)
        self.stop_ids = stop_ids
        self.book = book or SessionBook(open_sessions=True)
        self.book.pin_slots(slots)
        self.admission = admission or Admission()
        self.access = Access(api_key, max_body_bytes)
        self.arrivals = Arrivals(slots)
        # the sampling a call gets for what it leaves out (a run's: rollout.temperature, top_p, top_k)
        self.defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, **(defaults or {})}
        self.batcher: Batcher | None = None
        self.counts = {"calls": 0, "refused": 0, "forks": 0, "tool_calls": 0, "tool_parse_failures": 0,
                       "model_tokens": 0, "edited_answers": 0}
        self.max_session_calls, self.idle_s = max_session_calls, idle_s
        self.tool_parser = parsers.select(tool_parser, tokenizer)

    @property
    def load(self) -> list[int]:
        """Sessions pinned per slot."""
        return self.book.load

    # --- sessions ---
    def session(self, sid: str) -> Session:
        """The open session `sid`; a served endpoint (`qgrpo serve`) opens it on its first call."""
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
        return s

    def open(self, sid: str, step: int | None = None, limits: dict | None = None) -> Session:
        """A session pinned to the least loaded slot; `limits` (a run's episode): max_calls, max_context,
        max_tokens per call, greedy (held-out evaluation samples at temperature 0 whatever the agent asks)."""
        return self.book.open(sid, step, limits)

    def close(self, sid: str) -> Session | None:
        s = self.book.close(sid)
        self.admission.leave(sid)
        return s

    def expire(self, now: float | None = None) -> list[str]:
        """Close the served sessions idle past `idle_s` (none with a call in flight; none a run opened)."""
        gone = self.book.idle(self.idle_s, now)
        for sid in gone:
            self.close(sid)
        return gone

    def repin(self, slots: int) -> None:
        """The rollout actors changed (`slots` of them now): open sessions move to live ones."""
        self.slots = slots
        self.book.pin_slots(slots)
        self.arrivals.reset(slots)
        if self.batcher is not None:
            self.batcher.close()
            self.batcher = None

    # --- checks of what depends on the served model ---
    def check_model(self, name, session: Session, required: bool = True) -> None:
        if name is None and not required:
            return
        if name != self.model:
            message = (f"model {name!r} is not served here; this endpoint serves {self.model!r} (GET /v1/models), "
                       "the model the run trains")
            session.refuse(message)
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
        """max_tokens (as asked; `grant` grants it), temperature, top_p, top_k, seed of a checked request, the
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

    # --- sampling one call ---
    def grant(self, session: Session, prompt_ids: list[int], sampling: dict) -> tuple[dict, tuple[int, int, str]]:
        """(the sampling the call gets, (max_tokens asked, granted, the setting that lowered it or "")) under the
        episode's and the endpoint's limits; a call past them is refused."""
        lim = session.limits
        if lim.get("max_calls") and len(session.calls) >= lim["max_calls"]:
            session.end("max_turns")
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
                session.end("context")
                raise RequestError(f"this episode's conversation is {len(prompt_ids)} tokens, "
                                   f"environment.max_context is {lim['max_context']}; it ends here", "messages", 400,
                                   "context")
            caps.append((room, "environment.max_context"))
        caps.append((self.max_model_len - len(prompt_ids), "the model's max_model_len"))
        asked = sampling["max_tokens"]
        granted, cap = min(caps, key=lambda c: c[0])
        if granted >= asked:
            granted, cap = asked, ""
        sampling = {**sampling, "max_tokens": granted}
        if lim.get("greedy"):
            sampling = {**sampling, "temperature": 0.0, "top_p": 1.0, "top_k": 0}
        return sampling, (asked, granted, cap)

    async def sample(self, session: Session, prompt_ids: list[int], sampling: dict
                     ) -> tuple[Sample, tuple[int, int, str]]:
        """The call's tokens, sampled on the slot its session is pinned to, once admitted; and its grant."""
        sampling, grant = self.grant(session, prompt_ids, sampling)
        if not await self.admission.enter(session.id):
            self.counts["refused"] += 1
            raise RequestError("the endpoint is at capacity (sessions are admitted as room frees up, or the rollout "
                               "actors are being changed); retry after the Retry-After seconds", None, 429,
                               "rate_limit_exceeded")
        if self.batcher is None:
            self.batcher = Batcher(self.run, self.slots, self.stop_ids, self.arrivals)
        self.arrivals.settle()  # queued now: no longer on its way
        return await self.batcher.sample(max(session.slot, 0), prompt_ids, **sampling), grant

    def record(self, session: Session, call: Call, sample: Sample, grant: tuple, t0: float) -> Call:
        sibling = session.record(call, sample, self.renderer.decode(sample.ids), grant, self.precision, t0)
        self.counts["calls"] += 1
        self.counts["forks"] += bool(call.fork) + sibling  # as Session.stats counts them
        self.counts["edited_answers"] += call.edited
        self.counts["model_tokens"] += len(sample.ids)
        return call

    # --- the parts every answer has ---
    def answer(self, call: Call, sample: Sample, prompt: list[int] | None = None) -> dict:
        """The fields of an answer every route returns (protocol._Answer): id, created, model, prompt ids, usage,
        fingerprint and the `qgrpo` block."""
        sid = call.id.rsplit(":", 1)[0]
        s = self.book.get(sid)
        root = s.path(call)[0] if s is not None else call
        spans = weight_spans(sample)
        qgrpo = Qgrpo(precision=self.precision, session=sid, call_id=call.id, parent=call.parent, branch=root.id,
                      fork=call.fork or None, linked_by=call.linked_by or None, edited=call.edited,
                      weight_versions=spans, tool_parser=call.tool_parser,
                      max_tokens=TokenGrant(asked=call.asked_tokens, granted=call.granted_tokens,
                                            cap=call.token_cap or None))
        n = len(sample.ids)
        return {"id": f"qgrpo-{call.id}", "created": int(time.time()), "model": self.model,
                "prompt_token_ids": call.prompt_ids if prompt is None else prompt,
                "usage": Usage(prompt_tokens=call.prompt_len, completion_tokens=n, total_tokens=call.prompt_len + n),
                "system_fingerprint": f"qgrpo-{self.precision}", "qgrpo": qgrpo}

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model, root=self.model, max_model_len=self.max_model_len)])

    def stats(self) -> dict:
        return {**self.counts, "precision": self.precision, "open_sessions": len(self.book.sessions)}

    def health(self, keyed: bool) -> Health:
        """Alive; the counters too for a call with the key (any call, on an endpoint without one)."""
        return Health(**self.stats()) if keyed else Health()


def weight_spans(sample: Sample) -> list[WeightSpan]:
    """vLLM's weight_versions: [{"version": str, "start", "end"}] over the output tokens."""
    pts = sample.spans
    out: list[WeightSpan] = []
    for k, (first, v) in enumerate(pts):
        end = pts[k + 1][0] if k + 1 < len(pts) else len(sample.ids)
        if end > first or not out:
            out.append(WeightSpan(version=str(v), start=first, end=end))
    return out


def session_record(s: Session) -> SessionRecord:
    """A session's record: its calls (ids, parents, token counts, forks) and branch statistics."""
    return SessionRecord(session=s.id, step=s.step, stats=s.stats(), calls=[CallRecord(
        id=c.id, parent=c.parent, route=c.route, prompt_tokens=c.prompt_len, completion_tokens=len(c.ids),
        finish=c.finish, fork=c.fork or None, linked_by=c.linked_by or None, edited=c.edited, tool_calls=c.tool_calls,
        tool_parser=c.tool_parser, prompt_token_ids=c.prompt_ids, token_ids=c.ids, logprobs=c.logprobs,
        weight_versions=[{"version": str(v), "first": f} for f, v in c.spans]) for c in s.calls])
