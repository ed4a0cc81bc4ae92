"""`qgrpo train CONFIG [--set section.key=value ...]`, `qgrpo train [CONFIG] --resume RUN_DIR|CHECKPOINT`,
`qgrpo submit CONFIG --address URL` (the same run on a Ray cluster), `qgrpo scale RUN_DIR --rollout-actors N`.

The config is validated completely before Ray starts, any model is touched, or any directory is created: a bad
config exits with status 2 and one message listing every problem.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from qgrpo.core import storage
from qgrpo.cluster.config.schema import ConfigError, load_config

EXIT_CONFIG = 2
EXIT_FAILED = 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qgrpo", description="GRPO with quantized rollouts on Ray")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run a GRPO job")
    t.add_argument("config", nargs="?", help="TOML preset, e.g. configs/tiny.toml (with --resume: default the run's "
                   "own config.toml)")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one field; repeatable")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its newest complete checkpoint (or from "
                   "the checkpoints/step_* folder given), in the same run directory (a path or a URI)")
    t.add_argument("--ray-address", default=None, help="join a running cluster (default: start Ray locally, "
                   "or the one RAY_ADDRESS names, as under `ray job submit`)")
    s = sub.add_parser("submit", help="run a job on a running Ray cluster (through `ray job submit`)")
    s.add_argument("config", help="TOML config, anywhere: the project folder is uploaded, with the config and the data "
                   "files it names when they are outside it")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    s.add_argument("--address", help="the cluster's dashboard address, e.g. http://HEAD:8265 (default: "
                   "RAY_API_SERVER_ADDRESS or RAY_ADDRESS)")
    s.add_argument("--python", help="the Python of the project's environment on the cluster's nodes (default: the "
                   "one cluster/ray_cluster.yaml installs; refused when it is not this machine's own)")
    s.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment variable for the "
                   "job and its actors; repeatable")
    s.add_argument("--submission-id", help="the job's id (default qgrpo-NAME-TIME)")
    s.add_argument("--no-wait", action="store_true", help="return once submitted (follow with `ray job logs -f ID`)")
    k = sub.add_parser("scale", help="change the number of rollout actors of a running job at its next step")
    k.add_argument("run_dir")
    k.add_argument("--rollout-actors", type=int, required=True, metavar="N")
    c = sub.add_parser("check", help="validate a config and print the effective one")
    c.add_argument("config")
    c.add_argument("--gpus", metavar="N[,N...]", help="check the GPU plan against nodes of these GPU counts, e.g. 1, "
                   "8 or 4,1,1 (default: this machine's GPUs; not checked on a machine without one)")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    e = sub.add_parser("eval", help="held-out accuracy of a checkpoint or model folder (greedy)")
    e.add_argument("model", help="a checkpoint (runs/NAME/checkpoints/step_N, or its URI) or any local HF model "
                   "folder")
    e.add_argument("--task", help="task name, e.g. rg:basic_arithmetic (default: the config's)")
    e.add_argument("--config", help="preset whose [task], [rewards] and max_new_tokens to use")
    e.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    e.add_argument("-n", type=int, default=0, help="held-out prompts (default: task.eval_size)")
    e.add_argument("--precision", default="bf16", help="generator precision for the evaluation (default bf16)")
    e.add_argument("--backend", help="generator backend for the evaluation, e.g. vllm (default: the config's)")
    r = sub.add_parser("report", help="PNG plots and a Markdown summary of a run")
    r.add_argument("run_dir", help="a run directory or its URI (the report is written into RUN_DIR/report)")
    m = sub.add_parser("migrate", help="write an MLX-GRPO TOML config as one of ours (how each key maps, as comments)")
    m.add_argument("config", help="the MLX-GRPO TOML (flat keys or an [mlx_grpo] table)")
    m.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="an MLX-GRPO key (key=value) or one of ours (section.key=value); repeatable")
    m.add_argument("-o", "--out", help="write here (default: print); an existing file is not overwritten")
    x = sub.add_parser("export", help="copy a checkpoint into a folder that mlx-lm loads")
    x.add_argument("checkpoint")
    x.add_argument("out")
    g = sub.add_parser("merge", help="write a LoRA/QLoRA checkpoint's merged model (base + adapters) as an HF folder")
    g.add_argument("checkpoint", help="runs/NAME/checkpoints/step_N of a run with learner.mode = lora or qlora")
    g.add_argument("-o", "--out", required=True, help="a new folder (an existing one is not overwritten)")
    g.add_argument("--base", help="the base model folder (default: the one the checkpoint was trained on)")
    return p


def _merge_command(args) -> int:
    from qgrpo.learner.adapters import merge_checkpoint

    try:
        out = merge_checkpoint(Path(args.checkpoint).expanduser(), Path(args.out).expanduser(), args.base)
    except (ValueError, OSError) as e:
        print(f"qgrpo merge: {e}", file=sys.stderr)
        return EXIT_CONFIG
    print(out)
    return 0


def _run_config(model: Path) -> dict | None:
    """The effective config a qgrpo checkpoint was trained with (its trainer_state.json); None for other folders."""
    from qgrpo.cluster.rundir.checkpoint import STATE_FILE, read_state

    if not (model / STATE_FILE).is_file():
        return None
    try:
        return read_state(model)["config"]
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError([f"{model / STATE_FILE}: unreadable ({type(e).__name__}: {e}); pass --config PRESET to say "
                           "which task and rewards to evaluate with"]) from None


def _eval_command(args) -> int:
    try:  # a URI checkpoint is evaluated from this machine's copy of it (without the optimizer state)
        model = Path(storage.localize(args.model, skip=("optimizer",)) if storage.is_uri(args.model) else args.model)
    except OSError as e:
        print(f"qgrpo eval: {args.model}: {e}", file=sys.stderr)
        return EXIT_CONFIG
    model = model.expanduser()
    overrides = [f"model.path={json.dumps(str(model))}", *args.overrides]
    if args.task:
        overrides.append(f"task.name={json.dumps(args.task)}")
    if args.precision:
        overrides.append(f"rollout.precision={json.dumps(args.precision)}")
    if args.backend:
        overrides.append(f"rollout.backend={json.dumps(args.backend)}")
    try:
        # A checkpoint is evaluated as its run was (task settings, worked examples, rewards, generation length)
        # unless --config says otherwise; its task settings are dropped when --task names another task.
        base = None if args.config else _run_config(model)
        if base is not None:
            if args.task and args.task != base.get("task", {}).get("name"):
                base.pop("task", None)
            base.get("run", {}).pop("wandb_project", None)  # evaluation logs nothing to W&B
            print(f"qgrpo eval: task, rewards and generation length from the run config in {model}/trainer_state.json"
                  " (--config PRESET to use another)", file=sys.stderr)
        cfg = load_config(args.config, overrides, base=base)
    except ConfigError as e:
        print(f"qgrpo eval: {e}", file=sys.stderr)
        return EXIT_CONFIG
    from qgrpo.rollout.answer_stats import verdict_lines
    from qgrpo.rollout.evaluate import accuracy_reward, evaluate_model
    from qgrpo.rollout.backends import backend_options
    from qgrpo.rollout.tasks import make_task

    n = args.n or cfg.task.eval_size
    if n > cfg.task.eval_size and cfg.task.name != "digit_sum":
        print(f"qgrpo eval: -n {n} is more than the task's {cfg.task.eval_size} held-out prompts; "
              "lower -n or --set task.eval_size=N", file=sys.stderr)
        return EXIT_CONFIG
    from qgrpo.learner.adapters import as_model_folder

    with as_model_folder(cfg.model.path) as path:  # a LoRA/QLoRA checkpoint: its merged model is evaluated
        res = evaluate_model(path, make_task(cfg.task, cfg.run.seed, split="eval"), n,
                             cfg.rollout.max_new_tokens, accuracy_reward([f.name for f in cfg.rewards.functions]),
                             precision=cfg.rollout.precision, chat_template=cfg.task.chat_template,
                             backend=cfg.rollout.backend, options=backend_options(cfg.rollout.backend, cfg.rollout),
                             train_task=make_task(cfg.task, cfg.run.seed))
    print(json.dumps({"task": cfg.task.name, "backend": cfg.rollout.backend,
                      **{k: v for k, v in res.items() if k != "samples"}}))
    print(f"qgrpo eval: {args.model}: accuracy {res['accuracy']:.1%} on {res['n']} held-out {cfg.task.name} prompts "
          f"({res['metric']}, greedy, {cfg.rollout.backend} {res['precision']})", file=sys.stderr)
    for line in verdict_lines(res, res["baseline"]):
        print(f"qgrpo eval: {line}", file=sys.stderr)
    return 0


def _migrate_command(args) -> int:
    """An MLX-GRPO config -> our TOML: only the fields the translation set (the rest are our defaults), each key's
    mapping as a comment above. Validated as ours before anything is written."""
    import tomllib

    from qgrpo.cluster.config.schema import _set_path
    from qgrpo.cluster.config.mlx_grpo import is_mlx_grpo, translate
    from qgrpo.cluster.rundir.runlog import to_toml

    out = Path(args.out) if args.out else None
    try:
        data = tomllib.loads(Path(args.config).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        print(f"qgrpo migrate: {args.config}: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if not is_mlx_grpo(data):
        print(f"qgrpo migrate: {args.config} has no MLX-GRPO keys (it may already be one of ours: `qgrpo check` it)",
              file=sys.stderr)
        return EXIT_CONFIG
    ours, lines, _, problems, rest = translate(data, args.overrides)
    for item in rest:  # our own section.key=value overrides land in the file too
        key, _, raw = item.partition("=")
        _set_path(ours, key.strip(), raw.strip(), problems)
    text = to_toml(ours)
    try:
        if problems:
            raise ConfigError(problems)
        load_config(None, [], base=tomllib.loads(text))  # what we write loads as our config
    except ConfigError as e:
        print(f"qgrpo migrate: {args.config}: {e}", file=sys.stderr)
        return EXIT_CONFIG
    header = [f"# Written by `qgrpo migrate {args.config}` from an MLX-GRPO config; how each key maps:"]
    header += [f"#   {line}" for line in lines] + ["# Fields not listed here take our defaults (`qgrpo check` shows all).", ""]
    if out is None:
        print("\n".join(header) + text)
        return 0
    if out.exists():
        print(f"qgrpo migrate: {out} exists; not overwritten (give another -o)", file=sys.stderr)
        return EXIT_CONFIG
    out.write_text("\n".join(header) + text)
    print(f"qgrpo migrate: wrote {out}; run it with `qgrpo train {out}`", file=sys.stderr)
    return 0


def _check_gpu_plan(cfg, gpus: str | None) -> int:
    """`qgrpo check`: where every GPU-asking actor would sit, on nodes of `gpus` GPUs (else this machine's); exit 2
    naming the roles and the GPUs when they cannot all be placed at once."""
    from qgrpo.cluster.config.plan import gpu_plan, nodes_from_counts, role_requests
    from qgrpo.core.devices import visible_gpu_count

    requests = role_requests(cfg)
    if not any(r.gpus for r in requests):
        return 0
    if gpus:
        try:
            counts = [int(x) for x in gpus.split(",")]
            if any(c < 0 for c in counts):
                raise ValueError
        except ValueError:
            print(f"qgrpo check: --gpus {gpus}: expected GPU counts per node, e.g. --gpus 1 or --gpus 4,1,1",
                  file=sys.stderr)
            return EXIT_CONFIG
        where = f"--gpus {gpus}"
    else:
        n = visible_gpu_count()
        if not n:
            print("qgrpo check: GPU plan not checked: this machine has no GPU; `--gpus N` checks it against a node of "
                  "N GPUs (`--gpus 4,1,1`: several nodes)", file=sys.stderr)
            return 0
        counts, where = [n], f"this machine's {n} GPU{'s' * (n != 1)}"
    lines, problems = gpu_plan(requests, nodes_from_counts(counts))
    if problems:
        print(f"qgrpo: {ConfigError(problems)}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"qgrpo check: GPU plan on {where}:\n" + "\n".join(f"  {line}" for line in lines), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "eval":
        return _eval_command(args)
    if args.command == "submit":
        from qgrpo.cluster.cli.submit import submit

        return submit(args)
    if args.command == "scale":
        from qgrpo.cluster.run.control import request_rollout_actors

        try:
            path = request_rollout_actors(storage.absolute(args.run_dir), args.rollout_actors)
        except ValueError as e:
            print(f"qgrpo scale: {e}", file=sys.stderr)
            return EXIT_CONFIG
        print(f"qgrpo scale: asked for {args.rollout_actors} rollout actors ({path}); the run applies it at its next "
              "step boundary and logs a `scale` event in metrics.jsonl", file=sys.stderr)
        return 0
    if args.command == "report":
        print(_report_command(args.run_dir))
        return 0
    if args.command == "migrate":
        return _migrate_command(args)
    if args.command == "merge":
        return _merge_command(args)
    if args.command == "export":
        from qgrpo.cluster.cli.export import export_for_mlx
        from qgrpo.learner.adapters import as_model_folder

        try:
            with as_model_folder(args.checkpoint) as src:  # a LoRA/QLoRA checkpoint: its merged model is exported
                print(export_for_mlx(src, args.out))
        except (ValueError, FileNotFoundError) as e:
            print(f"qgrpo export: {e}", file=sys.stderr)
            return EXIT_CONFIG
        return 0
    resume = None
    if getattr(args, "resume", None):
        from qgrpo.cluster.rundir.resume import find_checkpoint

        try:
            resume = find_checkpoint(storage.absolute(args.resume))
        except (ValueError, OSError) as e:
            print(f"qgrpo: --resume: {e}", file=sys.stderr)
            return EXIT_CONFIG
    run_root = storage.parent(storage.parent(resume)) if resume else None  # RUN/checkpoints/step_N
    config_path = args.config or (storage.join(run_root, "config.toml") if resume else None)
    if config_path is None:
        print("qgrpo: train needs a config, e.g. `qgrpo train configs/tiny.toml`", file=sys.stderr)
        return EXIT_CONFIG
    try:
        if storage.is_uri(config_path):  # a URI run's own config.toml, as the effective config to start from
            import tomllib

            cfg = load_config(None, args.overrides, base=tomllib.loads(storage.read_text(config_path)))
        else:
            notes: list[str] = []
            try:
                cfg = load_config(config_path, args.overrides, notes=notes)
            finally:  # the mapping helps read an error about a translated field too
                if notes:
                    print(f"qgrpo: {config_path} is an MLX-GRPO config, read as ours (`qgrpo migrate` writes the "
                          "result as a file):\n" + "\n".join(f"  {line}" for line in notes), file=sys.stderr)
    except ConfigError as e:
        print(f"qgrpo: {e}", file=sys.stderr)
        return EXIT_CONFIG
    from qgrpo.cluster.rundir.runlog import to_toml
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
        print(f"qgrpo: {ConfigError(problems)}", file=sys.stderr)
        return EXIT_CONFIG
    if args.command == "check":
        print(to_toml(cfg.to_dict()))
        return _check_gpu_plan(cfg, args.gpus)

    # Valid config: from here on work is expensive.
    from qgrpo.actors.common import quiet_libraries

    quiet_libraries()
    from qgrpo.cluster.config.preflight import CPU_OVERSUBSCRIPTION, cpu_problems, preflight
    from qgrpo.rollout.models import resolve_model_path

    model_path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    if resume is not None:
        from qgrpo.cluster.rundir.checkpoint import check_same_model

        try:
            check_same_model(resume, model_path)
        except ValueError as e:
            print(f"qgrpo: --resume: {e}", file=sys.stderr)
            return EXIT_CONFIG
    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    problems = preflight(cfg, model_path, None if address else os.cpu_count() or 1, resuming=resume is not None)
    if not address:  # this machine: its GPUs must hold every role that asks for one, all at once
        from qgrpo.cluster.config.plan import gpu_plan, nodes_from_counts, role_requests
        from qgrpo.core.devices import visible_gpu_count

        if any(r.gpus for r in role_requests(cfg)):
            problems += gpu_plan(role_requests(cfg), nodes_from_counts([visible_gpu_count()]))[1]
    if problems:  # what would hang or train on garbage, before Ray starts or anything is written
        print(f"qgrpo: {ConfigError(problems)}", file=sys.stderr)
        return EXIT_CONFIG
    import ray

    from qgrpo.cluster.run.driver import train
    from qgrpo.cluster.run.workers import RunFailed

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
    if address or not started:  # a cluster: what its nodes can hold is known once connected, before any actor
        from qgrpo.cluster.config.plan import gpu_plan, infeasible, nodes_from_ray, role_requests

        problems = infeasible(role_requests(cfg), ray.nodes()) + (
            cpu_problems(cfg, int(ray.cluster_resources().get("CPU", 0))) if address else [])
        problems = problems or gpu_plan(role_requests(cfg), nodes_from_ray(ray.nodes()))[1]
        if problems:
            if started:
                ray.shutdown()
            print(f"qgrpo: {ConfigError(problems)}", file=sys.stderr)
            return EXIT_CONFIG
    if resume is not None:
        run_dir = storage.RunDir.resume(run_root)  # a URI run: its logs come down to a staging copy, mirrored back
        saved, effective = run_dir.local / "config.toml", to_toml(cfg.to_dict())
        if saved.is_file() and saved.read_text() != effective:  # the run's record follows what it now runs with
            step = storage.name(resume).removeprefix("step_")
            saved.rename(run_dir.local / f"config.before_resume_at_{step}.toml")
            print(f"qgrpo: the config differs from the run's; the earlier one is kept as "
                  f"config.before_resume_at_{step}.toml", file=sys.stderr)
        saved.write_text(effective)
        print(f"qgrpo: resuming from {resume}", file=sys.stderr)
    else:
        try:  # a URI: the first sync shows the run there and proves it writable before any actor starts
            run_dir = storage.RunDir.create(cfg.run.output_dir, f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}")
            (run_dir.local / "config.toml").write_text(to_toml(cfg.to_dict()))
            run_dir.sync()
        except OSError as e:
            if started:
                ray.shutdown()
            print(f"qgrpo: run.output_dir: cannot write the run directory there ({type(e).__name__}: {e}); pick a "
                  "place this machine and every node can write to", file=sys.stderr)
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


def _report_command(run_dir: str) -> str:
    """`qgrpo report`; a URI run's logs are read from this machine's cache of them and the report is uploaded to
    RUN_DIR/report next to them."""
    from qgrpo.cluster.report.build import report

    if not storage.is_uri(run_dir):
        return str(report(run_dir))
    out = report(storage.localize(run_dir, skip=("checkpoints", "abandoned", "report")))
    storage.upload(out, storage.join(run_dir, "report"))
    return f"{storage.join(run_dir, 'report')} (also in {out})"


def summary(result: dict, run_dir, seconds: float) -> str:
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

