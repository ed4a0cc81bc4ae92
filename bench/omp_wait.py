"""What OpenMP's wait policy costs the torch generator's decode step on a CPU, alone and beside a learner.

A decode step at few rows is hundreds of short parallel regions (each quantized product, each attention product and
softmax). Between two of them the main thread runs Python for tens of microseconds. With `OMP_WAIT_POLICY=PASSIVE`
(what the actors had: spinning threads slowed the other actors of a shared machine) the worker threads go to sleep
at the end of every region and each next region waits for them to wake. A bounded spin (`GOMP_SPINCOUNT`, the wait
policy unset) keeps them awake across those gaps and lets them sleep soon after.

Each variant is an environment for fresh processes (libgomp reads it once, at load), timed in turns (round 1: every
variant, round 2: every variant, ...), so that the machine's drift falls on all of them alike:

- `alone`: the decode step of `--model` (random weights, `--precision`) at each of `--rows`, a 256-token prompt;
- `shared` (`--shared`): the same decode process and a learner-like process at once (a SmolLM2-135M-shaped model's
  forward, backward and SGD step on 2 x 64 tokens), both with the variant's environment and `--threads` threads;
  the decode step and the learner's steps per second, against the learner alone.

    .venv/bin/python bench/omp_wait.py --model Qwen2.5-0.5B --precision int8+head --rows 1 8 --shared \
        --waits passive spin:2000 spin:20000 spin:200000

`rollout.cpu_wait = "spin"` is `spin:2000` (core/cpu.py SPIN_COUNT).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name: the environment a variant's processes start with (on top of the thread counts)
WAITS = {"passive": {"OMP_WAIT_POLICY": "PASSIVE"},
         "active": {"OMP_WAIT_POLICY": "ACTIVE"}}


def wait_env(name: str) -> dict[str, str]:
    """`passive`, `active`, or `spin:N` (GOMP_SPINCOUNT=N, which libgomp obeys over the wait policy)."""
    if name.startswith("spin:"):
        return {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": str(int(name[5:]))}
    if name not in WAITS:
        raise SystemExit(f"--waits: {name!r} is not passive, active or spin:N")
    return dict(WAITS[name])


def child_env(wait: str, threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return {**env, **wait_env(wait), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false"}


def decode_child(args) -> dict:
    """The decode step's wall time (ms) at each of args.rows: the static decoder's steps after one prompt's prefill."""
    import tempfile

    import torch

    from bench.gpu_speed import load_tokenizer, never_stop
    from bench.model_ladder import build_model, prompts_of
    from qgrpo.rollout.backends.torch_backend import TorchGenerator

    format_, _, extra = args.precision.partition("+")
    tok = load_tokenizer(args.tokenizer)[0]
    out = {}
    with tempfile.TemporaryDirectory(prefix="omp_wait_") as folder:
        tok.save_pretrained(folder)
        gen = TorchGenerator(folder, precision=format_, device="cpu", model=build_model(args.model, tok, "cpu"),
                             chat_template=False, options={"quantize_head": extra == "head"})
        never_stop(gen)
        d = gen.decoder
        if d is None:
            raise SystemExit(f"{args.model}: no static decoder")
        _, ids, attn = gen._encode(prompts_of(tok, 1, args.context))
        with torch.inference_mode():
            cache = gen._prefill(ids, attn).past_key_values
            for rows in args.rows:
                d.start(cache, attn, rows, args.steps + 8)
                tokens = torch.zeros(rows, dtype=torch.long)
                for _ in range(3):
                    d.step(tokens)
                times = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    d.step(tokens)
                    times.append(time.perf_counter() - t0)
                out[str(rows)] = {"step_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3}
    return out


def learner_child(args) -> dict:
    """A learner's kind of work until the file args.stop_file exists (or args.learn_s pass): forward, backward and an
    SGD step of a SmolLM2-135M-shaped model in float32 on 2 x 64 tokens. Steps per second."""
    import torch

    from bench.model_shapes import build_config

    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(build_config("SmolLM2-135M"), dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    ids = torch.randint(0, 49152, (2, 64))
    model(input_ids=ids, labels=ids).loss.backward()  # warm
    Path(args.ready_file).touch() if args.ready_file else None
    steps, t0 = 0, time.perf_counter()
    while not (args.stop_file and os.path.exists(args.stop_file)) and time.perf_counter() - t0 < args.learn_s:
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        steps += 1
    return {"steps": steps, "steps_per_s": steps / (time.perf_counter() - t0)}


def spawn(args, role: str, wait: str, extra: list[str]) -> subprocess.Popen:
    argv = [sys.executable, __file__, "--child", role, "--model", args.model, "--precision", args.precision,
            "--rows", *map(str, args.rows), "--steps", str(args.steps), "--context", str(args.context),
            "--tokenizer", args.tokenizer, "--learn-s", str(args.learn_s), *extra]
    return subprocess.Popen(argv, env=child_env(wait, args.threads), stdout=subprocess.PIPE, text=True,
                            cwd=str(ROOT))


def result(p: subprocess.Popen) -> dict:
    out, _ = p.communicate()
    if p.returncode:
        raise RuntimeError(f"child exited {p.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def shared(args, wait: str, tmp: Path) -> dict:
    """Decode and learner processes at once: the learner starts first and runs until the decode process is done."""
    ready, stop = tmp / f"ready_{wait}", tmp / f"stop_{wait}"
    for f in (ready, stop):
        f.unlink(missing_ok=True)
    learner = spawn(args, "learner", wait, ["--ready-file", str(ready), "--stop-file", str(stop),
                                                "--learn-s", "3600"])
    while not ready.exists():
        if learner.poll() is not None:
            raise RuntimeError("the learner process ended before it was ready")
        time.sleep(0.2)
    decode = spawn(args, "decode", wait, [])
    d = result(decode)
    stop.touch()
    return {"decode": d, "learner": result(learner)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen2.5-0.5B")
    ap.add_argument("--precision", default="int8+head", help="a torch precision; +head quantizes the tied head")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=24, help="timed decode steps per rows")
    ap.add_argument("--waits", nargs="+", default=["passive", "spin:2000", "spin:20000"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shared", action="store_true", help="also time decode beside a learner-like process")
    ap.add_argument("--learn-s", type=float, default=30.0, help="the learner alone runs this long")
    ap.add_argument("--tokenizer", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--out", default=str(ROOT / "bench/results/omp_wait.json"))
    ap.add_argument("--child", choices=["decode", "learner"], help=argparse.SUPPRESS)
    ap.add_argument("--ready-file", help=argparse.SUPPRESS)
    ap.add_argument("--stop-file", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(decode_child(args) if args.child == "decode" else learner_child(args)), flush=True)
        return {}
    for w in args.waits:
        wait_env(w)
    import platform
    import tempfile

    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    res = {"command": ".venv/bin/python bench/omp_wait.py " + shlex.join(sys.argv[1:] if argv is None else argv),
           "machine": f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}",
           "args": vars(args), "runs": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="omp_wait_") as tmp:
        for r in range(args.rounds):
            for w in args.waits:
                run = {"round": r, "wait": w, "env": wait_env(w), "alone": result(spawn(args, "decode", w, []))}
                if args.shared:
                    run["learner_alone"] = result(spawn(args, "learner", w, []))
                    run["shared"] = shared(args, w, Path(tmp))
                res["runs"].append(run)
                print(json.dumps(run), flush=True)
                out.write_text(json.dumps(res, indent=2) + "\n")
    res["summary"] = summary(res, args)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(table(res["summary"]))
    return res


def summary(res: dict, args) -> list[dict]:
    """Per wait: medians over rounds of the decode step (alone, shared) per rows and of the learner's steps/s."""
    rows = []
    for w in args.waits:
        runs = [x for x in res["runs"] if x["wait"] == w]
        s = {"wait": w}
        for n in map(str, args.rows):
            s[f"alone_ms_{n}"] = statistics.median(x["alone"][n]["step_ms"] for x in runs)
            if args.shared:
                s[f"shared_ms_{n}"] = statistics.median(x["shared"]["decode"][n]["step_ms"] for x in runs)
        if args.shared:
            s["learner_alone_per_s"] = statistics.median(x["learner_alone"]["steps_per_s"] for x in runs)
            s["learner_shared_per_s"] = statistics.median(x["shared"]["learner"]["steps_per_s"] for x in runs)
        rows.append(s)
    return rows


def table(rows: list[dict]) -> str:
    keys = [k for k in rows[0] if k != "wait"]
    lines = ["| wait | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for s in rows:
        lines.append(f"| {s['wait']} | " + " | ".join(f"{s[k]:.2f}" for k in keys) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
