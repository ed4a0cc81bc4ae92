"""The `qgrpo` subcommands other than `train`: check, eval, merge, export, migrate, report, scale, serve and submit.
Each takes the parsed arguments and returns the exit status; the heavy imports happen inside, once a command runs."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from qgrpo.cluster.cli.train import EXIT_CONFIG, Progress, Refused, before_ray
from qgrpo.cluster.config.schema import ConfigError, load_config
from qgrpo.core import storage


class CheckReport(Progress):
    """`qgrpo check`'s report: each check that passed and what it found, the hints, the problems and the verdict, on
    stdout (check's output; library messages go to stderr). With --show-config stdout is the effective config alone
    (TOML, to redirect into a file) and the report goes to stderr."""

    def __init__(self, show_config: bool):
        self.show_config = show_config
        self.stream = sys.stderr if show_config else sys.stdout

    def say(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def loaded(self, cfg) -> None:
        if self.show_config:
            from qgrpo.cluster.config.tomlio import to_toml

            print(to_toml(cfg), flush=True)

    def passed(self, what: str, found: str) -> None:
        self.say(f"  {what + ':':<10} {found}")

    told = passed

    def hint(self, text: str) -> None:
        self.say(f"qgrpo: hint: {text}")

    def table(self, lines: list[str]) -> None:
        for line in lines:
            self.say(f"    {line}")


def check_command(args) -> int:
    """`qgrpo check`: every check `qgrpo train` runs before Ray starts (the same function, `before_ray`), one line per
    check that passed, then one verdict line: exit 0 when train would start, 2 (after the problems) when it would
    refuse. `--gpus` checks the GPU plan for nodes of those GPU counts instead of this machine."""
    gpus = None
    if args.gpus:
        try:
            gpus = [int(x) for x in args.gpus.split(",")]
            if any(c < 0 for c in gpus):
                raise ValueError
        except ValueError:
            print(f"qgrpo check: --gpus {args.gpus}: expected GPU counts per node, e.g. --gpus 1 or --gpus 4,1,1",
                  file=sys.stderr)
            return EXIT_CONFIG
    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    report = CheckReport(args.show_config)
    report.say(f"qgrpo check: {args.config}" + (f" on --gpus {args.gpus}" if gpus else f" for the cluster at {address}"
                                               if address else " on this machine"))
    try:
        before_ray(args, address=address, gpus=gpus, progress=report, trials=True)
    except Refused as e:
        report.say(f"qgrpo: {e}")
        report.say(f"qgrpo check: REFUSED: {e.count} problem{'s' * (e.count != 1)}")
        return EXIT_CONFIG
    report.say("qgrpo check: OK: train would start")
    return 0


def eval_command(args) -> int:
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
            base.pop("sync", None)  # nor syncs or learns: how the run re-quantized and learned does not apply
            base.get("learner", {}).pop("fake_quant", None)
            print(f"qgrpo eval: task, rewards and generation length from the run config in {model}/trainer_state.json"
                  " (--config PRESET to use another)", file=sys.stderr)
        cfg = load_config(args.config, overrides, base=base)
    except ConfigError as e:
        print(f"qgrpo eval: {e}", file=sys.stderr)
        return EXIT_CONFIG
    from qgrpo.rollout.answer_stats import verdict_lines
    from qgrpo.rollout.backends import backend_options
    from qgrpo.rollout.data.tasks import make_task
    from qgrpo.rollout.evaluate import evaluate_model, task_judge

    n = args.n or cfg.task.eval_size
    if n > cfg.task.eval_size and cfg.task.name != "digit_sum":
        print(f"qgrpo eval: -n {n} is more than the task's {cfg.task.eval_size} held-out prompts; "
              "lower -n or --set task.eval_size=N", file=sys.stderr)
        return EXIT_CONFIG
    from qgrpo.learner.adapters import as_model_folder

    eval_task = make_task(cfg.task, cfg.run.seed, split="eval")
    judge = task_judge(cfg.rewards, eval_task, n, _reward_model_scorer(cfg), cfg.environment)
    if judge.environment:  # evaluate_model answers single-turn: there is no trajectory for the environment to score
        print("qgrpo eval: rewards.eval_metric: 'environment' scores trajectories, and qgrpo eval answers without the "
              "environment's episodes; name another judge with --set rewards.eval_metric=NAME (the run's own held-out "
              "evaluations, in RUN_DIR/evals, are judged by the environment)", file=sys.stderr)
        return EXIT_CONFIG
    from qgrpo.cluster.cli.train import _auto_here
    from qgrpo.cluster.run.precision_auto import is_auto

    with as_model_folder(cfg.model.path) as path:  # a LoRA/QLoRA checkpoint: its merged model is evaluated
        if is_auto(cfg):  # tried here, where the evaluation's generator runs, as `qgrpo check` tries it
            try:
                cfg = _auto_here(cfg, path, Progress()).cfg
            except Refused as e:
                print(f"qgrpo eval: {e}", file=sys.stderr)
                return EXIT_CONFIG
        res = evaluate_model(path, eval_task, n, cfg.rollout.max_new_tokens, judge,
                             precision=cfg.rollout.precision, chat_template=cfg.task.chat_template,
                             backend=cfg.rollout.backend,
                             options=backend_options(cfg.rollout.backend, cfg.rollout, cfg.compute_dtype_of("rollout")),
                             train_task=make_task(cfg.task, cfg.run.seed))
    print(json.dumps({"task": cfg.task.name, "backend": cfg.rollout.backend,
                      **{k: v for k, v in res.items() if k != "samples"}}))
    print(f"qgrpo eval: {args.model}: accuracy {res['accuracy']:.1%} on {res['n']} held-out {cfg.task.name} prompts "
          f"({res['metric']}, greedy, {cfg.rollout.backend} {res['precision']})", file=sys.stderr)
    for line in verdict_lines(res, res["baseline"]):
        print(f"qgrpo eval: {line}", file=sys.stderr)
    return 0


def _reward_model_scorer(cfg):
    """A scorer for a judge that is the reward model: the classifier loaded in this process on first use."""
    loaded: list = []

    def score(prompts: list, completions: list, histories: list) -> list[float]:
        if not loaded:
            from qgrpo.rollout.rewards.classifier import RewardClassifier

            rm = cfg.reward_model
            loaded.append(RewardClassifier(rm.path, rm.precision, max_length=rm.max_length,
                                           cache_dir=cfg.model.cache_dir))
        return loaded[0].score(prompts, completions, histories)

    return score if cfg.reward_model.path else None


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


def merge_command(args) -> int:
    from qgrpo.learner.adapters import merge_checkpoint

    try:
        out = merge_checkpoint(Path(args.checkpoint).expanduser(), Path(args.out).expanduser(), args.base)
    except (ValueError, OSError) as e:
        print(f"qgrpo merge: {e}", file=sys.stderr)
        return EXIT_CONFIG
    print(out)
    return 0


def migrate_command(args) -> int:
    """An MLX-GRPO config -> our TOML: only the fields the translation set (the rest are our defaults), each key's
    mapping as a comment above. Validated as ours before anything is written; what only this machine lacks (the model
    folder, a data file) is a warning, not a refusal: the file is often written before the model is fetched."""
    import tomllib

    from qgrpo.cluster.cli.migrate import migrate
    from qgrpo.cluster.config.mlx_grpo import is_mlx_grpo

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
    try:
        text, warnings = migrate(data, args.overrides, args.config)
    except ConfigError as e:
        print(f"qgrpo migrate: {args.config}: {e}", file=sys.stderr)
        return EXIT_CONFIG
    for w in warnings:
        print(f"qgrpo migrate: warning: {w}", file=sys.stderr)
    if out is None:
        print(text)
        return 0
    if out.exists():
        print(f"qgrpo migrate: {out} exists; not overwritten (give another -o)", file=sys.stderr)
        return EXIT_CONFIG
    out.write_text(text)
    from qgrpo.core.invocation import qgrpo_command

    print(f"qgrpo migrate: wrote {out}; run it with `{qgrpo_command('train', out)}`", file=sys.stderr)
    return 0


def _report(run_dir: str) -> str:
    """`qgrpo report`; a URI run's logs are read from this machine's cache of them and the report is uploaded to
    RUN_DIR/report next to them."""
    from qgrpo.cluster.report.build import report

    if not storage.is_uri(run_dir):
        return str(report(run_dir))
    out = report(storage.localize(run_dir, skip=("checkpoints", "abandoned", "report")))
    storage.upload(out, storage.join(run_dir, "report"))
    return f"{storage.join(run_dir, 'report')} (also in {out})"


def report_command(args) -> int:
    print(_report(args.run_dir))
    return 0


def scale_command(args) -> int:
    from qgrpo.cluster.run.control import request_rollout_actors

    try:
        path = request_rollout_actors(storage.absolute(args.run_dir), args.rollout_actors)
    except ValueError as e:
        print(f"qgrpo scale: {e}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"qgrpo scale: asked for {args.rollout_actors} rollout actors ({path}); the run applies it at its next "
          "step boundary and logs a `scale` event in metrics.jsonl", file=sys.stderr)
    return 0


def export_command(args) -> int:
    from qgrpo.cluster.cli.export import export_for_mlx
    from qgrpo.learner.adapters import as_model_folder

    try:
        with as_model_folder(args.checkpoint) as src:  # a LoRA/QLoRA checkpoint: its merged model is exported
            print(export_for_mlx(src, args.out, overwrite=args.overwrite))
    except (ValueError, FileNotFoundError) as e:
        print(f"qgrpo export: {e}", file=sys.stderr)
        return EXIT_CONFIG
    return 0


def submit_command(args) -> int:
    from qgrpo.cluster.cli.submit import submit

    return submit(args)


def serve_command(args) -> int:
    from qgrpo.cluster.cli.serve import serve_command as serve

    return serve(args)
