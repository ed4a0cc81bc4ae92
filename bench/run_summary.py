"""One finished run directory summarised as the default-job tables are: held-out accuracy at each evaluation, mean step
time by stage (steps 2..N; step 1 is warm-up), what each role computed in, and the machine line of the run's
config.toml. For a run made by hand (`make train`), e.g. on a machine or under an emulation the other benches do not
cover.

    .venv/bin/python bench/run_summary.py RUN_DIR --note "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 make train" \
        --publish default_job_avx2_emulated

Prints a table; `--publish NAME` writes bench/published/NAME.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("step", "generate", "reference", "learn", "learn_forward", "learn_backward", "learn_optimizer", "sync")


def summarise(run_dir: Path) -> dict:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [m for m in lines if "time/step" in m]
    later = [m for m in steps if m["step"] >= 2] or steps
    start = next((m for m in lines if m.get("event") == "start"), {})
    config = (run_dir / "config.toml").read_text().splitlines()
    return {
        "run": run_dir.name,
        "steps": len(steps),
        "evals": {str(m["step"]): m["accuracy"] for m in lines if m.get("event") == "eval"},
        "seconds_per_stage": {s: round(statistics.mean(m[f"time/{s}"] for m in later), 2) for s in STAGES
                              if all(f"time/{s}" in m for m in later)},
        "learner_compute_dtype": [r.get("compute_dtype") for r in start.get("placement", {}).get("learner", [])],
        "config_note": [x for x in config if x.startswith("# model.compute_dtype")],
        "final_reward": steps[-1].get("reward/mean") if steps else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--note", default="", help="how the run was made (the command), stored with the figures")
    ap.add_argument("--wall-min", type=float, default=0.0, help="the run's wall time as `qgrpo train` printed it")
    ap.add_argument("--publish", default="", help="write bench/published/NAME.json")
    args = ap.parse_args()
    out = summarise(args.run_dir)
    out.update(command=args.note, wall_min=args.wall_min or None, python=platform.python_version(),
               summarised_at=subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                     text=True).stdout.strip())
    print(f"{out['run']}: {out['steps']} steps, learner computed in {out['learner_compute_dtype']}")
    print("\n".join(out["config_note"]))
    print("held-out accuracy: " + ", ".join(f"step {k} {v:.0%}" for k, v in out["evals"].items()))
    print("| stage | s per step |\n|---|---|")
    for stage, s in out["seconds_per_stage"].items():
        print(f"| {stage} | {s} |")
    if args.publish:
        path = ROOT / "bench" / "published" / f"{args.publish}.json"
        path.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
