"""[rollout.torch] quantize_head: an output head tied to the input embedding is quantized on its own copy while the
embedding stays bf16, its log-probs stay within the format's bounds of fp32, a weight update re-quantizes it from
the new embedding exactly as a generator started from those weights quantizes it, the rollout actor's grids leave
the copy out (no tensor of the stream), and the learner's fake_quant simulates it on request."""
from __future__ import annotations

import copy

import pytest
import torch

from qgrpo.core.grids import decode, encode
from qgrpo.learner.fake_quant import fake_quant_layers
from qgrpo.rollout.backends import served_grid
from qgrpo.rollout.backends.torch_backend import TorchGenerator
from qgrpo.rollout.quantization import quant
from qgrpo.rollout.quantization.quant import quant_config_summary, quantize_model, quantized_weight_names
from tests.helpers import LOGPROB_BOUNDS, next_token_logprobs, tiny_llama

BATCH = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(123))


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_a_tied_head_is_quantized_on_its_own_copy(precision):
    m = tiny_llama(tie=True)
    embedding = m.model.embed_tokens.weight.detach().clone()
    ref = next_token_logprobs(copy.deepcopy(m).float(), BATCH)
    assert quant.tied_head_source(m) == ("lm_head", "model.embed_tokens.weight")
    assert "lm_head.weight" not in quantized_weight_names(m, precision, 64, "cpu")
    assert "lm_head.weight" in quantized_weight_names(m, precision, 64, "cpu", head=True)
    quantize_model(m, precision, head=True)
    assert m.lm_head.weight is not m.model.embed_tokens.weight and quant.tied_head_source(m) is None
    assert m.model.embed_tokens.weight.dtype == torch.bfloat16 and torch.equal(m.model.embed_tokens.weight, embedding)
    s = quant_config_summary(m)
    assert (s["quantized_linears"], s["bf16_linears"]) == (15, 0), s  # 2 x 7 + the head
    diff = (next_token_logprobs(m, BATCH) - ref).abs()
    assert torch.isfinite(diff).all()
    mean_bound, max_bound = LOGPROB_BOUNDS[precision]
    assert diff.mean().item() < mean_bound and diff.max().item() < max_bound, (diff.mean().item(), diff.max().item())


def test_an_untied_head_is_quantized_either_way():
    m = tiny_llama(tie=False)
    assert quant.tied_head_source(m) is None
    assert "lm_head.weight" in quantized_weight_names(m, "int8", 64, "cpu")


def _generator(tokenizer_path, model, precision="int8", head=True, onednn=True):
    return TorchGenerator(tokenizer_path, precision=precision, model=copy.deepcopy(model),
                          options={"quantize_head": head, "onednn": onednn})


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_an_update_requantizes_the_head_from_the_new_embedding(tiny_model_path, precision):
    base, moved = tiny_llama(tie=True), tiny_llama(seed=1, tie=True)
    ids = [1, 5, 7, 9, 11, 3, 4]
    gen = _generator(tiny_model_path, base, precision)
    before = gen.score(ids)
    stream = [(n, p.detach().clone()) for n, p in moved.named_parameters()]
    assert "lm_head.weight" not in dict(stream)  # a tied model sends its embedding once
    gen.load_weights(1, stream)
    fresh = _generator(tiny_model_path, moved, precision)
    assert gen.score(ids) == fresh.score(ids) and gen.score(ids) != before
    assert gen.policy_version == 1
    grids = gen.quant_grids()
    assert "lm_head.weight" not in grids and "model.layers.0.mlp.down_proj.weight" in grids
    plain = _generator(tiny_model_path, base, precision, head=False)
    assert gen.memory_bytes()["linear"] < plain.memory_bytes()["linear"]  # the head's bytes, now quantized


def test_bf16_ignores_the_switch(tiny_model_path):
    gen = _generator(tiny_model_path, tiny_llama(tie=True), "bf16", onednn=False)
    assert gen.model.lm_head.weight is gen.model.model.embed_tokens.weight and gen._head_copy is None


def test_fake_quant_simulates_a_tied_head_only_when_asked():
    grid = served_grid("torch", "int8")
    assert "lm_head" not in fake_quant_layers(tiny_llama(tie=True), grid, head=True)
    m = tiny_llama(tie=True)
    names = fake_quant_layers(m, grid, head=True, tied_head=True)
    assert "lm_head" in names and m.lm_head.weight is m.model.embed_tokens.weight  # still tied
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    w = m.lm_head.weight
    expected = torch.nn.functional.linear(x, decode(grid, encode(grid, w.detach())).to(w.dtype))
    assert torch.equal(m.lm_head(x), expected)
    ids = torch.tensor([[4, 9]])
    assert torch.equal(m.model.embed_tokens(ids), w.detach()[ids])  # the lookup reads the weight itself
