"""The rules that span fields: each reads a few fields of the whole config and returns "field: rule; fix" lines.

One field's own rule (its type, bounds, allowed values) is declared with the field (sections.py, training.py).
The rules here need several fields, or knowledge the fields cannot state (which precisions a backend serves). Each
names the fields it reads: when one of those already has an error of its own, the rule is skipped rather than
judged on a value the user did not give (see `rule_problems`). Nothing here touches files, packages or the network:
those checks are preflight.environment_problems.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

from qgrpo.cluster.config.plan import placement_problems
from qgrpo.cluster.config.training import ALGO_RULES, MODE_ZERO_STAGES
from qgrpo.rollout.backends import REFERENCE_BACKENDS, REGISTRY
from qgrpo.rollout.modeling.models import BUILTIN_PREFIX

if TYPE_CHECKING:
    from qgrpo.cluster.config.schema import Config

RULES: list[tuple[tuple[str, ...], Callable[[Config], list[str]]]] = []


def rule(*fields: str) -> Callable:
    """Register a rule reading `fields`."""
    def register(fn: Callable[[Config], list[str]]) -> Callable[[Config], list[str]]:
        RULES.append((fields, fn))
        return fn
    return register


def _overlaps(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def rule_problems(cfg: Config, invalid: Iterable[str] = ()) -> list[str]:
    """Every rule's problems, in order; rules reading a field in `invalid` (fields with errors of their own, whose
    values in `cfg` are defaults standing in for them) are skipped."""
    bad = list(invalid)
    out: list[str] = []
    for fields, check in RULES:
        if not any(_overlaps(f, b) for f in fields for b in bad):
            out += check(cfg)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# [run] and [model]


@rule("run.name")
def _run_name(cfg: Config) -> list[str]:
    name = cfg.run.name
    return [] if name and "/" not in name else [f"run.name: must be non-empty without '/', got {name!r}"]


@rule("run.output_dir")
def _output_uri(cfg: Config) -> list[str]:
    from qgrpo.core.storage import uri_problem

    return list(filter(None, [uri_problem(cfg.run.output_dir, "run.output_dir")]))  # the scheme only: no network


@rule("run.eval", "task.eval_size")
def _eval_needs_prompts(cfg: Config) -> list[str]:
    if cfg.run.eval and cfg.task.eval_size <= 0:
        return ["run.eval: held-out evaluation needs task.eval_size > 0; set task.eval_size=100 or run.eval=false"]
    return []


@rule("run.save_every", "algo.update_every")
def _save_on_sync(cfg: Config) -> list[str]:
    save, every = cfg.run.save_every, cfg.algo.update_every
    if save % every == 0:
        return []
    return [f"run.save_every: must be a multiple of algo.update_every ({every}) so that checkpoints are taken when "
            f"the generators hold the checkpointed weights (exact resume), got {save}; set e.g. "
            f"run.save_every={every * -(-save // every)}"]


@rule("model.path")
def _model_path(cfg: Config) -> list[str]:
    from qgrpo.rollout.modeling.models import BUILTIN_MODELS
    from qgrpo.rollout.rewards.classifier import CLASSIFIER_BUILTINS

    path, policies = cfg.model.path, sorted(set(BUILTIN_MODELS) - set(CLASSIFIER_BUILTINS))
    if not path:
        return ["model.path: missing; set a local HF model folder or a builtin model: "
                + ", ".join(BUILTIN_PREFIX + n for n in policies)]
    name = path[len(BUILTIN_PREFIX):]
    if path.startswith(BUILTIN_PREFIX) and name in CLASSIFIER_BUILTINS:
        return [f"model.path: builtin:{name} is a reward model (a sequence classifier), not a policy; set it as "
                f"reward_model.path and choose a policy: {', '.join(policies)}"]
    if path.startswith(BUILTIN_PREFIX) and name not in BUILTIN_MODELS:
        return [f"model.path: unknown builtin model {name!r}; choose one of {', '.join(policies)}"]
    return []  # a folder: whether it exists here is an environment check


# ---------------------------------------------------------------------------------------------------------------------
# [task] and [rewards]


@rule("task.name")
def _task_name(cfg: Config) -> list[str]:
    from qgrpo.rollout.data.tasks import RG_PREFIX, TASKS

    name = cfg.task.name
    if name.startswith(RG_PREFIX) or name in TASKS:
        return []
    return [f"task.name: unknown task {name!r}; choose one of {', '.join(sorted(TASKS))}, or {RG_PREFIX}NAME for a "
            f"reasoning-gym generator, e.g. {RG_PREFIX}basic_arithmetic"]


@rule("task.examples")
def _examples(cfg: Config) -> list[str]:
    return [f"task.examples[{i}]: question and completion must both be non-empty text, e.g. "
            '{ question = "Calculate 4 - 1.", completion = "4 - 1 = 3\\n<answer>3</answer>" }'
            for i, ex in enumerate(cfg.task.examples) if not (ex.question.strip() and ex.completion.strip())]


@rule("task.name", "task.params")
def _params_only_for_rg(cfg: Config) -> list[str]:
    from qgrpo.rollout.data.tasks import RG_PREFIX

    t = cfg.task
    if t.params and not t.name.startswith(RG_PREFIX):
        return [f"task.params: only {RG_PREFIX} tasks take generator settings; remove task.params for "
                f"task.name={t.name!r}"]
    return []


@rule("task.name", "task.size", "task.eval_seed_offset", "task.eval_size")
def _rg_eval_split(cfg: Config) -> list[str]:
    from qgrpo.rollout.data.tasks import RG_PREFIX, RG_SEED_STRIDE

    t = cfg.task
    if not t.name.startswith(RG_PREFIX) or t.size <= t.eval_seed_offset <= RG_SEED_STRIDE - t.eval_size:
        return []
    return [f"task.eval_seed_offset: must be in task.size..2**32 - task.eval_size, got {t.eval_seed_offset} "
            f"(size {t.size}); reasoning-gym draws entry i with seed + i, so a smaller offset makes eval entries "
            f"copies of train entries; e.g. set task.eval_seed_offset={max(t.size, 1_000_000)}"]


@rule("task.name", "task.path", "task.eval_path", "task.prompt_column", "task.answer_column", "task.system_column")
def _file_task(cfg: Config) -> list[str]:
    from qgrpo.rollout.data.datasets import FORMATS

    t = cfg.task
    kinds = ", ".join(FORMATS[:-1]) + f" and {FORMATS[-1]}"
    if t.name not in FORMATS:
        return [f"task.{key}: only read by the {kinds} tasks, not {t.name!r}; remove it or set task.name to one of "
                "them" for key, value in (("path", t.path), ("eval_path", t.eval_path),
                                          ("system_column", t.system_column)) if value]
    what = "folder written by save_to_disk" if t.name == "hf_disk" else f"{t.name} file"
    out = [] if t.path else [f"task.path: missing; set the {what} with a {t.prompt_column!r} column"]
    if not t.prompt_column or t.prompt_column == t.answer_column:
        out.append(f"task.prompt_column/answer_column: must be two different names, the prompt column's not empty "
                   f"(answer_column \"\" = no answers), got {t.prompt_column!r} and {t.answer_column!r}")
    if t.system_column and t.system_column in (t.prompt_column, t.answer_column):
        out.append(f"task.system_column: {t.system_column!r} is also the prompt or answer column; name the column "
                   "holding each row's system prompt, or \"\" for none")
    return out  # whether the files exist here is an environment check; rollout.tasks.check_task reads the rows


@rule("task.name", "task.answer_column", "rewards.functions")
def _references_needed(cfg: Config) -> list[str]:  # built-ins that compare completions with the reference answer
    if cfg.task.name not in ("jsonl", "parquet", "hf_disk") or cfg.task.answer_column:
        return []
    return [f"rewards.functions[{i}]: {s.name} compares completions with the reference answer, but task.answer_column "
            '= "" (the rows have none); set task.answer_column to the column of answers, or use rewards that need none '
            "(answer_format, integer_format, reward_model, a function or a url)" for i, s in enumerate(
                cfg.rewards.functions) if s.name in ("correct", "exact", "answer_correct", "lenient_correct",
                                                     "text_match", "rg_score", "math_verify")]


@rule("task.name", "task.split", "task.eval_split")
def _hf_splits(cfg: Config) -> list[str]:
    t = cfg.task
    if t.name == "hf_disk":
        return [] if t.split else ['task.split: empty; name the split of the saved DatasetDict to train on (a single '
                                   'saved Dataset: leave the default "train")']
    changed = [key for key, value, default in (("split", t.split, "train"), ("eval_split", t.eval_split, ""))
               if value != default]
    return [f"task.{key}: only read by the hf_disk task (splits of a saved DatasetDict), not {t.name!r}; remove it"
            for key in changed]


@rule("rewards.functions", "task.name")
def _reward_entries(cfg: Config) -> list[str]:
    """Each entry is exactly one of name / function / url, well formed; labels (the metric names) are unique."""
    from qgrpo.rollout.rewards.calls import RewardLoadError, split_spec
    from qgrpo.rollout.rewards.remote import url_problems
    from qgrpo.rollout.rewards.scoring import entry_label

    out, labels = [], {}
    for i, s in enumerate(cfg.rewards.functions):
        where = f"rewards.functions[{i}]"
        given = [k for k in ("name", "function", "url") if getattr(s, k)]
        if len(given) != 1:
            out.append(f"{where}: give exactly one of name (a built-in), function (\"FILE.py:NAME\") or url, got "
                       f"{' and '.join(given) or 'none'}; e.g. {{name = \"answer_correct\", weight = 1.0}}")
            continue
        try:
            if s.function:
                split_spec(s.function, f"{where}.function")
        except RewardLoadError as e:
            out.append(str(e))
            continue
        out += url_problems(s.url, f"{where}.url") if s.url else []
        if s.name == "rg_score" and not cfg.task.name.startswith("rg:"):
            out.append(f"{where}: rg_score is reasoning-gym's own verifier, for rg: tasks only, not task.name = "
                       f"{cfg.task.name!r}; use answer_correct, math_verify or a function of your own")
        label = entry_label(s)
        if label in labels:
            out.append(f"{where}: its metric name {label!r} is also rewards.functions[{labels[label]}]'s; set a "
                       "distinct label = \"...\" on one of them")
        labels.setdefault(label, i)
    return out


@rule("rewards.functions", "environment.name", "environment.weight")
def _some_reward(cfg: Config) -> list[str]:
    """rewards.functions = [] only where an environment's own score is the reward (environment.weight != 0)."""
    env = cfg.environment
    if cfg.rewards.functions or (env.name and env.weight):
        return []
    if env.name:
        return ["rewards.functions: empty, and environment.weight = 0 leaves the environment's score out, so nothing "
                "scores a trajectory; set environment.weight (e.g. 1.0) or list rewards, e.g. "
                "[{name = \"answer_correct\", weight = 1.0}]"]
    return ["rewards.functions: must not be empty without an [environment] (whose own score can be the reward); "
            "list the rewards, e.g. [{name = \"answer_correct\", weight = 1.0}]"]


@rule("rewards.eval_metric", "rewards.functions")
def _eval_metric(cfg: Config) -> list[str]:
    """rewards.eval_metric names an accuracy built-in, a rewards.functions entry by its label, or "environment" (the
    environment's own score of each trajectory, which needs an [environment])."""
    from qgrpo.rollout.rewards.builtin import EVAL_METRICS
    from qgrpo.rollout.rewards.judge import ENVIRONMENT
    from qgrpo.rollout.rewards.scoring import entry_label

    name = cfg.rewards.eval_metric
    if name == ENVIRONMENT and not cfg.environment.name:
        return [f"rewards.eval_metric: {name!r} judges held-out trajectories by the environment's own score, but no "
                "environment is set (environment.name = \"\"); set environment.name = \"FILE.py:NAME\", or name an "
                "accuracy reward or the label of a rewards.functions entry"]
    if not name or name in EVAL_METRICS or name == ENVIRONMENT:
        return []
    try:
        labels = [entry_label(s) for s in cfg.rewards.functions]
    except ValueError:  # a malformed entry: _reward_entries names it
        return []
    if name in labels:
        return []
    return [f"rewards.eval_metric: {name!r} is neither a built-in accuracy reward ({', '.join(EVAL_METRICS)}) nor "
            f"the label of a rewards.functions entry ({', '.join(labels)}) nor \"environment\" (with an "
            "[environment]); name one of them, or leave it \"\" to let the references decide"]


# ---------------------------------------------------------------------------------------------------------------------
# [environment]


@rule("environment.name")
def _environment_name(cfg: Config) -> list[str]:
    from qgrpo.rollout.environments.loader import EnvironmentLoadError, split_name

    name = cfg.environment.name
    if not name:
        return []
    try:
        split_name(name)
    except EnvironmentLoadError as e:
        return [str(e)]
    return []  # whether the file or module is there, and NAME in it: qgrpo check (rollout/environments/probe.py)


@rule("environment.name", "environment.params")
def _environment_params(cfg: Config) -> list[str]:
    if cfg.environment.params and not cfg.environment.name:
        return ["environment.params: set, but environment.name is \"\" (no environment); name the environment "
                "(\"FILE.py:NAME\") or remove environment.params"]
    return []


@rule("environment.name", "environment.branches")
def _environment_branches(cfg: Config) -> list[str]:
    from qgrpo.rollout.environments.kinds import capabilities

    if cfg.environment.branches == "main" or capabilities(cfg.environment.name).forks:
        return []
    return [f"environment.branches: {cfg.environment.branches!r} is read for agent programs only (environment.name "
            f"= \"agent:FILE.py:NAME\"), whose calls can fork; an environment's trajectory never does: remove it"]


@rule("environment.name", "rollout.backend")
def _environment_backend(cfg: Config) -> list[str]:
    backend = cfg.rollout.backend
    if not cfg.environment.name or REGISTRY[backend].multi_turn:
        return []
    able = ", ".join(n for n, s in REGISTRY.items() if s.multi_turn) or "none yet"
    return [f"rollout.backend: {backend!r} cannot continue a trajectory from its token ids, which an environment's "
            f"turns need (environment.name = {cfg.environment.name!r}); choose one that can: {able}"]


@rule("environment.name", "algo.dynamic_sampling")
def _agent_dynamic_sampling(cfg: Config) -> list[str]:
    from qgrpo.rollout.environments.kinds import capabilities

    if capabilities(cfg.environment.name).redraws or not cfg.algo.dynamic_sampling:
        return []
    return ["algo.dynamic_sampling: not served for agent programs (environment.name = "
            f"{cfg.environment.name!r}): their episodes are drawn step by step; set it to false"]


@rule("environment.name", "environment.turn_tokens", "environment.max_context", "rollout.max_new_tokens")
def _turn_fits_context(cfg: Config) -> list[str]:
    from qgrpo.cluster.config.turns import turn_tokens
    from qgrpo.rollout.environments.kinds import capabilities

    env = cfg.environment
    if not env.name or (capabilities(env.name).asks_max_tokens and not env.turn_tokens):  # a call: what fits, no cap
        return []
    turn, key = turn_tokens(cfg)
    if turn < env.max_context:
        return []
    return [f"environment.max_context: {env.max_context} tokens for a whole trajectory leave no room beside one "
            f"model turn of {turn} tokens ({key}) and the prompt; raise environment.max_context or lower "
            "environment.turn_tokens"]


@rule("environment.name", "environment.weight", "rewards.functions")
def _environment_label(cfg: Config) -> list[str]:
    """The environment's score joins the rewards by environment.weight, under the metric name "environment"."""
    from qgrpo.rollout.rewards import ENVIRONMENT_REWARD as ENVIRONMENT_LABEL
    from qgrpo.rollout.rewards.scoring import entry_label

    if not cfg.environment.name or not cfg.environment.weight:
        return []
    try:
        labels = [entry_label(s) for s in cfg.rewards.functions]
    except ValueError:  # a malformed entry: _reward_entries names it
        return []
    if ENVIRONMENT_LABEL not in labels:
        return []
    return [f"rewards.functions[{labels.index(ENVIRONMENT_LABEL)}]: its metric name {ENVIRONMENT_LABEL!r} is the "
            f"environment's score's (weighted by environment.weight, logged as reward/{ENVIRONMENT_LABEL}); set "
            "another label = \"...\" on it"]


# ---------------------------------------------------------------------------------------------------------------------
# Backends, precisions and placement


@rule("rollout.backend", "rollout.precision", "rollout.num_gpus", "sync.requantize",
      "learner.fake_quant")
def _rollout_precision(cfg: Config) -> list[str]:
    from qgrpo.rollout.backends import AUTO, auto_candidates, device_of

    ro = cfg.rollout
    spec = REGISTRY[ro.backend]
    here = set(spec.unavailable())  # platform and packages: environment_problems reports those
    if ro.precision != AUTO:
        return [p for p in spec.problems(ro.precision, ro.num_gpus) if p not in here]
    device = device_of(ro.num_gpus)
    if auto_candidates(ro.backend, device, grid_needed(cfg)):
        return []
    if not spec.served(device):  # the backend does not run there: its own message for any precision says so
        return [p for p in spec.problems("bf16", ro.num_gpus) if p not in here]
    return [f"rollout.precision: \"auto\" tries the precisions with a grid the rollout actor emulates "
            f"(sync.requantize = {cfg.sync.requantize!r}, learner.fake_quant = {cfg.learner.fake_quant!r}), and the "
            f"{ro.backend} backend serves none on {device}; name a precision, or set sync.requantize = \"nearest\" and "
            "fake_quant = \"off\""]


def grid_needed(cfg: Config) -> bool:
    """Whether the config needs the generators' format to be an emulated grid (sync.requantize other than "nearest",
    learner.fake_quant = "rollout"): then `auto` tries only those."""
    return cfg.sync.requantize != "nearest" or cfg.learner.fake_quant != "off"


@rule(*(f"rollout.{name}" for name, spec in REGISTRY.items() if spec.options is not None), "rollout.num_gpus")
def _backend_tables(cfg: Config) -> list[str]:
    # Each backend checks its own [rollout.NAME] table, chosen or not (a typo there would otherwise wait for the
    # day the backend is chosen).
    return [p for name, spec in REGISTRY.items() if spec.options is not None
            for p in getattr(cfg.rollout, name).problems(f"rollout.{name}", cfg.rollout.num_gpus)]


@rule("reference.backend", "reference.precision", "reference.num_gpus")
def _reference_precision(cfg: Config) -> list[str]:
    from qgrpo.rollout.backends import device_of

    ref = cfg.reference
    served = REFERENCE_BACKENDS[ref.backend]
    if ref.precision not in served:
        return [f"reference.precision: {ref.precision!r} is not served by the {ref.backend} reference; choose one "
                f"of {', '.join(served)}"]
    device = device_of(ref.num_gpus)
    here = REGISTRY[ref.backend].served(device)
    if not here or ref.precision in here:  # a backend serving nothing there: gpu_problems says so
        return []
    gpu = ref.precision in REGISTRY[ref.backend].served("cuda") and device == "cpu"
    return [f"reference.precision: {ref.precision} on the {ref.backend} reference is not served on {device} "
            f"(reference.num_gpus = {ref.num_gpus:g}); choose one of {', '.join(here)}"
            + (", or set reference.num_gpus >= 1 to score on a CUDA GPU" if gpu else "")]


@rule(*(f"{role}.{key}" for role in ("rollout", "reference", "learner") for key in ("resources", "node_labels")))
def _placement(cfg: Config) -> list[str]:
    return [p for role in ("rollout", "reference", "learner") for p in placement_problems(role, getattr(cfg, role))]


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
    if cfg.reference_actor and ref.num_gpus > 0 and not REGISTRY[ref.backend].served("cuda"):
        cuda = next(n for n in REFERENCE_BACKENDS if REGISTRY[n].served("cuda"))
        p.append(f"reference.num_gpus: the {ref.backend} reference runs on Apple silicon or the CPU, never on CUDA; "
                 f"set reference.num_gpus = 0, or reference.backend = \"{cuda}\" to score on a GPU")
    return p


rule("rollout.num_gpus", "reference.num_gpus", "reference.backend", "reference.from_learner", "learner.num_gpus",
     "learner.world_size", "algo.kl_coeff")(gpu_problems)


# ---------------------------------------------------------------------------------------------------------------------
# [algo] and [learner]


for _fields, _check in ALGO_RULES:
    rule(*_fields)(lambda cfg, check=_check: check(cfg.algo, cfg))


@rule("learner.mode", "learner.zero_stage")
def _zero_stage_of_mode(cfg: Config) -> list[str]:
    le = cfg.learner
    stages = MODE_ZERO_STAGES[le.mode]
    if le.zero_stage in stages:
        return []
    return [f"learner.zero_stage: learner.mode = {le.mode!r} supports ZeRO stages {', '.join(map(str, stages))}, got "
            f"{le.zero_stage} (ZeRO-3 partitions the weights, which a 4-bit base and the merged export of adapters "
            "do not allow); set learner.zero_stage = 2"]


@rule("reference.from_learner", "learner.mode")
def _reference_from_learner(cfg: Config) -> list[str]:
    if not (cfg.reference.from_learner and cfg.learner.mode == "full"):
        return []
    return ["reference.from_learner: needs learner.mode = \"lora\" or \"qlora\" (the reference is the learner's frozen "
            "base with its adapters off; a full fine-tune has no frozen base); set it to false for a reference actor"]


@rule("learner.world_size", "rollout.prompts_per_step", "rollout.group_size")
def _batch_over_ranks(cfg: Config) -> list[str]:
    batch, ranks = cfg.rollout.prompts_per_step * cfg.rollout.group_size, cfg.learner.world_size
    if batch % ranks == 0:
        return []
    return [f"learner.world_size: the {batch} sequences of a step (rollout.prompts_per_step * rollout.group_size) "
            f"must split evenly over {ranks} ranks; change prompts_per_step or world_size"]


# ---------------------------------------------------------------------------------------------------------------------
# [reward_model]


@rule("reward_model.path", "rewards.functions")
def _reward_model_used(cfg: Config) -> list[str]:
    """A reward model scores only through a rewards.functions entry named "reward_model", which needs one."""
    from qgrpo.rollout.rewards import MODEL_REWARD

    entries = [i for i, s in enumerate(cfg.rewards.functions) if getattr(s, "name", "") == MODEL_REWARD]
    path = cfg.reward_model.path
    if path and not entries:
        return [f"reward_model.path: set ({path!r}) but no rewards.functions entry uses it, so it would be loaded and "
                f"never scored; add {{name = \"{MODEL_REWARD}\", weight = 1.0}} to rewards.functions, or remove "
                "reward_model.path"]
    if entries and not path:
        return [f"rewards.functions[{entries[0]}]: the {MODEL_REWARD!r} reward needs a reward model, but "
                "reward_model.path is empty; set reward_model.path to a sequence classifier folder (or "
                "builtin:tiny-reward for a test), or remove the entry"]
    if len(entries) > 1:
        return [f"rewards.functions[{entries[1]}]: a second {MODEL_REWARD!r} entry (the first is "
                f"rewards.functions[{entries[0]}]); keep one and set its weight"]
    return []


@rule("reward_model.path")
def _reward_model_builtin(cfg: Config) -> list[str]:
    from qgrpo.rollout.modeling.models import BUILTIN_MODELS
    from qgrpo.rollout.rewards.classifier import CLASSIFIER_BUILTINS

    path = cfg.reward_model.path
    if not path.startswith(BUILTIN_PREFIX):
        return []  # a folder or Hub id: what it holds is a preflight check (reward_model_problems)
    name = path[len(BUILTIN_PREFIX):]
    ok = ", ".join(BUILTIN_PREFIX + n for n in CLASSIFIER_BUILTINS)
    if name not in BUILTIN_MODELS:
        return [f"reward_model.path: unknown builtin model {name!r}; the builtin reward models are: {ok}"]
    if name not in CLASSIFIER_BUILTINS:
        return [f"reward_model.path: {path} is a causal LM, not a sequence classifier with one label; the builtin "
                f"reward models are: {ok}"]
    return []


@rule("reward_model.precision", "reward_model.num_gpus")
def _reward_model_device(cfg: Config) -> list[str]:
    from qgrpo.rollout.backends import device_of
    from qgrpo.rollout.rewards.classifier import rm_served

    rm, out = cfg.reward_model, []
    device = device_of(rm.num_gpus)
    # a torch classifier, quantized by rollout/quantization/quant.py: no generator backend's spec
    here = rm_served(device)
    if rm.precision not in here:
        out.append(f"reward_model.precision: {rm.precision} is not served on {device} (reward_model.num_gpus = "
                   f"{rm.num_gpus:g}); choose one of {', '.join(here)}")
    if rm.num_gpus > 1:
        out.append(f"reward_model.num_gpus: {rm.num_gpus:g} GPUs per actor, but a reward model actor scores on one "
                   "GPU; set reward_model.num_gpus = 1 (or a share, e.g. 0.25) and scale out with "
                   "reward_model.num_actors")
    return out


@rule("reward_model.resources", "reward_model.node_labels")
def _reward_model_placement(cfg: Config) -> list[str]:
    return placement_problems("reward_model", cfg.reward_model)
