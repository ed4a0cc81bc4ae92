"""Generator backend on plain torch + transformers (CPU here, CUDA where present).

Holds one copy of the policy, in the served format: the model is quantized in place once at the start, and at a sync
each received bf16 weight of a quantized layer is quantized again in place (rollout/quantization/quant.py:
requantize_in_place) while the other weights are copied in, so the sender never needs to know the receiver's format and
no second copy of the model is ever built. With sync.adapters_only only LoRA adapters arrive (`load_adapters`): they sit
beside the quantized base in bf16 (rollout/backends/torch_adapters.py) and the base is not touched. On a CPU computing
in float32, the unquantized linears multiply by weights in oneDNN's layout (rollout/backends/onednn.py): a full update
re-packs them from what it receives.
"""
from __future__ import annotations

import time
import zlib
from typing import Iterable

import torch

from qgrpo.core.records import Completion, GroupRollout, PromptItem, SamplingParams
from qgrpo.core.scoring import token_logprobs
from qgrpo.rollout.backends import Generator, TorchOptions, onednn, served_grid, torch_adapters
from qgrpo.rollout.backends.common import (
    build_completion,
    build_group,
    check_stream,
    continuation_prompts,
    format_prompt,
    stop_token_ids,
)
from qgrpo.rollout.backends.compute import compute_in
from qgrpo.rollout.backends.torch_decode import StaticDecoder, pick
from qgrpo.rollout.backends.torch_graphs import GraphDecoder
from qgrpo.rollout.quantization.quant import (
    linear_weight_bytes,
    quantize_model,
    quantized_weight_names,
    requantize_in_place,
    tied_head_source,
)


def load_into(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy a full set of (name, tensor) into `model`'s parameters; strict (every parameter exactly once, same
    shapes), and all-or-nothing: the stream is checked to its end before any parameter changes. Returns the count."""
    params = dict(model.named_parameters())
    received = list(check_stream({n: tuple(p.shape) for n, p in params.items()}, named_tensors))
    with torch.no_grad():
        for name, t in received:
            params[name].copy_(t)
    return len(received)


class TorchGenerator(Generator):
    updates_between_steps = True  # its decode loops call `_boundary` (see Generator.step_boundary)

    def __init__(self, model_path: str, precision: str = "bf16", group_size_quant: int = 64,
                 generator_id: str = "torch-0", seed: int = 0, device: str | None = None, initial_version: int = 0,
                 chat_template: bool = True, compute_dtype: str = "auto", options: dict | None = None,
                 model: torch.nn.Module | None = None):
        """`compute_dtype`: model.compute_dtype ("auto": bf16 where the device computes it natively, else fp32;
        core/cpu.py); the weights are bf16 values either way, quantized from bf16 (rollout/backends/compute.py).
        `options`: the `[rollout.torch]` table (TorchOptions). `model`: a bf16 causal LM already built, served in
        place of loading one from `model_path`, which then needs only the tokenizer (benches build models of published
        shapes with random weights: bench/model_ladder.py); the generator quantizes it in place, as its own."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from qgrpo.core.cpu import compute_dtype as choose
        from qgrpo.core.cpu import torch_dtype

        self.generator_id = generator_id
        self.precision = precision
        self.group_size_quant = group_size_quant
        self.policy_version = initial_version
        self.chat_template = chat_template
        # Wall seconds of the last generate's decoding: from the prompts' forward done to the samples on the CPU
        # (benchmarks read it instead of subtracting a separately timed prefill from the whole call).
        self.last_decode_s: float | None = None
        from qgrpo.core.devices import bind, current_device

        # The GPU Ray assigned this actor, else the CPU (core/devices.py); never "any GPU the node has".
        self.device = bind(torch.device(device) if device is not None
                           else current_device(f"rollout actor {generator_id}"))
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        tok = self.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.stop_ids = stop_token_ids(model_path, self.tokenizer)
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
        model = model.to(self.device).eval()
        self.options = TorchOptions(**(options or {}))
        # What a full update must hold (the bf16 model's parameters), which of them are quantized, and the linear
        # layers' shapes (for adapters); then the one copy is quantized in place. A tied head quantized on request
        # (options.quantize_head) is re-quantized at each update from the embedding it copies (`_head_copy`).
        head = self.options.quantize_head
        self._shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        self._quantized = quantized_weight_names(model, precision, group_size_quant, self.device.type, head)
        self._head_copy = tied_head_source(model) if head and precision != "bf16" else None
        self._linears = {n: tuple(m.weight.shape) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self.compute_dtype, self.compute_why = choose(compute_dtype, self.device)
        self._dtype = torch_dtype(self.compute_dtype)
        self.model = compute_in(quantize_model(model, precision, group_size_quant, head), self._dtype).eval()
        # On a float32 CPU the unquantized linears multiply by weights in oneDNN's layout: {received name: layers}.
        self._packed = onednn.pack_linears(self.model) if (
            self.options.onednn and self._dtype == torch.float32 and self.device.type == "cpu"
            and onednn.available()) else {}
        # Llama-family models decode on a preallocated cache (torch_decode.py); others through their own forward.
        self.decoder = StaticDecoder(self.model) if StaticDecoder.supports(self.model) else None
        # On CUDA the same steps replayed as CUDA graphs (torch_graphs.py), where the options ask for them.
        self.graphs = None
        if self.decoder is not None and self.device.type == "cuda" and self.options.cuda_graphs:
            self.graphs = GraphDecoder(self.model, self.pad_id, self.stop_ids, fused=self.options.fused_step)
        self.adapters: dict[str, torch_adapters.LoraDelta] = {}
        self._base_only = True  # adapters-only updates are relative to the base the generator started from
        self._seed = seed
        self._calls = 0

    @torch.inference_mode()
    def generate(self, items: list[PromptItem], sampling: SamplingParams) -> list[GroupRollout]:
        G = sampling.group_size
        prompts, ids, attn = self._encode(items)
        rng = self._rng(sampling)
        new, logp = self._sample(ids.to(self.device), attn.to(self.device), G, sampling, rng)  # [N*G, L] each
        versions = self._changes  # the versions that sampled the columns (an update may land between two steps)
        groups = []
        for i, it in enumerate(items):  # prompt i's G completions are rows i*G .. i*G+G-1
            rows = range(i * G, (i + 1) * G)
            groups.append(build_group(it, prompts[i], [(new[r].tolist(), logp[r].tolist(), versions) for r in rows],
                                      self.stop_ids, self.tokenizer, versions.version, self.generator_id,
                                      self.precision))
        return groups

    @torch.inference_mode()
    def continue_ids(self, sequences: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        """One continuation per sequence: the sequences left-padded into one batch and sampled as `generate` samples
        prompts, one row each (`_sample` with G = 1); a row stops at its own budget (`sampling.row_tokens`)."""
        prompts = continuation_prompts(self.generator_id, sequences)
        if not prompts:
            return []
        budgets = sampling.row_budgets(len(prompts))
        ids, attn = self._pad(prompts)
        new, logp = self._sample(ids.to(self.device), attn.to(self.device), 1, sampling, self._rng(sampling),
                                 budgets if sampling.row_tokens is not None else None)
        return [build_completion(new[r, :n].tolist(), logp[r, :n].tolist(), self.stop_ids, self.tokenizer,
                                 self._changes) for r, n in enumerate(budgets)]

    def _rng(self, sampling: SamplingParams) -> torch.Generator:
        """The call's random stream, seeded from (step seed, generator id): reproducible, and different on every
        actor; without a seed, from the generator's own seed and its count of calls."""
        base = sampling.seed if sampling.seed is not None else self._seed * 1_000_003 + self._calls
        self._calls += 1
        return torch.Generator(self.device).manual_seed(zlib.crc32(f"{base}/{self.generator_id}".encode()))

    def _encode(self, items: list[PromptItem]) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
        """Token ids of each prompt, and the prompts left-padded (`_pad`)."""
        prompts = [format_prompt(self.tokenizer, it, self.chat_template) for it in items]
        return prompts, *self._pad(prompts)

    def _pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-id lists left-padded into ids/mask [N, P] so every row's last prompt token sits at the same column
        (positions come from the mask)."""
        P = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), P), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), P), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, P - len(p):] = torch.tensor(p)
            attn[i, P - len(p):] = 1
        return ids, attn

    def _prefill(self, ids: torch.Tensor, attn: torch.Tensor):
        return self.model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                          use_cache=True, logits_to_keep=1)

    @torch.inference_mode()
    def prefill_seconds(self, items: list[PromptItem]) -> float:
        """Wall time of the prompts' forward alone (what `generate` does first), for benchmarks."""
        _, ids, attn = self._encode(items)
        ids, attn = ids.to(self.device), attn.to(self.device)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda *a: None)
        sync(self.device)
        t0 = time.perf_counter()
        self._prefill(ids, attn)
        sync(self.device)  # the kernels, not their launches
        return time.perf_counter() - t0

    def _sample(self, ids: torch.Tensor, attn: torch.Tensor, G: int, sp: SamplingParams, rng: torch.Generator,
                budgets: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompts [N, P] -> sampled tokens and their log-probs [N*G, L] (CPU), L <= max_new_tokens;
        `budgets`: each row's own token budget (a row stops there; the CUDA graphs' loop runs every row to L).
        Rows that finished are padded after their stop token (log-prob 0). `self._changes` says which policy version
        sampled which columns (a VersionSpans, see `_boundary`)."""
        self._versions_start()
        # Prefill each distinct prompt once, then copy its KV cache to its G rows (rows i*G .. i*G+G-1).
        out = self._prefill(ids, attn)
        B, L = ids.shape[0] * G, sp.max_new_tokens
        logits = out.logits[:, -1].float().repeat_interleave(G, dim=0)  # [B, V]
        if self.device.type == "cuda":  # the prompts' kernels done: what follows is the decode's own time
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        toks, lps = self._sample_after_prefill(out, attn, logits, ids.shape[1], G, B, L, sp, rng, budgets)
        self.last_decode_s = time.perf_counter() - t0  # the samples are on the CPU: every kernel has run
        return toks, lps

    def _sample_after_prefill(self, out, attn: torch.Tensor, logits: torch.Tensor, P: int, G: int, B: int, L: int,
                              sp: SamplingParams, rng: torch.Generator, budgets: list[int] | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_sample` after the prompts' forward `out` (P columns): CUDA graphs, the static decoder, or the model's
        forward on its dynamic cache, whichever fits."""
        if self.graphs is not None and self.decoder.fits(P + L):
            return self.graphs.run(out.past_key_values, attn, logits, G, L, sp, rng, self.stop_ids,
                                   boundary=self._boundary if self.step_boundary is not None else None)
        if self.decoder is not None and self.decoder.fits(P + L):
            self.decoder.start(out.past_key_values, attn, G, L)
            return self._decode(logits, self.decoder.step, self.decoder.compact, B, L, sp, rng, budgets)
        cache = out.past_key_values
        cache.batch_repeat_interleave(G)
        state = {"attn": attn.repeat_interleave(G, dim=0), "cache": cache}

        def step(tok: torch.Tensor) -> torch.Tensor:  # transformers' forward on its dynamic cache
            # One more mask column per step; the new token's position counts only real (unpadded) tokens.
            a = state["attn"] = torch.cat([state["attn"], state["attn"].new_ones(len(tok), 1)], dim=1)
            o = self.model(input_ids=tok[:, None], attention_mask=a, position_ids=a.sum(-1, keepdim=True) - 1,
                           past_key_values=state["cache"], use_cache=True)
            state["cache"] = o.past_key_values
            return o.logits[:, -1].float()

        def compact(live: torch.Tensor) -> torch.Tensor:  # drop finished rows from mask and cache at once
            idx = live.nonzero().squeeze(-1)
            state["attn"] = state["attn"][idx]
            state["cache"].batch_select_indices(idx)
            return idx

        return self._decode(logits, step, compact, B, L, sp, rng, budgets)

    def _decode(self, logits: torch.Tensor, step, compact, B: int, L: int, sp: SamplingParams,
                rng: torch.Generator, budgets: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampling loop over a decoder: `step(tokens)` -> next logits for the decoder's rows; `compact(live)` ->
        the indices of the rows it keeps, or None when finished rows stay in it (their samples unread). A row is
        finished at a stop token, or at its own budget (`budgets`, one per output row; None: L for every row)."""
        dev = logits.device
        toks = torch.full((B, L), self.pad_id, dtype=torch.long, device=dev)
        lps = torch.zeros((B, L), device=dev)
        rows = torch.arange(B, device=dev)  # the output row of each decoder row
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        stop = torch.tensor(self.stop_ids, device=dev)
        cap = torch.tensor(budgets, device=dev) if budgets is not None else None
        for i in range(L):
            go = ~done
            # Draw for the live rows only: finished rows riding along cost no sampling, and the generator's random
            # stream is the same whichever decoder runs.
            tok, lp = _pick(logits if go.all() else logits[go], sp, rng)
            toks[rows[go], i], lps[rows[go], i] = tok, lp
            if not go.all():  # finished rows are fed padding; their output is never read
                tok = torch.full_like(rows, self.pad_id).masked_scatter(go, tok)
            done = done | (torch.isin(tok, stop) & go)
            if cap is not None:
                done = done | (cap[rows] <= i + 1)
            if i == L - 1 or done.all():
                break
            if done.any():
                idx = compact(~done)
                if idx is not None:
                    rows, done, tok = rows[idx], done[idx], tok[idx]
            self._boundary(i + 1)
            logits = step(tok)
        return toks[:, :i + 1].cpu(), lps[:, :i + 1].cpu()

    @torch.no_grad()
    def load_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A full update: strict and all-or-nothing (the stream is checked to its end before anything changes). The
        weights of quantized layers are quantized again in place, the others copied in; adapters are removed."""
        received = list(check_stream(self._shapes, named_tensors))
        t0 = time.perf_counter()
        self.adapters = torch_adapters.unwrap(self.model, self.adapters)
        params, quantized = dict(self.model.named_parameters()), set(self._quantized)
        for name, t in received:
            for layer in self._packed.get(name, ()):  # oneDNN's copy; a tied embedding's own tensor copied below
                onednn.repack(layer, t)
            if name not in quantized and params[name].device.type != "meta":
                params[name].copy_(t)
        if self._quantized:
            new = {n.removesuffix(".weight"): t for n, t in received if n in quantized}
            if self._head_copy is not None:  # the quantized head's own copy of the embedding it was tied to
                head, embedding = self._head_copy
                new[head] = next(t for n, t in received if n == embedding)
            requantize_in_place(self.model, new)
            compute_in(self.model, self._dtype)  # layers made anew (nf4) compute as before
        self._base_only = False  # adapters, relative to the base this generator started from, no longer fit
        self.requantize_seconds = time.perf_counter() - t0
        self.policy_version = version

    def load_adapters(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """An adapters-only update (`<linear>.lora_A` [r, in], `<linear>.lora_B` [out, r], B scaled): the first one
        wraps the named linears of the served model, later ones copy A and B in place; the quantized base stays as
        it is. Strict and all-or-nothing like `load_weights` (WeightMismatchError). Adapters are relative to the base
        model this generator was started from: after a full update they are refused."""
        if not self._base_only:
            raise RuntimeError(f"{self.generator_id}: adapters-only update after a full one; the adapters are relative "
                               "to the base model the generator started from, which it no longer holds (start it "
                               "again from the base)")
        self.adapters = torch_adapters.load_adapters(self.model, self._linears, self.adapters, named_tensors,
                                                     self.device)
        self.requantize_seconds = 0.0  # nothing is re-quantized
        self.policy_version = version

    def decode_info(self) -> dict:
        """Which decode loop runs ("graphs", "static": the eager fixed-shape steps, "forward": transformers' forward),
        the seconds spent capturing graphs, and why graphs are not used where they were asked for."""
        if self.graphs is not None:
            return self.graphs.info()
        why = None if not self.options.cuda_graphs else (
            "CUDA graphs need a CUDA device" if self.device.type != "cuda" else "the model's layers are not Llama's")
        return {"loop": "static" if self.decoder is not None else "forward",
                "fused": self.decoder is not None and self.decoder.fused is not None, "kernels": None,
                "capture_s": 0.0, "captures": 0, "fallback": why}

    def quant_grids(self) -> dict:
        """{HF tensor name: core.grids.Grid} of the weights this generator quantizes onto a grid the rollout actor
        can emulate (rollout/quantization/requantize.py); {} at bf16 and nf4."""
        grid = served_grid("torch", self.precision, self.group_size_quant)
        copy = f"{self._head_copy[0]}.weight" if self._head_copy else None  # no tensor of the stream: its own
        return {} if grid is None else {name: grid for name in self._quantized if name != copy}

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> list[float]:
        ids = torch.tensor([token_ids], device=self.device)
        return token_logprobs(self.model, ids)[0, 1:].float().tolist()

    def memory_bytes(self) -> dict[str, int]:
        linear = linear_weight_bytes(self.model)
        linear_ids = {id(m.weight) for m in self.model.modules() if hasattr(m, "weight") and _is_linear(m)}
        other = sum(p.numel() * p.element_size() for p in self.model.parameters() if id(p) not in linear_ids)
        return {"linear": linear, "total": linear + other}


def _is_linear(m) -> bool:
    return isinstance(m, torch.nn.Linear) or type(m).__name__ in ("Linear4bit", "Linear8bitLt", "Fp8Linear")


def _pick(logits: torch.Tensor, sp: SamplingParams, rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] float32 -> (token [B], log-prob [B]) drawn from softmax(logits / T) after top-k and top-p (HF's
    order), one uniform per row from `rng` (none at T = 0): torch_decode.pick."""
    u = None if sp.temperature <= 0 else torch.rand(logits.shape[0], generator=rng, device=logits.device)
    return pick(logits, sp, u)
