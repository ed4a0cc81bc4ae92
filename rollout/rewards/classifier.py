"""A reward model: a sequence classifier with one output that scores a prompt and its completion, formatted as a chat
with the classifier's own template, as TRL's RewardTrainer trains them. Hosted on Ray by actors/reward_model_actor.py.

The score is the logit at the last token that is not the pad token, which is where transformers'
*ForSequenceClassification reads it given `config.pad_token_id`; sequences are padded on the right with exactly that
id, so a batch scores as its rows would one by one (positions unchanged, pads after the read position and masked).

Precisions: bf16 (weights and compute), fp32, and int8 (bf16 weights quantized by the generators' own path,
rollout/quantization/quant.py: torchao weight-only int8 per output channel, the one-row score head included) on CPU and
CUDA. int4/nf4 are not offered: the score head and a reward's small differences between completions are what matter
here.

This module imports neither torch nor transformers at import: the config schema reads RM_PRECISIONS from it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from qgrpo.rollout.modeling.models import (  # noqa: F401 (re-exported)
    TINY_CHAT_TEMPLATE,
    build_tiny_reward,
    resolve_model_path,
)
from qgrpo.rollout.options import QUANT_SERVED

RM_PRECISIONS = ("bf16", "fp32", "int8")
CLASSIFIER_BUILTINS = ("tiny-reward",)  # the builtin models (rollout/modeling/models.py) that are reward models
FIELD = "reward_model.path"
_FIX = ("point reward_model.path at a sequence classifier with one output (a folder saved from "
        "AutoModelForSequenceClassification with num_labels = 1, e.g. a reward model trained by TRL's RewardTrainer), "
        "or builtin:tiny-reward for a test")


def rm_served(device: str) -> tuple[str, ...]:
    """The precisions a reward model scores at on `device` ("cpu" or "cuda"): bf16 and fp32 need no quantizer; int8
    where the quantizer it shares with the torch generators (rollout/quantization/quant.py, QUANT_SERVED) runs it. Read
    by the config's rule, so what this module runs is what the config allows."""
    return tuple(p for p in RM_PRECISIONS if p in ("bf16", "fp32") or p in QUANT_SERVED.get(device, ()))


def _labels(cfg: dict) -> int:
    """How many outputs a saved config declares: id2label's size, else num_labels, else transformers' default 2."""
    if isinstance(cfg.get("id2label"), dict):
        return len(cfg["id2label"])
    n = cfg.get("num_labels")
    return n if isinstance(n, int) else 2


def classifier_problems(path: str, field: str = FIELD) -> list[str]:
    """Why the model folder `path` cannot be a reward model, read from its config.json alone (no weights loaded):
    it must be a *ForSequenceClassification with one label, and carry tokenizer files. [] when it can."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return [f"{field}: folder {path!r} does not exist; {_FIX}"]
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        return [f"{field}: {path!r} has no config.json; it must be a Hugging Face model folder (save_pretrained); "
                f"{_FIX}"]
    except (OSError, ValueError) as e:
        return [f"{field}: {path!r}: config.json is not readable JSON ({e}); {_FIX}"]
    archs = [a for a in cfg.get("architectures") or [] if isinstance(a, str)]
    out = []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        if any(a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for a in archs):
            found = f"a causal LM ({', '.join(archs)})"
        else:
            found = f"architectures {archs}" if archs else "no `architectures` in config.json"
        out.append(f"{field}: {path!r} is not a sequence classifier: found {found}; a reward model scores each "
                   f"completion with one number; {_FIX} (a causal LM can judge only through a reward function of "
                   "your own)")
    elif (n := _labels(cfg)) != 1:
        out.append(f"{field}: {path!r} is a classifier with {n} labels (id2label {cfg.get('id2label')}); a reward "
                   f"model has exactly one output, the score; {_FIX}")
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        out.append(f"{field}: {path!r} has no tokenizer files (tokenizer.json / tokenizer_config.json); save the "
                   "classifier's tokenizer into the same folder")
    return out


def _turns(history: Sequence | None) -> list[dict[str, str]]:
    """Earlier chat turns as messages: (role, content) pairs or {role, content} dicts."""
    out = []
    for turn in history or ():
        role, content = (turn["role"], turn["content"]) if isinstance(turn, dict) else turn
        out.append({"role": str(role), "content": str(content)})
    return out


def encode_chat(tokenizer: Any, prompt: str, completion: str, history: Sequence | None = None) -> list[int]:
    """Token ids of one scored conversation: the history's turns, the prompt as the user turn and the completion as
    the assistant's, with the tokenizer's chat template; without one, the turns' texts each followed by a blank line,
    then prompt + "\\n" + completion with the tokenizer's own special tokens."""
    turns = _turns(history)
    if getattr(tokenizer, "chat_template", None):
        messages = turns + [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    text = "".join(f"{t['content']}\n\n" for t in turns) + prompt + "\n" + completion
    return list(tokenizer(text)["input_ids"])


class RewardClassifier:
    """A sequence classifier (one label) scoring prompt + completion pairs in padded batches."""

    def __init__(self, path: str, precision: str = "bf16", device: Any = "cpu", batch_size: int = 16,
                 max_length: int = 0, cache_dir: str = ""):
        """`path`: a local folder, a Hub id in the local cache, or builtin:NAME. `max_length` 0: the model's
        max_position_embeddings; a longer conversation keeps its last `max_length` tokens (the score is read at the
        end), counted in `truncated`."""
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if precision not in RM_PRECISIONS:
            raise ValueError(f"reward_model.precision: must be one of {', '.join(RM_PRECISIONS)}, got {precision!r}")
        if batch_size < 1:
            raise ValueError(f"reward_model.batch_size: must be >= 1, got {batch_size}")
        folder = resolve_model_path(path, cache_dir)
        problems = classifier_problems(folder)
        if problems:
            raise ValueError("; ".join(problems))
        self.path, self.precision, self.batch_size = folder, precision, batch_size
        self.device = torch.device(device)
        dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=dtype).to(self.device).eval()
        if precision == "int8":
            from qgrpo.rollout.quantization.quant import quantize_model

            model = quantize_model(model, "int8").eval()
        self.model, self.tokenizer = model, AutoTokenizer.from_pretrained(folder)
        text_cfg = model.config.get_text_config()
        # The id padded with must be the one the model skips when it looks for the last token.
        pad = text_cfg.pad_token_id
        if pad is None:
            tok = self.tokenizer
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            if pad is None:
                raise ValueError(f"{FIELD}: {folder} names no pad token (config.json pad_token_id) and its tokenizer "
                                 "has neither a pad nor an eos token; set pad_token_id in its config.json")
            text_cfg.pad_token_id = model.config.pad_token_id = pad
        self.pad_id = int(pad)
        self.max_length = max_length or int(getattr(text_cfg, "max_position_embeddings", 0) or 0)
        self.truncated = 0

    def encode(self, prompts: Sequence[str], completions: Sequence[str],
               histories: Sequence[Sequence | None] | None = None) -> list[list[int]]:
        if len(prompts) != len(completions) or (histories is not None and len(histories) != len(prompts)):
            raise ValueError(f"reward model: {len(prompts)} prompts, {len(completions)} completions and "
                             f"{'no' if histories is None else len(histories)} histories; give one of each per "
                             "completion")
        seqs = [encode_chat(self.tokenizer, p, c, None if histories is None else histories[i])
                for i, (p, c) in enumerate(zip(prompts, completions))]
        if self.max_length:
            self.truncated += sum(len(s) > self.max_length for s in seqs)
            seqs = [s[-self.max_length:] for s in seqs]
        return seqs

    def score(self, prompts: Sequence[str], completions: Sequence[str],
              histories: Sequence[Sequence | None] | None = None) -> list[float]:
        """One float per completion: the classifier's logit for (history, prompt, completion)."""
        import torch

        seqs = self.encode(prompts, completions, histories)
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # similar lengths together: less padding
        out = [0.0] * len(seqs)
        for start in range(0, len(order), self.batch_size):
            rows = order[start:start + self.batch_size]
            width = max(1, max(len(seqs[i]) for i in rows))
            ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for j, i in enumerate(rows):
                ids[j, :len(seqs[i])] = torch.tensor(seqs[i], dtype=torch.long)
                mask[j, :len(seqs[i])] = 1
            with torch.no_grad():
                logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            for j, v in enumerate(logits[:, 0].float().cpu().tolist()):
                out[rows[j]] = float(v)
        return out

    def info(self) -> dict[str, Any]:
        return {"path": self.path, "precision": self.precision, "device": str(self.device),
                "architecture": type(self.model).__name__, "pad_token_id": self.pad_id, "max_length": self.max_length,
                "batch_size": self.batch_size, "chat_template": bool(getattr(self.tokenizer, "chat_template", None)),
                "truncated": self.truncated}
