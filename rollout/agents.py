"""Agent programs as a rollout source: `environment.name = "agent:FILE.py:NAME"` names an ordinary async function

    async def my_agent(row: dict, client: AgentClient) -> float | None

that plays one episode of a dataset row by calling the endpoint (rollout/endpoint) as it calls any OpenAI-compatible
server: `openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key)` with `model=client.model`, or any
framework built on it. It returns the episode's reward (the environment's score, weighted by environment.weight), or
None and lets rewards.functions score the final answer. Each episode is its own session, so its calls are stitched
into a training row by exact tokens (rollout/endpoint/sessions.py).

An agent that raises, passes its deadline (environment.episode_timeout_s, for the whole episode), sends a foreign
model name, has a call refused or never calls the endpoint fails its episode: it follows environment.on_error
("end": the episode scores 0 and its finish is "env_error", the error and the user's line in its last turn, counted
and logged as an environment's failures are; "fail": the run stops naming the row). This module loads the function
and runs episodes; the episodes' sessions become GroupRollouts in `episode_group`.
"""
from __future__ import annotations

import asyncio
import inspect
import math
import secrets
import threading
import time
from dataclasses import dataclass, field

from qgrpo.core.records import Completion, GroupRollout, PromptItem
from qgrpo.rollout.endpoint.sessions import Session, branch_row
from qgrpo.rollout.environments.contract import row_of
from qgrpo.rollout.environments.loader import NAME_FIELD, EnvironmentLoadError, EnvSpec, split_name
from qgrpo.rollout.rewards.calls import RewardLoadError, failure_trace, load_function

PROBE_ROWS = 1  # `qgrpo check` plays this many episodes against the base model


@dataclass(frozen=True)
class AgentClient:
    """What an agent is given to reach the model: an OpenAI-compatible base URL of its own session (which names the
    session), an API key (the run's key, required on every call), the model name, the session id. `openai()` makes
    the usual client."""

    base_url: str
    api_key: str
    model: str
    session_id: str

    def openai(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)


@dataclass
class Outcome:
    """One episode as the agent ended it."""

    session_id: str
    reward: float | None = None
    error: str = ""
    where: str = ""
    trace: str = ""
    timed_out: bool = False
    seconds: float = 0.0
    messages: list[dict] = field(default_factory=list)


def load_agent(spec: EnvSpec):
    """The agent function `spec` names, loaded in this process; EnvironmentLoadError naming environment.name when it
    is not a function taking (row, client)."""
    split_name(spec.name)
    try:
        fn = load_function(spec.source, NAME_FIELD, runs_in="the agent runner")
    except RewardLoadError as e:
        raise EnvironmentLoadError(str(e)) from None
    if inspect.isclass(fn):
        raise EnvironmentLoadError(f"{NAME_FIELD}: {spec.name} is a class; an agent is an async function "
                                   "`async def agent(row, client) -> float | None`")
    try:
        params = [p for p in inspect.signature(fn).parameters.values() if p.default is p.empty
                  and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = None
    if params is not None and len(params) != 2 and not spec.params:
        raise EnvironmentLoadError(f"{NAME_FIELD}: {spec.name} takes {len(params)} required arguments; an agent is "
                                   "`async def agent(row, client)` (the dataset row, and the client configuration: "
                                   "base_url, api_key, model)")
    return fn


async def play(fn, row: dict, client: AgentClient, timeout_s: float, params: dict | None = None) -> Outcome:
    """One episode: the agent called with its deadline; whatever it does is an Outcome, never an exception."""
    out = Outcome(client.session_id)
    t0 = time.monotonic()
    try:
        if inspect.iscoroutinefunction(fn):
            result = await asyncio.wait_for(fn(row, client, **(params or {})), timeout_s)
        else:  # a plain function runs on a thread of its own, so that it holds neither the other episodes nor,
            # past its deadline, the loop's end (a daemon thread, left to finish or not)
            result = await asyncio.wait_for(_in_thread(fn, row, client, **(params or {})), timeout_s)
        out.reward = _reward(result)
    except asyncio.TimeoutError:
        out.error = f"the agent did not finish within environment.episode_timeout_s = {timeout_s:g} s"
        out.timed_out = True
    except BaseException as e:  # noqa: BLE001 - a user's agent may raise anything; cancellation of the loop excepted
        if isinstance(e, asyncio.CancelledError):
            raise
        out.error = f"{type(e).__name__}: {e}"
        out.where, out.trace = failure_trace(e)
    out.seconds = time.monotonic() - t0
    return out


def _in_thread(fn, *args, **kwargs) -> asyncio.Future:
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(method, value) -> None:
        if not fut.done():
            method(value)

    def run() -> None:
        try:
            value, method = fn(*args, **kwargs), fut.set_result
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting episode
            value, method = e, fut.set_exception
        try:
            loop.call_soon_threadsafe(settle, method, value)
        except RuntimeError:  # the loop is gone: the episode ended at its deadline
            pass

    threading.Thread(target=run, name="qgrpo-agent", daemon=True).start()
    return fut


def _reward(result) -> float | None:
    if result is None:
        return None
    if isinstance(result, dict) and "reward" in result:
        result = result["reward"]
    if isinstance(result, bool) or not isinstance(result, (int, float)) or not math.isfinite(result):
        raise TypeError(f"the agent returned {result!r}; return the episode's reward (a finite number) or None")
    return float(result)


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
            import dataclasses

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
    import dataclasses

    turns = list(c.turns or []) + ([extra_turn] if extra_turn else [])
    return dataclasses.replace(c, finish_reason=finish, env_score=score, turns=turns)


def call_default(env) -> int:
    """max_tokens of an agent's call that asks none, under [environment] `env`: environment.turn_tokens (the cap of
    every call), else environment.max_context (the room left in it bounds the call anyway). The run's endpoint and
    `qgrpo check` both use it (cluster/config/turns.py says why rollout.max_new_tokens is not an agent's cap)."""
    return env.turn_tokens or env.max_context


def episode_row(item: PromptItem) -> dict:
    """What the agent is given of a dataset row: its prompt, its reference answer and its other columns."""
    return row_of(item)


def probe_agent(cfg, item):
    """`qgrpo check` for an agent program: one episode of train row `item` against the real base model (a bf16 torch
    generator behind an endpoint in this process), as the run will play it (its call cap, limits and sampling).
    Returns a rewards Probe: the problems (an agent that raises, names the file and line; one that never calls, hangs
    or sends a foreign model name; a run cap that cut every call; a None reward with no rewards.functions), hints
    saying why the episode may have scored 0 (`episode_findings`) and what passed, with the rewards that apply."""
    from qgrpo.rollout.backends import make_generator
    from qgrpo.rollout.endpoint.local import serve_local
    from qgrpo.rollout.environments.loader import environment_spec
    from qgrpo.rollout.models import resolve_model_path
    from qgrpo.rollout.rewards.probe import Probe
    from qgrpo.rollout.rewards.scoring import rewards_applied

    env, out = cfg.environment, Probe()
    head = f"{NAME_FIELD} ({env.name})"
    try:
        spec = environment_spec(env.name, env.params)
        fn = load_agent(spec)
    except EnvironmentLoadError as e:
        out.problems.append(str(e))
        return out
    gen = make_generator("torch", model_path=resolve_model_path(cfg.model.path, cfg.model.cache_dir),
                         precision="bf16", generator_id="check", seed=cfg.run.seed,
                         chat_template=cfg.task.chat_template)
    ro = cfg.rollout
    key = secrets.token_urlsafe(32)  # as in a run: an agent that does not send its client's key fails here too
    ep = serve_local([gen], model=env.served_model, max_tokens=call_default(cfg.environment),
                     chat_template=cfg.task.chat_template, api_key=key,
                     defaults={"temperature": ro.temperature, "top_p": ro.top_p, "top_k": ro.top_k})
    try:
        sid = "check"
        ep.endpoint.open(sid, 0, {"max_calls": env.max_turns, "max_context": env.max_context,
                                  "max_tokens": cfg.environment.turn_tokens})
        outcome = asyncio.run(play(fn, row_of(item), AgentClient(ep.session_url(sid), key, env.served_model, sid),
                                   env.episode_timeout_s, spec.params))
        session = ep.endpoint.close(sid)
    finally:
        ep.close()
    from qgrpo.rollout.backends.common import format_prompt

    group, problems = episode_group(item, [outcome], [session], 0, "check", "bf16",
                                    format_prompt(gen.tokenizer, item, cfg.task.chat_template))
    on = f"train row {item.prompt_id}"
    for p in problems:
        fix = ("make it finish sooner or raise environment.episode_timeout_s" if outcome.timed_out else
               f"pass model=client.model ({env.served_model!r})" if "not served here" in p else
               "call the endpoint with the client's base_url and api_key" if "never called" in p else
               "fix the agent so that it plays the episode to its end")
        out.problems.append(f"{head}: the agent failed on {on} against the base model: {p}; {fix}")
    found = episode_findings(cfg, outcome, session)
    out.problems += [f"{head}: on {on} against the base model, {p}" for p in found.problems]
    out.hints += [f"{head}: on {on} against the base model, {h}" for h in found.hints]
    if not out.problems:
        out.found = f"one episode: {found.summary}, {outcome.seconds:.1f} s; rewards {rewards_applied(cfg)}"
    return out


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
