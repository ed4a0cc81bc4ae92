"""Why an agent's episode may have scored 0, read from its session's calls (`episode_findings`): calls cut by the
run's cap, by the agent's own max_tokens or by environment.max_context, tools offered but never called, tool calls
that did not parse, a reward no one gives. `qgrpo check` says them after its one episode (probe.py); `call_stats`
counts what they read.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from qgrpo.rollout.agents.contract import Outcome, call_default
from qgrpo.rollout.endpoint.sessions import Session


@dataclass
class Findings:
    """What one episode says about why it may have scored 0: problems (a misconfiguration that fails `qgrpo
    check`), hints (warning lines) and a summary of its calls."""

    problems: list[str] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)
    summary: str = ""


def _offered(call) -> bool:
    return bool(call.tools) and call.tools != "[]"


def call_stats(session) -> dict:
    """`session.stats()` with the keys the findings read: capped_calls, cut_calls and tool_offers computed from the
    calls where the session does not count them itself."""
    st = dict(session.stats()) if session is not None else {}
    calls = session.calls if session is not None else []
    st.setdefault("calls", len(calls))
    st.setdefault("tool_calls", sum(len(c.tool_calls) for c in calls))
    st.setdefault("tool_parse_failures", sum(c.tool_parse_failures for c in calls))
    st.setdefault("cut_calls", sum(c.finish == "length" for c in calls))
    st.setdefault("tool_offers", sum(_offered(c) for c in calls))
    return st


def _cut_by(session) -> dict[str, list[tuple[int, int]]]:
    """The session's calls cut at their max_tokens ("length"), by what granted them fewer tokens than they asked
    (the endpoint's record of each call: asked_tokens, granted_tokens, token_cap): "cap" (environment.turn_tokens),
    "context" (the room left in environment.max_context or the model's length), "asked" (nothing: the max_tokens the
    call asked, or the endpoint's default for a call that asks none); each as (asked, granted)."""
    out: dict[str, list[tuple[int, int]]] = {"cap": [], "asked": [], "context": []}
    for c in session.calls if session is not None else []:
        if c.finish != "length":
            continue
        cap = getattr(c, "token_cap", "")
        kind = "cap" if cap == "environment.turn_tokens" else "context" if cap else "asked"
        out[kind].append((getattr(c, "asked_tokens", 0) or len(c.ids), getattr(c, "granted_tokens", 0) or len(c.ids)))
    return out


def _asked(pairs: list[tuple[int, int]]) -> str:
    asked, granted = sorted({a for a, _ in pairs}), sorted({g for _, g in pairs})
    said = f"asked max_tokens={asked[0]}" if len(asked) == 1 else f"asked max_tokens {asked[0]}-{asked[-1]}"
    return f"{said}, granted {granted[0]}" + (f"-{granted[-1]}" if len(granted) > 1 else "")


def episode_findings(cfg, outcome: Outcome, session: Session | None) -> Findings:
    """Why an episode may have scored 0, from its session's calls: calls cut by the run's cap
    (environment.turn_tokens; a problem when it cut every call that asked more than it), by the agent's own
    max_tokens or by environment.max_context (hints); tools offered on its calls but none called; tool calls that
    did not parse; a None reward with no rewards.functions to score it (a problem)."""

    env, out = cfg.environment, Findings()
    st = call_stats(session)
    calls = st["calls"]
    cut = _cut_by(session)
    capped = cut["cap"]
    if capped:
        cap = env.turn_tokens
        line = (f"{len(capped)} of {_n(calls, 'call')} {'was' if len(capped) == 1 else 'were'} cut by the run's cap "
                f"({_asked(capped)}: environment.turn_tokens = {cap}); a turn cut there ends mid-sentence and a tool "
                f"call cut mid-JSON does not parse: raise environment.turn_tokens to what the agent asks, or set it "
                "to 0 (each call then gets the max_tokens it asks, up to the room left in environment.max_context)")
        every = len(capped) == calls
        (out.problems if every else out.hints).append(line)
    if cut["asked"]:
        out.hints.append(f"{len(cut['asked'])} of {_n(calls, 'call')} ran to the max_tokens the agent asked "
                         f"({_asked(cut['asked'])}; a call asking none gets {call_default(cfg.environment)}) and "
                         f"{'was' if len(cut['asked']) == 1 else 'were'} cut there; a tool call cut mid-JSON does not "
                         "parse: ask for more max_tokens in the agent")
    if cut["context"]:
        out.hints.append(f"{len(cut['context'])} of {_n(calls, 'call')} {'was' if len(cut['context']) == 1 else 'were'}"
                         f" cut by the room left in environment.max_context = {env.max_context} (or the model's "
                         f"length) ({_asked(cut['context'])}): raise environment.max_context")
    offers, tool_calls, bad = st["tool_offers"], st["tool_calls"], st["tool_parse_failures"]
    if bad:
        out.hints.append(f"the model wrote {_n(bad, 'tool call')} that did not parse (a <tool_call> left open by "
                         "max_tokens, or JSON not in the chat template's tool format); see the cuts above, or the "
                         "session's calls with `qgrpo serve`")
    if offers and not tool_calls:
        causes = ["the model does not know the chat template's tool format (a small model rarely calls a tool it is "
                  "only told about: put a worked exchange, a call and its result, in the agent's messages)",
                  "the prompt does not ask for the tool"]
        if any(cut.values()):
            causes.insert(0, "max_tokens cut the calls before a tool call was complete")
        out.hints.append(f"the agent offered tools on {_n(offers, 'call')} and the model called none; likely causes: "
                         + "; ".join(causes) + " (in a run, agent/tool_offers without agent/tool_calls_* warns)")
    if outcome.reward is None and not outcome.error and not cfg.rewards.functions:
        out.problems.append("the agent returned None (leaving the score to rewards.functions), but rewards.functions "
                            "is [] (the default with an [environment]: the agent's own reward alone); return the "
                            "episode's reward from the agent, or list rewards, e.g. [{name = \"answer_correct\"}]")
    if outcome.reward is not None and not env.weight:
        out.hints.append(f"the agent returned {outcome.reward:g}, but environment.weight = 0 leaves it out of the "
                         "reward; set environment.weight (e.g. 1.0), or return None to let rewards.functions score")
    parts = [_n(calls, "call")]
    if st["cut_calls"]:
        parts[0] += f" ({st['cut_calls']} cut at max_tokens)"
    parts.append(_n(tool_calls, "tool call") + (f" (tools offered on {_n(offers, 'call')})" if offers else ""))
    if bad:
        parts.append(_n(bad, "unparsed tool call"))
    reward = "None (rewards.functions score it)" if outcome.reward is None else f"{outcome.reward:g}"
    out.summary = ", ".join(parts) + f", reward {reward}"
    return out


def _n(k: int, word: str) -> str:
    return f"{k} {word}" + ("" if k == 1 else "s")
