"""Plan past this machine: a seeded discrete-event model (plain Python, no Ray) of a GRPO step loop with 1-16 rollout
actors per learner, projecting learner utilisation and steps per hour for the synchronous loop, one-step-off overlap
(`algo.overlap`) and asynchronous rollouts at staleness bounds 1, 2 and 4. Projections from a model, not measurements.

Inputs, read and recorded in the output (nothing hard-coded):
- **stage times** measured on this machine: bench/published/default_job.json, the runs at the config's rollout
  precision, mean over seeds: `stage_s` (generate; rewards, pack and reference as the driver's "reference" lap; learn;
  sync), `sync_split_s.export_seconds` (the learner's part of a sync; the rest of the sync lap is the actors'
  receive, re-quantize and verify), `completion_len` and `s_per_step` (the check below);
- **the job**: configs/smollm2_arith.toml's prompts_per_step, group_size, max_new_tokens and num_actors;
- **completion lengths**, drawn independently per completion: the `num_tokens` of a real run's rollouts Parquet
  (`--lengths-from RUN_DIR`) and a long-tailed lognormal (sigma `--sigma`) whose mean, after the cap at `--cap`
  tokens, is the measured mean completion length. Without `--lengths-from` the first scenario is the lognormal capped
  at max_new_tokens.

The model:
- **batched decode**: an actor decodes a chunk of whole groups as one batch, in `token_s x rows x longest completion`
  seconds: the longest completion holds the whole batch (static batching), so a long tail stalls it. `token_s`, the
  cost of one decode step per row, is calibrated so that the measured batch (prompts_per_step x group_size rows on
  the config's actors) takes the measured generate time at the expected longest completion of such a batch;
  `--row-share` is the part of a decode step that grows with the rows (1: compute-bound, as on this CPU, where
  bench/published/rollout_backends.json has the same bf16 tokens/s at 32 and 128 rows; 0: a step costs the same at
  any batch size, as memory-bound decode on a GPU);
- **per step**, in the learner's path one after another as the driver runs them: rewards + pack + reference, learn,
  the learner's export of the weights; then every actor loads them (in parallel, the same time at any actor count).
  These are per step of prompts_per_step groups, as measured;
- **sync**: a step splits its prompts over the actors (whole groups, near-equal chunks, as cluster/run/workers.py
  does) and waits for the slowest; then reference, learn, sync;
- **one-step-off** (`algo.overlap`): step k+1's rollouts are generated, on the weights before step k's update, while
  step k is scored and trained; the sync waits for them (as the one-step-off loop did before `algo.overlap` became
  an alias of the stream at staleness 1, whose sync reaches them mid-call);
- **async-S**: each actor takes the next chunk of prompts whenever it is free (the same chunk size as sync's, or
  `--chunk-groups`), loading the newest weights first if the learner has published any (a sync reaches an actor
  between chunks), and pushes the finished groups to a buffer; admission is paced as AReaL does: an actor holding
  version w admits prompts only while those admitted (less those discarded) stay <= (w + S + 1) x prompts_per_step.
  The learner takes prompts_per_step groups, oldest policy version first, dropping any more than S versions stale.
  Async-0 is the synchronous loop (tests/test_async_sim.py checks it).

Every actor, the reference and the learner are assumed to have a device of their own (on this 2-core CPU they share
its cores, so overlap gains less here: bench/published/loss_variants_overlap.json). Figures are steady state: the
first `--warmup` steps are left out. Learner utilisation is time in the learn stage over wall time; learner wait is
the time per step the learner's path (reference, learn, export) stands idle.

    .venv/bin/python bench/async_sim.py                                  # lognormal lengths only
    .venv/bin/python bench/async_sim.py --lengths-from RUN_DIR --publish # a run's lengths and the lognormal
    .venv/bin/python bench/async_sim.py --lengths-from bench/published/async_sim.json   # the published lengths again
    .venv/bin/python bench/async_sim.py --row-share 0 --sigma 1.5 --cap 512

Writes bench/results/async_sim.json and prints a table; `--publish` also writes bench/published/async_sim.{json,txt}.
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
import tomllib
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "bench" / "published" / "default_job.json"
CONFIG = ROOT / "configs" / "smollm2_arith.toml"
MODES = ("sync", "one-step-off", "async-1", "async-2", "async-4")
ACTORS = (1, 2, 4, 8, 16)
MACHINE = ("none: a model in plain Python; its stage times were measured on a 2-core x86_64 CPU, no GPU "
           "(bench/published/default_job.json)")


@dataclass(frozen=True)
class Stages:
    """Seconds per step of prompts_per_step groups, and the cost of one decode step per row at the measured batch."""

    token_s: float  # one decode step, per row of the measured batch (batch time = token_s x rows x longest)
    reference_s: float  # rewards + pack + reference (the driver's laps before learn)
    learn_s: float
    export_s: float  # the learner's part of a weight sync
    load_s: float  # an actor's part (receive, re-quantize, verify): the rest of the sync lap
    rows: int = 64  # the measured batch's rows per actor, where token_s was calibrated
    row_share: float = 1.0  # the part of a decode step that grows with the rows


@dataclass(frozen=True)
class Job:
    prompts_per_step: int
    group_size: int


class Lengths:
    """Completion lengths per prompt index, drawn in blocks from one seeded stream: prompt i gets the same lengths
    whichever mode asks for it, in whatever order, so the modes are compared on the same completions."""

    BLOCK = 1024

    def __init__(self, draw: Callable[[random.Random], int], group_size: int, seed: int):
        self.draw, self.group_size, self.rng, self.rows = draw, group_size, random.Random(seed), []

    def __getitem__(self, i: int) -> list[int]:
        while i >= len(self.rows):
            self.rows += [[self.draw(self.rng) for _ in range(self.group_size)] for _ in range(self.BLOCK)]
        return self.rows[i]


def chunk_seconds(st: Stages, lengths: Lengths, prompts: range) -> float:
    """One actor decoding these prompts' groups as one batch: the longest completion holds every row."""
    if not prompts:
        return 0.0
    rows = sum(len(lengths[i]) for i in prompts)
    longest = max(max(lengths[i]) for i in prompts)
    return st.token_s * st.rows * ((1 - st.row_share) + st.row_share * rows / st.rows) * longest


def split(start: int, n: int, actors: int) -> list[range]:
    """Near-equal contiguous chunks of whole prompts, as cluster/run/workers.py's split_prompts."""
    k, r = divmod(n, actors)
    out, i = [], start
    for a in range(actors):
        j = i + k + (a < r)
        out.append(range(i, j))
        i = j
    return out


def _sync(st, job, lengths, actors, steps):
    """Step k: every actor decodes its chunk of step k's prompts, the step waits for the slowest, then reference,
    learn and export; the actors load the new weights before step k+1."""
    P, t, ends, gen_busy = job.prompts_per_step, 0.0, [], 0.0
    for k in range(steps):
        chunks = [chunk_seconds(st, lengths, c) for c in split(k * P, P, actors)]
        gen_busy += sum(chunks)
        t += max(chunks) + st.reference_s + st.learn_s + st.export_s
        ends.append(t)
        t += st.load_s
    return ends, [[0] * P for _ in range(steps)], 0, steps * P, gen_busy


def _one_step_off(st, job, lengths, actors, steps):
    """Step k+1's rollouts are generated from when step k's are taken, on the weights before step k's update; the
    sync after step k waits for them, then exports and loads."""
    P, ends, gen_busy = job.prompts_per_step, [], 0.0

    def gen(k):
        nonlocal gen_busy
        chunks = [chunk_seconds(st, lengths, c) for c in split(k * P, P, actors)]
        gen_busy += sum(chunks)
        return max(chunks)

    take = gen(0)
    for k in range(steps):
        ahead = take + gen(k + 1)  # the last step too: the figures are steady state, not a run's end
        export_end = max(take + st.reference_s + st.learn_s, ahead) + st.export_s
        ends.append(export_end)
        take = export_end + st.load_s
    return ends, [[0] * P] + [[1] * P for _ in range(steps - 1)], 0, steps * P, gen_busy


def _async(st, job, lengths, actors, steps, staleness, chunk):
    """Actors pull chunks of prompts whenever free (after loading any newer weights) under AReaL's paced admission;
    the learner takes prompts_per_step groups, oldest version first, within `staleness` versions."""
    P, S = job.prompts_per_step, staleness
    events, seq = [], 0
    published, held = 0, [0] * actors
    admitted, next_prompt, discarded, completed, gen_busy = 0, 0, 0, 0, 0.0
    buffer: list[tuple[int, int, int]] = []  # (policy version, arrival order, prompt index)
    waiting: set[int] = set()  # actors with nothing to admit until the learner publishes
    learner_idle, ends, taken = True, [], []

    def push(t, kind, data):
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, data))
        seq += 1

    def start(a, now):
        nonlocal admitted, next_prompt, gen_busy
        if held[a] < published:
            push(now + st.load_s, "loaded", (a, published))
            return
        n = min(chunk, (held[a] + S + 1) * P - admitted)
        if n <= 0:
            waiting.add(a)
            return
        prompts = range(next_prompt, next_prompt + n)
        next_prompt, admitted = next_prompt + n, admitted + n
        seconds = chunk_seconds(st, lengths, prompts)
        gen_busy += seconds
        push(now + seconds, "done", (a, held[a], prompts))

    def wake(now):
        for a in sorted(waiting):
            waiting.discard(a)
            start(a, now)

    def learn(now):
        nonlocal learner_idle, discarded, admitted
        if not learner_idle:
            return
        fresh = [g for g in buffer if published - g[0] <= S]
        if len(fresh) < len(buffer):
            dropped = len(buffer) - len(fresh)
            discarded, admitted = discarded + dropped, admitted - dropped  # room for as many new prompts
            buffer[:] = fresh
            wake(now)
        if len(buffer) < P or len(taken) >= steps:
            return
        buffer.sort()
        batch, buffer[:] = buffer[:P], buffer[P:]
        taken.append([published - v for v, _, _ in batch])
        learner_idle = False
        push(now + st.reference_s + st.learn_s + st.export_s, "published", None)

    for a in range(actors):
        start(a, 0.0)
    arrivals = 0
    while events and len(ends) < steps:
        now, _, kind, data = heapq.heappop(events)
        if kind == "loaded":
            a, version = data
            held[a] = version
            start(a, now)
        elif kind == "done":
            a, version, prompts = data
            for i in prompts:
                buffer.append((version, arrivals, i))
                arrivals += 1
            completed += len(prompts)
            start(a, now)
            learn(now)
        else:
            published += 1
            ends.append(now)
            learner_idle = True
            wake(now)
            learn(now)
    if len(ends) < steps:
        raise RuntimeError(f"async-{S} stalled after {len(ends)} of {steps} steps")
    return ends, taken, discarded, completed, gen_busy


def simulate(st: Stages, job: Job, lengths: Lengths, mode: str, actors: int, steps: int = 300, warmup: int = 20,
             chunk_groups: int = 0) -> dict:
    """One mode at one actor count: its steady-state figures over steps warmup+1..steps. `mode`: sync,
    one-step-off or async-S (S: the staleness bound, async-0 included)."""
    chunk = chunk_groups or -(-job.prompts_per_step // actors)
    if mode == "sync":
        ends, taken, discarded, completed, gen_busy = _sync(st, job, lengths, actors, steps)
    elif mode == "one-step-off":
        ends, taken, discarded, completed, gen_busy = _one_step_off(st, job, lengths, actors, steps)
    elif mode.startswith("async-"):
        ends, taken, discarded, completed, gen_busy = _async(st, job, lengths, actors, steps, int(mode[6:]), chunk)
    else:
        raise ValueError(f"unknown mode {mode!r}: sync, one-step-off or async-S")
    wall = ends[-1] - ends[warmup - 1] if warmup else ends[-1]
    n = steps - warmup
    stale = [s for step in taken[warmup:] for s in step]
    s_per_step = wall / n
    return {
        "mode": mode, "actors": actors, "chunk_groups": chunk if mode.startswith("async-") else None,
        "s_per_step": s_per_step, "steps_per_hour": 3600 / s_per_step,
        "learner_utilisation": st.learn_s / s_per_step,
        "learner_wait_s": s_per_step - (st.reference_s + st.learn_s + st.export_s),
        "actor_busy": gen_busy / (actors * ends[-1]),
        "staleness_mean": statistics.fmean(stale), "staleness_max": max(stale),
        "discarded_frac": discarded / completed if completed else 0.0,
    }


# --- inputs ----------------------------------------------------------------------------------------------------------

def lognormal(mean: float, sigma: float, cap: int) -> tuple[Callable[[random.Random], int], float]:
    """A lognormal draw, rounded and capped at `cap` tokens, whose capped mean is `mean`; and its mu."""
    phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731

    def capped_mean(mu):
        z = (math.log(cap) - mu) / sigma
        return math.exp(mu + sigma**2 / 2) * phi(z - sigma) + cap * (1 - phi(z))

    lo, hi = -10.0, math.log(cap) + 10
    for _ in range(200):  # capped_mean rises with mu
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if capped_mean(mid) < mean else (lo, mid)
    mu = (lo + hi) / 2
    return (lambda rng: max(1, min(cap, round(rng.lognormvariate(mu, sigma))))), mu


def empirical(hist: dict[int, int]) -> Callable[[random.Random], int]:
    values, weights = list(hist), list(hist.values())
    return lambda rng: rng.choices(values, weights)[0]


def read_lengths(path: Path) -> tuple[dict[int, int], str]:
    """num_tokens of every completion in a run's rollouts Parquet (a run directory, its rollouts/ folder or one
    file), or the histogram a published async_sim JSON kept."""
    if path.suffix == ".json":
        d = json.loads(path.read_text())["inputs"]["lengths"]["measured"]
        return {int(k): v for k, v in d["histogram"].items()}, d["source"]
    import pyarrow.parquet as pq

    files = [path] if path.is_file() else sorted((path / "rollouts" if (path / "rollouts").is_dir() else path)
                                                 .glob("*.parquet"))
    if not files:
        raise SystemExit(f"no rollouts Parquet under {path}")
    counts = Counter(n for f in files for n in pq.read_table(f, columns=["num_tokens"]).column(0).to_pylist())
    run = path if path.is_dir() and (path / "rollouts").is_dir() else files[0].parent.parent
    return dict(sorted(counts.items())), f"num_tokens of the rollouts Parquet of run {run.name}"


def expected_longest(draw: Callable[[random.Random], int], rows: int, seed: int, n: int = 4000) -> float:
    rng = random.Random(seed)
    return statistics.fmean(max(draw(rng) for _ in range(rows)) for _ in range(n))


def measured(source: Path, precision: str) -> dict:
    """The stage times of the published default-job runs at this precision, mean over seeds."""
    d = json.loads(source.read_text())
    runs = [r for r in d["runs"] if r["precision"] == precision]
    if not runs:
        raise SystemExit(f"{source} has no run at rollout precision {precision}")
    m = lambda get: statistics.fmean(get(r) for r in runs)  # noqa: E731
    stage = lambda k: m(lambda r: r["stage_s"].get(k, 0.0))  # noqa: E731
    return {
        "file": str(source.relative_to(ROOT)) if source.is_relative_to(ROOT) else source.name,
        "command": d.get("command"), "machine": d.get("machine"),
        "runs": [r["name"] for r in runs],
        "fields": ["runs[].stage_s.{generate,rewards,pack,reference,learn,sync}", "runs[].sync_split_s.export_seconds",
                   "runs[].completion_len", "runs[].s_per_step", "runs[].gen_tokens_per_s"],
        "generate_s": stage("generate"), "reference_s": stage("rewards") + stage("pack") + stage("reference"),
        "learn_s": stage("learn"), "sync_s": stage("sync"),
        "export_s": m(lambda r: r["sync_split_s"]["export_seconds"]),
        "completion_len": m(lambda r: r["completion_len"]), "s_per_step": m(lambda r: r["s_per_step"]),
        "gen_tokens_per_s": m(lambda r: r["gen_tokens_per_s"]),
    }


def inputs(args) -> tuple[dict, Job, list[tuple[str, dict, Callable]], Stages]:
    cfg = tomllib.loads(args.config.read_text())
    ro = cfg["rollout"]
    job = Job(ro["prompts_per_step"], ro["group_size"])
    meas = measured(args.source, ro.get("precision", "int8"))
    cap = args.cap or 8 * ro["max_new_tokens"]
    logn, mu = lognormal(meas["completion_len"], args.sigma, cap)
    scenarios = []
    if args.lengths_from:
        hist, source = read_lengths(args.lengths_from)
        total = sum(hist.values())
        scenarios.append(("measured", {"source": source,
                                       "completions": total, "mean": sum(k * v for k, v in hist.items()) / total,
                                       "max": max(hist), "histogram": hist}, empirical(hist)))
    else:
        capped, mu24 = lognormal(meas["completion_len"], args.sigma, ro["max_new_tokens"])
        scenarios.append(("lognormal_capped", {"source": f"lognormal, sigma {args.sigma}, capped at max_new_tokens "
                                               f"{ro['max_new_tokens']}, capped mean = the measured mean",
                                               "mu": mu24, "sigma": args.sigma, "cap": ro["max_new_tokens"]}, capped))
    scenarios.append(("long_tail", {"source": f"lognormal, sigma {args.sigma}, capped at {cap} tokens, capped mean = "
                                    "the measured mean", "mu": mu, "sigma": args.sigma, "cap": cap}, logn))
    actors_measured = ro.get("num_actors", 1)
    rows = -(-job.prompts_per_step // actors_measured) * job.group_size
    longest = expected_longest(scenarios[0][2], rows, args.seed)
    token_s = meas["generate_s"] / (rows * longest)
    st = Stages(token_s, meas["reference_s"], meas["learn_s"], meas["export_s"], meas["sync_s"] - meas["export_s"],
                rows, args.row_share)
    for _, info, draw in scenarios:
        rng = random.Random(args.seed)
        sample = [draw(rng) for _ in range(20000)]
        info["sampled_mean"] = statistics.fmean(sample)
        info["expected_longest_of_batch"] = expected_longest(draw, rows, args.seed)
    record = {
        "stage_times": meas,
        "config": {"file": str(args.config.relative_to(ROOT)) if args.config.is_relative_to(ROOT) else args.config.name,
                   "prompts_per_step": job.prompts_per_step, "group_size": job.group_size,
                   "max_new_tokens": ro["max_new_tokens"], "num_actors": actors_measured,
                   "precision": ro.get("precision", "int8")},
        "calibration": {"batch_rows": rows, "expected_longest": longest, "token_s": token_s,
                        "from": "generate_s / (batch_rows x the expected longest completion of a batch under "
                                f"'{scenarios[0][0]}')"},
        "stages": asdict(st),
        "lengths": {name: info for name, info, _ in scenarios},
    }
    return record, job, scenarios, st


# --- report ----------------------------------------------------------------------------------------------------------

def table(result: dict) -> str:
    out = []
    inp = result["inputs"]
    t = inp["stage_times"]
    out.append(f"async_sim: projections from a model, not measurements; stage times from {t['file']} "
               f"({', '.join(t['runs'])}): generate {t['generate_s']:.2f} s, reference {t['reference_s']:.2f} s, "
               f"learn {t['learn_s']:.2f} s, sync {t['sync_s']:.2f} s (export {t['export_s']:.2f} s) per step")
    c = inp["config"]
    out.append(f"job: {c['file']}, {c['prompts_per_step']} prompts x {c['group_size']} completions, "
               f"max_new_tokens {c['max_new_tokens']}; token_s {inp['calibration']['token_s'] * 1e3:.3f} ms per row "
               f"per decode step; row share {inp['stages']['row_share']}")
    ck = result["check"]
    out.append(f"check: sync at {c['num_actors']} actor(s), first lengths below: "
               f"{ck['simulated_s_per_step']:.1f} s/step against {ck['measured_s_per_step']:.1f} s measured")
    for name, rows in result["scenarios"].items():
        lg = inp["lengths"][name]
        out += ["", f"{name}: {lg['source']}; mean {lg['sampled_mean']:.1f}, expected longest of a "
                    f"{inp['calibration']['batch_rows']}-row batch {lg['expected_longest_of_batch']:.1f}"]
        out.append(f"{'mode':<13} {'actors':>6} {'s/step':>7} {'steps/h':>8} {'learner':>8} {'wait s':>7} "
                   f"{'actor busy':>10} {'stale mean':>10} {'max':>4} {'discarded':>9}")
        for r in rows:
            out.append(f"{r['mode']:<13} {r['actors']:>6} {r['s_per_step']:>7.1f} {r['steps_per_hour']:>8.1f} "
                       f"{r['learner_utilisation']:>8.0%} {r['learner_wait_s']:>7.1f} {r['actor_busy']:>10.0%} "
                       f"{r['staleness_mean']:>10.2f} {r['staleness_max']:>4} {r['discarded_frac']:>9.1%}")
    return "\n".join(out)


def shown(arg: str) -> str:
    """A path as the published record names it: relative to the repository, or RUN_DIR for a run made elsewhere."""
    path = Path(arg).resolve()
    if not (Path(arg).exists() and ("/" in arg or path.is_dir())):
        return arg
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else "RUN_DIR"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, default=SOURCE, help="published default-job stage times")
    ap.add_argument("--config", type=Path, default=CONFIG, help="the job: prompts_per_step, group_size, ...")
    ap.add_argument("--lengths-from", type=Path, default=None,
                    help="a run directory, its rollouts/ folder or one Parquet file (num_tokens), or a published "
                         "async_sim JSON (its histogram)")
    ap.add_argument("--sigma", type=float, default=1.0, help="the lognormal's sigma")
    ap.add_argument("--cap", type=int, default=0, help="the long tail's cap in tokens (default 8 x max_new_tokens)")
    ap.add_argument("--row-share", type=float, default=1.0, help="part of a decode step that grows with the rows")
    ap.add_argument("--chunk-groups", type=int, default=0, help="async: groups per chunk (default: sync's split)")
    ap.add_argument("--actors", type=int, nargs="+", default=list(ACTORS))
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--publish", action="store_true", help="also write bench/published/async_sim.{json,txt}")
    args = ap.parse_args(argv)
    record, job, scenarios, st = inputs(args)
    results = {}
    for name, _, draw in scenarios:
        results[name] = [simulate(st, job, Lengths(draw, job.group_size, args.seed), mode, a, args.steps,
                                  args.warmup, args.chunk_groups) for mode in args.modes for a in args.actors]
    n = record["config"]["num_actors"]
    check = simulate(st, job, Lengths(scenarios[0][2], job.group_size, args.seed), "sync", n, args.steps, args.warmup)
    argv = [shown(a) for a in (sys.argv[1:] if argv is None else argv)]
    result = {
        "command": " ".join([".venv/bin/python bench/async_sim.py", *argv]),
        "machine": MACHINE,
        "argv": argv,
        "what": "projections from a model (bench/async_sim.py), not measurements",
        "inputs": record,
        "args": {k: shown(str(v)) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "publish"},
        "check": {"measured_s_per_step": record["stage_times"]["s_per_step"],
                  "simulated_s_per_step": check["s_per_step"], "actors": n},
        "scenarios": results,
    }
    text = table(result)
    print(text)
    out = ROOT / "bench" / "results" / "async_sim.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if args.publish:
        pub = ROOT / "bench" / "published"
        (pub / "async_sim.json").write_text(json.dumps(result, indent=1) + "\n")
        (pub / "async_sim.txt").write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
