"""Quantization-aware learning (learner.fake_quant = "rollout"): the fake-quantized forward is the torch generator's
forward on the same weights up to its kernels, far closer than the bf16 forward is at int4, and the gradient passes
straight through the rounding."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qgrpo.core.grids import decode, encode
from qgrpo.core.scoring import token_logprobs
from qgrpo.learner.fake_quant import fake_quant_layers, fake_quantize
from qgrpo.rollout.backends import served_grid
from qgrpo.rollout.quantization.quant import quantize_model


@pytest.fixture(scope="module")
def tiny_bf16(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16).eval()


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_fake_quant_forward_is_the_generators_forward(tiny_bf16, precision):
    """Mean |log-prob gap| to the torch generator's quantized model on the same weights, nats per token: measured
    6.7e-4 (int4) and 7.7e-4 (int8) for the fake-quantized forward, against 1.7e-2 and 1.3e-3 for the bf16 one; the
    gap left is the kernels' (bf16 activations, the order of the sums)."""
    ids = torch.randint(3, tiny_bf16.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0))
    simulated = copy.deepcopy(tiny_bf16)
    names = fake_quant_layers(simulated, served_grid("torch", precision, 64), head=True)
    assert len(names) == 15 and "lm_head" in names  # 2 layers x 7 projections, and the untied head
    served = quantize_model(copy.deepcopy(tiny_bf16), precision, 64)
    with torch.no_grad():
        fq, gen, bf16 = (token_logprobs(m, ids).float() for m in (simulated, served, tiny_bf16))
    assert torch.isfinite(fq).all()
    gap, bf16_gap = (fq - gen).abs().mean().item(), (bf16 - gen).abs().mean().item()
    assert gap < 2e-3, gap
    if precision == "int4":
        assert gap < bf16_gap / 5, (gap, bf16_gap)


def test_fake_quant_rounds_forward_and_passes_the_gradient_straight_through():
    grid = served_grid("torch", "int4", 64)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(32, 128, generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
    x = torch.randn(5, 128, generator=g).to(torch.bfloat16)
    dout = torch.randn(5, 32, generator=g).to(torch.bfloat16)
    out = F.linear(x, fake_quantize(w, grid))
    expected = F.linear(x, decode(grid, encode(grid, w.detach())).to(torch.bfloat16))
    assert torch.equal(out, expected)  # the forward uses the generator's codes
    out.backward(dout)
    assert torch.equal(w.grad, (dout.T.float() @ x.float()).to(torch.bfloat16))  # d fq(w) / dw = 1
    assert w.grad.abs().sum() > 0


def test_tied_head_and_layers_off_the_grid_stay_bf16():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(16, 64)
            self.proj = nn.Linear(64, 64)
            self.odd = nn.Linear(48, 64)  # in_features not a multiple of the group
            self.head = nn.Linear(64, 16, bias=False)
            self.head.weight = self.embed.weight

        def get_input_embeddings(self):
            return self.embed

        def get_output_embeddings(self):
            return self.head

    assert fake_quant_layers(Tied(), served_grid("torch", "int4", 64), head=True) == ["proj"]
    untied = Tied()
    untied.head.weight = nn.Parameter(untied.head.weight.detach().clone())
    assert fake_quant_layers(untied, served_grid("vllm", "int8"), head=False) == ["proj", "odd"]  # vLLM: no head
