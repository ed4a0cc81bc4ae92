"""The endpoint as a Ray actor in front of the rollout actors: an asyncio actor whose event loop runs the HTTP server
(rollout/endpoint/server.py) and sends each batch of calls to the rollout actor its sessions are pinned to, through
the pool's link (actors/pool_link.py: the generation deadline, a dead actor's calls sent again to its
replacement; `RolloutActor.complete` runs under the actor's update gate: a weight sync lands between two decode steps
of a call in flight, and its answer's spans cover both versions).

Why one plain actor and not Ray Serve: the endpoint's state is the sessions' call trees, which must live in one place
to stitch a session's calls by exact tokens; the generators already live in the rollout actors (Serve would add a
replica and proxy process per node between the agent and the same actors, and its own autoscaling, which the run's
rollout.num_actors already decides). One asyncio loop holds thousands of waiting calls; the work is in the actors.
"""
from __future__ import annotations

import os
import signal

import ray

from qgrpo.core import faults
from qgrpo.core.records import SamplingParams


class _EndpointActor:
    def __init__(self, model: str, model_path: str, link, *, host: str = "127.0.0.1", port: int = 0,
                 max_tokens: int = 256, max_model_len: int = 0, chat_template: bool = True,
                 open_sessions: bool = False, max_sessions: int = 0, wait_s: float = 30.0,
                 defaults: dict | None = None, api_key: str | None = None, max_body_bytes: int = 8 << 20,
                 max_session_calls: int = 0, idle_s: float = 0.0):
        """`link`: the rollout pool's (RolloutPool.link(): the only way to its actors); `model_path`: the
        policy's folder (tokenizer, config); `open_sessions`: any session id is served (`qgrpo serve`), else only
        those the run opened; `api_key`: required on every call (the run's, or `qgrpo serve --api-key`);
        `max_body_bytes`, `max_session_calls`, `idle_s`: rollout/endpoint/serving.py's Endpoint bounds."""
        from qgrpo.actors.common import local_model
        from qgrpo.actors.pool_link import PoolLink
        from qgrpo.rollout.endpoint.admission import Admission
        from qgrpo.rollout.endpoint.sessions import SessionBook

        if not isinstance(link, PoolLink):
            raise TypeError(f"EndpointActor: `link` is a PoolLink (RolloutPool.link()), not {type(link).__name__}")

        self.model, self.host, self.port = model, host, port
        self.link = link
        self.model_path = local_model(model_path, skip=("optimizer",))
        self.max_tokens, self.max_model_len, self.chat_template = max_tokens, max_model_len, chat_template
        self.book = SessionBook(open_sessions)
        self.serving = open_sessions  # `qgrpo serve`'s endpoint
        self.admission = Admission(max_sessions, wait_s)
        self.endpoint = None
        self.server = None
        self.defaults = defaults  # the sampling of what a call leaves out (the run's rollout settings)
        self.kill_next = False
        self.batches = 0  # batches sent to the rollout actors
        self.access = {"api_key": api_key, "max_body_bytes": max_body_bytes, "max_session_calls": max_session_calls,
                       "idle_s": idle_s}

    async def start(self) -> str:
        """Start serving; returns the address (http://HOST:PORT)."""
        import asyncio
        import json
        from pathlib import Path

        from transformers import AutoTokenizer

        from qgrpo.rollout.endpoint.local import bind, model_len, uvicorn_server
        from qgrpo.rollout.endpoint.server import Endpoint, app

        info = await self.link.serving()
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        cfg_file = Path(self.model_path) / "config.json"
        config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.endpoint = Endpoint(model=self.model, tokenizer=tokenizer, stop_ids=info["stop_ids"], run=self._run,
                                 slots=self.link.slots, precision=info["precision"],
                                 max_model_len=self.max_model_len or model_len(tokenizer, config),
                                 max_tokens=self.max_tokens, chat_template=self.chat_template, book=self.book,
                                 admission=self.admission, defaults=self.defaults,
                                 vocab_size=int(config.get("vocab_size") or 0), **self.access)
        sock = bind(self.host, self.port)
        self.server = uvicorn_server(app(self.endpoint))
        asyncio.get_running_loop().create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            await asyncio.sleep(0.01)
        host = self.host if self.host not in ("0.0.0.0", "") else ray.util.get_node_ip_address()
        return f"http://{host}:{sock.getsockname()[1]}"

    async def _run(self, slot: int, sequences: list[list[int]], sampling: SamplingParams):
        self.batches += 1
        # a drill (core/faults.py: endpoint.kill): this process dies with calls in flight; in `qgrpo serve` (open
        # sessions) at that many batches served
        if self.kill_next or (self.serving and faults.fires("endpoint.kill", self.batches)):
            os.kill(os.getpid(), signal.SIGKILL)
        return await self.link.complete(slot, sequences, sampling)

    # --- the run's side ---
    async def open_sessions(self, ids: list[str], step: int, limits: dict | None = None) -> None:
        """Sessions of step `step`'s episodes (the generators' 1-based step, admitted by the run's staleness rule),
        pinned to the least loaded actors."""
        self.kill_next = self.kill_next or faults.fires("endpoint.kill", step)
        for sid in ids:
            self.endpoint.open(sid, step, limits)

    async def close_sessions(self, ids: list[str]) -> dict:
        """The sessions' records, removed: {sid: Session} (plain dataclasses, pickled by Ray)."""
        return {sid: s for sid in ids if (s := self.endpoint.close(sid)) is not None}

    async def pause(self) -> None:
        """Calls wait (then 429) while the rollout actors change."""
        self.admission.paused = True

    async def resume(self) -> None:
        self.admission.paused = False

    async def set_link(self, link) -> None:
        """The pool's link now (pushed by the pool after a replacement, a resize, the precision ladder): a call
        waiting on a dead actor goes to its replacement; a changed number of actors re-pins the open sessions."""
        resized = link.slots != self.link.slots
        self.link.follow(link)
        if resized:
            self.endpoint.repin(link.slots)

    async def reports(self, wait_s: float = 5.0) -> dict:
        """The link's failures and answers since the last call (a long poll, up to `wait_s`), for the pool."""
        return await self.link.take_reports(wait_s)

    async def stats(self) -> dict:
        return self.endpoint.stats()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True


EndpointActor = ray.remote(num_cpus=0, max_concurrency=1000)(_EndpointActor)
