"""The request bodies the endpoint serves, one pydantic model per route: `ChatRequest` (POST /v1/chat/completions),
`CompletionRequest` (POST /v1/completions) and `GenerateRequest` (POST /inference/v1/generate, vLLM's token-in
route, with its nested `sampling_params`). Fields the endpoint does not read are allowed (OpenAI clients send many:
user, metadata, parallel_tool_calls, ...); those it reads are typed and bounded here, and a body that does not fit is
refused with one `RequestError` naming the field (`param`) and what it takes (`HINTS`).

What depends on the served model (its name, its vocabulary, its length) is checked by the server (server.py), the
messages' roles and parts by chat.canonical, the tools' shape by chat.tool_schemas: their messages name the message
or tool at fault.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError

from qgrpo.rollout.endpoint.chat import RequestError

Number = StrictFloat | StrictInt  # a JSON number, not a string or a boolean
TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]

# what each field takes, for the refusal's message
HINTS = {
    "model": "the served model's name (GET /v1/models)",
    "messages": "a non-empty list of chat messages",
    "tools": "a list of {\"type\": \"function\", \"function\": {...}}",
    "tool_choice": "\"auto\" and \"none\" are served; forcing a call is not (the model decides)",
    "response_format": "only text is served",
    "n": "one choice per call is served (make n calls; each is a branch of the session)",
    "stop": "stop strings are not served; a turn ends at the model's stop tokens or max_tokens",
    "top_logprobs": "only the sampled token's log-prob is served (it is always returned)",
    "logprobs": "only the sampled token's log-prob is served (it is always returned)",
    "max_tokens": "a whole number >= 1",
    "max_completion_tokens": "a whole number >= 1",
    "temperature": "out of range (a number from 0 to 10)",
    "top_p": "out of range (a number above 0, at most 1)",
    "top_k": "out of range (a whole number, -1 or 0 for none)",
    "seed": "a whole number",
    "prompt": "one text or one list of token ids (batches of prompts: one request each)",
    "echo": "echo and suffix are not served",
    "suffix": "echo and suffix are not served",
    "token_ids": "a non-empty list of token ids",
    "sampling_params": "an object",
    "stop_token_ids": "a list of token ids",
    "stream": "true or false",
    "stream_options": "an object, e.g. {\"include_usage\": true}",
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class Sampling(_Body):
    """The sampling fields of an OpenAI body (and of vLLM's `sampling_params`)."""

    n: Literal[1] | None = None
    stop: Literal[""] | Annotated[list, Field(max_length=0)] | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=0)] | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=10)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    seed: StrictInt | None = None

    def asked_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class _OpenAI(Sampling):
    model: Any = None  # checked against the served name by the server (404 model_not_found)
    stream: StrictBool | None = None
    stream_options: dict | None = None


class _Function(_Body):
    name: str


class _ResponseFormat(_Body):
    type: Literal["text"] = "text"


class ChatRequest(_OpenAI):
    messages: Annotated[list[Any], Field(min_length=1)]  # each checked by chat.canonical
    tools: list[Any] | None = None  # checked by chat.tool_schemas
    tool_choice: Literal["auto", "none"] | None = None
    response_format: _ResponseFormat | None = None
    logprobs: StrictBool | None = None  # the sampled tokens' log-probs are always returned


class CompletionRequest(_OpenAI):
    prompt: str | TokenIds | Annotated[list[str | TokenIds], Field(min_length=1, max_length=1)]
    echo: Literal[False] | None = None
    suffix: Literal[""] | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=1)] | None = None


class GenerateSampling(Sampling):
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=1)] | None = None  # vLLM: how many log-probs; the sampled one


class GenerateRequest(_Body):
    model: Any = None  # optional on this route; when given, the served name
    token_ids: TokenIds
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    request_id: Any = None


def parse(kind: type[_Body], body: dict):
    """`body` as a `kind`, or a RequestError naming the first field that does not fit and what it takes."""
    try:
        return kind.model_validate(body)
    except ValidationError as e:
        raise _refusal(e, body) from None


def _refusal(e: ValidationError, body: dict) -> RequestError:
    err = e.errors()[0]
    loc = [x for x in err["loc"] if isinstance(x, str)]
    field, where, value = loc[0] if loc else "", "", body
    if field == "sampling_params" and len(loc) > 1 and isinstance(body.get("sampling_params"), dict):
        where, field, value = "sampling_params.", loc[1], body["sampling_params"]
    if err["type"] == "missing":
        return RequestError(f"{where}{field}: required, {HINTS.get(field, 'missing')}", f"{where}{field}")
    got = repr(value.get(field) if isinstance(value, dict) else value)
    got = got if len(got) <= 80 else got[:77] + "..."
    return RequestError(f"{where}{field}: {HINTS.get(field, err['msg'])}, got {got}", f"{where}{field}" or None)
