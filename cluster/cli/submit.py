"""`qgrpo submit CONFIG [--set ...] --address http://HEAD:8265`: a run on a running Ray cluster, in one command.

It builds and runs a `ray job submit` command line (printed first, so it can be run by hand or put in a script):
- the config is validated here, before anything is uploaded (paths that only the cluster's nodes have are left to
  the job's own check);
- the dashboard is probed first (`probe`: GET ADDRESS/api/version, 5 s): an address nobody answers at is one line
  with the usual causes, not the ray CLI's traceback; `ray://` (Ray Client) addresses are refused, the job API is the
  dashboard's http address;
- the project folder is uploaded as the job's working directory, without the virtualenv, run directories, caches, git
  history and benchmark results (`EXCLUDES`); its packages go up once more as the job's `py_modules`, which is how the
  job and its actors import the submitted code as `qgrpo` (`_package`). A config, or a file it names (task.path,
  task.eval_path, a local model.path folder), that is outside that folder or excluded from it would not reach the job:
  then the job's working directory is a staging copy of the project plus `_submitted/` holding those files, the job gets
  `--set` overrides pointing the fields there (printed; the user's config file is not rewritten), and the copy is
  deleted once `ray job submit` returns (with --no-wait too: it returns after the upload). A file the project folder
  does hold is named by its path in it. Anything larger than `UPLOAD_MAX` (e.g. a big model) is not uploaded: the nodes
  must have it at the path the config gives, which a note says. Paths that do not exist here are the cluster's and are
  left as they are;
- the job runs in a named Python environment, which runs the entrypoint and with which Ray starts every actor
  (runtime_env `py_executable`). The rule: `--python PATH` is used as given (and printed); without it, the one
  cluster/ray_cluster.yaml installs on every node (its `file_mounts` target of the project + `.venv/bin/python`, e.g.
  /home/ubuntu/qgrpo/.venv/bin/python), which must be the interpreter running `qgrpo submit` (submitting from the
  head's own checkout) or the submission is refused naming both paths: this machine's path rarely exists on the nodes,
  and guessing would start every actor in the wrong environment. Without that YAML, this interpreter is used;
- a relative `run.output_dir` would land in Ray's package cache on the head node (the job's working directory),
  where the submitter cannot find it and Ray may delete it: it is made absolute against the folder `qgrpo submit`
  runs in and passed with --set, which is printed; on several nodes it must be shared storage (or a URI);
- Ray 2.60 enables token authentication on clusters that have a token; its job client only sends the token when
  RAY_AUTH_MODE=token, so that is set for the submission when a token is found (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
  ~/.ray/auth_token) and the variable is unset. A client token is accepted by clusters without authentication too.
"""
from __future__ import annotations

import http.client
import json
import os
import posixpath
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the project folder: what the job runs
EXCLUDES = [".venv", "venv", "runs", ".cache", ".git", "bench/results", "**/__pycache__", "*.egg-info",
            ".pytest_cache", "*.parquet"]
# What the cluster's nodes have and this machine may not: checked by the job itself, on the head node.
_CLUSTER_SIDE = ("model.path: folder", "task.path: file", "task.eval_path: file")
CLUSTER_YAML = ROOT / "cluster" / "ray_cluster.yaml"  # the `ray up` example: where the nodes have the project
# What `import qgrpo` is made of (pyproject.toml maps the project root to the package).
PACKAGE_PARTS = ("__init__.py", "__main__.py", "actors", "cluster", "core", "learner", "rollout")
SUBMITTED = "_submitted"  # in a staged working directory: the config and the files it names from elsewhere
# Ray refuses a working_dir package of 512 MiB or more (its gRPC message limit): a file or model folder above this is
# not uploaded (the project tree is a few MiB).
UPLOAD_MAX = 384 * 2**20
# The local files a config names: (field, what it is); each is uploaded when the job could not see it otherwise.
_LOCAL_INPUTS = (("task.path", "file"), ("task.eval_path", "file"), ("model.path", "folder"))
DASHBOARD_FIX = ("is the cluster up (ray status on the head), is port 8265 reachable (ray dashboard / ssh -L "
                 "8265:localhost:8265), and is the address http://HOST:8265?")


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


def yaml_python(path: Path = CLUSTER_YAML) -> str | None:
    """The interpreter the `ray up` example installs on every node: the `file_mounts` target of the project (source
    ".") + .venv/bin/python, as written there (a path on the nodes: nothing is expanded here). None without one."""
    try:
        import yaml  # a Ray dependency

        mounts = (yaml.safe_load(path.read_text()) or {}).get("file_mounts") or {}
    except Exception:  # no example (or an unreadable one) is no reason to refuse a submission: this interpreter then
        return None
    for target, source in mounts.items():
        if str(source).strip().rstrip("/") in (".", ""):
            return posixpath.join(str(target).rstrip("/"), ".venv", "bin", "python")
    return None


def job_python(python: str | None) -> tuple[str, str]:
    """(the interpreter the job and its actors run, a line saying so), by the rule in the module docstring.
    Raises ValueError with the fix when --python is missing and this interpreter is not the cluster's."""
    if python:
        return python, f"the job and its actors run {python} (--python)"
    want = yaml_python()
    if want is None or os.path.normpath(sys.executable) == os.path.normpath(want):
        return sys.executable, f"the job and its actors run {sys.executable} (this interpreter; --python to change)"
    raise ValueError(f"--python not given, and this interpreter {sys.executable} is not the project's Python that "
                     f"{CLUSTER_YAML.relative_to(ROOT)} installs on the nodes, {want}: pass --python {want} for a "
                     "cluster started from it, or for another cluster --python with the path of the project's Python "
                     "on its nodes (`which python` there, in the project's environment)")


def probe(address: str, timeout: float = 5.0) -> str | None:
    """None when the dashboard's job API answers at `address`, else the line that says why not (one line: the ray
    CLI's own failure is a long traceback). 401/403 is a dashboard with token authentication: reachable, and
    `ray job submit` sends the token when one is found here."""
    url = (address if "://" in address else f"http://{address}").rstrip("/") + "/api/version"
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return None  # 2xx (redirects followed); anything else raises HTTPError
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            return None if has_auth_token() else (
                f"the Ray dashboard at {address} wants an auth token (HTTP {e.code}) and none was found here; set "
                "RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH, or copy the head's ~/.ray/auth_token to ~/.ray/auth_token")
        reason = f"HTTP {e.code} {e.reason}"
    except urllib.error.URLError as e:
        reason = str(e.reason)
    except TimeoutError:
        reason = f"no answer within {timeout:g} s"
    except (OSError, http.client.HTTPException, ValueError) as e:  # a reset, a non-HTTP port, a malformed address
        reason = f"{type(e).__name__}: {e}"
    reason = " ".join(reason.split()) or "no reason given"
    return f"cannot reach the Ray dashboard at {address} ({reason}); {DASHBOARD_FIX}"


def _excluded(rel: str) -> bool:
    """Whether the project-relative POSIX path `rel` is left out of the upload by `EXCLUDES` (gitignore-style, as Ray
    applies them: a pattern without "/" matches a name at any depth, one with "/" a path from the top)."""
    parts = rel.split("/")
    for pattern in EXCLUDES:
        pattern = pattern.removeprefix("**/")
        if "/" in pattern:
            n = pattern.count("/") + 1
            if len(parts) >= n and fnmatch("/".join(parts[:n]), pattern):
                return True
        elif any(fnmatch(part, pattern) for part in parts):
            return True
    return False


def _in_project(path: Path) -> str | None:
    """`path` (absolute) relative to the project folder when the upload of that folder holds it, else None."""
    try:
        rel = path.relative_to(ROOT).as_posix()
    except ValueError:
        return None
    return None if rel == "." or _excluded(rel) or rel.split("/")[0] == SUBMITTED else rel


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _package() -> Path:
    """`qgrpo` as links to this project's packages, in a temporary folder: uploaded as the job's `py_modules`, so that
    the job and every actor import the submitted code under its package name (the working directory is the project
    folder, which Python cannot import as `qgrpo`; an install on the nodes would be an older copy)."""
    package = Path(tempfile.mkdtemp(prefix="qgrpo-submit-")) / "qgrpo"
    package.mkdir()
    for part in PACKAGE_PARTS:
        (package / part).symlink_to(ROOT / part)
    return package


def _stage(uploads: list[tuple[Path, str]]) -> Path:
    """A new folder with the project tree less `EXCLUDES` and each (local path, relative destination) of `uploads`."""
    stage = Path(tempfile.mkdtemp(prefix="qgrpo-submit-"))
    try:
        for top, dirs, files in os.walk(ROOT):
            here = Path(top).relative_to(ROOT)
            dirs[:] = [d for d in dirs if _in_project(Path(top, d)) is not None and Path(top, d) != stage]
            for name in files:
                if _in_project(Path(top, name)) is not None:
                    (stage / here).mkdir(parents=True, exist_ok=True)
                    shutil.copy2(Path(top, name), stage / here / name)
        for src, dest in uploads:
            (stage / dest).parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if src.is_dir() else shutil.copy2)(src, stage / dest)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return stage


def build(config: str, overrides: list[str], address: str, python: str | None, wait: bool, env: list[str],
          submission_id: str | None = None) -> tuple[list[str], dict[str, str], list[str], Path | None]:
    """(the `ray job submit` argv, its environment, lines to tell the user, the staging folder to delete once it has
    run, or None when the job runs the project folder itself). Raises ValueError with the fix."""
    from qgrpo.cluster.config.schema import ConfigError, load_config
    from qgrpo.core.storage import is_uri
    from qgrpo.rollout.modeling.models import BUILTIN_PREFIX

    cfg_path = Path(config).expanduser().resolve()
    notes, overrides = [], list(overrides)
    try:
        cfg = load_config(cfg_path, overrides)
    except ConfigError as e:
        here = [p for p in e.problems if not p.startswith(_CLUSTER_SIDE)]
        if here:
            raise ValueError(str(ConfigError(here))) from None
        notes += [f"not checked here, the job checks on the cluster: {p}" for p in e.problems]
        cfg = None
    seen = cfg or _unchecked(cfg_path, overrides)
    python, line = job_python(python)
    notes.append(line)
    out = seen.run.output_dir
    if not is_uri(out) and not Path(out).expanduser().is_absolute():
        absolute = str(Path(out).expanduser().resolve())
        overrides.append(f"run.output_dir={json.dumps(absolute)}")
        notes.append(f"run.output_dir {out!r} is relative; the job writes under {absolute} (on a cluster of several "
                     "nodes that must be shared storage, or give an s3:// URI)")
    # What the job could not see otherwise goes into _submitted/ (paths as load_config gives them: the config's own
    # made absolute against its folder, a --set value or an older config's against the cwd).
    uploads: list[tuple[Path, str]] = []
    for field, kind in _LOCAL_INPUTS:
        section, key = field.split(".")
        value = getattr(getattr(seen, section), key)
        if not value or value.startswith(BUILTIN_PREFIX) or is_uri(value):
            continue
        local = Path(value).expanduser().resolve()
        if not (local.is_dir() if kind == "folder" else local.is_file()):
            continue  # the cluster's path: the job checks it
        rel = _in_project(local)
        if rel is not None:  # uploaded with the project: the job reads it there (its cwd is the working directory)
            if Path(value) != Path(rel):
                overrides.append(f"{field}={json.dumps(rel)}")
                notes.append(f"{field} {value!r} is the project's {rel!r}: the job reads it there (--set {field}=...)")
            continue
        if (size := _size(local)) > UPLOAD_MAX:
            notes.append(f"{field} {value!r} is a local {kind} of {size / 2**30:.2f} GiB, above the {UPLOAD_MAX >> 20} "
                         f"MiB uploaded with a job: NOT uploaded; every node must have it at {value!r} (or --set "
                         f"{field}= its path on the nodes)")
            continue
        dest = f"{SUBMITTED}/{field}/{local.name}"
        uploads.append((local, dest))
        overrides.append(f"{field}={json.dumps(dest)}")
        notes.append(f"{field} {value!r} is uploaded with the job: --set {field}={json.dumps(dest)}")
    cfg_rel = _in_project(cfg_path)
    if uploads or cfg_rel is None:
        cfg_rel = f"{SUBMITTED}/{cfg_path.name}"
        uploads.append((cfg_path, cfg_rel))
        notes.append(f"the job's working directory is a copy of {ROOT} with {SUBMITTED}/ (the config and the files "
                     "above), deleted once submitted")
    env_vars = dict(kv.split("=", 1) for kv in env)
    entry = [python, "-m", "qgrpo", "train", cfg_rel, *[a for o in overrides for a in ("--set", o)]]
    ray_cli = shutil.which("ray", path=str(Path(python).parent)) or shutil.which("ray") or "ray"
    job_env = dict(os.environ)
    if "RAY_AUTH_MODE" not in job_env and has_auth_token():
        job_env["RAY_AUTH_MODE"] = "token"
        notes.append("a Ray auth token was found: submitting with RAY_AUTH_MODE=token (Ray 2.60's job client sends the "
                     "token only then)")
    # Last: nothing to clean up when anything above raises. The staged tree is filtered already, and Ray's excludes
    # would drop staged files they match (*.parquet data).
    stage = _stage(uploads) if uploads else None
    package = _package()
    runtime_env = {"working_dir": str(stage or ROOT), **({} if stage else {"excludes": EXCLUDES}),
                   "py_modules": [str(package)], "py_executable": python, "env_vars": env_vars}
    argv = [ray_cli, "job", "submit", "--address", address, "--runtime-env-json", json.dumps(runtime_env),
            "--submission-id", submission_id or f"qgrpo-{seen.run.name}-{time.strftime('%Y%m%d-%H%M%S')}",
            *([] if wait else ["--no-wait"]), "--", *entry]
    return argv, job_env, notes, [d for d in (stage, package.parent) if d is not None]


def _unchecked(cfg_path: Path, overrides: list[str]):
    """The config as load_config reads it, without the checks of this machine: for a config whose local check failed
    only on paths the cluster has (its values are still needed here; the job checks them there)."""
    from qgrpo.cluster.config.schema import load_config

    return load_config(cfg_path, overrides, check_environment=False)


def submit(args) -> int:
    address = args.address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS")
    if not address:
        print("qgrpo submit: which cluster? pass --address http://HEAD:8265 (the dashboard address) or set "
              "RAY_API_SERVER_ADDRESS", file=sys.stderr)
        return 2
    if address.lower().startswith("ray://"):
        given = "--address" if args.address else "RAY_API_SERVER_ADDRESS" if os.environ.get(
            "RAY_API_SERVER_ADDRESS") else "RAY_ADDRESS"
        print(f"qgrpo submit: {given} {address} is a Ray Client address (ray://), not the job API: use the "
              "dashboard's http address, e.g. --address http://HEAD:8265", file=sys.stderr)
        return 2
    bad = [kv for kv in args.env if "=" not in kv]
    if bad:
        print(f"qgrpo submit: --env {bad[0]}: expected KEY=VALUE", file=sys.stderr)
        return 2
    try:
        argv, env, notes, temporary = build(args.config, args.overrides, address, args.python, not args.no_wait,
                                        args.env, args.submission_id)
    except ValueError as e:
        print(f"qgrpo submit: {e}", file=sys.stderr)
        return 2
    try:
        if (problem := probe(address)) is not None:
            print(f"qgrpo submit: {problem}", file=sys.stderr)
            return 2
        for n in notes:
            print(f"qgrpo submit: {n}", file=sys.stderr)
        print(f"qgrpo submit: {shlex.join(argv)}", file=sys.stderr)
        return subprocess.call(argv, env=env)  # returns once Ray has the upload (with --no-wait too)
    finally:
        for folder in temporary:
            shutil.rmtree(folder, ignore_errors=True)
