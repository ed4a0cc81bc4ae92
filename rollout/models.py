"""Where models come from: a local HF folder, or a builtin one materialised offline into a cache folder.

`resolve_model_path` runs once on the driver before any actor starts, so every actor loads the same files.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

BUILTIN_PREFIX = "builtin:"

# Characters of the tiny model's vocabulary: enough for arithmetic prompts and answers.
_TINY_CHARS = list("0123456789+-=*/ ")
_TINY_SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def cache_root(cache_dir: str = "") -> Path:
    return Path(cache_dir or os.environ.get("QGRPO_CACHE") or Path.home() / ".cache" / "qgrpo").expanduser()


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
    multiples of 64 so int4 group-64 quantization covers every linear layer, lm_head included (untied)."""
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
        num_attention_heads=4,
        num_key_value_heads=4,
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


BUILTIN_MODELS: dict[str, Callable[[Path], None]] = {
    "tiny-digits": build_tiny_digits,
}
_BUILTIN_VERSION = "v2"  # bump when a builder changes, so caches are rebuilt rather than reused stale


def resolve_model_path(path: str, cache_dir: str = "") -> str:
    """Return a local folder for `path`, materialising builtin models on first use (atomically: built in a temporary
    folder and renamed into place, so a crash never leaves a half-written model that later runs would trust)."""
    if not path.startswith(BUILTIN_PREFIX):
        return str(Path(path).expanduser().resolve())
    name = path[len(BUILTIN_PREFIX):]
    target = cache_root(cache_dir) / "models" / f"{name}-{_BUILTIN_VERSION}"
    if (target / "config.json").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        BUILTIN_MODELS[name](tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is complete
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(target)
