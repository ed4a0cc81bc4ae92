"""rollout/quantization/w8_triton.py: the Triton weight-only matmul on int8 and float8_e4m3fn codes against a float32
reference, and its routing from a torchao-int8 nn.Linear (rollout/quantization/quant.py: _int8_forward) and from an
Fp8Linear (rollout/quantization/fp8.py: fp8_linear).

Without a GPU the kernel runs on CPU tensors through Triton's interpreter, which needs TRITON_INTERPRET=1 before
Triton's first import: ``test_interpreter_tests_pass_in_a_subprocess`` reruns this file's ``*_in_interpreter`` tests
in a fresh Python with it set (they skip in a process without it). The interpreter's bf16 ``tl.dot`` and 8-bit -> bf16
casts work on raw bits, so there the kernel's dot runs in fp32 (``DOT_F32``): indexing, masks, the K split and the
epilogue are checked on CPU, the bf16 dot only by the ``cuda`` tests. The routing test needs neither Triton nor a
GPUs (a meta tensor stands in for a CUDA one).

Tolerance: the output is bf16, so |y - ref| <= 1e-2 |ref| + 1e-3 max|ref| per element (bf16 keeps 8 significant
bits: 2**-8 relative rounding to nearest; the interpreter's fp32 -> bf16 cast truncates, up to 2**-7).
"""

import os

import pytest
import torch
from torch import nn

from qgrpo.rollout.backends import torch_fused
from qgrpo.rollout.quantization import fp8, quant, w8_triton
from tests.helpers import rerun_in_triton_interpreter

RTOL = 1e-2
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
SHAPES = [(m, k, n) for m in (1, 7, 16, 33) for k in (200, 256, 1536) for n in (64, 300)]


def _operands(m: int, k: int, n: int, bias: bool, device: str = "cpu", seed: int = 0, codes: str = "int8"):
    """bf16 x [m, k], 8-bit codes [n, k] (int8 in [-127, 127], or fp8 codes of a random weight: fp8_per_row's), an
    fp32 scale per row and a bf16 bias [n] or None."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    if codes == "int8":
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        scale = torch.rand(n, 1, generator=g) * 0.02 + 1e-3  # torchao's Int8Tensor: fp32 [N, 1]
    else:
        q, scale = fp8.fp8_per_row(torch.randn(n, k, generator=g) * 0.05)  # float8_e4m3fn [N, K], fp32 [N]
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    return [t.to(device) if t is not None else None for t in (x, q, scale, b)]


def _check(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    assert not torch.isnan(y).any()
    torch.testing.assert_close(y.float(), ref, rtol=RTOL, atol=1e-3 * ref.abs().max().item())


@pytest.fixture
def interpreter():
    pytest.importorskip("triton")
    if not INTERPRETING:
        pytest.skip("needs TRITON_INTERPRET=1 before Triton's import: test_interpreter_tests_pass_in_a_subprocess")
    assert w8_triton.available()


# --- Triton's interpreter, CPU tensors ----------------------------------------------------------------------------

@pytest.mark.slow  # `make test-slow` (docs/testing.md)
@pytest.mark.heavy  # 40 s: every interpreter test in a process of its own
def test_interpreter_tests_pass_in_a_subprocess():
    pytest.importorskip("triton")
    if INTERPRETING:
        pytest.skip("this process interprets: the interpreter tests run here")
    rerun_in_triton_interpreter(__file__)


@pytest.mark.parametrize("codes", ["int8", "fp8"])
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_kernel_matches_reference_in_interpreter(interpreter, m, k, n, codes):
    x, q, scale, b = _operands(m, k, n, bias=(m + k + n) % 2 == 0, codes=codes)
    _check(w8_triton.w8_linear(x, q, scale, b), w8_triton.reference(x, q, scale, b))


@pytest.mark.parametrize("codes", ["int8", "fp8"])
def test_split_k_path_matches_reference_in_interpreter(interpreter, codes):
    # A narrow layer: 2 N tiles x 1 M tile fill no device, so K is split into slices of whole BLOCK_K steps.
    _, _, split, per_split = w8_triton._config(1, 64, 1536, torch.device("cpu"))
    assert split > 1 and per_split % w8_triton.BLOCK_K == 0 and (split - 1) * per_split < 1536 <= split * per_split
    for bias in (False, True):
        x, q, scale, b = _operands(3, 1536, 64, bias=bias, seed=1, codes=codes)
        _check(w8_triton.w8_linear(x, q, scale, b), w8_triton.reference(x, q, scale, b))


def test_strided_operands_and_batch_dims_in_interpreter(interpreter):
    # x [2, 3, K] cut from a wider tensor, a transposed (column-major) weight, scale given as [N]: strides are honoured.
    x, q, scale, b = _operands(6, 200, 300, bias=True, seed=2)
    wide = torch.zeros(6, 264, dtype=torch.bfloat16)
    wide[:, :200] = x
    x3 = wide[:, :200].reshape(2, 3, 200)
    q_t = q.t().contiguous().t()
    assert q_t.stride() == (1, 300)
    y = w8_triton.w8_linear(x3, q_t, scale.reshape(-1), b)
    assert y.shape == (2, 3, 300)
    _check(y, w8_triton.reference(x3, q, scale, b))


def test_reads_the_weight_it_is_given_in_interpreter(interpreter):
    # New codes copied into the same int8 storage (a weight sync) change the product.
    x, q, scale, _ = _operands(2, 256, 64, bias=False, seed=3)
    before = w8_triton.w8_linear(x, q, scale)
    q.copy_(-q)
    after = w8_triton.w8_linear(x, q, scale)
    _check(after, w8_triton.reference(x, q, scale))
    torch.testing.assert_close(after.float(), -before.float(), rtol=RTOL, atol=1e-3 * before.abs().max().item())


def test_fp8_weight_only_product_is_within_fp8_bounds_in_interpreter(interpreter):
    """An Fp8Linear's codes through the kernel against float32 F.linear of the bf16 weights it was made from: only the
    weight is rounded (3 mantissa bits), so the relative (Frobenius) error is under the W8A8 bound of
    tests/test_quant.py (0.075, where weights and activations are both rounded: 0.036-0.037 there) and under its own
    (0.05; 0.025-0.027 over seeds 0-4 at K = 256)."""
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(128, 256, generator=g).to(torch.bfloat16)
        b = torch.randn(128, generator=g).to(torch.bfloat16)
        x = torch.randn(4, 16, 256, generator=g).to(torch.bfloat16)
        layer = fp8.Fp8Linear(w, b)
        y = w8_triton.w8_linear(x, layer.weight, layer.scale, layer.bias)
        ref = nn.functional.linear(x.float(), w.float(), b.float())
        err = ((y.float() - ref).norm() / ref.norm()).item()
        assert y.shape == (4, 16, 128) and torch.isfinite(y).all() and err < 0.05, (seed, err)


def test_fp8_fused_decode_through_the_kernel_in_interpreter(interpreter, tiny_model_path, monkeypatch):
    # The fused decode step and the model's forward at fp8 with the products on the weight-only route that CUDA takes
    # for a decode step's rows (here on CPU tensors): sampled log-probs are the served model's, and a sync reaches
    # the joint buffers the kernel reads (tests/test_torch_graphs.py runs the same on the W8A8 route).
    from tests.test_torch_graphs import check_fp8_fused_decode_and_sync

    kernel, calls = w8_triton.w8_linear, []

    def counted(x, qdata, *rest):
        calls.append(qdata.dtype)
        return kernel(x, qdata, *rest)

    monkeypatch.setattr(w8_triton, "w8_linear", counted)
    monkeypatch.setattr(torch_fused, "KERNELS", False)  # the step's own kernels: tests/test_triton_step.py
    monkeypatch.setattr(fp8, "FP8_DECODE", "weight_only")
    monkeypatch.setattr(fp8, "weight_only_takes",  # the CUDA route's test without its device check
                        lambda x: fp8.FP8_DECODE == "weight_only" and x.dtype == torch.bfloat16
                        and x.numel() // x.shape[-1] <= fp8.FP8_WEIGHT_ONLY_ROWS)
    check_fp8_fused_decode_and_sync(tiny_model_path, compute_dtype="bf16")  # bf16, as on CUDA, on any CPU
    assert calls and set(calls) == {torch.float8_e4m3fn}


def test_refuses_other_dtypes_and_mismatched_shapes():
    x, q, scale, _ = _operands(2, 256, 64, bias=False)
    with pytest.raises(ValueError, match="needs bf16 x and a 2-D int8 or float8_e4m3fn weight"):
        w8_triton.w8_linear(x.float(), q, scale)
    with pytest.raises(ValueError, match="needs bf16 x and a 2-D int8 or float8_e4m3fn weight"):
        w8_triton.w8_linear(x, q.to(torch.float16), scale)
    with pytest.raises(ValueError, match="shapes don't match"):
        w8_triton.w8_linear(x[:, :128], q, scale)
    with pytest.raises(ValueError, match="shapes don't match"):
        w8_triton.w8_linear(x, q, scale[:10])


def test_reference_is_the_dequantized_product():
    x, q, scale, b = _operands(3, 200, 64, bias=True)
    expect = x.float() @ (q.float() * scale).t() + b.float()
    torch.testing.assert_close(w8_triton.reference(x, q, scale, b), expect, rtol=1e-5, atol=1e-4)


# --- routing in rollout/quantization/quant.py (no Triton, no GPU: a meta tensor stands in for a CUDA one)
# -----------------------

def _int8_layer(bias: bool = True) -> nn.Linear:
    lin = nn.Sequential(nn.Linear(256, 64, bias=bias)).to(torch.bfloat16)
    quant.quantize_model(lin, "int8")
    return lin[0]


def test_off_cpu_forward_routes_decode_rows_to_the_kernel_on_live_storage(monkeypatch):
    lin = _int8_layer()
    w = lin.weight
    calls = []

    def fake_kernel(x, qdata, scale, bias=None):
        calls.append(("kernel", x.shape, qdata, scale, bias))
        return torch.empty(*x.shape[:-1], qdata.shape[0], device=x.device, dtype=torch.bfloat16)

    def fake_linear(x, weight, bias=None):
        calls.append(("torchao", x.shape, weight))
        return torch.empty(*x.shape[:-1], weight.shape[0], device=x.device, dtype=x.dtype)

    monkeypatch.setattr(w8_triton, "w8_linear", fake_kernel)
    monkeypatch.setattr(torch.nn.functional, "linear", fake_linear)
    monkeypatch.setattr(w8_triton, "available", lambda: True)
    lin(torch.empty(2, 32, 256, device="meta", dtype=torch.bfloat16))  # 64 rows: a decode step's most
    kind, shape, qdata, scale, bias = calls.pop()
    assert (kind, shape) == ("kernel", (2, 32, 256))
    assert qdata is w.qdata and scale.data_ptr() == w.scale.data_ptr() and bias is lin.bias  # the layer's own storage
    lin(torch.empty(65, 256, device="meta", dtype=torch.bfloat16))  # more rows: torchao's linear
    lin(torch.empty(4, 256, device="meta", dtype=torch.float32))  # not bf16: torchao's linear
    assert [c[0] for c in calls] == ["torchao", "torchao"] and calls[0][2] is w
    calls.clear()
    monkeypatch.setattr(w8_triton, "available", lambda: False)  # no Triton: torchao's linear
    lin(torch.empty(4, 256, device="meta", dtype=torch.bfloat16))
    assert [c[0] for c in calls] == ["torchao"]


def test_fp8_decode_rows_route_to_the_kernel_on_live_storage(monkeypatch):
    # An Fp8Linear off the CPU with FP8_DECODE = "weight_only": a decode step's bf16 rows go to the weight-only kernel
    # with the layer's own codes, scales and bias; more rows, float32 activations, no Triton or
    # FP8_DECODE = "scaled_mm" go to torch._scaled_mm.
    assert fp8.FP8_DECODE == "weight_only"  # the default since measured faster on an H200 (rollout/quantization/fp8.py)
    layer = fp8.Fp8Linear(torch.randn(64, 256)).to("meta")
    calls = []

    def fake_kernel(x, qdata, scale, bias=None):
        calls.append(("kernel", x.shape, qdata, scale, bias))
        return torch.empty(*x.shape[:-1], qdata.shape[0], device=x.device, dtype=torch.bfloat16)

    def fake_scaled_mm(xq, w_t, scale_a, scale_b, out_dtype):
        calls.append(("scaled_mm", xq.shape, w_t._base, scale_b))  # w_t: a view of the codes
        return torch.empty(xq.shape[0], w_t.shape[1], device=xq.device, dtype=out_dtype)

    monkeypatch.setattr(w8_triton, "w8_linear", fake_kernel)
    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    monkeypatch.setattr(w8_triton, "available", lambda: True)
    monkeypatch.setattr(fp8, "FP8_DECODE", "weight_only")
    y = layer(torch.empty(2, 32, 256, device="meta", dtype=torch.bfloat16))  # 64 rows: a decode step's most
    assert y.shape == (2, 32, 64)
    kind, shape, qdata, scale, bias = calls.pop()
    assert (kind, shape) == ("kernel", (2, 32, 256)) and qdata is layer.weight and scale is layer.scale and bias is None
    layer(torch.empty(65, 256, device="meta", dtype=torch.bfloat16))  # more rows (a prefill): W8A8
    layer(torch.empty(4, 256, device="meta", dtype=torch.float32))  # float32 activations: W8A8
    monkeypatch.setattr(fp8, "FP8_DECODE", "scaled_mm")
    layer(torch.empty(4, 256, device="meta", dtype=torch.bfloat16))
    monkeypatch.setattr(fp8, "FP8_DECODE", "weight_only")
    monkeypatch.setattr(w8_triton, "available", lambda: False)
    layer(torch.empty(4, 256, device="meta", dtype=torch.bfloat16))
    assert [c[0] for c in calls] == ["scaled_mm"] * 4 and all(c[2] is layer.weight for c in calls)
    assert [c[1][0] for c in calls] == [65, 4, 4, 4]
    assert not fp8.weight_only_takes(torch.empty(4, 256, dtype=torch.bfloat16))  # CPU: never


# --- CUDA -----------------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def on_gpu():
    pytest.importorskip("triton")
    if INTERPRETING:
        pytest.skip("Triton's interpreter is on in this process")
    assert w8_triton.available()


def _codes_on_this_gpu(codes: str) -> None:
    if codes == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 codes need compute capability >= 8.9 (Ada or Hopper)")


@pytest.mark.parametrize("codes", ["int8", "fp8"])
@pytest.mark.parametrize("m, k, n", SHAPES + [(1, 1536, 8960), (64, 1536, 8960), (1, 8960, 1536), (5, 1536, 256),
                                              (1, 1536, 151936)])
@pytest.mark.cuda
@needs_cuda
@pytest.mark.usefixtures("on_gpu")
def test_kernel_matches_reference_on_cuda(m, k, n, codes):
    _codes_on_this_gpu(codes)
    x, q, scale, b = _operands(m, k, n, bias=(m + k + n) % 2 == 0, device="cuda", codes=codes)
    _check(w8_triton.w8_linear(x, q, scale, b), w8_triton.reference(x, q, scale, b))


@pytest.mark.parametrize("codes", ["int8", "fp8"])
@pytest.mark.cuda
@needs_cuda
@pytest.mark.usefixtures("on_gpu")
def test_kernel_replays_in_a_cuda_graph(codes):
    _codes_on_this_gpu(codes)
    x, q, scale, b = _operands(8, 1536, 1536, bias=True, device="cuda", codes=codes)
    assert w8_triton._config(8, 1536, 1536, x.device)[2] > 1  # the K split: kernel, workspace and torch epilogue
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        w8_triton.w8_linear(static_x, q, scale, b)  # compile before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = w8_triton.w8_linear(static_x, q, scale, b)
    new_x, new_q, _, _ = _operands(8, 1536, 1536, bias=False, device="cuda", seed=5, codes=codes)
    static_x.copy_(new_x)
    q.copy_(new_q)  # new codes in the captured storage, as a weight sync writes them
    graph.replay()
    torch.cuda.synchronize()
    _check(static_y, w8_triton.reference(new_x, new_q, scale, b))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.usefixtures("on_gpu")
def test_torchao_int8_linear_on_cuda_runs_the_kernel():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1536, 8960, bias=True)).to(device="cuda", dtype=torch.bfloat16)
    quant.quantize_model(model, "int8")
    lin = model[0]
    w = lin.weight
    assert quant.quant_config_summary(model)["quantized_linears"] == 1 and w.qdata.is_cuda
    x = torch.randn(4, 1536, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y = model(x)
        torch.testing.assert_close(y, w8_triton.w8_linear(x, w.qdata, w.scale, lin.bias), rtol=0, atol=0)
        torchao_y = nn.functional.linear(x, w, lin.bias)  # torchao's own weight-only int8 linear
        # torchao rounds to bf16 three times (the product, the scale, the sum with the bias): a looser bound
        torch.testing.assert_close(y.float(), torchao_y.float(), rtol=2e-2, atol=1e-2 * torchao_y.abs().max().item())
        big = torch.randn(65, 1536, device="cuda", dtype=torch.bfloat16)  # past INT8PACK_ROWS: torchao's linear
        torch.testing.assert_close(model(big), nn.functional.linear(big, w, lin.bias), rtol=0, atol=0)
        w.qdata.copy_(-w.qdata)  # a weight sync writes new codes into the same storage: the forward reads them
        _check(model(x), w8_triton.reference(x, w.qdata, w.scale, lin.bias))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.usefixtures("on_gpu")
def test_fp8_linear_on_cuda_runs_the_kernel_for_decode_rows(monkeypatch):
    _codes_on_this_gpu("fp8")
    monkeypatch.setattr(fp8, "FP8_DECODE", "weight_only")
    torch.manual_seed(0)
    w = torch.randn(8960, 1536, device="cuda", dtype=torch.bfloat16) * 0.02
    b = torch.randn(8960, device="cuda", dtype=torch.bfloat16)
    layer = fp8.Fp8Linear(w, b)
    x = torch.randn(4, 1536, device="cuda", dtype=torch.bfloat16)
    ref = nn.functional.linear(x.float(), w.float(), b.float())
    with torch.no_grad():
        y = layer(x)
        torch.testing.assert_close(y, w8_triton.w8_linear(x, layer.weight, layer.scale, b), rtol=0, atol=0)
        # W8A8 (torch._scaled_mm) on the same codes: both within fp8's bound of the float32 product (test_quant.py)
        w8a8 = fp8.fp8_linear(torch.cat([x, x.new_zeros(61, 1536)]), layer.weight, layer.scale, b)[:4]  # 65 rows
        for out in (y, w8a8):
            assert torch.isfinite(out).all() and ((out.float() - ref).norm() / ref.norm()).item() < 0.075
        # a weight sync writes new codes into the same storage: the forward reads them
        layer.weight.copy_(fp8.fp8_per_row(-w)[0])
        _check(layer(x), w8_triton.reference(x, layer.weight, layer.scale, b))


@pytest.mark.parametrize("fused", [False, True], ids=["static_step", "fused_step"])
@pytest.mark.cuda
@needs_cuda
@pytest.mark.usefixtures("on_gpu")
def test_fp8_weight_only_decode_in_cuda_graphs_samples_the_served_model(tiny_model_path, fused, monkeypatch):
    """The torch generator at fp8 with FP8_DECODE = "weight_only", decode replayed as CUDA graphs: each sampled token's
    log-prob is the served model's own full forward's (whose rows take the same route here: fewer than 64)."""
    from qgrpo.core.records import PromptItem, SamplingParams
    from qgrpo.rollout.backends.torch_backend import TorchGenerator
    from tests.test_cuda import _logprob_gap

    _codes_on_this_gpu("fp8")
    monkeypatch.setattr(fp8, "FP8_DECODE", "weight_only")
    kernel, calls = w8_triton.w8_linear, []
    monkeypatch.setattr(w8_triton, "w8_linear", lambda x, q, *rest: calls.append(q.dtype) or kernel(x, q, *rest))
    gen = TorchGenerator(tiny_model_path, "fp8", device="cuda:0", chat_template=False,
                         options={"cuda_graphs": True, "fused_step": fused})
    groups = gen.generate([PromptItem(f"p{i}", f"{i}+{i + 1}=", "0") for i in (0, 5, 12)],
                          SamplingParams(group_size=8, max_new_tokens=12, temperature=1.0, seed=7))
    info = gen.decode_info()
    assert info["loop"] == "graphs" and info["fallback"] is None, info
    assert calls and set(calls) == {torch.float8_e4m3fn}
    assert _logprob_gap(gen, groups) < 0.05
