"""The endpoint over generators in this process, on a thread: for `qgrpo check` (one episode of an agent against the
base model), the endpoint bench and tests of the routes. A run's endpoint is the Ray actor of
actors/endpoint_actor.py, over its rollout actors; both serve the same app (server.py)."""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from qgrpo.rollout.endpoint.admission import Admission
from qgrpo.rollout.endpoint.auth import MAX_BODY_BYTES
from qgrpo.rollout.endpoint.server import app
from qgrpo.rollout.endpoint.serving import Endpoint
from qgrpo.rollout.endpoint.sessions import SessionBook


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: a free one), made before the server starts so its port is known at once."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({e.strerror}); choose another port (--port, "
                      "environment.endpoint_port) or 0 for a free one") from None
    sock.listen(512)
    return sock


def uvicorn_server(asgi, log_level: str = "warning"):
    import uvicorn

    return uvicorn.Server(uvicorn.Config(asgi, log_level=log_level, access_log=False, lifespan="off",
                                         timeout_keep_alive=30))


@dataclass
class LocalEndpoint:
    endpoint: Endpoint
    base_url: str  # http://HOST:PORT/v1
    address: str  # http://HOST:PORT
    server: object
    thread: threading.Thread

    def session_url(self, sid: str) -> str:
        """The per-session base URL of session `sid`."""
        return f"{self.address}/sessions/{sid}/v1"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def serve_local(generators: list, *, model: str = "qgrpo-policy", host: str = "127.0.0.1", port: int = 0,
                max_model_len: int | None = None, max_tokens: int = 256, chat_template: bool = True,
                book: SessionBook | None = None, admission: Admission | None = None,
                defaults: dict | None = None, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                max_session_calls: int = 0, idle_s: float = 0.0, tool_parser: str | None = None) -> LocalEndpoint:
    """Serve `generators` (rollout/backends Generators; sessions are pinned to one each) on a thread; returns once
    the server answers. `api_key`, `max_body_bytes`, `max_session_calls`, `idle_s`, `tool_parser`: the Endpoint's
    (serving.py)."""
    gen = generators[0]
    pools = [ThreadPoolExecutor(1, thread_name_prefix=f"endpoint-gen{k}") for k in range(len(generators))]

    async def run(slot, sequences, sampling):
        g = generators[slot]

        def call():
            version = g.policy_version
            return version, g.continue_ids(sequences, sampling)
        return await asyncio.get_running_loop().run_in_executor(pools[slot], call)

    endpoint = Endpoint(model=model, tokenizer=gen.tokenizer, stop_ids=gen.stop_ids, run=run, slots=len(generators),
                        precision=gen.precision, max_model_len=max_model_len or model_len(gen.tokenizer),
                        max_tokens=max_tokens, chat_template=chat_template, book=book, admission=admission,
                        defaults=defaults, vocab_size=_vocab(gen), api_key=api_key, max_body_bytes=max_body_bytes,
                        max_session_calls=max_session_calls, idle_s=idle_s, tool_parser=tool_parser)
    sock = bind(host, port)
    server = uvicorn_server(app(endpoint))
    thread = threading.Thread(target=lambda: server.run(sockets=[sock]), name="qgrpo-endpoint", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the endpoint's server did not start")
        time.sleep(0.01)
    address = f"http://{host}:{sock.getsockname()[1]}"
    return LocalEndpoint(endpoint, f"{address}/v1", address, server, thread)


def model_len(tokenizer, config: dict | None = None) -> int:
    """Prompt and completion tokens the model serves: its config's max_position_embeddings, else the tokenizer's
    model_max_length where that is a real bound, else 2048."""
    for v in ((config or {}).get("max_position_embeddings"), getattr(tokenizer, "model_max_length", None)):
        if isinstance(v, int) and 0 < v < 10**7:
            return v
    return 2048


def _vocab(gen) -> int:
    """The generator's vocabulary (its model config's vocab_size where it has one: ids past the tokenizer's, padded
    rows, are valid), else 0 (the endpoint takes the tokenizer's length)."""
    config = getattr(getattr(gen, "model", None), "config", None)
    return int(getattr(config, "vocab_size", 0) or 0)
