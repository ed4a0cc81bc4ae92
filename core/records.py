"""Typed records passed between stages. Plain dataclasses: they cross Ray process boundaries by pickling.

Shape comments use B = sequences in a batch, T = padded sequence length, G = group size.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PromptItem:
    """One task instance. `prompt` is the question given to the model; `reference` what the verifier checks against.
    `history` holds earlier chat turns shown before the question (few-shot examples) as (role, content) pairs."""

    prompt_id: str
    prompt: str
    reference: str
    meta: dict | None = None  # JSON-safe extras for verifiers and logs, e.g. {"split": "eval", "index": 3}
    history: tuple[tuple[str, str], ...] = ()  # e.g. (("user", "Calculate 4 - 1."), ("assistant", "<answer>3</answer>"))


@dataclass(frozen=True)
class SamplingParams:
    group_size: int  # G completions per prompt
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None


@dataclass
class Completion:
    token_ids: list[int]  # [L] sampled tokens, the stop token included when the model emitted it
    logprobs: list[float]  # [L] log mu(token) under the distribution actually sampled from (after temperature/top-p)
    finish_reason: str  # "stop" (emitted EOS) or "length" (hit max_new_tokens)
    text: str  # decoded completion, special tokens removed


@dataclass
class GroupRollout:
    """All G completions of one prompt; a group never spans generators."""

    item: PromptItem
    prompt_ids: list[int]  # [P] tokenized prompt
    completions: list[Completion]  # [G]
    policy_version: int  # version of the weights the generator sampled with
    generator_id: str
    precision: str  # generator precision, e.g. "int4"
    rewards: list[float] = field(default_factory=list)  # [G], filled by the driver
    advantages: list[float] = field(default_factory=list)  # [G], filled by the driver


@dataclass
class GenerationStats:
    generator_id: str
    seconds: float
    new_tokens: int
    policy_version: int
