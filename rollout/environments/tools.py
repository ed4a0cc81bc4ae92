"""Tools: plain Python functions the model may call, described by the JSON schema transformers' chat templates take
(from the function's type hints and its Google-style docstring), and `ToolEnvironment`, which runs the calls.

The call format is the one most chat templates with tool use train their models on:

    <tool_call>{"name": "calculate", "arguments": {"expression": "123 * 456"}}</tool_call>

A model turn may hold several calls; each is run in order and answered with a tool message,
{"role": "tool", "content": RESULT}. A call that cannot be parsed, names no tool of the environment, does not bind to
the tool's parameters or raises is answered with the error as its tool message and counted in info["tool_errors"]:
the model sees what went wrong, as it would from a real tool; so is a <tool_call> never closed (a turn cut by
max_tokens inside its call). A turn without a call is the model's final answer:
the episode is done. `tools_prompt` writes the tools and the format out as text, for chat templates that do not render
`tools=` themselves (SmolLM2's does not).
"""
from __future__ import annotations

import inspect
import json
import re
from typing import Any, Callable

from qgrpo.rollout.environments.contract import Environment, StepResult

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
RESULT_CHARS = 2000  # a tool's result is cut to this many characters (a runaway result would fill the context)


class ToolSchemaError(ValueError):
    """A tool whose signature or docstring cannot be made a JSON schema; the message names it and the fix."""


def tool_name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def tool_schema(fn: Callable) -> dict:
    """The JSON schema of `fn` as chat templates take it ({"type": "function", "function": {"name", "description",
    "parameters"}}), from its type hints and Google-style docstring (transformers.utils.get_json_schema)."""
    from transformers.utils import get_json_schema

    if not callable(fn):
        raise ToolSchemaError(f"tool {fn!r} is a {type(fn).__name__}, not a function")
    try:
        return get_json_schema(fn)
    except Exception as e:  # DocstringParsingException, TypeHintParsingException, a signature that is not one
        raise ToolSchemaError(
            f"tool {tool_name(fn)!r}: its JSON schema cannot be made from its signature and docstring ({e}); give "
            "every parameter a type hint and write a docstring with a description and an `Args:` section naming "
            "each parameter, e.g.\n    def calculate(expression: str) -> str:\n        \"\"\"Evaluate an "
            "arithmetic expression.\n\n        Args:\n            expression: The expression, e.g. \"123 * 456\".\n"
            "        \"\"\"") from None


def tools_prompt(tools: list[Callable]) -> str:
    """The text describing `tools` and the call format, for a system message where the chat template does not
    render `tools=` itself. "" without tools."""
    return schemas_prompt([tool_schema(fn) for fn in tools])


def schemas_prompt(schemas: list[dict]) -> str:
    """`tools_prompt` from the tools' JSON schemas ({"type": "function", "function": {...}}, as an OpenAI request's
    `tools` carries them): the same text, so an agent behind the endpoint sees what an in-process environment shows."""
    if not schemas:
        return ""
    lines = ["You can call these tools (JSON schemas):"]
    lines += [json.dumps(s["function"]) for s in schemas]
    lines += ["To call a tool, write exactly <tool_call>{\"name\": NAME, \"arguments\": {ARGUMENT: VALUE}}</tool_call>"
              " and stop; its result comes back in a tool message. When you have the answer, reply without a tool "
              "call."]
    return "\n".join(lines)


def parse_tool_calls(turn: str) -> list[dict | str]:
    """The calls in a model turn, in order: {"name", "arguments"} for each well-formed one, and for one that is not,
    the error to answer it with (a string)."""
    calls: list[dict | str] = []
    for body in TOOL_CALL.findall(turn):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(f"the tool call is not JSON ({e.msg} at character {e.pos}): {body[:80]}")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(f"a tool call is a JSON object with a \"name\" and \"arguments\"; got {body[:80]}")
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(f"the arguments of a call to {call['name']!r} must be a JSON object; got "
                         f"{str(arguments)[:80]}")
            continue
        calls.append({"name": call["name"], "arguments": arguments})
    rest = turn[turn.rfind("</tool_call>") + len("</tool_call>"):] if "</tool_call>" in turn else turn
    if "<tool_call>" in rest:  # opened and never closed: the turn was cut (max_tokens) inside its call
        body = rest[rest.index("<tool_call>") + len("<tool_call>"):].strip()
        calls.append(f"the tool call is not closed with </tool_call> (the turn was cut, e.g. by max_tokens): "
                     f"{body[:80]}")
    return calls


def run_tool(tools: dict[str, Callable], call: dict) -> tuple[str, str | None]:
    """(the tool message's content, the error or None) of one parsed call."""
    fn = tools.get(call["name"])
    if fn is None:
        return (f"error: there is no tool {call['name']!r}; the tools are {', '.join(tools) or 'none'}",
                f"unknown tool {call['name']!r}")
    try:
        inspect.signature(fn).bind(**call["arguments"])
    except TypeError as e:
        return f"error: {call['name']}: {e}", f"{call['name']}: {e}"
    except ValueError:  # a callable without a signature: find out when called
        pass
    try:
        result: Any = fn(**call["arguments"])
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        return f"error: {error}", error
    text = result if isinstance(result, str) else json.dumps(result, default=str)
    return text[:RESULT_CHARS], None


class ToolEnvironment(Environment):
    """An environment whose only answers are tool results: each turn's tool calls are run and answered with tool
    messages; a turn without a call is the final answer (kept in `self.final`) and ends the episode. Subclass it to
    set `tools`, the first messages (`reset`; by default the row's prompt as the user's turn) and the final score
    (`score`; by default the sum of the step rewards, 0 here: override it to judge `self.final`)."""

    final: str | None = None  # the model's final answer, once a turn without a tool call ended the episode
    row: dict | None = None  # the row reset was given

    def reset(self, row: dict) -> list[dict]:
        self.row, self.final = dict(row), None
        return [{"role": "user", "content": str(row["prompt"])}]

    def step(self, turn: str) -> StepResult:
        calls = parse_tool_calls(turn)
        if not calls:
            self.final = turn
            return StepResult([], done=True)
        tools = {tool_name(fn): fn for fn in self.tools}
        messages, made, errors = [], [], 0
        for call in calls:
            if isinstance(call, str):
                content, error = f"error: {call}", call
                made.append({"name": None, "arguments": None, "error": call})
            else:
                content, error = run_tool(tools, call)
                made.append({**call, "error": error})
            errors += error is not None
            messages.append({"role": "tool", "content": content})
        return StepResult(messages, info={"tool_calls": made, "tool_errors": errors})
