"""The frozen reference model: per-token log-probs of given sequences for the KL term."""
from __future__ import annotations

import torch

from rollout.quant import quantize_model
from core.scoring import token_logprobs


class ReferenceScorer:
    """Frozen copy of the initial policy, optionally quantized like the generators (as the original MLX design did)."""

    def __init__(self, model_path: str, precision: str = "bf16", group_size_quant: int = 64, micro_batch: int = 64):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()
        self.model = quantize_model(model, precision, group_size_quant).eval()
        self.precision = precision
        self.micro_batch = micro_batch

    @torch.no_grad()
    def score(self, input_ids: torch.Tensor, temperature: float = 1.0, prompt_lens: torch.Tensor | None = None,
              group_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> log-probs [B, T] (position j: token j), computed in micro-batches. With `prompt_lens`
        (and `group_ids`) only completion positions are scored and each group's prompt is run once."""
        parts = []
        for i in range(0, input_ids.shape[0], self.micro_batch):
            sl = slice(i, i + self.micro_batch)
            parts.append(token_logprobs(self.model, input_ids[sl], temperature,
                                        None if prompt_lens is None else prompt_lens[sl],
                                        None if group_ids is None else group_ids[sl]))
        return torch.cat(parts)
