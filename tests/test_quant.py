"""rollout.quant: every precision runs, log-probs stay within stated bounds of fp32, storage really shrinks,
re-quantizing a fresh copy of updated bf16 weights follows the update, and importing the module stays light.

fp8 is served on CUDA only, but torch's ``_scaled_mm`` runs on CPU too: its numerics are checked here through
``_quantize_layers`` (quantize_model past its device check), which quantize_model itself refuses on CPU."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qgrpo.rollout.quantization.quant as quant
from qgrpo.rollout.quantization import fp8
from qgrpo.rollout.quantization.quant import SERVED, linear_weight_bytes, quant_config_summary, quantize_model
from tests.helpers import LOGPROB_BOUNDS, next_token_logprobs, tiny_llama  # LOGPROB_BOUNDS: measured there

# The CPU's precisions, and fp8 (CUDA-served; its arithmetic runs on CPU as well, see the module docstring).
PRECISIONS = (*SERVED["cpu"], "fp8")
# fp8 W8A8 (weights and activations in float8_e4m3fn) against fp32, this file's model and batch, measured over
# tiny_llama seeds 0-4 (batch seeds 123-127): mean 0.126-0.136, max 0.46-0.76 nats; between int8's and int4's. Bounds
# ~2x the worst seen, as LOGPROB_BOUNDS are.
FP8_LOGPROB_BOUNDS = (0.30, 1.50)
BOUNDS = {**LOGPROB_BOUNDS, "fp8": FP8_LOGPROB_BOUNDS}


def quantize(model, precision):
    """quantize_model, or for fp8 (refused on CPU) the same quantization past that check."""
    if precision == "fp8":
        return quant._quantize_layers(model, "fp8", 64, torch.device("cpu"))
    return quantize_model(model, precision)

REPO = Path(__file__).resolve().parents[1]

# Storage of the linear weights vs bf16 (16 bits/weight). int8: 8-bit data + fp32 scale and int8 zero per row
# (measured 0.518x here). int4: 4-bit packed + bf16 scale and zero per 64 weights = 4.5 bits (0.281x); nf4: 4-bit
# packed + bf16 absmax per 64 + a 64-byte code table per layer (0.267x); fp8: 8-bit codes + fp32 scale per row
# (0.514x). Bounds leave room, not for a format change.
BYTES_RATIO_MAX = {"int8": 0.55, "int4": 0.30, "nf4": 0.30, "fp8": 0.55}


@pytest.fixture(scope="module")
def base():
    return tiny_llama()


@pytest.fixture(scope="module")
def batch():
    return torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(123))


@pytest.fixture(scope="module")
def ref_logprobs(base, batch):
    return next_token_logprobs(copy.deepcopy(base).float(), batch)


@pytest.fixture(scope="module")
def quantized(base):
    return {p: quantize(copy.deepcopy(base), p) for p in PRECISIONS}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_forward_and_generate(quantized, batch, precision):
    m = quantized[precision]
    with torch.no_grad():
        logits = m(batch).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    torch.manual_seed(0)
    prompt = batch[:4, :8]
    with torch.no_grad():
        out = m.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, max_new_tokens=5,
                         min_new_tokens=5, temperature=1.0, output_logits=True, return_dict_in_generate=True)
    assert out.sequences.shape == (4, 13)
    assert torch.equal(out.sequences[:, :8], prompt)
    assert all(torch.isfinite(step).all() for step in out.logits)  # raw logits: min_new_tokens puts -inf in scores


@pytest.mark.parametrize("precision", PRECISIONS)
def test_logprob_bounds(quantized, batch, ref_logprobs, precision):
    lp = next_token_logprobs(quantized[precision], batch)
    assert torch.isfinite(lp).all()  # NaN fails here, and would fail the comparisons below too
    diff = (lp - ref_logprobs).abs()
    mean_bound, max_bound = BOUNDS[precision]
    assert diff.mean().item() < mean_bound, (precision, diff.mean().item())
    assert diff.max().item() < max_bound, (precision, diff.max().item())


def test_error_ordering(quantized, batch, ref_logprobs):
    err = {p: (next_token_logprobs(quantized[p], batch) - ref_logprobs).abs().mean().item() for p in PRECISIONS}
    assert err["bf16"] < err["int8"] < err["int4"], err
    assert err["int8"] < err["nf4"], err
    assert err["int8"] < err["fp8"] < err["int4"], err  # 8-bit weights, but 3-bit mantissas and fp8 activations


@pytest.mark.parametrize("precision", ["int8", "int4", "nf4", "fp8"])
def test_bytes_and_summary(quantized, precision):
    bf16_bytes = linear_weight_bytes(quantized["bf16"])
    assert bf16_bytes == sum(m.weight.numel() * 2 for m in quantized["bf16"].modules()
                             if isinstance(m, torch.nn.Linear))
    ratio = linear_weight_bytes(quantized[precision]) / bf16_bytes
    assert ratio <= BYTES_RATIO_MAX[precision], ratio
    s = quant_config_summary(quantized[precision])
    assert s["precision"] == precision and s["quantized_linears"] == 15 and s["bf16_linears"] == 0  # 2 x 7 + lm_head
    assert quant_config_summary(quantized["bf16"])["quantized_linears"] == 0


@pytest.mark.parametrize("precision", ["int8", "int4", "nf4", "fp8"])
def test_tied_lm_head_and_indivisible_layers_stay_bf16(precision):
    # intermediate 160 is not a multiple of 64: down_proj (in_features 160) can't be grouped for int4 / nf4 (fp8 needs
    # multiples of 16 only: it fits).
    m = tiny_llama(tie=True, intermediate=160)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    quantize(m, precision)
    assert m.lm_head.weight is m.model.embed_tokens.weight and m.lm_head.weight.dtype == torch.bfloat16
    s = quant_config_summary(m)
    bf16_expected = 1 + (2 if precision in ("int4", "nf4") else 0)
    assert (s["quantized_linears"], s["bf16_linears"]) == (15 - bf16_expected, bf16_expected), s
    assert torch.isfinite(m(torch.randint(0, 64, (2, 16))).logits).all()
    with pytest.raises(ValueError):
        quantize_model(m, precision)  # quantizing twice is a caller bug: quantize a copy of the bf16 model


@pytest.mark.parametrize("precision", ["int8", "int4", "nf4", "fp8"])
@pytest.mark.parametrize("out_features, in_features", [(64, 128), (100, 128), (64, 96)])
def test_bias_and_awkward_shapes(precision, out_features, in_features):
    # Qwen2-style bias; N=100 is not a multiple of 16/32 and K=96 not of 64: those stay bf16 at int4/nf4; at fp8
    # N=100 does (not a multiple of 16), K=96 fits.
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(in_features, out_features)).to(torch.bfloat16)
    x = torch.randn(3, in_features, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = m(x).float()
        quantize(m, precision)
        y = m(x).float()
    assert torch.isfinite(y).all() and (y - ref).abs().max() < 0.2 * ref.abs().max()
    expect_bf16 = (out_features == 100 if precision == "fp8"
                   else precision != "int8" and (out_features, in_features) != (64, 128))
    assert quant_config_summary(m)["bf16_linears"] == int(expect_bf16)


@pytest.mark.parametrize("precision", ["int8", "int4", "nf4", "fp8"])
def test_requantize_follows_new_weights(precision, batch):
    master = tiny_llama(seed=1)  # the generator's bf16 master copy
    old_bf16 = next_token_logprobs(master, batch)
    old_q = next_token_logprobs(quantize(copy.deepcopy(master), precision), batch)
    with torch.no_grad():  # a "weight sync": new values copied into the master in place
        w = master.model.layers[1].mlp.down_proj.weight
        w.add_(0.6 * torch.randn(w.shape, generator=torch.Generator().manual_seed(7)).to(w.dtype))
    new_bf16 = next_token_logprobs(master, batch)
    new_q = next_token_logprobs(quantize(copy.deepcopy(master), precision), batch)
    assert (new_bf16 - old_bf16).abs().mean() > 0.8  # measured 1.04: large next to the 4-bit error (~0.3)
    to_new, to_old = (new_q - new_bf16).abs().mean(), (new_q - old_bf16).abs().mean()
    assert to_new < 0.5 * to_old, (to_new, to_old)  # measured int4 0.39 vs 1.08, nf4 0.39 vs 1.10, int8 0.04 vs 1.05
    assert (new_q - old_q).abs().mean() > 0.8  # the quantized model really changed
    assert type(master.model.layers[1].mlp.down_proj.weight) is torch.nn.Parameter  # master left untouched


def test_import_is_light(tmp_path):
    # from a folder other than the checkout, so the installed `qgrpo` package is what is imported, as users import it
    code = ("import sys, qgrpo.rollout.quantization.quant; "
            "bad = [m for m in ('torchao', 'bitsandbytes') if m in sys.modules]; "
            "assert not bad, bad; assert 'rollout' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, timeout=60)


@pytest.mark.parametrize("rows", [4, 35])  # through torch's int8 kernel (<= INT8PACK_ROWS) and through a bf16 product
def test_int8_layers_read_their_int8_data_directly(base, batch, ref_logprobs, monkeypatch, rows):
    """CPU int8 layers run on the layer's int8 data with plain torch ops (few rows: torch's int8 kernel; more:
    torchao's arithmetic, bit for bit): within bf16 rounding of the dequantized weight's float32 product and of
    torchao's own linear; the model's log-probs inside int8's bounds; a re-quantization moves the layer to the new
    codes."""
    import qgrpo.rollout.quantization.quant as quant
    from qgrpo.rollout.quantization import cpu_kernels
    from qgrpo.rollout.quantization.quant import requantize_in_place

    fast = quantize_model(copy.deepcopy(base), "int8")
    monkeypatch.setattr(quant, "INT8_LINEAR", "torchao")
    slow = quantize_model(copy.deepcopy(base), "int8")
    lin, ref_lin = fast.model.layers[0].mlp.up_proj, slow.model.layers[0].mlp.up_proj
    assert "forward" in vars(lin) and "forward" not in vars(ref_lin)
    monkeypatch.setattr(cpu_kernels, "cpu_int8_rows", lambda n, k, dtype: 16)  # the kernel to 16 rows
    x = torch.randn(rows // 5 or 1, min(rows, 5) if rows < 10 else 7, 128, dtype=torch.bfloat16)
    exact = x.float() @ (lin.weight.qdata.float() * lin.weight.scale.float()).T  # the dequantized weight
    y = lin(x)
    assert y.shape == (*x.shape[:-1], 256) and y.dtype == torch.bfloat16
    if x.shape[0] * x.shape[1] > 16:
        assert torch.equal(y, ref_lin(x))  # torchao's arithmetic
    for out in (y, ref_lin(x)):
        assert ((out.float() - exact).abs().max() / exact.abs().max()) < 0.01  # bf16 rounding of the output
    err = (next_token_logprobs(fast, batch) - ref_logprobs).abs()  # the whole model, against float32: int8's bounds
    assert torch.isfinite(err).all() and err.mean() < LOGPROB_BOUNDS["int8"][0]
    assert err.max() < LOGPROB_BOUNDS["int8"][1]
    monkeypatch.setattr(quant, "INT8_LINEAR", "direct")
    new = torch.randn(256, 128, dtype=torch.bfloat16) * 0.1
    requantize_in_place(fast, {"model.layers.0.mlp.up_proj": new})
    lin = fast.model.layers[0].mlp.up_proj
    want = x.float() @ new.float().T
    assert ((lin(x).float() - want).abs().max() / want.abs().max()) < 0.02


def test_cpu_int8_rows_are_measured_once_per_shape_and_climb_while_the_kernel_wins(monkeypatch, tmp_path):
    import time

    from qgrpo.core.cpu import isa
    from qgrpo.rollout.quantization import cpu_kernels as ck
    from qgrpo.rollout.quantization import cpu_native

    monkeypatch.setenv("QGRPO_CACHE", str(tmp_path))
    monkeypatch.setattr(ck, "_ROWS", {})
    rows = ck.cpu_int8_rows(1024, 1024, torch.bfloat16)  # above SMALL_INT8_WEIGHT: measured
    own = cpu_native.available()
    assert rows in (0, *ck.ROW_STEPS) and ck._ROWS == {("int8", 1024, 1024, None, torch.bfloat16, own): rows}
    (machine, recorded), = json.loads((tmp_path / ck.ROUTES_FILE).read_text()).items()
    assert recorded == {"1024x1024:bfloat16": rows} and f"{torch.get_num_threads()} threads" in machine
    assert f"| {isa().capability} |" in machine  # other kernels (ATEN_CPU_CAPABILITY), other crossovers
    assert machine.endswith(f"| kernels {cpu_native.tag()}")  # qgrpo's kernels (which build) or torch's: other rows
    assert cpu_native.tag() == "torch" if not own else cpu_native.tag().startswith("qgrpo-")
    monkeypatch.setattr(ck, "_measure_int8_rows", lambda *a: pytest.fail("measured again"))
    assert ck.cpu_int8_rows(1024, 1024, torch.bfloat16) == rows  # kept in this process
    monkeypatch.setattr(ck, "_ROWS", {})  # a later process on this machine reads the file
    (tmp_path / ck.ROUTES_FILE).write_text(json.dumps({machine: {"1024x1024:bfloat16": 32}}))
    assert ck.cpu_int8_rows(1024, 1024, torch.bfloat16) == 32
    if own:  # a small weight takes qgrpo's kernel up to its most rows, unmeasured
        assert ck.cpu_int8_rows(256, 128, torch.bfloat16) == ck.INT8_KERNEL_MAX_ROWS
    monkeypatch.undo()
    monkeypatch.setattr(ck, "_ROWS", {})
    monkeypatch.setattr(ck, "int8_kernel", lambda x, q, s: x[:, :1] * 0)  # a kernel that costs nothing
    assert ck._measure_int8_rows(256, 128, torch.bfloat16) == 64  # up to INT8_KERNEL_MAX_ROWS
    monkeypatch.setattr(ck, "INT8_KERNEL_MAX_ROWS", 16)
    assert ck._measure_int8_rows(256, 128, torch.bfloat16) == 16

    def slow_past_two(x, q, s):  # free to two rows, then 5 ms a row
        if x.shape[0] > 2:
            time.sleep(0.005 * (x.shape[0] - 2))
        return x[:, :1] * 0
    monkeypatch.setattr(ck, "int8_kernel", slow_past_two)
    assert ck._measure_int8_rows(256, 128, torch.bfloat16) == 2


def test_an_int8_product_takes_the_measured_route(monkeypatch):
    import qgrpo.rollout.quantization.quant as quant
    from qgrpo.rollout.quantization import cpu_kernels as ck

    q = torch.randint(-127, 128, (1024, 1024), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    scale = torch.rand(1024) / 127
    x = torch.randn(4, 1024, dtype=torch.bfloat16)
    kernel, cast = ck.int8_kernel(x, q, scale), torch.nn.functional.linear(x, q.bfloat16()) * scale.bfloat16()
    assert not torch.equal(kernel, cast)  # the two routes round differently: which one ran is visible
    key = ("int8", 1024, 1024, None, torch.bfloat16, ck.cpu_native.available())  # qgrpo's own int8 kernel or torch's
    monkeypatch.setattr(ck, "_ROWS", {key: 4})
    assert torch.equal(quant.int8_product(x, q, scale), kernel)
    monkeypatch.setattr(ck, "_ROWS", {key: 2})
    assert torch.equal(quant.int8_product(x, q, scale), cast)


# --- int4 on CPU: torch's packing decoded, and the route past the kernel's rows ---------------------------------------

@pytest.mark.parametrize("capability", ["", "avx2", "default"])
def test_int4_packing_is_decoded_exactly_at_each_cpu_capability(capability):
    """torch packs CPU int4 differently per vector width (AVX-512, AVX2, scalar): in a fresh process with that
    capability forced, the layout found decodes a weight with whole blocks and a tail (N = 80, 208) exactly as the
    kernel's own product on the identity does, in bf16 and float32."""
    code = """
import torch
from qgrpo.rollout.quantization import cpu_kernels as ck
layout = ck.int4_layout()
assert layout is not None
for n, k, g in ((80, 128, 64), (208, 256, 32)):
    packed, sz = ck._probe_int4(n, k, g, seed=3)
    want = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(k, dtype=torch.bfloat16), packed, g, sz)
    got = ck.int4_dequantize(packed, sz, n, k, g, torch.bfloat16)
    assert torch.equal(got, want), (layout, n, (got.float() - want.float()).abs().max())
    wide = ck.int4_dequantize(packed, sz, n, k, g, torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(wide.bfloat16(), want)
print(layout)
"""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    want = {"avx2": "('lanes', 32)", "default": "('pairs', 32)"}.get(capability)
    assert want is None or out.stdout.strip().endswith(want)


def test_an_int4_product_past_the_kernel_rows_decodes_the_weight_once(monkeypatch):
    """Rows past the measured ones go through the decoded weight, in chunks, with a tail: within bf16 rounding of the
    kernel's product and of the float32 product on the decoded weight; float32 activations stay float32 there. A
    model's int4 layers take this route, and a re-quantized layer is read live."""
    from qgrpo.rollout.quantization import cpu_kernels as ck
    from qgrpo.rollout.quantization.quant import requantize_in_place

    monkeypatch.setattr(ck, "INT4_CHUNK", 64)  # two whole-block chunks and a tail of 16 at 208 rows
    packed, sz = ck._probe_int4(208, 256, 32, seed=4)
    exact = ck.int4_dequantize(packed, sz, 208, 256, 32, torch.float32)
    x = torch.randn(2, 5, 256, dtype=torch.bfloat16)
    for rows, dtype in ((4, torch.bfloat16), (4, torch.float32), (0, torch.float32)):
        monkeypatch.setattr(ck, "_ROWS", {("int4", 208, 256, 32, dtype): rows})
        y = ck.int4_product(x.to(dtype), packed, sz, 208, 32)
        want = x.float() @ exact
        assert y.shape == (2, 5, 208) and y.dtype == dtype and torch.isfinite(y).all()
        assert ((y.float() - want).abs().max() / want.abs().max()) < 0.01
        kernel = ck.int4_kernel(x.reshape(10, 256), packed, sz, 32).reshape(2, 5, 208).float()
        assert ((y.float() - kernel).abs().max() / kernel.abs().max()) < 0.01
    assert ck.int4_product(x[:1, :4], packed, sz, 208, 32, bias=torch.ones(208)).shape == (1, 4, 208)

    lin = torch.nn.Sequential(torch.nn.Linear(256, 208, bias=False)).bfloat16()
    quantize_model(lin, "int4", 32)
    assert "forward" in vars(lin[0])
    monkeypatch.setattr(ck, "_ROWS", {("int4", 208, 256, 32, torch.bfloat16): 4})
    new = torch.randn(208, 256, dtype=torch.bfloat16) * 0.1
    requantize_in_place(lin, {"0": new})
    want = x.float() @ new.float().T
    assert ((lin(x).float() - want).abs().max() / want.abs().max()) < 0.1  # int4's own error, the new weight's


def test_cpu_int4_rows_climb_while_the_kernel_wins(monkeypatch, tmp_path):
    import time

    from qgrpo.rollout.quantization import cpu_kernels as ck

    monkeypatch.setenv("QGRPO_CACHE", str(tmp_path))
    monkeypatch.setattr(ck, "_ROWS", {})
    rows = ck.cpu_int4_rows(128, 256, 64, torch.bfloat16)
    assert rows in (0, *ck.INT4_ROW_STEPS)
    (machine, recorded), = json.loads((tmp_path / ck.ROUTES_FILE).read_text()).items()
    assert recorded == {"int4:128x256:g64:bfloat16": rows}
    from qgrpo.rollout.quantization import cpu_native

    if cpu_native.takes_int4(128, 256, 64, ck.int4_layout()):  # qgrpo's int4 kernel: never past its most rows
        assert rows <= ck.INT4_KERNEL_MAX_ROWS
        monkeypatch.setattr(ck, "_ROWS", {})
        (tmp_path / ck.ROUTES_FILE).write_text(json.dumps({machine: {"int4:128x256:g64:bfloat16": 1024}}))
        assert ck.cpu_int4_rows(128, 256, 64, torch.bfloat16) == ck.INT4_KERNEL_MAX_ROWS  # even when recorded so

    def slow_past_eight(x, q, sz, g):  # free to 8 rows, then 2 ms a row
        if x.shape[0] > 8:
            time.sleep(0.002 * (x.shape[0] - 8))
        return x[:, :1] * 0
    monkeypatch.setattr(ck, "int4_kernel", slow_past_eight)
    assert ck._measure_int4_rows(128, 256, 64, torch.bfloat16) == 8
    monkeypatch.setattr(ck, "_LAYOUT", [None])  # a torch whose packing we cannot decode: the kernel at every row
    assert ck.cpu_int4_rows(128, 256, 64, torch.float32) == ck.INT4_ROW_STEPS[-1]


# --- fp8 (Fp8Linear, torch._scaled_mm): numerics on CPU -------------------------------------------------------------

def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("seed", range(3))
def test_fp8_linear_against_float32(seed):
    """Fp8Linear [128, 256] against float32 F.linear of the same (bf16) weights on random data, 3-D input with a
    bias: fp8 e4m3 rounds each weight and activation within 2^-4 of its magnitude (3 mantissa bits), which for these
    K = 256 dot products gave a relative (Frobenius) error of 0.036-0.037 over seeds 0-4; the bound is ~2x that."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(128, 256, generator=g).to(torch.bfloat16)
    b = torch.randn(128, generator=g).to(torch.bfloat16)
    x = torch.randn(4, 16, 256, generator=g).to(torch.bfloat16)
    layer = fp8.Fp8Linear(w, b)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.shape == (128, 256)
    assert layer.scale.dtype == torch.float32 and layer.scale.shape == (128,)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    y = layer(x)
    assert y.shape == (4, 16, 128) and y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert _rel_err(y, ref) < 0.075, _rel_err(y, ref)
    y32 = layer(x.float())  # model.compute_dtype = "fp32": float32 in, float32 out, the same fp8 product
    assert y32.dtype == torch.float32 and _rel_err(y32, ref) < 0.075
    assert _rel_err(y, y32) < 0.01  # the two differ by the output's bf16 rounding only


def test_fp8_activation_scale_is_per_token():
    """Rows of very different magnitude in one call each keep fp8's relative accuracy: a scale per token, not one
    for the whole batch (which would flush the small rows to zero)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g)
    x = torch.randn(3, 128, generator=g) * torch.tensor([[1e3], [1.0], [1e-3]])
    y = fp8.Fp8Linear(w)(x)
    ref = x @ w.T
    for row in range(3):
        assert _rel_err(y[row], ref[row]) < 0.075, (row, _rel_err(y[row], ref[row]))


def test_fp8_per_row_codes():
    """Each weight comes back from codes * scale within e4m3's rounding: 2^-4 of its magnitude (normal codes) or half
    the smallest subnormal step, 2^-10 of the row's scale; a row's largest magnitude maps to 448 exactly. A zero row
    stays zero and huge values saturate at +-448, never NaN (e4m3fn has no infinity)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=g) * torch.logspace(-3, 3, 32)[:, None]
    w[5] = 0.0
    w[7, 3] = 3e38
    codes, scale = fp8.fp8_per_row(w)
    back = codes.float() * scale[:, None]
    assert torch.isfinite(back).all() and torch.equal(back[5], torch.zeros(64))
    tol = torch.maximum(w.abs() * 2.0 ** -4, scale[:, None] * 2.0 ** -10) * (1 + 1e-6)
    assert ((back - w).abs() <= tol).all()
    assert torch.equal(codes.float().abs().amax(dim=1)[torch.arange(32) != 5], torch.full((31,), 448.0))


def test_fp8_is_refused_on_cpu_by_quantize_model():
    m = torch.nn.Sequential(torch.nn.Linear(128, 64)).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"rollout.precision: 'fp8' is not served by the torch backend on cpu; "
                                         r"choose one of bf16, int8, int4, nf4"):
        quantize_model(m, "fp8")
    assert not hasattr(m, "_qgrpo_quant") and type(m[0]) is torch.nn.Linear  # refused before any change


def test_fp8_codes_survive_compute_in_float32(base, batch, ref_logprobs):
    """compute_in (model.compute_dtype = "fp32") casts floating parameters; fp8's codes and scales are buffers and
    stay as they are (same dtype, same storage), and the model computes in float32 within fp8's bounds."""
    from qgrpo.rollout.backends.compute import compute_in

    m = quantize(copy.deepcopy(base), "fp8")
    lin = m.model.layers[0].self_attn.q_proj
    ptrs = [t.data_ptr() for t in quant._storage_tensors(lin)]
    compute_in(m, torch.float32)
    assert lin.weight.dtype == torch.float8_e4m3fn and lin.scale.dtype == torch.float32
    assert [t.data_ptr() for t in quant._storage_tensors(lin)] == ptrs
    with torch.no_grad():
        assert m(batch).logits.dtype == torch.float32
    diff = (next_token_logprobs(m, batch) - ref_logprobs).abs()
    assert diff.mean() < FP8_LOGPROB_BOUNDS[0] and diff.max() < FP8_LOGPROB_BOUNDS[1]
