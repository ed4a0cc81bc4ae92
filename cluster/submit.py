"""`qgrpo submit CONFIG [--set ...] --address http://HEAD:8265`: a run on a running Ray cluster, in one command.

It builds and runs a `ray job submit` command line (printed first, so it can be run by hand or put in a script):
- the config is validated here, before anything is uploaded (paths that only the cluster's nodes have are left to
  the job's own check);
- the project folder is uploaded as the job's working directory, without the virtualenv, run directories, caches, git
  history and benchmark results (`EXCLUDES`);
- the job runs in a named Python environment: the interpreter running `qgrpo submit` (the same path on every node,
  as the `ray up` example in cluster/ray_cluster.yaml installs it), or `--python PATH`; it runs the entrypoint, and
  Ray starts every actor with it (runtime_env `py_executable`);
- a relative `run.output_dir` would land in Ray's package cache on the head node (the job's working directory),
  where the submitter cannot find it and Ray may delete it: it is made absolute against the folder `qgrpo submit`
  runs in and passed with --set, which is printed; on several nodes it must be shared storage (or a URI);
- Ray 2.60 enables token authentication on clusters that have a token; its job client only sends the token when
  RAY_AUTH_MODE=token, so that is set for the submission when a token is found (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
  ~/.ray/auth_token) and the variable is unset. A client token is accepted by clusters without authentication too.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the project folder: what the job runs
EXCLUDES = [".venv", "venv", "runs", ".cache", ".git", "bench/results", "**/__pycache__", "*.egg-info",
            ".pytest_cache", "*.parquet"]
# What the cluster's nodes have and this machine may not: checked by the job itself, on the head node.
_CLUSTER_SIDE = ("model.path: folder", "task.path: file", "task.eval_path: file")


def ray_job_id() -> str | None:
    """The submission id when this process is a Ray job's entrypoint (`ray job submit`), else None."""
    try:
        meta = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")).get("metadata", {})
    except ValueError:
        return None
    return meta.get("job_submission_id")


def has_auth_token() -> bool:
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    return Path(path).expanduser().is_file()


def use_auth_token() -> bool:
    """Joining a cluster with `ray.init(address)`: Ray 2.60 presents a token only in token mode, which clusters turn on
    by themselves when they have one. Turn it on for this process when a token is there and nothing says otherwise
    (Ray's own rule for `ray start`)."""
    if "RAY_AUTH_MODE" in os.environ or not has_auth_token():
        return False
    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

    return maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def build(config: str, overrides: list[str], address: str, python: str, wait: bool, env: list[str],
          submission_id: str | None = None) -> tuple[list[str], dict[str, str], list[str]]:
    """(the `ray job submit` argv, its environment, lines to tell the user). Raises ValueError with the fix."""
    from cluster.config import ConfigError, load_config

    cfg_path = Path(config).expanduser().resolve()
    try:
        rel = cfg_path.relative_to(ROOT)
    except ValueError:
        raise ValueError(f"config {config} is outside the project folder {ROOT}, which is what the job uploads; "
                         f"copy it under {ROOT / 'configs'}") from None
    notes, overrides = [], list(overrides)
    try:
        cfg = load_config(cfg_path, overrides)
    except ConfigError as e:
        here = [p for p in e.problems if not p.startswith(_CLUSTER_SIDE)]
        if here:
            raise ValueError(str(ConfigError(here))) from None
        notes += [f"not checked here, the job checks on the cluster: {p}" for p in e.problems]
        cfg = None
    out = cfg.run.output_dir if cfg else _output_dir(cfg_path, overrides)
    from cluster.storage import is_uri

    if not is_uri(out) and not Path(out).expanduser().is_absolute():
        absolute = str(Path(out).expanduser().resolve())
        overrides.append(f"run.output_dir={json.dumps(absolute)}")
        notes.append(f"run.output_dir {out!r} is relative; the job writes under {absolute} (on a cluster of several "
                     "nodes that must be shared storage, or give an s3:// URI)")
    python = python or sys.executable
    runtime_env = {"working_dir": str(ROOT), "excludes": EXCLUDES, "py_executable": python,
                   "env_vars": dict(kv.split("=", 1) for kv in env)}
    entry = [python, "-m", "cluster.cli", "train", str(rel), *[a for o in overrides for a in ("--set", o)]]
    ray_cli = shutil.which("ray", path=str(Path(python).parent)) or shutil.which("ray") or "ray"
    argv = [ray_cli, "job", "submit", "--address", address, "--runtime-env-json", json.dumps(runtime_env),
            "--submission-id", submission_id or f"qgrpo-{cfg.run.name if cfg else 'run'}-{time.strftime('%Y%m%d-%H%M%S')}",
            *([] if wait else ["--no-wait"]), "--", *entry]
    job_env = dict(os.environ)
    if "RAY_AUTH_MODE" not in job_env and has_auth_token():
        job_env["RAY_AUTH_MODE"] = "token"
        notes.append("a Ray auth token was found: submitting with RAY_AUTH_MODE=token (Ray 2.60's job client sends the "
                     "token only then)")
    return argv, job_env, notes


def _output_dir(cfg_path: Path, overrides: list[str]) -> str:
    """run.output_dir as the config and overrides give it, when the config cannot be fully checked here."""
    import tomllib

    from cluster.config import RunConfig

    out = tomllib.loads(cfg_path.read_text()).get("run", {}).get("output_dir", RunConfig.output_dir)
    for o in overrides:
        key, _, value = o.partition("=")
        if key.strip() == "run.output_dir":
            out = value.strip().strip('"')
    return out


def submit(args) -> int:
    address = args.address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS")
    if not address:
        print("qgrpo submit: which cluster? pass --address http://HEAD:8265 (the dashboard address) or set "
              "RAY_API_SERVER_ADDRESS", file=sys.stderr)
        return 2
    bad = [kv for kv in args.env if "=" not in kv]
    if bad:
        print(f"qgrpo submit: --env {bad[0]}: expected KEY=VALUE", file=sys.stderr)
        return 2
    try:
        argv, env, notes = build(args.config, args.overrides, address, args.python, not args.no_wait, args.env,
                                 args.submission_id)
    except ValueError as e:
        print(f"qgrpo submit: {e}", file=sys.stderr)
        return 2
    for n in notes:
        print(f"qgrpo submit: {n}", file=sys.stderr)
    print(f"qgrpo submit: {shlex.join(argv)}", file=sys.stderr)
    return subprocess.call(argv, env=env)
