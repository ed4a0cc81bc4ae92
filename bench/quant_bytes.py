"""Linear-weight bytes, quantize time and forward time per precision on a SmolLM2-135M-shaped Llama (random bf16
weights, nothing downloaded). Each precision quantizes a fresh deepcopy of the bf16 model, the way a rollout
generator re-quantizes after a weight sync.

    .venv/bin/python bench/quant_bytes.py [--threads N]   # prints a table, writes bench/results/quant_bytes.json

`--requantize` measures instead what sync.requantize costs a rollout actor on the same model
(rollout/quantization/requantize.py): for each emulated format (torch int8, torch int4, vllm int8) and mode (nearest,
stochastic, error_feedback), SYNCS syncs of a slow, steady drift of the fp32 master weights by LR per sync in a fixed
random direction (about an early Adam step at lr 1e-5), as the learner sends them (bf16). Per format and mode: seconds
per sync (prepare + commit), the bytes of state the actor keeps, and the update visibility averaged over the syncs
(share of codes changed, share of bf16 weights changed, the served update's projection on the bf16 one). Writes
bench/results/requantize_costs.json (`--publish`: bench/published/ too).

`--generator-memory` measures instead the torch generator at a sync on the real SmolLM2-135M: one copy re-quantized
in place (what the generator does) against a bf16 master plus a quantized copy rebuilt by deep copy at every sync
(what it did before, reproduced here: load into the master, `quantize_model(copy.deepcopy(master))`). Each (variant,
precision) runs in a fresh process so that its peak RSS (ru_maxrss) is its own: the generator is built, then takes
--syncs full updates of random bf16 weights (the stream a rollout actor holds after receiving them, counted in both
variants). Columns: RSS after start, peak RSS over the syncs, bytes of tensors held (the model, plus the master for
"rebuild"), median seconds per sync. Writes bench/results/generator_memory.json (or --out).

    .venv/bin/python bench/quant_bytes.py --generator-memory --out bench/published/generator_memory.json

Timings depend on torch's thread count; when other jobs share the cores, OpenMP spinning can make 2 threads far
slower than 1, so the thread count is an option and is recorded.
"""

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from qgrpo.rollout.quantization.quant import (  # noqa: E402
    PRECISIONS,
    linear_weight_bytes,
    quant_config_summary,
    quantize_model,
)

OUT = Path(__file__).resolve().parent / "results" / "quant_bytes.json"
BATCH, SEQ, REPEATS = 8, 64, 3
GEN_PROMPTS, GEN_TOKENS = 8, 16


def smollm2_135m_shape() -> LlamaForCausalLM:
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                      max_position_embeddings=8192, pad_token_id=2, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


SYNCS, LR = 10, 1e-5


def requantize_costs(base: LlamaForCausalLM) -> list[dict]:
    """sync.requantize on the model's linear weights: see the module docstring."""
    from qgrpo.rollout.backends import EMULATED_FORMATS, served_grid
    from qgrpo.rollout.quantization.quant import quantized_weight_names
    from qgrpo.rollout.quantization.requantize import Requantizer

    params = dict(base.named_parameters())
    rows = []
    for backend, precision in EMULATED_FORMATS:
        names = quantized_weight_names(base, "int4" if precision == "int4" else "int8", 64, "cpu")
        grids = {n: served_grid(backend, precision, 64) for n in names}
        direction = {n: torch.randn(params[n].shape, generator=torch.Generator().manual_seed(i)).sign()
                     for i, n in enumerate(names)}
        for mode in ("nearest", "stochastic", "error_feedback"):
            master = {n: params[n].detach().float() for n in names}
            rq = Requantizer(mode, grids, [(n, params[n].detach()) for n in names])
            seconds, stats = [], []
            for version in range(1, SYNCS + 1):
                sent = [(n, (master[n] + version * LR * direction[n]).to(torch.bfloat16)) for n in names]
                (prepared, t) = timed(lambda s=sent, v=version: rq.prepare(v, s))
                stats.append(rq.commit(prepared))
                seconds.append(t)
            kept = sum(t.numel() * t.element_size() for k in rq.kept.values()
                       for t in (k.weight, k.codes.codes, k.codes.scale, k.codes.offset, k.residual) if t is not None)
            rows.append({"format": f"{backend} {precision}", "mode": mode, "weights": sum(params[n].numel()
                                                                                     for n in names),
                         "seconds_per_sync": round(statistics.median(seconds), 3), "state_bytes": kept,
                         **{k: statistics.mean(s[k] for s in stats) for k in stats[0]}})
    print(f"sync.requantize on the SmolLM2-135M shape: {SYNCS} syncs of a drift of {LR} per sync, "
          f"{torch.get_num_threads()} threads")
    print(f"{'format':11} {'mode':15} {'s/sync':>7} {'state MB':>8} {'codes chg':>10} {'bf16 chg':>9} "
          f"{'upd proj':>9} {'upd norm':>9}")
    for r in rows:
        print(f"{r['format']:11} {r['mode']:15} {r['seconds_per_sync']:7.2f} {r['state_bytes'] / 1e6:8.1f} "
              f"{r['code_change_frac']:10.2e} {r['bf16_change_frac']:9.2e} {r['update_projection']:9.3f} "
              f"{r['update_norm_ratio']:9.2f}")
    return rows


VARIANTS = ("in_place", "rebuild")
MEMORY_PRECISIONS = ("int8", "int4", "nf4")


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _held_mb(*models) -> float:
    seen, total = set(), 0
    for m in models:
        for t in [*m.parameters(), *m.buffers()]:
            inner = [getattr(t, n) for n in t.__tensor_flatten__()[0]] if hasattr(t, "__tensor_flatten__") else [t]
            for x in inner:
                s = x.untyped_storage()
                if s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    total += s.nbytes()
    return total / 2**20


def measure(variant: str, precision: str, path: str, syncs: int) -> dict:
    """One variant in this process (the child's side)."""
    import copy
    import resource

    import torch

    from qgrpo.rollout.backends.torch_backend import TorchGenerator, load_into
    from qgrpo.rollout.quantization.quant import quantize_model

    torch.set_num_threads(1)
    if variant == "in_place":
        gen = TorchGenerator(path, precision=precision)
        models, shapes = [gen.model], gen._shapes
    else:  # the former generator: a bf16 master beside a quantized deep copy of it
        from transformers import AutoModelForCausalLM

        master = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        model = quantize_model(copy.deepcopy(master), precision).eval()
        models, shapes = [model, master], {n: tuple(p.shape) for n, p in master.named_parameters()}
    start_rss, held = _rss_mb(), _held_mb(*models)
    seconds = []
    for k in range(syncs):
        torch.manual_seed(k)
        stream = [(n, torch.randn(s, dtype=torch.bfloat16) * 0.02) for n, s in shapes.items()]
        t0 = time.perf_counter()
        if variant == "in_place":
            gen.load_weights(k + 1, stream)
        else:
            load_into(master, stream)
            model = quantize_model(copy.deepcopy(master), precision).eval()
        seconds.append(time.perf_counter() - t0)
        del stream
    return {"variant": variant, "precision": precision, "parameters": len(shapes), "start_rss_mb": round(start_rss, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "held_mb": round(held, 1), "sync_s": round(statistics.median(seconds), 3)}


def generator_memory(args) -> None:
    """--generator-memory: each (variant, precision) in a fresh process (module docstring)."""
    import os
    import subprocess

    from qgrpo.rollout.modeling.models import resolve_model_path

    path = resolve_model_path(args.model, args.cache_dir)
    if args.child:
        print(json.dumps(measure(*args.child, path, args.syncs)))
        return
    rows = []
    for precision in MEMORY_PRECISIONS:
        for variant in VARIANTS:  # side by side, each in a fresh process
            r = subprocess.run([sys.executable, __file__, "--generator-memory", "--model", args.model, "--cache-dir",
                                args.cache_dir, "--syncs", str(args.syncs), "--child", variant, precision],
                               capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if r.returncode != 0:
                raise SystemExit(f"{variant} {precision} failed:\n{r.stderr[-3000:]}")
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    result = {"meta": {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "model": path, "torch": torch.__version__,
                       "cpu_count": os.cpu_count(), "args": {k: str(v) for k, v in vars(args).items()},
                       "syncs": args.syncs, "load_avg": os.getloadavg()[0]}, "rows": rows}
    out = args.out if args.out != OUT else OUT.parent / "generator_memory.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_memory_table(result)
    print(f"\nwrote {out}")


def print_memory_table(result: dict) -> None:
    meta = result["meta"]
    print(f"torch generator at a sync, {Path(meta['model']).name}, {meta['syncs']} full updates, 1 thread; "
          f"torch {meta['torch']}, {meta['cpu_count']} cores, load average {meta['load_avg']:.1f}")
    head = ["precision", "variant", "start RSS MB", "peak RSS MB", "held MB", "s/sync"]
    cells = [[r["precision"], r["variant"], f"{r['start_rss_mb']:.0f}", f"{r['peak_rss_mb']:.0f}",
              f"{r['held_mb']:.0f}", f"{r['sync_s']:.2f}"] for r in result["rows"]]
    widths = [max(len(h), *(len(c[k]) for c in cells)) + 2 for k, h in enumerate(head)]
    for cs in [head, *cells]:
        print("".join(f"{c:<{w}}" if k < 2 else f"{c:>{w}}" for k, (c, w) in enumerate(zip(cs, widths))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--requantize", action="store_true", help="measure sync.requantize instead (module docstring)")
    ap.add_argument("--publish", action="store_true", help="with --requantize: also write bench/published/")
    ap.add_argument("--generator-memory", action="store_true",
                    help="the torch generator's memory and time at a sync, in place vs rebuilt (module docstring)")
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct", help="with --generator-memory")
    ap.add_argument("--cache-dir", default="", help="with --generator-memory: builtin models' cache")
    ap.add_argument("--syncs", type=int, default=3, help="with --generator-memory: full updates per variant")
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "PRECISION"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.generator_memory:
        return generator_memory(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.requantize:
        rows = requantize_costs(smollm2_135m_shape())
        text = json.dumps({"model": "SmolLM2-135M shape (random weights)", "torch": torch.__version__,
                           "threads": torch.get_num_threads(), "arch": platform.machine(),
                           "processor": platform.processor(), "syncs": SYNCS, "lr": LR, "results": rows},
                          indent=2) + "\n"
        for folder in ("results",) + (("published",) if args.publish else ()):
            path = OUT.parent.parent / folder / "requantize_costs.json"
            path.write_text(text)
            print(f"wrote {path}")
        return
    import bitsandbytes  # noqa: F401  imported here so the one-time import cost (~2-3 s) isn't timed as quantize
    import torchao.quantization  # noqa: F401

    base = smollm2_135m_shape()
    ids = torch.randint(0, base.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    prompts = ids[:GEN_PROMPTS, :16]
    lm_head_bytes = base.lm_head.weight.untyped_storage().nbytes()  # tied: stays bf16 at every precision
    rows = []
    for precision in PRECISIONS:
        copied, t_copy = timed(lambda: copy.deepcopy(base))
        model, t_quant = timed(lambda c=copied: quantize_model(c, precision))
        with torch.no_grad():
            model(ids)  # warm-up
            model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=2)
            t_fwd = statistics.median(timed(lambda m=model: m(ids))[1] for _ in range(REPEATS))
            torch.manual_seed(0)
            mask = torch.ones_like(prompts)
            _, t_gen = timed(lambda m=model: m.generate(prompts, attention_mask=mask, do_sample=True,
                                                        max_new_tokens=GEN_TOKENS, min_new_tokens=GEN_TOKENS))
        nbytes = linear_weight_bytes(model)
        rows.append({"precision": precision, "linear_weight_bytes": nbytes,
                     "linear_weight_bytes_without_tied_lm_head": nbytes - lm_head_bytes,
                     "deepcopy_s": round(t_copy, 3), "quantize_s": round(t_quant, 3),
                     f"forward_{BATCH}x{SEQ}_s": round(t_fwd, 3),
                     f"generate_{GEN_PROMPTS}x{GEN_TOKENS}_tok_per_s": round(GEN_PROMPTS * GEN_TOKENS / t_gen, 1),
                     "summary": quant_config_summary(model)})
        del model, copied
    bf16, bf16_wo = rows[0]["linear_weight_bytes"], rows[0]["linear_weight_bytes_without_tied_lm_head"]
    for r in rows:
        r["ratio_vs_bf16"] = round(r["linear_weight_bytes"] / bf16, 3)
        r["ratio_vs_bf16_without_tied_lm_head"] = round(r["linear_weight_bytes_without_tied_lm_head"] / bf16_wo, 3)

    print(f"SmolLM2-135M shape, random bf16 weights, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("(ratio*: without the tied lm_head, which stays bf16 and is 21% of the bf16 linear bytes)")
    head = (f"{'precision':9} {'linear MB':>9} {'ratio':>6} {'ratio*':>6} {'copy s':>6} {'quant s':>7} "
            f"{'fwd ' + str(BATCH) + 'x' + str(SEQ) + ' s':>11} {'gen tok/s':>9}")
    print(head)
    for r in rows:
        print(f"{r['precision']:9} {r['linear_weight_bytes'] / 1e6:9.1f} {r['ratio_vs_bf16']:6.3f} "
              f"{r['ratio_vs_bf16_without_tied_lm_head']:6.3f} {r['deepcopy_s']:6.2f} {r['quantize_s']:7.2f} "
              f"{r[f'forward_{BATCH}x{SEQ}_s']:11.3f} {r[f'generate_{GEN_PROMPTS}x{GEN_TOKENS}_tok_per_s']:9.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": "SmolLM2-135M shape (random weights)", "torch": torch.__version__,
                               "threads": torch.get_num_threads(), "machine": platform.machine(),
                               "results": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
