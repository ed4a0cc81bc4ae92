"""What the endpoint reads and what it answers, as pydantic models.

Requests, one model per route: `ChatRequest` (POST /v1/chat/completions), `CompletionRequest` (POST /v1/completions)
and `GenerateRequest` (POST /inference/v1/generate, vLLM's token-in route, with its nested `sampling_params`). Fields
the endpoint does not read are allowed (OpenAI clients send many: user, metadata, parallel_tool_calls, ...); those it
reads are typed and bounded here, and a body that does not fit is refused with one `RequestError` naming the field
(`param`) and what it takes (`HINTS`). What depends on the served model (its name, its vocabulary, its length) is
checked by serving.py, the messages' roles and parts by chat.canonical, the tools' shape by chat.tool_schemas.

Answers: every JSON body the endpoint returns, streamed chunks included, is one of the models below `# --- answers`
(OpenAI's and vLLM's shapes, plus the `qgrpo` block). An optional key OpenAI leaves out when it has no value is named
in its model's `OMIT` and left out when None; every other field is always present.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    model_serializer,
)

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


# --- answers ---
class _Out(BaseModel):
    """A part of an answer: its fields in order, those in OMIT left out when None."""

    model_config = ConfigDict(extra="forbid")
    OMIT: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit(self, handler):
        out = handler(self)
        for k in self.OMIT:
            if out.get(k, 0) is None:
                del out[k]
        return out


class WeightSpan(_Out):
    """vLLM's weight_versions entry: the version that sampled output tokens start..end."""

    version: str
    start: int
    end: int


class TokenGrant(_Out):
    asked: int
    granted: int
    cap: str | None  # the setting that lowered the grant (None: as asked)


class Qgrpo(_Out):
    """The `qgrpo` block of every answer (docs/agents.md, "What the endpoint returns")."""

    precision: str
    session: str
    call_id: str
    parent: str | None
    branch: str
    fork: str | None
    linked_by: str | None
    edited: bool
    weight_versions: list[WeightSpan]
    tool_parser: str | None  # the parser that ran on this answer (parsers.py); None: none ran
    max_tokens: TokenGrant


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Function(_Out):
    name: str
    arguments: str  # JSON text


class ToolCall(_Out):
    OMIT = ("index",)
    index: int | None = None  # streamed calls only
    id: str
    type: Literal["function"] = "function"
    function: Function


class ChatMessage(_Out):
    OMIT = ("reasoning_content", "tool_calls")
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list = []


class ChatLogprobs(_Out):
    content: list[ChatLogprob]


class TextLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: None = None
    text_offset: list[int]


class TokenLogprob(_Out):
    token: str
    token_id: int
    logprob: float
    top_logprobs: list = []


class TokenLogprobs(_Out):
    content: list[TokenLogprob]


class _Choice(_Out):
    index: int = 0
    finish_reason: str
    token_ids: list[int]
    weight_versions: list[WeightSpan]


class ChatChoice(_Choice):
    message: ChatMessage
    logprobs: ChatLogprobs


class CompletionChoice(_Choice):
    text: str
    logprobs: TextLogprobs
    prompt_token_ids: list[int]


class GenerateChoice(_Choice):
    stop_reason: None = None
    logprobs: TokenLogprobs


class _Answer(_Out):
    id: str
    created: int
    model: str
    prompt_token_ids: list[int]
    usage: Usage
    system_fingerprint: str
    qgrpo: Qgrpo


class ChatAnswer(_Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class CompletionAnswer(_Answer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class GenerateAnswer(_Answer):
    object: Literal["generate"] = "generate"
    choices: list[GenerateChoice]
    request_id: str
    output_mode: Literal["tokens"] = "tokens"


# server-sent events: a finished answer replayed as chunks (routes_chat.py, routes_completions.py: `events`)
class ChatDelta(_Out):
    OMIT = ("role", "content", "reasoning_content", "tool_calls")
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class _ChunkChoice(_Out):
    OMIT = ("token_ids", "weight_versions")
    index: int = 0
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # the last chunk's
    weight_versions: list[WeightSpan] | None = None  # the last chunk's


class ChatChunkChoice(_ChunkChoice):
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None


class TextChunkChoice(_ChunkChoice):
    text: str
    logprobs: TextLogprobs | None = None


class Chunk(_Out):
    OMIT = ("prompt_token_ids", "qgrpo", "usage")
    id: str
    object: Literal["chat.completion.chunk", "text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice | TextChunkChoice]
    prompt_token_ids: list[int] | None = None  # the last chunk's
    qgrpo: Qgrpo | None = None  # the last chunk's
    usage: Usage | None = None  # the usage chunk's (stream_options.include_usage)


# the other routes
class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "qgrpo"
    root: str
    max_model_len: int


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CallRecord(_Out):
    """One call in GET /v1/sessions/{SID}."""

    id: str
    parent: str | None
    route: str
    prompt_tokens: int
    completion_tokens: int
    finish: str
    fork: str | None
    linked_by: str | None
    edited: bool
    tool_calls: list[dict]
    tool_parser: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[dict]  # [{"version": str, "first": int}]: the change points


class SessionRecord(_Out):
    session: str
    step: int | None
    stats: dict  # sessions.Session.stats()
    calls: list[CallRecord]


class Health(_Out):
    """GET /health: alive; with the endpoint's key (or on an endpoint without one), its counters too."""

    OMIT = ("calls", "refused", "forks", "tool_calls", "tool_parse_failures", "model_tokens", "edited_answers",
            "precision", "open_sessions")
    status: Literal["ok"] = "ok"
    calls: int | None = None
    refused: int | None = None
    forks: int | None = None
    tool_calls: int | None = None
    tool_parse_failures: int | None = None
    model_tokens: int | None = None
    edited_answers: int | None = None
    precision: str | None = None
    open_sessions: int | None = None


class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(_Out):
    error: ErrorDetail
