"""How many new tokens one model turn may take, from the config: the one place the run (cluster/run/agents.py, the
episode loop), `qgrpo check` (rollout/agents/probe.py), the step estimate (machine.py) and the rules (rules.py) read
it.

An environment's turn (rollout/episodes.py) is sampled to environment.turn_tokens, else rollout.max_new_tokens. An
agent program's call asks its own `max_tokens`, as it would of any OpenAI-compatible server: by default nothing caps
it but the room left in environment.max_context (and the model's length), so the agent's request is honoured as
written; environment.turn_tokens, when set, caps every call at that many tokens (a call asking more is granted that
many and counted in agent/capped_calls). rollout.max_new_tokens is the single-turn completion length, never an agent
call's cap: a default job's 24 tokens would cut an agent's tool calls mid-JSON.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qgrpo.cluster.config.schema import Config


def _asks_max_tokens(cfg: Config) -> bool:
    """Each call of the environment asks its own max_tokens (an agent program's; rollout/environments/kinds.py)."""
    from qgrpo.rollout.environments.kinds import capabilities

    return capabilities(cfg.environment.name).asks_max_tokens


def agent_call_cap(cfg: Config) -> int:
    """The most new tokens one call of an agent program is granted, whatever it asks: environment.turn_tokens; 0 =
    no cap beyond the room left in environment.max_context and the model's length (the endpoint's session limit
    `max_tokens` is then 0, which caps nothing)."""
    return cfg.environment.turn_tokens


def agent_call_default(cfg: Config) -> int:
    """max_tokens of an agent's call that asks none: the cap, else environment.max_context (the room left in it
    bounds the call anyway; rollout/agents/contract.py's call_default, which `qgrpo check` uses too)."""
    from qgrpo.rollout.agents.contract import call_default

    return call_default(cfg.environment)


def turn_tokens(cfg: Config) -> tuple[int, str]:
    """(new tokens one model turn may take at most, the setting that says so) for the config's rollouts: a single
    completion's rollout.max_new_tokens; an environment's turn_tokens, else max_new_tokens; an agent's call cap, else
    the whole of environment.max_context (what fits)."""
    env, ro = cfg.environment, cfg.rollout
    if not env.name:
        return ro.max_new_tokens, "rollout.max_new_tokens"
    if env.turn_tokens:
        return env.turn_tokens, "environment.turn_tokens"
    if _asks_max_tokens(cfg):
        return env.max_context, "environment.max_context (environment.turn_tokens = 0: no cap per call)"
    return ro.max_new_tokens, "rollout.max_new_tokens (environment.turn_tokens = 0)"
