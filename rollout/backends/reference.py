"""The frozen reference model: per-token log-probs of given sequences for the KL term. The torch scorer is here; a
backend with a scorer of its own names it in its spec (MLX: rollout/backends/mlx_reference.py)."""
from __future__ import annotations

import torch

from qgrpo.core.scoring import token_logprobs
from qgrpo.rollout.backends import REFERENCE_BACKENDS, REGISTRY
from qgrpo.rollout.quantization.quant import quantize_model


def make_reference_scorer(backend: str, model_path: str, precision: str = "bf16", group_size_quant: int = 64,
                          device: torch.device | str | None = None, compute_dtype: str = "auto"):
    """`compute_dtype` (model.compute_dtype) applies to the torch scorer; MLX computes as its precision says."""
    if backend not in REFERENCE_BACKENDS:
        raise ValueError(f"unknown reference backend {backend!r}; choose one of {', '.join(REFERENCE_BACKENDS)}")
    scorer = REGISTRY[backend].reference_class()  # the backend's own (BackendSpec.reference_scorer)
    if REGISTRY[backend].compute_dtype:  # a scorer that computes in model.compute_dtype on a device of its choice
        return scorer(model_path, precision, group_size_quant, device=device, compute_dtype=compute_dtype)
    return scorer(model_path, precision, group_size_quant)


MICRO_BATCH = 64  # sequences a torch reference scores per forward


class ReferenceScorer:
    """Frozen copy of the initial policy, optionally quantized like the generators (as the original MLX design did)."""

    def __init__(self, model_path: str, precision: str = "bf16", group_size_quant: int = 64,
                 micro_batch: int = MICRO_BATCH, device: torch.device | str | None = None,
                 compute_dtype: str = "auto"):
        """`device`: where it scores (default: the GPU Ray assigned the reference actor, else the CPU); the model is
        quantized there, and sequences come in and log-probs go out as CPU tensors. `compute_dtype`:
        model.compute_dtype, resolved on that device (core/cpu.py; rollout/backends/compute.py)."""
        from transformers import AutoModelForCausalLM

        from qgrpo.core.cpu import compute_dtype as choose
        from qgrpo.core.cpu import torch_dtype
        from qgrpo.core.devices import bind, current_device
        from qgrpo.rollout.backends.compute import compute_in

        self.device = bind(torch.device(device) if device is not None else current_device("the reference actor"))
        self.compute_dtype, self.compute_why = choose(compute_dtype, self.device)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).to(self.device).eval()
        self.model = compute_in(quantize_model(model, precision, group_size_quant), torch_dtype(self.compute_dtype))
        self.model.eval()
        self.precision = precision
        self.micro_batch = micro_batch

    @torch.no_grad()
    def score(self, input_ids: torch.Tensor, temperature: float = 1.0, prompt_lens: torch.Tensor | None = None,
              group_ids: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> log-probs [B, T] (position j: token j), computed in micro-batches. With `prompt_lens`
        (and `group_ids`) only completion positions are scored and each group's prompt is run once; with
        `seq_lens` too, each group's completions are packed without padding (core/scoring.py). Positions at or past
        a row's `seq_lens` are 0 whenever it is given; without it they hold the pad tokens' log-probs (mask them)."""
        parts = []
        def on(t):
            return None if t is None else t.to(self.device)

        for i in range(0, input_ids.shape[0], self.micro_batch):
            sl = slice(i, i + self.micro_batch)
            parts.append(token_logprobs(self.model, on(input_ids[sl]), temperature,
                                        None if prompt_lens is None else on(prompt_lens[sl]),
                                        None if group_ids is None else on(group_ids[sl]),
                                        seq_lens=None if seq_lens is None else on(seq_lens[sl])).cpu())
        return torch.cat(parts)
