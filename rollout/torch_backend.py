"""Generator backend on plain torch + transformers (CPU here, CUDA where present).

Keeps a bf16 master copy of the policy and a quantized copy built from it; new weights go into the master and the
quantized copy is rebuilt, so the sender never needs to know the receiver's format.
"""
from __future__ import annotations

import copy
import time
import zlib
from typing import Iterable

import torch

from rollout.quant import linear_weight_bytes, quantize_model
from rollout.records import Completion, GroupRollout, PromptItem, SamplingParams


class WeightMismatchError(ValueError):
    pass


def load_into(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy a full set of (name, tensor) into `model`'s parameters; strict: every parameter exactly once, same shapes.
    Returns the number of tensors loaded. Shared by generators and the reference scorer."""
    params = dict(model.named_parameters())
    seen: set[str] = set()
    for name, t in named_tensors:
        if name not in params:
            raise WeightMismatchError(f"received weight {name!r} that this model does not have; is the stream from another model?")
        if tuple(t.shape) != tuple(params[name].shape):
            raise WeightMismatchError(
                f"weight {name!r}: received shape {tuple(t.shape)}, model has {tuple(params[name].shape)}"
            )
        with torch.no_grad():
            params[name].copy_(t)
        seen.add(name)
    missing = set(params) - seen
    if missing:
        raise WeightMismatchError(f"weight stream lacks {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
    return len(seen)


def format_prompt(tokenizer, item: PromptItem, chat_template: bool = True) -> list[int]:
    """A prompt item -> token ids. With a chat template (asked for, and the tokenizer has one): the item's history
    turns, then the question as the last user turn, then the assistant header. Otherwise plain text: every turn's text
    followed by a blank line, then the question, with the tokenizer's own special tokens."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": r, "content": c} for r, c in item.history] + [{"role": "user", "content": item.prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer("".join(f"{c}\n\n" for _, c in item.history) + item.prompt)["input_ids"]


class TorchGenerator:
    def __init__(self, model_path: str, precision: str = "bf16", group_size_quant: int = 64,
                 generator_id: str = "torch-0", seed: int = 0, device: str | None = None, initial_version: int = 0,
                 chat_template: bool = True):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.generator_id = generator_id
        self.precision = precision
        self.group_size_quant = group_size_quant
        self.policy_version = initial_version
        self.chat_template = chat_template
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.eos_id = self.tokenizer.eos_token_id
        self._master = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).to(self.device).eval()
        self._rebuild()
        self._seed = seed
        self._calls = 0

    def _rebuild(self) -> None:
        self.model = quantize_model(copy.deepcopy(self._master), self.precision, self.group_size_quant).eval()

    @torch.inference_mode()
    def generate(self, items: list[PromptItem], sampling: SamplingParams) -> list[GroupRollout]:
        G = sampling.group_size
        prompts, ids, attn = self._encode(items)
        # Seeded per call from (step seed, generator id): reproducible, and different on every actor.
        base = sampling.seed if sampling.seed is not None else self._seed * 1_000_003 + self._calls
        self._calls += 1
        rng = torch.Generator(self.device).manual_seed(zlib.crc32(f"{base}/{self.generator_id}".encode()))
        new, logp = self._sample(ids.to(self.device), attn.to(self.device), G, sampling, rng)  # [N*G, L] each
        groups = []
        for i, it in enumerate(items):
            comps = []
            for j in range(G):
                row = i * G + j  # prompt i's G completions are consecutive rows
                toks = new[row].tolist()
                if self.eos_id in toks:
                    n, reason = toks.index(self.eos_id) + 1, "stop"
                else:
                    n, reason = len(toks), "length"
                comps.append(Completion(
                    token_ids=toks[:n], logprobs=logp[row, :n].tolist(), finish_reason=reason,
                    text=self.tokenizer.decode(toks[:n], skip_special_tokens=True),
                ))
            groups.append(GroupRollout(item=it, prompt_ids=prompts[i], completions=comps,
                                       policy_version=self.policy_version, generator_id=self.generator_id,
                                       precision=self.precision))
        return groups

    def _encode(self, items: list[PromptItem]) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
        """Token ids of each prompt, and the prompts left-padded into ids/mask [N, P] so every row's last prompt token
        sits at the same column (positions come from the mask)."""
        prompts = [format_prompt(self.tokenizer, it, self.chat_template) for it in items]
        P = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), P), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), P), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, P - len(p):] = torch.tensor(p)
            attn[i, P - len(p):] = 1
        return prompts, ids, attn

    def _prefill(self, ids: torch.Tensor, attn: torch.Tensor):
        return self.model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                          use_cache=True, logits_to_keep=1)

    @torch.inference_mode()
    def prefill_seconds(self, items: list[PromptItem]) -> float:
        """Wall time of the prompts' forward alone (what `generate` does first), for benchmarks."""
        _, ids, attn = self._encode(items)
        t0 = time.perf_counter()
        self._prefill(ids.to(self.device), attn.to(self.device))
        return time.perf_counter() - t0

    def _sample(self, ids: torch.Tensor, attn: torch.Tensor, G: int, sp: SamplingParams,
                rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompts [N, P] -> sampled tokens and their log-probs [N*G, L] (CPU), L <= max_new_tokens.
        Rows that finished are padded after their EOS (log-prob 0)."""
        # Prefill each distinct prompt once, then copy its KV cache to its G rows (rows i*G .. i*G+G-1).
        out = self._prefill(ids, attn)
        cache = out.past_key_values
        cache.batch_repeat_interleave(G)
        attn = attn.repeat_interleave(G, dim=0)
        logits = out.logits[:, -1].float().repeat_interleave(G, dim=0)  # [B, V]
        B, L = attn.shape[0], sp.max_new_tokens
        toks = torch.full((B, L), self.pad_id, dtype=torch.long, device=ids.device)
        lps = torch.zeros((B, L), device=ids.device)
        rows = torch.arange(B, device=ids.device)  # output rows still decoding, in batch order
        for step in range(L):
            tok, lp = _pick(logits, sp, rng)
            toks[rows, step], lps[rows, step] = tok, lp
            live = tok != self.eos_id
            if step == L - 1 or not live.any():
                break
            if not live.all():  # drop finished rows from batch, mask and cache: they would only decode padding
                rows, tok, attn = rows[live], tok[live], attn[live]
                cache.batch_select_indices(live.nonzero().squeeze(-1))
            # One more mask column per step; the new token's position counts only real (unpadded) tokens.
            attn = torch.cat([attn, attn.new_ones(len(rows), 1)], dim=1)
            out = self.model(input_ids=tok[:, None], attention_mask=attn, position_ids=attn.sum(-1, keepdim=True) - 1,
                             past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1].float()
        return toks[:, :step + 1].cpu(), lps[:, :step + 1].cpu()

    def load_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_into(self._master, named_tensors)
        self._rebuild()
        self.policy_version = version

    def memory_bytes(self) -> dict[str, int]:
        linear = linear_weight_bytes(self.model)
        linear_ids = {id(m.weight) for m in self.model.modules() if hasattr(m, "weight") and _is_linear(m)}
        other = sum(p.numel() * p.element_size() for p in self.model.parameters() if id(p) not in linear_ids)
        return {"linear": linear, "total": linear + other}


def _is_linear(m) -> bool:
    return isinstance(m, torch.nn.Linear) or type(m).__name__ in ("Linear4bit", "Linear8bitLt")


def _pick(logits: torch.Tensor, sp: SamplingParams, rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] float32 -> (token [B], log-prob [B]) drawn from softmax(logits / T) after top-k and top-p (HF's
    order); the log-prob is of that filtered, renormalised distribution, i.e. the one actually sampled from.
    T = 0 is greedy, reported at T = 1 unfiltered."""
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
        u = torch.rand(cdf.shape[0], 1, generator=rng, device=cdf.device) * cdf[:, -1:]
        # First index whose cdf exceeds u: never a zero-probability (filtered) token, whose cdf equals its predecessor's.
        tok = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)
    # Only the sampled token's log-prob: never a [B, L, V] log-softmax.
    return tok, logits.gather(-1, tok[:, None]).squeeze(-1) - logits.logsumexp(-1)
