"""Sessions: each episode's calls as a tree stitched by exact tokens, and its branches as training rows.

A session is one episode of an agent (one per-session base URL, API key or X-Session-ID). Each call it makes is a node
of its tree. A call whose messages extend an earlier call's (that call's messages, then its answer as the endpoint
returned it, then new messages: tool results, a user's turn) is that call's child: its prompt is the parent's prompt
ids, the parent's sampled ids as they were sampled, then only the new messages rendered (chat.Renderer.tail). A
token-in call (/inference/v1/generate, /v1/completions with token ids or text) is the child of the call whose prompt
plus sampled ids is the longest prefix of its prompt, compared token by token. Anything else starts a new root (a
fork: another conversation, history the client rewrote, an answer edited before it was sent back), counted with its
reason; a call whose parent already has a child is a fork too (a retry, a sub-agent).

Each root-to-leaf path is a branch. The training row of an episode is its main branch, the one ending in its last
call: prompt ids (the root's prompt), then every call's sampled tokens (loss mask 1, the sampler's log-probs and
weight versions) and the tokens rendered between them (mask 0). The session's other branches are counted, not trained
(docs/agents.md). Nothing here re-tokenizes a sampled turn: the row is exactly what the generator was fed and sampled.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from qgrpo.core.records import Completion
from qgrpo.rollout.backends.versions import VersionSpans


@dataclass
class Call:
    """One call of a session: what was fed (prompt_ids) and sampled (ids, their log-probs and versions)."""

    id: str
    parent: str | None
    route: str  # "chat", "completions" or "generate"
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # (first token, version) change points of `ids`
    finish: str = ""
    text: str = ""  # the sampled text (special tokens removed)
    messages: list[tuple] = field(default_factory=list)  # canonical request messages (chat calls)
    answer: tuple | None = None  # the canonical assistant message returned (chat calls)
    tail_messages: list[dict] = field(default_factory=list)  # the new messages this call rendered (as text)
    tools: str = ""  # the request's tools, as JSON (chat calls)
    tool_calls: list[dict] = field(default_factory=list)  # parsed from the answer
    tool_parse_failures: int = 0
    asked_tokens: int = 0  # the max_tokens the call asked for (its own, else the endpoint's default)
    granted_tokens: int = 0  # what it was granted: lower when a limit cut it (token_cap says which)
    token_cap: str = ""  # the setting that lowered it: environment.turn_tokens, environment.max_context, max_model_len
    fork: str = ""  # why this call did not extend its session's conversation ("" = it did, or the first call)
    precision: str = ""
    started: float = 0.0
    seconds: float = 0.0

    @property
    def stopped(self) -> bool:
        return self.finish == "stop"

    @property
    def end(self) -> list[int]:
        return self.prompt_ids + self.ids


@dataclass
class Session:
    id: str
    slot: int = -1  # the rollout actor it is pinned to
    step: int | None = None  # the training step whose episode it is (None: a served session)
    calls: list[Call] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # refused calls (a foreign model name, a bad request), not limits
    opened: float = field(default_factory=time.monotonic)
    limits: dict = field(default_factory=dict)  # max_calls, max_context, max_tokens, greedy (a run's episode)
    ended: str = ""  # the limit a refused call reached ("max_turns", "context"), which ends the episode

    def call(self, call_id: str) -> Call:
        return next(c for c in self.calls if c.id == call_id)

    def children(self, call_id: str) -> list[Call]:
        return [c for c in self.calls if c.parent == call_id]

    # --- finding a call's parent ---
    def chat_parent(self, messages: list[tuple], tools: str) -> Call | None:
        """The call whose messages and answer this call's messages begin with, followed by at least one new message
        and none of the assistant's (the longest such); None when there is none. An assistant message among the new
        ones is a model turn this call did not sample (an answer edited before it was sent back): a fork."""
        best = None
        for c in self.calls:
            if c.route != "chat" or c.answer is None or c.tools != tools:
                continue
            n = len(c.messages)
            if len(messages) > n + 1 and messages[:n] == c.messages and messages[n] == c.answer \
                    and all(m[0] != "assistant" for m in messages[n + 1:]) \
                    and (best is None or n > len(best.messages)):
                best = c
        return best

    def token_parent(self, prompt_ids: list[int]) -> Call | None:
        """The call whose prompt + sampled ids are the longest prefix of `prompt_ids`, token by token."""
        best = None
        for c in self.calls:
            end = c.end
            if len(end) <= len(prompt_ids) and prompt_ids[:len(end)] == end \
                    and (best is None or len(end) > len(best.end)):
                best = c
        return best

    def fork_reason(self, route: str, messages: list[tuple] | None, prompt_ids: list[int] | None) -> str:
        """Why a call with no parent did not extend the session's last call ("" for the session's first call)."""
        if not self.calls:
            return ""
        last = self.calls[-1]
        if route == "chat" and last.route == "chat" and messages is not None:
            n = len(last.messages)
            if messages[:n] != last.messages:
                k = next((i for i, (a, b) in enumerate(zip(messages, last.messages)) if a != b), min(n, len(messages)))
                return f"history differs from call {last.id} at message {k}"
            if len(messages) <= n or messages[n] != last.answer:
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
            out.append(self.call(out[-1].parent))
        return out[::-1]

    def leaves(self) -> list[Call]:
        parents = {c.parent for c in self.calls}
        return [c for c in self.calls if c.id not in parents]

    def stats(self) -> dict:
        """branches (root-to-leaf paths), forks (calls that did not extend the call before them, with reasons),
        calls, tool calls and tool-call parse failures; capped_calls (granted fewer tokens than they asked), cut_calls
        (ended by the token limit: finish "length"), tool_offers (calls whose request offered tools)."""
        forks = [c for c in self.calls if c.fork]
        multi = sum(max(len(self.children(c.id)) - 1, 0) for c in self.calls)
        return {"calls": len(self.calls), "branches": len(self.leaves()), "forks": len(forks) + multi,
                "fork_reasons": [c.fork for c in forks], "tool_calls": sum(len(c.tool_calls) for c in self.calls),
                "tool_parse_failures": sum(c.tool_parse_failures for c in self.calls),
                "model_tokens": sum(len(c.ids) for c in self.calls), "errors": list(self.errors),
                "capped_calls": sum(c.granted_tokens < c.asked_tokens for c in self.calls),
                "cut_calls": sum(c.finish == "length" for c in self.calls),
                "tool_offers": sum(c.tools not in ("", "[]") for c in self.calls)}


@dataclass
class Branch:
    """One root-to-leaf path as a training row: the root's prompt ids and everything after them."""

    prompt_ids: list[int]
    completion: Completion
    versions: list[int]  # every token's version after the prompt (environment tokens: the turn before's)
    calls: int


def branch_row(session: Session, leaf: Call | None = None) -> Branch:
    """The training row of the path ending in `leaf` (default: the session's last call): the calls' sampled tokens
    (mask 1) and the rendered tokens between them (mask 0), never re-tokenized."""
    leaf = leaf or session.calls[-1]
    path = session.path(leaf)
    root = path[0]
    ids, lps, mask, turns = [], [], [], []
    spans = VersionSpans()
    prev: Call | None = None
    for c in path:
        if prev is not None:
            tail = c.prompt_ids[len(prev.end):]
            start = len(ids)
            ids += tail
            lps += [0.0] * len(tail)
            mask += [0] * len(tail)
            for m in c.tail_messages or [{"role": "user", "content": ""}]:
                turns.append({"role": m.get("role", "user"), "content": m.get("content", ""), "start": start,
                              "end": len(ids), "tool_calls": [], "error": None})
        start = len(ids)
        for first, v in c.spans:
            spans.change(start + first, v)
        ids += c.ids
        lps += c.logprobs
        mask += [1] * len(c.ids)
        turns.append({"role": "assistant", "content": c.text, "start": start, "end": len(ids),
                      "tool_calls": list(c.tool_calls), "error": None, "call": c.id,
                      **({"tool_errors": c.tool_parse_failures} if c.tool_parse_failures else {})})
        prev = c
    versions = spans.token_versions(len(ids), -1) or [spans.version] * len(ids)
    finish = {"stop": "stop", "length": "length"}.get(leaf.finish, leaf.finish or "stop")
    comp = Completion(token_ids=ids, logprobs=lps, finish_reason=finish, text=leaf.text, model_mask=mask,
                      turns=turns, token_versions=versions)
    return Branch(list(root.prompt_ids), comp, versions, len(path))


class SessionBook:
    """Every open session of the endpoint, thread-safe. Sessions are opened by the rollout supply (with the step
    whose episode they are) or, when `open_sessions` is True (`qgrpo serve`), by their first call."""

    def __init__(self, open_sessions: bool = True):
        self.open_sessions = open_sessions
        self.sessions: dict[str, Session] = {}
        self.lock = threading.Lock()
        self.calls = 0

    def open(self, sid: str, step: int | None = None, slot: int = -1, limits: dict | None = None) -> Session:
        with self.lock:
            s = self.sessions.get(sid)
            if s is None:
                s = self.sessions[sid] = Session(sid, slot, step, limits=dict(limits or {}))
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
            return self.sessions.pop(sid, None)
