"""bench/gpu_matmuls.py on a CPU: its int4 grouping as tinygemm dequantizes it and the same codes in GemLite's (HQQ's)
convention, the bad-row flag, and dry runs whose rows carry their error against float32 (the CUDA-only routes, the
GemLite ones and an unknown route recorded as errors, the others measured), per model shape and within a budget."""
import json

import pytest
import torch

from bench import gpu_matmuls
from bench.model_shapes import linear_shapes


def test_int4_groups_dequantize_within_half_a_step():
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q, scale, zero = gpu_matmuls.int4_groups(w, 64)
    assert q.shape == (16, 256) and scale.shape == zero.shape == (16, 4)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    back = ((q.float() - 8).reshape(16, 4, 64) * scale[..., None] + zero[..., None]).reshape(16, 256)
    step = scale.repeat_interleave(64, dim=1)
    assert ((back - w.float()).abs() <= step / 2 + 1e-6).all()  # round to nearest: at most half a step off
    assert (back - w.float()).abs().max() > 0  # and int4 does round


def test_int4_hqq_dequantizes_as_tinygemm():
    """zeros = 8 - zero / scale turns tinygemm's (q - 8) * scale + zero into HQQ's (q - zeros) * scales: equal in
    float32; and in GemLite's bf16 form (scales, zeros cast to bf16, fma_mode's q * scales + bf16(-zeros * scales),
    rounded to bf16) within 0.15 of a step of it: bf16's 8 bits on a zero of ~10 steps, a scale times q <= 15, the
    fma's addend and its result, each <= 0.03 step."""
    w = (torch.randn(64, 512, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    q, scale, zero = gpu_matmuls.int4_groups(w, 64)
    qh, scales, zeros = gpu_matmuls.int4_hqq(w, 64)
    assert qh.dtype == torch.uint8 and qh.shape == (64, 512) and scales.shape == zeros.shape == (64, 8)
    assert torch.equal(qh.to(torch.int32), q) and torch.equal(scales, scale)
    per = lambda t: t.repeat_interleave(64, dim=1)  # noqa: E731 - one value per group -> one per weight
    step = per(scale)
    tinygemm = (q.float() - 8) * step + per(zero)
    hqq = (qh.float() - per(zeros)) * per(scales)
    assert ((hqq - tinygemm).abs() / step).max() < 1e-5
    sb, zb = scales.to(torch.bfloat16), zeros.to(torch.bfloat16)
    addend = (-zb.float() * sb.float()).to(torch.bfloat16)
    gemlite = (qh.float() * per(sb).float() + per(addend).float()).to(torch.bfloat16).float()
    assert ((gemlite - tinygemm).abs() / step).max() < 0.15
    assert ((gemlite - w.float()).abs() / step).max() < 0.65  # half a step of rounding, plus the above
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(1))
    ref, y_gemlite, y_tinygemm = x @ w.float().T, x @ gemlite.T, x @ tinygemm.T
    err = lambda y: float((y - ref).abs().max() / ref.abs().max())  # noqa: E731 - the bench's err
    assert err(y_gemlite) == pytest.approx(err(y_tinygemm), abs=0.02) and err(y_tinygemm) < 0.15  # int4's error
    assert float((y_gemlite - y_tinygemm).abs().max() / ref.abs().max()) < 0.03  # bf16's rounding: ~1%


def test_flag_marks_rows_past_the_tolerance_or_not_finite():
    ok = {"route": "int4/gemlite", "err": 0.09, "finite": True, "note": ""}
    far = {"route": "int8/gemlite", "err": 0.5, "finite": True, "note": "eager"}
    nan = {"route": "bf16", "err": float("nan"), "finite": False, "note": ""}
    for row in (ok, far, nan):
        gpu_matmuls.flag(row)
    assert "bad" not in ok and ok["tolerance"] == gpu_matmuls.TOLERANCE["int4"]
    assert far["bad"] and far["note"] == "BAD: err 0.500 > 0.03; eager"
    assert nan["bad"] and nan["note"] == "BAD: non-finite output"


def test_dry_run_on_a_cpu_measures_what_the_cpu_serves(tmp_path):
    out = tmp_path / "m.json"
    gpu_matmuls.main(["--device", "cpu", "--precisions", "bf16,int8,int4/unpadded", "--shapes", "k/v",
                      "--rows", "8", "--calls", "2", "--repeats", "1", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["device_name"] == "cpu" and ", cpu, torch" in res["machine"]  # the CPU's model name first
    assert res["cpu_int8_kernel"] and res["command"].startswith(".venv/bin/python bench/")
    rows = {r["route"]: r for r in res["rows"]}
    assert {r["model"] for r in res["rows"]} == {"1.3b"} and rows["bf16"]["shape"] == "k/v"
    assert (rows["bf16"]["n"], rows["bf16"]["k"]) == gpu_matmuls.SHAPES["k/v"]
    assert rows["bf16"]["err"] < 0.01 and rows["int8"]["err"] < 0.03  # against float32, quantization included
    assert rows["bf16"]["vs_bf16"] == pytest.approx(1.0)
    for r in (rows["bf16"], rows["int8"]):
        assert r["finite"] and r["seconds"] > 0 and r["weight_bytes"] > 0 and not r.get("bad")
    assert rows["int8"]["weight_bytes"] < 0.6 * rows["bf16"]["weight_bytes"]
    assert "error" in rows["int4/unpadded"]  # torch packs for tinygemm on CUDA only


def test_fp32_routes_on_a_cpu_read_four_bytes_a_weight_within_float32_rounding(tmp_path):
    """`fp32` (F.linear) and `fp32/onednn` (oneDNN's linear on a weight reordered once): what the generator computes
    where bf16 is not native, and the candidate that reads the weight in oneDNN's blocked layout."""
    out = tmp_path / "m.json"
    gpu_matmuls.main(["--device", "cpu", "--precisions", "bf16,fp32,fp32/onednn", "--shapes", "k/v", "--rows", "1,8",
                      "--calls", "2", "--repeats", "1", "--out", str(out)])
    rows = {(r["route"], r["rows"]): r for r in json.loads(out.read_text())["rows"]}
    for route in ("fp32", "fp32/onednn"):
        for n in (1, 8):
            r = rows[(route, n)]
            assert r["finite"] and not r.get("bad") and r["err"] < 1e-5, r  # the same product as the reference
            assert r["weight_bytes"] == 2 * rows[("bf16", n)]["weight_bytes"]


def test_a_model_shape_with_gemlite_and_an_unknown_route_records_their_errors(tmp_path):
    out = tmp_path / "m.json"
    gpu_matmuls.main(["--device", "cpu", "--models", "tiny-qwen3", "--rows", "8,32", "--calls", "2",
                      "--repeats", "1", "--precisions", "bf16,int8,int4/gemlite,int8/gemlite,no/such", "--out",
                      str(out)])
    res = json.loads(out.read_text())  # strict JSON: no NaN
    shapes = linear_shapes("tiny-qwen3")
    rows = {(r["product"], r["route"], r["rows"]): r for r in res["rows"]}
    assert len(rows) == len(res["rows"]) == len(shapes) * 5 * 2 and {r["model"] for r in res["rows"]} == {"tiny-qwen3"}
    for product, (n, k) in shapes.items():
        for r in (8, 32):
            for route in ("bf16", "int8"):
                row = rows[product, route, r]
                assert (row["n"], row["k"]) == (n, k) and row["seconds"] > 0 and not row.get("bad")
                assert row["err"] < gpu_matmuls.TOLERANCE[route]
            for route in ("int4/gemlite", "int8/gemlite"):  # no CUDA (nor GemLite) here: an error, not a crash
                assert "gemlite unavailable" in rows[product, route, r]["error"]
            assert "unknown route 'no/such'" in rows[product, "no/such", r]["error"]
    # gate/up has q's 128 x 64 in this shape: measured once, copied
    assert rows["gate/up", "int8", 8]["same_as"] == "q" and "same_as" not in rows["q", "int8", 8]
    assert rows["gate/up", "int8", 8]["seconds"] == rows["q", "int8", 8]["seconds"]
    assert res["gemlite"] == {"error": "gemlite unavailable: RuntimeError: GemLite runs on CUDA only, not cpu"}
    best = {(b["product"], b["rows"], b["family"]): b for b in res["best"]}
    assert len(best) == len(shapes) * 2 * 2  # int4 and int8 families asked, no fp8
    assert best["lm_head", 8, "int8"]["route"] == "int8" and best["lm_head", 8, "int8"]["vs_bf16"] > 0
    assert best["lm_head", 8, "int4"]["route"] is None  # the only int4 route failed
    assert "| tiny-qwen3 | 32 | down | 64 x 128 | - |  | int8 |" in res["best_table"]


@pytest.mark.parametrize("after", ["model", "all"])
def test_a_spent_budget_skips_and_still_writes(tmp_path, after):
    out = tmp_path / "m.json"
    gpu_matmuls.main(["--device", "cpu", "--models", "tiny-llama,tiny-qwen2", "--shapes", "q,lm_head", "--rows", "8",
                      "--precisions", "int4/gemlite,bf16", "--budget-s", "0", "--gemlite-after", after, "--out",
                      str(out)])
    res = json.loads(out.read_text())
    assert [(r["model"], r["product"], r["route"], r.get("skipped")) for r in res["rows"]] == [
        (m, p, route, "budget spent") for m in ("tiny-llama", "tiny-qwen2") for p in ("q", "lm_head")
        for route in ("int4/gemlite", "bf16")]  # sorted as asked
    # the order they came in: GemLite after each model's other routes, or after every model's
    plain = [f"{m}/{p}/bf16/8" for m in ("tiny-llama", "tiny-qwen2") for p in ("q", "lm_head")]
    tuned = [x.replace("bf16", "int4/gemlite") for x in plain]
    assert res["budget"]["skipped"] == (plain + tuned if after == "all" else
                                        plain[:2] + tuned[:2] + plain[2:] + tuned[2:])
    assert res["best"][0]["route"] is None


def test_unknown_models_and_products_are_refused():
    with pytest.raises(SystemExit):
        gpu_matmuls.main(["--device", "cpu", "--models", "no-such-model"])
    with pytest.raises(SystemExit):
        gpu_matmuls.main(["--device", "cpu", "--models", "tiny-qwen3", "--shapes", "q/o"])  # 1.3b's name only
