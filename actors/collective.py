"""The collective weight carrier (`sync.transport = "collective"`): learner rank 0 broadcasts the packed buckets to
every rollout actor over a torch.distributed process group of their own, separate from the learner ranks' DeepSpeed
group. Built statelessly (no `init_process_group`): rank 0 hosts a TCPStore on its node, each generation of the group
gets a PrefixStore, and the group is `ProcessGroupNCCL` only when every member reports a GPU of its own, else
`ProcessGroupGloo` (`core.devices.transport_backend`: a CPU rollout actor cannot join NCCL, and NCCL refuses two
members on one physical GPU, which fractional GPUs allow). Gloo carries CUDA weights through host memory.

One sync: rank 0 broadcasts a manifest (version, probe, the buckets' layout; pickled into a uint8 tensor, its length
first), then each bucket as one uint8 tensor. Every member must be inside the broadcast at the same time, so the
driver issues the send and all receives together under one deadline (`CollectiveGroup.sync`); every group operation
also carries that timeout, so a member that dies mid-broadcast makes the others raise instead of hanging.
"""
from __future__ import annotations

import datetime
import pickle
import time
from typing import Callable, Iterable

import torch

from qgrpo.actors.weights import Bucket, WeightUpdate, pack_buckets, put_buckets
from qgrpo.core.devices import transport_backend
from qgrpo.core.records import SyncAck

PREFIX = "qgrpo-weights"


class CollectiveTransport:
    """One process's side of the group: rank 0 hosts and sends, ranks 1..N receive."""

    def __init__(self):
        self.store = self.pg = None
        self.timeout, self.device = datetime.timedelta(seconds=60), torch.device("cpu")
        # Rank 0 keeps the last buckets it broadcast: a rollout actor started later (a replacement, the precision
        # ladder, `qgrpo scale`) must load the PUBLISHED weights, and the learner may have trained past them by then.
        # Cost: one bf16 copy of the weights on rank 0 (in process memory, or in the object store once handed out).
        self.published: tuple[WeightUpdate, list[Bucket]] | None = None
        self.handed_out: WeightUpdate | None = None

    def host(self, timeout_s: float) -> tuple[str, int]:
        """Rank 0: a fresh store on this node's address, on a port the OS picks here (nothing to collide with)."""
        self.leave()
        addr, self.timeout = _own_address(), datetime.timedelta(seconds=timeout_s)
        self.store = torch.distributed.TCPStore(addr, 0, is_master=True, wait_for_workers=False, timeout=self.timeout)
        return addr, self.store.port

    def join(self, addr: str, port: int, generation: int, rank: int, size: int, timeout_s: float,
             device: str = "cpu") -> None:
        """Blocks until all `size` members have joined (gloo and NCCL connect every pair at creation)."""
        dist, self.timeout, self.device = torch.distributed, datetime.timedelta(seconds=timeout_s), torch.device(device)
        if rank != 0:
            self.leave()
            self.store = dist.TCPStore(addr, port, is_master=False, timeout=self.timeout)
        store = dist.PrefixStore(f"{PREFIX}/{generation}/", self.store)
        if self.device.type == "cuda":  # untested here (no GPU): see tests/test_transport.py's cuda mark
            if not hasattr(dist, "ProcessGroupNCCL"):
                raise RuntimeError("sync.transport = 'collective' on CUDA needs a torch built with NCCL")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self.timeout
            # Bind to this node's Ray address, not whatever the host name resolves to (often loopback only).
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=_own_address())]
            self.pg = dist.ProcessGroupGloo(store, rank, size, opts)

    def leave(self) -> None:
        """Drop this process's group (a dead member's is simply gone). Rank 0's store goes with it."""
        pg, self.pg, self.store = self.pg, None, None
        if pg is not None:
            try:
                pg.shutdown()
            except RuntimeError:  # a group broken by a dead member: dropping it is all that is left to do
                pass

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.device)
        self.pg.broadcast(t, 0, self.timeout).wait()
        return t.cpu()

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                probe_ids: list[int], probe_logprobs: list[float]) -> WeightUpdate:
        """Rank 0: pack, then broadcast the manifest and every bucket. Returns the update's summary (no handles)."""
        if self.pg is None:
            raise RuntimeError("not in a weight-broadcast group (the driver forms it before a collective sync)")
        buckets = list(pack_buckets(named_tensors, bucket_bytes))
        update = WeightUpdate(version, [], sum(len(b.names) for b in buckets), sum(b.data.nbytes for b in buckets),
                              len(buckets), probe_ids, probe_logprobs)
        self.published, self.handed_out = (update, buckets), None
        layout = [(b.names, b.shapes, b.dtypes, b.offsets, b.data.nbytes) for b in buckets]
        manifest = torch.frombuffer(bytearray(pickle.dumps((update, layout))), dtype=torch.uint8)
        self._broadcast(torch.tensor([manifest.numel()], dtype=torch.int64))
        self._broadcast(manifest)
        for b in buckets:
            self._broadcast(torch.from_numpy(b.data))
        return update

    def receive(self) -> tuple[WeightUpdate, list[Bucket], float]:
        """Ranks 1..N: (update summary, buckets, seconds from the manifest's arrival to the last bucket's)."""
        if self.pg is None:
            raise RuntimeError("not in a weight-broadcast group (the driver forms it before a collective sync)")
        n = self._broadcast(torch.empty(1, dtype=torch.int64))
        # Pickle from learner rank 0 of this job, over the job's own group: the same trust as Ray's own arguments.
        update, layout = pickle.loads(self._broadcast(torch.empty(int(n), dtype=torch.uint8)).numpy().tobytes())
        t0 = time.perf_counter()
        buckets = [Bucket(names, shapes, dtypes, offsets,
                          self._broadcast(torch.empty(nbytes, dtype=torch.uint8)).numpy())
                   for names, shapes, dtypes, offsets, nbytes in layout]
        return update, buckets, time.perf_counter() - t0

    def last_published(self) -> WeightUpdate | None:
        """Rank 0: the last broadcast buckets as an object-store update, put once per version; the process copy is
        dropped then (the object store holds it), so the cost stays one copy."""
        if self.handed_out is None and self.published is not None:
            update, buckets = self.published
            self.handed_out = put_buckets(update.version, buckets, probe_ids=update.probe_ids,
                                          probe_logprobs=update.probe_logprobs)
            self.published = (update, [])
        return self.handed_out


def _own_address() -> str:
    import ray

    return ray.util.get_node_ip_address()


class CollectiveMember:
    """Mixin for the actors in the group (LearnerActor for rank 0, RolloutActor): the driver's join/leave calls, and
    where the member's tensors live (`collective_device_info`, from the device Ray gave it). Rank 0 adds
    `collective_host(timeout_s) -> (addr, port)`, `publish_weights(bucket_bytes, "collective")` and
    `last_published_update()`; the others `receive_weights()`."""

    def _tensor_device(self) -> str:
        """"cuda" or "cpu": where this member's weights live (each actor class says)."""
        return "cpu"

    def collective_device_info(self) -> dict:
        from qgrpo.core.devices import physical_gpus

        device = self._tensor_device()
        return {"device": device, "gpus": physical_gpus() if device == "cuda" else []}

    def _collective(self) -> CollectiveTransport:
        if getattr(self, "_carrier", None) is None:
            self._carrier = CollectiveTransport()
        return self._carrier

    def collective_join(self, addr: str, port: int, generation: int, rank: int, size: int, timeout_s: float,
                        device: str = "cpu") -> None:
        self._collective().join(addr, port, generation, rank, size, timeout_s, device)

    def collective_leave(self) -> None:
        self._collective().leave()


class CollectiveGroup:
    """Driver side: the members of the current group, and one sync over it. The group is formed lazily: before a
    sync, if the live rollout actors differ from the members (a replacement, the precision ladder, scaling), a new
    generation is formed; a failed sync forgets the group, so the next one forms it anew."""

    def __init__(self, wait: Callable[[dict, float, str], dict]):
        self.wait = wait  # {ref: actor name}, seconds, stage -> {ref: result}; raises naming the actor
        self.members: list = []
        self.generation = 0
        self.host = None  # learner rank 0, once a sync has published through it
        self.backend, self.why = "", ""  # the group's backend ("nccl" | "gloo") and why, once formed

    def sync(self, learners: list, actors: list, names: list[str], bucket_bytes: int, seconds: float
             ) -> tuple[WeightUpdate, list[SyncAck]]:
        deadline = time.monotonic() + seconds
        try:
            if len(actors) != len(self.members) or any(a is not m for a, m in zip(actors, self.members)):
                self._form(learners[0], actors, names, seconds, deadline)
            sends = {a.publish_weights.remote(bucket_bytes, "collective"): f"learner rank {r}"
                     for r, a in enumerate(learners)}
            receives = {a.receive_weights.remote(): name for a, name in zip(actors, names)}
            out = self.wait({**sends, **receives}, deadline - time.monotonic(), "weight sync (collective)")
        except BaseException:
            self.members = []
            raise
        self.host = learners[0]
        return out[next(iter(sends))], [out[r] for r in receives]

    def _form(self, host, actors: list, names: list[str], timeout_s: float, deadline: float) -> None:
        for old in self.members:  # members that stay leave as they join; the dead are gone; the rest leave now
            if not any(old is a for a in actors):
                old.collective_leave.remote()  # best effort: an actor removed or killed may not answer
        self.members, self.generation = [], self.generation + 1
        members = [host, *actors]
        infos = {m.collective_device_info.remote(): name for m, name in zip(members, ["learner rank 0", *names])}
        got = self.wait(infos, deadline - time.monotonic(), "forming the weight group")
        self.backend, self.why = transport_backend([{**got[r], "name": n} for r, n in infos.items()])
        device = "cuda" if self.backend == "nccl" else "cpu"
        ref = host.collective_host.remote(timeout_s)
        addr, port = self.wait({ref: "learner rank 0"}, deadline - time.monotonic(), "forming the weight group")[ref]
        size = len(actors) + 1
        joins = {host.collective_join.remote(addr, port, self.generation, 0, size, timeout_s, device): "learner rank 0",
                 **{a.collective_join.remote(addr, port, self.generation, i + 1, size, timeout_s, device): name
                    for i, (a, name) in enumerate(zip(actors, names))}}
        self.wait(joins, deadline - time.monotonic(), "forming the weight group")
        self.members = list(actors)

    def last_published(self, seconds: float) -> WeightUpdate | None:
        """What a new rollout actor must load before it serves: rank 0's last broadcast, via the object store."""
        if self.host is None:
            return None
        ref = self.host.last_published_update.remote()
        return self.wait({ref: "learner rank 0"}, seconds, "handing the published weights to a new rollout actor")[ref]
