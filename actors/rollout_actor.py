"""Ray actor hosting one generator (any backend) behind the generator base class (rollout/backends: Generator): what
a backend may lack (emulated grids, adapters, timing its re-quantization, a close) has a default there, so the actor
asks and never probes.

Weight loads run in a concurrency group of their own ("sync"), beside a generation call in flight: the buckets are
fetched at once and the load is applied between two decode steps of that call, or at its end, by the update gate
(actors/update_gate.py)."""
from __future__ import annotations

import math
import os
import signal
import time

import ray

from qgrpo.actors.collective import CollectiveMember
from qgrpo.actors.common import apply_threads, local_model, resolve_threads
from qgrpo.actors.update_gate import UpdateGate
from qgrpo.actors.weights import Bucket, ObjectStoreTransport, WeightUpdate, unpack_buckets
from qgrpo.core import faults
from qgrpo.core.cpu import current_wait
from qgrpo.core.records import GenerationStats, GroupRollout, PromptItem, SamplingParams, SyncAck
from qgrpo.rollout.backends import REGISTRY, make_generator
from qgrpo.rollout.backends.common import WeightFingerprintError, check_fingerprint, hf_tensors
from qgrpo.rollout.episodes import Episodes, EpisodeSetup, tools_for
from qgrpo.rollout.noise import NormNoise
from qgrpo.rollout.quantization.requantize import VISIBILITY_ROW_STRIDE, Requantizer


class _RolloutActor(CollectiveMember):
    def __init__(self, backend: str, generator_kwargs: dict, threads: int, update: WeightUpdate | None = None,
                 requantize: str = "nearest", visibility: bool = True, noise: NormNoise | None = None,
                 episodes: EpisodeSetup | None = None):
        """`update`: the last published weights, for an actor that replaces a lost one or moves up the precision
        ladder; it loads them (and passes the fingerprint check) before it serves anything, or fails to start.
        `requantize`, `visibility`: sync.requantize and sync.visibility (rollout/quantization/requantize.py); `noise`:
        the exploration noise added to the norm weights at each sync (rollout.norm_noise, rollout/noise.py); `episodes`:
        the [environment] of multi-turn rollouts (rollout/episodes.py), whose workers this actor starts and owns."""
        apply_threads(resolve_threads(threads))
        # A builtin model is built on this node; a checkpoint given as a URI (a resume) is read from this node's copy
        # of its model files.
        model_path = local_model(generator_kwargs["model_path"], skip=("optimizer",))
        # MLX's arrays stay on the thread that made them: the gate's home thread builds, loads and runs its generator
        self.gate = UpdateGate(home=REGISTRY[backend].one_thread)
        self.gen = self.gate.run(lambda: make_generator(backend, **{**generator_kwargs, "model_path": model_path}))
        self.requant = self.gate.run(lambda: self._requantizer(model_path, requantize, visibility))
        self.noise = noise if noise is not None and noise.start > 0 else None
        self.episodes = self._episodes(episodes) if episodes is not None else None
        self.calls = 0
        self.gate.attach(self.gen)
        self.last_ack = self.load_weights(update) if update is not None else None

    def _episodes(self, setup: EpisodeSetup) -> Episodes:
        """The episode loop of this actor's generator, its environment workers started (and waited for)."""
        from qgrpo.actors.env_worker import EnvClient
        from qgrpo.rollout.environments.loader import environment_tools, factory_of

        tools = environment_tools(factory_of(setup.spec))
        chat = self.gen.chat_template and bool(self.gen.tokenizer.chat_template)
        schemas, text = tools_for(self.gen.tokenizer, tools if chat else [])
        if tools and not chat:  # plain text: the tools described in the first message
            from qgrpo.rollout.environments.tools import tools_prompt

            text = tools_prompt(tools)
        client = EnvClient(setup.spec, setup.timeout_s, num_workers=setup.num_workers, num_cpus=setup.num_cpus)
        client.wait_ready()
        return Episodes(self.gen, self.gen.tokenizer, self.gen.stop_ids, client, setup.limits, schemas, text, chat)

    def _requantizer(self, model_path: str, mode: str, visibility: bool) -> Requantizer | None:
        """The requantizer of this generator's grid, its state started from the weights the generator loaded; None
        when the weights are handed over as received and nothing is measured: at nearest without visibility, and
        where the format has no emulated grid (bf16 after the precision ladder's last rung; the config refuses the
        other modes for such a format at the start)."""
        grids = self.gen.quant_grids()
        if not grids or (mode == "nearest" and not visibility):
            return None
        return Requantizer(mode, grids, hf_tensors(model_path, grids), row_stride=VISIBILITY_ROW_STRIDE)

    def generate(self, items: list[PromptItem], sampling: SamplingParams, step: int = 0
                 ) -> tuple[list[GroupRollout], GenerationStats]:
        """The groups of `items`, sampled under the gate: a weight load that arrives meanwhile is applied between
        two decode steps (or after the call), and GenerationStats.policy_version is the version the call began with
        (Completion.token_versions say where tokens were sampled by a later one)."""
        return self.gate.call(lambda: self._generate(items, sampling, step))

    def _generate(self, items: list[PromptItem], sampling: SamplingParams, step: int
                  ) -> tuple[list[GroupRollout], GenerationStats]:
        t0, version = time.perf_counter(), self.gen.policy_version
        if faults.fires("rollout.kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if faults.fires("rollout.hang", step):
            time.sleep(10**6)
        self.gate.delay = faults.SLOW_DECODE_SECONDS if faults.fires("rollout.slow_decode", step) else 0.0
        env0 = self.episodes.env_seconds if self.episodes is not None else 0.0
        if self.episodes is not None:  # multi-turn: token in, token out against the environment
            self.calls += 1
            groups = self.episodes.run(items, sampling, f"{self.gen.generator_id}/{step}/{self.calls}",
                                       version, self.gen.generator_id, self.gen.precision)
        else:
            groups = self.gen.generate(items, sampling)
        if groups and faults.fires("rollout.nan", step):
            groups[0].completions[0].logprobs[0] = math.nan
        n = sum(c.model_tokens for g in groups for c in g.completions)
        env = self.episodes.env_seconds - env0 if self.episodes is not None else 0.0
        return groups, GenerationStats(self.gen.generator_id, time.perf_counter() - t0, n, version, env)

    def complete(self, sequences: list[list[int]], sampling: SamplingParams) -> tuple[int, list]:
        """One continuation of each token-id sequence, for the endpoint's calls (actors/endpoint_actor.py), under the
        gate as `generate`: (the version the batch began with, a Completion per sequence; token_versions where an
        update landed between two decode steps)."""
        def run():
            version = self.gen.policy_version
            if faults.fires("rollout.kill", version + 1):
                os.kill(os.getpid(), signal.SIGKILL)
            slow = faults.fires("rollout.slow_decode", version + 1)  # a drill: a call long enough for a sync to land
            self.gate.delay = faults.SLOW_DECODE_SECONDS if slow else 0.0
            return version, self.gen.continue_ids(sequences, sampling)
        return self.gate.call(run)

    def serving(self) -> dict:
        """What the endpoint needs of this actor's generator: its precision, version and stop tokens."""
        return {"precision": self.gen.precision, "version": self.gen.policy_version,
                "stop_ids": list(self.gen.stop_ids), "generator_id": self.gen.generator_id}

    def load_weights(self, update: WeightUpdate) -> SyncAck:
        """Load one versioned update from the object store (see `_load`): fetched now, loaded through the gate."""
        t0 = time.perf_counter()
        buckets = ObjectStoreTransport.fetch(update)
        seconds = time.perf_counter() - t0
        return self.gate.load(lambda: self._load(update, buckets, seconds))

    def receive_weights(self) -> SyncAck:
        """Receive one update from learner rank 0's broadcast (sync.transport = "collective"; see `_load`): received
        now, loaded through the gate."""
        update, buckets, seconds = self._collective().receive()
        return self.gate.load(lambda: self._load(update, buckets, seconds))

    def _load(self, update: WeightUpdate, buckets: list[Bucket], receive_seconds: float) -> SyncAck:
        """Load the received buckets, then prove it: the generator's log-probs on the update's probe sequence must
        match the learner's within the precision's tolerance (WeightFingerprintError otherwise). An update of kind
        "adapters" goes to the generator's `load_adapters` as it came: no re-rounding, no norm noise (the quantized
        base does not change and the norms are not sent)."""
        t0 = time.perf_counter()
        stream, prepared, visibility, sigma = unpack_buckets(buckets), None, {}, 0.0
        if update.kind == "adapters":  # a backend that cannot raises (Generator.load_adapters)
            rounding_seconds = 0.0
            self.gen.load_adapters(update.version, stream)
        else:
            if self.requant is not None:
                prepared = self.requant.prepare(update.version, list(stream))
                stream = prepared.tensors
            sigma = self.noise.sigma(update.version) if self.noise is not None else 0.0
            if sigma > 0:
                stream = self.noise.apply(update.version, stream)
            rounding_seconds = time.perf_counter() - t0
            self.gen.load_weights(update.version, stream)
            if prepared is not None:
                visibility = self.requant.commit(prepared)
        t1 = time.perf_counter()
        try:
            fp = check_fingerprint(self.gen.generator_id, self.gen.precision, update.version,
                                   self.gen.score(update.probe_ids), update.probe_logprobs)
        except WeightFingerprintError as e:
            if self.requant is None or self.requant.mode == "nearest":
                raise
            raise WeightFingerprintError(
                f"{e} Here the likelier cause is sync.requantize = {self.requant.mode!r}: it serves weights up to a "
                "whole grid step from the received ones, about 1.4x the rounding error of nearest, which this "
                f"precision's tolerance does not leave room for; use sync.requantize = \"nearest\" or a higher "
                "rollout.precision (docs/quantization.md)") from e
        self.last_ack = SyncAck(self.gen.generator_id, self.gen.policy_version, seconds=t1 - t0,
                                receive_seconds=receive_seconds,
                                requantize_seconds=rounding_seconds + self.gen.requantize_seconds,
                                verify_seconds=time.perf_counter() - t1, fingerprint_gap=fp["gap"],
                                fingerprint_corr=fp["corr"], norm_noise=sigma, **visibility)
        return self.last_ack

    def last_load(self) -> SyncAck | None:
        return self.last_ack

    def updates_mid_call(self) -> int:
        """Weight loads applied between two decode steps of a generation call so far (the rest came between calls)."""
        return self.gate.applied_mid_call

    def _tensor_device(self) -> str:
        device = self.gen.device  # None where its arrays are not torch's (MLX)
        return "cuda" if device is not None and str(device).startswith("cuda") else "cpu"

    def close(self) -> None:
        """Release the generator's engine and device memory before the actor is killed (the precision ladder
        starts a replacement on the same GPU, which waits for the memory to be free)."""
        if self.gen is not None:  # a second close finds it gone
            self.gate.run(self.gen.close)
        self.gen = None

    def info(self) -> dict:
        import torch

        return {"generator_id": self.gen.generator_id, "version": self.gen.policy_version,
                "precision": self.gen.precision, "memory_bytes": self.gate.run(self.gen.memory_bytes),
                "device": self._tensor_device(),
                "node_id": ray.get_runtime_context().get_node_id(), "threads": torch.get_num_threads(),
                "cpu_wait": current_wait(), "compute_dtype": getattr(self.gen, "compute_dtype", None)}

    def set_threads(self, threads: int) -> None:
        """Local mode: more actors now share this machine's cores (or fewer do)."""
        apply_threads(threads)


class _ThreadedRolloutActor(_RolloutActor):
    """Weight loads in a concurrency group of their own, beside the generation call in flight (the update gate
    applies them between two decode steps)."""

    @ray.method(concurrency_group="sync")
    def load_weights(self, update: WeightUpdate) -> SyncAck:
        return super().load_weights(update)

    @ray.method(concurrency_group="sync")
    def receive_weights(self) -> SyncAck:
        return super().receive_weights()

    @ray.method(concurrency_group="sync")
    def last_load(self) -> SyncAck | None:
        return super().last_load()

    @ray.method(concurrency_group="sync")
    def updates_mid_call(self) -> int:
        return super().updates_mid_call()


RolloutActor = ray.remote(concurrency_groups={"sync": 1})(_ThreadedRolloutActor)
