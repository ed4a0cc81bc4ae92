"""The default job (configs/smollm2_arith.toml) run whole, once per (seed, rollout precision): what each precision costs
and what it learns, in one session.

Per run, from the run's own metrics.jsonl and run log:
- **learning**: greedy held-out accuracy at step 0 and after the last step, as the run measured it (its generators, at
  the rollout precision), and again for the final checkpoint on a **bf16** generator (`qgrpo eval CKPT --precision
  bf16`), so that int8 and bf16 runs are compared on the trained policy and not on the precision of the evaluation;
  points of held-out accuracy gained per minute of wall time (the whole `qgrpo train` process: start-up, evaluations
  and checkpoints in, as a user waits for them);
- **step time by stage** (mean over steps 2..N; step 1 is warm-up): generation, reference, learner (forward, backward,
  optimizer: the learner's own clock), weight sync (export on the learner; receive, re-quantize and verify on the
  slowest rollout actor; the whole sync as the driver saw it). The driver's laps cover the whole step: "ref" includes
  reward scoring and building the batch (runs of the older one-step-off loop also lapped its wait, rollout_wait);
- **memory per actor**: peak RSS and PSS of the learner, rollout and reference actors, Ray's own processes and the
  driver, and of their sum (bench/sides.py's sampler, as in bench/vs_trl.py: the process tree of the run, RSS every
  0.5 s, PSS every 3 s).

Runs go one at a time (seed-major: s0 int8, s0 bf16, s1 int8, ...; each `--variant` of a precision after it, its
name appended), so a slow spell of the machine falls on both precisions, and every variant, of a seed. Each
finished run is kept in bench/results/default_job/<name>.json and `--resume` skips it, so a long session can be split
(a full 30-step run takes 30-60 min on a 2-core CPU without AMX).

    .venv/bin/python bench/default_job.py                                   # seeds 0 1 x int8 bf16, 30 steps each
    .venv/bin/python bench/default_job.py --seeds 0 --precisions bf16 int8 int4 --steps 6 --no-eval --tag profile
    .venv/bin/python bench/default_job.py --resume --publish                # add the runs not done yet, then publish
    .venv/bin/python bench/default_job.py --report --publish                # tabulate the runs done so far
    .venv/bin/python bench/default_job.py --from-run RUN_DIR --tag NAME --note "how it was run" --publish
    .venv/bin/python bench/default_job.py --seeds 0 1 --precisions int8 --variant passive:learner.cpu_wait='"passive"' \
        --variant auto:learner.cpu_wait='"auto"' --tag waits     # variants side by side, in turns within each seed

`--from-run` tabulates one run made by hand (`make train`, e.g. on a CPU or under an emulation the runs here do not
cover): held-out accuracy at each evaluation, mean step time by stage (steps 2..N), what the learner computed in and
the compute-dtype note of the run's config.toml.

Writes bench/results/default_job[_TAG].json and prints a table; `--publish` also writes bench/published/
default_job[_TAG].{json,txt}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from sides import (  # noqa: E402  (same sampler and environment as the TRL bench)
    GB,
    machine,
    run_side,
    side_env,
    versions,
)

CONFIG = ROOT / "configs" / "smollm2_arith.toml"
WARMUP_STEPS = 1
# The driver's laps, together the whole step (rewards and pack were inside reference before they had laps).
STAGES = ("generate", "rewards", "pack", "reference", "learn", "rollout_wait", "sync")
LEARN = ("forward", "backward", "optimizer")
SYNC = ("export_seconds", "receive_seconds_max", "requantize_seconds_max", "verify_seconds_max", "seconds")
EVAL_KEYS = ("accuracy", "lenient_accuracy", "precision", "answers_given", "answers_distinct", "answers_top_share")
ROLES = ("learner", "rollout", "reference", "ray system", "ray idle workers", "driver")


def mean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]  # NaN (e.g. no re-quantization on a bf16 generator) is left out, not averaged in
    return statistics.fmean(xs) if xs else float("nan")


def eval_bf16(checkpoint: Path, log: Path) -> dict:
    """The final checkpoint on a bf16 generator: the trained policy itself, whatever precision sampled its rollouts."""
    out = subprocess.run([sys.executable, "-m", "qgrpo", "eval", str(checkpoint), "--precision", "bf16"],
                         cwd=ROOT, env=side_env(), capture_output=True, text=True)
    log.write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        raise SystemExit(f"qgrpo eval of {checkpoint} failed (exit {out.returncode}): see {log}")
    return json.loads(out.stdout.splitlines()[0])


def one_run(args, seed: int, precision: str, name: str = "", config: Path = CONFIG,
            extra: tuple[str, ...] = (), keep: Callable[[Path], None] | None = None, bf16_eval: bool = True) -> dict:
    """One `qgrpo train` of `config` under the memory sampler, then the bf16 evaluation of its final checkpoint;
    `extra` are more `--set KEY=VALUE` overrides, after this bench's own (bench/loss_variants.py's variants).
    `keep(run_dir)` copies what a bench needs out of the run directory before it is deleted; `bf16_eval` False skips
    the final checkpoint's `qgrpo eval` (single-turn: it does not play an environment's episodes)."""
    name = name or f"s{seed}_{precision}"
    logs = args.out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="default_job-", dir=args.tmp_dir) as tmp:
        sets = {"run.seed": seed, "rollout.precision": precision, "run.output_dir": tmp, "run.name": name,
                "run.progress": False, **({"run.steps": args.steps} if args.steps else {}),
                **({"run.eval": False} if args.no_eval else {})}
        cmd = [sys.executable, "-m", "qgrpo", "train", str(config),
               *[x for k, v in sets.items() for x in ("--set", f"{k}={json.dumps(v)}")],
               *[x for e in extra for x in ("--set", e)]]
        print(f"[{datetime.datetime.now():%H:%M}] {name}: {' '.join(cmd[2:])}", flush=True)
        rc, sampler, seconds = run_side(cmd, side_env(), logs / f"{name}.log", args.timeout_s)
        run_dir = next(Path(tmp).glob(f"{name}*"), None)
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] if run_dir else []
        steps = [m for m in lines if "time/step" in m]
        if rc != 0 or not steps or steps[-1]["step"] != (args.steps or 30):
            raise SystemExit(f"run {name} failed (exit {rc}, {len(steps)} steps logged): see {logs / f'{name}.log'}")
        shutil.copy(run_dir / "metrics.jsonl", logs / f"{name}.metrics.jsonl")
        if keep is not None:
            keep(run_dir)
        evals = {e["step"]: e for e in lines if e.get("event") == "eval"}
        baseline = next((e for e in lines if e.get("event") == "baseline"), None)
        final = None
        if evals and bf16_eval:
            ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
            final = eval_bf16(ckpts[-1], logs / f"{name}.eval_bf16.log")
    timed = steps[WARMUP_STEPS:]
    synced = [m for m in timed if "sync/seconds" in m]
    stage = {k: mean([m.get(f"time/{k}", float("nan")) for m in timed]) for k in STAGES}
    step_s = mean([m["time/step"] for m in timed])
    first, last = (min(evals), max(evals)) if evals else (None, None)
    acc0 = evals[first]["accuracy"] if evals else None
    res = {
        "name": name, "seed": seed, "precision": precision, "steps": len(steps), "process_s": seconds,
        "train_s": sum(m["time/step"] for m in steps),
        "s_per_step": step_s, "stage_s": stage,
        "learn_split_s": {k: mean([m.get(f"time/learn_{k}", float("nan")) for m in timed]) for k in LEARN},
        "sync_split_s": {k: mean([m[f"sync/{k}"] for m in synced]) for k in SYNC},
        "sync_mb": mean([m["sync/nbytes"] / 2**20 for m in synced]),
        "gen_tokens_per_s": mean([m.get("perf/gen_tokens_per_s", float("nan")) for m in timed]),
        "completion_len": mean([m["rollout/completion_len"] for m in steps]),
        "train_reward_first5": mean([m["reward/mean"] for m in steps[:5]]),
        "train_reward_last5": mean([m["reward/mean"] for m in steps[-5:]]),
        "is_weight_mean": mean([m.get("loss/is_weight_mean", float("nan")) for m in steps]),
        "mismatch_kl_mean": mean([m.get("mismatch/kl_mu_old", float("nan")) for m in steps]),
        "skipped_steps": sum(bool(m.get("guard/skipped")) for m in steps),
        "eval": {s: {k: e.get(k) for k in EVAL_KEYS} for s, e in sorted(evals.items())},
        "eval_final_bf16": final and {k: final.get(k) for k in EVAL_KEYS},
        "baseline": baseline and {k: v for k, v in baseline.items() if k not in ("event", "time")},
        "memory": {k: v for k, v in sampler.result({}).items() if k not in ("series", "peak_in")},
    }
    if evals:
        res["acc_gain_points"] = 100 * (evals[last]["accuracy"] - acc0)
        res["acc_gain_points_per_min"] = res["acc_gain_points"] / (seconds / 60)
        if final is not None:
            res["acc_gain_bf16_points_per_min"] = 100 * (final["accuracy"] - acc0) / (seconds / 60)
    return res


def parse_variants(specs: list[str]) -> dict[str, tuple[str, ...]]:
    """{name: its --set overrides} from NAME:KEY=VALUE specs, in their order; {"": ()} (the runs as they are) when
    there are none. A spec without a name or a KEY=VALUE is refused."""
    out: dict[str, tuple[str, ...]] = {}
    for spec in specs:
        name, _, kv = spec.partition(":")
        if not name.isidentifier() or "=" not in kv:
            raise SystemExit(f"--variant {spec!r}: expected NAME:KEY=VALUE, NAME a word (e.g. spin:rollout.cpu_wait="
                             "'\"spin\"')")
        out[name] = (*out.get(name, ()), kv)
    return out or {"": ()}


def table(result: dict) -> str:
    runs = result["runs"]
    f = lambda x, p=1: "-" if x is None or x != x else f"{x:.{p}f}"  # noqa: E731
    commits = sorted({r.get("versions", {}).get("qgrpo_commit", "?")[:12] for r in runs})
    sets = "".join(f" --set {x}" for x in result.get("sets", []))
    w = max([10] + [len(r["name"]) for r in runs])  # the run column
    out = [f"default job ({result['config']}{sets}), {result['steps']} steps; runs at commit {', '.join(commits)}",
           *(f"  variant {k}:" + "".join(f" --set {x}" for x in v) for k, v in result.get("variants", {}).items()), ""]
    if any(r["eval"] for r in runs):
        out += ["held-out accuracy (greedy, 100 prompts): step 0 -> last step on the run's own generators; the final "
                "checkpoint again on bf16",
                f"{'run':<{w}} {'acc 0':>6} {'acc end':>8} {'end bf16':>9} {'gain pts':>9} {'wall min':>9} "
                f"{'pts/min':>8} {'majority':>9} {'distinct':>9} {'reward 1-5':>11} {'reward -5':>10}"]
        for r in runs:
            if not r["eval"]:
                continue
            ev = list(r["eval"].values())
            maj = (r["baseline"] or {}).get("majority_accuracy")
            out.append(f"{r['name']:<{w}} {f(100 * ev[0]['accuracy'])+'%':>6} {f(100 * ev[-1]['accuracy'])+'%':>8} "
                       f"{f(100 * r['eval_final_bf16']['accuracy'])+'%':>9} {f(r['acc_gain_points']):>9} "
                       f"{f(r['process_s'] / 60):>9} {f(r['acc_gain_points_per_min'], 2):>8} "
                       f"{(f(100 * maj) + '%') if maj is not None else '-':>9} "
                       f"{ev[-1].get('answers_distinct') or '-':>9} "
                       f"{f(r['train_reward_first5'], 3):>11} {f(r['train_reward_last5'], 3):>10}")
        for prec, acc in result.get("by_precision", {}).items():
            out.append(f"  {prec}: end accuracy mean {f(100 * acc['end'])}% (bf16 eval {f(100 * acc['end_bf16'])}%) "
                       f"over seeds {acc['seeds']}")
        out.append("")
    out += ["seconds per step by stage (mean over steps 2..N)",
            f"{'run':<{w}} {'step':>6} {'generate':>9} {'ref':>6} {'learn':>6} {'fwd':>6} {'bwd':>6} {'optim':>6} "
            f"{'sync':>6} {'export':>7} {'receive':>8} {'requant':>8} {'verify':>7} {'sync %':>7} "
            f"{'gen tok/s':>9}"]
    for r in runs:
        st, ls, ss = r["stage_s"], r["learn_split_s"], r["sync_split_s"]
        ref = st.get("rewards", 0.0) + st.get("pack", 0.0) + st["reference"]  # one "ref" column, as before the split
        out.append(f"{r['name']:<{w}} {f(r['s_per_step']):>6} {f(st['generate']):>9} {f(ref):>6} "
                   f"{f(st['learn']):>6} {f(ls['forward']):>6} {f(ls['backward']):>6} {f(ls['optimizer'], 2):>6} "
                   f"{f(st['sync'], 2):>6} {f(ss['export_seconds'], 2):>7} {f(ss['receive_seconds_max'], 2):>8} "
                   f"{f(ss['requantize_seconds_max'], 2):>8} {f(ss['verify_seconds_max'], 2):>7} "
                   f"{f(100 * st['sync'] / r['s_per_step']):>7} {f(r['gen_tokens_per_s'], 0):>9}")
    out += ["", "peak memory per actor, GB RSS / PSS (whole run, start-up and checkpoints in)",
            f"{'run':<{w}} " + " ".join(f"{x:>15}" for x in (*ROLES, "sum")) + f" {'others cores':>13}"]
    for r in runs:
        mem, roles = r["memory"], r["memory"]["per_role_peak"]
        cells = [f"{roles[x]['rss'] / GB:.2f} / {roles[x]['pss'] / GB:.2f}" if x in roles else "-" for x in ROLES]
        cells.append(f"{mem['peak_rss'] / GB:.2f} / {mem['peak_pss'] / GB:.2f}")
        out.append(f"{r['name']:<{w}} " + " ".join(f"{c:>15}" for c in cells) + f" {mem['others_cores']:>13.2f}")
    return "\n".join(out)


def session_options(ap: argparse.ArgumentParser, bench: str) -> None:
    """The options of a bench of whole runs kept one file each (this one, bench/loss_variants.py)."""
    ap.add_argument("--tag", default="", help="suffix of the result files, e.g. 'profile'")
    ap.add_argument("--resume", action="store_true", help=f"keep runs already in bench/results/{bench}[_TAG]/")
    ap.add_argument("--report", action="store_true", help="run nothing: tabulate the runs already in the results "
                    "folder (those not done yet are listed as missing)")
    ap.add_argument("--publish", action="store_true", help=f"also write bench/published/{bench}[_TAG].{{json,txt}}")
    ap.add_argument("--timeout-s", type=float, default=3 * 3600, help="per run")
    ap.add_argument("--tmp-dir", default=None, help="where runs write checkpoints (2 x 2.1 GB each; deleted after)")


def results_folder(args, bench: str) -> str:
    """The stem of the result files, BENCH[_TAG]; its runs are kept in args.out_dir = bench/results/STEM/."""
    stem = bench + (f"_{args.tag}" if args.tag else "")
    args.out_dir = ROOT / "bench" / "results" / stem
    args.out_dir.mkdir(parents=True, exist_ok=True)
    return stem


def kept_or_run(args, path: Path, run: Callable[[], dict]) -> dict | None:
    """The run kept in `path` under --resume or --report; None when --report finds none there; else `run()` now,
    with the versions of the code it started with, kept in `path`."""
    if (args.resume or args.report) and path.is_file():
        print(f"{path.stem}: kept from {path}")
        return json.loads(path.read_text())
    if args.report:
        return None
    at_start = versions()  # the code the run starts with
    res = {**run(), "versions": at_start}
    path.write_text(json.dumps(res, indent=1))
    return res


def save(stem: str, result: dict, text: str, publish: bool) -> None:
    """Print the table; the result to bench/results/STEM.json, and with `publish` to bench/published/STEM.{json,txt}."""
    print(text)
    (ROOT / "bench" / "results" / f"{stem}.json").write_text(json.dumps(result, indent=1))
    if publish:
        pub = ROOT / "bench" / "published"
        (pub / f"{stem}.json").write_text(json.dumps(result, indent=1))
        (pub / f"{stem}.txt").write_text(text + "\n")
        print(f"published bench/published/{stem}.{{json,txt}}")


RUN_STAGES = ("step", "generate", "reference", "learn", "learn_forward", "learn_backward", "learn_optimizer", "sync")


def from_run(run_dir: Path, note: str, wall_min: float, command: str = "", machine: str = "") -> tuple[dict, str]:
    """(result, table) of one finished run directory (--from-run). `command` and `machine` are what
    bench/publish.py shows beside the figures (the run was made by hand, so only its maker knows them)."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [m for m in lines if "time/step" in m]
    later = [m for m in steps if m["step"] >= 2] or steps
    start = next((m for m in lines if m.get("event") == "start"), {})
    result = {"command": command, "machine": machine, "run": run_dir.name, "note": note,
              "wall_min": wall_min or None, "steps": len(steps),
              "evals": {str(m["step"]): m["accuracy"] for m in lines if m.get("event") == "eval"},
              "seconds_per_stage": {s: round(mean([m[f"time/{s}"] for m in later]), 2) for s in RUN_STAGES
                                    if all(f"time/{s}" in m for m in later)},
              "learner_compute_dtype": [r.get("compute_dtype") for r in start.get("placement", {}).get("learner", [])],
              "config_note": [x for x in (run_dir / "config.toml").read_text().splitlines()
                              if x.startswith("# model.compute_dtype")],
              "final_reward": steps[-1].get("reward/mean") if steps else None, "summarised_with": versions()}
    text = "\n".join([f"{result['run']}: {result['steps']} steps, learner in {result['learner_compute_dtype']}",
                      *result["config_note"],
                      "held-out accuracy: " + ", ".join(f"step {k} {v:.0%}" for k, v in result["evals"].items()),
                      "| stage | s per step |", "|---|---|",
                      *(f"| {k} | {v} |" for k, v in result["seconds_per_stage"].items())])
    return result, text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from-run", type=Path, default=None, help="tabulate this finished run directory, run nothing")
    ap.add_argument("--note", default="", help="--from-run: how the run was made, kept with its figures")
    ap.add_argument("--wall-min", type=float, default=0.0, help="--from-run: its wall time as `qgrpo train` said")
    ap.add_argument("--command", default="", help="--from-run: the command that made the run (bench/publish.py)")
    ap.add_argument("--machine", default="", help="--from-run: the machine it ran on (bench/publish.py)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--precisions", nargs="+", default=["int8", "bf16"], help="rollout.precision values")
    ap.add_argument("--steps", type=int, default=0, help="run.steps (default: the config's 30)")
    ap.add_argument("--no-eval", action="store_true", help="run.eval = false (a stage/memory profile only)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="one more `qgrpo train --set` for every run, after the bench's own (e.g. "
                         "algo.max_staleness=0: the config with one setting changed)")
    ap.add_argument("--variant", dest="variants", action="append", default=[], metavar="NAME:KEY=VALUE",
                    help="run every (seed, precision) once more per NAME with these --set overrides (repeat NAME for "
                         "more than one), named s0_int8_NAME: settings compared side by side")
    session_options(ap, "default_job")
    args = ap.parse_args()
    variants = parse_variants(args.variants)
    stem = results_folder(args, "default_job")
    if args.from_run:
        save(stem, *from_run(args.from_run, args.note, args.wall_min, args.command, args.machine), args.publish)
        return
    started = datetime.datetime.now().isoformat(timespec="seconds")
    runs, missing = [], []
    for seed in args.seeds:
        for precision in args.precisions:
            for variant, sets in variants.items():
                name = f"s{seed}_{precision}" + (f"_{variant}" if variant else "")
                path = args.out_dir / f"{name}.json"
                extra = (*args.sets, *sets)
                run = kept_or_run(args, path, lambda: {**one_run(args, seed, precision, name, extra=extra),
                                                       "variant": variant, "variant_sets": sets})
                if run is None:
                    missing.append(path.stem)
                else:
                    runs.append(run)
    by_precision = {}
    for p, v in [(p, v) for p in args.precisions for v in variants]:
        done = [r for r in runs if r["precision"] == p and r.get("variant", "") == v and r["eval"]]
        if done:
            by_precision[p + (f"_{v}" if v else "")] = {"seeds": [r["seed"] for r in done],
                               "end": mean([list(r["eval"].values())[-1]["accuracy"] for r in done]),
                               "end_bf16": mean([r["eval_final_bf16"]["accuracy"] for r in done])}
    argv = [a for a in sys.argv[1:] if a not in ("--resume", "--report")]
    result = {"command": shlex.join([".venv/bin/python", "bench/default_job.py", *argv]), "machine": machine(),
              "config": str(CONFIG.relative_to(ROOT)), "steps": args.steps or 30, "started": started,
              "argv": sys.argv[1:], "sets": args.sets, "variants": {k: v for k, v in variants.items() if k},
              "versions": versions(), "by_precision": by_precision,
              "runs": runs, "missing": missing}
    save(stem, result, table(result) + (f"\nnot run yet: {', '.join(missing)}" if missing else ""), args.publish)


if __name__ == "__main__":
    main()
