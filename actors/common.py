"""Process set-up shared by every actor: thread counts, so that actors do not fight over the cores."""
from __future__ import annotations

import os


def thread_env(threads: int) -> dict[str, str]:
    """Environment for an actor process. PASSIVE: idle OpenMP threads sleep instead of spinning, which otherwise
    slows the other actors on a shared machine by up to 10x. Fault-injection drills (core/faults.py) pass through.
    `threads` 0: decided inside the actor from the CPUs Ray gives it (`resolve_threads`)."""
    from qgrpo.core import faults

    counts = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads else {}
    return {**counts, "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false", **faults.env()}


def local_model(path: str, skip: tuple[str, ...] = ()) -> str:
    """The model folder `path` on this actor's node: a builtin model built here (cached; the driver's cache is not on
    other nodes), a checkpoint given as a URI downloaded here (cached, without the top-level entries in `skip`), a
    folder as given (it must be on every node: shared storage or copied)."""
    from qgrpo.core.storage import is_uri, localize
    from qgrpo.rollout.models import resolve_model_path

    return localize(path, skip=skip) if is_uri(path) else resolve_model_path(path)


def resolve_threads(threads: int) -> int:
    """`threads`, or (0) as many as the CPUs Ray assigned to this actor, at least one."""
    if threads:
        return threads
    import ray

    return max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)))


def apply_threads(threads: int) -> None:
    import torch

    os.environ.update(thread_env(threads))
    torch.set_num_threads(threads)
    quiet_libraries()


def quiet_libraries() -> None:
    """torchao logs a warning per missing CUDA-only kernel library at import; on CPU they are expected noise.
    transformers draws a progress bar for every model load and save; from the actors they cut through the job's own
    bar, so they are off unless the user set HF_HUB_DISABLE_PROGRESS_BARS themselves. vLLM logs INFO lines at every
    weight reload and cache reset; its level is WARNING unless the user set VLLM_LOGGING_LEVEL (read when vllm is
    first imported, which the generator does after this)."""
    import logging
    import sys

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1") == "1" and "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging  # read the variable at import: already done here

        hf_logging.disable_progress_bar()
