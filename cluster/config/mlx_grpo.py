"""MLX-GRPO configs read as ours: `qgrpo train old.toml` takes an MLX-GRPO TOML (flat keys, or under an [mlx_grpo]
table) and its `--set key=value` overrides, prints how every key maps, and `qgrpo migrate` writes the result as one of
our configs (`migrate`).

MLX-GRPO is a single-process Mac trainer: one prompt per "batch step", `gradient_accumulation_steps` batch steps per
optimizer update, `num_generations` completions per prompt, a 4-bit `model_old` synced every `update_every` batch
steps, GSM8K from the hub with an XML-format system prompt. Our step is one optimizer update on `prompts_per_step`
prompts, so counts in batch steps are converted to our steps (divided by gradient_accumulation_steps), and each
conversion is printed. A key without an equivalent here is printed with what happens instead; an unknown key is an
error naming the nearest key (MLX-GRPO itself ignored unknown keys silently, which hid typos).

Keys MLX-GRPO did not have (the task, the rewards, the backends) come from our own sections when the file has them
([task], [rewards], [rollout], ... beside the MLX-GRPO keys). A field set both in our section and by an MLX-GRPO key
the file writes is an error naming both; MLX-GRPO's defaults give way to our sections.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import platform
from typing import Any

from pydantic import TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

from qgrpo.cluster.config.errors import problems_of
from qgrpo.cluster.config.fields import SECTION, Bool, Float, Int, Str, choice, setting
from qgrpo.cluster.config.tomlio import is_text_field, parse_value
from qgrpo.cluster.config.training import LR_SCHEDULES

TABLE = "mlx_grpo"
GSM8K_TRAIN_SIZE = 7_473  # MLX-GRPO trained on all of GSM8K's train split unless max_train_samples said otherwise
# MLX-GRPO's system prompt (its GSM8K formatting); ours reads the number inside <answer></answer>
SYSTEM_PROMPT = "Respond in the following format:\n\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>"


@dataclass(config=SECTION)
class MLXGRPOKeys:
    """MLX-GRPO's settings (its MLXGRPOConfig) with its defaults, plus the keys its configs carry in later versions.
    A count of "batch steps" is MLX-GRPO's: one prompt each, gradient_accumulation_steps of them per update."""

    model_name: Str = "Qwen/Qwen2.5-1.5B-Instruct"
    """-> model.path (a local folder: mlx-lm's converted folders load as they are)."""
    output_dir: Str = "outputs/Qwen-1.5B-MLX-GRPO"
    """-> run.output_dir."""
    run_name: Str = "Qwen-1.5B-MLX-GRPO-gsm8k"
    """-> run.name (runs go to output_dir/run_name-TIME)."""
    learning_rate: Float = 1e-6
    """-> learner.lr."""
    batch_size: Int = setting(1, ge=1)
    """Prompts per batch step; batch_size x gradient_accumulation_steps -> rollout.prompts_per_step."""
    gradient_accumulation_steps: Int = setting(4, ge=1)
    """Batch steps per optimizer update; one of our steps is one update."""
    num_epochs: Int = setting(1, ge=1)
    """Passes over the training prompts -> run.steps."""
    max_train_samples: Int = setting(0, ge=0, why="0 = GSM8K's whole train split")
    """Training prompts (0 = GSM8K's whole train split) -> run.steps, and task.size without a [task] table."""
    warmup_ratio: Float = setting(0.1, ge=0, lt=1)
    """Share of the run that warms the learning rate up -> learner.warmup_steps."""
    max_grad_norm: Float = 0.1
    """-> learner.grad_clip."""
    logging_steps: Int = setting(1, ge=1)
    """-> run.log_every."""
    num_generations: Int = setting(64, ge=1)
    """Completions per prompt -> rollout.group_size."""
    max_prompt_length: Int = 512
    """Not enforced (MLX-GRPO declared it and did not use it)."""
    max_completion_length: Int = 1024
    """Not used: rollout.max_new_tokens bounds completions (MLX-GRPO generated max_new_tokens)."""
    max_new_tokens: Int = setting(512, ge=1)
    """-> rollout.max_new_tokens."""
    temperature: Float = 0.7
    """-> rollout.temperature (top_p is 0.95, fixed in MLX-GRPO's sampler)."""
    clip_eps: Float = 0.2
    """-> algo.clip_low and algo.clip_high (a symmetric clip)."""
    kl_coeff: Float = 0.0
    """-> algo.kl_coeff (0 = no reference model); the estimator is k3, as MLX-GRPO's."""
    adam_beta1: Float = 0.9
    """-> learner.beta1."""
    adam_beta2: Float = 0.999
    """-> learner.beta2."""
    weight_decay: Float = 0.0
    """-> learner.weight_decay."""
    lr_scheduler_type: choice(LR_SCHEDULES, "{got} is not served here; use 'cosine' (MLX-GRPO's) or 'constant'") = (
        "cosine")
    """-> learner.lr_schedule."""
    save_steps: Int = setting(100, ge=0)
    """Checkpoint every N batch steps -> run.save_every, in our steps, a multiple of algo.update_every."""
    eval_steps: Int = setting(50, ge=0)
    """Evaluate every N batch steps (0 = never) -> run.eval and run.eval_every."""
    eval_samples: Int = setting(200, ge=0)
    """-> task.eval_size: a fixed held-out set (MLX-GRPO drew a new random subset each time)."""
    seed: Int = 0
    """-> run.seed."""
    use_compile: Bool = True
    """No equivalent: the learner is torch + DeepSpeed, the generators compile nothing."""
    eval_every_updates: Int = setting(25, ge=0)
    """Not a separate pass here: train/accuracy is in metrics.jsonl at every step."""
    eval_subset_size: Int = 200
    """Not needed here: train/accuracy covers every prompt trained on."""
    eval_max_new_tokens: Int = setting(128, ge=0)
    """-> run.eval_max_new_tokens."""
    log_jsonl: Bool = True
    """metrics.jsonl is always written here."""
    quantize_for_rollouts: Bool = True
    """int4 group-64 generators and reference (true) or unquantized ones -> rollout.precision, reference.precision."""
    update_every: Int = setting(10, ge=0)
    """Sync model_old every N batch steps -> algo.update_every, in our steps."""


# Keys of other GRPO trainers (and MLX-GRPO forks) a user may write here: our field and the value to give it.
ALIASES: dict[str, tuple[str, str]] = {
    "use_lora": ("learner.mode", '"lora"'), "lora_rank": ("learner.lora.rank", ""),
    "lora_alpha": ("learner.lora.alpha", ""), "lora_dropout": ("learner.lora.dropout", ""),
    "top_p": ("rollout.top_p", ""), "top_k": ("rollout.top_k", ""), "max_steps": ("run.steps", ""),
    "beta": ("algo.kl_coeff", ""),
}
DEFAULTS: dict[str, Any] = dataclasses.asdict(MLXGRPOKeys())
OUR_SECTIONS = ("run", "model", "task", "rewards", "rollout", "reference", "algo", "learner", "sync", "faults", "guard")
_ADAPTER = TypeAdapter(MLXGRPOKeys)


def is_mlx_grpo(data: dict) -> bool:
    """An MLX-GRPO file: an [mlx_grpo] table, or any of its keys at the top level (ours has only tables there)."""
    return isinstance(data.get(TABLE), dict) or any(k in DEFAULTS for k in data)


def unknown_key(at_loc: str, loc: tuple, known: list[str]) -> str:
    """An unknown MLX-GRPO key: what it means here when it is a known alias, else the nearest key."""
    key, keys = str(loc[-1]), sorted(known)
    if key in ALIASES:
        field, value = ALIASES[key]
        section = field.rsplit(".", 1)[0]
        hint = (f"its equivalent here is {field}{f' = {value}' if value else ''} (in a [{section}] table beside the "
                f"MLX-GRPO keys, or --set {field}={value.strip(chr(34)) if value else '...'})")
    else:
        near = difflib.get_close_matches(key, keys, n=1)
        hint = (f"did you mean {near[0]}?" if near else
                f"our own settings go in tables beside the keys: [{'], ['.join(OUR_SECTIONS)}]")
    return (f"{key}: not an MLX-GRPO key; known keys are: {', '.join(keys[:3])}, ... ({len(keys)} in all, listed in "
            f"docs/reference/config.md); {hint}")


def _split(data: dict, overrides, problems: list[str]) -> tuple[dict, dict, list[str]]:
    """(MLX-GRPO keys with their overrides applied, our own sections, our own overrides)."""
    data = copy.deepcopy(data)
    flat = data.pop(TABLE) if isinstance(data.get(TABLE), dict) else {}
    ours = {k: data.pop(k) for k in list(data) if k in OUR_SECTIONS and isinstance(data[k], dict)}
    for key in list(data):  # flat keys at the top level (a file may use both forms; a key given twice is an error)
        if key in flat:
            problems.append(f"{key}: given both at the top level and in [{TABLE}]; keep one")
        flat[key] = data.pop(key)
    rest = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep:
            problems.append(f"--set {item}: expected key=value (an MLX-GRPO key) or section.key=value (ours)")
        elif "." in key:
            rest.append(item)
        else:
            flat[key] = parse_value(raw.strip(), is_text_field(MLXGRPOKeys, key))
    return flat, ours, rest


class _Translation:
    """Our config dict being built from the MLX-GRPO values `c`, with a line per mapping and, per field we set, the
    MLX-GRPO keys it came from."""

    def __init__(self, c: dict[str, Any], given: set[str]):
        self.c, self.given = c, given
        self.out: dict[str, dict] = {s: {} for s in OUR_SECTIONS}
        self.lines: list[str] = []
        self.origin: dict[str, str] = {}  # our field -> the first MLX-GRPO key it came from
        self.sources: dict[str, tuple[str, ...]] = {}  # our field -> every MLX-GRPO key it came from
        self.line_of: dict[str, int] = {}  # our field -> its line in self.lines
        self.accum = c["gradient_accumulation_steps"]

    def _shown(self, key: str) -> str:
        return f"{key} = {self.c[key]!r}" + ("" if key in self.given else " (MLX-GRPO default)")

    def put(self, field: str, value: Any, keys: tuple[str, ...], why: str = "") -> None:
        section, name = field.split(".", 1)
        self.out[section][name] = value
        self.origin[field], self.sources[field], self.line_of[field] = keys[0], keys, len(self.lines)
        source = " + ".join(map(self._shown, keys))
        self.lines.append(f"{source} -> {field} = {value!r}" + (f"  ({why})" if why else ""))

    def fixed(self, field: str, value: Any, what: str) -> None:
        """A value MLX-GRPO fixed in its code rather than in a key: our section may always set it otherwise."""
        section, name = field.split(".", 1)
        self.out[section][name], self.line_of[field] = value, len(self.lines)
        self.lines.append(f"({what}) -> {field} = {value!r}")

    def note(self, key: str, what: str) -> None:
        self.lines.append(f"{self._shown(key)} -> {what}")

    def in_steps(self, batch_steps: int) -> int:  # MLX-GRPO counts batch steps; one of our steps is `accum` of them
        return max(1, round(batch_steps / self.accum))

    def training(self) -> tuple[int, int]:
        """The run's length, the optimizer and the sync: returns (our steps, algo.update_every)."""
        c, put = self.c, self.put
        per_update = c["batch_size"] * self.accum
        samples = c["max_train_samples"] or GSM8K_TRAIN_SIZE
        steps = math.ceil(samples / per_update) * c["num_epochs"]
        put("model.path", c["model_name"], ("model_name",),
            "a local folder: mlx-lm's converted folders load as they are")
        put("run.output_dir", c["output_dir"], ("output_dir",))
        put("run.name", c["run_name"], ("run_name",), "runs go to output_dir/run_name-TIME")
        put("run.seed", c["seed"], ("seed",))
        put("learner.lr", c["learning_rate"], ("learning_rate",))
        put("rollout.prompts_per_step", per_update, ("batch_size", "gradient_accumulation_steps"),
            "one of our steps is one optimizer update, on all the prompts MLX-GRPO accumulated for it")
        put("rollout.group_size", c["num_generations"], ("num_generations",))
        put("run.steps", steps, ("max_train_samples", "num_epochs"),
            f"ceil({samples} prompts / {per_update} per update) x {c['num_epochs']} epochs"
            + ("" if c["max_train_samples"] else "; 0 = GSM8K's whole train split"))
        update_every = self.in_steps(c["update_every"]) if c["update_every"] else 1
        put("algo.update_every", update_every, ("update_every",),
            f"MLX-GRPO synced model_old every {c['update_every']} batch steps = {c['update_every'] / self.accum:g} "
            "updates")
        warm = max(1, int(steps * c["warmup_ratio"])) if c["warmup_ratio"] else 0
        put("learner.warmup_steps", warm, ("warmup_ratio",),
            f"int({steps} steps x {c['warmup_ratio']}), as MLX-GRPO did")
        put("learner.lr_schedule", c["lr_scheduler_type"], ("lr_scheduler_type",),
            "cosine decay to 0 over the run, times the warm-up ramp" if c["lr_scheduler_type"] == "cosine" else "")
        put("learner.grad_clip", c["max_grad_norm"], ("max_grad_norm",))
        put("learner.beta1", c["adam_beta1"], ("adam_beta1",))
        put("learner.beta2", c["adam_beta2"], ("adam_beta2",))
        put("learner.weight_decay", c["weight_decay"], ("weight_decay",))
        put("run.log_every", c["logging_steps"], ("logging_steps",), "a metrics.jsonl line every N steps")
        return steps, update_every

    def sampling(self) -> None:
        """Generation, the objective, the precisions and the backends."""
        c, put = self.c, self.put
        put("rollout.max_new_tokens", c["max_new_tokens"], ("max_new_tokens",))
        put("rollout.temperature", c["temperature"], ("temperature",))
        self.fixed("rollout.top_p", 0.95, "MLX-GRPO's sampler: fixed in its generate_responses")
        put("algo.clip_low", c["clip_eps"], ("clip_eps",))
        put("algo.clip_high", c["clip_eps"], ("clip_eps",), "symmetric clip, as MLX-GRPO")
        put("algo.kl_coeff", c["kl_coeff"], ("kl_coeff",), "0 = no reference model")
        self.fixed("algo.kl_estimator", "k3", "MLX-GRPO's KL: r - log r - 1 with r = pi_ref / pi_theta")
        quantized = c["quantize_for_rollouts"]
        bits = "int4" if quantized else "bf16"
        put("rollout.precision", bits, ("quantize_for_rollouts",),
            "int4 group-64 generators, as MLX-GRPO's nn.quantize(bits=4, group_size=64), with TIS (algo.is_mode) and "
            "the precision ladder (guard.ladder) on" if quantized else "unquantized generators")
        if quantized:
            self.fixed("rollout.group_size_quant", 64, "MLX-GRPO's nn.quantize group size")
        put("reference.precision", bits, ("quantize_for_rollouts",),
            "MLX-GRPO quantized the reference with the same switch"
            + ("" if c["kl_coeff"] else "; unused at kl_coeff 0"))
        backend = "mlx" if platform.system() == "Darwin" else "torch"
        for section in ("rollout", "reference"):
            self.out[section]["backend"] = backend
        self.lines.append(f"(this machine: {platform.system()}) -> rollout.backend = reference.backend = {backend!r}  "
                          "(mlx-lm on a Mac, as MLX-GRPO; torch elsewhere; [rollout] to choose)")

    def evaluation(self, update_every: int) -> None:
        """Held-out evaluation, checkpoints, and the keys without an equivalent."""
        c, put, note = self.c, self.put, self.note
        evaluating = c["eval_steps"] > 0
        put("run.eval", evaluating, ("eval_steps",), "held-out accuracy (greedy) before and after training")
        if evaluating:
            put("run.eval_every", self.in_steps(c["eval_steps"]), ("eval_steps",),
                f"every {c['eval_steps']} batch steps = {c['eval_steps'] / self.accum:g} updates")
            put("task.eval_size", c["eval_samples"], ("eval_samples",),
                "a fixed held-out set (MLX-GRPO drew a new random subset of GSM8K's test split each time)")
            put("run.eval_max_new_tokens", c["eval_max_new_tokens"], ("eval_max_new_tokens",))
        else:
            note("eval_samples", "unused (eval_steps = 0)")
            note("eval_max_new_tokens", "unused (eval_steps = 0)")
        save = math.ceil(self.in_steps(c["save_steps"]) / update_every) * update_every if c["save_steps"] else 0
        put("run.save_every", save, ("save_steps",),
            f"every {c['save_steps']} batch steps, rounded up to a multiple of algo.update_every so that a resume is "
            "exact" if c["save_steps"] else "0 = only at the end")
        note("eval_every_updates", "not a separate pass: train/accuracy is in metrics.jsonl at every step")
        note("eval_subset_size", "not needed: train/accuracy covers every prompt trained on")
        note("log_jsonl", "metrics.jsonl is always written (RUN_DIR/metrics.jsonl)")
        note("use_compile", "no equivalent: the learner is torch + DeepSpeed, the generators compile nothing")
        note("max_prompt_length", "not enforced (MLX-GRPO declared it and did not use it)")
        note("max_completion_length", "rollout.max_new_tokens bounds completions (MLX-GRPO generated max_new_tokens)")
        self.lines.append("MLX-GRPO's ratio is of whole sequences; ours is per token (GRPO/DAPO), averaged over the "
                          "step's tokens")

    def task_and_rewards(self, ours: dict) -> None:
        """MLX-GRPO always trained GSM8K (the hub) with its XML format and four rewards; our sections may say else."""
        if "task" in ours:
            self.lines.append("[task] from this file (MLX-GRPO had no task keys: it always trained GSM8K)")
        else:
            self.out["task"].update(name="rg:gsm_symbolic", system_prompt=SYSTEM_PROMPT, instruction="")
            if self.c["max_train_samples"]:
                self.put("task.size", self.c["max_train_samples"], ("max_train_samples",),
                         "the train pool: num_epochs passes over it")
            self.lines.append("(GSM8K from the hub) -> task.name = 'rg:gsm_symbolic'  (reasoning-gym's offline "
                              "GSM8K-style generator), task.system_prompt = MLX-GRPO's XML format; add a [task] table "
                              "for another dataset, e.g. name = 'jsonl' with path = 'gsm8k_train.jsonl'")
        if "rewards" in ours:
            self.lines.append("[rewards] from this file")
        else:
            self.out["rewards"]["functions"] = [{"name": "answer_correct", "weight": 2.0},
                                                {"name": "answer_format", "weight": 0.5}]
            self.lines.append("(correctness 2.0 + three format rewards of 0.5) -> rewards.functions = answer_correct "
                              "2.0 + answer_format 0.5  (the number inside the last <answer> tag; one well-formed tag)")

    def merge(self, ours: dict) -> list[str]:
        """Our own sections over the translation. A field an MLX-GRPO key the file writes also sets is a conflict;
        one that MLX-GRPO would only have defaulted (or fixed in its code) is simply ours, and no longer blamed on
        an MLX-GRPO key."""
        problems = []
        for section, table in ours.items():
            for key, value in table.items():
                field, translated = f"{section}.{key}", self.out[section].get(key)
                written = [k for k in self.sources.get(field, ()) if k in self.given]
                if key in self.out[section] and translated != value:
                    if written:
                        problems.append(f"{field}: set to {value!r} in [{section}] and to {translated!r} by the "
                                        f"MLX-GRPO key {written[0]}; keep one")
                    else:  # the translation's line for this field says what replaced it
                        line = (f"[{section}] {key} = {value!r} -> {field} = {value!r}  (this file's, over the "
                                f"translation's {translated!r})")
                        if field in self.line_of:
                            self.lines[self.line_of[field]] = line
                        else:
                            self.lines.append(line)
                        self.origin.pop(field, None)
                self.out[section][key] = value
        return problems


def translate(data: dict, overrides: list[str] = ()) -> tuple[dict, list[str], dict[str, str], list[str], list[str]]:
    """MLX-GRPO TOML (already parsed) + its overrides -> (our config dict, mapping lines, {our field: MLX-GRPO key},
    problems, our own overrides). Overrides without a dot are MLX-GRPO keys; `section.key=value` ones are ours and are
    returned for load_config to apply after the translation."""
    problems: list[str] = []
    flat, ours, rest = _split(data, overrides, problems)
    try:
        c = dataclasses.asdict(_ADAPTER.validate_python(flat))
    except ValidationError as e:
        problems += problems_of(e, MLXGRPOKeys, unknown_key, " (MLX-GRPO's type)")[0]
    if problems:
        return {}, [], {}, problems, rest
    t = _Translation(c, set(flat))
    _, update_every = t.training()
    t.sampling()
    t.evaluation(update_every)
    t.task_and_rewards(ours)
    problems = t.merge(ours)
    return {k: v for k, v in t.out.items() if v}, t.lines, t.origin, problems, rest


def name_origin(problem: str, origin: dict[str, str]) -> str:
    """A validation problem about a translated field also names the MLX-GRPO key it came from."""
    field = problem.split(":", 1)[0]
    return f"{origin[field]} -> {problem}" if field in origin else problem
