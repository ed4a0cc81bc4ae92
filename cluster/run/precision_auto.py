"""`rollout.precision = "auto"` resolved before any actor starts: a trial of each precision the rollout backend serves
on the actors' device (rollout/precision_trials.py), at the model and one rollout actor's share of a step's rows, and
the fastest one the precision guard accepts.

`qgrpo check` runs the trials in its own process when the rollout actors would run on this machine; `qgrpo train` and
`qgrpo serve` run them in a Ray task with one rollout actor's resources (its node, CPUs, GPU share and thread count),
which exits afterwards, so that the driver holds no model. The run directory's config.toml holds the choice as
rollout.precision with the trials in a comment, and the run's start event holds the trials (`record`); a resumed run
keeps its own choice. The user's file is never touched.
"""
from __future__ import annotations

import dataclasses
import math
import os
import tomllib

from qgrpo.rollout.backends import AUTO, auto_candidates, device_of
from qgrpo.rollout.precision_trials import Trial, choose, table

TRIAL_NEW_TOKENS = 16  # the most tokens a trial samples per row (a few decode steps past the prefill)
NOTE = "# rollout.precision = \"auto\" chose "  # the comment line under the run's config.toml


def is_auto(cfg) -> bool:
    return cfg.rollout.precision == AUTO


def candidates(cfg) -> list[str]:
    from qgrpo.cluster.config.rules import grid_needed

    ro = cfg.rollout
    return list(auto_candidates(ro.backend, device_of(ro.num_gpus), grid_needed(cfg)))


def trial_shape(cfg) -> tuple[int, int, int]:
    """(prompts, completions per prompt, new tokens) of one rollout actor's share of a step."""
    ro = cfg.rollout
    return math.ceil(ro.prompts_per_step / ro.num_actors), ro.group_size, min(ro.max_new_tokens, TRIAL_NEW_TOKENS)


def trial_items(cfg, prompts: int) -> list:
    """The first `prompts` train rows of the run's task (from the start again if it has fewer), as a trial samples
    them; the compute-precision timing of the generator takes the same (cluster/run/role_timing.py)."""
    from qgrpo.rollout.data.tasks import make_task

    task = make_task(cfg.task, cfg.run.seed)
    try:
        size = len(task)
    except TypeError:  # generated without end
        size = prompts
    return [task.item(i % size) for i in range(prompts)]


def run_trials(cfg, model_path: str, threads: int = 0) -> list[dict]:
    """The trials, run in this process (`threads`: torch's intra-op threads meanwhile, 0 = as they are)."""
    import torch

    from qgrpo.actors.common import local_model
    from qgrpo.cluster.run.workers import generator_kwargs
    from qgrpo.core.records import SamplingParams
    from qgrpo.rollout.backends import make_generator
    from qgrpo.rollout.precision_trials import measure

    prompts, group, new_tokens = trial_shape(cfg)
    items = trial_items(cfg, prompts)
    path = local_model(model_path, skip=("optimizer",))

    def make(precision: str):
        return make_generator(cfg.rollout.backend, **generator_kwargs(cfg, path, precision, f"auto-{precision}", 0))

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        trials = measure(make, candidates(cfg), items, SamplingParams(group, new_tokens, seed=cfg.run.seed),
                         cfg.guard.max_mismatch_kl if cfg.guard.enabled else 0.0)
    finally:
        torch.set_num_threads(before)
    return [t.to_dict() for t in trials]


def _trials_in_task(cfg, model_path: str, threads: int) -> list[dict]:
    """run_trials in a Ray task, with a rollout actor's threads (0: the CPUs Ray gave the task)."""
    from qgrpo.actors.common import quiet_libraries, resolve_threads

    quiet_libraries()
    return run_trials(cfg, model_path, resolve_threads(threads))


def remote_trials(cfg, model_path: str, threads: int, wait: str = "passive") -> list[dict]:
    """The trials in a Ray task placed as one rollout actor is (its resources, node labels, thread count and OpenMP
    wait); Ray must be running. The task's worker exits after it, with the models it loaded."""
    import ray

    from qgrpo.actors.common import thread_env
    from qgrpo.cluster.config.plan import role_requests
    from qgrpo.core.devices import role_env

    request = next(r for r in role_requests(cfg) if r.role == "rollout")
    task = ray.remote(max_calls=1)(_trials_in_task).options(
        **request.actor_options(),
        runtime_env={"env_vars": {**thread_env(threads, wait), **role_env(request.gpus)}})
    return ray.get(task.remote(cfg, model_path, threads))


@dataclasses.dataclass
class Choice:
    """The trials and what they chose: `cfg` with rollout.precision set to it, `record` for the run's start event."""

    cfg: object
    trials: list[Trial]
    chosen: Trial

    @property
    def lines(self) -> list[str]:
        prompts, group, new_tokens = trial_shape(self.cfg)
        return [f"auto tried {len(self.trials)} precision{'s' * (len(self.trials) != 1)} on {prompts * group} rows "
                f"({prompts} prompts x {group}), {new_tokens} new tokens each: {self.chosen.precision} chosen",
                *table(self.trials, self.chosen)]

    @property
    def record(self) -> dict:
        prompts, group, new_tokens = trial_shape(self.cfg)
        return {"choice": self.chosen.precision, "rows": prompts * group, "new_tokens": new_tokens,
                "trials": [t.to_dict() for t in self.trials]}

    @property
    def note(self) -> str:
        """The comment line under the run's config.toml."""
        tried = ", ".join(f"{t.precision} " + (f"{t.tokens_per_s:.1f} tokens/s" + (f" (rejected: {t.rejected})"
                                                                                   if t.rejected else "")
                                               if not t.error else "could not run")
                          for t in self.trials)
        return f"{NOTE}{self.chosen.precision} by trial: {tried}\n"


def choice(cfg, trial_dicts: list[dict]) -> Choice:
    """The fastest accepted trial as a Choice; ValueError (naming the field, the trials and the fix) when the guard
    accepted none."""
    trials = [Trial(**d) for d in trial_dicts]
    chosen = choose(trials)
    if chosen is None:
        raise ValueError("rollout.precision: \"auto\" found no precision that runs here and passes the precision "
                         "guard:\n    " + "\n    ".join(table(trials, None))
                         + "\n  name a precision (rollout.precision = \"bf16\" is the unquantized one)")
    ro = dataclasses.replace(cfg.rollout, precision=chosen.precision)
    return Choice(dataclasses.replace(cfg, rollout=ro), trials, chosen)


def resumed_choice(run_config_text: str) -> str | None:
    """The precision a run resumed from chose (its config.toml's rollout.precision), or None if it says auto."""
    try:
        precision = tomllib.loads(run_config_text).get("rollout", {}).get("precision")
    except tomllib.TOMLDecodeError:
        return None
    return precision if precision and precision != AUTO else None


def here(cfg, address: str | None, gpus: list[int] | None) -> bool:
    """Whether the rollout actors would run on this machine, so that `check` can try the precisions in its process."""
    if address is not None or gpus is not None:
        return False
    if not cfg.rollout.num_gpus:
        return True
    from qgrpo.core.devices import visible_gpu_count

    return visible_gpu_count() > 0


def local_threads(cfg) -> int:
    """One rollout actor's threads on this machine, as a local run gives them (cluster/run/workers.py)."""
    return cfg.rollout.threads or max(1, (os.cpu_count() or 1) // cfg.rollout.num_actors)


__all__ = ["is_auto", "candidates", "trial_shape", "trial_items", "run_trials", "remote_trials", "Choice", "choice",
           "resumed_choice", "here", "local_threads", "NOTE"]
