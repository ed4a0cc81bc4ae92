"""Each matrix product of a decode step alone, per precision: how fast the quantized products read their weights.

A decode step of 8-64 rows is a sequence of small products whose cost is reading the weight. This times each product
of the 1.3b shape of bench/gpu_speed.py (Qwen2.5-1.5B's trunk: q/o 1536 -> 1536, k/v 1536 -> 256, the fused q/k/v
1536 -> 2048, gate/up 1536 -> 8960, the fused gate/up 1536 -> 17920, down 8960 -> 1536, lm_head 1536 -> 49152) as the
generator runs it: one bf16 nn.Linear with random weights (seed 0), quantized by rollout/quant.py's `quantize_model`
at each precision, called on `rows` random bf16 activations. Routes (`--precisions`):

- `bf16`: F.linear (cuBLAS); `int8`: the generator's int8 product (rollout/w8_triton.py's kernel at <= 64 rows);
  `int8/aten`: torch's own weight-only int8 kernel (`torch._weight_int8pack_mm`) on the same per-row int8 weight;
  `int4`: torchao's tinygemm layout as the generator quantizes it (K padded to a multiple of 1024);
  `int4/unpadded`: torch's tinygemm kernel (`aten._weight_int4pack_mm`) on weights packed here without that padding
  (`aten._convert_weight_to_int4pack`, inner k tiles 8, the same asymmetric group-wise int4); `nf4`: bitsandbytes;
  `fp8`: W8A8 `torch._scaled_mm`; `fp8/weight_only`: rollout/fp8.py's weight-only kernel (`FP8_DECODE`).

Each product is captured in a CUDA graph of `--calls` calls and replayed (`--repeats`, median), so launch gaps are
left out: `us` is the kernel time of one call, `GB/s` the weight's storage bytes (codes and scales, padding included)
over it, `of bw` that over the card's read bandwidth (a bf16 `torch.sum` over 2 GiB), `vs bf16` bf16's time over the
route's, `err` max |y - y_ref| / max |y_ref| against float32 `x @ w.T` of the unquantized weight (quantization error
included: int8 ~1%, int4/nf4/fp8 a few %). Where a route cannot be captured it is timed eagerly (the `note`).

    .venv/bin/python bench/gpu_matmuls.py                          # CUDA: every route, rows 8, 16, 64
    .venv/bin/python bench/gpu_matmuls.py --device cpu --precisions bf16,int8 --rows 8 --calls 2 --repeats 1

Writes bench/results/gpu_matmuls.json (--out) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_speed import read_bandwidth, sync  # noqa: E402 - the measurements gpu_speed makes, made the same way

SHAPES = {"q/o": (1536, 1536), "k/v": (256, 1536), "qkv": (2048, 1536), "gate/up": (8960, 1536),
          "gate_up": (17920, 1536), "down": (1536, 8960), "lm_head": (49152, 1536)}  # name: (out N, in K)


def int4_groups(w, group_size: int):
    """(q int32 [N, K] in 0..15, scale, zero float32 [N, K / group]): asymmetric int4 per group of `group_size`
    along K, as tinygemm dequantizes it: (q - 8) * scale + zero."""
    import torch

    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    zero = lo + 8 * scale
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    return q, scale, zero


def int4_unpadded(w, group_size: int):
    """(packed weight, scales and zeros) for `aten._weight_int4pack_mm` from bf16 `w` [N, K] without padding K
    (`int4_groups`' codes, two per byte, packed by torch for 8 inner k tiles: K a multiple of 128)."""
    import torch

    q, scale, zero = int4_groups(w, group_size)
    packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8)
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [K / group, N, 2]
    return packed, sz


def build(route: str, w, group_size: int):
    """(fn(x) -> y, weight storage bytes) for one route over weight `w`."""
    import torch
    from torch import nn

    from qgrpo.rollout import fp8
    from qgrpo.rollout.quant import linear_weight_bytes, quantize_model

    if route == "int8/aten":
        from qgrpo.rollout.quant import int8_per_channel

        q, scale = int8_per_channel(w)
        scale = scale.reshape(-1).to(torch.bfloat16)
        return (lambda x: torch._weight_int8pack_mm(x, q, scale)), q.numel() + scale.numel() * 2
    if route == "int4/unpadded":
        packed, sz = int4_unpadded(w, group_size)
        nbytes = packed.numel() * packed.element_size() + sz.numel() * sz.element_size()
        return (lambda x: torch.ops.aten._weight_int4pack_mm(x, packed, group_size, sz)), nbytes
    precision, _, decode = route.partition("/")
    holder = nn.Module()
    holder.lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        holder.lin.weight.copy_(w)
    quantize_model(holder, precision, group_size)
    lin = holder.lin
    if precision == "fp8":
        mode = decode or "scaled_mm"

        def fn(x):
            held, fp8.FP8_DECODE = fp8.FP8_DECODE, mode
            try:
                return lin(x)
            finally:
                fp8.FP8_DECODE = held
        return fn, linear_weight_bytes(holder)
    return lin, linear_weight_bytes(holder)


def time_calls(fn, x, calls: int, repeats: int, device) -> tuple[float, str]:
    """Seconds per call: replays of a CUDA graph of `calls` calls (median of `repeats`), else eager calls."""
    import torch

    note = ""
    if device.type == "cuda":
        try:
            s = torch.cuda.Stream(device)
            s.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(s):
                for _ in range(3):
                    fn(x)
            torch.cuda.current_stream(device).wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(calls):
                    fn(x)
            graph.replay()
            sync(device)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                graph.replay()
                sync(device)
                times.append((time.perf_counter() - t0) / calls)
            return statistics.median(times), note
        except Exception as e:  # noqa: BLE001 - a route that cannot be captured is timed eagerly, and says so
            note = f"eager (no graph: {type(e).__name__}: {str(e)[:80]})"
    fn(x)
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(x)
        sync(device)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times), note


def main(argv=None) -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="")
    ap.add_argument("--precisions", default="bf16,int8,int8/aten,int4,int4/unpadded,nf4,fp8,fp8/weight_only")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", default="8,16,64")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--calls", type=int, default=50, help="calls per captured graph")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bandwidth-gib", type=float, default=0.0, help="default: 2 on CUDA, 1/16 on a CPU")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_matmuls.json"))
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    routes, shapes = args.precisions.split(","), args.shapes.split(",")
    rows_list = [int(r) for r in args.rows.split(",")]
    bw = read_bandwidth(device, args.bandwidth_gib or (2.0 if device.type == "cuda" else 1 / 16))["bytes_per_s"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    res = {"command": ".venv/bin/python bench/gpu_matmuls.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "machine": f"{name}, torch {torch.__version__}" + (f", CUDA {torch.version.cuda}" if torch.version.cuda
                                                               else ""),
           "device_name": name,
           "torch": torch.__version__, "args": vars(args), "read_bytes_per_s": bw, "rows": []}
    gen = torch.Generator(device="cpu").manual_seed(0)
    for shape in shapes:
        n, k = SHAPES[shape]
        w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16).to(device)
        xs = {r: torch.randn(r, k, generator=gen).to(torch.bfloat16).to(device) for r in rows_list}
        refs = {r: xs[r].float() @ w.float().T for r in rows_list}
        for route in routes:
            try:
                fn, nbytes = build(route, w, args.group_size)
            except Exception as e:  # noqa: BLE001 - one route's failure must not cost the others
                print(traceback.format_exc(), file=sys.stderr)
                res["rows"].append({"shape": shape, "route": route, "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            for r in rows_list:
                row = {"shape": shape, "n": n, "k": k, "route": route, "rows": r, "weight_bytes": nbytes}
                try:
                    with torch.no_grad():
                        y = fn(xs[r]).float()
                        ref = refs[r]
                        row["err"] = float((y - ref).abs().max() / ref.abs().max())
                        row["finite"] = bool(torch.isfinite(y).all())
                        row["seconds"], row["note"] = time_calls(fn, xs[r], args.calls, args.repeats, device)
                    row["bytes_per_s"] = nbytes / row["seconds"]
                    row["of_bandwidth"] = row["bytes_per_s"] / bw
                except Exception as e:  # noqa: BLE001
                    print(traceback.format_exc(), file=sys.stderr)
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                res["rows"].append(row)
            del fn
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = {(x["shape"], x["rows"]): x["seconds"] for x in res["rows"] if x["route"] == "bf16" and "seconds" in x}
    for x in res["rows"]:
        if "seconds" in x and (x["shape"], x["rows"]) in base:
            x["vs_bf16"] = base[(x["shape"], x["rows"])] / x["seconds"]
    lines = ["| shape | N x K | route | rows | MB | us | GB/s | of bw | vs bf16 | err | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in res["rows"]:
        if "seconds" not in x:
            lines.append(f"| {x['shape']} | | {x['route']} | {x.get('rows', '')} | | | | | | | "
                         f"{x.get('error', '')[:100].replace('|', '/')} |")
            continue
        lines.append(f"| {x['shape']} | {x['n']} x {x['k']} | {x['route']} | {x['rows']} | "
                     f"{x['weight_bytes'] / 1e6:.2f} | {x['seconds'] * 1e6:.1f} | {x['bytes_per_s'] / 1e9:.0f} | "
                     f"{x['of_bandwidth']:.1%} | {x.get('vs_bf16', float('nan')):.2f} | "
                     f"{x['err']:.4f}{'' if x['finite'] else ' NaN'} | {x['note']} |")
    res["table"] = "\n".join(lines)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"{res['device_name']}, torch {torch.__version__}; read bandwidth {bw / 1e9:.0f} GB/s")
    print(res["table"])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
