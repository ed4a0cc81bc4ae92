"""Typed records passed between stages. Plain dataclasses: they cross Ray process boundaries by pickling. The records
of rollouts (Completion, GroupRollout, GenerationStats) are frozen: a stage that adds to them (rewards, advantages)
returns new ones (dataclasses.replace), so a value handed on never changes under its reader.

Shape comments use B = sequences in a batch, T = padded sequence length, G = group size.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class PromptItem:
    """One task instance. `prompt` is the question given to the model; `reference` what the verifier checks against.
    `history` holds earlier chat turns shown before the question (a system turn, few-shot examples, a chat row's
    earlier turns) as (role, content) pairs. `columns` are the row's columns that reward functions receive as keyword
    arguments (one list entry per completion)."""

    prompt_id: str
    prompt: str
    reference: str
    meta: dict | None = None  # JSON-safe extras for verifiers and logs, e.g. {"split": "eval", "index": 3}
    # e.g. (("user", "Calculate 4 - 1."), ("assistant", "<answer>3</answer>"))
    history: tuple[tuple[str, str], ...] = ()
    # JSON-safe, by column name; None = none. File tasks: every column of the row; rg: tasks: question, answer,
    # metadata and rg_entry (what rebuilds the reasoning-gym entry in another process, see rollout/tasks.RGTask)
    columns: dict | None = None
    # the row's prompt column held chat turns: reward functions then get `prompts[i]` as the whole message list and
    # `completions[i]` as [{"role": "assistant", "content": TEXT}], as TRL passes conversational rows
    chat: bool = False


@dataclass(frozen=True)
class SamplingParams:
    group_size: int  # G completions per prompt
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    # continue_ids only: each sequence's own token budget, one per sequence, each at most max_new_tokens (a row stops
    # at its own; the endpoint batches calls that asked for different max_tokens). None: max_new_tokens for every row.
    row_tokens: tuple[int, ...] | None = None

    def row_budgets(self, rows: int) -> list[int]:
        """Each of `rows` sequences' token budget: row_tokens (checked: one per row, 1 to max_new_tokens), else
        max_new_tokens for every row."""
        if self.row_tokens is None:
            return [self.max_new_tokens] * rows
        if len(self.row_tokens) != rows or not all(1 <= int(n) <= self.max_new_tokens for n in self.row_tokens):
            raise ValueError(f"SamplingParams.row_tokens: one budget per sequence ({rows}), each from 1 to "
                             f"max_new_tokens ({self.max_new_tokens}); got {self.row_tokens!r}. Set max_new_tokens "
                             "to the largest, or leave row_tokens None for one budget")
        return [int(n) for n in self.row_tokens]


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]  # [L] sampled tokens, the stop token included when the model emitted it
    logprobs: list[float]  # [L] log mu(token) under the distribution actually sampled from (after temperature/top-p)
    finish_reason: str  # "stop" (emitted EOS) or "length" (hit max_new_tokens); a multi-turn trajectory's: "stop"
    #                     (the environment ended it), "length", "max_turns", "context" (its token budget) or "env_error"
    text: str  # decoded completion, special tokens removed
    # A multi-turn trajectory (rollout/episodes.py): token_ids hold the model's turns as sampled and the environment's
    # turns as the chat template renders them, appended. model_mask[i] is 1 where the model sampled token i, 0 on an
    # environment token (its log-prob is 0.0 and the loss never sees it); None: every token is the model's.
    model_mask: list[int] | None = None
    # each turn: {"role", "content", "start", "end" (its token span in token_ids), "tool_calls", "error"}
    turns: list[dict] | None = None
    env_score: float | None = None  # the environment's score of the trajectory (a reward entry reads it)
    # [L] the policy version whose weights sampled each token, where a weight update reached the generator between
    # two decode steps of this completion (an in-flight update, algo.max_staleness > 0); None: every token was
    # sampled by GroupRollout.policy_version. `logprobs` are each token's sampler's, so the loss's corrections work
    # token by token. Tokens of an environment turn carry the version of the model turn before them.
    token_versions: list[int] | None = None

    # What consumers ask of the optional fields above, answered once here so that none tests them for None:
    def versions(self, default: int) -> list[int]:
        """Each token's version: token_versions, or `default` (the group's policy_version) for every token."""
        return self.token_versions if self.token_versions is not None else [default] * len(self.token_ids)

    def mask(self) -> list[int]:
        """1 on each token the model sampled, 0 on an environment token: model_mask, or all 1."""
        return self.model_mask if self.model_mask is not None else [1] * len(self.token_ids)

    @property
    def model_tokens(self) -> int:
        """How many tokens the model sampled (a multi-turn trajectory's environment tokens left out)."""
        return len(self.token_ids) if self.model_mask is None else sum(self.model_mask)

    @property
    def multi_turn(self) -> bool:
        """A trajectory of turns (rollout/episodes.py): `turns`, `env_score` and `model_mask` are set."""
        return self.turns is not None


@dataclass(frozen=True)
class GroupRollout:
    """All G completions of one prompt; a group never spans generators."""

    item: PromptItem
    prompt_ids: list[int]  # [P] tokenized prompt
    completions: list[Completion]  # [G]
    policy_version: int  # version of the weights the generator sampled with
    generator_id: str
    precision: str  # generator precision, e.g. "int4"
    rewards: list[float] = field(default_factory=list)  # [G]: empty as generated; set by scoring (a new record)
    advantages: list[float] = field(default_factory=list)  # [G]: empty until the advantages (a new record)
    # each reward entry's own score, label -> [G] (None where it returned None or its call failed), unweighted;
    # set with the rewards
    scores: dict[str, list[float | None]] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerationStats:
    generator_id: str
    seconds: float
    new_tokens: int  # tokens the model sampled (a multi-turn trajectory's environment tokens are not counted)
    policy_version: int
    env_seconds: float = 0.0  # of `seconds`, the time spent waiting on the environment (multi-turn rollouts)


@dataclass
class TrainStepResult:
    """One learner rank's result of one `Learner.train_step` (one step's shard of the batch). The driver adds the
    ranks' `stats` and `loss` together; the scalars of rank 0 stand for the step (every rank holds the same ones)."""

    stats: dict[str, float]  # loss statistics SUMMED over this rank's tokens of every pass (and _max/_min), keys of
    #                          learner/objective/loss.py; its finalize_stats turns the ranks' sum into means
    loss: float  # this rank's share of the global loss, averaged over the passes run (ranks add up to the batch's)
    grad_norm: float  # global gradient norm (over ranks, before clipping) of the last pass; NaN when none was computed
    lr: float  # the learning rate after this step (the schedule moves only with updates really taken)
    policy_version: int  # optimizer updates applied so far, this step's included: the version a sync would publish
    version_before: int  # the policy version the batch was trained from (the rollouts' staleness is counted from it)
    staleness: float  # mean over this rank's rows of version_before - the version that sampled the row, in updates
    #                   (over its completion tokens where tokens record their own versions: learner/batch.py)
    timing: dict[str, float]  # seconds per phase, summed over micro-batches and passes: "forward", "backward",
    #                           "optimizer"
    skipped: str = ""  # why the guard skipped the update ("" = every update taken): "sampler_logprobs",
    #                    "reference_logprobs", "loss", "mismatch" or "grad_norm"


@dataclass
class SyncAck:
    """A rollout actor's answer to one weight sync: the version it now holds, what loading it cost, and how close its
    log-probs on the probe sequence came to the learner's (the check already passed, or the load raised)."""

    generator_id: str
    version: int  # the policy version the generator holds after loading
    seconds: float  # loading the weights into the generator, re-quantization included
    receive_seconds: float  # fetching the buckets from the object store, or receiving the broadcast
    requantize_seconds: float  # the re-quantization part of `seconds` where the backend times it apart, else NaN
    verify_seconds: float  # scoring the probe sequence for the fingerprint check
    fingerprint_gap: float  # mean |log mu - log pi| over the probe's tokens, nats per token
    fingerprint_corr: float  # correlation of the generator's and the learner's probe log-probs
    # Update visibility against the previous version (rollout/quantization/requantize.py), NaN where not measured:
    code_change_frac: float = math.nan  # share of the quantized weights whose code changed
    bf16_change_frac: float = math.nan  # share of those weights whose received bf16 value changed
    update_norm_ratio: float = math.nan  # ||served update|| / ||bf16 update|| over those weights
    update_projection: float = math.nan  # <served update, bf16 update> / ||bf16 update||^2: 1 follows, 0 stands still
    norm_noise: float = 0.0  # sigma of the exploration noise added to the norm weights (rollout/noise.py)


def _nanmin(values) -> float:
    """The smallest of the values that are not NaN; NaN when all are."""
    kept = [v for v in values if not math.isnan(v)]
    return min(kept) if kept else math.nan


@dataclass
class WeightSync:
    """One whole sync as the driver logs it (`sync/<field>` in the metrics, `version` aside): the learner's export
    and every rollout actor's load, the slowest and worst actor standing for all."""

    version: int  # the policy version every rollout actor now holds
    nbytes: int  # bytes of bf16 weights sent
    buckets: int  # buckets they travelled in
    seconds: float  # the whole sync, export and every load, as the driver waited for it
    export_seconds: float  # learner rank 0's gather, fingerprint and hand-out
    receive_seconds_max: float  # SyncAck.receive_seconds of the slowest actor
    requantize_seconds_max: float  # SyncAck.requantize_seconds of the slowest actor (NaN where none times it)
    verify_seconds_max: float  # SyncAck.verify_seconds of the slowest actor
    load_seconds_max: float  # SyncAck.seconds of the slowest actor
    fingerprint_gap_max: float  # the largest SyncAck.fingerprint_gap, nats per token
    fingerprint_corr_min: float  # the smallest SyncAck.fingerprint_corr
    code_change_frac_min: float = math.nan  # the smallest SyncAck.code_change_frac (the actor that follows least)
    bf16_change_frac: float = math.nan  # SyncAck.bf16_change_frac (the same stream reaches every actor)
    update_norm_ratio_min: float = math.nan  # the smallest SyncAck.update_norm_ratio
    update_projection_min: float = math.nan  # the smallest SyncAck.update_projection
    norm_noise: float = 0.0  # the largest SyncAck.norm_noise (every actor draws the same)

    @classmethod
    def of(cls, version: int, nbytes: int, buckets: int, seconds: float, export_seconds: float,
           acks: list[SyncAck]) -> "WeightSync":
        return cls(version, nbytes, buckets, seconds, export_seconds,
                   receive_seconds_max=max(a.receive_seconds for a in acks),
                   requantize_seconds_max=max(a.requantize_seconds for a in acks),
                   verify_seconds_max=max(a.verify_seconds for a in acks),
                   load_seconds_max=max(a.seconds for a in acks),
                   fingerprint_gap_max=max(a.fingerprint_gap for a in acks),
                   fingerprint_corr_min=min(a.fingerprint_corr for a in acks),
                   code_change_frac_min=_nanmin(a.code_change_frac for a in acks),
                   bf16_change_frac=_nanmin(a.bf16_change_frac for a in acks),
                   update_norm_ratio_min=_nanmin(a.update_norm_ratio for a in acks),
                   update_projection_min=_nanmin(a.update_projection for a in acks),
                   norm_noise=max(a.norm_noise for a in acks))

    def metrics(self) -> dict[str, float]:
        """{"sync/nbytes": ..., ...}: every field but the version, which the step's metrics carry already."""
        return {f"sync/{k}": v for k, v in asdict(self).items() if k != "version"}
