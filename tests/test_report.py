"""cluster.report.build: plots and summary of a run directory, from synthetic runs (no Ray, no model)."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from qgrpo.cluster.report.build import report
from qgrpo.cluster.report.run_data import moving_average

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL_PNGS = ("reward.png", "accuracy.png", "kl.png", "mismatch.png", "time.png")
STEPS = 30
NAN_STEP = 4  # reward/mean is NaN here (inside the first 10 steps, so the summary's mean must skip it)
ACC_BEFORE, ACC_AFTER = 0.137, 0.712
LENIENT_BEFORE, LENIENT_AFTER = 0.231, 0.804

CONFIG = """\
[run]
name = "synthetic"
steps = 30
eval = true

[model]
path = "builtin:tiny-digits"

[task]
name = "digit_sum"

[rewards]
functions = [{ name = "correct", weight = 0.8 }, { name = "answer_format", weight = 0.2 }]

[rollout]
precision = "int4"
prompts_per_step = 4
group_size = 8

[algo]
kl_coeff = 0.001
kl_estimator = "k3"

[learner]
lr = 0.00025
"""


def make_run(run_dir: Path, full: bool = True) -> list[dict]:
    """A plausible 30-step run: rising reward, eval at 0 and 30, a NaN, a checkpoint, Parquet rollouts.
    `full=False`: step lines with reward keys only, nothing else. Returns the step records written."""
    rng = random.Random(0)
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = 1_700_000_000.0
    lines: list[dict] = [{"time": t0, "event": "start", "generators": [], "resumed_from": None}] if full else []
    if full:
        lines.append({"time": t0 + 5, "event": "eval", "step": 0, "accuracy": ACC_BEFORE,
                      "lenient_accuracy": LENIENT_BEFORE, "n": 64, "split": "eval"})
    steps = []
    for step in range(1, STEPS + 1):
        p = 0.15 + 0.6 * step / STEPS + rng.uniform(-0.08, 0.08)
        m = {"time": t0 + 10 + 3.0 * step, "step": step, "reward/mean": p, "reward/std": 0.3 + 0.05 * rng.random(),
             "reward/correct": p * 0.9, "reward/answer_format": min(1.0, 0.5 + step / STEPS)}
        if step == NAN_STEP:
            m["reward/mean"] = math.nan
        if full:
            gen, ref, learn, sync = 1.6 + 0.2 * rng.random(), 0.3, 0.8 + 0.1 * rng.random(), 0.15
            m.update({
                "loss/kl": 0.002 * step * (1 + 0.2 * rng.random()) if step != 17 else math.nan,
                "loss/clip_frac_low": 0.01, "loss/clip_frac_high": 0.02, "loss/grad_norm": 0.5,
                "mismatch/log_ratio_max": 1.2 + 0.5 * rng.random() if step != 9 else -math.inf,  # no tokens
                "mismatch/log_ratio_min": -1.0 - 0.5 * rng.random(),
                "mismatch/kl_mu_old": (kl_mu := 0.006 + 0.002 * rng.random()),
                "mismatch/log_ratio_mean": -kl_mu * (0.8 + 0.4 * rng.random()),  # E_mu[log pi_old/mu] = -KL
                "perf/gen_tokens_per_s": 900 + 50 * rng.random(),
                "time/generate": gen, "time/reference": ref, "time/learn": learn, "time/sync": sync,
                "time/step": gen + ref + learn + sync, "policy_version": step,
            })
        steps.append(m)
        lines.append(m)
        if full and step == 20:
            lines.append({"time": m["time"] + 0.5, "event": "checkpoint", "step": 20, "path": "ckpt/step_000020"})
    if full:
        lines.append({"time": t0 + 10 + 3.0 * STEPS + 6, "event": "eval", "step": STEPS, "accuracy": ACC_AFTER,
                      "lenient_accuracy": LENIENT_AFTER, "n": 64, "split": "eval"})
    # json.dumps writes NaN / -Infinity literals, as cluster.rundir.runlog does
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if full:
        (run_dir / "config.toml").write_text(CONFIG)
        write_rollouts(run_dir, rng)
    return steps


def write_rollouts(run_dir: Path, rng: random.Random) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = {k: [] for k in ("step", "prompt_id", "prompt", "completion", "reward", "advantage", "policy_version",
                            "precision", "generator_id")}
    for step in range(1, STEPS + 1):
        for i in range(8):
            r = 1.0 if rng.random() < 0.2 + 0.6 * step / STEPS else 0.0
            text = f"step {step} sample {i}: the sum is {rng.randint(0, 18)}"
            if step == 1 and i == 0:
                text += " ```code``` " + "x" * 2000  # long, with backticks
            for k, v in zip(cols, (step, f"p{step}-{i // 4}", f"What is {i} + {step}?", text, r, r - 0.5,
                                   step - 1, "int4", i % 2)):
                cols[k].append(v)
    d = run_dir / "rollouts"
    d.mkdir()
    table = pa.table(cols)
    pq.write_table(table.slice(0, 80), d / "steps_000001-000010.parquet")
    pq.write_table(table.slice(80), d / "steps_000011-000030.parquet")
    return table.num_rows


def assert_png(path: Path) -> None:
    from matplotlib.image import imread

    assert path.is_file() and path.stat().st_size > 0, path
    assert path.read_bytes()[:8] == PNG_MAGIC, path
    img = imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100, (path, img.shape)


def finite_mean(values) -> float:
    vals = [v for v in values if math.isfinite(v)]
    return sum(vals) / len(vals)


def test_full_run_report(tmp_path):
    run = tmp_path / "run"
    steps = make_run(run)
    out = report(run)
    assert out == run / "report"
    for name in ALL_PNGS:
        assert_png(out / name)
    md = (out / "summary.md").read_text()

    # settings from config.toml
    for text in ("synthetic", "builtin:tiny-digits", "digit_sum", "int4", "| rollout.group_size | 8 |",
                 "| rollout.prompts_per_step | 4 |", "0.00025"):
        assert text in md, text
    assert "Steps done: 30 of 30" in md
    wall = (1_700_000_000.0 + 10 + 3.0 * STEPS + 6) - 1_700_000_000.0
    assert f"{wall:.1f} s" in md

    # reward first 10 vs last 10, computed here independently (the NaN step is skipped)
    first = finite_mean(s["reward/mean"] for s in steps[:10])
    last = finite_mean(s["reward/mean"] for s in steps[-10:])
    assert f"| mean | {first:.3f} | {last:.3f} |" in md
    assert f"{finite_mean(s['reward/correct'] for s in steps[-10:]):.3f}" in md

    # held-out accuracy before / after
    assert f"accuracy {ACC_BEFORE:.3f} at step 0 -> {ACC_AFTER:.3f} at step {STEPS}" in md
    assert f"lenient {LENIENT_BEFORE:.3f} -> {LENIENT_AFTER:.3f}" in md

    # final mismatch, time split, images, samples
    assert f"{steps[-1]['mismatch/kl_mu_old']:.4f}" in md
    gen_share = 100 * np.mean([s["time/generate"] for s in steps]) / np.mean([s["time/step"] for s in steps])
    assert f"{gen_share:.1f}%" in md
    for name in ALL_PNGS:
        assert f"]({name})" in md
    assert "Rollout rows: 240" in md
    assert "### First logged step (1)" in md and "### Last logged step (30)" in md
    assert "more characters]" in md and "x" * 1000 not in md  # the long completion is truncated
    assert "````text" in md  # a fence longer than the completion's own backticks
    assert md.count("Completion:") == 6
    assert "no eval events" not in md and "Missing" not in md


def test_minimal_run_reports_what_is_missing(tmp_path):
    run = tmp_path / "bare"
    make_run(run, full=False)
    out = report(run, tmp_path / "out")
    assert out == tmp_path / "out"
    assert_png(out / "reward.png")
    for name in ALL_PNGS[1:]:
        assert not (out / name).exists(), name
    md = (out / "summary.md").read_text()
    assert "## Missing or skipped" in md
    for text in ("no eval events", "no loss/kl", "no mismatch", "no time/", "no rollouts", "no config.toml"):
        assert text in md, text
    assert "Steps done: 30" in md and "(reward.png)" in md and "kl.png" not in md


def test_broken_and_empty_inputs_do_not_crash(tmp_path):
    run = tmp_path / "broken"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"time": 1.0, "event": "start"}\n{"time": 2.0, "step": 1, "reward/me')
    (run / "config.toml").write_text("this is = = not toml")
    md = (report(run) / "summary.md").read_text()
    assert "1 unreadable line" in md and "config.toml unreadable" in md and "Steps done: 0" in md
    with pytest.raises(FileNotFoundError):
        report(tmp_path / "nope")


def test_moving_average_skips_nan():
    y = np.array([1.0, np.nan, 3.0, 5.0, np.nan, np.nan, np.nan])
    ma = moving_average(y, window=2)
    np.testing.assert_allclose(ma[:6], [1.0, 1.0, 3.0, 4.0, 5.0, np.nan])
    assert np.isnan(ma[6])


# ---------------------------------------------------------------------------------------------------------------------
# short runs, no KL term, reward entries whose calls failed


def _short_run(run_dir: Path, steps: int = 3, kl_coeff: float = 0.001, extra: dict | None = None,
               events: list[dict] | None = None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [{"time": 10.0 + s, "step": s, "reward/mean": 0.1 * s, "reward/correct": 0.2 * s, "loss/kl": 0.001 * s,
              **(extra or {}).get(s, {})} for s in range(1, steps + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines + (events or [])))
    (run_dir / "config.toml").write_text(CONFIG.replace("kl_coeff = 0.001", f"kl_coeff = {kl_coeff}"))


def test_a_three_step_run_has_whole_step_ticks(tmp_path):
    from qgrpo.cluster.report.plots import plot_kl, plot_reward
    from qgrpo.cluster.report.run_data import RunData, load_metrics, read_run_config

    _short_run(tmp_path / "run")
    data = RunData()
    load_metrics(tmp_path / "run" / "metrics.jsonl", data)
    read_run_config(tmp_path / "run" / "config.toml", data)
    for plot in (plot_reward, plot_kl):
        ax = plot(data, tmp_path / "p.png").axes[0]
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_no_kl_panel_when_the_run_had_no_kl_term(tmp_path):
    _short_run(tmp_path / "with", kl_coeff=0.001)
    _short_run(tmp_path / "without", kl_coeff=0.0)
    assert_png(report(tmp_path / "with") / "kl.png")
    out = report(tmp_path / "without")
    assert not (out / "kl.png").exists()
    md = (out / "summary.md").read_text()
    assert "kl.png" not in md and "algo.kl_coeff = 0" in md


FAILED_EVENTS = [
    {"time": 12.5, "event": "reward_errors", "step": 2, "label": "answer_format", "field": "rewards.functions[1]",
     "failed": 3, "of": 32, "error": "ValueError: no digits", "where": "rewards.py:12 in fmt: int(text)",
     "log": "reward_errors.log"},
    {"time": 13.5, "event": "reward_errors", "step": 3, "label": "answer_format", "field": "rewards.functions[1]",
     "failed": 32, "of": 32, "error": "ValueError: no digits again", "where": "", "log": "reward_errors.log"},
]


def test_failed_reward_entries_are_reported_not_drawn_as_zero(tmp_path):
    """Step 2: 3 of 32 calls of answer_format failed (its mean is over the other 29); step 3: all 32 failed, so the
    step has no reward/answer_format at all. The summary says so; the averages use what exists."""
    run = tmp_path / "run"
    _short_run(run, steps=4, events=FAILED_EVENTS, extra={
        1: {"reward/answer_format": 0.5}, 2: {"reward/answer_format": 0.7, "reward/errors/answer_format": 3},
        3: {"reward/errors/answer_format": 32}, 4: {"reward/answer_format": 0.9}})
    (run / "reward_errors.log").write_text("Traceback ...\nValueError: no digits\n")
    out = report(run)
    assert_png(out / "reward.png")
    md = (out / "summary.md").read_text()
    section = md.split("## Reward failures", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in section.splitlines() if line.startswith("| answer_format"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["answer_format (rewards.functions[1])", "35 of 64", "29 in those steps; all in the other 2",
                     "2 of 4 (steps 2-3)", "ValueError: no digits", "rewards.py:12 in fmt: int(text)"], row
    assert f"`{run / 'reward_errors.log'}`" in section
    # first/last 10 of a 4-step run: the mean of the three values that exist (0.5, 0.7, 0.9), not of a 0 for step 3
    assert "| answer_format (calls failed in 2 steps: see Reward failures) | 0.700 | 0.700 |" in md
    assert "errors/answer_format" not in md.split("## Reward failures")[0]  # a count, not a reward entry


def test_failures_without_events_still_count(tmp_path):
    """Step lines with counts but no events (a log cut short): counted, the error unknown; no section without any."""
    _short_run(tmp_path / "run", extra={2: {"reward/errors/correct": 4}})
    md = (report(tmp_path / "run") / "summary.md").read_text()
    assert "## Reward failures" in md
    assert "| correct | 4 | n/a; all in the other 2 | 1 of 3 (step 2) | n/a | n/a |" in md
    assert "is not in the run directory" in md
    _short_run(tmp_path / "clean")
    assert "Reward failures" not in (report(tmp_path / "clean") / "summary.md").read_text()


def test_the_reward_plot_marks_the_failed_steps(tmp_path):
    from qgrpo.cluster.report.plots import plot_reward
    from qgrpo.cluster.report.run_data import RunData, load_metrics, read_run_config

    _short_run(tmp_path / "run", steps=4, events=FAILED_EVENTS, extra={
        2: {"reward/answer_format": 0.7, "reward/errors/answer_format": 3}, 3: {"reward/errors/answer_format": 32}})
    data = RunData()
    load_metrics(tmp_path / "run" / "metrics.jsonl", data)
    read_run_config(tmp_path / "run" / "config.toml", data)
    lines = {line.get_label(): line for line in plot_reward(data, tmp_path / "r.png").axes[0].get_lines()}
    assert list(lines["answer_format: calls failed"].get_xdata()) == [2, 3]
    assert "correct: calls failed" not in lines
    drawn = lines["answer_format (trailing avg)"].get_ydata()
    assert np.isnan(drawn[0]) and drawn[2] == pytest.approx(0.7)  # nothing before step 2; step 3 draws no 0
