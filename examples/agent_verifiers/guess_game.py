"""Guess-the-number as a verifiers 0.4.0 v1 environment, written with verifiers' own API (`import verifiers.v1 as
vf`): the taskset, the task's reward, the game's scripted user and the agent program that plays it. It runs under
`.venv-verifiers/bin/python` (verifiers pins openai<3, which the main venv does not hold); run_episode.py next to
this file plays it against an OpenAI-compatible endpoint through verifiers' TrainClient, which renders the prompts to
token ids itself and calls the endpoint's `POST /inference/v1/generate`.

The game: the model is told a whole number from 1 to `high` was chosen and answers with a guess; the environment's
user replies "Higher." / "Lower." / "Correct!" (or asks for a number) for up to `max_guesses` model turns. The reward
is 1 when a guess hit the number, else 0; `guesses` (metric) counts the model's turns.

The v1 pieces, as verifiers' loader finds them in this module's `__all__` (the taskset id is the module name,
`guess_game`, importable from this folder):
- `GuessTaskset` (vf.Taskset) yields `GuessTask`s, one per secret number (`load`), each with its prompt;
- `GuessEnv` (a vf.SingleAgentEnv) drives the exchange turn by turn through `agents.agent.interaction(task)`: the
  scripted user of the game;
- `ChatHarness` (vf.Harness) is the agent program: one chat completion per segment, in-process, sent to the
  interception endpoint verifiers hands it (the loop verifiers records into the trace), with verifiers' own openai 2
  SDK. verifiers' built-in `null` harness does the same as a uv script, which needs `uv` and downloads; this one
  needs nothing. verifiers' TrainClient behind the interception does the tokenizing and the /generate calls.
"""
from __future__ import annotations

import re

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire

PROMPT = ("I am thinking of a whole number from 1 to {high}. Guess it: answer with just the number, "
          "and I will tell you if it is higher or lower.")
_NUMBER = re.compile(r"-?\d+")


def first_number(text: str | None) -> int | None:
    """The first whole number in `text`, else None."""
    found = _NUMBER.search(text or "")
    return int(found.group()) if found else None


def reply(secret: int, high: int, text: str | None) -> tuple[str, bool]:
    """The game's answer to one guess and whether the game is won."""
    guess = first_number(text)
    if guess is None or not 1 <= guess <= high:
        return f"Please answer with one whole number from 1 to {high}.", False
    if guess == secret:
        return "Correct!", True
    return ("Higher." if guess < secret else "Lower."), False


class GuessData(vf.TaskData):
    secret: int
    """The number to guess."""
    high: int = 10
    """The range is 1..high."""
    max_guesses: int = 3
    """Model turns before the game ends."""


class GuessTask(vf.Task[GuessData]):
    @vf.reward(weight=1.0)
    async def solved(self, trace: vf.Trace) -> float:
        return 1.0 if any(first_number(m.content) == self.data.secret for m in trace.assistant_messages) else 0.0

    @vf.metric
    async def guesses(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


def make_task(row: dict, config=None) -> GuessTask:
    """A task from a row {"secret": int, "high": int?, "max_guesses": int?}."""
    high = int(row.get("high", 10))
    data = GuessData(secret=int(row["secret"]), high=high, max_guesses=int(row.get("max_guesses", 3)),
                     prompt=PROMPT.format(high=high), id=str(row.get("id", row["secret"])))
    return GuessTask(data, config)


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self) -> list[GuessTask]:
        return [make_task({"secret": s}, self.config.task) for s in range(1, 11)]


class GuessEnv(vf.SingleAgentEnv):
    """The game's user: answers each guess until it is right or `max_guesses` model turns were played."""

    async def run(self, task, agents) -> None:
        data = task.data
        async with agents.agent.interaction(task) as interaction:
            segment = await interaction.turn()  # the prompted task: the model speaks first
            for _ in range(data.max_guesses - 1):
                if segment.terminated:
                    break
                answer, won = reply(data.secret, data.high, segment.last_reply)
                if won:
                    break
                segment = await interaction.turn(answer)


class ChatHarnessConfig(vf.HarnessConfig):
    pass


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """One chat completion per segment, in-process, through the interception endpoint (verifiers' contract: every
    model call goes to `endpoint` with `secret`); the default `resume()` relaunches it on the whole conversation."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(m) for m in prompt or []]
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["GuessTaskset", "GuessEnv", "ChatHarness"]
