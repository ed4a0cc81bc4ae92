"""Process set-up shared by every actor: thread counts, so that actors do not fight over the cores; the library
messages dropped in every process; and ending actors without Ray reporting their death."""
from __future__ import annotations

import os


def thread_env(threads: int, wait: str = "passive") -> dict[str, str]:
    """Environment for an actor process. `wait` (CPU_WAITS): "passive", idle OpenMP threads sleep instead of spinning,
    which otherwise slows the other actors on a shared machine by up to 10x; "spin" (rollout.cpu_wait) for a process
    that has its cores to itself. Fault-injection drills (core/faults.py) pass through.
    `threads` 0: decided inside the actor from the CPUs Ray gives it (`resolve_threads`)."""
    from qgrpo.core import faults
    from qgrpo.core.cpu import wait_env

    counts = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads else {}
    return {**counts, **wait_env(wait), "TOKENIZERS_PARALLELISM": "false", **faults.env()}


def local_model(path: str, skip: tuple[str, ...] = ()) -> str:
    """The model folder `path` on this actor's node: a builtin model built here (cached; the driver's cache is not on
    other nodes), a checkpoint given as a URI downloaded here (cached, without the top-level entries in `skip`), a
    folder as given (it must be on every node: shared storage or copied)."""
    from qgrpo.core.storage import is_uri, localize
    from qgrpo.rollout.modeling.models import resolve_model_path

    return localize(path, skip=skip) if is_uri(path) else resolve_model_path(path)


def resolve_threads(threads: int) -> int:
    """`threads`, or (0) as many as the CPUs Ray assigned to this actor, at least one."""
    if threads:
        return threads
    import ray

    return max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)))


def apply_threads(threads: int) -> None:
    import torch

    from qgrpo.core.cpu import current_wait

    # The wait this process started with stays: libgomp has read it, and child processes must inherit the same.
    os.environ.update(thread_env(threads, current_wait()))
    torch.set_num_threads(threads)
    quiet_libraries()


class _Drop:
    """A logging filter on one library logger: drops the records whose message starts with one of `starts` (and
    contains `contains`), lets every other record of that logger through."""

    def __init__(self, *starts: str, contains: str = ""):
        self.starts, self.contains = starts, contains

    def filter(self, record) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is not ours to judge
            return True
        return not (text.startswith(self.starts) and self.contains in text)


# logger name -> the one expected message dropped there (each filter is installed once per process).
NOISE = {
    # torchao at import: its CUDA-only kernel libraries (_C_*.so) do not load on a CPU build of torch
    "torchao": _Drop("Failed to load ", contains=".so"),
    # torch, when torchao registers an enum at import: a deprecation notice meant for torchao's developers
    "torch.utils._pytree": _Drop("<enum ", contains="is an Enum subclass and is now natively supported"),
    # DeepSpeed at import in a process that trains nothing (the driver, a reward worker): a CPU learner is given
    # DS_ACCELERATOR=cpu (cluster/run/learners.py), a GPU one finds CUDA
    "DeepSpeed": _Drop("Setting accelerator to CPU."),
    # transformers, at the learner's shared-prompt pass under gradient checkpointing: the prompt's cache is kept all
    # the same (core/kv_replay.py lets the checkpointed layers fill the cache they are given)
    "transformers.utils.generic": _Drop("`use_cache=True` is incompatible with gradient checkpointing."),
    # Ray, when `qgrpo train` starts a local cluster: token authentication is on by default, as the notice says
    # (RAY_AUTH_MODE=disabled turns it off; set explicitly, Ray says nothing)
    "ray._private.authentication.authentication_token_setup": _Drop("Token authentication is enabled for this Ray "
                                                                    "cluster."),
}


def quiet_libraries() -> None:
    """Library messages that are expected noise in every qgrpo process, dropped at their source before the library
    is imported: called by the CLI before any command runs and by every actor when it starts. Each is one message
    of one named logger (NOISE); everything else those loggers say, warnings and errors, still shows.
    transformers draws a progress bar for every model load and save; from the actors they cut through the job's own
    bar, so they are off unless the user set HF_HUB_DISABLE_PROGRESS_BARS themselves. vLLM logs INFO lines at every
    weight reload and cache reset; its level is WARNING unless the user set VLLM_LOGGING_LEVEL (read when vllm is
    first imported, which the generator does after this)."""
    import logging
    import sys

    for name, drop in NOISE.items():
        logger = logging.getLogger(name)
        if drop not in logger.filters:
            logger.addFilter(drop)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1") == "1" and "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging  # read the variable at import: already done here

        hf_logging.disable_progress_bar()


END_WAIT_S = 10.0  # how long a clean run's end waits for its actors to exit by themselves before killing them


def end_actors(actors: list, wait_s: float = END_WAIT_S) -> None:
    """End `actors` as an exit of their own: `__ray_terminate__` runs after what each is doing, and Ray records an
    intended exit. `ray.kill` instead tears the worker down under Ray's feet, which Ray may report on the driver as
    "A worker died or was killed ... SYSTEM_ERROR" at the end of a clean run. Whatever has not exited within `wait_s`
    (busy, hung, or `wait_s` 0) is killed; actors already dead are skipped."""
    import ray

    asked = {}
    for a in actors:
        try:
            asked[a.__ray_terminate__.remote()] = a
        except Exception:  # noqa: BLE001 - a handle Ray no longer serves: killed below, best effort
            asked[object()] = a
    refs = [r for r in asked if isinstance(r, ray.ObjectRef)]
    left = set(asked)
    if refs and wait_s > 0:
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        left = set(pending) | {r for r in asked if not isinstance(r, ray.ObjectRef)}
    for r in left:
        try:
            ray.kill(asked[r], no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
