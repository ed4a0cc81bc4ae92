"""The environments of many trajectories in one process, called in batches: what an environment worker
(actors/env_worker.py) holds.

Each call of one trajectory's environment (make + reset, step, score) runs in a thread of its own, waited for at most
`timeout_s`: a call that raises or passes its deadline becomes an `EnvFailure` in its place in the batch (the others
are answered as usual) and that trajectory's environment is dropped. A thread that passed its deadline cannot be
stopped; `stuck()` counts those still running, so that the worker's owner can replace the process once it holds no
live trajectory. A call that never gives the interpreter back (a C extension holding the GIL) stops the whole process:
the worker's client has a deadline of its own for that (EnvClient).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Hashable

from qgrpo.rollout.environments.contract import EnvFailure, Environment, reset_env, score_env, step_env
from qgrpo.rollout.rewards.calls import failure_trace


class EnvHost:
    def __init__(self, factory: Callable[[], Environment], timeout_s: float):
        self.factory, self.timeout_s = factory, timeout_s
        self.envs: dict[Hashable, Environment] = {}
        self.threads: list[threading.Thread] = []  # calls that passed their deadline

    def _call(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        box: dict = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - every failure becomes a value
                box["error"] = e

        thread = threading.Thread(target=run, daemon=True, name=f"env-{key}")
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            self.threads.append(thread)
            self.envs.pop(key, None)
            return EnvFailure(key, f"timed out after {self.timeout_s:g} s", timed_out=True)
        if "error" in box:
            e = box["error"]
            self.envs.pop(key, None)
            where, trace = failure_trace(e)
            return EnvFailure(key, f"{type(e).__name__}: {e}", where, trace=trace)
        return box["value"]

    def _env(self, key: Hashable) -> Environment | EnvFailure:
        env = self.envs.get(key)
        return env if env is not None else EnvFailure(key, "no environment for this trajectory (never reset, "
                                                           "dropped, or an earlier call of it failed)")

    def reset(self, keys: list, rows: list[dict]) -> list:
        """Per key: a new instance, reset from its row -> its first messages (or an EnvFailure)."""
        out = []
        for key, row in zip(keys, rows, strict=True):
            def make_and_reset(key=key, row=row) -> list[dict]:
                env = self.factory()
                messages = reset_env(env, row)
                self.envs[key] = env
                return messages
            self.envs.pop(key, None)
            out.append(self._call(key, make_and_reset))
        return out

    def step(self, keys: list, turns: list[str]) -> list:
        """Per key: its environment's answer (a StepResult) to the model's turn (or an EnvFailure)."""
        out = []
        for key, turn in zip(keys, turns, strict=True):
            env = self._env(key)
            out.append(env if isinstance(env, EnvFailure) else self._call(key, lambda env=env, turn=turn:
                                                                          step_env(env, turn)))
        return out

    def score(self, keys: list) -> list:
        """Per key: its environment's final score (or an EnvFailure)."""
        out = []
        for key in keys:
            env = self._env(key)
            out.append(env if isinstance(env, EnvFailure) else self._call(key, lambda env=env: score_env(env)))
        return out

    def drop(self, keys: list) -> int:
        """Close and forget these trajectories' environments (a close that fails or hangs is let go: the trajectory
        is over); the number still held."""
        for key in keys:
            env = self.envs.get(key)
            if env is not None:
                self._call(key, env.close)
            self.envs.pop(key, None)
        return len(self.envs)

    def stuck(self) -> int:
        """Calls past their deadline whose threads still run."""
        self.threads = [t for t in self.threads if t.is_alive()]
        return len(self.threads)

