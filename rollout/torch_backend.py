"""Generator backend on plain torch + transformers (CPU here, CUDA where present).

Keeps a bf16 master copy of the policy and a quantized copy built from it; new weights go into the master and the
quantized copy is rebuilt, so the sender never needs to know the receiver's format.
"""
from __future__ import annotations

import copy
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


def format_prompt(tokenizer, prompt: str, chat_template: bool = True) -> list[int]:
    """Prompt text -> token ids: as one user turn of the chat template when asked and the tokenizer has one,
    else the plain text with the tokenizer's own special tokens."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(prompt)["input_ids"]


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

    @torch.no_grad()
    def generate(self, items: list[PromptItem], sampling: SamplingParams) -> list[GroupRollout]:
        G = sampling.group_size
        prompts = [format_prompt(self.tokenizer, it.prompt, self.chat_template) for it in items]
        P = max(len(p) for p in prompts)
        # Left-pad so every row's last prompt token sits at the same column; generate derives positions from the mask.
        ids = torch.full((len(prompts), P), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), P), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, P - len(p):] = torch.tensor(p)
            attn[i, P - len(p):] = 1
        # Seeded per call from (step seed, generator id): reproducible, and different on every actor.
        base = sampling.seed if sampling.seed is not None else self._seed * 1_000_003 + self._calls
        self._calls += 1
        torch.manual_seed(zlib.crc32(f"{base}/{self.generator_id}".encode()))
        out = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=attn.to(self.device),
            # temperature 0 = greedy (evaluation); 0 = off for top_k (None would fall back to the model default of 50)
            **(dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
               if sampling.temperature > 0 else dict(do_sample=False, temperature=None, top_p=None, top_k=None)),
            max_new_tokens=sampling.max_new_tokens, num_return_sequences=G,
            pad_token_id=self.pad_id, eos_token_id=self.eos_id,
            return_dict_in_generate=True, output_scores=True,
        )
        new = out.sequences[:, P:].cpu()  # [N*G, L]
        # `scores` are the processed logits (after temperature/top-k/top-p): their log-softmax is the distribution
        # the tokens were drawn from.
        scores = torch.stack(out.scores, dim=1).float().cpu()  # [N*G, L, V]
        logp = torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)  # [N*G, L]
        groups = []
        for i, it in enumerate(items):
            comps = []
            for j in range(G):
                row = i * G + j  # generate repeats each prompt G times, consecutively
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
