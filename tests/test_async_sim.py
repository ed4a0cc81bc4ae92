"""bench/async_sim.py's model of the step loop: the synchronous step is the sum of its stages, overlap and
asynchronous rollouts are never slower than it, the staleness bound holds for every group the learner takes, more
rollout actors never make the learner wait longer, and async at staleness 0 is the synchronous loop. Pure Python,
about a second."""
from __future__ import annotations

import random
import statistics

import pytest

from qgrpo.bench.async_sim import Job, Lengths, Stages, lognormal, simulate

JOB = Job(prompts_per_step=8, group_size=8)
ACTORS = (1, 2, 4, 8, 16)
STEPS, WARMUP = 120, 10


def stages(row_share: float = 1.0, learn_s: float = 10.0) -> Stages:
    return Stages(token_s=0.01, reference_s=3.0, learn_s=learn_s, export_s=0.5, load_s=1.0, rows=64,
                  row_share=row_share)


def constant(n: int) -> Lengths:
    return Lengths(lambda rng: n, JOB.group_size, seed=0)


def tail(sigma: float = 1.5, seed: int = 3) -> Lengths:
    draw, _ = lognormal(16.5, sigma, 512)
    return Lengths(draw, JOB.group_size, seed)


def run(st, lengths, mode, actors, **kw):
    return simulate(st, JOB, lengths, mode, actors, STEPS, WARMUP, **kw)


def test_sync_step_is_the_sum_of_its_stages():
    st = stages()
    gen = 0.01 * 64 * 20  # one actor: 64 rows x 20 tokens at 0.01 s per row and decode step = 12.8 s
    r = run(st, constant(20), "sync", 1)
    assert r["s_per_step"] == pytest.approx(gen + 3.0 + 10.0 + 0.5 + 1.0)  # generate, reference, learn, export, load
    assert r["learner_wait_s"] == pytest.approx(gen + 1.0)
    assert r["learner_utilisation"] == pytest.approx(10.0 / 27.3)
    assert r["staleness_max"] == 0 and r["discarded_frac"] == 0
    # Two actors each decode half the rows; with a step that costs the same at any batch size they do not gain.
    assert run(st, constant(20), "sync", 2)["s_per_step"] == pytest.approx(gen / 2 + 14.5)
    assert run(stages(row_share=0.0), constant(20), "sync", 2)["s_per_step"] == pytest.approx(gen + 14.5)


def test_overlapped_steps_by_hand():
    # A learner slower than generation: one-step-off hides generation but not the sync; async hides the actors'
    # weight loads too, and the learner never waits.
    st = stages(learn_s=30.0)
    assert run(st, constant(20), "one-step-off", 1)["s_per_step"] == pytest.approx(3.0 + 30.0 + 0.5 + 1.0)
    r = run(st, constant(20), "async-1", 1)
    assert r["s_per_step"] == pytest.approx(3.0 + 30.0 + 0.5) and r["learner_wait_s"] == pytest.approx(0, abs=1e-9)
    assert r["staleness_max"] == 1
    # Generation slower than the learner: the sync waits for the rollouts in flight, so a step is generation + sync.
    gen = 0.01 * 64 * 40
    assert run(stages(), constant(40), "one-step-off", 1)["s_per_step"] == pytest.approx(gen + 0.5 + 1.0)
    assert run(stages(), constant(40), "async-2", 1)["s_per_step"] == pytest.approx(gen + 1.0)  # chunk + load


def test_the_longest_completion_holds_the_batch():
    # One completion of 100 tokens among 64 of 10 costs the batch as if every row were 100 tokens long.
    lengths = Lengths(lambda rng: 10, JOB.group_size, seed=0)
    for i in range(0, STEPS * JOB.prompts_per_step, JOB.prompts_per_step):
        lengths[i][0] = 100
    r = run(stages(), lengths, "sync", 1)
    assert r["s_per_step"] == pytest.approx(0.01 * 64 * 100 + 14.5)


@pytest.mark.parametrize("row_share", [1.0, 0.0])
def test_overlap_and_async_are_never_slower_than_sync(row_share):
    st = stages(row_share)
    for actors in ACTORS:
        sync = run(st, tail(), "sync", actors)["s_per_step"]
        for mode in ("one-step-off", "async-1", "async-2", "async-4"):
            assert run(st, tail(), mode, actors)["s_per_step"] <= sync * (1 + 1e-12), (mode, actors)


def test_staleness_of_taken_groups_never_exceeds_the_bound():
    # A heavy tail, a fast learner and decode steps that cost the same at any batch size: late groups would break
    # the bound here, so the learner has to drop some (the bound is exercised, not vacuous).
    st = stages(row_share=0.0, learn_s=2.0)
    dropped = 0.0
    for bound in (1, 2, 4):
        for actors in ACTORS:
            for chunk in (0, 1):
                r = run(st, tail(sigma=1.5), f"async-{bound}", actors, chunk_groups=chunk)
                assert r["staleness_max"] <= bound, (bound, actors, chunk)
                dropped += r["discarded_frac"]
    assert dropped > 0
    assert run(st, tail(), "one-step-off", 4)["staleness_max"] == 1
    assert run(st, tail(), "sync", 4)["staleness_max"] == 0


@pytest.mark.parametrize("row_share", [1.0, 0.0])
@pytest.mark.parametrize("mode", ["sync", "one-step-off", "async-1", "async-2", "async-4"])
def test_more_actors_never_make_the_learner_wait_longer(mode, row_share):
    waits = [run(stages(row_share), tail(sigma=1.0), mode, a)["learner_wait_s"] for a in ACTORS]
    assert all(b <= a + 1e-9 for a, b in zip(waits, waits[1:])), waits


@pytest.mark.parametrize("actors", [1, 2, 4, 8])
def test_async_at_staleness_zero_is_the_synchronous_loop(actors):
    st = stages()
    sync, async0 = run(st, tail(), "sync", actors), run(st, tail(), "async-0", actors)
    assert async0["s_per_step"] == pytest.approx(sync["s_per_step"], rel=1e-12)
    assert async0["staleness_max"] == 0 and async0["discarded_frac"] == 0


def test_lognormal_keeps_the_measured_mean_under_its_cap():
    draw, _ = lognormal(16.5, 1.0, 192)
    rng = random.Random(0)
    sample = [draw(rng) for _ in range(40000)]
    assert statistics.fmean(sample) == pytest.approx(16.5, rel=0.02)
    assert max(sample) == 192 and min(sample) >= 1
    assert sum(x > 4 * 16.5 for x in sample) / len(sample) > 0.02  # a long tail: >2% past four times the mean
