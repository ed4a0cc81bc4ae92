"""The policy under DeepSpeed: GRPO updates, weight export, checkpoints. It computes in bf16 where the rank's device
does so natively, else in fp32 (model.compute_dtype, core/cpu.py); the weights it streams and saves are bf16 either way.

A plain object: the Ray actor in actors/learner_actor.py sets the process-group environment and wraps it, and a
unit test can build it in-process with world_size 1.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Iterator

import torch

from qgrpo.core import faults
from qgrpo.core.cpu import compute_dtype, torch_dtype
from qgrpo.core.devices import bind, collective_device, current_device, dist_backend
from qgrpo.core.records import TrainStepResult
from qgrpo.core.scoring import token_logprobs
from qgrpo.learner.adapters import adapter_weights, merged_weights, save_adapters, unwrap
from qgrpo.learner.batch import TrainBatch, staleness
from qgrpo.learner.objective.loss import aggregation_weights, grpo_loss, merge_stats
from qgrpo.learner.optim import GuardedLambdaLR, guarded_optimizer, lr_factor
from qgrpo.learner.settings import LearnerSettings

# DeepSpeed's ZeRO optimizer states hold these plain-data objects besides tensors; nothing else is unpickled.
_SAFE_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.zero.config.ZeroStageEnum",
                 "deepspeed.utils.tensor_fragment.fragment_address")


def _safe_checkpoint_engine():
    """DeepSpeed's checkpoint engine with `torch.load(weights_only=True)`: a checkpoint folder from elsewhere cannot run
    code when a run resumes from it (DeepSpeed's own engine unpickles arbitrary objects)."""
    import importlib

    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    allowed = [getattr(importlib.import_module(m), a) for m, _, a in (g.rpartition(".") for g in _SAFE_GLOBALS)]

    class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location=map_location, weights_only=True)

    return WeightsOnlyCheckpointEngine()


def _init_distributed(device: torch.device) -> None:
    """The ranks' process group: NCCL when they train on GPUs, gloo on CPUs (from the device, not from whether the
    node has a GPU: a CPU learner on a GPU node is a gloo learner)."""
    import deepspeed

    if device.type == "cpu":
        # On CPU DeepSpeed JIT-compiles a shared-memory all-reduce op (~2 min here) that serves only its inference
        # all-reduce; training collectives go through torch.distributed (gloo). Skip the build.
        # (`deepspeed.comm.torch` as an attribute is the torch module, hence sys.modules.)
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend=dist_backend(device))


def auto_attention(device: torch.device, dtype: str) -> str:
    """learner.attention = "auto": SDPA on a GPU and on a CPU learner computing in fp32; eager on a CPU learner in
    bf16. Measured with bench/learner_profile.py on 2-core CPUs: in fp32, SDPA ran the TRL comparison's step 8% faster
    than eager (the default job's batch: equal without gradient checkpointing, 4.5% faster with it) and held 1.2 GB
    less; in bf16 emulated by a CPU without native bf16, eager's step was 1.1-1.5x faster."""
    return "sdpa" if device.type == "cuda" or dtype == "fp32" else "eager"


class Learner:
    def __init__(self, model_path: str, settings: LearnerSettings | None = None,
                 device: torch.device | str | None = None):
        """`settings`: learner/settings.py (one record, filled from the run's config by the cluster layer; None: its
        defaults).
        `device`: where this rank trains (default: the GPU Ray assigned it, else the CPU: core/devices.py); every
        tensor the learner makes (batch, probe, guard flags) goes there."""
        import deepspeed

        from qgrpo.core import kv_replay
        from qgrpo.learner.adapters import load_model
        from qgrpo.learner.fake_quant import fake_quant_layers

        s = settings if settings is not None else LearnerSettings()
        self.device = bind(torch.device(device) if device is not None else current_device("learner rank"))
        if self.device.type == "cpu":
            # DeepSpeed picks its accelerator by itself (CUDA wherever torch sees a GPU, MPS on a Mac); the CPU rank
            # of a GPU node must not get CUDA's (the actor sees no GPU, but a learner built in-process may).
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        _init_distributed(self.device)
        torch.manual_seed(s.seed)
        self.model_path, self.settings, self.guard = model_path, s, s.guard
        # What train_step reads, as attributes a test (or a later step) may adjust on a built learner.
        self.world_size, self.zero_stage, self.micro_batch, self.mode = (s.world_size, s.zero_stage,
                                                                          s.micro_batch_per_rank, s.mode)
        self.objective, self.temperature, self.shared_prompt = s.objective, s.temperature, s.shared_prompt
        self.reference_from_learner = s.reference_from_learner and s.mode != "full" and s.objective.kl_coeff > 0
        self.max_mismatch_kl = s.max_mismatch_kl  # skip the update when mismatch/kl_mu_old exceeds it (0 = no bound)
        self.version = 0  # policy version = optimizer updates applied; generators record the version they sampled with

        self.compute_dtype, self.compute_why = compute_dtype(s.compute_dtype, self.device)
        attention = s.attention if s.attention != "auto" else auto_attention(self.device, self.compute_dtype)
        model = load_model(model_path, s.mode, lora=s.lora, attention=attention,
                           gradient_checkpointing=s.gradient_checkpointing, device=self.device,
                           dtype=torch_dtype(self.compute_dtype))
        if s.gradient_checkpointing and s.shared_prompt:  # the prompt cache survives the layers' replay
            kv_replay.keep_cache_under_checkpointing(model)
        if s.fake_quant_grid is not None:  # learner.fake_quant = "rollout": the generators' rounding in the forward
            fake_quant_layers(model, s.fake_quant_grid, s.fake_quant_head, s.fake_quant_tied_head)
        # Our own optimizer object: DeepSpeed's "AdamW" config type silently becomes its CPU Adam, a ~150 s JIT build.
        # Only trainable tensors reach it (the adapters in lora/qlora).
        # An fp32 learner keeps bf16 weights over fp32 masters, as DeepSpeed's bf16 mode does (learner/optim.py).
        self.inner_optimizer = guarded_optimizer(s.optimizer, [p for p in model.parameters() if p.requires_grad],
                                                 round_weights=self.compute_dtype == "fp32", lr=s.lr, betas=s.betas,
                                                 weight_decay=s.weight_decay)
        scheduler = GuardedLambdaLR(self.inner_optimizer,
                                    lambda u: lr_factor(u, s.warmup_steps, s.lr_schedule, s.total_updates))
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=self.inner_optimizer, lr_scheduler=scheduler, config=s.deepspeed_config(
                self.compute_dtype))
        self.engine.checkpoint_engine = _safe_checkpoint_engine()
        if s.world_size == 1 and not s.zero_stage:
            # One rank has nothing to average: DeepSpeed would still flatten every gradient into a buffer, all-reduce
            # it over a group of one and copy it back, each step. (ZeRO's reduction also fills its partitions: kept.)
            self.engine.enable_backward_allreduce = False
        if torch.device(self.engine.device).type != self.device.type:  # DeepSpeed chose another accelerator
            raise RuntimeError(f"learner: DeepSpeed placed the model on {self.engine.device}, the rank's device is "
                               f"{self.device}; unset DS_ACCELERATOR or set it to {self.device.type}")

    # ---------------------------------------------------------------- training

    def _logprobs(self, mb: TrainBatch, with_entropy: bool = False):
        """Policy log-probs [B, T]; with `shared_prompt` each distinct prompt of the micro-batch is run once.
        `with_entropy`: (log-probs, per-token entropy of softmax(logits / temperature)), both [B, T]."""
        if self.shared_prompt and mb.prompt_lens is not None:
            return token_logprobs(self.engine, mb.input_ids, self.temperature, mb.prompt_lens, mb.group_ids,
                                  with_entropy=with_entropy, seq_lens=mb.seq_lens)
        return token_logprobs(self.engine, mb.input_ids, self.temperature, with_entropy=with_entropy)

    def _micro_batches(self, batch: TrainBatch) -> list[TrainBatch]:
        n = len(batch)
        return [batch.select(slice(i, i + self.micro_batch)) for i in range(0, n, self.micro_batch)]

    def train_step(self, batch: TrainBatch, step: int = 0) -> TrainStepResult:
        """One batch (this rank's shard) -> `updates_per_batch` optimizer updates. The statistics are sums, to be
        added across ranks by the caller, then turned into means by learner.objective.loss.finalize_stats.
        With the guard on, an update whose inputs, loss or gradients are not finite, or whose sampler mismatch is
        above `max_mismatch_kl`, is skipped on every rank; `skipped` names why ("" when every update was taken)."""
        self.engine.train()
        version_before = self.version
        batch = batch.to(self.device)  # DeepSpeed moves the model, never the inputs
        micro = self._micro_batches(batch)
        old: list[torch.Tensor] | None = None
        if self.objective.updates_per_batch > 1:
            # pi_old = the BF16 policy as the batch arrives, before any update on it.
            with torch.no_grad():
                old = [self._logprobs(mb) for mb in micro]
        # Rank first: a one-shot fault is claimed by whichever process asks first, so other ranks must not ask.
        nan_loss = self._rank() == 0 and faults.fires("learner.nan_loss", step)
        stats_acc: dict = {}
        loss_total, grad_norms, skipped = 0.0, [], ""
        clock = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}  # seconds, for time/learn_* in the metrics
        for update in range(self.objective.updates_per_batch):
            checks = torch.zeros(5, dtype=torch.float64)  # sampler, reference, loss non-finite; mismatch sum, tokens
            for i, mb in enumerate(micro):
                t = time.perf_counter()
                if self.reference_from_learner:
                    mb = self._with_base_reference(mb)
                # The entropy is logged every step, and read by the loss for its bonus or top-entropy mask.
                logp, entropy = self._logprobs(mb, with_entropy=True)
                # With one update per batch pi_theta == pi_old at this point, so pi_old needs no extra forward.
                old_logp = logp.detach() if old is None else old[i]
                weights = aggregation_weights(
                    mb.completion_mask, self.objective.loss_agg, num_sequences=batch.total_sequences,
                    num_tokens=batch.total_tokens, max_len=batch.max_new_tokens,
                )
                loss, stats = grpo_loss(logp, old_logp, mb.mu_logp, mb.ref_logp, mb.advantages, mb.completion_mask,
                                        weights, self.objective,
                                        entropy=entropy if self.objective.needs_entropy else entropy.detach())
                if nan_loss:
                    loss = loss * float("nan")
                checks += self._checks(mb, loss, stats)
                t = _lap(clock, "forward", t)
                # Each rank's loss is its share of the global sum; DeepSpeed averages gradients over ranks, so scale
                # back up. scale_wrt_gas=False: the weights already normalise over the whole batch.
                self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
                t = _lap(clock, "backward", t)
                if i == len(micro) - 1:  # the accumulation boundary: decide together, then step (or not)
                    opt = self.inner_optimizer
                    # DeepSpeed's bf16 wrapper skips the inner step by itself on a non-finite gradient norm.
                    opt.veto, opt.applied = self._veto(checks), False
                    opt.reason = opt.veto or "grad_norm"
                    # DeepSpeed's fp32 path at ZeRO-0 would clip tensor by tensor without keeping the norm: the
                    # learner clips there itself, in one foreach pass that gives the norm (settings.deepspeed_config).
                    norm = _clip(self.engine.module, self.settings.grad_clip) \
                        if self.compute_dtype == "fp32" and not self.zero_stage else None
                self.engine.step()
                _lap(clock, "optimizer", t)
                loss_total += loss.detach().item()
                # Over every pass: the clip only acts from the second update on (the first has ratio 1 exactly).
                stats_acc = merge_stats(stats_acc, stats)
            self.inner_optimizer.veto = ""
            gn = self.engine.get_global_grad_norm()
            gn = gn if gn is not None else norm
            grad_norms.append(float(gn) if gn is not None else float("nan"))
            if not self.inner_optimizer.applied:
                skipped = self.inner_optimizer.reason
                break
            self.version += 1
        return TrainStepResult(
            stats={k: float(v) for k, v in stats_acc.items()}, loss=loss_total / (update + 1),
            grad_norm=grad_norms[-1], lr=self.scheduler.get_last_lr()[0], policy_version=self.version,
            version_before=version_before,
            staleness=staleness(batch, version_before), timing=clock, skipped=skipped,
        )

    @torch.no_grad()
    def _with_base_reference(self, mb: TrainBatch) -> TrainBatch:
        """The micro-batch with reference log-probs from the frozen base: the learner's own model, adapters off."""
        with self.engine.module.disable_adapter():
            return mb.with_ref(self._logprobs(mb))

    @staticmethod
    def _checks(mb: TrainBatch, loss: torch.Tensor, stats: dict) -> torch.Tensor:
        m = mb.completion_mask > 0
        ref_bad = mb.ref_logp is not None and not torch.isfinite(mb.ref_logp[m]).all()
        # Plain host numbers: summed on the host over micro-batches, all-reduced on the group's device (`_veto`).
        return torch.tensor([float(not torch.isfinite(mb.mu_logp[m]).all()), float(ref_bad),
                             float(not torch.isfinite(loss)), float(stats["kl_mu_old_sum"]), float(stats["tokens"])],
                            dtype=torch.float64)

    def _veto(self, checks: torch.Tensor) -> str:
        """The reason to skip this update, the same on every rank (the checks are summed over ranks first)."""
        self.inner_optimizer.enabled = self.guard
        if not self.guard:
            return ""
        if torch.distributed.is_initialized():
            checks = checks.to(collective_device())  # NCCL serves only CUDA tensors
            torch.distributed.all_reduce(checks)
        sampler, reference, loss, kl_sum, tokens = checks.tolist()
        kl = kl_sum / max(tokens, 1.0)
        if sampler:
            return "sampler_logprobs"
        if reference:
            return "reference_logprobs"
        if loss:
            return "loss"
        if kl != kl or (self.max_mismatch_kl > 0 and kl > self.max_mismatch_kl):
            return "mismatch"
        return ""

    @staticmethod
    def _rank() -> int:
        return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    # ---------------------------------------------------------------- weights and checkpoints

    @torch.no_grad()
    def score(self, token_ids: list[int]) -> list[float]:
        """Log-probs (temperature 1) of tokens 1.. of one sequence under the current policy; a forward, so under
        ZeRO-3 every rank must call it."""
        was_training = self.engine.module.training
        self.engine.module.eval()
        lp = token_logprobs(self.engine.module, torch.tensor([token_ids], device=self.device))[0, 1:].float().tolist()
        self.engine.module.train(was_training)
        return lp

    def named_weights(self, bucket_bytes: int = 64 << 20) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, bf16 tensor) for every parameter, HF names. Under ZeRO-3 every rank must iterate: parameters are
        gathered a bucket of about `bucket_bytes` at a time (one collective per bucket, not per parameter; at most
        one bucket of full tensors held at once besides the shards), and tensors are full on every rank."""
        import deepspeed

        if self.mode != "full":  # base + adapters merged layer by layer (no ZeRO-3 in these modes: config.py)
            yield from merged_weights(self.engine.module)
            return
        params = list(self.engine.module.named_parameters())
        if self.zero_stage != 3:
            for name, p in params:
                yield name, p.detach().to(torch.bfloat16)
            return
        for bucket in _buckets(params, bucket_bytes):
            with deepspeed.zero.GatheredParameters([p for _, p in bucket]):
                full = [(name, p.data.detach().to(torch.bfloat16).clone()) for name, p in bucket]
            yield from full

    def adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, bf16 tensor) of the adapters alone (learner/adapters.py: adapter_weights), for sync.adapters_only:
        the generators keep the frozen base they started from."""
        if self.mode == "full":
            raise ValueError("adapters-only weights need learner.mode = \"lora\" or \"qlora\", got \"full\"")
        return adapter_weights(self.engine.module)

    def save(self, out_dir: str | Path, rank: int = 0) -> None:
        """HF folder (model.safetensors + config + tokenizer) written by rank 0, and DeepSpeed's optimizer state
        under optimizer/ (every rank writes its own shard)."""
        out = Path(out_dir)
        adapters = self.mode != "full"
        state = {} if adapters else dict(self.named_weights())
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            if adapters:  # peft's folder (the adapters alone) beside the base's config: `qgrpo merge` makes a model
                save_adapters(self.engine.module, out)
                config = unwrap(self.engine.module).config.to_dict()
                config.pop("quantization_config", None)  # the base as model.path holds it (bf16), not as QLoRA loads it
                (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
            else:  # bf16 tensors, and a config that says so, whatever the learner computes in
                self.engine.module.save_pretrained(out, state_dict=state, safe_serialization=True)
                saved = json.loads((out / "config.json").read_text())
                (out / "config.json").write_text(json.dumps({**saved, "dtype": "bfloat16"}, indent=2, sort_keys=True))
            _copy_tokenizer(self.model_path, out)
        # Adapter modes keep the frozen base out of DeepSpeed's state: it is model.path, loaded again on resume.
        self.engine.save_checkpoint(str(out / "optimizer"), tag="state", save_latest=False,
                                    exclude_frozen_parameters=adapters)

    def load(self, ckpt_dir: str | Path, version: int) -> None:
        # Adapter modes: the checkpoint has the trainable tensors only (the base's NF4 quantization state is
        # recomputed from model.path); anything else missing would have been refused before (check_same_model).
        path, _ = self.engine.load_checkpoint(str(Path(ckpt_dir) / "optimizer"), tag="state",
                                              load_module_strict=self.mode == "full")
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed optimizer state under {ckpt_dir}/optimizer")
        self.version = version


def _clip(module, max_norm: float) -> float:
    """Clip the gradients to a global norm of `max_norm` (0: no clipping); their norm before clipping."""
    params = [p for p in module.parameters() if p.grad is not None]
    if not params:
        return 0.0
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True))
    return float(torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True))


def _lap(clock: dict, stage: str, since: float) -> float:
    now = time.perf_counter()
    clock[stage] += now - since
    return now


def _buckets(params: list, bucket_bytes: int) -> Iterator[list]:
    """Consecutive groups of ZeRO-3 parameters of about `bucket_bytes` (full bf16 size, `ds_numel`) each."""
    bucket, size = [], 0
    for name, p in params:
        n = getattr(p, "ds_numel", p.numel()) * 2
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, p))
        size += n
    if bucket:
        yield bucket


def _copy_tokenizer(src: str, dst: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                 "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json"):
        f = Path(src) / name
        if f.is_file() and not (dst / name).exists():
            shutil.copy2(f, dst / name)
