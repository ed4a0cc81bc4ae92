"""Per-token log-probs of given sequences: shared by the learner (policy, pi_old) and the reference scorer.

GRPO batches are groups: G completions of one prompt. When the caller says where prompts end and which rows share
one (`prompt_lens`, `group_ids`), each distinct prompt is run once and its KV cache is handed to every completion of
the group (`shared_prompt_logprobs`). Gradients flow back through the shared cache, so this is the same function as
the full forward, computed with far fewer tokens when prompts are long (few-shot prompts are ~140 tokens, completions
~20), and the output projection runs only where log-probs are needed.

The output projection and the softmax over the vocabulary run in chunks of `CHUNK_TOKENS` positions
(`head_logprobs`), each recomputed in the backward pass: the [B, T, vocab] float32 logits (~0.8 GB for 32 x 128
tokens of a 49k vocabulary, and as much again for their gradient) never exist at once. A plain nn.Linear head (every
model this project ships) goes through a hand-written forward and backward (`_LinearHeadLogprobs`): one shifted
exponential per chunk gives the log-probs and the entropy, and the backward forms the softmax's gradient in place,
instead of autograd's nodes for logsumexp, gather and softmax each over [chunk, vocab] (the head's softmax and gather
went from 1.95 s to 0.30 s of the learner's step at the TRL comparison's batch in `bench/learner_ops.py`, on a 2-core
CPU in fp32); any other head keeps the checkpointed autograd chunk.

With `with_entropy=True` the same functions also return the per-token entropy H = -sum_v p_v log p_v of that
distribution (softmax(logits / T), after the soft-cap), at the same positions and 0 where the log-prob is 0, with a
gradient through the same checkpointed chunks (for an entropy bonus in the loss). The default path is unchanged.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from qgrpo.core import kv_replay

CHUNK_TOKENS = 1024  # positions per chunk of the output projection: [1024, vocab] fp32 logits (~200 MB at 49k)
# Causal LMs whose forward is `lm_head(trunk(...))` (with an optional final tanh soft-cap); any other model is scored
# through its own forward, full logits at once.
_HEAD_AFTER_TRUNK = {"llama", "qwen2", "qwen3", "mistral", "nanochat", "smollm3"}


def _picked(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T)[target] as logit[target] - logsumexp(logits), float32; [..., V], [...] -> [...]."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _picked_entropy(logits: torch.Tensor, targets: torch.Tensor,
                    temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(`_picked`, entropy of softmax(logits / T)), float32; [..., V], [...] -> ([...], [...]). The log-probs are
    `_picked`'s bit for bit. H = logsumexp(z) - sum(softmax(z) * z) with z = logits / T shifted by its (detached) row
    max: H does not depend on the shift, and the shifted z keeps both terms small (no cancellation of two large
    numbers, no log(0))."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    picked = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
    z = z - z.amax(dim=-1, keepdim=True).detach()
    return picked, torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)


def _chunk_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                    softcap: float | None, with_entropy: bool = False):
    logits = head(hidden).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if with_entropy:
        return _picked_entropy(logits, targets, temperature)
    return _picked(logits, targets, temperature)


class _LinearHeadLogprobs(torch.autograd.Function):
    """log softmax(z)[target] and the entropy of softmax(z), z = softcap(h @ W^T + b) / T, for one chunk of positions
    of a plain nn.Linear head, with a hand-written backward: the [n, vocab] logits are recomputed there from the
    saved hidden states (as the checkpointed chunk did), but the softmax's gradient is formed in place in one buffer
    instead of through autograd's graph of logsumexp, gather, softmax and their backward nodes. Same values and
    gradients (float32 arithmetic, different rounding) as `_chunk_logprobs` under `checkpoint`."""

    @staticmethod
    def _logits(h, weight, bias, softcap):
        raw = torch.nn.functional.linear(h, weight, bias).float()
        if not softcap:
            return raw, None
        capped = torch.tanh(raw / softcap)
        return capped * softcap, capped

    @staticmethod
    def forward(ctx, h, weight, bias, targets, temperature, softcap, with_entropy):
        z, _ = _LinearHeadLogprobs._logits(h, weight, bias, softcap)
        if temperature != 1.0:
            z.div_(temperature)
        # Shifted by the row max: zs <= 0, the exponentials in (0, 1], no cancellation in the entropy.
        top = z.amax(dim=-1, keepdim=True)
        z.sub_(top)
        e = torch.exp(z)
        total = e.sum(-1)
        lse = torch.log(total)  # logsumexp of the shifted logits
        picked = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        entropy = lse - e.mul_(z).sum(-1) / total if with_entropy else None
        ctx.save_for_backward(h, weight, bias, targets, lse + top.squeeze(-1), entropy)
        ctx.temperature, ctx.softcap = temperature, softcap
        ctx.set_materialize_grads(False)
        return picked, entropy

    @staticmethod
    def backward(ctx, g_picked, g_entropy):
        h, weight, bias, targets, lse, entropy = ctx.saved_tensors
        if g_picked is None and g_entropy is None:
            return None, None, None, None, None, None, None
        z, capped = _LinearHeadLogprobs._logits(h, weight, bias, ctx.softcap)
        if ctx.temperature != 1.0:
            z.div_(ctx.temperature)
        logp = z.sub_(lse.unsqueeze(-1))
        # d picked / d z = onehot - p;  d H / d z = -p * (log p + H)
        if g_entropy is not None:
            grad = logp.add(entropy.unsqueeze(-1)).mul_(-g_entropy.unsqueeze(-1))  # -g_H (log p + H)
            p = logp.exp_()
            grad.mul_(p)
            if g_picked is not None:
                grad.sub_(p.mul_(g_picked.unsqueeze(-1)))
        else:
            grad = logp.exp_().mul_(-g_picked.unsqueeze(-1))
        if g_picked is not None:
            grad.scatter_add_(-1, targets.unsqueeze(-1), g_picked.unsqueeze(-1).to(grad.dtype))
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        if capped is not None:
            grad.mul_(1 - capped * capped)
        grad = grad.to(h.dtype)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        return (grad @ weight if need_h else None, grad.t() @ h if need_w else None,
                grad.sum(0) if need_b and bias is not None else None, None, None, None, None)


def _plain_linear(head) -> bool:
    """Whether `head` computes exactly F.linear(x, weight, bias): a plain nn.Linear without a replaced forward (the
    learner's fake-quant), hooks, or parametrizations (whose class is not nn.Linear)."""
    return type(head) is torch.nn.Linear and "forward" not in vars(head) \
        and not head._forward_hooks and not head._forward_pre_hooks


def split_head(model):
    """(trunk, head, softcap) of a causal LM whose logits are `head(trunk(...).last_hidden_state)`, else None
    (also under ZeRO-3, where the model's own forward runs). Works through a DeepSpeed engine (`.module`)."""
    m = getattr(model, "module", model)
    if hasattr(m, "get_base_model"):  # a peft model: its transformers model, with the adapters injected in its layers
        m = m.get_base_model()
    config = getattr(m, "config", None)
    if getattr(config, "model_type", None) not in _HEAD_AFTER_TRUNK:
        return None
    trunk, head = getattr(m, getattr(m, "base_model_prefix", ""), None), m.get_output_embeddings()
    if trunk is None or head is None:
        return None
    if hasattr(head.weight, "ds_id"):
        # ZeRO-3 partitions the head's weight: calling the head once per chunk (and again in the recomputation)
        # gave a gradient norm 8% off the one-rank value at two ranks (tests/test_multirank.py); one call it is.
        return None
    return trunk, head, getattr(config, "final_logit_softcapping", None)


def head_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                  softcap: float | None = None, chunk: int = CHUNK_TOKENS, *,
                  with_entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax(head(hidden) / T)[targets], [..., H] and [...] -> [...] float32, `chunk` positions at a time.
    With gradients on, each chunk's logits are recomputed in the backward pass instead of being kept.
    `with_entropy`: (log-probs, entropies), both [...] float32."""
    shape = targets.shape
    h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    grad = torch.is_grad_enabled() and hidden.requires_grad
    fused = _plain_linear(head)
    parts = []
    for i in range(0, h.shape[0], chunk):
        if fused:
            lp, ent = _LinearHeadLogprobs.apply(h[i:i + chunk], head.weight, head.bias, t[i:i + chunk], temperature,
                                                softcap, with_entropy)
            parts.append((lp, ent) if with_entropy else lp)
            continue
        args = (head, h[i:i + chunk], t[i:i + chunk], temperature, softcap) + ((True,) if with_entropy else ())
        parts.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False) if grad else _chunk_logprobs(*args))
    if not with_entropy:
        return torch.cat(parts).reshape(shape) if parts else torch.zeros(shape, device=hidden.device)
    if not parts:
        return torch.zeros(shape, device=hidden.device), torch.zeros(shape, device=hidden.device)
    return tuple(torch.cat(p).reshape(shape) for p in zip(*parts))


def _forward_logprobs(model, input_ids: torch.Tensor, targets: torch.Tensor, temperature: float,
                      with_entropy: bool = False, **kwargs) -> tuple[torch.Tensor | tuple, object]:
    """Log-probs of `targets` [B, L-1] given `input_ids` [B, L] (position j predicts targets[:, j]), and the
    model output (for its cache): through the chunked head when the model allows, else its full logits.
    `with_entropy`: the first item is (log-probs, entropies)."""
    parts = split_head(model)
    if parts is None:
        out = model(input_ids=input_ids, **kwargs)
        pick = _picked_entropy if with_entropy else _picked
        return pick(out.logits[:, :-1], targets, temperature), out
    trunk, head, softcap = parts
    out = trunk(input_ids=input_ids, **kwargs)
    h = out.last_hidden_state[:, :-1]
    return head_logprobs(head, h, targets, temperature, softcap, with_entropy=with_entropy), out


def token_logprobs(model, input_ids: torch.Tensor, temperature: float = 1.0, prompt_lens: torch.Tensor | None = None,
                   group_ids: torch.Tensor | None = None, pad_id: int = 0, *, with_entropy: bool = False,
                   seq_lens: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, T] (right-padded) -> log-probs [B, T] float32; position j = log p(token j | tokens < j) of the
    distribution softmax(logits / temperature), the one the generators sample from. Position 0 has no prediction.

    With `prompt_lens` [B] (and optionally `group_ids` [B]: rows with equal ids have the same prompt), positions before
    a row's prompt end are 0 and only completion positions are scored, through `shared_prompt_logprobs`; with
    `seq_lens` [B] too (each row's prompt + completion tokens), a group's completions are packed into one row there.

    Padding: given `seq_lens`, every path (plain, padded or packed shared-prompt) returns 0 at positions at or past a
    row's length; without them the plain and padded passes cannot tell padding from tokens and return the pad
    tokens' log-probs there, for the caller to mask with its completion mask (`zero_past_ends`).

    `with_entropy`: (log-probs, entropies), both [B, T] float32; entropy j is that of the distribution predicting
    token j, 0 wherever the log-prob is 0 by construction (position 0, prompt positions), with gradients.
    """
    if prompt_lens is not None:
        return shared_prompt_logprobs(model, input_ids, prompt_lens, group_ids, temperature, pad_id,
                                      with_entropy=with_entropy, seq_lens=seq_lens)
    if seq_lens is not None:
        seq_lens = checked_seq_lens(seq_lens, input_ids.shape[1], device=input_ids.device)
    picked, _ = _forward_logprobs(model, input_ids, input_ids[:, 1:], temperature, with_entropy)  # [B, T-1]
    out = tuple(torch.nn.functional.pad(x, (1, 0)) for x in (picked if with_entropy else (picked,)))
    out = tuple(zero_past_ends(x, seq_lens) for x in out) if seq_lens is not None else out
    return out if with_entropy else out[0]


def checked_seq_lens(seq_lens: torch.Tensor, T: int, prompt_lens: torch.Tensor | None = None,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """`seq_lens` [B] as int64 on `device`, after checking each lies between its row's prompt length (0 without
    prompts) and the batch width `T`: a length outside the row would score padding or drop tokens silently."""
    seq_lens = seq_lens.to(device).long()
    low = 0 if prompt_lens is None else prompt_lens.to(seq_lens.device).long()
    if bool((seq_lens < low).any()) or bool((seq_lens > T).any()):
        raise ValueError(f"scoring: seq_lens must lie between the prompt lengths (or 0) and the width {T}")
    return seq_lens


def zero_past_ends(x: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """x [B, T] with positions at or past each row's length (`seq_lens` [B]: its prompt + completion tokens) set to
    0: the padding holds 0 in every scoring path that is told the rows' lengths, as the packed pass leaves it.
    Differentiable (the masked positions get no gradient)."""
    keep = torch.arange(x.shape[1], device=x.device) < seq_lens.to(x.device)[:, None]
    return x.masked_fill(~keep, 0)


def shared_prompt_logprobs(model, input_ids: torch.Tensor, prompt_lens: torch.Tensor,
                           group_ids: torch.Tensor | None = None, temperature: float = 1.0,
                           pad_id: int = 0, *, with_entropy: bool = False,
                           seq_lens: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Completion log-probs with each distinct prompt run once.

    1. prefix pass: prompt tokens but the last, one row per group, left-padded, `use_cache=True`;
    2. the cache is indexed out to the rows (differentiable: gradients of all G rows add up in the prefix);
    3. suffix pass: each row's last prompt token + completion, on top of its group's cache; its logits score the
       completion tokens, so the output projection never runs on prompt positions.
    Rows of one group must have identical prompts (checked on lengths; the tokens are the caller's contract).
    `with_entropy`: (log-probs, entropies), both [B, T], entropies placed (and 0) as the log-probs are.

    With `seq_lens` (each row's prompt + completion tokens, right padding excluded), step 3 is padding-free where the
    model allows (`packs`): each group's suffixes are laid end to end in one row on top of its own cache entry, a
    block-causal mask keeping each completion to its prompt and itself (`_packed_suffix`). No FLOP goes to the right
    padding of short completions, only to the difference between groups' total lengths. Same values (within the
    arithmetic's rounding) and gradients as the padded suffix pass, which with `seq_lens` (where the model does not
    pack) also returns 0 at positions at or past each row's length; without `seq_lens` those hold the pad tokens'
    log-probs.
    """
    B, T = input_ids.shape
    dev = input_ids.device
    prompt_lens = prompt_lens.to(dev).long()
    if group_ids is None:
        group_ids = torch.arange(B, device=dev)
    uniq, row_group = torch.unique(group_ids.to(dev), return_inverse=True)  # row_group [B]: index into uniq
    N = len(uniq)
    first = torch.full((N,), B, device=dev).scatter_reduce(0, row_group, torch.arange(B, device=dev), "amin")
    group_len = prompt_lens[first]  # [N] prompt length of each group
    if not torch.equal(group_len[row_group], prompt_lens):
        raise ValueError("shared_prompt_logprobs: rows with the same group id have different prompt lengths")
    if int(prompt_lens.min()) < 1 or int(prompt_lens.max()) > T:
        raise ValueError(f"shared_prompt_logprobs: prompt lengths must be in 1..{T}")
    if seq_lens is not None:
        seq_lens = checked_seq_lens(seq_lens, T, prompt_lens, dev)

    K = int(group_len.max()) - 1  # prefix width: longest prompt minus its last token
    replay = kv_replay.replayable(model)  # caches that gradient checkpointing may replay (core/kv_replay.py)
    cache, prefix_mask = None, torch.zeros((N, 0), dtype=torch.long, device=dev)
    if K > 0:
        prefix = torch.full((N, K), pad_id, dtype=torch.long, device=dev)
        prefix_mask = torch.zeros((N, K), dtype=torch.long, device=dev)
        for g in range(N):
            n = int(group_len[g]) - 1
            if n > 0:
                prefix[g, K - n:] = input_ids[first[g], :n]
                prefix_mask[g, K - n:] = 1
        pos = (prefix_mask.cumsum(-1) - 1).clamp(min=0)
        parts = split_head(model)  # the prefix's logits are never needed: run the trunk alone where possible
        given = kv_replay.prefix_cache() if replay else None
        kw = dict(input_ids=prefix, attention_mask=prefix_mask, position_ids=pos, use_cache=True,
                  **({"past_key_values": given} if replay else {}))
        out = parts[0](**kw) if parts else model(**kw, logits_to_keep=1)
        # Under checkpointing transformers turns use_cache off, and some models (Qwen2, Qwen3) then return no cache
        # although their layers filled the one given: the replay cache is read from our own reference.
        cache = given if replay else out.past_key_values
    if seq_lens is not None and packs(model, K + T):
        if replay and cache is not None:
            cache = kv_replay.suffix_cache(cache)
        return _packed_suffix(model, input_ids, prompt_lens, seq_lens, row_group, N, cache,
                              prefix_mask, temperature, pad_id, with_entropy)
    if cache is not None:  # [N, ...] -> [B, ...]
        if replay:
            cache = kv_replay.suffix_cache(cache, row_group)
        else:
            cache.batch_select_indices(row_group)

    L = T - int(prompt_lens.min()) + 1  # longest suffix: last prompt token + completion (+ right padding)
    suffix = torch.full((B, L), pad_id, dtype=torch.long, device=dev)
    for b in range(B):
        s = input_ids[b, int(prompt_lens[b]) - 1:]
        suffix[b, :len(s)] = s
    attn = torch.cat([prefix_mask[row_group], torch.ones((B, L), dtype=torch.long, device=dev)], dim=1)
    pos = (prompt_lens - 1).unsqueeze(1) + torch.arange(L, device=dev)  # [B, L] positions continue the prompt's
    kwargs = {"past_key_values": cache} if cache is not None else {}
    # picked[b, j] scores token P_b + j: [B, L-1]
    picked, _ = _forward_logprobs(model, suffix, suffix[:, 1:], temperature, with_entropy, attention_mask=attn,
                                  position_ids=pos, use_cache=cache is not None, **kwargs)
    # Place at columns P_b .. P_b + L - 2; columns past T (suffix padding) land in the slack and are cut off.
    idx = prompt_lens.unsqueeze(1) + torch.arange(L - 1, device=dev)

    def place(x: torch.Tensor) -> torch.Tensor:
        x = torch.zeros((B, T + L), dtype=x.dtype, device=dev).scatter(1, idx, x)[:, :T]
        return x if seq_lens is None else zero_past_ends(x, seq_lens)  # the packed pass's zeros at the padding

    return tuple(place(x) for x in picked) if with_entropy else place(picked)


# Model types whose transformers implementation takes a custom 4D attention mask as given (masking_utils), under the
# eager and SDPA attention implementations; flash-attention kernels take no such mask, so those pad instead.
_PACKS = {"llama", "qwen2", "qwen3", "mistral", "smollm3"}


def packs(model, width: int) -> bool:
    """Whether `shared_prompt_logprobs` may pack `model`'s suffixes (contexts up to `width` tokens): a model type in
    _PACKS, eager or SDPA attention, every layer attending in full (no sliding window within `width`)."""
    cfg = kv_replay.model_config(model)
    if getattr(cfg, "model_type", None) not in _PACKS or getattr(cfg, "_attn_implementation", None) not in (
            "eager", "sdpa"):
        return False
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        return False
    window = getattr(cfg, "sliding_window", None)
    return window is None or width <= window


def _packed_suffix(model, input_ids, prompt_lens, seq_lens, row_group, N, cache, prefix_mask, temperature, pad_id,
                   with_entropy):
    """Step 3 of `shared_prompt_logprobs` without padding: group g's rows (in row order) each contribute their last
    prompt token + completion, end to end in row g of a [N, S] batch on top of the group's cache [N, K]. Token i of
    row g sees the prefix's real tokens and the tokens of its own segment up to itself; positions continue each
    row's prompt. Padding queries (past a group's end) see only themselves. `seq_lens` checked by the caller;
    positions outside each row's completion are 0 (nothing is placed there)."""
    B, T = input_ids.shape
    dev = input_ids.device
    seg_len = seq_lens - prompt_lens + 1  # last prompt token + completion
    offset, fill = [0] * B, [0] * N
    for b in range(B):  # rows keep their order within the group
        g = int(row_group[b])
        offset[b], fill[g] = fill[g], fill[g] + int(seg_len[b])
    S = max(fill)
    packed = torch.full((N, S), pad_id, dtype=torch.long, device=dev)
    pos = torch.zeros((N, S), dtype=torch.long, device=dev)
    seg = torch.full((N, S), -1, dtype=torch.long, device=dev)
    for b in range(B):
        g, o, n, p = int(row_group[b]), offset[b], int(seg_len[b]), int(prompt_lens[b])
        packed[g, o:o + n] = input_ids[b, p - 1:p - 1 + n]
        pos[g, o:o + n] = torch.arange(p - 1, p - 1 + n, device=dev)
        seg[g, o:o + n] = b
    real = seg >= 0
    own = (seg[:, :, None] == seg[:, None, :]) & real[:, :, None] & torch.ones(S, S, dtype=torch.bool,
                                                                                 device=dev).tril()
    own |= torch.eye(S, dtype=torch.bool, device=dev)  # padding queries attend to themselves alone
    allowed = torch.cat([prefix_mask.bool()[:, None, :] & real[:, :, None], own], dim=-1)  # [N, S, K + S]
    dtype = getattr(getattr(model, "module", model), "dtype", torch.float32)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=dev).masked_fill(~allowed, torch.finfo(dtype).min)
    kwargs = {"past_key_values": cache} if cache is not None else {}
    picked, _ = _forward_logprobs(model, packed, packed[:, 1:], temperature, with_entropy,
                                  attention_mask=mask[:, None], position_ids=pos, use_cache=cache is not None,
                                  **kwargs)  # [N, S-1]: picked[g, i] scores packed[g, i + 1]
    # Row b's completion token j (column P_b + j) is scored at packed column offset_b + j of its group's row.
    src, dst = [], []
    for b in range(B):
        g, o, p, c = int(row_group[b]), offset[b], int(prompt_lens[b]), int(seg_len[b]) - 1
        src += range(g * (S - 1) + o, g * (S - 1) + o + c)
        dst += range(b * T + p, b * T + p + c)
    src_t, dst_t = torch.tensor(src, device=dev, dtype=torch.long), torch.tensor(dst, device=dev, dtype=torch.long)

    def place(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1).index_select(0, src_t)
        return torch.zeros(B * T, dtype=x.dtype, device=dev).index_add(0, dst_t, flat).reshape(B, T)

    return tuple(place(x) for x in picked) if with_entropy else place(picked)
