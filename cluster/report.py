"""A static report of one run directory: PNG plots and a Markdown summary, built from metrics.jsonl, config.toml
and rollouts/*.parquet. Nothing here needs Ray, torch or a display.

    from cluster.report import report
    out = report("runs/tiny-20260101-120000")    # -> runs/.../report/{summary.md, reward.png, ...}

Whatever is missing from the run (no eval events, no KL because there is no reference, no rollouts, a crashed run
with a half-written last line) only removes the matching plot or section; the summary says what was left out and
why. NaN and +-inf values are plotted as gaps and ignored by the averages.
"""
from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

STAGES = ("generate", "reference", "learn", "sync")  # StageClock laps of the driver, in order
REWARD_STATS = {"mean", "std", "groups_with_signal", "errors", "min", "max"}  # reward/* keys that are not functions
MISMATCH_RATIO_KEYS = ("mismatch/log_ratio_max", "mismatch/log_ratio_mean", "mismatch/log_ratio_min")
SMOOTH = 10  # moving-average window, in logged steps (longer runs: 1% of the steps, see _window)
HEAD_TAIL = 10  # "first 10 vs last 10 steps" in the summary
SAMPLES = 3  # sample completions per step shown
MAX_TEXT = 400  # characters of a prompt / completion shown
FIGSIZE, DPI = (7.0, 4.0), 110

SETTINGS = (("run", "name"), ("model", "path"), ("task", "name"), ("rollout", "precision"),
            ("rollout", "group_size"), ("rollout", "prompts_per_step"), ("learner", "lr"))


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


def load_config(path: Path, data: RunData) -> None:
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


def reward_functions(data: RunData) -> list[str]:
    """reward/<fn> keys: the configured function names when the config lists them, else every non-statistic."""
    keys = {k for s in data.steps for k in s if k.startswith("reward/")}
    fns = _cfg(data.config, "rewards", "functions", [])
    named = [f.get("name") for f in fns if isinstance(f, dict)] if isinstance(fns, list) else []
    if named:
        return [f"reward/{n}" for n in named if f"reward/{n}" in keys]
    return sorted(k for k in keys if k.split("/", 1)[1] not in REWARD_STATS)


def eval_points(data: RunData) -> dict[str, list[dict]]:
    """Eval events grouped by split, sorted by step (the last event of a step wins, as for metrics)."""
    out: dict[str, dict[int, dict]] = {}
    for e in data.events:
        if e.get("event") == "eval" and isinstance(e.get("step"), (int, float)):
            out.setdefault(str(e.get("split") or "eval"), {})[int(e["step"])] = e
    return {split: [pts[k] for k in sorted(pts)] for split, pts in out.items()}


# ---------------------------------------------------------------------------------------------------- plots


def _figure(nrows: int = 1, height: float = FIGSIZE[1]):
    # Figure + savefig without pyplot: no global backend switch, no display needed, nothing left open.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(FIGSIZE[0], height), dpi=DPI, layout="constrained")  # fits outside legends
    axes = fig.subplots(nrows, 1, sharex=True, squeeze=False)[:, 0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return fig, axes


def _legend(ax, where: str = "best", ncol: int = 1) -> None:
    """Legends outside the data: "right" of the axes, or "below" them; "best" inside."""
    if where == "right":
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    elif where == "below":
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=ncol, frameon=False)
    else:
        ax.legend(fontsize=8, loc=where)


def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=DPI, format="png")


def plot_reward(data: RunData, path: Path) -> None:
    fig, (ax,) = _figure(height=4.5)  # room for the legend below the axes
    x, mean = data.x(), data.y("reward/mean")
    if data.has("reward/std"):
        std = data.y("reward/std")
        ok = np.isfinite(mean) & np.isfinite(std)
        ax.fill_between(x, mean - std, mean + std, where=ok, color="C0", alpha=0.15, linewidth=0,
                        label="mean ± std")
    w, alpha = _window(len(x)), _raw_alpha(len(x))
    ax.plot(x, mean, color="C0", linewidth=0.8, alpha=alpha, label="mean")
    ax.plot(x, moving_average(mean, w), color="C0", linewidth=2.2, label=f"mean, trailing avg ({w} steps)")
    for i, key in enumerate(reward_functions(data)):
        ax.plot(x, moving_average(data.y(key), w), color=f"C{i + 1}", linewidth=1.4, linestyle="--",
                label=f"{key.split('/', 1)[1]} (trailing avg)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title("Training reward per step")
    _legend(ax, "below", ncol=3)
    _save(fig, path)


def plot_accuracy(data: RunData, path: Path) -> None:
    fig, (ax,) = _figure()
    points = eval_points(data)
    ns = [int(_num(p.get("n"))) for pts in points.values() for p in pts if _num(p.get("n")) == _num(p.get("n"))]
    n_total = max(ns, default=0)
    for i, (split, pts) in enumerate(sorted(points.items(), key=lambda kv: kv[0] != "eval")):
        steps = [p["step"] for p in pts]
        suffix = "" if split == "eval" else f" [{split}]"
        for key, style, marker, label in (("accuracy", "-", "o", "accuracy"),
                                          ("lenient_accuracy", "--", "s", "lenient accuracy")):
            ys = np.array([_num(p.get(key)) for p in pts])
            if not np.isfinite(ys).any():
                continue
            color = f"C{2 * i + (key != 'accuracy')}"
            ax.plot(steps, ys, linestyle=style, marker=marker, color=color, label=label + suffix)
            if len(pts) <= 8:  # label the values while they do not clutter
                for s, v in zip(steps, ys):
                    if v == v:
                        ax.annotate(f"{v:.2f}", (s, v), textcoords="offset points", xytext=(0, 7),
                                    ha="center", fontsize=8, color=color)
    ax.set_ylim(-0.02, 1.08)
    ax.set_xlabel("step (0 = before training)")
    ax.set_ylabel("accuracy (fraction correct)")
    ax.set_title("Held-out accuracy (greedy)" + (f", n = {n_total} prompts" if n_total else ""))
    ax.legend(fontsize=8, loc="best")
    _save(fig, path)


def plot_kl(data: RunData, path: Path) -> None:
    fig, (ax,) = _figure()
    x, kl = data.x(), data.y("loss/kl")
    w = _window(len(x))
    ax.plot(x, kl, color="C3", linewidth=0.8, alpha=_raw_alpha(len(x)), label="KL")
    ax.plot(x, moving_average(kl, w), color="C3", linewidth=2.2, label=f"trailing avg ({w} steps)")
    est = _cfg(data.config, "algo", "kl_estimator")
    ax.set_xlabel("step")
    ax.set_ylabel("KL(policy || reference)" + (f" [{est}]" if est else ""))
    coeff = _cfg(data.config, "algo", "kl_coeff")
    ax.set_title("KL to the reference model" + (f" (kl_coeff = {coeff:g})" if isinstance(coeff, (int, float)) else ""))
    ax.legend(fontsize=8, loc="best")
    _save(fig, path)


def plot_mismatch(data: RunData, path: Path) -> None:
    # Two scales: the per-token averages (KL(mu || pi_old) and mean log(pi_old / mu), about -KL under mu) are
    # ~1e-3, the extremes over a batch's tokens ~1: one axis would flatten the averages to a line at 0.
    avg = [k for k in ("mismatch/kl_mu_old", "mismatch/log_ratio_mean") if data.has(k)]
    ext = [k for k in ("mismatch/log_ratio_max", "mismatch/log_ratio_min") if data.has(k)]
    fig, axes = _figure(nrows=int(bool(avg)) + int(bool(ext)), height=5.2 if avg and ext else FIGSIZE[1])
    x, i = data.x(), 0
    if avg:
        ax = axes[i]
        ax.axhline(0.0, color="black", linewidth=0.8, alpha=0.5)
        for key, color, label in (("mismatch/kl_mu_old", "C4", "KL(mu || pi_old), k3"),
                                  ("mismatch/log_ratio_mean", "C0", "mean log(pi_old / mu)")):
            if key in avg:
                y = data.y(key)
                w = _window(len(x))
                ax.plot(x, y, color=color, linewidth=0.8, alpha=_raw_alpha(len(x)), label=label)
                ax.plot(x, moving_average(y, w), color=color, linewidth=2.0, label=f"  trailing avg ({w} steps)")
        ax.set_ylabel("per-token average")
        _legend(ax, "right")
        i += 1
    if ext:
        ax = axes[i]
        ax.axhline(0.0, color="black", linewidth=0.8, alpha=0.5)
        for key, color in (("mismatch/log_ratio_max", "C1"), ("mismatch/log_ratio_min", "C2")):
            if key in ext:
                ax.plot(x, data.y(key), color=color, linewidth=1.0, label=key.rsplit("_", 1)[1] + " over tokens")
        ax.set_ylabel("log(pi_old / mu)")
        _legend(ax, "right")
    axes[-1].set_xlabel("step")
    precision = _cfg(data.config, "rollout", "precision")
    sampler = f"{precision} sampler" if isinstance(precision, str) else "quantized sampler"
    fig.suptitle("Rollout mismatch: quantized sampler vs BF16 policy\n"
                 f"mu = {sampler}, pi_old = BF16 learner policy; 0 = identical token probabilities", fontsize=10)
    _save(fig, path)


def stage_times(data: RunData) -> dict[str, np.ndarray]:
    """Seconds per stage per step (NaN -> 0 for stacking), plus "other" when time/step exceeds the stages' sum
    by more than 1% on average."""
    out = {s: np.nan_to_num(data.y(f"time/{s}"), nan=0.0) for s in STAGES if data.has(f"time/{s}")}
    if out and data.has("time/step"):
        total = data.y("time/step")
        other = np.where(np.isfinite(total), np.maximum(total - sum(out.values()), 0.0), 0.0)
        if other.mean() > 0.01 * nanmean(total):
            out["other"] = other
    return out


def plot_time(data: RunData, path: Path) -> None:
    fig, (ax,) = _figure()
    x, parts = data.x(), stage_times(data)
    colors = {"generate": "C0", "reference": "C2", "learn": "C3", "sync": "C1", "other": "0.6"}
    ax.stackplot(x, *parts.values(), labels=list(parts), colors=[colors[k] for k in parts], alpha=0.85,
                 step="mid" if len(x) < 40 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("Step time by stage (stacked)")
    handles, labels = ax.get_legend_handles_labels()  # reversed: legend order = stacking order, top first
    ax.legend(handles[::-1], labels[::-1], fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              borderaxespad=0.0)
    if len(x) > 1:
        ax.set_xlim(x.min(), x.max())
    _save(fig, path)


# ---------------------------------------------------------------------------------------------------- summary


def _fence(text: str) -> str:
    """A code block that survives backticks in model output."""
    run = longest = 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    f = "`" * max(3, longest + 1)
    return f"{f}text\n{text}\n{f}"


def _short(text: Any, limit: int = MAX_TEXT) -> str:
    s = "" if text is None else str(text)
    return s if len(s) <= limit else s[:limit] + f" [... {len(s) - limit} more characters]"


def _summary(data: RunData, run_dir: Path, plots: list[tuple[str, str]], rollouts: Rollouts | None,
             missing: list[str]) -> str:
    c = data.config
    name = _cfg(c, "run", "name") or run_dir.name
    md = [f"# Run report: {name}", "", f"Run directory: `{run_dir}`", ""]

    md += ["## Settings", "", "| setting | value |", "|---|---|"]
    for sec, key in SETTINGS:
        v = _cfg(c, sec, key)
        md.append(f"| {sec}.{key} | {'n/a' if v is None else (f'{v:g}' if isinstance(v, float) else v)} |")
    md.append("")

    md += ["## Progress", ""]
    if data.steps:
        total = _cfg(c, "run", "steps")
        last = data.steps[-1]["step"]
        md.append(f"- Steps done: {last}" + (f" of {total}" if isinstance(total, int) else "")
                  + f" ({len(data.steps)} logged step lines)")
    else:
        md.append("- Steps done: 0 (no step lines in metrics.jsonl)")
    if len(data.times) >= 2:
        wall = data.times[-1] - data.times[0]
        md.append(f"- Wall time: {fmt_duration(wall)} ({wall:.1f} s, first to last metrics line)")
    else:
        md.append("- Wall time: n/a (fewer than two timed lines)")
    ckpts = [e for e in data.events if e.get("event") == "checkpoint"]
    if ckpts:
        md.append(f"- Checkpoints: {len(ckpts)}, last at step {ckpts[-1].get('step')}: `{ckpts[-1].get('path')}`")
    md.append("")

    if data.has("reward/mean"):
        k = HEAD_TAIL
        md += ["## Reward", "",
               f"| reward | first {k} steps | last {k} steps | change |", "|---|---|---|---|"]
        for key in ["reward/mean"] + reward_functions(data):
            y = data.y(key)
            a, b = nanmean(y[:k]), nanmean(y[-k:])
            md.append(f"| {key.split('/', 1)[1]} | {fmt(a)} | {fmt(b)} | {_signed(b - a)} |")
        if len(data.steps) < 2 * k:
            md.append(f"\n(Only {len(data.steps)} steps: the first and last {k} overlap.)")
        md.append("")

    points = eval_points(data)
    if points:
        md += ["## Held-out accuracy", ""]
        for split, pts in sorted(points.items(), key=lambda kv: kv[0] != "eval"):
            before, after = pts[0], pts[-1]
            n = before.get("n")
            md.append(f"- {split}" + (f" (n = {n})" if n is not None else "") + ":"
                      f" accuracy {fmt(before.get('accuracy'))} at step {before['step']}"
                      f" -> {fmt(after.get('accuracy'))} at step {after['step']}"
                      + (f"; lenient {fmt(before.get('lenient_accuracy'))} -> {fmt(after.get('lenient_accuracy'))}"
                         if any(_num(p.get("lenient_accuracy")) == _num(p.get("lenient_accuracy")) for p in pts)
                         else ""))
            if before is after:
                md.append("  (a single eval: no before/after pair)")
        md.append("")

    mism = [k for k in ("mismatch/kl_mu_old", "mismatch/log_ratio_mean", "mismatch/log_ratio_max",
                        "mismatch/log_ratio_min") if data.has(k)]
    if mism:
        precision = _cfg(c, "rollout", "precision", "quantized")
        md += [f"## Final mismatch ({precision} sampler mu vs BF16 policy pi_old)", "",
               f"| metric | last step | mean of last {HEAD_TAIL} |", "|---|---|---|"]
        for k in mism:
            y = data.y(k)
            md.append(f"| {k} | {fmt(last_finite(y), 4)} | {fmt(nanmean(y[-HEAD_TAIL:]), 4)} |")
        md.append("")

    parts = stage_times(data)
    if parts:
        means = {s: float(v.mean()) for s, v in parts.items()}
        total = sum(means.values())
        md += ["## Step time by stage", "", "| stage | mean s/step | share |", "|---|---|---|"]
        for s, m in means.items():
            md.append(f"| {s} | {m:.3f} | {100 * m / total:.1f}% |" if total > 0 else f"| {s} | {m:.3f} | n/a |")
        md.append(f"| total | {total:.3f} | 100% |")
        if data.has("perf/gen_tokens_per_s"):
            md.append(f"\nGeneration throughput: {fmt(nanmean(data.y('perf/gen_tokens_per_s')), 1)} tokens/s "
                      "(mean over steps).")
        md.append("")

    if plots:
        md += ["## Plots", ""]
        md += [f"![{title}]({fname})\n" for fname, title in plots]

    if rollouts is not None:
        md += ["## Sample completions", "", f"Rollout rows: {rollouts.rows} (steps {rollouts.first_step}"
               f"-{rollouts.last_step}). Shown: the best, a middle and the worst completion by reward.", ""]
        for label, step, rows in (("First", rollouts.first_step, rollouts.first),
                                  ("Last", rollouts.last_step, rollouts.last)):
            if not rows:
                continue
            md += [f"### {label} logged step ({step})", ""]
            for r in rows:
                meta = ", ".join(f"{k} {fmt(r.get(k))}" for k in ("reward", "advantage") if k in r)
                extra = ", ".join(f"{k} {r[k]}" for k in ("precision", "policy_version", "generator_id") if k in r)
                md += [f"- prompt `{r.get('prompt_id', '?')}`: {meta}" + (f" ({extra})" if extra else ""), "",
                       "Prompt:", "", _fence(_short(r.get("prompt"))), "", "Completion:", "",
                       _fence(_short(r.get("completion"))), ""]

    notes = missing + data.notes
    if notes:
        md += ["## Missing or skipped", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(md).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------------- entry


def report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write reward.png, accuracy.png, kl.png, mismatch.png, time.png (each when its data exists) and summary.md
    into `out_dir` (default RUN_DIR/report); return `out_dir`."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)

    data = RunData()
    load_metrics(run_dir / "metrics.jsonl", data)
    load_config(run_dir / "config.toml", data)
    rollouts = load_rollouts(run_dir, data.notes)

    plan = [
        ("reward.png", "Training reward", plot_reward, data.steps and data.has("reward/mean"),
         "reward plot: no reward/mean values"),
        ("accuracy.png", "Held-out accuracy", plot_accuracy, bool(eval_points(data)),
         "held-out accuracy: no eval events (enable run.eval)"),
        ("kl.png", "KL to reference", plot_kl, data.steps and data.has("loss/kl"),
         "KL plot: no loss/kl values (no reference model?)"),
        ("mismatch.png", "Sampler vs policy mismatch", plot_mismatch,
         data.steps and any(data.has(k) for k in ("mismatch/kl_mu_old",) + MISMATCH_RATIO_KEYS),
         "mismatch plot: no mismatch/* values"),
        ("time.png", "Step time by stage", plot_time, data.steps and any(data.has(f"time/{s}") for s in STAGES),
         "step time plot: no time/<stage> values"),
    ]
    plots, missing = [], []
    for fname, title, fn, available, why in plan:
        target = out / fname
        if not available:
            missing.append(why)
            target.unlink(missing_ok=True)  # no stale plot from an earlier report of the same run
            continue
        try:
            fn(data, target)
            plots.append((fname, title))
        except Exception as e:  # one broken panel must not cost the whole report
            missing.append(f"{fname}: plotting failed ({type(e).__name__}: {e})")
    (out / "summary.md").write_text(_summary(data, run_dir, plots, rollouts, missing))
    return out
