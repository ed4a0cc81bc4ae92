"""The expected step time (cluster/config/machine.py): its arithmetic from given rates and a given model size, on the
shipped configs, and the lines check and train print (steps left on a resume, the rollout mode, no estimate)."""
from __future__ import annotations

import pytest

from qgrpo.cluster.config import machine
from qgrpo.cluster.config.machine import (
    MachineReport,
    ModelSize,
    StepEstimate,
    eval_estimate,
    evaluations,
    step_estimate,
    steps_done,
)
from qgrpo.cluster.config.schema import load_config

SIZE = ModelSize(params=10**8, matrix=10**8, layers=10)
RATE = 100.0  # GFLOP/s
PROMPT = 50


def _cfg(path: str, **sets):
    cfg = load_config(path, check_environment=False)
    for dotted, value in sets.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg


def test_a_single_turn_step_by_stage():
    cfg = _cfg("configs/smollm2_arith.toml")  # 8 prompts x 8, 24 new tokens, checkpointed learner, a reference
    e = step_estimate(cfg, SIZE, PROMPT, RATE)
    fill = machine.COMPLETION_FILL
    train_tokens = 8 * PROMPT + 64 * fill * 24
    forward = 2 * 1e8 * train_tokens / 1e11
    assert e.learn == pytest.approx(4 * forward) and e.reference == pytest.approx(forward)
    decode_step = 2 * 1e8 * 64 / 1e11 + machine.DECODE_S_PER_LAYER * 10
    assert e.generate == pytest.approx(2 * 1e8 * 8 * PROMPT / 1e11 + 24 * decode_step)
    assert e.environment == 0.0 and e.sync == pytest.approx(machine.SYNC_S_PER_GPARAM * 0.1)
    assert e.fixed == machine.FIXED_S
    assert e.total == pytest.approx(e.learn + e.reference + e.generate + e.sync + e.fixed)
    cfg.learner.gradient_checkpointing, cfg.algo.kl_coeff = False, 0.0  # no reference actor without a KL term
    e2 = step_estimate(cfg, SIZE, PROMPT, RATE)
    assert e2.learn == pytest.approx(3 * forward) and e2.reference == 0.0


def test_turns_and_environment_time_count():
    """The calculator: 3 turns of 48 tokens decode 144 steps, and each call to the environment costs its time."""
    single = step_estimate(_cfg("examples/calculator/config.toml", environment__name=""), SIZE, PROMPT, RATE)
    multi = step_estimate(_cfg("examples/calculator/config.toml"), SIZE, PROMPT, RATE, env_call_s=0.01)
    assert multi.generate > 2.5 * single.generate and multi.learn > 2.5 * single.learn
    calls = 64 * (2 + machine.COMPLETION_FILL * 3)
    assert multi.environment == pytest.approx(calls * 0.01 / 2)  # environment.num_workers = 2


def test_a_tiny_model_decodes_at_its_per_layer_cost_not_at_the_matmul_rate():
    cfg = _cfg("examples/openenv_guess/config.toml")  # 5 turns of 2 tokens, 128 trajectories
    tiny = ModelSize(params=10**5, matrix=10**5, layers=2)
    e = step_estimate(cfg, tiny, 10, 1000.0)
    decode = 10 * (2 * 1e5 * 128 / 1e12 + machine.DECODE_S_PER_LAYER * 2)  # 10 steps, at most 1e-4 s of products
    later = 128 * (machine.COMPLETION_FILL * 5 - 1) * (10 + 2)  # turns 2.. prefill each trajectory's context again
    turns = 128 * machine.COMPLETION_FILL * 5 * machine.TURN_S  # the episode loop's work per trajectory and turn
    assert e.generate == pytest.approx(2 * 1e5 * (16 * 10 + later) / 1e12 + decode + turns)
    assert e.generate > 0.9 * 10 * machine.DECODE_S_PER_LAYER * 2
    assert e.total > machine.FIXED_S  # the fixed cost is a floor: no "under 1 s" for a Ray step


def test_the_printed_lines():
    e = StepEstimate(learn=20.0, reference=5.0, generate=10.0, environment=0.0, sync=3.0, fixed=2.0)
    r = MachineReport("cpu", "fp32", "auto: cpu", {"bf16": 1.0, "fp32": 40.0}, e.total, e)
    lines = r.lines(30)
    assert "expected: about 40 s per step, 20 min for 30 steps with the start" in lines[2]  # 1200 s + STARTUP_S
    assert "learner 20 s, reference 5 s, generation 10 s, sync and fixed 5 s" in lines[2]
    assert "measured times" in lines[2] and len(lines) == 3
    resumed = MachineReport("cpu", "fp32", "auto: cpu", {"bf16": 1.0, "fp32": 40.0}, 60.0, None, done=24)
    assert "about 60 s per step, 6 min for the 6 steps left with the start" in resumed.lines(30)[2]  # 360 s + 30 s
    unknown = MachineReport("cpu", "fp32", "", {"bf16": 1.0, "fp32": 1.0}, float("nan"), unknown="no config.json")
    assert unknown.lines(30)[2].startswith("expected: no estimate (no config.json)")


def test_held_out_evaluations_are_counted_and_timed():
    """The default job (30 steps, eval_every 10): before step 1 and at 10, 20, 30; each 100 greedy rows decoded to the
    token budget. A resumed run counts those still due; run.eval off or no held-out prompts: none."""
    cfg = _cfg("configs/smollm2_arith.toml")
    assert (cfg.run.steps, cfg.run.eval_every, cfg.task.eval_size) == (30, 10, 100)
    assert evaluations(cfg) == 4 and evaluations(cfg, done=10) == 2 and evaluations(cfg, done=25) == 1
    assert evaluations(cfg, done=30) == 0
    cfg.run.eval_every = 0
    assert evaluations(cfg) == 2 and evaluations(cfg, done=5) == 1  # before and after only
    cfg.run.eval_every = 7
    assert evaluations(cfg) == 1 + 4 + 1  # 7, 14, 21, 28 and the last
    tokens = cfg.run.eval_max_new_tokens or cfg.rollout.max_new_tokens
    decode_step = 2 * 1e8 * 100 / 1e11 + machine.DECODE_S_PER_LAYER * 10
    prefill = 2 * 1e8 * 100 * PROMPT / 1e11
    assert eval_estimate(cfg, SIZE, PROMPT, RATE) == pytest.approx(prefill + tokens * decode_step)
    cfg.run.eval_max_new_tokens = 2 * tokens
    assert eval_estimate(cfg, SIZE, PROMPT, RATE) == pytest.approx(prefill + 2 * tokens * decode_step)
    cfg.run.eval = False
    assert evaluations(cfg) == 0
    cfg.run.eval, cfg.task.eval_size = True, 0
    assert evaluations(cfg) == 0 and eval_estimate(cfg, SIZE, PROMPT, RATE) == 0.0


def test_the_total_adds_the_evaluations():
    e = StepEstimate(learn=20.0, reference=5.0, generate=10.0, environment=0.0, sync=3.0, fixed=2.0)
    r = MachineReport("cpu", "fp32", "auto: cpu", {"bf16": 1.0, "fp32": 40.0}, e.total, e, eval_s=45.0, evals=4)
    line = r.lines(30)[2]  # 1200 s of steps + STARTUP_S + 180 s
    assert "about 40 s per step, 24 min for 30 steps with the start and 4 held-out evaluations of 45 s each" in line
    one = MachineReport("cpu", "fp32", "", {"bf16": 1.0, "fp32": 40.0}, e.total, e, done=29, eval_s=45.0, evals=1)
    assert "for the 1 steps left with the start and 1 held-out evaluation of 45 s (rough" in one.lines(30)[2]


def test_steps_done_reads_the_checkpoint_folder():
    assert steps_done(None) == 0
    assert steps_done("runs/r/checkpoints/step_000024") == 24
    assert steps_done("s3://b/runs/r/checkpoints/step_000007/") == 7


def test_the_rate_is_the_best_of_short_trials():
    """A trial slowed by another process does not set the rate."""
    trials = iter([{"bf16": 5.0, "fp32": 40.0}, {"bf16": 6.0, "fp32": 160.0}, {"bf16": 4.0, "fp32": 150.0}])
    asked = []

    def measure(seconds):
        asked.append(seconds)
        return next(trials)

    assert machine.best_rates(measure, 1.5, trials=3) == {"bf16": 6.0, "fp32": 160.0}
    assert asked == [0.5, 0.5, 0.5]
    slow = iter([{"fp32": 40.0}, {"fp32": 160.0}])
    ticks = iter([0.0, 5.0])  # the first trial took 5 s: no second
    assert machine.best_rates(lambda seconds: next(slow), 1.0, trials=3, clock=lambda: next(ticks)) == {"fp32": 40.0}


def test_an_agent_programs_step_is_a_range():
    """An agent's calls reach the generators as it makes them: the step is given from every turn's calls decoded
    together to AGENT_SPREAD times that generation, and the run's total as a range too."""
    e = StepEstimate(learn=36.0, reference=10.0, generate=30.0, environment=0.0, sync=2.0, fixed=2.0)
    r = MachineReport("cpu", "bf16", "auto: cpu", {"bf16": 400.0, "fp32": 160.0}, e.total, e, agent=True)
    line = r.lines(10)[2]
    high = e.total + (machine.AGENT_SPREAD - 1) * 30.0  # 110 s
    assert line.startswith(f"expected: 80 s to {high / 60:.0f} min per step, 14 min to {(high * 10 + 30) / 60:.0f} "
                           "min for 10 steps") and "calls are its own" in line
    assert "about" not in line.split("(")[0]
