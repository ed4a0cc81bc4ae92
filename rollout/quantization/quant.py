"""Weight-only quantization of a HF causal LM's nn.Linear layers, on the device its weights are on (CPU or CUDA).

Which library path each (precision, device) uses (torch 2.13, torchao 0.18, bitsandbytes 0.50); ``quant_path`` names
it, ``serves`` says whether it is served (``SERVED``, declared in rollout/options.py; the torch backend serves
exactly that):

- bf16, cpu | cuda: no-op.
- int8, cpu | cuda (``torchao.int8``): torchao ``Int8WeightOnlyConfig`` -> ``Int8Tensor`` (per output channel).
  Storage: int8 ``qdata`` [N, K], fp32 scale and int8 zero point per row (~8 bits/weight). torchao's linear casts the
  int8 weight to the activation dtype, runs a plain ``torch.mm`` and scales per row: plain torch ops, no
  device-specific kernel, so the same path runs on CUDA. On CPU a decode step's few rows go through torch's own int8
  kernel ``_weight_int8pack_mm`` instead (no bf16 copy of the weight per call; ``INT8_LINEAR``).
- int4, cpu (``torchao.int4_opaque_cpu``): torchao ``PrototypeInt4WeightOnlyConfig(group_size)`` ->
  ``Int4OpaqueTensor``: asymmetric int4, two nibbles per byte in uint8 ``qdata`` [N, K/2] plus bf16 (scale, zero)
  pairs [K/group, N, 2] (~4.5 bits/weight at group 64); a decode step's rows multiplied by torch's own CPU kernel
  ``aten._weight_int4pack_mm_for_cpu``, more rows (a prefill) by the weight decoded once per call into the
  activations' dtype (rollout/quantization/cpu_kernels.py; where the routes cross is measured per shape). Its packer
  asserts a CPU tensor. Rejected on CPU, measured:
  ``Int4WeightOnlyConfig`` PLAIN / PRESHUFFLED ("Requires mslk"), PLAIN_INT32 ("does not support device cpu"),
  TILE_PACKED_TO_4D (needs CUDA); ``IntxWeightOnlyConfig(int4, PerGroup(64))`` runs but keeps each int4 value
  unpacked in an int8 byte (~8.5 bits/weight) and was less accurate (symmetric).
- int4, cuda (``torchao.int4_tile_packed_cuda``): torchao ``Int4WeightOnlyConfig(group_size,
  int4_packing_format=TILE_PACKED_TO_4D)`` -> ``Int4TilePackedTo4dTensor``: asymmetric int4 (tinygemm scale/zero
  choice) packed for torch's own CUDA kernel ``aten._weight_int4pack_mm`` (tinygemm; in torch itself, no extra kernel
  library). From the torchao / torch sources: bf16 weights and activations only; compute capability >= 8.0 (the
  packer raises below that: we raise first, naming the field); group size 32, 64, 128 or 256; the packer pads K to a
  multiple of 1024 and N to a multiple of 8 (16 on ROCm, where torchao's ``int4_tile_packed_ntile`` must be 16), so
  any N fits, but storage grows with the K padding: K = 576 packs as 1024 (~8 bits/weight instead of ~4.5), and
  K <= 256 takes more bytes than bf16. The other int4 formats are no option there: PLAIN / PRESHUFFLED need the
  mslk kernel library, PLAIN_INT32 runs on XPU / NPU only, and ``Int4OpaqueTensor`` is CPU-only.
- nf4, cpu (``bnb.nf4_cpu``): bitsandbytes ``Linear4bit`` (quant_type nf4, blocksize = group_size, no double
  quantization), quantized by ``Params4bit.to("cpu")``. On CPUs with AVX512-BF16 bnb repacks the weight at the first
  no-grad forward to uint8 [N, K/2] + bf16 absmax per block (~4.25 bits/weight); we trigger that repack here so
  storage and speed don't change after the first rollout.
- nf4, cuda (``bnb.nf4_cuda``): the same ``Linear4bit``, quantized by ``Params4bit.to(<the CUDA device>)`` (bnb's CUDA
  ``quantize_4bit`` kernel): packed uint8 [N*K/2, 1] + fp32 absmax per block (~4.5 bits/weight). The repack and its
  probe forward are CPU-only (bnb's forward repacks only ``x.device.type == "cpu"``), so none is run.
- fp8, cuda (``torch.fp8_scaled_mm``): our ``Fp8Linear`` (rollout/quantization/fp8.py): float8_e4m3fn weight [N, K] with
one fp32
  scale per row (row absmax / 448, ~8 bits/weight); the activations quantized per token to float8_e4m3fn the same way at
  each call and the product by torch's own ``torch._scaled_mm`` (row-wise scales, bf16 out, W8A8) on float8 tensor
  cores, for a prefill and larger calls. A decode step's few bf16 rows go through a weight-only Triton kernel that
  reads the fp8 codes instead (rollout/quantization/w8_triton.py; ``fp8.FP8_DECODE = "weight_only"``, the default:
  faster on an H200). Both need compute capability
  >= 8.9 (Ada or Hopper; we refuse older GPUs, naming the field). Not served on CPU, where torch 2.13's ``_scaled_mm``
  runs the same arithmetic slowly: the tests check the numerics there (tests/test_quant.py). No emulated grid (like
  vLLM's fp8, ``BackendSpec.grids``).

Re-quantization at a weight sync (``requantize_in_place``) keeps the storage: each layer's new weight is quantized
into a temporary layer the usual way and its storage tensors (``_storage_tensors``: torchao's inner tensors, bnb's
packed data and absmax, fp8 codes and scales) are copied into the served layer's, so every data pointer stays the
same and a CUDA graph captured on them replays the new policy. Should a layout ever differ, the layer is replaced as
at the start and ``model._qgrpo_storage_epoch`` goes up by one: captured addresses are then stale.

Layers left in bf16 (counted as ``bf16_linears`` by ``quant_config_summary``), decided by ``layer_fits``:
- int4 / nf4, any device: layers whose ``in_features`` is not divisible by ``group_size`` (groups run along
  in_features; torchao skips such weights itself, bnb's blocks would straddle rows).
- int4 / nf4 on CPU: layers whose ``out_features`` is not a multiple of 16 (int4) / 32 (nf4): the CPU packers
  refuse those shapes. On CUDA any out_features fits (the tinygemm packer pads N; bnb's CUDA blocks are flat).
- fp8, any device: layers whose ``in_features`` or ``out_features`` is not a multiple of 16 (``_scaled_mm``'s rule).
- all precisions: ``lm_head`` when its weight is tied to the input embedding (quantizing it would break the tie),
  unless ``head=True`` (``[rollout.torch] quantize_head``): the head then gets its own weight, a copy of the
  embedding's, which is quantized like any other layer while the embedding stays bf16 (``untie_head``).

Verified here on CPU only (this machine has no GPU): every CPU path, and the device decision (``quant_path``,
``serves``, ``layer_fits``), and fp8's numerics through CPU ``_scaled_mm``. NOT run here: the four CUDA paths (int8,
int4 tinygemm, nf4, fp8); they follow the torchao / bitsandbytes / torch sources and are checked by the ``cuda``-marked
tests in tests/test_quant_devices.py and tests/test_requant_storage.py (log-probs within stated bounds of fp32,
weights on the GPU, storage kept at a re-quantization), which skip without a GPU. ROCm's ntile 16 is untested as well.

torchao / bitsandbytes are imported inside the functions: importing this module loads neither.
"""

from __future__ import annotations

import torch
from torch import nn

from qgrpo.rollout.options import QUANT_PATHS as _PATHS
from qgrpo.rollout.options import QUANT_SERVED as SERVED
from qgrpo.rollout.quantization import cpu_kernels
from qgrpo.rollout.quantization.fp8 import Fp8Linear, quantize_fp8

# (precision, device type) -> the library path that quantizes and runs it (see the module docstring), and the
# precisions served on each device, are declared without torch in rollout/options.py: the torch backend's spec reads
# them from there (rollout/backends: BackendSpec.precisions_by_device), so the config refuses what this module cannot
# run, and this module needs nothing of the backends built on it.
PRECISIONS = tuple(dict.fromkeys(p for served in SERVED.values() for p in served))  # every precision, CPU's first

# out_features must be a multiple of this on CPU, else the layer stays bf16 (measured: the CPU packers raise otherwise).
_CPU_OUT_MULTIPLE = {"int4": 16,  # aten._convert_weight_to_int4pack_for_cpu: "expect N to be dividable by 16"
                     "nf4": 32}  # bnb's CPU repack (_convert_weight_packed_for_cpu) asserts N % 32 == 0
# torch's tinygemm kernel (aten._weight_int4pack_mm on CUDA) needs Ampere or newer: compute capability >= 8.0.
_TINYGEMM_MIN_CAPABILITY = (8, 0)
# float8 tensor cores (torch._scaled_mm with float8_e4m3fn operands) need Ada or Hopper: compute capability >= 8.9.
_FP8_MIN_CAPABILITY = (8, 9)
_FP8_MULTIPLE = 16  # torch._scaled_mm: K and N (the weight's in and out features) must be multiples of 16


def serves(precision: str, device_type: str) -> bool:
    """Whether `precision` is served on `device_type` ("cpu", "cuda"; a torch.device's .type)."""
    return precision in SERVED.get(device_type, ())


def quant_path(precision: str, device_type: str) -> str:
    """The library path (a short name, see the module docstring) that quantizes `precision` on `device_type`; raises
    ValueError naming rollout.precision, the device and what is served there when the pair is not served."""
    if not serves(precision, device_type):
        here = SERVED.get(device_type, ())
        raise ValueError(f"rollout.precision: {precision!r} is not served by the torch backend on {device_type}; "
                         + (f"choose one of {', '.join(here)}" if here else
                            f"the torch backend quantizes on {' or '.join(SERVED)} only: move the model there"))
    return _PATHS[(precision, device_type)]


def layer_fits(precision: str, device_type: str, out_features: int, in_features: int, group_size: int) -> bool:
    """Whether an nn.Linear [out_features, in_features] can be quantized at `precision` on `device_type`; a layer that
    does not fit stays bf16 (the kernels' shape rules, module docstring)."""
    if precision in ("int4", "nf4") and in_features % group_size:
        return False
    if precision == "fp8":
        return not (in_features % _FP8_MULTIPLE or out_features % _FP8_MULTIPLE)
    if device_type == "cpu" and out_features % _CPU_OUT_MULTIPLE.get(precision, 1):
        return False
    return True


def _tied_lm_head(model: nn.Module) -> nn.Module | None:
    """The output projection if it shares its weight with the input embedding, else None."""
    get_out = getattr(model, "get_output_embeddings", None)
    get_in = getattr(model, "get_input_embeddings", None)
    if get_out is None or get_in is None:
        return None
    out, emb = get_out(), get_in()
    if out is None or emb is None:
        return None
    if out.weight is emb.weight or out.weight.data_ptr() == emb.weight.data_ptr():
        return out
    return None


def tied_head_source(model: nn.Module) -> tuple[str, str] | None:
    """(the output projection's module name, the name of the embedding weight it is tied to) when they are tied, else
    None: what a generator that quantizes a tied head (`quantize_model(head=True)`) re-quantizes the head from."""
    head = _tied_lm_head(model)
    if head is None:
        return None
    module = next(name for name, m in model.named_modules() if m is head)
    weight = next(name for name, p in model.named_parameters(remove_duplicate=False) if p is head.weight
                  and not name.startswith(module + "."))
    return module, weight


def untie_head(model: nn.Module) -> str | None:
    """Give a tied output projection its own weight (a copy of the embedding's), so that it can be quantized while
    the embedding stays bf16; the head's module name, or None when the head was not tied."""
    head = _tied_lm_head(model)
    if head is None:
        return None
    head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    if getattr(model, "config", None) is not None:  # a later tie_weights() must not tie them again
        model.config.tie_word_embeddings = False
    return next(name for name, m in model.named_modules() if m is head)


def _to_quantize(model: nn.Module, precision: str, group_size: int, device_type: str = "cpu",
                 head: bool = False) -> list[tuple[str, nn.Linear]]:
    """(name, module) of the plain bf16 nn.Linear layers this precision will quantize on `device_type`; a tied head
    only with `head`."""
    skip = None if head else _tied_lm_head(model)
    return [(name, m) for name, m in model.named_modules()
            if type(m) is nn.Linear and m is not skip
            and layer_fits(precision, device_type, m.out_features, m.in_features, group_size)]


def quantized_weight_names(model: nn.Module, precision: str, group_size: int, device_type: str,
                           head: bool = False) -> list[str]:
    """Names of the weights `quantize_model` quantizes at `precision` on `device_type` (none at bf16); with `head`,
    a tied head's too."""
    if precision == "bf16":
        return []
    return [f"{name}.weight" for name, _ in _to_quantize(model, precision, group_size, device_type, head)]


def _model_device(model: nn.Module) -> torch.device:
    """The one device the model's weights are on (CPU for a model without parameters)."""
    devices = {p.device for m in model.modules() if not hasattr(m, "_onednn")  # a layer packed for oneDNN
               for p in m.parameters(recurse=False)}  # (rollout/backends/onednn.py) holds its weight on meta
    if len(devices) > 1:  # e.g. a device_map split: each layer's kernel would have to be chosen apart
        raise ValueError(f"quantize_model: the model's weights are spread over {sorted(map(str, devices))}; "
                         "move the whole model to one device first")
    return devices.pop() if devices else torch.device("cpu")


def quantize_model(model: nn.Module, precision: str, group_size: int = 64, head: bool = False) -> nn.Module:
    """Quantize the nn.Linear layers of a HF causal LM (bf16 weights) in place, on the device its weights are on (CPU
    or CUDA), and return it.

    bf16: no-op. int8: torchao weight-only int8 per output channel. int4: torchao weight-only int4, group-wise along
    in_features with ``group_size`` (32, 64 or 128; 64 default, like MLX's nn.quantize): the CPU kernel on CPU,
    torch's tinygemm on CUDA. nf4: bitsandbytes NF4 ``Linear4bit`` with blocks of ``group_size`` weights along
    in_features. fp8 (CUDA): ``Fp8Linear``, float8 weights (rollout/quantization/fp8.py). Layers that
    don't fit the kernel's shapes (``layer_fits``) stay bf16, as does a tied lm_head. Activations stay bf16;
    ``model(input_ids)`` and ``model.generate`` keep working on the same device. A model is quantized once; new
    weights for its quantized layers go through ``requantize_in_place``. `head`: a tied lm_head is untied
    (``untie_head``) and quantized too.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    previous = getattr(model, "_qgrpo_quant", None)
    if previous is not None and previous[0] != "bf16":
        raise ValueError(f"model is already quantized ({previous[0]}); give it new weights with requantize_in_place")
    device = _model_device(model)
    path = quant_path(precision, device.type)  # refuses a device this precision is not served on, before any change
    if path == "torchao.int4_tile_packed_cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < _TINYGEMM_MIN_CAPABILITY:
            raise ValueError(f"rollout.precision: int4 on CUDA runs torch's tinygemm kernel, which needs compute "
                             f"capability >= 8.0 (Ampere or newer); {torch.cuda.get_device_name(device)} is "
                             f"{cap[0]}.{cap[1]}: choose rollout.precision = \"nf4\" or \"int8\"")
    if path == "torch.fp8_scaled_mm" and device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < _FP8_MIN_CAPABILITY:
            others = "\"int8\", \"int4\" or \"nf4\"" if cap >= _TINYGEMM_MIN_CAPABILITY else "\"int8\" or \"nf4\""
            raise ValueError(f"rollout.precision: fp8 on CUDA runs torch._scaled_mm on float8 tensor cores, which need "
                             f"compute capability >= 8.9 (Ada or Hopper); {torch.cuda.get_device_name(device)} is "
                             f"{cap[0]}.{cap[1]}: choose rollout.precision = {others}")
    return _quantize_layers(model, precision, group_size, device, head)


def _quantize_layers(model: nn.Module, precision: str, group_size: int, device: torch.device,
                     head: bool = False) -> nn.Module:
    """quantize_model past its checks: quantize the fitting layers at `precision` on `device` (no check that the pair
    is served: the tests run fp8's numerics on CPU through it) and start the storage epoch at 0."""
    model._qgrpo_quant = (precision, group_size)
    model._qgrpo_storage_epoch = 0
    if precision == "bf16":
        return model
    if head:
        untie_head(model)
    layers = _to_quantize(model, precision, group_size, device.type)
    if precision == "nf4":
        _quantize_nf4(model, layers, group_size, device)
    elif precision == "fp8":
        quantize_fp8(model, layers)
    else:
        _quantize_torchao(model, precision, group_size, device, {id(m) for _, m in layers})
    return model


def _quantize_torchao(model: nn.Module, precision: str, group_size: int, device: torch.device,
                      chosen: set[int]) -> None:
    """torchao's weight-only int8 / int4 on the modules whose id is in `chosen`, in place."""
    from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    # set_inductor_config=False: we never torch.compile here; don't change global inductor settings.
    if precision == "int8":
        config = Int8WeightOnlyConfig(set_inductor_config=False)
    elif device.type == "cpu":
        config = PrototypeInt4WeightOnlyConfig(group_size=group_size, set_inductor_config=False)
    else:
        from torchao.quantization.quantize_.workflows.int4.int4_packing_format import Int4PackingFormat

        config = Int4WeightOnlyConfig(group_size=group_size, int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D,
                                      int4_tile_packed_ntile=16 if torch.version.hip else 8,  # the kernel's N tile
                                      set_inductor_config=False)
    if device.type == "cuda":
        # torchao's tinygemm packer checks the *current* CUDA device's capability: make it the model's.
        with torch.cuda.device(device):
            quantize_(model, config, filter_fn=lambda m, fqn: id(m) in chosen)
    else:
        quantize_(model, config, filter_fn=lambda m, fqn: id(m) in chosen)
    if precision == "int8":  # CPU: torch's int8 kernel; CUDA: rollout/quantization/w8_triton.py's (see _int8_forward)
        for m in model.modules():
            if id(m) in chosen:
                _int8_direct(m)
    elif device.type == "cpu":
        for m in model.modules():
            if id(m) in chosen:
                _int4_direct(m)


# CPU int8 products. torchao's weight-only int8 linear casts the whole int8 weight to bf16 at every call (a bf16 copy
# written and read again per product) behind a tensor subclass's Python dispatch. "direct" reads the layer's int8 data
# with plain torch ops instead: a decode step's few rows through torch's `_weight_int8pack_mm`, which reads the int8
# weight inside the kernel and applies the per-row scale there; more rows (a prefill, scoring) through torchao's own
# arithmetic (cast, one bf16 product, the scale), where the bf16 product's blocking wins. Up to how many rows the
# kernel wins is measured per weight shape on the machine (rollout/quantization/cpu_kernels.py: `cpu_int8_rows`).
# Measured on the default job's batch (bench/generation_speed.py, 2-core AMD EPYC with avx512_bf16): decode 450 tokens/s
# with the int8 kernel against 395 through torchao, while a 1,200-row prefill took 0.64 s against 0.36 s.
# "torchao" keeps torchao's linear. Same storage either way (tests/test_quant.py).
# CPU int4 layers take the same kind of route (`_int4_forward`): torch's int4 kernel up to the rows measured faster
# there, the weight decoded once per call and one plain product past them (cpu_kernels.int4_product).
INT8_LINEAR = "direct"
INT8PACK_ROWS = 64  # on CUDA: the most rows through the Triton int8 kernel (rollout/quantization/w8_triton.py)


def _int8_direct(module: nn.Module) -> None:
    """Route `module`'s forward through torch ops on the int8 weight torchao just gave it (INT8_LINEAR = "direct"),
    else through torchao's linear, as a module whose weight is not symmetric per row always is."""
    w = module.weight
    if INT8_LINEAR != "direct" or not hasattr(w, "qdata") or w.qdata.dim() != 2 or bool(w.zero_point.any()) \
            or w.scale.numel() != w.shape[0]:
        module.__dict__.pop("forward", None)
        module.__dict__.pop("_int8", None)
        return
    module._int8 = (w.qdata, w.scale.reshape(-1))
    module.forward = _int8_forward.__get__(module)


def _int4_direct(module: nn.Module) -> None:
    """Route a CPU int4 layer's forward through cpu_kernels.int4_product (the kernel's rows measured per shape), as
    long as torchao's weight is the plain weight-only kind (no activation scale or quantization) and this torch's
    packing is one we can decode; else torchao's linear. It reads the layer's live weight at each call."""
    w = module.weight
    if type(w).__name__ != "Int4OpaqueTensor" or w.block_size[0] != 1 or w.act_pre_scale is not None \
            or w.act_mapping_type is not None or cpu_kernels.int4_layout() is None:
        module.__dict__.pop("forward", None)
        return
    module.forward = _int4_forward.__get__(module)


def _int4_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    w = self.weight
    return cpu_kernels.int4_product(x, w.qdata, w.scale_and_zero, w.shape[0], w.block_size[1], self.bias)


def _int8_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Few rows: `_weight_int8pack_mm` on the int8 weight; more: torchao's weight-only arithmetic (x W_int8^T in
    x's dtype, then the per-row scale in that dtype) without its tensor-subclass dispatch.
    On CUDA: at most INT8PACK_ROWS bf16 rows through the Triton kernel of rollout/quantization/w8_triton.py, which reads
    the int8 weight itself (torchao's linear writes and reads a bf16 copy of it per call); anything else, or no Triton,
    through torchao's linear. Both read the layer's live ``qdata`` / ``scale`` (a weight sync copies into them)."""
    if x.device.type != "cpu" and not _int8_kernel_takes(x):
        return nn.functional.linear(x, self.weight, self.bias)
    return int8_product(x, *self._int8, self.bias)


def _int8_kernel_takes(x: torch.Tensor) -> bool:
    """On CUDA: whether the Triton int8 kernel takes these activations (bf16, at most INT8PACK_ROWS rows)."""
    from qgrpo.rollout.quantization import w8_triton

    return x.dtype == torch.bfloat16 and x.numel() // x.shape[-1] <= INT8PACK_ROWS and w8_triton.available()


def int8_product(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] times the int8 weight `qdata` [N, K] with per-row `scale` [N] (+ bias), as `_int8_forward`: on
    CUDA the Triton kernel where it takes the rows; on CPU `_weight_int8pack_mm` for as many rows as it was measured
    faster here (`cpu_kernels.cpu_int8_rows`); else torchao's weight-only arithmetic (x W_int8^T in x's dtype, then
    the per-row scale)."""
    if x.device.type != "cpu":
        if _int8_kernel_takes(x):
            from qgrpo.rollout.quantization import w8_triton

            return w8_triton.w8_linear(x, qdata, scale, bias)
        y = nn.functional.linear(x, qdata.to(x.dtype)) * scale.to(x.dtype)
        return y if bias is None else y + bias
    rows = x.numel() // x.shape[-1]
    if x.dtype in (torch.bfloat16, torch.float32) and rows <= cpu_kernels.cpu_int8_rows(*qdata.shape, x.dtype):
        y = cpu_kernels.int8_kernel(x.reshape(rows, x.shape[-1]), qdata, scale).reshape(*x.shape[:-1], qdata.shape[0])
    else:
        y = nn.functional.linear(x, qdata.to(x.dtype)) * scale.to(x.dtype)
    return y if bias is None else y + bias


@torch.no_grad()
def requantize_in_place(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """New bf16 weights ({layer name: [out, in]}) for layers that `quantize_model` quantized, quantized again at the
    model's precision and group size in place (a sync's re-quantization), keeping each layer's storage: the weight is
    quantized into a temporary layer as at the start and its storage tensors (`_storage_tensors`) are copied into the
    served layer's, so their data pointers do not move (a captured CUDA graph keeps reading the live weights). One
    temporary layer exists at a time. A layer whose temporary's storage does not match (count, shapes, dtypes,
    strides, device, format metadata: not expected) is replaced as at the start instead, and
    ``model._qgrpo_storage_epoch`` goes up by one so that a holder of captured addresses knows they are stale.
    The layers' biases are the caller's to update (they are plain parameters)."""
    precision, group_size = getattr(model, "_qgrpo_quant", ("bf16", None))
    if precision == "bf16":
        raise ValueError("requantize_in_place: the model is not quantized; copy bf16 weights into it instead")
    device = _model_device(model)
    for name, w in weights.items():  # all checked before any layer changes
        old = model.get_submodule(name)
        if tuple(w.shape) != (old.out_features, old.in_features):
            raise ValueError(f"requantize_in_place: {name} is [{old.out_features}, {old.in_features}], got a weight "
                             f"of shape {list(w.shape)}")
    for name, w in weights.items():
        old = model.get_submodule(name)
        new = _fresh_layer(old, precision, group_size, device, w.to(device=device, dtype=torch.bfloat16))
        if _layout(old) == _layout(new):
            for dst, src in zip(_storage_tensors(old), _storage_tensors(new)):
                dst.copy_(src)
            if precision == "int8":
                _int8_direct(old)  # the direct path reads the same (live) tensors; its conditions checked again
        else:
            _replace_layer(model, name, old, new, precision)
            model._qgrpo_storage_epoch = getattr(model, "_qgrpo_storage_epoch", 0) + 1
        del new


def _fresh_layer(old: nn.Module, precision: str, group_size: int, device: torch.device,
                 w: torch.Tensor) -> nn.Module:
    """A temporary layer holding bf16 weight `w` ([out, in], on `device`) quantized at `precision` as
    `quantize_model` quantizes it, without bias."""
    if precision == "fp8":
        return Fp8Linear(w)
    lin = nn.Linear(old.in_features, old.out_features, bias=False, device="meta")
    lin.weight = nn.Parameter(w, requires_grad=False)
    if precision == "nf4":
        return _nf4_layer(lin, group_size, device)
    holder = nn.Sequential(lin)
    _quantize_torchao(holder, precision, group_size, device, {id(lin)})
    return holder[0]


def _layout(layer: nn.Module) -> tuple:
    """What must match for a layer's storage to be overwritten with another's: each storage tensor's shape, dtype,
    strides and device, and the format's non-tensor metadata (torchao's tensor attributes, bnb's quant state)."""
    w = layer.weight
    if hasattr(w, "__tensor_flatten__"):
        meta = repr(w.__tensor_flatten__()[1])
    else:
        qs = getattr(w, "quant_state", None)
        meta = None if qs is None else (tuple(qs.shape), qs.dtype, qs.blocksize, qs.quant_type,
                                        bool(getattr(qs, "nested", False)),
                                        bool(getattr(qs, "packing_format_for_cpu", False)))
    return (type(layer), type(w), meta,
            tuple((tuple(t.shape), t.dtype, t.stride(), t.device) for t in _storage_tensors(layer)))


def _replace_layer(model: nn.Module, name: str, old: nn.Module, new: nn.Module, precision: str) -> None:
    """The fallback of `requantize_in_place`: `new`'s storage takes `old`'s place (new addresses)."""
    if precision == "fp8":
        old.weight, old.scale = new.weight, new.scale
    elif precision == "nf4":
        new.bias = old.bias
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
    else:
        old.weight = new.weight
        if precision == "int8":
            _int8_direct(old)


def _quantize_nf4(model: nn.Module, layers: list[tuple[str, nn.Linear]], group_size: int,
                  device: torch.device) -> None:
    for name, lin in layers:
        q = _nf4_layer(lin, group_size, device)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, q)


def _nf4_layer(lin: nn.Linear, group_size: int, device: torch.device) -> nn.Module:
    """A bitsandbytes NF4 Linear4bit of `lin`'s weight (and bias) on `device`."""
    import bitsandbytes as bnb

    q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                          compute_dtype=torch.bfloat16, compress_statistics=False, quant_type="nf4",
                          device="meta")
    # .to(device) of an unquantized Params4bit is bnb's public way to quantize it, on that device's kernels.
    q.weight = bnb.nn.Params4bit(lin.weight.data.contiguous(), requires_grad=False, blocksize=group_size,
                                 compress_statistics=False, quant_type="nf4", module=q).to(device)
    q.quant_state = q.weight.quant_state
    if lin.bias is not None:
        q.bias = nn.Parameter(lin.bias.data, requires_grad=False)
    if device.type == "cpu":
        # Trigger bnb's one-time CPU repack (it happens at the first eval no-grad forward) now, so bytes and speed
        # are what rollouts will see and the repack isn't paid inside generation. CUDA has no repack.
        was_training = q.training
        q.eval()
        with torch.no_grad():
            q(torch.zeros(1, lin.in_features, dtype=torch.bfloat16))
        q.train(was_training)
    return q


def _storage_tensors(w: torch.Tensor | nn.Module):
    """The plain tensors that really hold a (possibly quantized) weight, in a fixed order; given a layer, those of its
    weight (an Fp8Linear's: its codes and their scales)."""
    if isinstance(w, Fp8Linear):
        yield w.weight
        yield w.scale
        return
    if isinstance(w, nn.Module):
        yield from _storage_tensors(w.weight)
        return
    if hasattr(w, "__tensor_flatten__"):  # torchao tensor subclass: its inner tensors (qdata, scales, zeros)
        names, _ = w.__tensor_flatten__()
        for n in names:
            yield from _storage_tensors(getattr(w, n))
        return
    yield w
    qs = getattr(w, "quant_state", None)  # bitsandbytes Params4bit: packed data + quant_state (absmax, code, ...)
    if qs is not None:
        for t in (qs.absmax, qs.code, getattr(qs, "offset", None)):
            if isinstance(t, torch.Tensor):
                yield t
        if getattr(qs, "nested", False):
            yield qs.state2.absmax
            yield qs.state2.code


def _linears(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, (nn.Linear, Fp8Linear))]  # bnb Linear4bit is an nn.Linear


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes held by the weights of the linear layers (packed data + scales + zero points), measured as the sizes of
    the storages of the tensors that hold them, each storage counted once (biases not included).
    A tied lm_head counts: it stays bf16 and its storage is the embedding's; packed on oneDNN (a float32 CPU
    generator), it holds a copy of its own."""
    seen, total = set(), 0
    for m in _linears(model):
        if hasattr(m, "_onednn"):  # float32 in oneDNN's layout (rollout/backends/onednn.py), its own
            total += m.out_features * m.in_features * 4
            continue
        for t in _storage_tensors(m):
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
    return total


def _is_quantized(layer: nn.Module) -> bool:
    return isinstance(layer, Fp8Linear) or type(layer.weight) not in (torch.Tensor, nn.Parameter)  # torchao, bnb


def quant_config_summary(model: nn.Module) -> dict:
    """e.g. {"precision": "int4", "quantized_linears": 14, "bf16_linears": 1, "group_size": 64}"""
    precision, group_size = getattr(model, "_qgrpo_quant", ("bf16", None))
    lins = _linears(model)
    n_q = sum(_is_quantized(m) for m in lins)
    return {"precision": precision, "quantized_linears": n_q, "bf16_linears": len(lins) - n_q,
            "group_size": group_size if precision in ("int4", "nf4") else None}


def int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization per output channel (row) of a [N, K] weight, computed in float32:
    scale = max|w_row| / 127, q = round(w / scale) in [-127, 127]. Returns (q int8 [N, K], scale float32 [N, 1]);
    q * scale reconstructs w within scale / 2 per element. The layout vLLM's compressed-tensors W8A8 int8 loads."""
    w = w.detach().float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale
