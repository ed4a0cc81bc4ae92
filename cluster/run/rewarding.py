"""A step's rewards, off the critical path: a pool of Ray reward workers (rewards.num_workers) and the reward-model
actors ([reward_model]) score the step's completions in parallel, while the driver goes on to the reference stage.

`RewardPool.submit(groups)` splits the completions into one slice of whole prompts per worker and returns at once;
`PendingRewards.result()` waits and returns the groups scored, as new values (`Scored`: each group with its
rewards and each entry's scores), with the reward metrics. Every call has a deadline
(rollout/rewards/scoring.py); a worker that passed one, or died, is killed and replaced before the next step, and its
completions follow rewards.on_error. A worker that cannot load a function (a user file that does not import) fails
the first step with the entry named, whatever on_error says.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import ray

from qgrpo.actors.common import END_WAIT_S, end_actors
from qgrpo.cluster.run.supervisor import RunFailed
from qgrpo.core.records import GroupRollout
from qgrpo.rollout.rewards.builtin import RewardError
from qgrpo.rollout.rewards.calls import group_kwargs, slice_kwargs
from qgrpo.rollout.rewards.scoring import (
    CallResult,
    RewardEntry,
    Scores,
    combine,
    entries_from_config,
    make_callable,
    score_batch,
)


@dataclass(frozen=True)
class Scored:
    """Groups with their rewards: new GroupRollout values (`rewards`, and `scores`, each entry's own), and the reward
    metrics of the step's completions."""

    groups: list[GroupRollout]
    metrics: dict[str, float]


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


ERROR_LOG = "reward_errors.log"  # in the run directory: the tracebacks of failed reward calls


class RewardHealth:
    """Failing rewards made loud. Every step, each entry's failed calls are counted (`record`, before the failures
    are zeroed or raised); `end_step` returns one event per entry that failed (a warning line for the terminal and
    metrics.jsonl) and stops the run when an entry has failed on every call for rewards.max_failed_steps steps in a
    row, whatever rewards.on_error says. Each distinct error's traceback goes to RUN_DIR/reward_errors.log once."""

    def __init__(self, entries: list[RewardEntry], max_failed_steps: int, run_dir: Path | None):
        self.entries = {e.label: e for e in entries}
        self.limit = max_failed_steps
        self.log = run_dir / ERROR_LOG if run_dir is not None else None
        self.streak = dict.fromkeys(self.entries, 0)
        self.totals = {label: {"failed": 0, "of": 0, "steps": 0, "error": "", "where": ""} for label in self.entries}
        self.step: dict[str, list] = {}  # label -> [failed, of, first failed CallResult] of the step in progress
        self.logged: set[tuple[str, str]] = set()
        self.broken: str | None = None

    def record(self, scores: Scores, step: int) -> None:
        for label in self.entries:
            self.step.setdefault(label, [0, 0, None])[1] += scores.n
        for r, start, stop in scores.failures:
            now = self.step[r.label]
            now[0] += stop - start
            now[2] = now[2] or r
            if self.log is not None and (r.label, r.error) not in self.logged:
                self.logged.add((r.label, r.error))
                with self.log.open("a") as f:
                    f.write(f"step {step}: reward {r.label!r} ({self.entries[r.label].field}): {r.error}\n"
                            f"{r.trace or '(no traceback: the call did not raise)'}\n\n")

    def where(self) -> str:
        return f"; tracebacks in {self.log}" if self.log is not None and self.log.is_file() else ""

    def end_step(self, step: int) -> list[dict]:
        """The step's reward_errors events (with a warning message each); `broken` says why the run must stop when
        an entry failed on every call for the last max_failed_steps steps (`stop_if_broken` raises it)."""
        events, stop = [], None
        for label, (failed, of, first) in self.step.items():
            total = self.totals[label]
            total["of"] += of
            self.streak[label] = self.streak[label] + 1 if of and failed == of else 0
            if not failed:
                continue
            e = self.entries[label]
            total.update(failed=total["failed"] + failed, steps=total["steps"] + 1)
            total["error"], total["where"] = total["error"] or first.error, total["where"] or first.where
            at = f" at {first.where}" if first.where else ""
            events.append({"event": "reward_errors", "step": step, "label": label, "field": e.field, "failed": failed,
                           "of": of, "error": first.error, "where": first.where, "log": ERROR_LOG,
                           "message": f"reward {label!r} ({e.field}) failed on {failed} of {of} completions "
                                      f"({first.error}{at}); they scored 0 for it (rewards.on_error = \"zero\")"
                                      f"{self.where()}"})
            if self.limit and self.streak[label] >= self.limit and stop is None:
                stop = (f"reward {label!r} ({e.field}) failed on every call for {self.streak[label]} steps in a row "
                        f"({first.error}{at}){self.where()}; fix it (rewards.max_failed_steps = {self.limit} stops a "
                        "run whose reward is broken, whatever rewards.on_error says)")
        self.step, self.broken = {}, stop
        return events

    def stop_if_broken(self) -> None:
        """Raises RunFailed naming an entry that failed on every call for max_failed_steps steps in a row."""
        if self.broken:
            raise RunFailed(self.broken)

    def failures(self) -> dict[str, dict]:
        """label -> totals of the entries that failed at least once in this process's steps."""
        return {label: {"field": self.entries[label].field, **t} for label, t in self.totals.items() if t["failed"]}


class RewardPool:
    def __init__(self, cfg, reward_model_path: str | None = None, run_dir: Path | None = None):
        self.cfg = cfg
        self.entries = entries_from_config(cfg.rewards, environment=cfg.environment)
        self.health = RewardHealth(self.entries, cfg.rewards.max_failed_steps, run_dir)
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

    def submit(self, groups: list[GroupRollout], step: int = 0) -> "PendingRewards":
        """Score `groups` (of `step`, 1-based, for the error log); returns at once."""
        kwargs = group_kwargs(groups)
        pending = PendingRewards(self, groups, kwargs, step)
        if self.inline is not None:
            pending.inline = self.inline.submit(score_batch, self.calls, self.fns, kwargs)
        for slot, (_, _, c0, c1) in enumerate(_slices(groups, len(self.workers))):
            pending.refs[self.workers[slot].score.remote(slice_kwargs(kwargs, c0, c1))] = ("worker", slot, c0, c1)
        if self.models:
            histories = [list(g.item.history) for g in groups for _ in g.completions]
            prompts = [g.item.prompt for g in groups for _ in g.completions]  # texts, whatever shape kwargs hold
            texts = [c.text for g in groups for c in g.completions]
            for slot, (_, _, c0, c1) in enumerate(_slices(groups, len(self.models))):
                ref = self.models[slot].score.remote(prompts[c0:c1], texts[c0:c1], histories[c0:c1])
                pending.refs[ref] = ("model", slot, c0, c1)
        return pending

    def model(self, prompts: list, completions: list, histories: list) -> list[float]:
        """The reward model's scores of a batch (rewards.eval_metric may name it), on this pool's actors."""
        from qgrpo.actors.reward_model_actor import score_on

        if not self.models:
            raise RuntimeError("the reward model is not loaded: no rewards.functions entry is reward_model")
        timeout = max(e.timeout_s for e in self.entries if e.kind == "model")
        return score_on(self.models, prompts, completions, histories, timeout)

    def replace(self, slot: int) -> None:
        """Kill a worker that timed out or died (a hung call's thread cannot be stopped otherwise) and start another."""
        ray.kill(self.workers[slot], no_restart=True)
        self.workers[slot] = self._spawn()
        self.replaced += 1

    def close(self, wait_s: float = END_WAIT_S) -> None:
        """The actors exit by themselves within `wait_s` (0: killed at once, as on a signal), unreported by Ray."""
        if self.inline is not None:
            self.inline.shutdown(wait=False, cancel_futures=True)
        end_actors(self.workers + self.models, wait_s)


class PendingRewards:
    def __init__(self, pool: RewardPool, groups: list[GroupRollout], kwargs: dict[str, list], step: int):
        self.pool, self.groups, self.kwargs, self.step = pool, groups, kwargs, step
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

    def result(self) -> Scored:
        """The groups with their rewards, and the reward metrics. Raises RewardError (rewards.on_error = "fail")."""
        n = len(self.kwargs["completions"])
        scores = Scores(n)
        if self.inline is not None:
            for r in self.inline.result():
                scores.add(r, 0, n)
        for slot in sorted(self._collect(scores)):
            self.pool.replace(slot)
        self.pool.health.record(scores, self.step)
        try:
            totals, metrics = combine(self.pool.entries, scores, self.kwargs["item_ids"], self.pool.on_error)
        except RewardError as e:
            raise RewardError(f"{e}{self.pool.health.where()}", e.failure) from None
        groups, i = [], 0
        for g in self.groups:
            j = i + len(g.completions)
            groups.append(dataclasses.replace(g, rewards=totals[i:j], scores={
                e.label: scores.values[e.label][i:j] for e in self.pool.entries}))  # None: not applied, or failed
            i = j
        mixed = sum(1 for g in groups if max(g.rewards) > min(g.rewards))
        return Scored(groups, {"reward/mean": statistics.fmean(totals), "reward/std": statistics.pstdev(totals),
                               "reward/groups_with_signal": mixed / len(groups),
                               "reward/workers_replaced": self.pool.replaced, **metrics})
