"""rollout/int8_triton.py: the Triton int8 weight-only matmul against a float32 reference, and its routing from a
torchao-int8 nn.Linear (rollout/quant.py: _int8_forward).

Without a GPU the kernel runs on CPU tensors through Triton's interpreter, which needs TRITON_INTERPRET=1 before
Triton's first import: ``test_interpreter_tests_pass_in_a_subprocess`` reruns this file's ``*_in_interpreter`` tests
in a fresh Python with it set (they skip in a process without it). The interpreter's bf16 ``tl.dot`` and int8 -> bf16
cast work on raw bits, so there the kernel's dot runs in fp32 (``DOT_F32``): indexing, masks, the K split and the
epilogue are checked on CPU, the bf16 dot only by the ``cuda`` tests. The routing test needs neither Triton nor a
GPU (a meta tensor stands in for a CUDA one).

Tolerance: the output is bf16, so |y - ref| <= 1e-2 |ref| + 1e-3 max|ref| per element (bf16 keeps 8 significant
bits: 2**-8 relative rounding to nearest; the interpreter's fp32 -> bf16 cast truncates, up to 2**-7).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from qgrpo.rollout import int8_triton, quant

RTOL = 1e-2
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
SHAPES = [(m, k, n) for m in (1, 7, 16, 33) for k in (200, 256, 1536) for n in (64, 300)]


def _operands(m: int, k: int, n: int, bias: bool, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, 1, generator=g) * 0.02 + 1e-3  # torchao's Int8Tensor: fp32 [N, 1]
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
    assert int8_triton.available()


# --- Triton's interpreter, CPU tensors ----------------------------------------------------------------------------

def test_interpreter_tests_pass_in_a_subprocess():
    pytest.importorskip("triton")
    if INTERPRETING:
        pytest.skip("this process interprets: the interpreter tests run here")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "in_interpreter",
                          str(Path(__file__).resolve())], cwd=root, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout.splitlines()[-1], run.stdout[-2000:]

@pytest.mark.parametrize("m, k, n", SHAPES)
def test_kernel_matches_reference_in_interpreter(interpreter, m, k, n):
    x, q, scale, b = _operands(m, k, n, bias=(m + k + n) % 2 == 0)
    _check(int8_triton.int8_linear(x, q, scale, b), int8_triton.reference(x, q, scale, b))


def test_split_k_path_matches_reference_in_interpreter(interpreter):
    # A narrow layer: 2 N tiles x 1 M tile fill no device, so K is split into slices of whole BLOCK_K steps.
    _, _, split, per_split = int8_triton._config(1, 64, 1536, torch.device("cpu"))
    assert split > 1 and per_split % int8_triton.BLOCK_K == 0 and (split - 1) * per_split < 1536 <= split * per_split
    for bias in (False, True):
        x, q, scale, b = _operands(3, 1536, 64, bias=bias, seed=1)
        _check(int8_triton.int8_linear(x, q, scale, b), int8_triton.reference(x, q, scale, b))


def test_strided_operands_and_batch_dims_in_interpreter(interpreter):
    # x [2, 3, K] cut from a wider tensor, a transposed (column-major) weight, scale given as [N]: strides are honoured.
    x, q, scale, b = _operands(6, 200, 300, bias=True, seed=2)
    wide = torch.zeros(6, 264, dtype=torch.bfloat16)
    wide[:, :200] = x
    x3 = wide[:, :200].reshape(2, 3, 200)
    q_t = q.t().contiguous().t()
    assert q_t.stride() == (1, 300)
    y = int8_triton.int8_linear(x3, q_t, scale.reshape(-1), b)
    assert y.shape == (2, 3, 300)
    _check(y, int8_triton.reference(x3, q, scale, b))


def test_reads_the_weight_it_is_given_in_interpreter(interpreter):
    # New codes copied into the same int8 storage (a weight sync) change the product.
    x, q, scale, _ = _operands(2, 256, 64, bias=False, seed=3)
    before = int8_triton.int8_linear(x, q, scale)
    q.copy_(-q)
    after = int8_triton.int8_linear(x, q, scale)
    _check(after, int8_triton.reference(x, q, scale))
    torch.testing.assert_close(after.float(), -before.float(), rtol=RTOL, atol=1e-3 * before.abs().max().item())


def test_refuses_other_dtypes_and_mismatched_shapes():
    x, q, scale, _ = _operands(2, 256, 64, bias=False)
    with pytest.raises(ValueError, match="needs bf16 x and a 2-D int8 weight"):
        int8_triton.int8_linear(x.float(), q, scale)
    with pytest.raises(ValueError, match="shapes don't match"):
        int8_triton.int8_linear(x[:, :128], q, scale)
    with pytest.raises(ValueError, match="shapes don't match"):
        int8_triton.int8_linear(x, q, scale[:10])


def test_reference_is_the_dequantized_product():
    x, q, scale, b = _operands(3, 200, 64, bias=True)
    expect = x.float() @ (q.float() * scale).t() + b.float()
    torch.testing.assert_close(int8_triton.reference(x, q, scale, b), expect, rtol=1e-5, atol=1e-4)


# --- routing in rollout/quant.py (no Triton, no GPU: a meta tensor stands in for a CUDA one) -----------------------

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

    monkeypatch.setattr(int8_triton, "int8_linear", fake_kernel)
    monkeypatch.setattr(torch.nn.functional, "linear", fake_linear)
    monkeypatch.setattr(int8_triton, "available", lambda: True)
    lin(torch.empty(2, 32, 256, device="meta", dtype=torch.bfloat16))  # 64 rows: a decode step's most
    kind, shape, qdata, scale, bias = calls.pop()
    assert (kind, shape) == ("kernel", (2, 32, 256))
    assert qdata is w.qdata and scale.data_ptr() == w.scale.data_ptr() and bias is lin.bias  # the layer's own storage
    lin(torch.empty(65, 256, device="meta", dtype=torch.bfloat16))  # more rows: torchao's linear
    lin(torch.empty(4, 256, device="meta", dtype=torch.float32))  # not bf16: torchao's linear
    assert [c[0] for c in calls] == ["torchao", "torchao"] and calls[0][2] is w
    calls.clear()
    monkeypatch.setattr(int8_triton, "available", lambda: False)  # no Triton: torchao's linear
    lin(torch.empty(4, 256, device="meta", dtype=torch.bfloat16))
    assert [c[0] for c in calls] == ["torchao"]


# --- CUDA -----------------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def on_gpu():
    pytest.importorskip("triton")
    if INTERPRETING:
        pytest.skip("Triton's interpreter is on in this process")
    assert int8_triton.available()


@pytest.mark.parametrize("m, k, n", SHAPES + [(1, 1536, 8960), (64, 1536, 8960), (1, 8960, 1536), (5, 1536, 256),
                                              (1, 1536, 151936)])
@pytest.mark.cuda
@needs_cuda
@pytest.mark.usefixtures("on_gpu")
def test_kernel_matches_reference_on_cuda(m, k, n):
    x, q, scale, b = _operands(m, k, n, bias=(m + k + n) % 2 == 0, device="cuda")
    _check(int8_triton.int8_linear(x, q, scale, b), int8_triton.reference(x, q, scale, b))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.usefixtures("on_gpu")
def test_kernel_replays_in_a_cuda_graph():
    x, q, scale, b = _operands(8, 1536, 1536, bias=True, device="cuda")
    assert int8_triton._config(8, 1536, 1536, x.device)[2] > 1  # the K split: kernel, workspace and torch epilogue
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        int8_triton.int8_linear(static_x, q, scale, b)  # compile before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = int8_triton.int8_linear(static_x, q, scale, b)
    new_x, new_q, _, _ = _operands(8, 1536, 1536, bias=False, device="cuda", seed=5)
    static_x.copy_(new_x)
    q.copy_(new_q)  # new codes in the captured storage, as a weight sync writes them
    graph.replay()
    torch.cuda.synchronize()
    _check(static_y, int8_triton.reference(new_x, new_q, scale, b))


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
        torch.testing.assert_close(y, int8_triton.int8_linear(x, w.qdata, w.scale, lin.bias), rtol=0, atol=0)
        torchao_y = nn.functional.linear(x, w, lin.bias)  # torchao's own weight-only int8 linear
        # torchao rounds to bf16 three times (the product, the scale, the sum with the bias): a looser bound
        torch.testing.assert_close(y.float(), torchao_y.float(), rtol=2e-2, atol=1e-2 * torchao_y.abs().max().item())
        big = torch.randn(65, 1536, device="cuda", dtype=torch.bfloat16)  # past INT8PACK_ROWS: torchao's linear
        torch.testing.assert_close(model(big), nn.functional.linear(big, w, lin.bias), rtol=0, atol=0)
        w.qdata.copy_(-w.qdata)  # a weight sync writes new codes into the same storage: the forward reads them
        _check(model(x), int8_triton.reference(x, w.qdata, w.scale, lin.bias))
