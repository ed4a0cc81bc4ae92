"""The user's contract: `environment.name = "agent:FILE.py:NAME"` names an ordinary async function

    async def my_agent(row: dict, client: AgentClient) -> float | None

that plays one episode of a dataset row by calling the endpoint (rollout/endpoint) as it calls any OpenAI-compatible
server: `openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key)` with `model=client.model`, or any
framework built on it. It returns the episode's reward (the environment's score, weighted by environment.weight), or
None and lets rewards.functions score the final answer. Each episode is its own session, so its calls are stitched
into a training row by exact tokens (rollout/endpoint/sessions.py; the rows: rows.py).

An agent that raises, passes its deadline (environment.episode_timeout_s, for the whole episode), sends a foreign
model name, has a call refused or never calls the endpoint fails its episode: it follows environment.on_error
("end": the episode scores 0 and its finish is "env_error", the error and the user's line in its last turn, counted
and logged as an environment's failures are; "fail": the run stops naming the row). This module loads the function
(`load_agent`), says what it is given (`episode_row`, `AgentClient`, `call_default`) and plays an episode (`play`),
whatever the function does, into an `Outcome`.
"""
from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
from dataclasses import dataclass, field

from qgrpo.core.records import PromptItem
from qgrpo.rollout.environments.contract import row_of
from qgrpo.rollout.environments.loader import NAME_FIELD, EnvironmentLoadError, EnvSpec, split_name
from qgrpo.rollout.rewards.calls import RewardLoadError, failure_trace, load_function


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


def call_default(env) -> int:
    """max_tokens of an agent's call that asks none, under [environment] `env`: environment.turn_tokens (the cap of
    every call), else environment.max_context (the room left in it bounds the call anyway). The run's endpoint and
    `qgrpo check` both use it (cluster/config/turns.py says why rollout.max_new_tokens is not an agent's cap)."""
    return env.turn_tokens or env.max_context


def episode_row(item: PromptItem) -> dict:
    """What the agent is given of a dataset row: its prompt, its reference answer and its other columns."""
    return row_of(item)
