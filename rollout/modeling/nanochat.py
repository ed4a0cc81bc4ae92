"""nanochat checkpoints in their two spellings.

- transformers' `NanoChatForCausalLM` (what the learner, the torch generators and vLLM load):
  `model.embed_tokens`, `model.layers.N.self_attn.{q,k,v,o}_proj`, `model.layers.N.mlp.{fc1,fc2}`, `lm_head`;
- nanochat's own names, which mlx-lm's `nanochat` model and MLX-GRPO's converted folders and checkpoints use:
  `transformer.wte`, `transformer.h.N.attn.{c_q,c_k,c_v,c_proj}`, `transformer.h.N.mlp.{c_fc,c_proj}`, `lm_head`.

Neither has norm weights (nanochat's RMSNorms are parameter-free). A folder in the native spelling (an MLX-GRPO
checkpoint, or a model converted for mlx-lm) is converted once into the transformers spelling for our actors
(`to_hf_folder`); the MLX backend renames to the native spelling on load, and `qgrpo export` writes it for mlx-lm.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

MODEL_TYPE = "nanochat"
SOFTCAP = 15.0  # mlx-lm's nanochat model has this logit soft-cap built in
# RMSNorm eps: transformers' NanoChatConfig default; mlx-lm's nanochat hard-codes 1e-5, so a folder in nanochat's own
# names without rms_norm_eps (MLX-GRPO's converter writes none) was trained under mlx-lm with 1e-5 and keeps it.
HF_EPS, MLX_EPS = 1e-6, 1e-5
# (transformers' prefix, nanochat's prefix); {i} is the layer index
_PREFIXES = [
    ("model.embed_tokens.", "transformer.wte."),
    ("model.layers.{i}.self_attn.q_proj.", "transformer.h.{i}.attn.c_q."),
    ("model.layers.{i}.self_attn.k_proj.", "transformer.h.{i}.attn.c_k."),
    ("model.layers.{i}.self_attn.v_proj.", "transformer.h.{i}.attn.c_v."),
    ("model.layers.{i}.self_attn.o_proj.", "transformer.h.{i}.attn.c_proj."),
    ("model.layers.{i}.mlp.fc1.", "transformer.h.{i}.mlp.c_fc."),
    ("model.layers.{i}.mlp.fc2.", "transformer.h.{i}.mlp.c_proj."),
]


def _rules(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [("^" + re.escape(a).replace(re.escape("{i}"), r"(\d+)"), b.replace("{i}", r"\1")) for a, b in pairs]


_HF_TO_NATIVE = _rules(_PREFIXES)
_NATIVE_TO_HF = _rules([(b, a) for a, b in _PREFIXES])
# transformers' NanoChatConfig fields a native config.json (MLX-GRPO's converter writes mlx-lm's ModelArgs) lacks
HF_DEFAULTS = {"hidden_act": "relu2", "final_logit_softcapping": SOFTCAP, "tie_word_embeddings": False,
               "attention_bias": False, "architectures": ["NanoChatForCausalLM"]}


def _rename(name: str, rules: list[tuple[str, str]]) -> str:
    for pattern, repl in rules:
        new, n = re.subn(pattern, repl, name)
        if n:
            return new
    return name


def to_native(name: str) -> str:
    return _rename(name, _HF_TO_NATIVE)


def to_hf(name: str) -> str:
    return _rename(name, _NATIVE_TO_HF)


def is_nanochat(config: dict) -> bool:
    return config.get("model_type") == MODEL_TYPE


def native_names(tensor_names: set[str] | list[str]) -> bool:
    """Weights in nanochat's own spelling (transformer.*), as mlx-lm and MLX-GRPO save them."""
    return any(n.startswith("transformer.") for n in tensor_names)


def rms_eps(config: dict, native: bool = False) -> float:
    """The RMSNorm eps a nanochat config.json means: its rms_norm_eps, else mlx-lm's for a folder in nanochat's own
    names and transformers' for one in transformers' names."""
    return float(config.get("rms_norm_eps", MLX_EPS if native else HF_EPS))


def check_mlx_compatible(config: dict) -> None:
    """What mlx-lm's nanochat model cannot represent (it hard-codes the soft-cap): one clear error."""
    cap = config.get("final_logit_softcapping", SOFTCAP)
    if cap != SOFTCAP:
        raise ValueError(f"nanochat: final_logit_softcapping = {cap} in config.json; mlx-lm's nanochat model has "
                         f"{SOFTCAP} built in, so the mlx backend would compute other log-probs; use the torch backend")


# What a converted folder keeps besides the weights: the tokenizer and generation settings. An MLX-GRPO checkpoint's
# optimizer.safetensors and trainer_state.json (MLX's optimizer state, its own run arguments) are left behind.
KEEP = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
        "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json", "generation_config.json")


def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("model*.safetensors"))


def to_hf_folder(src: Path, dst: Path) -> None:
    """A native-spelling nanochat folder (config.json, model*.safetensors, tokenizer files) written in transformers'
    spelling: tensors renamed (values untouched), config completed with NanoChatConfig's fields, tokenizer copied."""
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    for f in weight_files(src):
        save_file({to_hf(k): v.contiguous() for k, v in load_file(str(f)).items()}, str(dst / f.name),
                  metadata={"format": "pt"})
    index = src / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {to_hf(k): v for k, v in data["weight_map"].items()}
        (dst / index.name).write_text(json.dumps(data, indent=1))
    for name in KEEP:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    hf = {**HF_DEFAULTS, **{k: v for k, v in config.items() if k != "architectures"},
          "rms_norm_eps": rms_eps(config, native=True)}
    if "rope_theta" in hf and "rope_parameters" not in hf:
        hf["rope_parameters"] = {"rope_theta": hf["rope_theta"], "rope_type": "default"}
    (dst / "config.json").write_text(json.dumps(hf, indent=1))
