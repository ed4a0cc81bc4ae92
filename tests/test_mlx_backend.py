"""The MLX generator and reference scorer, on real mlx-cpu (rollout/backends/mlx_backend.py,
rollout/backends/reference.py).

The generator contract (shapes, stops, seeds, strict loads, versions, fingerprint) is tests/test_backend_contract.py,
which runs every registered backend, mlx included. This file holds what is MLX's own: agreement with torch on the same
weights (the RoPE-base trap), the quantized generators' distance from full precision, a weight sync round trip at
each precision, the MLX reference, the BLAS that MLX runs on, and a training run with MLX rollouts and reference.
"""
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from qgrpo.cluster.cli.app import main
from qgrpo.core.records import PromptItem, SamplingParams
from qgrpo.core.scoring import token_logprobs
from qgrpo.rollout.backends import make_generator
from qgrpo.rollout.modeling import models

pytestmark = pytest.mark.skipif(sys.platform not in ("linux", "darwin"), reason="MLX runs on Linux and macOS")
ROOT = Path(__file__).resolve().parents[1]
ITEMS = [PromptItem(f"p{i}", f"{i}+{i + 3}=", str(2 * i + 3)) for i in (1, 4, 20)]


@pytest.fixture(scope="module")
def peaked_folder(tmp_path_factory) -> str:
    """A small Llama whose distributions are peaked (large weights), saved as transformers 5 saves it: bf16, tied
    embeddings, the RoPE base (50000, not mlx-lm's default 10000) only under `rope_parameters`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("mlx-peaked")
    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                         tie_word_embeddings=True, rope_theta=50000.0, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2, initializer_range=0.2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    models.build_char_tokenizer(path)
    cfg = json.loads((path / "config.json").read_text())
    assert "rope_theta" not in cfg and cfg["rope_parameters"]["rope_theta"] == 50000.0, "the trap is not set"
    return str(path)


@pytest.fixture(scope="module")
def fp32_torch(peaked_folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(peaked_folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gens(peaked_folder):
    return {p: make_generator("mlx", model_path=peaked_folder, precision=p, generator_id=f"mlx-{p}", seed=0)
            for p in ("bf16", "int8", "int4")}


def _weights(path):
    from safetensors.torch import load_file

    return list(load_file(f"{path}/model.safetensors").items())


def _long_ids(n=96):
    return [(i * 7 + 3) % 29 + 3 for i in range(n)]  # far enough into the sequence that a wrong RoPE base shows


def test_logprobs_equal_torch_on_the_same_fp32_weights(gens, fp32_torch, peaked_folder):
    """Score and sampled log-probs of the full-precision MLX generator vs a float32 torch forward of the same
    (bf16-valued) weights: within 1e-4 (measured ~2e-6). The control: mlx-lm loading the folder as it is, without
    the RoPE base we pass, is off by nats, so this test would catch the trap."""
    import numpy as np
    from mlx_lm.utils import load_model

    from qgrpo.rollout.backends.mlx_backend import import_mlx

    mx = import_mlx()
    gen, ids = gens["bf16"], _long_ids()
    with torch.no_grad():
        ref = token_logprobs(fp32_torch, torch.tensor([ids]))[0, 1:]
    got = torch.tensor(gen.score(ids))
    assert torch.isfinite(got).all()
    assert (got - ref).abs().max().item() < 1e-4

    raw, _ = load_model(Path(peaked_folder))  # mlx-lm on its own: rope base 10000
    raw.set_dtype(mx.float32)
    logits = raw(mx.array([ids]))[0, :-1].astype(mx.float32)
    raw_lp = np.array(mx.take_along_axis(logits, mx.array(ids[1:])[:, None], axis=-1)[:, 0]
                      - mx.logsumexp(logits, axis=-1))
    assert np.abs(raw_lp - ref.numpy()).max() > 0.5, "control: the RoPE base made no difference; the test is vacuous"

    # Sampled at T = 0.7 with top-k 5: each reported log-prob is that of the filtered, tempered distribution.
    groups = gen.generate(ITEMS, SamplingParams(group_size=4, max_new_tokens=8, temperature=0.7, top_k=5, seed=2))
    worst, n = 0.0, 0
    for g in groups:
        for c in g.completions:
            seq = torch.tensor([g.prompt_ids + c.token_ids])
            with torch.no_grad():
                logits = fp32_torch(input_ids=seq).logits[0].float() / 0.7
            for j, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs)):
                row = logits[len(g.prompt_ids) + j - 1]
                top = row.topk(6).values
                if top[-2] - top[-1] < 1e-3:
                    continue  # a tie at the k-th place: either side is right
                row = row.masked_fill(row < top[-2], float("-inf"))
                worst = max(worst, abs(row.log_softmax(-1)[tok].item() - lp))
                n += 1
    assert n >= 40 and worst < 1e-4, (n, worst)


def test_quantized_generators_stay_near_full_precision(gens, peaked_folder):
    """Mean |log-prob difference| per token from the full-precision generator on a 96-token sequence of this peaked
    model (mean |log-prob| ~4.8 nats). Measured: MLX int8 0.051, int4 0.72; the torch backend's own int8 / int4
    (group 64) on the same weights 0.047 / 0.54. Bounds: int8 < 0.15, int4 < 1.5, int4 the farther one (a
    re-quantization that did nothing would give 0), and each within 2x of the torch quantizer's gap: MLX's quantization
    costs what quantization costs, not more."""
    ids = _long_ids()

    def gaps(backend, gen_for):
        full = torch.tensor(gen_for("bf16").score(ids))
        return {p: (torch.tensor(gen_for(p).score(ids)) - full).abs().mean().item() for p in ("int8", "int4")}

    mlx = gaps("mlx", gens.__getitem__)
    ref = gaps("torch", lambda p: make_generator("torch", model_path=peaked_folder, precision=p))
    print("quantization gap (nats/token): mlx", mlx, "torch", ref)
    assert all(math.isfinite(v) for v in [*mlx.values(), *ref.values()])
    assert 0 < mlx["int8"] < 0.15 and mlx["int8"] < mlx["int4"] < 1.5, mlx
    assert all(mlx[p] < 2 * ref[p] for p in mlx), (mlx, ref)
    mem = {p: gens[p].memory_bytes()["linear"] for p in gens}
    assert mem["int4"] < mem["int8"] < mem["bf16"] / 2, mem  # fp32 -> 8.5 bits -> 4.5 bits per weight (group 64)


@pytest.mark.parametrize("precision", ["bf16", "int8", "int4"])
def test_a_sync_changes_outputs_and_restoring_the_weights_restores_them(gens, peaked_folder, precision):
    gen = gens[precision]
    original = _weights(peaked_folder)
    gen.load_weights(0, original)
    greedy = SamplingParams(group_size=1, max_new_tokens=10, temperature=0.0)
    ids = _long_ids(40)
    before = [c.token_ids for g in gen.generate(ITEMS, greedy) for c in g.completions]
    before_lp = gen.score(ids)
    g = torch.Generator().manual_seed(1)
    moved = [(n, t + 0.2 * torch.randn(t.shape, generator=g).to(t.dtype) if t.dim() == 2 else t) for n, t in original]
    gen.load_weights(1, moved)
    after = [c.token_ids for g in gen.generate(ITEMS, greedy) for c in g.completions]
    assert after != before and gen.policy_version == 1
    assert max(abs(a - b) for a, b in zip(gen.score(ids), before_lp)) > 0.1
    gen.load_weights(2, original)  # re-quantizing the same values gives the same model, bit for bit
    assert [c.token_ids for g in gen.generate(ITEMS, greedy) for c in g.completions] == before
    assert gen.score(ids) == before_lp


@pytest.mark.parametrize("precision", ["bf16", "int4"])
def test_mlx_reference_equals_the_torch_reference(peaked_folder, fp32_torch, gens, precision):
    """Same [B, T] contract as the torch scorer: zeros up to each row's prompt end, completion log-probs after. MLX
    full precision vs a float32 torch forward: within 1e-4; vs the torch bf16 reference (bf16 arithmetic on this
    peaked model): at most 0.3 and 0.05 on average (measured 0.12 and ~0.02). int4 MLX vs int4 torch are different
    quantizers (MLX affine with biases, torchao symmetric), so they agree only loosely: mean within 0.3 nats per token
    (measured ~0.08)."""
    from qgrpo.rollout.backends.reference import make_reference_scorer

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 32, (6, 40), generator=g)
    prompt_lens = torch.tensor([10, 10, 10, 17, 17, 17])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    ids[3:, :17] = ids[3, :17]
    ids[:3, :10] = ids[0, :10]
    mlx_ref = make_reference_scorer("mlx", peaked_folder, precision)
    torch_ref = make_reference_scorer("torch", peaked_folder, precision)
    got = mlx_ref.score(ids, 0.8, prompt_lens, groups)
    want = torch_ref.score(ids, 0.8, prompt_lens, groups)
    mask = torch.arange(40)[None, :] >= prompt_lens[:, None]
    assert got.shape == want.shape == ids.shape and torch.isfinite(got).all()
    assert (got[~mask] == 0).all() and (want[~mask] == 0).all()
    if precision == "bf16":
        with torch.no_grad():
            fp32 = token_logprobs(fp32_torch, ids, 0.8)
        assert (got - fp32)[mask].abs().max().item() < 1e-4
        diff = (got - want)[mask].abs()
        assert diff.max().item() < 0.3 and diff.mean().item() < 0.05, (diff.max(), diff.mean())
    else:
        for row in range(ids.shape[0]):
            own = torch.tensor(gens[precision].score(ids[row].tolist()))
            assert (mlx_ref.score(ids[row:row + 1], 1.0)[0, 1:] - own).abs().max().item() < 1e-5
        with torch.no_grad():
            fp32 = token_logprobs(fp32_torch, ids, 0.8)
        assert 0 < (got - fp32)[mask].abs().mean().item() < 1.5


def test_mlx_runs_on_openblas_when_the_system_has_it():
    """In a fresh process (MLX must not be loaded before the backend puts the BLAS under it): the backend reports
    OpenBLAS where the system has it, and one line tells the user what to install where it does not."""
    from qgrpo.rollout.backends.mlx_backend import OPENBLAS_PATHS

    code = ("import sys; sys.path.insert(0, {root!r}); from rollout.backends import mlx_backend as m; {patch}"
            "m.import_mlx(); print('BLAS', m.blas_status())")
    env = {k: v for k, v in os.environ.items() if k != "QGRPO_MLX_BLAS"}
    run = subprocess.run([sys.executable, "-c", code.format(root=str(ROOT), patch="")], env=env, capture_output=True,
                         text=True, timeout=120)
    present = [p for p in OPENBLAS_PATHS if Path(p).is_file()]
    if sys.platform != "linux":
        assert "BLAS n/a" in run.stdout
        return
    if present:
        assert f"BLAS {present[0]}" in run.stdout and "libopenblas0-pthread" not in run.stderr, run
    patched = code.format(root=str(ROOT), patch="m.OPENBLAS_PATHS = ('/nonexistent',); ")
    missing = subprocess.run([sys.executable, "-c", patched], env=env, capture_output=True, text=True, timeout=120)
    assert "BLAS bundled" in missing.stdout
    assert missing.stderr.count("apt-get install libopenblas0-pthread") == 1, missing.stderr


def test_config_accepts_mlx_and_names_what_it_does_not_serve():
    from qgrpo.cluster.config.schema import Config, validate

    cfg = Config()
    cfg.model.path = "builtin:tiny-digits"
    cfg.rollout.backend, cfg.rollout.precision = "mlx", "int4"
    cfg.reference.backend, cfg.reference.precision = "mlx", "int8"
    assert validate(cfg) == []
    cfg.rollout.precision, cfg.reference.precision, cfg.reference.backend = "nf4", "nf4", "mlx"
    problems = validate(cfg)
    assert any(p.startswith("rollout.precision: 'nf4' is not served by the mlx backend") for p in problems)
    assert any(p.startswith("reference.precision: 'nf4' is not served by the mlx reference") for p in problems)
    cfg.reference.backend = "vllm"
    assert any(p.startswith("reference.backend: unknown backend 'vllm'") for p in validate(cfg))


def test_a_short_run_with_mlx_rollouts_and_reference_moves_the_reward(ray_session, tiny_model_path, tmp_path):
    """The smoke of the curve below, in `make test`: 30 steps at lr 1e-2 with int4 MLX generators and an MLX
    reference, the reward moved (tests/helpers.py: SMOKE_GAIN)."""
    from tests.helpers import SMOKE_GAIN, SMOKE_STEPS, read_metrics, reward_moved, step_metrics

    rc = main(["train", str(ROOT / "configs" / "tiny.toml"), "--set", f"model.path='{tiny_model_path}'",
               "--set", f"run.output_dir='{tmp_path}'", "--set", "run.progress=false", "--set",
               f"run.steps={SMOKE_STEPS}", "--set", "run.eval=false", "--set", "learner.lr=1e-2", "--set",
               "run.save_every=0", "--set", "rollout.backend='mlx'", "--set", "reference.backend='mlx'"])
    assert rc == 0
    (run_dir,) = tmp_path.iterdir()
    (start,) = [r for r in read_metrics(run_dir) if r.get("event") == "start"]
    assert [g["generator_id"] for g in start["generators"]] == ["mlx-0"], start["generators"]
    steps = step_metrics(run_dir)
    assert len(steps) == SMOKE_STEPS and all(r["rollout/precision"] == "int4" for r in steps)
    first, last = reward_moved(run_dir)
    print(f"tiny smoke on mlx: reward first3={first:.3f} last10={last:.3f}")
    assert last - first >= SMOKE_GAIN, (first, last)


@pytest.mark.slow  # ~85 s here; the smoke above is in `make test`
def test_tiny_config_learns_with_mlx_rollouts_and_reference(ray_session, tiny_model_path, tmp_path):
    """The same job with int4 MLX generators (nn.quantize, group 64) and an MLX reference, on mlx-cpu: 150 steps,
    the same bar. Measured: first 25 steps 0.18 mean reward, steps 125-150 0.68, 175-200 0.88."""
    t0 = time.monotonic()
    rc = main(["train", str(ROOT / "configs" / "tiny.toml"), "--set", f"model.path='{tiny_model_path}'",
               "--set", f"run.output_dir='{tmp_path}'",
               "--set", "run.progress=false", "--set", "run.steps=150", "--set", "run.eval=false",
               "--set", "rollout.backend='mlx'", "--set", "reference.backend='mlx'"])
    elapsed = time.monotonic() - t0
    assert rc == 0
    (run_dir,) = tmp_path.iterdir()
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (start,) = [r for r in rows if r.get("event") == "start"]
    assert [g["generator_id"] for g in start["generators"]] == ["mlx-0"], start["generators"]
    rows = [r for r in rows if "reward/mean" in r]
    assert len(rows) == 150 and all(r["rollout/precision"] == "int4" for r in rows)
    first = sum(r["reward/mean"] for r in rows[:10]) / 10
    last = sum(r["reward/mean"] for r in rows[-10:]) / 10
    print(f"tiny on mlx: reward first10={first:.3f} last10={last:.3f} in {elapsed:.0f} s")
    assert all(math.isfinite(r["mismatch/kl_mu_old"]) and math.isfinite(r["loss/total"]) for r in rows)
    assert last - first >= 0.3, (first, last)
