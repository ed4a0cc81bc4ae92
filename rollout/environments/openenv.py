"""OpenEnv environments (the `openenv-core` package, Gym-like `reset`/`step` over typed actions and observations)
through qgrpo's environment contract: `environment.name = "openenv:TARGET"`, TARGET one of

- `FILE.py:NAME` or `MODULE:NAME`: an OpenEnv `Environment` subclass (the server side of an OpenEnv environment),
  run in qgrpo's own environment workers with environment.params as its constructor's keywords;
- `http://HOST:PORT` (or https, ws, wss): a running OpenEnv server (`openenv serve`, a Docker container, a Space),
  one WebSocket session per trajectory (the server must allow as many concurrent sessions as trajectories in flight).

`OpenEnvAdapter` maps one trajectory onto one OpenEnv episode:
- **reset**: `reset(seed=..., **columns)`. The seed is the row's "seed" column when it has one, else a stable hash of
  the row's prompt, so the G trajectories of a row start the same episode and rows differ. Of the row's keys
  (prompt, answer and its other columns) it passes those `reset` takes, as an OpenEnv server does: the ones it names,
  or all when it takes **kwargs. The first messages are the row's prompt with the reset observation's text after it.
- **step**: the model's turn becomes the action (`to_action`: the text in the action's one text field), the
  observation after it becomes a user message (`to_text`: its one text field, else its fields as JSON), and the
  observation's `done` and `reward` are the step's (a reward adds to the trajectory's score).

Both maps guess from the action and observation types; an environment whose types they cannot read is refused when
loaded, naming the fields, and `environment.params.openenv` says which field to use (`action_field`,
`observation_field`) and which row keys `reset` gets (`reset_args`). For anything else, subclass `OpenEnvAdapter` in
your own file, override `to_action`, `to_text` or `reset_kwargs`, and name that class as a plain environment.

openenv-core is an optional extra (`pip install qgrpo[openenv]`): this module imports it only when an OpenEnv
environment is made.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
import typing
from typing import Any, Callable

from qgrpo.rollout.environments.contract import Environment, StepResult

PREFIX = "openenv:"
OPTIONS_KEY = "openenv"  # environment.params.openenv: the adapter's own settings, not the environment's
OPTIONS = ("action_field", "observation_field", "reset_args")
# Field names taken as "the text" when a type has several text fields, in this order.
TEXT_NAMES = ("message", "text", "content", "prompt", "observation", "feedback", "output", "action", "command",
              "guess", "code", "answer")
ENVELOPE = ("done", "reward", "metadata")  # an observation's fields that are not its content
URL_SCHEMES = ("http://", "https://", "ws://", "wss://")
INSTALL = "pip install 'qgrpo[openenv]' (openenv-core 0.3.0)"


class OpenEnvError(ValueError):
    """An OpenEnv environment that cannot be adapted: the message names the field and the fix."""


def is_url(target: str) -> bool:
    return target.startswith(URL_SCHEMES)


def openenv_core() -> Any:
    """The `openenv.core` module; OpenEnvError saying how to install it when it is not."""
    try:
        import openenv.core as core
    except ImportError as e:
        raise OpenEnvError(f"environment.name names an OpenEnv environment, but openenv-core is not installed "
                           f"({e}); {INSTALL}") from None
    return core


def text_field(fields: dict[str, Any], chosen: str | None, what: str) -> str:
    """The action field the model's text goes in, among `fields` ({name: annotation or JSON-schema type}): `chosen`
    (environment.params.openenv.action_field) when given, else the only text field, else the first of TEXT_NAMES
    among several."""
    if chosen:
        if chosen not in fields:
            raise OpenEnvError(f"environment.params.openenv.action_field = {chosen!r}: {what} has no such field; its "
                               f"fields: {', '.join(fields) or 'none'}")
        return chosen
    texts = [name for name, kind in fields.items() if kind in (str, "string")]
    if len(texts) == 1:
        return texts[0]
    named = [name for name in TEXT_NAMES if name in texts]
    if named:
        return named[0]
    found = f"text fields {', '.join(texts)}" if texts else "no text field"
    raise OpenEnvError(f"{what} has {found} among {', '.join(fields) or 'no fields'}; set "
                       "environment.params.openenv.action_field to the field the model's text goes in, or subclass "
                       "OpenEnvAdapter and override to_action(turn)")


def model_fields(cls: type) -> dict[str, Any]:
    """{field: annotation} of a pydantic model class, without the envelope fields."""
    fields = getattr(cls, "model_fields", None)
    if fields is None:
        raise OpenEnvError(f"{cls.__name__} is not a pydantic model (an OpenEnv Action or Observation)")
    return {name: f.annotation for name, f in fields.items() if name not in ENVELOPE}


def action_type(env_cls: type) -> type:
    """The Action class of an OpenEnv Environment subclass: its step's `action` annotation, else the first type
    argument of its generic base Environment[Action, Observation, State]."""
    try:
        hint = typing.get_type_hints(env_cls.step).get("action")
    except Exception:  # noqa: BLE001 - unresolvable annotations: try the generic base
        hint = None
    if isinstance(hint, type) and hasattr(hint, "model_fields"):
        return hint
    for base in getattr(env_cls, "__orig_bases__", ()):
        args = typing.get_args(base)
        if args and isinstance(args[0], type) and hasattr(args[0], "model_fields"):
            return args[0]
    raise OpenEnvError(f"environment.name: {env_cls.__name__}.step does not say its action type (annotate "
                       "`def step(self, action: MyAction, ...)` or subclass Environment[MyAction, MyObservation, "
                       "State])")


class OpenEnvAdapter(Environment):
    """One trajectory = one OpenEnv episode, in this process (`env`, an OpenEnv Environment instance) or on a server
    (`base_url`). `options` are environment.params.openenv."""

    def __init__(self, env: Any = None, base_url: str = "", options: dict | None = None, timeout_s: float = 60.0):
        options = dict(options or {})
        check_options(options)
        self.options = options
        self.env, self.base_url, self.client = env, base_url, None
        if base_url:
            core = openenv_core()
            self.client = core.GenericEnvClient(base_url=base_url, message_timeout_s=timeout_s).sync()
            self.action_cls = None
            self.action_key = options.get("action_field") or remote_action_field(base_url)
        else:
            self.action_cls = action_type(type(env))
            self.action_key = text_field(model_fields(self.action_cls), options.get("action_field"),
                                         f"the action type {self.action_cls.__name__}")
        self.row: dict = {}

    # --- what a subclass may override ---
    def reset_kwargs(self, row: dict) -> dict:
        """The keywords of the episode's reset: a seed that is a function of the row, and the row's plain values
        (text, numbers) that `reset` takes: those it names, or all of them when it takes **kwargs, as an OpenEnv
        server passes them."""
        seed = row.get("seed")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            seed = int.from_bytes(hashlib.sha256(json.dumps(row.get("prompt"), default=str).encode()).digest()[:4],
                                  "little")
        wanted = self.options.get("reset_args")
        if wanted is None:
            wanted = [k for k, v in row.items() if isinstance(v, (str, int, float, bool)) or v is None]
            if self.client is None:  # as an OpenEnv server filters them: those reset names, all if it takes **kwargs
                params = inspect.signature(self.env.reset).parameters.values()
                if not any(p.kind is p.VAR_KEYWORD for p in params):
                    wanted = [k for k in wanted if k in {p.name for p in params}]
        missing = [k for k in wanted if k not in row]
        if missing:
            raise OpenEnvError(f"environment.params.openenv.reset_args names {', '.join(missing)}, which the row "
                               f"does not have; its keys: {', '.join(row)}")
        return {"seed": seed, **{k: row[k] for k in wanted if k not in ("seed", "episode_id")}}

    def to_action(self, turn: str) -> Any:
        """The model's turn as the environment's action."""
        if self.action_cls is None:
            return {self.action_key: turn}
        return self.action_cls(**{self.action_key: turn})

    def to_text(self, observation: Any) -> str:
        """The observation as the text the model is shown."""
        fields = observation if isinstance(observation, dict) else observation.model_dump()
        content = {k: v for k, v in fields.items() if k not in ENVELOPE}
        key = self.options.get("observation_field")
        if key:
            if key not in content:
                raise OpenEnvError(f"environment.params.openenv.observation_field = {key!r}: the observation has no "
                                   f"such field; its fields: {', '.join(content) or 'none'}")
            return str(content[key])
        texts = [k for k, v in content.items() if isinstance(v, str)]
        if len(texts) == 1:
            return content[texts[0]]
        named = [k for k in TEXT_NAMES if k in texts]
        if named:
            return content[named[0]]
        return json.dumps(content, default=str)

    # --- the contract ---
    def reset(self, row: dict) -> list[dict]:
        self.row = row
        kwargs = self.reset_kwargs(row)
        if self.client is not None:
            result = self.client.reset(**kwargs)
            observation = result.observation
        else:
            observation = self.env.reset(**kwargs)
        shown = self.to_text(observation)
        prompt = row.get("prompt")
        if isinstance(prompt, list):  # chat rows: the observation joins the last message
            messages = [dict(m) for m in prompt]
            if shown:
                if messages and messages[-1].get("role") == "user":
                    messages[-1]["content"] = f"{messages[-1]['content']}\n\n{shown}"
                else:
                    messages.append({"role": "user", "content": shown})
            return messages
        text = "\n\n".join(x for x in (str(prompt or ""), shown) if x)
        return [{"role": "user", "content": text}]

    def step(self, turn: str) -> StepResult:
        action = self.to_action(turn)
        if self.client is not None:
            result = self.client.step(action)
            observation, done, reward = result.observation, bool(result.done), result.reward
        else:
            observation = self.env.step(action)
            done, reward = bool(observation.done), observation.reward
        shown = self.to_text(observation)
        reward = None if reward is None else float(reward)
        messages = [{"role": "user", "content": shown}] if shown and not done else []
        return StepResult(messages, done, reward)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        elif self.env is not None and hasattr(self.env, "close"):
            self.env.close()


def remote_action_field(base_url: str) -> str:
    """The action's text field, read from the server's /schema."""
    import requests

    url = base_url.rstrip("/").replace("ws://", "http://").replace("wss://", "https://") + "/schema"
    try:
        response = requests.get(url, timeout=10)
        response.raise_for_status()
        schema = response.json()["action"]
    except Exception as e:  # noqa: BLE001 - any failure is the server's, named
        raise OpenEnvError(f"environment.name: cannot read the action schema of the OpenEnv server at {url} "
                           f"({type(e).__name__}: {e}); start the server, or set environment.params.openenv."
                           "action_field") from None
    fields = {k: v.get("type") for k, v in schema.get("properties", {}).items() if k not in ENVELOPE}
    return text_field(fields, None, f"the action schema of {base_url}")


def factory(target: Any, params: dict, name: str) -> Callable[[], OpenEnvAdapter]:
    """A function making one adapter per trajectory for `target` (an OpenEnv Environment subclass or factory, or a
    server URL) with environment.params `params`; what can be checked before an episode is checked here."""
    params = dict(params)
    options = params.pop(OPTIONS_KEY, None) or {}
    if not isinstance(options, dict):
        raise OpenEnvError(f"environment.params.{OPTIONS_KEY} is a {type(options).__name__}; it is a table "
                           f"{{{', '.join(o + ' = ...' for o in OPTIONS)}}}")
    check_options(options)
    core = openenv_core()
    if isinstance(target, str):
        if params:
            raise OpenEnvError(f"environment.params: {', '.join(params)} given to the OpenEnv server {name}; a "
                               "server's environment is made by the server, so params take only "
                               f"{OPTIONS_KEY} = {{...}}")
        return functools.partial(OpenEnvAdapter, base_url=target, options=options)
    if inspect.isclass(target):
        if not issubclass(target, core.Environment):
            raise OpenEnvError(f"environment.name: {name} is not an OpenEnv Environment subclass "
                               "(openenv.core.Environment); name one, or drop the openenv: prefix for a qgrpo "
                               "environment")
        action = action_type(target)
        text_field(model_fields(action), options.get("action_field"), f"the action type {action.__name__}")
    return functools.partial(_adapted, target, params, options, name)


def check_options(options: dict) -> None:
    """environment.params.openenv's keys and types."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise OpenEnvError(f"environment.params.{OPTIONS_KEY}: unknown {', '.join(unknown)}; it takes "
                           f"{', '.join(OPTIONS)}")
    for key in ("action_field", "observation_field"):
        if key in options and not isinstance(options[key], str):
            raise OpenEnvError(f"environment.params.{OPTIONS_KEY}.{key} is {options[key]!r}; it is a field name")
    wanted = options.get("reset_args")
    if wanted is not None and not (isinstance(wanted, list) and all(isinstance(k, str) for k in wanted)):
        raise OpenEnvError(f"environment.params.{OPTIONS_KEY}.reset_args is {wanted!r}; it is a list of the row's "
                           "keys, e.g. [\"answer\"]")


def _adapted(target: Any, params: dict, options: dict, name: str) -> OpenEnvAdapter:
    env = target(**params)
    if not isinstance(env, openenv_core().Environment):
        raise OpenEnvError(f"environment.name: {name}(**environment.params) returned a {type(env).__name__}, not an "
                           "OpenEnv Environment")
    return OpenEnvAdapter(env, options=options)
