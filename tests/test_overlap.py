"""One-step-off-policy training (algo.overlap), an alias of the rollout supply at staleness 1 whose step k+1 is drawn
when the learner takes step k (learner/objective/staleness.py), and the synchronous supply beside it.

A real run checks what the option promises: every step trains on its own prompts exactly once and in order, the
rollouts are at most one update stale from step 2 on (recorded per token and in the metrics), checkpoints save the
cursor of trained prompts only, and a resumed run trains on the same prompts as the uninterrupted one. The supply's
ordering and failure handling are unit-tested over a stand-in for the rollout pool (tests/helpers.py: FakePool).
"""
import json
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from qgrpo.cluster.cli.app import main
from qgrpo.cluster.run.stream import RolloutStream
from qgrpo.cluster.run.supervisor import RunFailed
from qgrpo.learner.objective.staleness import admission
from tests.helpers import CountingSampler, FakePool, read_metrics

ROOT = Path(__file__).resolve().parents[1]


class _Ro:
    prompts_per_step, group_size, max_new_tokens, temperature, top_p, top_k = 2, 1, 4, 1.0, 1.0, 0


class _Generator:
    """Records which prompts each call generated; `fail_at` makes that generator step raise; with `gate`, steps
    after the first wait for it."""

    def __init__(self, fail_at: int = 0, gate: threading.Event | None = None):
        self.calls, self.fail_at, self.gate = [], fail_at, gate

    def __call__(self, items, sampling, step):
        if self.gate is not None and step > 1:
            assert self.gate.wait(10)
        self.calls.append((step, list(items), sampling.seed))
        if step == self.fail_at:
            raise RunFailed(f"generate at step {step}: actor lost")
        return [_Group(f"g{i}", step - 1) for i in items], _Stats(step)


class _Group(str):
    """A group's stand-in: its name, and the version that sampled it."""

    def __new__(cls, name: str, version: int):
        g = super().__new__(cls, name)
        g.policy_version = version
        return g


class _Stats:
    def __init__(self, step):
        self.seconds, self.policy_version = 0.01, step - 1


def _supply(gen, seed: int = 0, overlap: bool = False, steps: int = 3) -> RolloutStream:
    return RolloutStream(FakePool(gen), CountingSampler(), _Ro, seed=seed, rule=admission(0, 1, overlap),
                         start_step=0, published=0, steps=steps)


def test_overlap_draws_the_next_step_when_the_learner_takes_a_step():
    gate = threading.Event()  # holds the generation ahead until the learner's part of the step is "done"
    gen = _Generator(gate=gate)
    src = _supply(gen, seed=3, overlap=True)
    first = src.take(0)
    assert first.groups == ["g0", "g1"] and first.cursor == 2
    assert src.sampler.cursor == 4  # step 1's prompts were drawn at once and are being generated
    assert [c[0] for c in gen.calls] == [1]  # ... behind the gate, not yet finished
    assert src.next_step == 2  # a checkpoint now would keep step 1 in its snapshot
    gate.set()
    src.advance(1, 1)
    second = src.take(1)
    assert second.groups == ["g2", "g3"] and second.cursor == 4  # the trained prompts' cursor, not the sampler's
    src.advance(2, 2)
    third = src.take(2)  # the last step: nothing is drawn beyond it
    assert third.groups == ["g4", "g5"] and third.cursor == 6 and src.sampler.cursor == 6
    assert sorted((c[0], c[1], c[2]) for c in gen.calls) == [(1, [0, 1], 3_000_009), (2, [2, 3], 3_000_010),
                                                             (3, [4, 5], 3_000_011)]
    assert "stream/staleness_max" in third.stream  # stale rollouts are reported
    src.close()


def test_synchronous_supply_draws_each_step_when_asked_and_keeps_nothing_beyond():
    gen = _Generator()
    src = _supply(gen)
    for step in range(3):
        taken = src.take(step)
        assert taken.cursor == src.sampler.cursor == 2 * (step + 1)  # nothing drawn ahead
        assert taken.stream == {} and src.snapshot() is None  # a synchronous checkpoint holds no buffer
        src.advance(step + 1, step + 1)
    assert [c[0] for c in gen.calls] == [1, 2, 3]
    src.close()


def test_a_failure_surfaces_in_the_driver():
    src = _supply(_Generator(fail_at=2), overlap=True)
    src.take(0)
    src.advance(1, 1)
    with pytest.raises(RunFailed, match="generate at step 2"):
        src.take(1)
    src.close()


def _train(out: Path, tiny_model_path: str, *extra: str) -> int:
    return main(["train", str(ROOT / "configs" / "tiny.toml"), "--set", f"model.path='{tiny_model_path}'",
                 "--set", f"run.output_dir='{out}'", "--set", "run.progress=false", "--set", "run.eval=false",
                 "--set", "algo.overlap=true", "--set", "run.rollouts_flush_every=1", *extra])


def _prompts_by_step(run_dir: Path) -> dict[int, list[str]]:
    t = pq.read_table(run_dir / "rollouts").to_pydict()
    out: dict[int, list[str]] = {}
    for step, pid in zip(t["step"], t["prompt_id"]):
        if pid not in out.setdefault(step, []):
            out[step].append(pid)
    return out


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
def test_overlap_run_trains_each_prompt_once_one_step_stale(ray_session, tiny_model_path, tmp_path):
    rc = _train(tmp_path / "a", tiny_model_path, "--set", "run.steps=4", "--set", "run.save_every=2")
    assert rc == 0
    (run,) = (tmp_path / "a").iterdir()
    rows = [m for m in read_metrics(run) if "reward/mean" in m]
    assert [m["step"] for m in rows] == [1, 2, 3, 4]
    # step 1 is generated before any update; every later step starts on the weights one update behind the learner
    # (a sync may reach its completions between two decode steps: the mean over its tokens is then below 1)
    assert rows[0]["rollout/staleness"] == 0.0 and all(0 < m["rollout/staleness"] <= 1 for m in rows[1:])
    assert [m["rollout/policy_versions"] for m in rows] == [[0], [0], [1], [2]]
    assert all(m["stream/staleness_max"] <= 1 and m["mismatch/kl_mu_old"] == m["mismatch/kl_mu_old"] for m in rows)
    t = pq.read_table(run / "rollouts").to_pydict()
    assert {s: set() for s in t["step"]}.keys() == {1, 2, 3, 4}
    assert {(s, st) for s, st in zip(t["step"], t["staleness"])} == {(1, 0), (2, 1), (3, 1), (4, 1)}
    prompts = _prompts_by_step(run)
    n = len(prompts[1])
    flat = [p for s in sorted(prompts) for p in prompts[s]]
    assert len(flat) == len(set(flat)) == 4 * n  # each prompt trained exactly once
    assert flat == sorted(flat, key=lambda p: int(p.rsplit("-", 1)[1]))  # in order
    state = json.loads((run / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["cursor"] == 2 * n  # step 3's prompts were drawn (generated ahead) but not trained

    # Resumed from step 2: steps 3-4 train on the same prompts as the uninterrupted run.
    resumed = tmp_path / "b"
    rc = _train(resumed, tiny_model_path, "--set", "run.steps=2", "--set", "run.save_every=2")
    assert rc == 0
    (rb,) = resumed.iterdir()
    assert main(["train", "--resume", str(rb), "--set", "run.steps=4"]) == 0
    again = _prompts_by_step(rb)
    assert again[3] == prompts[3] and again[4] == prompts[4]
