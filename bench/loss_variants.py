"""Loss and correction variants side by side: each a set of [algo] overrides on one base config (the default job,
configs/smollm2_arith.toml, unless --config names another), run whole once per seed with int8 rollouts (the default
job's own), to see which learns most per minute and which keep the sampler mismatch and the answers' spread in hand.

Variants (docs/algorithms.md, and the docstrings of [algo] in cluster/config/training.py):
- `tis`: today's default, token-level truncated importance sampling, weight min(pi_old/mu, 2);
- `seq_mask`: the sequence's ratio, kept inside [0, 3] and zeroed outside (TRL's default);
- `icepop`: each token's ratio, kept inside [0.5, 5] and zeroed outside (IcePop);
- `geo_rs`: rejection of a whole sequence whose geometric-mean ratio is outside [0.999, 1.001], weight 1 inside
  (verl's Geo-RS; the bounds its docs suggest, docs/algo/rollout_corr.md);
- `gspo`: GSPO's sequence-level clip, with its paper's clip_low = 3e-4, clip_high = 4e-4 and loss_agg = "seq_mean";
- `cispo`: CISPO's clipped stop-gradient weight on log pi;
- `dynamic`: DAPO's dynamic sampling (groups with equal rewards dropped, more prompts drawn);
- `m2po`: M2PO's second-moment token mask for stale rollouts, as AReaL's example sets it (m2_threshold 0.04, each
  token's ratio kept inside [0, 5]); the staleness correction beside `tis` for algo.max_staleness > 0.

`--family requantize` runs instead, under bench/results/requantize[_TAG] (docs/quantization.md): `int4_nearest`,
`int4_stochastic`, `int4_error_feedback` and the same at int8 (sync.requantize), and `int4_fake_quant`,
`int8_fake_quant` (learner.fake_quant = "rollout" with nearest rounding); each sets rollout.precision itself.
Their tables add the update visibility per sync (share of codes changed, the served update's projection on the
bf16 update and its norm against it).

Each run is bench/default_job.py's (`one_run`: `qgrpo train` under its memory sampler, then `qgrpo eval CKPT
--precision bf16` of the final checkpoint), with the variant's overrides and the --set ones after them. Per run:
- held-out greedy accuracy at step 0 and after the last step (the run's own evaluations, on its int8 generators) and of
  the final checkpoint on a bf16 generator, against the base model on a bf16 generator (once per seed, kept as
  base_bf16_s<seed>.json); the gain in points and points per minute of wall time (the whole process);
  the majority baseline (always the train split's most common answer) and, after the last step, how many distinct
  answers the policy gave and the share of the most common one, where a collapse onto one answer shows;
- per step (kept in the JSON as curves): the sampler mismatch (mismatch/kl_mu_old, the effective sample size
  mismatch/ess), the fractions the correction truncated or masked, the policy's entropy, and what the variant's own
  mechanism logs (clip fractions, dropped groups). The tables show their means over steps and the last entropy; a
  metric the run did not log is left out.

Runs go seed-major (s0 of every variant, then s1), so a slow spell of the machine falls on every variant of a seed.
Finished runs are kept in bench/results/loss_variants[_TAG]/<variant>_s<seed>.json and `--resume` skips them; a run
that fails (e.g. an option the learner does not read yet) is reported with the end of its log and not kept.

    .venv/bin/python bench/loss_variants.py                                   # 8 variants x seeds 0 1, 30 steps
    .venv/bin/python bench/loss_variants.py --variants tis icepop --seeds 0 --steps 10 --tag short
    .venv/bin/python bench/loss_variants.py --set rollout.prompts_per_step=4 --tag small
    .venv/bin/python bench/loss_variants.py --config configs/tiny.toml --steps 2 --seeds 0 --variants tis seq_mask \\
        --tag smoke                                                           # minutes: the tiny digit-sum model
    .venv/bin/python bench/loss_variants.py --resume --publish                # add the runs not done yet, publish
    .venv/bin/python bench/loss_variants.py --report                          # tabulate the runs done so far
    .venv/bin/python bench/loss_variants.py --family requantize --config configs/tiny.toml --tag tiny --resume

Writes bench/results/loss_variants[_TAG].json and prints the tables; `--publish` also writes bench/published/
loss_variants[_TAG].{json,txt}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from default_job import (  # noqa: E402  (the default job's run, its keeping and its publishing)
    CONFIG,
    kept_or_run,
    mean,
    one_run,
    results_folder,
    save,
    session_options,
)
from sides import side_env, versions  # noqa: E402

from qgrpo.cluster.config.tomlio import value_text  # noqa: E402
from qgrpo.rollout.modeling.models import resolve_model_path  # noqa: E402

BENCH = "loss_variants"
TIS = {"algo.policy_loss": "grpo", "algo.is_level": "token", "algo.is_mode": "truncate", "algo.is_cap": 2.0,
       "algo.is_floor": 0.0}
VARIANTS: dict[str, dict] = {
    "tis": TIS,
    "seq_mask": {"algo.is_level": "sequence", "algo.is_mode": "mask", "algo.is_cap": 3.0, "algo.is_floor": 0.0},
    "icepop": {"algo.is_level": "token", "algo.is_mode": "mask", "algo.is_floor": 0.5, "algo.is_cap": 5.0},
    "geo_rs": {"algo.is_level": "geometric", "algo.is_mode": "reject", "algo.is_floor": 0.999, "algo.is_cap": 1.001},
    "gspo": {"algo.policy_loss": "gspo", "algo.loss_agg": "seq_mean", "algo.clip_low": 3e-4, "algo.clip_high": 4e-4},
    "cispo": {"algo.policy_loss": "cispo"},
    "dynamic": {"algo.dynamic_sampling": True},
    # M2PO's second-moment token mask as AReaL's example sets it (docs/algorithms.md): the staleness correction
    "m2po": {**TIS, "algo.m2_threshold": 0.04, "algo.is_mode": "mask", "algo.is_cap": 5.0},
}
# --family requantize: sync.requantize on int4 and int8 rollouts, and quantization-aware learning
# (learner.fake_quant) with nearest rounding (docs/quantization.md); results under "requantize".
REQUANTIZE = {**{f"{p}_{mode}": {"rollout.precision": p, "sync.requantize": mode}
                 for p in ("int4", "int8") for mode in ("nearest", "stochastic", "error_feedback")},
              **{f"{p}_fake_quant": {"rollout.precision": p, "sync.requantize": "nearest",
                                     "learner.fake_quant": "rollout"} for p in ("int4", "int8")}}
FAMILIES = {"loss": (BENCH, VARIANTS), "requantize": ("requantize", REQUANTIZE)}
# Per-step metrics kept as curves (those a run logs): (key, table header, "mean" over steps or "last" value)
CURVES = (
    ("mismatch/kl_mu_old", "kl mu|old", "mean"), ("mismatch/ess", "ess", "mean"),
    ("mismatch/truncated_token_frac", "trunc tok", "mean"), ("mismatch/truncated_seq_frac", "trunc seq", "mean"),
    ("mismatch/masked_token_frac", "mask tok", "mean"), ("mismatch/masked_seq_frac", "mask seq", "mean"),
    ("mismatch/offpolicy_masked_seq_frac", "offpol seq", "mean"),
    ("entropy/mean", "entropy", "mean"), ("entropy/mean", "entropy end", "last"),
    ("entropy/masked_token_frac", "ent mask", "mean"), ("loss/clip_frac_low", "clip low", "mean"),
    ("loss/clip_frac_high", "clip high", "mean"), ("dynamic/dropped_group_frac", "dropped grp", "mean"),
    ("dynamic/extra_prompts", "extra prm", "mean"), ("dynamic/rounds", "rounds", "mean"),
    ("overlong/penalized_frac", "overlong", "mean"), ("train/accuracy", "train acc", "mean"),
    ("reward/mean", "reward", "mean"), ("sync/code_change_frac_min", "codes chg", "mean"),
    ("sync/update_projection_min", "upd proj", "mean"), ("sync/update_norm_ratio_min", "upd norm", "mean"),
)


def pct(x):
    return None if x is None else 100 * x


def last_eval(r: dict, key: str):
    return list(r["eval"].values())[-1].get(key) if r.get("eval") else None


# The learning table: (header, width, value of a run or None, format)
LEARNING = (
    ("acc 0", 6, lambda r: pct(list(r["eval"].values())[0]["accuracy"]) if r.get("eval") else None, ".1f"),
    ("acc end", 8, lambda r: pct(last_eval(r, "accuracy")), ".1f"),
    ("bf16 0", 7, lambda r: pct((r.get("eval_base_bf16") or {}).get("accuracy")), ".1f"),
    ("end bf16", 9, lambda r: pct((r.get("eval_final_bf16") or {}).get("accuracy")), ".1f"),
    ("gain pts", 9, lambda r: r.get("acc_gain_points"), ".1f"),
    ("gain bf16", 10, lambda r: bf16_gain(r), ".1f"),
    ("pts/min", 8, lambda r: r.get("acc_gain_points_per_min"), ".2f"),
    ("bf16 pts/min", 13, lambda r: None if bf16_gain(r) is None else bf16_gain(r) / (r["process_s"] / 60), ".2f"),
    ("majority", 9, lambda r: pct((r.get("baseline") or {}).get("majority_accuracy")), ".1f"),
    ("distinct", 9, lambda r: last_eval(r, "answers_distinct"), ".1f"),
    ("top share", 10, lambda r: pct(last_eval(r, "answers_top_share")), ".1f"),
    ("wall min", 9, lambda r: r["process_s"] / 60, ".1f"),
    ("s/step", 7, lambda r: r["train_s"] / r["steps"], ".1f"),
)


def bf16_gain(r: dict):
    """Points gained on a bf16 generator: the final checkpoint against the base model on the same prompts (where the
    seed's base evaluation is there; else against the run's own step-0 evaluation, on its rollout precision)."""
    final, base = r.get("eval_final_bf16"), r.get("eval_base_bf16")
    if final and base:
        return 100 * (final["accuracy"] - base["accuracy"])
    return r.get("acc_gain_bf16_points")


def base_bf16(args, seed: int) -> dict:
    """The base model on a bf16 generator, on the held-out prompts of `seed` (the config's, --set ones included):
    where every variant of the seed starts in bf16, whatever precision its own step-0 evaluation ran at."""
    cfg = tomllib.loads(args.config.read_text())
    model = resolve_model_path(cfg["model"]["path"], cfg["model"].get("cache_dir", ""))
    log = args.out_dir / "logs" / f"base_bf16_s{seed}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "qgrpo", "eval", model, "--config", str(args.config), "--precision", "bf16",
           "--set", f"run.seed={seed}", *[x for e in args.set for x in ("--set", e)]]
    out = subprocess.run(cmd, cwd=ROOT, env=side_env(), capture_output=True, text=True)
    log.write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        raise SystemExit(f"qgrpo eval of the base model failed (exit {out.returncode}): see {log}")
    return json.loads(out.stdout.splitlines()[-1])


def variant_run(args, variant: str, seed: int) -> dict:
    """One run of `variant` (bench/default_job.py's), with its per-step curves read from the run's metrics."""
    name = f"{variant}_s{seed}"
    extra = (*[f"{k}={value_text(v)}" for k, v in args.variants_of[variant].items()], *args.set)
    precision = args.variants_of[variant].get("rollout.precision", args.precision)  # the variant's, where it sets one
    res = one_run(args, seed, precision, name=name, config=args.config, extra=extra)
    lines = (args.out_dir / "logs" / f"{name}.metrics.jsonl").read_text().splitlines()
    steps = [m for m in map(json.loads, lines) if "time/step" in m]
    curves = {k: [[m["step"], m[k]] for m in steps if m.get(k) is not None] for k, _, _ in CURVES}
    curves = {k: c for k, c in curves.items() if c}
    final, acc0 = res.get("eval_final_bf16"), list(res["eval"].values())[0]["accuracy"] if res["eval"] else None
    return {**res, "variant": variant, "overrides": list(extra), "curves": curves,
            "acc_gain_bf16_points": 100 * (final["accuracy"] - acc0) if final and acc0 is not None else None}


def thinned(run: dict, points: int = 60) -> dict:
    """The run with its curves at most `points` steps each (evenly spaced, the last kept) and 4 significant digits,
    for the result files; the run's own file in the results folder keeps every step."""
    def thin(c: list) -> list:
        every = max(1, -(-len(c) // points))
        return [[s, float(f"{v:.4g}")] for s, v in c[every - 1::every] + ([] if len(c) % every == 0 else c[-1:])]

    return {**run, "curves": {k: thin(c) for k, c in run.get("curves", {}).items()}}


def curve_value(r: dict, key: str, how: str):
    c = r.get("curves", {}).get(key)
    return None if not c else (c[-1][1] if how == "last" else mean([v for _, v in c]))


def cell(values: list, width: int, spec: str) -> str:
    """The mean of the values that are there ('-' when none is), right-aligned in `width`."""
    xs = [v for v in values if v is not None and v == v]
    return f"{mean(xs):>{width}{spec}}" if xs else f"{'-':>{width}}"


def tables(result: dict) -> str:
    runs = result["runs"]
    by_variant = {v: [r for r in runs if r["variant"] == v] for v in result["variants"]}
    by_variant = {v: rs for v, rs in by_variant.items() if rs}
    curves = [(k, h, how) for k, h, how in CURVES if any(curve_value(r, k, how) is not None for r in runs)]
    commits = sorted({r.get("versions", {}).get("qgrpo_commit", "?")[:12] for r in runs})
    out = [f"{result.get('family', 'loss')} variants on {result['config']}, {result['steps']} steps, "
           f"{result['precision']} rollouts"
           + (f", --set {' '.join(result['sets'])}" if result["sets"] else "")
           + f"; runs at commit {', '.join(commits) or '-'}", ""]
    groups = [("variant", "per variant, mean over seeds", list(by_variant.items())),
              ("run", "per run", [(r["name"], [r]) for r in runs])]
    for first, title, rows in groups:
        out += [f"{title}: held-out accuracy, greedy (%), at step 0 and the last step on the run's "
                f"{result['precision']} generators, and on a bf16 generator of the base model (bf16 0) and the final "
                "checkpoint;", "gains in points and per minute of wall time (gain bf16: end bf16 - bf16 0); distinct "
                "answers, the top one's share at the last step",
                f"{first:<12} {'seeds':>6} " + " ".join(f"{h:>{w}}" for h, w, _, _ in LEARNING)]
        for name, rs in rows:
            out.append(f"{name:<12} {' '.join(str(r['seed']) for r in rs):>6} "
                       + " ".join(cell([fn(r) for r in rs], w, d) for _, w, fn, d in LEARNING))
        out.append("")
        if curves:
            out += [f"per-step metrics, {title}: means over steps ('entropy end': the last step's entropy)",
                    f"{first:<12} " + " ".join(f"{h:>11}" for _, h, _ in curves)]
            out += [f"{name:<12} " + " ".join(cell([curve_value(r, k, how) for r in rs], 11, ".3g")
                                              for k, _, how in curves) for name, rs in rows]
            out.append("")
    for f in result["failed"]:
        out += [f"FAILED {f['name']}: {f['error']}", *[f"    {x}" for x in f["log_tail"]]]
    return "\n".join(out).rstrip()


def summary(runs: list[dict]) -> dict | None:
    """A variant's means over its runs (seeds) of the table's columns, those the runs have."""
    if not runs:
        return None
    cols = {h: [fn(r) for r in runs] for h, _, fn, _ in LEARNING}
    cols.update({f"{k} ({how})": [curve_value(r, k, how) for r in runs] for k, _, how in CURVES})
    present = {k: [x for x in xs if x is not None and x == x] for k, xs in cols.items()}
    return {"seeds": [r["seed"] for r in runs], **{k: mean(xs) for k, xs in present.items() if xs}}


def log_tail(path: Path, n: int = 4) -> list[str]:
    """The last `n` lines of a run's log that say something (progress bars and warnings left out)."""
    if not path.is_file():
        return []
    lines = [x.strip()[:300] for x in path.read_text(errors="replace").splitlines()]
    return [x for x in lines if x and "Warning" not in x and "it/s]" not in x][-n:]


def steps_of(args) -> int:
    """run.steps as the runs will have it: a --set run.steps=N, else --steps, else the config's."""
    for s in reversed(args.set):
        if s.split("=", 1)[0].strip() == "run.steps":
            return int(s.split("=", 1)[1])
    return args.steps or tomllib.loads(args.config.read_text())["run"]["steps"]


def collect(args, bases: dict) -> tuple[list, list, list]:
    """(runs, failed, missing) over seeds and variants, seed-major: each run kept, run now, or missing (--report).
    A run that fails (one_run's verdict) is kept as NAME.failed.json with the end of its log, reported as failed,
    and under --resume or --report not tried again unless --retry-failed: a failure of the method (e.g. a fingerprint
    past its tolerance) is a result of the comparison."""
    runs, failed, missing = [], [], []
    for seed in args.seeds:
        for variant in args.variants:
            name = f"{variant}_s{seed}"
            gave_up = args.out_dir / f"{name}.failed.json"
            if (args.resume or args.report) and gave_up.is_file() and not args.retry_failed:
                failed.append(json.loads(gave_up.read_text()))
                print(f"{name}: failed before ({failed[-1]['error']}); --retry-failed runs it again", flush=True)
                continue
            try:
                run = kept_or_run(args, args.out_dir / f"{name}.json", lambda: variant_run(args, variant, seed))
            except SystemExit as e:  # one_run's verdict on a failed run: the others go on
                tail = log_tail(args.out_dir / "logs" / f"{name}.log")
                failed.append({"name": name, "variant": variant, "seed": seed, "error": str(e), "log_tail": tail,
                               "versions": versions()})
                gave_up.write_text(json.dumps(failed[-1], indent=1))
                print(f"{name}: FAILED: {e}", *tail, sep="\n    ", flush=True)
                continue
            gave_up.unlink(missing_ok=True)
            if run is None:
                missing.append(name)
            else:
                runs.append({**run, "eval_base_bf16": bases[seed]})
    return runs, failed, missing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=CONFIG, help="the base config (default: the default job's)")
    ap.add_argument("--family", choices=list(FAMILIES), default="loss",
                    help="loss: the losses and corrections; requantize: sync.requantize at int4 and int8")
    ap.add_argument("--variants", nargs="+", choices=[v for _, vs in FAMILIES.values() for v in vs],
                    help="default: every variant of the family")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=0, help="run.steps (default: the config's)")
    ap.add_argument("--precision", default="int8", help="rollout.precision of every run (default: int8)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every run, after the variant's (repeatable)")
    ap.add_argument("--retry-failed", action="store_true", help="under --resume, run again the runs that failed")
    session_options(ap, BENCH)
    args = ap.parse_args()
    bench, args.variants_of = FAMILIES[args.family]
    args.variants = args.variants or list(args.variants_of)
    if unknown := [v for v in args.variants if v not in args.variants_of]:
        ap.error(f"--variants {' '.join(unknown)}: not of --family {args.family} ({', '.join(args.variants_of)})")
    args.config, args.no_eval = args.config.resolve(), False
    args.steps = steps_of(args)
    stem = results_folder(args, bench)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    bases = {seed: kept_or_run(args, args.out_dir / f"base_bf16_s{seed}.json", lambda: base_bf16(args, seed))
             for seed in args.seeds}
    runs, failed, missing = collect(args, bases)
    by_variant = {v: summary([r for r in runs if r["variant"] == v]) for v in args.variants}
    config = args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config
    precision = args.precision if args.family == "loss" else "each variant's"
    result = {"config": str(config), "steps": args.steps, "precision": precision, "sets": args.set,
              "family": args.family, "variants": {v: args.variants_of[v] for v in args.variants},
              "started": started, "argv": sys.argv[1:],
              "versions": versions(), "by_variant": by_variant, "runs": runs, "failed": failed, "missing": missing}
    text = tables(result) + (f"\nnot run yet: {', '.join(missing)}" if missing else "")  # from every step
    save(stem, {**result, "runs": [thinned(r) for r in runs]}, text, args.publish)


if __name__ == "__main__":
    main()
