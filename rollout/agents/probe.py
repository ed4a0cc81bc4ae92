"""`qgrpo check` (and `qgrpo train`, before Ray starts) for an agent program: the environments' checks
(rollout/environments/probe.py) for what the rollout actors host, these for what plays against the endpoint.

`load_problems` (with the config's other checks that need no model): the agent's file is read and its function
loaded, taking (row, client). `probe_agent` (with the reward calls): one episode of the first train row against the
real base model, served behind an endpoint in this process by the run's rollout backend, as the run will play it.
Both answer [] for an environment that does not play against the endpoint (rollout/environments/kinds.py).
"""
from __future__ import annotations

import asyncio
import secrets

from qgrpo.rollout.agents.contract import AgentClient, call_default, load_agent, play
from qgrpo.rollout.agents.findings import episode_findings
from qgrpo.rollout.agents.rows import episode_group
from qgrpo.rollout.environments.contract import row_of
from qgrpo.rollout.environments.kinds import capabilities
from qgrpo.rollout.environments.loader import NAME_FIELD, EnvironmentLoadError, environment_spec
from qgrpo.rollout.rewards.probe import Probe, first_row, reported

PROBE_ROWS = 1  # `qgrpo check` plays this many episodes against the base model


def load_problems(env_cfg) -> list[str]:
    """The agent program named by `env_cfg` ([environment]) is read and loaded in this process; [] when it loads
    (or the environment is not an agent program)."""
    if not capabilities(env_cfg.name).endpoint:
        return []
    try:
        load_agent(environment_spec(env_cfg.name, env_cfg.params))
    except EnvironmentLoadError as e:
        return [str(e)]
    return []


def probe_agent(cfg, item):
    """`qgrpo check` for an agent program: one episode of train row `item` against the real base model (a bf16
    generator of the run's rollout.backend, with its [rollout.BACKEND] settings, behind an endpoint in this process),
    as the run will play it (its call cap, limits and sampling).
    Returns a rewards Probe: the problems (an agent that raises, names the file and line; one that never calls, hangs
    or sends a foreign model name; a run cap that cut every call; a None reward with no rewards.functions), hints
    saying why the episode may have scored 0 (`episode_findings`) and what passed, with the rewards that apply."""
    from qgrpo.rollout.backends import backend_options, make_generator
    from qgrpo.rollout.endpoint.local import serve_local
    from qgrpo.rollout.modeling.models import resolve_model_path
    from qgrpo.rollout.rewards.scoring import rewards_applied

    env, out = cfg.environment, Probe()
    head = f"{NAME_FIELD} ({env.name})"
    try:
        spec = environment_spec(env.name, env.params)
        fn = load_agent(spec)
    except EnvironmentLoadError as e:
        out.problems.append(str(e))
        return out
    ro = cfg.rollout
    gen = make_generator(ro.backend, model_path=resolve_model_path(cfg.model.path, cfg.model.cache_dir),
                         precision="bf16", generator_id="check", seed=cfg.run.seed,
                         chat_template=cfg.task.chat_template,
                         **backend_options(ro.backend, ro, cfg.compute_dtype_of("rollout")))
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
        rewards = rewards_applied(cfg, spec.caps.own_score)
        out.found = f"one episode: {found.summary}, {outcome.seconds:.1f} s; rewards {rewards}"
    return out


def probe_agent_checks(cfg, progress=None) -> list[str]:
    """`probe_agent` on the first train row of `cfg`'s task, for `qgrpo check` and `qgrpo train` before Ray starts:
    what passed told to `progress`; returns the problems ([] also when the environment is not an agent program)."""
    if not capabilities(cfg.environment.name).endpoint or (item := first_row(cfg)) is None:
        return []
    return reported(probe_agent(cfg, item), progress, "agent")
