"""The reference model on MLX (reference.backend = "mlx"): the MLX backend's spec names it (its `reference_scorer`),
so it is imported only when chosen. The torch scorer, and the contract both keep, are in
rollout/backends/reference.py."""
from __future__ import annotations

import numpy as np
import torch

from qgrpo.core.scoring import checked_seq_lens, zero_past_ends
from qgrpo.rollout.backends.mlx_backend import MLXModel, import_mlx, picked_logprobs, take_rows


class MLXReferenceScorer:
    """The reference on MLX (mlx-lm's model, `nn.quantize` group 64 for int8/int4, as in the original MLX-GRPO design):
    the same `score` contract as the torch scorer, torch tensors in and out. With `prompt_lens` each distinct prompt
    (`group_ids`) is run once into a left-padded batch cache, repeated to its rows, and only each row's last prompt
    token and completion run on top of it; positions before a row's prompt end are 0, as in the torch scorer."""

    def __init__(self, model_path: str, precision: str = "bf16", group_size_quant: int = 64, micro_batch: int = 64):
        self.net = MLXModel(model_path, precision, group_size_quant)
        self.precision = precision
        self.micro_batch = micro_batch

    def score(self, input_ids: torch.Tensor, temperature: float = 1.0, prompt_lens: torch.Tensor | None = None,
              group_ids: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        """As the torch scorer's: MLX pads each group's suffixes, and `seq_lens`, when given, zeroes the positions at
        or past each row's length afterwards, so the padding holds 0 as in the torch scorer's packed pass."""
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
        from mlx_lm.models.cache import BatchKVCache

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
