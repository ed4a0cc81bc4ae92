"""Shared-prompt scoring equals the plain full forward: same completion log-probs and same gradients."""
import pytest
import torch

from core.scoring import token_logprobs


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


def test_shared_prompt_gradients_match_full_forward():
    ids, mask, plens, gids = _groups(1)
    adv = torch.linspace(-1, 1, ids.shape[0])[:, None]
    grads = []
    for kw in ({}, {"prompt_lens": plens, "group_ids": gids}):
        model = _model()
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
