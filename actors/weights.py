"""Versioned weight stream, carried in buckets. The format is (name, tensor) pairs; the carrier is chosen by
`sync.transport`, and both carriers pack and unpack the same buckets:

- `ObjectStoreTransport` (here, "object_store") puts each bucket once into Ray's object store (shared memory on one
  node, pulled once per node across nodes); every rollout actor reads the same buckets.
- `CollectiveTransport` (actors/collective.py, "collective") broadcasts them from learner rank 0 over a process group
  of its own (gloo on CPU, NCCL when the tensors live on CUDA).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np
import torch


@dataclass
class Bucket:
    names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    offsets: list[int]  # byte offset of each tensor in `data`
    data: np.ndarray  # [nbytes] uint8, tensors back to back


@dataclass(frozen=True)
class WeightUpdate:
    """What travels to every rollout actor for one sync: the version and handles to its buckets. Made whole by the
    sender (frozen): nothing is filled in after publishing."""

    version: int
    buckets: list = field(default_factory=list)  # carrier-specific handles (ray ObjectRefs here)
    num_tensors: int = 0
    nbytes: int = 0
    num_buckets: int = 0  # also for carriers that hand out no handles (the collective broadcast)
    # A fingerprint of the sent weights: token ids of a fixed probe text and the sender's log-probs of tokens 1..
    # under them; each receiver scores the same ids after loading and must agree within its precision's tolerance.
    probe_ids: list[int] = field(default_factory=list)
    probe_logprobs: list[float] = field(default_factory=list)
    export_seconds: float = 0.0  # the sender's time to gather, fingerprint and hand out the weights
    # "full": every parameter of the model (the generators load and re-quantize it); "adapters" (sync.adapters_only):
    # only each LoRA layer's `<base>.lora_A` and scaled `<base>.lora_B`, added beside the generators' quantized base.
    kind: str = "full"


def pack_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group tensors into flat byte buffers of about `bucket_bytes` (a tensor larger than that gets its own)."""
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0

    def flush() -> Bucket:
        offsets, off = [], 0
        for _, t in pending:
            offsets.append(off)
            off += t.numel() * t.element_size()
        data = torch.empty(off, dtype=torch.uint8)
        for (_, t), o in zip(pending, offsets):
            n = t.numel() * t.element_size()
            data[o:o + n] = t.detach().contiguous().reshape(-1).view(torch.uint8)
        return Bucket([n for n, _ in pending], [tuple(t.shape) for _, t in pending],
                      [str(t.dtype).removeprefix("torch.") for _, t in pending], offsets, data.numpy())

    for name, t in named_tensors:
        n = t.numel() * t.element_size()
        if pending and size + n > bucket_bytes:
            yield flush()
            pending, size = [], 0
        pending.append((name, t.cpu()))
        size += n
    if pending:
        yield flush()


def unpack_buckets(buckets: Iterable[Bucket]) -> Iterator[tuple[str, torch.Tensor]]:
    for b in buckets:
        yield from unpack_bucket(b)


def unpack_bucket(b: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
    with warnings.catch_warnings():  # object-store buffers are read-only; receivers copy out of them
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(b.data)
    for name, shape, dtype, off in zip(b.names, b.shapes, b.dtypes, b.offsets):
        dt = getattr(torch, dtype)
        n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dt).element_size()
        yield name, raw[off:off + n].view(dt).reshape(shape)


class ObjectStoreTransport:
    def __init__(self, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], **fields) -> WeightUpdate:
        """The update of `version`, its buckets in the object store; `fields`: the rest of the WeightUpdate (the
        probe, the kind)."""
        return put_buckets(version, pack_buckets(named_tensors, self.bucket_bytes), **fields)

    @staticmethod
    def fetch(update: WeightUpdate) -> list[Bucket]:
        """Every bucket of `update` (zero-copy views of the object store on this node)."""
        import ray

        return ray.get(list(update.buckets))

    @staticmethod
    def receive(update: WeightUpdate) -> Iterator[tuple[str, torch.Tensor]]:
        import ray

        for ref in update.buckets:
            yield from unpack_bucket(ray.get(ref))


def put_buckets(version: int, buckets: Iterable[Bucket], **fields) -> WeightUpdate:
    """An object-store WeightUpdate of packed buckets (each put once); `fields`: its probe and kind."""
    import ray

    refs, num_tensors, nbytes = [], 0, 0
    for b in buckets:
        refs.append(ray.put(b))
        num_tensors += len(b.names)
        nbytes += b.data.nbytes
    return WeightUpdate(version, refs, num_tensors, nbytes, len(refs), **fields)
