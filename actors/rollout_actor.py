"""Ray actor hosting one generator (any backend) behind the generator protocol."""
from __future__ import annotations

import time

import ray

from actors.common import apply_threads
from actors.weights import ObjectStoreTransport, WeightUpdate
from rollout.backends import make_generator
from rollout.backends.common import check_fingerprint
from core.records import GenerationStats, GroupRollout, PromptItem, SamplingParams


@ray.remote
class RolloutActor:
    def __init__(self, backend: str, generator_kwargs: dict, threads: int):
        apply_threads(threads)
        self.gen = make_generator(backend, **generator_kwargs)

    def generate(self, items: list[PromptItem], sampling: SamplingParams) -> tuple[list[GroupRollout], GenerationStats]:
        t0 = time.perf_counter()
        groups = self.gen.generate(items, sampling)
        n = sum(len(c.token_ids) for g in groups for c in g.completions)
        return groups, GenerationStats(self.gen.generator_id, time.perf_counter() - t0, n, self.gen.policy_version)

    def load_weights(self, update: WeightUpdate) -> dict:
        """Load one versioned update, then prove it: the generator's log-probs on the update's probe sequence must
        match the learner's within the precision's tolerance (WeightFingerprintError otherwise)."""
        t0 = time.perf_counter()
        self.gen.load_weights(update.version, ObjectStoreTransport.receive(update))
        seconds = time.perf_counter() - t0
        fp = check_fingerprint(self.gen.generator_id, self.gen.precision, update.version,
                               self.gen.score(update.probe_ids), update.probe_logprobs)
        return {"generator_id": self.gen.generator_id, "version": self.gen.policy_version, "seconds": seconds,
                "fingerprint_gap": fp["gap"], "fingerprint_corr": fp["corr"]}

    def info(self) -> dict:
        return {"generator_id": self.gen.generator_id, "version": self.gen.policy_version,
                "precision": self.gen.precision, "memory_bytes": self.gen.memory_bytes()}
