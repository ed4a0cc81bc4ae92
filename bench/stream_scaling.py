"""The tiny job (configs/tiny.toml) with 1 and 2 rollout actors, synchronous (algo.max_staleness = 0) and streamed
(max_staleness = 1, 2): how long the driver waits for each step's rollouts, and what a step costs, side by side in one
session. Runs go one at a time; each is a whole `qgrpo train` process.

Per run, from its metrics.jsonl, means over steps 2..N (step 1 is warm-up):
- **wait**: time/generate, the driver's wait for the step's rollouts (synchronously the whole generation; for a
  stream what was not generated yet when the learner asked);
- **step**: time/step, and steps per minute over the same steps;
- **staleness**: stream/staleness_mean and the largest stream/staleness_max (policy versions);
- **buffered**: stream/buffered_groups, the groups of later steps already generated when a step was taken.

On a 2-core CPU the rollout actors, the reference and the learner share the cores, so a second actor slows the
others: read the wait, not only the step time.

    .venv/bin/python bench/stream_scaling.py                          # actors 1 2 x staleness 0 1 2, 30 steps
    .venv/bin/python bench/stream_scaling.py --steps 10 --actors 1 2 --staleness 0 2 --publish
    .venv/bin/python bench/stream_scaling.py --set rollout.group_size=64    # more generation per step
    .venv/bin/python bench/stream_scaling.py --actors 1 2 3 4 --ray-cpus 4  # 4 actors on a 2-core machine

`--ray-cpus N` runs every job on one Ray node of N logical CPUs started for the bench (`ray start`, as a user's
cluster would be), joined with `--ray-address`: the preflight allows as many rollout actors as the cluster has CPUs,
and each actor, rank and the reference then get the threads of its num_cpus (1) instead of a share of this machine's
cores. Compare its rows with each other, not with a local run's.

Writes bench/results/stream_scaling.json and prints a table; `--publish` also writes
bench/published/stream_scaling.{json,txt}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from calculator_job import machine  # noqa: E402
from sides import side_env, versions  # noqa: E402

CONFIG = ROOT / "configs" / "tiny.toml"


def mean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.fmean(xs) if xs else float("nan")


def one_run(steps: int, actors: int, staleness: int, seed: int, log: Path, extra: list[str],
            cluster=None) -> dict:
    with tempfile.TemporaryDirectory(prefix="stream_scaling-") as tmp:
        sets = {"run.steps": steps, "run.seed": seed, "rollout.num_actors": actors, "algo.max_staleness": staleness,
                "run.output_dir": tmp, "run.progress": False, "run.eval": False, "run.tensorboard": False}
        cmd = [sys.executable, "-m", "qgrpo", "train", str(CONFIG),
               *[x for k, v in sets.items() for x in ("--set", f"{k}={json.dumps(v)}")],
               *[x for e in extra for x in ("--set", e)]]
        env = side_env()
        if cluster is not None:
            cmd += ["--ray-address", cluster.address]
            env["RAY_AUTH_TOKEN"] = cluster.token
        print(f"[{datetime.datetime.now():%H:%M}] actors {actors}, max_staleness {staleness}", flush=True)
        t0 = time.monotonic()
        with log.open("w") as f:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
        seconds = time.monotonic() - t0
        metrics = next(Path(tmp).glob("*/metrics.jsonl"), None)
        lines = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics else []
    timed = [m for m in lines if "time/step" in m][1:]
    if rc != 0 or len(timed) != steps - 1:
        raise SystemExit(f"run failed (exit {rc}): see {log}")
    step_s = mean([m["time/step"] for m in timed])
    return {"actors": actors, "max_staleness": staleness, "steps": steps, "process_s": seconds,
            "wait_s": mean([m["time/generate"] for m in timed]), "step_s": step_s, "steps_per_min": 60 / step_s,
            "learn_s": mean([m["time/learn"] for m in timed]),
            "staleness_mean": mean([m.get("stream/staleness_mean", 0.0) for m in timed]),
            "staleness_max": max(m.get("stream/staleness_max", 0) for m in timed),
            "buffered_groups": mean([m.get("stream/buffered_groups", 0.0) for m in timed])}


def table(runs: list[dict]) -> str:
    head = ["actors", "max_staleness", "wait s/step", "learn s/step", "step s", "steps/min", "staleness mean/max",
            "buffered groups"]
    rows = [[str(r["actors"]), str(r["max_staleness"]), f"{r['wait_s']:.3f}", f"{r['learn_s']:.3f}",
             f"{r['step_s']:.3f}", f"{r['steps_per_min']:.1f}", f"{r['staleness_mean']:.2f}/{r['staleness_max']}",
             f"{r['buffered_groups']:.1f}"] for r in runs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--actors", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                    help="more config overrides for every run, e.g. rollout.max_new_tokens=16")
    ap.add_argument("--ray-cpus", type=int, default=0,
                    help="run on a Ray node of this many logical CPUs started for the bench (0: local Ray per run)")
    ap.add_argument("--tag", default="", help="suffix of the result files, e.g. 'actors4'")
    ap.add_argument("--publish", action="store_true", help="also write bench/published/stream_scaling[_TAG].{json,txt}")
    args = ap.parse_args()
    name = "stream_scaling" + (f"_{args.tag}" if args.tag else "")
    logs = ROOT / "bench" / "results" / name
    logs.mkdir(parents=True, exist_ok=True)
    at_start = versions()
    cluster = None
    if args.ray_cpus:
        sys.path.insert(0, str(ROOT / "tests"))
        from ray_nodes import LocalCluster  # `ray start` on free ports, stopped by killing only its own processes

        cluster = LocalCluster(num_cpus=args.ray_cpus)
    try:
        runs = [one_run(args.steps, a, s, args.seed, logs / f"a{a}_s{s}.log", args.extra, cluster)
                for a in args.actors for s in args.staleness]
    finally:
        if cluster is not None:
            cluster.stop()
    text = table(runs)
    result = {"bench": "stream_scaling", "command": shlex.join([".venv/bin/python", "bench/stream_scaling.py",
                                                                 *sys.argv[1:]]),
              "machine": machine(),
              "config": str(CONFIG.relative_to(ROOT)), "args": vars(args), "versions": at_start, "runs": runs}
    print(text)
    (ROOT / "bench" / "results" / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    if args.publish:
        pub = ROOT / "bench" / "published"
        (pub / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        (pub / f"{name}.txt").write_text(text + "\n")
        print(f"published bench/published/{name}.{{json,txt}}")


if __name__ == "__main__":
    main()
