"""`qgrpo train`: the config checked completely, then the pre-flight checks, Ray, the run directory, the run.

Everything up to `_start_ray` is cheap and leaves nothing behind, so a config that cannot run exits with status 2
before Ray starts, any model is touched, or any directory is created. Each step says why it refuses by raising
`Refused`; `train_command` prints it as one `qgrpo: ...` message.
"""
from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

from qgrpo.cluster.config.schema import ConfigError, load_config
from qgrpo.core import storage

EXIT_CONFIG = 2  # the config, an argument or the machine cannot run the job: fixed by the user, not retried
EXIT_FAILED = 1  # the run started and failed


class Refused(Exception):
    """Why the job is not started; printed after `qgrpo: `, exit status EXIT_CONFIG."""


def resume_point(args):
    """The checkpoint `--resume` names (its run's newest complete one for a run directory), or None."""
    if not getattr(args, "resume", None):
        return None
    from qgrpo.cluster.rundir.resume import find_checkpoint

    try:
        return find_checkpoint(storage.absolute(args.resume))
    except (ValueError, OSError) as e:
        raise Refused(f"--resume: {e}") from None


def _run_root(resume):
    return storage.parent(storage.parent(resume))  # RUN/checkpoints/step_N


def _load(args, resume):
    """The effective config: the file given, else the resumed run's own config.toml, with the --set overrides."""
    config_path = args.config or (storage.join(_run_root(resume), "config.toml") if resume else None)
    if config_path is None:
        raise Refused("train needs a config, e.g. `qgrpo train configs/tiny.toml`")
    try:
        if storage.is_uri(config_path):  # a URI run's own config.toml, as the effective config to start from
            import tomllib

            return load_config(None, args.overrides, base=tomllib.loads(storage.read_text(config_path)))
        notes: list[str] = []
        try:
            return load_config(config_path, args.overrides, notes=notes)
        finally:  # the mapping helps read an error about a translated field too
            if notes:
                print(f"qgrpo: {config_path} is an MLX-GRPO config, read as ours (`qgrpo migrate` writes the "
                      "result as a file):\n" + "\n".join(f"  {line}" for line in notes), file=sys.stderr)
    except ConfigError as e:
        raise Refused(str(e)) from None


def checked_config(args, resume=None):
    """The config of `qgrpo train` and `qgrpo check`, with the checks that need no model and no Ray."""
    cfg = _load(args, resume)
    from qgrpo.rollout.tasks import check_task

    problems = check_task(cfg.task, cfg.run.seed)  # reads user datasets fully: malformed rows fail here, not mid-run
    from qgrpo.cluster.cli.submit import ray_job_id

    out = cfg.run.output_dir
    if ray_job_id() and resume is None and not storage.is_uri(out) and not Path(out).expanduser().is_absolute():
        problems.append(f"run.output_dir: {out!r} is relative, and this is a Ray job, whose working directory is a "
                        f"copy in Ray's package cache ({Path.cwd()}): the submitter would not find the run there and "
                        "Ray may delete it; give an absolute path on storage every node shares (or a URI), or submit "
                        "with `qgrpo submit`, which makes it absolute")
    if problems:
        raise Refused(str(ConfigError(problems)))
    return cfg


def _preflight(cfg, resume, address: str | None) -> str:
    """The model folder, once what would hang or train on garbage is ruled out (before Ray starts or anything is
    written)."""
    from qgrpo.actors.common import quiet_libraries

    quiet_libraries()
    from qgrpo.cluster.config.preflight import preflight
    from qgrpo.rollout.models import resolve_model_path

    model_path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    if resume is not None:
        from qgrpo.cluster.rundir.checkpoint import check_same_model

        try:
            check_same_model(resume, model_path)
        except ValueError as e:
            raise Refused(f"--resume: {e}") from None
    problems = preflight(cfg, model_path, None if address else os.cpu_count() or 1, resuming=resume is not None)
    if not address:  # this machine: its GPUs must hold every role that asks for one, all at once
        from qgrpo.cluster.config.plan import gpu_plan, nodes_from_counts, role_requests
        from qgrpo.core.devices import visible_gpu_count

        if any(r.gpus for r in role_requests(cfg)):
            problems += gpu_plan(role_requests(cfg), nodes_from_counts([visible_gpu_count()]))[1]
    if problems:
        raise Refused(str(ConfigError(problems)))
    return model_path


def _start_ray(cfg, address: str | None) -> bool:
    """Start (or join) Ray unless this process already has it; True when this call started it."""
    import ray

    from qgrpo.cluster.config.preflight import CPU_OVERSUBSCRIPTION

    started = not ray.is_initialized()
    if started and address:
        from qgrpo.cluster.cli.submit import use_auth_token

        use_auth_token()
    if started:
        # Locally, logical CPUs are what the actors ask for (they share the cores; threads are set per actor), with
        # room for `qgrpo scale` to add rollout actors (up to the oversubscription preflight allows).
        needed = (cfg.rollout.num_actors * cfg.rollout.num_cpus + cfg.learner.world_size * cfg.learner.num_cpus
                  + cfg.reference.num_cpus)
        ray.init(address=address, include_dashboard=False,
                 num_cpus=None if address else max(CPU_OVERSUBSCRIPTION * (os.cpu_count() or 1), math.ceil(needed)))
    return started


def _check_cluster(cfg, address: str | None, started: bool) -> None:
    """On a cluster, what its nodes can hold is known once connected: checked before any actor starts."""
    if started and not address:  # Ray of our own on this machine: _preflight checked its GPUs
        return
    import ray

    from qgrpo.cluster.config.plan import gpu_plan, infeasible, nodes_from_ray, role_requests
    from qgrpo.cluster.config.preflight import cpu_problems

    problems = infeasible(role_requests(cfg), ray.nodes()) + (
        cpu_problems(cfg, int(ray.cluster_resources().get("CPU", 0))) if address else [])
    problems = problems or gpu_plan(role_requests(cfg), nodes_from_ray(ray.nodes()))[1]
    if problems:
        raise Refused(str(ConfigError(problems)))


def _open_run_dir(cfg, resume) -> storage.RunDir:
    """The run directory with the effective config.toml in it: the resumed run's own, or a new one."""
    from qgrpo.cluster.config.tomlio import to_toml

    if resume is not None:
        run_dir = storage.RunDir.resume(_run_root(resume))  # a URI run: logs come down to a staging copy, mirrored
        saved, effective = run_dir.local / "config.toml", to_toml(cfg)
        if saved.is_file() and saved.read_text() != effective:  # the run's record follows what it now runs with
            step = storage.name(resume).removeprefix("step_")
            saved.rename(run_dir.local / f"config.before_resume_at_{step}.toml")
            print(f"qgrpo: the config differs from the run's; the earlier one is kept as "
                  f"config.before_resume_at_{step}.toml", file=sys.stderr)
        saved.write_text(effective)
        print(f"qgrpo: resuming from {resume}", file=sys.stderr)
        return run_dir
    try:  # a URI: the first sync shows the run there and proves it writable before any actor starts
        run_dir = storage.RunDir.create(cfg.run.output_dir, f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        (run_dir.local / "config.toml").write_text(to_toml(cfg))
        run_dir.sync()
    except OSError as e:
        raise Refused(f"run.output_dir: cannot write the run directory there ({type(e).__name__}: {e}); pick a "
                      "place this machine and every node can write to") from None
    return run_dir


def train_command(args) -> int:
    try:
        resume = resume_point(args)
        cfg = checked_config(args, resume)
        # Valid config: from here on work is expensive.
        address = args.ray_address or os.environ.get("RAY_ADDRESS")
        model_path = _preflight(cfg, resume, address)
    except Refused as e:
        print(f"qgrpo: {e}", file=sys.stderr)
        return EXIT_CONFIG
    import ray

    from qgrpo.cluster.run.driver import train
    from qgrpo.cluster.run.workers import RunFailed

    started = _start_ray(cfg, address)
    try:
        _check_cluster(cfg, address, started)
        run_dir = _open_run_dir(cfg, resume)
    except Refused as e:
        if started:
            ray.shutdown()
        print(f"qgrpo: {e}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"qgrpo: run directory {run_dir}" + (f" (logs staged in {run_dir.local})" if run_dir.local != run_dir.root
                                               else ""), file=sys.stderr)
    t0 = time.monotonic()
    try:
        result = train(cfg, run_dir, model_path, resume)
    except (RunFailed, storage.StorageError) as e:  # StorageError: the last copy of the logs to a URI failed
        print(f"qgrpo: {e}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if started:
            ray.shutdown()
    print(summary(result, run_dir.root, time.monotonic() - t0), file=sys.stderr)
    return 0


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
    lines += [f"  run directory:    {run_dir}",
              f"  final checkpoint: {result['checkpoint']}  (loads with transformers.AutoModelForCausalLM)",
              f"  look at it:       qgrpo report {run_dir}   |   tensorboard --logdir {run_dir}/tensorboard",
              f"  samples:          {run_dir}/rollouts/*.parquet (pandas / DuckDB / pyarrow)"]
    return "\n".join(lines)
