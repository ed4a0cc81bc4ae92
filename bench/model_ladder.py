"""The torch generator at the model sizes people train, each precision against the memory and compute bounds of the
machine it runs on, measured side by side in one run.

    .venv/bin/python bench/model_ladder.py --models Qwen2.5-1.5B,Qwen3-8B --rows 8,32      # CUDA
    .venv/bin/python bench/model_ladder.py --device cpu --models tiny-qwen2,tiny-qwen3 --rows 1,8 --contexts 32 \\
        --new-tokens 8 --precisions bf16,int8                                          # a dry run on a CPU

Models (`--models`, from bench/model_shapes.py): each built from its published config (architecture, widths, heads,
vocabulary, tied or untied embeddings) with random bf16 weights (seed 0) on the device it runs on; nothing is
downloaded, and speed does not depend on the values. The tokenizer is borrowed (`--tokenizer`: a folder, or builtin:
NAME; tiny-digits' character tokenizer where that is missing) and the model keeps its published vocabulary, so the
embedding and head have their published bytes; the table's header says which tokenizer. Each (model, precision) is
served by qgrpo's torch generator (rollout/backends/torch_backend.py) as a run serves it: quantized in place at
start, its decode steps replayed as CUDA graphs of the fused step on a GPU (`[rollout.torch]` defaults), the static
decoder's steps on a CPU, where it computes in the CPU's compute dtype (`compute` column: fp32 on CPUs without native
bf16). A model is built again for each precision (same seed, same weights). `FORMAT+head` (e.g. `int8+head`) serves
the format with `[rollout.torch] quantize_head`: a head tied to the embedding quantized too (the others keep it bf16).
`int8` (CPU) sends a product through qgrpo's own int8 kernel (rollout/quantization/cpu_native.py) up to the rows
measured there to beat the cast-and-bf16-product route, per weight shape; `int8/torch` does the same with torch's
`_weight_int8pack_mm` (the generator's kernel before qgrpo's, and where qgrpo's cannot be built); `int8/kernel` sends
every product of up to 64 rows through the int8 kernel, the rule before those rows were measured; `int8/noprefetch`
qgrpo's int8 kernel without asking for its weight rows ahead (`cpu_native.INT8_PREFETCH = 0`, the kernel before);
`int8/fused` (CPU) has the static decoder step through the step CUDA graphs record (rollout/backends/torch_fused.py:
q/k/v and gate/up one int8 product each, the rotary as one product), eagerly, instead of its own;
`int4` (CPU) sends a product through qgrpo's own int4 kernel up to the rows measured there to beat the weight decoded
once into the compute dtype and one plain product (rollout/quantization/cpu_kernels.py), `int4/torch` the same with
torch's `_weight_int4pack_mm_for_cpu`; `int4/kernel` every product through the int4 kernel, the rule before a prefill's
rows went through the weight decoded once. On a CPU that computes in float32, the unquantized products (all of `bf16`'s,
the head of the others) multiply by weights reordered for oneDNN (`[rollout.torch] onednn`); `bf16/torch` is `bf16`
through F.linear, the generator's route before. `FORMAT/wide` (CPU) runs every operation of a decode step on all
threads, the step before its norms, attention and small int8 products ran on one at up to 16 rows
(`torch_decode.LEAN_ROWS`, `cpu_native.SMALL_BYTES`).

Per (rows, context): prompts of exactly `context` tokens (rows / 8 prompts x 8 completions, or 1 x rows below 8),
`--new-tokens` new tokens every row (stop ids emptied; `full` checks it), T = 1. One warm-up generate (graph
capture), then `--repeats` timed generates (median) and the prompts' forward timed alone: `prefill tok/s` the prompt
tokens over it; `decode tok/s` rows x new tokens over (generate - prefill).

Bounds, from what this run measures: `mem bound` is rows over the bytes a decode step must read (the served linear
weights, lm_head included, in their storage format; one embedding row per row; the KV cache at the mean context,
prompt + half the new tokens) at the read bandwidth measured here (bench/gpu_speed.py: `read_bandwidth`);
`compute bound` is rows over a step's FLOPs (2 x the matrix-product parameters, lm_head included, plus attention's
4 x layers x query heads x head dim x context per row) at the bf16 (CPU: compute-dtype) matmul rate measured here on
the model's own gate/up product at `--compute-rows` rows (CPU: 64 rows; in float32 the faster of F.linear and oneDNN's
linear on the reordered weight, each in `matmul_routes`). `binds` names the lower one; `of bound` is decode tok/s over
it. `vs bf16` is decode tok/s over bf16's at the same model, rows and context. `GiB` is the generator's weights
(`memory_bytes()["total"]`), `peak GiB` the device's peak allocation over the variant (CUDA).

`--interleave` compares variants on a machine whose speed drifts (a shared host's memory bandwidth moved a cell by
20-40% between runs): per model, every precision's generator is built first and all are held at once, then each
(context, rows) times one generate and one prompt forward of each in turn, the order rotated each repeat (repeat r
starts at the r-th variant), so that a slow minute falls on every variant alike. It needs the memory of all of a
model's generators at once, and records no `peak GiB`. Without it, variants run one after another.

The machine's rates are read at the start of the run and again at its end, and the bounds take the higher of each
(a bound is the best the machine did; a shared host can halve a read for a minute): both reads are in `rate_reads`.
`--rebound PATH` reads them once more on the machine that made PATH, a finished run's JSON, and recomputes its
bounds the same way (its command is added to the JSON's).

`--budget-s` bounds the run: variants are run in order (precisions, then models, then contexts and rows as given)
and those past the deadline are listed as skipped; the JSON (`--out`) is written after every row, so a run cut short
keeps what it measured. A variant that fails records its error and the run goes on.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin on shared cores
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_speed import (  # noqa: E402 - measured as gpu_speed measures them
    batch_shape,
    completion_tokens,
    decode_info,
    finite,
    fmt,
    load_tokenizer,
    never_stop,
    read_bandwidth,
    release,
    sync,
    timed,
)
from bench.model_shapes import SHAPES, caps_prefix, head_dim, linear_shapes, random_model  # noqa: E402

GROUP_SIZE = 8


def build_model(name: str, tok, device: str):
    """Shape `name` with random bf16 weights (seed 0) on `device`, its published vocabulary kept."""
    try:
        return random_model(name, tok, device)
    except Exception:  # noqa: BLE001 - slower, same model: built on the CPU, then moved
        print(traceback.format_exc(), file=sys.stderr)
        return random_model(name, tok, "cpu").to(device)


def prompts_of(tok, n: int, length: int) -> list:
    """`n` distinct prompts of exactly `length` tokens each (no chat template): digits and spaces, cut at `length`
    tokens and checked to encode back to that many."""
    from qgrpo.core.records import PromptItem

    out = []
    for i in range(n):
        words, ids = [], []
        k = 0
        while len(ids) < length + 8:
            words.append(" ".join(str((i * 7919 + j * 104729) % 1000) for j in range(k, k + 64)))
            k += 64
            ids = tok(" ".join(words), add_special_tokens=True)["input_ids"]
        for cut in range(length, length + 8):  # a cut inside a word can re-encode longer: take the first that holds
            text = tok.decode(ids[:cut], skip_special_tokens=True)
            if len(tok(text, add_special_tokens=True)["input_ids"]) == length:
                break
        out.append(PromptItem(prompt_id=f"p{i}", prompt=text, reference=""))
    return out


def matmul_rate(device: str, dtype, k: int, n: int, rows: int, repeats: int = 5, routes: dict | None = None) -> float:
    """FLOP/s of a [rows, k] x [k, n] product in `dtype` (median of `repeats` after two warm-ups): F.linear's, or on a
    CPU computing in float32 the faster of F.linear's and oneDNN's linear on the weight reordered once, the route the
    generator's unquantized products take there (rollout/backends/onednn.py). `routes` gets each route's rate."""
    import torch

    from qgrpo.rollout.backends import onednn

    a = torch.randn(rows, k, dtype=dtype, device=device)
    b = torch.randn(n, k, dtype=dtype, device=device)
    fns = {"F.linear": lambda: torch.nn.functional.linear(a, b)}
    if torch.device(device).type == "cpu" and dtype == torch.float32 and onednn.available():
        packed = torch.ops.mkldnn._reorder_linear_weight(b, None)
        fns["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
    rates = {}
    for route, f in fns.items():
        for _ in range(2):
            f()
        rates[route] = 2 * rows * k * n / statistics.median(timed(f, device)[1] for _ in range(repeats))
    if routes is not None:
        routes.update(rates)
    return max(rates.values())


def step_flops(name: str, context: float) -> float:
    """FLOPs of one row's decode step: 2 x the matrix products' parameters (lm_head included) plus attention's scores
    and weighted sum over `context` columns (4 x layers x query heads x head dim x context)."""
    _, v = SHAPES[name]
    s = linear_shapes(name)
    per_layer = sum(n * k for key, (n, k) in s.items() if key in ("qkv", "o", "gate_up", "down"))
    products = v["num_hidden_layers"] * per_layer + s["lm_head"][0] * s["lm_head"][1]
    attn = 4 * v["num_hidden_layers"] * v["num_attention_heads"] * head_dim(v) * context
    return 2 * products + attn


def kv_bytes(name: str, rows: int, context: float, element: int = 2) -> float:
    _, v = SHAPES[name]
    return rows * v["num_hidden_layers"] * 2 * v["num_key_value_heads"] * head_dim(v) * element * context


@contextlib.contextmanager
def switches(precision: str):
    """The process-wide switches `precision` names, set while its generator is built and while it runs, then put
    back: fp8 decode's route, torch's CPU kernels instead of qgrpo's (`/torch`), a former rule of rows (`/kernel`),
    qgrpo's int8 kernel without its prefetch (`int8/noprefetch`), every operation of a decode step on all threads
    (`/wide`)."""
    from qgrpo.rollout.backends import torch_decode
    from qgrpo.rollout.quantization import cpu_kernels, cpu_native, fp8

    served, _, route = precision.partition("+")[0].partition("/")
    held, rules = fp8.FP8_DECODE, (cpu_kernels.cpu_int8_rows, cpu_kernels.cpu_int4_rows)
    ahead, lean = cpu_native.INT8_PREFETCH, (torch_decode.LEAN_ROWS, cpu_native.SMALL_BYTES)
    with contextlib.ExitStack() as stack:
        try:
            fp8.FP8_DECODE = route if served == "fp8" and route else held
            if served == "int8" and route == "kernel":  # the former rule: up to 64 rows through the kernel
                cpu_kernels.cpu_int8_rows = lambda n, k, dtype: cpu_kernels.INT8_KERNEL_MAX_ROWS
            if route == "torch":  # torch's int8 or int4 kernel, not qgrpo's (its rows measured as well)
                stack.enter_context(cpu_native.torch_kernel())
            if served == "int8" and route == "noprefetch":
                cpu_native.INT8_PREFETCH = 0
            if served == "int4" and route == "kernel":  # the former rule: every row through the kernel
                cpu_kernels.cpu_int4_rows = lambda n, k, group, dtype: 1 << 62
            if route == "wide":  # the step before: norms, attention and small int8 products on every thread
                torch_decode.LEAN_ROWS, cpu_native.SMALL_BYTES = 0, 0
            yield
        finally:
            fp8.FP8_DECODE, (cpu_kernels.cpu_int8_rows, cpu_kernels.cpu_int4_rows) = held, rules
            cpu_native.INT8_PREFETCH = ahead
            torch_decode.LEAN_ROWS, cpu_native.SMALL_BYTES = lean


def open_variant(args, name: str, precision: str, folder: str, tok):
    """(model, precision)'s generator, built as a run builds it under the precision's switches, and what each of its
    rows records of it."""
    from qgrpo.rollout.backends.torch_backend import TorchGenerator

    format_, _, extra = precision.partition("+")  # int8+head: the tied head quantized too ([rollout.torch])
    with switches(precision):
        t0 = time.perf_counter()
        model = build_model(name, tok, args.device)
        sync(args.device)
        build_s = time.perf_counter() - t0
        gen, load_s = timed(lambda: TorchGenerator(folder, precision=format_.partition("/")[0], device=args.device,
                                                   model=model, chat_template=False,
                                                   options={"quantize_head": extra == "head",
                                                            "onednn": precision != "bf16/torch"}), args.device)
        if format_ == "int8/fused" and gen.graphs is None and gen.decoder is not None:
            from qgrpo.rollout.backends.torch_fused import FusedLayers

            d = gen.decoder  # its steps through the fused step, eagerly (q/k/v and gate/up one product each)
            d.fused = FusedLayers(gen.model, d.q_heads, d.kv_heads, d.head_dim)
    never_stop(gen)
    mem = gen.memory_bytes()
    return gen, {"build_s": build_s, "load_s": load_s, "compute": gen.compute_dtype,
                 "linear_bytes": int(mem["linear"]), "total_bytes": int(mem["total"])}


class Cell:
    """One (context, rows) of one generator: its prompts, and the timed generates and prompt forwards gathered."""

    def __init__(self, args, gen, tok, rows: int, context: int):
        self.gen, self.device, self.L = gen, args.device, args.new_tokens
        self.n, self.g = batch_shape(rows)
        self.items = prompts_of(tok, self.n, context)
        self.runs, self.prefills = [], []

    def generate(self, seed: int) -> tuple[float, int]:
        from qgrpo.core.records import SamplingParams

        groups, s = timed(lambda: self.gen.generate(self.items, SamplingParams(self.g, self.L, temperature=1.0,
                                                                               seed=seed)), self.device)
        return s, completion_tokens(groups)

    def warm(self, row: dict) -> None:  # the first generate (graph capture), not timed with the rest
        row["warmup_s"] = self.generate(0)[0]

    def once(self, repeat: int) -> None:  # one timed generate and one timed prompt forward
        s, tokens = self.generate(100 + repeat)
        self.runs.append({"seconds": s, "tokens": tokens, "decode_s": getattr(self.gen, "last_decode_s", None)})
        self.prefills.append(timed(lambda: self.gen.prefill_seconds(self.items), self.device)[1])

    def finish(self, row: dict, name: str, res: dict, args) -> None:
        rows, pre = row["rows"], statistics.median(self.prefills)
        row["runs"] = self.runs
        row["seconds"] = statistics.median(x["seconds"] for x in self.runs)
        row["full"] = all(x["tokens"] == rows * self.L for x in self.runs)
        row["prefill_s"] = pre
        row["prefill_tokens_per_s"] = self.n * row["context"] / pre
        by_difference = rows * self.L / (row["seconds"] - pre) if row["seconds"] > pre else None
        own = [x["decode_s"] for x in self.runs if x["decode_s"]]
        # The generator's own clock on its decoding where it has one; the whole call less the separately timed
        # prompt forward (two noisy times, ~±15% at few rows on a CPU) otherwise.
        row["decode_timing"] = "generator" if len(own) == len(self.runs) else "difference"
        row["decode_tokens_per_s"] = (rows * self.L / statistics.median(own) if row["decode_timing"] == "generator"
                                      else by_difference)
        row["decode_tokens_per_s_by_difference"] = by_difference
        row.update({f"decode_{k}": v for k, v in decode_info(self.gen, None).items()})
        bounds(row, name, res, args)


def failed(row: dict, e: Exception) -> None:
    print(traceback.format_exc(), file=sys.stderr)
    row["error"] = f"{type(e).__name__}: {e}"[:1000]


def run_variant(args, name: str, precision: str, folder: str, tok, res: dict, emit, over) -> None:
    """One (model, precision): the generator built once, then every (context, rows); rows appended to res["rows"]."""
    import torch

    cuda = args.device.startswith("cuda")
    base = {"model": name, "precision": precision}
    gen = None
    made = []
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        gen, info = open_variant(args, name, precision, folder, tok)
        for ctx in args.contexts:
            for rows in args.rows:
                row = {**base, "rows": rows, "context": ctx, **info}
                made.append(row)
                res["rows"].append(row)
                if over():
                    row["skipped"] = "budget spent"
                    res["budget"]["skipped"].append(f"{name}/{precision}/{ctx}/{rows}")
                    emit()
                    continue
                cell = Cell(args, gen, tok, rows, ctx)
                with switches(precision):
                    cell.warm(row)
                    for r in range(args.repeats):
                        cell.once(r)
                cell.finish(row, name, res, args)
                if cuda:
                    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
                emit()
    except Exception as e:  # noqa: BLE001 - one variant's failure must not cost the others' results
        if not made or "seconds" in made[-1] or "skipped" in made[-1]:
            made.append({**base, "rows": None, "context": None})
            res["rows"].append(made[-1])
        failed(made[-1], e)
        emit()
    finally:
        gen = None
        release(args.device)


def run_interleaved(args, name: str, folder: str, tok, res: dict, emit, over) -> None:
    """One model under `--interleave`: every precision's generator built and held at once, then each (context, rows)
    times them in turn, the order rotated each repeat, so that the machine's drift falls on every variant alike."""
    gens, infos = {}, {}
    try:
        for p in args.precisions:
            if over():
                res["budget"]["skipped"].append(f"{name}/{p}")
                res["rows"].append({"model": name, "precision": p, "rows": None, "context": None,
                                    "skipped": "budget spent"})
                continue
            print(f"{name} {p} ...", flush=True)
            try:
                gens[p], infos[p] = open_variant(args, name, p, folder, tok)
            except Exception as e:  # noqa: BLE001 - the other precisions are still measured
                res["rows"].append(row := {"model": name, "precision": p, "rows": None, "context": None})
                failed(row, e)
        emit()
        for ctx in args.contexts:
            for rows in args.rows:
                made = {p: {"model": name, "precision": p, "rows": rows, "context": ctx, **infos[p]} for p in gens}
                res["rows"].extend(made.values())
                if over():
                    for p, row in made.items():
                        row["skipped"] = "budget spent"
                        res["budget"]["skipped"].append(f"{name}/{p}/{ctx}/{rows}")
                    emit()
                    continue
                cells = {}

                def attempt(p, fn):  # a variant that fails records its error and leaves the rotation
                    try:
                        with switches(p):
                            fn()
                    except Exception as e:  # noqa: BLE001
                        failed(made[p], e)
                        cells.pop(p, None)

                def start(p):
                    cells[p] = Cell(args, gens[p], tok, rows, ctx)
                    cells[p].warm(made[p])

                for p in gens:
                    attempt(p, lambda p=p: start(p))
                for r in range(args.repeats):
                    order = list(cells)
                    for p in order[r % len(order):] + order[:r % len(order)] if order else []:
                        attempt(p, lambda p=p, r=r: cells[p].once(r))
                for p, cell in cells.items():  # in --precisions order: bf16's row is done before the others' vs bf16
                    cell.finish(made[p], name, res, args)
                emit()
    finally:
        gens.clear()
        release(args.device)


def bounds(row: dict, name: str, res: dict, args) -> None:
    """The row's memory and compute bounds (module docstring), which binds, its share of that, and vs bf16."""
    _, v = SHAPES[name]
    rows, ctx = row["rows"], row["context"] + (args.new_tokens + 1) / 2
    act = 2 if row["compute"] in ("bf16", "fp16") else 4
    step_bytes = row["linear_bytes"] + rows * v["hidden_size"] * act + kv_bytes(name, rows, ctx, act)
    mem = rows * res["bandwidth"]["bytes_per_s"] / step_bytes
    rate = res["matmul"].get(name)
    comp = rows * rate / (rows * step_flops(name, ctx)) if rate else None
    row["step_bytes"] = step_bytes
    row["mem_bound_tokens_per_s"] = mem
    row["compute_bound_tokens_per_s"] = comp
    row["binds"] = "memory" if comp is None or mem <= comp else "compute"
    speed = row.get("decode_tokens_per_s")
    if speed:
        row["share_of_bound"] = speed / min(mem, comp or mem)
        base = next((r for r in res["rows"] if r["model"] == name and r["precision"] == "bf16"
                     and r["rows"] == rows and r["context"] == row["context"] and r.get("decode_tokens_per_s")), None)
        if base is not None and base is not row:
            row["vs_bf16"] = speed / base["decode_tokens_per_s"]


def table(res: dict) -> str:
    head = ["model", "precision", "compute", "ctx", "rows", "GiB", "peak GiB", "full", "prefill tok/s",
            "decode tok/s", "mem bound", "compute bound", "binds", "of bound", "vs bf16", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in res["rows"]:
        note = r.get("error") or r.get("skipped") or r.get("decode_fallback") or ""
        cells = [r["model"], r["precision"], r.get("compute", ""), r.get("context"), r.get("rows"),
                 fmt(r.get("total_bytes") and r["total_bytes"] / 2**30, ".2f"), fmt(r.get("peak_gib"), ".1f"),
                 "" if "full" not in r else ("yes" if r["full"] else "NO"),
                 fmt(r.get("prefill_tokens_per_s"), ".0f"), fmt(r.get("decode_tokens_per_s"), ".0f"),
                 fmt(r.get("mem_bound_tokens_per_s"), ".0f"), fmt(r.get("compute_bound_tokens_per_s"), ".0f"),
                 r.get("binds", ""), fmt(r.get("share_of_bound"), ".1%"), fmt(r.get("vs_bf16"), ".2f"),
                 str(note).replace("|", "/")[:120]]
        lines.append("| " + " | ".join("" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines)


def _parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="", help="cuda:0 where CUDA is, else cpu")
    ap.add_argument("--models", default="Qwen2.5-1.5B,Qwen3-8B,Qwen2.5-0.5B,Qwen3-4B,Qwen2.5-14B")
    ap.add_argument("--precisions", default="", help="default: CUDA bf16,int8,int4,fp8/weight_only,fp8/scaled_mm,"
                    "nf4; CPU every precision the torch backend serves there")
    ap.add_argument("--rows", default="8,32")
    ap.add_argument("--contexts", default="512,2048", help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--compute-rows", type=int, default=4096, help="rows of the matmul-rate measurement")
    ap.add_argument("--bandwidth-gib", type=float, default=0.0, help="default: 2 on CUDA, 1/4 on a CPU")
    ap.add_argument("--tokenizer", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--interleave", action="store_true",
                    help="per model, hold every precision's generator at once and time them in turn (docstring)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "model_ladder.json"))
    ap.add_argument("--rebound", default="", metavar="PATH",
                    help="a finished run's JSON: read the machine's rates again, recompute its bounds")
    args = ap.parse_args(argv)
    if args.rebound:
        return args
    import torch

    from qgrpo.rollout.options import QUANT_SERVED

    args.device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    cuda = args.device.startswith("cuda")
    args.models = args.models.split(",")
    unknown = [m for m in args.models if m not in SHAPES]
    if unknown:
        ap.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    args.precisions = (args.precisions.split(",") if args.precisions else
                       ["bf16", "int8", "int4", "fp8/weight_only", "fp8/scaled_mm", "nf4"] if cuda
                       else list(QUANT_SERVED["cpu"]))
    served = QUANT_SERVED["cuda" if cuda else "cpu"]
    routes = {"fp8": ("", "weight_only", "scaled_mm"),
              "int8": ("", "kernel", "torch", "noprefetch", "fused", "wide"), "int4": ("", "kernel", "torch", "wide"),
              "bf16": ("", "torch", "wide")}
    bad = [p for p in args.precisions if p.partition("+")[0].partition("/")[0] not in served
           or p.partition("+")[0].partition("/")[2] not in routes.get(p.partition("/")[0], ("",))
           or p.partition("+")[2] not in ("", "head")]
    if bad:
        ap.error(f"--precisions: {', '.join(bad)} not served by the torch backend on this device; "
                 f"choose from {', '.join(served)} (fp8/weight_only, fp8/scaled_mm on CUDA; int8/kernel, int8/torch, "
                 "int8/noprefetch, int8/fused, int4/kernel, int4/torch, bf16/torch, FORMAT/wide on CPU; FORMAT+head: a "
                 "tied head quantized too)")
    args.rows = [int(x) for x in args.rows.split(",")]
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.bandwidth_gib = args.bandwidth_gib or (2.0 if cuda else 0.25)
    return args


def machine_of(device: str) -> tuple[str, str, str | None, str]:
    """The device's name, the CPU's model (CPU), the driver (CUDA), and the words the JSON's `machine` gives them."""
    import torch
    import transformers

    cuda = device.startswith("cuda")
    name, cpu_model, driver = torch.cuda.get_device_name(device) if cuda else "cpu", "", None
    if cuda:
        try:
            import subprocess

            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=20).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            pass
    else:
        try:
            cpu_model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                             if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
    words = (f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}, driver {driver}, "
             f"transformers {transformers.__version__}" if cuda else
             f"{cpu_model or 'a CPU'}, {os.cpu_count()} CPUs, torch {torch.__version__}, transformers "
             f"{transformers.__version__}")
    return name, cpu_model, driver, words


def machine_rates(args, dtype) -> dict:
    """This machine's read bandwidth, and each model's gate/up product at many rows (the rate its decode step can
    compute at), measured now."""
    cuda = args.device.startswith("cuda")
    read = {"bandwidth": read_bandwidth(args.device, args.bandwidth_gib), "matmul": {}, "matmul_routes": {}}
    for m in args.models:
        n, k = linear_shapes(m)["gate_up"]
        read["matmul_routes"][m] = {}
        read["matmul"][m] = matmul_rate(args.device, dtype, k, n, args.compute_rows if cuda else 64,
                                        routes=read["matmul_routes"][m])
    release(args.device)
    return read


def take_rates(res: dict, reads: list[dict]) -> None:
    """The bounds' rates from every read this run made (`rate_reads`): the highest bandwidth and each model's highest
    matmul rate, since a bound is the best the machine did. Rows already measured get their bounds again."""
    res["rate_reads"] = reads
    res["bandwidth"] = max(reads, key=lambda r: r["bandwidth"]["bytes_per_s"])["bandwidth"]
    res["matmul"], res["matmul_routes"] = {}, {}
    for m in dict.fromkeys(m for r in reads for m in r["matmul"]):
        best = max((r for r in reads if r["matmul"].get(m)), key=lambda r: r["matmul"][m], default=None)
        if best is not None:
            res["matmul"][m], res["matmul_routes"][m] = best["matmul"][m], best["matmul_routes"].get(m, {})
    args = argparse.Namespace(**res["args"])
    for row in res["rows"]:
        if row.get("decode_tokens_per_s"):
            bounds(row, row["model"], res, args)


def rebound(path: str, argv) -> dict:
    """`--rebound PATH`: the machine's rates read once more for a finished run, on the machine that made it."""
    import torch

    from qgrpo.core.cpu import compute_dtype, torch_dtype

    out = Path(path)
    res = json.loads(out.read_text())
    saved = argparse.Namespace(**res["args"])
    here = machine_of(saved.device)[3]
    if here != res["machine"]:
        raise SystemExit(f"--rebound: {path} was measured on {res['machine']!r}, this is {here!r}; read the rates "
                         "on the machine that made it")
    reads = res.get("rate_reads") or [{k: res.get(k, {}) for k in ("bandwidth", "matmul", "matmul_routes")}]
    take_rates(res, [*reads, machine_rates(saved, torch_dtype(compute_dtype("auto", torch.device(saved.device))[0]))])
    res["command"] += "\n" + caps_prefix() + ".venv/bin/python bench/model_ladder.py " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    res["table"] = table(res)
    out.write_text(json.dumps(finite(res), indent=2, allow_nan=False, default=str) + "\n")
    print(f"{path}: read {res['bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s over {len(res['rate_reads'])} reads")
    print(res["table"])
    return res


def main(argv=None) -> dict:
    t_start = time.perf_counter()
    args = _parse(argv)
    if args.rebound:
        return rebound(args.rebound, argv)
    import torch
    import transformers

    from qgrpo.core.cpu import compute_dtype, torch_dtype

    cuda = args.device.startswith("cuda")
    name, cpu_model, driver, machine = machine_of(args.device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res = {"command": caps_prefix() + ".venv/bin/python bench/model_ladder.py "
                      + shlex.join(sys.argv[1:] if argv is None else argv),
           "device_name": name, "cpu": cpu_model or None, "cpus": os.cpu_count(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "transformers": transformers.__version__,
           "args": {k: v for k, v in vars(args).items()}, "rows": [],
           "omp": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")},
           "budget": {"budget_s": args.budget_s, "skipped": []}}
    if cuda:
        res["driver"] = driver
    else:
        from qgrpo.core.cpu import isa
        from qgrpo.rollout.quantization import cpu_kernels, cpu_native

        res["cpu_int8_kernel"] = cpu_native.describe()  # qgrpo's or torch's (`int8/torch` variants: torch's)
        res["cpu_int4_kernel"] = cpu_kernels.describe("int4")  # and the same for int4 (`int4/torch`)
        res["cpu_isa"] = isa().words()
    res["machine"] = machine

    def emit() -> None:
        res["budget"]["elapsed_s"] = time.perf_counter() - t_start
        out.write_text(json.dumps(finite(res), indent=2, allow_nan=False, default=str) + "\n")

    over = lambda: time.perf_counter() - t_start > args.budget_s  # noqa: E731
    tok, res["tokenizer"], res["tokenizer_note"] = load_tokenizer(args.tokenizer)
    dtype = torch_dtype(compute_dtype("auto", torch.device(args.device))[0])
    res["compute_dtype"] = str(dtype).removeprefix("torch.")
    take_rates(res, [machine_rates(args, dtype)])
    print(f"{name}: read {res['bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s; "
          + ", ".join(f"{m} {r / 1e12:.2f} TFLOP/s" for m, r in res["matmul"].items()), flush=True)
    emit()
    with tempfile.TemporaryDirectory(prefix="model_ladder_") as folder:
        tok.save_pretrained(folder)  # the generator reads the tokenizer here; the model comes built
        for m in args.models if args.interleave else ():
            run_interleaved(args, m, folder, tok, res, emit, over)
        for p in args.precisions if not args.interleave else ():  # precision-major: every model's bf16 first
            for m in args.models:
                if over():
                    res["budget"]["skipped"].append(f"{m}/{p}")
                    res["rows"].append({"model": m, "precision": p, "rows": None, "context": None,
                                        "skipped": "budget spent"})
                    emit()
                    continue
                print(f"{m} {p} ...", flush=True)
                run_variant(args, m, p, folder, tok, res, emit, over)
    take_rates(res, [*res["rate_reads"], machine_rates(args, dtype)])
    res["table"] = table(res)
    emit()
    print(f"\n{name}{f' ({cpu_model})' if cpu_model else ''}, torch {torch.__version__}; tokenizer "
          f"{res['tokenizer']}{' (' + res['tokenizer_note'] + ')' if res['tokenizer_note'] else ''}; "
          f"{args.new_tokens} new tokens at T=1, median of {args.repeats}; read "
          f"{res['bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s; {res['budget']['elapsed_s']:.0f} s of "
          f"{args.budget_s:.0f}" + (f"; skipped: {', '.join(res['budget']['skipped'])}"
                                    if res["budget"]["skipped"] else ""))
    print(res["table"])
    print(f"wrote {out}")
    return res


if __name__ == "__main__":
    main()
