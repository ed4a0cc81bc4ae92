"""qgrpo's CPU int8 and int4 kernels (rollout/quantization/cpu_native.py, rollout/quantization/csrc/w8a16_cpu.cpp,
rollout/quantization/csrc/w4a16_cpu.cpp): their products against a float64 reference on both instruction-set paths, and
what happens where they cannot run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qgrpo.rollout.quantization import cpu_kernels, cpu_native

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not cpu_native.available(), reason=f"kernel not available: {cpu_native.why_not()}")

# The kernel rounds activations to int16 per block of 256 inputs (at most 1/65534 of the block's largest |x|), then
# sums exactly: measured 0.7e-4 to 2.7e-4 of the largest |output| at these shapes. torch's kernel, whose inputs are
# bf16, is at 3e-3 to 7e-3. The bound: 1e-3, and at most a fifth of torch's kernel's error on the same product.
TOL = 1e-3
SHAPES = [(8960, 1536), (1536, 8960), (1000, 896), (13, 96), (4099, 576)]  # a partial block, N % 4 != 0
ROWS = [1, 2, 3, 4, 5, 8, 13, 16, 17, 64]  # each remainder of the 4-row tile


def _case(n: int, k: int, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, generator=g) / 127 + 1e-4
    x = torch.randn(rows, k, generator=g)
    x[:, 5] *= 100  # an outlier channel, as LLM activations have
    ref = x.double() @ (q.double() * scale.double()[:, None]).T
    return x, q, scale, ref


def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def _check_products() -> dict:
    """Every shape and rows count: the kernel's error, and torch's kernel's on the same product."""
    errors = {}
    for n, k in SHAPES:
        for rows in ROWS:
            x, q, scale, ref = _case(n, k, rows)
            out = cpu_native.w8a16_mm(x, q, scale)
            assert out.shape == (rows, n) and out.dtype == torch.float32
            theirs = torch._weight_int8pack_mm(x.bfloat16(), q, scale.bfloat16())
            errors[f"{n}x{k}x{rows}"] = (_error(out, ref), _error(theirs, ref))
    return errors


def test_products_match_float64_within_tolerance():
    _within_bounds(_check_products())


def _capped(code: str) -> list:
    """What `code` prints last (JSON) when run in a process whose torch is capped at AVX2 (ATEN_CPU_CAPABILITY=avx2),
    as on an AVX2-only CPU."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _within_bounds(errors: dict) -> None:
    for key, (ours, theirs) in errors.items():
        assert ours <= TOL, (key, ours)
        assert ours <= theirs / 5, (key, ours, theirs)


def test_avx2_path_in_a_capped_process():
    """ATEN_CPU_CAPABILITY=avx2 sends the kernel down its AVX2 path (vpmaddwd), as on an AVX2-only CPU; the same
    bounds hold there."""
    words, code_, errors = _capped("import json; from tests.test_cpu_native import _check_products; from qgrpo.rollout"
                                   ".quantization import cpu_native; print(json.dumps([cpu_native.describe(), "
                                   "cpu_native.isa_code()[0], _check_products()]))")
    assert code_ == cpu_native.ISA_AVX2 and "AVX2" in words
    _within_bounds(errors)


# int4: the weight as torch packs it, decoded by cpu_kernels.int4_dequantize (checked against torch's own kernel by
# int4_layout) is the reference's weight; the activations are rounded as for int8, per group instead of per 256 inputs.
# Measured 0.3e-4 to 3.8e-4 of the largest |output|; torch's kernel (bf16 inputs) 2.6e-3 to 5.4e-3.
INT4_SHAPES = [(8960, 1536, 64), (1536, 8960, 64), (256, 1536, 32), (128, 512, 128), (64, 1024, 256)]


def _check_int4_products() -> dict:
    """Every int4 shape and rows count: the kernel's error against float64, and torch's kernel's on the same product
    (both through cpu_kernels.int4_kernel: it must take ours)."""
    layout = cpu_kernels.int4_layout()
    errors = {}
    for n, k, group in INT4_SHAPES:
        packed, sz = cpu_kernels._probe_int4(n, k, group)
        w = cpu_kernels.int4_dequantize(packed, sz, n, k, group, torch.float32).double()  # [k, n]
        assert cpu_native.takes_int4(n, k, group, layout), (n, k, group, layout)
        for rows in ROWS + [70]:  # past the 64 rows of one pass too
            g = torch.Generator().manual_seed(rows)
            x = torch.randn(rows, k, generator=g)
            x[:, 5] *= 100
            ref = x.double() @ w
            out = cpu_kernels.int4_kernel(x, packed, sz, group)
            assert out.shape == (rows, n) and out.dtype == torch.float32
            torch.testing.assert_close(out, cpu_native.w4a16_mm(x, packed, sz, n, group, layout[1]), rtol=0, atol=0)
            theirs = torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, group, sz)
            errors[f"int4 {n}x{k} g{group} x{rows}"] = (_error(out, ref), _error(theirs, ref))
    return errors


def test_int4_products_match_float64_within_tolerance():
    _within_bounds(_check_int4_products())


def test_int4_avx2_path_in_a_capped_process():
    """Capped at AVX2, torch packs int4 in blocks of 32 output rows and the kernel takes its AVX2 path: the same
    bounds hold there."""
    words, layout, errors = _capped("import json; from tests.test_cpu_native import _check_int4_products; from "
                                    "qgrpo.rollout.quantization import cpu_kernels; print(json.dumps(["
                                    "cpu_kernels.describe('int4'), cpu_kernels.int4_layout(), "
                                    "_check_int4_products()]))")
    assert words.startswith("qgrpo w4a16 (AVX2") and layout == ["lanes", 32], (words, layout)
    _within_bounds(errors)


def _lanes(q: torch.Tensor, block: int) -> torch.Tensor:
    """int4 codes q [n, k] (0..15) packed as torch's AVX2 / AVX-512 kernels pack them: each block of `block` output
    rows as [k, block / 2] bytes, byte j's low nibble row j, its high nibble row j + block / 2."""
    n, k = q.shape
    b = q.view(n // block, 2, block // 2, k).to(torch.uint8)  # [blocks, halves, rows of a half, k]
    return (b[:, 0] | (b[:, 1] << 4)).transpose(1, 2).contiguous().view(-1)


def _check_int4_rows_alone() -> dict:
    """For both block widths: the largest difference between a row's outputs computed alone, in a pair and in a call
    of 5 rows (1 and 2 rows take the kernel's direct path, 5 its panel), and each call's error against float64."""
    found = {}
    for block in (32, 64):
        n, k, group = 2 * block, 512, 64
        g = torch.Generator().manual_seed(block)
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        sz = torch.stack([torch.rand(k // group, n, generator=g) / 8 + 1e-3,
                          torch.randn(k // group, n, generator=g) / 8], -1).bfloat16()
        s, z = sz.float().unbind(-1)
        w = (q.double() - 8) * s.double().repeat_interleave(group, 0).T + z.double().repeat_interleave(group, 0).T
        x = torch.randn(5, k, generator=g)
        x[:, 5] *= 100
        packed = _lanes(q, block)
        outs = [cpu_native.w4a16_mm(x[:rows], packed, sz, n, group, block) for rows in (1, 2, 5)]
        found[block] = {"diff": max((o - outs[-1][: len(o)]).abs().max().item() for o in outs[:2]),
                        "error": max(_error(o, x[: len(o)].double() @ w.T) for o in outs)}
    return found


def _rows_alone_hold(found: dict) -> None:
    for block, r in found.items():
        assert r["diff"] == 0.0, (block, r)  # a sequence's numbers do not depend on the rows beside it
        assert r["error"] <= TOL, (block, r)


def test_int4_rows_alone_equal_rows_in_a_batch():
    """The direct path of few rows (decoded into registers) and the panel of more rows give bit-equal outputs, both
    within the tolerance of float64, in blocks of 32 and 64 output rows, on this CPU's path and capped at AVX2."""
    _rows_alone_hold(_check_int4_rows_alone())
    _rows_alone_hold({int(b): r for b, r in _capped("import json; from tests.test_cpu_native import "
                                                    "_check_int4_rows_alone; print(json.dumps("
                                                    "_check_int4_rows_alone()))").items()})


def test_int4_kernel_routes_through_ours_and_back_to_torch():
    """cpu_kernels.int4_kernel takes qgrpo's kernel where it can; under cpu_native.torch_kernel(), or for a weight
    whose rows end in a partial block of torch's packing, torch's; zero and extreme rows stay finite."""
    n, k, group = 128, 256, 64
    packed, sz = cpu_kernels._probe_int4(n, k, group)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    x[1] = 1e30 * torch.sign(x[1])  # far past bf16's usual range, its outputs still float32's
    x[2] = 0.0
    ours = cpu_kernels.int4_kernel(x.bfloat16(), packed, sz, group)
    ref = x.bfloat16().double() @ cpu_kernels.int4_dequantize(packed, sz, n, k, group, torch.float32).double()
    full = cpu_native.w4a16_mm(x.bfloat16().float(), packed, sz, n, group, cpu_kernels.int4_layout()[1])
    assert ours.dtype == torch.bfloat16 and "qgrpo w4a16" in cpu_kernels.describe("int4")
    torch.testing.assert_close(ours, full.bfloat16())
    assert _error(full[:2], ref[:2]) <= TOL and (full[2] == 0).all()
    with cpu_native.torch_kernel():
        assert "_weight_int4pack_mm_for_cpu" in cpu_kernels.describe("int4")
        theirs = cpu_kernels.int4_kernel(x[:1].bfloat16(), packed, sz, group)
        torch.testing.assert_close(theirs, torch.ops.aten._weight_int4pack_mm_for_cpu(x[:1].bfloat16(), packed,
                                                                                       group, sz))
    n_tail = cpu_kernels.int4_layout()[1] + 16  # a whole block and a tail of 16 rows
    packed, sz = cpu_kernels._probe_int4(n_tail, k, group)
    assert not cpu_native.takes_int4(n_tail, k, group, cpu_kernels.int4_layout())
    torch.testing.assert_close(cpu_kernels.int4_kernel(x[:1], packed, sz, group),
                               torch.ops.aten._weight_int4pack_mm_for_cpu(x[:1].bfloat16(), packed, group,
                                                                          sz).float())
    with pytest.raises(ValueError, match="scale/zero pairs"):
        cpu_native.w4a16_mm(x, packed, sz.float(), n_tail, group, 64)


def test_zero_and_extreme_rows_stay_finite():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-128, 128, (64, 256), dtype=torch.int8, generator=g)
    scale = torch.rand(64, generator=g) / 127
    x = torch.zeros(3, 256)
    x[1] = 3e38 * torch.sign(torch.randn(256, generator=g))  # the largest float32 magnitudes: codes saturate, no NaN
    x[2, 17] = -1e-30  # one tiny value alone in its block
    out = cpu_native.w8a16_mm(x, q, scale)
    assert torch.isfinite(out[0]).all() and (out[0] == 0).all()
    ref = x[2].double() @ (q.double() * scale.double()[:, None]).T
    assert torch.allclose(out[2].double(), ref, rtol=1e-4, atol=0)


def test_int8_prefetch_changes_no_product(monkeypatch):
    """Asking for weight rows ahead (cpu_native.INT8_PREFETCH) only moves memory: every distance, none included, gives
    the same bits, at every tile remainder and with a distance past the next tile's row."""
    for n, k in [(8960, 1536), (1000, 896), (13, 96)]:
        for rows in (1, 2, 5, 8):
            x, q, scale, _ = _case(n, k, rows)
            monkeypatch.setattr(cpu_native, "INT8_PREFETCH", 0)
            want = cpu_native.w8a16_mm(x, q, scale)
            for ahead in (64, 1024, k - 32, 3 * k):
                monkeypatch.setattr(cpu_native, "INT8_PREFETCH", ahead)
                assert torch.equal(cpu_native.w8a16_mm(x, q, scale), want), (n, k, rows, ahead)
    monkeypatch.setattr(cpu_native, "INT8_PREFETCH", -1)
    with pytest.raises(RuntimeError, match="returned -3"):
        cpu_native.w8a16_mm(x, q, scale)


def test_int8_kernel_routes_through_ours_and_back_to_torch():
    x, q, scale, _ = _case(256, 512, 4)
    ours = cpu_kernels.int8_kernel(x.bfloat16(), q, scale)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours, cpu_native.w8a16_mm(x.bfloat16().float(), q, scale).bfloat16())
    with cpu_native.torch_kernel():
        assert not cpu_native.available() and "torch" in cpu_native.describe()
        theirs = cpu_kernels.int8_kernel(x.bfloat16(), q, scale)
        torch.testing.assert_close(theirs, torch._weight_int8pack_mm(x.bfloat16(), q, scale.bfloat16()))
    assert cpu_native.available()
    # K a multiple of 16, not of 32: torch's kernel takes the product
    x2, q2, s2, _ = _case(16, 48, 2)
    assert not cpu_native.takes(48)
    torch.testing.assert_close(cpu_kernels.int8_kernel(x2, q2, s2),
                               torch._weight_int8pack_mm(x2.bfloat16(), q2, s2.bfloat16()).float())


def test_an_odd_width_never_reaches_torch_int8_kernel():
    """torch 2.13's `_weight_int8pack_mm` crashes the process (SIGSEGV) when K is not a multiple of 16; such a layer
    takes the cast-and-product route at every row count."""
    from qgrpo.rollout.quantization.quant import int8_product

    assert cpu_kernels.cpu_int8_rows(16, 40, torch.float32) == 0
    x, q, scale, ref = _case(16, 40, 2)
    assert _error(int8_product(x, q, scale), ref) <= 1e-5


def _fresh(env: dict, code: str, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "QGRPO_CACHE": str(cache), **env})


def test_without_a_compiler_torch_kernel_is_used_and_the_reason_given(tmp_path):
    code = ("from qgrpo.rollout.quantization import cpu_native, cpu_kernels; import torch;"
            "print(cpu_native.available(), '|', cpu_native.describe());"
            "x = torch.randn(2, 64); q = torch.randint(-128, 128, (8, 64), dtype=torch.int8);"
            "print(cpu_kernels.int8_kernel(x, q, torch.rand(8)).shape);"
            "p, sz = cpu_kernels._probe_int4(64, 128, 64); print(cpu_kernels.describe('int4'), '|',"
            "tuple(cpu_kernels.int4_kernel(torch.randn(2, 128), p, sz, 64).shape))")
    done = _fresh({"CXX": "", "PATH": str(tmp_path)}, code, tmp_path)  # no compiler on PATH, an empty cache
    assert done.returncode == 0, done.stderr[-2000:]
    first, shape, int4 = done.stdout.strip().splitlines()[-3:]
    assert first.startswith("False |") and "no C++ compiler" in first
    assert shape == "torch.Size([2, 8])"
    assert int4.startswith("torch's _weight_int4pack_mm_for_cpu (") and "no C++ compiler" in int4, int4
    assert int4.endswith("| (2, 64)")
    off = _fresh({"QGRPO_CPU_KERNEL": "torch"},
                 "from qgrpo.rollout.quantization import cpu_native; print(cpu_native.describe())", tmp_path)
    assert "QGRPO_CPU_KERNEL=torch" in off.stdout


def test_a_broken_build_is_reported_not_raised(tmp_path):
    cxx = tmp_path / "fakecxx"
    cxx.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\n"
                   "echo 'error: no' >&2\nexit 3\n")
    cxx.chmod(0o755)
    code = "from qgrpo.rollout.quantization import cpu_native; print(cpu_native.available(), '|', cpu_native.why_not())"
    done = _fresh({"CXX": str(cxx)}, code, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout.strip().splitlines()[-1]
    assert out.startswith("False |") and "fakecxx exited 3" in out and "error: no" in out
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-built is left to be loaded later


def test_concurrent_processes_build_once(tmp_path):
    code = ("from qgrpo.rollout.quantization import cpu_native; import torch; "
            "assert cpu_native.available(), cpu_native.why_not();"
            "x = torch.randn(3, 64); q = torch.randint(-128, 128, (8, 64), dtype=torch.int8); s = torch.rand(8);"
            "ref = x.double() @ (q.double() * s.double()[:, None]).T;"
            "print(float((cpu_native.w8a16_mm(x, q, s).double() - ref).abs().max() / ref.abs().max()))")
    env = {**os.environ, "QGRPO_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        assert float(out.strip().splitlines()[-1]) <= TOL
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 1
    assert not list((tmp_path / "kernels").glob("*.tmp"))
