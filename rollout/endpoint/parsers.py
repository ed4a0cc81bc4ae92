"""The model's tool calls parsed out of its turn, by a registry of parsers (`PARSERS`), one per format a model family
writes:

- "hermes": <tool_call>{"name": ..., "arguments": {...}}</tool_call>, as rollout/environments/tools.py parses it
  (Qwen2.5/Qwen3, Hermes, and any model told the format by the tools' system message, SmolLM2's);
- "response_template": the tokenizer's own parser (transformers' `tokenizer.parse_response`, where the model family's
  tokenizer has a `response_template`); a turn it cannot parse (a call cut by max_tokens) is parsed by "hermes", and
  the answer names "hermes";
- "llama3_json": Llama 3.1-3.3's JSON calls, {"name": ..., "parameters": {...}} (or {"type": "function", "name":
  ...}), the turn's whole text, after `<|python_tag|>` or not, several separated by ";".

The endpoint takes one (`Endpoint(tool_parser=...)`, `serve_local(tool_parser=...)`); `select` picks the default:
"response_template" where the tokenizer has one, else "hermes". Every answer names the parser that ran
(`qgrpo.tool_parser`; None where none ran: tool_choice "none", the token-in routes). A leading <think> block is split
off first, as `reasoning_content`, by every parser. A call that cannot be parsed is counted (the session's
`tool_parse_failures`) and its text stays in the content.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from qgrpo.rollout.endpoint.chat import split_reasoning
from qgrpo.rollout.endpoint.protocol import ChatMessage, Function, ToolCall
from qgrpo.rollout.environments.tools import TOOL_CALL, parse_tool_calls

HERMES, TEMPLATE, LLAMA3 = "hermes", "response_template", "llama3_json"
PREFIX_TOKENS = 32  # the prompt's last tokens handed to parse_response (where the template pre-writes the turn's start)
PYTHON_TAG = "<|python_tag|>"  # Llama 3's tool-call token (a special token: gone from text decoded without them)
LLAMA3_START = re.compile(r"\s*\{\s*\"(?:name|type)\"\s*:")  # a call's start: {"name": ..., or {"type": ...


@dataclass
class Turn:
    """A model turn parsed: its reasoning (None without a <think> block), its text after it (`rest`), that text with
    the calls taken out (`cleaned`), and the calls: {"name", "arguments"} each, or the error of one that could not be
    parsed (a string)."""

    reasoning: str | None
    rest: str
    cleaned: str
    calls: list = field(default_factory=list)


def hermes(text: str, **_) -> Turn:
    reasoning, rest = split_reasoning(text)
    return Turn(reasoning, rest, TOOL_CALL.sub("", rest).strip(), parse_tool_calls(rest))


def response_template(text: str, tokenizer=None, prompt_ids: list[int] = (), schemas: list[dict] = ()) -> Turn | None:
    """The tokenizer's own parse of a model turn: None when it has no response_template or cannot parse the turn."""
    if getattr(tokenizer, "response_template", None) is None or not hasattr(tokenizer, "parse_response"):
        return None
    try:
        prefix = tokenizer.decode(list(prompt_ids)[-PREFIX_TOKENS:])
        out = tokenizer.parse_response(text, prefix=prefix, tools=list(schemas) or None)
    except Exception:  # noqa: BLE001 - a template that does not fit this turn: the hermes parse answers
        return None
    if not isinstance(out, dict):
        return None
    rest = out.get("content")
    rest = rest if isinstance(rest, str) else ""
    reasoning = out.get("reasoning_content") or out.get("thinking") or None
    return Turn(reasoning, rest, rest.strip(), [_call(c, "arguments") for c in out.get("tool_calls") or []])


def llama3_json(text: str, **_) -> Turn:
    """Llama 3's JSON tool calls: the turn (after any <think> block) is one or more JSON objects {"name",
    "parameters"} ("arguments" read too) separated by ";", after `<|python_tag|>` or not; text after the last one is
    content. A turn that starts as a call and is not one (cut by max_tokens, not JSON) is a failed call."""
    reasoning, rest = split_reasoning(text)
    tag = re.match(r"\s*" + re.escape(PYTHON_TAG), rest)
    if not tag and not LLAMA3_START.match(rest):
        return Turn(reasoning, rest, rest.strip(), [])
    body, at, calls = rest, tag.end() if tag else 0, []
    decoder = json.JSONDecoder()
    while True:
        at = len(body) - len(body[at:].lstrip())
        if at >= len(body) or body[at] != "{":
            break
        try:
            obj, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError as e:
            calls.append(f"the tool call is not JSON ({e.msg} at character {e.pos - at}): {body[at:at + 80]}")
            return Turn(reasoning, rest, rest.strip(), calls)
        calls.append(_call(obj, "parameters"))
        after = body[at:].lstrip()
        if not after.startswith(";"):
            break
        at = len(body) - len(after) + 1
    if not calls:  # a bare <|python_tag|> and no object: code or text, not a call format this parser reads
        calls.append(f"{PYTHON_TAG} is followed by no JSON call: {body[at:at + 80]}")
    return Turn(reasoning, rest, body[at:].strip(), calls)


def _call(call, key: str) -> dict | str:
    """One parsed call as {"name", "arguments"}, or the error (a string). `key`: where the format puts the arguments
    ("arguments" is read too)."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        return f"a tool call is a JSON object with a \"name\"; got {str(call)[:80]}"
    arguments = fn.get(key, fn.get("arguments")) or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return f"the arguments of a call to {fn['name']!r} are not JSON: {arguments[:80]}"
    if not isinstance(arguments, dict):
        return f"the arguments of a call to {fn['name']!r} must be a JSON object; got {str(arguments)[:80]}"
    return {"name": fn["name"], "arguments": arguments}


PARSERS = {HERMES: hermes, TEMPLATE: response_template, LLAMA3: llama3_json}


def select(name: str | None, tokenizer) -> str:
    """The parser the endpoint runs: `name` (a key of PARSERS), or by default (None, "auto") "response_template"
    where the tokenizer has one, else "hermes"."""
    has_template = bool(getattr(tokenizer, "response_template", None))
    if name in (None, "", "auto"):
        return TEMPLATE if has_template else HERMES
    if name not in PARSERS:
        raise ValueError(f"tool_parser {name!r} is not a parser of this endpoint; choose one of "
                         f"{', '.join(sorted(PARSERS))}, or leave it out (the tokenizer's response_template where it "
                         "has one, else hermes)")
    if name == TEMPLATE and not has_template:
        raise ValueError("tool_parser 'response_template': this tokenizer has no response_template; choose "
                         f"{HERMES!r} or {LLAMA3!r}, or leave it out")
    return name


@dataclass
class Parsed:
    """An answer's message, its calls ({"name", "arguments"}), the calls that could not be parsed, and the parser that
    ran (None: none, tool_choice "none")."""

    message: ChatMessage
    calls: list[dict]
    failed: int
    parser: str | None


def parse(parser: str, text: str, call_id: str, tools: bool = True, tokenizer=None, prompt_ids: list[int] = (),
          schemas: list[dict] = ()) -> Parsed:
    """The OpenAI assistant message of a model turn, parsed by `parser` (a key of PARSERS; "response_template" falls
    back to "hermes" on a turn it cannot parse). `tools` False (tool_choice "none"): no parser runs, the reasoning is
    still split off."""
    name = parser if tools else None
    turn = None
    if name is not None:
        turn = PARSERS[name](text, tokenizer=tokenizer, prompt_ids=prompt_ids, schemas=schemas)
        if turn is None:  # the tokenizer's own parser could not parse it
            name, turn = HERMES, hermes(text)
    if turn is None:
        reasoning, rest = split_reasoning(text)
        turn = Turn(reasoning, rest, rest)
    good = [c for c in turn.calls if isinstance(c, dict)]
    failed = len(turn.calls) - len(good)
    content = turn.rest if turn.reasoning is None or turn.rest else None
    if good:
        content = (turn.rest if failed else turn.cleaned) or None
    message = ChatMessage(content=content, reasoning_content=turn.reasoning, tool_calls=[
        ToolCall(id=f"{call_id}-{k}", function=Function(name=c["name"], arguments=json.dumps(c["arguments"])))
        for k, c in enumerate(good)] or None)
    return Parsed(message, good, failed, name)
