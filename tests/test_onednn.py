"""The float32 CPU generator's unquantized linears on oneDNN's reordered weights (rollout/backends/onednn.py): each
product within 1e-5 relative of a float64 reference, the layers' weights held once (on the meta device beside the
packed copy), a tied head packed as a copy while the embedding keeps its tensor, a full update re-packing every
layer exactly as a generator started from the new weights, and quantized layers and adapters left as they were."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from qgrpo.rollout.backends import onednn
from qgrpo.rollout.backends.torch_backend import TorchGenerator
from qgrpo.rollout.quantization.quant import linear_weight_bytes
from tests.helpers import tiny_llama

pytestmark = pytest.mark.skipif(not onednn.available(), reason="this torch has no oneDNN linear")

IDS = [1, 5, 7, 9, 11, 3, 4, 8, 12]


@pytest.mark.parametrize("shape", [(2,), (3,), (8,), (2, 5)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_product_matches_float64(shape, bias):
    torch.manual_seed(0)
    lin = nn.Linear(96, 160, bias=bias)
    w64, b64 = lin.weight.detach().double(), None if lin.bias is None else lin.bias.detach().double()
    assert onednn.packable(lin)
    packed = onednn.pack_linears(lin)
    assert list(packed) == ["weight"] and lin.weight.device.type == "meta" and linear_weight_bytes(lin) == 160 * 96 * 4
    x = torch.randn(*shape, 96)
    with torch.inference_mode():
        y = lin(x)
    ref = nn.functional.linear(x.double(), w64, b64)
    assert y.dtype == torch.float32 and y.shape == ref.shape and torch.isfinite(y).all()
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    with torch.inference_mode():  # a bf16 input leaves in bf16
        assert lin(x.bfloat16()).dtype == torch.bfloat16


def test_only_plain_float32_cpu_linears_are_packable():
    assert not onednn.packable(nn.Linear(8, 8, dtype=torch.bfloat16))
    assert not onednn.packable(nn.Embedding(8, 8))
    lin = nn.Linear(8, 8)
    lin.forward = lambda x: x  # another module's forward in its place
    assert not onednn.packable(lin)


def _gen(path, model, precision="bf16", on=True):
    return TorchGenerator(path, precision=precision, model=copy.deepcopy(model), compute_dtype="fp32",
                          options={"onednn": on})


@pytest.mark.parametrize("tie", [False, True])
def test_the_generator_packs_its_linears_and_scores_as_before(tiny_model_path, tie):
    model = tiny_llama(tie=tie)
    on, off = _gen(tiny_model_path, model), _gen(tiny_model_path, model, on=False)
    assert off._packed == {}
    layers = [m for ms in on._packed.values() for m in ms]
    assert len(layers) == 15  # 2 layers x 7 products + the head
    assert all(m.weight.device.type == "meta" for m in layers)
    if tie:  # the head is packed from the embedding, which keeps its tensor for the lookup
        assert on._packed["model.embed_tokens.weight"] == [on.model.lm_head]
        assert on.model.model.embed_tokens.weight.device.type == "cpu"
    mem_on, mem_off = on.memory_bytes(), off.memory_bytes()
    assert mem_on["linear"] == mem_off["linear"]
    assert mem_on["total"] == mem_off["total"] + (64 * 128 * 4 if tie else 0)  # a tied head's copy
    a, b = on.score(IDS), off.score(IDS)
    assert all(abs(x - y) < 1e-4 for x, y in zip(a, b)), (a, b)


@pytest.mark.parametrize("tie", [False, True])
def test_an_update_repacks_as_a_fresh_generator_packs(tiny_model_path, tie):
    base, moved = tiny_llama(tie=tie), tiny_llama(seed=1, tie=tie)
    gen = _gen(tiny_model_path, base)
    before = gen.score(IDS)
    gen.load_weights(1, [(n, p.detach().clone()) for n, p in moved.named_parameters()])
    assert gen.score(IDS) == _gen(tiny_model_path, moved).score(IDS) != before
    if tie:
        assert torch.equal(gen.model.model.embed_tokens.weight, moved.model.embed_tokens.weight.float())
    served = onednn.served_state_dict(gen.model)  # the packed weights read back: exactly the received values
    for n, p in moved.state_dict().items():
        assert torch.equal(served[n], p.float()), n


def test_quantized_layers_stay_quantized_and_the_tied_head_is_packed(tiny_model_path):
    base, moved = tiny_llama(tie=True), tiny_llama(seed=1, tie=True)
    gen = _gen(tiny_model_path, base, "int8")
    assert list(gen._packed) == ["model.embed_tokens.weight"]  # the head alone: the rest is int8
    before = gen.score(IDS)
    gen.load_weights(1, [(n, p.detach().clone()) for n, p in moved.named_parameters()])  # re-quantizes beside it
    assert gen.score(IDS) == _gen(tiny_model_path, moved, "int8").score(IDS) != before


def test_adapters_wrap_packed_layers(tiny_model_path):
    gen = _gen(tiny_model_path, tiny_llama())
    before = gen.score(IDS)
    q = gen.model.model.layers[0].self_attn.q_proj
    stream = [("model.layers.0.self_attn.q_proj.lora_A", torch.randn(4, 128, dtype=torch.bfloat16)),
              ("model.layers.0.self_attn.q_proj.lora_B", torch.randn(128, 4, dtype=torch.bfloat16))]
    gen.load_adapters(1, stream)
    assert gen.model.model.layers[0].self_attn.q_proj.base is q and gen.score(IDS) != before


def test_the_fused_step_leaves_packed_layers_to_their_own_forward(tiny_model_path):
    """The graph loop's step (run eagerly here) joins plain linears into one buffer from their weights; packed ones
    have none, so each keeps its own product, and the sampled log-probs stay the served model's."""
    from qgrpo.core.records import PromptItem, SamplingParams
    from qgrpo.rollout.backends.torch_graphs import GraphDecoder

    gen = _gen(tiny_model_path, tiny_llama())
    gen.graphs = GraphDecoder(gen.model, gen.pad_id, gen.stop_ids, graphs=False)
    items = [PromptItem("p0", "1+2=", "3"), PromptItem("p1", "4+4=", "8")]
    (g0, g1) = gen.generate(items, SamplingParams(group_size=2, max_new_tokens=6, temperature=1.0, seed=3))
    assert gen.graphs.fused.layers[0][1:] == (None, None)
    for c in g0.completions + g1.completions:
        assert len(c.token_ids) > 0 and all(lp <= 0 and lp == lp for lp in c.logprobs)
