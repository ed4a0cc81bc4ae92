"""bench/gpu_matmuls.py on a CPU: its int4 grouping as tinygemm dequantizes it, and a dry run whose rows carry their
error against float32 (the CUDA-only routes recorded as errors, the others measured)."""
import json

import pytest
import torch

from bench import gpu_matmuls


def test_int4_groups_dequantize_within_half_a_step():
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q, scale, zero = gpu_matmuls.int4_groups(w, 64)
    assert q.shape == (16, 256) and scale.shape == zero.shape == (16, 4)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    back = ((q.float() - 8).reshape(16, 4, 64) * scale[..., None] + zero[..., None]).reshape(16, 256)
    step = scale.repeat_interleave(64, dim=1)
    assert ((back - w.float()).abs() <= step / 2 + 1e-6).all()  # round to nearest: at most half a step off
    assert (back - w.float()).abs().max() > 0  # and int4 does round


def test_dry_run_on_a_cpu_measures_what_the_cpu_serves(tmp_path):
    out = tmp_path / "m.json"
    gpu_matmuls.main(["--device", "cpu", "--precisions", "bf16,int8,int4/unpadded", "--shapes", "k/v",
                      "--rows", "8", "--calls", "2", "--repeats", "1", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["machine"].startswith("cpu, torch") and res["command"].startswith(".venv/bin/python bench/")
    rows = {r["route"]: r for r in res["rows"]}
    assert rows["bf16"]["err"] < 0.01 and rows["int8"]["err"] < 0.03  # against float32, quantization included
    assert rows["bf16"]["vs_bf16"] == pytest.approx(1.0)
    for r in (rows["bf16"], rows["int8"]):
        assert r["finite"] and r["seconds"] > 0 and r["weight_bytes"] > 0
    assert rows["int8"]["weight_bytes"] < 0.6 * rows["bf16"]["weight_bytes"]
    assert "error" in rows["int4/unpadded"]  # torch packs for tinygemm on CUDA only
