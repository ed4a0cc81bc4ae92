"""The endpoint's calls batched onto generators: one queue per rollout actor (a session's calls all go to the actor it
is pinned to), and while an actor runs one batch the calls that arrive wait and go together in the next, as the
episode loop batches a step's turns. A batch holds the calls of one sampling setting (temperature, top-p, top-k);
each row stops at its own `max_tokens` in the generator (SamplingParams.row_tokens, which the torch, vLLM and MLX
backends honour), so a call asking few tokens costs no decode steps past them. A backend that ignores row_tokens
samples every row to the batch's longest; its rows are then cut to their own here (`cut`).

`run(slot, sequences, sampling)` is the backend's: a rollout actor's `complete` (actors/endpoint_actor.py) or a
generator in this process (local.py). It returns (the version the batch began with, one Completion per sequence);
a Completion's token_versions say where an in-flight update changed the weights between two decode steps.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from qgrpo.core.records import Completion, SamplingParams

MAX_BATCH = 64  # sequences in one batch
# Before a batch is sent to an idle generator, calls that arrive close together are gathered: while another arrived
# within GATHER_S, and until the calls that waited through the last batch and as many as that batch held are in (the
# loop answers that batch's calls one by one, so its sessions come back spread over milliseconds each; counting those
# that waited too merges two cohorts of sessions into one batch instead of letting them alternate), up to the larger
# of GATHER_MAX_S and a tenth of the last batch's time. An isolated call waits GATHER_S.
GATHER_S = 0.005
GATHER_MAX_S = 0.05
# Calls the endpoint has received for the slot and not yet queued (being read, rendered) are waited for too, up to
# this long: 64 sessions' calls arriving together are rendered one after another, more than GATHER_S apart.
GATHER_COMING_MAX_S = 1.0


@dataclass
class Sample:
    """One call's sampled tokens."""

    ids: list[int]
    logprobs: list[float]
    spans: list[tuple[int, int]]  # (first token, version) change points; the first at token 0
    finish: str  # "stop" or "length"
    seconds: float  # queue + generation


@dataclass
class _Pending:
    prompt_ids: list[int]
    max_tokens: int
    key: tuple  # (temperature, top_p, top_k)
    seed: int | None
    future: asyncio.Future
    queued: float = field(default_factory=time.monotonic)


Run = Callable[[int, list[list[int]], SamplingParams], Awaitable[tuple[int, list[Completion]]]]


class Batcher:
    """Per-slot queues drained by one task each, on the running event loop."""

    def __init__(self, run: Run, slots: int, stop_ids: list[int], coming: Callable[[int], int] | None = None):
        """`coming(slot)`: the calls received for the slot and not yet queued (the endpoint counts them)."""
        self.run, self.stop_ids = run, set(stop_ids)
        self.coming = coming or (lambda slot: 0)
        self.queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(slots)]
        self.tasks = [asyncio.get_running_loop().create_task(self._drain(s)) for s in range(slots)]
        self.batches = 0
        self.batched_calls = 0
        # per slot: calls in its last batch (their sessions come back together, answered one by one by the loop)
        # and that batch's seconds, which bound the wait for them
        self.last_n = [0] * slots
        self.last_s = [0.0] * slots
        self.waited = [0] * slots  # calls queued when the slot's last batch ended: another cohort of sessions

    async def sample(self, slot: int, prompt_ids: list[int], max_tokens: int, temperature: float, top_p: float,
                     top_k: int, seed: int | None) -> Sample:
        fut = asyncio.get_running_loop().create_future()
        await self.queues[slot].put(_Pending(prompt_ids, max_tokens, (temperature, top_p, top_k), seed, fut))
        return await fut

    async def _drain(self, slot: int) -> None:
        q = self.queues[slot]
        while True:
            first = await q.get()
            t0, seen = time.monotonic(), -1
            # the calls that waited through the last batch, and that batch's sessions, whose next calls are coming
            expect = min(self.waited[slot] + self.last_n[slot], MAX_BATCH)
            cap = max(GATHER_MAX_S, 0.1 * self.last_s[slot])
            while q.qsize() < MAX_BATCH - 1:
                waited = time.monotonic() - t0
                gathering = waited < cap and (q.qsize() != seen or q.qsize() + 1 < expect)
                if not gathering and not (self.coming(slot) > 0 and waited < GATHER_COMING_MAX_S):
                    break
                seen = q.qsize()
                await asyncio.sleep(GATHER_S)
            batch = [first]
            while not q.empty() and len(batch) < MAX_BATCH:
                batch.append(q.get_nowait())
            same = [p for p in batch if p.key == first.key]
            for p in batch:  # another sampling setting waits for the next batch, in its order
                if p.key != first.key:
                    q.put_nowait(p)
            t1 = time.monotonic()
            await self._one(slot, same)
            self.last_n[slot], self.last_s[slot] = len(same), time.monotonic() - t1
            self.waited[slot] = q.qsize()

    async def _one(self, slot: int, batch: list[_Pending]) -> None:
        t, p, k = batch[0].key
        budget = max(x.max_tokens for x in batch)
        seed = batch[0].seed if len(batch) == 1 else None
        rows = tuple(x.max_tokens for x in batch)
        try:
            version, comps = await self.run(slot, [x.prompt_ids for x in batch], SamplingParams(
                1, budget, t, p, k, seed=seed, row_tokens=rows if len(set(rows)) > 1 else None))
        except BaseException as e:  # noqa: BLE001 - every caller of the batch gets it
            for x in batch:
                if not x.future.done():
                    x.future.set_exception(e)
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        self.batches += 1
        self.batched_calls += len(batch)
        now = time.monotonic()
        for x, c in zip(batch, comps, strict=True):
            if not x.future.done():
                x.future.set_result(cut(c, x.max_tokens, version, now - x.queued))

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()


def cut(c: Completion, max_tokens: int, version: int, seconds: float) -> Sample:
    """A row's Completion as the call's own Sample, at most `max_tokens` long: a backend that honours row_tokens
    stopped it there; one that does not is cut here ("length" when cut before a stop token)."""
    n = min(len(c.token_ids), max_tokens)
    finish = c.finish_reason if n == len(c.token_ids) else "length"
    versions = c.versions(version)[:n]
    spans: list[tuple[int, int]] = [(0, versions[0] if versions else version)]
    for i, v in enumerate(versions):
        if v != spans[-1][1]:
            spans.append((i, v))
    return Sample(list(c.token_ids[:n]), [float(x) for x in c.logprobs[:n]], spans, finish, seconds)
