"""Ray actors hosting the reward model ([reward_model]): a sequence classifier scoring prompt + completion pairs, on
the CPU or on the GPU Ray assigns (reward_model.num_gpus), scaled out over reward_model.num_actors actors."""
from __future__ import annotations

from typing import Any, Sequence

import ray

from qgrpo.actors.common import apply_threads, local_model, resolve_threads, thread_env
from qgrpo.rollout.rewards.classifier import RewardClassifier

_GB = 2**30


@ray.remote
class RewardModelActor:
    def __init__(self, model_path: str, precision: str = "bf16", threads: int = 0, batch_size: int = 16,
                 max_length: int = 0):
        """`threads` 0: as many as the CPUs Ray gave the actor. The device follows the GPUs Ray assigned (none: CPU)."""
        from qgrpo.core.devices import bind, current_device

        self.threads = resolve_threads(threads)
        apply_threads(self.threads)
        device = bind(current_device("the reward model actor"))
        self.classifier = RewardClassifier(local_model(model_path), precision, device, batch_size, max_length)

    def score(self, prompts: Sequence[str], completions: Sequence[str],
              histories: Sequence[Sequence | None] | None = None) -> list[float]:
        return self.classifier.score(prompts, completions, histories)

    def info(self) -> dict[str, Any]:
        return {**self.classifier.info(), "threads": self.threads, "node_id": ray.get_runtime_context().get_node_id()}


def actor_options(rm_cfg: Any) -> dict:
    """`.options(...)` of one reward model actor from [reward_model] (CPUs, GPUs, memory, custom resources, labels),
    as cluster/config/plan.RoleRequest.actor_options builds them for the other roles."""
    opts: dict = {"num_cpus": rm_cfg.num_cpus, "num_gpus": rm_cfg.num_gpus}
    if rm_cfg.memory_gb:
        opts["memory"] = int(rm_cfg.memory_gb * _GB)
    if getattr(rm_cfg, "resources", None):
        opts["resources"] = {k: float(v) for k, v in rm_cfg.resources.items()}
    if getattr(rm_cfg, "node_labels", None):
        opts["label_selector"] = {k: str(v) for k, v in rm_cfg.node_labels.items()}
    return opts


def start_reward_models(rm_cfg: Any, model_path: str, threads: int | None = None,
                        options: dict | None = None) -> list:
    """reward_model.num_actors actor handles hosting `model_path` (a folder, or builtin:/Hub id/URI resolved on each
    actor's node). `threads` None: reward_model.threads (0 = the CPUs each actor was given; a local driver may pass
    its core count). `options` replaces the `.options(...)` built from rm_cfg (e.g. a RoleRequest's, in a placement
    group)."""
    from qgrpo.core.devices import role_env

    n = rm_cfg.threads if threads is None else threads
    opts = dict(options) if options is not None else actor_options(rm_cfg)
    env = {**thread_env(n), **role_env(opts.get("num_gpus", 0.0))}
    return [RewardModelActor.options(**opts, runtime_env={"env_vars": env}).remote(
        model_path, rm_cfg.precision, n, rm_cfg.batch_size, rm_cfg.max_length) for _ in range(rm_cfg.num_actors)]


def score_on(actors: list, prompts: Sequence[str], completions: Sequence[str],
             histories: Sequence[Sequence | None] | None = None, timeout_s: float = 120.0) -> list[float]:
    """Score a batch split into contiguous, near-equal slices over `actors`, in parallel; the scores in input order.
    Raises TimeoutError naming reward_model.timeout_s when the slowest slice takes longer."""
    n, k = len(prompts), min(len(actors), len(prompts))
    if n == 0:
        return []
    bounds = [n * i // k for i in range(k + 1)]
    refs = [a.score.remote(list(prompts[lo:hi]), list(completions[lo:hi]),
                           None if histories is None else list(histories[lo:hi]))
            for a, lo, hi in zip(actors, bounds, bounds[1:])]
    try:
        parts = ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        for r in refs:
            ray.cancel(r)
        raise TimeoutError(f"reward_model.timeout_s: scoring {n} completions on {k} reward model actor(s) took longer "
                           f"than {timeout_s:g} s; raise reward_model.timeout_s, add actors (reward_model.num_actors) "
                           "or give them GPUs (reward_model.num_gpus)") from None
    return [float(x) for part in parts for x in part]
