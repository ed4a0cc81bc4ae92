"""The torch generator's decode loop for Llama-family models, on a preallocated KV cache.

transformers' forward with its dynamic cache spent most of a decode step outside the matrix products (SmolLM2-135M,
batch 64, 100-token context, CPU: 49% in scaled-dot-product attention of one query token, 13% concatenating the
cache, 30% in the products; docs/performance.md). Here, as in gpt-fast:

- the cache is one [rows, kv_heads, prompt + max_new_tokens, head_dim] buffer per layer and side, written in place
  at the step's column: no concatenation;
- attention of the step's one token is two batched matrix products per layer over all the buffer's columns, the
  query heads of a key/value head grouped into one product (grouped-query attention without repeating the keys), the
  softmax in float32, left padding and the columns not yet written masked by an additive bias: every step has the
  same shapes (and reads the cache contiguously, which ran faster than attending over a slice of it), so that
  torch.compile can take a step whole. `compiled=True` does; it is off: on a 2-core CPU inductor compiled the 135M
  model's step in ~2 minutes for 12% at bf16 and failed on the int8 kernel (docs/performance.md);
- the layers' own modules (norms, projections, MLP; quantized or wrapped with adapters, whatever the generator holds)
  do the rest, so the decode computes what the model's forward computes.

Prefill stays the model's own forward (each distinct prompt once, `TorchGenerator._prefill`); its cache is copied into
the buffers, G rows per prompt. Rows that finished are dropped by compacting the buffers once the live rows fall to
`COMPACT_AT` of the buffer: finished rows cost decode work until then, a compaction costs a copy of the cache.

`StaticDecoder.supports(model)` says which models take this path (architectures whose layers follow Llama's:
llama, qwen2, mistral, qwen3, all layers with full attention) and `fits(width)` whether a batch stays inside Mistral's
attention window; the generator falls back to transformers' forward for the others.
The logits agree with that forward's to bf16 rounding (tests/test_torch_decode.py).
"""
from __future__ import annotations

import contextlib

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # Qwen2's and Mistral's are the same

# Model types whose decoder layers are Llama's: input_layernorm -> self_attn (q/k/v/o_proj, rotary, GQA) -> residual
# -> post_attention_layernorm -> mlp -> residual; model.norm, lm_head. Qwen2 adds q/k/v biases (inside the Linear);
# Qwen3 an RMSNorm over head_dim of each query and key head (self_attn.q_norm, k_norm) before the rotary, and a
# head_dim of its own (q_proj's width need not be the hidden size).
SUPPORTED = ("llama", "qwen2", "mistral", "qwen3")
COMPACT_AT = 0.75  # compact the cache when live rows fall to this share of its rows
LEAN_ROWS = 16  # on a CPU, steps of at most this many rows run their small operations on one thread (_fixed_step)


class StaticDecoder:
    def __init__(self, model, compiled: bool = False):
        """`compiled`: decode steps through one torch.compile'd graph (`_fixed_step`), else eager (`step`'s own)."""
        cfg = model.config
        self.model = model
        self.layers = list(model.model.layers)
        self.q_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5
        self.window = getattr(cfg, "sliding_window", None)  # Mistral's; Qwen2 sets it only when layers use it
        self.compiled = torch.compile(_fixed_step, fullgraph=True, dynamic=True) if compiled else None
        self.compile_error: str | None = None  # why a compiled decoder fell back to eager steps
        # torch_fused.FusedLayers of the model, or None: steps through torch_fused's step (q/k/v and gate/up one
        # product each) instead of `_fixed_step`. Set by bench/model_ladder.py's int8/fused variant; it reads the
        # projections as they were when it was made, so a generator whose modules change must not keep it.
        self.fused = None

    def fits(self, width: int) -> bool:
        """Whether a prompt + completion of `width` tokens stays inside the attention window (if any), where full
        attention, which this decoder computes, is what the model computes."""
        return self.window is None or width <= self.window

    @staticmethod
    def supports(model) -> bool:
        """Whether `model` (a transformers causal LM) takes this decode path."""
        cfg = getattr(model, "config", None)
        if getattr(cfg, "model_type", None) not in SUPPORTED:
            return False
        if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
            return False  # layers with a sliding window (Qwen2's use_sliding_window): the forward's masks apply
        inner = getattr(model, "model", None)
        return all(hasattr(inner, a) for a in ("layers", "norm", "embed_tokens", "rotary_emb")) and all(
            hasattr(layer, "self_attn") and hasattr(layer.self_attn, "q_proj") for layer in inner.layers)

    def start(self, cache, attn: torch.Tensor, group: int, max_new: int) -> None:
        """Take over the prefill's cache (transformers' DynamicCache of N prompts, left-padded to P columns, `attn`
        [N, P] their mask): each prompt's keys and values copied to its `group` rows of new [N*group, kv_heads,
        P + max_new, head_dim] buffers."""
        n, p = attn.shape
        rows, width = n * group, p + max_new
        self.keys, self.values = [], []
        for layer in cache.layers:
            for src, dst in ((layer.keys, self.keys), (layer.values, self.values)):
                buf = src.new_empty((rows, self.kv_heads, width, self.head_dim))
                buf[:, :, :p] = src.repeat_interleave(group, dim=0)
                buf[:, :, p:] = 0  # attention reads every column: no garbage (NaN) behind the mask
                dst.append(buf)
        # Additive mask over the columns, [rows, 1, 1, width]: -inf on left padding and on the generated columns
        # until each is written.
        self.bias = torch.full((rows, 1, 1, width), float("-inf"), dtype=torch.float32, device=attn.device)
        self.bias[:, 0, 0, :p] = torch.where(attn.repeat_interleave(group, dim=0) > 0, 0.0, float("-inf"))
        self.pos = attn.sum(-1).repeat_interleave(group)  # each row's next position (real tokens before it)
        self.col = p  # the column the next token's keys and values go to

    def compact(self, live: torch.Tensor) -> torch.Tensor | None:
        """`live` (bool, one per buffer row): the rows that go on decoding. Once they are at most COMPACT_AT of the
        buffer's rows, the buffers keep those rows alone and their indices are returned (the caller keeps its own
        per-row state in step); else None, and finished rows ride along (their output unread)."""
        idx = live.nonzero().squeeze(-1)
        if len(idx) > COMPACT_AT * len(live):
            return None
        for bufs in (self.keys, self.values):
            for i, buf in enumerate(bufs):
                bufs[i] = buf.index_select(0, idx)
        self.bias, self.pos = self.bias[idx], self.pos[idx]
        return idx

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step: `tokens` [rows] (one per buffer row) -> float32 logits [rows, vocab] of the next token."""
        col = torch.tensor([self.col], device=tokens.device)
        args = (self.model, self.layers, tokens, col, self.pos, self.keys, self.values, self.bias, self.q_heads,
                self.kv_heads, self.head_dim, self.scale)
        logits = None
        if self.compiled is not None:
            try:
                logits = self.compiled(*args)
            except Exception as e:  # noqa: BLE001 - no compiler, an unsupported op: the eager step computes the same
                self.compile_error = f"{type(e).__name__}: {e}"
                self.compiled = None
        if logits is None and self.fused is not None:
            from qgrpo.rollout.backends import torch_fused

            logits = torch_fused.step(self.model, self.fused, *args[2:])
        if logits is None:
            threads = torch.get_num_threads()
            lean = threads if (tokens.device.type == "cpu" and threads > 1 and len(tokens) <= LEAN_ROWS) else None
            logits = _fixed_step(*args, lean=lean)
        self.col += 1
        self.pos = self.pos + 1
        return logits


class _OneThread:
    """Runs its block on one thread and gives the products back `threads` (StaticDecoder.step's `lean`)."""

    def __init__(self, threads: int):
        self.threads = threads

    def __enter__(self):
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.threads)


def _fixed_step(model, layers, tokens, col, pos, keys, values, bias, q_heads, kv_heads, head_dim, scale,
                lean: int | None = None):
    """One decode step (StaticDecoder.step), written as a graph of fixed shapes that torch.compile takes whole: the
    step's keys, values and mask column are written at `col` (a 1-element tensor, not a Python int: no recompile per
    column) and attention runs over every column of the buffers, those not yet written masked by `bias`.

    `lean` (a CPU's thread count, at few rows): everything but the layers' products (norms, rotary, attention) runs
    on one thread, the products on `lean`. At few rows those small operations cost less than waking the other
    threads for each of them, which on a VM under OMP_WAIT_POLICY=PASSIVE takes longer than the work
    (docs/performance.md, "The decode step's small operations on one thread")."""
    few = _OneThread(lean) if lean else contextlib.nullcontext()
    m = model.model
    x = m.embed_tokens(tokens[:, None])
    cos, sin = m.rotary_emb(x, pos[:, None])
    bias.index_fill_(-1, col, 0.0)
    b, g = x.shape[0], q_heads // kv_heads
    for i, layer in enumerate(layers):
        att = layer.self_attn
        with few:
            h = layer.input_layernorm(x)
        q = att.q_proj(h).view(b, q_heads, 1, head_dim)
        k = att.k_proj(h).view(b, kv_heads, 1, head_dim)
        v = att.v_proj(h).view(b, kv_heads, 1, head_dim)
        with few:
            if getattr(att, "q_norm", None) is not None:  # Qwen3: each head RMS-normed over head_dim, then rotated
                q, k = att.q_norm(q), att.k_norm(k)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys[i].index_copy_(2, col, k)
            values[i].index_copy_(2, col, v)
            q = q.view(b, kv_heads, g, head_dim)
            scores = torch.matmul(q, keys[i].transpose(-1, -2)).float() * scale + bias
            o = torch.matmul(scores.softmax(-1).to(values[i].dtype), values[i])
        x = x + att.o_proj(o.reshape(b, 1, q_heads * head_dim))
        with few:
            h = layer.post_attention_layernorm(x)
        x = x + layer.mlp(h)
    with few:
        x = m.norm(x)
    return model.lm_head(x)[:, 0].float()


def pick(logits: torch.Tensor, sp, u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] float32 -> (token [B], log-prob [B]) drawn from softmax(logits / T) after top-k and top-p (HF's
    order) with the uniforms `u` [B] in [0, 1) (one per row; None at T = 0, which is greedy, reported at T = 1
    unfiltered); the log-prob is of that filtered, renormalised distribution, i.e. the one actually sampled from.
    Only tensor operations of fixed shapes, no host synchronisation: a CUDA graph captures it (torch_graphs.py)."""
    if sp.temperature <= 0:
        tok = logits.argmax(-1)
    else:
        logits = logits / sp.temperature
        if 0 < sp.top_k < logits.shape[-1]:
            kth = logits.topk(sp.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if sp.top_p < 1.0:
            # Drop a token when the more likely tokens already hold top_p of the mass; the top token always stays.
            srt, idx = logits.sort(-1, descending=True)
            probs = srt.softmax(-1)
            drop = (probs.cumsum(-1) - probs) >= sp.top_p
            drop[:, 0] = False
            logits = logits.scatter(-1, idx, srt.masked_fill(drop, float("-inf")))
        # Inverse-CDF draw: one uniform per row. torch.multinomial draws an exponential per vocab entry (single
        # threaded with a generator), which cost more than the decode forward itself at vocab 49k.
        cdf = logits.softmax(-1).cumsum(-1)
        # First index whose cdf exceeds u: never a zero-probability (filtered) token, whose cdf equals its
        # predecessor's.
        tok = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)
    # Only the sampled token's log-prob: never a [B, L, V] log-softmax.
    return tok, logits.gather(-1, tok[:, None]).squeeze(-1) - logits.logsumexp(-1)
