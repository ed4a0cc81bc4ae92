"""The precision trials behind `rollout.precision = "auto"`: each precision a backend serves, built as a rollout
actor builds it, timed on a few decode steps of a run's rows, and put to the precision guard's two tests.

A trial builds the generator (loading and quantizing the model), samples one short warm-up call, then `repeats` calls
of the run's rows, and keeps the best seconds per sampled token (prefill included, as a rollout pays it). The guard's
tests are the learner's, applied to the trial's samples: every sampled log-prob finite, and the mean k3 estimate of
KL(mu || pi) at most `max_kl` (guard.max_mismatch_kl; 0 = no bound), where mu is the trial's sampler and pi the
`reference` precision's generator scoring the same tokens (the unquantized one, which the learner's BF16 policy is
closest to). Trials sample at temperature 1 without top-k or top-p, so that a sampled log-prob and a score compare.
The quantized precisions run first and the reference last, which scores their samples before it closes: one model is
held at a time.

`choose` takes the fastest accepted trial. Nothing here reads a config: cluster/run/precision_auto.py builds the
generators and the prompts of a run.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from qgrpo.rollout.backends import AUTO

if TYPE_CHECKING:
    from qgrpo.core.records import GroupRollout, PromptItem, SamplingParams
    from qgrpo.rollout.backends import Generator


@dataclass
class Trial:
    """One precision's trial. `error`: why it could not run here; `rejected`: which guard test it failed."""

    precision: str
    tokens_per_s: float = 0.0
    load_s: float = 0.0
    memory_mb: float = 0.0
    tokens: int = 0  # sampled in the timed call kept
    nonfinite: int = 0  # sampled log-probs that were NaN or infinite
    mismatch_kl: float | None = None  # mean k3 KL(mu || reference); None for the reference, or unmeasured
    error: str = ""
    rejected: str = ""

    @property
    def accepted(self) -> bool:
        return not self.error and not self.rejected

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _first_line(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0][:200]}" if lines else type(err).__name__


def _sequences(groups: list[GroupRollout], limit: int) -> list[tuple[list[int], int, list[float]]]:
    """Up to `limit` samples as (prompt and completion ids, prompt length, sampled log-probs), one per group first."""
    rows = []
    for j in range(max((len(g.completions) for g in groups), default=0)):
        for g in groups:
            if j < len(g.completions) and g.completions[j].token_ids:
                c = g.completions[j]
                rows.append((g.prompt_ids + c.token_ids, len(g.prompt_ids), c.logprobs))
    return rows[:limit]


def mismatch_k3(reference: Generator, samples: list[tuple[list[int], int, list[float]]]) -> float:
    """Mean over the sampled tokens of r - 1 - log r, r = pi / mu (pi: `reference`'s score of the token, mu: the
    sampler's log-prob): the k3 estimate of KL(mu || pi) that the learner's guard bounds (mismatch/kl_mu_old). NaN
    when a log-prob is not finite."""
    total, count = 0.0, 0
    for ids, prompt_len, logprobs in samples:
        scores = reference.score(ids)[prompt_len - 1:prompt_len - 1 + len(logprobs)]
        for pi, mu in zip(scores, logprobs):
            lr = pi - mu
            total += math.expm1(lr) - lr if math.isfinite(lr) else math.nan
            count += 1
    return total / count if count else 0.0


def _timed(gen: Generator, items: list[PromptItem], sampling: SamplingParams, repeats: int, trial: Trial):
    """The warm-up call, then the timed calls: the groups of the fastest, its rate set on `trial`."""
    gen.generate(items[:1], dataclasses.replace(sampling, group_size=1, max_new_tokens=min(2, sampling.max_new_tokens)))
    best, kept = math.inf, []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        groups = gen.generate(items, sampling)
        seconds = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
        if tokens and seconds / tokens < best:
            best, kept, trial.tokens = seconds / tokens, groups, tokens
    trial.tokens_per_s = 1.0 / best if kept else 0.0
    return kept


def measure(make: Callable[[str], Generator], precisions: list[str], items: list[PromptItem],
            sampling: SamplingParams, max_kl: float, reference: str = "bf16", repeats: int = 2,
            scored: int = 8) -> list[Trial]:
    """A trial of each of `precisions`, in their order; `make(precision)` builds a generator. `scored`: the samples
    per precision the reference scores for the mismatch."""
    sampling = dataclasses.replace(sampling, temperature=1.0, top_p=1.0, top_k=0)
    order = [p for p in precisions if p != reference] + [p for p in precisions if p == reference]
    trials, samples = {p: Trial(p) for p in precisions}, {}
    for p in order:
        trial = trials[p]
        try:
            t0 = time.perf_counter()
            gen = make(p)
            trial.load_s = time.perf_counter() - t0
            try:
                groups = _timed(gen, items, sampling, repeats, trial)
                trial.memory_mb = gen.memory_bytes().get("total", 0) / 2 ** 20
                trial.nonfinite = sum(not math.isfinite(x) for g in groups for c in g.completions for x in c.logprobs)
                samples[p] = _sequences(groups, scored)
                if p == reference:
                    for other, seqs in samples.items():
                        if other != reference and not trials[other].error and not trials[other].nonfinite:
                            trials[other].mismatch_kl = mismatch_k3(gen, seqs)
            finally:
                gen.close()
        except Exception as e:  # a precision that cannot run here (a kernel missing on this CPU, a package): left out
            trial.error = _first_line(e)
        if not trial.error and not trial.tokens:
            trial.error = "sampled no tokens"
    for t in trials.values():
        if t.error:
            continue
        if t.nonfinite:
            t.rejected = f"{t.nonfinite} sampled log-probs not finite"
        elif t.mismatch_kl is not None and (not math.isfinite(t.mismatch_kl) or 0 < max_kl < t.mismatch_kl):
            t.rejected = f"mismatch KL {t.mismatch_kl:.3g} > guard.max_mismatch_kl {max_kl:g}"
    return [trials[p] for p in precisions]


def choose(trials: list[Trial]) -> Trial | None:
    """The fastest accepted trial; None when none was accepted."""
    accepted = [t for t in trials if t.accepted]
    return max(accepted, key=lambda t: t.tokens_per_s) if accepted else None


def table(trials: list[Trial], chosen: Trial | None) -> list[str]:
    """The trials as aligned lines: precision, tokens/s, against the reference, load seconds, memory, mismatch, and
    the verdict (chosen, or why not)."""
    base = next((t.tokens_per_s for t in trials if t.precision == "bf16" and t.tokens_per_s), 0.0)
    lines = [f"{'precision':<9} {'tokens/s':>9} {'vs bf16':>7} {'load s':>6} {'MiB':>7} {'mismatch':>9}  verdict"]
    for t in trials:
        if t.error:
            lines.append(f"{t.precision:<9} {'-':>9} {'-':>7} {'-':>6} {'-':>7} {'-':>9}  cannot run here: {t.error}")
            continue
        ratio = f"{t.tokens_per_s / base:.2f}x" if base else "-"
        kl = "-" if t.mismatch_kl is None else f"{t.mismatch_kl:.4f}"
        verdict = "chosen" if t is chosen else (f"rejected: {t.rejected}" if t.rejected else "slower")
        lines.append(f"{t.precision:<9} {t.tokens_per_s:>9.1f} {ratio:>7} {t.load_s:>6.1f} {t.memory_mb:>7.1f} "
                     f"{kl:>9}  {verdict}")
    return lines


__all__ = ["AUTO", "Trial", "measure", "choose", "table", "mismatch_k3"]
