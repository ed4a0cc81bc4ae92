"""The calculator example (examples/calculator/config.toml) run whole, once per seed with its int8 rollouts: whether
the default model learns to call the `calculate` tool for 3-digit multiplications it cannot do in its head.

Per run, from the run's metrics.jsonl and its held-out answers (RUN_DIR/evals/step_N.jsonl, the greedy evaluation
that plays each held-out row's episode through the environment, at step 0 and after the last step):
- **held-out accuracy** at step 0 and at the end (100 prompts, greedy, on the run's int8 generators);
- **on the held-out set**, at step 0 and at the end: the share of trajectories that called the tool (any tool call in
  any model turn, well-formed or not), and the accuracy of those that called it and of those that did not, each with
  its count; tool errors and model turns per trajectory;
- **in training**: `episode/called_tool_frac` (the share of the step's 64 trajectories that called the tool) over the
  first 5 and the last 5 steps, tool errors and model turns per trajectory, the reward, and seconds per step (mean
  over steps 2..N; step 1 is warm-up).

Each run is bench/default_job.py's (`one_run`: `qgrpo train` under its memory sampler), without the bf16 `qgrpo eval`
of the final checkpoint: that evaluation is single-turn and would not play the episodes. Finished runs are kept in
bench/results/calculator_job[_TAG]/s<seed>.json (their metrics and held-out answers under logs/) and `--resume` skips
them.

    .venv/bin/python bench/calculator_job.py                          # seeds 0 1, the config's 30 steps
    .venv/bin/python bench/calculator_job.py --steps 20 --publish     # fewer steps per seed, then publish
    .venv/bin/python bench/calculator_job.py --seeds 0 --steps 2 --tag smoke
    .venv/bin/python bench/calculator_job.py --report --publish       # tabulate the runs done so far
    .venv/bin/python bench/calculator_job.py --variants env agent --steps 10 --tag agent_vs_env --publish

Writes bench/results/calculator_job[_TAG].json and prints a table; `--publish` also writes bench/published/
calculator_job[_TAG].{json,txt}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shlex
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from default_job import kept_or_run, mean, one_run, results_folder, save, session_options  # noqa: E402
from sides import machine, versions  # noqa: E402

BENCH = "calculator_job"
CONFIG = ROOT / "examples" / "calculator" / "config.toml"
# The same task two ways: "env", the in-process environment (env.py, played by the rollout actors' episode loop);
# "agent", the ordinary openai-SDK program of examples/agent_calculator behind the run's endpoint. Same settings.
VARIANTS = {"env": CONFIG, "agent": ROOT / "examples" / "agent_calculator" / "config.toml"}
PRECISION = "int8"  # the example's own rollout.precision
EDGE = 5  # training steps averaged at the start and at the end


def called(answer: dict) -> bool:
    """Whether a held-out trajectory called a tool in any model turn (a call that could not be parsed counts)."""
    return any(t.get("tool_calls") for t in answer.get("turns") or [] if t.get("role") == "assistant")


def heldout(path: Path) -> dict:
    """Tool use and accuracy over one evaluation's held-out answers (evals/step_N.jsonl)."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    yes = [r for r in rows if called(r)]
    no = [r for r in rows if not called(r)]
    acc = lambda rs: sum(r["correct"] for r in rs) / len(rs) if rs else None  # noqa: E731
    turns = [r.get("turns") or [] for r in rows]
    return {"n": len(rows), "accuracy": acc(rows), "called_frac": len(yes) / len(rows) if rows else None,
            "called_n": len(yes), "called_accuracy": acc(yes), "called_correct": sum(r["correct"] for r in yes),
            "not_called_n": len(no), "not_called_accuracy": acc(no),
            "not_called_correct": sum(r["correct"] for r in no),
            "tool_calls": mean([sum(len(t.get("tool_calls") or []) for t in ts) for ts in turns]),
            "tool_errors": mean([sum(t.get("tool_errors", 0) for t in ts) for ts in turns]),
            "turns": mean([sum(t["role"] == "assistant" for t in ts) for ts in turns]),
            "samples": [{"prompt": r["prompt"], "reference": r["reference"], "correct": r["correct"],
                         "turns": [t["content"] for t in r.get("turns") or []]} for r in rows[:2]]}


def training(metrics: Path) -> dict:
    """The run's training steps from its metrics.jsonl: tool use and the environment's score over the first and the
    last `edge` steps (EDGE, or half the steps of a shorter run, so the two ends never share a step)."""
    steps = [json.loads(x) for x in metrics.read_text().splitlines()]
    steps = [m for m in steps if "time/step" in m]
    edge = max(1, min(EDGE, len(steps) // 2))
    ep = lambda key, ms: mean([m.get(f"episode/{key}", float("nan")) for m in ms])  # noqa: E731
    return {
        "edge": edge,
        "called_tool_frac_first": ep("called_tool_frac", steps[:edge]),
        "called_tool_frac_last": ep("called_tool_frac", steps[-edge:]),
        "called_tool_frac_curve": [m.get("episode/called_tool_frac") for m in steps],
        "tool_errors": ep("tool_errors", steps), "tool_calls": ep("tool_calls", steps), "turns": ep("turns", steps),
        "reward_curve": [m.get("reward/mean") for m in steps],
        "environment_score_first": mean([m.get("reward/environment", float("nan")) for m in steps[:edge]]),
        "environment_score_last": mean([m.get("reward/environment", float("nan")) for m in steps[-edge:]]),
    }


def calculator_run(args, seed: int, variant: str = "env") -> dict:
    """One whole run of the example (`variant`: VARIANTS); its held-out answers are copied to logs/<name>.evals/
    before the run directory is deleted."""
    name = ("" if variant == "env" else f"{variant}_") + f"s{seed}_{PRECISION}"
    kept = args.out_dir / "logs" / f"{name}.evals"

    def keep(run_dir: Path) -> None:
        shutil.rmtree(kept, ignore_errors=True)
        if (run_dir / "evals").is_dir():
            shutil.copytree(run_dir / "evals", kept)

    res = one_run(args, seed, PRECISION, name=name, config=VARIANTS[variant], keep=keep, bf16_eval=False,
                  extra=tuple(args.set))
    res["variant"] = variant
    res["train"] = training(args.out_dir / "logs" / f"{name}.metrics.jsonl")
    res["heldout"] = {int(p.stem.split("_")[1]): heldout(p) for p in sorted(kept.glob("step_*.jsonl"))}
    return res


def table(result: dict) -> str:
    f = lambda x, p=1: "-" if x is None or x != x else f"{x:.{p}f}"  # noqa: E731
    pc = lambda x: "-" if x is None or x != x else f"{100 * x:.0f}%"  # noqa: E731
    runs = result["runs"]
    n = next((h["n"] for r in runs for h in r["heldout"].values()), 0)
    edge = min((r["train"].get("edge", EDGE) for r in runs), default=EDGE)
    how = ("episodes played through the environment, or by the agent program behind the endpoint (agent_ runs)"
           if any(r.get("variant") == "agent" for r in runs) else "episodes played through the environment")
    out = [f"calculator example ({result['config']}), {result['steps']} steps per seed, {PRECISION} rollouts; "
           f"machine: {result['machine']}", "",
           f"held-out (greedy, {n} prompts, {how}): accuracy, share of trajectories that called the tool, and the "
           "accuracy of those that did / did not (correct of count)",
           f"{'run':<15} {'step':>5} {'acc':>5} {'called':>7} {'acc called':>14} {'acc not called':>16} "
           f"{'calls/traj':>11} {'errors/traj':>12} {'turns':>6}"]
    for r in runs:
        for step, h in r["heldout"].items():
            yes = f"{pc(h['called_accuracy'])} ({h['called_correct']}/{h['called_n']})"
            no = f"{pc(h['not_called_accuracy'])} ({h['not_called_correct']}/{h['not_called_n']})"
            out.append(f"{r['name']:<15} {step:>5} {pc(h['accuracy']):>5} {pc(h['called_frac']):>7} {yes:>14} "
                       f"{no:>16} {f(h['tool_calls'], 2):>11} {f(h['tool_errors'], 2):>12} {f(h['turns'], 2):>6}")
    first, last = f"1-{edge}" if edge > 1 else "1", f"-{edge}" if edge > 1 else "last"
    out += ["", "training (64 trajectories a step, temperature 1): called_tool_frac over the first and the last "
                f"{edge} step{'s' if edge > 1 else ''}; tool errors, model turns per trajectory and s/step over the "
                "run",
            f"{'run':<15} {'called ' + first:>11} {'called ' + last:>10} {'env score ' + first:>14} "
            f"{'env score ' + last:>13} "
            f"{'errors':>7} {'turns':>6} {'s/step':>7} {'wall min':>9}"]
    for r in runs:
        t = r["train"]
        out.append(f"{r['name']:<15} {pc(t['called_tool_frac_first']):>11} {pc(t['called_tool_frac_last']):>10} "
                   f"{f(t['environment_score_first'], 3):>14} {f(t['environment_score_last'], 3):>13} "
                   f"{f(t['tool_errors'], 2):>7} {f(t['turns'], 2):>6} {f(r['s_per_step']):>7} "
                   f"{f(r['process_s'] / 60):>9}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=0, help="run.steps (default: the config's 30)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="more overrides of both variants, e.g. task.eval_size=50")
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["env"],
                    help="env: examples/calculator (in-process environment); agent: examples/agent_calculator (an "
                         "openai-SDK program behind the endpoint); both, side by side")
    session_options(ap, BENCH)
    args = ap.parse_args()
    args.no_eval = False  # one_run's option: the held-out evaluations are the point here
    stem = results_folder(args, BENCH)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    runs, missing = [], []
    for seed in args.seeds:
        for variant in args.variants:  # interleaved: both variants of a seed share the machine's state of the moment
            path = args.out_dir / (("" if variant == "env" else f"{variant}_") + f"s{seed}.json")
            run = kept_or_run(args, path, lambda: calculator_run(args, seed, variant))
            if run is None:
                missing.append(path.stem)
                continue
            metrics = args.out_dir / "logs" / f"{run['name']}.metrics.jsonl"
            if metrics.is_file():  # a kept run is summarised as this version of the script summarises
                run["train"] = training(metrics)
            runs.append(run)
    argv = [a for a in sys.argv[1:] if a not in ("--resume", "--report")]
    result = {"command": shlex.join([".venv/bin/python", "bench/calculator_job.py", *argv]), "machine": machine(),
              "config": ", ".join(str(VARIANTS[v].relative_to(ROOT)) for v in args.variants),
              "steps": args.steps or 30, "precision": PRECISION,
              "started": started, "argv": sys.argv[1:], "versions": versions(), "runs": runs, "missing": missing}
    save(stem, result, table(result) + (f"\nnot run yet: {', '.join(missing)}" if missing else ""), args.publish)


if __name__ == "__main__":
    main()
