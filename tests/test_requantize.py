"""Re-quantization that follows small updates (sync.requantize) and the update visibility measured at every sync:
the grids emulated here are the ones the real kernels store (torchao int8 and int4 on CPU, the int8 handed to vLLM),
stochastic rounding is unbiased and deterministic per version, error feedback's accumulated drift stays bounded
where nearest rounding's grows, and visibility is computed right on tensors made by hand."""
import math

import pytest
import torch
from torch import nn

from qgrpo.core.grids import Grid, decode, encode, handed
from qgrpo.rollout.backends import served_grid
from qgrpo.rollout.quantization.quant import int8_per_channel, quantize_model
from qgrpo.rollout.quantization.requantize import Requantizer

TORCH_FORMATS = [("int8", "nearest"), ("int8", "stochastic"), ("int4", "nearest"), ("int4", "stochastic")]


def _weight(n: int = 128, k: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)


def _steps(grid: Grid, enc, shape) -> torch.Tensor:
    """Each weight's grid step (its scale), [N, K]."""
    return enc.scale.expand(shape[0], -1, grid.group or shape[1]).reshape(shape)


@pytest.mark.parametrize("precision,rounding", TORCH_FORMATS)
def test_torchao_stores_the_codes_chosen_here(precision, rounding):
    grid = served_grid("torch", precision, 64)
    w = _weight()
    enc = encode(grid, w, rounding, torch.Generator().manual_seed(1))
    given = handed(grid, w, enc) if rounding == "stochastic" else w
    layer = nn.Sequential(nn.Linear(w.shape[1], w.shape[0], bias=False)).to(torch.bfloat16)
    with torch.no_grad():
        layer[0].weight.copy_(given)
    quantize_model(layer, precision, 64)
    if precision == "int8":  # torchao's Int8Tensor: the codes themselves
        assert torch.equal(layer[0].weight.qdata, enc.codes)
        assert torch.equal(layer[0].weight.scale.float().reshape(-1), enc.scale.reshape(-1))
        return
    # int4 is packed for the CPU kernel: read the weights it multiplies by (bf16 outputs: ~0.04 of a step of error)
    with torch.no_grad():
        served = layer(torch.eye(w.shape[1], dtype=torch.bfloat16)).float().T
    off = (served - decode(grid, enc)).abs() / _steps(grid, enc, w.shape)
    assert off.max() < 0.25, f"a served int4 weight is {off.max():.2f} steps from the code chosen here"


def test_vllm_int8_takes_the_codes_chosen_here():
    grid = served_grid("vllm", "int8")
    w = _weight(seed=3)
    assert torch.equal(int8_per_channel(w)[0], encode(grid, w).codes)  # nearest: the same rounding
    enc = encode(grid, w, "stochastic", torch.Generator().manual_seed(2))
    q, scale = int8_per_channel(handed(grid, w, enc))
    assert torch.equal(q, enc.codes) and torch.allclose(scale.reshape(-1), enc.scale.reshape(-1), rtol=1e-6)
    assert (q != encode(grid, w).codes).float().mean() > 0.2  # stochastic really differs from nearest


@pytest.mark.parametrize("backend,precision", [("torch", "int8"), ("torch", "int4"), ("vllm", "int8")])
def test_stochastic_rounding_is_unbiased_and_nearest_is_not(backend, precision):
    grid, w, K = served_grid(backend, precision, 64), _weight(32, 128, seed=4), 400
    total = torch.zeros(w.shape)
    for version in range(K):
        total += decode(grid, encode(grid, w, "stochastic", torch.Generator().manual_seed(version)))
    enc = encode(grid, w)
    step = _steps(grid, enc, w.shape)
    # The setters (each row's absmax, each group's min and max) take the backend's own nearest code: they set the grid.
    bias = ((total / K - w.float()) / step).abs()[~enc.setters]
    # Each draw errs by less than a step, with variance <= 1/4 step^2: the mean of K draws by 0.5/sqrt(K) steps at
    # one sigma; 5.5 sigma over 4096 weights leaves a false alarm at ~1e-4.
    assert bias.max() < 5.5 * 0.5 / math.sqrt(K), f"largest bias {bias.max():.3f} steps"
    nearest_bias = ((decode(grid, enc) - w.float()) / step).abs()[~enc.setters]
    assert nearest_bias.mean() > 0.2 and bias.mean() < nearest_bias.mean() / 5


def test_stochastic_rounding_is_deterministic_per_version():
    grid = served_grid("torch", "int4", 64)
    w = _weight(16, 128, seed=5)
    rq = Requantizer("stochastic", {"w": grid})
    a = rq.prepare(3, [("w", w)]).tensors[0][1]
    b = rq.prepare(3, [("w", w)]).tensors[0][1]
    c = rq.prepare(4, [("w", w)]).tensors[0][1]
    assert torch.equal(a, b) and not torch.equal(a, c)
    other = Requantizer("stochastic", {"v": grid}).prepare(3, [("v", w)]).tensors[0][1]
    assert not torch.equal(a, other)  # seeded by the tensor's name too: no two tensors round alike


@pytest.mark.parametrize("mode", ["nearest", "error_feedback"])
def test_error_feedback_keeps_the_accumulated_drift_within_a_step(mode):
    """A weight moving by 0.03 of a step per sync: nearest keeps its code for ~17 syncs at a time, so the served
    weights' running sum falls behind the received ones' without bound; error feedback's stays within a step."""
    grid = served_grid("vllm", "int8")
    w0 = _weight(16, 64, seed=6).float()
    step = w0.abs().amax(1, keepdim=True) / 127.0
    rq = Requantizer(mode, {"w": grid}, [("w", w0.to(torch.bfloat16))])
    drift = torch.zeros(w0.shape)
    setter = w0.abs() == w0.abs().amax(1, keepdim=True)
    for t in range(1, 301):
        w = torch.where(setter, w0, w0 + 0.03 * t * step).to(torch.bfloat16)  # the setters hold the scale still
        prepared = rq.prepare(t, [("w", w)])
        rq.commit(prepared)
        served = int8_per_channel(prepared.tensors[0][1])  # what the vLLM engine stores
        drift += served[0].float() * served[1] - w.float()
    worst = (drift / step).abs().max()
    if mode == "error_feedback":
        assert worst <= 1.0 + 1e-3, f"error feedback drifted {worst:.2f} steps"
    else:
        assert worst > 5.0  # the test can fail: nearest rounding does drift


def test_visibility_on_hand_made_tensors():
    """Scale 1 (absmax 127 / 127): 0.25 -> 0.375 keeps code 0, 0.375 -> 0.625 moves 0 -> 1; the second row stays."""
    grid = served_grid("vllm", "int8")
    old = torch.tensor([[127.0, 0.25, 0.375, -1.0], [-127.0, 2.0, 3.0, 4.0]], dtype=torch.bfloat16)
    new = torch.tensor([[127.0, 0.375, 0.625, -1.0], [-127.0, 2.0, 3.0, 4.0]], dtype=torch.bfloat16)
    rq = Requantizer("nearest", {"w": grid}, [("w", old)])
    prepared = rq.prepare(1, [("w", new), ("norm", torch.ones(4))])
    assert prepared.tensors[0][1] is new and prepared.tensors[1][0] == "norm"  # nearest hands over as received
    stats = rq.commit(prepared)
    assert stats["code_change_frac"] == 1 / 8 and stats["bf16_change_frac"] == 2 / 8
    dw2 = 0.125 ** 2 + 0.25 ** 2  # dq = 1 where dw = 0.25
    assert math.isclose(stats["update_norm_ratio"], 1 / math.sqrt(dw2), rel_tol=1e-6)
    assert math.isclose(stats["update_projection"], 0.25 / dw2, rel_tol=1e-6)
    again = rq.commit(rq.prepare(2, [("w", new)]))
    assert again["code_change_frac"] == 0 and math.isnan(again["update_norm_ratio"])  # nothing moved
    first = Requantizer("nearest", {"w": grid}).prepare(1, [("w", new)]).stats  # no initial weights: no baseline
    assert all(math.isnan(v) for v in first.values())


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_visibility_on_every_32nd_row_estimates_the_full_measure(precision):
    """The rollout actor measures visibility on every 32nd row, at least 64 rows of a tensor (a grid's scales are per
    row or per row group, so those rows' codes are the served ones): on an update of 512 x 1024 weights (every 8th
    row, 64 rows) each estimate is within 10% of the full measure, the tensors are handed over untouched, an eighth
    of the state is kept, and a tensor of 64 rows or fewer is measured whole."""
    grid = served_grid("torch", precision, 64)
    w0 = _weight(512, 1024, seed=3)
    g = torch.Generator().manual_seed(4)
    w1 = (w0.float() + 2e-4 * torch.randn(w0.shape, generator=g)).to(torch.bfloat16)  # moves a share of the codes
    full = Requantizer("nearest", {"w": grid}, [("w", w0)])
    sampled = Requantizer("nearest", {"w": grid}, [("w", w0)], row_stride=32)
    a, b = full.prepare(1, [("w", w1)]), sampled.prepare(1, [("w", w1)])
    assert b.tensors[0][1] is w1  # nearest hands the received tensor over as it came
    assert sampled.kept["w"].weight.shape == (64, 1024) and full.kept["w"].weight.shape == (512, 1024)
    est, exact = sampled.commit(b), full.commit(a)
    assert 0.001 < exact["code_change_frac"] < 0.9, exact  # the update is neither nothing nor everything
    for k, v in exact.items():
        assert math.isfinite(est[k]) and abs(est[k] - v) <= 0.1 * abs(v), (k, est[k], v)
    # the sampled rows are the first of each block of 8: their codes are those of the full measure
    assert torch.equal(sampled.kept["w"].codes.codes, full.kept["w"].codes.codes[::8])
    small = Requantizer("nearest", {"v": grid}, [("v", w0[:64])], row_stride=32)
    assert small.kept["v"].weight.shape == (64, 1024)  # too few rows to sample: measured whole
    wide = Requantizer("nearest", {"u": grid}, [("u", _weight(4096, 64, seed=5))], row_stride=32)
    assert wide.kept["u"].weight.shape == (128, 64)  # every 32nd of 4096 rows
    with pytest.raises(ValueError, match="row_stride"):
        Requantizer("nearest", {"w": grid}, row_stride=0)
    assert Requantizer("stochastic", {"w": grid}, row_stride=32).stride == 1  # re-rounding modes round every row


def test_prepare_changes_nothing_until_commit():
    grid = served_grid("torch", "int8")
    w0, w1 = _weight(8, 64, seed=7), _weight(8, 64, seed=8)
    rq = Requantizer("error_feedback", {"w": grid}, [("w", w0)])
    before = rq.kept["w"].residual.clone()
    rq.prepare(1, [("w", w1)])  # the load fails after this: the actor keeps serving version 0
    assert torch.equal(rq.kept["w"].residual, before) and torch.equal(rq.kept["w"].weight, w0)


def test_modes_and_formats_are_checked():
    with pytest.raises(ValueError, match="sync.requantize must be one of"):
        Requantizer("round_up", {})
    with pytest.raises(ValueError, match="has no emulated grid"):
        Requantizer("stochastic", {})  # a format without an emulated grid (bf16, nf4, fp8, MLX)
    assert served_grid("torch", "nf4") is None and served_grid("vllm", "fp8") is None
    assert served_grid("mlx", "int4") is None and served_grid("torch", "int4", 32).group == 32


def _sync(changed: float):
    from qgrpo.core.records import SyncAck, WeightSync

    ack = SyncAck("torch-0", 1, 0.1, 0.1, 0.1, 0.1, 0.01, 0.99, code_change_frac=changed)
    return WeightSync.of(1, 10, 1, 0.1, 0.1, [ack])


def test_follow_watch_warns_once_per_window_when_codes_stop_changing():
    from qgrpo.cluster.run.follow import FollowWatch

    watch = FollowWatch(floor=1e-4, window=3)
    assert [watch.after(_sync(x)) for x in (5e-5, 5e-5, 1e-6)] == [None, None, None]  # 1.01e-4 >= the floor
    said = [watch.after(_sync(x)) for x in (1e-5, 1e-5, 1e-5, 1e-5, 1e-3)]
    # The window slides: 5e-5 + 1e-6 + 1e-5 falls short at once; then it starts again and fills three syncs later.
    assert [i for i, m in enumerate(said) if m] == [0, 3]
    assert "sync.requantize" in said[0] and "over the last 3 syncs" in said[0]
    assert FollowWatch(0.0, 1).after(_sync(0.0)) is None  # floor 0: no warning
    assert FollowWatch(1e-4, 1).after(_sync(math.nan)) is None  # nothing measured (bf16 generators)
    assert FollowWatch(1e-4, 1).after(_sync(0.0)) is not None
