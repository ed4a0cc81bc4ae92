"""The HTTP front: the app (`app`) over an `Endpoint` (serving.py), its routes each also under /sessions/{SID}/ (a
per-session base URL: http://HOST:PORT/sessions/SID/v1). Engine-agnostic: `run` samples on a rollout actor or a
local generator, whichever backend it holds.

- POST /v1/chat/completions (routes_chat.py), POST /v1/completions (routes_completions.py), POST
  /inference/v1/generate (routes_tokens.py);
- GET /v1/models: the one model served, with max_model_len;
- GET /v1/sessions/{SID}: the session's calls and branches (what the training row will be);
- GET /health: that the endpoint is alive; its counters only with its key (auth.py).

Every answer carries the prompt's token ids, the completion's, each sampled token's log-prob from the quantized
generator that sampled it, the weight-version spans and a `qgrpo` block (protocol.py: the answers' models; docs/
agents.md). Request bodies are checked by one pydantic model per route (protocol.py); a refusal names the field.
Access (auth.py): the key, the body limit, the naming of sessions. Admission (admission.py): calls wait while the
rollout actors change, and new sessions past `max_sessions`; either is answered 429 with Retry-After after `wait_s`.
"""
from __future__ import annotations

import math

from qgrpo.rollout.endpoint.admission import Admission
from qgrpo.rollout.endpoint.auth import MAX_BODY_BYTES
from qgrpo.rollout.endpoint.chat import RequestError
from qgrpo.rollout.endpoint.protocol import ErrorBody, ErrorDetail
from qgrpo.rollout.endpoint.routes_chat import chat
from qgrpo.rollout.endpoint.routes_chat import events as chat_events
from qgrpo.rollout.endpoint.routes_completions import completions
from qgrpo.rollout.endpoint.routes_completions import events as text_events
from qgrpo.rollout.endpoint.routes_tokens import generate
from qgrpo.rollout.endpoint.serving import Endpoint, session_record

__all__ = ["Admission", "Endpoint", "MAX_BODY_BYTES", "app"]
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error"}
KEPT_ERRORS = ("max_turns", "context", "model_not_found")  # refusals that do not fail the episode as errors


def app(endpoint: Endpoint):
    """The ASGI app of `endpoint`."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def reply(model) -> JSONResponse:
        return JSONResponse(model.model_dump())

    def error(e: RequestError) -> JSONResponse:
        headers = {"Retry-After": str(max(1, math.ceil(endpoint.admission.wait_s / 10)))} if e.status == 429 else None
        body = ErrorBody(error=ErrorDetail(message=str(e), type=ERROR_TYPES.get(e.status, "error"), param=e.param,
                                           code=e.code))
        return JSONResponse(body.model_dump(), status_code=e.status, headers=headers)

    def route(fn, events=None):
        async def handler(request):
            session = None
            try:
                body = await endpoint.access.read_json(request)
                session = endpoint.session(endpoint.access.session_id(request, request.path_params.get("sid")))
                endpoint.book.enter(session.id)
                held = endpoint.arrivals.arrive(session.slot)
                try:
                    _, out = await fn(endpoint, session, body)
                finally:
                    endpoint.arrivals.done(held)
                    endpoint.book.leave(session.id)
            except RequestError as e:
                if session is not None and e.code not in KEPT_ERRORS:
                    session.refuse(str(e))  # a refused call fails its episode, loudly, even if the agent goes on
                return error(e)
            except Exception as e:  # noqa: BLE001 - a failure of ours or of the generator: an OpenAI-shaped 500
                return error(RequestError(f"the endpoint failed on this call: {type(e).__name__}: {e}", None, 500,
                                          "internal_error"))
            if events is not None and body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return StreamingResponse(events(out, include_usage), media_type="text/event-stream")
            return reply(out)
        return handler

    async def models(request):
        return reply(endpoint.models())

    async def record(request):
        s = endpoint.book.get(request.path_params["sid"])
        if s is None:
            return error(RequestError(f"no open session {request.path_params['sid']!r}", None, 404, "not_found"))
        return reply(session_record(s))

    async def health(request):
        return reply(endpoint.health(endpoint.access.keyed(request)))

    async def not_served(request):
        path = request.url.path
        what = ("the Responses API" if path.endswith("/responses") else "Anthropic's Messages API"
                if path.endswith("/messages") else f"{request.method} {path}")
        return error(RequestError(f"{what} is not served here; the routes are /v1/chat/completions, /v1/completions, "
                                  "/inference/v1/generate and /v1/models (docs/agents.md)", None, 404, "not_found"))

    routes = []
    for prefix in ("", "/sessions/{sid}"):
        routes += [Route(f"{prefix}/v1/chat/completions", route(chat, chat_events), methods=["POST"]),
                   Route(f"{prefix}/v1/completions", route(completions, text_events), methods=["POST"]),
                   Route(f"{prefix}/inference/v1/generate", route(generate), methods=["POST"]),
                   Route(f"{prefix}/v1/models", models, methods=["GET"])]
    routes += [Route("/v1/sessions/{sid}", record, methods=["GET"]), Route("/health", health),
               Route("/{path:path}", not_served, methods=["GET", "POST", "PUT", "DELETE"])]
    return endpoint.access.guard(Starlette(routes=routes), error)
