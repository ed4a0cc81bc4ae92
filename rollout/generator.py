"""The one protocol every generator backend implements, and a lazy registry of backends.

A backend module is imported only when chosen, so vLLM is never imported on a Mac and MLX never on a Linux server.
"""
from __future__ import annotations

import importlib
from typing import Iterable, Protocol

import torch

from rollout.records import GroupRollout, PromptItem, SamplingParams


class Generator(Protocol):
    generator_id: str
    precision: str
    policy_version: int

    def generate(self, items: list[PromptItem], sampling: SamplingParams) -> list[GroupRollout]:
        """group_size completions per item; per-token log-probs of the distribution actually sampled from."""

    def load_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take a full set of bf16 weights (HF names) and re-quantize into this generator's own format."""

    def memory_bytes(self) -> dict[str, int]:
        """Bytes the generator's weights take: {"linear": ..., "total": ...}."""


# backend name -> "module:Class"
BACKENDS = {
    "torch": "rollout.torch_backend:TorchGenerator",
}


def make_generator(backend: str, **kwargs) -> Generator:
    if backend not in BACKENDS:
        raise ValueError(f"unknown generator backend {backend!r}; available: {', '.join(BACKENDS)}")
    module, cls = BACKENDS[backend].split(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)
