"""Learner forward + backward on GRPO-shaped batches: the plain full forward vs the shared-prompt forward
(learner.shared_prompt), side by side in one run, on the real model.

    .venv/bin/python bench/learner_step.py [--model builtin:smollm2-135m-instruct] [--groups 8] [--group-size 8]

A batch is `--groups` prompts of `--prompt-len` tokens, each with `--group-size` completions of `--completion-len`
tokens (the default job's shape: few-shot prompts ~130 tokens, completions ~18). Each variant runs `--repeats` times
after one warm-up; the table shows the median. Writes bench/results/learner_step.json. Ratios are what to read.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=130)
    ap.add_argument("--completion-len", type=int, default=18)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "learner_step.json"))
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from qgrpo.core.scoring import token_logprobs
    from qgrpo.rollout.modeling.models import resolve_model_path

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(args.model), dtype=torch.bfloat16)
    model.train()
    G, N, P, C = args.group_size, args.groups, args.prompt_len, args.completion_len
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size, (N * G, P + C), generator=g)
    ids[:, :P] = ids[::G, :P].repeat_interleave(G, dim=0)  # G completions per prompt
    mask = torch.zeros(N * G, P + C)
    mask[:, P:] = 1
    variants = {"full forward": {},
                "shared prompt": {"prompt_lens": torch.full((N * G,), P), "group_ids": torch.arange(N * G) // G}}
    rows, reference = [], None
    for name, kw in variants.items():
        fwd, bwd = [], []
        for rep in range(args.repeats + 1):
            t0 = time.perf_counter()
            logp = token_logprobs(model, ids, 1.0, **kw) * mask
            t1 = time.perf_counter()
            logp.sum().backward()
            t2 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            if rep:  # the first pass is a warm-up
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
        value = logp.detach()
        diff = 0.0 if reference is None else float((value - reference).abs().max())
        reference = value if reference is None else reference
        f, b = statistics.median(fwd), statistics.median(bwd)
        rows.append({"variant": name, "forward_s": f, "backward_s": b, "total_s": f + b,
                     "completion_tokens_per_s": N * G * C / (f + b), "max_abs_logp_diff_vs_full": diff})
    base = rows[0]["total_s"]
    print(f"batch: {N} prompts x {G} completions, prompt {P} + completion {C} tokens, bf16, {args.threads} threads")
    print(f"{'variant':<15}{'forward s':>10}{'backward s':>11}{'total s':>9}{'speed-up':>9}{'tok/s':>8}"
          f"{'max |dlogp|':>12}")
    for r in rows:
        print(f"{r['variant']:<15}{r['forward_s']:>10.2f}{r['backward_s']:>11.2f}{r['total_s']:>9.2f}"
              f"{base / r['total_s']:>9.2f}{r['completion_tokens_per_s']:>8.0f}{r['max_abs_logp_diff_vs_full']:>12.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
