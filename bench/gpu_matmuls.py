"""Each matrix product of a decode step alone, per precision: how fast the quantized products read their weights.

A decode step of 8-64 rows is a sequence of small products whose cost is reading the weight. This times each product
of one or more model shapes (`--models`) as the generator runs it: one bf16 nn.Linear with random weights (normal x
0.02, a generator seeded 0 per product, on the device), quantized by rollout/quantization/quant.py's `quantize_model` at
each precision (the GemLite routes: by GemLite's helpers), called on `rows` random bf16 activations. `--models` takes
`1.3b` (the default: bench/gpu_speed.py's 1.3b shape, Qwen2.5-1.5B's trunk with SmolLM2's vocabulary: q/o 1536 -> 1536,
k/v 1536 -> 256, the fused q/k/v 1536 -> 2048, gate/up 1536 -> 8960, the fused gate/up 1536 -> 17920, down 8960 -> 1536,
lm_head 1536 -> 49152) and the names of bench/model_shapes.py (SmolLM2-135M ... Qwen2.5-14B, tiny-*), whose
`linear_shapes` gives the products (q, k/v, qkv, o, gate/up, gate_up, down, lm_head). A product with the N x K of an
earlier product of its model is not measured again: its rows are that product's (`same_as`). `--shapes` keeps only the
named products. A row holds `model`, `product` (and `shape`, the same name, which bench/publish.py reads), N, K, route
and rows. Routes (`--precisions`; the default: every route but GemLite's):

- `bf16`: F.linear (cuBLAS); `int8`: the generator's int8 product (rollout/quantization/w8_triton.py's kernel at <= 64
rows);
  `int8/aten`: torch's own weight-only int8 kernel (`torch._weight_int8pack_mm`) on the same per-row int8 weight;
  `int4/aten` (CPU): torch's own int4 kernel (`_weight_int4pack_mm_for_cpu`) on the generator's int4 weight, where
  `int4` takes qgrpo's kernel up to its measured rows;
  `int4`: torchao's tinygemm layout as the generator quantizes it (K padded to a multiple of 1024);
  `fp32` (CPU): F.linear on the weight in float32, as the generator computes where bf16 is not native; `fp32/onednn`
  (CPU): oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`) on that weight reordered once into oneDNN's blocked
  layout (`_reorder_linear_weight`), as torch.compile's CPU freezing does;
  `int4/unpadded`: torch's tinygemm kernel (`aten._weight_int4pack_mm`) on weights packed here without that padding
  (`aten._convert_weight_to_int4pack`, inner k tiles 8, the same asymmetric group-wise int4); `nf4`: bitsandbytes;
  `fp8`: W8A8 `torch._scaled_mm`; `fp8/weight_only`: rollout/quantization/fp8.py's weight-only kernel (`FP8_DECODE`).
- GemLite 0.6 (`gemlite` on PyPI: Triton kernels, not a project dependency, imported only when one of these routes is
  asked for, on CUDA only; elsewhere, or not installed, the routes' rows hold the error): `int4/gemlite` the codes,
  scales and zeros of `int4/unpadded` in GemLite's (HQQ's) convention (`int4_hqq`) through `helper.A16W4_HQQ_INT`, bf16
  in and out (GemLite keeps scales and zeros in bf16 and dequantizes q * scales + bf16(-zeros * scales) in bf16: its
  weights within 0.15 of a step of tinygemm's, its output within ~1% of theirs); `int8/gemlite` `helper.A16W8_INT8`
  (int8 per row, scale max|w| / 127, as `int8`); `fp8/gemlite` `helper.A16W8_FP8` (float8_e4m3fn per row). NOT yet
  run on a GPU: checked on CPU only, the conversion by tests/test_gpu_matmuls_bench.py and, outside the suite, the
  three routes' build and output against GemLite 0.6.0.post2's kernels run by Triton 3.9's interpreter in fp16 (its bf16
  is broken). GemLite picks its kernel by rows (4 bits: GEMV to 4 rows, split-K GEMM to 63; 8 bits: GEMV to 2, split-K
  to 63; GEMM from 64) and tunes it at its first call for each key (rows rounded up, N, K, group, codes per word,
  dtypes) unless a loaded config table holds the key. At import it loads the table whose tag its GPU's name holds
  (configs/h100.json on an "H100"); an "NVIDIA H200" holds none, so there this loads h100.json (the same SM90 chip)
  (`--gemlite-config`: `auto`, `none`, or a file, e.g. what `--gemlite-save` wrote in a former run). That table holds
  few of these shapes (at 4 bits Qwen3-8B's q/o, k/v, qkv and Qwen2.5-14B's q/o, qkv, gate_up, down at 8 and 32 rows;
  nothing at 8 bits with bf16 activations): the others autotune, 16-22 configs each compiled (N and K are constexpr;
  ~0.7 s each on a 2-core CPU) and timed (~0.13 s each), ~10-20 s per product, route and rows (`first s`;
  `--gemlite-autotune default` tries 2 configs). A row's `gemlite_tuned` says whether its key was in a loaded table;
  the JSON's `gemlite` what was loaded.

Each product is captured in a CUDA graph of `--calls` calls and replayed (`--repeats`, median), so launch gaps are
left out: `us` is the kernel time of one call, `GB/s` the weight's storage bytes (codes and scales, padding included)
over it, `of bw` that over the card's read bandwidth (a bf16 `torch.sum` over 2 GiB), `vs bf16` bf16's time over the
route's, `err` max |y - y_ref| / max |y_ref| against float32 `x @ w.T` of the unquantized weight (quantization error
included; on an H200: bf16 <= 0.003, int8 <= 0.011, fp8 0.024-0.043, int4 / nf4 0.077-0.106). A row whose err passes
its precision's `TOLERANCE` (bf16 0.02, int8 0.03, fp8 0.08, int4 / nf4 0.2: 2-6x the most an H200 showed; fp32 1e-4,
float32 rounding) or whose output is not finite is flagged (`bad`, `BAD` in its note) and gets no `vs bf16`. Where
a route cannot be captured it is timed eagerly (the `note`); `build s` is the route's quantization and packing,
`first s` its first call at those
rows (compilation, autotuning). A route that fails records its error on its rows and the run goes on.

`best` (JSON, and the second table): per model, rows and product, the fastest route that is not bad among the int4
routes, among the int8 routes and among the fp8 routes (by the route's name before "/"), its speed over bf16 and the
others' (`others`); `route` null where none of that family was measured.

`--budget-s` bounds the run: once it is spent each remaining (product, route, rows) is recorded as skipped (listed in
the JSON's `budget`), and a GemLite route is skipped at rows whose first call would not fit in what is left (the
longest first call of a GemLite route so far, tuned and untuned keys apart). Order: model by model, each model's
GemLite routes after its other routes (`--gemlite-after model`) or after every model's (`all`); within that, product by
product, routes as asked. The JSON is rewritten after every row: a run cut short keeps what it measured.

    .venv/bin/python bench/gpu_matmuls.py                          # CUDA: the 1.3b shape, every non-GemLite route
    .venv/bin/python bench/gpu_matmuls.py --models Qwen2.5-1.5B,Qwen3-8B --rows 8,32 --budget-s 120 \\
        --precisions bf16,int8,int4,int4/unpadded,int4/gemlite,int8/gemlite   # CUDA, GemLite installed
    .venv/bin/python bench/gpu_matmuls.py --device cpu --precisions bf16,int8 --rows 8 --calls 2 --repeats 1
    .venv/bin/python bench/gpu_matmuls.py --device cpu --models tiny-qwen3 --rows 8 --calls 2 --repeats 1

Writes bench/results/gpu_matmuls.json (--out) and prints the tables.
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_speed import finite, read_bandwidth, sync  # noqa: E402 - the measurements gpu_speed makes, the same way
from bench.model_shapes import SHAPES as MODEL_SHAPES  # noqa: E402
from bench.model_shapes import caps_prefix, linear_shapes  # noqa: E402

SHAPES = {"q/o": (1536, 1536), "k/v": (256, 1536), "qkv": (2048, 1536), "gate/up": (8960, 1536),
          "gate_up": (17920, 1536), "down": (1536, 8960), "lm_head": (49152, 1536)}  # `1.3b`: name: (out N, in K)
DEFAULT_MODEL = "1.3b"
DEFAULT_ROUTES = "bf16,int8,int8/aten,int4,int4/unpadded,nf4,fp8,fp8/weight_only"
GEMLITE_ROUTES = {"int4/gemlite": "A16W4_HQQ_INT", "int8/gemlite": "A16W8_INT8", "fp8/gemlite": "A16W8_FP8"}
PLAIN_PRECISIONS = ("bf16", "int8", "int4", "nf4", "fp8")  # through quantize_model; fp8 also as fp8/<FP8_DECODE>
# The most err (max |y - y_ref| / max |y_ref|) a right kernel of each precision may show: 2-6x the most the H200 showed
# (module docstring), far below a wrong layout's ~1. Past it, or with a non-finite output, a row is `bad`.
TOLERANCE = {"bf16": 0.02, "fp32": 1e-4, "int8": 0.03, "fp8": 0.08, "int4": 0.2, "nf4": 0.2}
FAMILIES = ("int4", "int8", "fp8")  # `best` picks the fastest route of each, by the route's name before "/"
GEMLITE = {}  # the lazily imported gemlite module ("module"), or why it is not there ("error"); see gemlite_module


def products_of(model: str) -> dict[str, tuple[int, int]]:
    """{product: (out N, in K)} of `model`: the 1.3b table (SHAPES) or bench/model_shapes.py's `linear_shapes`."""
    return dict(SHAPES) if model == DEFAULT_MODEL else linear_shapes(model)


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


def int4_hqq(w, group_size: int):
    """`int4_groups`' quantization in GemLite's (HQQ's) convention W ~= (q - zeros) * scales: (q uint8 [N, K] in
    0..15, scales, zeros float32 [N, K / group]). tinygemm's (q - 8) * scale + zero = (q - (8 - zero / scale)) *
    scale, so zeros = 8 - zero / scale (here -lo / scale: the group's minimum in steps below 0), a float zero point."""
    import torch

    q, scale, zero = int4_groups(w, group_size)
    return q.to(torch.uint8), scale, 8 - zero / scale


def int4_unpadded(w, group_size: int):
    """(packed weight, scales and zeros) for `aten._weight_int4pack_mm` from bf16 `w` [N, K] without padding K
    (`int4_groups`' codes, two per byte, packed by torch for 8 inner k tiles: K a multiple of 128)."""
    import torch

    q, scale, zero = int4_groups(w, group_size)
    packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8)
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [K / group, N, 2]
    return packed, sz


def gemlite_module(device, config: str, autotune: str) -> tuple[object, dict]:
    """(gemlite, what was loaded) imported once per process, on CUDA only; raises (the same error each time) where it
    cannot be. `config`: `auto` loads configs/h100.json on a GPU whose name has "H200" (GemLite's own pick at import,
    by the GPU's name, matches no table there), `none` nothing beyond GemLite's pick, else that file.
    `autotune` != "fast" (GemLite's default) is set through `gemlite.set_autotune`."""
    if "module" in GEMLITE:
        return GEMLITE["module"], GEMLITE["info"]
    if "error" in GEMLITE:
        raise RuntimeError(GEMLITE["error"])
    try:
        import torch

        if device.type != "cuda":
            raise RuntimeError(f"GemLite runs on CUDA only, not {device.type}")
        import gemlite

        info = {"version": getattr(gemlite, "__version__", None), "autotune": autotune,
                "import_pick": getattr(gemlite.core, "selected_tag", None), "config": None, "config_loaded": None}
        path = config
        if config == "auto":
            name = torch.cuda.get_device_name(device)
            path = str(Path(gemlite.core.__file__).parent / "configs" / "h100.json") if "H200" in name else "none"
        if path != "none":
            info["config"], info["config_loaded"] = path, bool(gemlite.load_config(path))
        if autotune != "fast":
            gemlite.set_autotune(autotune)
    except Exception as e:  # noqa: BLE001 - not installed, no CUDA, an API change: the routes' rows say so
        GEMLITE["error"] = f"gemlite unavailable: {type(e).__name__}: {e}"[:300]
        raise RuntimeError(GEMLITE["error"]) from e
    GEMLITE.update(module=gemlite, info=info)
    return gemlite, info


def gemlite_tuned(lin, rows: int) -> bool | None:
    """Whether a loaded GemLite config table holds the key `lin`'s kernel looks up at `rows` rows (then its first call
    compiles one config and times none), read as its kernels' `kernel_config_pruner` reads it: the table of the matmul
    type `get_matmul_type` picks, key (rows rounded up by `get_closest_m`, N, K, group size, codes per packed word,
    input dtype (bf16 as fp16) x 100 + bits); None where GemLite's internals do not answer."""
    try:
        from gemlite import core
        from gemlite.triton_kernels import utils

        kind = core.get_matmul_type(rows, lin.W_nbits, core.is_mx_dtype(lin.input_dtype))
        dtype = core.DType.FP16 if lin.input_dtype == core.DType.BF16 else lin.input_dtype
        key = str((utils.get_closest_m(rows), lin.out_features, lin.in_features, lin.group_size,
                   lin.elements_per_sample, dtype.value * 100 + lin.W_nbits))
        return key in core.GEMLITE_TRITON_CONFIG_CACHE.get(kind, {})
    except Exception:  # noqa: BLE001 - a diagnostic only
        return None


def build_gemlite(route: str, w, group_size: int):
    """(GemLite module, weight storage bytes: packed codes, scales, zeros) for a GemLite route over bf16 `w` [N, K]
    on CUDA."""
    from gemlite import helper

    cls = getattr(helper, GEMLITE_ROUTES[route])
    if route == "int4/gemlite":
        q, scales, zeros = int4_hqq(w, group_size)  # the helper casts scales and zeros to its dtype (bf16)
        lin = cls(device=str(w.device), dtype=w.dtype).from_weights(q, scales, zeros)
    else:  # what helper.A16W8.from_linear does, without an nn.Linear to build and empty
        lin = cls(device=str(w.device), dtype=w.dtype).from_weights(w)
    return lin, sum(t.numel() * t.element_size() for t in (lin.W_q, lin.scales, lin.zeros))


def build(route: str, w, group_size: int, gemlite_args: tuple[str, str] = ("auto", "fast")):
    """(fn(x) -> y, weight storage bytes, fields for the route's rows) for one route over weight `w`; raises for a
    route it does not know or cannot build here."""
    import torch
    from torch import nn

    from qgrpo.rollout.quantization import fp8
    from qgrpo.rollout.quantization.quant import linear_weight_bytes, quant_config_summary, quantize_model

    if route in GEMLITE_ROUTES:
        gemlite_module(w.device, *gemlite_args)
        lin, nbytes = build_gemlite(route, w, group_size)
        return lin, nbytes, {}
    if route == "int8/aten":
        from qgrpo.rollout.quantization.quant import int8_per_channel

        q, scale = int8_per_channel(w)
        scale = scale.reshape(-1).to(torch.bfloat16)
        return (lambda x: torch._weight_int8pack_mm(x, q, scale)), q.numel() + scale.numel() * 2, {}
    if route == "int4/aten":  # torch's CPU int4 kernel on the generator's own int4 weight (the generator's before)
        if w.device.type != "cpu":
            raise ValueError("int4/aten is torch's CPU int4 kernel: CPU only")
        holder = nn.Module()
        holder.lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
        with torch.no_grad():
            holder.lin.weight.copy_(w)
        quantize_model(holder, "int4", group_size)
        qd, sz = holder.lin.weight.qdata, holder.lin.weight.scale_and_zero
        return ((lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(sz.dtype).contiguous(), qd, group_size,
                                                                       sz).to(x.dtype)),
                linear_weight_bytes(holder), {})
    if route in ("fp32", "fp32/onednn"):  # CPU: what the generator computes in where bf16 is not native
        if w.device.type != "cpu":
            raise ValueError(f"{route} is a CPU route")
        w32 = w.float()
        if route == "fp32":
            return (lambda x: torch.nn.functional.linear(x.float(), w32)), w32.numel() * 4, {}
        packed = torch.ops.mkldnn._reorder_linear_weight(w32, None)  # oneDNN's blocked layout, reordered once
        return ((lambda x: torch.ops.mkldnn._linear_pointwise(x.float(), packed, None, "none", [], "")),
                w32.numel() * 4, {})
    if route == "int4/unpadded":
        packed, sz = int4_unpadded(w, group_size)
        nbytes = packed.numel() * packed.element_size() + sz.numel() * sz.element_size()
        return (lambda x: torch.ops.aten._weight_int4pack_mm(x, packed, group_size, sz)), nbytes, {}
    precision, _, decode = route.partition("/")
    if precision not in PLAIN_PRECISIONS or (decode and precision != "fp8"):
        raise ValueError(f"unknown route {route!r}: {', '.join(DEFAULT_ROUTES.split(','))}, fp8/<FP8_DECODE> or "
                         f"{', '.join(GEMLITE_ROUTES)}")
    holder = nn.Module()
    holder.lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        holder.lin.weight.copy_(w)
    quantize_model(holder, precision, group_size)
    lin = holder.lin
    extra = {}
    if precision != "bf16" and not quant_config_summary(holder)["quantized_linears"]:
        extra["note"] = "stayed bf16 (rollout/quantization/quant.py's layer_fits)"
    if precision == "fp8":
        mode = decode or "scaled_mm"

        def fn(x):
            held, fp8.FP8_DECODE = fp8.FP8_DECODE, mode
            try:
                return lin(x)
            finally:
                fp8.FP8_DECODE = held
        return fn, linear_weight_bytes(holder), extra
    return lin, linear_weight_bytes(holder), extra


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


def flag(row: dict) -> None:
    """Mark `row` bad when its err passes its precision's TOLERANCE or its output is not finite."""
    tol = row["tolerance"] = TOLERANCE.get(row["route"].partition("/")[0])
    why = ("non-finite output" if not row["finite"] or not math.isfinite(row["err"]) else
           f"err {row['err']:.3f} > {tol}" if tol is not None and row["err"] > tol else "")
    if why:
        row["bad"] = True
        row["note"] = "; ".join(filter(None, [f"BAD: {why}", row.get("note", "")]))


def fmt(v, spec: str) -> str:
    return "" if v is None else format(v, spec)


def summarize(res: dict, order: dict) -> None:
    """Sort the rows (model, product, route, rows as asked), set `vs_bf16`, `best` and the two tables."""
    rows = res["rows"]
    rows.sort(key=lambda x: tuple(order[f].get(x.get(f), len(order[f])) for f in ("model", "product", "route", "rows")))
    base = {(x["model"], x["product"], x["rows"]): x["seconds"] for x in rows
            if x["route"] == "bf16" and "seconds" in x and not x.get("bad")}
    for x in rows:
        key = (x["model"], x["product"], x["rows"])
        if "seconds" in x and not x.get("bad") and key in base:
            x["vs_bf16"] = base[key] / x["seconds"]
    res["best"], cases = [], {}
    for x in rows:
        cases.setdefault((x["model"], x["rows"], x["product"]), []).append(x)
    for (model, r, product), xs in cases.items():
        for fam in FAMILIES:
            asked = [x for x in xs if x["route"].partition("/")[0] == fam]
            good = sorted((x for x in asked if "seconds" in x and not x.get("bad")), key=lambda x: x["seconds"])
            if not asked:
                continue
            top = good[0] if good else {}
            res["best"].append({"model": model, "rows": r, "product": product, "n": xs[0].get("n"),
                                "k": xs[0].get("k"), "family": fam, "route": top.get("route"),
                                "seconds": top.get("seconds"), "vs_bf16": top.get("vs_bf16"), "err": top.get("err"),
                                "others": {x["route"]: x.get("vs_bf16") for x in good[1:]}})
    lines = ["| model | product | N x K | route | rows | MB | us | GB/s | of bw | vs bf16 | err | build s | first s | "
             "note |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        head = f"| {x['model']} | {x['product']} | {x.get('n', '')} x {x.get('k', '')} | {x['route']} | {x['rows']} |"
        if "seconds" not in x:
            why = x.get("error") or (f"skipped: {x['skipped']}" if "skipped" in x else "")
            lines.append(head + " |" * 8 + f" {why[:100].replace('|', '/')} |")
            continue
        err = fmt(x["err"], ".4f") + ("" if x["finite"] else " NaN") + (" BAD" if x.get("bad") else "")
        lines.append(f"{head} {x['weight_bytes'] / 1e6:.2f} | {x['seconds'] * 1e6:.1f} | "
                     f"{x['bytes_per_s'] / 1e9:.0f} | {x['of_bandwidth']:.1%} | {fmt(x.get('vs_bf16'), '.2f')} | "
                     f"{err} | {fmt(x.get('build_s'), '.2f')} | {fmt(x.get('first_s'), '.2f')} | "
                     f"{x['note'].replace('|', '/')} |")
    res["table"] = "\n".join(lines)
    fams = [f for f in FAMILIES if any(b["family"] == f for b in res["best"])]
    lines = ["| model | rows | product | N x K | " + " | ".join(f"{f}: fastest | vs bf16" for f in fams) + " |",
             "|---|---|---|---|" + "---|---|" * len(fams)]
    best = {(b["model"], b["rows"], b["product"], b["family"]): b for b in res["best"]}
    for (model, r, product), xs in cases.items():
        cells = [best.get((model, r, product, f), {}) for f in fams]
        lines.append(f"| {model} | {r} | {product} | {xs[0].get('n', '')} x {xs[0].get('k', '')} | "
                     + " | ".join(f"{c.get('route') or '-'} | {fmt(c.get('vs_bf16'), '.2f')}" for c in cells) + " |")
    res["best_table"] = "\n".join(lines) if fams else ""


def main(argv=None) -> None:
    import torch

    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="")
    ap.add_argument("--models", default=DEFAULT_MODEL,
                    help=f"comma list: {DEFAULT_MODEL} (bench/gpu_speed.py's shape) or of {', '.join(MODEL_SHAPES)}")
    ap.add_argument("--precisions", default=DEFAULT_ROUTES, help="routes, comma list (module docstring)")
    ap.add_argument("--shapes", default="", help="only these products (comma list); default: every product")
    ap.add_argument("--rows", default="8,16,64")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--calls", type=int, default=50, help="calls per captured graph")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bandwidth-gib", type=float, default=0.0, help="default: 2 on CUDA, 1/16 on a CPU")
    ap.add_argument("--budget-s", type=float, default=300.0, help="wall seconds of the whole run (module docstring)")
    ap.add_argument("--gemlite-config", default="auto", help="auto, none, or a GemLite config JSON to load")
    ap.add_argument("--gemlite-autotune", default="fast", choices=("fast", "default", "max"))
    ap.add_argument("--gemlite-after", default="model", choices=("model", "all"),
                    help="run the GemLite routes after each model's other routes, or after every model's")
    ap.add_argument("--gemlite-save", default="", help="write GemLite's tuned configs here after each GemLite route")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_matmuls.json"))
    args = ap.parse_args(argv)
    models, routes = args.models.split(","), args.precisions.split(",")
    for m in models:
        if m != DEFAULT_MODEL and m not in MODEL_SHAPES:
            ap.error(f"unknown model {m!r}: {DEFAULT_MODEL} or one of {', '.join(MODEL_SHAPES)}")
    tables = {m: products_of(m) for m in models}
    wanted = args.shapes.split(",") if args.shapes else []
    if unknown := [p for p in wanted if not any(p in t for t in tables.values())]:
        ap.error(f"unknown products {unknown}: the models' are {sorted({p for t in tables.values() for p in t})}")
    rows_list = [int(r) for r in args.rows.split(",")]
    device = torch.device(args.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    bw = read_bandwidth(device, args.bandwidth_gib or (2.0 if device.type == "cuda" else 1 / 16))["bytes_per_s"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    res = {"command": caps_prefix() + ".venv/bin/python bench/gpu_matmuls.py "
                      + shlex.join(sys.argv[1:] if argv is None else argv),
           "machine": f"{name}, torch {torch.__version__}" + (f", CUDA {torch.version.cuda}" if torch.version.cuda
                                                               else ""),
           "device_name": name, "torch": torch.__version__, "args": vars(args), "models": models,
           "read_bytes_per_s": bw, "tolerance": TOLERANCE, "gemlite": None,
           "budget": {"budget_s": args.budget_s, "skipped": []}, "rows": []}
    if device.type == "cpu":  # which kernel the generator's `int8` route takes here, and the CPU as torch uses it
        from qgrpo.core.cpu import isa
        from qgrpo.rollout.quantization import cpu_kernels, cpu_native

        res["cpu_int8_kernel"], res["cpu_isa"] = cpu_native.describe(), isa().words()
        res["cpu_int4_kernel"] = cpu_kernels.describe("int4")
        res["machine"] = f"{isa().name or 'a CPU'}, {res['machine']}"
    order = {"model": {m: i for i, m in enumerate(models)}, "route": {r: i for i, r in enumerate(routes)},
             "rows": {r: i for i, r in enumerate(rows_list)},
             "product": {p: i for i, p in enumerate(dict.fromkeys(p for t in tables.values() for p in t))}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def emit() -> None:
        res["budget"]["elapsed_s"] = time.perf_counter() - t_start
        summarize(res, order)
        out.write_text(json.dumps(finite(res), indent=1, allow_nan=False, default=str) + "\n")

    def left() -> float:
        return args.budget_s - (time.perf_counter() - t_start)

    printed = set()  # the errors whose traceback went to stderr: each once
    first_costs = {True: [0.0], False: [0.0]}  # GemLite first calls so far, by gemlite_tuned: the next one's cost

    def skip(base: dict, route: str, rows: list[int], why: str = "budget spent") -> None:
        res["rows"] += [dict(base, route=route, rows=r, skipped=why) for r in rows]
        res["budget"]["skipped"] += [f"{base['model']}/{base['product']}/{route}/{r}" for r in rows]

    def measure(base: dict, phase: list[str]) -> None:
        """The routes of `phase` on one product: each built once, then checked and timed at each rows value."""
        if left() <= 0:
            for route in phase:
                skip(base, route, rows_list)
            emit()
            return
        n, k = base["n"], base["k"]
        gen = torch.Generator(device=device).manual_seed(0)
        w = (torch.randn(n, k, generator=gen, device=device) * 0.02).to(torch.bfloat16)
        xs = {r: torch.randn(r, k, generator=gen, device=device).to(torch.bfloat16) for r in rows_list}
        for route in phase:
            if left() <= 0:
                skip(base, route, rows_list)
                emit()
                continue
            print(f"{base['model']} {base['product']} {n} x {k} {route} ...", flush=True)
            t0 = time.perf_counter()
            try:
                fn, nbytes, extra = build(route, w, args.group_size, (args.gemlite_config, args.gemlite_autotune))
                sync(device)
            except Exception as e:  # noqa: BLE001 - one route's failure must not cost the others
                err = f"{type(e).__name__}: {e}"[:300]
                if err not in printed:
                    printed.add(err)
                    print(traceback.format_exc(), file=sys.stderr)
                res["rows"] += [dict(base, route=route, rows=r, error=err) for r in rows_list]
                continue
            finally:
                if route in GEMLITE_ROUTES:
                    res["gemlite"] = GEMLITE.get("info") or {"error": GEMLITE.get("error")}
                emit()
            built = time.perf_counter() - t0
            for r in rows_list:
                row = dict(base, route=route, rows=r, weight_bytes=nbytes, build_s=built, **extra)
                need = 0.0
                if route in GEMLITE_ROUTES:
                    row["gemlite_tuned"] = gemlite_tuned(fn, r)
                    need = max(first_costs[bool(row["gemlite_tuned"])])
                if left() <= need:
                    skip(base, route, [r], "budget spent" + (f" (a first call takes ~{need:.0f} s)" if need else ""))
                    emit()
                    continue
                try:
                    with torch.no_grad():
                        t1 = time.perf_counter()
                        y = fn(xs[r])
                        sync(device)
                        row["first_s"] = time.perf_counter() - t1
                        if route in GEMLITE_ROUTES:
                            first_costs[bool(row["gemlite_tuned"])].append(row["first_s"])
                        y = y.float()
                        ref = xs[r].float() @ w.float().T
                        row["err"] = float((y - ref).abs().max() / ref.abs().max())
                        row["finite"] = bool(torch.isfinite(y).all())
                        del y, ref
                        row["seconds"], note = time_calls(fn, xs[r], args.calls, args.repeats, device)
                    row["note"] = "; ".join(filter(None, [row.get("note", ""), note]))
                    row["bytes_per_s"] = nbytes / row["seconds"]
                    row["of_bandwidth"] = row["bytes_per_s"] / bw
                    flag(row)
                except Exception as e:  # noqa: BLE001
                    print(traceback.format_exc(), file=sys.stderr)
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                res["rows"].append(row)
                emit()
            del fn
            if route in GEMLITE_ROUTES and args.gemlite_save:
                try:
                    GEMLITE["module"].cache_config(args.gemlite_save)
                except Exception as e:  # noqa: BLE001 - the configs are a by-product
                    res["gemlite_save_error"] = f"{type(e).__name__}: {e}"[:300]
        del w, xs
        if device.type == "cuda":
            torch.cuda.empty_cache()

    phases = list(filter(None, [[r for r in routes if r not in GEMLITE_ROUTES],
                                [r for r in routes if r in GEMLITE_ROUTES]]))
    plan = [(m, ph) for m in models for ph in phases] if args.gemlite_after == "model" else \
        [(m, ph) for ph in phases for m in models]
    for model, phase in plan:
        table = {p: s for p, s in tables[model].items() if not wanted or p in wanted}
        first = {}  # (N, K) -> the first product of this model with that shape: the one measured
        for p, s in table.items():
            first.setdefault(s, p)
        for product in first.values():
            n, k = table[product]
            measure({"model": model, "product": product, "shape": product, "n": n, "k": k}, phase)
        measured = [x for x in res["rows"] if x["model"] == model and x["route"] in phase]
        for p, s in table.items():  # products sharing an earlier product's N x K: that product's rows
            if first[s] != p:
                res["rows"] += [dict(x, product=p, shape=p, same_as=first[s]) for x in measured
                                if x["product"] == first[s]]
        emit()
    emit()
    print(f"{res['device_name']}, torch {torch.__version__}; read bandwidth {bw / 1e9:.0f} GB/s; "
          f"{res['budget']['elapsed_s']:.0f} s of a {args.budget_s:.0f} s budget"
          + (f"; {len(res['budget']['skipped'])} skipped (budget)" if res["budget"]["skipped"] else "")
          + (f"; gemlite: {res['gemlite']}" if res["gemlite"] else ""))
    print(res["table"])
    if res["best_table"]:
        print("\nFastest route per family (not bad), per model, rows and product:")
        print(res["best_table"])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
