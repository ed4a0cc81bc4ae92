"""A static report of one run directory: PNG plots and a Markdown summary, built from metrics.jsonl, config.toml
and rollouts/*.parquet. Nothing here needs Ray, torch or a display.

    from qgrpo.cluster.report.build import report
    out = report("runs/tiny-20260101-120000")    # -> runs/.../report/{summary.md, reward.png, ...}

Whatever is missing from the run (no eval events, no KL because there is no reference or algo.kl_coeff = 0, no
rollouts, a crashed run with a half-written last line) only removes the matching plot or section; the summary says
what was left out and why. NaN and +-inf values are plotted as gaps and ignored by the averages. Reward entries whose
calls failed get a section of their own (failures.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from qgrpo.cluster.report.failures import failures_section, reward_failures
from qgrpo.cluster.report.plots import (
    plot_accuracy,
    plot_episodes,
    plot_kl,
    plot_mismatch,
    plot_reward,
    plot_time,
    stage_times,
)
from qgrpo.cluster.report.run_data import (
    HEAD_TAIL,
    MAX_TEXT,
    MISMATCH_RATIO_KEYS,
    SETTINGS,
    STAGES,
    Rollouts,
    RunData,
    _cfg,
    _num,
    _signed,
    eval_points,
    fmt,
    fmt_duration,
    last_event,
    last_finite,
    load_metrics,
    load_rollouts,
    nanmean,
    read_run_config,
    reward_functions,
    stream_stats,
)
from qgrpo.learner.objective.staleness import rollout_mode
from qgrpo.rollout.answer_stats import describe_answers, describe_baseline, hollow_warnings


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


def _baseline_lines(before: dict, after: dict, baseline: dict | None) -> list[str]:
    """The final held-out accuracy beside the base model's and the majority baseline, and its answers."""
    base = (f"base model {fmt(before.get('accuracy'))}" if before["step"] == 0 and before is not after
            else "no base-model evaluation before it")
    majority = (f"majority baseline: {describe_baseline(baseline)}" if baseline
                else "no majority baseline in the run log (a run from before it was logged)")
    lines = [f"  - final {fmt(after.get('accuracy'))} at step {after['step']} against: {base}; {majority}"]
    answers = describe_answers(after)
    return lines + ([f"  - held-out answers at step {after['step']}: {answers}"] if answers else [])


def _warnings(points: dict[str, list[dict]], baseline: dict | None) -> list[str]:
    final = points["eval"][-1] if points.get("eval") else None
    warnings = hollow_warnings(final, baseline) if final and final["step"] > 0 else []  # step 0: the base model
    if not warnings:
        return []
    md = ["## Warnings", "", f"Held-out evaluation at step {final['step']}:", ""]
    return md + [f"- **Warning:** {w.removeprefix('warning: ')}" for w in warnings] + [""]


def _settings(c: dict) -> list[str]:
    md = ["## Settings", "", "| setting | value |", "|---|---|"]
    for sec, key in SETTINGS:
        v = _cfg(c, sec, key)
        md.append(f"| {sec}.{key} | {'n/a' if v is None else (f'{v:g}' if isinstance(v, float) else v)} |")
    return md + [""]


def _progress(data: RunData) -> list[str]:
    md = ["## Progress", ""]
    if data.steps:
        total = _cfg(data.config, "run", "steps")
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
    return md + [""]


def _rollouts(data: RunData) -> list[str]:
    """How the run got its rollouts (the config's mode) and, for a stream, how stale they were (stream/* metrics)."""
    c = data.config
    if not c and not data.steps:
        return []
    md = ["## Rollouts", "", "- Mode: " + rollout_mode(_cfg(c, "algo", "max_staleness"), _cfg(c, "algo", "overlap"),
                                                      _cfg(c, "rollout", "num_actors"))]
    stats = stream_stats(data.steps)
    if stats is not None:
        md.append(f"- Streamed: {stats.words()}")
    return md + [""]


def _reward(data: RunData) -> list[str]:
    if not data.has("reward/mean"):
        return []
    k = HEAD_TAIL
    md = ["## Reward", "", f"| reward | first {k} steps | last {k} steps | change |", "|---|---|---|---|"]
    failures = reward_failures(data)
    for key in ["reward/mean"] + reward_functions(data):
        y, name = data.y(key), key.split('/', 1)[1]
        a, b = nanmean(y[:k]), nanmean(y[-k:])
        failed = failures[name].steps if name in failures else []
        note = f" (calls failed in {len(failed)} step{'s' * (len(failed) != 1)}: see Reward failures)" if failed else ""
        md.append(f"| {name}{note} | {fmt(a)} | {fmt(b)} | {_signed(b - a)} |")
    if len(data.steps) < 2 * k:
        md.append(f"\n(Only {len(data.steps)} steps: the first and last {k} overlap.)")
    if data.has("answers/top_share"):
        d, t = data.y("answers/distinct"), data.y("answers/top_share")
        md.append(f"\nAnswers of the training completions (all of a step's): {fmt(nanmean(d[:k]), 1)} -> "
                  f"{fmt(nanmean(d[-k:]), 1)} distinct, the most common {fmt(nanmean(t[:k]))} -> "
                  f"{fmt(nanmean(t[-k:]))} of them (first vs last {k} steps).")
    return md + [""]


def _accuracy(points: dict[str, list[dict]], baseline: dict | None) -> list[str]:
    if not points:
        return []
    md = ["## Held-out accuracy", ""]
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
        if split == "eval":
            md += _baseline_lines(before, after, baseline)
    return md + [""]


def _mismatch(data: RunData) -> list[str]:
    mism = [k for k in ("mismatch/kl_mu_old", "mismatch/log_ratio_mean", "mismatch/log_ratio_max",
                        "mismatch/log_ratio_min") if data.has(k)]
    if not mism:
        return []
    precision = _cfg(data.config, "rollout", "precision", "quantized")
    md = [f"## Final mismatch ({precision} sampler mu vs BF16 policy pi_old)", "",
          f"| metric | last step | mean of last {HEAD_TAIL} |", "|---|---|---|"]
    for k in mism:
        y = data.y(k)
        md.append(f"| {k} | {fmt(last_finite(y), 4)} | {fmt(nanmean(y[-HEAD_TAIL:]), 4)} |")
    return md + [""]


def _step_time(data: RunData) -> list[str]:
    parts = stage_times(data)
    if not parts:
        return []
    means = {s: float(v.mean()) for s, v in parts.items()}
    total = sum(means.values())
    md = ["## Step time by stage", "", "| stage | mean s/step | share |", "|---|---|---|"]
    for s, m in means.items():
        md.append(f"| {s} | {m:.3f} | {100 * m / total:.1f}% |" if total > 0 else f"| {s} | {m:.3f} | n/a |")
    md.append(f"| total | {total:.3f} | 100% |")
    if data.has("perf/gen_tokens_per_s"):
        md.append(f"\nGeneration throughput: {fmt(nanmean(data.y('perf/gen_tokens_per_s')), 1)} tokens/s "
                  "(mean over steps).")
    return md + [""]


def _samples(rollouts: Rollouts | None) -> list[str]:
    if rollouts is None:
        return []
    md = ["## Sample completions", "", f"Rollout rows: {rollouts.rows} (steps {rollouts.first_step}"
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
    return md


def _summary(data: RunData, run_dir: Path, plots: list[tuple[str, str]], rollouts: Rollouts | None,
             missing: list[str]) -> str:
    """summary.md: a section only where the run has its data; what is missing is listed at the end."""
    name = _cfg(data.config, "run", "name") or run_dir.name
    md = [f"# Run report: {name}", "", f"Run directory: `{run_dir}`", ""]
    points, baseline = eval_points(data), last_event(data, "baseline")
    md += _warnings(points, baseline) + _settings(data.config) + _progress(data) + _rollouts(data) + _reward(data)
    md += failures_section(data, run_dir)
    md += _accuracy(points, baseline) + _mismatch(data) + _step_time(data)
    if plots:
        md += ["## Plots", ""]
        md += [f"![{title}]({fname})\n" for fname, title in plots]
    md += _samples(rollouts)
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
    read_run_config(run_dir / "config.toml", data)
    rollouts = load_rollouts(run_dir, data.notes)
    no_kl = _num(_cfg(data.config, "algo", "kl_coeff")) == 0.0  # the run's effective config (config.toml)

    plan = [
        ("reward.png", "Training reward", plot_reward, data.steps and data.has("reward/mean"),
         "reward plot: no reward/mean values"),
        ("accuracy.png", "Held-out accuracy", plot_accuracy, bool(eval_points(data)),
         "held-out accuracy: no eval events (enable run.eval)"),
        ("kl.png", "KL to reference", plot_kl, data.steps and data.has("loss/kl") and not no_kl,
         "KL plot: algo.kl_coeff = 0 (no KL term in the loss)" if no_kl else
         "KL plot: no loss/kl values (no reference model?)"),
        ("mismatch.png", "Sampler vs policy mismatch", plot_mismatch,
         data.steps and any(data.has(k) for k in ("mismatch/kl_mu_old",) + MISMATCH_RATIO_KEYS),
         "mismatch plot: no mismatch/* values"),
        ("time.png", "Step time by stage", plot_time, data.steps and any(data.has(f"time/{s}") for s in STAGES),
         "step time plot: no time/<stage> values"),
        ("episodes.png", "Multi-turn trajectories", plot_episodes, data.steps and data.has("episode/turns"), None),
    ]
    plots, missing = [], []
    for fname, title, fn, available, why in plan:
        target = out / fname
        if not available:
            if why is not None:  # a panel only some runs have (episodes: an [environment]) is not missed
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
