"""model.compute_dtype = "auto" decided by each CPU role's timed work (cluster/run/compute_auto.py): the choice from
given timings both ways (the issue's Xeon, where fp32 is faster; Zen 4 and AMX, where bf16 is), what the flags prune,
the cache that makes a second check measure nothing, the estimate built from the timings, and the real measurement of
the three roles on the tiny model in a child process. The whole path through `qgrpo train` (the effective config, the
start event, each actor computing in its choice) is asserted on the shared torch run (tests/test_faults.py)."""
from __future__ import annotations

import math

import pytest

from qgrpo.cluster.config import machine
from qgrpo.cluster.config.machine import ModelSize, step_estimate
from qgrpo.cluster.config.schema import load_config
from qgrpo.cluster.run import compute_auto as ca
from qgrpo.cluster.run import role_timing
from qgrpo.cluster.run.compute_auto import FP32_MARGIN, Timing, candidates, decide

DEFAULT_JOB = "configs/smollm2_arith.toml"


def _per_step(dtype: str, seconds: float, units: float = 8.0) -> Timing:
    """A Timing whose step of `units` groups (one call, no fixed part) takes `seconds`."""
    return Timing(dtype, 0.0, seconds / units)


# The default job's learner and reference a step, from the 4-step runs on a 2-core Xeon with AVX512-BF16 and
# no AMX (steps 3-4), and from `qgrpo check` on a 2-core Zen 4 EPYC; AMX: bf16 products 5-7x fp32's (FACTS).
XEON = {"learner": {"bf16": 21.9, "fp32": 13.8}, "reference": {"bf16": 6.0, "fp32": 3.9}}
ZEN4 = {"learner": {"bf16": 8.8, "fp32": 13.3}, "reference": {"bf16": 1.9, "fp32": 3.5}}
AMX = {"learner": {"bf16": 3.1, "fp32": 14.0}, "reference": {"bf16": 0.8, "fp32": 3.7}}


@pytest.mark.parametrize("machine_name, rates, chosen", [("xeon", XEON, "fp32"), ("zen4", ZEN4, "bf16"),
                                                         ("amx", AMX, "bf16")])
def test_auto_takes_the_precision_each_role_measured_faster(machine_name, rates, chosen):
    roles = {role: decide(role, "auto", [_per_step(d, s) for d, s in by.items()], 8, 1) for role, by in rates.items()}
    assert {c.dtype for c in roles.values()} == {chosen}
    took = sum(c.step_seconds() for c in roles.values())
    bf16 = sum(c.step_seconds("bf16") for c in roles.values())
    if machine_name == "xeon":  # the roles' part of the step at least 1.3x faster than the flags' bf16 choice
        assert bf16 / took >= 1.3
        assert "fp32 1.59x faster" in roles["learner"].why and "bf16 21.9 s, fp32 13.8 s a step" in roles["learner"].why
    else:  # nothing changes where bf16 is faster
        assert took == bf16 and "bf16" in roles["learner"].why.split("a step, ")[1]


def test_fp32_within_the_margin_keeps_bf16_and_a_forced_precision_stays():
    near = decide("rollout", "auto", [_per_step("bf16", 5.4 * 1.0), _per_step("fp32", 5.4 / (FP32_MARGIN - 0.05))],
                  8, 1)
    assert near.dtype == "bf16" and "within the 1.10x that keeps bf16" in near.why
    past = decide("rollout", "auto", [_per_step("bf16", 5.4), _per_step("fp32", 5.4 / (FP32_MARGIN + 0.05))], 8, 1)
    assert past.dtype == "fp32"
    forced = decide("learner", "bf16", [_per_step("bf16", 21.9)], 8, 1)
    assert forced.dtype == "bf16" and forced.why.startswith('learner.compute_dtype = "bf16"; measured bf16 21.9 s')
    broken = decide("reference", "auto", [Timing("bf16", error="RuntimeError: no kernel"), _per_step("fp32", 3.0)],
                    8, 1)
    assert broken.dtype == "fp32" and "bf16 could not run" in broken.why
    nothing = decide("reference", "auto", [Timing("bf16", error="A"), Timing("fp32", error="B")], 8, 1)
    assert "no precision could be timed (bf16: A; fp32: B)" in nothing.why and math.isnan(nothing.step_seconds())


def test_the_flags_say_which_precisions_to_time():
    assert candidates("auto", True) == (["bf16", "fp32"], "")
    assert candidates("auto", None) == (["bf16", "fp32"], "")  # a Mac's unlisted flags: time both
    only, why = candidates("auto", False)  # an AVX2-only CPU: bf16 products would be emulated
    assert only == ["fp32"] and "emulated" in why
    assert candidates("fp32", True)[0] == ["fp32"] and candidates("bf16", False)[0] == ["bf16"]


def test_a_step_counts_its_micro_batches_updates_and_decode_steps():
    cfg = load_config(DEFAULT_JOB)
    shape = ca.shape_of(cfg, 78)
    assert (shape.prompt, shape.completion, shape.group, shape.prompts, shape.shared) == (78, 14, 8, 8, True)
    assert ca.run_units(cfg, "learner", shape) == (8.0, 1) and ca.run_units(cfg, "reference", shape) == (8, 1)
    assert ca.run_units(cfg, "rollout", shape) == (24, 1)  # the batch decodes to its token budget
    cfg.learner.micro_batch_per_rank, cfg.algo.updates_per_batch = 16, 2
    assert ca.run_units(cfg, "learner", shape) == (16.0, 8)  # 4 micro-batches, twice


class _Child:
    """Stands in for the measuring process: records the jobs asked of it, answers given timings."""

    def __init__(self, seconds: dict):
        self.seconds, self.asked = seconds, []

    def __call__(self, cfg, model_path, shape, vocab, wait, jobs):
        self.asked += [(role, dtype, wait) for role, dtype, _ in jobs]
        return [Timing(dtype, 0.1, self.seconds[role][dtype]) for role, dtype, _ in jobs]


def test_the_choice_is_cached_per_machine_and_becomes_the_effective_config(tiny_model_path, monkeypatch, tmp_path):
    from qgrpo.core import cpu

    monkeypatch.setenv("QGRPO_CACHE", str(tmp_path))
    cfg = load_config("configs/tiny.toml")
    child = _Child({"learner": {"bf16": 2.0, "fp32": 1.0}, "reference": {"bf16": 0.5, "fp32": 0.6},
                    "rollout": {"bf16": 0.1, "fp32": 0.3}})
    monkeypatch.setattr(ca, "in_child", child)
    native = cpu.isa_from({"avx512f", "avx512_bf16"}, "AVX512", {}, name="Xeon-like")
    monkeypatch.setattr(cpu, "isa", lambda: native)
    said = []
    threads = {"learner": 2, "reference": 2, "rollout": 2}
    made = ca.resolve(cfg, tiny_model_path, 12, threads, 16, {"rollout": "spin"}, said.append)
    assert made.roles["learner"].dtype == "fp32" and made.roles["reference"].dtype == "bf16"
    assert made.roles["rollout"].dtype == "bf16"
    assert sorted(child.asked) == sorted([(r, d, "spin" if r == "rollout" else "passive") for r in threads
                                          for d in ("bf16", "fp32")])
    assert len(said) == 1 and "timing 6 role and precision pairs" in said[0]
    effective = made.applied(cfg)
    assert (effective.learner.compute_dtype, effective.reference.compute_dtype, effective.rollout.compute_dtype) == (
        "fp32", "bf16", "bf16")
    assert cfg.learner.compute_dtype == "" and effective.compute_dtype_of("learner") == "fp32"  # the given config kept
    assert made.note.startswith(ca.NOTE) and "learner fp32 (auto: measured" in made.note
    assert set(made.record) == {"learner", "reference", "rollout"}
    # a second check of the same job on the same machine measures nothing
    child.asked.clear()
    again = ca.resolve(cfg, tiny_model_path, 12, threads, 16, {"rollout": "spin"}, said.append)
    assert child.asked == [] and len(said) == 1 and again.roles["learner"].dtype == "fp32"
    assert all(t.cached for c in again.roles.values() for t in c.timings)
    # other threads are another machine key: measured again; a forced role is timed alone
    cfg.rollout.compute_dtype = "fp32"
    ca.resolve(cfg, tiny_model_path, 12, {**threads, "learner": 1}, 16, {"rollout": "spin"})
    assert sorted(child.asked) == [("learner", "bf16", "passive"), ("learner", "fp32", "passive")]
    # an AVX2-only CPU: bf16 is not timed at all
    monkeypatch.setattr(cpu, "isa", lambda: cpu.isa_from({"avx2"}, "AVX2", {}, name="EPYC-like"))
    child.asked.clear()
    cfg.rollout.compute_dtype = ""
    plain = ca.resolve(cfg, tiny_model_path, 12, threads, 16, {})
    assert {d for _, d, _ in child.asked} == {"fp32"} and set(plain.record) == {"learner", "reference", "rollout"}
    assert "no native bf16" in plain.roles["learner"].why


def test_the_estimate_takes_each_timed_role_in_its_choice():
    cfg = load_config(DEFAULT_JOB)
    size = ModelSize(params=10**8, matrix=10**8, layers=10)
    roles = {"learner": decide("learner", "auto", [Timing("bf16", 0.5, 2.0), Timing("fp32", 0.4, 1.0)], 8, 1),
             "reference": decide("reference", "auto", [Timing("bf16", 0.1, 0.2), Timing("fp32", 0.2, 0.3)], 8, 1),
             "rollout": decide("rollout", "auto", [Timing("bf16", 0.3, 0.15)], 24, 1)}
    e = step_estimate(cfg, size, 50, 100.0, compute=ca.ComputeChoice(roles))
    assert e.learn == pytest.approx(0.4 + 8 * 1.0) and e.reference == pytest.approx(0.1 + 8 * 0.2)
    assert e.generate == pytest.approx(0.3 + 24 * 0.15)
    plain = step_estimate(cfg, size, 50, 100.0)  # untimed: the rate's arithmetic, as on a cluster
    assert plain.learn != e.learn and plain.sync == e.sync and plain.fixed == e.fixed
    # the held-out evaluation: 100 greedy rows, the prefill by prompts and the decode step beyond its products kept
    per_row = 2 * 1e8 / 1e11
    beyond = max(0.15 - 64 * per_row, 0.0)
    assert machine.eval_estimate(cfg, size, 50, 100.0, ca.ComputeChoice(roles)) == pytest.approx(
        0.3 * 100 / 8 + 24 * (beyond + 100 * per_row))


@pytest.mark.heavy
def test_check_times_each_role_for_real_once_per_machine(tiny_model_path, monkeypatch, tmp_path, capsys):
    """`qgrpo check` of the tiny job on a fresh cache, roles timed as a user's check does: the learner's train_step
    through DeepSpeed, the reference scorer and the int4 torch generator, in each precision the CPU's flags allow, in a
    child process with the actors' passive OpenMP wait; each role's line says what was measured and chosen, and the
    cache holds finite times with a per-unit part. A second check measures nothing and says the same."""
    import json
    import pickle
    from pathlib import Path

    from qgrpo.cluster.cli.app import main
    from qgrpo.core.cpu import isa

    monkeypatch.setenv("QGRPO_TIME_ROLES", "1")
    monkeypatch.setenv("QGRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cache = Path(tiny_model_path).parents[1]
    args = ["check", "configs/tiny.toml", "--set", f"model.cache_dir='{cache}'", "--set",
            f"run.output_dir='{tmp_path / 'runs'}'"]
    assert main(args) == 0
    first = capsys.readouterr().out
    tried = ["bf16", "fp32"] if isa().native_bf16 is not False else ["fp32"]
    assert f"timing {3 * len(tried)} role and precision pairs of this job" in first, first
    chosen = {}
    for role in ("learner", "reference", "rollout"):
        (line,) = [x for x in first.splitlines() if x.strip().startswith(f"compute:   {role} ")]
        chosen[role] = line.split()[2]
        assert chosen[role] in tried and "(auto: " in line and " a step" in line, line
    (kept,) = json.loads((tmp_path / "cache" / ca.CACHE_FILE).read_text()).values()
    assert len(kept) == 3 * len(tried)
    for value in kept.values():
        assert math.isfinite(value["fixed"]) and math.isfinite(value["per_unit"]) and value["fixed"] >= 0
        assert value["per_unit"] > 0 or value["fixed"] > 0, value
    assert main(args) == 0
    second = capsys.readouterr().out
    assert "timing" not in second
    for role, dtype in chosen.items():
        assert f"compute:   {role} {dtype} (auto: " in second
    # a role that cannot be timed is reported with why, the others are still timed
    cfg = load_config("configs/tiny.toml")
    given, taken = tmp_path / "jobs.pkl", tmp_path / "timings.pkl"
    given.write_bytes(pickle.dumps((cfg, "/nonexistent/model", ca.shape_of(cfg, 8), 32, [("reference", "fp32", 1)])))
    role_timing._child(str(given), str(taken))
    (bad,) = [Timing(**t) for t in pickle.loads(taken.read_bytes())]
    assert bad.error.startswith("OSError: ") and "/nonexistent/model" in bad.error


def test_the_shared_run_timed_its_roles_and_each_actor_computes_in_its_choice(torch_smoke_run):
    """`qgrpo train` of the shared torch run (QGRPO_TIME_ROLES=1, as a user's local run): the run's config.toml holds
    each role's chosen compute_dtype and the times behind it, the start event the timings, and the learner rank and
    the rollout actors report computing in what was chosen for them."""
    import tomllib

    from tests.helpers import read_metrics

    text = (torch_smoke_run / "config.toml").read_text()
    saved = tomllib.loads(text)
    (note,) = [line for line in text.splitlines() if line.startswith(ca.NOTE)]
    (start,) = [e for e in read_metrics(torch_smoke_run) if e.get("event") == "start"]
    record = start["compute_auto"]
    assert set(record) == {"learner", "reference", "rollout"}
    for role, made in record.items():
        assert saved[role]["compute_dtype"] == made["chosen"] in ("bf16", "fp32")
        assert f"{role} {made['chosen']} (auto: " in note
        timed = [t for t in made["timings"] if not t["error"]]
        assert timed and all(t["fixed"] + t["per_unit"] > 0 for t in timed), made
    assert saved["model"]["compute_dtype"] == "auto"  # the user's setting, as given
    (rank,) = start["placement"]["learner"]
    assert rank["compute_dtype"] == record["learner"]["chosen"]
    assert {g["compute_dtype"] for g in start["generators"]} == {record["rollout"]["chosen"]}
