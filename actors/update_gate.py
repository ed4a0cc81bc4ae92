"""In-flight weight updates: how a rollout actor applies a sync that arrives while it generates.

The rollout actor takes weight loads in a concurrency group of their own (actors/rollout_actor.py), so a sync no
longer queues behind the generation call in flight: its buckets are fetched (or received) at once, beside the
generation. Loading them into the model is handed to the gate:

- no call in flight: the load runs at once, in the sync's thread, and a generation call that comes meanwhile waits
  for it;
- a call in flight on a generator whose decode loop stops between steps (`Generator.updates_between_steps`: torch,
  and vLLM, which is stepped by its generator): the load waits in the gate and the decode loop runs it at its next
  step boundary (`Generator.step_boundary`), in the generation's own thread, so the model is never touched by two
  threads at once.
  The completion continues under the new weights, and the generator records which version sampled which tokens
  (Completion.token_versions);
- a call in flight on any other generator (vLLM with an fp8 KV cache or adapters only): the load runs when the call
  ends, as a queued sync did before.

A backend whose arrays must stay on the thread that made them (BackendSpec.one_thread: MLX, whose arrays fail on
another thread with "no Stream(cpu, 0) in current thread") gets a home thread: the gate runs every generation call,
every load and whatever else touches the model (`run`) on that one thread, so the decode loop's step boundary is
there too.

The sync returns once the load ran (its SyncAck), or raises what the load raised; a load that fails inside a
generation call does not end that call.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable


class _Load:
    def __init__(self, fn: Callable):
        self.fn, self.done, self.result, self.error = fn, threading.Event(), None, None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - handed to the sync's thread, which raises it
            self.error = e
        self.done.set()


class UpdateGate:
    def __init__(self, gen=None, home: bool = False):
        """`gen`: the generator (or `attach` it once built, by `run` on the home thread); `home`: run everything that
        touches the model on one thread of the gate's own."""
        self.cv = threading.Condition()
        self.busy = False  # a generation call, or a load run at once, holds the model
        self.waiting: deque[_Load] = deque()
        self.applied_mid_call = 0  # loads a decode loop ran between two of its steps
        self.delay = 0.0  # seconds to sleep at every step boundary (the fault rollout.slow_decode, core/faults.py)
        self.home = ThreadPoolExecutor(1, thread_name_prefix="model") if home else None
        if gen is not None:
            self.attach(gen)

    def attach(self, gen) -> None:
        """Give a generator whose decode loop stops between steps the gate's step boundary."""
        if getattr(gen, "updates_between_steps", False):
            gen.step_boundary = self._between_steps

    def run(self, fn: Callable):
        """`fn()` on the home thread (in the caller's thread without one); returns or raises what it does."""
        return fn() if self.home is None else self.home.submit(fn).result()

    def _hold(self) -> None:
        with self.cv:
            while self.busy:
                self.cv.wait()
            self.busy = True

    def _release(self) -> None:
        with self.cv:
            self.busy = False
            self.cv.notify_all()

    def call(self, fn: Callable):
        """Run a generation call `fn` holding the model; the loads that arrived and were not taken at a step
        boundary run as it ends."""
        self._hold()
        try:
            return self.run(fn)
        finally:
            self._drain_and_release()

    def load(self, fn: Callable):
        """Run a weight load `fn` now if the model is free, else at the next step boundary of the call in flight
        (or at its end); returns what `fn` returns, or raises what it raised."""
        job = _Load(fn)
        with self.cv:
            now = not self.busy
            if now:
                self.busy = True
            else:
                self.waiting.append(job)
        if now:
            try:
                self.run(job.run)
            finally:
                self._release()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def _drain_and_release(self) -> None:
        """Run the loads waiting, and free the model once none is: the look and the release are one step under the
        lock, so a load that arrives meanwhile is either run here or finds the model free (never left waiting)."""
        while True:
            self.run(self._run_waiting)  # a load's own error is handed to its caller (_Load.run): never raises
            with self.cv:
                if not self.waiting:
                    self.busy = False
                    self.cv.notify_all()
                    return

    def _run_waiting(self) -> int:
        with self.cv:
            jobs = list(self.waiting)
            self.waiting.clear()
        for job in jobs:
            job.run()
        return len(jobs)

    def _between_steps(self) -> None:
        """The generator's step_boundary: runs the loads waiting, in the decode loop's thread."""
        if self.delay:
            time.sleep(self.delay)
        if self.waiting:  # unlocked look: a load that just missed it is run at the next boundary
            self.applied_mid_call += self._run_waiting()
