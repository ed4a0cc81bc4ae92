"""The bucketed fixed-shape decode loop that CUDA graphs replay (rollout/backends/torch_graphs.py), run eagerly on the
CPU: bucket choice, compaction into smaller buckets, sampled log-probs equal to the served model's forward (tiny-digits'
Llama, and a Qwen3 with per-head query/key norms), greedy output equal to the static decoder's, seeded
reproducibility, and the weights' fingerprint that decides a new capture. Its CUDA-graph replay is tested in
tests/test_cuda.py."""
import pytest
import torch

from qgrpo.core.records import PromptItem, SamplingParams
from qgrpo.rollout.backends import torch_graphs
from qgrpo.rollout.backends.torch_graphs import GraphDecoder, bucket_for


def test_bucket_choice():
    assert [bucket_for(n) for n in (1, 8, 9, 16, 17, 64, 65, 1000, 1024)] == [8, 8, 16, 16, 32, 64, 128, 1024, 1024]
    assert bucket_for(1025) == 2048 and bucket_for(3000) == 3072  # multiples of the largest bucket beyond it


ITEMS = [PromptItem(f"p{i}", f"{i}+{i + 1}=", str(2 * i + 1)) for i in (0, 5, 12)]


@pytest.fixture(scope="module")
def tiny_qwen3_path(tiny_model_path, tmp_path_factory) -> str:
    """tiny-digits' tokenizer on a random 2-layer Qwen3: 4 query heads of 32 on 2 key/value heads (q_proj's width 128,
    not the hidden 64), q/k norm weights around 1 (test_torch_decode._random_qk_norms). A decode step without the
    norms put sampled log-probs 0.29 nats off the forward's (measured, bf16 and int8), far past the tests' 0.05."""
    from transformers import AutoConfig, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from tests.test_torch_decode import _random_qk_norms

    out = tmp_path_factory.mktemp("tiny-qwen3")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=AutoConfig.from_pretrained(tiny_model_path).vocab_size, hidden_size=64,
                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2)
    model = Qwen3ForCausalLM(cfg)
    _random_qk_norms(model)
    model.to(torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(out)
    return str(out)


def _eager_graphs(tiny_model_path, precision="bf16", fused=True, compute_dtype="auto"):
    """A CPU generator whose decode goes through the graph loop's steps, run eagerly: torch_fused's step, or the
    static decoder's (`fused=False`, what `[rollout.torch] fused_step = false` records). Its float linears stay plain
    nn.Linears as on a GPU (`onednn` off: a CPU computing in float32 would pack them, and they would not be fused)."""
    from qgrpo.rollout.backends.torch_backend import TorchGenerator

    gen = TorchGenerator(tiny_model_path, precision=precision, compute_dtype=compute_dtype,
                         options={"onednn": False})
    gen.graphs = GraphDecoder(gen.model, gen.pad_id, gen.stop_ids, graphs=False, fused=fused)
    return gen


def _max_logprob_gap(gen, groups) -> float:
    """Largest |sampled log-prob - the served model's full forward log-prob| over every completion token."""
    from qgrpo.core.scoring import token_logprobs

    gaps = [0.0]
    for g in groups:
        for c in g.completions:
            ids = torch.tensor([g.prompt_ids + c.token_ids])
            ref = token_logprobs(gen.model, ids)[0, len(g.prompt_ids):].float()
            gaps += (ref - torch.tensor(c.logprobs)).abs().tolist()
    return max(gaps)


@pytest.mark.parametrize("fused", [True, False], ids=["fused_step", "static_step"])
@pytest.mark.parametrize("precision", ["bf16", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_sampled_logprobs_are_the_models_with_compaction(tiny_model_path, tiny_qwen3_path, arch, precision, fused,
                                                         monkeypatch):
    """24 rows decode in bucket 32; rows that stop move the live ones into smaller buckets (checked every 2 steps
    here); every sampled token's log-prob is that of the served model's own forward over prompt + completion."""
    gen = _eager_graphs(tiny_qwen3_path if arch == "qwen3" else tiny_model_path, precision, fused)
    monkeypatch.setattr(torch_graphs, "CHECK_EVERY", 2)
    buckets = []
    compact = gen.graphs._compact
    monkeypatch.setattr(gen.graphs, "_compact", lambda b, nb: buckets.append(nb) or compact(b, nb))
    groups = gen.generate(ITEMS, SamplingParams(group_size=8, max_new_tokens=20, temperature=1.0, seed=7))
    comps = [c for g in groups for c in g.completions]
    assert len(comps) == 24 and {c.finish_reason for c in comps} == {"stop", "length"}
    assert buckets and buckets == sorted(buckets, reverse=True) and buckets[-1] < 32
    assert _max_logprob_gap(gen, groups) < 0.05  # nats: bf16 rounding, cached decode vs full forward
    assert gen.decode_info()["loop"] == "static"  # eager steps: no graphs on a CPU
    assert gen.decode_info()["fused"] == fused and (gen.graphs.fused is None) == (not fused)


@pytest.mark.parametrize("fused", [True, False], ids=["fused_step", "static_step"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_output_is_the_static_decoders(tiny_model_path, tiny_qwen3_path, arch, fused):
    from qgrpo.rollout.backends.torch_backend import TorchGenerator

    path = tiny_qwen3_path if arch == "qwen3" else tiny_model_path
    sp = SamplingParams(group_size=2, max_new_tokens=16, temperature=0.0)
    static = TorchGenerator(path)
    assert static.decoder is not None  # the static decoder's loop, not transformers' forward
    want = static.generate(ITEMS, sp)
    got = _eager_graphs(path, fused=fused).generate(ITEMS, sp)
    for a, b in zip(want, got):
        assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
        for ca, cb in zip(a.completions, b.completions):
            assert max(abs(x - y) for x, y in zip(ca.logprobs, cb.logprobs)) < 0.05


def test_seeded_calls_reproduce_and_seeds_differ(tiny_model_path):
    gen = _eager_graphs(tiny_model_path)

    def run(seed):
        sp = SamplingParams(group_size=4, max_new_tokens=12, temperature=1.0, seed=seed)
        return [c.token_ids for g in gen.generate(ITEMS, sp) for c in g.completions]

    first = run(3)
    assert run(3) == first and run(4) != first


def test_buffers_grow_and_are_kept(tiny_model_path):
    gen = _eager_graphs(tiny_model_path)
    gen.generate(ITEMS[:1], SamplingParams(group_size=4, max_new_tokens=8, temperature=1.0, seed=0))
    small = gen.graphs.info()
    assert small["buffer_rows"] == 8 and small["buffer_width"] % torch_graphs.WIDTH_ROUND == 0
    gen.generate(ITEMS, SamplingParams(group_size=8, max_new_tokens=8, temperature=1.0, seed=0))
    assert gen.graphs.info()["buffer_rows"] == 32
    keys = gen.graphs.keys[0]
    gen.generate(ITEMS[:1], SamplingParams(group_size=4, max_new_tokens=8, temperature=1.0, seed=0))
    assert gen.graphs.keys[0] is keys  # a smaller call reuses the larger buffers (and their graphs)


@pytest.mark.parametrize("precision", ["bf16", "int8", "int4", "nf4"])
def test_a_sync_keeps_the_weights_addresses_and_adapters_change_them(tiny_model_path, precision):
    """A full sync re-quantizes into the storage a captured graph reads (bf16: copies into the fused projections'
    buffers): the fingerprint that decides a new capture stays, and the model computes the new weights. Wrapping
    adapters around the layers changes it, and the step then computes the wrapped layers."""
    from transformers import AutoModelForCausalLM

    gen = _eager_graphs(tiny_model_path, precision)
    before = gen.graphs._weights_fingerprint()
    new = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * p.float().std().clamp(min=1e-3).to(p.dtype))
    sp = SamplingParams(group_size=2, max_new_tokens=8, temperature=0.0)
    old_out = [c.token_ids for grp in gen.generate(ITEMS, sp) for c in grp.completions]
    gen.load_weights(1, [(n, p.detach()) for n, p in new.named_parameters()])
    assert gen.graphs._weights_fingerprint() == before
    groups = gen.generate(ITEMS, sp)
    assert [c.token_ids for grp in groups for c in grp.completions] != old_out
    assert _max_logprob_gap(gen, groups) < 0.05  # the new weights' log-probs
    lin = gen._linears
    name = next(n for n in lin if n.endswith("q_proj"))
    r = 2
    tensors = [(f"{name}.lora_A", torch.randn(r, lin[name][1])), (f"{name}.lora_B", torch.randn(lin[name][0], r))]
    fresh = _eager_graphs(tiny_model_path, precision)
    fp = fresh.graphs._weights_fingerprint()
    fresh.load_adapters(1, tensors)
    assert fresh.graphs._weights_fingerprint() != fp
    assert _max_logprob_gap(fresh, fresh.generate(ITEMS, SamplingParams(group_size=4, max_new_tokens=8,
                                                                       temperature=1.0, seed=1))) < 0.05


def test_projections_are_fused_into_views_of_one_buffer(tiny_model_path):
    """bf16: q, k, v (and gate, up) become row views of one buffer, so a sync's copy into a parameter reaches the
    product the step computes; a quantized model keeps its projections apart."""
    gen = _eager_graphs(tiny_model_path)
    layer, qkv, gate_up = gen.graphs.fused.layers[0]
    att = layer.self_attn
    assert qkv[0] == "float"
    buf = qkv[1]
    assert buf.shape[0] == att.q_proj.out_features + att.k_proj.out_features + att.v_proj.out_features
    assert att.k_proj.weight.data_ptr() == buf[att.q_proj.out_features].data_ptr() and gate_up is not None
    with torch.no_grad():
        att.k_proj.weight.add_(1.0)
    assert torch.equal(buf[att.q_proj.out_features:att.q_proj.out_features + att.k_proj.out_features],
                       att.k_proj.weight)
    assert torch_graphs.torch_fused.FusedLayers(gen.model, 1, 1, 2).layers[0][1][1] is buf  # kept, not rebuilt
    assert _eager_graphs(tiny_model_path, "int4").graphs.fused.layers[0][1:] == (None, None)
    int8 = _eager_graphs(tiny_model_path, "int8")
    layer, qkv, gate_up = int8.graphs.fused.layers[0]
    assert qkv[0] == "int8" and gate_up[0] == "int8"
    w = layer.self_attn.k_proj.weight
    assert w.qdata.data_ptr() == qkv[1][layer.self_attn.q_proj.out_features].data_ptr()
    assert layer.self_attn.k_proj._int8[0] is w.qdata  # its own forward reads the joint buffer too


def test_fp8_projections_are_fused_and_a_sync_reaches_them(tiny_model_path):
    """fp8 (W8A8, whose numerics torch's CPU `_scaled_mm` runs): q/k/v and gate/up codes and scales become row views of
    one buffer each and one fp8 product computes them; sampled log-probs are the served model's, and a sync's
    re-quantization (into the same storage) reaches the joint buffers. The same through the weight-only kernel of a
    decode step on CUDA: tests/test_w8_triton.py, in Triton's interpreter."""
    check_fp8_fused_decode_and_sync(tiny_model_path)


def check_fp8_fused_decode_and_sync(tiny_model_path, compute_dtype="auto") -> None:
    """The fp8 test above, on whichever route rollout/quantization/fp8.py takes for these activations."""
    from transformers import AutoModelForCausalLM

    from qgrpo.rollout.quantization import quant

    gen = _eager_graphs(tiny_model_path, compute_dtype=compute_dtype)
    gen.model._qgrpo_quant = ("bf16", 64)  # quantize the bf16 generator's model to fp8 on the CPU (tests only)
    gen.precision, gen._quantized = "fp8", quant.quantized_weight_names(gen.model, "fp8", 64, "cpu")
    quant._quantize_layers(gen.model, "fp8", 64, torch.device("cpu"))
    gen.graphs = GraphDecoder(gen.model, gen.pad_id, gen.stop_ids, graphs=False)
    layer, qkv, gate_up = gen.graphs.fused.layers[0]
    assert qkv[0] == "fp8" and gate_up[0] == "fp8"
    att = layer.self_attn
    assert att.v_proj.scale.data_ptr() == qkv[2][att.q_proj.out_features + att.k_proj.out_features].data_ptr()
    sp = SamplingParams(group_size=4, max_new_tokens=10, temperature=1.0, seed=2)
    assert _max_logprob_gap(gen, gen.generate(ITEMS, sp)) < 0.05
    before = gen.graphs._weights_fingerprint()
    codes = qkv[1].clone()
    new = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in new.parameters():
            p.neg_()
    gen.load_weights(1, [(n, p.detach()) for n, p in new.named_parameters()])
    assert gen.graphs._weights_fingerprint() == before and not torch.equal(qkv[1].float(), codes.float())
    assert _max_logprob_gap(gen, gen.generate(ITEMS, sp)) < 0.05
