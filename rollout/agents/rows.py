"""Training rows from an agent's sessions: the G episodes of one dataset row (their Outcomes, rollout/agents/
contract.py, and the sessions the endpoint kept of their calls, rollout/endpoint/sessions.py) become one
GroupRollout (`episode_group`), each episode's main branch a row, under environment.branches (`branch_counts`: what
of a session trains).
"""
from __future__ import annotations

import dataclasses

from qgrpo.core.records import Completion, GroupRollout, PromptItem
from qgrpo.rollout.agents.contract import Outcome
from qgrpo.rollout.endpoint.sessions import Session, branch_row

BRANCHES = ("main", "drop")  # environment.branches: which branches of an episode train


def branch_counts(session: Session | None, branches: str = "main") -> dict:
    """What of a session trains under environment.branches: trained_calls (the calls of its trained row),
    untrained_calls (its other calls), dropped (1 when "drop" leaves out an episode that forked)."""
    if session is None or not session.calls:
        return {"trained_calls": 0, "untrained_calls": 0, "dropped": 0}
    n = len(session.calls)
    forked = len(session.leaves()) > 1
    if branches == "drop" and forked:
        return {"trained_calls": 0, "untrained_calls": n, "dropped": 1}
    main = session.stats()["main_calls"]
    return {"trained_calls": main, "untrained_calls": n - main, "dropped": 0}


def episode_group(item: PromptItem, outcomes: list[Outcome], sessions: list[Session | None], policy_version: int,
                  generator_id: str, precision: str, fallback_prompt: list[int],
                  branches: str = "main") -> tuple[GroupRollout, list[str]]:
    """The G episodes of one row as a GroupRollout: each session's main branch (Session.branches: the most sampled
    tokens, ties by the call issued first; sampled tokens mask 1, the rendered turns between them mask 0), the
    group's prompt the longest prefix the branches share (each branch's own prompt beyond it joins its completion,
    masked). `branches` (environment.branches): "main" trains each main branch; "drop" zeroes the loss mask of an
    episode that forked (its row stays, so the group keeps its G rows, and its reward still enters the group's
    mean and spread). A failed episode (its outcome's error, a session that made no call or reached a limit) keeps
    whatever it sampled, scores 0 and finishes "env_error" ("max_turns" or "context" for a limit). Returns the group
    and the problems to count (one per failed episode)."""
    if branches not in BRANCHES:
        raise ValueError(f"environment.branches: {branches!r}; one of {', '.join(BRANCHES)}")
    rows = []
    for o, s in zip(outcomes, sessions, strict=True):
        calls = s.calls if s is not None else []
        if not o.error and not calls:
            o.error = "the agent never called the endpoint (it must use the base_url and api_key it is given)"
        if s is not None and s.errors:  # what the endpoint refused says more than the client's exception
            o.error = (f"{o.error} (" if o.error else "") + f"the endpoint refused a call: {s.errors[-1]}" + \
                (")" if o.error else "")
        rows.append(branch_row(s) if calls else None)
    prompts = [r.prompt_ids for r in rows if r is not None]
    prefix = _common_prefix(prompts) if prompts else list(fallback_prompt)
    comps, problems = [], []
    for o, s, r in zip(outcomes, sessions, rows, strict=True):
        comp = _completion(r, prefix)
        if branch_counts(s, branches)["dropped"]:
            comp = dataclasses.replace(comp, model_mask=[0] * len(comp.token_ids))
        ended = s.ended if s is not None else ""
        if o.error:
            if ended and o.reward is None:  # the agent stopped at a limit the endpoint set: a truncated episode
                comp = _finished(comp, ended, 0.0)
            else:
                problems.append(o.error + (f" at {o.where}" if o.where else ""))
                turn = {"role": "user", "content": f"[agent error] {o.error}", "start": len(comp.token_ids),
                        "end": len(comp.token_ids), "tool_calls": [], "error": o.error, "where": o.where,
                        "call": "agent", **({"trace": o.trace} if o.trace else {})}
                comp = _finished(comp, "env_error", 0.0, extra_turn=turn)
        else:
            comp = _finished(comp, ended or comp.finish_reason, o.reward)
        comps.append(comp)
    return GroupRollout(item=item, prompt_ids=prefix, completions=comps, policy_version=policy_version,
                        generator_id=generator_id, precision=precision), problems


def _common_prefix(seqs: list[list[int]]) -> list[int]:
    n = min(len(s) for s in seqs)
    first = seqs[0]
    k = next((i for i in range(n) if any(s[i] != first[i] for s in seqs)), n)
    return list(first[:k])


def _completion(row, prefix: list[int]) -> Completion:
    if row is None:
        return Completion(token_ids=[], logprobs=[], finish_reason="env_error", text="", model_mask=[], turns=[],
                          token_versions=[])
    own = row.prompt_ids[len(prefix):]
    c = row.completion
    shift = len(own)
    turns = [{**t, "start": t["start"] + shift, "end": t["end"] + shift} for t in c.turns]
    if own:
        turns.insert(0, {"role": "user", "content": "", "start": 0, "end": shift, "tool_calls": [], "error": None})
    versions = c.versions(0)
    return Completion(token_ids=own + c.token_ids, logprobs=[0.0] * shift + c.logprobs, finish_reason=c.finish_reason,
                      text=c.text, model_mask=[0] * shift + c.mask(), turns=turns,
                      token_versions=([versions[0]] * shift if versions else []) + versions)


def _finished(c: Completion, finish: str, score: float | None, extra_turn: dict | None = None) -> Completion:
    turns = list(c.turns or []) + ([extra_turn] if extra_turn else [])
    return dataclasses.replace(c, finish_reason=finish, env_score=score, turns=turns)
