"""A step's rewards, off the critical path: a pool of Ray reward workers (rewards.num_workers) and the reward-model
actors ([reward_model]) score the step's completions in parallel, while the driver goes on to the reference stage.

`RewardPool.submit(groups)` splits the completions into one slice of whole prompts per worker and returns at once;
`PendingRewards.result()` waits, fills each group's rewards and returns the reward metrics. Every call has a deadline
(rollout/rewards/scoring.py); a worker that passed one, or died, is killed and replaced before the next step, and its
completions follow rewards.on_error. A worker that cannot load a function (a user file that does not import) fails
the first step with the entry named, whatever on_error says.
"""
from __future__ import annotations

import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor

import ray

from qgrpo.cluster.run.workers import RunFailed
from qgrpo.core.records import GroupRollout
from qgrpo.rollout.rewards.calls import group_kwargs, slice_kwargs
from qgrpo.rollout.rewards.scoring import (
    CallResult,
    Scores,
    combine,
    entries_from_config,
    make_callable,
    score_batch,
)

START_SLACK_S = 60.0  # added to a worker call's deadline: a replaced worker starts (imports, loads) within the call


class RewardWorkersFailed(RunFailed):
    """A reward worker could not start: the function it was to load is named."""


def _slices(groups: list[GroupRollout], n: int) -> list[tuple[int, int, int, int]]:
    """(first group, end group, first completion, end completion) of n contiguous slices of whole groups."""
    out, g0, c0 = [], 0, 0
    for k in range(n):
        g1 = g0 + (len(groups) - g0) // (n - k)
        c1 = c0 + sum(len(g.completions) for g in groups[g0:g1])
        if g1 > g0:
            out.append((g0, g1, c0, c1))
        g0, c0 = g1, c1
    return out


class RewardPool:
    def __init__(self, cfg, reward_model_path: str | None = None):
        self.cfg = cfg
        self.entries = entries_from_config(cfg.rewards)
        self.on_error = cfg.rewards.on_error
        self.calls = [e for e in self.entries if e.kind != "model"]
        self.workers = [self._spawn() for _ in range(cfg.rewards.num_workers)] if self.calls else []
        self.inline = None
        if self.calls and not self.workers:  # rewards.num_workers = 0: in this process
            self.inline = ThreadPoolExecutor(1, thread_name_prefix="rewards")
            self.fns = {e.label: make_callable(e) for e in self.calls}
        self.models: list = []
        if any(e.kind == "model" for e in self.entries):
            from qgrpo.actors.reward_model_actor import start_reward_models

            self.models = start_reward_models(cfg.reward_model, reward_model_path or cfg.reward_model.path)
        self.replaced = 0

    def _spawn(self):
        from qgrpo.actors.reward_worker import RewardWorker

        return RewardWorker.options(num_cpus=self.cfg.rewards.num_cpus, max_restarts=0).remote(self.calls)

    def submit(self, groups: list[GroupRollout]) -> "PendingRewards":
        kwargs = group_kwargs(groups)
        pending = PendingRewards(self, groups, kwargs)
        if self.inline is not None:
            pending.inline = self.inline.submit(score_batch, self.calls, self.fns, kwargs)
        for slot, (_, _, c0, c1) in enumerate(_slices(groups, len(self.workers))):
            pending.refs[self.workers[slot].score.remote(slice_kwargs(kwargs, c0, c1))] = ("worker", slot, c0, c1)
        if self.models:
            histories = [list(g.item.history) for g in groups for _ in g.completions]
            for slot, (_, _, c0, c1) in enumerate(_slices(groups, len(self.models))):
                ref = self.models[slot].score.remote(kwargs["prompts"][c0:c1], kwargs["completions"][c0:c1],
                                                     histories[c0:c1])
                pending.refs[ref] = ("model", slot, c0, c1)
        return pending

    def replace(self, slot: int) -> None:
        """Kill a worker that timed out or died (a hung call's thread cannot be stopped otherwise) and start another."""
        ray.kill(self.workers[slot], no_restart=True)
        self.workers[slot] = self._spawn()
        self.replaced += 1

    def close(self) -> None:
        if self.inline is not None:
            self.inline.shutdown(wait=False, cancel_futures=True)
        for a in self.workers + self.models:
            ray.kill(a, no_restart=True)


class PendingRewards:
    def __init__(self, pool: RewardPool, groups: list[GroupRollout], kwargs: dict[str, list]):
        self.pool, self.groups, self.kwargs = pool, groups, kwargs
        self.refs: dict = {}
        self.inline: Future | None = None
        self.started = time.monotonic()

    def _deadline(self, kind: str) -> float:
        if kind == "model":
            return max(e.timeout_s for e in self.pool.entries if e.kind == "model")
        return sum(e.timeout_s for e in self.pool.calls) + START_SLACK_S

    def _collect(self, scores: Scores) -> set[int]:
        """Every call's results into `scores`; the worker slots to replace."""
        replace: set[int] = set()
        for ref, (kind, slot, c0, c1) in self.refs.items():
            left = self._deadline(kind) - (time.monotonic() - self.started)
            done, _ = ray.wait([ref], timeout=max(left, 0.0))
            results, failure = self._results(ref, kind, done, c0, c1)
            for r in results:
                scores.add(r, c0, c1)
            if kind == "worker" and (failure or any(r.timed_out for r in results)):
                replace.add(slot)
        return replace

    def _results(self, ref, kind: str, done: list, c0: int, c1: int) -> tuple[list[CallResult], bool]:
        labels = [e.label for e in (self.pool.calls if kind == "worker" else self.pool.entries) if
                  (e.kind == "model") == (kind == "model")]
        what = "reward worker" if kind == "worker" else "reward-model actor"
        if not done:
            why = f"the {what} did not answer within {self._deadline(kind):g} s"
            return [CallResult(label, None, why, True) for label in labels], True
        try:
            got = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            if kind == "worker" and "__init__" in str(e):  # a function that cannot be loaded: a config error
                cause = str(e).strip().splitlines()[-1]
                raise RewardWorkersFailed(f"the reward workers could not start: {cause}") from None
            return [CallResult(label, None, f"the {what} died ({type(e).__name__})") for label in labels], True
        except ray.exceptions.RayError as e:
            return [CallResult(label, None, f"{type(e).__name__}: {str(e)[:300]}") for label in labels], False
        if kind == "model":
            return [CallResult(labels[0], list(got), seconds=time.monotonic() - self.started)], False
        return got, False

    def result(self) -> dict[str, float]:
        """Fill each group's rewards; the reward metrics. Raises RewardError (rewards.on_error = "fail")."""
        n = len(self.kwargs["completions"])
        scores = Scores(n)
        if self.inline is not None:
            for r in self.inline.result():
                scores.add(r, 0, n)
        for slot in sorted(self._collect(scores)):
            self.pool.replace(slot)
        totals, metrics = combine(self.pool.entries, scores, self.kwargs["item_ids"], self.pool.on_error)
        i = 0
        for g in self.groups:
            g.rewards, i = totals[i:i + len(g.completions)], i + len(g.completions)
        mixed = sum(1 for g in self.groups if max(g.rewards) > min(g.rewards))
        return {"reward/mean": statistics.fmean(totals), "reward/std": statistics.pstdev(totals),
                "reward/groups_with_signal": mixed / len(self.groups), "reward/workers_replaced": self.pool.replaced,
                **metrics}
