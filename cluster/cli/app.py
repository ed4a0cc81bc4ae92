"""`qgrpo train CONFIG [--set section.key=value ...]`, `qgrpo train [CONFIG] --resume RUN_DIR|CHECKPOINT`,
`qgrpo submit CONFIG --address URL` (the same run on a Ray cluster), `qgrpo scale RUN_DIR --rollout-actors N`, and the
other subcommands: the parser and the dispatcher. The train command is in train.py, the others in commands.py.

The config is validated completely before Ray starts, any model is touched, or any directory is created: a bad
config exits with status 2 and one message listing every problem.
"""
from __future__ import annotations

import argparse

from qgrpo import __version__
from qgrpo.cluster.cli import commands
from qgrpo.cluster.cli.summary import summary  # noqa: F401  (re-exported for callers of app)
from qgrpo.cluster.cli.train import EXIT_CONFIG, EXIT_FAILED, train_command

__all__ = ["EXIT_CONFIG", "EXIT_FAILED", "main", "summary"]  # summary: what tests and callers imported from here

COMMANDS = {"train": train_command, "check": commands.check_command, "eval": commands.eval_command,
            "submit": commands.submit_command, "scale": commands.scale_command, "report": commands.report_command,
            "migrate": commands.migrate_command, "merge": commands.merge_command, "export": commands.export_command,
            "serve": commands.serve_command}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qgrpo", description="GRPO with quantized rollouts on Ray")
    p.add_argument("--version", action="version", version=f"qgrpo {__version__}")
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
    c = sub.add_parser("check", help="run every check `train` runs before Ray starts; a verdict at the end")
    c.add_argument("config")
    c.add_argument("--gpus", metavar="N[,N...]", help="check the GPU plan for nodes of these GPU counts, e.g. 1, 8 or "
                   "4,1,1, instead of this machine (whose CPUs are then not checked either)")
    c.add_argument("--ray-address", default=None, help="the cluster train would join (default RAY_ADDRESS): its CPUs "
                   "and GPUs are checked by train once connected")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    c.add_argument("--show-config", action="store_true", help="print the effective config (TOML, on stdout)")
    e = sub.add_parser("eval", help="held-out accuracy of a checkpoint or model folder (greedy)")
    e.add_argument("model", help="a checkpoint (runs/NAME/checkpoints/step_N, or its URI) or any local HF model "
                   "folder")
    e.add_argument("--task", help="task name, e.g. rg:basic_arithmetic (default: the config's)")
    e.add_argument("--config", help="preset whose [task], [rewards] and max_new_tokens to use")
    e.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    e.add_argument("-n", type=int, default=0, help="held-out prompts (default: task.eval_size)")
    e.add_argument("--precision", default="bf16", help="generator precision for the evaluation (default bf16; "
                   "auto: each one tried here, the fastest the precision guard accepts)")
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
    x.add_argument("--overwrite", action="store_true", help="replace OUT when it exists (only once the new copy is "
                   "complete)")
    v = sub.add_parser("serve", help="serve a base model or a checkpoint through the run's OpenAI-compatible "
                       "endpoint (rollout actors on a local Ray) until Ctrl-C")
    v.add_argument("target", metavar="CONFIG|CHECKPOINT", help="a TOML config (its model.path, rollout backend, "
                   "precision, num_actors and sampling) or a checkpoint folder (its model, its saved config)")
    v.add_argument("--port", type=int, default=None, help="default: environment.endpoint_port, else 8000 (0: a free "
                   "one)")
    v.add_argument("--host", default=None, help="default: environment.endpoint_host (127.0.0.1); 0.0.0.0 serves "
                   "other machines")
    v.add_argument("--model-name", default=None, help="the model name served (default: environment.served_model, "
                   "qgrpo-policy)")
    v.add_argument("--api-key", default=None, help="the key every call must send (Authorization: Bearer KEY; a "
                   "client's api_key); default: $QGRPO_API_KEY, else none on loopback and one generated and printed "
                   "when --host serves other machines")
    v.add_argument("--max-body-mb", type=float, default=None, help="the largest request body in MiB (default 8)")
    v.add_argument("--max-session-calls", type=int, default=None, help="calls one session may make (default 1000; "
                   "0: no bound)")
    v.add_argument("--session-idle-s", type=float, default=None, help="a session with no call for this long is "
                   "closed (default 600; 0: never)")
    v.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    g = sub.add_parser("merge", help="write a LoRA/QLoRA checkpoint's merged model (base + adapters) as an HF folder")
    g.add_argument("checkpoint", help="runs/NAME/checkpoints/step_N of a run with learner.mode = lora or qlora")
    g.add_argument("-o", "--out", required=True, help="a new folder (an existing one is not overwritten)")
    g.add_argument("--base", help="the base model folder (default: the one the checkpoint was trained on)")
    return p


def main(argv: list[str] | None = None) -> int:
    from qgrpo.actors.common import quiet_libraries

    args = _parser().parse_args(argv)
    quiet_libraries()  # before any command imports a library (a user's reward file may import torch or DeepSpeed)
    return COMMANDS[args.command](args)
