"""What one learner rank is built with: a plain record, filled from the run's config in one place
(cluster/run/learners.py) and pickled to every rank's actor. The learner layer knows nothing of the config."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from qgrpo.core.grids import Grid
from qgrpo.learner.objective.settings import ObjectiveSettings


@dataclass
class LearnerSettings:
    # The DeepSpeed job
    world_size: int = 1  # ranks in the learner's process group
    zero_stage: int = 0  # DeepSpeed ZeRO stage 0-3
    micro_batch_per_rank: int = 64  # sequences per forward/backward on one rank (one DeepSpeed micro-step)
    sequences_per_rank: int = 64  # sequences of one step's batch per rank; gradients accumulate over its micro-batches
    seed: int = 0  # torch's seed on every rank (adapter initialisation)
    # The optimizer and its schedule
    optimizer: str = "adamw"  # "adamw" (torch) or "adamw8bit" (bitsandbytes), both with the guard
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0  # max global gradient norm (0 = off)
    warmup_steps: int = 0  # optimizer updates of the linear warm-up
    lr_schedule: str = "constant"  # "constant" or "cosine" (optim.lr_factor)
    total_updates: int = 0  # optimizer updates of the whole run: where the cosine schedule reaches 0
    # The GRPO update
    # What is optimised: [algo] as the objective's record (learner/objective/settings.py): the policy loss and its
    # parameters, the KL, the sampler correction, the aggregation (loss_agg) and the updates per batch
    objective: ObjectiveSettings = field(default_factory=ObjectiveSettings)
    temperature: float = 1.0  # log-probs are those of softmax(logits / temperature), as the generators sample
    shared_prompt: bool = True  # each distinct prompt of a micro-batch runs once, its KV cache shared
    # The precision guard
    guard: bool = True  # skip an update whose inputs, loss or gradients are not finite
    max_mismatch_kl: float = 0.0  # ... or whose mismatch/kl_mu_old is above this (0 = no bound)
    # The model (learner/adapters.py)
    mode: str = "full"  # "full" | "lora" | "qlora"
    lora: dict | None = None  # rank, alpha, dropout, target_modules: the adapters of lora/qlora
    attention: str = "auto"  # transformers' attn_implementation; "auto": engine.auto_attention
    # model.compute_dtype: "auto" (bf16 where the rank's device computes it natively, else fp32: core/cpu.py), "bf16"
    # or "fp32". The weights the learner streams and saves are bf16 either way.
    compute_dtype: str = "auto"
    gradient_checkpointing: bool = False
    # lora/qlora with a KL term: the reference log-probs are the learner's own base with its adapters off
    reference_from_learner: bool = False
    # learner.fake_quant = "rollout" (learner/fake_quant.py): the generators' grid, and whether they quantize an
    # untied output head; None: the learner computes with its bf16 weights
    fake_quant_grid: Grid | None = None
    fake_quant_head: bool = False
    fake_quant_tied_head: bool = False  # ... and a head tied to the embedding ([rollout.torch] quantize_head)

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer update on each rank."""
        return math.ceil(self.sequences_per_rank / self.micro_batch_per_rank)

    def deepspeed_config(self, dtype: str = "bf16") -> dict:
        """DeepSpeed's config: every micro-batch is one micro-step, the optimizer steps at the accumulation
        boundary. The optimizer and scheduler are the learner's own objects, not named here. `dtype`: the resolved
        compute dtype, "bf16" (bf16 weights and activations, fp32 masters in the optimizer) or "fp32" (fp32
        throughout)."""
        return {
            "train_micro_batch_size_per_gpu": self.micro_batch_per_rank,
            "gradient_accumulation_steps": self.grad_accum,
            "train_batch_size": self.micro_batch_per_rank * self.grad_accum * self.world_size,
            "bf16": {"enabled": dtype == "bf16"},
            "zero_optimization": {"stage": self.zero_stage},
            "zero_allow_untested_optimizer": True,  # GuardedAdamW: torch's AdamW plus a veto (ZeRO checks the type)
            # fp32 at ZeRO-0: the learner clips itself (learner/engine.py: _clip), in one pass that keeps the norm
            "gradient_clipping": 0.0 if dtype == "fp32" and not self.zero_stage else self.grad_clip,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
