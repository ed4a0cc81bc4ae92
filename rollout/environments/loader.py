"""Loading the environment a config names: environment.name is "FILE.py:NAME" or "MODULE:NAME", as reward functions
are named (rollout/rewards/calls.py), NAME an `Environment` subclass or a factory (a function returning a new
instance); environment.params are its keyword settings. "openenv:TARGET" names an OpenEnv environment (a class, or
a server's URL) played through the adapter in openenv.py; "agent:FILE.py:NAME" an agent program (rollout/agents/),
which this module names but does not load. Which kind a name is, and what each kind can do, is kinds.py's.

The file is read once in the driver (`environment_spec`) and its source travels in the `EnvSpec`, so the
environment workers need not find it on their node; a relative path is read against the working directory (a config
file's own paths are made absolute against its folder when it is loaded: cluster/config/tomlio.anchor_paths).
`factory_of(spec)` loads it in the process that runs the environments. Every error names environment.name or
environment.params and the fix.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from qgrpo.rollout.environments.contract import Environment
from qgrpo.rollout.environments.kinds import KINDS, PREFIXES, Capabilities, bare_name, kind_of
from qgrpo.rollout.environments.openenv import OPTIONS_KEY, OpenEnvError, is_url, openenv_core
from qgrpo.rollout.environments.openenv import factory as openenv_factory
from qgrpo.rollout.environments.tools import ToolSchemaError, tool_name, tool_schema
from qgrpo.rollout.rewards.calls import RewardLoadError, Source, load_function, read_source

NAME_FIELD, PARAMS_FIELD = "environment.name", "environment.params"
EXAMPLE = "\"env.py:GuessNumber\""


class EnvironmentLoadError(ValueError):
    """An environment that cannot be used: the message names the config field and the fix."""


@dataclass(frozen=True)
class EnvSpec:
    """Everything a process on any node needs to make the environment's instances."""

    source: Source  # environment.name (less an "openenv:" prefix), with the file's path and text for a file
    params: dict = field(default_factory=dict)  # environment.params
    kind: str = "environment"  # its kind (rollout/environments/kinds.py): "environment", "openenv" or "agent"

    @property
    def name(self) -> str:
        return PREFIXES.get(self.kind, "") + self.source.spec

    @property
    def caps(self) -> Capabilities:
        """What its kind can do (rollout/environments/kinds.py)."""
        return KINDS[self.kind]


def split_name(name: str) -> tuple[str, str]:
    """(FILE.py or MODULE, NAME) of environment.name, less the prefix of its kind; (URL, "") for an OpenEnv
    server."""
    kind, bare = kind_of(name), bare_name(name)
    if kind == "openenv" and is_url(bare):
        return bare, ""
    target, sep, attr = bare.rpartition(":")
    if not sep or not target or not attr.isidentifier():
        raise EnvironmentLoadError(f"{NAME_FIELD}: {name!r} is not FILE.py:NAME or MODULE:NAME, NAME an Environment "
                                   f"subclass or a function returning one, e.g. {EXAMPLE} (or, for an OpenEnv "
                                   "environment, openenv:FILE.py:NAME, openenv:MODULE:NAME or "
                                   "openenv:http://HOST:PORT; for an agent program, agent:FILE.py:NAME)")
    return target, attr


def environment_spec(name: str, params: dict | None = None, base: Path | None = None) -> EnvSpec:
    """The spec of environment `name` with `params`, its file read here (relative to `base`, by default the working
    directory)."""
    kind, name = kind_of(name), bare_name(name)
    if kind == "openenv" and is_url(name):
        return EnvSpec(Source(name), dict(params or {}), kind)
    split_name(name)
    try:
        return EnvSpec(read_source(name, NAME_FIELD, base), dict(params or {}), kind)
    except RewardLoadError as e:
        raise EnvironmentLoadError(str(e)) from None


def _target(spec: EnvSpec) -> Any:
    split_name(spec.source.spec)
    try:
        return load_function(spec.source, NAME_FIELD, runs_in="every environment worker")
    except RewardLoadError as e:
        raise EnvironmentLoadError(str(e).replace("not a function", "not an Environment subclass or a function "
                                                  "returning one")) from None


def _bind(target: Any, params: dict, name: str) -> None:
    """`params` bind to the keyword parameters of `target` (a class's __init__, or a factory)."""
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return  # no signature to check: found out when called
    takes = [p for p in sig.parameters.values() if p.kind is not p.VAR_POSITIONAL]
    listed = ", ".join(p.name for p in takes if p.kind is not p.VAR_KEYWORD) or "none"
    try:
        sig.bind(**params)
    except TypeError as e:
        given = ", ".join(params)
        raise EnvironmentLoadError(f"{PARAMS_FIELD}: {{{given}}} does not bind to {name}'s parameters ({listed}): "
                                   f"{e}; set {PARAMS_FIELD} to the keyword settings it takes, as a table "
                                   "{NAME = VALUE, ...}") from None
    positional = [p.name for p in takes if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if positional:
        raise EnvironmentLoadError(f"{NAME_FIELD}: {name} requires positional-only {', '.join(positional)}; "
                                   f"{PARAMS_FIELD} gives keyword settings only")


def checked_tools(tools: Any, name: str) -> list[Callable]:
    if not isinstance(tools, (list, tuple)):
        raise EnvironmentLoadError(f"{NAME_FIELD}: {name}.tools is a {type(tools).__name__}; it must be a list of "
                                   "functions")
    for fn in tools:
        try:
            tool_schema(fn)
        except ToolSchemaError as e:
            raise EnvironmentLoadError(f"{NAME_FIELD}: {name}: {e}") from None
    names = [tool_name(fn) for fn in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise EnvironmentLoadError(f"{NAME_FIELD}: {name}.tools names {', '.join(twice)} twice; each tool is called "
                                   "by its function's name")
    return list(tools)


def factory_of(spec: EnvSpec) -> Callable[[], Environment]:
    """A function making a new instance per call, loaded in this process. Checks what can be checked before an
    instance exists: the target is an Environment subclass or a callable, the params bind to its parameters, a
    class's tools have schemas. An instance that is not an Environment is refused when made."""
    if spec.kind == "openenv":
        return _openenv_factory(spec)
    if not spec.caps.episode_loop:
        raise EnvironmentLoadError(f"{NAME_FIELD}: {spec.name} is an agent program; it runs against the endpoint "
                                   "(rollout/agents/contract.py: load_agent), not as an Environment")
    target, name = _target(spec), spec.name.rpartition(":")[2]
    if inspect.isclass(target) and not issubclass(target, Environment):
        raise EnvironmentLoadError(f"{NAME_FIELD}: {spec.name} is a class but not an Environment subclass; subclass "
                                   "qgrpo.rollout.environments.Environment (reset, step, score) or name a function "
                                   "returning an instance")
    _bind(target, spec.params, name)
    if inspect.isclass(target):
        checked_tools(target.tools, name)
    return functools.partial(_made, target, spec.params, spec.name)


def _openenv_factory(spec: EnvSpec) -> Callable[[], Environment]:
    try:
        openenv_core()  # before the user's file, which imports it: the error says how to install it
        if is_url(spec.source.spec):
            return openenv_factory(spec.source.spec, spec.params, spec.name)
        target = _target(spec)
        _bind(target, {k: v for k, v in spec.params.items() if k != OPTIONS_KEY}, spec.source.spec.rpartition(":")[2])
        return openenv_factory(target, spec.params, spec.name)
    except OpenEnvError as e:
        raise EnvironmentLoadError(str(e)) from None


def _made(target: Any, params: dict, name: str) -> Environment:
    env = target(**params)
    if not isinstance(env, Environment):
        raise EnvironmentLoadError(f"{NAME_FIELD}: {name}(**{PARAMS_FIELD}) returned a {type(env).__name__}, not an "
                                   "Environment; return an instance of an Environment subclass")
    return env


def load_environment(name: str, params: dict | None = None, base: Path | None = None) -> Callable[[], Environment]:
    """The factory of environment `name` (FILE.py:NAME or MODULE:NAME) with its keyword settings `params`."""
    return factory_of(environment_spec(name, params, base))


def environment_tools(factory: Callable[[], Environment]) -> list[Callable]:
    """The tools of the environment `factory` makes (one instance is made to read them), each with a schema."""
    env = factory()
    return checked_tools(getattr(env, "tools", []), type(env).__name__)


def tool_names(spec: EnvSpec) -> list[str]:
    """The names of the tools of the environment `spec` names, for the driver's warnings: a class's `tools` read
    without an instance, a factory's from one instance it makes; [] for an OpenEnv environment (its tools are the
    server's) or when they cannot be read (the checks before the run name that)."""
    if not spec.caps.tools_known:
        return []
    try:
        target = _target(spec)
        tools = target.tools if inspect.isclass(target) else getattr(factory_of(spec)(), "tools", [])
        return [tool_name(fn) for fn in checked_tools(tools, spec.name.rpartition(":")[2])]
    except Exception:  # noqa: BLE001 - only for a warning's text
        return []
