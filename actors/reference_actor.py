"""Ray actor hosting the frozen reference scorer."""
from __future__ import annotations

import ray
import torch

from qgrpo.actors.common import apply_threads, local_model, resolve_threads
from qgrpo.rollout.backends.reference import make_reference_scorer


@ray.remote
class ReferenceActor:
    def __init__(self, model_path: str, precision: str, group_size_quant: int, threads: int, backend: str = "torch",
                 compute_dtype: str = "auto"):
        apply_threads(resolve_threads(threads))
        self.scorer = make_reference_scorer(backend, local_model(model_path), precision, group_size_quant,
                                            compute_dtype=compute_dtype)

    def score(self, input_ids: torch.Tensor, temperature: float, prompt_lens: torch.Tensor | None = None,
              group_ids: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        return self.scorer.score(input_ids, temperature, prompt_lens, group_ids, seq_lens)

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()
