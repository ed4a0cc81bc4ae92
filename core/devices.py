"""Which device each role runs on, decided in one place, from what Ray assigned it.

The rule: a role's device follows the GPUs Ray gave its actor, never `torch.cuda.is_available()`.
- A role that asked for no GPU runs with no GPU visible: `role_env(0)` puts `CUDA_VISIBLE_DEVICES=""` in its runtime
  environment. Ray 2.60 no longer clears that variable for zero-GPU actors, so without this a CPU learner on a GPU
  node would see every GPU (and DeepSpeed would pick NCCL), and zero-GPU rollout actors would pile onto cuda:0 outside
  Ray's accounting.
- A role that asked for GPUs sees exactly the ones Ray assigned (Ray sets `CUDA_VISIBLE_DEVICES` to them), so its
  device is `cuda:0` of its own process: `device_from_ids`.
- Outside a Ray actor (the driver, `qgrpo eval`, a unit test) nothing was assigned: the process's own visible GPUs
  are its own, and `current_device()` takes the first of them, or the CPU.

A fractional GPU (`num_gpus` < 1) is a share of one GPU that other roles use too. What such a role may allocate
follows its share: torch roles cap their caching allocator at it (`bind`), vLLM's memory share is derived from it
(rollout/backends: `VLLMOptions.memory_share`), and an engine that starts while a killed one still holds memory waits
for the memory to be free (`wait_for_gpu_memory`). Everything here is a plain function with a CPU test.
"""
from __future__ import annotations

import os
import time
from typing import Callable

import torch

# Memory a shared GPU's roles leave unclaimed: CUDA contexts (~0.5 GiB per process) and allocator fragmentation live
# outside every share (vLLM's own default share of a whole GPU is 0.9 for the same reason).
HEADROOM = 0.1


class DeviceError(RuntimeError):
    """A role was assigned a device this process cannot use (e.g. GPUs with a CPU-only torch)."""


def role_env(num_gpus: float) -> dict[str, str]:
    """Environment variables for an actor that asks Ray for `num_gpus`: none asked means none visible."""
    return {} if num_gpus > 0 else {"CUDA_VISIBLE_DEVICES": ""}


def device_from_ids(gpu_ids: list, cuda_available: bool, role: str = "this role") -> torch.device:
    """The device of a process whose assigned GPU ids are `gpu_ids` (Ray made exactly those visible, so the first is
    cuda:0); the CPU when none were assigned. Raises DeviceError when GPUs were assigned but torch cannot use them."""
    if not gpu_ids:
        return torch.device("cpu")
    if not cuda_available:
        raise DeviceError(f"{role} was assigned GPU(s) {', '.join(map(str, gpu_ids))} but this torch cannot use CUDA "
                          f"(torch {torch.__version__}, "
                          f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r});"
                          " install the CUDA build on that node (`make install-cuda`), or set the role's num_gpus = 0")
    return torch.device("cuda", 0)


def assigned_gpus() -> tuple[list[str], float] | None:
    """(GPU ids, GPU amount) Ray assigned to the calling actor, or None outside a Ray worker."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        ctx = ray.get_runtime_context()
        if ctx.worker.mode != ray.WORKER_MODE:  # the driver: nothing assigned
            return None
        return list(ctx.get_accelerator_ids().get("GPU", [])), float(ctx.get_assigned_resources().get("GPU", 0.0))
    except ImportError:
        return None


def visible_gpu_count() -> int:
    """GPUs this process may use: none when CUDA_VISIBLE_DEVICES is empty, else what torch counts."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def current_device(role: str = "this role") -> torch.device:
    """This process's device: inside a Ray actor from the GPUs Ray assigned it; outside, its first visible GPU."""
    got = assigned_gpus()
    if got is not None:
        return device_from_ids(got[0], torch.cuda.is_available(), role)
    return torch.device("cuda", 0) if visible_gpu_count() else torch.device("cpu")


def gpu_share() -> float:
    """The share of its GPU the calling actor holds (1.0 for whole GPUs or outside Ray)."""
    got = assigned_gpus()
    if got is None or not got[0]:
        return 1.0
    ids, amount = got
    return min(1.0, amount / len(ids))


def bind(device: torch.device, share: float | None = None) -> torch.device:
    """Make `device` this process's current device; on a shared GPU (share < 1) cap torch's allocator at the share,
    less the headroom, so the role cannot starve the others on that GPU (it raises CUDA out-of-memory instead)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        share = gpu_share() if share is None else share
        if share < 1.0:
            torch.cuda.set_per_process_memory_fraction(allocator_fraction(share), device)
    return device


def allocator_fraction(share: float) -> float:
    """The allocator cap of a role holding `share` of a GPU: the share less its part of the headroom."""
    return max(0.01, share * (1.0 - HEADROOM))


def wait_for_gpu_memory(fraction: float, timeout_s: float, what: str,
                        mem_get_info: Callable[[], tuple[int, int]] | None = None,
                        sleep: Callable[[float], None] = time.sleep, poll_s: float = 1.0) -> float:
    """Wait until `fraction` of the GPU's memory is free (an engine replaced or moved up the precision ladder starts
    while the killed one's process may still hold its memory). Returns the seconds waited; raises DeviceError naming
    `what`, the free and needed GiB after `timeout_s`."""
    if mem_get_info is None:
        mem_get_info = torch.cuda.mem_get_info
    t0 = time.monotonic()
    while True:
        free, total = mem_get_info()
        if free >= fraction * total:
            return time.monotonic() - t0
        if time.monotonic() - t0 >= timeout_s:
            raise DeviceError(f"{what}: needs {fraction * total / 2**30:.1f} GiB of its GPU ({fraction:.2f} of "
                              f"{total / 2**30:.1f} GiB) but only {free / 2**30:.1f} GiB stayed free for "
                              f"{timeout_s:.0f} s; another process holds the rest (nvidia-smi shows which): lower the "
                              "role's share or give it a GPU of its own")
        sleep(poll_s)


def collective_device() -> torch.device:
    """The device of tensors handed to the default process group's collectives: NCCL serves only CUDA tensors,
    gloo CPU ones."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def dist_backend(device: torch.device) -> str:
    """The learner ranks' process-group backend for the device they train on."""
    return "nccl" if device.type == "cuda" else "gloo"


def physical_gpus() -> list[str]:
    """Identities of the GPUs the calling process holds, unique across the cluster: "NODE_ID/GPU_ID" from Ray's
    assignment (inside an actor), [] without GPUs."""
    got = assigned_gpus()
    if not got or not got[0]:
        return []
    import ray

    node = ray.get_runtime_context().get_node_id()
    return [f"{node}/{i}" for i in got[0]]


def transport_backend(members: list[dict]) -> tuple[str, str]:
    """The weight broadcast group's backend from what each member reports ({"name", "device": "cuda"|"cpu", "gpus":
    physical ids}): NCCL only when every member is on CUDA and no two share a physical GPU (NCCL refuses two members
    on one device), else gloo. Returns (backend, why)."""
    cpu = [m["name"] for m in members if m["device"] != "cuda"]
    if cpu:
        return "gloo", f"{', '.join(cpu)} on the CPU"
    seen: dict[str, str] = {}
    for m in members:
        for g in m.get("gpus", []):
            if g in seen:
                return "gloo", f"{seen[g]} and {m['name']} share GPU {g.rpartition('/')[2]} of one node"
            seen[g] = m["name"]
    return "nccl", "every member has a GPU of its own"
