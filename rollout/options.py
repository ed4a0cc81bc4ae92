"""Rollout-side choices, without torch: the config schema (cluster/config) builds its allowed values from them, so
the two cannot drift and `qgrpo` starts without importing torch."""

# sync.requantize (rollout/quantization/requantize.py): how a rollout actor rounds received weights onto its format's
# grid. Which formats have a grid it emulates each backend's spec says (rollout/backends: BackendSpec.grids,
# EMULATED_FORMATS).
REQUANTIZE_MODES = ("nearest", "stochastic", "error_feedback")

# The torch quantizer (rollout/quantization/quant.py): (precision, device) -> the library path that quantizes and runs
# it (its module docstring says why each). Declared here, without torch, so that what it serves is its own to say: the
# torch backend's spec (and so the torch reference scorer) and the reward model's rule read QUANT_SERVED, and the config
# refuses the rest.
QUANT_PATHS = {
    ("bf16", "cpu"): "none", ("bf16", "cuda"): "none",
    ("int8", "cpu"): "torchao.int8", ("int8", "cuda"): "torchao.int8",
    ("int4", "cpu"): "torchao.int4_opaque_cpu", ("int4", "cuda"): "torchao.int4_tile_packed_cuda",
    ("nf4", "cpu"): "bnb.nf4_cpu", ("nf4", "cuda"): "bnb.nf4_cuda",
    ("fp8", "cuda"): "torch.fp8_scaled_mm",
}
# device -> the precisions quantized there, in QUANT_PATHS's order: every pair served has a path by construction.
QUANT_SERVED: dict[str, tuple[str, ...]] = {
    device: tuple(p for p, d in QUANT_PATHS if d == device) for device in dict.fromkeys(d for _, d in QUANT_PATHS)}
