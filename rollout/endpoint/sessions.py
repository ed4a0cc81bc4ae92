"""Sessions: each episode's calls as a tree stitched by exact tokens, and its branches as training rows.

A session is one episode of an agent (one per-session base URL, API key or X-Session-ID). Each call it makes is a node
of its tree. A chat call's parent is found first by what the endpoint itself issued and the client sent back: the ids
of the tool calls in an echoed assistant message (`issued`), or that message's `id` when it is the answer's id; then
by comparing messages: the earlier call whose messages and answer begin this call's messages, compared with
whitespace runs made one space and a leading <think> block left out (`loose`), followed by new messages and none of
the assistant's. Found either way, the call's prompt is the parent's prompt ids, the parent's sampled ids as they were
sampled, then only the new messages rendered (chat.Renderer.tail); an answer the client edited (found by its issued
ids, its text not the answer's) is still the sampled ids in the prompt, and is counted (`edited`), not a fork. A
token-in call (/inference/v1/generate, /v1/completions with token ids or text) is the child of the call whose prompt
plus sampled ids is the longest prefix of its prompt, compared token by token. Anything else starts a new root (a
fork: another conversation, history the client rewrote), counted with its reason; a call whose parent already has a
child is a fork too (a retry, a sub-agent, a concurrent call).

Each call keeps only its own ids: the ids its prompt adds past its parent's end (`own`) and the chunks before them
shared with its ancestors (`base`: the same list objects, never copied), so a session's memory, and the work of
finding a parent (by digests of the messages and of the token prefixes), grow with its calls, not their square.

Each root-to-leaf path is a branch. The main branch is the one with the most sampled tokens (ties: the earlier call
issued), whatever order the calls finished in; its training row is rows.py's `branch_row`.

This module owns every change of a session and of its calls (`Session.record`, `answered`, `refuse`, `end`, `pin`;
`SessionBook` opens, pins and closes them): the routes read sessions and ask for changes here.
"""
from __future__ import annotations

import hashlib
import itertools
import threading
import time
from array import array
from dataclasses import dataclass, field

from qgrpo.rollout.endpoint.rows import Branch, branch_row  # noqa: F401 - a branch's row, read from here too


def loose(message: tuple) -> tuple:
    """A canonical message (chat.canonical) as compared for stitching: its text with every whitespace run made one
    space and the ends stripped (a client that strips or re-wraps text still continues its conversation)."""
    role, text, calls, name = message
    return role, " ".join(text.split()), calls, name


# A fork's reason (Session.fork_reason) by its kind: what the step's agent/forks_<kind> metrics count and the
# untrained-calls warning names as the likely cause (cluster/run/env_health.py)
FORK_KINDS = {"history differs": "history", "was not sent back": "answer", "nothing new": "answer",
              "chat template renders": "template", "token": "tokens", "another route": "route"}


def fork_kind(reason: str) -> str:
    """"history", "answer", "template", "tokens" or "route": the kind of a fork reason ("" for none)."""
    return next((k for words, k in FORK_KINDS.items() if words in reason), "other") if reason else ""


def _digest(prev: bytes, item) -> bytes:
    return hashlib.blake2b(prev + repr(item).encode(), digest_size=16).digest()


def chain(tools: str, messages: list[tuple]) -> list[bytes]:
    """The digest of each prefix of `messages` (loosely compared), under `tools`: chain[k] stands for messages[:k+1]."""
    out, d = [], _digest(b"", tools)
    for m in messages:
        d = _digest(d, loose(m))
        out.append(d)
    return out


def _ids_digest(h, ids: list[int]) -> None:
    h.update(array("q", ids).tobytes())


@dataclass
class Call:
    """One call of a session: what was fed (its prompt: the shared chunks `base`, then its `own` ids) and sampled
    (ids, their log-probs and versions)."""

    id: str
    parent: str | None
    route: str  # "chat", "completions" or "generate"
    own: list[int]  # the prompt's ids past the parent's end (a root: the whole prompt)
    base: tuple = ()  # the parent's prompt and sampled ids, as the chunks (lists) they are held in: shared, not copied
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # (first token, version) change points of `ids`
    finish: str = ""
    text: str = ""  # the sampled text (special tokens removed)
    new_messages: list[tuple] = field(default_factory=list)  # canonical request messages past the parent's answer
    echoed: tuple | None = None  # the parent's answer as the client sent it back, where it differed (chat calls)
    n_messages: int = 0  # the request's messages (chat calls)
    key: bytes = b""  # digest of the request's tools and messages (chat calls: `chain`)
    answer: tuple | None = None  # the canonical assistant message returned (chat calls)
    answer_key: bytes = b""  # digest of the messages and the answer: what a continuing call's history begins with
    tail_messages: list[dict] = field(default_factory=list)  # the new messages this call rendered (as text)
    tools: str = ""  # the request's tools, as JSON (chat calls)
    tool_calls: list[dict] = field(default_factory=list)  # parsed from the answer
    tool_parse_failures: int = 0
    tool_parser: str | None = None  # the parser that ran on the answer (parsers.py; None: none ran)
    asked_tokens: int = 0  # the max_tokens the call asked for (its own, else the endpoint's default)
    granted_tokens: int = 0  # what it was granted: lower when a limit cut it (token_cap says which)
    token_cap: str = ""  # the setting that lowered it: environment.turn_tokens, environment.max_context, max_model_len
    fork: str = ""  # why this call did not extend its session's conversation ("" = it did, or the first call)
    linked_by: str = ""  # how its parent was found: "tool_call_id", "response_id", "messages", "tokens"
    edited: bool = False  # the client sent the parent's answer back with other text (the prompt has the sampled ids)
    end_key: bytes = b""  # digest of prompt + sampled ids (token-in parents)
    precision: str = ""
    started: float = 0.0
    seconds: float = 0.0

    @property
    def stopped(self) -> bool:
        return self.finish == "stop"

    @property
    def seq(self) -> int:
        """The order the call was issued in (its id's number)."""
        tail = self.id.rsplit(":", 1)[-1]
        return int(tail) if tail.isdigit() else 0

    @property
    def prompt_len(self) -> int:
        return sum(len(c) for c in self.base) + len(self.own)

    @property
    def prompt_ids(self) -> list[int]:
        """The whole prompt (built from the shared chunks: a new list)."""
        return list(itertools.chain(*self.base, self.own))

    @property
    def chunks(self) -> tuple:
        """Prompt and sampled ids as shared chunks: a child's `base`."""
        return (*self.base, self.own, self.ids)

    @property
    def end(self) -> list[int]:
        return list(itertools.chain(*self.chunks))


@dataclass
class Session:
    id: str
    slot: int = -1  # the rollout actor it is pinned to
    step: int | None = None  # the training step whose episode it is (None: a served session)
    calls: list[Call] = field(default_factory=list)  # in the order they were recorded (finished)
    errors: list[str] = field(default_factory=list)  # refused calls (a foreign model name, a bad request), not limits
    opened: float = field(default_factory=time.monotonic)
    limits: dict = field(default_factory=dict)  # max_calls, max_context, max_tokens, greedy (a run's episode)
    ended: str = ""  # the limit a refused call reached ("max_turns", "context"), which ends the episode
    issued: dict = field(default_factory=dict)  # tool-call ids and answer ids the endpoint issued -> call id
    by_id: dict = field(default_factory=dict)  # call id -> Call
    kids: dict = field(default_factory=dict)  # call id -> its children's ids
    heads: dict = field(default_factory=dict)  # answer_key -> the chat calls with that conversation and answer
    ends: dict = field(default_factory=dict)  # end_key -> call id; and ("len", n) -> the ends' lengths

    # --- every change of a session and of its calls is made here ---
    def add(self, call: Call) -> None:
        """A finished call joins the session (its parent, if any, already in)."""
        self.calls.append(call)
        self.by_id[call.id] = call
        if call.parent is not None:
            self.kids.setdefault(call.parent, []).append(call.id)
        h = hashlib.blake2b(digest_size=16)
        for chunk in call.chunks:
            _ids_digest(h, chunk)
        call.end_key = h.digest()
        self.ends.setdefault(call.end_key, call.id)

    def record(self, call: Call, sample, text: str, grant: tuple[int, int, str], precision: str,
               started: float) -> bool:
        """A call sampled (`sample`: engine.Sample; `text` its decoded tokens; `grant`: (max_tokens asked, granted,
        the setting that lowered it or "")) joins the session. True when its parent already had a child (a fork)."""
        call.ids, call.logprobs, call.spans, call.finish = sample.ids, sample.logprobs, sample.spans, sample.finish
        call.asked_tokens, call.granted_tokens, call.token_cap = grant
        call.text, call.precision, call.started, call.seconds = text, precision, started, time.monotonic() - started
        sibling = call.parent is not None and bool(self.kids.get(call.parent))
        self.add(call)
        return sibling

    def answered(self, call: Call, answer: tuple, issued: list[str], tool_calls: list[dict] = (), failed: int = 0,
                 parser: str | None = None) -> None:
        """A chat call's answer is known (`answer`: its canonical message; `tool_calls` parsed from it by `parser`,
        `failed` not parsed): continuing calls find it by its messages and answer, or by `issued` ids."""
        call.answer, call.tool_calls, call.tool_parse_failures, call.tool_parser = answer, list(tool_calls), failed, \
            parser
        call.answer_key = _digest(call.key, loose(call.answer))
        self.heads.setdefault(call.answer_key, []).append(call.id)
        for i in issued:
            self.issued[i] = call.id

    def refuse(self, message: str) -> None:
        """A refused call (another model's name, a bad request): the episode fails, loudly, even if the agent goes
        on."""
        self.errors.append(message)

    def end(self, limit: str) -> None:
        """A call past an episode limit ("max_turns", "context"): the first limit reached ends the episode."""
        self.ended = self.ended or limit

    def pin(self, slot: int) -> None:
        """The rollout actor (its slot) the session's calls go to."""
        self.slot = slot

    def call(self, call_id: str) -> Call:
        return self.by_id[call_id]

    def children(self, call_id: str) -> list[Call]:
        return [self.by_id[k] for k in self.kids.get(call_id, ())]

    def messages_of(self, call: Call) -> list[tuple]:
        """A chat call's request messages (rebuilt from the calls' deltas)."""
        path = self.path(call)
        out: list[tuple] = []
        prev = None
        for c in path:
            if prev is not None:
                out.append(c.echoed or prev.answer)
            out += c.new_messages
            prev = c
        return out

    # --- finding a call's parent ---
    def chat_parent(self, messages: list[tuple], tools: str, issued: list[str] = ()
                    ) -> tuple[Call | None, int, str, bool]:
        """(parent, the index of its answer in `messages`, how it was found, whether the client edited the answer's
        text): the call an id in `issued` names (the tool-call ids or answer id the last assistant message carries)
        when `messages` before that message are its messages; else the call whose messages and answer begin
        `messages`, compared loosely; (None, -1, "", False) when there is none. Only the last assistant message can
        be a parent's answer: one among the new messages would be a model turn this call did not sample."""
        j = max((k for k, m in enumerate(messages) if m[0] == "assistant"), default=-1)
        if j < 0 or j == len(messages) - 1:
            return None, -1, "", False
        keys = chain(tools, messages[:j + 1])
        for how, i in issued:
            c = self.by_id.get(self.issued.get(i, ""))
            if c is not None and c.answer is not None and c.tools == tools and c.n_messages == j \
                    and (j == 0 or keys[j - 1] == c.key):
                return c, j, how, keys[j] != c.answer_key
        for cid in self.heads.get(keys[j], ()):
            c = self.by_id[cid]
            if c.n_messages == j:
                return c, j, "messages", False
        return None, -1, "", False

    def token_parent(self, prompt_ids: list[int]) -> Call | None:
        """The call whose prompt + sampled ids are the longest prefix of `prompt_ids`, token by token (by digests of
        the prompt's prefixes at the lengths the calls' ends have: one pass over the prompt)."""
        lengths = sorted({c.prompt_len + len(c.ids) for c in self.calls if c.prompt_len + len(c.ids)
                          <= len(prompt_ids)})
        h, done, best = hashlib.blake2b(digest_size=16), 0, None
        for n in lengths:
            _ids_digest(h, prompt_ids[done:n])
            done = n
            cid = self.ends.get(h.copy().digest())
            if cid is not None:
                best = self.by_id[cid]
        return best

    def fork_reason(self, route: str, messages: list[tuple] | None, prompt_ids: list[int] | None,
                    tools: str = "") -> str:
        """Why a call with no parent did not extend the session's last call ("" for the session's first call)."""
        if not self.calls:
            return ""
        last = self.calls[-1]
        if route == "chat" and last.route == "chat" and messages is not None:
            had = [loose(m) for m in self.messages_of(last)]
            n = len(had)
            now = [loose(m) for m in messages]
            if now[:n] != had:
                k = next((i for i, (a, b) in enumerate(zip(now, had)) if a != b), min(n, len(now)))
                return f"history differs from call {last.id} at message {k}"
            if len(now) <= n or last.answer is None or now[n] != loose(last.answer):
                return f"the answer of call {last.id} was not sent back as returned"
            return f"nothing new after the answer of call {last.id}"
        if prompt_ids is not None:
            end = last.end
            k = next((i for i, (a, b) in enumerate(zip(prompt_ids, end)) if a != b), min(len(end), len(prompt_ids)))
            return f"its token {k} differs from call {last.id}'s tokens"
        return f"another route than call {last.id}"

    # --- branches ---
    def path(self, leaf: Call) -> list[Call]:
        out = [leaf]
        while out[-1].parent is not None:
            out.append(self.by_id[out[-1].parent])
        return out[::-1]

    def leaves(self) -> list[Call]:
        return [c for c in self.calls if not self.kids.get(c.id)]

    def sampled(self) -> dict[str, int]:
        """Each call's sampled tokens on its path from the root (its own included)."""
        out: dict[str, int] = {}
        for c in self.calls:  # a parent is recorded before its children
            out[c.id] = out.get(c.parent, 0) + len(c.ids)
        return out

    def branches(self) -> list[Call]:
        """The leaves, the main branch's first: most sampled tokens, ties by the order the calls were issued (never by
        the order they finished in); the others in the order they were issued."""
        leaves = sorted(self.leaves(), key=lambda c: c.seq)
        if not leaves:
            return []
        tokens = self.sampled()
        main = min(leaves, key=lambda c: (-tokens[c.id], c.seq))
        return [main] + [c for c in leaves if c is not main]

    def main(self) -> Call | None:
        b = self.branches()
        return b[0] if b else None

    def stats(self) -> dict:
        """branches (root-to-leaf paths), forks (calls that did not extend the call before them, with reasons),
        calls, tool calls and tool-call parse failures; capped_calls (granted fewer tokens than they asked), cut_calls
        (ended by the token limit: finish "length"), tool_offers (calls whose request offered tools), edited_answers
        (answers the client sent back with other text, continued with the sampled ids), main_calls (the calls on the
        main branch), second_children (calls continuing a call that already had a child: a retry, a concurrent call,
        a sub-agent), fork_kinds (the forks with a reason, by `fork_kind`)."""
        forks = [c for c in self.calls if c.fork]
        multi = sum(max(len(v) - 1, 0) for v in self.kids.values())
        main = self.main()
        return {"calls": len(self.calls), "branches": len(self.leaves()), "forks": len(forks) + multi,
                "fork_reasons": [c.fork for c in forks], "tool_calls": sum(len(c.tool_calls) for c in self.calls),
                "tool_parse_failures": sum(c.tool_parse_failures for c in self.calls),
                "model_tokens": sum(len(c.ids) for c in self.calls), "errors": list(self.errors),
                "capped_calls": sum(c.granted_tokens < c.asked_tokens for c in self.calls),
                "cut_calls": sum(c.finish == "length" for c in self.calls),
                "tool_offers": sum(c.tools not in ("", "[]") for c in self.calls),
                "edited_answers": sum(c.edited for c in self.calls), "second_children": multi,
                "fork_kinds": _counts(fork_kind(c.fork) for c in forks),
                "main_calls": len(self.path(main)) if main is not None else 0}


def _counts(keys) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in keys:
        out[k] = out.get(k, 0) + 1
    return out


class SessionBook:
    """Every open session of the endpoint, thread-safe, each pinned to the least loaded of `slots` rollout actors
    (`pin_slots`). Sessions are opened by the rollout supply (with the step whose episode they are) or, when
    `open_sessions` is True (`qgrpo serve`), by their first call. It keeps when each session was last called and how
    many of its calls are in flight, for idle expiry (`idle`)."""

    def __init__(self, open_sessions: bool = True):
        self.open_sessions = open_sessions
        self.sessions: dict[str, Session] = {}
        self.lock = threading.Lock()
        self.calls = 0
        self.load: list[int] = [0]  # sessions pinned per slot
        self.seen: dict[str, float] = {}  # session -> its last call's time
        self.busy: dict[str, int] = {}  # session -> calls in flight (never expired under them)
        self.swept = 0.0

    def open(self, sid: str, step: int | None = None, limits: dict | None = None) -> Session:
        """The session `sid`, opened if it is not, pinned to the least loaded slot; `limits` (a run's episode):
        max_calls, max_context, max_tokens per call, greedy."""
        with self.lock:
            s = self.sessions.get(sid)
            if s is None:
                slot = min(range(len(self.load)), key=lambda k: self.load[k])
                s = self.sessions[sid] = Session(sid, slot, step, limits=dict(limits or {}))
                self.load[slot] += 1
            return s

    def get(self, sid: str) -> Session | None:
        with self.lock:
            return self.sessions.get(sid)

    def next_call_id(self, sid: str) -> str:
        with self.lock:
            self.calls += 1
            return f"{sid}:{self.calls}"

    def close(self, sid: str) -> Session | None:
        with self.lock:
            s = self.sessions.pop(sid, None)
            if s is not None and 0 <= s.slot < len(self.load):
                self.load[s.slot] -= 1
            self.seen.pop(sid, None)
            return s

    def pin_slots(self, slots: int) -> None:
        """The rollout actors are `slots` now: every open session is pinned again, to the least loaded."""
        with self.lock:
            self.load = [0] * max(slots, 1)
            for s in self.sessions.values():
                s.pin(min(range(len(self.load)), key=lambda k: self.load[k]))
                self.load[s.slot] += 1

    # --- calls in flight and idle expiry ---
    def enter(self, sid: str) -> None:
        self.busy[sid] = self.busy.get(sid, 0) + 1
        self.seen[sid] = time.monotonic()

    def leave(self, sid: str) -> None:
        self.seen[sid] = time.monotonic()
        if self.busy.get(sid, 0) <= 1:
            self.busy.pop(sid, None)
        else:
            self.busy[sid] -= 1

    def idle(self, idle_s: float, now: float | None = None) -> list[str]:
        """The served sessions (none a run opened) with no call in flight and none for `idle_s` seconds; checked at
        most every min(1 s, idle_s / 4)."""
        now = time.monotonic() if now is None else now
        if not idle_s or now - self.swept < min(1.0, idle_s / 4):
            return []
        self.swept = now
        return [sid for sid, s in list(self.sessions.items())
                if s.step is None and not self.busy.get(sid) and now - self.seen.get(sid, s.opened) > idle_s]
