"""Generator backend on MLX (mlx-lm's model code): Metal on Apple silicon, the MLX CPU build (`mlx[cpu]`) on Linux.

- The model is built by mlx-lm from the local HF folder; its config gets the top-level `rope_theta`, `rope_scaling`
  and `tie_word_embeddings` that mlx-lm reads (transformers 5 writes the RoPE base only under `rope_parameters`, and
  mlx-lm silently falls back to base 10000 without it: log-probs off by nats; tests/test_mlx_backend.py guards this).
- Precisions. bf16: the weights unquantized, computed in bf16 on Metal and in fp32 on CPU (the MLX CPU build's bf16
  matmuls are very slow; a bf16 value converts to fp32 exactly, so nothing the learner sent is lost). int8 / int4:
  `nn.quantize(group_size=64, bits=8 / 4)` of every Linear and Embedding whose input width the group size divides,
  as in the original MLX-GRPO trainer; scales and biases in the compute dtype.
- Sampling is our own batched loop over mlx-lm's model and its left-padded `BatchKVCache`: each distinct prompt is
  prefilled once and its cache repeated to the G rows. Temperature, top-k and top-p are applied to the logits before
  the draw, and the reported log-prob is of that filtered, renormalised distribution (mlx-lm's own generate reports
  temperature-1 log-probs whatever the sampler's temperature).
- Weight updates: each received bf16 tensor (HF names, which equal mlx-lm's for Llama/Qwen2) is checked against the
  unquantized model's names and shapes, converted, re-quantized with `mx.quantize` where the layer is quantized, and
  loaded with `load_weights(strict=True)`; nothing changes unless the whole stream passed the checks.
- On Linux, MLX's CPU wheel ships a reference BLAS (~3 GFLOP/s here). If the system has OpenBLAS, it is loaded into
  the process's global symbol scope before MLX, so MLX's matrix products run on it (~30 GFLOP/s on this 2-core
  machine); without it one line says what to install.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from qgrpo.core.records import Completion, GroupRollout, PromptItem, SamplingParams
from qgrpo.rollout.backends import Generator
from qgrpo.rollout.backends.common import (
    build_completion,
    build_group,
    check_stream,
    continuation_prompts,
    format_prompt,
    hf_tensor_shapes,
    mlx_config,
    stop_token_ids,
)
from qgrpo.rollout.modeling import nanochat

if TYPE_CHECKING:
    import torch

BITS = {"int8": 8, "int4": 4}
# Where Debian/Ubuntu's libopenblas0-pthread puts the library; QGRPO_MLX_BLAS names another file ("" = do not load).
OPENBLAS_PATHS = ("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
                  "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
                  "/usr/lib64/libopenblasp.so.0", "/usr/lib64/libopenblas.so.0")
_blas_state: dict = {}


def blas_status() -> str:
    """Which BLAS MLX's CPU matmuls run on in this process: a path, "bundled", or "n/a" (not Linux)."""
    return _blas_state.get("path", "n/a" if sys.platform != "linux" else "bundled")


def import_mlx():
    """`mlx.core`, with an optimized BLAS under it on Linux (see the module doc)."""
    if sys.platform == "linux" and "mlx.core" not in sys.modules and "path" not in _blas_state:
        _preload_blas()
    import mlx.core as mx

    return mx


def _preload_blas() -> None:
    override = os.environ.get("QGRPO_MLX_BLAS")
    _blas_state["path"] = "bundled"
    if override == "":  # the user's choice: MLX's own BLAS, no message
        return
    for path in [override] if override else OPENBLAS_PATHS:
        if Path(path).is_file():
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)  # MLX's cblas_* calls bind to it when MLX loads next
            except OSError as e:
                print(f"qgrpo: could not load {path} for MLX ({e}); MLX uses its bundled BLAS, ~10x slower",
                      file=sys.stderr)
                return
            _blas_state["path"] = path
            return
    if override:
        print(f"qgrpo: QGRPO_MLX_BLAS={override} is not a file; MLX uses its bundled BLAS, ~10x slower",
              file=sys.stderr)
    else:
        print("qgrpo: MLX on Linux runs on its bundled reference BLAS, ~10x slower; install OpenBLAS "
              "(`apt-get install libopenblas0-pthread`; `make install` does it when run as root) and qgrpo uses it "
              "automatically, or set QGRPO_MLX_BLAS=/path/to/libopenblas.so", file=sys.stderr)


def compute_dtype():
    mx = import_mlx()
    return mx.bfloat16 if mx.metal.is_available() else mx.float32


def to_mx(t, dtype):
    """A torch tensor (any float dtype, bf16 included) or a numpy array -> an MLX array of `dtype`; torch is never
    imported here (a torch tensor can only arrive where torch is already loaded)."""
    import numpy as np

    mx = import_mlx()
    if isinstance(t, np.ndarray):
        return mx.array(t).astype(dtype)
    t = t.detach().cpu().contiguous()
    if str(t.dtype) == "torch.bfloat16":  # numpy has no bf16: move the raw 16-bit patterns and reinterpret them
        import torch

        return mx.array(t.view(torch.int16).numpy()).view(mx.bfloat16).astype(dtype)
    return mx.array(t.numpy()).astype(dtype)


def take_rows(cache, rows) -> None:
    """Index each layer's left-padded `BatchKVCache` to batch rows `rows` (mx int array), in place: a prompt run once
    hands its cache to the completions that continue it (the generator's G samples, the reference's group rows)."""
    for c in cache:
        if c.keys is not None:
            c.keys, c.values = c.keys[rows], c.values[rows]
        c.offset, c.left_padding = c.offset[rows], c.left_padding[rows]


def picked_logprobs(logits, targets):
    """logits [..., V] float32, targets [...] int -> log-softmax of the logits at the targets, [...]."""
    mx = import_mlx()
    return mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - mx.logsumexp(logits, axis=-1)


def _nanochat_classes(config: dict):
    """mlx-lm's nanochat model with the folder's RMSNorm eps (mlx-lm hard-codes 1e-5; transformers reads
    rms_norm_eps, 1e-6 by default: on a freshly initialised model the two differ by 3e-3 nats), loading either
    tensor spelling (rollout/modeling/nanochat.py). mlx-lm's blocks call one module-level `rms_norm`; the model puts its
    own in place for each forward (MLX builds the graph during the call), so models with different eps can coexist."""
    mx = import_mlx()
    from mlx_lm.models import nanochat as mlx_nanochat

    eps = nanochat.rms_eps(config)

    def rms_norm(x):
        return mx.fast.rms_norm(x, None, eps)

    class Model(mlx_nanochat.Model):
        def __call__(self, inputs, cache=None):
            mlx_nanochat.rms_norm = rms_norm
            return super().__call__(inputs, cache=cache)

        def sanitize(self, weights):
            return {nanochat.to_native(k): v for k, v in weights.items()}

    return Model, mlx_nanochat.ModelArgs


class MLXModel:
    """An mlx-lm model loaded from an HF folder at one precision, with strict, re-quantizing weight loads.
    Shared by the generator and the MLX reference scorer."""

    def __init__(self, model_path: str, precision: str = "bf16", group_size_quant: int = 64):
        mx = import_mlx()  # first: it puts the BLAS under MLX before anything imports mlx.core
        import mlx.nn as nn
        from mlx.utils import tree_flatten
        from mlx_lm.utils import load_model

        if precision not in ("bf16", *BITS):
            raise ValueError(f"mlx backend: precision {precision!r} not in bf16, int8, int4")
        self.precision, self.group_size_quant = precision, group_size_quant
        self.dtype = compute_dtype()
        shapes = hf_tensor_shapes(model_path)
        config = json.loads((Path(model_path) / "config.json").read_text())
        # nanochat: mlx-lm names its tensors as nanochat does, transformers (and our weight streams) otherwise
        self.nanochat = nanochat.is_nanochat(config)
        classes = {}
        if self.nanochat:
            nanochat.check_mlx_compatible(config)
            config = {**config, "rms_norm_eps": nanochat.rms_eps(config, nanochat.native_names(set(shapes)))}
            classes["get_model_classes"] = _nanochat_classes
        self.model, _ = load_model(Path(model_path), model_config=mlx_config(config, set(shapes)), **classes)
        self.model.set_dtype(self.dtype)
        # The names and shapes a weight stream must carry: the unquantized model's, in HF names (rotary buffers and a
        # tied lm_head are not parameters).
        self.expected = {self._hf(k): tuple(v.shape) for k, v in tree_flatten(self.model.parameters())}
        self.quantized: set[str] = set()  # ".weight" names held as (weight, scales, biases)
        if precision in BITS:
            def predicate(path, module):
                return hasattr(module, "to_quantized") and module.weight.shape[-1] % group_size_quant == 0

            nn.quantize(self.model, group_size=group_size_quant, bits=BITS[precision], class_predicate=predicate)
            names = {self._hf(k) for k, _ in tree_flatten(self.model.parameters())}
            self.quantized = {k for k in self.expected if k.endswith(".weight")
                              and k.removesuffix("weight") + "scales" in names}
        self.model.eval()
        mx.eval(self.model.parameters())

    def load(self, named_tensors: Iterable[tuple[str, object]]) -> int:
        """Strict and all-or-nothing: the stream is checked to its end (names, shapes) before any weight changes."""
        mx = import_mlx()
        received = list(check_stream(self.expected, named_tensors))
        out = []
        for hf_name, t in received:
            w, name = to_mx(t, self.dtype), self._mlx(hf_name)
            if hf_name in self.quantized:
                q, scales, biases = mx.quantize(w, group_size=self.group_size_quant, bits=BITS[self.precision])
                stem = name.removesuffix("weight")
                out += [(name, q), (stem + "scales", scales), (stem + "biases", biases)]
            else:
                out.append((name, w))
        self.model.load_weights(out, strict=True)
        mx.eval(self.model.parameters())
        return len(received)

    def _hf(self, name: str) -> str:  # mlx-lm's parameter name -> the weight stream's (transformers') name
        return nanochat.to_hf(name) if self.nanochat else name

    def _mlx(self, name: str) -> str:
        return nanochat.to_native(name) if self.nanochat else name

    def logprobs(self, ids, temperature: float = 1.0):
        """ids mx [B, T] -> mx float32 [B, T-1]: log p(token j | tokens < j) for j = 1.., at `temperature`."""
        mx = import_mlx()
        return picked_logprobs(self.model(ids)[:, :-1].astype(mx.float32) / temperature, ids[:, 1:])

    def memory_bytes(self) -> dict[str, int]:
        import_mlx()
        import mlx.nn as nn
        from mlx.utils import tree_flatten

        total = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
        linear = sum(v.nbytes for _, m in self.model.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))
                     for _, v in tree_flatten(m.parameters()))
        return {"linear": linear, "total": total}


class MLXGenerator(Generator):
    updates_between_steps = True  # its decode loop calls `_boundary` (see Generator.step_boundary)

    def __init__(self, model_path: str, precision: str = "bf16", group_size_quant: int = 64,
                 generator_id: str = "mlx-0", seed: int = 0, initial_version: int = 0, chat_template: bool = True):
        from transformers import AutoTokenizer

        self.generator_id = generator_id
        self.precision = precision
        self.policy_version = initial_version
        self.chat_template = chat_template
        self._seed, self._calls = seed, 0
        self.net = MLXModel(model_path, precision, group_size_quant)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.stop_ids = stop_token_ids(model_path, self.tokenizer)

    def generate(self, items: list[PromptItem], sampling: SamplingParams) -> list[GroupRollout]:
        G = sampling.group_size
        prompts = [format_prompt(self.tokenizer, it, self.chat_template) for it in items]
        toks, lps = self._sample(prompts, G, sampling, self._key(sampling))  # per row, rows i*G .. i*G+G-1 for prompt i
        versions = self._changes  # the versions that sampled the columns (an update may land between two steps)
        return [build_group(it, prompts[i], [(toks[r], lps[r], versions) for r in range(i * G, (i + 1) * G)],
                            self.stop_ids, self.tokenizer, versions.version, self.generator_id, self.precision)
                for i, it in enumerate(items)]

    def continue_ids(self, sequences: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        """One continuation per sequence: the sequences left-padded into one batch and sampled as `generate` samples
        prompts, one row each (`_sample` with G = 1); a row stops at its own budget (`sampling.row_tokens`)."""
        prompts = continuation_prompts(self.generator_id, sequences)
        if not prompts:
            return []
        toks, lps = self._sample(prompts, 1, sampling, self._key(sampling), sampling.row_budgets(len(prompts)))
        return [build_completion(t, lp, self.stop_ids, self.tokenizer, self._changes)
                for t, lp in zip(toks, lps, strict=True)]

    def _key(self, sampling: SamplingParams):
        """The call's random key, from (step seed, generator id): reproducible, and different on every actor; without
        a seed, from the generator's own seed and its count of calls."""
        mx = import_mlx()
        base = sampling.seed if sampling.seed is not None else self._seed * 1_000_003 + self._calls
        self._calls += 1
        return mx.random.key(zlib.crc32(f"{base}/{self.generator_id}".encode()))

    def _sample(self, prompts: list[list[int]], G: int, sp: SamplingParams, key, budgets: list[int] | None = None):
        """Per row (rows i*G .. i*G+G-1 for prompt i): its sampled tokens and their log-probs, each row stopping at a
        stop token or its budget (`budgets`, one per row; None: max_new_tokens)."""
        mx = import_mlx()
        from mlx_lm.models.cache import BatchKVCache

        self._versions_start()
        model = self.net.model
        P = max(len(p) for p in prompts)
        pad = [P - len(p) for p in prompts]
        ids = mx.array([[self.pad_id] * n + p for n, p in zip(pad, prompts)])
        cache = [BatchKVCache(pad) for _ in model.layers]
        logits = model(ids, cache=cache)[:, -1, :].astype(mx.float32)  # one prefill per distinct prompt ...
        rows = mx.repeat(mx.arange(len(prompts)), G)  # ... whose cache and logits go to its G rows
        take_rows(cache, rows)
        logits = logits[rows]
        mx.eval(logits, [(c.keys, c.values) for c in cache])
        B = len(prompts) * G
        toks: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        live = list(range(B))  # output rows still decoding, in batch order
        stops = set(self.stop_ids)
        budgets = budgets or [sp.max_new_tokens] * B
        for step in range(sp.max_new_tokens):
            key, sub = mx.random.split(key)
            tok, lp = pick(logits, sp, sub)
            tl, ll = tok.tolist(), lp.tolist()
            keep = []
            for j, r in enumerate(live):
                toks[r].append(tl[j])
                lps[r].append(ll[j])
                if tl[j] not in stops and len(toks[r]) < budgets[r]:
                    keep.append(j)
            if step == sp.max_new_tokens - 1 or not keep:
                break
            if len(keep) < len(live):  # drop finished rows from the batch and the cache
                sel = mx.array(keep)
                for c in cache:
                    c.filter(sel)
                tok, live = tok[sel], [live[j] for j in keep]
            self._boundary(step + 1)  # a weight update that arrived during the call is applied here
            model = self.net.model  # (a load may replace the model's modules)
            logits = model(tok[:, None], cache=cache)[:, -1, :].astype(mx.float32)
            # Materialise the cache with the logits: left lazy, each step would recompute the chain of updates before
            # it.
            mx.eval(logits, [(c.keys, c.values) for c in cache])
        return toks, lps

    def load_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.net.load(named_tensors)
        self.policy_version = version

    def score(self, token_ids: list[int]) -> list[float]:
        mx = import_mlx()
        return self.net.logprobs(mx.array([list(token_ids)]))[0].tolist()

    def memory_bytes(self) -> dict[str, int]:
        return self.net.memory_bytes()


def pick(logits, sp: SamplingParams, key):
    """logits mx [B, V] float32 -> (token [B], log-prob [B]) drawn from softmax(logits / T) after top-k and top-p,
    the same filters in the same order as the torch backend; the log-prob is of that filtered, renormalised
    distribution. T = 0 is greedy, reported at T = 1 unfiltered."""
    mx = import_mlx()
    if sp.temperature <= 0:
        tok = mx.argmax(logits, axis=-1)
    else:
        logits = logits / sp.temperature
        V = logits.shape[-1]
        if 0 < sp.top_k < V:
            kth = mx.min(mx.topk(logits, sp.top_k, axis=-1), axis=-1, keepdims=True)
            logits = mx.where(logits < kth, -mx.inf, logits)
        if sp.top_p < 1.0:
            # Drop a token when the more likely tokens already hold top_p of the mass; the top token always stays.
            order = mx.argsort(-logits, axis=-1)
            srt = mx.take_along_axis(logits, order, axis=-1)
            probs = mx.softmax(srt, axis=-1)
            drop = (mx.cumsum(probs, axis=-1) - probs) >= sp.top_p
            drop = mx.concatenate([mx.zeros_like(drop[:, :1]), drop[:, 1:]], axis=-1)
            logits = mx.put_along_axis(logits, order, mx.where(drop, -mx.inf, srt), axis=-1)
        tok = mx.random.categorical(logits, axis=-1, key=key)
    return tok, picked_logprobs(logits, tok)
