"""rollout.norm_noise (QeRL's adaptive quantization noise, rollout/noise.py): the schedule by hand, the noise's
statistics and seeding, which tensors it touches, the config's rule, and that a run logs it."""
import pytest
import torch

from qgrpo.rollout.noise import NOISE_SUFFIXES, NormNoise, noisy

TINY = "configs/tiny.toml"


def test_schedule_by_hand():
    noise = NormNoise(start=1e-2, end=1e-4, stages=3, horizon=30)
    expected = {0: 1e-2, 9: 1e-2, 10: 1e-3, 19: 1e-3, 20: 1e-4, 29: 1e-4, 30: 1e-4, 500: 1e-4}
    for version, sigma in expected.items():
        assert noise.sigma(version) == pytest.approx(sigma, rel=1e-12), version
    # QeRL's ten stages from 1e-2 to 5e-4: each stage the previous times (5e-2) ** (1/9)
    qerl = NormNoise(1e-2, 5e-4, 10, horizon=100)
    ratios = [qerl.sigma(10 * (k + 1)) / qerl.sigma(10 * k) for k in range(9)]
    assert ratios == pytest.approx([0.05 ** (1 / 9)] * 9, rel=1e-12)
    assert NormNoise(3e-3, 5e-4, 1, horizon=10).sigma(7) == 3e-3  # one stage: the start throughout
    assert NormNoise(0.0, 5e-4, 10, horizon=10).sigma(0) == 0.0  # off


def _stream():
    g = torch.Generator().manual_seed(0)
    return [("model.layers.0.input_layernorm.weight", torch.ones(4096, dtype=torch.bfloat16)),
            ("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 8, generator=g).to(torch.bfloat16)),
            ("model.layers.0.post_attention_layernorm.weight", torch.full((4096,), 0.5)),
            ("model.norm.weight", torch.ones(16, dtype=torch.bfloat16))]


def test_only_the_norms_before_attention_and_mlp_get_noise_of_the_scheduled_size():
    stream = _stream()
    out = list(NormNoise(1e-2, 1e-2, 1, horizon=10).apply(5, iter(stream)))
    assert [n for n, _ in out] == [n for n, _ in stream]
    for (name, t), (_, t0) in zip(out, stream):
        assert t.dtype == t0.dtype and t.shape == t0.shape
        if not name.endswith(NOISE_SUFFIXES):
            assert t is t0
            continue
        z = t.float() - t0.float()
        # 4096 draws of N(0, 1e-4): the sample std within 5% (the bf16 rounding of 1 + z adds ~2e-3 relative),
        # the mean within 4 standard errors
        assert z.std().item() == pytest.approx(1e-2, rel=0.05)
        assert abs(z.mean().item()) < 4 * 1e-2 / 4096 ** 0.5
        assert not torch.isnan(t).any()


def test_noise_is_seeded_by_version_and_name():
    t = torch.zeros(1000)
    a, b = noisy(t, 1e-2, 4, "x.input_layernorm.weight"), noisy(t, 1e-2, 4, "x.input_layernorm.weight")
    assert torch.equal(a, b)  # every actor serves the same noisy policy; a version re-sent is served again
    assert not torch.equal(a, noisy(t, 1e-2, 5, "x.input_layernorm.weight"))
    assert not torch.equal(a, noisy(t, 1e-2, 4, "y.input_layernorm.weight"))
    stream = _stream()
    off = list(NormNoise(0.0, 5e-4, 10, horizon=10).apply(1, stream))
    assert all(t is t0 for (_, t), (_, t0) in zip(off, stream))  # off: every tensor passes as it came


def test_config_rule_and_bounds():
    from qgrpo.cluster.config.schema import ConfigError, load_config

    on = load_config(TINY, ["rollout.norm_noise=1e-2"]).rollout
    assert (on.norm_noise, on.norm_noise_end, on.norm_noise_stages) == (1e-2, 5e-4, 10)
    with pytest.raises(ConfigError, match=r"rollout.norm_noise_end: the noise decays .* lower norm_noise_end"):
        load_config(TINY, ["rollout.norm_noise=1e-4"])  # the default end, 5e-4, above the start
    assert load_config(TINY, ["rollout.norm_noise=1e-4", "rollout.norm_noise_stages=1"]).rollout.norm_noise == 1e-4
    with pytest.raises(ConfigError, match="rollout.norm_noise"):
        load_config(TINY, ["rollout.norm_noise=0.5"])
