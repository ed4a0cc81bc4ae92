"""Weight sync by transport, side by side in one run, on the real SmolLM2-135M-Instruct (bf16, ~270 MB of weights):
`sync.transport = object_store` (learner rank 0 puts the packed buckets into Ray's object store, each rollout actor
reads them) vs `collective` (rank 0 broadcasts them over a gloo group of its own, actors/collective.py).

The sender is a plain Ray actor holding the model's bf16 weights that streams `model.named_parameters()` through the
same pack / transport code as LearnerActor.publish_weights (same probe log-probs too), not a DeepSpeed learner: the
learner's own export is not what is compared here. The receivers are real RolloutActors (torch backend), 1 and 2 of
them, at bf16 and int8; every sync ends with their fingerprint check, as in a run. Per configuration: one untimed
sync per transport (for collective it forms the group: timed and shown apart), then `--repeats` syncs per transport,
alternating, median reported. Columns (seconds):

    send     the sender's publish: pack + ray.put (object_store) or pack + broadcast (collective); excludes the
             probe forward, which both transports do alike
    receive  slowest receiver: ray.get of the buckets (zero-copy on one node) / manifest arrival to last bucket
    load     slowest receiver: `gen.load_weights` (strict check, re-quantization)
    total    the whole sync as the driver sees it (both probes and the fingerprint checks included)

With --adapters it compares instead what a sync of a learner.mode = "lora" learner sends (default [learner.lora]:
rank 16, alpha 32, every linear layer; adapters random and non-zero): the merged model W + (alpha/r) B A
(learner/adapters.py: merged_weights, the default) vs the adapters alone (sync.adapters_only: adapter_weights), over
the object store to 1 rollout actor: torch at int8 and int4, vLLM at int8 (Linux). Columns: MB sent; export (the
sender's merge or adapter gather + pack + ray.put), receive, load (re-quantization, or wrapping / copying the
adapters, or writing vLLM's peft folder, plus the fingerprint check), total; median of --repeats after one untimed
sync per path (the adapters' first wraps the layers).

    .venv/bin/python bench/weight_transport.py --adapters --model builtin:tiny-digits --out /tmp/adapters.json

The share of a step uses --step-s (default: the README's default-job figure, "seed 0, ~20 s per step").

    .venv/bin/python bench/weight_transport.py [--cache-dir DIR] [--repeats N] [--step-s S] [--bucket-mb MB] \\
        [--out PATH]
    .venv/bin/python bench/weight_transport.py --model builtin:tiny-digits --repeats 1 --out /tmp/x.json  # smoke test

Prints a table and writes bench/results/weight_transport.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEP_S = 20.0
STEP_SOURCE = "README.md, default job (seed 0): 'Where the time goes (qgrpo report, seed 0, ~20 s per step)'"
CONFIGS = [(1, "bf16"), (1, "int8"), (2, "bf16"), (2, "int8")]  # (rollout actors, precision)
TRANSPORTS = ("object_store", "collective")


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache-dir", default="", help="builtin models' cache (default: $QGRPO_CACHE or ~/.cache/qgrpo)")
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct",
                    help="another model only to smoke-test this script")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step-s", type=float, default=STEP_S, help=f"seconds per default-job step ({STEP_SOURCE})")
    ap.add_argument("--bucket-mb", type=float, default=64.0, help="sync.bucket_mb (the default)")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="sync.timeout_s (the default)")
    ap.add_argument("--adapters", action="store_true",
                    help="compare a LoRA learner's merged sync with sync.adapters_only instead of the transports")
    ap.add_argument("--out", default="")
    return ap.parse_args()


def _sender_class():
    """The Ray actor class of the sender (built here: Ray and torch are imported only once the bench runs)."""
    import ray
    import torch

    from qgrpo.actors.collective import CollectiveMember
    from qgrpo.actors.weights import ObjectStoreTransport

    @ray.remote
    class Sender(CollectiveMember):
        """Learner rank 0's side of a sync without DeepSpeed: bf16 weights, probe log-probs, both transports."""

        def __init__(self, path: str):
            from transformers import AutoModelForCausalLM, AutoTokenizer

            from qgrpo.core.scoring import token_logprobs
            from qgrpo.rollout.backends.common import probe_ids

            torch.set_num_threads(1)
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
            self.probe = probe_ids(AutoTokenizer.from_pretrained(path))
            self.score = lambda: token_logprobs(self.model, torch.tensor([self.probe]))[0, 1:].float().tolist()
            self.send_s = 0.0

        def collective_host(self, timeout_s: float):
            return self._collective().host(timeout_s)

        def publish_weights(self, bucket_bytes: int, transport: str = "object_store"):
            with torch.no_grad():
                logprobs = self.score()
            t0 = time.perf_counter()
            weights = ((n, p.detach().to(torch.bfloat16)) for n, p in self.model.named_parameters())
            if transport == "collective":
                update = self._collective().publish(1, weights, bucket_bytes, self.probe, logprobs)
            else:
                update = ObjectStoreTransport(bucket_bytes).publish(1, weights, probe_ids=self.probe,
                                                                    probe_logprobs=logprobs)
            self.send_s = time.perf_counter() - t0
            return update

        def last_send_seconds(self) -> float:
            return self.send_s

    return Sender


def _lora_sender_class():
    """A learner.mode = "lora" model's side of a sync (no DeepSpeed): merged weights or the adapters alone."""
    import ray
    import torch

    from qgrpo.actors.weights import ObjectStoreTransport

    @ray.remote
    class LoraSender:
        def __init__(self, path: str, lora: dict):
            from transformers import AutoTokenizer

            from qgrpo.core.scoring import token_logprobs
            from qgrpo.learner.adapters import load_model
            from qgrpo.rollout.backends.common import probe_ids

            torch.set_num_threads(1)
            torch.manual_seed(0)
            self.model = load_model(path, "lora", lora=lora).eval()
            with torch.no_grad():  # peft starts B at zero: a trained-looking update instead
                for name, p in self.model.named_parameters():
                    if "lora_B" in name:
                        p.copy_(torch.randn_like(p.float()) * 0.05)
            self.probe = probe_ids(AutoTokenizer.from_pretrained(path))
            self.score = lambda: token_logprobs(self.model, torch.tensor([self.probe]))[0, 1:].float().tolist()

        def publish_weights(self, bucket_bytes: int, adapters_only: bool):
            from qgrpo.learner.adapters import adapter_weights, merged_weights

            with torch.no_grad():
                logprobs = self.score()
            t0 = time.perf_counter()
            weights = adapter_weights(self.model) if adapters_only else merged_weights(self.model)
            update = ObjectStoreTransport(bucket_bytes).publish(1, weights, probe_ids=self.probe,
                                                                probe_logprobs=logprobs,
                                                                kind="adapters" if adapters_only else "full")
            return dataclasses.replace(update, export_seconds=time.perf_counter() - t0)

    return LoraSender


def _adapter_rows(args, path: str, bucket_bytes: int) -> list[dict]:
    """Merged vs adapters-only syncs of a default-rank LoRA model to one torch rollout actor per precision."""
    import dataclasses

    import ray

    from qgrpo.actors.rollout_actor import RolloutActor
    from qgrpo.cluster.config.training import LoraConfig

    lora = dataclasses.asdict(LoraConfig())
    sender, rows = _lora_sender_class().remote(path, lora), []
    engines = [("torch", "int8"), ("torch", "int4")] + ([("vllm", "int8")] if sys.platform == "linux" else [])
    for (backend, precision), adapters_only in [(e, a) for e in engines for a in (False, True)]:
        # An actor per path: adapters are relative to the base, which a merged sync would have replaced. The vLLM
        # engine of the adapters path starts with LoRA support (sync.adapters_only's lora_rank).
        kwargs = dict(model_path=path, precision=precision, generator_id=f"{backend}-{precision}")
        if backend == "vllm" and adapters_only:
            kwargs["lora_rank"] = lora["rank"]
        actor = RolloutActor.remote(backend, kwargs, 1)
        ray.get(actor.info.remote())

        def sync() -> dict:
            t0 = time.perf_counter()
            ref = sender.publish_weights.remote(bucket_bytes, adapters_only)
            update = _wait({ref: "sender"}, args.timeout_s, "publish")[ref]
            ack = ray.get(actor.load_weights.remote(update))
            return {"nbytes": update.nbytes, "export": update.export_seconds, "receive": ack.receive_seconds,
                    "load": ack.seconds, "total": time.perf_counter() - t0, "gap": ack.fingerprint_gap}

        first = sync()
        samples = [sync() for _ in range(args.repeats)]
        med = {k: statistics.median(x[k] for x in samples) for k in ("export", "receive", "load", "total")}
        rows.append({"backend": backend, "precision": precision, "path": "adapters" if adapters_only else "merged",
                     "rank": lora["rank"], "nbytes": first["nbytes"], **{k: round(v, 4) for k, v in med.items()},
                     "first_sync_total": round(first["total"], 4),
                     "fingerprint_gap_max": max(x["gap"] for x in [first, *samples])})
        ray.kill(actor)
    ray.kill(sender)
    return rows


def print_adapter_table(result: dict) -> None:
    """The --adapters table of one run, from its JSON."""
    meta, a = result["meta"], result["meta"]["args"]
    print(f"\nLoRA sync of {Path(meta['model']).name} (learner.mode lora, rank {result['rows'][0]['rank']}, every "
          f"linear layer): merged model vs sync.adapters_only, object store, 1 rollout actor (1 thread), median "
          f"of {a['repeats']}, seconds; torch {meta['torch']}, {meta['cpu_count']} cores, load average "
          f"{meta['load_avg'][0]:.1f} / {meta['load_avg'][1]:.1f}")
    head = ["backend", "precision", "path", "MB sent", "export", "receive", "load", "total", "first", "fp gap"]
    cells = [[r.get("backend", "torch"), r["precision"], r["path"], f"{r['nbytes'] / 2**20:.3f}", f"{r['export']:.4f}",
              f"{r['receive']:.4f}", f"{r['load']:.4f}", f"{r['total']:.4f}", f"{r['first_sync_total']:.4f}",
              f"{r['fingerprint_gap_max']:.4f}"] for r in result["rows"]]
    widths = [max(len(h), *(len(c[k]) for c in cells)) + 2 for k, h in enumerate(head)]
    for cs in [head, *cells]:
        print("".join(f"{c:<{w}}" if k < 3 else f"{c:>{w}}" for k, (c, w) in enumerate(zip(cs, widths))))


def _wait(calls, seconds, stage):
    from qgrpo.cluster.run.supervisor import gather

    return gather(calls, seconds, stage, "--timeout-s")


def _configuration(args, sender, path: str, n: int, precision: str, bucket_bytes: int) -> tuple[list[dict], int]:
    """The rows of one configuration (n rollout actors at `precision`), one per transport, and the bytes a sync
    moves."""
    import ray

    from qgrpo.actors.collective import CollectiveGroup
    from qgrpo.actors.rollout_actor import RolloutActor

    actors = [RolloutActor.remote("torch", dict(model_path=path, precision=precision,
                                                generator_id=f"torch-{precision}-{i}"), 1) for i in range(n)]
    names = [f"torch-{precision}-{i}" for i in range(n)]
    ray.get([sender.last_send_seconds.remote(), *[a.info.remote() for a in actors]])  # start-up not timed
    group = CollectiveGroup(_wait)

    def sync(transport: str) -> dict:
        t0 = time.perf_counter()
        if transport == "collective":
            update, acks = group.sync([sender], actors, names, bucket_bytes, args.timeout_s)
        else:
            ref = sender.publish_weights.remote(bucket_bytes)
            update = _wait({ref: "sender"}, args.timeout_s, "publish")[ref]
            refs = {a.load_weights.remote(update): name for a, name in zip(actors, names)}
            acks = list(_wait(refs, args.timeout_s, "load").values())
        total = time.perf_counter() - t0
        return {"send": ray.get(sender.last_send_seconds.remote()), "nbytes": update.nbytes,
                "receive": max(a.receive_seconds for a in acks), "load": max(a.seconds for a in acks),
                "total": total, "fingerprint_gap_max": max(a.fingerprint_gap for a in acks)}

    first = {t: sync(t) for t in TRANSPORTS}  # warm-up; collective forms its group here
    samples = {t: [] for t in TRANSPORTS}
    for _ in range(args.repeats):
        for t in TRANSPORTS:
            samples[t].append(sync(t))
    rows, nbytes = [], 0
    for t in TRANSPORTS:
        nbytes = samples[t][0]["nbytes"]
        med = {k: statistics.median(s[k] for s in samples[t]) for k in ("send", "receive", "load", "total")}
        rows.append({"actors": n, "precision": precision, "transport": t, **{k: round(v, 3) for k, v in med.items()},
                     "pct_of_step": round(100 * med["total"] / args.step_s, 2),
                     "totals": [round(s["total"], 3) for s in samples[t]],
                     "first_sync_total": round(first[t]["total"], 3),
                     "fingerprint_gap_max": max(s["fingerprint_gap_max"] for s in samples[t])})
    for a in actors:
        ray.kill(a)
    return rows, nbytes


def main() -> None:
    args = _parse()
    out = Path(args.out or ROOT / "bench" / "results" / ("weight_transport_adapters.json" if args.adapters
                                                          else "weight_transport.json"))
    args.out, started, t_start = str(out), datetime.datetime.now().isoformat(timespec="seconds"), time.perf_counter()
    load_start = os.getloadavg()[0]

    import ray
    import torch

    from qgrpo.actors.common import thread_env
    from qgrpo.rollout.modeling.models import resolve_model_path

    path = resolve_model_path(args.model, args.cache_dir)
    bucket_bytes = int(args.bucket_mb * 2**20)
    env = {"env_vars": {**thread_env(1), "PYTHONPATH": str(ROOT)}}
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env=env)
    rows, nbytes = [], 0
    try:
        if args.adapters:
            rows = _adapter_rows(args, path, bucket_bytes)
        else:
            sender = _sender_class().remote(path)
            for n, precision in CONFIGS:
                more, nbytes = _configuration(args, sender, path, n, precision, bucket_bytes)
                rows += more
            ray.kill(sender)
    finally:
        ray.shutdown()
    result = {"meta": {"date": started, "torch": torch.__version__, "ray": ray.__version__,
                       "cpu_count": os.cpu_count(), "model": path, "nbytes": nbytes, "args": vars(args),
                       "step_source": STEP_SOURCE,
                       "sender": "plain Ray actor streaming model.named_parameters() in bf16 through the same pack / "
                                 "transport code (not DeepSpeed)",
                       "load_avg": [load_start, os.getloadavg()[0]],
                       "total_s": round(time.perf_counter() - t_start, 1)},
              "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")  # before the table: a table bug must not lose the run
    (print_adapter_table if args.adapters else print_table)(result)
    print(f"\nwrote {out}")


def print_table(result: dict) -> None:
    """The table of one run, from its JSON (`print_table(json.load(open(path)))` re-prints a saved run)."""
    meta = result["meta"]
    a = meta["args"]
    print(f"\nWeight sync of {Path(meta['model']).name} ({meta['nbytes'] / 2**20:.0f} MB bf16, buckets of "
          f"{a['bucket_mb']:g} MB), torch rollout actors (1 thread each), median of {a['repeats']}, seconds; torch "
          f"{meta['torch']}, ray {meta['ray']}, {meta['cpu_count']} cores")
    print(f"sender: {meta['sender']}")
    print(f"step: {a['step_s']:g} s from {meta['step_source']}")
    print(f"first: the untimed warm-up sync (collective: includes forming the group); load average at start / end: "
          f"{meta['load_avg'][0]:.1f} / {meta['load_avg'][1]:.1f} (other jobs share the machine)")
    head = ["actors", "precision", "transport", "send", "receive", "load", "total", "% of step", "totals",
            "first"]
    cells = [[str(r["actors"]), r["precision"], r["transport"], f"{r['send']:.2f}", f"{r['receive']:.2f}",
              f"{r['load']:.2f}", f"{r['total']:.2f}", f"{r['pct_of_step']:.1f}%",
              "/".join(f"{x:.2f}" for x in r["totals"]), f"{r['first_sync_total']:.2f}"] for r in result["rows"]]
    widths = [max(len(h), *(len(c[k]) for c in cells)) + 2 for k, h in enumerate(head)]

    def line(cs):
        return "".join(f"{c:<{w}}" if k < 3 else f"{c:>{w}}" for k, (c, w) in enumerate(zip(cs, widths)))

    print("\n" + line(head))
    for c in cells:
        print(line(c))
    print(f"\nbench took {meta['total_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
