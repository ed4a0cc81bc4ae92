"""DAPO's dynamic sampling, overlong reward shaping and overlong filtering (learner/objective/groups.py and
shaping.py, cluster/run/sampling.py, their use in cluster/run/step_data.py).

The penalty, the selection and the filter are checked on hand-computed values; the driver's dynamic loop runs with
stand-ins for the Ray actors only (generators, reward workers, reference): rounds, cursor, prompts drawn, seeds,
metrics. One real 2-step run of configs/tiny.toml checks that the metrics reach metrics.jsonl.
"""
import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qgrpo.cluster.config.schema import load_config
from qgrpo.cluster.run.driver import StageClock
from qgrpo.cluster.run.rewarding import Scored
from qgrpo.cluster.run.step_data import step_data
from qgrpo.cluster.run.stream import RolloutStream
from qgrpo.cluster.run.supply import ROUND_SEED_STRIDE, StepRollouts
from qgrpo.core.records import Completion, GenerationStats, GroupRollout, PromptItem
from qgrpo.learner.batch import pack_rollouts
from qgrpo.learner.objective.groups import has_signal, prompts_to_draw, select_groups
from qgrpo.learner.objective.loss import aggregation_weights, grpo_loss
from qgrpo.learner.objective.settings import objective_settings
from qgrpo.learner.objective.shaping import overlong_penalties, shape_groups, truncated
from qgrpo.learner.objective.staleness import admission
from tests.helpers import CountingSampler, FakePool  # the prompt sampler stand-in: ids 0, 1, 2, ...

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ overlong shaping

def test_overlong_penalty_below_inside_and_at_the_end_of_the_buffer():
    # L_max = 24, buffer 8: free up to 16, then down by 1/8 a token to -1 at 24
    assert overlong_penalties([0, 10, 16, 17, 20, 23, 24], 24, 8, 1.0) == [0.0, 0.0, 0.0, -0.125, -0.5, -0.875, -1.0]
    assert overlong_penalties([20, 24, 30], 24, 8, 0.5) == [-0.25, -0.5, -0.5]  # scaled by P; capped beyond L_max
    assert overlong_penalties([3, 24], 24, 0, 1.0) == [0.0, 0.0]  # buffer 0: off
    assert overlong_penalties([2, 3], 3, 1, 1.0) == [0.0, -1.0]  # the tiny job's setting: only the full length
    for bad in ((24, 24, 1.0), (24, -1, 1.0), (24, 8, 0.0), (24, 8, math.nan)):
        with pytest.raises(ValueError):
            overlong_penalties([1], *bad)


def _group(pid: str, spec: list[tuple[str, int, str]], version: int = 0) -> GroupRollout:
    """A group from (text, length in tokens, finish reason) per completion; the prompt is 2 tokens."""
    comps = [Completion([5] * n, [-0.5] * n, finish, text) for text, n, finish in spec]
    return GroupRollout(item=PromptItem(pid, f"q{pid}", "1"), prompt_ids=[1, 2], completions=comps,
                        policy_version=version, generator_id="fake-0", precision="int4")


def test_shape_groups_adds_the_penalty_and_reports_it():
    a = _group("a", [("1", 2, "stop"), ("1", 4, "length")])
    b = _group("b", [("0", 3, "stop"), ("0", 1, "stop")])
    a, b = dataclasses.replace(a, rewards=[1.0, 1.0]), dataclasses.replace(b, rewards=[0.0, 0.0])
    (a2, b2), m = shape_groups([a, b], max_new_tokens=4, buffer=2, penalty=1.0)  # free up to 2 tokens
    assert a2.rewards == [1.0, 0.0] and b2.rewards == [-0.5, 0.0]
    assert a.rewards == [1.0, 1.0] and b.rewards == [0.0, 0.0]  # new values: the groups given are unchanged
    assert m == {"overlong/penalized_frac": 0.5, "overlong/penalty_mean": -1.5 / 4}
    assert has_signal(a2.rewards) and has_signal(b2.rewards)  # both were flat before the shaping
    assert shape_groups([a], 4, 0, 1.0) == ([a], {})  # off: nothing changes, no metrics


# ------------------------------------------------------------------------------------------------ selection

def test_select_groups_keeps_the_first_with_signal_in_order():
    rewards = [[1, 1], [0, 1], [0, 0], [1, 0], [0.5, 0.2], [0.3, 0.3]]
    assert [has_signal(r) for r in rewards] == [False, True, False, True, True, False]
    assert select_groups(rewards, 2) == ([1, 3], 0)  # at the cap: the first two with signal, the third left
    assert select_groups(rewards, 3) == ([1, 3, 4], 0)
    assert select_groups(rewards, 5) == ([0, 1, 2, 3, 4], 2)  # filled with the first flat groups, in order
    assert select_groups(rewards, 6) == ([0, 1, 2, 3, 4, 5], 3)
    assert select_groups([[1, 1], [2, 2]], 1) == ([0], 1)


def test_prompts_to_draw_follows_the_keep_rate():
    assert prompts_to_draw(missing=2, kept=2, generated=4, cap=16) == 4  # keep rate 1/2
    assert prompts_to_draw(missing=3, kept=3, generated=10, cap=16) == 10  # exact: 3 / 0.3 is 10.000000000000002
    assert prompts_to_draw(missing=1, kept=3, generated=8, cap=16) == 3  # ceil(8 / 3)
    assert prompts_to_draw(missing=3, kept=1, generated=10, cap=16) == 12  # rate 0.1, floored at 1/4: 4x missing
    assert prompts_to_draw(missing=2, kept=0, generated=8, cap=16) == 8  # no signal yet: the floor too
    assert prompts_to_draw(missing=5, kept=0, generated=8, cap=16) == 16  # 20, capped at prompts_per_step
    assert prompts_to_draw(missing=3, kept=1, generated=4, cap=4) == 4
    assert prompts_to_draw(missing=0, kept=4, generated=4, cap=4) == 0


# ------------------------------------------------------------------------------------------------ overlong filter

def test_the_truncated_rows_are_left_out_and_tokens_recounted():
    groups = [_group("a", [("1", 2, "stop"), ("0", 4, "length")]), _group("b", [("1", 4, "length"), ("0", 3, "stop")])]
    packed = pack_rollouts(groups, 0, 4)
    batch = packed.train_batch(torch.tensor([1.0, -1.0, 1.0, -1.0]))
    assert batch.total_tokens == 13.0 and batch.completion_mask.shape == (4, 6)
    assert truncated(groups) == [False, True, True, False]
    out = packed.without(truncated(groups)).train_batch(batch.advantages)
    assert out.completion_mask.sum(dim=1).tolist() == [2.0, 0.0, 0.0, 3.0]
    assert torch.equal(out.completion_mask[[0, 3]], batch.completion_mask[[0, 3]])
    assert out.total_tokens == 5.0 and out.total_sequences == 4  # the sequence count stays
    assert packed.completion_mask.sum() == 13  # the input is not changed
    with pytest.raises(ValueError):
        packed.without(truncated(groups[:1]))


def test_a_wholly_filtered_batch_has_a_finite_zero_loss():
    groups = [_group("a", [("1", 3, "length"), ("0", 3, "length")])]
    batch = pack_rollouts(groups, 0, 3).without(truncated(groups)).train_batch(torch.tensor([1.0, -1.0]))
    assert batch.total_tokens == 0.0
    logp = torch.full(batch.input_ids.shape, -0.4, requires_grad=True)
    for agg in ("token_mean", "seq_mean", "constant"):
        w = aggregation_weights(batch.completion_mask, agg, num_sequences=batch.total_sequences,
                                num_tokens=batch.total_tokens, max_len=batch.max_new_tokens)
        loss, stats = grpo_loss(logp, logp.detach(), batch.mu_logp, batch.mu_logp, batch.advantages,
                                batch.completion_mask, w, objective_settings(kl_coeff=0.1))
        loss.backward()
        assert loss.item() == 0.0 and stats["tokens"] == 0 and torch.isfinite(logp.grad).all()


# ------------------------------------------------------------------------------------------------ the driver's loop

class _Workers:
    """Stands in for the rollout actors (one actor's call: groups and its stats): prompt i's two completions are
    SPEC[i] (else two flat "0"s of 1 token); each call takes 1 s of generator time."""

    def __init__(self, spec, log):
        self.spec, self.log, self.calls = spec, log, []
        self.reference = object()

    def generate(self, items, sampling, step):
        self.calls.append((list(items), sampling.seed, step))
        self.log.append("generate")
        groups = [_group(f"p-{i}", self.spec.get(i, [("0", 1, "stop"), ("0", 1, "stop")])) for i in items]
        return groups, GenerationStats("fake-0", 1.0, sum(len(c.token_ids) for g in groups for c in g.completions), 0)

    def reference_logprobs(self, batch):
        self.log.append("reference")
        return torch.zeros(batch.input_ids.shape)


class _Rewards:
    """Stands in for the reward pool: a completion's reward is its text as a number; `result` reports the mean of
    the groups it scored and, as `reward/workers_replaced`, how many times it was asked."""

    def __init__(self, log):
        self.log, self.asked = log, 0

    def submit(self, groups, step=0):
        self.asked += 1
        pool = self

        class Pending:
            def result(self):
                pool.log.append("rewards")
                scored = [dataclasses.replace(g, rewards=[float(c.text) for c in g.completions]) for g in groups]
                flat = [r for g in scored for r in g.rewards]
                return Scored(scored, {"reward/mean": sum(flat) / len(flat), "reward/workers_replaced": pool.asked})

        return Pending()


def _run(spec, rounds=3, buffer=0, overlong_filter=False, per_step=4, max_new_tokens=4, dynamic=True):
    # the real Config: a field the driver reads that the schema renamed breaks this test, not only the driver
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"rollout.prompts_per_step={per_step}", "rollout.group_size=2", f"rollout.max_new_tokens={max_new_tokens}",
        "rollout.temperature=1.0", "rollout.top_p=1.0", "rollout.top_k=0",
        f"algo.dynamic_sampling={str(dynamic).lower()}",
        f"algo.dynamic_sampling_rounds={rounds}", "algo.advantage_scale='none'", f"algo.overlong_buffer={buffer}",
        "algo.overlong_penalty=1.0", f"algo.overlong_filter={str(overlong_filter).lower()}", "run.steps=10"],
        check_environment=False)
    log: list[str] = []
    workers = _Workers(spec, log)
    return SimpleNamespace(cfg=cfg, workers=workers, rewards=_Rewards(log), supply=None), log


def _supply(workers, ro, step: int, overlap: bool = False) -> RolloutStream:
    """The run's supply over the stand-in generators, starting at `step` with its weights held."""
    return RolloutStream(FakePool(workers.generate), CountingSampler(), ro, seed=1, rule=admission(0, 1, overlap),
                         start_step=step, published=step, steps=10)


MIXED = [("1", 1, "stop"), ("0", 1, "stop")]


def _step(run, step, clock):
    run.supply = _supply(run.workers, run.cfg.rollout, step)
    try:
        data = step_data(run, step, clock)
    finally:
        run.supply.close()
    return data.rollouts, data.batch, data.reward_metrics


def test_dynamic_loop_draws_by_keep_rate_until_the_batch_is_full():
    # round 1: prompts 0-3, signal in 0, 1 (keep rate 1/2, 2 missing: 4 more); round 2: 4-7, signal in 4 (3 of 8,
    # 1 missing: ceil(8 / 3) = 3 more); round 3: 8-10, signal in 9: full
    run, log = _run({0: MIXED, 1: MIXED, 4: MIXED, 9: MIXED, 10: MIXED})
    clock = StageClock()
    rollouts, batch, m = _step(run, 2, clock)
    assert [c[0] for c in run.workers.calls] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    base = 1 * 1_000_003 + 2
    assert [c[1] for c in run.workers.calls] == [base, base + ROUND_SEED_STRIDE, base + 2 * ROUND_SEED_STRIDE]
    assert {c[2] for c in run.workers.calls} == {3}  # every round generates for the same step
    assert [g.item.prompt_id for g in rollouts.groups] == ["p-0", "p-1", "p-4", "p-9"]  # p-10 is past the cap
    assert rollouts.cursor == 11 and run.supply.sampler.cursor == 11  # after every prompt drawn this step
    assert len(rollouts.stats) == 3 and rollouts.seconds == 3.0  # every round's generation, rounds add up
    assert [g.item.prompt_id for g in rollouts.sample] == ["p-0", "p-1", "p-2", "p-3"]  # the first round
    assert m["reward/mean"] == 0.25  # the first round's 8 completions (2 right), not the batch's (4 of 8)
    assert m["reward/workers_replaced"] == 3  # the last round's count
    assert (m["dynamic/rounds"], m["dynamic/extra_prompts"], m["dynamic/topped_up"]) == (3, 7, 0)
    assert m["dynamic/dropped_group_frac"] == pytest.approx(6 / 11)  # 11 groups, 5 with signal
    assert not any(k.startswith("overlong/") for k in m)  # both overlong options off
    assert len(batch) == 8 and batch.advantages.tolist() == [0.5, -0.5] * 4
    assert batch.ref_logp is not None and log[-1] == "reference"  # the reference scores the batch kept, at the end
    assert log == ["generate", "rewards"] * 3 + ["reference"]
    assert set(clock.seconds) == {"generate", "rewards", "pack", "reference"}


def test_dynamic_loop_stops_early_and_tops_up_when_the_rounds_run_out():
    run, _ = _run({1: MIXED, 2: MIXED, 3: MIXED, 0: MIXED})  # every first-round group has signal: one round
    rollouts, _, m = _step(run, 0, StageClock())
    assert len(run.workers.calls) == 1 and rollouts.cursor == 4
    assert (m["dynamic/rounds"], m["dynamic/extra_prompts"], m["dynamic/topped_up"]) == (1, 0, 0)
    assert m["dynamic/dropped_group_frac"] == 0.0

    run, _ = _run({1: MIXED}, rounds=2)  # 1 of 4 with signal: the floor, 12 wanted, capped at 4; none has signal
    rollouts, batch, m = _step(run, 0, StageClock())
    assert [c[0] for c in run.workers.calls] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [g.item.prompt_id for g in rollouts.groups] == ["p-0", "p-1", "p-2", "p-3"]  # filled with p-0, p-2, p-3
    assert rollouts.cursor == 8
    assert (m["dynamic/rounds"], m["dynamic/extra_prompts"], m["dynamic/topped_up"]) == (2, 4, 3)
    assert m["dynamic/dropped_group_frac"] == 7 / 8
    assert batch.advantages.tolist() == [0.0, 0.0, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0]  # the filled groups: 0


def test_dynamic_loop_keeps_groups_the_overlong_shaping_split_and_filters_cut_ones():
    # prompt 0 is flat in its rewards but not in its lengths: the shaping gives it signal (max_new_tokens 4,
    # buffer 2: a 4-token completion loses 1); prompt 1 is mixed, but its right answer is cut at the length
    spec = {0: [("1", 2, "stop"), ("1", 4, "length")], 1: [("1", 4, "length"), ("0", 1, "stop")],
            4: MIXED, 5: MIXED}
    run, _ = _run(spec, rounds=2, buffer=2, overlong_filter=True)
    rollouts, batch, m = _step(run, 0, StageClock())
    assert [g.item.prompt_id for g in rollouts.groups] == ["p-0", "p-1", "p-4", "p-5"]
    assert rollouts.groups[0].rewards == [1.0, 0.0] and rollouts.groups[1].rewards == [0.0, 0.0]  # 1 - 1 = 0
    # p-1 became flat by the shaping: 1 of 4 kept in round 1 -> 4 more prompts, 2 with signal; p-1 fills the batch
    assert m["dynamic/rounds"] == 2 and m["dynamic/topped_up"] == 1 and m["dynamic/dropped_group_frac"] == 5 / 8
    assert m["overlong/penalized_frac"] == 2 / 8 and m["overlong/penalty_mean"] == -2 / 8  # the first round's
    assert m["overlong/filtered_frac"] == 2 / 8  # the batch's: p-0's and p-1's cut completions
    assert batch.completion_mask.sum(dim=1).tolist() == [2.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert batch.total_tokens == 7.0


def test_the_parallel_path_shapes_before_the_advantages_and_filters():
    spec = {0: [("1", 2, "stop"), ("1", 4, "length")]}
    run, log = _run(spec, buffer=2, overlong_filter=True, per_step=2, dynamic=False)
    rollouts, batch, m = _step(run, 0, StageClock())
    groups = rollouts.groups
    assert groups[0].rewards == [1.0, 0.0] and batch.advantages.tolist() == [0.5, -0.5, 0.0, 0.0]
    assert groups[0].advantages == [0.5, -0.5] and rollouts.sample == groups  # the record trained on, logged
    assert m["overlong/penalized_frac"] == 0.25 and m["overlong/filtered_frac"] == 0.25
    assert batch.total_tokens == 4.0 and log == ["generate", "reference", "rewards"]  # reference and rewards overlap


def test_a_supply_that_draws_ahead_refuses_more_prompts():
    src = _supply(_Workers({}, []), _run({})[0].cfg.rollout, 0, overlap=True)
    with pytest.raises(RuntimeError, match="synchronous supply"):
        src.more(0, 2, 1)
    src.close()
    assert StepRollouts([], [GenerationStats("a", 2.0, 1, 0), GenerationStats("b", 3.0, 1, 0)], 0).seconds == 3.0


# ------------------------------------------------------------------------------------------------ a real run

@pytest.mark.slow
def test_tiny_run_with_dynamic_sampling_and_overlong_options(ray_session, tiny_model_path, tmp_path):
    from qgrpo.cluster.cli.app import main

    rc = main(["train", str(ROOT / "configs" / "tiny.toml"), "--set", f"model.path='{tiny_model_path}'",
               "--set", f"run.output_dir='{tmp_path}'", "--set", "run.steps=2", "--set", "run.progress=false",
               "--set", "run.eval=false", "--set", "algo.dynamic_sampling=true", "--set", "algo.overlong_buffer=1",
               "--set", "algo.overlong_filter=true", "--set", "rollout.temperature=0.3",
               "--set", "rollout.group_size=4"])
    assert rc == 0  # a cooler sampler and smaller groups: some groups come out flat (here step 1 needs 2 rounds)
    (run_dir,) = tmp_path.iterdir()
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert any(r["dynamic/rounds"] > 1 for r in rows)  # the extra rounds ran for real
    for r in rows:
        assert (r["dynamic/topped_up"] == 0) or r["dynamic/rounds"] == 3  # topped up only when the rounds ran out
        assert 1 <= r["dynamic/rounds"] <= 3 and 0 <= r["dynamic/topped_up"] <= 16
        assert 0.0 <= r["dynamic/dropped_group_frac"] <= 1.0 and 0 <= r["dynamic/extra_prompts"] <= 2 * 16
        assert (r["dynamic/rounds"] == 1) == (r["dynamic/extra_prompts"] == 0)
        assert 0.0 <= r["overlong/penalized_frac"] <= 1.0 and 0.0 <= r["overlong/filtered_frac"] <= 1.0
        assert -1.0 <= r["overlong/penalty_mean"] <= 0.0
        # buffer 1 of max_new_tokens 3: only completions of the full length are penalised, by exactly 1
        assert r["overlong/penalty_mean"] == pytest.approx(-r["overlong/penalized_frac"])
        assert math.isfinite(r["loss/total"])
    state = json.loads((run_dir / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    drawn = sum(16 + r["dynamic/extra_prompts"] for r in rows)
    assert state["cursor"] == drawn  # every prompt drawn, the extra rounds' included
