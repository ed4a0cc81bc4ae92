"""The learner's input: scored rollouts packed into padded tensors.

Per-token tensors are [B, T] and aligned with `input_ids`: position j holds the value for token j (predicted from
tokens < j). Prompt and padding positions have mask 0. Sequences are right-padded, so with causal attention no real
token ever attends to padding and no attention mask is needed.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from qgrpo.core.records import GroupRollout


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, T] int64, prompt + completion, right-padded with pad_id
    completion_mask: torch.Tensor  # [B, T] float32, 1 on sampled completion tokens
    mu_logp: torch.Tensor  # [B, T] float32, log mu(token) from the generator that sampled it
    advantages: torch.Tensor  # [B] float32
    policy_versions: torch.Tensor  # [B] int64, weights version the generator sampled with
    ref_logp: torch.Tensor | None = None  # [B, T] float32, filled by the reference scorer when kl_coeff > 0
    prompt_lens: torch.Tensor | None = None  # [B] int64, tokens of each row's prompt
    group_ids: torch.Tensor | None = None  # [B] int64, rows with equal ids are completions of the same prompt
    seq_lens: torch.Tensor | None = None  # [B] int64, tokens of each row's prompt + completion (padding excluded)
    # Global sizes of the whole step's batch, kept when sharding so every rank and micro-batch normalises alike.
    total_sequences: int = 0
    total_tokens: float = 0.0
    max_new_tokens: int = 0

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: slice | torch.Tensor) -> "TrainBatch":
        """Rows `idx`, same global sizes."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = v[idx] if isinstance(v, torch.Tensor) else v
        return TrainBatch(**out)

    def to(self, device: torch.device | str) -> "TrainBatch":
        """Every tensor on `device` (the learner's: DeepSpeed moves the model, never the inputs)."""
        return TrainBatch(**{f.name: (v.to(device) if isinstance(v := getattr(self, f.name), torch.Tensor) else v)
                             for f in fields(self)})

    def shard(self, rank: int, world_size: int) -> "TrainBatch":
        """Rows rank, rank + world_size, ... so ranks get near-equal shares of long and short groups."""
        return self.select(torch.arange(rank, len(self), world_size))

    def with_ref(self, ref_logp: torch.Tensor) -> "TrainBatch":
        return replace(self, ref_logp=ref_logp)


def build_train_batch(groups: list[GroupRollout], pad_id: int, max_new_tokens: int) -> TrainBatch:
    rows, masks, mus, advs, versions, plens, gids = [], [], [], [], [], [], []
    for gid, g in enumerate(groups):
        for comp, adv in zip(g.completions, g.advantages, strict=True):
            p, c = len(g.prompt_ids), len(comp.token_ids)
            rows.append(g.prompt_ids + comp.token_ids)
            masks.append([0.0] * p + [1.0] * c)
            mus.append([0.0] * p + list(comp.logprobs))
            advs.append(adv)
            versions.append(g.policy_version)
            plens.append(p)
            gids.append(gid)
    T = max(len(r) for r in rows)
    B = len(rows)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T)
    mu = torch.zeros(B, T)
    for i, (r, m, u) in enumerate(zip(rows, masks, mus)):
        input_ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(m)] = torch.tensor(m)
        mu[i, : len(u)] = torch.tensor(u)
    return TrainBatch(
        input_ids=input_ids,
        completion_mask=mask,
        mu_logp=mu,
        advantages=torch.tensor(advs, dtype=torch.float32),
        policy_versions=torch.tensor(versions, dtype=torch.long),
        prompt_lens=torch.tensor(plens, dtype=torch.long),
        group_ids=torch.tensor(gids, dtype=torch.long),
        seq_lens=torch.tensor([len(r) for r in rows], dtype=torch.long),
        total_sequences=B,
        total_tokens=float(mask.sum()),
        max_new_tokens=max_new_tokens,
    )
