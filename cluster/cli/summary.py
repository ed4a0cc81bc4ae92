"""What `qgrpo train` prints when a run ends: the held-out accuracy before and after, the rewards that failed, how
the run got its rollouts (and, streamed, how stale they were), and where to look next, as commands that run where the
user started qgrpo (core/invocation.py)."""
from __future__ import annotations

from pathlib import Path


def _rollout_lines(cfg, logs: Path | None) -> list[str]:
    """The run's rollout mode, and a stream's staleness from the stream/* metrics in `logs`/metrics.jsonl."""
    from qgrpo.cluster.report.run_data import RunData, load_metrics, stream_stats
    from qgrpo.learner.objective.staleness import rollout_mode

    lines = []
    if cfg is not None:
        mode = rollout_mode(cfg.algo.max_staleness, cfg.algo.overlap, cfg.rollout.num_actors)
        lines.append(f"  rollouts:         {mode}")
    if logs is not None:
        data = RunData()
        load_metrics(Path(logs) / "metrics.jsonl", data)
        stats = stream_stats(data.steps)
        if stats is not None:
            lines.append(f"  streamed:         {stats.words()}")
    return lines


def summary(result: dict, run_dir, seconds: float, cfg=None, logs: Path | None = None) -> str:
    """What `qgrpo train` prints at the end: the held-out accuracy before and after, the rollout mode (and a stream's
    staleness, read from `logs`/metrics.jsonl: the run's local copy of its logs), and where to look next."""
    from qgrpo.core.invocation import qgrpo_command, tool_command
    from qgrpo.rollout.answer_stats import verdict_lines

    m, evals = result["last"], result["evals"]
    lines = [f"qgrpo: done in {seconds / 60:.1f} min, {m.get('step')} steps; "
             f"last step reward {m.get('reward/mean', float('nan')):.3f}"]
    if evals:
        first, last = evals[min(evals)], evals[max(evals)]
        before = "base model" if min(evals) == 0 else f"step {min(evals)}"
        lines.append(f"  held-out accuracy ({first['metric']}, {first['n']} prompts, greedy, {first['precision']} "
                     f"generator): {first['accuracy']:.1%} before ({before}) -> {last['accuracy']:.1%} after")
        lines += [f"  {line}" for line in verdict_lines(last, result.get("baseline"))]
    lines += [f"  warning: reward {label!r} ({t['field']}) failed on {t['failed']} of {t['of']} completions in "
              f"{t['steps']} step{'s' * (t['steps'] != 1)} ({t['error']}{' at ' + t['where'] if t['where'] else ''}); "
              f"tracebacks in {run_dir}/reward_errors.log" for label, t in result.get("reward_failures", {}).items()]
    env = result.get("env_failures") or {}
    if env:  # environment failures (cluster/run/env_health.py), next to the rewards'
        lines.append(f"  warning: environment {env['name']} failed on {env['failed']} of {env['of']} trajectories in "
                     f"{env['steps']} step{'s' * (env['steps'] != 1)} ({env['error']}"
                     f"{' at ' + env['where'] if env['where'] else ''}); they ended as \"env_error\" with a score "
                     f"of 0; tracebacks in {run_dir}/env_errors.log")
    lines += _rollout_lines(cfg, logs)
    look = qgrpo_command("report", run_dir)
    if logs is None or (Path(logs) / "tensorboard").is_dir():  # run.tensorboard, and tensorboard installed
        look += f"   |   {tool_command('tensorboard', 'tensorboard.main', '--logdir', f'{run_dir}/tensorboard')}"
    lines += [f"  run directory:    {run_dir}",
              f"  final checkpoint: {result['checkpoint']}  (loads with transformers.AutoModelForCausalLM)",
              f"  look at it:       {look}",
              f"  samples:          {run_dir}/rollouts/*.parquet (pandas / DuckDB / pyarrow)"]
    return "\n".join(lines)
