"""Generation speed of the torch generator per precision, side by side, on a real model and task.

    .venv/bin/python bench/generation_speed.py [--model builtin:smollm2-135m-instruct] [--precisions bf16,int8,int4]
    .venv/bin/python bench/generation_speed.py --config configs/smollm2_arith.toml   # the default job's prompts

Samples group_size completions for each of `--prompts` reasoning-gym prompts (chat template, answer-tag instruction;
with --config: that preset's task, examples, group size, max_new_tokens and temperature) with every precision in one
run, prints a table and writes bench/results/generation_speed.json. Prefill (the prompts' forward, once per prompt)
and decode are timed separately. Ratios between rows are what to read on a busy machine; absolute tokens/s move with
the load.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--config", default="", help="take task, group size, max_new_tokens, temperature from a preset")
    ap.add_argument("--precisions", default="bf16,int8,int4")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "generation_speed.json"))
    args = ap.parse_args()

    import torch

    from qgrpo.cluster.config.schema import load_config
    from qgrpo.core.records import SamplingParams
    from qgrpo.rollout.backends.torch_backend import TorchGenerator
    from qgrpo.rollout.models import resolve_model_path
    from qgrpo.rollout.tasks import make_task

    torch.set_num_threads(args.threads)
    if args.config:
        cfg = load_config(args.config)
        path = resolve_model_path(cfg.model.path)
        ro = cfg.rollout
        sampling = SamplingParams(ro.group_size, ro.max_new_tokens, temperature=ro.temperature, seed=1)
    else:
        path = resolve_model_path(args.model)
        cfg = load_config(None, [f"model.path={json.dumps(path)}", "task.name='rg:basic_arithmetic'",
                                 "task.params={min_terms=2, max_terms=2, min_digits=1, max_digits=1}"])
        sampling = SamplingParams(args.group_size, args.max_new_tokens, temperature=1.0, seed=1)
    items = [make_task(cfg.task, 0).item(i) for i in range(args.prompts)]
    rows = []
    for precision in args.precisions.split(","):
        gen = TorchGenerator(path, precision=precision)
        gen.generate(items[:1], SamplingParams(2, 4, seed=0))  # warm-up: kernels, allocator
        # Prefill alone: the same forward the generator runs first (one row per prompt, one logit kept).
        prefill = gen.prefill_seconds(items)
        t0 = time.perf_counter()
        groups = gen.generate(items, sampling)
        seconds = time.perf_counter() - t0
        comps = [c for g in groups for c in g.completions]
        tokens = sum(len(c.token_ids) for c in comps)
        rows.append({"precision": precision, "seconds": seconds, "prefill_s": prefill, "new_tokens": tokens,
                     "tokens_per_s": tokens / seconds,
                     "linear_mb": gen.memory_bytes()["linear"] / 2**20,
                     "answer_tags": sum("<answer>" in c.text for c in comps) / len(comps)})
        del gen
    base = rows[0]["tokens_per_s"]
    print(f"{len(items)} prompts x {sampling.group_size} completions, up to {sampling.max_new_tokens} new tokens, "
          f"T={sampling.temperature}, {args.threads} threads")
    print(f"{'precision':<10}{'seconds':>9}{'prefill s':>10}{'tokens':>8}{'tok/s':>8}{'vs ' + rows[0]['precision']:>9}"
          f"{'linear MB':>11}{'tags':>7}")
    for r in rows:
        print(f"{r['precision']:<10}{r['seconds']:>9.1f}{r['prefill_s']:>10.2f}{r['new_tokens']:>8}{r['tokens_per_s']:>8.0f}"
              f"{r['tokens_per_s'] / base:>9.2f}{r['linear_mb']:>11.1f}{r['answer_tags']:>7.0%}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
