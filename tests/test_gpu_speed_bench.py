"""bench/gpu_speed.py, the GPU speed bench, on a CPU: its dry run end to end (every variant measured, graphs falling
back where there is no GPU, a strict JSON), its time budget, and the memory-bound arithmetic of its table."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_speed

ROOT = Path(__file__).resolve().parents[1]
TINY_LAYER = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64  # q, o; k, v (2 kv heads of 16); MLP; two norms


def _reject(name: str):
    raise AssertionError(f"{name} in the JSON")


@pytest.mark.slow  # `make test-slow` (docs/testing.md)
@pytest.mark.heavy  # 13 s: the bench as a process
def test_dry_run_measures_every_variant_on_a_cpu(tmp_path):
    out = tmp_path / "gpu_speed.json"
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_speed.py"), "--device", "cpu", "--shape", "tiny", "--rows", "8",
           "--max-new-tokens", "8", "--precisions", "bf16,int8", "--no-learner", "--repeats", "1", "--budget-s", "150",
           "--out", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(out.read_text(), parse_constant=_reject)  # no NaN / Infinity anywhere
    assert res["device_name"] == "cpu" and res["budget"]["skipped"] == []
    V = res["model"]["vocab"]
    assert res["model"]["params"] == 2 * V * 64 + 2 * TINY_LAYER + 64  # untied embeddings
    rows = {(r["precision"], r["loop"], r["rows"]): r for r in res["generation"]}
    assert set(rows) == {("bf16", "eager", 8), ("bf16", "graphs", 8), ("bf16", "graphs_fused", 8),
                         ("bf16", "generate", 8), ("int8", "graphs", 8), ("int8", "graphs_fused", 8),
                         ("int8", "eager", 8)}
    for key, r in rows.items():
        assert "error" not in r and "skipped" not in r, (key, r)
        assert r["full"] and r["tokens"] == 8 * 8, key  # no row stopped early
        assert r["seconds"] > 0 and r["tokens_per_s"] > 0 and 0 < r["share_of_bound"], key
    # No CUDA: the graphs loop falls back to the static one and says why; the eager loop is the static one.
    assert rows[("bf16", "graphs", 8)]["decode_loop"] == "static" and rows[("bf16", "graphs", 8)]["decode_fallback"]
    assert rows[("bf16", "eager", 8)]["decode_loop"] == "static" and not rows[("bf16", "eager", 8)]["decode_fallback"]
    bf16, int8 = rows[("bf16", "eager", 8)], rows[("int8", "eager", 8)]
    # Operators per decode step of the eager loop: each of the 2 layers runs a few dozen (norms, projections,
    # rotary, attention, MLP) beside the step's own (embedding, head, sampling).
    assert 2 * 20 < bf16["ops_per_step"] < 2 * 120 and "kernel_ms_per_step" not in bf16
    assert int8["linear_bytes"] < 0.7 * bf16["linear_bytes"]  # int8 serves fewer bytes: a higher bound
    assert int8["bound"]["tokens_per_s"] > bf16["bound"]["tokens_per_s"]
    assert int8["share_of_bf16_bound"] == pytest.approx(
        (int8["decode_tokens_per_s"] or int8["tokens_per_s"]) / bf16["bound"]["tokens_per_s"])
    assert int8["speedup_vs_bf16"] == pytest.approx(int8["tokens_per_s"] / bf16["tokens_per_s"])
    assert rows[("bf16", "graphs", 8)]["speedup_vs_eager"] > 0 and bf16["speedup_vs_generate"] > 0
    assert "| int8 | graphs (ran static) | 8 |" in res["table"] and res["table"] in p.stdout


def test_a_spent_budget_skips_every_variant_and_says_so(tmp_path):
    out = tmp_path / "gpu_speed.json"
    gpu_speed.main(["--device", "cpu", "--shape", "tiny", "--rows", "8", "--precisions", "bf16,int8", "--no-learner",
                    "--budget-s", "0", "--out", str(out)])
    res = json.loads(out.read_text(), parse_constant=_reject)
    assert res["budget"]["skipped"] == ["bf16/eager", "bf16/graphs", "bf16/graphs_fused", "bf16/generate",
                                        "int8/graphs_fused", "int8/graphs", "int8/eager"]
    assert all(r["skipped"] == "budget spent" for r in res["generation"])
    assert res["bandwidth"]["bytes_per_s"] > 0 and res["matmul"]["flops_per_s"] > 0


def test_memory_bound_counts_weights_embedding_rows_and_kv_cache():
    model = {"layers": 28, "hidden": 1536, "kv_heads": 2, "head_dim": 128}
    b = gpu_speed.decode_bound(3 * 10**9, model, rows=64, context=100.0, bandwidth=4.0e12)
    kv = 64 * 28 * 2 * 2 * 128 * 2 * 100.0
    assert b["kv_bytes"] == kv
    assert b["step_bytes"] == 3 * 10**9 + 64 * 1536 * 2 + kv
    assert b["tokens_per_s"] == pytest.approx(64 * 4.0e12 / b["step_bytes"])
    # More rows share the weights' read: a higher bound, though less than proportionally (the cache grows).
    b8 = gpu_speed.decode_bound(3 * 10**9, model, rows=8, context=100.0, bandwidth=4.0e12)
    assert b8["tokens_per_s"] < b["tokens_per_s"] < 8 * b8["tokens_per_s"]


def test_only_fp8_takes_a_route():
    gpu_speed._parse(["--device", "cpu", "--precisions", "bf16,fp8/weight_only"])
    with pytest.raises(SystemExit):
        gpu_speed._parse(["--device", "cpu", "--precisions", "bf16,int8/weight_only"])


def test_a_profiled_rows_kernels_share_the_steps_bytes():
    """What a step must read, spread over the kernels the profiler counted, and the rate those kernels read it at
    (kernel time only, launch gaps aside) as a share of the measured bandwidth."""
    model = {"layers": 28, "hidden": 1536, "kv_heads": 2, "head_dim": 128}
    row = {"variant": "torch", "precision": "bf16", "loop": "graphs_fused", "rows": 8, "tokens_per_s": 3000.0,
           "decode_tokens_per_s": 4000.0, "linear_bytes": 2.8e9, "kernels_per_step": 330, "kernel_ms_per_step": 1.6}
    gpu_speed.add_bounds_and_speedups([row], model, bandwidth=4.0e12, context_of=lambda rows: 100.0)
    step = row["bound"]["step_bytes"]
    assert row["bytes_per_kernel"] == pytest.approx(step / 330)
    assert row["kernel_read_share"] == pytest.approx(step / 1.6e-3 / 4.0e12)
    assert "| bf16 | graphs_fused | 8 |" in gpu_speed.table({"generation": [row]})
