"""LoRA and QLoRA for the learner (peft adapters on a frozen base; bitsandbytes NF4 for QLoRA).

The learner's model in each `learner.mode`:
- "full": the model itself, every weight trainable;
- "lora": the bf16 base, frozen, with peft LoRA adapters (the only trainable tensors);
- "qlora": the base loaded by bitsandbytes as NF4 with double quantization and bf16 compute, frozen, plus adapters.

What leaves the learner is always a plain model in the base's own tensor names: `merged_weights` computes
W + (alpha / r) B A one wrapped layer at a time (against the dequantized NF4 weight for QLoRA), so the generators
load and re-quantize it like any full-precision update and no second full copy of the model is ever built. With
`sync.adapters_only` the learner sends `adapter_weights` instead: each wrapped layer's A and its scaled B, which the
generators add beside their quantized base (rollout/backends/torch_backend.py: load_adapters).
Checkpoints of the adapter modes are peft folders (adapter_config.json + adapter_model.safetensors, with the base's
config.json beside them); `merge_checkpoint` writes the merged model folder that `qgrpo merge` and `qgrpo eval` use.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import torch

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def is_adapter_checkpoint(folder: str | Path) -> bool:
    """A folder holding LoRA adapters in peft's format and no full model weights."""
    f = Path(folder)
    return all((f / n).is_file() for n in ADAPTER_FILES) and not (f / "model.safetensors").is_file() \
        and not (f / "model.safetensors.index.json").is_file()


def quantization_config(dtype: torch.dtype = torch.bfloat16):
    """QLoRA's base: NF4 weights, double quantization (the block scales quantized too), compute in `dtype`."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype)


def _lora_config(rank: int, alpha: float, dropout: float, target_modules: list[str]):
    from peft import LoraConfig

    targets = "all-linear" if list(target_modules) == ["all-linear"] else list(target_modules)
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, bias="none",
                      task_type="CAUSAL_LM")


def load_model(model_path: str, mode: str = "full", *, lora: dict | None = None, attention: str = "eager",
               gradient_checkpointing: bool = False, adapter_path: str | None = None,
               device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16):
    """The learner's model for `mode` (see the module docstring). `lora`: rank, alpha, dropout, target_modules.
    `adapter_path`: a peft folder whose adapters are loaded (trainable) instead of new ones. `device`: the rank's
    (core/devices.py); QLoRA's base is quantized there by bitsandbytes as it loads, the other modes are moved there
    by DeepSpeed. `dtype`: what it computes in (model.compute_dtype resolved, core/cpu.py): bf16, or fp32 where bf16
    is emulated; the weights are read from the bf16 folder either way, so fp32 holds them exactly."""
    from transformers import AutoModelForCausalLM

    kwargs: dict = dict(dtype=dtype, attn_implementation=attention)
    if mode == "qlora":
        kwargs.update(quantization_config=quantization_config(dtype),
                      device_map={"": str(device)})
    model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    model.config.use_cache = False
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            # bitsandbytes repacks a 4-bit weight in place into a CPU-only layout at its first forward in eval mode
            # without gradients (the probe score of every sync), after which dequantize_4bit no longer reads it
            # right: the merged export was 0.14 nats per token off the learner's own forward. Keep the standard one.
            m.support_avx512bf16_for_cpu = False
    if gradient_checkpointing:
        # Non-reentrant: gradients reach the adapters although the embeddings' output does not require grad.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mode == "full":
        return model
    from peft import PeftModel, get_peft_model

    model.requires_grad_(False)
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    if adapter_path:
        model = PeftModel.from_pretrained(model, adapter_path, is_trainable=True)
    else:
        model = get_peft_model(model, _lora_config(**(lora or {})))
    if tied and _is_lora(model.get_base_model().get_output_embeddings()):
        # The merged head would differ from the embeddings it shares its tensor with, and the export (like
        # named_parameters) names a tied tensor once: the head's update would be lost on the way to the generators.
        raise ValueError("learner.lora.target_modules: this model's output head is tied to its input embeddings; "
                         "an adapter on it would untie them. Leave the head out (\"all-linear\" does)")
    # peft keeps adapters in fp32 on a bf16 base; the learner's adapters are in its compute dtype like a full
    # model's weights (DeepSpeed's bf16 mode keeps their fp32 masters in the optimizer).
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.data = p.data.to(dtype)
    return model


def _is_lora(module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def unwrap(model):
    """The transformers model under a DeepSpeed engine and/or a peft wrapper (adapters, if any, injected in it)."""
    m = getattr(model, "module", model)
    return m.get_base_model() if hasattr(m, "get_base_model") else m


def _dense(p: torch.Tensor) -> torch.Tensor:
    """A weight as a float32 matrix: bitsandbytes 4-bit parameters are dequantized."""
    if type(p).__name__ == "Params4bit":
        import bitsandbytes as bnb

        if getattr(p.quant_state, "packing_format_for_cpu", False):
            raise RuntimeError("a 4-bit weight is in bitsandbytes' CPU-packed layout, which dequantize_4bit does not "
                               "read; load the model with learner.adapters.load_model")
        return bnb.functional.dequantize_4bit(p.data, p.quant_state).float()
    return p.detach().float()


@torch.no_grad()
def merged_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, bf16 tensor) of the model the adapters make, in the base model's own names, one tensor at a time: each
    wrapped layer's weight is W + scaling * B @ A computed in float32 (W dequantized from NF4 for QLoRA), every other
    parameter is passed through (dequantized if 4-bit). Tied weights appear once, as in `named_parameters`."""
    from peft.tuners.lora import LoraLayer

    base = unwrap(model)
    wrapped = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    for name, p in base.named_parameters():
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".")
        hf_name = name.replace(".base_layer.", ".")
        layer = wrapped.get(owner[:-len(".base_layer")]) if owner.endswith(".base_layer") else None
        w = _dense(p)
        if layer is not None and leaf == "weight":
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A and not layer.merged:
                    a, b = layer.lora_A[adapter].weight.float(), layer.lora_B[adapter].weight.float()
                    w = w + (b @ a) * layer.scaling[adapter]
        yield hf_name, w.to(torch.bfloat16)


@torch.no_grad()
def adapter_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, bf16 tensor) of the adapters alone, for generators that keep their own copy of the frozen base: for each
    wrapped layer whose base weight is `<base>.weight` in the base model's names, `<base>.lora_A` [r, in] and
    `<base>.lora_B` [out, r] with peft's scaling (alpha / r) already in B, so that W + B A is the layer's weight."""
    from peft.tuners.lora import LoraLayer

    for name, layer in unwrap(model).named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        active = [a for a in layer.active_adapters if a in layer.lora_A]
        if len(active) != 1 or layer.merged:
            raise ValueError(f"{name}: adapters-only export needs exactly one active, unmerged adapter, got "
                             f"{active} (merged={layer.merged})")
        a, b = layer.lora_A[active[0]].weight, layer.lora_B[active[0]].weight
        yield f"{name}.lora_A", a.detach().to(torch.bfloat16)
        yield f"{name}.lora_B", (b.float() * layer.scaling[active[0]]).to(torch.bfloat16)


def save_adapters(model, out: Path) -> None:
    """peft's format: adapter_config.json + adapter_model.safetensors in `out`."""
    m = getattr(model, "module", model)
    m.save_pretrained(str(out), safe_serialization=True)
    (Path(out) / "README.md").unlink(missing_ok=True)  # peft's model card template: nothing of ours


@contextlib.contextmanager
def as_model_folder(path: str) -> Iterator[str]:
    """`path` itself, or for an adapter checkpoint its merged model in a temporary folder (removed afterwards): what
    `qgrpo eval` and `qgrpo export` read."""
    if not is_adapter_checkpoint(path):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="qgrpo-merged-") as tmp:
        yield str(merge_checkpoint(path, Path(tmp) / "merged"))


def merge_checkpoint(ckpt: str | Path, out: str | Path, base_path: str | None = None) -> Path:
    """Write the merged model of an adapter checkpoint as a full HF folder (bf16 safetensors, config, tokenizer) at
    `out`, which must not exist. The base is `base_path`, else the one the checkpoint names (its trainer_state.json,
    else adapter_config.json); a QLoRA checkpoint is merged against the NF4-dequantized base, the model it trained."""
    from safetensors.torch import save_file

    ckpt, out = Path(ckpt), Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; choose a new folder (nothing is overwritten)")
    if not is_adapter_checkpoint(ckpt):
        raise ValueError(f"{ckpt} is not an adapter checkpoint (it needs {' and '.join(ADAPTER_FILES)}, and no "
                         "model.safetensors: a full model folder needs no merge)")
    state = json.loads((ckpt / "trainer_state.json").read_text()) if (ckpt / "trainer_state.json").is_file() else {}
    mode = state.get("config", {}).get("learner", {}).get("mode", "lora")
    if base_path is None:
        base_path = state.get("model_path") or json.loads((ckpt / "adapter_config.json").read_text()).get(
            "base_model_name_or_path")
    if not base_path or not (Path(base_path) / "config.json").is_file():
        raise FileNotFoundError(f"{ckpt}: its base model {base_path!r} is not a model folder here; pass the base "
                                "folder the adapters were trained on (qgrpo merge CKPT -o OUT --base FOLDER)")
    model = load_model(base_path, mode, adapter_path=str(ckpt))
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {n: t.contiguous() for n, t in merged_weights(model)}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((Path(base_path) / "config.json").read_text())
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for f in Path(base_path).iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in (
                "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja",
                "generation_config.json")):
            shutil.copy2(f, tmp / f.name)
    tmp.rename(out)
    return out
