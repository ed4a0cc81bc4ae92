"""Asynchronous rollouts with a staleness bound (`algo.max_staleness` > 0): the rollout actors generate continuously
and the learner takes each step's groups as soon as they are in.

Each step's prompts are drawn in step order (the same prompts per step as a synchronous run) and split into chunks,
one per rollout actor (the split `Workers.generate` makes, with the step's sampling seed). A background thread, the
pump, keeps one generation call in flight on every actor: a free actor takes the oldest chunk waiting, of any step
the bound admits. Admission is by the weights the actors hold, so staleness is bounded by construction, not by
discarding late groups (which would bias training towards fast prompts):

- a step's rollouts are, synchronously, sampled by the weights published after the last sync before it. With
  S = max_staleness and U = algo.update_every, a chunk of step c may be generated once the actors hold the weights
  of step U * floor(c / U) - S * U or later: at most S syncs older than synchronous training would use.
- A sync (Workers.sync_weights, in the driver) does not wait for the actors' calls in flight: each actor fetches the
  weights at once and applies them between two decode steps of the completions it is generating (an in-flight
  update, actors/update_gate.py; vLLM with an fp8 KV cache or adapters at the end of the call). Those completions
  continue under the new weights; each token records the version that sampled it (Completion.token_versions, the group's
  policy_version being the first) and that version's log-prob, which the learner's importance weights correct for
  token by token. The bound holds a fortiori: a token is never older than its chunk's first.

Extra rollout actors add throughput: with more actors than a step's prompts the chunks are single prompts, and the
free actors take the next steps' chunks. The learner's wait for each step, the groups already generated for later
steps (the buffer) and the staleness of the groups taken are logged as stream/* metrics.

Nothing lost, nothing twice: the groups of step c are trained on at step c, in the order the prompts were drawn. A
checkpoint holds the stream's state (`snapshot`, written as rollout_buffer.json beside the model): the steps drawn
beyond the one trained, each with its chunks' prompts and the groups already generated, and the data cursor after
them. A resumed run (`restore`) trains on those groups as they were sampled, generates again only the chunks that
were waiting or in flight, and draws on from that cursor. A checkpoint without the file (a synchronous run's, or a
run resumed with algo.max_staleness > 0 from one) leaves the stream to draw from the checkpoint's own cursor. A
chunk whose actor failed is sent again, first, to a live actor (the failed one is replaced as in a synchronous
step).

Limits: a chunk is the unit of admission (a long-tail completion holds its chunk, though it no longer holds a
sync); steps are taken in order (a slow chunk of step c delays step c even when later steps' chunks are done).
The metrics count the step's tokens by age (stream/tokens_age<k>) and the completions that span versions
(stream/mixed_completions).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from dataclasses import dataclass

import ray

from qgrpo.cluster.run.overlap import StepRollouts
from qgrpo.core.records import Completion, GenerationStats, GroupRollout, PromptItem, SamplingParams

POLL_S = 0.05
BUFFER_FILE = "rollout_buffer.json"  # a checkpoint's copy of the stream's state (RolloutStream.snapshot)


@dataclass
class Chunk:
    step: int  # 0-based training step it belongs to
    index: int  # its place among the step's chunks
    items: list  # PromptItems


class RolloutStream:
    def __init__(self, workers, sampler, ro, seed: int, max_staleness: int, update_every: int, start_step: int,
                 published: int, steps: int, timeout_s: float, buffer: dict | None = None):
        """`buffer`: a checkpoint's snapshot to take up (`restore`) before anything is drawn."""
        self.pool, self.sampler, self.ro, self.seed = workers.rollout, sampler, ro, seed
        self.S, self.U, self.steps, self.timeout_s = max_staleness, update_every, steps, timeout_s
        self.held = start_step  # the actors hold the weights of this many steps (the last sync's)
        self.held_version = published  # ... which are this policy version
        self.next_step = start_step  # the next step whose prompts are drawn
        self.queue: deque[Chunk] = deque()  # drawn, not yet sent
        self.flight: dict = {}  # ObjectRef -> (Chunk, actor slot, time sent)
        self.done: dict[int, dict[int, tuple]] = {}  # step -> chunk index -> (groups, stats)
        self.chunks: dict[int, list[list]] = {}  # step -> its chunks' prompts (for a checkpoint's snapshot)
        self.expected: dict[int, tuple[int, int]] = {}  # step -> (number of chunks, cursor after its prompts)
        self.error: BaseException | None = None
        self.paused = False
        self.cv = threading.Condition()
        self.stop = threading.Event()
        self.restored = self.restore(buffer) if buffer else 0
        self.thread = threading.Thread(target=self._pump, name="rollout-stream", daemon=True)
        self.thread.start()

    # --- the bound ---
    def needed(self, step: int) -> int:
        """The weights (in steps trained) a chunk of `step` may be generated from at the oldest."""
        return max(0, self.U * (step // self.U) - self.S * self.U)

    def sampling(self, step: int) -> SamplingParams:
        ro = self.ro
        return SamplingParams(ro.group_size, ro.max_new_tokens, ro.temperature, ro.top_p, ro.top_k,
                              seed=self.seed * 1_000_003 + step)

    # --- the pump (its own thread) ---
    def _admit(self) -> None:
        """Draw the prompts of every step the bound admits now (in step order)."""
        from qgrpo.cluster.run.workers import _split

        while self.next_step < self.steps and self.needed(self.next_step) <= self.held:
            items = self.sampler.next(self.ro.prompts_per_step)
            chunks = [c for c in _split(items, len(self.pool.actors)) if c]
            self.expected[self.next_step] = (len(chunks), self.sampler.cursor)
            self.done[self.next_step] = {}
            self.chunks[self.next_step] = chunks
            self.queue.extend(Chunk(self.next_step, k, c) for k, c in enumerate(chunks))
            self.next_step += 1

    def _send(self) -> None:
        busy = {slot for _, slot, _ in self.flight.values()}
        free = [s for s in range(len(self.pool.actors)) if s not in busy and self.pool.failures[s] == 0]
        free += [s for s in range(len(self.pool.actors)) if s not in busy and s not in free]
        while free and self.queue and not self.paused:
            chunk, slot = self.queue.popleft(), free.pop(0)
            ref = self.pool.actors[slot].generate.remote(chunk.items, self.sampling(chunk.step), chunk.step + 1)
            self.flight[ref] = (chunk, slot, time.monotonic())

    def _collect(self, ref) -> None:
        chunk, slot, _ = self.flight.pop(ref)
        try:
            result = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
            self.pool._failed(slot, e, [i.prompt_id for i in chunk.items], f"generate at step {chunk.step + 1}")
            self.queue.appendleft(chunk)  # again, first, on a live actor
            return
        self.pool.failures[slot] = 0
        self.done[chunk.step][chunk.index] = result

    def _pump(self) -> None:
        from qgrpo.cluster.run.workers import StageTimeout

        try:
            while not self.stop.is_set():
                with self.cv:
                    self._admit()
                    self._send()
                    refs = list(self.flight)
                if not refs:
                    with self.cv:
                        self.cv.wait(POLL_S)
                    continue
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=POLL_S)
                with self.cv:
                    for ref in ready:
                        self._collect(ref)
                    now = time.monotonic()
                    late = [(c, s) for c, s, t in self.flight.values() if now - t > self.timeout_s]
                    if late:
                        chunk, slot = late[0]
                        raise StageTimeout(f"generate at step {chunk.step + 1}: no result within {self.timeout_s:.0f}"
                                           f" s ({self.pool.name(slot)} held "
                                           f"{', '.join(i.prompt_id for i in chunk.items)}); raise "
                                           "faults.generate_timeout_s if generation is that slow, or look for a hung "
                                           "actor")
                    self.cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - raised in the driver by take()
            with self.cv:
                self.error = e
                self.cv.notify_all()

    # --- the driver's side ---
    def take(self, step: int, steps: int) -> StepRollouts:
        """Step `step`'s rollouts (0-based), waiting until each of its chunks is in, with the stream/* metrics:
        the learner's wait, the groups of later steps already in (the buffer), the prompts in flight, and the
        staleness of the groups taken in policy versions (learner updates) behind the weights the actors hold now."""
        t0 = time.monotonic()
        with self.cv:
            while True:
                if self.error is not None:
                    raise self.error
                n = self.expected.get(step, (None,))[0]
                if n is not None and len(self.done[step]) == n:
                    break
                self.cv.wait(1.0)
            results = self.done.pop(step)
            n, cursor = self.expected.pop(step)
            self.chunks.pop(step, None)
            buffered = sum(len(gs) for d in self.done.values() for gs, _ in d.values())
            in_flight = sum(len(c.items) for c, _, _ in self.flight.values())
        groups = [g for k in range(n) for g in results[k][0]]
        stats = [results[k][1] for k in range(n)]
        ages = [self.held_version - g.policy_version for g in groups]
        return StepRollouts(groups, stats, cursor, stream={
            "stream/wait_s": time.monotonic() - t0, "stream/buffered_groups": buffered,
            "stream/in_flight_prompts": in_flight, "stream/staleness_mean": sum(ages) / len(ages),
            "stream/staleness_max": max(ages)})

    def before_sync(self) -> None:
        """Nothing to wait for: each actor applies the sync between two decode steps of its chunk in flight."""

    def after_sync(self, done: int, version: int) -> None:
        """The actors now hold the weights of `done` steps, policy `version` (a sync, or a due sync the unchanged
        policy made unnecessary)."""
        with self.cv:
            self.held, self.held_version = done, version
            self.cv.notify_all()

    def settle(self) -> None:
        """Stop sending and wait until no call is in flight (before the actors are resized)."""
        with self.cv:
            self.paused = True
            while self.flight and self.error is None:
                self.cv.wait(1.0)
            if self.error is not None:
                raise self.error

    def resume(self) -> None:
        with self.cv:
            self.paused = False
            self.cv.notify_all()

    # --- checkpoints ---
    def snapshot(self) -> dict:
        """The stream's state beyond the steps trained, JSON-safe: every step drawn and not yet taken, with its
        chunks' prompts and the groups of the chunks already generated (those waiting or in flight are generated
        again after a resume), and the sampler's cursor after them."""
        with self.cv:
            steps = {}
            for step in sorted(self.expected):
                n, cursor = self.expected[step]
                steps[str(step)] = {"cursor": cursor, "chunks": [[_item_json(i) for i in c] for c in self.chunks[step]],
                                    "done": {str(k): {"groups": [_group_json(g) for g in gs], "stats": _stats_json(st)}
                                             for k, (gs, st) in self.done[step].items()}}
            return {"next_step": self.next_step, "cursor": self.sampler.cursor, "steps": steps}

    def restore(self, state: dict) -> int:
        """Take up a checkpoint's snapshot (the constructor does, before the pump draws anything): its steps' groups
        as they were generated, their other chunks queued again, the sampler at the snapshot's cursor. Returns the
        groups restored."""
        with self.cv:
            if self.expected:
                raise RuntimeError("RolloutStream.restore: the stream has drawn prompts already")
            restored = 0
            for key in sorted(state["steps"], key=int):
                step, entry = int(key), state["steps"][key]
                chunks = [[_item_of(i) for i in c] for c in entry["chunks"]]
                self.expected[step] = (len(chunks), entry["cursor"])
                self.chunks[step] = chunks
                self.done[step] = {int(k): ([_group_of(g) for g in d["groups"]], _stats_of(d["stats"]))
                                   for k, d in entry["done"].items()}
                restored += sum(len(gs) for gs, _ in self.done[step].values())
                self.queue.extend(Chunk(step, k, c) for k, c in enumerate(chunks) if k not in self.done[step])
            self.next_step = state["next_step"]
            self.sampler.cursor = state["cursor"]
            self.cv.notify_all()
            return restored

    def more(self, step: int, n: int, round_: int) -> StepRollouts:
        raise RuntimeError("RolloutStream.more: dynamic sampling cannot run with algo.max_staleness > 0")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


# --- the snapshot's JSON (records are plain dataclasses of JSON-safe fields) ---
def _item_json(item: PromptItem) -> dict:
    return dataclasses.asdict(item)


def _item_of(d: dict) -> PromptItem:
    return PromptItem(**{**d, "history": tuple(tuple(turn) for turn in d.get("history") or ())})


def _group_json(g: GroupRollout) -> dict:
    return {**dataclasses.asdict(g), "item": _item_json(g.item)}


def _group_of(d: dict) -> GroupRollout:
    return GroupRollout(**{**d, "item": _item_of(d["item"]),
                            "completions": [Completion(**c) for c in d["completions"]]})


def _stats_json(st: GenerationStats) -> dict:
    return dataclasses.asdict(st)


def _stats_of(d: dict) -> GenerationStats:
    return GenerationStats(**d)


def write_buffer(checkpoint, state: dict) -> None:
    """The stream's snapshot into a checkpoint folder (a path or URI) being written."""
    import json

    from qgrpo.core import storage

    storage.write_text(storage.join(checkpoint, BUFFER_FILE), json.dumps(state))


def read_buffer(checkpoint) -> dict | None:
    """A checkpoint's stream snapshot, or None where it holds none."""
    import json

    from qgrpo.core import storage

    f = storage.join(checkpoint, BUFFER_FILE)
    return json.loads(storage.read_text(f)) if storage.is_file(f) else None
