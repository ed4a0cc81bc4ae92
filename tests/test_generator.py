"""The torch generator in-process (no Ray): shapes, finish reasons, and that its log-probs are those of the
distribution it sampled from (compared with an independent full forward of the same weights)."""
import pytest
import torch

from qgrpo.core.records import PromptItem, SamplingParams
from qgrpo.core.scoring import token_logprobs
from qgrpo.rollout.backends.common import WeightMismatchError
from qgrpo.rollout.backends.torch_backend import TorchGenerator

# Different prompt lengths, so left padding (mask and positions) is exercised.
ITEMS = [PromptItem(f"p{i}", f"{i}+{i + 1}=", str(2 * i + 1)) for i in (0, 5, 12)]


def _seqs(groups):
    rows = [g.prompt_ids + c.token_ids for g in groups for c in g.completions]
    T = max(map(len, rows))
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    return rows, ids


def _fp32(path):
    """The generator's bf16 weights (the model file's) in a float32 model: the reference its log-probs approach."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).float().eval()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_match_the_sampled_distribution(tiny_model_path, temperature):
    gen = TorchGenerator(tiny_model_path, precision="bf16")
    groups = gen.generate(ITEMS, SamplingParams(group_size=4, max_new_tokens=6, temperature=temperature, seed=3))
    assert len(groups) == len(ITEMS) and all(len(g.completions) == 4 for g in groups)
    for g in groups:
        assert g.policy_version == 0 and g.precision == "bf16"
        for c in g.completions:
            assert len(c.token_ids) == len(c.logprobs) >= 1
            assert c.finish_reason == ("stop" if c.token_ids[-1] == gen.stop_ids[0] else "length")
            assert c.finish_reason == "stop" or len(c.token_ids) == 6
            assert all(lp <= 0 and lp == lp for lp in c.logprobs)
    rows, ids = _seqs(groups)
    # Reference: a float32 forward of the same weights, at the sampling temperature.
    ref_model = _fp32(tiny_model_path)
    ref = token_logprobs(ref_model, ids, temperature)
    diffs = []
    for i, (g, c) in enumerate([(g, c) for g in groups for c in g.completions]):
        p = len(g.prompt_ids)
        diffs += (ref[i, p:p + len(c.token_ids)] - torch.tensor(c.logprobs)).abs().tolist()
    # bf16 generation (KV cache) vs a float32 full forward: agreement within bf16 rounding.
    assert max(diffs) < 0.05, max(diffs)
    # A wrong temperature is clearly detectable: log-probs at T=1 differ when sampling at T=0.6.
    if temperature != 1.0:
        wrong = token_logprobs(ref_model, ids, 1.0)
        i, g, c = 0, groups[0], groups[0].completions[0]
        p = len(g.prompt_ids)
        assert (wrong[0, p:p + len(c.token_ids)] - torch.tensor(c.logprobs)).abs().max() > 0.05


def test_seeded_generation_is_reproducible(tiny_model_path):
    gen = TorchGenerator(tiny_model_path, precision="int4")
    sp = SamplingParams(group_size=4, max_new_tokens=5, seed=11)
    a = [c.token_ids for g in gen.generate(ITEMS, sp) for c in g.completions]
    b = [c.token_ids for g in gen.generate(ITEMS, sp) for c in g.completions]
    assert a == b


def test_load_weights_is_strict(tiny_model_path):
    gen = TorchGenerator(tiny_model_path, precision="int8")
    named = [(n, p.detach().clone()) for n, p in _fp32(tiny_model_path).named_parameters()]
    with pytest.raises(WeightMismatchError, match="lacks 1 parameters"):
        gen.load_weights(1, named[:-1])
    with pytest.raises(WeightMismatchError, match="does not have"):
        gen.load_weights(1, named + [("extra.weight", torch.zeros(1))])
    bad = [(n, torch.zeros(3, 3) if i == 0 else t) for i, (n, t) in enumerate(named)]
    with pytest.raises(WeightMismatchError, match="received shape"):
        gen.load_weights(1, bad)
    gen.load_weights(5, named)
    assert gen.policy_version == 5


def test_memory_bytes_shrink_with_precision(tiny_model_path):
    sizes = {p: TorchGenerator(tiny_model_path, precision=p).memory_bytes()["linear"] for p in ("bf16", "int8", "int4")}
    assert sizes["int8"] < 0.7 * sizes["bf16"] and sizes["int4"] < sizes["int8"], sizes


def test_top_k_samples_from_the_renormalised_top_k(tiny_model_path):
    gen = TorchGenerator(tiny_model_path, precision="bf16")
    groups = gen.generate(ITEMS, SamplingParams(group_size=4, max_new_tokens=6, temperature=0.8, top_k=3, seed=5))
    rows, ids = _seqs(groups)
    with torch.no_grad():
        logits = _fp32(tiny_model_path)(input_ids=ids).logits.float() / 0.8  # [B, T, V]
    diffs = []
    for i, (g, c) in enumerate([(g, c) for g in groups for c in g.completions]):
        p = len(g.prompt_ids)
        for j, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            top = logits[i, p + j - 1].topk(3)
            assert tok in top.indices.tolist(), (tok, top)
            diffs.append(abs(logits[i, p + j - 1, tok] - top.values.logsumexp(-1) - lp).item())
    assert max(diffs) < 0.05, max(diffs)


def test_rows_stop_at_eos_and_the_rest_run_to_length(tiny_model_path):
    gen = TorchGenerator(tiny_model_path, precision="bf16")
    groups = gen.generate(ITEMS, SamplingParams(group_size=8, max_new_tokens=20, temperature=1.0, seed=7))
    comps = [c for g in groups for c in g.completions]
    reasons = {c.finish_reason for c in comps}
    assert reasons == {"stop", "length"}, reasons  # the seed is chosen so both occur
    for c in comps:
        assert len(c.token_ids) == len(c.logprobs)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == gen.stop_ids[0] and gen.stop_ids[0] not in c.token_ids[:-1]
            assert len(c.token_ids) <= 20
        else:
            assert len(c.token_ids) == 20 and gen.stop_ids[0] not in c.token_ids


@pytest.mark.parametrize("precision", ["int8", "int4", "nf4"])
def test_a_sync_quantizes_in_place_exactly_as_a_fresh_start(tiny_model_path, precision):
    """load_weights quantizes the received weights again inside the one model the generator holds (no bf16 master,
    no copy): its logits equal, bit for bit, those of the same weights quantized from scratch, and differ from the
    base's."""
    from transformers import AutoModelForCausalLM

    from qgrpo.rollout.backends.compute import compute_in
    from qgrpo.rollout.quantization.quant import quantize_model

    gen = TorchGenerator(tiny_model_path, precision=precision)
    assert not hasattr(gen, "_master")
    base = _fp32(tiny_model_path).to(torch.bfloat16)
    torch.manual_seed(0)
    new = {n: (p.float() + 0.02 * torch.randn_like(p.float())).to(torch.bfloat16) for n, p in base.named_parameters()}
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        before = gen.model(ids).logits
        gen.load_weights(1, new.items())
        fresh = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16).eval()  # as the generator
        for n, p in fresh.named_parameters():
            p.copy_(new[n])
        fresh = compute_in(quantize_model(fresh, precision), gen.model.dtype)  # as the generator computes here
        assert torch.equal(gen.model(ids).logits, fresh(ids).logits)
        assert not torch.equal(gen.model(ids).logits, before)
