"""What every generator backend needs: the prompt as token ids, the stop tokens, strict checks of a weight stream,
the probe a weight load is fingerprinted with, and the `Completion` / `GroupRollout` records built from sampled tokens.

Backends differ in how they sample; they must not differ in what they sample from (the same prompt ids), where a
completion ends (the same stop tokens) or what they report, so all of that lives here once.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

from qgrpo.core.records import Completion, GroupRollout, PromptItem
from qgrpo.rollout.backends.versions import VersionSpans, token_versions

# One sample of a prompt: (token ids, their log-probs, the versions that sampled them; None: the call's version)
Sample = tuple[list[int], list[float], VersionSpans | None]

if TYPE_CHECKING:
    import torch


class WeightMismatchError(ValueError):
    """A weight stream that does not fit the generator's model: a name it lacks or does not know, or a wrong shape."""


class WeightFingerprintError(RuntimeError):
    """After a weight load the generator's log-probs on the probe sequence disagree with the learner's."""


# A fixed text whose tokens probe a weight load (see `probe_ids`): digits and operators for arithmetic models, words for
# the rest. Any tokenizer encodes it (a character-level one maps letters it lacks to its unknown token).
PROBE_TEXT = "12 + 34 = 46. 7 - 5 = 2. The quick brown fox jumps over the lazy dog; the answer is 9."
PROBE_MAX_TOKENS = 32

# How close a generator's probe log-probs must be to the learner's bf16 ones, per generator precision: at most
# `max_gap` nats per token apart on average, and correlated at least `min_corr` across the probe's tokens. The gap
# catches a broken load on a real model (SmolLM2-135M: wrong-format int8 load NaN, half-scaled MLPs 15.6); the
# correlation catches it where every log-prob is alike, as on the near-uniform random tiny model (rows shuffled:
# 0.20, bf16 tensors reloaded into the int8 engine: 0.81). Honest loads, measured (gap / corr):
#   SmolLM2 torch: bf16 0.000/1.000, int8 0.10/0.997, int4 0.98/0.75, nf4 0.74/0.87; vLLM int8 W8A8 0.23/see note;
#   tiny: every precision and backend <= 0.02 / >= 0.976 at the start; vLLM int8 against an fp32 learner (a CPU
#   without native bf16) on the tiny model trained 263 steps, its log-probs peaked: 0.285 / 0.95, so int8 asks 0.9.
FINGERPRINT_TOLERANCE = {  # precision: (max_gap, min_corr)
    "bf16": (0.1, 0.99), "fp8": (0.5, 0.95), "int8": (0.5, 0.9), "int4": (2.0, 0.6), "nf4": (2.0, 0.6),
}


def format_prompt(tokenizer, item: PromptItem, chat_template: bool = True) -> list[int]:
    """A prompt item -> token ids. With a chat template (asked for, and the tokenizer has one): the item's history
    turns, then the question as the last user turn, then the assistant header. Otherwise plain text: every turn's text
    followed by a blank line, then the question, with the tokenizer's own special tokens."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": r, "content": c} for r, c in item.history] + [{"role": "user", "content": item.prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer("".join(f"{c}\n\n" for _, c in item.history) + item.prompt)["input_ids"]


def stop_token_ids(model_path: str, tokenizer) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS and all EOS ids of the model's generation config (chat
    models often list several, e.g. <|im_end|> and <|endoftext|>)."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    gen_cfg = Path(model_path) / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    out = list(dict.fromkeys(int(i) for i in ids))
    if not out:
        raise ValueError(f"{model_path}: neither the tokenizer nor generation_config.json names an EOS token; "
                         "set eos_token_id in generation_config.json")
    return out


def probe_ids(tokenizer) -> list[int]:
    return list(tokenizer(PROBE_TEXT)["input_ids"])[:PROBE_MAX_TOKENS]


def fingerprint(got: list[float], expected: list[float]) -> tuple[float, float]:
    """(mean |difference|, Pearson correlation) of two log-prob lists; NaN where either holds a non-finite value,
    their lengths differ, or (correlation) one is constant."""
    import math

    if len(got) != len(expected) or not got or not all(math.isfinite(x) for x in [*got, *expected]):
        return float("nan"), float("nan")
    n = len(got)
    gap = sum(abs(a - b) for a, b in zip(got, expected)) / n
    mg, me = sum(got) / n, sum(expected) / n
    cov = sum((a - mg) * (b - me) for a, b in zip(got, expected))
    var = math.sqrt(sum((a - mg) ** 2 for a in got) * sum((b - me) ** 2 for b in expected))
    return gap, (cov / var if var > 0 else float("nan"))


def check_fingerprint(generator_id: str, precision: str, version: int, got: list[float],
                      expected: list[float]) -> dict[str, float]:
    """Raise WeightFingerprintError unless the generator's probe log-probs are within its precision's tolerance of
    the learner's. Returns {"gap": ..., "corr": ...}."""
    gap, corr = fingerprint(got, expected)
    max_gap, min_corr = FINGERPRINT_TOLERANCE[precision]
    if not (gap <= max_gap and corr >= min_corr):  # NaN fails too
        raise WeightFingerprintError(
            f"{generator_id} ({precision}): after loading version {version}, its log-probs on the probe sequence are "
            f"{gap:.3g} nats per token from the learner's (at most {max_gap}) with correlation {corr:.3g} (at least "
            f"{min_corr}): the engine does not hold the weights that were sent (a load in the wrong format, or a "
            "broken re-quantization). Stopping rather than training on samples from the wrong model.")
    return {"gap": gap, "corr": corr}


def check_stream(expected: dict[str, tuple[int, ...]],
                 named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass the stream through, raising WeightMismatchError on a name not in `expected`, a wrong shape, a name twice,
    or (at the end) a name never sent. Consumers must not commit anything before the stream is exhausted."""
    seen: set[str] = set()
    for name, t in named_tensors:
        if name not in expected:
            raise WeightMismatchError(f"received weight {name!r} that this model does not have; "
                                      "is the stream from another model?")
        if tuple(t.shape) != tuple(expected[name]):
            raise WeightMismatchError(f"weight {name!r}: received shape {tuple(t.shape)}, model has "
                                      f"{tuple(expected[name])}")
        if name in seen:
            raise WeightMismatchError(f"weight {name!r} received twice")
        seen.add(name)
        yield name, t
    missing = set(expected) - seen
    if missing:
        raise WeightMismatchError(f"weight stream lacks {len(missing)} parameters, e.g. {sorted(missing)[:3]}")


def build_group(item: PromptItem, prompt_ids: list[int], samples: list[Sample], stop_ids: list[int], tokenizer,
                policy_version: int, generator_id: str, precision: str) -> GroupRollout:
    """One prompt's G samples -> a GroupRollout of their `build_completion`s. A sample is (token ids, their log-probs,
    the versions that sampled them: a VersionSpans from the call's version `policy_version`, or None where that
    version sampled them all). The call's rows share one (torch, MLX); vLLM reports each request's own."""
    comps = [build_completion(toks, lps, stop_ids, tokenizer, versions) for toks, lps, versions in samples]
    return GroupRollout(item=item, prompt_ids=list(prompt_ids), completions=comps, policy_version=policy_version,
                        generator_id=generator_id, precision=precision)


def build_completion(toks: list[int], lps: list[float], stop_ids: list[int], tokenizer,
                     versions: VersionSpans | None = None) -> Completion:
    """One sample (token ids, their log-probs) -> a Completion, for `generate`'s groups and `continue_ids` alike. It
    ends at its first stop token (kept, finish_reason "stop"); one without a stop token ran to the length limit
    ("length"); whatever a backend decoded past the end (padding of a finished row) is cut off. `versions` as
    `build_group` takes them: token_versions is set where the completion's tokens span more than one version."""
    stops = set(stop_ids)
    end = next((i + 1 for i, t in enumerate(toks) if t in stops), None)
    n = end if end is not None else len(toks)
    return Completion(token_ids=list(toks[:n]), logprobs=[float(x) for x in lps[:n]],
                      finish_reason="stop" if end is not None else "length",
                      text=tokenizer.decode(toks[:n], skip_special_tokens=True),
                      token_versions=token_versions(versions, n))


def continuation_prompts(generator_id: str, sequences: list[list[int]]) -> list[list[int]]:
    """The sequences `Generator.continue_ids` continues, as lists of ints (tensors' and numpy's ids included); an empty
    one is refused, naming it: there is nothing to continue from."""
    out = [[int(t) for t in s] for s in sequences]
    empty = [i for i, s in enumerate(out) if not s]
    if empty:
        raise ValueError(f"{generator_id}: continue_ids got empty token-id sequences at {empty}; each must hold at "
                         "least the prompt's ids")
    return out


def hf_tensor_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the model folder's tensors, read from the safetensors headers (no tensor is loaded)."""
    from safetensors import safe_open

    shapes = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                shapes[k] = tuple(st.get_slice(k).get_shape())
    if not shapes:
        raise FileNotFoundError(f"{model_path}: no *.safetensors files; generators load safetensors folders")
    return shapes


def hf_tensors(model_path: str, names) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the named tensors of a safetensors model folder (names it lacks are left out)."""
    from safetensors import safe_open

    wanted, found = set(names), []
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            found += [(k, st.get_tensor(k)) for k in st.keys() if k in wanted]
    return found


def mlx_config(config: dict, tensor_names: set[str]) -> dict:
    """config.json as mlx-lm reads it: top-level rope_theta and rope_scaling, an explicit tie_word_embeddings."""
    cfg = dict(config)
    rope = cfg.get("rope_parameters") or {}
    if cfg.get("rope_theta") is None and rope.get("rope_theta") is not None:
        cfg["rope_theta"] = rope["rope_theta"]
    if not cfg.get("rope_scaling") and rope.get("rope_type", "default") != "default":
        # mlx-lm reads scaling only from `rope_scaling` (its "type" or "rope_type" key), never `rope_parameters`.
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    has_head = "lm_head.weight" in tensor_names
    if "tie_word_embeddings" not in cfg:
        # mlx-lm defaults to tied, transformers (Llama/Qwen2) to untied: say it explicitly, from the weights.
        cfg["tie_word_embeddings"] = not has_head
    elif not cfg["tie_word_embeddings"] and not has_head and tensor_names:
        raise ValueError("config.json says tie_word_embeddings=false but the weights hold no lm_head.weight")
    return cfg
