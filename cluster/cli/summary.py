"""What `qgrpo train` prints when a run ends: the held-out accuracy before and after, the rewards that failed, and
where to look next."""
from __future__ import annotations


def summary(result: dict, run_dir, seconds: float) -> str:
    """What `qgrpo train` prints at the end: the held-out accuracy before and after, and where to look next."""
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
    lines += [f"  run directory:    {run_dir}",
              f"  final checkpoint: {result['checkpoint']}  (loads with transformers.AutoModelForCausalLM)",
              f"  look at it:       qgrpo report {run_dir}   |   tensorboard --logdir {run_dir}/tensorboard",
              f"  samples:          {run_dir}/rollouts/*.parquet (pandas / DuckDB / pyarrow)"]
    return "\n".join(lines)
