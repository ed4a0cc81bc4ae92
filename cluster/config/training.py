"""The sections of how the policy learns: [algo], [learner] (with [learner.lora]), [sync], [faults] and [guard].

The loss's choices and the bound of its importance-weight cap come from learner/loss.py, the advantage scales from
rollout/advantages.py and the placement strategies from the placement plan, so the schema cannot drift from the code
that reads these values.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import Field
from pydantic.dataclasses import dataclass

from qgrpo.cluster.config.fields import SECTION, Bool, Float, Int, Str, Table, choice, setting
from qgrpo.cluster.config.plan import STRATEGIES
from qgrpo.learner.options import AGGREGATIONS, IS_CAP_MIN, IS_MODES, KL_ESTIMATORS
from qgrpo.rollout.options import SCALES

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


@dataclass(config=SECTION)
class AlgoConfig:
    advantage_scale: choice(SCALES, "must be {quoted}") = "std"
    """"std" (GRPO: rewards minus the group mean, over the group's std) or "none" (Dr. GRPO: no std scaling)."""
    clip_low: Float = setting(0.2, ge=0, lt=1)
    """eps_low of the clipped surrogate (the ratio floor is 1 - clip_low); at most clip_high."""
    clip_high: Float = setting(0.2, ge=0)
    """eps_high of the clipped surrogate (DAPO's clip-higher uses 0.28)."""
    kl_coeff: Float = setting(0.0, ge=0)
    """Weight of the KL-to-reference term; 0 disables the reference actor."""
    kl_estimator: choice(KL_ESTIMATORS, EITHER) = "k3"
    """Per-token estimate of KL(pi_theta || ref): k1 (unbiased), k2 (low variance) or k3 (unbiased, >= 0)."""
    loss_agg: choice(AGGREGATIONS, EITHER) = "token_mean"
    """How token losses add up: token_mean (DAPO), seq_mean (GRPO) or constant (Dr. GRPO)."""
    is_mode: choice(IS_MODES, EITHER) = "truncate"
    """Correction for the quantized sampler mu != pi_old: truncate (TIS: min(pi_old/mu, C)), mask (drop tokens
    outside [1/C, C]) or none."""
    is_cap: Float = setting(2.0, ge=IS_CAP_MIN, why="C in min(pi_old/mu, C); [1/C, C] must contain 1")
    """C, the bound of the importance weights: truncate at C, or mask outside [1/C, C] (inf = untruncated)."""
    update_every: Int = setting(1, ge=1, why="1 = sync after every step")
    """Generators get new weights every N learner steps (1 = on-policy up to quantization)."""
    updates_per_batch: Int = setting(1, ge=1)
    """Optimizer updates on each batch (> 1 makes the clip matter)."""
    overlap: Bool = False
    """One-step-off-policy: step k+1's rollouts are generated while the learner trains on step k
    (cluster/run/overlap.py). They are one update stale at update_every = 1, corrected by the importance weights
    (is_mode); staleness is recorded per rollout. Pays off when generators and learner have their own devices or
    nodes."""


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
class LearnerConfig:
    world_size: Int = setting(1, ge=1)
    """DeepSpeed ranks, one Ray actor each."""
    zero_stage: choice(ZERO_STAGES, EITHER) = 0
    """DeepSpeed ZeRO stage 0-3 (lora and qlora: at most 2)."""
    lr: Float = setting(1e-6, gt=0, lt=1, fix="typical values are 1e-6 .. 1e-3")
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
    """Attention kernel of the learner's model: "auto" = "eager" on a CPU learner (on a 2-core CPU the shared-prompt
    forward + backward ran 1.1-1.5x faster than with SDPA, whose masked CPU path is slow: bench/learner_profile.py),
    "sdpa" with GPUs; or name one of transformers' attn_implementation values."""
    num_cpus: Float = setting(1.0, ge=0)
    """Ray CPU resource per rank."""
    num_gpus: Float = setting(0.0, ge=0)
    """Ray GPU resource per rank (CUDA: NCCL between ranks; 0 = the CPU learner, gloo)."""
    memory_gb: Float = setting(0.0, ge=0, why="0 = none reserved")
    """Ray memory reserved per rank (0 = none reserved)."""
    resources: Table = setting(default_factory=dict, fix="e.g. {learner_node = 1}")
    """Custom Ray resources per rank, to pin it to node types started with `ray start --resources '{"NAME": N}'`,
    e.g. {learner_node = 1}."""
    node_labels: Table = setting(default_factory=dict, fix="e.g. {pool = \"spot\"}")
    """Labels its node must carry (`ray start --labels`)."""
    placement_strategy: choice(STRATEGIES) = "PACK"
    """How the ranks' placement group spreads them: PACK (few nodes), SPREAD, STRICT_PACK (one node),
    STRICT_SPREAD (one rank per node). All ranks are placed together or not at all."""
    threads: Int = setting(0, ge=0, why="0 = automatic")
    """0 = all cores locally; on a cluster, the CPUs each rank was given (num_cpus)."""
    mode: choice(LEARNER_MODES) = "full"
    """"full": every weight trains (bf16 weights, fp32 masters in the optimizer). "lora": a frozen bf16 base plus
    trainable adapters ([learner.lora]). "qlora": the frozen base in bitsandbytes NF4 (double quantization, bf16
    compute) plus adapters. Generators always receive the merged weights and quantize them as usual."""
    lora: LoraConfig = setting(default_factory=LoraConfig)
    """[learner.lora]: read when mode is lora or qlora."""
    optimizer: choice(OPTIMIZERS) = "adamw"
    """"adamw" (torch) or "adamw8bit" (bitsandbytes: 8-bit moments, ~4x less state)."""
    gradient_checkpointing: Bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them (less memory, ~1 more
    forward). Needs shared_prompt = false: checkpointed layers drop the KV cache the shared-prompt forward passes
    along."""


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
