"""MLX-GRPO configs read as ours: `qgrpo train old.toml` takes an MLX-GRPO TOML (flat keys, or under an [mlx_grpo]
table) and its `--set key=value` overrides, prints how every key maps, and `qgrpo migrate` writes the result as one of
our configs.

MLX-GRPO is a single-process Mac trainer: one prompt per "batch step", `gradient_accumulation_steps` batch steps per
optimizer update, `num_generations` completions per prompt, a 4-bit `model_old` synced every `update_every` batch
steps, GSM8K from the hub with an XML-format system prompt. Our step is one optimizer update on `prompts_per_step`
prompts, so counts in batch steps are converted to our steps (divided by gradient_accumulation_steps), and each
conversion is printed. A key without an equivalent here is printed with what happens instead; an unknown key is an
error (MLX-GRPO itself ignored unknown keys silently, which hid typos).

Keys MLX-GRPO did not have (the task, the rewards, the backends) come from our own sections when the file has them
([task], [rewards], [rollout], ... beside the MLX-GRPO keys); a field set both ways is an error naming both.
"""
from __future__ import annotations

import copy
import math
import platform
import tomllib
from typing import Any

TABLE = "mlx_grpo"
GSM8K_TRAIN_SIZE = 7_473  # MLX-GRPO trained on all of GSM8K's train split unless max_train_samples said otherwise
# MLX-GRPO's system prompt (its GSM8K formatting); ours reads the number inside <answer></answer>
SYSTEM_PROMPT = "Respond in the following format:\n\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>"

# MLX-GRPO's fields and its defaults (MLXGRPOConfig), plus the keys its configs carry in later versions.
DEFAULTS: dict[str, Any] = {
    "model_name": "Qwen/Qwen2.5-1.5B-Instruct", "output_dir": "outputs/Qwen-1.5B-MLX-GRPO",
    "run_name": "Qwen-1.5B-MLX-GRPO-gsm8k", "learning_rate": 1e-6, "batch_size": 1, "gradient_accumulation_steps": 4,
    "num_epochs": 1, "max_train_samples": 0, "warmup_ratio": 0.1, "max_grad_norm": 0.1, "logging_steps": 1,
    "num_generations": 64, "max_prompt_length": 512, "max_completion_length": 1024, "max_new_tokens": 512,
    "temperature": 0.7, "clip_eps": 0.2, "kl_coeff": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999,
    "weight_decay": 0.0, "lr_scheduler_type": "cosine", "save_steps": 100, "eval_steps": 50, "eval_samples": 200,
    "seed": 0, "use_compile": True, "eval_every_updates": 25, "eval_subset_size": 200, "eval_max_new_tokens": 128,
    "log_jsonl": True, "quantize_for_rollouts": True, "update_every": 10,
}
OUR_SECTIONS = ("run", "model", "task", "rewards", "rollout", "reference", "algo", "learner", "sync", "faults", "guard")


def is_mlx_grpo(data: dict) -> bool:
    """An MLX-GRPO file: an [mlx_grpo] table, or any of its keys at the top level (ours has only tables there)."""
    return isinstance(data.get(TABLE), dict) or any(k in DEFAULTS for k in data)


def _coerce(key: str, value: Any, problems: list[str]) -> Any:
    want = type(DEFAULTS[key])
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) != (want is bool) or not isinstance(value, want):
        problems.append(f"{key}: expected {want.__name__} (MLX-GRPO's type), got {type(value).__name__} {value!r}")
        return None
    return value


def _parse_override(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare word is a string, as in our --set


def translate(data: dict, overrides: list[str] = ()) -> tuple[dict, list[str], dict[str, str], list[str], list[str]]:
    """MLX-GRPO TOML (already parsed) + its overrides -> (our config dict, mapping lines, {our field: MLX-GRPO key},
    problems, our own overrides). Overrides without a dot are MLX-GRPO keys; `section.key=value` ones are ours and are
    returned for load_config to apply after the translation."""
    problems: list[str] = []
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
            flat[key] = _parse_override(raw.strip())
    for key in flat:
        if key not in DEFAULTS:
            problems.append(f"{key}: not an MLX-GRPO key; known keys are: {', '.join(sorted(DEFAULTS))} (or our "
                            f"sections {', '.join(OUR_SECTIONS)} as tables)")
    given = {k: v for k, v in ((k, _coerce(k, v, problems)) for k, v in flat.items() if k in DEFAULTS)
             if v is not None}
    c = {**DEFAULTS, **given}
    for key in ("gradient_accumulation_steps", "batch_size", "num_epochs", "num_generations", "max_new_tokens",
                "logging_steps"):
        if c[key] < 1:
            problems.append(f"{key}: must be >= 1, got {c[key]}")
    for key in ("max_train_samples", "save_steps", "eval_steps", "eval_samples", "eval_every_updates",
                "update_every", "eval_max_new_tokens"):
        if c[key] < 0:
            problems.append(f"{key}: must be >= 0, got {c[key]}")
    if not 0 <= c["warmup_ratio"] < 1:
        problems.append(f"warmup_ratio: must be in [0, 1), got {c['warmup_ratio']}")
    if c["lr_scheduler_type"] not in ("cosine", "constant"):
        problems.append(f"lr_scheduler_type: {c['lr_scheduler_type']!r} is not served here; use 'cosine' (MLX-GRPO's) "
                        "or 'constant'")
    if problems:
        return {}, [], {}, problems, rest

    out: dict[str, dict] = {s: {} for s in OUR_SECTIONS}
    lines: list[str] = []
    origin: dict[str, str] = {}

    def put(field: str, value: Any, keys: tuple[str, ...], why: str = "") -> None:
        section, name = field.split(".", 1)
        out[section][name] = value
        origin[field] = keys[0]
        src = " + ".join(f"{k} = {c[k]!r}" + ("" if k in given else " (MLX-GRPO default)") for k in keys)
        lines.append(f"{src} -> {field} = {value!r}" + (f"  ({why})" if why else ""))

    def note(key: str, what: str) -> None:
        lines.append(f"{key} = {c[key]!r}" + ("" if key in given else " (MLX-GRPO default)") + f" -> {what}")

    accum, per_update = c["gradient_accumulation_steps"], c["batch_size"] * c["gradient_accumulation_steps"]
    samples = c["max_train_samples"] or GSM8K_TRAIN_SIZE
    steps = math.ceil(samples / per_update) * c["num_epochs"]

    def in_steps(batch_steps: int) -> int:  # MLX-GRPO counts batch steps; one of our steps is `accum` of them
        return max(1, round(batch_steps / accum))

    put("model.path", c["model_name"], ("model_name",), "a local folder: mlx-lm's converted folders load as they are")
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
    update_every = in_steps(c["update_every"]) if c["update_every"] else 1
    put("algo.update_every", update_every, ("update_every",),
        f"MLX-GRPO synced model_old every {c['update_every']} batch steps = {c['update_every'] / accum:g} updates")
    warm = max(1, int(steps * c["warmup_ratio"])) if c["warmup_ratio"] else 0
    put("learner.warmup_steps", warm, ("warmup_ratio",), f"int({steps} steps x {c['warmup_ratio']}), as MLX-GRPO did")
    put("learner.lr_schedule", c["lr_scheduler_type"], ("lr_scheduler_type",),
        "cosine decay to 0 over the run, times the warm-up ramp" if c["lr_scheduler_type"] == "cosine" else "")
    put("learner.grad_clip", c["max_grad_norm"], ("max_grad_norm",))
    put("learner.beta1", c["adam_beta1"], ("adam_beta1",))
    put("learner.beta2", c["adam_beta2"], ("adam_beta2",))
    put("learner.weight_decay", c["weight_decay"], ("weight_decay",))
    put("run.log_every", c["logging_steps"], ("logging_steps",), "a metrics.jsonl line every N steps")
    put("rollout.max_new_tokens", c["max_new_tokens"], ("max_new_tokens",))
    put("rollout.temperature", c["temperature"], ("temperature",))
    lines.append("(MLX-GRPO's sampler) -> rollout.top_p = 0.95  (fixed in MLX-GRPO's generate_responses)")
    out["rollout"]["top_p"] = 0.95
    put("algo.clip_low", c["clip_eps"], ("clip_eps",))
    put("algo.clip_high", c["clip_eps"], ("clip_eps",), "symmetric clip, as MLX-GRPO")
    put("algo.kl_coeff", c["kl_coeff"], ("kl_coeff",), "0 = no reference model")
    put("algo.kl_estimator", "k3", ("kl_coeff",), "MLX-GRPO's r - log r - 1 with r = pi_ref / pi_theta")
    bits = "int4" if c["quantize_for_rollouts"] else "bf16"
    put("rollout.precision", bits, ("quantize_for_rollouts",),
        "int4 group-64 generators, as MLX-GRPO's nn.quantize(bits=4, group_size=64), with TIS (algo.is_mode) and the "
        "precision ladder (guard.ladder) on" if c["quantize_for_rollouts"] else "unquantized generators")
    if c["quantize_for_rollouts"]:
        put("rollout.group_size_quant", 64, ("quantize_for_rollouts",))
    put("reference.precision", bits, ("quantize_for_rollouts",),
        "MLX-GRPO quantized the reference with the same switch" + ("" if c["kl_coeff"] else "; unused at kl_coeff 0"))
    mac = platform.system() == "Darwin"
    for section in ("rollout", "reference"):
        out[section]["backend"] = "mlx" if mac else "torch"
    lines.append(f"(this machine: {platform.system()}) -> rollout.backend = reference.backend = "
                 f"{out['rollout']['backend']!r}  (mlx-lm on a Mac, as MLX-GRPO; torch elsewhere; [rollout] to choose)")
    evaluating = c["eval_steps"] > 0
    put("run.eval", evaluating, ("eval_steps",), "held-out accuracy (greedy) before and after training")
    if evaluating:
        put("run.eval_every", in_steps(c["eval_steps"]), ("eval_steps",),
            f"every {c['eval_steps']} batch steps = {c['eval_steps'] / accum:g} updates")
        put("task.eval_size", c["eval_samples"], ("eval_samples",),
            "a fixed held-out set (MLX-GRPO drew a new random subset of GSM8K's test split each time)")
        put("run.eval_max_new_tokens", c["eval_max_new_tokens"], ("eval_max_new_tokens",))
    else:
        note("eval_samples", "unused (eval_steps = 0)")
        note("eval_max_new_tokens", "unused (eval_steps = 0)")
    save = math.ceil(in_steps(c["save_steps"]) / update_every) * update_every if c["save_steps"] else 0
    put("run.save_every", save, ("save_steps",),
        f"every {c['save_steps']} batch steps, rounded up to a multiple of algo.update_every so that a resume is exact"
        if c["save_steps"] else "0 = only at the end")
    note("eval_every_updates", "not a separate pass: train/accuracy is in metrics.jsonl at every step")
    note("eval_subset_size", "not needed: train/accuracy covers every prompt trained on")
    note("log_jsonl", "metrics.jsonl is always written (RUN_DIR/metrics.jsonl)")
    note("use_compile", "no equivalent: the learner is torch + DeepSpeed, the generators compile nothing")
    note("max_prompt_length", "not enforced (MLX-GRPO declared it and did not use it)")
    note("max_completion_length", "rollout.max_new_tokens bounds completions (MLX-GRPO generated max_new_tokens)")
    lines.append("MLX-GRPO's ratio is of whole sequences; ours is per token (GRPO/DAPO), averaged over the step's tokens")

    # The task and rewards: MLX-GRPO always trained GSM8K (the hub) with its XML format and four rewards.
    if "task" in ours:
        lines.append("[task] from this file (MLX-GRPO had no task keys: it always trained GSM8K)")
    else:
        out["task"].update(name="rg:gsm_symbolic", system_prompt=SYSTEM_PROMPT, instruction="")
        if c["max_train_samples"]:
            put("task.size", c["max_train_samples"], ("max_train_samples",), "the train pool: num_epochs passes over it")
        lines.append("(GSM8K from the hub) -> task.name = 'rg:gsm_symbolic'  (reasoning-gym's offline GSM8K-style "
                     "generator), task.system_prompt = MLX-GRPO's XML format; add a [task] table for another dataset, "
                     "e.g. name = 'jsonl' with path = 'gsm8k_train.jsonl'")
    if "rewards" in ours:
        lines.append("[rewards] from this file")
    else:
        out["rewards"]["functions"] = [{"name": "answer_correct", "weight": 2.0}, {"name": "answer_format", "weight": 0.5}]
        lines.append("(correctness 2.0 + three format rewards of 0.5) -> rewards.functions = answer_correct 2.0 + "
                     "answer_format 0.5  (the number inside the last <answer> tag; one well-formed tag)")

    for section, table in ours.items():  # our own sections in the same file: fields the translation set must agree
        for key, value in table.items():
            field = f"{section}.{key}"
            if field in origin and out[section].get(key) != value:
                problems.append(f"{field}: set to {value!r} in [{section}] and to {out[section][key]!r} by the "
                                f"MLX-GRPO key {origin[field]}; keep one")
            out[section][key] = value
    return {k: v for k, v in out.items() if v}, lines, origin, problems, rest


def name_origin(problem: str, origin: dict[str, str]) -> str:
    """A validation problem about a translated field also names the MLX-GRPO key it came from."""
    field = problem.split(":", 1)[0]
    return f"{origin[field]} -> {problem}" if field in origin else problem
