"""LoRA adapters beside a vLLM engine's quantized base (sync.adapters_only): the engine starts with vLLM's LoRA
support, and each adapters update becomes a peft folder that a new LoRARequest names; every generation and score
passes the newest request (rollout/backends/vllm_backend.py: load_adapters)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

# vLLM's max_lora_rank must be one of these (vllm/config/lora.py: MaxLoRARanks); the engine takes the smallest that
# holds the learner's rank.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def engine_options(lora_rank: int, precision: str, cuda: bool) -> dict:
    """vLLM engine arguments for adapters of rank up to `lora_rank` (none for 0), one adapter slot."""
    if not lora_rank:
        return {}
    max_rank = next((r for r in VLLM_LORA_RANKS if r >= lora_rank), None)
    if max_rank is None:
        raise ValueError(f"vllm backend: LoRA rank {lora_rank} is above vLLM's largest, {VLLM_LORA_RANKS[-1]}")
    if precision == "int8" and not cuda:
        _lora_beside_onednn_int8()
    return {"enable_lora": True, "max_lora_rank": max_rank, "max_loras": 1}


def _lora_beside_onednn_int8() -> None:
    """vLLM 0.32's LoRA layers place their adapters on the device of the base layer's `weight`, which the CPU int8
    kernel sets to None once it has packed the weight into its oneDNN handler: engine start fails with "'NoneType'
    object has no attribute 'device'". Such a layer's weight scale sits on the same device."""
    from vllm.lora.layers import base_linear

    if getattr(base_linear, "_qgrpo_patched", False):
        return
    original = base_linear._get_lora_device

    def lora_device(base_layer):
        if getattr(base_layer, "weight", 0) is None:
            return next(p.device for p in base_layer.parameters())
        return original(base_layer)

    base_linear._get_lora_device = lora_device
    base_linear._qgrpo_patched = True


def write_peft_folder(folder: Path, tensors: dict[str, torch.Tensor]) -> int:
    """`tensors` ({`<linear>.lora_A`: [r, in], `<linear>.lora_B`: [out, r]}, alpha / r already in B) as a peft folder
    with lora_alpha = r, so that vLLM's scaling is 1. Returns the rank."""
    from safetensors.torch import save_file

    rank = next(t.shape[0] for n, t in tensors.items() if n.endswith(".lora_A"))
    folder.mkdir(parents=True, exist_ok=True)
    save_file({f"base_model.model.{n}.weight": t.contiguous() for n, t in tensors.items()},
              str(folder / "adapter_model.safetensors"))
    leaves = sorted({n.rpartition(".")[0].rpartition(".")[2] for n in tensors})
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
        "target_modules": leaves, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "modules_to_save": None, "base_model_name_or_path": None}))
    return rank
