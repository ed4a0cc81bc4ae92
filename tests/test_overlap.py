"""One-step-off-policy training (algo.overlap): step k+1's rollouts are generated while the learner trains on step k.

A real run checks what the option promises: every step trains on its own prompts exactly once and in order, the
rollouts are one update stale from step 2 on (recorded per rollout and in the metrics), checkpoints save the cursor
of trained prompts only, and a resumed run trains on the same prompts as the uninterrupted one. RolloutSource's
ordering and failure handling are unit-tested with a stand-in for the rollout actors.
"""
import json
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from qgrpo.cluster.cli.app import main
from qgrpo.cluster.run.overlap import RolloutSource
from qgrpo.cluster.run.workers import RunFailed
from tests.helpers import CountingSampler, read_metrics

ROOT = Path(__file__).resolve().parents[1]


class _Ro:
    prompts_per_step, group_size, max_new_tokens, temperature, top_p, top_k = 2, 1, 4, 1.0, 1.0, 0


class _Workers:
    """Records which thread generated which prompts; `fail_at` makes that generator step raise."""

    def __init__(self, fail_at: int = 0, gate: threading.Event | None = None):
        self.calls, self.fail_at, self.gate = [], fail_at, gate

    def generate(self, items, sampling, step):
        if self.gate is not None and step > 1:
            assert self.gate.wait(10)
        self.calls.append((step, list(items), sampling.seed, threading.current_thread().name))
        if step == self.fail_at:
            raise RunFailed(f"generate at step {step}: actor lost")
        return [f"g{i}" for i in items], [step]


def test_source_generates_one_step_ahead_in_a_thread():
    gate = threading.Event()  # holds the generation ahead until the learner's part of the step is "done"
    w = _Workers(gate=gate)
    src = RolloutSource(w, CountingSampler(), _Ro, seed=3, overlap=True)
    first = src.take(0, steps=3)
    assert first.groups == ["g0", "g1"] and first.cursor == 2
    assert src.sampler.cursor == 4  # step 1's prompts were drawn at once and are being generated
    assert [c[0] for c in w.calls] == [1]  # ... in the background, not yet finished
    gate.set()
    src.settle()
    second = src.take(1, steps=3)
    assert second.groups == ["g2", "g3"] and second.cursor == 4  # the trained prompts' cursor, not the sampler's
    third = src.take(2, steps=3)  # the last step: nothing is generated ahead of it
    src.settle()
    assert third.groups == ["g4", "g5"] and third.cursor == 6 and src.sampler.cursor == 6
    assert [(c[0], c[1], c[2]) for c in w.calls] == [(1, [0, 1], 3_000_009), (2, [2, 3], 3_000_010),
                                                    (3, [4, 5], 3_000_011)]
    assert w.calls[0][3] != w.calls[1][3]  # the step ahead ran in the source's own thread
    src.close()


def test_source_without_overlap_generates_in_order_in_the_caller():
    w = _Workers()
    src = RolloutSource(w, CountingSampler(), _Ro, seed=0, overlap=False)
    for step in range(3):
        assert src.take(step, 3).cursor == 2 * (step + 1)
        src.settle()
    assert [c[0] for c in w.calls] == [1, 2, 3]
    assert {c[3] for c in w.calls} == {threading.current_thread().name}


def test_source_failure_ahead_surfaces_in_the_driver():
    src = RolloutSource(_Workers(fail_at=2), CountingSampler(), _Ro, seed=0, overlap=True)
    src.take(0, 3)
    with pytest.raises(RunFailed, match="generate at step 2"):
        src.settle()
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


def test_overlap_run_trains_each_prompt_once_one_step_stale(ray_session, tiny_model_path, tmp_path):
    rc = _train(tmp_path / "a", tiny_model_path, "--set", "run.steps=4", "--set", "run.save_every=2")
    assert rc == 0
    (run,) = (tmp_path / "a").iterdir()
    rows = [m for m in read_metrics(run) if "reward/mean" in m]
    assert [m["step"] for m in rows] == [1, 2, 3, 4]
    # step 1 is generated before any update; every later step by the weights one update behind the learner
    assert [m["rollout/staleness"] for m in rows] == [0.0, 1.0, 1.0, 1.0]
    assert [m["rollout/policy_versions"] for m in rows] == [[0], [0], [1], [2]]
    assert all("time/rollout_wait" in m and m["mismatch/kl_mu_old"] == m["mismatch/kl_mu_old"] for m in rows)
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
