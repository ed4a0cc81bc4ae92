"""rollout.quant on each device: which library path a (precision, device) takes, which layers fit there, what the
backend registry serves per device (and refuses, naming the field), and, on a CUDA GPU, that every precision really
quantizes there with log-probs within stated bounds of fp32.

Everything but the `cuda`-marked tests runs on CPU. The CUDA dispatch is also checked without a GPU: the model's
device is faked and the library calls recorded (config chosen, device quantized on, probe forward skipped)."""

import contextlib
import copy

import pytest
import torch

import qgrpo.rollout.quantization.quant as quant
from qgrpo.rollout.backends import REGISTRY, device_of, next_rung
from qgrpo.rollout.quantization.quant import (
    SERVED,
    layer_fits,
    quant_config_summary,
    quant_path,
    quantize_model,
    serves,
)
from tests.helpers import LOGPROB_BOUNDS, next_token_logprobs, skip_below_capability, tiny_llama
from tests.test_quant import FP8_LOGPROB_BOUNDS  # measured there, on CPU's _scaled_mm

ALL = ("bf16", "int8", "int4", "nf4")  # served on CPU and CUDA alike; fp8 on CUDA only
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# --- the device decision (pure functions) -------------------------------------------------------------------------

def test_torch_serves_every_precision_on_cpu_and_cuda():
    assert SERVED == {"cpu": ALL, "cuda": (*ALL, "fp8")} == REGISTRY["torch"].precisions_by_device
    assert all(serves(p, d) for p in ALL for d in ("cpu", "cuda"))
    assert serves("fp8", "cuda") and not serves("fp8", "cpu")
    assert not serves("int4", "mps") and not serves("int8", "meta")


@pytest.mark.parametrize("precision, device, path", [
    ("bf16", "cpu", "none"), ("bf16", "cuda", "none"),
    ("int8", "cpu", "torchao.int8"), ("int8", "cuda", "torchao.int8"),  # Int8Tensor: plain torch ops on both
    ("int4", "cpu", "torchao.int4_opaque_cpu"),  # Int4OpaqueTensor, aten._weight_int4pack_mm_for_cpu
    ("int4", "cuda", "torchao.int4_tile_packed_cuda"),  # Int4TilePackedTo4dTensor, aten._weight_int4pack_mm
    ("nf4", "cpu", "bnb.nf4_cpu"), ("nf4", "cuda", "bnb.nf4_cuda"),
    ("fp8", "cuda", "torch.fp8_scaled_mm"),  # Fp8Linear: float8 weights and activations, torch._scaled_mm
])
def test_quant_path_per_device(precision, device, path):
    assert quant_path(precision, device) == path


def test_quant_path_refuses_what_is_not_served_naming_the_field():
    with pytest.raises(ValueError, match=r"rollout.precision: 'int4' is not served by the torch backend on mps; "
                                         r"the torch backend quantizes on cpu or cuda only"):
        quant_path("int4", "mps")
    with pytest.raises(ValueError, match=r"rollout.precision: 'fp8' is not served by the torch backend on cpu; "
                                         r"choose one of bf16, int8, int4, nf4"):
        quant_path("fp8", "cpu")


@pytest.mark.parametrize("precision, device, out_features, in_features, fits", [
    ("int8", "cpu", 100, 96, True), ("int8", "cuda", 100, 96, True),  # int8: any shape
    ("int4", "cpu", 100, 128, False), ("int4", "cuda", 100, 128, True),  # N % 16 on CPU; tinygemm pads N on CUDA
    ("nf4", "cpu", 48, 128, False), ("nf4", "cuda", 48, 128, True),  # N % 32 for bnb's CPU repack only
    ("int4", "cpu", 64, 96, False), ("int4", "cuda", 64, 96, False),  # K % group_size everywhere
    ("nf4", "cuda", 64, 96, False), ("int4", "cuda", 64, 128, True),
    ("fp8", "cuda", 64, 96, True), ("fp8", "cuda", 100, 128, False),  # _scaled_mm: K and N multiples of 16
    ("fp8", "cuda", 64, 72, False), ("fp8", "cpu", 48, 16, True),  # no group: group_size plays no part
])
def test_layer_fits_per_device(precision, device, out_features, in_features, fits):
    assert layer_fits(precision, device, out_features, in_features, 64) is fits


# --- the backend registry, per device -----------------------------------------------------------------------------

def test_registry_precisions_by_device():
    assert REGISTRY["vllm"].precisions_by_device == {"cpu": ("bf16", "int8"), "cuda": ("bf16", "int8", "fp8")}
    assert REGISTRY["mlx"].served("cpu") == ("bf16", "int8", "int4") and REGISTRY["mlx"].served("cuda") == ()
    # the union and the CUDA-only set, as the callers from before per-device precisions read them
    assert REGISTRY["vllm"].precisions == ("bf16", "int8", "fp8") and REGISTRY["vllm"].gpu_precisions == ("fp8",)
    assert REGISTRY["torch"].gpu_precisions == ("fp8",) and REGISTRY["mlx"].gpu_precisions == ()
    assert device_of(0) == "cpu" and device_of(0.5) == "cuda" and device_of(1) == "cuda"


def test_torch_int4_and_nf4_are_served_on_cuda():
    assert REGISTRY["torch"].served("cuda") == (*ALL, "fp8")
    assert all(REGISTRY["torch"].problems(p, 1) == [] for p in (*ALL, "fp8"))


def test_torch_fp8_is_refused_on_cpu_naming_the_field():
    msgs = [m for m in REGISTRY["torch"].problems("fp8", 0) if m.startswith("rollout.precision")]
    assert msgs == ["rollout.precision: fp8 on torch needs a CUDA GPU per rollout actor (set rollout.num_gpus >= 1); "
                    "on CPU choose one of bf16, int8, int4, nf4"]
    assert not [m for m in REGISTRY["torch"].problems("fp8", 0.5) if m.startswith("rollout.precision")]


def test_mlx_on_cuda_is_refused_naming_the_field():
    for precision in ("bf16", "int4"):
        msgs = REGISTRY["mlx"].problems(precision, 1)
        assert [m for m in msgs if m.startswith(f"rollout.precision: {precision} on mlx is not served on CUDA")], msgs
        assert "set rollout.num_gpus = 0" in msgs[-1] and "rollout.backend = torch" in msgs[-1], msgs
    assert not [m for m in REGISTRY["mlx"].problems("int4", 0) if m.startswith("rollout.precision")]


def test_vllm_fp8_is_refused_on_cpu_and_served_on_any_gpu_share():
    assert "fp8" not in REGISTRY["vllm"].served("cpu")
    msgs = [m for m in REGISTRY["vllm"].problems("fp8", 0) if m.startswith("rollout.precision")]
    assert msgs == ["rollout.precision: fp8 on vllm needs a CUDA GPU per rollout actor (set rollout.num_gpus >= 1); "
                    "on CPU choose one of bf16, int8"]
    # a share of one GPU (rollout.num_gpus = 0.5) puts the actor on CUDA: fp8 is served there
    assert not [m for m in REGISTRY["vllm"].problems("fp8", 0.5) if m.startswith("rollout.precision")]


def test_backend_spec_refuses_an_unknown_device_key():
    from qgrpo.rollout.backends import BackendSpec

    with pytest.raises(ValueError, match="precisions_by_device keys must be among"):
        BackendSpec("x", "m:C", {"gpu": ("bf16",)}, "typo'd device")


def test_next_rung_skips_rungs_not_served_on_the_device():
    assert next_rung("torch", "int4", "cuda") == "int8" and next_rung("torch", "nf4", "cpu") == "int8"
    assert next_rung("vllm", "fp8", "cuda") == "bf16" and next_rung("vllm", "int8") == "bf16"  # default: cpu
    assert next_rung("torch", "fp8", "cuda") == "bf16"
    assert next_rung("mlx", "int4", "cuda") is None  # mlx serves nothing on CUDA: no rung to go to
    assert next_rung("mlx", "int4") == "int8" and next_rung("torch", "bf16", "cuda") is None


# --- quantize_model: CPU for real, CUDA dispatch with the device faked ---------------------------------------------

@pytest.mark.parametrize("precision, weight_type", [("int8", "Int8Tensor"), ("int4", "Int4OpaqueTensor"),
                                                    ("nf4", "Params4bit")])
def test_quantize_on_cpu_takes_the_cpu_path(precision, weight_type):
    m = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(128, 100)).to(torch.bfloat16)
    assert quant.quantize_model(m, precision) is m
    assert quant_path(precision, "cpu") != quant_path(precision, "cuda") or precision == "int8"
    assert type(m[0].weight).__name__ == weight_type and m[0].weight.device.type == "cpu"
    # N = 100 stays bf16 on CPU at int4 (N % 16) and nf4 (N % 32); the same layer fits on CUDA
    assert (type(m[1].weight) is torch.nn.Parameter) is (precision != "int8")
    assert layer_fits(precision, "cuda", 100, 128, 64)


def test_quantize_refuses_a_device_it_does_not_serve():
    m = torch.nn.Sequential(torch.nn.Linear(128, 64, device="meta", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"rollout.precision: 'int4' is not served by the torch backend on meta"):
        quantize_model(m, "int4")
    assert not hasattr(m, "_qgrpo_quant")  # refused before any change
    mixed = torch.nn.Sequential(torch.nn.Linear(64, 64, dtype=torch.bfloat16),
                                torch.nn.Linear(64, 64, device="meta", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="weights are spread over"):
        quantize_model(mixed, "int8")


@pytest.fixture
def fake_cuda(monkeypatch):
    """The model's weights stay on CPU, but quantize_model sees CUDA (no GPU here): the CUDA branch runs up to the
    library calls, which the tests record."""
    dev = torch.device("cuda", 0)
    monkeypatch.setattr(quant, "_model_device", lambda model: dev)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    return dev


def test_int4_on_cuda_uses_torchaos_tile_packed_format(fake_cuda, monkeypatch):
    import torchao.quantization as tq
    from torchao.quantization.quantize_.workflows.int4.int4_packing_format import Int4PackingFormat

    calls = []
    monkeypatch.setattr(tq, "quantize_", lambda model, config, filter_fn: calls.append(
        (config, [n for n, mod in model.named_modules() if filter_fn(mod, n)])))
    m = torch.nn.Sequential(torch.nn.Linear(128, 100), torch.nn.Linear(96, 64)).to(torch.bfloat16)
    quantize_model(m, "int4", group_size=64)
    [(config, chosen)] = calls
    assert type(config) is tq.Int4WeightOnlyConfig and config.group_size == 64
    assert config.int4_packing_format == Int4PackingFormat.TILE_PACKED_TO_4D and config.int4_tile_packed_ntile == 8
    assert chosen == ["0"]  # N = 100 fits on CUDA; K = 96 is not a multiple of the group


def test_int4_on_a_pre_ampere_gpu_is_refused_naming_the_field(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    m = torch.nn.Sequential(torch.nn.Linear(128, 64)).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"rollout.precision: int4 on CUDA .* compute capability >= 8.0 .* "
                                         r"Fake GPU is 7.5: choose rollout.precision = \"nf4\" or \"int8\""):
        quantize_model(m, "int4")


def test_fp8_on_cuda_replaces_fitting_linears_by_fp8_layers(fake_cuda):
    m = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(96, 100), torch.nn.Linear(64, 48)).to(
        torch.bfloat16)
    quantize_model(m, "fp8")
    assert [type(x).__name__ for x in m] == ["Fp8Linear", "Linear", "Fp8Linear"]  # N = 100: not a multiple of 16
    assert m[0].weight.dtype == torch.float8_e4m3fn and m[0].bias is not None
    s = quant_config_summary(m)
    assert (s["precision"], s["quantized_linears"], s["bf16_linears"], s["group_size"]) == ("fp8", 2, 1, None)
    # codes (1 byte per weight) and a float32 scale per row, against bf16's 2 bytes per weight
    assert quant.linear_weight_bytes(m) == 64 * 128 + 4 * 64 + 100 * 96 * 2 + 48 * 64 + 4 * 48


@pytest.mark.parametrize("capability, others", [((8, 6), "\"int8\", \"int4\" or \"nf4\""),
                                                ((7, 5), "\"int8\" or \"nf4\"")])
def test_fp8_on_a_pre_ada_gpu_is_refused_naming_the_field(fake_cuda, monkeypatch, capability, others):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    m = torch.nn.Sequential(torch.nn.Linear(128, 64)).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"rollout.precision: fp8 on CUDA .* compute capability >= 8.9 .* "
                                         rf"Fake GPU is {capability[0]}.{capability[1]}: choose rollout.precision = "
                                         + others):
        quantize_model(m, "fp8")
    assert not hasattr(m, "_qgrpo_quant") and type(m[0]) is torch.nn.Linear


def test_nf4_on_cuda_quantizes_there_and_skips_the_cpu_repack_probe(fake_cuda, monkeypatch):
    import bitsandbytes as bnb

    to_devices, forwards = [], []
    real_to, real_forward = bnb.nn.Params4bit.to, bnb.nn.Linear4bit.forward

    def to(self, *args, **kwargs):  # record where bnb is asked to quantize; quantize on CPU (no GPU here)
        to_devices.append(torch.device(args[0]) if args else kwargs.get("device"))
        return real_to(self, "cpu")

    monkeypatch.setattr(bnb.nn.Params4bit, "to", to)
    monkeypatch.setattr(bnb.nn.Linear4bit, "forward", lambda self, x: forwards.append(x) or real_forward(self, x))
    m = torch.nn.Sequential(torch.nn.Linear(128, 48), torch.nn.Linear(128, 64)).to(torch.bfloat16)
    quantize_model(m, "nf4", group_size=64)
    assert to_devices == [fake_cuda, fake_cuda] and forwards == []  # both layers (N = 48 fits on CUDA), no probe
    assert quant_config_summary(m)["quantized_linears"] == 2


def test_nf4_on_cpu_still_runs_the_repack_probe(monkeypatch):
    import bitsandbytes as bnb

    forwards = []
    real_forward = bnb.nn.Linear4bit.forward
    monkeypatch.setattr(bnb.nn.Linear4bit, "forward",
                        lambda self, x: forwards.append(x.device) or real_forward(self, x))
    m = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(128, 48)).to(torch.bfloat16)
    quantize_model(m, "nf4")
    assert forwards == [torch.device("cpu")]  # one probe, for the one layer that fits on CPU (N = 48 does not)
    assert quant_path("nf4", "cpu") == "bnb.nf4_cpu"


# --- on a CUDA GPU: every precision quantizes there, log-probs within bounds of fp32 ------------------------------

# Builtin tiny model (vocab 32, init std 0.02: small logits), 8 x 32 random tokens, per-token log-prob error vs an
# fp32 forward of the same weights; measured on CPU's paths over seeds 0-4 (mean / max): bf16 0.0006 / 0.003, int8
# 0.0014 / 0.008, int4 0.017 / 0.083, nf4 0.018 / 0.070, fp8 (W8A8, CPU's _scaled_mm) 0.0073 / 0.028. Bounds ~2x the
# worst seen, as in test_quant.py. The model's log-probs differ from a uniform distribution's by ~0.125 mean, so a
# kernel returning zeros fails these bounds.
BUILTIN_BOUNDS = {"bf16": (0.002, 0.01), "int8": (0.004, 0.02), "int4": (0.04, 0.2), "nf4": (0.04, 0.2),
                  "fp8": (0.015, 0.06)}
CUDA_WEIGHT_TYPES = {"int8": "Int8Tensor", "int4": "Int4TilePackedTo4dTensor", "nf4": "Params4bit",
                     "fp8": "Fp8Linear"}
# The CUDA capability each precision needs (int4: tinygemm; fp8: float8 tensor cores).


def _storage_devices(model) -> set[str]:
    return {t.device.type for m in quant._linears(model) for t in quant._storage_tensors(m)}


def _format(layer) -> str:
    """What holds a quantized layer's weight: the torchao / bnb tensor type, or the layer type for Fp8Linear."""
    return "Fp8Linear" if isinstance(layer, quant.Fp8Linear) else type(layer.weight).__name__



@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("precision", ["int8", "int4", "nf4", "fp8"])
def test_builtin_tiny_model_on_cuda(tiny_model_path, precision):
    from transformers import AutoModelForCausalLM

    skip_below_capability(precision)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16).to("cuda").eval()
    ids = torch.randint(0, base.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(0)).cuda()
    ref = next_token_logprobs(copy.deepcopy(base).float(), ids)
    uniform_gap = (ref + torch.log(torch.tensor(float(base.config.vocab_size)))).abs().mean().item()
    q = quantize_model(copy.deepcopy(base), precision)
    s = quant_config_summary(q)
    assert (s["quantized_linears"], s["bf16_linears"]) == (15, 0), s  # 2 x 7 + lm_head, all fit at group 64
    assert {_format(m) for m in quant._linears(q)} == {CUDA_WEIGHT_TYPES[precision]}
    assert _storage_devices(q) == {"cuda"}  # packed data and scales really live on the GPU
    lp = next_token_logprobs(q, ids)
    assert lp.device.type == "cuda" and torch.isfinite(lp).all()
    diff = (lp - ref).abs()
    mean_bound, max_bound = BUILTIN_BOUNDS[precision]
    assert mean_bound * 3 < uniform_gap, uniform_gap  # the bound can tell a working kernel from one returning zeros
    assert diff.mean().item() < mean_bound, (precision, diff.mean().item())
    assert diff.max().item() < max_bound, (precision, diff.max().item())
    with torch.no_grad():
        out = q.generate(ids[:2, :8], attention_mask=torch.ones_like(ids[:2, :8]), do_sample=False, max_new_tokens=4,
                         min_new_tokens=4)
    assert out.shape == (2, 12)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("precision", ["int8", "int4", "nf4", "fp8"])
def test_test_quant_model_on_cuda_within_its_cpu_bounds(precision):
    """test_quant.py's tiny model (init std 0.1: large logits) and its bounds (LOGPROB_BOUNDS; fp8's measured there
    too), unchanged, on CUDA."""
    skip_below_capability(precision)
    base = tiny_llama().to("cuda")
    ids = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(123)).cuda()
    ref = next_token_logprobs(copy.deepcopy(base).float(), ids)
    q = quantize_model(copy.deepcopy(base), precision)
    assert _storage_devices(q) == {"cuda"} and quant_config_summary(q)["quantized_linears"] == 15
    diff = (next_token_logprobs(q, ids) - ref).abs()
    mean_bound, max_bound = {**LOGPROB_BOUNDS, "fp8": FP8_LOGPROB_BOUNDS}[precision]
    assert diff.mean().item() < mean_bound, (precision, diff.mean().item())
    assert diff.max().item() < max_bound, (precision, diff.max().item())


@pytest.mark.cuda
@cuda
def test_torch_generator_at_fp8_on_cuda(tiny_model_path):
    """The torch generator at fp8 on cuda:0: its layers are Fp8Linear on the GPU, its log-probs (score) within the
    builtin model's fp8 bounds of the bf16 generator's (plus bf16's own error), it samples (decode on the GPU), and a
    sync writes the new weights into the same storage and moves the log-probs."""
    from qgrpo.core.records import PromptItem, SamplingParams
    from qgrpo.rollout.backends.torch_backend import TorchGenerator

    skip_below_capability("fp8")
    gen = TorchGenerator(tiny_model_path, precision="fp8", device="cuda:0")
    ref = TorchGenerator(tiny_model_path, precision="bf16", device="cuda:0")
    assert {_format(m) for m in quant._linears(gen.model)} == {"Fp8Linear"} and _storage_devices(gen.model) == {"cuda"}
    ids = torch.randint(0, gen.model.config.vocab_size, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    lp, lp_bf16 = torch.tensor(gen.score(ids)), torch.tensor(ref.score(ids))
    diff = (lp - lp_bf16).abs()
    mean_bound, max_bound = BUILTIN_BOUNDS["fp8"]
    assert torch.isfinite(lp).all() and diff.mean().item() < mean_bound + 0.002, diff.mean().item()
    assert diff.max().item() < max_bound + 0.01, diff.max().item()
    groups = gen.generate([PromptItem("p0", "1+2=", "3")], SamplingParams(group_size=4, max_new_tokens=6, seed=0))
    assert len(groups[0].completions) == 4
    assert all(torch.isfinite(torch.tensor(c.logprobs)).all() for c in groups[0].completions)
    ptrs = [t.data_ptr() for m in quant._linears(gen.model) for t in quant._storage_tensors(m)]
    torch.manual_seed(0)
    new = {n: (p.float() + 0.05 * torch.randn_like(p.float())).to(torch.bfloat16).cpu()
           for n, p in ref.model.named_parameters()}
    gen.load_weights(1, new.items())
    assert [t.data_ptr() for m in quant._linears(gen.model) for t in quant._storage_tensors(m)] == ptrs
    assert gen.model._qgrpo_storage_epoch == 0
    assert (torch.tensor(gen.score(ids)) - lp).abs().max().item() > 0.05  # the new weights are served
