"""Each step's rollouts, generated one step ahead when `algo.overlap` is on (one-step-off-policy training).

With overlap, step k+1's prompts are handed to the generators as soon as step k's rollouts are back, so they are
generated while the driver scores step k and the learner trains on it. They come from the weights the generators
held then (one update behind the learner at `update_every = 1`): the learner's importance weights min(pi_old/mu, C)
correct for that as they do for quantization, since mu is whatever sampled the tokens. `settle()` waits for the
generation in flight before anything else uses the rollout actors (a weight sync, an evaluation, a resize, the
precision ladder), so only one thread ever drives them at a time.

The data cursor a checkpoint saves is the one after the prompts of the step being trained (`StepRollouts.cursor`),
not after the prompts generated ahead: a resumed run generates those again, from the checkpoint's weights.

With `algo.dynamic_sampling` (never with overlap) a step may ask for more prompts (`more`) after its first round;
cluster/run/sampling.py decides how many.
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from qgrpo.core.records import GenerationStats, GroupRollout, SamplingParams


@dataclass
class StepRollouts:
    groups: list[GroupRollout]
    stats: list[GenerationStats]
    cursor: int  # the sampler's cursor after this step's prompts: what a checkpoint taken after this step saves
    # Dynamic sampling (cluster/run/sampling.py): the first round's groups, the step's fresh sample of the policy
    # (`groups` are those kept for the batch), and the generators' time over every round, which run one after another
    first_round: list[GroupRollout] | None = None
    generate_seconds: float | None = None
    stream: dict = dataclasses.field(default_factory=dict)  # algo.max_staleness: the stream/* metrics (stream.py)

    @property
    def sample(self) -> list[GroupRollout]:
        """The step's fresh sample of the policy: what its rollout and reward statistics describe."""
        return self.groups if self.first_round is None else self.first_round

    @property
    def seconds(self) -> float:
        """The generators' own time for this step's rollouts: the slowest actor's (they run side by side), summed
        over dynamic sampling's rounds."""
        return self.generate_seconds if self.generate_seconds is not None else max(s.seconds for s in self.stats)


ROUND_SEED_STRIDE = 1_000_000_007  # dynamic sampling's round r samples with the step's seed + r * this


class RolloutSource:
    def __init__(self, workers, sampler, ro, seed: int, overlap: bool):
        self.workers, self.sampler, self.ro, self.seed = workers, sampler, ro, seed
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rollouts-ahead") if overlap else None
        self.ahead: tuple[int, int, Future] | None = None  # (step, cursor after its prompts, generation)

    def sampling(self, step: int) -> SamplingParams:
        ro = self.ro
        return SamplingParams(ro.group_size, ro.max_new_tokens, ro.temperature, ro.top_p, ro.top_k,
                              seed=self.seed * 1_000_003 + step)

    def _draw(self) -> tuple[int, list]:
        items = self.sampler.next(self.ro.prompts_per_step)
        return self.sampler.cursor, items

    def take(self, step: int, steps: int) -> StepRollouts:
        """Step `step`'s rollouts (0-based; generator step `step + 1`); with overlap, also start step + 1's."""
        if self.ahead is not None and self.ahead[0] == step:
            _, cursor, future = self.ahead
            self.ahead = None
            groups, stats = future.result()
        else:
            cursor, items = self._draw()
            groups, stats = self.workers.generate(items, self.sampling(step), step + 1)
        if self.pool is not None and step + 1 < steps:
            nxt, items = self._draw()
            self.ahead = (step + 1, nxt, self.pool.submit(self.workers.generate, items, self.sampling(step + 1),
                                                          step + 2))
        return StepRollouts(groups, stats, cursor)

    def more(self, step: int, n: int, round_: int) -> StepRollouts:
        """`n` more prompts for step `step` (dynamic sampling's round `round_`, 1 = the first after the step's own),
        drawn after everything drawn so far and generated now, with a seed of the round's own. Not with overlap."""
        if self.pool is not None:
            raise RuntimeError("RolloutSource.more: dynamic sampling cannot run with algo.overlap")
        items = self.sampler.next(n)
        base = self.sampling(step)
        sampling = dataclasses.replace(base, seed=base.seed + round_ * ROUND_SEED_STRIDE)
        groups, stats = self.workers.generate(items, sampling, step + 1)
        return StepRollouts(groups, stats, self.sampler.cursor)

    def before_sync(self) -> None:
        """The next step's rollouts (algo.overlap) are done: the generators are free to sync."""
        self.settle()

    def after_sync(self, done: int, version: int) -> None:
        """Nothing: the next step's prompts are drawn when it is taken (or, with overlap, when this one was)."""

    def resume(self) -> None:
        """Nothing: `take` starts the generations."""

    def settle(self) -> None:
        """Wait until the generation in flight (if any) is done; its failure is raised here, in the driver."""
        if self.ahead is not None:
            wait([self.ahead[2]])
            if self.ahead[2].exception() is not None:
                raise self.ahead[2].exception()

    def snapshot(self) -> dict | None:
        """Nothing beyond the step trained is kept for a checkpoint: a resume draws from the checkpoint's cursor
        (with algo.overlap, the step that was ahead is generated again)."""
        return None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
