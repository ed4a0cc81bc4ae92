"""Where the learner's step goes, by operator: one step of the real learner (DeepSpeed, one rank, in-process, the
compute dtype the run would choose on this machine) under torch.profiler, at the default job's shape and at the TRL
comparison's, each operator's own time put in one bucket:

- matrix products of the decoder (q/k/v/o and MLP projections, forward and backward), with their FLOP rate against
  the ceiling this script measures at the same shapes and dtype;
- matrix products of the log-prob head (hidden x vocab), the same;
- attention (score and value products, softmax, masks) and the rest of the log-prob head (log-softmax, gather);
- elementwise work and norms (the decoder's and the loss's);
- copies, casts and fills outside DeepSpeed and the optimizer;
- DeepSpeed's own work (the engine's and its optimizer wrapper's copies, flattening, clipping, all-reduce);
- the optimizer (torch's AdamW, the learner's guard and bf16 rounding of fp32 masters);
- Python and dispatch: time in Python functions (the model's, the loss's, autograd's), outside any operator;
- time the profiler saw in no event at all.

On a GPU (`--device cuda`) each operator's own time is the GPU time of the kernels it launched (the profiler's
self device time), the ceiling is the card's bf16 matmul rate at the same shapes, and the last bucket, "GPU idle", is
the step's wall time in which no kernel of ours ran: the host's Python, dispatch and launches the GPU waited for.

    .venv/bin/python bench/learner_ops.py                              # both shapes
    .venv/bin/python bench/learner_ops.py --shapes trl --publish       # one shape, then bench/published/
    python bench/learner_ops.py --device cuda --config bench/gpu_step.toml --model FOLDER --shapes default --out F

Writes bench/results/learner_ops.json and prints a table; `--publish` also writes
bench/published/learner_ops.{json,txt}. Each shape runs in its own process: a warm-up step, a timed step, then the
profiled step. The buckets are operators' self times on the profiled step; the profiler's own cost shows as the
profiled step's wall time over the timed one's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from gpu_speed import one_rank_env as gpu_rank_env  # noqa: E402
from learner_profile import batch, matmul_ceiling, one_rank_env, useful_flops  # noqa: E402
from sides import machine, versions  # noqa: E402

DEFAULT_CONFIG = ROOT / "configs" / "smollm2_arith.toml"
# The TRL comparison's batch (bench/vs_trl.py): 4 prompts x 8 completions x up to 64 tokens, prompts of ~70 tokens.
TRL = {"groups": 4, "group_size": 8, "prompt_len": 70, "completion_len": 64, "len_spread": 0.75,
       "gradient_checkpointing": False, "kl_coeff": 0.0}
BUCKETS = ("matmul: decoder", "matmul: log-prob head", "attention", "log-prob head (softmax, gather)",
           "elementwise and norms", "copies, casts, fills", "DeepSpeed", "optimizer", "Python and dispatch",
           "outside operators")
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation"}
COPIES = {"aten::copy_", "aten::_to_copy", "aten::clone", "aten::cat", "aten::fill_", "aten::zero_",
          "aten::zeros_like", "aten::empty_like", "aten::index", "aten::index_put_", "aten::_unsafe_view",
          "aten::contiguous", "aten::stack", "aten::full", "aten::zeros", "aten::ones", "aten::new_zeros"}
WAITS = ("<built-in method acquire of _thread.lock", "<built-in method acquire of _thread.RLock")
HEAD_BACKWARD = ("LogSoftmaxBackward", "GatherBackward", "LogsumexpBackward", "_LinearHeadLogprobsBackward")
ATTENTION_BACKWARD = ("BmmBackward", "SoftmaxBackward", "ScaledDotProduct", "MaskedFillBackward")


def default_shape(config: Path, model: str = "") -> dict:
    """The default job's learner batch: prompts_per_step x group_size rows, prompts as the task renders them (mean
    length of a step's prompts), completions up to max_new_tokens; its KL and gradient checkpointing."""
    from transformers import AutoTokenizer

    from qgrpo.cluster.config.schema import load_config
    from qgrpo.rollout.backends.common import format_prompt
    from qgrpo.rollout.data.tasks import make_task
    from qgrpo.rollout.modeling.models import resolve_model_path

    cfg = load_config(str(config))
    tok = AutoTokenizer.from_pretrained(resolve_model_path(model or cfg.model.path))
    task = make_task(cfg.task, cfg.run.seed)
    lens = [len(format_prompt(tok, task.item(i))) for i in range(cfg.rollout.prompts_per_step)]
    return {"groups": cfg.rollout.prompts_per_step, "group_size": cfg.rollout.group_size,
            "prompt_len": round(sum(lens) / len(lens)), "completion_len": cfg.rollout.max_new_tokens,
            "len_spread": 0.5, "gradient_checkpointing": cfg.learner.gradient_checkpointing,
            "kl_coeff": cfg.algo.kl_coeff}


def is_python(event) -> bool:
    """A Python function the profiler traced ('path/to/file.py(123): name'), not an operator."""
    return ".py(" in event.name


def frames(event) -> list[str]:
    """The Python functions the event ran inside, innermost first (the event itself when it is one)."""
    out, e = [], event
    while e is not None:
        if is_python(e):
            out.append(e.name)
        e = e.cpu_parent
    return out


def owner(event) -> str:
    """Who called the operator: the innermost frame of interest ("deepspeed", "optimizer", "model", "autograd")."""
    for fr in frames(event):
        path = "/" + fr.replace("\\", "/")  # the profiler names files from their package folder
        if "/torch/optim/" in path or "learner/optim.py" in path:
            return "optimizer"
        if "/deepspeed/" in path:
            # The engine's forward and backward hand the work to the model and to autograd: not DeepSpeed's own.
            func = path.rsplit(": ", 1)[-1]
            return "autograd" if "engine.py" in path and func in ("forward", "backward", "_call_impl") \
                else "deepspeed"
        if "/transformers/" in path or "core/scoring.py" in path or "learner/objective" in path \
                or "core/kv_replay.py" in path:
            return "model"
        if "/torch/autograd/" in path or "torch/utils/checkpoint.py" in path:
            return "autograd"
    return ""


def backward_of(event) -> str:
    """The autograd node an operator runs for ('MmBackward0'), '' in the forward pass."""
    e = event.cpu_parent
    while e is not None:
        if e.name.startswith("autograd::engine::evaluate_function: "):
            return e.name.split(": ", 1)[1]
        e = e.cpu_parent
    return ""


# The head's functions in core/scoring.py: the autograd chunk (_chunk_logprobs, _picked*) and the plain-Linear head's
# own forward and backward (_LinearHeadLogprobs; the profiler names a frame by its function, not its class).
HEAD_FUNCTIONS = ("_picked", "_picked_entropy", "_chunk_logprobs", "_logits", "forward", "backward")


def in_head(event) -> bool:
    return any("core/scoring.py" in fr and fr.rsplit(": ", 1)[-1] in HEAD_FUNCTIONS for fr in frames(event))


def in_attention(event) -> bool:
    return any("attention" in fr.rsplit(": ", 1)[-1].lower() for fr in frames(event))


def matmul_flops(event) -> float:
    """2mkn (times the batch for bmm) from the recorded input shapes; 0 when they are missing."""
    shapes = [s for s in (event.input_shapes or []) if s]
    if event.name in ("aten::addmm", "aten::baddbmm", "aten::_addmm_activation"):
        shapes = shapes[1:3]
    if len(shapes) < 2:
        return 0.0
    a, b = shapes[0], shapes[1]
    if len(a) == 2 and len(b) == 2:
        return 2.0 * a[0] * a[1] * b[1]
    if len(a) == 3 and len(b) == 3:
        return 2.0 * a[0] * a[1] * a[2] * b[2]
    return 0.0


def bucket(event, vocab: int) -> str:
    who, grad = owner(event), backward_of(event)
    if who == "optimizer":
        return "optimizer"
    if who == "deepspeed" and not grad:
        return "DeepSpeed"
    name = event.name
    if name.startswith(WAITS) or name.endswith(": wait"):
        return "waiting"  # a thread blocked while another works: not added up
    if is_python(event) or not name.startswith("aten::"):
        return "Python and dispatch"  # time in Python functions and profiler scopes, outside any operator
    if name in MATMULS:
        shapes = [d for s in (event.input_shapes or []) for d in (s or [])]
        if vocab in shapes:
            return "matmul: log-prob head"
        if name in ("aten::bmm", "aten::baddbmm") or grad.startswith("Bmm"):
            return "attention"
        return "matmul: decoder"
    if in_head(event) or grad.startswith(HEAD_BACKWARD):
        return "log-prob head (softmax, gather)"
    if in_attention(event) or grad.startswith(ATTENTION_BACKWARD) or "attention" in name:
        return "attention"
    if name in COPIES or grad.startswith(("ToCopyBackward", "CloneBackward", "CatBackward")):
        return "copies, casts, fills"
    return "elementwise and norms"


def run_shape(args) -> None:
    """Child process: one shape, JSON on stdout's last line."""
    cuda = args.device == "cuda"
    gpu_rank_env("cuda:0") if cuda else one_rank_env()
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoConfig

    from qgrpo.learner.engine import Learner
    from qgrpo.learner.objective.settings import ObjectiveSettings
    from qgrpo.learner.settings import LearnerSettings
    from qgrpo.rollout.modeling.models import resolve_model_path

    torch.set_num_threads(args.threads)
    shape = json.loads(args.shape_json)
    path = resolve_model_path(args.model)
    cfg = AutoConfig.from_pretrained(path)
    ns = argparse.Namespace(**{k: shape[k] for k in ("groups", "group_size", "prompt_len", "completion_len",
                                                     "len_spread")})
    b, lens = batch(ns, cfg.vocab_size)
    b = b.select(lens.argsort(descending=True))
    if shape["kl_coeff"]:
        b.ref_logp = b.mu_logp.clone()
    learner = Learner(path, LearnerSettings(
        lr=1e-6, micro_batch_per_rank=len(b), sequences_per_rank=len(b), zero_stage=0,
        gradient_checkpointing=shape["gradient_checkpointing"],
        objective=ObjectiveSettings(kl_coeff=shape["kl_coeff"])), device="cuda:0" if cuda else None)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    walls = []
    for _ in range(2):  # warm-up, then the timed step
        sync()
        t0 = time.perf_counter()
        learner.train_step(b)
        sync()
        walls.append(time.perf_counter() - t0)
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities, record_shapes=True, with_stack=True) as prof:
        t0 = time.perf_counter()
        learner.train_step(b)
        sync()
        profiled = time.perf_counter() - t0
    seconds, flops, per_thread = defaultdict(float), defaultdict(float), defaultdict(float)
    top: dict = defaultdict(lambda: [0.0, 0])  # (name, bucket) -> [own seconds, calls]
    from torch.autograd import DeviceType

    for e in prof.events():
        if cuda and e.device_type != DeviceType.CPU:
            continue  # kernels: their time is their launching operator's self device time
        own = (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e6
        k = bucket(e, cfg.vocab_size)
        if k == "waiting":
            per_thread["waiting"] += own
            continue
        if cuda and own == 0:
            continue
        seconds[k] += own
        per_thread[e.thread] += own
        t = top[(e.name if not is_python(e) else e.name.split("(")[0] + ": " + e.name.rsplit(": ", 1)[-1], k)]
        t[0] += own
        t[1] += 1
        if e.name in MATMULS:
            flops[k] += matmul_flops(e)
    seconds["GPU idle" if cuda else "outside operators"] = max(0.0, profiled - sum(seconds.values()))
    print(json.dumps({"shape": shape, "compute_dtype": learner.compute_dtype, "compute_why": learner.compute_why,
                      "warmup_s": walls[0], "step_s": walls[1], "profiled_s": profiled,
                      "self_s_per_thread": {str(k): v for k, v in per_thread.items()},
                      "top": [{"name": n, "bucket": b, "self_s": v[0], "calls": v[1]}
                              for (n, b), v in sorted(top.items(), key=lambda kv: -kv[1][0])[:40]],
                      "seconds": dict(seconds), "matmul_flop": dict(flops),
                      "useful_tflop": useful_flops(cfg, ns, lens) / 1e12, "device": args.device,
                      "gpu": torch.cuda.get_device_name(0) if cuda else None,
                      "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None}))


def ceiling(args, shape: dict, dtype: str) -> dict:
    """Matrix-product rates (FLOP/s) at the learner's shapes of `shape`, in its compute dtype."""
    from transformers import AutoConfig

    from qgrpo.core.cpu import torch_dtype
    from qgrpo.rollout.modeling.models import resolve_model_path

    cfg = AutoConfig.from_pretrained(resolve_model_path(args.model))
    tokens = shape["groups"] * shape["group_size"] * (shape["completion_len"] + 1)
    return matmul_ceiling(cfg, tokens, args.threads, torch_dtype(dtype), "cuda:0" if args.device == "cuda" else "cpu")


def table(result: dict) -> str:
    out = []
    for r in result["shapes"]:
        s, total = r["shape"], r["profiled_s"]
        best = max(r["ceiling_flops"].values())
        out.append(f"{r['name']}: {s['groups']} prompts x {s['group_size']} completions, prompt {s['prompt_len']} + "
                   f"completion {s['len_spread']:.0%}-100% of {s['completion_len']} tokens, "
                   f"{'gradient checkpointing, ' if s['gradient_checkpointing'] else ''}KL {s['kl_coeff']}; "
                   f"computed in {r['compute_dtype']} ({r['compute_why']})")
        out.append(f"step {r['step_s']:.2f} s unprofiled, {total:.2f} s profiled; useful work {r['useful_tflop']:.3f} "
                   f"TFLOP = {100 * r['useful_tflop'] * 1e12 / r['step_s'] / best:.1f}% of the {r['compute_dtype']} "
                   f"matmul ceiling measured here ({best / 1e9:.1f} GFLOP/s: " + ", ".join(
                       f"{k} {v / 1e9:.1f}" for k, v in r["ceiling_flops"].items()) + ")")
        if r.get("device") == "cuda":
            out.append(f"on {r['gpu']}: operators' own GPU time; peak allocated "
                       f"{r['peak_gpu_bytes'] / 2**30:.1f} GiB")
        out.append(f"{'bucket':<34}{'s':>8}{'share':>8}{'GFLOP/s':>9}{'% ceil':>8}")
        for k in BUCKETS + (("GPU idle",) if r.get("device") == "cuda" else ()):
            sec = r["seconds"].get(k, 0.0)
            fl = r["matmul_flop"].get(k, 0.0)
            rate = f"{fl / sec / 1e9:>9.1f}{100 * fl / sec / best:>8.1f}" if fl and sec else f"{'':>9}{'':>8}"
            out.append(f"{k:<34}{sec:>8.2f}{100 * sec / total:>7.1f}%{rate}")
        out.append("")
    return "\n".join(out).rstrip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", choices=("default", "trl"), default=["default", "trl"])
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct",
                    help="builtin:NAME or a folder (bench/model_shapes.py save writes a published shape)")
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                    help="the job whose batch is the default shape (bench/gpu_step.toml: the same prompts from a file, "
                         "for a machine without reasoning-gym)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default="", help="the JSON (default bench/results/learner_ops.json)")
    ap.add_argument("--publish", action="store_true")
    ap.add_argument("--shape-json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.shape_json:
        return run_shape(args)
    shapes = {"default": lambda: default_shape(args.config, args.model), "trl": lambda: dict(TRL)}
    rows = []
    for name in args.shapes:
        shape = shapes[name]()
        cmd = [sys.executable, __file__, "--shape-json", json.dumps(shape), "--model", args.model,
               "--threads", str(args.threads), "--device", args.device]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                           env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE",
                                "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", ""))
                                                              if p)})
        if p.returncode:
            print(p.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"shape {name!r} failed")
        r = {"name": name, **json.loads(p.stdout.strip().splitlines()[-1])}
        r["ceiling_flops"] = ceiling(args, shape, r["compute_dtype"])
        rows.append(r)
    result = {"command": " ".join([".venv/bin/python", "bench/learner_ops.py", *sys.argv[1:]]),
              "machine": machine(), "versions": versions(), "shapes": rows}
    text = table(result)
    print(text)
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / "learner_ops.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    if args.publish:
        (ROOT / "bench" / "published" / "learner_ops.json").write_text(json.dumps(result, indent=1))
        (ROOT / "bench" / "published" / "learner_ops.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
