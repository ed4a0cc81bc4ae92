"""The preflight lines with this machine's numbers: what the CPU roles compute in (model.compute_dtype, core/cpu.py),
the bf16 and fp32 matrix-product rates measured in about a second, and the step time they give the configured job, so
that a user knows before the run whether it takes minutes or hours.

The estimate (`StepEstimate`) adds up a synchronous step's stages, each from the config and this machine:
- learner and reference: their tokens (each prompt once, the group's sequences sharing it; every completion at its
  expected length) at 2 N FLOPs per token and forward (N: the model's matrix parameters, the output head included, the
  input embedding, a lookup, not), 3 forwards' worth for the learner's forward and backward, 4 with gradient
  checkpointing, one for the reference, at the measured rate;
- generation: the prompts' prefill (a later turn's: the trajectory's context so far, again), then one decode step per
  new token of the longest completion, every turn's (environment.max_turns x the turn's tokens in a multi-turn run,
  cluster/config/turns.py: environment.turn_tokens, else rollout.max_new_tokens for an environment's turns and an
  even share of environment.max_context for an agent's uncapped calls; a turn at most its share of max_context): a
  batch decodes until its last row ends. Each decode step costs the batch's products at the measured rate
  plus a cost per layer of one forward beyond its products (launching kernels, Python), which dominates a small
  model: decoding one token at a time runs far below the matrix-product rate;
- the environment: one reset, step and score timed here on the first train row, times the trajectories and turns of
  a step, spread over environment.num_workers; the first turn's prompt is rendered as the episode loop renders it
  (the environment's first messages, its tools' descriptions), and each trajectory's counts in the learner;
- a fixed cost per step (Ray's round trips, rewards, packing), the episode loop's work per trajectory and turn, and
  the weight sync, in proportion to N.
Completions and turns are taken at COMPLETION_FILL of their budget; a resumed run counts the steps it has left, and the
total adds the start (Ray, the actors, their models) and the held-out evaluations (`eval_estimate`: before the first
step, every run.eval_every steps and after the last; each greedy, one completion for each of task.eval_size prompts,
decoded to its token budget like a step's batch: on the AVX2 EPYC the default job's four took 40-55 s each, 3 of its
18 minutes). A stream (algo.max_staleness > 0) may overlap generation with
learning where they do not share the cores; its estimate stays that of a synchronous step. The constants were measured
on a 2-core AMD EPYC (AVX2, no native bf16) from the stages in metrics.jsonl of 3-step runs of the default job,
examples/calculator and examples/openenv_guess (`qgrpo train CONFIG --set run.steps=3 --set run.eval=false`); there the
estimate came within a factor of two of the measured step when the machine's load was the same while the rate was
measured and while the steps ran. The estimate moves with the measured rate, and so with whatever else runs on the
machine at that moment; once steps run, the progress bar's times and ETA are measured ones.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

from qgrpo.cluster.config.schema import Config

# Measured on a 2-core AMD EPYC (module docstring):
COMPLETION_FILL = 0.6  # completion tokens and model turns used, of their budget (default job 55%, calculator turns 47%)
DECODE_S_PER_LAYER = 0.0015  # one decode step's cost per layer beyond its products: 1.4 ms fp32, 1.6 ms bf16
FIXED_S = 0.3  # Ray round trips, rewards, packing and bookkeeping per step (openenv_guess: 0.1-0.2 s)
TURN_S = 0.0006  # each trajectory's turn in the episode loop: rendering, tokenizing, the environment's round trip
RATE_TRIALS = 5  # the rates are each dtype's best of this many short measurements (best_rates)
STARTUP_S = 30.0  # Ray, the actors and their models before the first step (openenv_guess: 22 s; more for larger models)
SYNC_S_PER_GPARAM = 15.0  # the weight sync (export, requantize, load) per billion parameters
# An agent program's calls reach the endpoint as the program makes them, not a turn at a time: the 64 episodes of
# examples/agent_calculator (up to 3 calls of 48 tokens) took 2.1x the generation of their calls decoded together
# (67 s a step against 33), on a 2-core Zen 4 EPYC (bench/published/estimate_accuracy.json). An agent's step is given
# from that batched figure to this many times its generation.
AGENT_SPREAD = 2.2


@dataclass(frozen=True)
class ModelSize:
    params: int  # every parameter (a tied head once)
    matrix: int  # those a token's forward multiplies with: the output head counted, the input embedding not
    layers: int


@dataclass(frozen=True)
class StepEstimate:
    """One synchronous step's stages, seconds."""

    learn: float
    reference: float
    generate: float
    environment: float
    sync: float
    fixed: float

    @property
    def total(self) -> float:
        return self.learn + self.reference + self.generate + self.environment + self.sync + self.fixed

    def parts(self) -> str:
        """The stages in words, those with time in them."""
        parts = [("learner", self.learn), ("reference", self.reference), ("generation", self.generate),
                 ("environment", self.environment), ("sync and fixed", self.sync + self.fixed)]
        return ", ".join(f"{name} {_span(s)}" for name, s in parts if s >= 1)


@dataclass(frozen=True)
class MachineReport:
    cpu: str  # the processor in words (core/cpu.py: ISA.words)
    dtype: str  # what the CPU roles compute in: "bf16" or "fp32"
    why: str
    rates: dict  # GFLOP/s of bf16 and fp32 products, measured here
    step_s: float  # the estimate of one step, seconds (nan when the model could not be sized)
    estimate: StepEstimate | None = None
    done: int = 0  # steps already done (a resumed run's)
    unknown: str = field(default="")  # why there is no estimate
    eval_s: float = 0.0  # one held-out evaluation, seconds (eval_estimate)
    evals: int = 0  # the held-out evaluations in the steps left (evaluations)
    compute: object = None  # the roles' timed work and choices (cluster/run/compute_auto.py: ComputeChoice)
    agent: bool = False  # an agent program's run: its step is given as a range (AGENT_SPREAD)

    def lines(self, steps: int) -> list[str]:
        """The compute line (one per timed role when the roles were timed), the machine's rates, the estimate."""
        rate = f"bf16 {self.rates['bf16']:.0f} and fp32 {self.rates['fp32']:.0f} GFLOP/s measured"
        cpu = "" if self.cpu in self.why else f"{self.cpu}; "
        if self.compute is not None and self.compute.roles:
            out = [f"compute: {line}" for line in self.compute.lines()]
        else:
            out = [f"compute: {self.dtype} on the CPU roles ({self.why})"]
        out.append(f"machine: {cpu}{rate} on this CPU")
        left = max(steps - self.done, 0)
        of = f"the {left} steps left" if self.done else f"{left} steps"
        if self.step_s == self.step_s:
            parts = self.estimate.parts() if self.estimate is not None else ""
            evals = self.evals if self.eval_s == self.eval_s else 0
            total = _span(self.step_s * left + STARTUP_S + evals * self.eval_s)
            rough = f"rough: {parts}" if parts else "rough"
            about = "" if self.step_s < 1 else "about "
            also = (f" and {evals} held-out evaluation{'s' * (evals != 1)} of {_span(self.eval_s)}" +
                    " each" * (evals != 1)) if evals else ""
            if self.agent and self.estimate is not None:  # the agent's calls reach the generators as it makes them
                high = self.step_s + (AGENT_SPREAD - 1) * self.estimate.generate
                top = _span(high * left + STARTUP_S + evals * self.eval_s)
                out.append(f"expected: {_span(self.step_s)} to {_span(high)} per step, {total} to {top} for {of} "
                           f"with the start{also} (an agent program's calls are its own: generation from every "
                           f"turn's calls decoded together to {AGENT_SPREAD:g}x that; {rough}; the progress bar then "
                           "shows measured times)")
            else:
                out.append(f"expected: {about}{_span(self.step_s)} per step, {total} for {of} with the start{also} "
                           f"({rough}; the progress bar then shows measured times)")
        else:
            out.append(f"expected: no estimate ({self.unknown or 'the model could not be sized'}); the progress "
                       "bar shows measured times")
        return out


def _span(seconds: float) -> str:
    if seconds < 1:
        return "under 1 s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def model_size(model_path: str) -> ModelSize:
    """The model at `model_path` counted on the meta device (nothing is loaded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embed
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None) or 1
    return ModelSize(n, n if tied else n - embed.numel(), int(layers))


def expected_completion(cfg: Config) -> tuple[float, int]:
    """(a trajectory's expected completion tokens, its turns): COMPLETION_FILL of the turns' budget."""
    turns, _, completion = _shape(cfg)
    return completion, turns


def decode_steps(cfg: Config) -> int:
    """The decode steps of a step's generation: every turn's token budget (a batch decodes until its last row ends)."""
    turns, per_turn, _ = _shape(cfg)
    return turns * per_turn


def _shape(cfg: Config) -> tuple[int, int, float]:
    """(turns, tokens per turn, expected completion tokens per trajectory) of the config's rollouts."""
    from qgrpo.cluster.config.turns import turn_tokens

    env = cfg.environment
    turns = env.max_turns if env.name else 1
    per_turn = turn_tokens(cfg)[0]
    if env.name:  # a trajectory's turns share environment.max_context (an agent's uncapped call: all of it)
        per_turn = min(per_turn, max(env.max_context // turns, 1))
    return turns, per_turn, COMPLETION_FILL * turns * per_turn


def step_estimate(cfg: Config, size: ModelSize, prompt_tokens: int, rate_gflops: float,
                  env_call_s: float = 0.0, compute=None) -> StepEstimate:
    """One synchronous step's seconds by stage (module docstring), at `rate_gflops` and `env_call_s` per environment
    call (a reset, a step and a score timed together, divided by 3). `compute` (cluster/run/compute_auto.py:
    ComputeChoice): the roles' own work timed at the run's shapes, which replaces the rate's arithmetic for each role
    it timed in the precision chosen."""
    ro = cfg.rollout
    rate = rate_gflops * 1e9
    timed = {role: c for role, c in (compute.roles.items() if compute is not None else ()) if c.timing()}
    turns, per_turn, completion = _shape(cfg)
    seqs = ro.prompts_per_step * ro.group_size
    # a group's sequences share their prompt in the learner and the reference; a multi-turn trajectory's own context
    # follows its first turn, so there each trajectory counts its whole prompt
    shared = ro.prompts_per_step * prompt_tokens if turns == 1 else seqs * prompt_tokens
    train_tokens = shared + seqs * completion
    per_forward = 2.0 * size.matrix * train_tokens / rate
    learner = (4 if cfg.learner.gradient_checkpointing else 3) * cfg.algo.updates_per_batch * per_forward
    reference = per_forward if cfg.reference_actor else 0.0
    if "learner" in timed:
        learner = timed["learner"].step_seconds()
    if "reference" in timed and cfg.reference_actor:
        reference = timed["reference"].step_seconds()
    # the first turn's prompts are prefilled once per group; each later turn prefills its trajectory's context again
    later = (COMPLETION_FILL * turns - 1) * (prompt_tokens + per_turn) if turns > 1 else 0.0
    if "rollout" in timed:  # one actor's prefill and decode steps, as timed; later turns' prefill at the rate
        generate = timed["rollout"].step_seconds() + 2.0 * size.matrix * seqs * later / rate
    else:
        generate = _decoded(size, rate, ro.prompts_per_step * prompt_tokens + seqs * later, seqs, turns * per_turn)
    generate += seqs * COMPLETION_FILL * turns * TURN_S if turns > 1 else 0
    environment = 0.0
    if cfg.environment.name:
        calls = seqs * (2 + COMPLETION_FILL * turns)  # a reset and a score, and a step per turn
        environment = calls * env_call_s / max(cfg.environment.num_workers, 1)
    return StepEstimate(learn=learner, reference=reference, generate=generate,
                        environment=environment, sync=SYNC_S_PER_GPARAM * size.params / 1e9, fixed=FIXED_S)


def eval_estimate(cfg: Config, size: ModelSize, prompt_tokens: int, rate_gflops: float, compute=None) -> float:
    """One held-out evaluation's seconds (module docstring): task.eval_size prompts, one greedy completion each, decoded
    to run.eval_max_new_tokens (else rollout.max_new_tokens; a multi-turn run: its turns' budget, as a step's), the
    batch until its longest row ends. With the generator timed (`compute`, as in step_estimate), its prefill scales
    with the prompts and its decode step keeps what it measured beyond the products of its rows."""
    rows = cfg.task.eval_size
    if not rows:
        return 0.0
    rate = rate_gflops * 1e9
    turns, per_turn, _ = _shape(cfg)
    tokens = turns * per_turn if turns > 1 else (cfg.run.eval_max_new_tokens or cfg.rollout.max_new_tokens)
    timed = compute.roles.get("rollout") if compute is not None else None
    if timed is not None and timed.timing():
        t, ro = timed.timing(), cfg.rollout
        prompts = math.ceil(ro.prompts_per_step / ro.num_actors)
        per_row = 2.0 * size.matrix / rate
        beyond = max(t.per_unit - prompts * ro.group_size * per_row, 0.0)  # the step's cost besides its products
        return t.fixed * rows / prompts + tokens * (beyond + rows * per_row)
    return _decoded(size, rate, rows * prompt_tokens, rows, tokens)


def _decoded(size: ModelSize, rate: float, prefill_tokens: float, rows: int, steps: float) -> float:
    """Seconds to prefill `prefill_tokens` and decode `steps` steps of a batch of `rows` rows, at `rate` FLOP/s; a
    decode step also pays DECODE_S_PER_LAYER per layer."""
    decode_step = 2.0 * size.matrix * rows / rate + DECODE_S_PER_LAYER * size.layers
    return 2.0 * size.matrix * prefill_tokens / rate + steps * decode_step


def evaluations(cfg: Config, done: int = 0) -> int:
    """How many held-out evaluations the run makes after `done` steps (cluster/run/driver.py): one before the first
    step of a new run, one every run.eval_every steps, one after the last; none with run.eval off."""
    if not cfg.run.eval or not cfg.task.eval_size:
        return 0
    every, steps = cfg.run.eval_every, cfg.run.steps
    due = sum(1 for s in range(done + 1, steps + 1) if s == steps or (every and s % every == 0))
    return due + (done == 0)


def environment_probe(cfg: Config, tokenizer) -> tuple[int, float]:
    """(the first turn's prompt tokens as the episode loop renders them: the environment's first messages and its
    tools' descriptions, the mean time of one environment call: a reset, a step with the row's answer, a score) on the
    first train row, measured here as a worker makes them."""
    from qgrpo.rollout.data.tasks import make_task
    from qgrpo.rollout.environments.contract import row_of
    from qgrpo.rollout.environments.host import EnvHost
    from qgrpo.rollout.environments.loader import environment_spec, environment_tools, factory_of
    from qgrpo.rollout.episodes import encode, render, tools_for

    env = cfg.environment
    item = make_task(cfg.task, cfg.run.seed).item(0)
    factory = factory_of(environment_spec(env.name, env.params))
    chat = bool(cfg.task.chat_template) and getattr(tokenizer, "chat_template", None) is not None
    schemas, text = tools_for(tokenizer, environment_tools(factory) if chat else [])
    host = EnvHost(factory, env.timeout_s)
    (first,) = host.reset(["estimate"], [row_of(item)])  # a first reset pays for imports and connections: not timed
    t0 = time.perf_counter()
    host.reset(["estimate"], [row_of(item)])
    host.step(["estimate"], [str(item.reference)])
    host.score(["estimate"])
    seconds = (time.perf_counter() - t0) / 3
    host.drop(["estimate"])
    messages = ([{"role": "system", "content": text}] if text else []) + list(first)
    if not chat:  # the episode loop's plain text: the messages' contents in a row
        return len(encode(tokenizer, "".join(str(m.get("content", "")) for m in messages))), seconds
    return len(encode(tokenizer, render(tokenizer, messages, schemas, True))), seconds


def best_rates(measure, seconds: float, trials: int = RATE_TRIALS, clock=time.monotonic) -> dict:
    """Each dtype's best of up to `trials` measurements of `seconds / trials` (`measure`: core/cpu.py matmul_rates):
    a moment's contention from another process (a shared machine) lowers one trial, not the rate the run's long
    products reach; a single measurement came out 38 to 170 GFLOP/s on the same idle-to-busy 2-core machine. The
    trials stop after 3 x `seconds` (an emulated bf16 product alone takes about a second)."""
    best: dict = {}
    start = clock()
    for _ in range(trials):
        for name, rate in measure(seconds / trials).items():
            best[name] = max(best.get(name, 0.0), rate)
        if clock() - start > 3 * seconds:
            break
    return best


def steps_done(resume) -> int:
    """The steps a resumed run has done: its checkpoint's (RUN/checkpoints/step_N); 0 for a new run."""
    m = re.search(r"step_(\d+)/?$", str(resume or ""))
    return int(m.group(1)) if m else 0


def machine_report(cfg: Config, model_path: str, seconds: float = 1.0, resume=None, compute=None,
                   untimed: str = "") -> MachineReport:
    """What this machine does for the configured job (module docstring); about `seconds` of measurement. `resume`:
    the checkpoint a resumed run starts from (the estimate is for the steps left). `compute`: the CPU roles' own work
    timed (cluster/run/compute_auto.py: ComputeChoice), which gives the estimate its roles' times; `untimed`: why
    they were not (said beside the flags' choice)."""
    from qgrpo.core.cpu import compute_dtype, isa, matmul_rates

    done = steps_done(resume)
    dtype, why = compute_dtype(cfg.compute_dtype_of("learner"), "cpu")
    if untimed:
        why = f"{why}; {untimed}"
    rates = best_rates(matmul_rates, seconds)
    try:
        from transformers import AutoTokenizer

        from qgrpo.rollout.backends.common import format_prompt
        from qgrpo.rollout.data.tasks import make_task

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        prompt = len(format_prompt(tokenizer, make_task(cfg.task, cfg.run.seed).item(0), cfg.task.chat_template))
        size = model_size(model_path)
    except Exception as e:  # a model transformers cannot size: the line says there is no estimate
        return MachineReport(isa().words(), dtype, why, rates, float("nan"), None, done,
                             f"the model could not be sized: {type(e).__name__}")
    env_s = 0.0
    if cfg.environment.name:
        try:
            prompt, env_s = environment_probe(cfg, tokenizer)
        except Exception:  # noqa: BLE001 - check's environment probe names what is wrong with it
            pass
    learner = compute.roles.get("learner") if compute is not None else None
    if learner is not None:  # the rate line and the untimed parts follow the learner's precision
        dtype, why = learner.dtype, learner.why
    estimate = step_estimate(cfg, size, prompt, rates[dtype], env_s, compute)
    from qgrpo.rollout.environments.kinds import capabilities

    return MachineReport(isa().words(), dtype, why, rates, estimate.total, estimate, done,
                         eval_s=eval_estimate(cfg, size, prompt, rates[dtype], compute), evals=evaluations(cfg, done),
                         compute=compute, agent=capabilities(cfg.environment.name).endpoint)
