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
