"""Who may call the endpoint, what names a call's session, and how large a body may be.

With a key (`Access(api_key=...)`: the run's, or `qgrpo serve --api-key`), every route but GET /health needs
`Authorization: Bearer KEY` (else 401 invalid_api_key), and GET /health shows its counters only to a call with the
key (to others, only that it is alive). A session is named by its base URL's SID or the X-Session-ID header; without
a key (`qgrpo serve` on loopback) the bearer key names a session too. A call naming no session gets one of its own
client's (named from its address and key, salted: not guessable from outside), never a shared one. A body over
`max_body_bytes` is answered 413 (its Content-Length, and the bytes actually read).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets

from qgrpo.rollout.endpoint.chat import RequestError

MAX_BODY_BYTES = 8 * 2**20  # a request body past this is refused 413 (`qgrpo serve --max-body-mb`)
KEY_SOURCE = ("during a run, the agent's client is given the run's key as its API key (client.api_key); `qgrpo "
              "serve` prints the key it generated when it started, or takes it from --api-key (QGRPO_API_KEY)")
OPEN_PATHS = ("/health",)  # answered without the key (GET /health: only that the endpoint is alive)


def bearer(header: str) -> str:
    """The key of an `Authorization: Bearer KEY` header ("" without one)."""
    return header[7:].strip() if header[:7].lower() == "bearer " else ""


class Access:
    """The endpoint's key and body limit, and the salt that names the sessions of calls that name none."""

    def __init__(self, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES):
        self.api_key, self.max_body_bytes = api_key or None, max_body_bytes
        self.salt = secrets.token_bytes(16)

    def authorized(self, header: str) -> bool:
        """The request's `Authorization` header carries this endpoint's key (always, without a key)."""
        if not self.api_key:
            return True
        return hmac.compare_digest(bearer(header).encode(), self.api_key.encode())

    def refusal(self, header: str) -> RequestError:
        what = "a wrong API key" if bearer(header) else "no API key (Authorization: Bearer KEY)"
        return RequestError(f"this endpoint asks for its key; the call gave {what}. Where the key comes from: "
                            f"{KEY_SOURCE}", None, 401, "invalid_api_key")

    def session_id(self, request, path_sid: str | None) -> str:
        """The per-session path's SID, else the X-Session-ID header; else, without a key, the bearer key; else a
        session of the calling client's own."""
        if path_sid:
            return path_sid
        sid = request.headers.get("x-session-id")
        if sid:
            return sid
        key = bearer(request.headers.get("authorization", ""))
        if key and not self.api_key:
            return key
        return self.client_session(request.client.host if request.client else "", key)

    def client_session(self, host: str, key: str) -> str:
        """The session of a client that names none: from its address and key, salted by this endpoint's secret."""
        digest = hmac.new(self.salt, f"{host}\0{key}".encode(), hashlib.sha256).hexdigest()
        return f"client-{digest[:24]}"

    def too_large(self) -> RequestError:
        mb = self.max_body_bytes / 2**20
        return RequestError(f"the request body is over {self.max_body_bytes} bytes ({mb:g} MiB), the endpoint's "
                            "limit (max_body_bytes; `qgrpo serve --max-body-mb N` raises it)", None, 413,
                            "request_too_large")

    async def read_json(self, request) -> dict:
        """The body, read up to the limit: its Content-Length first, then the bytes as they come (a chunked body has
        none)."""
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            raise self.too_large()
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > self.max_body_bytes:
                raise self.too_large()
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RequestError("the body is not JSON", None) from None
        if not isinstance(body, dict):
            raise RequestError("the body is a JSON object", None)
        return body

    def guard(self, inner, error):
        """`inner` (an ASGI app) behind the key: a call to any path but OPEN_PATHS without it is answered by
        `error(RequestError)` (an ASGI response)."""
        async def guarded(scope, receive, send):
            if scope["type"] == "http" and self.api_key and scope["path"] not in OPEN_PATHS:
                header = _header(scope)
                if not self.authorized(header):
                    await error(self.refusal(header))(scope, receive, send)
                    return
            await inner(scope, receive, send)
        return guarded

    def keyed(self, request) -> bool:
        """The call carries this endpoint's key (or the endpoint has none): it may see the counters."""
        return self.authorized(request.headers.get("authorization", ""))


def _header(scope) -> str:
    return next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), "")
