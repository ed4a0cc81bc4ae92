"""The environment contract: what a multi-turn rollout asks of an environment, and the checks of what it answers.

An environment is a new instance per trajectory. `reset(row)` gives the first messages from the dataset row
(`row_of`: its prompt, its answer and its other columns); `step(turn)` takes the model's turn (its text) and answers
with a `StepResult`: the observation messages shown after that turn, whether the episode is done, an optional reward
and free-form info; `score()` is the trajectory's final score (by default the sum of the step rewards). `tools` are
plain functions the model may call (`ToolEnvironment` in tools.py parses and runs the calls).

Messages are chat messages, {"role": ..., "content": TEXT}, as a chat template takes them. The rollout never calls an
environment's methods directly: `reset_env`, `step_env` and `score_env` call them and check what comes back, so that
a contract broken by the environment (a step that returns a string, a score that is NaN) is an error naming what was
wrong, not a crash in the episode loop. `EnvFailure` is how a failed call travels back as a value.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Hashable


@dataclass
class StepResult:
    """What the environment answers to one model turn."""

    messages: list[dict]  # shown after the model's turn, e.g. [{"role": "user", "content": "higher"}]
    done: bool = False  # the episode is over (the model's turn was its final answer, or the game ended)
    reward: float | None = None  # an optional per-step reward (summed into the default score)
    info: dict = field(default_factory=dict)  # free-form; ToolEnvironment puts "tool_calls" and "tool_errors" here


class Environment:
    """Subclass it: `reset` and `step` are required, `score` and `tools` optional. A new instance per trajectory,
    made by the environment's factory (the class itself, or a function returning an instance) with the keyword
    settings of environment.params."""

    tools: list = []  # plain functions the model may call, each with type hints and a docstring (tools.tool_schema)

    def reset(self, row: dict) -> list[dict]:
        """The first messages, from the dataset row: {"prompt", "answer", and every other column of the row}."""
        raise NotImplementedError(f"{type(self).__name__}.reset(row) -> list of messages")

    def step(self, turn: str) -> StepResult:
        """The model's turn (its text) -> what the environment answers."""
        raise NotImplementedError(f"{type(self).__name__}.step(turn) -> StepResult")

    def score(self) -> float:
        """The trajectory's final score; by default the sum of the rewards its steps returned."""
        return float(sum(self.step_rewards))

    def close(self) -> None:
        """Release what the instance holds (a connection, a process): called once its trajectory is over."""

    @property
    def step_rewards(self) -> list[float]:
        """The rewards this instance's steps returned, in order (kept by `step_env`)."""
        return self.__dict__.setdefault("_step_rewards", [])


@dataclass(frozen=True)
class EnvFailure:
    """A call of one trajectory's environment that failed: returned as a value in its place in a batch, never raised,
    so that one environment's failure follows environment.on_error instead of failing the others."""

    key: Hashable  # the trajectory's key
    error: str  # "ValueError: ...", or "timed out after 10 s"
    where: str = ""  # the user's line that raised ("env.py:12 in step: ..."), "" if none
    timed_out: bool = False
    trace: str = ""  # the formatted traceback of a call that raised (for RUN_DIR/env_errors.log), "" if none


class EnvironmentOutputError(TypeError):
    """An environment answered something other than the contract says (the message says what and where)."""


def row_of(item: Any) -> dict:
    """What `reset` is given for a PromptItem: its prompt, its reference answer and its other columns."""
    return {"prompt": item.prompt, "answer": item.reference, **(item.columns or {})}


def check_messages(messages: Any, what: str) -> list[dict]:
    """`messages` as a list of chat messages (dicts with text "role" and "content"); EnvironmentOutputError naming
    `what` ("reset", "step") otherwise."""
    expected = 'expected a list of messages such as [{"role": "user", "content": "higher"}]'
    if not isinstance(messages, (list, tuple)):
        raise EnvironmentOutputError(f"{what} returned a {type(messages).__name__}; {expected}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise EnvironmentOutputError(f"{what} returned a {type(m).__name__} as message {i}; {expected}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                got = "no" if key not in m else f"a {type(m[key]).__name__} as"
                raise EnvironmentOutputError(f"{what} returned {got} {key!r} in message {i} ({str(m)[:80]}); "
                                             f"{expected}")
    return [dict(m) for m in messages]


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise EnvironmentOutputError(f"{what} is {value!r}; expected a finite number")
    return float(value)


def reset_env(env: Environment, row: dict) -> list[dict]:
    """`env.reset(row)`, checked: at least one message."""
    messages = check_messages(env.reset(row), "reset")
    if not messages:
        raise EnvironmentOutputError("reset returned no messages; the first messages are the prompt the model sees")
    return messages


def step_env(env: Environment, turn: str) -> StepResult:
    """`env.step(turn)`, checked; its reward is kept for the default score."""
    result = env.step(turn)
    if not isinstance(result, StepResult):
        raise EnvironmentOutputError(f"step returned a {type(result).__name__}; expected a StepResult(messages, "
                                     "done=False, reward=None, info={})")
    messages = check_messages(result.messages, "step")
    if not isinstance(result.info, dict):
        raise EnvironmentOutputError(f"step returned info as a {type(result.info).__name__}; expected a dict")
    reward = None if result.reward is None else _number(result.reward, "the reward step returned")
    if not messages and not result.done:
        raise EnvironmentOutputError("step returned no messages and done=False; a turn the episode goes on after "
                                     "needs an observation for the model")
    if reward is not None:
        env.step_rewards.append(reward)
    return StepResult(messages, bool(result.done), reward, dict(result.info))


def score_env(env: Environment) -> float:
    """`env.score()`, checked: a finite number."""
    return _number(env.score(), "the score")
