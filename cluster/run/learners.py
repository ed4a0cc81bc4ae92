"""The learner ranks of a job: their settings, read from the run's config in this one place, and their start (one
placement group, one Ray actor per rank, joined into one process group)."""
from __future__ import annotations

import dataclasses
import os

from qgrpo.actors.common import thread_env
from qgrpo.actors.learner_actor import start_learners
from qgrpo.cluster.config.plan import RoleRequest
from qgrpo.cluster.config.schema import Config
from qgrpo.cluster.run.placement import learner_group, wait_scheduled
from qgrpo.core import storage
from qgrpo.core.devices import role_env
from qgrpo.learner.objective.settings import objective_settings
from qgrpo.learner.settings import LearnerSettings
from qgrpo.rollout.backends import REGISTRY, served_grid


def learner_settings(cfg: Config) -> LearnerSettings:
    """What every learner rank is built with (learner/settings.py), from the [learner], [algo], [guard] and
    [reference] sections; a step's batch is split evenly over the ranks."""
    le, algo, ro = cfg.learner, cfg.algo, cfg.rollout
    batch = ro.prompts_per_step * ro.group_size
    return LearnerSettings(
        world_size=le.world_size, zero_stage=le.zero_stage, micro_batch_per_rank=le.micro_batch_per_rank,
        sequences_per_rank=-(-batch // le.world_size), seed=cfg.run.seed,
        optimizer=le.optimizer, lr=le.lr, weight_decay=le.weight_decay, betas=(le.beta1, le.beta2),
        grad_clip=le.grad_clip, warmup_steps=le.warmup_steps, lr_schedule=le.lr_schedule,
        total_updates=cfg.run.steps * algo.updates_per_batch,
        objective=objective_settings(**dataclasses.asdict(algo)), temperature=ro.temperature,
        shared_prompt=le.shared_prompt,
        guard=cfg.guard.enabled, max_mismatch_kl=cfg.guard.max_mismatch_kl,
        mode=le.mode, attention=le.attention, compute_dtype=cfg.compute_dtype_of("learner"),
        gradient_checkpointing=le.gradient_checkpointing,
        lora=dict(rank=le.lora.rank, alpha=le.lora.alpha, dropout=le.lora.dropout,
                  target_modules=list(le.lora.target_modules)),
        reference_from_learner=cfg.reference.from_learner,
        fake_quant_grid=served_grid(ro.backend, ro.precision, ro.group_size_quant) if le.fake_quant == "rollout"
        else None, fake_quant_head=REGISTRY[ro.backend].fake_quant_head,
        fake_quant_tied_head=REGISTRY[ro.backend].quantizes_tied_head(ro),
    )


def start_learner_ranks(cfg: Config, model_path: str, request: RoleRequest, cores: int, wait: str = "passive") -> tuple:
    """Place the ranks together (one placement group, one bundle per rank: all placed or none, within the
    scheduling deadline), then start them. Returns (placement group, rank actors, refs of their `setup` calls).
    `cores`: the machine's cores when the ranks share the driver's machine (threads split them), else 0. `wait`: the
    ranks' OpenMP wait (cluster/run/cpu_waits.py)."""
    le = cfg.learner
    threads = le.threads or max(0, cores // le.world_size)
    # A CPU learner is forced to DeepSpeed's CPU accelerator: on a Mac DeepSpeed would otherwise pick its new MPS
    # accelerator by itself, which we have not been able to test. With GPUs DeepSpeed picks CUDA (NCCL).
    env = {**thread_env(threads, wait), **role_env(le.num_gpus)}
    if not le.num_gpus:
        env["DS_ACCELERATOR"] = os.environ.get("DS_ACCELERATOR", "cpu")
    ext_dir = str(storage.cache_root() / "torch_extensions")  # DeepSpeed's JIT-built ops: ours, not ~/.cache
    group = learner_group(request)
    wait_scheduled({group.ready(): f"the learner ({request.count} x {request.describe()})"},
                   cfg.faults.schedule_timeout_s, "placing the learner ranks")
    options = [{**request.actor_options(group, r), "runtime_env": {"env_vars": env}} for r in range(le.world_size)]
    actors, setups = start_learners(model_path, learner_settings(cfg), threads, ext_dir, options)
    return group, actors, setups
