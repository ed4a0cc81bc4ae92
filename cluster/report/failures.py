"""Reward entries whose calls failed, from metrics.jsonl: the `reward/errors/LABEL` count of each step line (absent
when 0) and the `reward_errors` events (one per entry and step with failures: how many of how many completions, the
first error, where it was raised, the log of tracebacks). A failed call scores nothing for its entry: `reward/LABEL`
is the mean over the completions the entry did score, absent in a step where every call failed, so the report draws
and averages what exists and says what failed here. Environment failures likewise, from the `env_errors` events
(cluster/run/env_health.py: per step with failures, the trajectories that ended as "env_error" of all, the first
error and where) and the `episode/finish_env_error` share of each step line."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from qgrpo.cluster.report.run_data import RunData, _cfg, _num

ERRORS_PREFIX = "reward/errors/"
ERROR_LOG = "reward_errors.log"  # where the driver writes the tracebacks, in the run directory
ENV_ERROR_LOG = "env_errors.log"  # the environment's


@dataclass
class EntryFailures:
    label: str
    field: str = ""  # the config entry, e.g. rewards.functions[1]
    failed: dict[int, int] = dataclasses.field(default_factory=dict)  # step -> completions whose call failed
    of: dict[int, int] = dataclasses.field(default_factory=dict)  # step -> completions of that step (from events)
    error: str = ""  # the first failure's error and where it was raised
    where: str = ""
    log: str = ERROR_LOG

    @property
    def steps(self) -> list[int]:
        return sorted(s for s, n in self.failed.items() if n > 0)

    def total(self) -> int:
        return sum(self.failed.values())


def reward_failures(data: RunData) -> dict[str, EntryFailures]:
    """label -> what failed, for the entries with at least one failed call (ordered by their first failing step)."""
    out: dict[str, EntryFailures] = {}
    events = {}  # (label, step) -> the last event (a resumed run logs a step again)
    for e in data.events:
        if e.get("event") == "reward_errors" and isinstance(e.get("step"), int) and e.get("label"):
            events[(str(e["label"]), e["step"])] = e
    for (label, step), e in sorted(events.items(), key=lambda kv: kv[0][1]):
        f = out.setdefault(label, EntryFailures(label))
        n, of = _num(e.get("failed")), _num(e.get("of"))
        f.failed[step] = int(n) if n == n else 0
        if of == of:
            f.of[step] = int(of)
        if not f.error:
            f.error, f.where = str(e.get("error") or ""), str(e.get("where") or "")
        f.field = f.field or str(e.get("field") or "")
        f.log = str(e.get("log") or f.log)
    for s in data.steps:  # counts without an event (a log cut short): counted, with no error text
        for key, v in s.items():
            n = _num(v)
            if key.startswith(ERRORS_PREFIX) and n == n and n > 0 and (label := key[len(ERRORS_PREFIX):]):
                out.setdefault(label, EntryFailures(label)).failed.setdefault(s["step"], int(n))
    failing = {label: f for label, f in out.items() if f.total() > 0}
    return dict(sorted(failing.items(), key=lambda kv: kv[1].steps[0]))


@dataclass
class EnvFailures:
    failed: dict[int, int] = dataclasses.field(default_factory=dict)  # step -> trajectories that ended "env_error"
    of: dict[int, int] = dataclasses.field(default_factory=dict)  # step -> trajectories of that step
    errors: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (error, where), first seen first
    log: str = ENV_ERROR_LOG

    @property
    def steps(self) -> list[int]:
        return sorted(self.failed)


def env_failures(data: RunData) -> EnvFailures | None:
    """What the environment failed on, by step (None when no trajectory ended as "env_error"): the env_errors
    events' counts, else (a log cut short, or a run from before the events) the finish share of the step line."""
    out = EnvFailures()
    events = {}  # step -> the last event (a resumed run logs a step again)
    for e in data.events:
        if e.get("event") == "env_errors" and isinstance(e.get("step"), int):
            events[e["step"]] = e
    for step, e in sorted(events.items()):
        n, of = _num(e.get("failed")), _num(e.get("of"))
        out.failed[step] = int(n) if n == n else 0
        if of == of:
            out.of[step] = int(of)
        error = (str(e.get("error") or ""), str(e.get("where") or ""))
        if error[0] and error not in out.errors:
            out.errors.append(error)
        out.log = str(e.get("log") or out.log)
    for s in data.steps:
        share = _num(s.get("episode/finish_env_error"))
        if share == share and share > 0 and s["step"] not in out.failed:
            out.failed[s["step"]] = 0  # known to have failed, not how many
    return out if out.failed else None


def env_section(data: RunData, run_dir: Path) -> list[str]:
    """summary.md's "Environment failures": the trajectories that ended as "env_error" (they scored 0), the steps,
    the distinct errors (the first 5) and where; a pointer to the tracebacks. Nothing when none failed."""
    f = env_failures(data)
    if f is None:
        return []
    steps = f.steps
    counted = [s for s in steps if s in f.of]
    md = ["## Environment failures", "",
          "These trajectories ended as \"env_error\" (the environment's call raised, passed environment.timeout_s or "
          "answered outside the contract): their score was 0 and their last turn the error. step() must answer any "
          "text the model can write rather than raise; environment.max_failed_steps stops a run whose environment "
          "fails on every trajectory.", ""]
    if counted:
        md.append(f"- Trajectories failed: {sum(f.failed[s] for s in counted)} of {sum(f.of[s] for s in counted)} in "
                  f"the steps with failures")
    md.append(f"- Steps with failures: {len(steps)} of {len(data.steps)} ({_spans(steps)})")
    if f.errors:
        md += ["", "| error | where |", "|---|---|"]
        md += [f"| {_cell(error)} | {_cell(where) or 'n/a'} |" for error, where in f.errors[:5]]
        if len(f.errors) > 5:
            md.append(f"\n({len(f.errors) - 5} more distinct first errors in the env_errors events of metrics.jsonl.)")
    md.append("")
    md.append(f"Tracebacks: `{run_dir / f.log}`" if (run_dir / f.log).is_file()
              else f"Tracebacks: `{f.log}` is not in the run directory.")
    return md + [""]


def failures_section(data: RunData, run_dir: Path) -> list[str]:
    """summary.md's "Reward failures": per entry, the completions that failed and those scored, the steps with
    failures, the first error and where; a pointer to the tracebacks. Nothing when no call failed. Then the
    environment's (`env_section`)."""
    return _reward_section(data, run_dir) + env_section(data, run_dir)


def _reward_section(data: RunData, run_dir: Path) -> list[str]:
    failures = reward_failures(data)
    if not failures:
        return []
    logged = len(data.steps)
    on_error = _cfg(data.config, "rewards", "on_error")
    md = ["## Reward failures", "",
          "Calls of these reward entries failed. An entry's reward and its plot line are the mean over the completions "
          "it did score (a gap, not a 0, where every call of a step failed)"
          + (f"; what a failed call counted in the total reward: rewards.on_error = \"{on_error}\"." if on_error
             else "."), "",
          "| entry | completions failed | scored | steps with failures | first error | where |",
          "|---|---|---|---|---|---|"]
    for f in failures.values():
        steps, known = f.steps, [s for s in f.steps if s in f.of]
        total = f.total()
        failed = f"{total} of {sum(f.of[s] for s in known)}" if len(known) == len(steps) else str(total)
        scored = (f"{sum(f.of[s] - f.failed[s] for s in known)} in those steps" if len(known) == len(steps) else "n/a")
        if logged > len(steps):
            scored += f"; all in the other {logged - len(steps)}"
        name = f.label + (f" ({f.field})" if f.field else "")
        md.append(f"| {name} | {failed} | {scored} | {len(steps)} of {logged} ({_spans(steps)}) | "
                  f"{_cell(f.error) or 'n/a'} | {_cell(f.where) or 'n/a'} |")
    logs = sorted({f.log for f in failures.values()})
    there = [name for name in logs if (run_dir / name).is_file()]
    md.append("")
    md.append("Tracebacks: " + ", ".join(f"`{run_dir / name}`" for name in there) if there else
              f"Tracebacks: {', '.join(f'`{name}`' for name in logs)} is not in the run directory.")
    return md + [""]


def failed_steps(data: RunData, key: str) -> list[int]:
    """The steps in which calls of the entry of `reward/LABEL` failed."""
    f = reward_failures(data).get(key.split("/", 1)[1])
    return f.steps if f else []


def _spans(steps: list[int]) -> str:
    """[1, 2, 3, 7] -> "steps 1-3, 7" (the first 6 runs, then how many more)."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    text = ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs[:6])
    return ("step " if len(steps) == 1 else "steps ") + text + (f", ... ({len(runs) - 6} more)" if len(runs) > 6
                                                                else "")


def _cell(text: str) -> str:
    """One Markdown table cell: one line, no pipes, at most 160 characters."""
    one = " ".join(str(text).split()).replace("|", "\\|")
    return one if len(one) <= 160 else one[:157] + "..."
