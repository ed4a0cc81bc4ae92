"""Shared-prompt scoring equals the plain full forward: same completion log-probs and same gradients."""
import pytest
import torch

from qgrpo.core.scoring import token_logprobs


def _model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
    m = LlamaForCausalLM(cfg).float()
    for p in m.parameters():  # larger weights than the default init: log-probs far from uniform
        p.data.normal_(0, 0.2)
    return m


def _groups(seed: int = 0, pad: int = 0):
    """3 groups with prompts of lengths 1, 5 and 9 and 2-4 completions of lengths 1..6, right-padded."""
    g = torch.Generator().manual_seed(seed)
    rows, plens, gids = [], [], []
    for gid, (plen, n) in enumerate([(5, 3), (9, 2), (1, 4)]):
        prompt = torch.randint(1, 97, (plen,), generator=g).tolist()
        for _ in range(n):
            clen = int(torch.randint(1, 7, (1,), generator=g))
            rows.append(prompt + torch.randint(1, 97, (clen,), generator=g).tolist())
            plens.append(plen)
            gids.append(gid)
    T = max(map(len, rows))
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), T)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, plens[i]:len(r)] = 1
    return ids, mask, torch.tensor(plens), torch.tensor(gids)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prompt_matches_full_forward(temperature):
    model = _model()
    ids, mask, plens, gids = _groups()
    full = token_logprobs(model, ids, temperature) * mask
    shared = token_logprobs(model, ids, temperature, prompt_lens=plens, group_ids=gids)
    assert torch.isfinite(shared).all()
    assert (shared[mask == 0][(torch.arange(ids.shape[1]) < plens[:, None])[mask == 0]] == 0).all()  # prompts: 0
    torch.testing.assert_close(shared * mask, full, atol=2e-5, rtol=0)
    # Every row its own group (no sharing) gives the same numbers too.
    alone = token_logprobs(model, ids, temperature, prompt_lens=plens)
    torch.testing.assert_close(alone * mask, full, atol=2e-5, rtol=0)


@pytest.mark.parametrize("packed", [False, True])
def test_shared_prompt_gradients_match_full_forward(packed):
    """The shared-prompt pass, padded or with each group's completions packed into one row (seq_lens): the full
    forward's gradients."""
    ids, mask, plens, gids = _groups(1)
    adv = torch.linspace(-1, 1, ids.shape[0])[:, None]
    grads = []
    shared = {"prompt_lens": plens, "group_ids": gids}
    for kw in ({}, {**shared, "seq_lens": plens + mask.sum(-1).long()} if packed else shared):
        model = _model()
        model.config._attn_implementation = "eager"
        loss = (token_logprobs(model, ids, 1.0, **kw) * mask * adv).sum()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(grads[1][name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_shared_prompt_rejects_mismatched_group():
    ids, mask, plens, gids = _groups()
    bad = plens.clone()
    bad[0] += 1
    with pytest.raises(ValueError, match="different prompt lengths"):
        token_logprobs(_model(), ids, prompt_lens=bad, group_ids=gids)


def _reference_logprobs(model, ids, temperature):
    """The plain definition: the model's own full logits, softmax at T, picked (no chunking, no trunk split)."""
    logits = model(input_ids=ids).logits[:, :-1].float() / temperature
    return torch.nn.functional.pad(torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0], (1, 0))


def _nanochat(seed: int = 0):
    """nanochat's head soft-caps its logits (tanh): the chunked head must apply it as the model's forward does."""
    from transformers import NanoChatConfig, NanoChatForCausalLM

    torch.manual_seed(seed)
    cfg = NanoChatConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         final_logit_softcapping=3.0)
    m = NanoChatForCausalLM(cfg).float()
    for p in m.parameters():
        p.data.normal_(0, 0.2)
    return m


@pytest.mark.parametrize("make", [_model, _nanochat])
@pytest.mark.parametrize("shared", [False, True])
def test_chunked_head_equals_full_logits(make, shared, monkeypatch):
    """Chunks of 7 positions (so chunks cut across rows) give the full-logits values and the same gradients."""
    import qgrpo.core.scoring as scoring

    ids, mask, plens, gids = _groups()
    adv = torch.linspace(-1, 1, ids.shape[0])[:, None]
    kw = {"prompt_lens": plens, "group_ids": gids} if shared else {}
    model = make()
    assert scoring.split_head(model) is not None
    want = _reference_logprobs(model, ids, 0.7) * mask
    (want * adv).sum().backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    monkeypatch.setattr(scoring, "CHUNK_TOKENS", 7)
    monkeypatch.setattr(scoring.head_logprobs, "__defaults__", (1.0, None, 7))
    got = token_logprobs(model, ids, 0.7, **kw) * mask
    (got * adv).sum().backward()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    for p, g in zip(model.parameters(), want_grads):
        torch.testing.assert_close(p.grad, g, atol=2e-5, rtol=1e-4)


def test_no_full_vocabulary_logits_tensor(monkeypatch):
    """Scoring 24 sequences never creates a tensor as large as [B, T, vocab] (forward or backward): the logits live
    one chunk at a time. Fails if the head is run over all positions at once."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import qgrpo.core.scoring as scoring

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    from transformers import LlamaConfig, LlamaForCausalLM

    V = 2000  # the vocabulary dominates, as in real models (49k vs a hidden size of 576)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (24, 40), generator=g)  # 936 positions: chunks of 128 hold 1/7 of the logits
    monkeypatch.setattr(scoring.head_logprobs, "__defaults__", (1.0, None, 128))
    with Largest():
        lp = token_logprobs(model, ids, 1.0)
        lp.sum().backward()
    full = 24 * 39 * V
    assert Largest.numel > 0
    assert Largest.numel < full, f"a tensor of {Largest.numel} elements: the full logits are {full}"


def test_eager_attention_equals_sdpa_with_shared_prompts():
    """learner.attention = "auto" picks eager on a CPU learner: the shared-prompt forward (left-padded prefix with a
    mask, cache, suffix) must give the same log-probs and gradients under it as under SDPA."""
    ids, mask, plens, gids = _groups()
    out = {}
    for impl in ("sdpa", "eager"):
        model = _model()
        model.config._attn_implementation = impl
        lp = token_logprobs(model, ids, 0.7, prompt_lens=plens, group_ids=gids) * mask
        lp.sum().backward()
        out[impl] = (lp.detach(), [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(out["eager"][0], out["sdpa"][0], atol=2e-5, rtol=1e-5)
    for a, b in zip(out["eager"][1], out["sdpa"][1]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def _reference_entropy(model, ids, temperature, dtype=torch.float32):
    """The plain definition: entropy of Categorical(model's own full logits / T), padded to [B, T] (position 0: 0)."""
    logits = model(input_ids=ids).logits[:, :-1].to(dtype) / temperature
    return torch.nn.functional.pad(torch.distributions.Categorical(logits=logits).entropy(), (1, 0))


@pytest.mark.parametrize("make,path", [(_model, "chunked"), (_model, "full"), (_nanochat, "chunked")])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_equals_full_logits_reference(make, path, shared, temperature, monkeypatch):
    """with_entropy=True: entropies equal Categorical(full logits / T).entropy() (atol 1e-5, float32) wherever a
    log-prob is scored and are 0 elsewhere; the gradient of sum(entropy * w) equals the reference's (atol 1e-5,
    rtol 1e-4); the log-probs are those of with_entropy=False, bit for bit. Chunks of 7 positions cut across rows;
    path "full" is the model's own logits (split_head None)."""
    import qgrpo.core.scoring as scoring

    ids, mask, plens, gids = _groups(2)
    kw = {"prompt_lens": plens, "group_ids": gids} if shared else {}
    scored = torch.arange(ids.shape[1]) >= (plens[:, None] if shared else torch.ones(len(ids), 1))  # [B, T]
    w = torch.randn(ids.shape, generator=torch.Generator().manual_seed(3))
    model = make()
    want = _reference_entropy(model, ids, temperature) * scored
    (want * w).sum().backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    monkeypatch.setattr(scoring.head_logprobs, "__defaults__", (1.0, None, 7))
    if path == "full":
        monkeypatch.setattr(scoring, "split_head", lambda model: None)
    lp, ent = token_logprobs(model, ids, temperature, **kw, with_entropy=True)
    assert ent.dtype == lp.dtype == torch.float32 and ent.shape == lp.shape == ids.shape
    assert torch.isfinite(ent).all() and (ent[~scored] == 0).all() and (lp[~scored] == 0).all()
    torch.testing.assert_close(ent, want, atol=1e-5, rtol=0)
    (ent * w).sum().backward()
    for (name, p), g in zip(model.named_parameters(), want_grads):
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-4, msg=name)
    with torch.no_grad():
        assert torch.equal(lp.detach(), token_logprobs(model, ids, temperature, **kw))


def test_with_entropy_false_is_the_plain_tensor():
    """with_entropy=False (and the default) return one tensor, the same bits as the entropy path's log-probs;
    head_logprobs over no positions returns zeros of the input shape, both with and without entropy."""
    import qgrpo.core.scoring as scoring

    ids, mask, plens, gids = _groups()
    model = _model()
    for kw in ({}, {"prompt_lens": plens, "group_ids": gids}):
        plain = token_logprobs(model, ids, 0.7, **kw)
        off = token_logprobs(model, ids, 0.7, **kw, with_entropy=False)
        on = token_logprobs(model, ids, 0.7, **kw, with_entropy=True)
        assert isinstance(off, torch.Tensor) and isinstance(on, tuple) and len(on) == 2
        assert torch.equal(off, plain) and torch.equal(on[0], plain)
    head, hidden = model.lm_head, torch.zeros(2, 0, 64)
    targets = torch.zeros(2, 0, dtype=torch.long)
    assert scoring.head_logprobs(head, hidden, targets).shape == (2, 0)
    assert [t.shape for t in scoring.head_logprobs(head, hidden, targets, with_entropy=True)] == [(2, 0), (2, 0)]


def test_entropy_no_nan_with_large_logits():
    """Head weights x1000 (logits over a thousand, near one-hot distributions): entropies and their gradients are
    finite, >= 0, and equal a float64 reference (atol 1e-4)."""
    ids, mask, plens, gids = _groups()
    model = _model()
    with torch.no_grad():
        model.lm_head.weight.mul_(1000)
    for kw in ({}, {"prompt_lens": plens, "group_ids": gids}):
        model.zero_grad()
        lp, ent = token_logprobs(model, ids, 0.7, **kw, with_entropy=True)
        assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and (ent >= 0).all()
        ent.sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        with torch.no_grad():
            want = _reference_entropy(model, ids, 0.7, torch.float64).float() * (ent != 0)
        torch.testing.assert_close(ent.detach(), want, atol=1e-4, rtol=0)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_plain_linear_head_equals_the_autograd_chunk(dtype, softcap, temperature):
    """A plain nn.Linear head (with a bias here) is scored by the hand-written forward and backward
    (_LinearHeadLogprobs): log-probs, entropies and the gradients of h, W and b from a loss on both equal the
    checkpointed autograd chunk's (float32: atol 1e-5; bf16 inputs: atol 2e-2 on log-probs, the gradients within 2% of
    their largest entry), across chunks of 5 positions; nothing is NaN."""
    import qgrpo.core.scoring as scoring

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(32, 61).to(dtype)
    with torch.no_grad():
        head.weight.normal_(0, 0.5, generator=g)
        head.bias.normal_(0, 0.5, generator=g)
    h0 = torch.randn(3, 7, 32, generator=g).to(dtype)
    t = torch.randint(0, 61, (3, 7), generator=g)
    wl, we = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    out = {}
    for fused in (True, False):
        head.zero_grad()
        h = h0.clone().requires_grad_()
        if not fused:
            head.register_forward_hook(lambda *a: None)  # any hook: the autograd chunk
        assert scoring._plain_linear(head) is fused
        lp, ent = scoring.head_logprobs(head, h, t, temperature, softcap, 5, with_entropy=True)
        ((lp * wl).sum() + (ent * we).sum()).backward()
        out[fused] = [x.detach().float() for x in (lp, ent, h.grad, head.weight.grad, head.bias.grad)]
    for name, a, b in zip(("logp", "entropy", "dh", "dW", "db"), out[True], out[False]):
        assert torch.isfinite(a).all() and torch.isfinite(b).all(), name
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
        else:
            tol = 2e-2 if name in ("logp", "entropy") else 0.02 * float(b.abs().max())
            torch.testing.assert_close(a, b, atol=tol, rtol=0, msg=name)


def test_fused_head_is_used_only_for_a_head_that_is_plain_linear():
    """The hand-written head applies only where the module computes F.linear(x, W, b) itself: not after the
    learner's fake-quant replaced its forward (whose values it would skip), not with hooks, not for other modules."""
    import qgrpo.core.scoring as scoring
    from qgrpo.learner.fake_quant import fake_quant_layers
    from qgrpo.rollout.backends import served_grid

    assert scoring._plain_linear(torch.nn.Linear(4, 8))
    assert not scoring._plain_linear(torch.nn.Sequential(torch.nn.Linear(4, 8)))
    hooked = torch.nn.Linear(4, 8)
    hooked.register_forward_pre_hook(lambda *a: None)
    assert not scoring._plain_linear(hooked)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    assert fake_quant_layers(model, served_grid("torch", "int8", 64), head=True) == ["0"]
    assert not scoring._plain_linear(model[0])


def _seq_lens(mask, plens):
    return plens + mask.sum(-1).long()


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_suffixes_equal_the_full_forward(impl, temperature):
    """With seq_lens each group's completions run end to end in one row (no right padding): log-probs, entropies
    and the zeros outside the completions as the full forward and the padded shared-prompt pass have them."""
    from qgrpo.core.scoring import packs

    model = _model()
    model.config._attn_implementation = impl
    ids, mask, plens, gids = _groups(pad=5)  # padding with a real token id: only seq_lens says where rows end
    seq_lens = _seq_lens(mask, plens)
    assert packs(model, ids.shape[1] + 8)
    full = token_logprobs(model, ids, temperature) * mask
    packed, ent = token_logprobs(model, ids, temperature, prompt_lens=plens, group_ids=gids, seq_lens=seq_lens,
                                 with_entropy=True)
    assert torch.isfinite(packed).all() and (packed[mask == 0] == 0).all() and (ent[mask == 0] == 0).all()
    torch.testing.assert_close(packed, full, atol=2e-5, rtol=0)
    _, ent_padded = token_logprobs(model, ids, temperature, prompt_lens=plens, group_ids=gids, with_entropy=True)
    torch.testing.assert_close(ent, ent_padded * mask, atol=2e-5, rtol=0)


def test_packing_is_skipped_where_the_model_takes_no_custom_mask():
    """Models outside the list, flash attention, or a sliding window inside the context: the padded suffix pass,
    same numbers."""
    from qgrpo.core.scoring import packs

    ids, mask, plens, gids = _groups()
    seq_lens = _seq_lens(mask, plens)
    nano = _nanochat()
    assert not packs(nano, 64)
    got = token_logprobs(nano, ids, 1.0, prompt_lens=plens, group_ids=gids, seq_lens=seq_lens) * mask
    torch.testing.assert_close(got, token_logprobs(nano, ids, 1.0) * mask, atol=2e-5, rtol=0)
    model = _model()
    model.config._attn_implementation = "flash_attention_2"
    assert not packs(model, 64)
    model.config._attn_implementation = "sdpa"
    model.config.sliding_window = 16
    assert packs(model, 16) and not packs(model, 17)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_every_path_given_seq_lens_holds_zero_at_the_padding(with_entropy, monkeypatch):
    """Given the rows' lengths, the padded shared-prompt pass (packing refused), the packed pass and the plain full
    pass return the same tensor, padding included: 0.0 at every position at or past a row's length (the pad id is a
    real token, so the padded passes would otherwise score it there). Without seq_lens the padded pass cannot tell
    padding from tokens and scores the pad tokens (what consumers mask with their completion mask)."""
    import qgrpo.core.scoring as scoring

    model = _model()
    model.config._attn_implementation = "sdpa"
    ids, mask, plens, gids = _groups(pad=5)
    seq_lens = _seq_lens(mask, plens)
    pad = torch.arange(ids.shape[1]) >= seq_lens[:, None]
    assert pad.any() and scoring.packs(model, 2 * ids.shape[1])
    shared = {"prompt_lens": plens, "group_ids": gids, "seq_lens": seq_lens, "with_entropy": with_entropy}

    def both(x):  # (log-probs, entropies) either way
        return x if with_entropy else (x,)

    packed = both(token_logprobs(model, ids, 0.7, **shared))
    plain = both(token_logprobs(model, ids, 0.7, seq_lens=seq_lens, with_entropy=with_entropy))
    unmasked = both(token_logprobs(model, ids, 0.7, prompt_lens=plens, group_ids=gids, with_entropy=with_entropy))
    monkeypatch.setattr(scoring, "packs", lambda *a: False)
    padded = both(token_logprobs(model, ids, 0.7, **shared))
    for p, q, f, u in zip(packed, padded, plain, unmasked):
        assert torch.isfinite(p).all() and (p[pad] == 0).all() and (q[pad] == 0).all() and (f[pad] == 0).all()
        assert (u[pad] != 0).any()  # the pass without lengths scores the pad tokens
        torch.testing.assert_close(q, p, atol=2e-5, rtol=0)
        torch.testing.assert_close(q, u * ~pad, atol=0, rtol=0)  # the padding zeroed, nothing else changed
        torch.testing.assert_close(f * mask, p, atol=2e-5, rtol=0)  # the plain pass: the same completions


def test_packed_suffixes_refuse_lengths_outside_the_rows():
    ids, mask, plens, gids = _groups()
    with pytest.raises(ValueError, match="seq_lens"):
        token_logprobs(_model(), ids, prompt_lens=plens, group_ids=gids, seq_lens=plens - 1)
    with pytest.raises(ValueError, match="seq_lens"):  # the padded and plain passes check them too
        token_logprobs(_nanochat(), ids, prompt_lens=plens, group_ids=gids, seq_lens=plens - 1)
    with pytest.raises(ValueError, match="seq_lens"):
        token_logprobs(_model(), ids, seq_lens=torch.full_like(plens, ids.shape[1] + 1))
