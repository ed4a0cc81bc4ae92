"""Rollout generator backends side by side, in one process, on the real SmolLM2-135M-Instruct:

1. generation tokens/s of torch bf16, torch int8, mlx bf16, mlx int8, mlx int4, vllm bf16, vllm int8 (our
   generators, via `make_generator`) at 32 x 64 (4 prompts x 8 completions x 64 new tokens) and 128 x 64
   (16 prompts x 8 x 64), T = 1; the mlx rows at 32 x 64 only (see below);
2. bare vLLM (`vllm.LLM` as it comes, a separate engine) on the same prompt ids, and the ratio ours / bare
   (target >= 0.9: what our wrapper costs on top of vLLM);
3. one weight sync per generator as a rollout actor does it: `load_weights` of the model's own bf16 state dict
   (strict check, re-quantization, reload) plus the fingerprint probe (`score` of the probe sequence), also as a share
   of a default-job step;
4. weight bytes per generator (`memory_bytes`: linear and total).

MLX rows. mlx bf16 is the unquantized model computed in fp32 on CPU (MLX's CPU bf16 matmuls are very slow), so its
weights take fp32 bytes; int8 / int4 are `nn.quantize` with group size 64. On Linux MLX runs on its CPU build, on the
system OpenBLAS when the backend finds one (the header says which). MLX's CPU quantized matmul is slow: on this
2-core machine a 32 x 64 run took ~47 s at mlx bf16 but ~270 s at int8 and ~315 s at int4 (~6x), so a 128 x 64 run
of a quantized mlx variant alone would take ~10 minutes or more. The mlx variants are therefore timed at 32 x 64
only, the quantized ones once (`--repeats` applies to mlx bf16), each after a small warm-up (1 prompt x 8 completions
x 4 tokens; MLX compiles nothing to warm up). On Apple silicon (Metal) MLX's quantized kernels are not slow, but that
was not measured here. Like vLLM's, mlx's "linear" bytes leave out the tied embedding / lm_head, which torch counts
as a Linear. The default run took 29 minutes on this 2-core machine, about half of it mlx int8 / int4; --quick
should take ~17 (estimated, not timed), mostly the same two mlx runs.

    .venv/bin/python bench/rollout_backends.py [--cache-dir DIR] [--repeats N] [--out PATH]
    .venv/bin/python bench/rollout_backends.py --quick   # smoke check: 32 x 64 only, 1 repeat (mlx dominates)

Completions may stop early at EOS, so tokens/s counts the tokens actually generated. Each generator gets one warm-up
call (vLLM's first call warms up for ~5 s); then the shapes are timed `--repeats` times, ours and bare vLLM
interleaved so that load from other jobs hits both alike, and the median is reported. Generators run one at a time
(torch, mlx, then vLLM: vLLM's CPU worker may re-pin threads for the rest of the process), each freed before the
next is built. Prints tables and writes bench/results/rollout_backends.json (rollout_backends_quick.json with
--quick).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from qgrpo.actors.common import thread_env  # noqa: E402  (imports nothing but os: safe before torch)

STEP_S = 20.0  # one step of the default job, as measured in the README (seed 0, `qgrpo report`: ~20 s per step)
GROUP, NEW_TOKENS = 8, 64
SHAPES = {"32x64": 4, "128x64": 16}  # name (completions x new tokens): prompts
MLX_SHAPE = "32x64"  # the only shape the mlx variants are timed at (MLX's CPU quantized matmul is slow: module doc)
MLX_QUANT_REPEATS = 1  # timed runs of mlx int8 / int4 (~4.5 and ~5.5 minutes at 32 x 64 here)
QUESTIONS = ["Calculate 3 + 4.", "Calculate 9 - 5.", "Calculate 6 * 7.", "Calculate 8 + 8.", "Calculate 12 - 7.",
             "Calculate 5 * 3.", "Calculate 14 + 9.", "Calculate 20 - 13.", "Calculate 4 * 9.", "Calculate 7 + 15.",
             "Calculate 30 - 18.", "Calculate 6 * 6.", "Calculate 25 + 17.", "Calculate 11 - 4.", "Calculate 3 * 8.",
             "Calculate 19 + 23."]


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache-dir", default="", help="builtin models' cache (default: $QGRPO_CACHE or ~/.cache/qgrpo, "
                    "where `make train` converted SmolLM2)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quick", action="store_true", help="32 x 64 only, 1 repeat")
    ap.add_argument("--out", default="")
    return ap.parse_args()


def _ours(gen):
    """A runner of our generator: (prompt items, seed) -> completion tokens generated."""
    from qgrpo.core.records import SamplingParams

    def run(its, seed):
        groups = gen.generate(its, SamplingParams(GROUP, NEW_TOKENS, temperature=1.0, seed=seed))
        return sum(len(c.token_ids) for g in groups for c in g.completions)
    return run


class Timings:
    """The rows of one run (generation, weight sync, memory) and what every timing shares: the arguments, the shapes,
    the prompt items and the bf16 state dict a sync streams."""

    def __init__(self, args: argparse.Namespace, shapes: dict, items: list, state: dict):
        self.args, self.shapes, self.items, self.state = args, shapes, items, state
        self.gen_rows, self.sync_rows, self.mem_rows = [], [], []

    def generation(self, variants: dict, only: dict | None = None, repeats: int = 0, warm: bool = True) -> None:
        """Warm each runner up once (unless `warm` is off), then time every shape (or `only`) `repeats` times
        (default --repeats), variants interleaved; median tokens/s."""
        if warm:
            for run in variants.values():
                run(self.items[:SHAPES["32x64"]], 0)
        for shape, n in (only or self.shapes).items():
            samples = {name: [] for name in variants}
            for r in range(repeats or self.args.repeats):
                for name, run in variants.items():
                    t0 = time.perf_counter()
                    tokens = run(self.items[:n], 1000 + r)
                    samples[name].append((tokens, time.perf_counter() - t0))
            for name, s in samples.items():
                self.gen_rows.append({"variant": name, "shape": shape, "tokens": [t for t, _ in s],
                                      "seconds": [round(x, 3) for _, x in s],
                                      "tokens_per_s": statistics.median(t / x for t, x in s)})

    def sync_and_memory(self, name: str, gen) -> None:
        from qgrpo.rollout.backends.common import probe_ids

        times, probe_times = [], []
        probe = probe_ids(gen.tokenizer)
        for version in (1, 2):
            t0 = time.perf_counter()
            gen.load_weights(version, list(self.state.items()))
            t1 = time.perf_counter()
            gen.score(probe)
            times.append(time.perf_counter() - t0)
            probe_times.append(time.perf_counter() - t1)
        self.sync_rows.append({"variant": name, "seconds": times, "probe_seconds": probe_times,
                               "median_s": statistics.median(times),
                               "pct_of_step": 100 * statistics.median(times) / STEP_S})
        self.mem_rows.append({"variant": name, **gen.memory_bytes()})


def _time_torch_and_mlx(t: Timings, path: str) -> None:
    """torch and mlx first: vLLM's CPU worker may re-pin threads for the whole process once it starts."""
    from qgrpo.core.records import SamplingParams
    from qgrpo.rollout.backends import make_generator

    for precision in ("bf16", "int8"):
        name = f"torch {precision}"
        gen = make_generator("torch", model_path=path, precision=precision, generator_id=f"torch-{precision}",
                             chat_template=True)
        t.generation({name: _ours(gen)})
        t.sync_and_memory(name, gen)
        del gen
        gc.collect()

    # mlx: 32 x 64 only, the quantized variants timed once (module doc); a small warm-up (MLX compiles nothing).
    from qgrpo.rollout.backends.mlx_backend import import_mlx

    mx = import_mlx()  # puts the system OpenBLAS under MLX (if there is one) before mlx.core loads
    mlx_repeats = {"bf16": t.args.repeats, "int8": MLX_QUANT_REPEATS, "int4": MLX_QUANT_REPEATS}
    for precision in ("bf16", "int8", "int4"):
        name = f"mlx {precision}"
        gen = make_generator("mlx", model_path=path, precision=precision, generator_id=f"mlx-{precision}", seed=0,
                             chat_template=True)
        gen.generate(t.items[:1], SamplingParams(GROUP, 4, temperature=1.0, seed=0))
        t.generation({name: _ours(gen)}, only={MLX_SHAPE: SHAPES[MLX_SHAPE]},
                     repeats=min(mlx_repeats[precision], t.args.repeats), warm=False)
        t.sync_and_memory(name, gen)
        del gen
        gc.collect()
        mx.clear_cache()  # MLX keeps freed buffers for reuse: hand them back before the next generator


def _bare(llm, prompt_ids: list, sampling):
    """A runner of the bare vLLM engine `llm` on the prompt ids our generator built."""
    from vllm.inputs import TokensPrompt

    def run(its, seed):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids[:len(its)]], sampling,
                            use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)
    return run


def _time_vllm(t: Timings, path: str) -> None:
    """Our vLLM generator beside a bare vLLM engine fed the same prompt ids, interleaved."""
    from vllm import LLM
    from vllm import SamplingParams as VSamplingParams

    from qgrpo.rollout.backends import make_generator
    from qgrpo.rollout.backends.common import format_prompt
    from qgrpo.rollout.backends.vllm_backend import write_int8_folder

    for precision in ("bf16", "int8"):
        gen = make_generator("vllm", model_path=path, precision=precision, generator_id=f"vllm-{precision}",
                             chat_template=True)
        # Sync first: vLLM keeps its parallel groups process-wide, and closing the bare engine below tears them down
        # for ours too, so ours is only used for generation while both are alive.
        t.sync_and_memory(f"vllm {precision}", gen)
        # A separate bare engine (never the one inside our generator), fed the very prompt ids ours builds.
        prompt_ids = [format_prompt(gen.tokenizer, it, True) for it in t.items]
        bare_sp = VSamplingParams(n=GROUP, max_tokens=NEW_TOKENS, temperature=1.0, logprobs=0,
                                  stop_token_ids=gen.stop_ids)
        with tempfile.TemporaryDirectory(prefix="bench-int8-") as tmp:
            model = path if precision == "bf16" else str(write_int8_folder(path, Path(tmp)))
            llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, distributed_executor_backend="uni", seed=0,
                      logprobs_mode="processed_logprobs")
            bare = _bare(llm, prompt_ids, bare_sp)
            t.generation({f"vllm {precision}": _ours(gen), f"bare vllm {precision}": bare})
            del llm, bare  # at most two engines alive: drop the bare one before the next generator starts
            gc.collect()
        del gen
        gc.collect()


def _result(t: Timings, path: str, started: str, t_start: float) -> dict:
    """The JSON of the run: the rows, ours / bare vLLM per precision and shape, and the versions."""
    from importlib.metadata import version as dist_version

    import mlx_lm
    import torch
    import vllm

    from qgrpo.rollout.backends.mlx_backend import blas_status

    args = t.args
    rate = {(r["variant"], r["shape"]): r["tokens_per_s"] for r in t.gen_rows}
    ratios = []
    for precision in ("bf16", "int8"):
        for shape in t.shapes:
            o, b = rate[(f"vllm {precision}", shape)], rate[(f"bare vllm {precision}", shape)]
            ratios.append({"precision": precision, "shape": shape, "ours": o, "bare": b, "ratio": o / b})
    return {
        "meta": {"date": started, "torch": torch.__version__, "vllm": vllm.__version__, "mlx": dist_version("mlx"),
                 "mlx_lm": mlx_lm.__version__, "mlx_blas": blas_status(), "cpu_count": os.cpu_count(), "model": path,
                 "args": vars(args), "group_size": GROUP, "max_new_tokens": NEW_TOKENS, "step_s": STEP_S,
                 "mlx_shape": MLX_SHAPE, "mlx_quant_repeats": min(MLX_QUANT_REPEATS, args.repeats),
                 "total_s": round(time.perf_counter() - t_start, 1)},
        "generation": t.gen_rows, "ours_vs_bare": ratios, "weight_sync": t.sync_rows, "memory_bytes": t.mem_rows,
    }


def main() -> None:
    args = _parse()
    t_start = time.perf_counter()
    if args.quick:
        args.repeats = 1
    shapes = {"32x64": SHAPES["32x64"]} if args.quick else SHAPES
    out = Path(args.out or ROOT / "bench" / "results" / f"rollout_backends{'_quick' if args.quick else ''}.json")
    args.out, started = str(out), datetime.datetime.now().isoformat(timespec="seconds")
    # Before torch is imported: PASSIVE OpenMP (spinning idle threads slow a shared machine many times over).
    os.environ.update(thread_env(args.threads))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    import torch
    import vllm  # noqa: F401  (imported before any generator, as the timings were taken)
    from safetensors.torch import load_file

    from qgrpo.core.records import PromptItem
    from qgrpo.rollout.modeling.models import resolve_model_path

    torch.set_num_threads(args.threads)
    path = resolve_model_path("builtin:smollm2-135m-instruct", args.cache_dir)
    items = [PromptItem(f"q{i}", q, "") for i, q in enumerate(QUESTIONS)]
    state = load_file(str(Path(path) / "model.safetensors"))  # the bf16 weights a sync streams
    t = Timings(args, shapes, items, state)
    _time_torch_and_mlx(t, path)
    _time_vllm(t, path)
    result = _result(t, path, started, t_start)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")  # before the tables: a table bug must not lose the run
    print_tables(result)
    print(f"\nwrote {out}")


def print_tables(result: dict) -> None:
    """The tables of one run, from its JSON (also: `print_tables(json.load(open(path)))` re-prints a saved run)."""
    meta, gen_rows = result["meta"], result["generation"]
    step_s, repeats, quant_repeats = meta["step_s"], meta["args"]["repeats"], meta["mlx_quant_repeats"]
    rate = {(r["variant"], r["shape"]): r["tokens_per_s"] for r in gen_rows}
    print(f"\nSmolLM2-135M-Instruct, {meta['group_size']} completions x {meta['max_new_tokens']} new tokens per "
          f"prompt, T=1, {meta['args']['threads']} threads, median of {repeats} (mlx int8/int4: {quant_repeats} run"
          f"{'s' if quant_repeats > 1 else ''}); torch {meta['torch']}, vllm {meta['vllm']}, mlx {meta['mlx']} + "
          f"mlx-lm {meta['mlx_lm']} on BLAS {meta['mlx_blas']}")
    shape = meta["mlx_shape"]
    slow = ", ".join(f"{p} {rate[('mlx bf16', shape)] / rate[(f'mlx {p}', shape)]:.1f}x" for p in ("int8", "int4")
                     if ("mlx bf16", shape) in rate and (f"mlx {p}", shape) in rate)
    print(f"mlx rows at {shape} only: MLX's CPU quantized matmul is slow (time per token vs mlx bf16: {slow}; "
          "Metal not measured)")
    cols = [("variant", [r["variant"] for r in gen_rows]), ("shape", [r["shape"] for r in gen_rows]),
            ("tokens", ["/".join(map(str, r["tokens"])) for r in gen_rows]),
            ("seconds", ["/".join(f"{x:.2f}" for x in r["seconds"]) for r in gen_rows]),
            ("tok/s", [f"{r['tokens_per_s']:.0f}" for r in gen_rows])]
    # Each column as wide as its widest value, two spaces apart: a value never runs into the next column.
    widths = [max(len(h), *map(len, v)) + (0 if k == 0 else 2) for k, (h, v) in enumerate(cols)]

    def line(cells):
        return "".join(f"{c:<{w}}" if k == 0 else f"{c:>{w}}" for k, (c, w) in enumerate(zip(cells, widths)))

    print("\n" + line([h for h, _ in cols]))
    for j in range(len(gen_rows)):
        print(line([v[j] for _, v in cols]))
    print(f"\n{'precision':<10}{'shape':>8}{'ours tok/s':>12}{'bare tok/s':>12}{'ours/bare':>11}  target >= 0.9")
    for r in result["ours_vs_bare"]:
        print(f"{r['precision']:<10}{r['shape']:>8}{r['ours']:>12.0f}{r['bare']:>12.0f}{r['ratio']:>11.2f}  "
              f"{'ok' if r['ratio'] >= 0.9 else 'BELOW'}")
    print(f"\n{'variant':<16}{'sync s':>14}{'median s':>10}{f'% of {step_s:.0f} s step':>16}")
    for r in result["weight_sync"]:
        print(f"{r['variant']:<16}{'/'.join(f'{x:.2f}' for x in r['seconds']):>14}{r['median_s']:>10.2f}"
              f"{r['pct_of_step']:>15.1f}%")
    print(f"\n{'variant':<16}{'linear MB':>10}{'total MB':>10}")
    for r in result["memory_bytes"]:
        print(f"{r['variant']:<16}{r['linear'] / 2**20:>10.1f}{r['total'] / 2**20:>10.1f}")
    print("(mlx bf16 is held in fp32 on CPU; vllm and mlx leave the tied embedding / lm_head out of linear)")
    print(f"\nbench took {meta['total_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
