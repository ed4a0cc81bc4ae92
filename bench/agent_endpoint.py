"""The OpenAI-compatible endpoint (rollout/endpoint/) against the in-process environment loop (rollout/episodes.py),
on one torch generator in this process (rollout/endpoint/local.py: `serve_local`), side by side in one run.

1. **Per call**: the same prompt token ids (a one-message conversation rendered by the endpoint's chat template) and
   the same max_tokens at T=1, one call at a time, timed as
   - `in-process`: `gen.continue_ids([ids], sampling)`, what the episode loop does per turn;
   - `generate`: POST /inference/v1/generate with those ids (httpx, one kept-alive connection);
   - `chat`: POST /v1/chat/completions with the conversation (httpx), whose rendering is the same ids (checked);
   - `chat (openai SDK)`: the same through the `openai` SDK's synchronous client.
   Each call is a session of its own; the variants take turns within every repetition, so load from other jobs falls
   on all of them alike. Reported: p50 / p99 ms per call and per sampled token, the overhead over `in-process`
   (p50 minus p50, p99 minus p99, and the median of the paired differences), and where an HTTP call's time went:
   `generator` (the generator's `continue_ids`, timed by a wrapper on the generator), `engine` (the endpoint's
   record of the call less that: the Batcher's gather wait and queue, the hop onto the generator's thread and back;
   the Batcher's settings are in the JSON's `batcher`) and `front`
   (what the client saw less the endpoint's record: HTTP, JSON, routing, chat rendering, the response's building).
2. **Concurrent sessions**: N sessions (1, 8, 64), each a conversation of `--turns` chat calls (a user message, the
   answer sent back as returned, a user follow-up, ...) through `openai.AsyncOpenAI`, each session its own base URL
   (`/sessions/SID/v1`), all at once; against `Episodes.run` over the same N first messages and follow-ups (an
   environment that answers each turn with the next follow-up), which samples every live trajectory's turn in one
   `continue_ids` batch. Reported: completion tokens/s and calls/s, the mean batch the endpoint's Batcher formed
   (batched calls / batches), the share of the wall time the generator was busy, and the calls that forked (0: every
   call extended its session's conversation).
3. **Through the run's pool** (bench/agent_pool_path.py; `--no-pool` leaves it out, `--quick` too): the endpoint as
   a run serves it, a Ray EndpointActor calling a RolloutActor through the pool's link with the run's key, against
   that actor's `complete` called directly; per call, and with 1, 8 and 64 concurrent sessions.

By default every call samples exactly its max_tokens (`--natural-stops` leaves the model's stop tokens on): the
generator's stop ids are replaced after the endpoint has taken the real ones, so the endpoint and the episode loop
render, stitch and report as usual while every call costs the same generation and every difference is overhead. The
HTTP clients run in this process, beside the endpoint's event loop and the generator's thread, as `serve_local`'s
callers do (tests, `qgrpo serve --local`); `others cores` is the CPU other jobs used meanwhile, in cores.

    .venv/bin/python bench/agent_endpoint.py                  # 50 calls per variant at 1 and 16 tokens; 1, 8, 64
    .venv/bin/python bench/agent_endpoint.py --publish        # also bench/published/agent_endpoint.{json,txt}
    .venv/bin/python bench/agent_endpoint.py --quick          # a smoke run (tests/test_agent_endpoint_bench.py)

Writes bench/results/agent_endpoint.json (--out) and prints two tables.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import statistics
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from agent_pool_path import PoolPath  # noqa: E402
from agent_pool_path import concurrency as pool_concurrency  # noqa: E402
from agent_pool_path import per_call as pool_per_call  # noqa: E402
from agent_pool_path import tables as pool_tables  # noqa: E402
from calculator_job import machine  # noqa: E402
from sides import busy_seconds, versions  # noqa: E402

NAME = "agent_endpoint"
MODEL = "builtin:smollm2-135m-instruct"
SERVED = "qgrpo-policy"
PROMPT = "Tell me a short story about a cat who learns to count."
FIRST = "Write one sentence about the number {i}."
FOLLOW_UPS = ("Now say the same in other words.", "Thanks. Once more, shorter.", "And once more, as a question.")
PER_CALL_ROUTES = ("in-process", "generate", "chat", "chat (openai SDK)")


# --- measuring ---------------------------------------------------------------------------------------------------

class Timed:
    """The generator's `continue_ids` with each call's batch, seconds and sampled tokens recorded (the endpoint's
    thread and the episode loop both call it on the instance)."""

    def __init__(self, gen):
        self.fn, self.calls = gen.continue_ids, []

    def __call__(self, sequences, sampling):
        t0 = time.perf_counter()
        out = self.fn(sequences, sampling)
        self.calls.append((len(sequences), time.perf_counter() - t0, sum(len(c.token_ids) for c in out)))
        return out


class Load:
    """CPU other jobs used between start and `stop()`, in cores on average (the machine's busy time less this
    process's): bench/sides.py's `others_cores`."""

    def __init__(self):
        import psutil

        self.psutil, self.proc = psutil, psutil.Process()
        self.t0, self.busy0, self.own0 = time.monotonic(), busy_seconds(psutil), self._own()

    def _own(self) -> float:
        t = self.proc.cpu_times()
        return t.user + t.system

    def stop(self) -> float:
        wall = time.monotonic() - self.t0
        others = busy_seconds(self.psutil) - self.busy0 - (self._own() - self.own0)
        return round(max(others, 0.0) / max(wall, 1e-9), 2)


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile, linear between the closest ranks (numpy's default)."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def summary(xs: list[float]) -> dict:
    return {"p50": percentile(xs, 50), "p99": percentile(xs, 99), "mean": statistics.fmean(xs), "min": min(xs),
            "max": max(xs)}


# --- 1. per call ---------------------------------------------------------------------------------------------------

def per_call(ep, gen, timed: Timed, ids: list[int], messages: list[dict], tokens: int, repeats: int,
             warmup: int) -> list[dict]:
    """One call at a time per route, the routes taking turns (rotated) in every repetition."""
    import httpx
    import openai

    from qgrpo.core.records import SamplingParams

    http = httpx.Client(timeout=600)
    sdk = openai.OpenAI(base_url=ep.base_url, api_key="bench", max_retries=0, http_client=httpx.Client(timeout=600))
    book = ep.endpoint.book
    sampling = SamplingParams(1, tokens, temperature=1.0)
    samples: dict[str, list[dict]] = {r: [] for r in PER_CALL_ROUTES}

    def call(route: str, sid: str) -> tuple[int, list[int] | None]:
        """(tokens sampled, the prompt ids the endpoint fed) of one call."""
        head = {"X-Session-ID": sid}
        if route == "in-process":
            return len(gen.continue_ids([ids], sampling)[0].token_ids), None
        if route == "generate":
            r = http.post(f"{ep.address}/inference/v1/generate", headers=head,
                          json={"token_ids": ids, "sampling_params": {"max_tokens": tokens, "temperature": 1.0}})
            r.raise_for_status()
            out = r.json()
        elif route == "chat":
            r = http.post(f"{ep.base_url}/chat/completions", headers=head,
                          json={"model": SERVED, "messages": messages, "max_tokens": tokens, "temperature": 1.0})
            r.raise_for_status()
            out = r.json()
        else:
            out = sdk.chat.completions.create(model=SERVED, messages=messages, max_tokens=tokens, temperature=1.0,
                                              extra_headers=head).model_dump()
        return out["usage"]["completion_tokens"], out["prompt_token_ids"]

    for rep in range(warmup + repeats):
        k = rep % len(PER_CALL_ROUTES)
        for route in PER_CALL_ROUTES[k:] + PER_CALL_ROUTES[:k]:
            sid = f"pc{tokens}-{PER_CALL_ROUTES.index(route)}-{rep}"  # a session per call
            n_gen = len(timed.calls)
            t0 = time.perf_counter()
            n, fed = call(route, sid)
            client = time.perf_counter() - t0
            if fed is not None and fed != ids:
                raise SystemExit(f"{route}: the endpoint fed {len(fed)} prompt ids, not the {len(ids)} compared")
            if len(timed.calls) != n_gen + 1:
                raise SystemExit(f"{route}: {len(timed.calls) - n_gen} generator calls for one call")
            generator = timed.calls[-1][1]
            if route != "in-process" and len(book.get(sid).calls) != 1:
                raise SystemExit(f"{route}: session {sid} holds {len(book.get(sid).calls)} calls, not 1")
            server = book.get(sid).calls[0].seconds if route != "in-process" else generator
            if rep >= warmup:
                samples[route].append({"ms": 1e3 * client, "tokens": n, "server_ms": 1e3 * server,
                                       "generator_ms": 1e3 * generator})
    http.close()
    sdk.close()
    base = samples["in-process"]
    rows = []
    for route, xs in samples.items():
        ms = [x["ms"] for x in xs]
        per_token = [x["ms"] / max(x["tokens"], 1) for x in xs]
        row = {"route": route, "max_tokens": tokens, "calls": len(xs), "tokens_mean": statistics.fmean(
            x["tokens"] for x in xs), "ms": summary(ms), "ms_per_token": summary(per_token),
            "generator_ms": summary([x["generator_ms"] for x in xs])}
        if route != "in-process":
            b = [x["ms"] for x in base]
            row["overhead_ms"] = {"p50": row["ms"]["p50"] - percentile(b, 50),
                                  "p99": row["ms"]["p99"] - percentile(b, 99),
                                  "paired_p50": statistics.median(x["ms"] - y["ms"] for x, y in zip(xs, base)),
                                  "per_token_p50": row["ms_per_token"]["p50"] - percentile(
                                      [y["ms"] / max(y["tokens"], 1) for y in base], 50)}
            row["split_ms"] = {"front": summary([x["ms"] - x["server_ms"] for x in xs]),
                               "engine": summary([x["server_ms"] - x["generator_ms"] for x in xs]),
                               "generator": row["generator_ms"]}
        rows.append(row)
    return rows


# --- 2. concurrent sessions ----------------------------------------------------------------------------------------

class Conversation:
    """The episode loop's environment: each model turn is answered by the next follow-up; done after `turns`."""

    def __init__(self, turns: int):
        self.turns, self.seen = turns, {}

    def reset(self, keys, rows):
        return [[{"role": "user", "content": r["prompt"]}] for r in rows]

    def step(self, keys, texts):
        from qgrpo.rollout.environments.contract import StepResult

        out = []
        for k in keys:
            n = self.seen[k] = self.seen.get(k, 0) + 1
            done = n >= self.turns
            out.append(StepResult([] if done else [{"role": "user", "content": FOLLOW_UPS[(n - 1) % 3]}], done=done))
        return out

    def score(self, keys):
        return [0.0] * len(keys)

    def drop(self, keys):
        for k in keys:
            self.seen.pop(k, None)


def in_process(gen, timed: Timed, stop_ids: list[int], sessions: int, turns: int, tokens: int, key: str) -> dict:
    from qgrpo.core.records import PromptItem, SamplingParams
    from qgrpo.rollout.episodes import EpisodeLimits, Episodes

    loop = Episodes(gen, gen.tokenizer, stop_ids, Conversation(turns), EpisodeLimits(turns, tokens, 4096))
    items = [PromptItem(str(i), FIRST.format(i=i), "") for i in range(sessions)]
    n0, load = len(timed.calls), Load()
    t0 = time.perf_counter()
    groups = loop.run(items, SamplingParams(1, tokens, temperature=1.0), key, 0, "t0", gen.precision)
    wall = time.perf_counter() - t0
    comps = [c for g in groups for c in g.completions]
    model_tokens = sum(c.model_tokens for c in comps)
    calls = sum(sum(t["role"] == "assistant" for t in c.turns) for c in comps)
    gen_calls = timed.calls[n0:]
    return {"wall_s": wall, "completion_tokens": model_tokens, "calls": calls,
            "tokens_per_s": model_tokens / wall, "calls_per_s": calls / wall,
            "batches": len(gen_calls), "mean_batch": sum(b for b, _, _ in gen_calls) / max(len(gen_calls), 1),
            "generator_busy": sum(s for _, s, _ in gen_calls) / wall, "others_cores": load.stop()}


async def _sessions(ep, sessions: int, turns: int, tokens: int, tag: str, api_key: str = "bench") -> tuple[int, int]:
    import httpx
    import openai

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=sessions + 8)) as http:
        async def one(i: int) -> tuple[int, int]:
            client = openai.AsyncOpenAI(base_url=ep.session_url(f"{tag}-{i}"), api_key=api_key, max_retries=0,
                                        http_client=http)
            messages = [{"role": "user", "content": FIRST.format(i=i)}]
            n = 0
            for t in range(turns):
                r = await client.chat.completions.create(model=SERVED, messages=messages, max_tokens=tokens,
                                                         temperature=1.0)
                n += r.usage.completion_tokens
                if t + 1 < turns:
                    messages += [r.choices[0].message.model_dump(exclude_none=True),
                                 {"role": "user", "content": FOLLOW_UPS[t % 3]}]
            return n, turns

        done = await asyncio.gather(*(one(i) for i in range(sessions)))
    return sum(n for n, _ in done), sum(c for _, c in done)


def endpoint(ep, timed: Timed, sessions: int, turns: int, tokens: int, tag: str) -> dict:
    e = ep.endpoint
    b = e.batcher
    b0 = (b.batches, b.batched_calls) if b is not None else (0, 0)
    forks0, n0, load = e.counts["forks"], len(timed.calls), Load()
    t0 = time.perf_counter()
    tokens_out, calls = asyncio.run(_sessions(ep, sessions, turns, tokens, tag))
    wall = time.perf_counter() - t0
    b = e.batcher
    batches, batched = b.batches - b0[0], b.batched_calls - b0[1]
    gen_calls = timed.calls[n0:]
    return {"wall_s": wall, "completion_tokens": tokens_out, "calls": calls, "tokens_per_s": tokens_out / wall,
            "calls_per_s": calls / wall, "batches": batches, "mean_batch": batched / max(batches, 1),
            "generator_busy": sum(s for _, s, _ in gen_calls) / wall, "forks": e.counts["forks"] - forks0,
            "others_cores": load.stop()}


def concurrency(ep, gen, timed: Timed, stop_ids: list[int], sessions: int, turns: int, tokens: int,
                rounds: int) -> dict:
    """`rounds` of (the episode loop, the endpoint), the median round of each kept (by tokens/s)."""
    runs = {"in_process": [], "endpoint": []}
    for r in range(rounds):
        runs["in_process"].append(in_process(gen, timed, stop_ids, sessions, turns, tokens, f"c{sessions}r{r}"))
        runs["endpoint"].append(endpoint(ep, timed, sessions, turns, tokens, f"c{sessions}r{r}"))

    def median(rs: list[dict]) -> dict:
        return sorted(rs, key=lambda x: x["tokens_per_s"])[(len(rs) - 1) // 2]

    a, b = median(runs["in_process"]), median(runs["endpoint"])
    return {"sessions": sessions, "turns": turns, "max_tokens": tokens, "in_process": a, "endpoint": b,
            "endpoint_over_in_process": b["tokens_per_s"] / a["tokens_per_s"], "rounds": runs}


# --- tables --------------------------------------------------------------------------------------------------------

def _md(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def tables(res: dict) -> str:
    f1 = lambda x: f"{x:.1f}"  # noqa: E731
    f2 = lambda x: f"{x:.2f}"  # noqa: E731
    per = []
    for r in res["per_call"]:
        o, s = r.get("overhead_ms"), r.get("split_ms")
        per.append([r["route"], str(r["max_tokens"]), f1(r["tokens_mean"]), f1(r["ms"]["p50"]), f1(r["ms"]["p99"]),
                    f2(r["ms_per_token"]["p50"]), *([f1(o["p50"]), f1(o["p99"]), f1(o["paired_p50"]),
                                                     f2(o["per_token_p50"])] if o else ["-"] * 4),
                    *([f1(s["front"]["p50"]), f1(s["engine"]["p50"])] if s else ["-"] * 2),
                    f1(r["generator_ms"]["p50"])])
    conc = []
    for c in res["concurrency"]:
        a, b = c["in_process"], c["endpoint"]
        conc.append([str(c["sessions"]), str(b["calls"]), f1(a["tokens_per_s"]), f1(b["tokens_per_s"]),
                     f"{c['endpoint_over_in_process']:.2f}", f2(a["calls_per_s"]), f2(b["calls_per_s"]),
                     f"{a['mean_batch']:.1f} / {b['mean_batch']:.1f}", f"{a['batches']} / {b['batches']}",
                     f"{a['generator_busy']:.0%} / {b['generator_busy']:.0%}", str(b["forks"]),
                     f"{a['others_cores']:.2f} / {b['others_cores']:.2f}"])
    a = res["args"]
    lines = [f"machine: {res['machine']}; {res['model']} at {res['precision']}, {res['threads']} torch threads, "
             f"T=1, {'natural stops' if a['natural_stops'] else 'every call samples exactly its max_tokens'}",
             "",
             f"Per call, one at a time ({a['repeats']} calls per route and max_tokens, after {a['warmup']} warm-up; "
             f"prompt {res['prompt_tokens']} tokens; others' cores meanwhile {res['per_call_others_cores']:.2f}):",
             "",
             *_md(["route", "max_tokens", "tokens", "p50 ms", "p99 ms", "ms/token p50", "overhead p50 ms",
                   "overhead p99 ms", "paired overhead ms", "overhead ms/token", "front ms", "engine ms",
                   "generator ms"], per),
             "",
             f"Concurrent sessions, {a['turns']} chat calls each (max_tokens {a['turn_tokens']}), against the episode "
             f"loop on the same conversations (median of {a['rounds']} round(s); pairs are in-process / endpoint):",
             "",
             *_md(["sessions", "calls", "in-process tok/s", "endpoint tok/s", "endpoint / in-process",
                   "in-process calls/s", "endpoint calls/s", "mean batch", "batches", "generator busy", "forks",
                   "others' cores"], conc),
             *pool_tables(res, _md)]
    return "\n".join(lines)


# --- main ----------------------------------------------------------------------------------------------------------

def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--precision", default="int8")
    ap.add_argument("--tokens", default="1,16", help="per call: the max_tokens compared, comma-separated")
    ap.add_argument("--repeats", type=int, default=50, help="per call: calls per route and max_tokens")
    ap.add_argument("--warmup", type=int, default=3, help="per call: repetitions not kept")
    ap.add_argument("--sessions", default="1,8,64", help="concurrent sessions, comma-separated")
    ap.add_argument("--turns", type=int, default=3, help="chat calls per session")
    ap.add_argument("--turn-tokens", type=int, default=16, help="max_tokens of each session's calls")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each session count (the median kept)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--natural-stops", action="store_true",
                    help="leave the model's stop tokens on (calls sample up to max_tokens, not exactly)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 3 calls per route at 2 tokens, 1 and 3 sessions of 2 calls of 2 tokens")
    ap.add_argument("--no-pool", action="store_true", help="leave out the part through the run's pool (Ray)")
    ap.add_argument("--pool-repeats", type=int, default=20, help="through the pool: calls per path and max_tokens")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / f"{NAME}.json"))
    ap.add_argument("--publish", action="store_true", help=f"also write bench/published/{NAME}.{{json,txt}}")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.repeats, args.warmup, args.sessions = "2", 3, 1, "1,3"
        args.turns, args.turn_tokens, args.rounds, args.no_pool = 2, 2, 1, True
    return args


def _versions() -> dict:
    out = versions()
    for p in ("openai", "httpx", "uvicorn", "starlette"):
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = None
    return out


def batcher_settings() -> dict:
    """The endpoint Batcher's limits as this run had them (rollout/endpoint/engine.py)."""
    from qgrpo.rollout.endpoint import engine

    return {k: getattr(engine, k) for k in ("MAX_BATCH", "GATHER_S", "GATHER_MAX_S") if hasattr(engine, k)}


def through_pool(args, path: str, tokens: list[int], sessions: list[int], ids: list[int]) -> dict:
    """Part 3: the endpoint actor over a rollout actor through the pool's link (bench/agent_pool_path.py)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    pp = PoolPath(path, args.precision, args.threads, max(tokens + [args.turn_tokens]), not args.natural_stops)
    try:
        rows = []
        for n in tokens:
            print(f"through the pool: max_tokens {n}, {args.pool_repeats} calls per path", flush=True)
            rows += pool_per_call(pp, ids, n, args.pool_repeats, args.warmup, summary)
        conc = []
        for s in sessions:
            print(f"through the pool: {s} sessions x {args.turns} calls", flush=True)
            conc.append(pool_concurrency(pp, tokenizer, s, args.turns, args.turn_tokens, args.rounds, FIRST,
                                         FOLLOW_UPS, _sessions))
    finally:
        pp.close()
    return {"repeats": args.pool_repeats, "per_call": rows, "concurrency": conc}


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    at_start = _versions()
    import torch

    from qgrpo.rollout.backends import make_generator
    from qgrpo.rollout.endpoint.local import serve_local
    from qgrpo.rollout.modeling.models import resolve_model_path

    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model, None)
    gen = make_generator("torch", model_path=path, precision=args.precision, generator_id="t0", seed=0)
    tokens, sessions = _ints(args.tokens), _ints(args.sessions)
    ep = serve_local([gen], max_tokens=max(tokens + [args.turn_tokens]))
    stop_ids = list(gen.stop_ids)  # the endpoint keeps the real ones (its rendering, its finish reasons)
    if not args.natural_stops:
        gen.stop_ids = [-1]  # no token is -1: every call samples exactly its max_tokens
    timed = gen.continue_ids = Timed(gen)
    try:
        messages = [{"role": "user", "content": PROMPT}]
        ids = ep.endpoint.renderer.prompt(messages, [])
        load = Load()
        rows = []
        for n in tokens:
            print(f"per call: max_tokens {n}, {args.repeats} calls per route", flush=True)
            rows += per_call(ep, gen, timed, ids, messages, n, args.repeats, args.warmup)
        per_call_load = load.stop()
        conc = []
        for s in sessions:
            print(f"concurrency: {s} sessions x {args.turns} calls", flush=True)
            conc.append(concurrency(ep, gen, timed, stop_ids, s, args.turns, args.turn_tokens, args.rounds))
    finally:
        ep.close()
    pool = None if args.no_pool else through_pool(args, path, tokens, sessions, ids)
    argv = sys.argv[1:] if argv is None else argv
    res = {"bench": NAME, "command": shlex.join([".venv/bin/python", f"bench/{NAME}.py", *argv]), "machine": machine(),
           "model": args.model, "model_path": path, "precision": args.precision, "threads": torch.get_num_threads(),
           "args": vars(args), "versions": at_start, "prompt_tokens": len(ids), "fixed_length": not args.natural_stops,
           "batcher": batcher_settings(), "per_call_others_cores": per_call_load, "per_call": rows,
           "concurrency": conc, "pool": pool}
    res["table"] = tables(res)
    print(res["table"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, allow_nan=False) + "\n")
    print(f"wrote {out}")
    if args.publish:
        pub = ROOT / "bench" / "published"
        (pub / f"{NAME}.json").write_text(json.dumps(res, indent=1, allow_nan=False) + "\n")
        (pub / f"{NAME}.txt").write_text(res["table"] + "\n")
        print(f"published bench/published/{NAME}.{{json,txt}}")
    return res


if __name__ == "__main__":
    main()
