"""OpenAI chat messages to token ids: the rendering of a call's messages (whole, or only the tail after an earlier
call's exact tokens). The model's tool calls are parsed out of its text by parsers.py.

Messages are first made canonical (`canonical`): content parts joined into text, an assistant's `tool_calls` kept as
(name, arguments) pairs, ids left out (clients make up their own). Two messages are the same when their canonical
forms are. Rendering is the episode loop's (rollout/episodes.py: ChatTemplate or PlainText), so an agent behind the
endpoint sees its conversation as an in-process environment's would be rendered. A chat template that renders `tools=`
gets the request's tool schemas; one that ignores them (SmolLM2's) gets them described in a system message placed
first (rollout/environments/tools.py: schemas_prompt), and the model calls a tool by writing
<tool_call>{"name": ..., "arguments": {...}}</tool_call> (the "hermes" format; parsers.py holds the others). A
leading <think>...</think> block is answered apart, as `reasoning_content`, and is no part of what identifies an
echoed assistant message. An assistant message is rendered from the text the model sampled (its tool calls as
written), never from the client's reconstruction, so the rendering of a conversation is the same whichever client
sends it.
"""
from __future__ import annotations

import json
import re
import threading

from qgrpo.rollout.environments.tools import schemas_prompt
from qgrpo.rollout.episodes import ChatTemplate, EpisodeError, PlainText, encode, render

# a leading reasoning block: <think>...</think>, or an unclosed <think> (cut by max_tokens) to the end
THINK = re.compile(r"\s*<think>(.*?)(?:</think>\s*|\Z)", re.DOTALL)
BRIDGE_MARKER = "qgrpo-bridge-9c41"  # the placeholder assistant turn's text, after which the tail is rendered


class RequestError(ValueError):
    """A request the endpoint refuses (HTTP 400): the message names the field and the fix."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str = "invalid_request"):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def text_of(content, where: str) -> str:
    """A message's content as text: a string, None (an assistant message with tool calls only), or a list of parts of
    type "text" (other parts, images, are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"{where}.content[{k}]: only text parts are served, got {kind!r}", where)
            out.append(str(part.get("text", "")))
        return "".join(out)
    raise RequestError(f"{where}.content: a string or a list of text parts, got {type(content).__name__}", where)


def _arguments(raw, where: str):
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return raw  # kept as the text it is: compared as such
    return raw


def canonical(message, k: int) -> tuple:
    """(role, text, ((name, arguments JSON), ...), name) of message `k`: what identifies it for stitching."""
    where = f"messages[{k}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(f"{where}: a message is an object with a \"role\" and a \"content\"", where)
    role = message["role"]
    if role == "developer":  # OpenAI's newer name for the system role
        role = "system"
    if role not in ("system", "user", "assistant", "tool", "function"):
        raise RequestError(f"{where}.role: {role!r} is not a chat role (system, user, assistant, tool)", where)
    calls = []
    for j, call in enumerate(message.get("tool_calls") or []):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{where}.tool_calls[{j}]: expected {{\"type\": \"function\", \"function\": "
                               "{\"name\": ..., \"arguments\": \"{...}\"}}", where)
        calls.append((fn["name"], json.dumps(_arguments(fn.get("arguments"), where), sort_keys=True)))
    text = text_of(message.get("content"), where)
    if role == "assistant":  # an answer echoed with or without its reasoning block is the same answer
        text = split_reasoning(text)[1]
    return role, text, tuple(calls), message.get("name") or ""


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(the reasoning of a leading <think>...</think> block, the text after it); (None, text) without one. An unclosed
    block (cut by max_tokens) is all reasoning. The sampled tokens are not touched: this only shapes the answer."""
    m = THINK.match(text)
    if m is None:
        return None, text
    return m.group(1).strip(), text[m.end():]


def tool_schemas(tools, where: str = "tools") -> list[dict]:
    """The request's `tools` checked: function tools only, each with a name."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError(f"{where}: a list of {{\"type\": \"function\", \"function\": {{...}}}}", where)
    out = []
    for k, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise RequestError(f"{where}[{k}]: only function tools are served ({{\"type\": \"function\", "
                               "\"function\": {\"name\": ..., \"parameters\": {...}}}})", where)
        out.append({"type": "function", "function": {k2: v for k2, v in fn.items() if k2 != "strict"}})
    return out


class Renderer:
    """The chat rendering of one tokenizer: `prompt(messages, tools)` for a conversation's first call, `tail(...)`
    for the messages after an earlier call's exact tokens. `stop_ids`: the generator's stop tokens."""

    def __init__(self, tokenizer, stop_ids: list[int], chat_template: bool = True):
        self.tokenizer = tokenizer
        self.stop_text = tokenizer.decode([stop_ids[0]]) if stop_ids else ""
        self.chat = bool(chat_template and getattr(tokenizer, "chat_template", None))
        # the endpoint renders off its event loop (asyncio.to_thread): one rendering at a time, so that the tokenizer
        # and the caches below are never used by two rendering threads at once
        self.lock = threading.Lock()
        self._native: dict[str, bool] = {}  # tools JSON -> the template renders them itself
        self._texts: dict[str, object] = {}  # tools JSON -> its ChatTemplate / PlainText

    def native_tools(self, schemas: list[dict]) -> bool:
        """The chat template renders `tools=` itself (Qwen's, in the hermes format); else they are described in a
        system message (SmolLM2's ignores them). A template that asks for another call format (Llama 3's bare JSON)
        is rendered natively; its calls are parsed by the endpoint's parser for it (parsers.py: llama3_json)."""
        key = json.dumps(schemas, sort_keys=True)
        if key not in self._native:
            probe = [{"role": "user", "content": "q"}]
            self._native[key] = bool(schemas) and self.chat and (
                render(self.tokenizer, probe, schemas, True) != render(self.tokenizer, probe, None, True))
        return self._native[key]

    def _text(self, schemas: list[dict]):
        key = json.dumps(schemas, sort_keys=True)
        if key not in self._texts:
            native = self.native_tools(schemas)
            self._texts[key] = (ChatTemplate(self.tokenizer, self.stop_text, schemas if native else None)
                                if self.chat else PlainText(self.tokenizer, self.stop_text))
        return self._texts[key]

    def messages(self, messages: list[dict], schemas: list[dict], tools_message: bool = True) -> list[dict]:
        """What the template renders: {"role", "content"} only (and the tool calls where the template renders them),
        with the tools' system message first where the template does not render `tools=` (`tools_message`)."""
        out = []
        for k, m in enumerate(messages):
            role, text, calls, _ = canonical(m, k)
            msg = {"role": "tool" if role == "function" else role, "content": text}
            if calls and role == "assistant" and self.native_tools(schemas):
                msg["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": json.loads(a)}}
                                     for n, a in calls]
            elif calls and role == "assistant":  # a call the client wrote (a worked example): as the model writes one
                msg["content"] = text + "".join(
                    f"<tool_call>{json.dumps({'name': n, 'arguments': json.loads(a)})}</tool_call>" for n, a in calls)
            out.append(msg)
        if tools_message and schemas and not self.native_tools(schemas):
            out.insert(0, {"role": "system", "content": schemas_prompt(schemas)})
        return out

    def prompt(self, messages: list[dict], schemas: list[dict]) -> list[int]:
        """The token ids of a whole conversation, ending with the assistant's header."""
        if not messages:
            raise RequestError("messages: at least one message", "messages")
        with self.lock:
            return self._text(schemas).prompt(self.messages(messages, schemas))

    def tail(self, new: list[dict], schemas: list[dict], stopped: bool, history=None) -> list[int]:
        """The token ids of `new` messages after the model's sampled turn (`stopped`: it ended with a stop token),
        with the next assistant header: the append-only bridge. Only the new messages are rendered, never the turns
        before them: the template renders a placeholder conversation (a user turn, an assistant turn, then `new`) and
        the text after the placeholder's stop token is the tail, so a template that renders earlier turns otherwise
        once a user turn follows (Qwen3's drops their reasoning) still extends the sampled ids. Where the template
        renders no placeholder turn as such (it never shows the marker, or ends the turn without the stop token),
        `history()` (the conversation before `new`, its last message the sampled turn) is rendered whole and the
        tail is its rendering with `new` less without (rollout/episodes.py: environment_turn_ids)."""
        with self.lock:
            return self._tail(new, schemas, stopped, history)

    def _tail(self, new: list[dict], schemas: list[dict], stopped: bool, history) -> list[int]:
        rendered = self.messages(new, schemas, tools_message=False)
        text = self._text(schemas)
        if not isinstance(text, ChatTemplate):
            return text.turn([], rendered, stopped)
        stop = self.stop_text
        probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": BRIDGE_MARKER}]
        try:
            whole = render(self.tokenizer, probe + rendered, text.tools, True)
        except Exception:  # noqa: BLE001 - a template that refuses the placeholder: the whole rendering answers
            whole = ""
        k = whole.find(BRIDGE_MARKER)
        after = whole[k + len(BRIDGE_MARKER):] if k >= 0 else ""
        if stop and stop in after:
            return encode(self.tokenizer, ("" if stopped else stop) + after[after.index(stop) + len(stop):])
        if history is None:
            raise EpisodeError("the chat template renders no assistant turn ending with the stop token "
                               f"{stop!r}, so the new messages cannot be rendered apart")
        past = self.messages(history(), schemas)
        return text.turn(past, rendered, stopped)

    def encode_text(self, text: str) -> list[int]:
        """A /v1/completions prompt given as text: the tokenizer's ids, its special tokens included (as vLLM)."""
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def token_text(tokenizer, ids: list[int]) -> list[str]:
    """Each token's own text (for OpenAI's logprobs.content[].token), decoded in one batch: on the event loop's hot
    path, per-token decode calls cost twice as much."""
    return list(tokenizer.batch_decode([[t] for t in ids])) if ids else []


def prompt_of_completion(renderer: Renderer, prompt) -> list[int]:
    """A /v1/completions `prompt`: text, or token ids (a list of ints)."""
    if isinstance(prompt, str):
        return renderer.encode_text(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) == 1:
        return prompt_of_completion(renderer, prompt[0])
    raise RequestError("prompt: one text or one list of token ids (batches of prompts: one request each)", "prompt")


__all__ = ["RequestError", "Renderer", "canonical", "encode", "prompt_of_completion", "split_reasoning", "text_of",
           "token_text", "tool_schemas"]
