"""The real learner (DeepSpeed, one rank, in-process, in the dtype it computes in on this machine: bf16 where the CPU
has it natively, else fp32) on a GRPO batch, variants side by side in one run: seconds per step split into forward /
backward / optimizer, useful FLOP/s against the matmul ceiling in that dtype measured by this same script at the
learner's own shapes, and each variant's peak RSS.

    .venv/bin/python bench/learner_profile.py [--groups 4 --group-size 8 --prompt-len 70 --completion-len 64]

The default batch is the TRL comparison's (bench/vs_trl.py): 4 prompts x 8 completions x 64 tokens, zero-shot prompts
of ~70 tokens. Each variant runs in its own process (so its peak RSS is its own) for `--steps` steps; the table shows
the median of the steps after the first. Writes bench/results/learner_profile.json. Ratios are what to read: the
machine is shared and noisy.

Variants: `full logits` is the learner before the chunked head (the model's own forward: [B, T, vocab] float32
logits at once); `chunked` is the default; `eager` swaps SDPA attention for the eager one; `micro 16` splits the 32
sequences into two micro-batches of 16 (gradient accumulation), longest first; `full prompts` runs every row's
prompt (learner.shared_prompt = false: one causal forward without a cache or a mask, as TRL does); `padded
suffixes` runs the completions right-padded to the longest (the shared-prompt pass before packing: no seq_lens);
`autograd head` scores
through the checkpointed autograd chunk instead of the plain-Linear head's own forward and backward (core/scoring.py);
`checkpointing` turns on learner.gradient_checkpointing (the default job's setting); `compiled layers` compiles
each decoder layer with torch.compile (inductor, dynamic shapes; not in the default list: its first step is the
compile, minutes on a small CPU, from an empty inductor cache) and reports its first step and the graphs dynamo
made; `plain torch`
is the same model, batch, log-probs and loss, the learner's own optimizer object and torch's gradient clipping, and no
DeepSpeed: what the DeepSpeed engine costs (in bf16 without fp32 master weights, which DeepSpeed's bf16 mode keeps).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "full logits": {"chunked": False},
    "chunked": {"attn": "sdpa"},
    "chunked + eager attention": {"attn": "eager"},  # the default on CPU (learner.attention = "auto")
    "eager + padded suffixes": {"attn": "eager", "packed": False},  # before packing: rows padded to the longest
    "chunked + micro 16": {"micro": 16},
    "chunked + full prompts": {"shared": False},
    "plain torch (no DeepSpeed)": {"plain": True},
    "eager + autograd head": {"attn": "eager", "autograd_head": True},  # before the hand-written head's backward
    "eager + checkpointing": {"attn": "eager", "checkpointing": True},  # learner.gradient_checkpointing = true
    "sdpa + checkpointing": {"attn": "sdpa", "checkpointing": True},
    "eager + checkpointing + autograd head": {"attn": "eager", "checkpointing": True, "autograd_head": True},
    "sdpa + compiled layers": {"attn": "sdpa", "compile": True},  # opt-in: minutes of compiling in its first step
}
DEFAULT_VARIANTS = [name for name, v in VARIANTS.items() if not v.get("compile")]


def batch(args, vocab: int):
    """A GRPO batch: `groups` prompts x `group_size` completions, completion lengths spread uniformly over
    `len_spread`-100% of max."""
    import torch

    from qgrpo.learner.batch import TrainBatch

    G, N, P, C = args.group_size, args.groups, args.prompt_len, args.completion_len
    g = torch.Generator().manual_seed(0)
    B, T = N * G, P + C
    ids = torch.randint(100, vocab, (B, T), generator=g)
    ids[:, :P] = ids[::G, :P].repeat_interleave(G, dim=0)
    lens = (C * (args.len_spread + (1 - args.len_spread) * torch.rand(B, generator=g))).long().clamp(min=1)
    mask = torch.zeros(B, T)
    for b in range(B):
        mask[b, P:P + int(lens[b])] = 1
        ids[b, P + int(lens[b]):] = 0
    return TrainBatch(input_ids=ids, completion_mask=mask, mu_logp=-torch.rand(B, T) * mask,
                      advantages=torch.randn(B, generator=g), policy_versions=torch.zeros(B, dtype=torch.long),
                      prompt_lens=torch.full((B,), P), group_ids=torch.arange(B) // G, seq_lens=P + lens,
                      total_sequences=B,
                      total_tokens=float(mask.sum()), max_new_tokens=C), lens


def useful_flops(cfg, args, lens) -> float:
    """Forward + backward (2x forward) matmul FLOPs of one step with shared prompts: each prompt's prefix through the
    trunk once, each completion (+ its last prompt token) through the trunk and the head. Attention scores included;
    padding, and the head's recomputation in the backward pass, are not counted (overhead, not useful work)."""
    H, I, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = H * cfg.num_key_value_heads // cfg.num_attention_heads
    per_token_trunk = 2 * L * (H * H * 2 + 2 * H * kv + 3 * H * I)  # q, o, k, v projections and the gated MLP
    P, N = args.prompt_len, args.groups
    prefix = N * (P - 1)
    seg = (lens + 1).double()  # each completion and its last prompt token
    suffix = float(seg.sum())
    attn = 2 * 2 * L * H * (N * (P - 1) ** 2 / 2 + float((seg * (P - 1) + seg ** 2 / 2).sum()))
    fwd = (prefix + suffix) * per_token_trunk + suffix * 2 * H * V + attn
    return 3 * fwd


def matmul_ceiling(cfg, tokens: int, threads: int, dtype=None, device: str = "cpu") -> dict:
    """Matrix products (bf16 unless `dtype` says otherwise) at the learner's shapes (tokens x hidden times hidden x
    {intermediate, vocab chunk}, and the transposed weight-gradient shape), on `device`; the best is the ceiling."""
    import torch

    dtype = dtype or torch.bfloat16
    torch.set_num_threads(threads)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes = {"x@W_mlp": (tokens, H, I), "x@W_head(1024)": (1024, H, V), "dY^T@x (grad)": (I, tokens, H)}
    out = {}
    for name, (m, k, n) in shapes.items():
        a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
        for _ in range(2):
            a @ b
        sync()
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 1.5:
            for _ in range(1 if device == "cpu" else 20):  # a GPU product takes microseconds: time them in tens
                a @ b
                reps += 1
            sync()
        out[name] = 2 * m * k * n * reps / (time.perf_counter() - t0)
    return out


def batch_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The model, batch shape, steps and threads of a learner bench (defaults: the TRL comparison's batch)."""
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=70)
    ap.add_argument("--completion-len", type=int, default=64)
    ap.add_argument("--len-spread", type=float, default=0.75, help="shortest completion, as a share of the longest")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    return ap


def run_child(script: str, variant: str) -> dict:
    """`script --variant NAME` with this process's arguments in a process of its own; its last stdout line (JSON)."""
    cmd = [sys.executable, script, "--variant", variant, *sys.argv[1:]]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}
    # compiled variants: a cold compile in an inductor cache of their own, as on a new machine's first run
    cold = tempfile.mkdtemp(prefix="inductor-") if VARIANTS[variant].get("compile") else None
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                           env={**env, "TORCHINDUCTOR_CACHE_DIR": cold} if cold else env)
    finally:
        if cold:
            shutil.rmtree(cold, ignore_errors=True)
    if p.returncode:
        print(p.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"variant {variant!r} failed")
    return json.loads(p.stdout.strip().splitlines()[-1])


def one_rank_env() -> None:
    """The environment of a one-rank gloo process group on a free local port, DeepSpeed on its CPU accelerator."""
    import socket

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      DS_ACCELERATOR="cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])


def run_variant(args) -> None:
    """Child process: one variant, JSON on stdout's last line."""
    one_rank_env()
    import torch

    torch.set_num_threads(args.threads)
    v = VARIANTS[args.variant]
    import qgrpo.core.scoring as scoring

    if v.get("chunked", True) is False:
        scoring._HEAD_AFTER_TRUNK = set()
    if v.get("autograd_head"):  # every head through the checkpointed autograd chunk (core/scoring.py)
        scoring._plain_linear = lambda head: False
    from transformers import AutoConfig

    from qgrpo.learner.engine import Learner
    from qgrpo.learner.settings import LearnerSettings
    from qgrpo.rollout.modeling.models import resolve_model_path

    path = resolve_model_path(args.model)
    cfg = AutoConfig.from_pretrained(path)
    b, lens = batch(args, cfg.vocab_size)
    order = lens.argsort(descending=True)  # longest first: the micro-batches' padding follows their own longest row
    b = b.select(order)
    if v.get("packed", True) is False:
        b.seq_lens = None
    if v.get("plain"):
        return print(json.dumps(plain_torch(path, b, args.steps)))
    learner = Learner(path, LearnerSettings(lr=1e-6, micro_batch_per_rank=v.get("micro", 64), sequences_per_rank=len(b),
                                            zero_stage=0, shared_prompt=v.get("shared", True),
                                            attention=v.get("attn", "auto"),
                                            gradient_checkpointing=v.get("checkpointing", False)))
    if v.get("compile"):
        compile_layers(learner.engine.module)
    steps = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        r = learner.train_step(b)
        steps.append({"total": time.perf_counter() - t0, **r.timing})
    extra = {"graphs": _graphs()} if v.get("compile") else {}
    print(json.dumps({"steps": steps, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                      **extra}))


def compile_layers(model) -> None:
    """torch.compile (inductor, dynamic shapes) of every decoder layer in place (Module.compile: the state dict keeps
    its names). The layers specialise on their index and on the cache's length (each layer's graph is its own), so
    dynamo's recompile limit is raised past the layer count instead of falling back to eager after 8 layers."""
    import torch._dynamo

    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(layers))
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                           16 * len(layers))
    for m in layers:
        m.compile(dynamic=True)


def _graphs() -> int:
    """The graphs dynamo compiled in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def plain_torch(path: str, b, steps: int) -> dict:
    """The learner's forward, loss and backward without DeepSpeed, in the dtype the learner computes in here
    (core/cpu.py) and with the attention learner.attention = "auto" picks for it: its own optimizer object
    (learner/optim.py: torch's AdamW with the guard; in fp32 over bf16-valued weights with fp32 masters, as the learner
    keeps them) and torch's gradient clipping at 1.0. In bf16 the AdamW steps the bf16 weights themselves: no fp32
    masters, less work than DeepSpeed's bf16 mode does."""
    import torch
    from transformers import AutoModelForCausalLM

    from qgrpo.core.cpu import compute_dtype, torch_dtype
    from qgrpo.core.scoring import token_logprobs
    from qgrpo.learner.engine import auto_attention
    from qgrpo.learner.objective.loss import aggregation_weights, grpo_loss
    from qgrpo.learner.objective.settings import ObjectiveSettings
    from qgrpo.learner.optim import guarded_optimizer

    dtype, _ = compute_dtype("auto", "cpu")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype),
                                                 attn_implementation=auto_attention(torch.device("cpu"), dtype))
    if dtype == "fp32":  # bf16 values held in fp32, as the learner starts
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16))
    model.config.use_cache = False
    model.train()
    opt = guarded_optimizer("adamw", list(model.parameters()), round_weights=dtype == "fp32", lr=1e-6)
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logp = token_logprobs(model, b.input_ids, 1.0, b.prompt_lens, b.group_ids, seq_lens=b.seq_lens)
        w = aggregation_weights(b.completion_mask, "token_mean", num_sequences=b.total_sequences,
                                num_tokens=b.total_tokens, max_len=b.max_new_tokens)
        loss, _ = grpo_loss(logp, logp.detach(), b.mu_logp, None, b.advantages, b.completion_mask, w,
                            ObjectiveSettings(kl_coeff=0.0))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        out.append({"total": t3 - t0, "forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2})
    return {"steps": out, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> None:
    ap = batch_arguments(argparse.ArgumentParser())
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"comma-separated, of: {', '.join(VARIANTS)} (default: all but the compiled one)")
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "learner_profile.json"))
    args = ap.parse_args()
    if args.variant:
        return run_variant(args)

    from transformers import AutoConfig

    from qgrpo.rollout.modeling.models import resolve_model_path

    cfg = AutoConfig.from_pretrained(resolve_model_path(args.model))
    _, lens = batch(args, cfg.vocab_size)
    flops = useful_flops(cfg, args, lens)
    load0 = os.getloadavg()[0]
    from qgrpo.core.cpu import compute_dtype, torch_dtype

    dtype, _ = compute_dtype("auto", "cpu")
    ceiling = matmul_ceiling(cfg, args.groups * args.group_size * (args.completion_len + 1), args.threads,
                             torch_dtype(dtype))
    best = max(ceiling.values())
    rows = []
    for name in args.variants.split(","):
        res = run_child(__file__, name)
        timed = res["steps"][1:] or res["steps"]
        med = {k: statistics.median(s[k] for s in timed) for k in timed[0]}
        rows.append({"variant": name, **{f"{k}_s": v for k, v in med.items()}, "peak_rss_gb": res["peak_rss_gb"],
                     "first_step_s": res["steps"][0]["total"], **({"graphs": res["graphs"]} if "graphs" in res else {}),
                     "tflops": flops / med["total"] / 1e12, "pct_of_ceiling": 100 * flops / med["total"] / best,
                     "steps": res["steps"]})
        print(f"  {name}: {med['total']:.2f} s/step", file=sys.stderr, flush=True)
    load1 = os.getloadavg()[0]
    head = (f"learner: {args.model}, {args.groups} prompts x {args.group_size} completions, prompt {args.prompt_len} + "
            f"completion {args.len_spread:.0%}-100% of {args.completion_len} tokens, {dtype}, DeepSpeed ZeRO-0, "
            f"1 rank, {args.threads} threads; "
            f"median of steps 2-{args.steps}\nuseful work {flops / 1e12:.2f} TFLOP per step; {dtype} matmul ceiling "
            f"measured here {best / 1e12:.2f} TFLOP/s (" + ", ".join(f"{k} {v / 1e12:.2f}" for k, v in ceiling.items())
            + f"); load average {load0:.1f} -> {load1:.1f}")
    lines = [head, f"{'variant':<26}{'fwd s':>7}{'bwd s':>7}{'opt s':>7}{'step s':>8}{'TFLOP/s':>9}"
                   f"{'% ceil':>8}{'peak RSS GB':>12}{'1st step s':>11}"]
    for r in rows:
        lines.append(f"{r['variant']:<26}{r['forward_s']:>7.2f}{r['backward_s']:>7.2f}{r['optimizer_s']:>7.2f}"
                     f"{r['total_s']:>8.2f}{r['tflops']:>9.3f}{r['pct_of_ceiling']:>8.1f}{r['peak_rss_gb']:>12.2f}"
                     f"{r['first_step_s']:>11.1f}" + (f"  ({r['graphs']} graphs)" if "graphs" in r else ""))
    print("\n".join(lines))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "compute_dtype": dtype, "useful_tflop_per_step": flops / 1e12,
                               "ceiling_tflops": {k: v / 1e12 for k, v in ceiling.items()},
                               "load_average": [load0, load1], "rows": rows, "table": "\n".join(lines)}, indent=2))


if __name__ == "__main__":
    main()
