"""A reward computed elsewhere: an HTTP endpoint that takes a batch as JSON and answers one score per completion.

The request is one POST of a JSON object holding every keyword of the calling convention (rollout/rewards/calls.py):
prompts, completions, completion_ids, references, item_ids, finish_reasons and the dataset's columns, each a list with
one entry per completion. They are sent as a function receives them: on a chat row a prompt is a JSON array of
{"role", "content"} objects and a completion [{"role": "assistant", "content": TEXT}] (TRL's conversational shape),
so one endpoint serves what a TRL reward function would; elsewhere both are strings. The answer is a JSON list of
numbers or nulls (null: does not apply), or {"rewards": [...]}. Standard library only, so it adds nothing to
install on the reward workers.
"""
from __future__ import annotations

import http.client
import json
import math
import socket
import time
import urllib.error
import urllib.parse
import urllib.request

EXAMPLE_URL = "http://verifier.internal:8000/score"


class RemoteRewardError(RuntimeError):
    """A remote reward that failed: the message names the URL, how many attempts were made and why the last failed."""


def url_problems(url, field: str = "rewards.functions[i].url") -> list[str]:
    """What is wrong with `url` as a remote reward's address, checked at config time, before anything starts."""
    fix = f'expected an http or https URL with a host, e.g. "{EXAMPLE_URL}"'
    if not isinstance(url, str) or not url.strip():
        return [f"{field}: {url!r} is empty; {fix}"]
    if url != url.strip() or any(c.isspace() for c in url):
        return [f"{field}: {url!r} contains whitespace; {fix}"]
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError for a port that is not a number in 0..65535)
    except ValueError as e:
        return [f"{field}: {url!r} is not a valid URL ({e}); {fix}"]
    if parts.scheme not in ("http", "https"):
        return [f"{field}: {url!r} has scheme {parts.scheme or 'none'!r}; {fix}"]
    if not parts.hostname:
        return [f"{field}: {url!r} has no host; {fix}"]
    return []


class _Retry(Exception):
    """A failure worth another attempt: the connection, a timeout, a 5xx."""


class _Final(Exception):
    """A failure another attempt would repeat: a 4xx, a malformed answer."""


class RemoteReward:
    """A reward function (`__call__(**kwargs) -> list[float | None]`) that POSTs the batch to `url`.

    `timeout_s` bounds each attempt's connect and each read; a connection error, a timeout or an HTTP 5xx is retried
    up to `retries` more times, waiting `backoff_s`, then twice that, and so on. A 4xx (the endpoint refuses the
    request) and a malformed answer are not retried. Every failure raises `RemoteRewardError`.
    """

    def __init__(self, url: str, timeout_s: float = 30.0, retries: int = 2, backoff_s: float = 0.5):
        problems = url_problems(url, "url")
        if problems:
            raise ValueError(problems[0])
        if timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise ValueError(f"RemoteReward({url!r}): timeout_s must be > 0, retries and backoff_s >= 0; got "
                             f"timeout_s={timeout_s}, retries={retries}, backoff_s={backoff_s}")
        self.url, self.timeout_s, self.retries, self.backoff_s = url, float(timeout_s), int(retries), float(backoff_s)
        self.shown = _without_password(url)  # what messages name

    @property
    def longest_s(self) -> float:
        """How long a call can take when every attempt times out: a caller's deadline shorter than this cuts the
        retries short."""
        return (self.retries + 1) * self.timeout_s + sum(self.backoff_s * 2 ** k for k in range(self.retries))

    def __repr__(self) -> str:
        return f"RemoteReward({self.shown!r}, timeout_s={self.timeout_s:g}, retries={self.retries})"

    def __call__(self, **kwargs) -> list[float | None]:
        n = len(kwargs.get("completions", ()))
        body = self._body(kwargs)
        attempts = self.retries + 1
        for attempt in range(1, attempts + 1):
            try:
                return _scores(self._post(body), n)
            except _Retry as e:
                if attempt == attempts:
                    raise self._error(attempt, str(e)) from None
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            except _Final as e:
                raise self._error(attempt, str(e)) from None
        raise AssertionError("unreachable")

    def _error(self, attempts: int, cause: str) -> RemoteRewardError:
        tries = f"{attempts} attempt{'s' if attempts != 1 else ''}"
        return RemoteRewardError(f"remote reward {self.shown} failed after {tries}: {cause}")

    def _body(self, kwargs: dict) -> bytes:
        try:
            return json.dumps(kwargs, allow_nan=False).encode()
        except (TypeError, ValueError):
            for name, values in kwargs.items():  # name the keyword that is not JSON
                try:
                    json.dumps(values, allow_nan=False)
                except (TypeError, ValueError) as e:
                    raise RemoteRewardError(f"remote reward {self.shown}: keyword {name!r} cannot be sent as JSON "
                                            f"({e}); dataset columns must hold JSON values") from None
            raise

    def _post(self, body: bytes) -> bytes:
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError as e:
            text = _first_chars(e)
            if e.code >= 500:
                raise _Retry(f"HTTP {e.code}: {text}") from None
            raise _Final(f"HTTP {e.code} (not retried): {text}") from None
        except urllib.error.URLError as e:
            raise _Retry(self._describe(e.reason)) from None
        except (OSError, http.client.HTTPException) as e:  # timeouts while reading, connections reset or cut short
            raise _Retry(self._describe(e)) from None

    def _describe(self, reason) -> str:
        if isinstance(reason, (TimeoutError, socket.timeout)) or "timed out" in str(reason):
            return f"timed out after {self.timeout_s:g} s"
        if isinstance(reason, ConnectionRefusedError):
            return "connection refused (is the server running and listening on that port?)"
        if isinstance(reason, socket.gaierror):
            return f"cannot resolve the host ({reason})"
        return f"{type(reason).__name__}: {reason}"


def _without_password(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)))


def _first_chars(e: urllib.error.HTTPError, limit: int = 200) -> str:
    try:
        text = e.read().decode("utf-8", "replace").strip()
    except Exception:  # the body is only for the message
        text = ""
    return (text[:limit] + "...") if len(text) > limit else (text or e.reason or "no body")


def _scores(raw: bytes, n: int) -> list[float | None]:
    """The answer's scores, checked: one number or null per completion."""
    snippet = raw[:200].decode("utf-8", "replace")
    try:
        data = json.loads(raw)
    except ValueError:
        raise _Final(f"the response is not JSON: {snippet!r}; expected a list of numbers or "
                     '{"rewards": [...]}') from None
    if isinstance(data, dict) and "rewards" in data:
        data = data["rewards"]
    if not isinstance(data, list):
        raise _Final(f"the response is not a list of numbers: {snippet!r}; expected a JSON list of numbers (null "
                     'where the reward does not apply) or {"rewards": [...]}')
    if len(data) != n:
        raise _Final(f"returned {len(data)} values for {n} completions; expected one per completion")
    out: list[float | None] = []
    for i, v in enumerate(data):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise _Final(f"the response is not a list of numbers: value {i} is {json.dumps(v)[:40]}; expected a "
                         "number or null")
        out.append(None if v is None else float(v))
    return out
