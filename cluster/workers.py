"""The actors of one job and the few operations the driver needs from them. Knows nothing of any backend: the
rollout backend is a name and a dict of arguments handed to the rollout actors."""
from __future__ import annotations

import os
import socket
from pathlib import Path

import ray
import torch

from actors.common import thread_env
from actors.learner_actor import LearnerActor
from actors.reference_actor import ReferenceActor
from actors.rollout_actor import RolloutActor
from actors.weights import wait_all
from cluster.config import Config
from learner.batch import TrainBatch
from learner.loss import GRPOLossConfig
from rollout.backends import backend_options
from core.records import GenerationStats, GroupRollout, PromptItem, SamplingParams


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _split(items: list, n: int) -> list[list]:
    """Near-equal contiguous chunks (whole prompts, so a group never spans generators)."""
    k, r = divmod(len(items), n)
    out, i = [], 0
    for a in range(n):
        j = i + k + (a < r)
        out.append(items[i:j])
        i = j
    return out


class Workers:
    def __init__(self, cfg: Config, policy_path: str, reference_path: str, policy_version: int = 0):
        cores = os.cpu_count() or 1
        ro, le, ref = cfg.rollout, cfg.learner, cfg.reference
        self.cfg = cfg
        r_threads = ro.threads or max(1, cores // ro.num_actors)
        self.rollout = [
            RolloutActor.options(num_cpus=ro.num_cpus, num_gpus=ro.num_gpus,
                                 runtime_env={"env_vars": thread_env(r_threads)}).remote(
                ro.backend,
                dict(model_path=policy_path, precision=ro.precision, group_size_quant=ro.group_size_quant,
                     generator_id=f"{ro.backend}-{i}", seed=cfg.run.seed,
                     initial_version=policy_version, chat_template=cfg.task.chat_template,
                     **backend_options(ro.backend, ro)),
                r_threads,
            )
            for i in range(ro.num_actors)
        ]
        self.reference = None
        if cfg.algo.kl_coeff > 0:
            f_threads = ref.threads or cores
            self.reference = ReferenceActor.options(
                num_cpus=ref.num_cpus, runtime_env={"env_vars": thread_env(f_threads)}
            ).remote(reference_path, ref.precision, ro.group_size_quant, f_threads)
        batch = ro.prompts_per_step * ro.group_size
        l_threads = le.threads or max(1, cores // le.world_size)
        learner_kwargs = dict(
            model_path=policy_path, zero_stage=le.zero_stage, lr=le.lr, weight_decay=le.weight_decay,
            betas=(le.beta1, le.beta2), grad_clip=le.grad_clip, warmup_steps=le.warmup_steps,
            micro_batch_per_rank=le.micro_batch_per_rank, sequences_per_rank=-(-batch // le.world_size),
            loss_cfg=GRPOLossConfig(clip_low=cfg.algo.clip_low, clip_high=cfg.algo.clip_high,
                                    kl_coeff=cfg.algo.kl_coeff, kl_estimator=cfg.algo.kl_estimator,
                                    is_mode=cfg.algo.is_mode, is_cap=cfg.algo.is_cap),
            loss_agg=cfg.algo.loss_agg, temperature=ro.temperature, updates_per_batch=cfg.algo.updates_per_batch,
            shared_prompt=le.shared_prompt,
            seed=cfg.run.seed,
        )
        port = _free_port()
        ext_dir = str(Path(os.environ.get("QGRPO_CACHE", Path.home() / ".cache" / "qgrpo")) / "torch_extensions")
        self.learners = [
            LearnerActor.options(num_cpus=le.num_cpus, runtime_env={"env_vars": thread_env(l_threads)}).remote(
                rank, le.world_size, "127.0.0.1", port, learner_kwargs, l_threads, ext_dir)
            for rank in range(le.world_size)
        ]
        # Surface construction errors (bad model folder, DeepSpeed failure) here rather than at the first step.
        ray.get([a.info.remote() for a in self.rollout] + [a.version.remote() for a in self.learners])

    # ------------------------------------------------------------------ the driver's operations

    def generate(self, items: list[PromptItem], sampling: SamplingParams
                 ) -> tuple[list[GroupRollout], list[GenerationStats]]:
        chunks = _split(items, len(self.rollout))
        futures = [a.generate.remote(c, sampling) for a, c in zip(self.rollout, chunks) if c]
        groups, stats = [], []
        for g, s in ray.get(futures):
            groups += g
            stats.append(s)
        return groups, stats

    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        shared = self.cfg.learner.shared_prompt
        return ray.get(self.reference.score.remote(batch.input_ids, self.cfg.rollout.temperature,
                                                   batch.prompt_lens if shared else None,
                                                   batch.group_ids if shared else None))

    def train(self, batch: TrainBatch) -> list[dict]:
        n = len(self.learners)
        return ray.get([a.train_step.remote(batch.shard(r, n)) for r, a in enumerate(self.learners)])

    def sync_weights(self) -> dict:
        """One versioned transfer from learner rank 0 to every rollout actor, with a deadline."""
        timeout = self.cfg.sync.timeout_s
        bucket_bytes = int(self.cfg.sync.bucket_mb * 2**20)
        updates = wait_all([a.publish_weights.remote(bucket_bytes) for a in self.learners], timeout, "weight export")
        update = updates[0]
        acks = wait_all([a.load_weights.remote(update) for a in self.rollout], timeout, "weight sync")
        bad = [a for a in acks if a["version"] != update.version]
        if bad:
            raise RuntimeError(f"rollout actors report versions {bad} after syncing version {update.version}")
        return {"version": update.version, "nbytes": update.nbytes, "buckets": len(update.buckets),
                "load_seconds_max": max(a["seconds"] for a in acks),
                "fingerprint_gap_max": max(a["fingerprint_gap"] for a in acks),
                "fingerprint_corr_min": min(a["fingerprint_corr"] for a in acks)}

    def rollout_info(self) -> list[dict]:
        return ray.get([a.info.remote() for a in self.rollout])

    def save(self, out_dir: str) -> None:
        ray.get([a.save.remote(out_dir) for a in self.learners])

    def load(self, ckpt_dir: str, version: int) -> None:
        ray.get([a.load.remote(ckpt_dir, version) for a in self.learners])

    def shutdown(self) -> None:
        for a in self.rollout + self.learners + ([self.reference] if self.reference else []):
            ray.kill(a)
