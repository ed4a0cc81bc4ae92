"""qgrpo vs TRL's GRPOTrainer, side by side in one session, on the setting of the comparison issue:
SmolLM2-135M-Instruct (our builtin model: both sides load the same local bf16 folder), reasoning-gym basic_arithmetic
at its default settings, zero-shot, 4 prompts x 8 completions x up to 64 new tokens, bf16 rollouts, no reference,
lr 1e-5, T = 1, 6 steps of which step 1 is warm-up (bench/vs_trl.toml; TRL's side: bench/trl_runner.py, which says what
is the same and what differs).

The figure of merit is **completion tokens trained per second**: the completion tokens of the timed steps (2..N) over
the wall seconds of those steps, from the end of step 1 to the end of step N (each side's own end-of-step clock: our
metrics.jsonl timestamps, TRL's `on_step_end`), so everything a step costs is in, logging included.

- Each side runs in a process of its own (ours: `python -m qgrpo train bench/vs_trl.toml`, which starts its own
  local Ray; TRL: bench/trl_runner.py), one at a time, alternating ours, TRL, ours, TRL, ... (`--rounds`) so that load
  from other jobs falls on both alike; the table shows each side's median over rounds and the ratio ours / TRL.
- Memory: a thread here samples the side's process and all its descendants (psutil) and sums their RSS (every 0.5 s) and
  PSS (every 3 s, as reading it is costly: see MemorySampler in bench/sides.py). PSS, the proportional set size, divides
  shared pages (Ray's object store in /dev/shm, shared libraries) among the processes mapping them, so its sum does not
  double-count them. The peaks of both sums are reported, and for our side the peak per role (learner, rollout,
  reference actors by their `ray::...` process titles; Ray's own processes; the driver). Ray started by our CLI
  (`ray.init()` without an address: RAY_ADDRESS is removed from the side's environment) runs gcs_server, raylet and
  their helpers as children of the driver, and the actors as children of the raylet, so all of them are descendants; as
  a check, every process on the machine whose command line names our Ray session folder (it ends in the driver's pid) is
  compared with that set and any outside it is reported (`unowned_ray_processes`, expected 0). Peaks are over the whole
  life of the process (start-up in, and for our side the final checkpoint it always writes after the last step);
  `memory.peak_in` has them during steps 1..N (`steps`) and during the timed steps (`timed`).
- Load from other jobs: for each run of a side, the machine's busy CPU time minus that of the side's processes and of
  the sampler, per second of wall time (`memory.others_cores`, shown per round in the table): ~0 on a quiet machine;
  a round with a high value was slowed by someone else, whichever side it was.
- `--ours-set KEY=VALUE` (repeatable) goes to our side as `--set`, e.g. `--ours-set rollout.backend=vllm`; `--trl-set
  KEY=VALUE` sets a GRPOConfig field of TRL's side (a TOML value, e.g. `--trl-set gradient_checkpointing=true`).

    .venv/bin/python bench/vs_trl.py [--rounds 2] [--steps 6] [--prompts 4] [--group-size 8] [--max-new-tokens 64]
    .venv/bin/python bench/vs_trl.py --quick      # smoke check: 3 steps, 1 round, 16 new tokens
    make bench-trl                                # installs the `bench` extra (TRL) first; ARGS="..." passes flags
    python bench/vs_trl.py --device cuda --config bench/gpu_step.toml --model FOLDER ...   # PARTS=step in
                                                  # bench/gpu_session.sh: a published shape on one GPU

On a GPU (`--device cuda`) both sides train there: ours with each role's share of the card from `--ours-set`
(`learner.num_gpus=0.5` ...), TRL's in its one process; GPU memory is sampled with nvidia-smi (the device's used memory,
and each process of the side where nvidia-smi names it), and our side's seconds per stage come from its metrics.
`--model` takes any model folder: `python bench/model_shapes.py save SHAPE FOLDER --tokenizer DIR` writes a published
shape with random weights, which both sides load.

Writes bench/results/vs_trl.json (vs_trl_quick.json with --quick) with every round's raw numbers and each side's log
under bench/results/vs_trl_logs/; `--publish` also writes bench/published/vs_trl.{json,txt}.
"""
from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from sides import GB, machine, run_side, side_env, versions  # noqa: E402  (the process sampler: bench/sides.py)

CONFIG = ROOT / "bench" / "vs_trl.toml"
WARMUP_STEPS = 1


def ours(args, overrides: list[str], model_path: str, n: int | str) -> dict:
    with tempfile.TemporaryDirectory(prefix="vs_trl-ours-") as tmp:
        cmd = [sys.executable, "-m", "qgrpo", "train", str(args.config), "--set", f"run.output_dir={json.dumps(tmp)}",
               "--set", f"model.path={json.dumps(model_path)}", *[x for o in overrides for x in ("--set", o)]]
        rc, sampler, seconds = run_side(cmd, side_env(), args.log_dir / f"ours_round{n}.log", args.timeout_s,
                                        gpu=args.device == "cuda")
        lines = [json.loads(x) for m in Path(tmp).glob("*/metrics.jsonl") for x in m.read_text().splitlines()]
        # what the run itself recorded of the settings a variant changes (its run directory's config.toml)
        ran = [tomllib.loads(c.read_text()) for c in Path(tmp).glob("*/config.toml")]
        settings = {f"{sec}.{key}": ran[0].get(sec, {}).get(key) for sec, key in (
            ("rollout", "precision"), ("rollout", "backend"), ("learner", "mode"), ("algo", "max_staleness"),
            ("learner", "gradient_checkpointing"), ("algo", "kl_coeff"))} if ran else {}
    steps = [m for m in lines if "time/step" in m]
    # every step logged, then the timeout: the exit (the final checkpoint, Ray's shutdown) outlasted it; the steps'
    # figures come from the run's own clock and stand, and the record says so
    exit_timed_out = rc == -1 and len(steps) == args.steps
    if (rc != 0 and not exit_timed_out) or len(steps) != args.steps:
        raise SystemExit(f"our side failed (exit {rc}, {len(steps)} of {args.steps} steps): see "
                         f"{args.log_dir / f'ours_round{n}.log'}")
    per_step = args.prompts * args.group_size
    timed = steps[WARMUP_STEPS:]
    wall = steps[-1]["time"] - steps[WARMUP_STEPS - 1]["time"]
    tokens = sum(m["rollout/completion_len"] * per_step for m in timed)
    stage = {k: sum(m.get(f"time/{k}", 0.0) for m in timed)
             for k in ("generate", "rewards", "pack", "reference", "learn", "sync")}
    # inside the sync: the slowest rollout actor's re-quantization of what it received (NaN where none timed it)
    requant = [x for m in timed if (x := m.get("sync/requantize_seconds_max")) is not None and x == x]
    requant_s = sum(requant) if requant else None
    # runs of the older one-step-off loop lapped the wait for the step ahead apart; a stream's wait is in "generate"
    stage["generate"] += sum(m.get("time/rollout_wait", 0.0) for m in timed)
    first_start = steps[0]["time"] - steps[0]["time/step"]
    return summary(
        "qgrpo", wall, tokens, stage["generate"], stage["learn"], seconds, len(timed),
        sampler.result({"steps": (first_start, steps[-1]["time"]), "timed": (steps[WARMUP_STEPS - 1]["time"],
                                                                             steps[-1]["time"])}),
        steps=[{k: m[k] for k in ("step", "time", "time/step", "time/generate", "time/reference", "time/learn",
                                  "time/sync", "sync/requantize_seconds_max", "rollout/completion_len",
                                  "perf/gen_tokens_per_s", "reward/mean")
                if k in m} for m in steps],
        # rewards and batch packing were timed inside the reference lap before they had laps of their own
        reference_s=stage["rewards"] + stage["pack"] + stage["reference"], sync_s=stage["sync"], settings=settings,
        exit_timed_out=exit_timed_out,
        stages_s_per_step={"generate": stage["generate"] / len(timed), "rewards": stage["rewards"] / len(timed),
                           "reference": (stage["pack"] + stage["reference"]) / len(timed),
                           "learn": stage["learn"] / len(timed), "sync": stage["sync"] / len(timed),
                           "requantize": None if requant_s is None else requant_s / len(timed)})


def trl(args, overrides: list[str], model_path: str, n: int, trl_set: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="vs_trl-trl-") as tmp:
        out = Path(tmp) / "trl.json"
        spec = {"config": str(args.config), "overrides": overrides, "model_path": model_path, "out": str(out),
                "tmp_dir": str(Path(tmp) / "trainer"), "threads": args.trl_threads, "trl_set": trl_set,
                "dtype": args.trl_dtype, "device": args.device}
        cmd = [sys.executable, str(ROOT / "bench" / "trl_runner.py"), json.dumps(spec)]
        rc, sampler, seconds = run_side(cmd, side_env(args.trl_threads), args.log_dir / f"trl_round{n}.log",
                                        args.timeout_s, gpu=args.device == "cuda")
        rec = json.loads(out.read_text()) if out.is_file() else {}
    ends = rec.get("step_end", [])
    if rc != 0 or len(ends) != args.steps or len(rec["generate_s"]) != args.steps:
        raise SystemExit(f"TRL's side failed (exit {rc}, {len(ends)} of {args.steps} steps): see "
                         f"{args.log_dir / f'trl_round{n}.log'}")
    if not all(rec["prompt_ids_match"]):
        raise SystemExit(f"TRL's prompt token ids differ from ours at steps {rec['prompt_ids_match']}: not comparable")
    wall = ends[-1] - ends[WARMUP_STEPS - 1]
    tokens = sum(rec["completion_tokens"][WARMUP_STEPS:])
    gen = sum(rec["generate_s"][WARMUP_STEPS:])
    lengths = [lg["completions/mean_length"] for lg in rec["logs"] if "completions/mean_length" in lg]
    return summary(
        "trl", wall, tokens, gen, wall - gen, seconds, len(ends) - WARMUP_STEPS,
        sampler.result({"steps": (rec["train_begin"], ends[-1]), "timed": (ends[WARMUP_STEPS - 1], ends[-1])}),
        steps=[{"step": i + 1, "time": t, "generate_s": g, "completion_tokens": c, "trl_mean_length": ln,
                "trl_step_time": lg.get("step_time")}
               for i, (t, g, c, ln, lg) in enumerate(zip(ends, rec["generate_s"], rec["completion_tokens"],
                                                         lengths, [x for x in rec["logs"] if "loss" in x]))],
        setup_s=rec["setup_s"], threads=rec["threads"], grpo_config=rec["grpo_config"],
        cuda_max_allocated=rec.get("cuda_max_allocated"))


def summary(side, wall, tokens, gen_s, learn_s, process_s, timed, memory, **extra) -> dict:
    return {"side": side, "timed_steps": timed, "wall_s": wall, "s_per_step": wall / timed,
            "completion_tokens": tokens, "trained_tokens_per_s": tokens / wall, "generate_s_per_step": gen_s / timed,
            "gen_tokens_per_s": tokens / gen_s, "learn_s_per_step": learn_s / timed,
            "other_s_per_step": (wall - gen_s - learn_s) / timed, "process_s": process_s, "memory": memory, **extra}


def medians(rounds: list[dict]) -> dict:
    keys = ("s_per_step", "trained_tokens_per_s", "gen_tokens_per_s", "generate_s_per_step", "learn_s_per_step",
            "other_s_per_step")
    med = {k: statistics.median(r[k] for r in rounds) for k in keys}
    for k in ("peak_rss", "peak_pss"):
        med[k] = statistics.median(r["memory"][k] for r in rounds)
    if all("stages_s_per_step" in r for r in rounds):
        med["stages_s_per_step"] = {k: (statistics.median(r["stages_s_per_step"][k] for r in rounds)
                                        if all(r["stages_s_per_step"][k] is not None for r in rounds) else None)
                                    for k in rounds[0]["stages_s_per_step"]}
    if all("gpu" in r["memory"] for r in rounds):
        g = [r["memory"]["gpu"] for r in rounds]
        med["gpu_peak_mib"] = {"device": statistics.median(x["device_used_peak_mib"] for x in g),
                               "device_at_start": statistics.median(x["device_used_start_mib"] or 0 for x in g),
                               **{role: statistics.median(x["per_role_peak_mib"].get(role, 0) for x in g)
                                  for role in g[0]["per_role_peak_mib"]}}
    med["per_role_peak"] = {role: {k: statistics.median(r["memory"]["per_role_peak"].get(role, {}).get(k, 0)
                                                        for r in rounds) for k in ("rss", "pss")}
                            for role in rounds[0]["memory"]["per_role_peak"]}
    med["rounds"] = len(rounds)
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="ours, TRL alternating, this many times each")
    ap.add_argument("--steps", type=int, default=6, help=f"steps per run; the first {WARMUP_STEPS} is warm-up")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="smoke check: 3 steps, 1 round, 16 new tokens")
    ap.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE", help="passed to our side as --set")
    ap.add_argument("--ours-variant", action="append", default=[], metavar="NAME:KEY=VALUE[;KEY=VALUE]",
                    help="one more side of ours with these --set values on top, run in every round "
                         "(e.g. 'overlap:algo.overlap=true')")
    ap.add_argument("--trl-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a GRPOConfig field of TRL's side (TOML value)")
    ap.add_argument("--trl-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="TRL's weights: bf16 (the issue's setting) or fp32 (bf16 autocast; see bench/trl_runner.py)")
    ap.add_argument("--trl-threads", type=int, default=os.cpu_count() or 1, help="torch threads of TRL's process")
    ap.add_argument("--cache-dir", default="", help="builtin models' cache (default: $QGRPO_CACHE or ~/.cache/qgrpo)")
    ap.add_argument("--config", type=Path, default=CONFIG,
                    help="our side's config, which TRL's side reads for its prompts, rewards and sizes "
                         "(bench/gpu_step.toml: the default job's settings)")
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct",
                    help="the bf16 model both sides load: builtin:NAME or a folder (bench/model_shapes.py save writes "
                         "one of a published shape with random weights)")
    ap.add_argument("--label", default="", help="the model and setting in words, for the table's first line")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: TRL's side trains on the GPU (our side's GPU shares come with --ours-set), and GPU "
                         "memory is sampled with nvidia-smi")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="start no side after this many seconds (0: no budget); what was skipped is recorded")
    ap.add_argument("--no-trl", action="store_true", help="our sides only (TRL measured in another run)")
    ap.add_argument("--keep-going", action="store_true",
                    help="a side that fails is recorded (its log named) and the others still run")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="per run of one side")
    ap.add_argument("--out", default="")
    ap.add_argument("--publish", action="store_true", help="also write bench/published/vs_trl.{json,txt}")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.rounds, args.max_new_tokens = 3, 1, 16
    if args.steps <= WARMUP_STEPS:
        ap.error(f"--steps must be > {WARMUP_STEPS} (step 1 is warm-up)")
    out = Path(args.out or ROOT / "bench" / "results" / f"vs_trl{'_quick' if args.quick else ''}.json")
    args.config = args.config.resolve()
    args.log_dir = out.parent / "vs_trl_logs"
    started, t_start, load_start = datetime.datetime.now().isoformat(timespec="seconds"), time.time(), os.getloadavg()
    trl_set = {k: tomllib.loads(f"v = {v}")["v"] for k, v in (s.split("=", 1) for s in args.trl_set)}

    from qgrpo.rollout.modeling.models import resolve_model_path

    model_path = resolve_model_path(args.model, args.cache_dir)
    # Both sides read bench/vs_trl.toml with these overrides (TRL's side for its prompts, rewards and sizes).
    shared = [f"run.steps={args.steps}", f"rollout.prompts_per_step={args.prompts}",
              f"rollout.group_size={args.group_size}", f"rollout.max_new_tokens={args.max_new_tokens}"]
    variants = {"qgrpo": []}
    for v in args.ours_variant:
        name, _, sets = v.partition(":")
        variants[f"qgrpo {name}"] = [x for x in sets.split(";") if x]
    # ours, TRL, then the variants of ours: under a budget the comparison itself comes first
    rounds: dict[str, list] = {"qgrpo": [], **({} if args.no_trl else {"trl": []}),
                               **{side: [] for side in variants if side != "qgrpo"}}
    failed, skipped = [], []
    for n in range(1, args.rounds + 1):
        for side in rounds:
            if args.budget_s and time.time() - t_start > args.budget_s:
                skipped.append(f"round {n}: {side}")
                continue
            print(f"round {n}/{args.rounds}: {side} ...", file=sys.stderr, flush=True)
            try:
                r = (trl(args, shared, model_path, n, trl_set) if side == "trl" else
                     ours(args, shared + args.ours_set + variants[side], model_path,
                          f"{n}{side[5:].replace(' ', '_')}"))
            except SystemExit as e:
                if not args.keep_going:
                    raise
                print(f"  {e}", file=sys.stderr, flush=True)
                failed.append({"round": n, "side": side, "error": str(e)})
                continue
            r["side"] = side
            rounds[side].append(r)
            print(f"  {r['s_per_step']:.1f} s/step, {r['trained_tokens_per_s']:.0f} completion tokens trained/s, peak "
                  f"PSS sum {r['memory']['peak_pss'] / GB:.1f} GB", file=sys.stderr, flush=True)
            write_partial(out, rounds, failed)
    rounds = {side: rs for side, rs in rounds.items() if rs}
    if "qgrpo" not in rounds:
        raise SystemExit(f"our side did not finish a run: {failed or skipped}")
    med = {side: medians(rs) for side, rs in rounds.items()}
    per_trl = (lambda k: med["qgrpo"][k] / med["trl"][k]) if "trl" in med else (lambda k: None)  # noqa: E731
    label = args.label or ("SmolLM2-135M-Instruct bf16, rg:basic_arithmetic (defaults)"
                           if args.model == "builtin:smollm2-135m-instruct" and args.config == CONFIG.resolve()
                           else f"{args.model}, {args.config.name}")
    result = {
        "command": " ".join(["python", "bench/vs_trl.py", *(shlex.quote(a) for a in sys.argv[1:])]),
        "machine": machine(),
        "meta": {"date": started, **versions(), "cpu_count": os.cpu_count(), "model": model_path, "label": label,
                 "device": args.device, "gpu": gpu_name() if args.device == "cuda" else None,
                 "failed": failed, "skipped": skipped,
                 "config": str(args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config),
                 "shared_overrides": shared, "ours_set": args.ours_set,
                 "ours_variants": variants,
                 "trl_set": trl_set, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                 "warmup_steps": WARMUP_STEPS, "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
                 "total_s": round(time.time() - t_start, 1)},
        "median": med,
        "ratio_ours_over_trl": None if "trl" not in med else {
            "trained_tokens_per_s": per_trl("trained_tokens_per_s"), "peak_pss": per_trl("peak_pss"),
            "peak_rss": per_trl("peak_rss"),
            **{f"{side}/trained_tokens_per_s": med[side]["trained_tokens_per_s"] / med["trl"]["trained_tokens_per_s"]
               for side in med if side not in ("qgrpo", "trl")}},
        "rounds": rounds,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")  # before the table: a table bug must not lose the run
    text = table(result)
    print(text)
    print(f"\nwrote {out}")
    if args.publish:
        pub = ROOT / "bench" / "published"
        (pub / "vs_trl.json").write_text(json.dumps(result, indent=2) + "\n")
        (pub / "vs_trl.txt").write_text(text + "\n")
        print(f"published {pub / 'vs_trl.json'} and vs_trl.txt")
    if failed:
        raise SystemExit(f"{len(failed)} run(s) failed: {[f['side'] for f in failed]}")


def write_partial(out: Path, rounds: dict, failed: list) -> None:
    """The runs so far, after each one (a run cut short by a deadline keeps what it measured)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".partial.json").write_text(json.dumps({"rounds": rounds, "failed": failed}, indent=2) + "\n")


def gpu_name() -> str | None:
    import subprocess

    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def table(result: dict) -> str:
    """The table of one run, from its JSON (`print(table(json.load(open(path))))` re-prints a saved run)."""
    meta, med, a = result["meta"], result["median"], result["meta"]["args"]
    buf = io.StringIO()
    p = lambda *s: print(*s, file=buf)  # noqa: E731
    label = meta.get("label", "SmolLM2-135M-Instruct bf16, rg:basic_arithmetic (defaults)")
    setting = ", no reference, lr 1e-5, T=1" if meta["config"] == "bench/vs_trl.toml" else f" ({meta['config']})"
    p(f"qgrpo vs TRL GRPOTrainer: {label}, {a['prompts']} prompts x {a['group_size']} completions x up to "
      f"{a['max_new_tokens']} new tokens{setting}; steps {meta['warmup_steps'] + 1}-{a['steps']} timed, median of "
      f"{a['rounds']} round(s)" + (f"; on {meta['gpu']}" if meta.get("gpu") else ""))
    dirty = " (dirty)" if "dirty" in meta["qgrpo_commit"] else ""
    p(f"torch {meta['torch']}, transformers {meta['transformers']}, trl {meta['trl']}, deepspeed {meta['deepspeed']}, "
      f"ray {meta['ray']}; qgrpo {meta['qgrpo_commit'][:12]}{dirty}; {meta['cpu_count']} cores; TRL "
      f"{a['trl_threads']} threads, {a['trl_dtype']} weights; load average at start / end "
      f"{meta['load_avg_start'][0]:.1f} / {meta['load_avg_end'][0]:.1f}")
    if meta["ours_set"] or meta["trl_set"]:
        p(f"ours --set {' '.join(meta['ours_set']) or '-'}; TRL GRPOConfig {meta['trl_set'] or '-'}")
    head = ["side", "s/step", "tok trained/s", "gen tok/s", "gen s/step", "learn s/step", "other s/step",
            "peak RSS sum", "peak PSS sum", "rounds"]
    cells = [[side, f"{m['s_per_step']:.1f}", f"{m['trained_tokens_per_s']:.0f}",
              f"{m['gen_tokens_per_s']:.0f}" if m["generate_s_per_step"] >= 0.05 else "hidden",
              f"{m['generate_s_per_step']:.1f}", f"{m['learn_s_per_step']:.1f}", f"{m['other_s_per_step']:.1f}",
              f"{m['peak_rss'] / GB:.1f} GB", f"{m['peak_pss'] / GB:.1f} GB", str(m["rounds"])]
             for side, m in med.items()]
    widths = [max(len(h), *(len(c[k]) for c in cells)) + (0 if k == 0 else 2) for k, h in enumerate(head)]
    line = lambda cs: "".join(f"{c:<{w}}" if k == 0 else f"{c:>{w}}" for k, (c, w) in enumerate(zip(cs, widths)))  # noqa: E731
    p("\n" + line(head))
    for c in cells:
        p(line(c))
    ratio = result["ratio_ours_over_trl"]
    if ratio:
        p(f"\nours / TRL: {ratio['trained_tokens_per_s']:.2f}x completion tokens trained per second; "
          f"{ratio['peak_pss']:.2f}x peak PSS" + "".join(f"; {k.split('/')[0]}: {v:.2f}x" for k, v in ratio.items()
                                                          if k.startswith("qgrpo ")))
    else:
        p("\nTRL's side not run (--no-trl): no ratio" if a.get("no_trl") else "\nTRL's side did not finish: no ratio")
    for f in meta.get("failed", []):
        p(f"FAILED round {f['round']} {f['side']}: {f['error']}")
    if meta.get("skipped"):
        p(f"skipped (budget): {', '.join(meta['skipped'])}")
    stages = {side: m["stages_s_per_step"] for side, m in med.items() if "stages_s_per_step" in m}
    if stages:
        keys = list(next(iter(stages.values())))
        p("ours, seconds per step by stage (" + ", ".join(keys) + "; requantize is inside sync): " + "; ".join(
            f"{side} " + " / ".join("-" if v[k] is None else f"{v[k]:.2f}" for k in keys)
            for side, v in stages.items()))
    gpus = {side: m["gpu_peak_mib"] for side, m in med.items() if "gpu_peak_mib" in m}
    if gpus:
        p("peak GPU memory, GiB (device total: used at start -> peak; then per process role where nvidia-smi named "
          "it): " + "; ".join(f"{side} {g['device_at_start'] / 1024:.1f} -> {g['device'] / 1024:.1f}" + "".join(
              f", {r} {v / 1024:.1f}" for r, v in g.items() if r not in ("device", "device_at_start"))
              for side, g in gpus.items()))
    for side, sets in meta.get("ours_variants", {}).items():
        if sets:
            p(f"{side}: --set {' '.join(sets)}")
    for side, rs in result["rounds"].items():
        if rs and rs[0].get("settings"):
            p(f"{side} ran with: " + ", ".join(f"{k} = {v}" for k, v in rs[0]["settings"].items()))
    p("gen s/step: ours, the time the driver waited for rollouts (with algo.overlap, what the learner did not hide); "
      "gen tok/s = tokens / that time.")
    p("learn: ours time/learn (the learner actor's step); TRL: everything but generation (rewards, forward, backward, "
      "optimizer, logging). other: ours reference + sync + the driver's own time; TRL none.")
    p("per round, tok trained/s (cores other jobs used meanwhile): " + "; ".join(
        f"{side} " + ", ".join(f"{r['trained_tokens_per_s']:.0f} ({r['memory']['others_cores']:.1f})" for r in rs)
        for side, rs in result["rounds"].items()))
    roles = med["qgrpo"]["per_role_peak"]  # CPU memory
    p("qgrpo peak by role (RSS / PSS sums, GB): " + ", ".join(
        f"{r} {v['rss'] / GB:.2f}/{v['pss'] / GB:.2f}" for r, v in sorted(roles.items(), key=lambda x: -x[1]["pss"])))
    unowned = sorted({pid for r in result["rounds"]["qgrpo"] for pid in r["memory"]["unowned_ray_processes"]})
    p(f"Ray processes of our session outside the sampled tree: {len(unowned)}" + (f" {unowned}" if unowned else ""))
    p("memory sampler's own CPU (s) / side's process wall (s): " + "; ".join(
        f"{side} " + ", ".join(f"{r['memory']['sampler_cpu_s']:.0f}/{r['process_s']:.0f}" for r in rs)
        for side, rs in result["rounds"].items()))
    p(f"\nbench took {meta['total_s'] / 60:.1f} min")
    return buf.getvalue().rstrip("\n")


if __name__ == "__main__":
    main()
