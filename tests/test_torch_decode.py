"""The torch generator's decode loop on a preallocated cache (rollout/backends/torch_decode.py) against the model's
own forward: the logits of every step, with left padding, grouped-query attention, biases in the projections (Qwen2),
per-head query/key norms and a head_dim of its own (Qwen3), finished rows compacted away, and quantized layers; and
which models take the path."""
import pytest
import torch

from qgrpo.core.records import PromptItem, SamplingParams
from qgrpo.rollout.backends import torch_decode
from qgrpo.rollout.backends.torch_decode import StaticDecoder

# The decoder's bf16 logits against a float32 full forward, relative to the largest logit: bf16 rounding of
# activations over two layers of large weights (transformers' own bf16 forward of the llama model: 1.9% off, the
# decoder 1.8%).
TOL = 0.05


def _off(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest difference relative to the largest reference logit."""
    return ((got - ref).abs().max() / ref.abs().max()).item()


def _model(kind: str, **extra):
    """A random 2-layer model of the given architecture: 4 query heads sharing 2 key/value heads; weights 10x the
    usual initialisation, so the logits depend strongly on every token and position. Qwen3: heads of 32 (q_proj's
    width 128, not the hidden 64) and q/k norm weights drawn around 1, so that a decode without them differs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    if kind == "qwen3":
        extra = {"head_dim": 32, **extra}  # Qwen3Config's default is 128
    cfg = AutoConfig.for_model(kind, vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                               initializer_range=0.2, **extra)  # large weights: logits that depend on the context
    model = AutoModelForCausalLM.from_config(cfg)
    _random_qk_norms(model)
    return model.to(torch.bfloat16).eval()


def _random_qk_norms(model) -> None:
    """Qwen3's q_norm / k_norm weights (initialised to ones) drawn from 1 + N(0, 0.5^2): a decode that skips the norms
    or swaps them computes other logits."""
    with torch.no_grad():
        for name, norm in model.named_modules():
            if name.endswith(("self_attn.q_norm", "self_attn.k_norm")):
                norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape))


def _prompts(n: int = 3):
    """n prompts of different lengths, left-padded: ids [n, P] and mask [n, P]."""
    lens = [5 + 3 * i for i in range(n)]
    P = max(lens)
    g = torch.Generator().manual_seed(1)
    ids = torch.zeros((n, P), dtype=torch.long)
    attn = torch.zeros((n, P), dtype=torch.long)
    for i, ln in enumerate(lens):
        ids[i, P - ln:] = torch.randint(1, 96, (ln,), generator=g)
        attn[i, P - ln:] = 1
    return ids, attn


def _reference(model, ids, attn, new):
    """float32 full forward of prompts (rows repeated G times) followed by `new` tokens [B, S]: the logits that
    predict each new token's successor, [B, S, V]."""
    G = new.shape[0] // ids.shape[0]
    full = torch.cat([ids.repeat_interleave(G, 0), new], 1)
    mask = torch.cat([attn.repeat_interleave(G, 0), torch.ones_like(new)], 1)
    ref = model.float()
    with torch.no_grad():
        out = ref(input_ids=full, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    model.to(torch.bfloat16)
    return out[:, ids.shape[1]:].float()


def _started(model, ids, attn, G, S, dec=None) -> StaticDecoder:
    """A decoder (`dec` or a new eager one) started on the prompts' prefill, for G rows each and S new tokens."""
    dec = dec or StaticDecoder(model)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                    use_cache=True, logits_to_keep=1)
    dec.start(out.past_key_values, attn, G, S)
    return dec


def _decode(model, ids, attn, new, G, dec=None):
    """The decoder's logits after each of `new`'s tokens, [B, S, V]."""
    dec = _started(model, ids, attn, G, new.shape[1], dec)
    return torch.stack([dec.step(new[:, s]) for s in range(new.shape[1])], 1)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "qwen3"])
def test_decode_logits_equal_the_full_forward(kind):
    model = _model(kind)
    assert StaticDecoder.supports(model)
    ids, attn = _prompts()
    G, S = 2, 6
    new = torch.randint(1, 96, (ids.shape[0] * G, S), generator=torch.Generator().manual_seed(2))
    got, ref = _decode(model, ids, attn, new, G), _reference(model, ids, attn, new)
    assert torch.isfinite(got).all()
    # The bar: transformers' own bf16 forward of the same model is this far from float32.
    G_ids = torch.cat([ids.repeat_interleave(G, 0), new], 1)
    mask = torch.cat([attn.repeat_interleave(G, 0), torch.ones_like(new)], 1)
    with torch.no_grad():
        hf = model(input_ids=G_ids, attention_mask=mask,
                   position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, ids.shape[1]:].float()
    assert _off(got, ref) < max(2 * _off(hf, ref), TOL), (_off(got, ref), _off(hf, ref))
    # A wrong decode is clearly detectable: position ids one off (rotary) moves the logits by far more.
    dec = _started(model, ids, attn, G, S)
    dec.pos = dec.pos + 1
    assert _off(dec.step(new[:, 0]), ref[:, 0]) > 5 * TOL


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_compaction_keeps_each_live_rows_logits(compiled):
    """Rows dropped from the buffers mid-way: the others' logits stay those of the full forward. Compiled
    (torch.compile, inductor: slow to compile), the batch size changes under the compiled step without a fallback."""
    model = _model("llama")
    ids, attn = _prompts()
    G, S = 4, 5
    B = ids.shape[0] * G
    new = torch.randint(1, 96, (B, S), generator=torch.Generator().manual_seed(3))
    ref = _reference(model, ids, attn, new)
    dec = _started(model, ids, attn, G, S, StaticDecoder(model, compiled=compiled))
    rows = torch.arange(B)
    few = torch.zeros(B, dtype=torch.bool)
    few[:B - 1] = True  # one row of 12 finished: above COMPACT_AT, it rides along
    assert dec.compact(few) is None and dec.keys[0].shape[0] == B
    for s in range(S):
        logits = dec.step(new[rows, s])
        assert dec.compile_error is None and torch.isfinite(logits).all()
        assert _off(logits, ref[rows, s]) < TOL
        if s == 1:  # half the rows finish: the buffers keep the other half
            live = torch.arange(len(rows)) % 2 == 0
            idx = dec.compact(live)
            assert idx is not None and dec.keys[0].shape[0] == len(idx) == B // 2
            rows = rows[idx]


def test_a_compile_that_fails_falls_back_to_the_eager_step():
    """Where torch.compile cannot run (no C++ compiler, an op inductor lacks), the first step says why and every step
    runs eager, with the eager decoder's logits."""
    model = _model("llama")
    ids, attn = _prompts()
    new = torch.randint(1, 96, (ids.shape[0] * 2, 4), generator=torch.Generator().manual_seed(4))
    dec = StaticDecoder(model, compiled=True)

    def no_compiler(*args):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    dec.compiled = no_compiler
    got = _decode(model, ids, attn, new, 2, dec)
    assert dec.compiled is None and "No working C++ compiler" in dec.compile_error
    assert torch.equal(got, _decode(model, ids, attn, new, 2))


def test_which_models_take_the_path():
    assert StaticDecoder.supports(_model("llama"))
    windowed = StaticDecoder(_model("mistral", sliding_window=8))
    assert windowed.fits(8) and not windowed.fits(9)  # past the window, full attention is not what Mistral computes
    assert not StaticDecoder.supports(_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0))
    assert StaticDecoder.supports(_model("qwen3"))
    assert not StaticDecoder.supports(_model("qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=0))
    assert not StaticDecoder.supports(_model("gpt2"))


@pytest.mark.parametrize("precision", ["bf16", "int8", "int4"])
def test_sampled_logprobs_are_those_of_the_models_forward(tiny_model_path, precision, monkeypatch):
    """Through the decoder, with quantized layers and rows finishing (and compacted away) at different steps, each
    sampled token's log-prob is that of the served model's own full forward over prompt + completion."""
    from qgrpo.core.scoring import token_logprobs
    from qgrpo.rollout.backends.torch_backend import TorchGenerator

    gen = TorchGenerator(tiny_model_path, precision=precision)
    assert gen.decoder is not None
    monkeypatch.setattr(torch_decode, "COMPACT_AT", 0.9)  # compact often
    compactions = []
    compact = gen.decoder.compact
    monkeypatch.setattr(gen.decoder, "compact", lambda live: compactions.append(compact(live)) or compactions[-1])
    items = [PromptItem(f"p{i}", f"{i}+{i + 1}=", str(2 * i + 1)) for i in (0, 5, 12)]
    groups = gen.generate(items, SamplingParams(group_size=8, max_new_tokens=20, temperature=1.0, seed=7))
    comps = [(g, c) for g in groups for c in g.completions]
    assert {c.finish_reason for _, c in comps} == {"stop", "length"}
    assert any(idx is not None for idx in compactions)
    diffs = []
    for g, c in comps:
        ids = torch.tensor([g.prompt_ids + c.token_ids])
        ref = token_logprobs(gen.model, ids)[0, len(g.prompt_ids):].float()
        diffs += (ref - torch.tensor(c.logprobs)).abs().tolist()
    assert max(diffs) < 0.05, max(diffs)  # nats: bf16 rounding, cached decode vs full forward


def test_a_lean_step_runs_the_small_operations_on_one_thread_and_computes_the_same(monkeypatch):
    # At few rows on a CPU the step runs norms and attention on one thread and the products on all of them
    # (torch_decode.LEAN_ROWS); the logits are the full-threaded step's, and the thread count comes back, also when
    # a layer raises.
    held = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = _model("qwen2").float()
        ids, attn = _prompts()
        G, S = 2, 4
        new = torch.randint(1, 96, (ids.shape[0] * G, S), generator=torch.Generator().manual_seed(2))
        monkeypatch.setattr(torch_decode, "LEAN_ROWS", 0)
        full = _decode(model, ids, attn, new, G)
        monkeypatch.setattr(torch_decode, "LEAN_ROWS", 16)
        dec = _started(model, ids, attn, G, S)  # the prompts' forward: all threads
        seen = {"norm": set(), "proj": set()}
        layer = model.model.layers[0]
        layer.input_layernorm.register_forward_hook(lambda *a: seen["norm"].add(torch.get_num_threads()))
        layer.self_attn.q_proj.register_forward_hook(lambda *a: seen["proj"].add(torch.get_num_threads()))
        lean = torch.stack([dec.step(new[:, s]) for s in range(S)], 1)
        assert seen == {"norm": {1}, "proj": {2}} and torch.get_num_threads() == 2
        assert torch.isfinite(lean).all() and _off(lean, full) < 1e-5, _off(lean, full)
        dec = _started(model, ids, attn, G, S)

        def boom(*a):
            raise RuntimeError("boom")

        monkeypatch.setattr(torch_decode, "apply_rotary_pos_emb", boom)
        with pytest.raises(RuntimeError, match="boom"):
            dec.step(new[:, 0])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(held)
