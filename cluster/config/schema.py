"""Typed run configuration: TOML presets + `--set section.key=value` overrides, every error reported at once.

Each field is documented where it is defined. Validation never changes a value: a bad value is an error that names
the field, the rule and the fix. Sizes are named so that global algorithm sizes (`prompts_per_step`, `group_size`)
cannot be confused with per-rank ones (`micro_batch_per_rank`).
"""
from __future__ import annotations

import copy
import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from qgrpo.cluster.config.plan import STRATEGIES, placement_problems
from qgrpo.rollout.backends import REFERENCE_BACKENDS, REGISTRY, VLLMOptions  # backends, their precisions and options

BUILTIN_MODEL_PREFIX = "builtin:"


@dataclass
class RunConfig:
    name: str = "run"  # run directory name under output_dir (a timestamp is appended)
    # Where run directories go: a local folder (on a cluster, one shared by every node), or a URI pyarrow opens
    # (s3://bucket/runs, gs://, hdfs://, file:///abs/path): logs are staged locally and mirrored there, checkpoints
    # uploaded by the learner ranks.
    output_dir: str = "runs"
    seed: int = 0  # seeds prompts, sampling, and model init of builtin models
    steps: int = 100  # learner steps (one optimizer update per step unless learner.updates_per_batch > 1)
    # Checkpoint every N steps and at the end (0 = only at the end); a multiple of algo.update_every, so a checkpoint
    # is always taken when the generators hold the checkpointed weights and a resume is exact.
    save_every: int = 10
    keep_last: int = 2  # checkpoints kept on disk
    log_every: int = 1  # metrics.jsonl line every N steps
    progress: bool = True  # terminal progress bar
    tensorboard: bool = True  # TensorBoard event files under RUN_DIR/tensorboard when tensorboard is installed
    wandb_project: str = ""  # log to Weights & Biases under this project ("" = off; needs `pip install wandb`)
    rollouts_flush_every: int = 10  # write RUN_DIR/rollouts/*.parquet every N steps (and at every checkpoint)
    eval_every: int = 0  # held-out accuracy (task.eval_size prompts, greedy) every N steps; 0 = before and after only
    eval: bool = False  # measure held-out accuracy before and after training (and every eval_every steps)
    eval_max_new_tokens: int = 0  # generation length of the held-out evaluation (0 = rollout.max_new_tokens)


@dataclass
class ModelConfig:
    path: str = ""  # local HF folder, or builtin:tiny-digits / builtin:smollm2-135m-instruct (built offline, cached)
    cache_dir: str = ""  # where builtin models are materialised ("" = $QGRPO_CACHE or ~/.cache/qgrpo)


@dataclass
class TaskConfig:
    name: str = "digit_sum"  # digit_sum | rg:NAME (a reasoning-gym generator) | jsonl | parquet (see rollout/tasks.py)
    max_operand: int = 9  # digit_sum: operands are drawn from 0..max_operand
    num_operands: int = 2  # digit_sum: how many numbers are added
    params: dict[str, Any] = field(default_factory=dict)  # rg: generator settings, e.g. {min_terms=2, max_terms=2}
    size: int = 10_000  # rg: train pool; item i is entry i % size
    eval_size: int = 100  # held-out prompts (rg: generated; jsonl/parquet: the last rows, or the first of eval_path)
    eval_seed_offset: int = 1_000_000  # rg: the eval split is generated with seed + this; must be >= size
    # rg/jsonl/parquet: appended to each question after a newline ("" = none); the answer_* rewards read the tags
    instruction: str = "Think briefly, then give only the final answer inside <answer></answer>."
    chat_template: bool = True  # wrap prompts in the tokenizer's chat template (done by the generators)
    path: str = ""  # jsonl/parquet: the dataset file
    eval_path: str = ""  # jsonl/parquet: a held-out file ("" = hold out the last eval_size rows of path)
    prompt_column: str = "prompt"  # jsonl/parquet: field with the question
    answer_column: str = "answer"  # jsonl/parquet: field with the reference answer (string or number)
    # A system turn before every question (train and eval); "" = none (the chat template may add its own default).
    system_prompt: str = ""
    # Worked examples put before every question (train and eval) as earlier chat turns; [] = zero-shot.
    # In TOML: examples = [{ question = "Calculate 4 - 1.", completion = "4 - 1 = 3\n<answer>3</answer>" }]
    examples: list[Example] = field(default_factory=list)


@dataclass
class Example:
    """One worked example shown to the model before each question, as an earlier chat turn (few-shot prompting)."""

    question: str = ""  # shown as a user turn, with task.instruction appended like every real question
    completion: str = ""  # the assistant's reply, in the answer format the rewards expect


@dataclass
class RewardSpec:
    name: str = "correct"  # a reward function from rollout/rewards.py
    weight: float = 1.0


@dataclass
class RewardsConfig:
    functions: list[RewardSpec] = field(default_factory=lambda: [RewardSpec()])
    on_error: str = "fail"  # "fail": stop with the prompt id; "zero": score 0, count it in metrics


@dataclass
class RolloutConfig:
    backend: str = "torch"  # generator backend: torch | vllm (rollout/backends: what each serves and needs)
    # Weights of the generators' linear layers. torch: bf16 | int8 | int4 | nf4; vllm: bf16 | int8 (W8A8) | fp8 (CUDA)
    precision: str = "int4"
    group_size_quant: int = 64  # int4 quantization group along in_features
    num_actors: int = 1  # rollout actors; prompts of a step are spread over them, whole groups per actor
    num_cpus: float = 1.0  # Ray CPU resource per rollout actor
    num_gpus: float = 0.0  # Ray GPU resource per rollout actor (CUDA clusters; vllm's tensor_parallel_size within)
    memory_gb: float = 0.0  # Ray memory reserved per rollout actor (0 = none reserved)
    # Custom Ray resources per rollout actor, to pin it to node types started with `ray start --resources '{"NAME": N}'`,
    # e.g. {rollout_node = 1}
    resources: dict[str, Any] = field(default_factory=dict)
    node_labels: dict[str, Any] = field(default_factory=dict)  # labels its node must carry (`ray start --labels`)
    threads: int = 0  # torch threads per rollout actor (0 = cores / num_actors locally; num_cpus on a cluster)
    prompts_per_step: int = 16  # prompts sampled per learner step (global)
    group_size: int = 8  # completions per prompt (G)
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    vllm: VLLMOptions = field(default_factory=VLLMOptions)  # [rollout.vllm]: read when backend = "vllm"


@dataclass
class ReferenceConfig:
    backend: str = "torch"  # torch | mlx (mlx-lm on Metal or the MLX CPU build; the Mac preset uses it)
    # The frozen reference may be quantized like the generators (original MLX design). torch: bf16 | int8 | int4 |
    # nf4; mlx: bf16 (unquantized; fp32 compute on CPU) | int8 | int4
    precision: str = "bf16"
    num_cpus: float = 0.0
    num_gpus: float = 0.0
    memory_gb: float = 0.0  # Ray memory reserved per reference actor (0 = none reserved)
    # Custom Ray resources per reference actor, to pin it to node types started with `ray start --resources '{"NAME": N}'`,
    # e.g. {reference_node = 1}
    resources: dict[str, Any] = field(default_factory=dict)
    node_labels: dict[str, Any] = field(default_factory=dict)  # labels its node must carry (`ray start --labels`)
    threads: int = 0  # 0 = all cores locally (it runs while the generators are idle); on a cluster, its num_cpus
    # With learner.mode = "lora" | "qlora": score the reference on the learner's own frozen base with the adapters
    # off (no reference actor, no second copy of the model). The rest of [reference] is then unused.
    from_learner: bool = False


@dataclass
class AlgoConfig:
    advantage_scale: str = "std"  # "std" (GRPO) or "none" (Dr. GRPO)
    clip_low: float = 0.2  # eps_low of the clipped surrogate
    clip_high: float = 0.2  # eps_high (DAPO's clip-higher uses 0.28)
    kl_coeff: float = 0.0  # weight of the KL-to-reference term; 0 disables the reference actor
    kl_estimator: str = "k3"  # k1 | k2 | k3
    loss_agg: str = "token_mean"  # token_mean (DAPO) | seq_mean (GRPO) | constant (Dr. GRPO)
    is_mode: str = "truncate"  # truncate (TIS) | mask | none: correction for the quantized sampler mu != pi_old
    is_cap: float = 2.0  # C in min(pi_old/mu, C)
    update_every: int = 1  # generators get new weights every N learner steps (1 = on-policy up to quantization)
    updates_per_batch: int = 1  # optimizer updates on each batch (>1 makes the clip matter)
    # One-step-off-policy: step k+1's rollouts are generated while the learner trains on step k (cluster/run/overlap.py).
    # They are one update stale at update_every = 1, corrected by the importance weights (is_mode); staleness is
    # recorded per rollout. Pays off when generators and learner have their own devices or nodes.
    overlap: bool = False


LR_SCHEDULES = ("constant", "cosine")  # learner.lr_schedule
LEARNER_MODES = ("full", "lora", "qlora")  # learner.mode
OPTIMIZERS = ("adamw", "adamw8bit")  # learner.optimizer
# ZeRO stages each learner.mode supports. A bitsandbytes 4-bit base cannot be partitioned (ZeRO-3 shards parameters,
# and its packed uint8 weights with their quantization state are not ordinary parameters), and the merged-weight
# export of lora/qlora reads each wrapped layer whole, which ZeRO-3 would have to gather module by module: both stop
# at ZeRO-2, which partitions only the (adapter) gradients and optimizer states.
MODE_ZERO_STAGES = {"full": (0, 1, 2, 3), "lora": (0, 1, 2), "qlora": (0, 1, 2)}


@dataclass
class LoraConfig:
    """[learner.lora]: the adapters of learner.mode = "lora" | "qlora" (peft)."""

    rank: int = 16  # r of the low-rank update B @ A
    alpha: float = 32.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input (0 keeps the learner's log-probs those of the policy)
    # Which modules get adapters: "all-linear" (every linear layer but the output head), or module names, e.g.
    # ["q_proj", "k_proj", "v_proj", "o_proj"]
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
ATTENTION = ("auto", "eager", "sdpa", "flash_attention_2", "flex_attention")  # learner.attention


@dataclass
class LearnerConfig:
    world_size: int = 1  # DeepSpeed ranks, one Ray actor each
    zero_stage: int = 0  # DeepSpeed ZeRO stage 0-3
    lr: float = 1e-6
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    warmup_steps: int = 0  # linear warm-up of the learning rate
    # "constant" after the warm-up, or "cosine": lr x (1 + cos(pi x update / total updates)) / 2 times the warm-up
    # ramp (MLX-GRPO's schedule), decaying towards 0 at run.steps
    lr_schedule: str = "constant"
    grad_clip: float = 1.0  # max global grad norm (0 = off)
    micro_batch_per_rank: int = 64  # sequences per forward/backward on one rank; gradients accumulate over the rest
    # Run each distinct prompt once per micro-batch and share its KV cache with the group's completions (learner and
    # reference). Same log-probs and gradients as the full forward (tests/test_scoring.py), several times fewer tokens.
    shared_prompt: bool = True
    # Attention kernel of the learner's model: "auto" = "eager" on a CPU learner (on this 2-core CPU the shared-prompt
    # forward + backward ran 1.1-1.5x faster than with SDPA, whose masked CPU path is slow: bench/learner_profile.py),
    # "sdpa" with GPUs; or name one of transformers' attn_implementation values.
    attention: str = "auto"
    num_cpus: float = 1.0  # Ray CPU resource per rank
    num_gpus: float = 0.0  # Ray GPU resource per rank (CUDA: NCCL between ranks; 0 = the CPU learner, gloo)
    memory_gb: float = 0.0  # Ray memory reserved per rank (0 = none reserved)
    # Custom Ray resources per rank, to pin it to node types started with `ray start --resources '{"NAME": N}'`,
    # e.g. {learner_node = 1}
    resources: dict[str, Any] = field(default_factory=dict)
    node_labels: dict[str, Any] = field(default_factory=dict)  # labels its node must carry (`ray start --labels`)
    # How the ranks' placement group spreads them: PACK (few nodes, default), SPREAD, STRICT_PACK (one node),
    # STRICT_SPREAD (one rank per node). All ranks are placed together or not at all.
    placement_strategy: str = "PACK"
    threads: int = 0  # 0 = all cores locally; on a cluster, the CPUs each rank was given (num_cpus)
    # "full": every weight trains (bf16 weights, fp32 masters in the optimizer). "lora": a frozen bf16 base plus
    # trainable adapters ([learner.lora]). "qlora": the frozen base in bitsandbytes NF4 (double quantization, bf16
    # compute) plus adapters. Generators always receive the merged weights and quantize them as usual.
    mode: str = "full"
    lora: LoraConfig = field(default_factory=LoraConfig)  # [learner.lora]: read when mode is lora or qlora
    optimizer: str = "adamw"  # "adamw" (torch) or "adamw8bit" (bitsandbytes: 8-bit moments, ~4x less state)
    # Recompute each layer's activations in the backward pass instead of keeping them (less memory, ~1 more forward).
    # Needs shared_prompt = false: checkpointed layers drop the KV cache the shared-prompt forward passes along.
    gradient_checkpointing: bool = False


@dataclass
class SyncConfig:
    timeout_s: float = 120.0  # a weight sync that takes longer raises
    bucket_mb: float = 64.0  # weights travel in buckets of about this size (one object per bucket)
    # How the buckets travel from learner rank 0: "object_store" (Ray's object store; shared memory on one node) or
    # "collective" (a broadcast over a process group of rank 0 and the rollout actors: gloo on CPU, NCCL on CUDA).
    transport: str = "object_store"


@dataclass
class FaultsConfig:
    """Deadlines and retries: a stage that does not finish in time raises, naming the stage and the actor."""

    generate_timeout_s: float = 900.0  # one step's generation (restarted when a lost actor's prompts are resubmitted)
    reference_timeout_s: float = 900.0  # one step's reference scoring
    learn_timeout_s: float = 1800.0  # one learner step, and a checkpoint save or load
    max_replacements: int = 3  # a rollout actor that fails this many times in a row more ends the run
    # How long actors may wait for a busy cluster to free the resources they ask for (a request no node can ever
    # satisfy fails at once instead)
    schedule_timeout_s: float = 600.0


@dataclass
class GuardConfig:
    """The precision guard: a step whose sampler log-probs, reference log-probs, loss or gradients are not finite, or
    whose sampler mismatch is above max_mismatch_kl, is skipped on every rank and logged with its reason."""

    enabled: bool = True
    max_mismatch_kl: float = 2.0  # bound on mismatch/kl_mu_old (mean per-token KL(mu || pi_old)); 0 = no bound
    # When the guard fires, move the quantized generators one rung up the ladder (int4/nf4 -> int8 -> bf16), or the
    # reference when its log-probs were the non-finite ones (or the generators are already at bf16).
    ladder: bool = True
    max_skips_at_top: int = 3  # skipped steps in a row with nothing left to step up before the run stops


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def reference_actor(self) -> bool:
        """Whether the run has a reference actor: only with a KL term, and not when the learner's base scores it."""
        return self.algo.kl_coeff > 0 and not self.reference.from_learner


class ConfigError(ValueError):
    """All problems of a config, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid config ({len(problems)} problem{'s' * (len(problems) != 1)}):\n{lines}")


# ---------------------------------------------------------------------------------------------------------------
# Building a Config from nested dicts, collecting type errors instead of stopping at the first


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str, problems: list[str]) -> Any:
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool):
        if isinstance(value, bool) and tp is not bool:
            problems.append(f"{where}: expected {_type_name(tp)}, got {value!r}")
            return None
        if not isinstance(value, tp):
            problems.append(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
            return None
        return value
    if tp == list[str]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            problems.append(f"{where}: expected a list of strings, e.g. [\"q_proj\", \"v_proj\"], got {value!r}")
            return None
        return list(value)
    if tp == dict[str, Any]:
        if not isinstance(value, dict):
            problems.append(f"{where}: expected a table, e.g. {{min_terms=2, max_terms=2}}, got {value!r}")
            return None
        return dict(value)
    for item_cls, keys in ((RewardSpec, "{name, weight}"), (Example, "{question, completion}")):
        if tp == list[item_cls]:
            if not isinstance(value, list):
                problems.append(f"{where}: expected a list of {keys} tables, got {value!r}")
                return None
            return [_build(item_cls, v, f"{where}[{i}]", problems) for i, v in enumerate(value)]
    raise TypeError(f"no coercion for {tp}")  # a schema bug, not a user error


def _build(cls, data: Any, where: str, problems: list[str]):
    if not isinstance(data, dict):
        problems.append(f"{where}: expected a table, got {data!r}")
        return cls()
    hints = get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            scope = f"keys of [{where}]" if where else "sections"
            problems.append(f"{where}.{key}: unknown key; known {scope} are: {', '.join(sorted(known))}")
    obj = cls()
    for name in known:
        if name not in data:
            continue
        tp = hints[name]
        sub = f"{where}.{name}" if where else name
        if dataclasses.is_dataclass(tp):
            setattr(obj, name, _build(tp, data[name], sub, problems))
        else:
            value = _coerce(data[name], tp, sub, problems)
            if value is not None:
                setattr(obj, name, value)
    return obj


def _set_path(data: dict, dotted: str, raw: str, problems: list[str]) -> None:
    """section.key=value, or section.table.key=value for a nested table such as [rollout.vllm]."""
    parts = dotted.split(".")
    if len(parts) < 2 or not all(parts):
        problems.append(f"--set {dotted}={raw}: expected section.key=value, e.g. --set learner.lr=1e-5")
        return
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare words are strings: --set rollout.precision=int8
    table = data
    for i, part in enumerate(parts[:-1]):
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            problems.append(f"--set {dotted}: [{'.'.join(parts[:i + 1])}] is not a table")
            return
    table[parts[-1]] = value


def load_config(path: str | os.PathLike | None, overrides: list[str] = (), base: dict[str, Any] | None = None,
                notes: list[str] | None = None) -> Config:
    """Read a TOML preset, apply `section.key=value` overrides, build and validate. Raises ConfigError.
    Without a path, `base` (an effective config saved by a run, e.g. a checkpoint's) is the starting point.
    An MLX-GRPO file (cluster/config/mlx_grpo.py) is translated first: its `key=value` overrides apply before the
    translation, ours after; how each key mapped is appended to `notes`."""
    from qgrpo.cluster.config.mlx_grpo import is_mlx_grpo, name_origin, translate

    problems: list[str] = []
    origin: dict[str, str] = {}
    data: dict[str, Any] = copy.deepcopy(base) if base else {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError([f"config file {str(p)!r} does not exist; presets are in configs/, e.g. configs/tiny.toml"])
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError([f"{p}: not valid TOML ({e})"]) from None
        if is_mlx_grpo(data):
            data, lines, origin, bad, overrides = translate(data, overrides)
            if bad:
                raise ConfigError([f"{x} (in {p}, read as an MLX-GRPO config)" for x in bad])
            if notes is not None:
                notes.extend(lines)
    for item in overrides:
        if "=" not in item:
            problems.append(f"--set {item}: expected section.key=value")
            continue
        key, raw = item.split("=", 1)
        _set_path(data, key.strip(), raw.strip(), problems)
    cfg = _build(Config, data, "", problems)
    # _build names top-level keys with a leading dot; strip it for readability
    problems = [p[1:] if p.startswith(".") else p for p in problems]
    problems += validate(cfg)
    if problems:
        raise ConfigError([name_origin(x, origin) for x in problems])
    return cfg


def config_from_dict(data: dict[str, Any]) -> Config:
    problems: list[str] = []
    cfg = _build(Config, data, "", problems)
    problems = [p[1:] if p.startswith(".") else p for p in problems] + validate(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


# ---------------------------------------------------------------------------------------------------------------
# Value rules: each returns "field: rule; fix"


def validate(cfg: Config) -> list[str]:
    from qgrpo.core.storage import uri_problem
    from qgrpo.rollout.datasets import FORMATS as FILE_FORMATS
    from qgrpo.rollout.rewards import REWARD_FUNCTIONS
    from qgrpo.rollout.tasks import RG_PREFIX, RG_SEED_STRIDE, TASKS, rg_config_problems

    p: list[str] = []

    def need(ok: bool, msg: str) -> None:
        if not ok:
            p.append(msg)

    r, m, ro, a, le = cfg.run, cfg.model, cfg.rollout, cfg.algo, cfg.learner
    need(r.steps >= 1, f"run.steps: must be >= 1, got {r.steps}; set e.g. run.steps=100")
    need(r.save_every >= 0, f"run.save_every: must be >= 0 (0 = only at the end), got {r.save_every}")
    need(r.keep_last >= 1, f"run.keep_last: must be >= 1, got {r.keep_last}")
    need(r.log_every >= 1, f"run.log_every: must be >= 1, got {r.log_every}")
    need(bool(r.name) and "/" not in r.name, f"run.name: must be non-empty without '/', got {r.name!r}")
    p.extend(filter(None, [uri_problem(r.output_dir, "run.output_dir")]))  # the scheme only: no network here
    need(r.rollouts_flush_every >= 1, f"run.rollouts_flush_every: must be >= 1, got {r.rollouts_flush_every}")
    need(not r.eval or cfg.task.eval_size > 0,
         "run.eval: held-out evaluation needs task.eval_size > 0; set task.eval_size=100 or run.eval=false")
    need(r.eval_every >= 0, f"run.eval_every: must be >= 0 (0 = before and after only), got {r.eval_every}")
    need(r.eval_max_new_tokens >= 0,
         f"run.eval_max_new_tokens: must be >= 0 (0 = rollout.max_new_tokens), got {r.eval_max_new_tokens}")
    if r.wandb_project:
        import importlib.util

        need(importlib.util.find_spec("wandb") is not None,
             "run.wandb_project: set, but wandb is not installed; `pip install wandb` or set run.wandb_project=''")

    if not m.path:
        p.append("model.path: missing; set a local HF model folder or a builtin model: "
                 "builtin:tiny-digits, builtin:smollm2-135m-instruct")
    elif m.path.startswith(BUILTIN_MODEL_PREFIX):
        from qgrpo.rollout.models import BUILTIN_MODELS

        name = m.path[len(BUILTIN_MODEL_PREFIX):]
        need(name in BUILTIN_MODELS,
             f"model.path: unknown builtin model {name!r}; choose one of {', '.join(sorted(BUILTIN_MODELS))}")
    elif not Path(m.path).expanduser().is_dir():
        p.append(f"model.path: folder {m.path!r} does not exist; put the model there (config.json, *.safetensors and "
                 "tokenizer files: a transformers folder, or an mlx-lm / MLX-GRPO folder of a nanochat model), point "
                 "model.path at it, or use a builtin model such as builtin:smollm2-135m-instruct")
    elif not (Path(m.path).expanduser() / "config.json").is_file():
        p.append(f"model.path: {m.path!r} has no config.json; it must be a HF model folder")

    t = cfg.task
    rg, files = t.name.startswith(RG_PREFIX), t.name in FILE_FORMATS
    need(rg or t.name in TASKS, f"task.name: unknown task {t.name!r}; choose one of {', '.join(sorted(TASKS))}, "
         f"or {RG_PREFIX}NAME for a reasoning-gym generator, e.g. {RG_PREFIX}basic_arithmetic")
    need(0 <= t.max_operand <= 9_999, f"task.max_operand: must be in 0..9999, got {t.max_operand}")
    need(1 <= t.num_operands <= 8, f"task.num_operands: must be in 1..8, got {t.num_operands}")
    need(t.eval_size >= 0, f"task.eval_size: must be >= 0 (0 = no held-out prompts), got {t.eval_size}")
    for i, ex in enumerate(t.examples):
        need(bool(ex.question.strip()) and bool(ex.completion.strip()),
             f"task.examples[{i}]: question and completion must both be non-empty text, e.g. "
             '{ question = "Calculate 4 - 1.", completion = "4 - 1 = 3\\n<answer>3</answer>" }')
    need(rg or not t.params, f"task.params: only {RG_PREFIX} tasks take generator settings; remove task.params "
         f"for task.name={t.name!r}")
    if rg:
        need(t.size >= 1, f"task.size: must be >= 1 (the train pool of {t.name}), got {t.size}")
        need(t.size <= t.eval_seed_offset <= RG_SEED_STRIDE - t.eval_size,
             f"task.eval_seed_offset: must be in task.size..2**32 - task.eval_size, got {t.eval_seed_offset} "
             f"(size {t.size}); reasoning-gym draws entry i with seed + i, so a smaller offset makes eval entries "
             f"copies of train entries; e.g. set task.eval_seed_offset={max(t.size, 1_000_000)}")
        p.extend(rg_config_problems(t))  # imports reasoning-gym; the generator must exist and accept task.params
    need(files or not (t.path or t.eval_path),
         f"task.path/eval_path: only read by the jsonl and parquet tasks, not {t.name!r}; remove them or set "
         "task.name='jsonl' or 'parquet'")
    if files:  # only existence here; rollout.tasks.check_task reads the rows
        need(bool(t.path), f"task.path: missing; set the {t.name} file with {t.prompt_column!r} and "
             f"{t.answer_column!r} columns")
        for key in ("path", "eval_path"):
            value = getattr(t, key)
            need(not value or Path(value).expanduser().is_file(), f"task.{key}: file {value!r} does not exist")
        need(bool(t.prompt_column) and bool(t.answer_column) and t.prompt_column != t.answer_column,
             f"task.prompt_column/answer_column: must be two different non-empty names, got "
             f"{t.prompt_column!r} and {t.answer_column!r}")

    rw = cfg.rewards
    need(len(rw.functions) >= 1, "rewards.functions: at least one reward function is needed, e.g. [{name='correct', weight=1.0}]")
    for i, spec in enumerate(rw.functions):
        need(spec.name in REWARD_FUNCTIONS,
             f"rewards.functions[{i}].name: unknown reward {spec.name!r}; choose one of {', '.join(sorted(REWARD_FUNCTIONS))}")
        need(spec.weight == spec.weight and abs(spec.weight) < 1e6,
             f"rewards.functions[{i}].weight: must be a finite number, got {spec.weight}")
    need(rw.on_error in ("fail", "zero"), f"rewards.on_error: must be 'fail' or 'zero', got {rw.on_error!r}")

    spec = REGISTRY.get(ro.backend)
    if spec is None:
        p.append(f"rollout.backend: unknown backend {ro.backend!r}; choose one of {', '.join(REGISTRY)}")
    else:  # the backend says which precisions, platforms and GPUs it serves
        p.extend(spec.problems(ro.precision, ro.num_gpus))
    for name, other in REGISTRY.items():  # each backend checks its own [rollout.NAME] table, chosen or not
        if other.options is not None:
            p.extend(getattr(ro, name).problems(f"rollout.{name}", ro.num_gpus))
    need(ro.group_size_quant in (32, 64, 128), f"rollout.group_size_quant: must be 32, 64 or 128, got {ro.group_size_quant}")
    need(ro.num_actors >= 1, f"rollout.num_actors: must be >= 1, got {ro.num_actors}")
    need(ro.num_cpus >= 0, f"rollout.num_cpus: must be >= 0, got {ro.num_cpus}")
    need(ro.threads >= 0, f"rollout.threads: must be >= 0 (0 = automatic), got {ro.threads}")
    need(ro.prompts_per_step >= 1, f"rollout.prompts_per_step: must be >= 1, got {ro.prompts_per_step}")
    need(ro.group_size >= 2, f"rollout.group_size: must be >= 2 (advantages compare completions within a group), got {ro.group_size}")
    need(ro.max_new_tokens >= 1, f"rollout.max_new_tokens: must be >= 1, got {ro.max_new_tokens}")
    need(ro.temperature > 0, f"rollout.temperature: must be > 0 (sampling; greedy gives a group no variance), got {ro.temperature}")
    need(0 < ro.top_p <= 1, f"rollout.top_p: must be in (0, 1], got {ro.top_p}")
    need(ro.top_k >= 0, f"rollout.top_k: must be >= 0 (0 = off), got {ro.top_k}")

    rb = cfg.reference.backend
    if rb not in REFERENCE_BACKENDS:
        p.append(f"reference.backend: unknown backend {rb!r}; choose one of {', '.join(REFERENCE_BACKENDS)}")
    else:
        p.extend(REGISTRY[rb].unavailable("reference.backend"))
        need(cfg.reference.precision in REFERENCE_BACKENDS[rb],
             f"reference.precision: {cfg.reference.precision!r} is not served by the {rb} reference; choose one of "
             f"{', '.join(REFERENCE_BACKENDS[rb])}")
    need(cfg.reference.num_cpus >= 0, f"reference.num_cpus: must be >= 0, got {cfg.reference.num_cpus}")
    for name, sec in (("rollout", ro), ("reference", cfg.reference), ("learner", le)):
        p.extend(placement_problems(name, sec))
    p.extend(gpu_problems(cfg))
    need(le.attention in ATTENTION, f"learner.attention: must be one of {', '.join(ATTENTION)}, got {le.attention!r}")
    need(le.placement_strategy in STRATEGIES, f"learner.placement_strategy: must be one of {', '.join(STRATEGIES)}, "
         f"got {le.placement_strategy!r}")
    need(cfg.reference.threads >= 0, f"reference.threads: must be >= 0, got {cfg.reference.threads}")

    need(a.advantage_scale in ("std", "none"), f"algo.advantage_scale: must be 'std' or 'none', got {a.advantage_scale!r}")
    need(0 <= a.clip_low < 1, f"algo.clip_low: must be in [0, 1), got {a.clip_low}")
    need(a.clip_high >= 0, f"algo.clip_high: must be >= 0, got {a.clip_high}")
    need(a.clip_low <= a.clip_high,
         f"algo.clip_low: must be <= algo.clip_high (clip-higher widens the upper side), got {a.clip_low} > {a.clip_high}")
    need(a.kl_coeff >= 0, f"algo.kl_coeff: must be >= 0, got {a.kl_coeff}")
    need(a.kl_estimator in ("k1", "k2", "k3"), f"algo.kl_estimator: must be k1, k2 or k3, got {a.kl_estimator!r}")
    need(a.loss_agg in ("token_mean", "seq_mean", "constant"),
         f"algo.loss_agg: must be token_mean, seq_mean or constant, got {a.loss_agg!r}")
    need(a.is_mode in ("truncate", "mask", "none"), f"algo.is_mode: must be truncate, mask or none, got {a.is_mode!r}")
    need(a.is_cap > 1, f"algo.is_cap: must be > 1 (C in min(pi_old/mu, C)), got {a.is_cap}")
    need(a.update_every >= 1, f"algo.update_every: must be >= 1 (1 = sync after every step), got {a.update_every}")
    need(a.updates_per_batch >= 1, f"algo.updates_per_batch: must be >= 1, got {a.updates_per_batch}")

    need(le.world_size >= 1, f"learner.world_size: must be >= 1, got {le.world_size}")
    need(le.zero_stage in (0, 1, 2, 3), f"learner.zero_stage: must be 0, 1, 2 or 3, got {le.zero_stage}")
    need(0 < le.lr < 1, f"learner.lr: must be in (0, 1), got {le.lr}; typical values are 1e-6 .. 1e-3")
    need(le.weight_decay >= 0, f"learner.weight_decay: must be >= 0, got {le.weight_decay}")
    need(0 <= le.beta1 < 1 and 0 <= le.beta2 < 1, f"learner.beta1/beta2: must be in [0, 1), got {le.beta1}, {le.beta2}")
    need(le.warmup_steps >= 0, f"learner.warmup_steps: must be >= 0, got {le.warmup_steps}")
    need(le.lr_schedule in LR_SCHEDULES,
         f"learner.lr_schedule: must be one of {', '.join(LR_SCHEDULES)}, got {le.lr_schedule!r}")
    need(le.grad_clip >= 0, f"learner.grad_clip: must be >= 0 (0 = off), got {le.grad_clip}")
    need(le.mode in LEARNER_MODES, f"learner.mode: must be one of {', '.join(LEARNER_MODES)}, got {le.mode!r}")
    need(le.optimizer in OPTIMIZERS, f"learner.optimizer: must be one of {', '.join(OPTIMIZERS)}, got {le.optimizer!r}")
    if le.mode in MODE_ZERO_STAGES:
        stages = MODE_ZERO_STAGES[le.mode]
        need(le.zero_stage in stages,
             f"learner.zero_stage: learner.mode = {le.mode!r} supports ZeRO stages {', '.join(map(str, stages))}, got "
             f"{le.zero_stage} (ZeRO-3 partitions the weights, which a 4-bit base and the merged export of adapters do "
             "not allow); set learner.zero_stage = 2")
    if le.mode != "full":
        lo = le.lora
        need(lo.rank >= 1, f"learner.lora.rank: must be >= 1, got {lo.rank}")
        need(lo.alpha > 0, f"learner.lora.alpha: must be > 0, got {lo.alpha}")
        need(0 <= lo.dropout < 1, f"learner.lora.dropout: must be in [0, 1), got {lo.dropout}")
        need(bool(lo.target_modules) and all(lo.target_modules),
             f"learner.lora.target_modules: must name modules, e.g. [\"all-linear\"] or [\"q_proj\", \"v_proj\"], "
             f"got {lo.target_modules!r}")
    need(not (le.gradient_checkpointing and le.shared_prompt),
         "learner.gradient_checkpointing: needs learner.shared_prompt = false (the shared-prompt forward hands a KV "
         "cache from its prompt pass to its completion pass, and checkpointed layers drop it); set "
         "learner.shared_prompt = false, or gradient_checkpointing = false")
    need(not (cfg.reference.from_learner and le.mode == "full"),
         "reference.from_learner: needs learner.mode = \"lora\" or \"qlora\" (the reference is the learner's frozen "
         "base with its adapters off; a full fine-tune has no frozen base); set it to false for a reference actor")
    need(le.micro_batch_per_rank >= 1, f"learner.micro_batch_per_rank: must be >= 1, got {le.micro_batch_per_rank}")
    need(le.num_cpus >= 0, f"learner.num_cpus: must be >= 0, got {le.num_cpus}")
    need(le.threads >= 0, f"learner.threads: must be >= 0, got {le.threads}")
    batch = ro.prompts_per_step * ro.group_size
    need(le.world_size < 1 or batch % le.world_size == 0,
         f"learner.world_size: the {batch} sequences of a step (rollout.prompts_per_step * rollout.group_size) must "
         f"split evenly over {le.world_size} ranks; change prompts_per_step or world_size")

    need(r.save_every % max(a.update_every, 1) == 0,
         f"run.save_every: must be a multiple of algo.update_every ({a.update_every}) so that checkpoints are taken "
         f"when the generators hold the checkpointed weights (exact resume), got {r.save_every}; set e.g. "
         f"run.save_every={a.update_every * max(1, -(-r.save_every // max(a.update_every, 1)))}")
    need(cfg.sync.timeout_s > 0, f"sync.timeout_s: must be > 0, got {cfg.sync.timeout_s}")
    f = cfg.faults
    for key in ("generate_timeout_s", "reference_timeout_s", "learn_timeout_s"):
        need(getattr(f, key) > 0, f"faults.{key}: must be > 0 seconds, got {getattr(f, key)}")
    need(f.schedule_timeout_s > 0, f"faults.schedule_timeout_s: must be > 0 seconds, got {f.schedule_timeout_s}")
    need(f.max_replacements >= 0, f"faults.max_replacements: must be >= 0, got {f.max_replacements}")
    g = cfg.guard
    need(g.max_mismatch_kl >= 0, f"guard.max_mismatch_kl: must be >= 0 (0 = no bound), got {g.max_mismatch_kl}")
    need(g.max_skips_at_top >= 1, f"guard.max_skips_at_top: must be >= 1, got {g.max_skips_at_top}")
    need(cfg.sync.bucket_mb > 0, f"sync.bucket_mb: must be > 0, got {cfg.sync.bucket_mb}")
    need(cfg.sync.transport in ("object_store", "collective"),
         f"sync.transport: must be 'object_store' or 'collective', got {cfg.sync.transport!r}")
    return p


def gpu_problems(cfg: Config) -> list[str]:
    """What a config asks of GPUs that cannot work, whatever the cluster: each process uses one device (one GPU, or
    a share of one), NCCL ranks need a GPU each, MLX has no CUDA. (Whether the roles fit the GPUs there are together:
    cluster.config.plan.gpu_plan.)"""
    p, le, ref = [], cfg.learner, cfg.reference
    for name, sec, what in (("rollout", cfg.rollout, "a rollout actor runs one engine on one GPU; scale out with "
                             "rollout.num_actors"),
                            ("reference", ref, "the reference scores on one GPU"),
                            ("learner", le, "each DeepSpeed rank trains on one GPU; use learner.world_size = N for N "
                             "GPUs")):
        if sec.num_gpus > 1:
            p.append(f"{name}.num_gpus: {sec.num_gpus:g} GPUs per actor, but {what}; set {name}.num_gpus = 1 (or a "
                     "share of one GPU, e.g. 0.5)")
    if 0 < le.num_gpus < 1 and le.world_size > 1:
        p.append(f"learner.num_gpus: {le.num_gpus:g} of a GPU per rank with learner.world_size = {le.world_size}: two "
                 "ranks could land on one GPU, which NCCL refuses; give each rank a whole GPU (learner.num_gpus = 1) "
                 "or train on one rank (learner.world_size = 1)")
    if cfg.reference_actor and ref.backend == "mlx" and ref.num_gpus > 0:
        p.append("reference.num_gpus: the mlx reference runs on Apple silicon or the CPU, never on CUDA; set "
                 "reference.num_gpus = 0, or reference.backend = \"torch\" to score on a GPU")
    return p
