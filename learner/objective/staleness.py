"""How stale a step's rollouts may be, and how their staleness is counted (plain Python).

One rule covers every way a run gets its rollouts (cluster/run/supply.py): S = algo.max_staleness, U =
algo.update_every, and how far ahead of the step the driver is taking prompts may be drawn (`lookahead`).

- A run trained synchronously samples step c from the weights of the last sync before it: those of step
  U * floor(c / U). The rollouts of step c may come from weights at most S syncs older: step U * floor(c / U) - S * U
  or later (`oldest_weights`). Staleness is bounded at admission, by the weights the actors hold when a step's prompts
  are drawn, never by discarding finished groups (which would bias training towards fast prompts).
- `lookahead`: the steps beyond the one the driver is taking whose prompts may be drawn. 0 draws each step's prompts
  when the driver asks for it, as the synchronous loop always did (and as DAPO's dynamic sampling needs: it draws
  more prompts after a step's rewards are in); 1 with S = 1 is one-step-off training (`algo.overlap`): step k + 1's
  prompts start when the driver takes step k; None: whatever the bound admits (the asynchronous stream).

| setting | S | lookahead |
|---|---|---|
| synchronous (max_staleness = 0), dynamic sampling | 0 | 0 |
| algo.overlap = true (one step off) | 1 | 1 |
| max_staleness = S > 0 | S | any |

A token's age is the number of learner updates between the weights that sampled it and the policy the step trains
from (`token_ages`); a completion spans versions where a weight update reached its generator between two of its
decode steps.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Admission:
    """Which steps' prompts may be drawn, given the weights the rollout actors hold."""

    max_staleness: int  # S: syncs the sampling weights may lag behind a synchronous run's
    update_every: int  # U: learner steps between two syncs
    lookahead: int | None  # steps beyond the driver's whose prompts may be drawn; None: no limit but the bound

    def __post_init__(self):
        if self.max_staleness < 0 or self.update_every < 1 or (self.lookahead is not None and self.lookahead < 0):
            raise ValueError(f"Admission: max_staleness >= 0, update_every >= 1 and lookahead >= 0 (or None) are "
                             f"needed, got {self.max_staleness}, {self.update_every}, {self.lookahead}")

    @property
    def synchronous(self) -> bool:
        """Every step sampled by the weights a synchronous run would use, drawn when the driver asks for it."""
        return self.max_staleness == 0 and self.lookahead == 0

    def oldest_weights(self, step: int) -> int:
        """The oldest weights (in steps trained) that may sample step `step` (0-based)."""
        u = self.update_every
        return max(0, u * (step // u) - self.max_staleness * u)

    def admits(self, step: int, held: int, asked: int) -> bool:
        """May step `step`'s prompts be drawn now? `held`: the steps whose weights the actors hold (the last sync's);
        `asked`: the step the driver is taking (-1 before the first)."""
        ahead = self.lookahead is None or step <= asked + self.lookahead
        return ahead and self.oldest_weights(step) <= held


def admission(max_staleness: int, update_every: int, overlap: bool = False) -> Admission:
    """The rule of an [algo] section: `overlap` (one step off) is S = 1 with lookahead 1; S > 0 draws whatever the
    bound admits; S = 0 is the synchronous loop. The config refuses overlap beside max_staleness > 0."""
    if overlap:
        return Admission(1, update_every, 1)
    return Admission(max_staleness, update_every, 0 if max_staleness == 0 else None)


def token_ages(completions: Iterable[tuple[list[int], list[int] | None]], trained_from: int) -> Counter:
    """Model tokens by age: {k: tokens sampled k updates before `trained_from`} over (per-token versions, model mask
    or None) pairs; environment tokens (mask 0) are not counted."""
    ages: Counter = Counter()
    for versions, mask in completions:
        for v, keep in zip(versions, mask if mask is not None else [1] * len(versions)):
            if keep:
                ages[trained_from - v] += 1
    return ages


def rollout_mode(max_staleness: int | None, overlap: bool | None, num_actors: int | None) -> str:
    """How a run gets its rollouts, in words (learner/objective/staleness.py): synchronous, or a stream with its bound
    (algo.overlap is staleness 1, one step off) and its rollout actors. `None`: the config does not say (default)."""
    actors = num_actors or 1
    on = f"{actors} rollout actor{'s' * (actors != 1)}"
    if overlap:
        return f"a stream one step off (algo.overlap: rollouts at most 1 sync stale), {on}"
    if max_staleness:
        return (f"a stream (algo.max_staleness = {max_staleness}: rollouts at most {max_staleness} "
                f"sync{'s' * (max_staleness != 1)} stale), {on}")
    return f"synchronous (algo.max_staleness = 0: each step samples from the weights it trains), {on}"
