"""The report's PNG plots (matplotlib Figure objects, no pyplot: no display, no global backend)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from qgrpo.cluster.report.failures import failed_steps
from qgrpo.cluster.report.run_data import (
    DPI,
    FIGSIZE,
    STAGES,
    RunData,
    _cfg,
    _num,
    _raw_alpha,
    _window,
    eval_points,
    moving_average,
    nanmean,
    reward_functions,
)

# ---------------------------------------------------------------------------------------------------- plots


def _figure(nrows: int = 1, height: float = FIGSIZE[1]):
    # Figure + savefig without pyplot: no global backend switch, no display needed, nothing left open.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(FIGSIZE[0], height), dpi=DPI, layout="constrained")  # fits outside legends
    axes = fig.subplots(nrows, 1, sharex=True, squeeze=False)[:, 0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: no 0.5 ticks on a short run
    return fig, axes


def _legend(ax, where: str = "best", ncol: int = 1) -> None:
    """Legends outside the data: "right" of the axes, or "below" them; "best" inside."""
    if where == "right":
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    elif where == "below":
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=ncol, frameon=False)
    else:
        ax.legend(fontsize=8, loc=where)


def _save(fig, path: Path):
    """Write the PNG; the Figure is returned, for a caller (or a test) that looks at it."""
    fig.savefig(path, dpi=DPI, format="png")
    return fig


def plot_reward(data: RunData, path: Path):  # -> the Figure written
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
        # The mean over the completions the entry scored: a step where every call failed is a gap, not a 0.
        ax.plot(x, moving_average(data.y(key), w), color=f"C{i + 1}", linewidth=1.4, linestyle="--",
                label=f"{key.split('/', 1)[1]} (trailing avg)")
        failed = failed_steps(data, key)
        if failed:  # marked along the bottom of the axes, in the entry's colour
            ax.plot(failed, [0.02] * len(failed), linestyle="none", marker="x", color=f"C{i + 1}",
                    transform=ax.get_xaxis_transform(), label=f"{key.split('/', 1)[1]}: calls failed")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title("Training reward per step")
    _legend(ax, "below", ncol=3)
    return _save(fig, path)


def plot_accuracy(data: RunData, path: Path):  # -> the Figure written
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
    return _save(fig, path)


def plot_kl(data: RunData, path: Path):  # -> the Figure written
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
    return _save(fig, path)


def plot_mismatch(data: RunData, path: Path):  # -> the Figure written
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
    return _save(fig, path)


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


def plot_time(data: RunData, path: Path):  # -> the Figure written
    fig, (ax,) = _figure()
    x, parts = data.x(), stage_times(data)
    # Every stage the driver may lap (STAGES) needs a colour; the first four keep theirs from older reports.
    colors = {"generate": "C0", "reference": "C2", "learn": "C3", "sync": "C1", "rewards": "C4", "pack": "C5",
              "rollout_wait": "C9", "other": "0.6"}  # C9 (cyan), not C7: grey would read as "other"
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
    return _save(fig, path)


# ---------------------------------------------------------------------------------------------------- summary




EPISODE_FINISHES = ("stop", "max_turns", "context", "env_error", "length")


def plot_episodes(data: RunData, path: Path):  # -> the Figure written
    """Multi-turn runs: what the trajectories did per step (model turns and tool calls per trajectory, the share that
    called a tool), and how they ended (the share of each finish reason: length, context, max_turns: truncations)."""
    fig, (top, bottom) = _figure(nrows=2, height=FIGSIZE[1] * 1.6)
    x = data.x()
    for key, label, color in (("episode/turns", "model turns", "C0"), ("episode/tool_calls", "tool calls", "C1"),
                              ("episode/tool_errors", "tool errors", "C3")):
        if data.has(key):
            top.plot(x, moving_average(data.y(key), _window(len(x))), color=color, linewidth=1.8, label=label)
    top.set_ylabel("per trajectory")
    top.set_title("Multi-turn trajectories (trailing averages)")
    _legend(top, "right")
    for i, reason in enumerate(EPISODE_FINISHES):
        key = f"episode/finish_{reason}"
        if data.has(key):
            bottom.plot(x, moving_average(data.y(key), _window(len(x))), color=f"C{i}", linewidth=1.8,
                        label=f"finished: {reason}")
    if data.has("episode/called_tool_frac"):
        bottom.plot(x, moving_average(data.y("episode/called_tool_frac"), _window(len(x))), color="C5",
                    linestyle="--", linewidth=1.8, label="called a tool")
    bottom.set_ylim(-0.02, 1.02)
    bottom.set_xlabel("step")
    bottom.set_ylabel("share of trajectories")
    _legend(bottom, "right")
    return _save(fig, path)
