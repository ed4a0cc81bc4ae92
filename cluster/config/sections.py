"""The sections of what is trained and how it is sampled: [run], [model], [task], [rewards], [environment],
[rollout] (with a [rollout.NAME] table per backend with settings, e.g. [rollout.vllm]), [reference] and
[reward_model]. The learning side ([algo], [learner], [sync], [faults], [guard]) is in training.py. The Ray
resources of the roles are defined once (fields.py: role_resources) and inherited.

Sizes are named so that global algorithm sizes (`prompts_per_step`, `group_size`) cannot be confused with per-rank
ones (`learner.micro_batch_per_rank`). Values the modules that use them own (reward names, backends, tasks) are
imported from there, so the schema cannot drift from the code.
"""
from __future__ import annotations

from pydantic.dataclasses import dataclass

from qgrpo.cluster.config.fields import (
    SECTION,
    Bool,
    Float,
    Int,
    Str,
    Table,
    choice,
    options_section,
    role_resources,
    setting,
)
from qgrpo.core.cpu import COMPUTE_DTYPES, CPU_WAIT_SETTINGS, ROLE_COMPUTE_DTYPES
from qgrpo.rollout.backends import REFERENCE_BACKENDS, REGISTRY
from qgrpo.rollout.data.tasks import RG_PREFIX, TASKS
from qgrpo.rollout.modeling.models import BUILTIN_MODELS, BUILTIN_PREFIX
from qgrpo.rollout.rewards import ON_ERROR, REWARD_NAMES
from qgrpo.rollout.rewards.builtin import EVAL_METRICS
from qgrpo.rollout.rewards.classifier import CLASSIFIER_BUILTINS, RM_PRECISIONS

UNKNOWN_BACKEND = "unknown backend {got}; choose one of {listed}"


def _precisions(backends: dict) -> str:
    """'torch: bf16, int8 ...; vllm: ...' with the CUDA-only precisions marked, for the field reference."""
    parts = []
    for name in backends:
        spec = REGISTRY[name]
        listed = ", ".join(p + (" (CUDA)" if p in spec.gpu_precisions else "") for p in spec.precisions)
        parts.append(f"{name}: {listed}")
    return "; ".join(parts)


@dataclass(config=SECTION)
class RunConfig:
    name: Str = setting("run", allowed="not empty, without '/'")
    """Run directory name under output_dir (a timestamp is appended); non-empty, without '/'."""
    output_dir: Str = setting("runs", path="cwd")
    """Where run directories go: a local folder (on a cluster, one shared by every node), or a URI pyarrow opens
    (s3://bucket/runs, gs://, hdfs://, file:///abs/path): logs are staged locally and mirrored there, checkpoints
    uploaded by the learner ranks."""
    seed: Int = 0
    """Seeds prompts, sampling, and model init of builtin models."""
    steps: Int = setting(30, ge=1, fix="set e.g. run.steps=100")
    """Learner steps (one optimizer update per step unless algo.updates_per_batch > 1)."""
    save_every: Int = setting(10, ge=0, why="0 = only at the end")
    """Checkpoint every N steps and at the end (0 = only at the end); a multiple of algo.update_every, so a
    checkpoint is always taken when the generators hold the checkpointed weights and a resume is exact."""
    keep_last: Int = setting(2, ge=1)
    """Checkpoints kept on disk."""
    log_every: Int = setting(1, ge=1)
    """A metrics.jsonl line every N steps; without the progress bar, also a plain line on stderr (the step, reward
    mean, loss, accuracies, seconds per step)."""
    progress: Bool = True
    """A progress bar on stderr when stderr is a terminal; false, or stderr a file or a pipe (a `ray job submit` log):
    a plain line every run.log_every steps instead."""
    tensorboard: Bool = True
    """TensorBoard event files under RUN_DIR/tensorboard when tensorboard is installed."""
    wandb_project: Str = ""
    """Log to Weights & Biases under this project ("" = off; needs `pip install wandb`)."""
    rollouts_flush_every: Int = setting(10, ge=1)
    """Write RUN_DIR/rollouts/*.parquet every N steps (and at every checkpoint)."""
    eval_every: Int = setting(10, ge=0, why="0 = before and after only")
    """Held-out accuracy (task.eval_size prompts, greedy) every N steps; 0 = before and after only."""
    eval: Bool = True
    """Measure held-out accuracy before and after training (and every eval_every steps)."""
    eval_max_new_tokens: Int = setting(0, ge=0, why="0 = rollout.max_new_tokens")
    """Generation length of the held-out evaluation (0 = rollout.max_new_tokens)."""


@dataclass(config=SECTION)
class ModelConfig:
    path: Str = setting("", allowed="a local HF model folder, a Hub id ORG/NAME in the local Hugging Face cache, or "
                        + ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_MODELS if n not in CLASSIFIER_BUILTINS),
                        path="path_or_hub")
    """The model trained: a local HF folder, a Hub id already in the local Hugging Face cache (`hf download ORG/NAME`
    first; nothing is downloaded during a run), or builtin:NAME (built offline, cached)."""
    cache_dir: Str = setting("", path="file")
    """Where builtin models are materialised ("" = $QGRPO_CACHE or ~/.cache/qgrpo)."""
    compute_dtype: choice(COMPUTE_DTYPES, "must be {quoted}") = "auto"
    """What the learner, the reference and the torch generator compute in ([learner], [reference] and [rollout]
    compute_dtype override it per role). "auto" on the CPU roles of a local run: each role's own work (the learner's
    forward and backward, the reference's forward, a decode step), timed at the run's shapes in each precision the
    CPU computes natively, the faster taken, cached per machine and model; elsewhere (a GPU, a cluster's nodes) bf16
    where the device computes it natively and fp32 where bf16 products are emulated. "bf16" or "fp32" force it. The
    weights streamed to the generators and the checkpoints stay bf16 either way. `qgrpo check` and the run's first
    lines say what was measured and chosen, per role (docs/performance.md#compute-precision-by-measurement)."""


@dataclass(config=SECTION)
class Example:
    """One worked example shown to the model before each question, as an earlier chat turn (few-shot prompting)."""

    question: Str = ""
    """Shown as a user turn, with task.instruction appended like every real question."""
    completion: Str = ""
    """The assistant's reply, in the answer format the rewards expect."""


@dataclass(config=SECTION)
class TaskConfig:
    name: Str = setting("digit_sum", allowed=", ".join(TASKS) + f", or {RG_PREFIX}NAME")
    """The prompt source: digit_sum, rg:NAME (a reasoning-gym generator), jsonl or parquet (a file), or hf_disk (a
    Hugging Face `datasets` folder written by save_to_disk); see rollout/data/tasks.py and rollout/data/datasets.py."""
    max_operand: Int = setting(9, ge=0, le=9_999)
    """digit_sum: operands are drawn from 0..max_operand."""
    num_operands: Int = setting(2, ge=1, le=8)
    """digit_sum: how many numbers are added."""
    modulus: Int = setting(0, ge=0, le=9_999, why="0 = the sum itself")
    """digit_sum: the answer is the sum modulo this (0 = the sum itself). 3 makes a collapse-prone task: three
    about equally common answers, so always giving one of them earns a third of the reward."""
    params: Table = setting(default_factory=dict, fix="e.g. {min_terms=2, max_terms=2}")
    """rg: generator settings, e.g. {min_terms=2, max_terms=2}."""
    size: Int = setting(10_000, ge=1, why="the train pool of an rg: task")
    """rg: the train pool; item i is entry i % size."""
    eval_size: Int = setting(100, ge=0, why="0 = no held-out prompts")
    """Held-out prompts (rg: generated; files: the last rows of path, or the first rows of eval_path or of
    eval_split)."""
    eval_seed_offset: Int = setting(1_000_000, allowed="rg: task.size..2**32 - task.eval_size")
    """rg: the eval split is generated with seed + this; must be in size..2**32 - eval_size."""
    instruction: Str = ""
    """rg and file tasks: appended to each question (a chat row's last user turn) after a newline; "" = none. The
    answer_* rewards read <answer> tags, so ask for them here (e.g. "Give the final answer inside
    <answer></answer>.")."""
    chat_template: Bool = True
    """Wrap prompts in the tokenizer's chat template (done by the generators); chat-format rows need it."""
    path: Str = setting("", path="file")
    """jsonl/parquet: the dataset file; hf_disk: the folder written by save_to_disk. Every column of a row reaches
    the reward functions as a keyword argument of that name."""
    eval_path: Str = setting("", path="file")
    """File tasks: a held-out file or hf_disk folder, whose first eval_size rows are the eval split ("" = hold out
    the last eval_size rows of path, or read task.eval_split)."""
    split: Str = "train"
    """hf_disk: the split of a saved DatasetDict to train on (a single saved Dataset: leave "train")."""
    eval_split: Str = ""
    """hf_disk: a split of the DatasetDict in path (or eval_path) whose first eval_size rows are the eval split;
    "" = hold out the last eval_size rows of path."""
    prompt_column: Str = "prompt"
    """File tasks: the column with the question: a string or number, or chat turns, a list of {role, content}
    (roles system, user, assistant; a system turn only first; the last turn the user's question, earlier ones shown
    before it)."""
    answer_column: Str = "answer"
    """File tasks: the column with the reference answer (string or number); "" = the rows have none (open-ended
    tasks: every reference is "", and the built-ins that compare with it are refused)."""
    system_column: Str = ""
    """File tasks: a column whose text is that row's system turn (null or empty: none); "" = no such column."""
    system_prompt: Str = ""
    """A system turn before every question (train and eval), unless the row has its own (a chat system turn or
    task.system_column); "" = none (the chat template may add its own default)."""
    examples: list[Example] = setting(default_factory=list)
    """Worked examples put before every question (train and eval) as earlier chat turns; [] = zero-shot. In TOML:
    examples = [{ question = "Calculate 4 - 1.", completion = "4 - 1 = 3\\n<answer>3</answer>" }]."""


@dataclass(config=SECTION)
class RewardSpec:
    """One reward in rewards.functions: a built-in (`name`), a function of the user's own (`function`) or a remote
    endpoint (`url`): exactly one of the three. Every reward is called the same way (rollout/rewards/calls.py)."""

    name: choice(("",) + REWARD_NAMES, "unknown reward {got}; choose one of {listed}, or give "
                 "function = \"FILE.py:NAME\" for one of your own") = ""
    """A built-in reward (rollout/rewards): correct, answer_correct, lenient_correct, ... ; rg_score (reasoning-gym's
    own verifier), math_verify (LaTeX/numeric answers), reward_model (the [reward_model] classifier)."""
    function: Str = setting("", path="module_file")
    """A function of your own: "FILE.py:NAME" or "MODULE:NAME", called on a batch as fn(prompts, completions,
    completion_ids, references, ..., **columns) -> one float (or None) per completion."""
    url: Str = ""
    """A remote reward: POST the batch as JSON to this http(s) URL; the reply is one number (or null) per completion,
    as a list or {"rewards": [...]}."""
    weight: Float = setting(1.0, gt=-1e6, lt=1e6, allow_inf_nan=False, why="a finite weight")
    """Its weight in the sum of rewards."""
    label: Str = ""
    """The name its mean is logged under (reward/LABEL); "" = the built-in's or the function's name, "remote" for a
    URL."""
    timeout_s: Float = setting(0.0, ge=0, why="0 = rewards.timeout_s")
    """Seconds one call on a batch may take (0 = rewards.timeout_s); a call past it follows rewards.on_error."""
    retries: Int = setting(2, ge=0)
    """url: attempts after the first on a connection error, a timeout or an HTTP 5xx."""


@dataclass(config=SECTION)
class RewardsConfig:
    functions: list[RewardSpec] = setting(default_factory=lambda: [RewardSpec(name="correct")],
                                          allowed="not empty, unless an [environment] with environment.weight != 0 "
                                          "scores (then [] = its score alone)",
                                          fix="e.g. [{name='answer_correct', weight=1.0}]")
    """The reward: the weighted sum of these, e.g. [{name = "answer_correct"}, {function = "my_rewards.py:brevity",
    weight = 0.1}]; with an [environment], its own score joins them (environment.weight, reward/environment). Left
    out of a config with an [environment] whose weight is not 0, it is [] (schema.CONTEXT_DEFAULTS): the environment's
    or agent's own score alone, not the default job's correct beside it. Where every one returns None for a completion
    (an agent returning None with [] here), that is an error (rewards.on_error)."""
    on_error: choice(ON_ERROR, "must be {quoted}") = "fail"
    """A reward call that raises, passes its timeout or returns the wrong count: "fail" stops the run naming the
    reward, the prompt and the line that raised; "zero" scores those completions 0 for that reward, counts them
    (reward/errors, reward/errors/LABEL), prints a warning line each step and keeps the tracebacks in
    RUN_DIR/reward_errors.log (and max_failed_steps still stops a reward that always fails)."""
    timeout_s: Float = setting(60.0, gt=0)
    """Seconds one reward call on a batch may take, unless its entry sets timeout_s."""
    max_failed_steps: Int = setting(3, ge=0, why="0 = never")
    """Stop the run when one entry has failed on every call (raised, hung, returned garbage) for this many steps in a
    row, whatever on_error says: a broken reward is not trained on for long (0 = never stop for it)."""
    num_workers: Int = setting(1, ge=0, why="0 = in the driver, without a way to stop a hung call")
    """Ray reward workers: a step's completions are split among them (whole prompts) and scored in parallel, while
    the reference scores the same step. A worker whose call timed out is replaced. 0 = in the driver process (a hung
    call's thread cannot be stopped there)."""
    num_cpus: Float = setting(0.0, ge=0)
    """Ray CPU resource per reward worker."""
    eval_metric: Str = setting("", allowed="\"\", a built-in accuracy reward (" + ", ".join(EVAL_METRICS)
                               + "), the label of a rewards.functions entry, or environment (with an "
                               "[environment])")
    """What scores held-out accuracy (run.eval): a built-in accuracy reward, or any rewards.functions entry by its
    label (a function of your own, a URL, reward_model), or "environment": the environment's own score of each
    held-out trajectory ([environment] must be set). "" = the first of rg_score, math_verify, answer_correct,
    correct, exact in rewards.functions that can read the references (correct reads integers), else lenient_correct
    (the answer in <answer> tags, else the last number) when the references are numbers and text_match (the reference
    as the answer or a phrase of it) when they are words."""
    eval_threshold: Float = setting(0.5, allow_inf_nan=False, why="a finite score")
    """A held-out answer counts as correct when the eval_metric's score is at or above this (a 0/1 reward is
    unaffected; set it for a graded reward or a reward model's logits)."""


ENV_ON_ERROR = ("end", "fail")
ENV_BRANCHES = ("main", "drop")  # rollout/agents/rows.py: BRANCHES


@dataclass(config=SECTION)
class EnvironmentConfig:
    """[environment]: multi-turn rollouts against an environment of your own (docs/environments.md). Off by
    default: without a name, a rollout is one prompt and one completion."""

    name: Str = setting("", allowed="\"\" (single-turn), FILE.py:NAME or MODULE:NAME, openenv:TARGET, "
                        "agent:FILE.py:NAME", path="module_file")
    """The environment: "FILE.py:NAME" or "MODULE:NAME", NAME an Environment subclass or a function returning a new
    instance; "" = none (single-turn rollouts). Each trajectory gets its own instance: reset from the dataset row,
    then a step per model turn."""
    params: Table = setting(default_factory=dict, fix="e.g. {turn_penalty = 0.1}")
    """Keyword settings of the environment (its class's or factory's parameters), e.g. {turn_penalty = 0.1}."""
    max_turns: Int = setting(4, ge=1)
    """Model turns per trajectory; one that has not ended by then finishes as "max_turns"."""
    turn_tokens: Int = setting(0, ge=0, why="0 = rollout.max_new_tokens for an environment's turns, no cap for an "
                               "agent's calls")
    """New tokens per model turn. An environment's turn: 0 = rollout.max_new_tokens; a trajectory the environment
    ends on a turn cut here (no stop token) finishes as "length". An agent program's call (agent:FILE.py:NAME) gets
    the max_tokens it asks: 0 = no cap beyond the room left in environment.max_context and the model's length; set,
    every call is capped at this many tokens (a call asking more is counted in agent/capped_calls, and one cut there in
    agent/cut_calls). A tool call needs room for its whole JSON (cluster/config/turns.py)."""
    max_context: Int = setting(1024, ge=2)
    """Tokens of a whole trajectory, the prompt and every turn included; one that reaches it finishes as "context"
    (an agent's call past it is refused, and each call's max_tokens is cut to the room it leaves). At most the
    model's context."""
    timeout_s: Float = setting(10.0, gt=0)
    """Seconds one environment call (a reset, a step, a score) may take; past it, the call follows on_error."""
    on_error: choice(ENV_ON_ERROR, "must be {quoted}") = "end"
    """An environment call that raises, passes timeout_s or answers outside the contract: "end" ends that trajectory
    with the error as its last observation and a score of 0 (finish "env_error"); "fail" stops the run naming the
    row."""
    max_failed_steps: Int = setting(3, ge=0, why="0 = never")
    """Stop the run when the environment has failed (raised, hung, answered outside the contract) on every trajectory
    for this many steps in a row, whatever on_error says: a run whose every score is a failure's 0 learns nothing
    (0 = never stop for it). Each step with failures prints a warning line; the tracebacks are kept in
    RUN_DIR/env_errors.log."""
    num_workers: Int = setting(2, ge=1)
    """Ray environment workers per rollout actor: a batch's trajectories are spread over them. A worker that stops
    answering is replaced (the trajectories it held end as "env_error")."""
    num_cpus: Float = setting(0.0, ge=0)
    """Ray CPU resource per environment worker."""
    weight: Float = setting(1.0, gt=-1e6, lt=1e6, allow_inf_nan=False, why="a finite weight")
    """The weight of the environment's score (its `score()`) in the sum of rewards, logged as reward/environment."""
    concurrency: Int = setting(64, ge=1)
    """Agent programs (environment.name = "agent:FILE.py:NAME"): episodes played at once (each a session of the
    endpoint); the rest wait their turn."""
    episode_timeout_s: Float = setting(600.0, gt=0)
    """Agent programs: seconds one whole episode may take; past it, the episode fails and follows on_error."""
    branches: choice(ENV_BRANCHES, "must be {quoted}") = "main"
    """Agent programs: which branches of an episode's call tree train (docs/agents.md, Sessions). "main": the main
    branch, the one with the most sampled tokens (ties: the call issued first); the calls on its other branches
    are counted in agent/untrained_calls, and a step where more than a quarter of the calls did not train warns. "drop":
    an episode that forked trains nothing (its row stays in its group with its loss mask zeroed, so the group keeps
    group_size rows; counted in agent/dropped_episodes). Every branch as a row of its own is not offered: a step's
    batch is rollout.prompts_per_step x rollout.group_size rows (the advantages' groups, the learner's gradient
    accumulation)."""
    served_model: Str = setting("qgrpo-policy")
    """Agent programs: the model name the endpoint serves (what the agent passes as `model`; any other is refused)."""
    endpoint_host: Str = setting("127.0.0.1", fix="e.g. \"0.0.0.0\" to serve agents on other machines")
    """Agent programs: the address the run's endpoint listens on; "0.0.0.0" serves other machines (the address
    written to RUN_DIR/endpoint.json is then the node's)."""
    endpoint_port: Int = setting(0, ge=0, le=65535, why="0 = a free port")
    """Agent programs: the endpoint's port (0 = a free one; the address is printed and written to
    RUN_DIR/endpoint.json)."""


# [rollout.NAME] of each backend with settings, generated from its options dataclass (fields.options_section). Each is
# also a module attribute under its class name (VLLMSection): pickle finds it there when a config travels to an actor.
BACKEND_SECTIONS = {name: options_section(spec.options, __name__) for name, spec in REGISTRY.items()
                    if spec.options is not None}
globals().update({section.__name__: section for section in BACKEND_SECTIONS.values()})


def _backend_tables(cls: type) -> type:
    """`cls` (RolloutConfig) with a field per backend with settings, its [rollout.NAME] table, after its own fields."""
    for name, section in BACKEND_SECTIONS.items():
        cls.__annotations__[name] = section
        setattr(cls, name, setting(default_factory=section,
                                   description=f"[rollout.{name}]: read when backend = \"{name}\"."))
    return cls


@dataclass(config=SECTION)
@_backend_tables
class RolloutConfig(role_resources("per rollout actor", "rollout_node", cpus=1.0,
                                   gpus=" (CUDA clusters; vllm's tensor_parallel_size within)")):
    backend: choice(tuple(REGISTRY), UNKNOWN_BACKEND) = "torch"
    """Generator backend (rollout/backends: what each serves and needs)."""
    precision: Str = setting("int8", allowed=_precisions(REGISTRY) + "; or auto")
    """Weights of the generators' linear layers; what is served depends on rollout.backend and the device. "auto":
    before the run starts, each precision served there is timed on a few decode steps of the run's rows on a rollout
    actor's machine and put to the precision guard's tests; the fastest one accepted is used, and the run directory's
    config.toml and start event record the trials (docs/quantization.md)."""
    group_size_quant: choice((32, 64, 128), "must be {either}") = 64
    """int4 quantization group along in_features."""
    num_actors: Int = setting(1, ge=1)
    """Rollout actors; the prompts of a step are spread over them, whole groups per actor."""
    threads: Int = setting(0, ge=0, why="0 = automatic")
    """Torch threads per rollout actor (0 = cores / num_actors locally; num_cpus on a cluster)."""
    compute_dtype: choice(ROLE_COMPUTE_DTYPES, "must be {quoted}") = ""
    """What the torch generator computes in: "" follows model.compute_dtype; "auto", "bf16" or "fp32" as there."""
    cpu_wait: choice(CPU_WAIT_SETTINGS, "must be {quoted}") = "passive"
    """A rollout actor's idle OpenMP threads on a CPU: "passive" sleep at once, "spin" spin ~20 us first (faster with
    cores of its own); "auto" spins where the roles take turns on one machine's cores (docs/quantization.md)."""
    prompts_per_step: Int = setting(8, ge=1)
    """Prompts sampled per learner step (global)."""
    group_size: Int = setting(8, ge=2, why="advantages compare completions within a group")
    """Completions per prompt (G)."""
    max_new_tokens: Int = setting(24, ge=1)
    """Completion length bound, in tokens."""
    temperature: Float = setting(1.0, gt=0, why="sampling; greedy gives a group no variance")
    """Sampling temperature."""
    top_p: Float = setting(1.0, gt=0, le=1)
    """Nucleus sampling: the smallest set of tokens with this much probability (1 = off)."""
    top_k: Int = setting(0, ge=0, why="0 = off")
    """Sample among the k likeliest tokens (0 = off)."""
    norm_noise: Float = setting(0.0, ge=0, le=0.1, why="0 = off")
    """Exploration noise (QeRL's adaptive quantization noise, docs/quantization.md): at each sync the rollout
    actors add Gaussian noise of this standard deviation to the RMSNorm weights in front of each layer's attention
    and MLP, decaying to norm_noise_end over norm_noise_stages stretches of the run; QeRL used 1e-2. The importance
    weights correct for it as for the quantization. 0 = off."""
    norm_noise_end: Float = setting(5e-4, gt=0, le=0.1)
    """The noise's standard deviation in the last stage (at most rollout.norm_noise)."""
    norm_noise_stages: Int = setting(10, ge=1)
    """Stretches of the run with one standard deviation each, decaying exponentially from norm_noise to
    norm_noise_end (1 = norm_noise throughout)."""


@dataclass(config=SECTION)
class ReferenceConfig(role_resources("of the reference actor", "reference_node")):
    backend: choice(tuple(REFERENCE_BACKENDS), UNKNOWN_BACKEND) = "torch"
    """The reference scorer: torch, or mlx (mlx-lm on Metal or the MLX CPU build; the Mac preset uses it)."""
    precision: Str = setting("bf16", allowed=_precisions(REFERENCE_BACKENDS))
    """The frozen reference may be quantized like the generators (the original MLX design); what is served depends
    on reference.backend (mlx: bf16 is unquantized, fp32 compute on CPU)."""
    threads: Int = setting(0, ge=0, why="0 = automatic")
    """0 = all cores locally (it runs while the generators are idle); on a cluster, its num_cpus."""
    compute_dtype: choice(ROLE_COMPUTE_DTYPES, "must be {quoted}") = ""
    """What the torch reference computes in: "" follows model.compute_dtype; "auto", "bf16" or "fp32" as there."""
    cpu_wait: choice(CPU_WAIT_SETTINGS, "must be {quoted}") = "passive"
    """Its idle OpenMP threads on a CPU, as rollout.cpu_wait."""
    from_learner: Bool = False
    """With learner.mode = "lora" | "qlora": score the reference on the learner's own frozen base with the adapters
    off (no reference actor, no second copy of the model). The rest of [reference] is then unused."""


@dataclass(config=SECTION)
class RewardModelConfig(role_resources("per reward model actor", "reward_node", gpus=" (0 = it scores on the CPU; a "
                                       "share such as 0.25 puts it on a GPU other roles use too)")):
    """[reward_model]: a sequence classifier whose score is one reward among the others, via the entry
    {name = "reward_model", weight = ...} in rewards.functions (rollout/rewards/classifier.py)."""

    path: Str = setting("", allowed="\"\" (none), a local folder of a sequence classifier with one label, a Hub id "
                        "ORG/NAME in the local Hugging Face cache, or builtin:tiny-reward", path="path_or_hub")
    """The reward model ("" = none): a folder saved from AutoModelForSequenceClassification with num_labels = 1 and
    its tokenizer, a Hub id already in the local Hugging Face cache, or builtin:tiny-reward (a tiny random one, for
    tests). It scores each completion after the row's earlier turns and its prompt, in its own chat template."""
    precision: choice(RM_PRECISIONS, "must be {either}") = "bf16"
    """Its weights and compute: bf16, fp32, or int8 (weight-only, quantized like the generators'); CPU or CUDA."""
    num_actors: Int = setting(1, ge=1)
    """Reward model actors; a step's completions are split among them and scored in parallel."""
    threads: Int = setting(0, ge=0, why="0 = automatic")
    """Torch threads per reward model actor (0 = the CPUs Ray gives it, at least one)."""
    batch_size: Int = setting(16, ge=1)
    """Conversations per forward pass (padded to the longest of them)."""
    max_length: Int = setting(0, ge=0, why="0 = the model's context")
    """Tokens scored per conversation (0 = the model's max_position_embeddings); a longer one keeps its last
    max_length tokens, where the score is read."""
    timeout_s: Float = setting(120.0, gt=0)
    """Seconds the reward model actors may take to score one step's completions."""
