"""`qgrpo train CONFIG [--set section.key=value ...] [--resume CHECKPOINT]`.

The config is validated completely before Ray starts, any model is touched, or any directory is created: a bad
config exits with status 2 and one message listing every problem.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

from cluster.config import ConfigError, load_config

EXIT_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qgrpo", description="GRPO with quantized rollouts on Ray")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run a GRPO job")
    t.add_argument("config", help="TOML preset, e.g. configs/tiny.toml")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one field; repeatable")
    t.add_argument("--resume", metavar="CHECKPOINT", help="a checkpoints/step_* folder of an earlier run")
    t.add_argument("--ray-address", default=None, help="join a running cluster (default: start Ray locally, "
                   "or the one RAY_ADDRESS names, as under `ray job submit`)")
    c = sub.add_parser("check", help="validate a config and print the effective one")
    c.add_argument("config")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"qgrpo: {e}", file=sys.stderr)
        return EXIT_CONFIG
    from cluster.runlog import to_toml

    if args.command == "check":
        print(to_toml(cfg.to_dict()))
        return 0

    resume = Path(args.resume).resolve() if args.resume else None
    if resume is not None and not (resume / "trainer_state.json").is_file():
        print(f"qgrpo: --resume {args.resume}: not a checkpoint folder (no trainer_state.json); "
              "pass runs/NAME/checkpoints/step_NNNNNN", file=sys.stderr)
        return EXIT_CONFIG

    # Valid config: from here on work is expensive.
    from actors.common import quiet_libraries

    quiet_libraries()
    from rollout.models import resolve_model_path

    model_path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    if resume is not None:
        from cluster.checkpoint import check_same_model

        try:
            check_same_model(resume, model_path)
        except ValueError as e:
            print(f"qgrpo: --resume: {e}", file=sys.stderr)
            return EXIT_CONFIG
        run_dir = resume.parent.parent
    else:
        run_dir = Path(cfg.run.output_dir) / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        run_dir.mkdir(parents=True, exist_ok=False)
        (run_dir / "config.toml").write_text(to_toml(cfg.to_dict()))
    print(f"qgrpo: run directory {run_dir}", file=sys.stderr)

    import ray

    from cluster.driver import train

    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    started = not ray.is_initialized()
    if started:
        # Locally, logical CPUs are what the actors ask for (they share the cores; threads are set per actor).
        needed = (cfg.rollout.num_actors * cfg.rollout.num_cpus + cfg.learner.world_size * cfg.learner.num_cpus
                  + cfg.reference.num_cpus)
        ray.init(address=address, include_dashboard=False,
                 num_cpus=None if address else max(os.cpu_count() or 1, math.ceil(needed)))
    try:
        m = train(cfg, run_dir, model_path, resume)
    finally:
        if started:
            ray.shutdown()
    print(f"qgrpo: done. step {m.get('step')}: reward {m.get('reward/mean', float('nan')):.3f}; "
          f"run directory {run_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
