"""The rollout supply (cluster/run/supply.py): the rollout actors generate each step's prompts, chunk by chunk, under
the admission rule of learner/objective/staleness.py, and the driver takes each step's groups as soon as they are in.

Each step's prompts are drawn in step order (the same prompts per step in every setting) and split into chunks, one
per rollout actor (RolloutPool.split), sampled with the step's seed. A background thread, the pump, keeps one
generation call in flight on every actor it can: a free actor takes the oldest chunk waiting. A step's prompts are
drawn once the rule admits it, by the weights the actors hold and the step the driver is taking:

- `algo.max_staleness = 0`: a step's prompts are drawn when the driver asks for them, after the sync before it, so
  every setting reproduces the synchronous loop exactly (same prompts, seeds, actors, checkpoints); dynamic
  sampling's extra rounds (`more`) are drawn right after the step's own, as chunks ahead of any other.
- `algo.overlap = true`: staleness 1, step k + 1's prompts drawn when step k is taken (one step off).
- `max_staleness = S > 0`: every step the bound admits: at most S syncs older than synchronous training would use.

A sync (Workers.sync_weights, in the driver) does not wait for the calls in flight: each actor fetches the weights at
once and applies them between two decode steps of the completions it is generating (an in-flight update,
actors/update_gate.py; vLLM with an fp8 KV cache or adapters at the end of the call). Those completions continue
under the new weights; each token records the version that sampled it (Completion.token_versions, the group's
policy_version being the first) and that version's log-prob, which the learner's importance weights correct for
token by token. The bound holds a fortiori: a token is never older than its chunk's first.

Extra rollout actors add throughput: with more actors than a step's prompts the chunks are single prompts, and the
free actors take the next steps' chunks. Where rollouts may be stale (S > 0), the learner's wait for each step, the
groups already generated for later steps (the buffer) and the staleness of the groups taken are logged as stream/*
metrics, with the step's tokens by age (stream/tokens_age<k>) and the completions that span versions
(stream/mixed_completions).

Nothing lost, nothing twice: the groups of step c are trained on at step c, in the order the prompts were drawn. A
checkpoint holds the stream's state (`snapshot`, written as rollout_buffer.json beside the model) when it drew beyond
the step trained: those steps, each with its chunks' prompts and the groups already generated, and the data cursor
after them. A resumed run (`restore`) trains on those groups as they were sampled, generates again only the chunks
that were waiting or in flight, and draws on from that cursor. A checkpoint without the file (a synchronous run's)
leaves the stream to draw from the checkpoint's own cursor. A chunk whose actor failed is sent again, first, to a
live actor (RolloutPool.collect replaces a dead one).

The stream's source is the rollout pool (RolloutPool: a chunk is a generation call on one actor) or, for agent
programs (environment.name = "agent:..."), the pool behind the run's endpoint (cluster/run/agents.py: AgentEpisodes,
a chunk is one row's episodes): both are a RolloutSource (cluster/run/source.py), so one pump, one admission rule
and one snapshot serve both. A chunk may report metrics beside its groups (agent/*: summed over the step's chunks into
the step's metrics). The pump is the one thread that calls the source: a held-out evaluation is a draw of its own in
the same queue (sent before the training chunks waiting), and the driver's operations on the pool run on it as jobs
(`on_pump`).

Limits: a chunk is the unit of admission (a long-tail completion holds its chunk, though it no longer holds a
sync); steps are taken in order (a slow chunk of step c delays step c even when later steps' chunks are done).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from qgrpo.cluster.run import buffer as state_json
from qgrpo.cluster.run.source import ChunkResult
from qgrpo.cluster.run.supply import RolloutSupply, StepRollouts, step_sampling
from qgrpo.core.records import GenerationStats, GroupRollout, PromptItem, SamplingParams
from qgrpo.learner.objective.staleness import Admission, admission, token_ages

POLL_S = 0.05
HELD_OUT = -1  # the step of a held-out evaluation's draws: (HELD_OUT, n), never snapshotted


@dataclass(frozen=True)
class Chunk:
    key: tuple[int, int]  # (0-based training step, dynamic sampling's round: 0 = the step's own prompts)
    index: int  # its place among the draw's chunks
    items: list  # PromptItems
    sampling: SamplingParams | None = None  # a held-out draw's own (a training step's: its step's)

    @property
    def held_out(self) -> bool:
        return self.key[0] == HELD_OUT


class _Job:
    """A driver's operation on the rollout source, run by the pump (RolloutStream.on_pump)."""

    def __init__(self, fn):
        self.fn, self.done, self.value, self.error = fn, threading.Event(), None, None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as e:  # noqa: BLE001 - raised in the driver by on_pump
            self.error = e
        self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()


class RolloutStream:
    """The one RolloutSupply (cluster/run/supply.py). `source`: what the stream dispatches to (cluster/run/source.py:
    the rollout pool, or the agent episodes over it); `rule`: the admission rule.

    One owner: the pump thread is the only one that calls the source. The stream's lock (`cv`) guards the stream's
    own state (the queue, the calls in flight, the results) and is never held across a call to the source, so no Ray
    call waits under it; the driver's operations on the pool run on the pump (`on_pump`), and a held-out evaluation
    is work of its own kind in the same queue."""

    def __init__(self, source, sampler, ro, *, seed: int, rule: Admission, start_step: int, published: int,
                 steps: int, buffer: dict | None = None):
        """`buffer`: a checkpoint's snapshot to take up (`restore`) before anything is drawn."""
        self.source, self.sampler, self.ro, self.seed, self.rule = source, sampler, ro, seed, rule
        self.steps = steps
        self.held = start_step  # the actors hold the weights of this many steps (the last sync's)
        self.held_version = published  # ... which are this policy version
        self.asked = start_step - 1  # the step the driver is taking
        self.next_step = start_step  # the next step whose prompts are drawn
        self.queue: deque[Chunk] = deque()  # drawn, not yet sent
        self.flight: dict = {}  # Call -> Chunk
        self.done: dict[tuple[int, int], dict[int, ChunkResult]] = {}  # draw -> chunk index -> its result
        self.chunks: dict[tuple[int, int], list[list]] = {}  # draw -> its chunks' prompts (for a snapshot)
        self.expected: dict[tuple[int, int], tuple[int, int]] = {}  # draw -> (number of chunks, cursor after it)
        self.evals = 0  # held-out draws so far
        self.sending = 0  # chunks taken off the queue that the pump is sending now
        self.jobs: deque[_Job] = deque()
        self.error: BaseException | None = None
        self.paused = False
        self.cv = threading.Condition()
        self.stop = threading.Event()
        self.restored = self.restore(buffer) if buffer else 0
        self.thread = threading.Thread(target=self._pump, name="rollout-stream", daemon=True)
        self.thread.start()

    # --- under the lock ---
    def _draw(self, key: tuple[int, int], n: int, first: bool = False) -> None:
        self._queue(key, self.sampler.next(n), first, self.sampler.cursor)

    def _queue(self, key: tuple[int, int], items: list, first: bool, cursor: int,
               sampling: SamplingParams | None = None) -> None:
        chunks = self.source.split(items)  # pure: no call to a process
        self.expected[key], self.done[key], self.chunks[key] = (len(chunks), cursor), {}, chunks
        new = [Chunk(key, k, c, sampling) for k, c in enumerate(chunks)]
        self.queue.extendleft(reversed(new)) if first else self.queue.extend(new)

    def _admit(self) -> None:
        """Draw the prompts of every step the rule admits now (in step order)."""
        while self.next_step < self.steps and self.rule.admits(self.next_step, self.held, self.asked):
            self._draw((self.next_step, 0), self.ro.prompts_per_step)
            self.next_step += 1

    def _picks(self) -> list[tuple[int, Chunk]]:
        """(slot, chunk) for each free slot the queue can fill now, taken off the queue."""
        if self.paused or not self.queue:
            return []
        busy = {call.slot for call in self.flight}
        picks = [(slot, self.queue.popleft()) for slot in self.source.free_slots(busy) if self.queue]
        self.sending = len(picks)  # off the queue, not yet in flight: `pause` waits for them too
        return picks

    # --- the pump: the only thread that calls the source ---
    def _pump(self) -> None:
        self.source.own(threading.get_ident())
        try:
            while not self.stop.is_set():
                while self.jobs:
                    self.jobs.popleft().run()
                with self.cv:
                    self._admit()
                    picks = self._picks()
                sent = [(self._submit(chunk, slot), chunk) for slot, chunk in picks]
                with self.cv:
                    self.flight.update(sent)
                    self.sending = 0
                    calls = list(self.flight)
                    if not calls:
                        if not self.jobs:
                            self.cv.wait(POLL_S)
                        continue
                results = [(call, self.source.collect(call)) for call in self.source.wait(calls, POLL_S)]
                finished = {call for call, _ in results}
                self.source.overdue([c for c in calls if c not in finished])
                with self.cv:
                    for call, result in results:
                        self._record(call, result)
                    self.cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - raised in the driver by take(), on_pump, evaluate
            with self.cv:
                self.error = e
                while self.jobs:
                    self.jobs.popleft().fail(e)
                self.cv.notify_all()
        finally:
            self.source.own(None)

    def _submit(self, chunk: Chunk, slot: int):
        step, round_ = chunk.key
        if chunk.held_out:
            return self.source.submit(slot, chunk.items, chunk.sampling, self.held, held_out=True)
        return self.source.submit(slot, chunk.items, step_sampling(self.ro, self.seed, step, round_), step + 1)

    def _record(self, call, result: ChunkResult | None) -> None:
        chunk = self.flight.pop(call)
        if result is None:  # its process failed (counted, replaced): again, first
            self.queue.appendleft(chunk)
        else:
            self.done[chunk.key][chunk.index] = result

    def _wait(self, key: tuple[int, int]) -> tuple[list[GroupRollout], list[GenerationStats], int, dict]:
        """The draw's groups (in prompt order), stats, cursor and its chunks' metrics summed, once all its chunks are
        in; removed from the stream."""
        self.cv.notify_all()
        while True:
            n = self.expected.get(key, (None,))[0]
            if n is not None and len(self.done[key]) == n:
                break  # in: taken even if a later chunk failed since (its error comes with the next take)
            if self.error is not None:
                raise self.error
            self.cv.wait(1.0)
        results, (n, cursor) = self.done.pop(key), self.expected.pop(key)
        self.chunks.pop(key, None)
        metrics: dict = {}
        for k in range(n):
            for name, v in results[k].metrics.items():
                metrics[name] = metrics.get(name, 0) + v
        return [g for k in range(n) for g in results[k].groups], [results[k].stats for k in range(n)], cursor, metrics

    # --- the driver's side ---
    def take(self, step: int) -> StepRollouts:
        """Step `step`'s rollouts (0-based), waiting until each of its chunks is in. Where rollouts may be stale,
        with the stream/* metrics: the learner's wait, the groups of later steps already in (the buffer), the prompts
        in flight, and the staleness of the groups taken in policy versions behind the weights the actors hold now."""
        t0 = time.monotonic()
        with self.cv:
            self.asked = max(self.asked, step)
            self._admit()
            groups, stats, cursor, metrics = self._wait((step, 0))
            buffered = sum(len(r.groups) for key, d in self.done.items() if key[0] != HELD_OUT for r in d.values())
            in_flight = sum(len(c.items) for c in self.flight.values() if not c.held_out)
        if self.rule.synchronous:
            return StepRollouts(groups, stats, cursor, stream=metrics)
        ages = [self.held_version - g.policy_version for g in groups]
        return StepRollouts(groups, stats, cursor, stream={**metrics,
            "stream/wait_s": time.monotonic() - t0, "stream/buffered_groups": buffered,
            "stream/in_flight_prompts": in_flight, "stream/staleness_mean": sum(ages) / len(ages),
            "stream/staleness_max": max(ages)})

    def more(self, step: int, n: int, round_: int) -> StepRollouts:
        """`n` more prompts for step `step`, dynamic sampling's round `round_`: drawn now, right after the step's
        own (nothing is drawn ahead under a synchronous rule), sent before anything else, with the round's seed."""
        if not self.rule.synchronous:
            raise RuntimeError("RolloutStream.more: dynamic sampling needs a synchronous supply (algo.max_staleness = "
                               "0, no algo.overlap)")
        with self.cv:
            self._draw((step, round_), n, first=True)
            groups, stats, cursor, metrics = self._wait((step, round_))
        return StepRollouts(groups, stats, cursor, stream=metrics)

    def evaluate(self, items: list[PromptItem], sampling: SamplingParams) -> list[GroupRollout]:
        """Held-out rows, each generated (or played by the agent) once with `sampling`, in the order of `items`:
        chunks of their own, sent before the training chunks waiting, on the pump like every other."""
        with self.cv:
            self.evals += 1
            key = (HELD_OUT, self.evals)
            self._queue(key, list(items), True, self.sampler.cursor, sampling)
            groups, _, _, _ = self._wait(key)
        return groups

    def on_pump(self, fn):
        """`fn()` run by the pump between two of its polls (a weight sync, a resize, the precision ladder: the
        pool's one owner calls it); its result, or its error raised here. After `close`, run here."""
        if not self.thread.is_alive():
            if self.error is not None:
                raise self.error
            return fn()
        job = _Job(fn)
        with self.cv:
            if self.error is not None:
                raise self.error
            self.jobs.append(job)
            self.cv.notify_all()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.value

    def advance(self, done: int, version: int) -> None:
        """The actors now hold the weights of `done` steps, policy `version` (a sync, or a due sync the unchanged
        policy made unnecessary)."""
        with self.cv:
            self.held, self.held_version = done, version
            self.cv.notify_all()

    def pause(self) -> None:
        """Stop sending and wait until no call is in flight (before the actors are resized or restarted)."""
        with self.cv:
            self.paused = True
            while (self.flight or self.sending) and self.error is None:
                self.cv.wait(1.0)
            if self.error is not None:
                raise self.error

    def resume(self) -> None:
        with self.cv:
            self.paused = False
            self.cv.notify_all()

    # --- checkpoints ---
    def snapshot(self) -> dict | None:
        """The stream's state beyond the steps trained, JSON-safe: every step drawn and not yet taken, with its
        chunks' prompts and the groups of the chunks already generated (those waiting or in flight are generated
        again after a resume), and the sampler's cursor after them. None when nothing was drawn beyond (always so
        under a synchronous rule): the checkpoint's own cursor says it all."""
        with self.cv:
            keys = sorted(k for k in self.expected if k[0] != HELD_OUT)
            if not keys:
                return None
            steps = {}
            for key in keys:
                n, cursor = self.expected[key]
                chunks = [[state_json.item_json(i) for i in c] for c in self.chunks[key]]
                steps[str(key[0])] = {"cursor": cursor, "chunks": chunks,
                                      "done": {str(k): {"groups": [state_json.group_json(g) for g in r.groups],
                                                        "stats": state_json.stats_json(r.stats), "metrics": r.metrics}
                                               for k, r in self.done[key].items()}}
            return {"next_step": self.next_step, "cursor": self.sampler.cursor, "steps": steps}

    def restore(self, state: dict) -> int:
        """Take up a checkpoint's snapshot (the constructor does, before the pump draws anything): its steps' groups
        as they were generated, their other chunks queued again, the sampler at the snapshot's cursor. Returns the
        groups restored."""
        with self.cv:
            if self.expected:
                raise RuntimeError("RolloutStream.restore: the stream has drawn prompts already")
            restored = 0
            for name in sorted(state["steps"], key=int):
                key, entry = (int(name), 0), state["steps"][name]
                chunks = [[state_json.item_of(i) for i in c] for c in entry["chunks"]]
                self.expected[key] = (len(chunks), entry["cursor"])
                self.chunks[key] = chunks
                self.done[key] = {int(k): ChunkResult([state_json.group_of(g) for g in d["groups"]],
                                                      state_json.stats_of(d["stats"]), d.get("metrics") or {})
                                  for k, d in entry["done"].items()}
                restored += sum(len(r.groups) for r in self.done[key].values())
                self.queue.extend(Chunk(key, k, c) for k, c in enumerate(chunks) if k not in self.done[key])
            self.next_step = state["next_step"]
            self.sampler.cursor = state["cursor"]
            self.cv.notify_all()
            return restored

    # --- beside the steps ---
    def announce(self) -> list[tuple[dict, str]]:
        """(an event for the run log, a line for stderr) the source has to say when the run starts."""
        return self.source.announce()

    def close(self) -> None:
        self.stop.set()
        with self.cv:
            self.cv.notify_all()
        self.thread.join(5)
        self.source.close()


def open_supply(cfg, pool, sampler, start_step: int, published: int, buffer: dict | None,
                run_dir=None) -> RolloutSupply:
    """The run's supply: a stream over the rollout pool (`pool`: cluster/run/workers.py's RolloutPool), or over the
    agent episodes served by it (environment.name = "agent:...", cluster/run/agents.py; endpoint.json in `run_dir`),
    under the [algo] section's admission rule, starting after `start_step` steps with the actors holding policy
    `published`; `buffer`: a checkpoint's snapshot to take up (None: draw from the sampler's cursor)."""
    from qgrpo.rollout.environments.kinds import capabilities

    a = cfg.algo
    source = pool
    if capabilities(cfg.environment.name).endpoint:
        from qgrpo.cluster.run.agents import AgentEpisodes

        source = AgentEpisodes(cfg, pool, run_dir)
    return RolloutStream(source, sampler, cfg.rollout, seed=cfg.run.seed,
                         rule=admission(a.max_staleness, a.update_every, a.overlap), start_step=start_step,
                         published=published, steps=cfg.run.steps, buffer=buffer)


def stream_ages(groups: list[GroupRollout], trained_from: int) -> dict:
    """The step's model tokens by the version that sampled them, as their age behind the policy the step trained from
    (`stream/tokens_age<k>`), and `stream/mixed_completions`: those whose tokens span two versions or more (a weight
    update landed between two of their decode steps)."""
    pairs = [(c.versions(g.policy_version), c.mask()) for g in groups for c in g.completions]
    ages = token_ages(pairs, trained_from)
    mixed = sum(len(set(v)) > 1 for v, _ in pairs)
    return {**{f"stream/tokens_age{k}": n for k, n in sorted(ages.items())}, "stream/mixed_completions": mixed}
