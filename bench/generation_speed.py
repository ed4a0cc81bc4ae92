"""Generation speed of the torch generator, per precision and decode loop, side by side, against the compute bound
measured in the same run.

    .venv/bin/python bench/generation_speed.py                                  # the default job's prompts
    .venv/bin/python bench/generation_speed.py --precisions bf16,int8,int4 --decode static,compiled,forward --repeats 3
    .venv/bin/python bench/generation_speed.py --model builtin:smollm2-135m-instruct --prompts 16 --max-new-tokens 64

Prompts and sampling: those of --config (default: the default job, configs/smollm2_arith.toml: 8 prompts x 8
completions = batch 64, its max_new_tokens and temperature); with --model, reasoning-gym arithmetic prompts at T=1.
Variants are precision x decode loop: `static` is the generator's own (rollout/backends/torch_decode.py: preallocated
KV cache, grouped-query attention as batched products), `compiled` the same step through torch.compile (inductor;
its compile and recompile time is the variant's `warmup_s`), `forward` is transformers' forward on its dynamic cache
(the fallback for other architectures); `int8/torchao` is int8 through torchao's own linear instead of the same
arithmetic as plain torch ops (rollout/quantization/quant.py: INT8_LINEAR). Each variant is warmed up once, then the
variants are timed in turn, `--repeats` rounds, and the median kept, so load from other jobs falls on all of them alike.

The bound: a decode step is, in its matrix products, one [batch, in] x [in, out] product per linear layer of the
model (lm_head included). Each distinct shape is timed here as a bf16 `F.linear` at the batch's rows (median of 20
after warm-up); the sum over layers is the fastest a decode step can be on this CPU with torch's bf16 products, and
batch / that time the bound in tokens/s. `share_of_bound` = a variant's decode tokens/s (prefill excluded) over that
bound. Rows that finish early shrink the batch, which the bound does not: the share counts that against us.

Prints a table and writes bench/results/generation_speed.json (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def matmul_bound(path: str, rows: int, repeats: int = 20) -> dict:
    """Time per decode step of the model's linear layers alone (bf16 products at `rows` rows) and what it allows."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    shapes = Counter((m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear))
    del model
    per_shape, step_s, flops = [], 0.0, 0
    for (k, n), count in sorted(shapes.items()):
        x, w = torch.randn(rows, k, dtype=torch.bfloat16), torch.randn(n, k, dtype=torch.bfloat16)
        for _ in range(3):
            F.linear(x, w)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            F.linear(x, w)
            times.append(time.perf_counter() - t0)
        s = statistics.median(times)
        per_shape.append({"in": k, "out": n, "layers": count, "seconds": s, "gflops": 2 * rows * k * n / s / 1e9})
        step_s += count * s
        flops += count * 2 * rows * k * n
    return {"rows": rows, "step_s": step_s, "gflop_per_step": flops / 1e9, "gflops": flops / step_s / 1e9,
            "tokens_per_s": rows / step_s, "shapes": per_shape}


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(ROOT / "configs" / "smollm2_arith.toml"),
                    help="take model, task, group size, max_new_tokens, temperature from this config")
    ap.add_argument("--model", default="", help="instead of --config: this model on arithmetic prompts")
    ap.add_argument("--precisions", default="bf16,int8,int8/torchao")
    ap.add_argument("--decode", default="static,forward")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8, help="with --model")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="with --model")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "generation_speed.json"))
    return ap.parse_args()


def _setup(args):
    """(model path, prompt items, sampling) of the run."""
    from qgrpo.cluster.config.schema import load_config
    from qgrpo.core.records import SamplingParams
    from qgrpo.rollout.data.tasks import make_task
    from qgrpo.rollout.modeling.models import resolve_model_path

    if args.model:
        path = resolve_model_path(args.model)
        cfg = load_config(None, [f"model.path={json.dumps(path)}", "task.name='rg:basic_arithmetic'",
                                 "task.params={min_terms=2, max_terms=2, min_digits=1, max_digits=1}"])
        sampling = SamplingParams(args.group_size, args.max_new_tokens, temperature=1.0, seed=1)
    else:
        cfg = load_config(args.config)
        path = resolve_model_path(cfg.model.path)
        ro = cfg.rollout
        sampling = SamplingParams(ro.group_size, ro.max_new_tokens, temperature=ro.temperature, seed=1)
    items = [make_task(cfg.task, 0).item(i) for i in range(args.prompts)]
    return path, items, sampling


def main() -> None:
    args = _parse()
    import torch

    from qgrpo.core.records import SamplingParams
    from qgrpo.rollout.backends.torch_backend import TorchGenerator
    from qgrpo.rollout.backends.torch_decode import StaticDecoder

    torch.set_num_threads(args.threads)
    path, items, sampling = _setup(args)
    batch = len(items) * sampling.group_size
    bound = matmul_bound(path, batch)
    gens, runs = {}, {}
    import qgrpo.rollout.quantization.quant as quant

    for precision in args.precisions.split(","):
        # "int8/torchao": int8 through torchao's own linear (its Python dispatch at every call) instead of the same
        # arithmetic as plain torch ops (rollout/quantization/quant.py: INT8_LINEAR).
        quant.INT8_LINEAR = "torchao" if precision.endswith("/torchao") else "direct"
        gen = TorchGenerator(path, precision=precision.removesuffix("/torchao"))
        decoders = {"static": gen.decoder, "forward": None}
        for decode in args.decode.split(","):
            if decode == "compiled":
                decoders[decode] = StaticDecoder(gen.model, compiled=True)
            gens[(precision, decode)] = (gen, decoders[decode])
            runs[(precision, decode)] = []
    warmup = {}
    for r in range(args.repeats + 1):  # round 0 warms every variant up (kernels, allocator) and is not kept
        for (precision, decode), (gen, decoder) in gens.items():
            gen.decoder = decoder
            prefill = gen.prefill_seconds(items)
            t0 = time.perf_counter()
            groups = gen.generate(items, SamplingParams(sampling.group_size, sampling.max_new_tokens,
                                                        temperature=sampling.temperature, seed=100 + r))
            seconds = time.perf_counter() - t0
            tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
            if r:
                runs[(precision, decode)].append({"seconds": seconds, "prefill_s": prefill, "tokens": tokens})
            else:
                warmup[(precision, decode)] = seconds
    rows = []
    for (precision, decode), rs in runs.items():
        sec = statistics.median(x["seconds"] for x in rs)
        pre = statistics.median(x["prefill_s"] for x in rs)
        decode_tps = statistics.median(x["tokens"] / max(x["seconds"] - x["prefill_s"], 1e-9) for x in rs)
        decoder = gens[(precision, decode)][1]
        rows.append({"precision": precision, "decode": decode, "seconds": sec, "prefill_s": pre,
                     "warmup_s": warmup[(precision, decode)],
                     "compile_error": getattr(decoder, "compile_error", None),
                     "tokens": statistics.median(x["tokens"] for x in rs),
                     "tokens_per_s": statistics.median(x["tokens"] / x["seconds"] for x in rs),
                     "decode_tokens_per_s": decode_tps, "share_of_bound": decode_tps / bound["tokens_per_s"],
                     "runs": rs})
    print(f"{path}: {len(items)} prompts x {sampling.group_size} completions (batch {batch}), up to "
          f"{sampling.max_new_tokens} new tokens, T={sampling.temperature}, {args.threads} threads, median of "
          f"{args.repeats}")
    print(f"bound: bf16 products of the model's linear layers at {batch} rows: {bound['gflop_per_step']:.1f} GFLOP "
          f"per step in {bound['step_s'] * 1e3:.1f} ms ({bound['gflops']:.0f} GFLOP/s) = "
          f"{bound['tokens_per_s']:.0f} tokens/s")
    print(f"{'precision':<13}{'decode':<9}{'seconds':>8}{'prefill s':>10}{'tokens':>8}{'tok/s':>7}"
          f"{'decode tok/s':>13}{'of bound':>9}{'warm-up s':>10}")
    for r in rows:
        print(f"{r['precision']:<13}{r['decode']:<9}{r['seconds']:>8.2f}{r['prefill_s']:>10.2f}{r['tokens']:>8.0f}"
              f"{r['tokens_per_s']:>7.0f}{r['decode_tokens_per_s']:>13.0f}{r['share_of_bound']:>9.0%}"
              f"{r['warmup_s']:>10.1f}" + (f"  (compile failed, ran eager: {r['compile_error']})"
                                          if r["compile_error"] else ""))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "torch": torch.__version__, "model": path, "batch": batch,
                               "bound": bound, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
