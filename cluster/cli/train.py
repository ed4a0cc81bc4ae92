"""`qgrpo train`: the config checked completely, then the pre-flight checks, Ray, the run directory, the run.

Everything up to `_start_ray` is cheap and leaves nothing behind, so a config that cannot run exits with status 2
before Ray starts, any model is touched, or any directory is created. Each step says why it refuses by raising
`Refused`; `train_command` prints it as one `qgrpo: ...` message. `before_ray` runs every one of these checks; `qgrpo
check` runs the same function, so that check cannot pass what train refuses.
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
    """Why the job is not started; printed after `qgrpo: `, exit status EXIT_CONFIG. `count`: the problems it lists."""

    def __init__(self, message: str, count: int = 1):
        super().__init__(message)
        self.count = count


def _refuse(problems: list[str]) -> None:
    if problems:
        raise Refused(str(ConfigError(problems)), len(problems))


class Progress:
    """What the checks found, told as each passes: `qgrpo train` keeps quiet until Ray starts (this class), `qgrpo
    check` prints a line each (commands.CheckReport). Hints are told to both. `compute`: the CPU roles' timed compute
    choice once the checks made it (cluster/run/compute_auto.py: ComputeChoice), else None."""

    compute = None

    def loaded(self, cfg) -> None:
        """The effective config, once it is valid."""

    def passed(self, what: str, found: str) -> None:
        """A check passed: its name, and what it found, in a few words."""

    def told(self, what: str, found: str) -> None:
        """What the run will do here (compute dtype, the machine's rates, the expected time): train prints it."""
        print(f"qgrpo: {what}: {found}", file=sys.stderr)

    def hint(self, text: str) -> None:
        """What would run but likely waste the run: train prints it on stderr, check in its report."""
        print(f"qgrpo: hint: {text}", file=sys.stderr)

    def table(self, lines: list[str]) -> None:
        """A table under the line before it (the precision trials of rollout.precision = "auto")."""
        for line in lines:
            print(f"qgrpo:     {line}", file=sys.stderr)


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


def _load(args, resume, machine: list[str]):
    """The effective config: the file given, else the resumed run's own config.toml, with the --set overrides. What
    a valid config names that this machine lacks (a data file, the model folder, a package) goes into `machine`, to be
    reported with the checks that follow."""
    config_path = args.config or (storage.join(_run_root(resume), "config.toml") if resume else None)
    if config_path is None:
        raise Refused("train needs a config, e.g. `qgrpo train configs/tiny.toml`")
    try:
        if storage.is_uri(config_path):  # a URI run's own config.toml, as the effective config to start from
            import tomllib

            return load_config(None, args.overrides, base=tomllib.loads(storage.read_text(config_path)),
                               machine=machine)
        notes: list[str] = []
        try:
            return load_config(config_path, args.overrides, notes=notes, machine=machine)
        finally:  # the mapping helps read an error about a translated field too
            if notes:
                print(f"qgrpo: {config_path} is an MLX-GRPO config, read as ours (`qgrpo migrate` writes the "
                      "result as a file):\n" + "\n".join(f"  {line}" for line in notes), file=sys.stderr)
    except ConfigError as e:
        raise Refused(str(e), len(e.problems)) from None


def before_ray(args, resume=None, address: str | None = None, gpus: list[int] | None = None,
               progress: Progress | None = None, trials: bool = False):
    """(config, local model folder) after every check `qgrpo train` runs before Ray starts; raises Refused listing
    every problem of the first stage that has any (config; dataset and rewards; reward calls; model and machine).
    `address`: a cluster, whose CPUs and GPUs are checked once connected; `gpus` (`qgrpo check --gpus`): the GPU counts
    of the nodes of another machine, whose GPU plan is checked instead of this one's, and whose CPUs are not known.
    `trials` (check): rollout.precision = "auto" is tried here, in this process, when the rollout actors would run
    on this machine; train tries it in a Ray task once Ray starts (`auto_precision`), and the config it returns
    still says auto."""
    progress = progress or Progress()
    cfg = checked_config(args, resume, progress)
    from qgrpo.rollout.agents.probe import probe_agent_checks  # an agent: one episode against the base model
    from qgrpo.rollout.environments.probe import probe_environment_checks  # reset and one step on a train row
    from qgrpo.rollout.rewards.probe import probe_checks  # each reward called once on stand-ins of two train rows

    _refuse(probe_checks(cfg, here=address is None and gpus is None, progress=progress)
            + probe_environment_checks(cfg, progress) + probe_agent_checks(cfg, progress))
    model_path, compute = _preflight(cfg, resume, address, gpus, progress)
    progress.compute = compute
    if compute is not None:  # model.compute_dtype = "auto" decided per CPU role by their timed work
        cfg = compute.applied(cfg)
    from qgrpo.cluster.run.precision_auto import here, is_auto

    if is_auto(cfg) and trials and here(cfg, address, gpus):
        _auto_here(cfg, model_path, progress)
    elif is_auto(cfg):
        progress.told("precision", "auto: each precision the backend serves is tried on a rollout actor's machine "
                      "when the run starts, the fastest the precision guard accepts chosen")
    return cfg, model_path


def _auto_here(cfg, model_path: str, progress: Progress):
    """rollout.precision = "auto" tried in this process (check, the rollout actors on this machine): the Choice."""
    from qgrpo.cluster.run.precision_auto import choice, local_threads, run_trials

    try:
        made = choice(cfg, run_trials(cfg, model_path, local_threads(cfg)))
    except ValueError as e:
        raise Refused(str(e)) from None
    progress.told("precision", made.lines[0])
    progress.table(made.lines[1:])
    return made


def auto_precision(cfg, model_path: str, resume, address: str | None):
    """rollout.precision = "auto" resolved once Ray runs: (the config with the precision chosen, the Choice; None for a
    resumed run, which keeps the precision its config.toml recorded). Raises Refused when the guard accepts none."""
    from qgrpo.cluster.run.cpu_waits import role_waits
    from qgrpo.cluster.run.precision_auto import choice, local_threads, remote_trials, resumed_choice

    if resume is not None:
        saved = storage.join(_run_root(resume), "config.toml")
        chosen = resumed_choice(storage.read_text(saved)) if storage.exists(saved) else None
        if chosen is not None:
            print(f"qgrpo: rollout.precision: auto: {chosen}, the resumed run's choice", file=sys.stderr)
            import dataclasses

            return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, precision=chosen)), None
    threads = cfg.rollout.threads if address else local_threads(cfg)
    cores = 0 if address else (os.cpu_count() or 1)  # the rollout actors' wait, as the run will start them
    wait = role_waits(cfg, not address, cores, {"rollout": threads})["rollout"]["wait"]
    try:
        made = choice(cfg, remote_trials(cfg, model_path, threads, wait))
    except ValueError as e:
        raise Refused(str(e)) from None
    print(f"qgrpo: precision: {made.lines[0]}", file=sys.stderr)
    Progress().table(made.lines[1:])
    return made.cfg, made


def _reward_checks(cfg) -> list[str]:
    """The rewards' problems found before the model is touched (a function that cannot be imported, a wrong
    signature, a reward model folder that is not a classifier), one line each; [] when they can run. A user's reward
    file is imported here, in this process, as the reward workers will import it."""
    from qgrpo.cluster.config.preflight import reward_model_problems
    from qgrpo.rollout.data.tasks import make_task
    from qgrpo.rollout.rewards.scoring import reward_problems

    try:  # the keywords a call passes besides the convention's: the first train row's columns
        columns = set(make_task(cfg.task, cfg.run.seed).item(0).columns or {})
    except Exception:  # the task's own problems are reported by check_task
        columns = None
    return reward_problems(cfg.rewards, columns) + reward_model_problems(cfg)


def _dataset_found(cfg) -> str:
    """The prompts of each split, counted as the run draws them."""
    from qgrpo.rollout.data.tasks import make_task

    def size(split: str) -> str:
        try:
            return f"{len(make_task(cfg.task, cfg.run.seed, split))} prompts"
        except TypeError:  # generated without end (digit_sum)
            return f"{cfg.task.eval_size} prompts (generated)" if split == "eval" else "generated without end"

    where = "".join(f", {key} {value}" for key, value in (("path", cfg.task.path), ("eval_path", cfg.task.eval_path))
                    if value)
    held = size("eval") if cfg.task.eval_size else "none (task.eval_size = 0)"
    return f"{cfg.task.name}{where}: train {size('train')}, held-out {held}"


def checked_config(args, resume=None, progress: Progress | None = None):
    """The config of `qgrpo train` and `qgrpo check`, with the checks that need no model and no Ray."""
    progress = progress or Progress()
    problems: list[str] = []  # what this machine lacks (files, folders, packages), then the dataset's problems
    cfg = _load(args, resume, problems)
    progress.loaded(cfg)
    progress.passed("config", f"valid: {cfg.run.steps} steps of {cfg.task.name} on {cfg.model.path}")
    from qgrpo.rollout.data.tasks import check_task

    if not any(p.startswith("task.") for p in problems):  # reads user datasets fully: malformed rows fail here
        problems += check_task(cfg.task, cfg.run.seed)
    from qgrpo.cluster.cli.submit import ray_job_id

    out = cfg.run.output_dir
    if ray_job_id() and resume is None and not storage.is_uri(out) and not Path(out).expanduser().is_absolute():
        problems.append(f"run.output_dir: {out!r} is relative, and this is a Ray job, whose working directory is a "
                        f"copy in Ray's package cache ({Path.cwd()}): the submitter would not find the run there and "
                        "Ray may delete it; give an absolute path on storage every node shares (or a URI), or submit "
                        "with `qgrpo submit`, which makes it absolute")
    if not problems:
        progress.passed("dataset", _dataset_found(cfg))
    reward_problems = _reward_checks(cfg)
    if not reward_problems:
        from qgrpo.rollout.environments.kinds import capabilities
        from qgrpo.rollout.rewards.scoring import rewards_applied

        own = capabilities(cfg.environment.name).own_score  # the environment's own score among them
        progress.passed("rewards", rewards_applied(cfg, own)
                        + ("; functions import, signatures fit the columns" if any(
                            s.function for s in cfg.rewards.functions) else ""))
    from qgrpo.rollout.agents.probe import load_problems as agent_load_problems
    from qgrpo.rollout.environments.probe import load_problems

    # the file imported here, its params bound, its tools described (an agent program: its function loaded)
    environment = load_problems(cfg.environment) + agent_load_problems(cfg.environment)
    if cfg.environment.name and not environment:
        params = cfg.environment.params
        progress.passed("env", f"{cfg.environment.name} loads" + (f" with {params}" if params else ""))
    reward_problems += environment
    if not problems:  # the task's rows can be read: who will judge held-out accuracy, and can the rewards score
        from qgrpo.rollout.evaluate import judge_check

        judged, more, warnings = judge_check(cfg)
        reward_problems += more
        if not more:
            progress.passed("held-out", judged)
        for w in warnings:
            progress.hint(w)
    _refuse(list(dict.fromkeys(problems + reward_problems)))  # a file two checks read is named once
    return cfg


def _model_path(cfg, progress: Progress) -> str:
    """The local model folder of model.path; a builtin model is built on first use (into the cache train uses)."""
    from qgrpo.rollout.modeling.models import BUILTIN_PREFIX, builtin_cache_dir, resolve_model_path

    path = cfg.model.path
    if path.startswith(BUILTIN_PREFIX):
        folder = builtin_cache_dir(path[len(BUILTIN_PREFIX):], cfg.model.cache_dir)
        if not (folder / "config.json").is_file():
            print(f"qgrpo: building {path} into {folder} (first use only; later runs reuse it)", file=sys.stderr)
    try:
        model_path = resolve_model_path(path, cfg.model.cache_dir)
    except (RuntimeError, OSError, ValueError) as e:
        raise Refused(f"model.path: {path!r} could not be made a local model folder ({type(e).__name__}: {e})") \
            from None
    progress.passed("model", path if model_path == path else f"{path} -> {model_path}")
    return model_path


def _preflight(cfg, resume, address: str | None, gpus: list[int] | None = None,
               progress: Progress | None = None):
    """(the model folder, the CPU roles' timed compute choice or None), once what would hang or train on garbage is
    ruled out (before Ray starts or anything is written). Hints (what would run but likely waste the run) are printed
    here, by train and check alike."""
    from qgrpo.actors.common import quiet_libraries

    progress = progress or Progress()
    quiet_libraries()
    from qgrpo.cluster.config.preflight import length_hints, precision_hints, preflight

    model_path = _model_path(cfg, progress)
    if resume is not None:
        from qgrpo.cluster.rundir.checkpoint import check_same_model

        try:
            check_same_model(resume, model_path)
        except ValueError as e:
            raise Refused(f"--resume: {e}") from None
    here = address is None and gpus is None  # this machine's CPUs; a cluster's are known once connected
    cpus = (os.cpu_count() or 1) if here else None
    problems = preflight(cfg, model_path, cpus, resuming=resume is not None)
    for hint in length_hints(cfg, model_path) + precision_hints(cfg):
        progress.hint(hint)
    if not problems:
        cpu_words = (f"actors fit the {cpus} CPUs here" if here else "CPUs not checked ("
                     + ("by train once connected)" if gpus is None else "--gpus: another machine)"))
        progress.passed("preflight", ("output folder writable; " if resume is None else "")
                        + f"prompts fit the context and tokenizer; {cpu_words}")
    found, plan_problems = _gpu_plan(cfg, address, gpus)
    if not plan_problems:
        progress.passed("GPU plan", found)
    _refuse(problems + plan_problems)
    from qgrpo.learner.objective.staleness import rollout_mode

    progress.told("rollouts", rollout_mode(cfg.algo.max_staleness, cfg.algo.overlap, cfg.rollout.num_actors))
    if here and any(getattr(cfg, r).cpu_wait != "passive" for r in ("rollout", "learner", "reference")):
        from qgrpo.cluster.run.cpu_waits import role_threads, role_waits, words

        progress.told("cpu waits", words(role_waits(cfg, True, cpus, role_threads(cfg, cpus))))
    compute = None
    if here and not cfg.learner.num_gpus:  # the roles compute on this machine's CPU: what in, and how fast
        from qgrpo.cluster.config.machine import machine_report
        from qgrpo.cluster.run import compute_auto

        untimed = "" if compute_auto.enabled() else f"roles not timed: {compute_auto.TIME_ROLES}=0"
        if not untimed:  # each CPU role's own work timed at the run's shapes (cached per machine and model)
            compute = compute_auto.resolve_here(cfg, model_path, lambda text: progress.told("compute", text))
        report = machine_report(cfg, model_path, resume=resume, compute=compute, untimed=untimed)
        for line in report.lines(cfg.run.steps):
            progress.told(*line.split(": ", 1))
        from qgrpo.rollout.backends import REGISTRY

        if REGISTRY[cfg.rollout.backend].cpu_native_kernels:
            from qgrpo.rollout.quantization import cpu_kernels

            for fmt in ("int8", "int4"):  # qgrpo's own kernel, or torch's and why
                if cfg.rollout.precision in (fmt, "auto"):
                    progress.told(f"{fmt} kernel", cpu_kernels.describe(fmt))
    return model_path, compute


COMPUTE_NOTE = "# model.compute_dtype on this machine's CPU: "  # the choice, recorded under the run's config.toml


def _recorded(cfg, note: str = "") -> str:
    """The run's config.toml: the effective config (each CPU role's compute_dtype as `auto` chose it by timing:
    cluster/run/compute_auto.py), the trials behind rollout.precision = "auto" (`note`), and what each role computes
    in on this machine's CPU."""
    from qgrpo.cluster.config.tomlio import to_toml
    from qgrpo.core.cpu import compute_dtype

    same: dict[tuple[str, str], list[str]] = {}  # the roles of one dtype and reason together
    for role in ("learner", "reference", "rollout"):
        own = getattr(cfg, role).compute_dtype
        made = (own, f"{role}.compute_dtype = \"{own}\"") if own in ("bf16", "fp32") else \
            compute_dtype(cfg.compute_dtype_of(role), "cpu")
        same.setdefault(made, []).append(role)
    roles = "; ".join(f"{', '.join(names)} {dtype} ({why})" for (dtype, why), names in same.items())
    return to_toml(cfg) + note + COMPUTE_NOTE + roles + "\n"


def _gpu_plan(cfg, address: str | None, gpus: list[int] | None) -> tuple[str, list[str]]:
    """(the plan in words, its problems): every role that asks for a GPU placed at once, on this machine's GPUs, or on
    nodes of `gpus` GPUs; a cluster's plan is made once connected (`_check_cluster`)."""
    from qgrpo.cluster.config.plan import gpu_plan, nodes_from_counts, role_requests

    requests = role_requests(cfg)
    if not any(r.gpus for r in requests):
        return "no role asks for a GPU", []
    if gpus is None and address:
        return "checked once connected to the cluster", []
    if gpus is None:
        from qgrpo.core.devices import visible_gpu_count

        counts = [visible_gpu_count()]
        where = f"this machine's {counts[0]} GPU{'s' * (counts[0] != 1)}"
    else:
        counts, where = gpus, f"--gpus {','.join(map(str, gpus))}"
    lines, problems = gpu_plan(requests, nodes_from_counts(counts))
    if problems and counts == [0] and gpus is None:
        problems[-1] += ("; this machine has no GPU: `qgrpo check CONFIG --gpus N` checks the config for a node of N "
                         "GPUs (`--gpus 4,1,1`: several nodes)")
    return f"on {where}:" + "".join(f"\n    {line}" for line in lines), problems


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
        rm = cfg.reward_model
        needed = (cfg.rollout.num_actors * cfg.rollout.num_cpus + cfg.learner.world_size * cfg.learner.num_cpus
                  + cfg.reference.num_cpus + cfg.rewards.num_workers * cfg.rewards.num_cpus
                  + (rm.num_actors * rm.num_cpus if rm.path else 0))
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
    _refuse(problems or gpu_plan(role_requests(cfg), nodes_from_ray(ray.nodes()))[1])


def _unnoted(text: str) -> str:
    from qgrpo.cluster.run.compute_auto import NOTE as MEASURED
    from qgrpo.cluster.run.precision_auto import NOTE

    return "".join(line for line in text.splitlines(keepends=True)
                   if not line.startswith((COMPUTE_NOTE, NOTE, MEASURED)))


def _open_run_dir(cfg, resume, note: str = "") -> storage.RunDir:
    """The run directory with the effective config.toml in it: the resumed run's own, or a new one. `note`: the trials
    of rollout.precision = "auto" (a resumed run keeps the note it has)."""
    if resume is not None:
        from qgrpo.cluster.run.precision_auto import NOTE

        run_dir = storage.RunDir.resume(_run_root(resume))  # a URI run: logs come down to a staging copy, mirrored
        saved = run_dir.local / "config.toml"
        kept = [line for line in saved.read_text().splitlines(keepends=True) if line.startswith(NOTE)] \
            if saved.is_file() and not note else []
        effective = _recorded(cfg, note or "".join(kept))
        if saved.is_file() and _unnoted(saved.read_text()) != _unnoted(effective):  # the record follows the run
            step = storage.name(resume).removeprefix("step_")
            saved.rename(run_dir.local / f"config.before_resume_at_{step}.toml")
            print(f"qgrpo: the config differs from the run's; the earlier one is kept as "
                  f"config.before_resume_at_{step}.toml", file=sys.stderr)
        saved.write_text(effective)
        print(f"qgrpo: resuming from {resume}", file=sys.stderr)
        return run_dir
    try:  # a URI: the first sync shows the run there and proves it writable before any actor starts
        run_dir = storage.RunDir.create(cfg.run.output_dir, f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        (run_dir.local / "config.toml").write_text(_recorded(cfg, note))
        run_dir.sync()
    except OSError as e:
        raise Refused(f"run.output_dir: cannot write the run directory there ({type(e).__name__}: {e}); pick a "
                      "place this machine and every node can write to") from None
    return run_dir


def train_command(args) -> int:
    try:
        resume = resume_point(args)
        address = args.ray_address or os.environ.get("RAY_ADDRESS")
        progress = Progress()
        cfg, model_path = before_ray(args, resume, address, progress=progress)
    except Refused as e:
        print(f"qgrpo: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:  # Ctrl-C before Ray starts: nothing of the run exists yet
        print("qgrpo: interrupted (SIGINT) before the run started; nothing was written", file=sys.stderr)
        return 130  # 128 + SIGINT, as a stopped run (cluster/run/stopping.py)
    from qgrpo.cluster.run.stopping import StopRequest

    stop = StopRequest()
    with stop.handling():  # the first SIGINT or SIGTERM stops at a step boundary, a second at once (run/stopping.py)
        return _train(cfg, model_path, resume, address, stop, progress.compute)


def _train(cfg, model_path: str, resume, address: str | None, stop, compute=None) -> int:
    """Ray, the run directory and the run itself; the exit status."""
    import ray

    from qgrpo.cluster.run.driver import train
    from qgrpo.cluster.run.stopping import local_ray_killer, stop_line
    from qgrpo.cluster.run.supervisor import RunFailed

    started = _start_ray(cfg, address)
    stop.install()  # again: ray.init put Ray's own SIGTERM handlers in place (a stack dump, then an abort)
    stop.on_exit = local_ray_killer() if started else None
    try:
        _check_cluster(cfg, address, started)
        from qgrpo.cluster.run.precision_auto import is_auto

        made = None
        if is_auto(cfg) and not stop.requested:  # tried on a rollout actor's machine, before any actor starts
            cfg, made = auto_precision(cfg, model_path, resume, address)
        run_dir = None if stop.requested else _open_run_dir(cfg, resume, (made.note if made else "")
                                                                    + (compute.note if compute else ""))
    except Refused as e:
        if started:
            ray.shutdown()
        print(f"qgrpo: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if run_dir is None:  # a signal while Ray started
        if started:
            ray.shutdown()
        print(f"qgrpo: stopped ({stop.name}) before the run started; nothing was written", file=sys.stderr)
        return stop.status
    stop.run_root = run_dir.root  # a second signal's line names its last checkpoint (run/stopping.py)
    print(f"qgrpo: run directory {run_dir}" + (f" (logs staged in {run_dir.local})" if run_dir.local != run_dir.root
                                               else ""), file=sys.stderr)
    t0 = time.monotonic()
    try:
        result = train(cfg, run_dir, model_path, resume, stop, auto_precision=made.record if made else None,
                       auto_compute=compute.record if compute else None)
    except (RunFailed, storage.StorageError) as e:  # StorageError: the last copy of the logs to a URI failed
        print(f"qgrpo: {e}", file=sys.stderr)
        return stop.status or EXIT_FAILED  # after a signal: it may have reached the actors too (a process group's)
    finally:
        if started:
            ray.shutdown()
    if result["stopped"]:
        print(stop_line(stop, result["stopped"]["step"], cfg.run.steps, run_dir.root, result["checkpoint"]),
              file=sys.stderr)
        return stop.status
    from qgrpo.cluster.cli.summary import summary

    print(summary(result, run_dir.root, time.monotonic() - t0, cfg, run_dir.local), file=sys.stderr)
    return 0
