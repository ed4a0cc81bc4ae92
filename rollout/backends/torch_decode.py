"""The torch generator's decode loop for Llama-family models, on a preallocated KV cache.

transformers' forward with its dynamic cache spent most of a decode step outside the matrix products (SmolLM2-135M,
batch 64, 100-token context, CPU: 49% in scaled-dot-product attention of one query token, 13% concatenating the
cache, 30% in the products; docs/performance.md). Here, as in gpt-fast:

- the cache is one [rows, kv_heads, prompt + max_new_tokens, head_dim] buffer per layer and side, written in place
  at the step's column: no concatenation;
- attention of the step's one token is two batched matrix products per layer over the filled columns, the query heads
  of a key/value head grouped into one product (grouped-query attention without repeating the keys), the softmax in
  float32, left padding and finished prompts' columns masked by an additive bias;
- the layers' own modules (norms, projections, MLP; quantized or wrapped with adapters, whatever the generator holds)
  do the rest, so the decode computes what the model's forward computes.

Prefill stays the model's own forward (each distinct prompt once, `TorchGenerator._prefill`); its cache is copied into
the buffers, G rows per prompt. Rows that finished are dropped by compacting the buffers once the live rows fall to
`COMPACT_AT` of the buffer: finished rows cost decode work until then, a compaction costs a copy of the cache.

`StaticDecoder.supports(model)` says which models take this path (architectures whose layers follow Llama's:
llama, qwen2, mistral, all layers with full attention) and `fits(width)` whether a batch stays inside Mistral's
attention window; the generator falls back to transformers' forward for the others.
The logits agree with that forward's to bf16 rounding (tests/test_torch_decode.py).
"""
from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # Qwen2's and Mistral's are the same

# Model types whose decoder layers are Llama's: input_layernorm -> self_attn (q/k/v/o_proj, rotary, GQA) -> residual
# -> post_attention_layernorm -> mlp -> residual; model.norm, lm_head. Qwen2 adds q/k/v biases (inside the Linear).
SUPPORTED = ("llama", "qwen2", "mistral")
COMPACT_AT = 0.75  # compact the cache when live rows fall to this share of its rows


class StaticDecoder:
    def __init__(self, model):
        cfg = model.config
        self.model = model
        self.layers = list(model.model.layers)
        self.q_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5
        self.window = getattr(cfg, "sliding_window", None)  # Mistral's; Qwen2 sets it only when layers use it

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
                dst.append(buf)
        # Additive mask over the columns, [rows, 1, 1, width]: -inf on left padding; generated columns open as they
        # are written.
        self.bias = torch.zeros((rows, 1, 1, width), dtype=torch.float32, device=attn.device)
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
        m = self.model.model
        x = m.embed_tokens(tokens[:, None])  # [B, 1, hidden]
        cos, sin = m.rotary_emb(x, self.pos[:, None])  # [B, 1, head_dim]
        col = self.col
        bias = self.bias[..., :col + 1]  # generated columns were never masked
        b, g = x.shape[0], self.q_heads // self.kv_heads
        for i, layer in enumerate(self.layers):
            att = layer.self_attn
            h = layer.input_layernorm(x)
            q = att.q_proj(h).view(b, self.q_heads, 1, self.head_dim)
            k = att.k_proj(h).view(b, self.kv_heads, 1, self.head_dim)
            v = att.v_proj(h).view(b, self.kv_heads, 1, self.head_dim)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            self.keys[i][:, :, col:col + 1] = k
            self.values[i][:, :, col:col + 1] = v
            keys, values = self.keys[i][:, :, :col + 1], self.values[i][:, :, :col + 1]
            q = q.view(b, self.kv_heads, g, self.head_dim)  # the query heads of each key/value head, together
            scores = torch.matmul(q, keys.transpose(-1, -2)).float() * self.scale + bias  # [B, kv, g, col+1]
            o = torch.matmul(scores.softmax(-1).to(values.dtype), values)  # [B, kv, g, head_dim]
            x = x + att.o_proj(o.reshape(b, 1, self.q_heads * self.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.col += 1
        self.pos = self.pos + 1
        return self.model.lm_head(m.norm(x))[:, 0].float()

