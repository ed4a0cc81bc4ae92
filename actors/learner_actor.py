"""Ray actors for the DeepSpeed learner: one per rank, joined into one gloo/NCCL process group.

Started in two steps so that ranks can sit on different nodes: the actors are created (placed by the caller, e.g. in
a placement group), rank 0 picks the rendezvous address on its own node (its node's IP and a port free there), and
then every rank builds its Learner against that address (`start_learners`)."""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import time

import ray

from qgrpo.actors.collective import CollectiveMember
from qgrpo.actors.common import apply_threads, local_model, resolve_threads
from qgrpo.actors.weights import ObjectStoreTransport, WeightUpdate
from qgrpo.core import faults
from qgrpo.core.cpu import current_wait
from qgrpo.core.records import TrainStepResult
from qgrpo.core.storage import localize, staged
from qgrpo.learner.batch import TrainBatch
from qgrpo.learner.settings import LearnerSettings
from qgrpo.rollout.backends.common import probe_ids


@ray.remote
class LearnerActor(CollectiveMember):
    def __init__(self, rank: int, model_path: str, settings: LearnerSettings, threads: int, extensions_dir: str):
        """`threads` 0: as many as the CPUs Ray gave this rank."""
        apply_threads(resolve_threads(threads))
        self.rank, self.model_path, self.settings, self.extensions_dir = rank, model_path, settings, extensions_dir
        self._probe: list[int] | None = None
        self.learner = None

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a port free on it (rank 0: where the other ranks find the process group)."""
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    def setup(self, master_addr: str, master_port: int) -> dict:
        """Join the process group at rank 0's address and build the DeepSpeed engine; returns where this rank runs."""
        os.environ.update(
            MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
            WORLD_SIZE=str(self.settings.world_size),
            # Each rank is its own process group member with only its own devices visible (Ray sets
            # CUDA_VISIBLE_DEVICES per actor), wherever the ranks sit: device 0 of this process.
            LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
            # DeepSpeed JIT-builds ops into this cache, which the project controls (not ~/.cache).
            TORCH_EXTENSIONS_DIR=self.extensions_dir,
        )
        from qgrpo.learner.engine import Learner

        # A builtin model is built on this node; a checkpoint given as a URI is read from this node's copy of it
        # (optimizer state included, for load()).
        self.learner = Learner(local_model(self.model_path), self.settings)
        return {"rank": self.rank, "node_id": ray.get_runtime_context().get_node_id(),
                "address": ray.util.get_node_ip_address(), "threads": torch_threads(),
                "device": str(self.learner.device), "compute_dtype": self.learner.compute_dtype,
                "cpu_wait": current_wait()}

    def train_step(self, shard: TrainBatch, step: int = 0) -> TrainStepResult:
        if self.rank == 0 and faults.fires("learner.kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        return self.learner.train_step(shard, step)

    def publish_weights(self, bucket_bytes: int, transport: str = "object_store",
                        adapters_only: bool = False) -> WeightUpdate | None:
        """Every rank iterates (ZeRO-3 gathers are collectives); rank 0 publishes, with the policy's log-probs on
        the probe sequence that every receiver checks its load against. "collective": rank 0 broadcasts to the
        rollout actors' receive_weights calls (actors/collective.py) and returns the update without handles.
        `adapters_only` (sync.adapters_only, object store only): the LoRA adapters alone, an update of kind
        "adapters"."""
        if adapters_only and transport != "object_store":
            raise ValueError("sync.adapters_only travels by sync.transport = \"object_store\" only")
        t0 = time.perf_counter()
        probe = self._probe_ids()
        probe_logprobs = self.learner.score(probe)  # a forward: collective under ZeRO-3, so every rank runs it
        weights = self.learner.adapter_weights() if adapters_only else self.learner.named_weights(bucket_bytes)
        if self.rank == 0 and transport == "collective":
            return self._collective().publish(self.learner.version, weights, bucket_bytes, probe, probe_logprobs)
        if self.rank == 0:
            update = ObjectStoreTransport(bucket_bytes).publish(self.learner.version, weights, probe_ids=probe,
                                                                probe_logprobs=probe_logprobs,
                                                                kind="adapters" if adapters_only else "full")
            return dataclasses.replace(update, export_seconds=time.perf_counter() - t0)
        for _ in weights:
            pass
        return None

    def collective_host(self, timeout_s: float) -> tuple[str, int]:
        """Rank 0 hosts the weight group's store: (node address, port)."""
        return self._collective().host(timeout_s)

    def _tensor_device(self) -> str:
        return self.learner.device.type

    def last_published_update(self) -> WeightUpdate | None:
        """The last weights broadcast by the collective transport, as an object-store update (for new actors)."""
        return self._collective().last_published()

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


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def start_learners(model_path: str, settings: LearnerSettings, threads: int, extensions_dir: str,
                   options: list[dict] | None = None) -> tuple[list, list]:
    """Create the `settings.world_size` rank actors (`options[r]`: Ray options of rank r, e.g. its placement-group
    bundle), then have them rendezvous at rank 0's node. Returns (actors, refs of their `setup` calls): the caller
    waits for those refs with its own deadline (DeepSpeed set-up, and scheduling when the cluster is busy)."""
    actors = [LearnerActor.options(**(options[r] if options else {})).remote(
        r, model_path, settings, threads, extensions_dir) for r in range(settings.world_size)]
    addr, port = ray.get(actors[0].rendezvous.remote())
    return actors, [a.setup.remote(addr, port) for a in actors]
