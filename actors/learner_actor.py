"""Ray actors for the DeepSpeed learner: one per rank, joined into one gloo/NCCL process group."""
from __future__ import annotations

import os
import signal

import ray

from actors.common import apply_threads
from actors.weights import ObjectStoreTransport, WeightUpdate
from cluster.storage import localize, staged
from core import faults
from learner.batch import TrainBatch
from rollout.backends.common import probe_ids


@ray.remote
class LearnerActor:
    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, learner_kwargs: dict,
                 threads: int, extensions_dir: str):
        apply_threads(threads)
        os.environ.update(
            MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank), LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
            # DeepSpeed JIT-builds ops into this cache, which the project controls (not ~/.cache).
            TORCH_EXTENSIONS_DIR=extensions_dir,
        )
        from learner.engine import Learner

        self.rank = rank
        self._probe: list[int] | None = None
        # A checkpoint given as a URI is read from this node's copy of it (optimizer state included, for load()).
        self.learner = Learner(world_size=world_size, **{**learner_kwargs,
                                                         "model_path": localize(learner_kwargs["model_path"])})

    def train_step(self, shard: TrainBatch, step: int = 0) -> dict:
        if self.rank == 0 and faults.fires("learner.kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        return self.learner.train_step(shard, step)

    def publish_weights(self, bucket_bytes: int) -> WeightUpdate | None:
        """Every rank iterates (ZeRO-3 gathers are collectives); rank 0 publishes, with the policy's log-probs on
        the probe sequence that every receiver checks its load against."""
        probe = self._probe_ids()
        probe_logprobs = self.learner.score(probe)  # a forward: collective under ZeRO-3, so every rank runs it
        weights = self.learner.named_weights()
        if self.rank == 0:
            update = ObjectStoreTransport(bucket_bytes).publish(self.learner.version, weights)
            update.probe_ids, update.probe_logprobs = probe, probe_logprobs
            return update
        for _ in weights:
            pass
        return None

    def _probe_ids(self) -> list[int]:
        if self._probe is None:
            from transformers import AutoTokenizer

            self._probe = probe_ids(AutoTokenizer.from_pretrained(self.learner.model_path))
        return self._probe

    def save(self, out_dir: str) -> None:
        """`out_dir` a URI: this rank writes its part (model files from rank 0, its optimizer shard) on its own node
        and uploads it there; the driver marks the checkpoint complete once every rank has returned."""
        with staged(out_dir) as local:
            self.learner.save(local, rank=self.rank)

    def load(self, ckpt_dir: str, version: int) -> None:
        self.learner.load(localize(ckpt_dir), version)

    def version(self) -> int:
        return self.learner.version
