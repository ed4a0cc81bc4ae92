"""A session's branch as a training row: the root's prompt ids, then every call's sampled tokens (loss mask 1, the
sampler's log-probs and weight versions) and the tokens rendered between them (mask 0), never re-tokenized. Which
branches train is environment.branches (rollout/agents/rows.py: episode_group; docs/agents.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from qgrpo.core.records import Completion
from qgrpo.rollout.backends.versions import VersionSpans

if TYPE_CHECKING:
    from qgrpo.rollout.endpoint.sessions import Call, Session


@dataclass
class Branch:
    """One root-to-leaf path as a training row: the root's prompt ids and everything after them."""

    prompt_ids: list[int]
    completion: Completion
    versions: list[int]  # every token's version after the prompt (environment tokens: the turn before's)
    calls: int


def branch_row(session: Session, leaf: Call | None = None) -> Branch:
    """The training row of the path ending in `leaf` (default: the session's main branch, Session.branches): the
    calls' sampled tokens (mask 1) and the rendered tokens between them (mask 0), never re-tokenized."""
    leaf = leaf or session.main()
    path = session.path(leaf)
    root = path[0]
    ids, lps, mask, turns = [], [], [], []
    spans = VersionSpans()
    prev: Call | None = None
    for c in path:
        if prev is not None:
            tail = c.own
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
