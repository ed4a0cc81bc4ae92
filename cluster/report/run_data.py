"""Reading a run directory for the report: metrics.jsonl, config.toml and rollouts/*.parquet, NaN-safe."""
from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# the driver's laps, in order; "rollout_wait" only in runs of the older one-step-off loop (algo.overlap waited there)
STAGES = ("generate", "rewards", "pack", "reference", "learn", "rollout_wait", "sync")
# reward/* keys that are not functions
REWARD_STATS = {"mean", "std", "groups_with_signal", "errors", "not_applicable", "workers_replaced", "min", "max"}
MISMATCH_RATIO_KEYS = ("mismatch/log_ratio_max", "mismatch/log_ratio_mean", "mismatch/log_ratio_min")
SMOOTH = 10  # moving-average window, in logged steps (longer runs: 1% of the steps, see _window)
HEAD_TAIL = 10  # "first 10 vs last 10 steps" in the summary
SAMPLES = 3  # sample completions per step shown
MAX_TEXT = 400  # characters of a prompt / completion shown
FIGSIZE, DPI = (7.0, 4.0), 110

SETTINGS = (("run", "name"), ("model", "path"), ("task", "name"), ("rollout", "precision"),
            ("rollout", "group_size"), ("rollout", "prompts_per_step"), ("rollout", "num_actors"),
            ("algo", "max_staleness"), ("learner", "lr"))


# ---------------------------------------------------------------------------------------------------- loading


@dataclass
class RunData:
    steps: list[dict[str, Any]] = field(default_factory=list)  # one record per step, sorted, last write wins
    events: list[dict[str, Any]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # `time` of every line, in file order
    config: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what is missing or was skipped, for the summary

    def has(self, key: str) -> bool:
        """True when at least one step has a finite value for `key`."""
        return any(_num(s.get(key)) == _num(s.get(key)) for s in self.steps)  # NaN != NaN

    def x(self) -> np.ndarray:
        return np.array([s["step"] for s in self.steps], dtype=float)

    def y(self, key: str) -> np.ndarray:
        """Values of `key` per step; missing, non-numeric and non-finite values are NaN (gaps in a plot)."""
        return np.array([_num(s.get(key)) for s in self.steps], dtype=float)


def _num(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return math.nan
    v = float(v)
    return v if math.isfinite(v) else math.nan


def load_metrics(path: Path, data: RunData) -> None:
    if not path.is_file():
        data.notes.append("no metrics.jsonl: no plots, no training statistics")
        return
    by_step: dict[int, dict] = {}
    bad = 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)  # json accepts NaN / Infinity, which json.dumps writes for non-finite floats
        except json.JSONDecodeError:
            bad += 1  # e.g. the half-written last line of a killed run
            continue
        if not isinstance(rec, dict):
            bad += 1
            continue
        t = _num(rec.get("time"))
        if t == t:
            data.times.append(t)
        if "event" in rec:
            data.events.append(rec)
        elif isinstance(rec.get("step"), int) and not isinstance(rec.get("step"), bool):
            by_step[rec["step"]] = rec  # a resumed run re-logs steps after its checkpoint: keep the newest
        else:
            bad += 1
    if bad:
        data.notes.append(f"metrics.jsonl: {bad} unreadable line(s) skipped")
    data.steps = [by_step[k] for k in sorted(by_step)]


def read_run_config(path: Path, data: RunData) -> None:
    """The run's config.toml as plain TOML, unchecked: a report reads whatever a run wrote, old configs too."""
    if not path.is_file():
        data.notes.append("no config.toml: run settings unknown")
        return
    try:
        data.config = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        data.notes.append(f"config.toml unreadable ({e}): run settings unknown")


def _cfg(config: dict, section: str, key: str, default: Any = None) -> Any:
    sec = config.get(section)
    return sec.get(key, default) if isinstance(sec, dict) else default


@dataclass
class Rollouts:
    rows: int
    first_step: int
    last_step: int
    first: list[dict]  # sample rows of the first step
    last: list[dict]


def load_rollouts(run_dir: Path, notes: list[str]) -> Rollouts | None:
    """Counts every row but reads whole rows only from the files holding the first and the last step."""
    d = run_dir / "rollouts"
    files = sorted(p for p in d.glob("*.parquet") if not p.name.startswith(".")) if d.is_dir() else []
    if not files:
        notes.append("no rollouts/*.parquet: no sample completions")
        return None
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    rows, spans = 0, []  # (min step, max step, file)
    for f in files:
        try:
            steps = pq.read_table(f, columns=["step"]).column("step")
        except Exception as e:  # a corrupt or foreign file must not sink the report
            notes.append(f"rollouts/{f.name} unreadable ({type(e).__name__}): skipped")
            continue
        rows += len(steps)
        if len(steps):
            spans.append((pc.min(steps).as_py(), pc.max(steps).as_py(), f))
    if not spans:
        notes.append("rollouts/*.parquet hold no rows: no sample completions")
        return Rollouts(rows, 0, 0, [], []) if rows else None
    first, last = min(s[0] for s in spans), max(s[1] for s in spans)

    def rows_of(step: int) -> list[dict]:
        out = []
        for lo, hi, f in spans:
            if lo <= step <= hi:
                t = pq.read_table(f)
                out += t.filter(pc.equal(t.column("step"), step)).to_pylist()
        return out

    return Rollouts(rows, first, last, _pick(rows_of(first)), _pick(rows_of(last)) if last != first else [])


def _pick(rows: list[dict], k: int = SAMPLES) -> list[dict]:
    """The best, a middle and the worst completion by reward (stable order on ties): more telling than 3 at random,
    and reproducible."""
    if len(rows) <= k:
        return rows
    order = sorted(range(len(rows)), key=lambda i: (-_nan_low(rows[i].get("reward")), i))
    idx = [order[round(j * (len(order) - 1) / (k - 1))] for j in range(k)]
    return [rows[i] for i in idx]


def _nan_low(v: Any) -> float:
    v = _num(v)
    return -math.inf if v != v else v


# ---------------------------------------------------------------------------------------------------- numbers


def _window(n: int) -> int:
    """10 logged steps, or 1% of them on long runs, where 10 would still be mostly noise."""
    return max(SMOOTH, n // 100)


def _raw_alpha(n: int) -> float:
    return 0.6 if n <= 200 else 0.3  # dense raw lines would hide the band and the average


def moving_average(y: np.ndarray, window: int = SMOOTH) -> np.ndarray:
    """Trailing mean over the last `window` points, ignoring NaN (NaN only where the whole window is NaN)."""
    ok = np.isfinite(y)
    csum = np.concatenate([[0.0], np.cumsum(np.where(ok, y, 0.0))])
    ccnt = np.concatenate([[0], np.cumsum(ok)])
    hi = np.arange(1, len(y) + 1)
    lo = np.maximum(hi - window, 0)
    cnt = ccnt[hi] - ccnt[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(cnt > 0, (csum[hi] - csum[lo]) / np.maximum(cnt, 1), np.nan)


def nanmean(y: np.ndarray) -> float:
    y = y[np.isfinite(y)]
    return float(y.mean()) if len(y) else math.nan


def last_finite(y: np.ndarray) -> float:
    y = y[np.isfinite(y)]
    return float(y[-1]) if len(y) else math.nan


def fmt(v: Any, digits: int = 3) -> str:
    v = _num(v)
    if v != v:
        return "n/a"
    if v != 0 and (abs(v) < 10 ** -digits or abs(v) >= 1e6):
        return f"{v:.{digits}g}" if abs(v) >= 1e6 else f"{v:.2e}"
    return f"{v:.{digits}f}"


def _signed(v: float) -> str:
    return "n/a" if v != v else ("+" if v >= 0 else "") + fmt(v)


def fmt_duration(seconds: float) -> str:
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else (f"{m}m {s:02d}s" if m else f"{seconds:.1f}s")


def _label(entry: dict) -> str:
    """The metric name of a saved rewards.functions entry (rollout/rewards/scoring.entry_label, on plain dicts)."""
    function = entry.get("function") or ""
    return (entry.get("label") or (function.rpartition(":")[2] if function else "")
            or ("remote" if entry.get("url") else entry.get("name") or ""))


def reward_functions(data: RunData) -> list[str]:
    """reward/<fn> keys: the configured function names when the config lists them, else every non-statistic."""
    keys = {k for s in data.steps for k in s if k.startswith("reward/")}
    fns = _cfg(data.config, "rewards", "functions", [])
    named = [_label(f) for f in fns if isinstance(f, dict)] if isinstance(fns, list) else []
    if any(named):
        return [f"reward/{n}" for n in named if f"reward/{n}" in keys]
    return sorted(k for k in keys if k.split("/", 1)[1] not in REWARD_STATS and not k.startswith("reward/errors/"))


def eval_points(data: RunData) -> dict[str, list[dict]]:
    """Eval events grouped by split, sorted by step (the last event of a step wins, as for metrics)."""
    out: dict[str, dict[int, dict]] = {}
    for e in data.events:
        if e.get("event") == "eval" and isinstance(e.get("step"), (int, float)):
            out.setdefault(str(e.get("split") or "eval"), {})[int(e["step"])] = e
    return {split: [pts[k] for k in sorted(pts)] for split, pts in out.items()}


def last_event(data: RunData, name: str) -> dict | None:
    """The last event called `name` (e.g. "baseline", logged again when a run resumes), None if there is none."""
    return next((e for e in reversed(data.events) if e.get("event") == name), None)


# ---------------------------------------------------------------------------------------------------- streaming


@dataclass
class StreamStats:
    """A streamed run's stream/* metrics over its steps (cluster/run/stream.py): how stale its rollouts were."""

    steps: int  # steps with stream/* metrics
    staleness_mean: float  # the mean over those steps of a step's mean group staleness, in policy versions
    staleness_max: float  # the largest group staleness of any step
    tokens_by_age: dict[int, int]  # model tokens trained on, by how many versions behind the trained policy
    mixed_completions: int  # completions whose tokens span two versions or more (an in-flight weight update)
    wait_mean_s: float  # the learner's mean wait for a step's rollouts
    wait_total_s: float

    def words(self) -> str:
        """One line: staleness, tokens by age, the learner's wait."""
        total = sum(self.tokens_by_age.values())
        ages = ", ".join(f"{n} ({n / total:.0%}) at age {k}" for k, n in sorted(self.tokens_by_age.items())) \
            if total else "none counted"
        return (f"staleness mean {self.staleness_mean:.2f}, max {self.staleness_max:.0f} versions over "
                f"{self.steps} steps; tokens {ages}; {self.mixed_completions} completions spanned a weight "
                f"update; the learner waited {self.wait_mean_s:.2f} s a step ({self.wait_total_s:.1f} s in all)")


def stream_stats(steps: list[dict[str, Any]]) -> StreamStats | None:
    """The stream/* metrics of a run's step records summed up; None when no step has them (a synchronous run)."""
    streamed = [s for s in steps if _num(s.get("stream/staleness_mean")) == _num(s.get("stream/staleness_mean"))]
    if not streamed:
        return None
    ages: dict[int, int] = {}
    for s in streamed:
        for k, v in s.items():
            age = k.removeprefix("stream/tokens_age")
            if k.startswith("stream/tokens_age") and age.isdigit() and _num(v) == _num(v):
                ages[int(age)] = ages.get(int(age), 0) + int(v)
    mixed = [_num(s.get("stream/mixed_completions")) for s in streamed]
    waits = np.array([_num(s.get("stream/wait_s")) for s in streamed])
    return StreamStats(
        steps=len(streamed),
        staleness_mean=nanmean(np.array([_num(s["stream/staleness_mean"]) for s in streamed])),
        staleness_max=float(np.nanmax([_num(s.get("stream/staleness_max")) for s in streamed] + [-np.inf])),
        tokens_by_age=dict(sorted(ages.items())),
        mixed_completions=int(sum(v for v in mixed if v == v)),
        wait_mean_s=nanmean(waits), wait_total_s=float(np.nansum(waits)) if np.isfinite(waits).any() else math.nan)
