"""Linear-weight bytes, quantize time and forward time per precision on a SmolLM2-135M-shaped Llama (random bf16
weights, nothing downloaded). Each precision quantizes a fresh deepcopy of the bf16 model, the way a rollout
generator re-quantizes after a weight sync.

    .venv/bin/python bench/quant_bytes.py [--threads N]   # prints a table, writes bench/results/quant_bytes.json

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
from qgrpo.rollout.quant import PRECISIONS, linear_weight_bytes, quant_config_summary, quantize_model  # noqa: E402

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
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
