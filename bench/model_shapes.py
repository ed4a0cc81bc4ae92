"""The model shapes people train, from their published configs, for benches that build them with random weights.

Each entry holds the values of the model's published `config.json` that decide its speed (architecture, widths,
layers, heads, vocabulary, tied embeddings, rotary base); `build_config` makes the transformers config from them.
Nothing is downloaded: speed does not depend on the weights' values, so the benches initialise them at random
(seeded). `tiny-qwen2` / `tiny-qwen3` / `tiny-llama` are two-layer stand-ins of the same architectures for dry runs
on a CPU and for the suite.

A bench that cannot use a model's own tokenizer (none is on the machine) borrows another and keeps the published
vocabulary size: every id the borrowed tokenizer makes falls inside it, and the embedding and head keep their
published bytes. Its table says which tokenizer it borrowed.
"""
from __future__ import annotations

# name: (transformers model_type, the config values). rope_scaling is Llama 3.2's published llama3 scaling.
SHAPES: dict[str, tuple[str, dict]] = {
    "SmolLM2-135M": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                   tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5)),
    "Qwen2.5-0.5B": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                   tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "Llama-3.2-1B": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                                   tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
                                   rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0, original_max_position_embeddings=8192))),
    "Qwen2.5-1.5B": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                   tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "Qwen3-4B": ("qwen3", dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                               tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "Qwen3-8B": ("qwen3", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                               tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "Qwen2.5-14B": ("qwen2", dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                                  num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                                  tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-5)),
    # Dry runs and the suite: the architectures above at two layers and a small width.
    "tiny-llama": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False,
                                 rope_theta=10000.0, rms_norm_eps=1e-5)),
    "tiny-qwen2": ("qwen2", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True,
                                 rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "tiny-qwen3": ("qwen3", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=32, vocab_size=512, tie_word_embeddings=False,
                                 rope_theta=1000000.0, rms_norm_eps=1e-6)),
}


def head_dim(values: dict) -> int:
    return values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]


def build_config(name: str, vocab_size: int | None = None, **special):
    """The transformers config of shape `name` (`vocab_size` replaces the published one only where a bench asks:
    it says so in its table); `special`: bos/eos/pad token ids and the like."""
    from transformers import AutoConfig

    model_type, values = SHAPES[name]
    values = dict(values, max_position_embeddings=32768, use_cache=True, **special)
    if vocab_size is not None:
        values["vocab_size"] = vocab_size
    if model_type == "qwen2":
        values.setdefault("use_sliding_window", False)
    return AutoConfig.for_model(model_type, **values)


def linear_shapes(name: str) -> dict[str, tuple[int, int]]:
    """{product: (out N, in K)} of one decoder layer's products and the head, as a decode step runs them: the fused
    q/k/v and gate/up products of the generator's fused step (rollout/backends/torch_fused.py) beside each alone."""
    _, v = SHAPES[name]
    h, hd = v["hidden_size"], head_dim(v)
    q, kv, mlp = v["num_attention_heads"] * hd, v["num_key_value_heads"] * hd, v["intermediate_size"]
    return {"q": (q, h), "k/v": (kv, h), "qkv": (q + 2 * kv, h), "o": (h, q), "gate/up": (mlp, h),
            "gate_up": (2 * mlp, h), "down": (h, mlp), "lm_head": (v["vocab_size"], h)}


def parameter_count(name: str) -> dict[str, int]:
    """Parameters of shape `name`'s matrix products: the decoder layers', the head's, the embedding's, and all of them
    (a tied head counted once); norms and biases (under 0.01% of each published model) are not counted."""
    _, v = SHAPES[name]
    s = linear_shapes(name)
    layer = sum(n * k for key, (n, k) in s.items() if key in ("q", "o", "gate/up", "down")) \
        + 2 * s["k/v"][0] * s["k/v"][1] + s["gate/up"][0] * s["gate/up"][1]
    head = s["lm_head"][0] * s["lm_head"][1]
    return {"layers": layer * v["num_hidden_layers"], "head": head, "embedding": head,
            "total": layer * v["num_hidden_layers"] + head * (1 if v["tie_word_embeddings"] else 2)}


def random_model(name: str, tok, device: str = "cpu", seed: int = 0, vocab_size: int | None = None):
    """Shape `name` with random bf16 weights (seeded), initialised on `device` (seconds on a GPU at 14B), the
    tokenizer `tok`'s special ids in its config; `vocab_size` replaces the published vocabulary where given."""
    import torch
    from transformers import AutoModelForCausalLM

    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    cfg = build_config(name, vocab_size=vocab_size, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=pad)
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)


def save_random(name: str, tokenizer: str, folder: str, device: str = "cpu", seed: int = 0) -> dict:
    """A checkpoint folder of shape `name` with random bf16 weights (seeded) and the tokenizer of folder `tokenizer`,
    which any trainer loads like a downloaded one (the whole-step benches: bench/vs_trl.py --model). The published
    vocabulary is kept (ids past the borrowed tokenizer's decode to nothing) unless it is smaller than the tokenizer's
    (the tiny shapes): then the tokenizer's, and `vocab_note` says so. Returns what was written."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    published = SHAPES[name][1]["vocab_size"]
    vocab = max(published, len(tok))
    model = random_model(name, tok, device, seed, vocab)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    return {"shape": name, "folder": folder, "parameters": params, "vocab": vocab, "tokenizer": tokenizer,
            "tokenizer_vocab": len(tok), "seed": seed,
            "vocab_note": None if vocab == published else f"vocabulary {vocab} (the tokenizer's), not {published}"}

if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description="Write a checkpoint of a published shape with random weights: "
                                             "python bench/model_shapes.py save SHAPE FOLDER --tokenizer DIR")
    ap.add_argument("command", choices=("save",))
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("folder")
    ap.add_argument("--tokenizer", required=True, help="a tokenizer folder (the published vocabulary is kept)")
    ap.add_argument("--device", default="cpu", help="where the weights are initialised (cuda: seconds at 8B)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(json.dumps(save_random(a.shape, a.tokenizer, a.folder, a.device, a.seed)))


# The variables that cap torch's and oneDNN's CPU kernels, and libgomp's spin count (GOMP_SPINCOUNT=2000 is
# rollout.cpu_wait = "spin"; the benches default to the actors' PASSIVE).
CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "GOMP_SPINCOUNT")


def caps_prefix() -> str:
    """The CPU-kernel caps (and spin count) this process runs under as a command-line prefix ('' when none), so that
    a capped run's JSON command reproduces the run."""
    import os
    import shlex

    return "".join(f"{name}={shlex.quote(os.environ[name])} " for name in CAPS if os.environ.get(name))
