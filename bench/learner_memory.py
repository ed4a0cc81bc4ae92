"""The memory-lean learner side by side in one run: peak memory and seconds per step of the real learner (DeepSpeed,
one rank, in-process) in each learner.mode / learner.optimizer / learner.gradient_checkpointing combination.

    .venv/bin/python bench/learner_memory.py [--groups 4 --group-size 8 --prompt-len 70 --completion-len 64]

The batch is bench/learner_profile.py's (the TRL comparison's: 4 prompts x 8 completions x 64 tokens, prompts of
~70 tokens, shared-prompt forward). Gradient checkpointing runs with the shared-prompt forward (its prompt cache
replayed: core/kv_replay.py) and with full prompts, each beside its "no GC" partner. Each variant runs in its own
process, so its peak RSS is its own (Python, torch and DeepSpeed included: the `idle` row is that floor, nothing
built). Columns: trainable parameters, bytes of the model's tensors (weights in their stored format, NF4 packed
plus its scales for QLoRA), of the optimizer state (moments, plus DeepSpeed's fp32 master copy of what trains), peak
RSS, RSS after building the engine, and the median s/step of the steps after the first. Writes
bench/results/learner_memory.json; ratios are what to read.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# name: (mode, optimizer, gradient checkpointing, shared prompt)
VARIANTS = {
    "idle": None,
    "full / adamw": ("full", "adamw", False, True),
    "full / adamw8bit": ("full", "adamw8bit", False, True),
    "lora / adamw": ("lora", "adamw", False, True),
    "qlora / adamw": ("qlora", "adamw", False, True),
    "qlora / adamw8bit": ("qlora", "adamw8bit", False, True),
    "full / adamw + GC": ("full", "adamw", True, True),
    "full / adamw8bit + GC": ("full", "adamw8bit", True, True),
    "lora + GC": ("lora", "adamw", True, True),
    "qlora + GC": ("qlora", "adamw", True, True),
    "full / adamw, full prompts": ("full", "adamw", False, False),
    "full / adamw, full prompts + GC": ("full", "adamw", True, False),
    "lora, full prompts": ("lora", "adamw", False, False),
    "lora, full prompts + GC": ("lora", "adamw", True, False),
    "qlora, full prompts": ("qlora", "adamw", False, False),
    "qlora, full prompts + GC": ("qlora", "adamw", True, False),
}


def _rss_gb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def _nbytes(tensors) -> int:
    import torch

    total = 0
    for t in tensors:
        if torch.is_tensor(t):
            total += t.numel() * t.element_size()
            qs = getattr(t, "quant_state", None)  # bitsandbytes 4-bit: block scales (and their own, nested)
            if qs is not None:
                total += qs.absmax.numel() * qs.absmax.element_size()
                if qs.nested:
                    total += qs.state2.absmax.numel() * qs.state2.absmax.element_size()
    return total


def run_variant(args) -> None:
    """Child process: one variant, JSON on stdout's last line."""
    from learner_profile import batch, one_rank_env

    one_rank_env()
    import torch
    from transformers import AutoConfig

    from qgrpo.learner.engine import Learner
    from qgrpo.learner.settings import LearnerSettings
    from qgrpo.rollout.modeling.models import resolve_model_path

    torch.set_num_threads(args.threads)
    spec = VARIANTS[args.variant]
    if spec is None:  # the floor: the same imports, nothing built
        import deepspeed  # noqa: F401  (imported by the learner in every other variant)

        return print(json.dumps({"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
    mode, optimizer, gc, shared = spec
    path = resolve_model_path(args.model)
    b, lens = batch(args, AutoConfig.from_pretrained(path).vocab_size)
    settings = LearnerSettings(lr=1e-5, micro_batch_per_rank=64, sequences_per_rank=len(b), zero_stage=0,
                               shared_prompt=shared, mode=mode, optimizer=optimizer, gradient_checkpointing=gc,
                               lora=dict(rank=args.lora_rank, alpha=2.0 * args.lora_rank, dropout=0.0,
                                         target_modules=["all-linear"]))
    learner = Learner(path, settings)
    rss_built = _rss_gb()
    module = learner.engine.module
    steps = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        r = learner.train_step(b)
        steps.append({"total": time.perf_counter() - t0, **r.timing})
        assert r.skipped == "", r.skipped
    opt = learner.optimizer  # DeepSpeed's bf16 wrapper: its fp32 masters, and the inner optimizer's moments
    state = [v for s in learner.inner_optimizer.state.values() for v in s.values()]
    masters = [p for g in learner.inner_optimizer.param_groups for p in g["params"]]
    print(json.dumps({
        "steps": steps, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "rss_built_gb": rss_built, "trainable_params": sum(p.numel() for p in module.parameters() if p.requires_grad),
        "model_bytes": _nbytes(list(module.parameters()) + list(module.buffers())),
        "optimizer_state_bytes": _nbytes(state), "master_bytes": _nbytes(masters), "wrapper": type(opt).__name__}))


def main() -> None:
    from learner_profile import batch_arguments, run_child

    ap = batch_arguments(argparse.ArgumentParser())
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--variants", default=";".join(VARIANTS), help="names separated by ';'")
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "learner_memory.json"))
    args = ap.parse_args()
    if args.variant:
        return run_variant(args)
    load0 = os.getloadavg()[0]
    rows = []
    for name in args.variants.split(";"):
        res = run_child(__file__, name)
        row = {"variant": name, **res}
        if "steps" in res:
            timed = res["steps"][1:] or res["steps"]
            row.update({f"{k}_s": statistics.median(s[k] for s in timed) for k in timed[0]})
        rows.append(row)
        print(f"  {name}: peak {res['peak_rss_gb']:.2f} GB" + (f", {row['total_s']:.2f} s/step" if "steps" in res
                                                                 else ""), file=sys.stderr, flush=True)
    load1 = os.getloadavg()[0]
    gb = lambda x: f"{x / 2**30:.3f}" if x is not None else "-"  # noqa: E731
    head = (f"learner memory: {args.model}, {args.groups} prompts x {args.group_size} completions, prompt "
            f"{args.prompt_len} + completion <= {args.completion_len} tokens, DeepSpeed ZeRO-0 bf16, 1 rank, "
            f"{args.threads} threads, LoRA rank {args.lora_rank} on every linear layer; median of steps 2-{args.steps};"
            f" load average {load0:.1f} -> {load1:.1f}")
    lines = [head, f"{'variant':<34}{'trainable':>11}{'model GB':>10}{'optim GB':>10}{'built GB':>10}"
                   f"{'peak RSS GB':>13}{'s/step':>8}{'fwd':>7}{'bwd':>7}{'opt':>7}"]
    for r in rows:
        if "steps" not in r:
            lines.append(f"{r['variant']:<34}{'-':>11}{'-':>10}{'-':>10}{'-':>10}{r['peak_rss_gb']:>13.2f}")
            continue
        lines.append(f"{r['variant']:<34}{r['trainable_params'] / 1e6:>10.2f}M{gb(r['model_bytes']):>10}"
                     f"{gb(r['optimizer_state_bytes'] + r['master_bytes']):>10}{r['rss_built_gb']:>10.2f}"
                     f"{r['peak_rss_gb']:>13.2f}{r['total_s']:>8.2f}{r['forward_s']:>7.2f}{r['backward_s']:>7.2f}"
                     f"{r['optimizer_s']:>7.2f}")
    print("\n".join(lines))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "load_average": [load0, load1], "rows": rows,
                               "table": "\n".join(lines)}, indent=2))


if __name__ == "__main__":
    main()
