"""The sections of how the policy learns: [algo], [learner] (with [learner.lora]), [sync], [faults] and [guard].

[algo] is generated from the objective's own declarations (learner/objective/: its settings record and the registered
policy losses' parameters), the placement strategies come from the placement plan, so the schema cannot drift from
the code that reads these values.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import Field
from pydantic.dataclasses import dataclass

from qgrpo.cluster.config.fields import (
    SECTION,
    Bool,
    Float,
    Int,
    Str,
    choice,
    generated_section,
    role_resources,
    setting,
)
from qgrpo.cluster.config.plan import STRATEGIES
from qgrpo.core.cpu import CPU_WAIT_SETTINGS, ROLE_COMPUTE_DTYPES
from qgrpo.learner.objective.knobs import REGISTERED, knobs
from qgrpo.learner.objective.losses import LOSSES, loss_keys
from qgrpo.learner.objective.rules import RULES as OBJECTIVE_RULES
from qgrpo.learner.objective.settings import ObjectiveSettings
from qgrpo.rollout.backends import AUTO, EMULATED_FORMATS, REGISTRY
from qgrpo.rollout.options import REQUANTIZE_MODES

LR_SCHEDULES = ("constant", "cosine")  # learner.lr_schedule (learner/engine.py: lr_factor)
LEARNER_MODES = ("full", "lora", "qlora")  # learner.mode
OPTIMIZERS = ("adamw", "adamw8bit")  # learner.optimizer
ATTENTION = ("auto", "eager", "sdpa", "flash_attention_2", "flex_attention")  # learner.attention
ZERO_STAGES = (0, 1, 2, 3)  # DeepSpeed's
# ZeRO stages each learner.mode supports. A bitsandbytes 4-bit base cannot be partitioned (ZeRO-3 shards parameters,
# and its packed uint8 weights with their quantization state are not ordinary parameters), and the merged-weight
# export of lora/qlora reads each wrapped layer whole, which ZeRO-3 would have to gather module by module: both stop
# at ZeRO-2, which partitions only the (adapter) gradients and optimizer states.
MODE_ZERO_STAGES = {"full": ZERO_STAGES, "lora": (0, 1, 2), "qlora": (0, 1, 2)}
TRANSPORTS = ("object_store", "collective")  # sync.transport (actors/weights.py, actors/collective.py)
EITHER = "must be {either}"


def algo_section() -> type:
    """[algo], generated from the objective's own declarations: the knobs of learner/objective/settings.py's
    ObjectiveSettings, with every registered policy loss's parameters (learner/objective/losses.py) after
    `policy_loss`, each under its [algo] key. cluster/config/schema.py regenerates it when a loss is registered."""
    entries = []
    for f in knobs(ObjectiveSettings):
        meta = {**f.metadata, "type": _type_name(f.type)}
        if meta["choices"] == REGISTERED:
            listed = "; ".join(f'"{name}" ({spec.summary})' for name, spec in LOSSES.items())
            meta = {**meta, "choices": tuple(LOSSES), "doc": f"{meta['doc']} One of: {listed}."}
        entries.append((f.name, f.default, meta))
        if f.name == "policy_loss":
            entries += [(key, p.default, {**p.metadata, "type": _type_name(p.type)})
                        for key, (_, p) in loss_keys().items()]
    return generated_section("AlgoConfig", ObjectiveSettings.__doc__ or "", __name__, entries)


def _type_name(tp) -> str:
    return tp if isinstance(tp, str) else tp.__name__


AlgoConfig = algo_section()


@dataclass(config=SECTION)
class LoraConfig:
    """[learner.lora]: the adapters of learner.mode = "lora" | "qlora" (peft)."""

    rank: Int = setting(16, ge=1)
    """r of the low-rank update B @ A."""
    alpha: Float = setting(32.0, gt=0)
    """The update is scaled by alpha / rank."""
    dropout: Float = setting(0.0, ge=0, lt=1)
    """Dropout on the adapters' input (0 keeps the learner's log-probs those of the policy)."""
    target_modules: list[Annotated[Str, Field(min_length=1)]] = setting(
        default_factory=lambda: ["all-linear"], min_length=1, fix='e.g. ["all-linear"] or ["q_proj", "v_proj"]')
    """Which modules get adapters: "all-linear" (every linear layer but the output head), or module names, e.g.
    ["q_proj", "k_proj", "v_proj", "o_proj"]."""


@dataclass(config=SECTION)
class LearnerConfig(role_resources("per rank", "learner_node", cpus=1.0,
                                   gpus=" (CUDA: NCCL between ranks; 0 = the CPU learner, gloo)")):
    world_size: Int = setting(1, ge=1)
    """DeepSpeed ranks, one Ray actor each."""
    zero_stage: choice(ZERO_STAGES, EITHER) = 0
    """DeepSpeed ZeRO stage 0-3 (lora and qlora: at most 2)."""
    lr: Float = setting(1e-5, gt=0, lt=1, fix="typical values are 1e-6 .. 1e-3")
    """Learning rate."""
    weight_decay: Float = setting(0.0, ge=0)
    """AdamW's decoupled weight decay."""
    beta1: Float = setting(0.9, ge=0, lt=1)
    """AdamW's beta1."""
    beta2: Float = setting(0.999, ge=0, lt=1)
    """AdamW's beta2."""
    warmup_steps: Int = setting(0, ge=0)
    """Linear warm-up of the learning rate, in optimizer updates."""
    lr_schedule: choice(LR_SCHEDULES) = "constant"
    """"constant" after the warm-up, or "cosine": lr x (1 + cos(pi x update / total updates)) / 2 times the warm-up
    ramp (MLX-GRPO's schedule), decaying towards 0 at run.steps."""
    grad_clip: Float = setting(1.0, ge=0, why="0 = off")
    """Max global grad norm (0 = off)."""
    micro_batch_per_rank: Int = setting(64, ge=1)
    """Sequences per forward/backward on one rank; gradients accumulate over the rest."""
    shared_prompt: Bool = True
    """Run each distinct prompt once per micro-batch and share its KV cache with the group's completions (learner
    and reference). Same log-probs and gradients as the full forward (tests/test_scoring.py), several times fewer
    tokens."""
    attention: choice(ATTENTION) = "auto"
    """Attention kernel of the learner's model: "auto" = "sdpa" with GPUs and on a CPU learner computing in fp32 (8%
    faster than eager at the TRL comparison's batch on a 2-core CPU, 1.2 GB less memory), "eager" on a CPU learner
    in bf16 (there the shared-prompt step ran 1.1-1.5x faster than SDPA's masked CPU path: bench/learner_profile.py); or
    name one of transformers' attn_implementation values."""
    placement_strategy: choice(STRATEGIES) = "PACK"
    """How the ranks' placement group spreads them: PACK (few nodes), SPREAD, STRICT_PACK (one node),
    STRICT_SPREAD (one rank per node). All ranks are placed together or not at all."""
    threads: Int = setting(0, ge=0, why="0 = automatic")
    """0 = all cores locally; on a cluster, the CPUs each rank was given (num_cpus)."""
    compute_dtype: choice(ROLE_COMPUTE_DTYPES, "must be {quoted}") = ""
    """What each rank computes in: "" follows model.compute_dtype; "auto", "bf16" or "fp32" as there."""
    cpu_wait: choice(CPU_WAIT_SETTINGS, "must be {quoted}") = "passive"
    """Each rank's idle OpenMP threads on a CPU, as rollout.cpu_wait."""
    mode: choice(LEARNER_MODES) = "full"
    """"full": every weight trains (bf16 weights, fp32 masters in the optimizer). "lora": a frozen bf16 base plus
    trainable adapters ([learner.lora]). "qlora": the frozen base in bitsandbytes NF4 (double quantization, bf16
    compute) plus adapters. Generators receive the merged weights and quantize them as usual, or with
    sync.adapters_only the adapters alone."""
    lora: LoraConfig = setting(default_factory=LoraConfig)
    """[learner.lora]: read when mode is lora or qlora."""
    optimizer: choice(OPTIMIZERS) = "adamw"
    """"adamw" (torch) or "adamw8bit" (bitsandbytes: 8-bit moments, ~4x less state)."""
    fake_quant: choice(("off", "rollout"), "must be {quoted}") = "off"
    """"rollout": quantization-aware learning. The learner's linear layers compute with their weights rounded onto
    the rollout generators' grid (round to nearest, straight-through gradients), so the policy it optimises is the
    one the generators sample from (docs/quantization.md). Needs learner.mode = "full" and a grid the project
    emulates: rollout.backend torch at int8 or int4, or vllm at int8."""
    gradient_checkpointing: Bool = True
    """Recompute each layer's activations in the backward pass instead of keeping them (less memory, ~1 more
    forward). With shared_prompt, the prompt pass's KV cache is replayed with the layers (core/kv_replay.py); that
    needs a model whose layers all attend in full (no sliding window), else the learner refuses at start."""


@dataclass(config=SECTION)
class SyncConfig:
    timeout_s: Float = setting(120.0, gt=0)
    """A weight sync that takes longer raises."""
    bucket_mb: Float = setting(64.0, gt=0)
    """Weights travel in buckets of about this size (one object per bucket)."""
    transport: choice(TRANSPORTS, "must be {quoted}") = "object_store"
    """How the buckets travel from learner rank 0: "object_store" (Ray's object store; shared memory on one node)
    or "collective" (a broadcast over a process group of rank 0 and the rollout actors: gloo on CPU, NCCL on
    CUDA)."""
    requantize: choice(REQUANTIZE_MODES, "must be {quoted}") = "nearest"
    """How each rollout actor rounds the received bf16 weights onto its format's grid (docs/quantization.md):
    "nearest" (what every backend does: an update smaller than half a step changes no code), "stochastic" (a
    weight's code rounds up with the chance of its remainder, seeded by the version: unbiased), "error_feedback"
    (each weight's rounding residual is added to the next version before rounding). The last two need a grid the
    actor emulates: rollout.backend torch at int8 or int4, or vllm at int8."""
    visibility: Bool = True
    """Measure at every sync how much of the update the quantized generators took up (sync/code_change_frac_min,
    sync/update_norm_ratio_min, sync/bf16_change_frac); each actor keeps the last version's codes and bf16 weights,
    3 bytes per quantized weight."""
    follow_floor: Float = setting(1e-4, ge=0, le=1, why="0 = no warning")
    """A warning in the run log when the shares of codes changed over the last follow_window syncs add up to less
    than this: the generators no longer follow the learner (try sync.requantize = "error_feedback")."""
    follow_window: Int = setting(10, ge=1)
    """Syncs that follow_floor looks back over."""
    adapters_only: Bool = False
    """learner.mode lora or qlora: send only the adapters (each layer's A and its B times alpha / rank) instead of the
    merged model; the generators keep the quantized base they started from and add B A beside it (torch: in bf16;
    vLLM: its LoRA support; docs/learner.md). Needs rollout.backend = "torch" or "vllm", sync.transport =
    "object_store", sync.requantize = "nearest" and rollout.norm_noise = 0."""


@dataclass(config=SECTION)
class FaultsConfig:
    """Deadlines and retries: a stage that does not finish in time raises, naming the stage and the actor."""

    generate_timeout_s: Float = setting(900.0, gt=0, why="seconds")
    """One step's generation (restarted when a lost actor's prompts are resubmitted)."""
    reference_timeout_s: Float = setting(900.0, gt=0, why="seconds")
    """One step's reference scoring."""
    learn_timeout_s: Float = setting(1800.0, gt=0, why="seconds")
    """One learner step, and a checkpoint save or load."""
    max_replacements: Int = setting(3, ge=0)
    """A rollout actor that fails this many times in a row more ends the run."""
    schedule_timeout_s: Float = setting(600.0, gt=0, why="seconds")
    """How long actors may wait for a busy cluster to free the resources they ask for (a request no node can ever
    satisfy fails at once instead)."""


@dataclass(config=SECTION)
class GuardConfig:
    """The precision guard: a step whose sampler log-probs, reference log-probs, loss or gradients are not finite,
    or whose sampler mismatch is above max_mismatch_kl, is skipped on every rank and logged with its reason."""

    enabled: Bool = True
    """Skip (and log) the steps described above instead of training on them."""
    max_mismatch_kl: Float = setting(2.0, ge=0, why="0 = no bound")
    """Bound on mismatch/kl_mu_old (mean per-token KL(mu || pi_old)); 0 = no bound."""
    ladder: Bool = True
    """When the guard fires, move the quantized generators one rung up the ladder (int4/nf4 -> int8 -> bf16), or
    the reference when its log-probs were the non-finite ones (or the generators are already at bf16)."""
    max_skips_at_top: Int = setting(3, ge=1)
    """Skipped steps in a row with nothing left to step up before the run stops."""



# Rules across fields (registered in rules.py): each reads the fields it is listed with, and is skipped when one of
# them has an error of its own. The objective's own (learner/objective/rules.py) read [algo] alone; these read more.
def _overlong_buffer(a, cfg) -> list[str]:
    if a.overlong_buffer < cfg.rollout.max_new_tokens:
        return []
    return [f"algo.overlong_buffer: must be < rollout.max_new_tokens ({cfg.rollout.max_new_tokens}), got "
            f"{a.overlong_buffer} (it is the last stretch of the allowed length); lower it"]


def _requantize_format(_, cfg) -> list[str]:
    ro = cfg.rollout
    if cfg.sync.requantize == "nearest" or REGISTRY[ro.backend].emulates(ro.precision) or ro.precision == AUTO:
        return []  # auto tries the emulated grids only (rules.py: _rollout_precision)
    served = ", ".join(f"{b} {p}" for b, p in EMULATED_FORMATS)
    return [f"sync.requantize: {cfg.sync.requantize!r} needs a quantized grid the rollout actor emulates ({served}); "
            f"rollout.backend {ro.backend!r} at rollout.precision {ro.precision!r} rounds by itself: set "
            "sync.requantize = \"nearest\" or change rollout.precision"]


def _fake_quant(_, cfg) -> list[str]:
    le, ro = cfg.learner, cfg.rollout
    if le.fake_quant == "off":
        return []
    if le.mode != "full":
        return [f"learner.fake_quant: \"rollout\" needs learner.mode = \"full\" (the generators of a {le.mode} "
                "learner quantize the merged weights, which the learner never holds); set fake_quant = \"off\""]
    if REGISTRY[ro.backend].emulates(ro.precision) or ro.precision == AUTO:
        return []
    served = ", ".join(f"{b} {p}" for b, p in EMULATED_FORMATS)
    return [f"learner.fake_quant: \"rollout\" simulates a grid the project emulates ({served}); rollout.backend "
            f"{ro.backend!r} at rollout.precision {ro.precision!r} has none: set fake_quant = \"off\" or change "
            "rollout.precision"]


def _norm_noise(_, cfg) -> list[str]:
    ro = cfg.rollout
    if ro.norm_noise == 0 or ro.norm_noise_stages == 1 or ro.norm_noise_end <= ro.norm_noise:
        return []
    return [f"rollout.norm_noise_end: the noise decays from rollout.norm_noise ({ro.norm_noise:g}) to it, got "
            f"{ro.norm_noise_end:g} > {ro.norm_noise:g}; lower norm_noise_end, or set norm_noise_stages = 1 "
            "to keep norm_noise throughout"]


def _adapters_only(_, cfg) -> list[str]:
    sy, ro = cfg.sync, cfg.rollout
    if not sy.adapters_only:
        return []
    if cfg.learner.mode == "full":
        return ["sync.adapters_only: needs learner.mode = \"lora\" or \"qlora\" (a full fine-tune has no adapters), "
                "got \"full\"; set sync.adapters_only = false or train adapters"]
    if not REGISTRY[ro.backend].adapters_only:
        able = " and ".join(f"\"{n}\"" for n, spec in REGISTRY.items() if spec.adapters_only)
        return [f"sync.adapters_only: built for rollout.backend = {able} ({ro.backend}'s adapter loading is not "
                f"built), got {ro.backend!r}; set sync.adapters_only = false or another rollout.backend"]
    if sy.transport != "object_store":
        return [f"sync.adapters_only: travels by sync.transport = \"object_store\" only, got {sy.transport!r}; set "
                "sync.transport = \"object_store\" or sync.adapters_only = false"]
    if sy.requantize != "nearest":
        return [f"sync.adapters_only: the generators' quantized base never changes, so there is nothing to re-round, "
                f"got sync.requantize = {sy.requantize!r}; set sync.requantize = \"nearest\" or adapters_only = false"]
    if ro.norm_noise > 0:
        return [f"sync.adapters_only: the norm weights are not sent, so rollout.norm_noise has nothing to perturb, got "
                f"{ro.norm_noise:g}; set rollout.norm_noise = 0 or sync.adapters_only = false"]
    return []


ALGO_RULES = [
    *((tuple(f"algo.{key}" for key in keys), lambda a, _, check=check: check(a)) for keys, check in OBJECTIVE_RULES),
    (("algo.overlong_buffer", "rollout.max_new_tokens"), _overlong_buffer),
    (("sync.requantize", "rollout.backend", "rollout.precision"), _requantize_format),  # [sync]'s, read the same way
    (("learner.fake_quant", "learner.mode", "rollout.backend", "rollout.precision"), _fake_quant),  # [learner]'s
    (("rollout.norm_noise", "rollout.norm_noise_end", "rollout.norm_noise_stages"), _norm_noise),  # [rollout]'s
    (("sync.adapters_only", "learner.mode", "rollout.backend", "sync.transport", "sync.requantize",
      "rollout.norm_noise"), _adapters_only),
]
