"""How close `qgrpo check`'s expected step time comes to the steps a run then takes, per job and per CPU kind.

For each config, in turn and alone on the machine:
1. the estimate, made as `qgrpo check` makes it (cluster/config/machine.py: machine_report, with the CPU roles timed
   at the run's shapes: cluster/run/compute_auto.py), in a process of its own with the variant's environment; the
   roles' timings come from the qgrpo cache when an earlier check of the same job on this machine made them (the
   table says which), as a user's second check would;
2. a short run of the same config (`qgrpo train CONFIG --set run.steps=N --set run.eval=false`, no checkpoints), in a
   process with the same environment; its steps 2..N (step 1 warms up) give the measured mean step and stages.

The table puts the estimate beside the measured mean step (and its range), their ratio, and the stages side by side:
learner, reference, generation (an agent's episodes included), and the rest (sync, rewards, packing). A variant runs
every config under an environment, e.g. `--variant avx2:ATEN_CPU_CAPABILITY=avx2,ONEDNN_MAX_CPU_ISA=AVX2`, which
makes an AVX-512 machine compute as an AVX2-only one (core/cpu.py: isa).

    .venv/bin/python bench/estimate_accuracy.py                                  # the three jobs, 4 steps each
    .venv/bin/python bench/estimate_accuracy.py --configs configs/smollm2_arith.toml --steps 6 \
        --variant avx2:ATEN_CPU_CAPABILITY=avx2,ONEDNN_MAX_CPU_ISA=AVX2 --tag avx2 --publish

Writes bench/results/estimate_accuracy[_TAG].json and prints a table; `--publish` also writes bench/published/
estimate_accuracy[_TAG].{json,txt}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from sides import machine, side_env, versions  # noqa: E402

NAME = "estimate_accuracy"
CONFIGS = ["configs/smollm2_arith.toml", "examples/word_answers/config.toml", "examples/agent_calculator/config.toml"]
STAGES = {"learner": ("learn",), "reference": ("reference",), "generation": ("generate",),
          "rest": ("sync", "rewards", "pack", "rollout_wait")}


def estimate(config: str, sets: list[str]) -> dict:
    """This process's side: the estimate of `config` with `sets`, as check makes it (printed as JSON by `main`)."""
    from qgrpo.actors.common import quiet_libraries
    from qgrpo.cluster.config.machine import machine_report
    from qgrpo.cluster.config.schema import load_config
    from qgrpo.cluster.run.compute_auto import resolve_here
    from qgrpo.rollout.modeling.models import resolve_model_path

    quiet_libraries()
    cfg = load_config(config, sets)
    path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    t0 = time.perf_counter()
    report = machine_report(cfg, path, compute=resolve_here(cfg, path))
    e = report.estimate
    compute = report.compute
    return {"step_s": report.step_s, "seconds_to_estimate": time.perf_counter() - t0,
            "stages": {"learner": e.learn, "reference": e.reference, "generation": e.generate + e.environment,
                       "rest": e.sync + e.fixed},
            "compute": compute.record if compute is not None else None, "lines": report.lines(cfg.run.steps),
            "cached": bool(compute) and all(t.cached for c in compute.roles.values() for t in c.timings)}


def run(config: str, sets: list[str], steps: int, env: dict, out: Path) -> dict:
    """`qgrpo train` for `steps` steps; the measured mean step and stages over steps 2..N."""
    cmd = [sys.executable, "-m", "qgrpo", "train", config, "--set", f"run.steps={steps}", "--set", "run.eval=false",
           "--set", f"run.output_dir='{out}'", "--set", "run.progress=false", "--set", "run.save_every=0",
           "--set", "run.tensorboard=false", *(a for s in sets for a in ("--set", s))]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{config}: qgrpo train failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in records if "time/step" in r and r.get("step", 0) >= 2]
    if not rows:
        raise SystemExit(f"{config}: no step after the first in {run_dir}")
    step = [r["time/step"] for r in rows]
    stages = {name: statistics.fmean(sum(r.get(f"time/{k}", 0.0) for k in keys) for r in rows)
              for name, keys in STAGES.items()}
    return {"steps": steps, "mean_s": statistics.fmean(step), "min_s": min(step), "max_s": max(step),
            "stages": stages, "wall_s": wall, "run": run_dir.name}


def with_range(row: dict) -> dict:
    """An agent program's row with the estimate's upper end (cluster/config/machine.py: AGENT_SPREAD), as check
    prints it."""
    from qgrpo.cluster.config.machine import AGENT_SPREAD
    from qgrpo.cluster.config.schema import load_config
    from qgrpo.rollout.environments.kinds import capabilities

    e = row["estimate"]
    if capabilities(load_config(str(ROOT / row["config"]), check_environment=False).environment.name).endpoint:
        e["high_s"] = e["step_s"] + (AGENT_SPREAD - 1) * e["stages"]["generation"]
    return row


def table(result: dict) -> str:
    head = ["config", "variant", "chose (learner/ref/rollout)", "estimate s", "measured s (range)", "est/meas",
            "learner est/meas", "reference est/meas", "generation est/meas", "rest est/meas"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        e, m = r["estimate"], r["measured"]
        chose = "/".join(r["estimate"]["compute"][role]["chosen"] if r["estimate"]["compute"] and
                         role in r["estimate"]["compute"] else "-" for role in ("learner", "reference", "rollout"))
        stage = [f"{e['stages'][s]:.1f} / {m['stages'][s]:.1f}" for s in STAGES]
        est = f"{e['step_s']:.1f}" + (f"-{e['high_s']:.1f}" if "high_s" in e else "")
        ratio = f"{e['step_s'] / m['mean_s']:.2f}" + (f"-{e['high_s'] / m['mean_s']:.2f}" if "high_s" in e else "")
        lines.append(f"| {r['config']} | {r['variant']} | {chose} | {est} | {m['mean_s']:.1f} "
                     f"({m['min_s']:.1f}-{m['max_s']:.1f}) | {ratio} | " + " | ".join(stage) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=CONFIGS)
    ap.add_argument("--steps", type=int, default=4, help="run.steps of each measured run (steps 2..N are kept)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--variant", dest="variants", action="append", default=[], metavar="NAME:VAR=VALUE,...",
                    help="run every config under this environment too (default: the machine as it is)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--publish", action="store_true")
    ap.add_argument("--report", action="store_true", help="run nothing: tabulate bench/results/ again (--tag)")
    ap.add_argument("--estimate", default=None, help=argparse.SUPPRESS)  # the estimate's own process
    args = ap.parse_args()
    if args.estimate:
        print(json.dumps(estimate(args.estimate, args.sets)))
        return
    if args.report:
        stem = NAME + (f"_{args.tag}" if args.tag else "")
        result = json.loads((ROOT / "bench" / "results" / f"{stem}.json").read_text())
        result["rows"] = [with_range(r) for r in result["rows"]]
        save(stem, result, args.publish)
        return
    variants = {"as is": {}}
    for spec in args.variants:
        name, _, pairs = spec.partition(":")
        variants[name] = dict(p.split("=", 1) for p in pairs.split(",") if p)
    if args.variants:
        del variants["as is"]
    started = datetime.datetime.now().isoformat(timespec="seconds")
    rows = []
    for name, extra in variants.items():
        env = {**side_env(), "QGRPO_TIME_ROLES": "1", **extra}
        for config in args.configs:
            sets = list(args.sets)
            out = subprocess.run([sys.executable, __file__, "--estimate", config,
                                  *(a for s in sets for a in ("--set", s))], cwd=ROOT, env=env, capture_output=True,
                                 text=True)
            if out.returncode != 0:
                raise SystemExit(f"{config}: the estimate failed:\n{out.stderr[-3000:]}")
            est = json.loads(out.stdout.strip().splitlines()[-1])
            with tempfile.TemporaryDirectory(prefix="qgrpo-estimate-") as tmp:
                measured = run(config, sets, args.steps, env, Path(tmp))
            rows.append(with_range({"config": config, "variant": name, "environment": extra, "estimate": est,
                                    "measured": measured}))
            print(table({"rows": rows[-1:]}).splitlines()[-1], flush=True)
    argv = [a for a in sys.argv[1:]]
    result = {"bench": NAME, "command": shlex.join([".venv/bin/python", f"bench/{NAME}.py", *argv]),
              "machine": machine() + "".join(f"; variant {n}: {' '.join(f'{k}={v}' for k, v in e.items())}"
                                             for n, e in variants.items() if e),
              "started": started, "versions": versions(), "rows": rows}
    save(NAME + (f"_{args.tag}" if args.tag else ""), result, args.publish)


def save(stem: str, result: dict, publish: bool) -> None:
    text = table(result)
    print(text)
    for folder in [ROOT / "bench" / "results"] + ([ROOT / "bench" / "published"] if publish else []):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
        (folder / f"{stem}.txt").write_text(text + "\n")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
