"""The frozen reference model: per-token log-probs of given sequences for the KL term, on torch or on MLX."""
from __future__ import annotations

import torch

from qgrpo.core.scoring import checked_seq_lens, token_logprobs, zero_past_ends
from qgrpo.rollout.backends import REFERENCE_BACKENDS, REGISTRY
from qgrpo.rollout.quant import quantize_model


def make_reference_scorer(backend: str, model_path: str, precision: str = "bf16", group_size_quant: int = 64,
                          device: torch.device | str | None = None, compute_dtype: str = "auto"):
    """`compute_dtype` (model.compute_dtype) applies to the torch scorer; MLX computes as its precision says."""
    if backend not in REFERENCE_BACKENDS:
        raise ValueError(f"unknown reference backend {backend!r}; choose one of {', '.join(REFERENCE_BACKENDS)}")
    scorer = {"ReferenceScorer": ReferenceScorer, "MLXReferenceScorer": MLXReferenceScorer}[
        REGISTRY[backend].reference_scorer]
    if REGISTRY[backend].compute_dtype:  # a scorer that computes in model.compute_dtype on a device of its choice
        return scorer(model_path, precision, group_size_quant, device=device, compute_dtype=compute_dtype)
    return scorer(model_path, precision, group_size_quant)


class ReferenceScorer:
    """Frozen copy of the initial policy, optionally quantized like the generators (as the original MLX design did)."""

    def __init__(self, model_path: str, precision: str = "bf16", group_size_quant: int = 64, micro_batch: int = 64,
                 device: torch.device | str | None = None, compute_dtype: str = "auto"):
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


class MLXReferenceScorer:
    """The reference on MLX (mlx-lm's model, `nn.quantize` group 64 for int8/int4, as in the original MLX-GRPO design):
    the same `score` contract as the torch scorer, torch tensors in and out. With `prompt_lens` each distinct prompt
    (`group_ids`) is run once into a left-padded batch cache, repeated to its rows, and only each row's last prompt
    token and completion run on top of it; positions before a row's prompt end are 0, as in the torch scorer."""

    def __init__(self, model_path: str, precision: str = "bf16", group_size_quant: int = 64, micro_batch: int = 64):
        from qgrpo.rollout.backends.mlx_backend import MLXModel

        self.net = MLXModel(model_path, precision, group_size_quant)
        self.precision = precision
        self.micro_batch = micro_batch

    def score(self, input_ids: torch.Tensor, temperature: float = 1.0, prompt_lens: torch.Tensor | None = None,
              group_ids: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        """As the torch scorer's: MLX pads each group's suffixes, and `seq_lens`, when given, zeroes the positions at
        or past each row's length afterwards, so the padding holds 0 as in the torch scorer's packed pass."""
        import numpy as np

        from qgrpo.rollout.backends.mlx_backend import import_mlx

        mx = import_mlx()
        ids = input_ids.cpu().long()
        if seq_lens is not None:
            seq_lens = checked_seq_lens(seq_lens, ids.shape[1], None if prompt_lens is None else prompt_lens.cpu(),
                                        "cpu")
        out = torch.zeros(ids.shape, dtype=torch.float32)
        for i in range(0, ids.shape[0], self.micro_batch):
            sl = slice(i, i + self.micro_batch)
            if prompt_lens is None:
                out[sl, 1:] = torch.from_numpy(np.array(self.net.logprobs(mx.array(ids[sl].numpy()), temperature)))
            else:
                groups = torch.arange(ids.shape[0]) if group_ids is None else group_ids.cpu()
                out[sl] = self._shared_prompt(ids[sl], prompt_lens.cpu()[sl].long(), groups[sl], temperature)
        return out if seq_lens is None else zero_past_ends(out, seq_lens)

    def _shared_prompt(self, ids: torch.Tensor, prompt_lens: torch.Tensor, group_ids: torch.Tensor,
                       temperature: float) -> torch.Tensor:
        import numpy as np
        from mlx_lm.models.cache import BatchKVCache

        from qgrpo.rollout.backends.mlx_backend import import_mlx, picked_logprobs, take_rows

        mx = import_mlx()
        B, T = ids.shape
        if int(prompt_lens.min()) < 1 or int(prompt_lens.max()) > T:
            raise ValueError(f"MLX reference: prompt lengths must be in 1..{T}")
        uniq, row_group = torch.unique(group_ids, return_inverse=True)
        first = [int((row_group == g).nonzero()[0]) for g in range(len(uniq))]
        group_len = prompt_lens[first]
        if not torch.equal(group_len[row_group], prompt_lens):
            raise ValueError("MLX reference: rows with the same group id have different prompt lengths")
        model = self.net.model
        # Prefix: each group's prompt but its last token, left-padded; its cache is then indexed out to the rows.
        K = int(group_len.max()) - 1
        pads = [K - (int(n) - 1) for n in group_len]
        cache = [BatchKVCache(pads) for _ in model.layers]
        if K > 0:
            prefix = [[0] * p + ids[f, :int(n) - 1].tolist() for p, f, n in zip(pads, first, group_len)]
            model(mx.array(prefix), cache=cache)
        take_rows(cache, mx.array(row_group.numpy()))
        # Suffix: each row's last prompt token and its completion (right-padded), on top of its prompt's cache.
        L = T - int(prompt_lens.min()) + 1
        suffix = torch.zeros((B, L), dtype=torch.long)
        for b in range(B):
            part = ids[b, int(prompt_lens[b]) - 1:]
            suffix[b, :len(part)] = part
        sfx = mx.array(suffix.numpy())
        logits = model(sfx, cache=cache)[:, :-1].astype(mx.float32) / temperature
        # [B, L-1]: picked[b, j] scores token prompt_len[b] + j
        picked = torch.from_numpy(np.array(picked_logprobs(logits, sfx[:, 1:])))
        out = torch.zeros((B, T + L), dtype=torch.float32)
        out.scatter_(1, prompt_lens[:, None] + torch.arange(L - 1), picked)
        return out[:, :T]
