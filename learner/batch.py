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
    # [B, T] int64, the policy version that sampled each completion token, where a weight update landed inside a
    # completion (Completion.token_versions); None: every token of a row was sampled by its policy_versions entry
    token_versions: torch.Tensor | None = None
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


@dataclass(frozen=True)
class PackedRollouts:
    """A step's rollouts as padded tensors, before their advantages are known: what the reference scores while the
    rewards are computed. `train_batch` makes the learner's batch of it, once."""

    input_ids: torch.Tensor  # [B, T] int64
    completion_mask: torch.Tensor  # [B, T] float32
    mu_logp: torch.Tensor  # [B, T] float32
    policy_versions: torch.Tensor  # [B] int64
    prompt_lens: torch.Tensor  # [B] int64
    group_ids: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64
    max_new_tokens: int
    token_versions: torch.Tensor | None = None  # [B, T] int64, as TrainBatch's

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def without(self, rows: list[bool]) -> "PackedRollouts":
        """The rows marked True left out of the loss (their mask zeroed): DAPO's overlong filtering. The sequence
        count stays (seq_mean and constant aggregation divide by every sequence, as TRL does); the token count is
        the mask's. With every row left out the learner's weights are 0 and the loss is 0, not NaN."""
        if len(rows) != len(self):
            raise ValueError(f"PackedRollouts.without: {len(rows)} rows marked for a batch of {len(self)}")
        mask = self.completion_mask.clone()
        mask[torch.tensor(rows, dtype=torch.bool)] = 0.0
        return replace(self, completion_mask=mask)

    def train_batch(self, advantages: torch.Tensor, ref_logp: torch.Tensor | None = None) -> TrainBatch:
        """The learner's batch: these tensors with each row's advantage and, with a KL term, the reference's
        log-probs."""
        if advantages.shape != (len(self),):
            raise ValueError(f"train_batch: {tuple(advantages.shape)} advantages for a batch of {len(self)} rows")
        return TrainBatch(
            input_ids=self.input_ids, completion_mask=self.completion_mask, mu_logp=self.mu_logp,
            advantages=advantages.to(torch.float32), policy_versions=self.policy_versions, ref_logp=ref_logp,
            prompt_lens=self.prompt_lens, group_ids=self.group_ids, seq_lens=self.seq_lens,
            token_versions=self.token_versions, total_sequences=len(self),
            total_tokens=float(self.completion_mask.sum()),
            max_new_tokens=self.max_new_tokens)


def pack_rollouts(groups: list[GroupRollout], pad_id: int, max_new_tokens: int) -> PackedRollouts:
    """The groups' prompts and completions as right-padded [B, T] tensors, a row per completion in group order."""
    rows, masks, mus, versions, plens, gids, per_token = [], [], [], [], [], [], []
    mixed = any(c.token_versions is not None for g in groups for c in g.completions)
    for gid, g in enumerate(groups):
        for comp in g.completions:
            p = len(g.prompt_ids)
            rows.append(g.prompt_ids + comp.token_ids)
            if mixed:
                per_token.append([g.policy_version] * p + comp.versions(g.policy_version))
            # the loss sees the model's tokens only: a multi-turn trajectory's environment turns are masked out
            masks.append([0.0] * p + [float(x) for x in comp.mask()])
            mus.append([0.0] * p + list(comp.logprobs))
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
    token_versions = None
    if mixed:  # padding holds the row's version (masked out like the rest of it)
        token_versions = torch.tensor(versions, dtype=torch.long)[:, None].repeat(1, T)
        for i, v in enumerate(per_token):
            token_versions[i, : len(v)] = torch.tensor(v)
    return PackedRollouts(
        input_ids=input_ids, completion_mask=mask, mu_logp=mu,
        policy_versions=torch.tensor(versions, dtype=torch.long), prompt_lens=torch.tensor(plens, dtype=torch.long),
        group_ids=torch.tensor(gids, dtype=torch.long), seq_lens=torch.tensor([len(r) for r in rows], dtype=torch.long),
        max_new_tokens=max_new_tokens, token_versions=token_versions)


def staleness(batch: TrainBatch, version_before: int) -> float:
    """How many updates the batch's samples are behind the policy trained from (`version_before`): the mean over
    its rows of that less the row's policy version, or, where tokens record their own versions (an in-flight
    update), the mean over its completion tokens."""
    if batch.token_versions is None:
        return float((version_before - batch.policy_versions).float().mean())
    m = batch.completion_mask
    ages = (version_before - batch.token_versions).float()
    return float((ages * m).sum() / m.sum().clamp(min=1.0))


def advantages_of(groups: list[GroupRollout]) -> torch.Tensor:
    """[B] float32: each completion's advantage, in the order pack_rollouts puts the rows."""
    return torch.tensor([a for g in groups for a in g.advantages], dtype=torch.float32)


def build_train_batch(groups: list[GroupRollout], pad_id: int, max_new_tokens: int) -> TrainBatch:
    """The learner's batch of groups whose advantages are in (a test's, a benchmark's): pack, then batch."""
    if any(len(g.advantages) != len(g.completions) for g in groups):
        raise ValueError("build_train_batch: every group needs one advantage per completion")
    return pack_rollouts(groups, pad_id, max_new_tokens).train_batch(advantages_of(groups))
