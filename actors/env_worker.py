"""The environments of multi-turn rollouts, off the rollout actors: `EnvWorker` Ray actors each hold the environments
of some trajectories (rollout/environments/host.py), and an `EnvClient` in the rollout actor spreads a batch's
trajectories over them and gathers the answers in key order.

Every entry of a batch is answered: a value, or an `EnvFailure` in its place (the environment raised, passed
environment.timeout_s, broke the contract, or its worker was lost), never an exception, so that one environment's
failure follows environment.on_error and not the others'. A worker calls its entries one at a time, each under its own
deadline; the client waits for a worker's batch at most timeout_s per entry plus `slack_s` (the start of a worker),
and a worker past that (a call that never gave the interpreter back) or dead is killed and replaced: the trajectories
it held are lost, and every later call of theirs answers EnvFailure. A worker with a call still running past its
deadline is replaced once it holds no trajectory.
"""
from __future__ import annotations

import time
from typing import Any, Hashable

import ray

from qgrpo.actors.common import END_WAIT_S, end_actors
from qgrpo.actors.ray_errors import cause_of
from qgrpo.rollout.environments.contract import EnvFailure
from qgrpo.rollout.environments.host import EnvHost
from qgrpo.rollout.environments.loader import EnvSpec, factory_of

START_SLACK_S = 60.0  # added to a batch's deadline: a (replaced) worker starts and loads the environment within it


class EnvWorkersFailed(RuntimeError):
    """An environment worker could not start: the environment could not be loaded (the cause is named)."""


@ray.remote
class EnvWorker:
    """{key: environment} of the trajectories given to it; batched reset, step, score and drop (EnvHost)."""

    def __init__(self, spec: EnvSpec, timeout_s: float):
        from qgrpo.actors.common import quiet_libraries

        quiet_libraries()  # before the user's file is imported
        self.host = EnvHost(factory_of(spec), timeout_s)

    def reset(self, keys: list, rows: list[dict]) -> list:
        return self.host.reset(keys, rows)

    def step(self, keys: list, turns: list[str]) -> list:
        return self.host.step(keys, turns)

    def score(self, keys: list) -> list:
        return self.host.score(keys)

    def drop(self, keys: list) -> tuple[int, int]:
        """(trajectories still held, calls still running past their deadline)."""
        return self.host.drop(keys), self.host.stuck()

    def ready(self) -> bool:
        return True


class EnvClient:
    """The environment workers of one rollout actor. `workers`: handles it owns from now on (replaced by new ones
    made from `spec` when they fail); None: it starts `num_workers` of them with `num_cpus` each."""

    def __init__(self, spec: EnvSpec, timeout_s: float, workers: list | None = None, num_workers: int = 2,
                 num_cpus: float = 0.0, slack_s: float = START_SLACK_S):
        self.spec, self.timeout_s, self.num_cpus, self.slack_s = spec, timeout_s, num_cpus, slack_s
        self.workers = list(workers) if workers is not None else [self._spawn() for _ in range(max(num_workers, 1))]
        self.home: dict[Hashable, int] = {}  # key -> the worker slot holding its environment
        self.lost: dict[Hashable, str] = {}  # key -> why its environment is gone (its worker was replaced)
        self.replaced = 0

    def _spawn(self):
        return EnvWorker.options(num_cpus=self.num_cpus, max_restarts=0).remote(self.spec, self.timeout_s)

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Every worker started and loaded the environment; EnvWorkersFailed naming the cause otherwise."""
        limit = timeout_s if timeout_s is not None else self.slack_s
        refs = [w.ready.remote() for w in self.workers]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=limit)
        if len(done) < len(refs):
            raise EnvWorkersFailed(f"the environment workers did not start within {limit:g} s")
        for ref in refs:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                raise EnvWorkersFailed(f"the environment workers could not start: {cause_of(e)}") from None

    # -- the batched calls: each returns one entry per key, in key order

    def reset(self, keys: list, rows: list[dict]) -> list:
        """Per key: a new environment, reset from its row -> its first messages, or an EnvFailure."""
        if len(keys) != len(rows):
            raise ValueError(f"reset: {len(keys)} keys for {len(rows)} rows")
        load = [0] * len(self.workers)
        for slot in self.home.values():
            load[slot] += 1
        for key in keys:
            self.lost.pop(key, None)
            if key in self.home:
                load[self.home[key]] -= 1
            slot = min(range(len(load)), key=load.__getitem__)
            self.home[key] = slot
            load[slot] += 1
        return self._batch("reset", keys, [[r] for r in rows])

    def step(self, keys: list, turns: list[str]) -> list:
        """Per key: its environment's answer to the model's turn (a StepResult), or an EnvFailure."""
        if len(keys) != len(turns):
            raise ValueError(f"step: {len(keys)} keys for {len(turns)} turns")
        return self._batch("step", keys, [[t] for t in turns])

    def score(self, keys: list) -> list:
        """Per key: its environment's final score, or an EnvFailure."""
        return self._batch("score", keys, [[] for _ in keys])

    def drop(self, keys: list) -> None:
        """Forget these trajectories; a worker left holding none, with a call still running past its deadline, is
        replaced (the call's thread cannot be stopped otherwise)."""
        by_slot: dict[int, list] = {}
        for key in keys:
            self.lost.pop(key, None)
            slot = self.home.pop(key, None)
            if slot is not None:
                by_slot.setdefault(slot, []).append(key)
        refs = {self.workers[slot].drop.remote(ks): slot for slot, ks in by_slot.items()}
        if not refs:
            return
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.timeout_s + self.slack_s)
        for ref, slot in refs.items():
            try:
                held, stuck = ray.get(ref) if ref in done else (0, 1)
            except ray.exceptions.RayError:
                held, stuck = 0, 1
            if stuck and not held:
                self._replace(slot, "")

    def close(self, wait_s: float = END_WAIT_S) -> None:
        end_actors(self.workers, wait_s)

    # -- how a batch travels

    def _batch(self, method: str, keys: list, args: list[list]) -> list:
        out: list[Any] = [None] * len(keys)
        by_slot: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            slot = self.home.get(key)
            if slot is None:
                out[i] = EnvFailure(key, self.lost.get(key, "no environment for this trajectory (never reset, or "
                                                             "dropped)"))
            else:
                by_slot.setdefault(slot, []).append(i)
        started = time.monotonic()
        pending = {}
        for slot, idx in by_slot.items():
            columns = [[args[i][j] for i in idx] for j in range(len(args[idx[0]]))]
            pending[slot] = getattr(self.workers[slot], method).remote([keys[i] for i in idx], *columns)
        for slot, ref in pending.items():
            idx = by_slot[slot]
            deadline = self.timeout_s * len(idx) + self.slack_s
            done, _ = ray.wait([ref], timeout=max(deadline - (time.monotonic() - started), 0.0))
            if not done:
                why = f"timed out after {deadline:g} s (its environment worker stopped answering and was replaced)"
                self._fail(slot, idx, keys, out, why, timed_out=True)
                continue
            try:
                got = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                if "__init__" in str(e):
                    raise EnvWorkersFailed(f"the environment workers could not start: {cause_of(e)}") from None
                self._fail(slot, idx, keys, out, f"the environment worker died ({type(e).__name__})")
                continue
            for i, value in zip(idx, got, strict=True):
                out[i] = value
                if isinstance(value, EnvFailure):  # the worker dropped its environment
                    self.home.pop(keys[i], None)
                    self.lost[keys[i]] = f"an earlier call failed: {value.error}"
        return out

    def _fail(self, slot: int, idx: list[int], keys: list, out: list, why: str, timed_out: bool = False) -> None:
        for i in idx:
            out[i] = EnvFailure(keys[i], why, timed_out=timed_out)
        self._replace(slot, why)

    def _replace(self, slot: int, why: str) -> None:
        """Kill the worker in `slot` and start another; the trajectories it held are lost (`why`)."""
        ray.kill(self.workers[slot], no_restart=True)
        self.workers[slot] = self._spawn()
        self.replaced += 1
        for key in [k for k, s in self.home.items() if s == slot]:
            del self.home[key]
            self.lost[key] = f"its environment was lost: {why}" if why else "its environment was lost"
