"""The remote reward against a real HTTP server on 127.0.0.1: scores, the request's contents, retries, timeouts and
every failure's message."""
from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from qgrpo.rollout.rewards.remote import RemoteReward, RemoteRewardError, url_problems

SLEEP_S = 1.0  # how long /slow sleeps; the tests' timeouts are far below it


class Handler(BaseHTTPRequestHandler):
    """Routes by path. /len: each completion's length; /dict: the same as {"rewards": ...}; /flaky: HTTP 503 twice,
    then /len; /slow: sleeps SLEEP_S first; /e500, /e400: that status; /count: one value too few; /strings: text."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with server.lock:
            server.requests.append((self.path, self.headers.get("Content-Type"), body))
            server.hits[self.path] = hits = server.hits.get(self.path, 0) + 1
        scores = [float(len(c)) for c in body["completions"]]
        if self.path == "/slow":
            time.sleep(SLEEP_S)
        if self.path == "/e500" or (self.path == "/flaky" and hits <= 2):
            return self.reply(500 if self.path == "/e500" else 503, "x" * 300 if self.path == "/e500" else "busy")
        if self.path == "/e400":
            return self.reply(400, "missing field 'references'")
        payload = {"/dict": {"rewards": scores}, "/count": scores[:-1], "/strings": ["good"] * len(scores),
                   "/nulls": [None] + scores[1:]}.get(self.path, scores)
        self.reply(200, json.dumps(payload))

    def reply(self, status: int, text: str):
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads, srv.block_on_close = True, False  # a /slow handler still asleep does not hold up teardown
    srv.lock, srv.requests, srv.hits = threading.Lock(), [], {}
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    yield srv
    srv.shutdown()
    srv.server_close()


def batch(n: int = 4) -> dict[str, list]:
    completions = ["a" * (i + 1) for i in range(n)]
    return {"prompts": ["p"] * n, "completions": completions, "completion_ids": [[1, 2, i] for i in range(n)],
            "references": ["r"] * n, "item_ids": [f"id-{i // 2}" for i in range(n)], "finish_reasons": ["stop"] * n,
            "difficulty": [i % 3 for i in range(n)], "metadata": [{"source": "x", "k": [i]} for i in range(n)]}


def test_scores_come_back_one_per_completion(server):
    assert RemoteReward(server.url + "/len")(**batch()) == [1.0, 2.0, 3.0, 4.0]
    assert RemoteReward(server.url + "/dict")(**batch(3)) == [1.0, 2.0, 3.0]
    assert RemoteReward(server.url + "/nulls")(**batch(3)) == [None, 2.0, 3.0]


def test_the_request_carries_every_keyword_and_the_extra_columns(server):
    kwargs = batch()
    RemoteReward(server.url + "/len")(**kwargs)
    (path, content_type, body), = server.requests
    assert path == "/len" and content_type == "application/json"
    assert body == kwargs  # the columns (difficulty, metadata) and the token ids as lists of ints, unchanged


def test_a_server_that_fails_twice_then_answers_is_retried(server):
    reward = RemoteReward(server.url + "/flaky", timeout_s=2, retries=2, backoff_s=0.01)
    assert reward(**batch()) == [1.0, 2.0, 3.0, 4.0]
    assert server.hits["/flaky"] == 3


def test_retries_run_out_on_a_5xx(server):
    with pytest.raises(RemoteRewardError) as e:
        RemoteReward(server.url + "/e500", timeout_s=2, retries=1, backoff_s=0.01)(**batch())
    msg = str(e.value)
    assert f"{server.url}/e500 failed after 2 attempts: HTTP 500: " + "x" * 200 + "..." in msg
    assert "x" * 201 not in msg and server.hits["/e500"] == 2


def test_a_server_slower_than_the_timeout_raises_timed_out(server):
    start = time.monotonic()
    with pytest.raises(RemoteRewardError, match=r"/slow failed after 2 attempts: timed out after 0.2 s"):
        RemoteReward(server.url + "/slow", timeout_s=0.2, retries=1, backoff_s=0.01)(**batch())
    assert time.monotonic() - start < SLEEP_S  # neither attempt waited for the answer
    assert server.hits["/slow"] == 2


def test_nothing_listening_raises_with_the_url():
    with socket.socket() as s:  # a port that was free a moment ago, now closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    with pytest.raises(RemoteRewardError) as e:
        RemoteReward(url, timeout_s=1, retries=2, backoff_s=0.01)(**batch())
    assert f"remote reward {url} failed after 3 attempts: connection refused" in str(e.value)


def test_a_4xx_is_not_retried(server):
    with pytest.raises(RemoteRewardError) as e:
        RemoteReward(server.url + "/e400", timeout_s=2, retries=3, backoff_s=0.01)(**batch())
    assert "failed after 1 attempt: HTTP 400 (not retried): missing field 'references'" in str(e.value)
    assert server.hits["/e400"] == 1


def test_a_wrong_count_or_a_malformed_answer_raises(server):
    with pytest.raises(RemoteRewardError, match="/count failed after 1 attempt: returned 3 values for 4 completions"):
        RemoteReward(server.url + "/count", retries=2)(**batch())
    with pytest.raises(RemoteRewardError, match="the response is not a list of numbers: value 0 is \"good\""):
        RemoteReward(server.url + "/strings", retries=2)(**batch())
    assert server.hits["/count"] == server.hits["/strings"] == 1


def test_a_column_that_is_not_json_is_named():
    kwargs = batch()
    kwargs["when"] = [object()] * 4
    with pytest.raises(RemoteRewardError, match="keyword 'when' cannot be sent as JSON"):
        RemoteReward("http://127.0.0.1:9/score")(**kwargs)


def test_url_problems():
    assert url_problems("http://127.0.0.1:8000/score") == url_problems("https://verifier.example/x") == []
    field = "rewards.functions[2].url"
    for url, what in [("ftp://host/x", "has scheme 'ftp'"), ("localhost:8000/score", "has scheme 'localhost'"),
                      ("verifier/score", "has scheme 'none'"), ("http:///score", "has no host"),
                      ("http://host:99999/x", "is not a valid URL"), ("", "is empty"),
                      ("http://host/a b", "contains whitespace")]:
        problems = url_problems(url, field)
        assert len(problems) == 1 and problems[0].startswith(f"{field}: {url!r} {what}"), (url, problems)
        assert 'e.g. "http://' in problems[0]
    with pytest.raises(ValueError, match="url: 'ftp://x' has scheme 'ftp'"):
        RemoteReward("ftp://x")


def test_longest_s_and_messages_hide_a_password():
    reward = RemoteReward("http://user:s3cret@127.0.0.1:9/score", timeout_s=2, retries=2, backoff_s=0.5)
    assert reward.longest_s == pytest.approx(3 * 2 + 0.5 + 1.0)
    kwargs = batch()
    kwargs["when"] = [object()] * 4
    with pytest.raises(RemoteRewardError) as e:
        reward(**kwargs)
    assert "http://user:***@127.0.0.1:9/score" in str(e.value) and "s3cret" not in str(e.value) + repr(reward)
