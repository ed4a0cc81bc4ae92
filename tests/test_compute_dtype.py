"""model.compute_dtype (core/cpu.py, rollout/backends/compute.py): what `auto` chooses on each kind of CPU, and that
an fp32 learner, reference and torch generator compute on the same bf16 weights, stream and save bf16, and stay within
bf16's own error of the bf16 path.

Tolerances, measured on the tiny builtin model: the fp32 roles equal a float32 forward of the bf16 weights to float32
rounding (1e-4 nats); the bf16 path differs from it by bf16 activation rounding (under 0.1 nats per token here)."""
import json
import math

import pytest
import torch

from qgrpo.core.cpu import compute_dtype, isa_from
from qgrpo.core.records import PromptItem, SamplingParams
from qgrpo.core.scoring import token_logprobs

ZEN2 = {"avx", "avx2", "fma", "f16c"}  # AVX2 only (most AMD Zen 2/3, Intel client CPUs)
ZEN4 = ZEN2 | {"avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"}
SKYLAKE_SP = ZEN2 | {"avx512f", "avx512bw", "avx512_vnni"}  # AVX-512 without bf16
SAPPHIRE = SKYLAKE_SP | {"avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"}
FP32_EXACT = 1e-4  # fp32 compute vs a float32 forward of the same bf16 weights
BF16_PATH = 0.1  # bf16 compute vs that float32 forward (activation rounding), per token
# int8's decode products and every int4 product take bf16 activations inside torch's kernels
# (rollout/quantization/quant.py, rollout/backends/compute.py), as does bitsandbytes' nf4 kernel, whose blocking follows
# the number of rows: a sampled log-prob and the same token's score may differ by bf16 rounding (measured 0.001 here).
OWN_FORWARD = {"int8": 0.01, "int4": 0.01, "nf4": 0.01}  # nf4: bitsandbytes' CPU kernel, the same


@pytest.mark.parametrize("flags, capability, env, native, avx512", [
    (ZEN2, "AVX2", {}, False, False),
    (ZEN4, "AVX512", {}, True, True),
    (SKYLAKE_SP, "AVX512", {}, False, True),
    (SAPPHIRE, "AVX512", {}, True, True),
    (ZEN4, "AVX2", {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}, False, False),  # the emulation
    (ZEN4, "AVX512", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, False, True),  # oneDNN capped below its bf16 products
    (ZEN4, "AVX512", {"ONEDNN_MAX_CPU_ISA": "ALL"}, True, True),
])
def test_isa_reads_flags_and_the_environments_caps(flags, capability, env, native, avx512):
    cpu = isa_from(flags, capability, env, "x86_64", "some CPU")
    assert (cpu.native_bf16, cpu.avx512) == (native, avx512)
    assert bool(cpu.capped_by) == (bool(env) and env.get("ONEDNN_MAX_CPU_ISA") != "ALL")
    choice, why = compute_dtype("auto", "cpu", cpu)
    assert choice == ("bf16" if native else "fp32") and why.startswith("auto: some CPU")


def test_arm_and_unknown_cpus():
    assert isa_from({"fp", "asimd", "bf16"}, "DEFAULT", {}, "aarch64").native_bf16 is True
    assert isa_from({"fp", "asimd"}, "DEFAULT", {}, "aarch64").native_bf16 is False
    assert isa_from(set(), "DEFAULT", {}, "arm64").native_bf16 is None  # macOS: measured when asked


def test_forced_values_win_and_a_bad_one_names_the_field():
    slow = isa_from(ZEN2, "AVX2", {}, "x86_64")
    assert compute_dtype("bf16", "cpu", slow) == ("bf16", 'model.compute_dtype = "bf16"')
    assert compute_dtype("fp32", "cpu", isa_from(ZEN4, "AVX512", {})) == ("fp32", 'model.compute_dtype = "fp32"')
    with pytest.raises(ValueError, match="model.compute_dtype"):
        compute_dtype("fp16", "cpu", slow)


def test_the_config_field_takes_the_three_values_only():
    from qgrpo.cluster.config.schema import ConfigError, load_config

    assert load_config("configs/tiny.toml", check_environment=False).model.compute_dtype == "auto"
    cfg = load_config("configs/tiny.toml", ["model.compute_dtype=fp32"], check_environment=False)
    assert cfg.model.compute_dtype == "fp32"
    with pytest.raises(ConfigError, match="model.compute_dtype"):
        load_config("configs/tiny.toml", ["model.compute_dtype=fp16"], check_environment=False)


# ---------------------------------------------------------------- the roles on the same weights


def _probe(path: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).float().eval()
    ids = torch.randint(3, model.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return ids, token_logprobs(model, ids)


def test_reference_in_fp32_is_the_float32_forward_of_its_bf16_weights(tiny_model_path):
    from qgrpo.rollout.backends.reference import ReferenceScorer

    ids, exact = _probe(tiny_model_path)
    fp32 = ReferenceScorer(tiny_model_path, "bf16", compute_dtype="fp32")
    bf16 = ReferenceScorer(tiny_model_path, "bf16", compute_dtype="bf16")
    assert fp32.compute_dtype == "fp32" and next(fp32.model.parameters()).dtype == torch.float32
    got_fp32, got_bf16 = fp32.score(ids), bf16.score(ids)
    assert torch.isfinite(got_fp32).all() and torch.isfinite(got_bf16).all()
    assert (got_fp32 - exact).abs().max() < FP32_EXACT < (got_bf16 - exact).abs().max() < BF16_PATH


@pytest.mark.parametrize("precision", ["bf16", "int8", "int4", "nf4"])
def test_generator_in_fp32_samples_what_it_reports_at_every_precision(tiny_model_path, precision):
    """The fp32 generator's sampled log-probs are its own forward's; within the bf16 path's error of the bf16
    generator; a sync keeps it in fp32 (nf4 builds its layers anew) and changes nothing when the weights do not."""
    from transformers import AutoModelForCausalLM

    from qgrpo.rollout.backends.torch_backend import TorchGenerator

    items = [PromptItem(f"p{i}", f"{i}+{i + 1}=", str(2 * i + 1)) for i in (0, 5, 12)]
    sp = SamplingParams(group_size=4, max_new_tokens=6, temperature=1.0, seed=3)
    gens = {d: TorchGenerator(tiny_model_path, precision, compute_dtype=d, generator_id=d) for d in ("fp32", "bf16")}
    gen = gens["fp32"]
    assert gen.compute_dtype == "fp32" and gen.model.get_input_embeddings().weight.dtype == torch.float32
    probe = gen.generate(items, sp)[1]
    seq = probe.prompt_ids + probe.completions[0].token_ids
    before = gen.score(seq)
    for g in gen.generate(items, sp):
        for c in g.completions:
            lp = gen.score(g.prompt_ids + c.token_ids)[len(g.prompt_ids) - 1:]
            assert max(abs(a - b) for a, b in zip(c.logprobs, lp)) < OWN_FORWARD.get(precision, FP32_EXACT)
    assert max(abs(a - b) for a, b in zip(before, gens["bf16"].score(seq))) < BF16_PATH
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)
    gen.load_weights(1, ((n, p.detach()) for n, p in base.named_parameters()))
    assert gen.model.get_input_embeddings().weight.dtype == torch.float32
    assert max(abs(a - b) for a, b in zip(before, gen.score(seq))) < FP32_EXACT
    gen.generate(items, sp)


# ---------------------------------------------------------------- the learner


def _batch(vocab: int, B: int = 8, P: int = 4, L: int = 5):
    from qgrpo.learner.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (B, P + L), generator=g)
    mask = torch.zeros(B, P + L)
    mask[:, P:] = 1
    return TrainBatch(input_ids=ids, completion_mask=mask, mu_logp=-2.0 * mask,
                      advantages=torch.randn(B, generator=g), policy_versions=torch.zeros(B, dtype=torch.long),
                      total_sequences=B, total_tokens=float(mask.sum()), max_new_tokens=L)


def test_learner_in_fp32_streams_and_saves_bf16_like_the_bf16_learner(tiny_model_path, dist_env, tmp_path):
    """Both learners score the probe within their bounds of the float32 forward and give the same first loss within
    bf16's error, each with the attention "auto" picks for its dtype; the fp32 learner trains, streams bf16 tensors
    (bf16 of its weights), and its checkpoint is bf16 with a config that says bfloat16."""
    from safetensors import safe_open

    from qgrpo.learner.engine import Learner
    from qgrpo.learner.objective.settings import objective_settings
    from qgrpo.learner.settings import LearnerSettings

    ids, exact = _probe(tiny_model_path)
    learners = {}
    for d in ("fp32", "bf16"):
        learners[d] = Learner(tiny_model_path, LearnerSettings(lr=1e-3, micro_batch_per_rank=8, sequences_per_rank=8,
                                                               grad_clip=0.0, compute_dtype=d,
                                                               objective=objective_settings(kl_coeff=0.0)))
    fp32, bf16 = learners["fp32"], learners["bf16"]
    assert fp32.compute_dtype == "fp32" and next(fp32.engine.module.parameters()).dtype == torch.float32
    # learner.attention = "auto" follows the dtype on a CPU: SDPA in fp32, eager in bf16 (learner.engine.auto_attention)
    assert fp32.engine.module.config._attn_implementation == "sdpa"
    assert bf16.engine.module.config._attn_implementation == "eager"
    for row in range(ids.shape[0]):
        assert max(abs(a - b) for a, b in zip(fp32.score(ids[row].tolist()), exact[row, 1:].tolist())) < FP32_EXACT
        assert max(abs(a - b) for a, b in zip(bf16.score(ids[row].tolist()), exact[row, 1:].tolist())) < BF16_PATH
    before = dict(fp32.named_weights())
    batch = _batch(fp32.engine.module.config.vocab_size)
    out = {d: learner.train_step(batch) for d, learner in learners.items()}
    assert all(o.skipped == "" for o in out.values()) and math.isfinite(out["fp32"].loss)
    assert abs(out["fp32"].loss - out["bf16"].loss) < BF16_PATH * abs(out["fp32"].loss)
    after = dict(fp32.named_weights())
    assert all(t.dtype == torch.bfloat16 for t in after.values()) and after.keys() == before.keys()
    # every matrix moved (a norm gain near 1 moves by less than bf16's resolution there at this lr)
    assert all(not torch.equal(before[n], after[n]) for n in before if "norm" not in n)
    held = dict(fp32.engine.module.named_parameters())
    assert all(torch.equal(after[n], held[n].detach().to(torch.bfloat16)) for n in after)
    fp32.save(tmp_path / "ckpt")
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["dtype"] == "bfloat16"
    assert next(fp32.engine.module.parameters()).dtype == torch.float32  # the save changed nothing it computes with


# ---------------------------------------------------------------- the preflight line and the run's record


def test_the_machine_lines_name_the_dtype_the_rates_and_the_estimate():
    """The estimate's arithmetic is tested in tests/test_estimate.py; here the lines check and train print."""
    from qgrpo.cluster.config.machine import MachineReport

    lines = MachineReport("AMD EPYC, AVX2, no native bf16", "fp32", "auto: ...", {"bf16": 7.5, "fp32": 44.0},
                          42.0).lines(30)
    assert lines[0].startswith("compute: fp32") and "AMD EPYC" in lines[1] and "bf16 8 and fp32 44 GFLOP/s" in lines[1]
    assert "about 42 s per step, 22 min for 30 steps" in lines[2]  # and the start (machine.STARTUP_S)
    assert "no estimate" in MachineReport("x", "bf16", "", {"bf16": 1.0, "fp32": 1.0}, float("nan")).lines(30)[2]


def test_the_runs_config_records_the_choice_and_a_resume_reads_past_it(monkeypatch):
    import tomllib

    from qgrpo.cluster.cli import train
    from qgrpo.cluster.config.schema import load_config
    from qgrpo.core import cpu

    monkeypatch.setattr(cpu, "isa", lambda: isa_from(ZEN2, "AVX2", {}, "x86_64", "AMD EPYC"))
    cfg = load_config("configs/tiny.toml", check_environment=False)
    text = train._recorded(cfg)
    assert text.splitlines()[-1] == train.COMPUTE_NOTE + (
        "learner, reference, rollout fp32 (auto: AMD EPYC, AVX2, no native bf16: bf16 products would be emulated, "
        "several times slower than fp32)")
    cfg.learner.compute_dtype = "bf16"  # a role's own setting, told apart
    recorded = train._recorded(cfg).splitlines()[-1]
    assert recorded.startswith(train.COMPUTE_NOTE + 'learner bf16 (learner.compute_dtype = "bf16"); reference, '
                                                    'rollout fp32 (auto: AMD EPYC')
    assert tomllib.loads(text)["model"]["compute_dtype"] == "auto"
    assert train._unnoted(text) == train._unnoted(text.replace("fp32 (", "bf16 ("))


def test_fp32_learner_keeps_bf16_weights_over_fp32_masters(tiny_model_path, dist_env, tmp_path):
    """At the default job's lr most Adam steps are smaller than half a bf16 spacing: the bf16 learner's weights hold
    still until its fp32 master has moved that far. The fp32 learner does the same (learner/optim.py: Bf16Weights):
    its weights stay bf16 values, its masters carry the rest, its streamed weights move about as often as the bf16
    learner's, and the masters survive a checkpoint."""
    from qgrpo.learner.engine import Learner
    from qgrpo.learner.objective.settings import objective_settings
    from qgrpo.learner.settings import LearnerSettings

    batch, moved = None, {}
    for d in ("fp32", "bf16"):
        learner = Learner(tiny_model_path, LearnerSettings(lr=2e-5, micro_batch_per_rank=8, sequences_per_rank=8,
                                                           objective=objective_settings(kl_coeff=0.0), compute_dtype=d))
        batch = batch or _batch(learner.engine.module.config.vocab_size)
        before = {n: t.clone() for n, t in learner.named_weights()}
        for _ in range(3):
            assert learner.train_step(batch).skipped == ""
        after = dict(learner.named_weights())
        moved[d] = sum(int((before[n] != after[n]).sum()) for n in before) / sum(t.numel() for t in before.values())
        if d == "fp32":
            fp32 = learner
    params = list(fp32.engine.module.parameters())
    assert all(torch.equal(p, p.to(torch.bfloat16).float()) for p in params)
    masters = fp32.inner_optimizer._masters()
    assert sum(int((masters[p] != p).sum()) for p in params) > 0.5 * sum(p.numel() for p in params)
    # measured: 56.4% of the streamed weights moved in both (the masters moved every weight)
    assert abs(moved["fp32"] - moved["bf16"]) < 0.1 * moved["bf16"] and moved["bf16"] < 0.9, moved
    state = fp32.inner_optimizer.state_dict()
    assert len(state["bf16_masters"]) == len(params)
    fp32.inner_optimizer._master_of = {}
    fp32.inner_optimizer.load_state_dict(state)
    assert all(torch.equal(masters[p], fp32.inner_optimizer._masters()[p]) for p in params)
