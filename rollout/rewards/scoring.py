"""A step's rewards: each configured reward called on a batch under its own deadline, then the weighted sum.

`RewardEntry` is a configured reward in a form any process can load (a built-in's name, a user file's shipped source,
a URL); `score_batch` calls every entry on one batch, each in a thread it waits for at most `timeout_s`, and reports
per call its values or what went wrong; `combine` adds the weighted values per completion and applies
`rewards.on_error` to failed calls. A batch call that raises is called again one completion at a time (`narrowed`,
within the same deadline in all) to find the completions it raises on: those fail, with their own error and line, and
the others keep their scores. A call that hangs, or raises only on the whole batch, fails for every completion in it.

A timed-out call's thread cannot be stopped from Python; the Ray reward workers (cluster/run/rewarding.py) are killed
and replaced after one, so nothing hung outlives its step.
"""
from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from qgrpo.rollout.rewards.builtin import REWARD_FUNCTIONS, RewardError
from qgrpo.rollout.rewards.calls import Source, call_reward, failure_trace, load_function, read_source, split_spec

KINDS = ("builtin", "function", "url", "model")


@dataclass(frozen=True)
class RewardEntry:
    label: str  # the metric's name: reward/<label>
    weight: float
    kind: str  # one of KINDS
    target: str  # the built-in's name, the function's spec, the URL; "" for the reward model
    timeout_s: float
    retries: int = 0
    source: Source | None = None  # kind "function"
    field: str = ""  # the config field it comes from, for messages: rewards.functions[2]


def entry_label(spec) -> str:
    """The metric name of a rewards.functions entry: its label, else the built-in's or the function's name, else
    "remote" for a URL."""
    if getattr(spec, "label", ""):
        return spec.label
    if spec.function:
        return split_spec(spec.function, "rewards.functions")[1]
    return "remote" if spec.url else spec.name


def entries_from_config(rewards_cfg, base=None, environment=None) -> list[RewardEntry]:
    """The entries of [rewards]; user files are read here (RewardLoadError names the entry when one cannot be).
    With an [environment] (`environment`: the section) whose weight is not 0, its score is one more entry, labelled
    "environment" (the built-in of that name reads each trajectory's env_score)."""
    entries = [make_entry(rewards_cfg, i, base) for i in range(len(rewards_cfg.functions))]
    if environment is not None and environment.name and environment.weight != 0:
        entries.append(RewardEntry("environment", environment.weight, "builtin", "environment",
                                   environment.timeout_s, field="environment.weight"))
    return entries


def make_entry(rewards_cfg, i: int, base=None) -> RewardEntry:
    """rewards.functions[i] as an entry (a user's file is read here)."""
    s, where = rewards_cfg.functions[i], f"rewards.functions[{i}]"
    timeout = s.timeout_s or rewards_cfg.timeout_s
    if s.function:
        return RewardEntry(entry_label(s), s.weight, "function", s.function, timeout,
                           source=read_source(s.function, f"{where}.function", base), field=where)
    if s.url:
        return RewardEntry(entry_label(s), s.weight, "url", s.url, timeout, retries=s.retries, field=where)
    if s.name == "reward_model":
        return RewardEntry(entry_label(s), s.weight, "model", "", timeout, field=where)
    return RewardEntry(entry_label(s), s.weight, "builtin", s.name, timeout, field=where)


def make_callable(entry: RewardEntry) -> Callable:
    """The function an entry names, loaded in this process."""
    if entry.kind == "builtin":
        return REWARD_FUNCTIONS[entry.target]
    if entry.kind == "function":
        return load_function(entry.source, f"{entry.field}.function")
    if entry.kind == "url":
        from qgrpo.rollout.rewards.remote import RemoteReward

        # the entry's deadline covers every attempt: each gets its share (less the backoff between them)
        per_attempt = max(entry.timeout_s * 0.9 / (entry.retries + 1), 0.1)
        return RemoteReward(entry.target, timeout_s=per_attempt, retries=entry.retries,
                            backoff_s=min(0.5, entry.timeout_s * 0.1 / max(entry.retries, 1) / 2))
    raise ValueError(f"{entry.field}: a {entry.kind} reward is scored by its own actors, not called here")


@dataclass
class CallResult:
    label: str
    values: list[float | None] | None  # None: the call failed (error says how)
    error: str = ""
    timed_out: bool = False
    seconds: float = 0.0
    where: str = ""  # the user's line that raised ("rewards.py:12 in tolerant: ..."), "" if none
    trace: str = ""  # the whole traceback of a call that raised
    raised: tuple[int, ...] = ()  # a narrowed call: the completions (in the call) that raised alone; values has None


def call_with_deadline(label: str, fn: Callable, kwargs: dict[str, list], timeout_s: float) -> CallResult:
    """One call in a daemon thread, waited for at most `timeout_s`."""
    box: dict = {}

    def run():
        try:
            box["values"] = call_reward(fn, kwargs)
        except BaseException as e:  # a user's function may raise anything, SystemExit included
            box["error"] = f"{type(e).__name__}: {e}"
            box["where"], box["trace"] = failure_trace(e)

    t0 = time.perf_counter()
    thread = threading.Thread(target=run, name=f"reward-{label}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    seconds = time.perf_counter() - t0
    if thread.is_alive():
        return CallResult(label, None, f"did not return within its timeout of {timeout_s:g} s", True, seconds)
    if "error" in box:
        return CallResult(label, None, box["error"], seconds=seconds, where=box["where"], trace=box["trace"])
    return CallResult(label, box["values"], seconds=seconds)


def narrowed(label: str, fn: Callable, kwargs: dict[str, list], timeout_s: float, failed: CallResult
             ) -> CallResult:
    """A batch call that raised (`failed`), called again on each completion alone, within what is left of `timeout_s`
    in all: a result with the values of the completions that scored and `raised` naming those that did not (each
    raising alone, or not reached in time), with the first one's error. `failed` itself when every completion scores
    alone (the call fails only on the batch) or the batch had one completion."""
    n = len(kwargs["completions"])
    if n < 2 or failed.timed_out:
        return failed
    values: list[float | None] = [None] * n
    raised, first, spent = [], None, failed.seconds
    for i in range(n):
        left = timeout_s - spent
        one = (call_with_deadline(label, fn, {k: v[i:i + 1] for k, v in kwargs.items()}, left) if left > 0 else
               CallResult(label, None, f"not tried alone within its timeout of {timeout_s:g} s", True))
        spent += one.seconds
        if one.values is None:
            raised.append(i)
            first = first or one
        else:
            values[i] = one.values[0]
    if not raised:
        return failed
    return dataclasses.replace(first, values=values, seconds=spent, raised=tuple(raised))


def score_batch(entries: list[RewardEntry], fns: dict[str, Callable], kwargs: dict[str, list]) -> list[CallResult]:
    """Every entry (the reward model's excepted) called on one batch, one after the other, each with its deadline; a
    call that raised narrowed to the completions it raises on."""
    out = []
    for e in entries:
        if e.kind == "model":
            continue
        r = call_with_deadline(e.label, fns[e.label], kwargs, e.timeout_s)
        out.append(narrowed(e.label, fns[e.label], kwargs, e.timeout_s, r) if r.values is None else r)
    return out


@dataclass
class Scores:
    """One step's scores, assembled from calls on slices of its completions."""

    n: int
    values: dict[str, list[float | None]] = field(default_factory=dict)  # label -> one per completion
    failures: list[tuple[CallResult, int, int]] = field(default_factory=list)  # (failed call, start, stop)
    seconds: dict[str, float] = field(default_factory=dict)  # label -> longest call

    def add(self, result: CallResult, start: int, stop: int) -> None:
        column = self.values.setdefault(result.label, [None] * self.n)
        self.seconds[result.label] = max(self.seconds.get(result.label, 0.0), result.seconds)
        if result.values is None:
            self.failures.append((result, start, stop))
            return
        column[start:stop] = result.values
        for i in result.raised:  # a narrowed call: only these completions failed
            self.failures.append((result, start + i, start + i + 1))

    def failed(self) -> dict[str, int]:
        """label -> completions whose call for that entry failed."""
        out: dict[str, int] = {}
        for r, start, stop in self.failures:
            out[r.label] = out.get(r.label, 0) + stop - start
        return out


def combine(entries: list[RewardEntry], scores: Scores, item_ids: list[str], on_error: str
            ) -> tuple[list[float], dict[str, float]]:
    """(total reward per completion, metrics). Failed calls follow `on_error`: "fail" raises RewardError naming the
    reward, the prompt and the user's line that raised; "zero" adds 0 to those completions' totals for that reward
    (their entry's values stay None: the entry's mean is of the completions it scored) and counts them in
    reward/errors and reward/errors/LABEL. A completion no reward applies to (all None) is the same kind of failure."""
    for result, start, stop in scores.failures:
        if on_error == "fail":
            entry = next(e for e in entries if e.label == result.label)
            ids = list(dict.fromkeys(item_ids[i] for r, a, b in scores.failures if r.label == result.label
                                     for i in range(a, b)))
            at = f" (at {result.where})" if result.where else ""
            raise RewardError(f"reward {result.label!r} ({entry.field}) failed on prompt {ids[0]!r}"
                              f"{f' and {len(ids) - 1} more' if len(ids) > 1 else ''}: {result.error}{at}; fix it, "
                              "or set rewards.on_error = \"zero\" to score such completions 0 and count them",
                              failure=result)
    failed = scores.failed()
    hit = {i for _, start, stop in scores.failures for i in range(start, stop)}  # completions of a failed call
    totals, not_applicable = [], 0
    for i in range(scores.n):
        parts = [(e.weight, scores.values[e.label][i]) for e in entries]
        if all(v is None for _, v in parts) and i not in hit:
            if on_error == "fail":
                raise RewardError(f"no reward applies to a completion of prompt {item_ids[i]!r}: every function "
                                  "returned None; add a reward that scores it, or set rewards.on_error = \"zero\"")
            not_applicable += 1
        totals.append(sum(w * v for w, v in parts if v is not None))
    metrics = {"reward/errors": sum(failed.values()), "reward/not_applicable": not_applicable}
    for e in entries:
        got = [v for v in scores.values[e.label] if v is not None]
        if got:
            metrics[f"reward/{e.label}"] = statistics.fmean(got)
        if failed.get(e.label):
            metrics[f"reward/errors/{e.label}"] = failed[e.label]
        metrics[f"time/reward_{e.label}"] = scores.seconds.get(e.label, 0.0)
    return totals, metrics


def score_texts(name: str, texts: list[str], items: list) -> list[float]:
    """The built-in reward `name` of completion texts, `items[i]` (a PromptItem) being the row of `texts[i]`; None
    (not applicable) counts 0. For held-out accuracy and the majority baseline, which score texts, not rollouts."""
    from qgrpo.core.records import Completion
    from qgrpo.rollout.rewards.calls import reward_kwargs

    kwargs = reward_kwargs(items, [Completion([], [], "stop", t) for t in texts])
    return [v or 0.0 for v in call_reward(REWARD_FUNCTIONS[name], kwargs)]


def reward_problems(rewards_cfg, columns: set[str] | None) -> list[str]:
    """Before anything starts: every user function is read, imported and its signature checked against the keywords
    a call passes (`columns`: the dataset's columns; None = unknown). Imports the user's files in this process."""
    from qgrpo.rollout.rewards.calls import RewardLoadError, signature_problems

    problems = []
    for i, s in enumerate(rewards_cfg.functions):
        if not s.function:
            continue
        field = f"rewards.functions[{i}].function"
        try:
            fn = load_function(read_source(s.function, field), field)
        except RewardLoadError as e:
            problems.append(str(e))
            continue
        problems += signature_problems(fn, field, columns)
    return problems


def rewards_applied(cfg, own_score: str) -> str:
    """The rewards a run of `cfg` adds up, in words, as `qgrpo check` says them: each rewards.functions entry and the
    environment's own score by environment.weight, named `own_score` (what its kind calls it:
    rollout/environments/kinds.py, Capabilities.own_score; "" for no environment), e.g. "0.2 x answer_format + 1 x
    the environment's own score (reward/environment)"."""
    parts = [f"{s.weight:g} x {entry_label(s)}" for s in cfg.rewards.functions]
    env = cfg.environment
    if own_score and env.weight:
        alone = "; rewards.functions = []: no other" if not parts else ""
        parts.append(f"{env.weight:g} x {own_score} (reward/environment{alone})")
    return " + ".join(parts) if parts else "none"
