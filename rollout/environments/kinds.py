"""The kinds of environment a config can name, and what each declares it is (`Capabilities`): the one place that
tells the kinds apart. environment.name picks the kind by its prefix:

- "" ("task"): no environment; each rollout is one completion of the task's prompt, scored by rewards.functions;
- FILE.py:NAME or MODULE:NAME ("environment"): a qgrpo Environment (rollout/environments/contract.py);
- "openenv:TARGET" ("openenv"): an OpenEnv environment through the adapter (rollout/environments/openenv.py);
- "agent:FILE.py:NAME" ("agent"): an agent program playing against the run's endpoint (rollout/agents/).

The config's rules, `qgrpo check`, the step estimate, the run's supply and health watches and the words for the
rewards read a kind's capabilities (`capabilities(environment.name)`, or an EnvSpec's `caps`), never the kind itself:
a new kind is added here, saying what it can do. tests/test_environment_kinds.py checks that no module elsewhere asks
which kind a name is.
"""
from __future__ import annotations

from dataclasses import dataclass

from qgrpo.rollout.environments.openenv import PREFIX as OPENENV_PREFIX

AGENT_PREFIX = "agent:"  # environment.name = "agent:FILE.py:NAME": an agent program behind the endpoint
PREFIXES = {"openenv": OPENENV_PREFIX, "agent": AGENT_PREFIX}  # kind -> the prefix of environment.name naming it


@dataclass(frozen=True)
class Capabilities:
    """What a kind of environment is, as the code around it asks."""

    # Its trajectories are played by the rollout actors' episode loop (rollout/episodes.py), the environment hosted
    # in Ray environment workers (actors/env_worker.py); `qgrpo check` resets and steps it (environments/probe.py).
    episode_loop: bool = False
    # A program plays its episodes against the run's OpenAI-compatible endpoint (rollout/agents/, run by
    # cluster/run/agents.py): its calls reach the generators as it makes them, its sessions are the rows, its calls'
    # own metrics are agent/*; `qgrpo check` plays one episode against the base model (rollout/agents/probe.py).
    endpoint: bool = False
    # An episode's calls can fork (two calls continue the same history differently): environment.branches says
    # which branches train.
    forks: bool = False
    # algo.dynamic_sampling can draw more groups for a step than it asked (an agent's episodes are drawn step by
    # step, as the endpoint serves them).
    redraws: bool = True
    # Each call asks its own max_tokens, as of any OpenAI-compatible server: no per-turn cap but
    # environment.turn_tokens when set (cluster/config/turns.py), and never rollout.max_new_tokens.
    asks_max_tokens: bool = False
    # The names of its tools can be read before the run (a class's `tools`, or one instance's), for the driver's
    # warnings; an OpenEnv server's tools, or an agent's, are known only to it.
    tools_known: bool = False
    # Its own score joins the reward by environment.weight (reward/environment): the words `qgrpo check` names it by;
    # "" for none (no environment).
    own_score: str = ""


KINDS = {
    "task": Capabilities(),
    "environment": Capabilities(episode_loop=True, tools_known=True, own_score="the environment's own score"),
    "openenv": Capabilities(episode_loop=True, own_score="the environment's own score"),
    "agent": Capabilities(endpoint=True, forks=True, redraws=False, asks_max_tokens=True,
                          own_score="the agent's own reward"),
}


def kind_of(name: str) -> str:
    """The kind of environment.name `name` (a key of KINDS): "task" for "", else by its prefix."""
    if not name:
        return "task"
    return next((kind for kind, prefix in PREFIXES.items() if name.startswith(prefix)), "environment")


def bare_name(name: str) -> str:
    """environment.name less the prefix that names its kind."""
    return name[len(PREFIXES.get(kind_of(name), "")):]


def capabilities(name: str) -> Capabilities:
    """What the environment environment.name = `name` names is (no file is read: the config's rules ask it too)."""
    return KINDS[kind_of(name)]
