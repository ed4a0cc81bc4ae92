"""Per-token log-probs of given sequences: shared by the learner (policy, pi_old) and the reference scorer."""
from __future__ import annotations

import torch


def token_logprobs(model, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """input_ids [B, T] -> log-probs [B, T] float32; position j = log p(token j | tokens < j) of the distribution
    softmax(logits / temperature), the one the generators sample from. Position 0 has no prediction and is 0.

    Uses logit[target] - logsumexp(logits) so the full [B, T, V] log-softmax is never materialised twice.
    """
    logits = model(input_ids=input_ids).logits[:, :-1].float()  # [B, T-1, V]
    if temperature != 1.0:
        logits = logits / temperature
    target = input_ids[:, 1:].unsqueeze(-1)  # [B, T-1, 1]
    picked = logits.gather(-1, target).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # [B, T-1]
    return torch.nn.functional.pad(picked, (1, 0))
