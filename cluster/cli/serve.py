"""`qgrpo serve CONFIG|CHECKPOINT [--port N] [--host H] [--model-name NAME] [--api-key KEY] [--max-body-mb MB]
[--max-session-calls N] [--session-idle-s S] [--set key=value ...]`: the run's OpenAI-compatible endpoint
(rollout/endpoint/, actors/endpoint_actor.py) over rollout actors of a base model or a checkpoint, without training.

- a TOML config serves its model.path, with its rollout backend, precision and num_actors, and its rollout sampling
  (temperature, top_p, top_k; max_new_tokens per call) as what a call leaves out;
- a checkpoint folder (runs/NAME/checkpoints/step_N, or its URI) serves its model files with the config saved in it
  (trainer_state.json); a LoRA/QLoRA checkpoint its merged model (in a temporary folder); a run directory its newest
  complete checkpoint; any other HF model folder the default config.

A local Ray of its own (RAY_ADDRESS is not joined) holds `rollout.num_actors` rollout actors, built as a run builds
them (cluster/run/workers.py: RolloutPool), and the EndpointActor over them, which serves any session id
(open_sessions). Access: bound beyond loopback, it asks every call for an API key (`--api-key`, else QGRPO_API_KEY,
else one generated and printed on stderr); a call naming no session gets one of its client's own; a session's calls
are bounded (`--max-session-calls`), an idle session is closed (`--session-idle-s`), a body is bounded
(`--max-body-mb`). Nothing is written into the user's folders. It serves until Ctrl-C or SIGTERM, then stops Ray and
exits 0 (a second signal exits at once). Bad input (no such file, a config with errors, a port in use) is one
`qgrpo serve:` message and exit status 2.
"""
from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import secrets
import shlex
import sys
import time
from pathlib import Path

from qgrpo.actors.ray_errors import cause_of
from qgrpo.cluster.cli.train import (
    EXIT_CONFIG,
    EXIT_FAILED,
    Progress,
    Refused,
    _model_path,
    _start_ray,
    auto_precision,
)
from qgrpo.cluster.config.schema import ConfigError, load_config
from qgrpo.cluster.run.stopping import StopRequest
from qgrpo.core import storage

DEFAULT_PORT = 8000  # when neither --port nor environment.endpoint_port names one
KEY_ENV = "QGRPO_API_KEY"  # the API key, when --api-key does not give one
MAX_SESSION_CALLS = 1000  # calls one served session may make (--max-session-calls)
SESSION_IDLE_S = 600.0  # a served session with no call for this long is closed (--session-idle-s)
MAX_BODY_MB = 8.0  # the largest request body (--max-body-mb)
POLL_S = 0.2  # how often the serving loop and the start-up waits look for a stop request


@dataclasses.dataclass
class Access:
    """Who may call, and how much: the endpoint's api_key (None: none), body, per-session call and idle bounds."""

    api_key: str | None
    generated: bool  # the key was made here (printed once serving)
    max_body_bytes: int
    max_session_calls: int
    idle_s: float

    def kwargs(self) -> dict:
        return {"api_key": self.api_key, "max_body_bytes": self.max_body_bytes,
                "max_session_calls": self.max_session_calls, "idle_s": self.idle_s}


def loopback(host: str) -> bool:
    """`host` reaches this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def access(args, host: str) -> Access:
    """--api-key, else QGRPO_API_KEY; bound beyond loopback without either: a key made now
    (secrets.token_urlsafe(32)). Raises Refused on a bound out of range."""
    key = getattr(args, "api_key", None) or os.environ.get(KEY_ENV) or None
    generated = key is None and not loopback(host)
    if generated:
        key = secrets.token_urlsafe(32)
    mb = getattr(args, "max_body_mb", None)
    calls = getattr(args, "max_session_calls", None)
    idle = getattr(args, "session_idle_s", None)
    mb, calls, idle = (MAX_BODY_MB if mb is None else mb, MAX_SESSION_CALLS if calls is None else calls,
                       SESSION_IDLE_S if idle is None else idle)
    if not mb > 0:
        raise Refused(f"--max-body-mb {mb:g}: a size in MiB above 0 (default {MAX_BODY_MB:g})")
    if calls < 0:
        raise Refused(f"--max-session-calls {calls}: a number of calls, 0 for no bound (default {MAX_SESSION_CALLS})")
    if idle < 0:
        raise Refused(f"--session-idle-s {idle:g}: seconds, 0 to keep idle sessions (default {SESSION_IDLE_S:g})")
    return Access(key, generated, int(mb * 2**20), calls, float(idle))


@dataclasses.dataclass
class Served:
    """What `qgrpo serve` serves: the effective config, the local model folder, and what it came from (in words)."""

    cfg: object
    model_path: str
    source: str


def serve_command(args) -> int:
    with contextlib.ExitStack() as stack:  # a merged LoRA checkpoint's temporary folder lives while it is served
        try:
            served = resolve(args, stack)
            host, port = listen_address(args, served.cfg)
            keys = access(args, host)
        except Refused as e:
            print(f"qgrpo serve: {e}", file=sys.stderr)
            return EXIT_CONFIG
        except KeyboardInterrupt:
            print("qgrpo serve: interrupted before serving; nothing was started", file=sys.stderr)
            return 0
        stop = _Stop()
        with stop.handling():
            return _serve(served, host, port, args.model_name or served.cfg.environment.served_model, stop, keys)


# ------------------------------------------------------------------ what is served, checked before Ray starts

def resolve(args, stack: contextlib.ExitStack) -> Served:
    """The config and local model folder of `args.target`; raises Refused. A LoRA checkpoint is merged into a
    temporary folder that `stack` removes."""
    target = args.target
    try:
        local = Path(storage.localize(target, skip=("optimizer",))) if storage.is_uri(target) \
            else Path(target).expanduser()
    except OSError as e:
        raise Refused(f"{target}: {e}") from None
    if not local.exists():
        raise Refused(f"{target}: no such file or folder; serve a TOML config (e.g. configs/tiny.toml) or a "
                      "checkpoint folder (runs/NAME/checkpoints/step_N)")
    source = str(target)
    machine: list[str] = []  # what this machine lacks; only what serving needs (the model, the backend) refuses
    try:
        if local.is_dir():
            local, source = _checkpoint_of(local, source)
            base = _saved_config(local)
            folder = _model_folder(local, stack)
            cfg = load_config(None, [f"model.path={json.dumps(folder)}", *args.overrides], base=base, machine=machine)
        else:
            cfg = load_config(local, args.overrides, machine=machine)
    except ConfigError as e:
        raise Refused(str(e), len(e.problems)) from None
    problems = [p for p in machine if p.startswith(("model.", "rollout."))]
    if problems:
        raise Refused(str(ConfigError(problems)), len(problems))
    return Served(cfg, _model_path(cfg, Progress()), source)


def _checkpoint_of(folder: Path, source: str) -> tuple[Path, str]:
    """A run directory's newest complete checkpoint (read only: nothing in the run is touched); other folders as
    given."""
    from qgrpo.cluster.rundir.checkpoint import STATE_FILE, complete_checkpoints

    if (folder / STATE_FILE).is_file() or not (folder / "checkpoints").is_dir():
        return folder, source
    found = complete_checkpoints(folder)
    if not found:
        raise Refused(f"{source}: a run directory with no complete checkpoint; serve its config.toml for the base "
                      "model, or a checkpoint once one is written")
    print(f"qgrpo serve: {source}: its newest complete checkpoint, {found[-1][1]}", file=sys.stderr)
    return Path(found[-1][1]), str(found[-1][1])


def _saved_config(folder: Path) -> dict | None:
    """The effective config a qgrpo checkpoint was trained with (its trainer_state.json), less what serving does
    not do (sync: no weights are loaded after the start; W&B); None for another model folder (the defaults)."""
    from qgrpo.cluster.rundir.checkpoint import STATE_FILE, read_state

    if not (folder / STATE_FILE).is_file():
        return None
    try:
        base = read_state(folder)["config"]
    except (OSError, ValueError, KeyError) as e:
        raise Refused(f"{folder / STATE_FILE}: unreadable ({type(e).__name__}: {e})") from None
    base.pop("sync", None)
    base.get("run", {}).pop("wandb_project", None)
    return base


def _model_folder(folder: Path, stack: contextlib.ExitStack) -> str:
    """`folder`, or a LoRA/QLoRA checkpoint's merged model in a temporary folder (removed when `stack` closes)."""
    from qgrpo.learner.adapters import as_model_folder, is_adapter_checkpoint

    if not is_adapter_checkpoint(folder):
        return str(folder)
    print(f"qgrpo serve: {folder} holds LoRA adapters: merging them into its base (a temporary folder)",
          file=sys.stderr)
    try:
        return stack.enter_context(as_model_folder(str(folder)))
    except (ValueError, OSError) as e:
        raise Refused(f"{folder}: {e}") from None


def listen_address(args, cfg) -> tuple[str, int]:
    """--host/--port, else environment.endpoint_host/endpoint_port (port 0 there: DEFAULT_PORT), checked free now
    (port 0: any free one) so that a port in use is refused before Ray starts."""
    from qgrpo.rollout.endpoint.local import bind

    host = args.host or cfg.environment.endpoint_host
    port = args.port if args.port is not None else (cfg.environment.endpoint_port or DEFAULT_PORT)
    if not 0 <= port <= 65535:
        raise Refused(f"--port {port}: a port number from 0 to 65535 (0: a free one)")
    try:
        bind(host, port).close()
    except OSError as e:
        raise Refused(str(e)) from None
    return host, port


# ------------------------------------------------------------------ serving

def _serve(served: Served, host: str, port: int, model: str, stop: _Stop, keys: Access) -> int:
    import ray

    from qgrpo.cluster.run.stopping import local_ray_killer
    from qgrpo.cluster.run.supervisor import RunFailed

    os.environ.pop("RAY_ADDRESS", None)  # a Ray of its own on this machine, where the model folder is
    started = _start_ray(served.cfg, None)
    stop.install()  # again: ray.init put Ray's own SIGTERM handler in place
    stop.on_exit = local_ray_killer() if started else None
    serving = _Serving(served, host, port, model, keys)
    try:
        address = serving.start(stop)
        if address is not None:
            _say_serving(served, model, address, keys)
            serving.keep_serving(stop)
        status, line = 0, f"stopped ({stop.name})" + ("" if address is not None else " before serving")
    except Refused as e:
        status, line = EXIT_CONFIG, str(e)
    except (_Failed, RunFailed) as e:
        status, line = EXIT_FAILED, str(e)
    finally:
        serving.end()  # an exit of their own, so that Ray reports no worker killed under it
        if started:
            ray.shutdown()
    print(f"qgrpo serve: {line}", file=sys.stderr)
    return status


class _Failed(Exception):
    """The actors or the endpoint did not start."""


class _Serving:
    """The rollout pool and the endpoint actor over it, supervised as a run supervises them
    (cluster/run/supervisor.py): a rollout actor that dies is replaced (the endpoint gets the pool's new link and
    the calls waiting on the dead one go to it); an endpoint that dies is started again at the same address (its
    calls in flight fail; the next ones are served). Past faults.max_replacements failures in a row, or a hung
    actor, RunFailed ends serving."""

    def __init__(self, served: Served, host: str, port: int, model: str, keys: Access):
        self.served, self.host, self.port, self.model, self.keys = served, host, port, model, keys
        self.pool = self.endpoint = self.supervisor = self.stop = None
        self.address: str | None = None

    def start(self, stop: _Stop) -> str | None:
        """The rollout actors and the endpoint over them; the endpoint's address (http://HOST:PORT), or None when
        a stop was requested meanwhile."""
        import ray

        from qgrpo.cluster.config.plan import infeasible, role_requests
        from qgrpo.cluster.run.precision_auto import is_auto
        from qgrpo.cluster.run.supervisor import Supervisor
        from qgrpo.cluster.run.workers import RolloutPool

        served, self.stop = self.served, stop
        if is_auto(served.cfg):  # tried on a rollout actor's machine before the pool starts (cli/train.py)
            served.cfg = auto_precision(served.cfg, served.model_path, None, None)[0]
        cfg, ro = served.cfg, served.cfg.rollout
        request = next(r for r in role_requests(cfg) if r.role == "rollout")
        problems = infeasible([request], ray.nodes())
        if problems:
            raise Refused(problems[0])
        # The pool of a run, at step 0: no environment (the endpoint plays no episodes; its workers would idle), no
        # weight sync (nothing publishes one; the pool's sync parts stay unused).
        pool_cfg = dataclasses.replace(cfg, environment=dataclasses.replace(cfg.environment, name=""))
        cores = os.cpu_count() or 1  # local mode: the actors share this machine's cores, as in a run
        print(f"qgrpo serve: starting {ro.num_actors} {ro.backend} rollout actor{'s' * (ro.num_actors != 1)} at "
              f"{ro.precision} on {served.source}", file=sys.stderr)
        self.pool = RolloutPool(pool_cfg, served.model_path, 0, ro.precision, request,
                                ro.threads or cores // ro.num_actors, cores if not ro.threads else 0)
        self.supervisor = Supervisor(cfg.faults.max_replacements, self.pool.events)
        if _wait(self.pool.starting(), stop, cfg.faults.schedule_timeout_s,
                 "starting the rollout actors (faults.schedule_timeout_s)") is None:
            return None
        return self._start_endpoint()

    def _start_endpoint(self) -> str | None:
        from qgrpo.actors.endpoint_actor import EndpointActor

        ro = self.served.cfg.rollout
        self.endpoint = EndpointActor.remote(self.model, self.served.model_path, self.pool.link(), host=self.host,
                                             port=self.port, max_tokens=ro.max_new_tokens,
                                             chat_template=self.served.cfg.task.chat_template, open_sessions=True,
                                             **self.keys.kwargs(), defaults={"temperature": ro.temperature,
                                                                             "top_p": ro.top_p, "top_k": ro.top_k})
        out = _wait([self.endpoint.start.remote()], self.stop, 300, "starting the endpoint")
        if out is None:
            return None
        self.address = out[0]
        self.port = int(self.address.rsplit(":", 1)[1])  # a replacement listens where this one did
        return self.address

    def _replace_endpoint(self, cause: str) -> None:
        import ray

        ray.kill(self.endpoint, no_restart=True)
        if self._start_endpoint() is None:  # a stop meanwhile
            return
        print(f"qgrpo serve: the endpoint died ({cause}); serving again at {self.address}/v1", file=sys.stderr,
              flush=True)

    def _push(self, link) -> None:
        import ray

        from qgrpo.cluster.run.supervisor import get_within

        try:
            get_within(self.endpoint.set_link.remote(link), 60, "serving: the endpoint's set_link")
        except ray.exceptions.RayActorError:  # the endpoint died: the one started next takes the pool's link
            pass

    def keep_serving(self, stop: _Stop) -> None:
        """Until a stop: the endpoint's reports of failed calls taken to the pool, which counts them and replaces a
        dead rollout actor; an endpoint that died replaced."""
        from qgrpo.cluster.run.supervisor import get_within

        self.pool.watch(self._push)
        while not stop.requested:
            ok, reports = self.supervisor.settle(
                "endpoint", lambda: get_within(self.endpoint.reports.remote(POLL_S), 60, "serving: the endpoint"),
                name="the endpoint actor", stage="serving", event="endpoint_failed", replace=self._replace_endpoint,
                work=False)
            if ok:
                if reports["served"]:  # calls answered: the endpoint's failures in a row start again
                    self.supervisor.served("endpoint")
                self.pool.take_reports(reports, "a served call")
            for e in self.pool.take_events():
                if e["event"] == "rollout_actor_failed":
                    said = f"rollout actor {e['actor'].removeprefix('rollout actor ')} failed ({e['cause']})"
                elif e["event"] == "rollout_actor_replaced":
                    said = f"rollout actor {e['actor']} replaced by {e['replacement']}; its calls go there"
                else:
                    continue
                print(f"qgrpo serve: {said}", file=sys.stderr, flush=True)

    def end(self) -> None:
        from qgrpo.actors.common import END_WAIT_S, end_actors

        if self.endpoint is not None:
            end_actors([self.endpoint], END_WAIT_S)
        if self.pool is not None:
            self.pool.end(END_WAIT_S)


def _wait(refs: list, stop: _Stop, seconds: float, what: str) -> list | None:
    """The results of `refs` (None when a stop is requested first); a failure or the deadline raise _Failed."""
    import ray

    deadline = time.monotonic() + seconds
    pending = list(refs)
    while pending:
        if stop.requested:
            return None
        if time.monotonic() > deadline:
            raise _Failed(f"{what}: not done within {seconds:.0f} s")
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
    try:
        return ray.get(refs)
    except ray.exceptions.RayError as e:
        raise _Failed(f"{what} failed: {cause_of(e)}") from None


def _say_serving(served: Served, model: str, address: str, keys: Access) -> None:
    """The address, the model name and a call to paste, on stdout (library messages go to stderr); a key made here on
    stderr, with the base URL."""
    cfg = served.cfg
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}],
                       "max_tokens": cfg.rollout.max_new_tokens})
    auth = ["-H", f"Authorization: Bearer ${KEY_ENV}"] if keys.api_key else []
    curl = shlex.join(["curl", f"{address}/v1/chat/completions", "-H", "Content-Type: application/json", *auth,
                       "-d", body])
    if keys.generated:
        print(f"qgrpo serve: {address}/v1 is reached beyond this machine, so every call needs this API key "
              f"(Authorization: Bearer KEY; a client's api_key); pass --api-key or {KEY_ENV} to choose it:\n"
              f"  {KEY_ENV}={keys.api_key}", file=sys.stderr, flush=True)
    print(f"qgrpo serve: {served.source} ({cfg.rollout.backend} {cfg.rollout.precision}, {cfg.rollout.num_actors} "
          f"rollout actor{'s' * (cfg.rollout.num_actors != 1)})\n"
          f"  base URL: {address}/v1\n"
          f"  model:    {model}\n"
          f"  try:      {curl}\n"
          "  Ctrl-C stops it.", flush=True)


class _Stop(StopRequest):
    """cluster/run/stopping.py's stop request, told for serving: the first SIGINT or SIGTERM stops serving (Ray is
    shut down, exit 0); a second exits at once, `on_exit` (killing the Ray this process started) first."""

    who, first = "qgrpo serve", "stopping"

    def left_behind(self) -> str:
        return ""
