"""What several test modules share: small batches and learner snapshots, the weight-sync prompts and the gap between a
generator's log-probs and a model's, a tiny random Llama with the log-prob bounds its quantized forms keep, the
arguments of a small `qgrpo train` run and readers of what it writes, and stand-ins for the driver's collaborators.
Plain functions, classes and constants, no tests; shared fixtures live in tests/conftest.py. Heavy libraries (Ray,
DeepSpeed, transformers) are imported inside the functions that need them, so that importing this module stays light.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from qgrpo.core.records import PromptItem, SamplingParams

if TYPE_CHECKING:
    from qgrpo.learner.batch import TrainBatch

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.toml")

# ------------------------------------------------------------------------------------------------ learner batches


def random_batch(vocab: int, B: int = 16, P: int = 4, L: int = 5) -> TrainBatch:
    """B rows of P prompt tokens and 1..L completion tokens (random ids >= 3, seeded), padded with 0; sampler
    log-probs -2 on every completion token, random advantages, all from policy version 0."""
    from qgrpo.learner.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (B, P + L), generator=g)
    lens = torch.randint(1, L + 1, (B,), generator=g)
    mask = torch.zeros(B, P + L)
    for i, n in enumerate(lens.tolist()):
        mask[i, P:P + n] = 1
        ids[i, P + n:] = 0
    return TrainBatch(input_ids=ids, completion_mask=mask, mu_logp=-2.0 * mask,
                      advantages=torch.randn(B, generator=g), policy_versions=torch.zeros(B, dtype=torch.long),
                      total_sequences=B, total_tokens=float(mask.sum()), max_new_tokens=L)


def group_batch(vocab: int, groups: int = 4, G: int = 4, P: int = 6, L: int = 5) -> TrainBatch:
    """`groups` prompts of P tokens with G completions each (lengths 1..L), as build_train_batch lays them out."""
    from qgrpo.learner.batch import TrainBatch

    b = random_batch(vocab, B=groups * G, P=P, L=L)
    ids = b.input_ids.clone()
    ids[:, :P] = ids[::G, :P].repeat_interleave(G, dim=0)
    return TrainBatch(**{**b.__dict__, "input_ids": ids, "prompt_lens": torch.full((groups * G,), P),
                         "group_ids": torch.arange(groups * G) // G})


def learner_state(learner) -> tuple[dict, dict, int]:
    """A copy of what an optimizer step changes: (weights by name, the optimizer's moments per parameter, the LR
    schedule's position)."""
    weights = {n: p.detach().clone() for n, p in learner.engine.module.named_parameters()}
    moments = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
               for i, s in enumerate(learner.inner_optimizer.state.values())}
    return weights, moments, learner.scheduler.last_epoch


def identical(a: dict, b: dict) -> bool:
    """Whether two (nested) dicts of tensors and plain values are equal bit for bit."""
    return a.keys() == b.keys() and all(
        (torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else (identical(a[k], b[k]) if isinstance(a[k], dict)
                                                                 else a[k] == b[k])) for k in a)


def start_ranks(path: str, world: int, zero_stage: int, ext: str) -> list:
    """`world` learner ranks of the tiny model as Ray actors (one gloo group), set up and ready to train; 16
    sequences in all per step, micro-batches of 4, no KL term, no gradient clipping."""
    import ray

    from qgrpo.actors.learner_actor import start_learners
    from qgrpo.learner.objective.settings import objective_settings
    from qgrpo.learner.settings import LearnerSettings

    settings = LearnerSettings(world_size=world, lr=1e-3, micro_batch_per_rank=4, sequences_per_rank=16 // world,
                               zero_stage=zero_stage, grad_clip=0.0, objective=objective_settings(kl_coeff=0.0))
    actors, setups = start_learners(path, settings, 1, ext)
    ray.get(setups)
    return actors


# ------------------------------------------------------------------------------------------------ weight sync

ITEMS = [PromptItem(f"p{i}", f"{i % 5}+{(3 * i) % 5}=", str(i % 5 + (3 * i) % 5)) for i in range(8)]
SAMPLING = SamplingParams(group_size=4, max_new_tokens=4, temperature=1.0, seed=7)
GREEDY = SamplingParams(group_size=1, max_new_tokens=6, temperature=0.0)


def mean_gap(groups, model) -> float:
    """Mean |log mu - log pi| over the sampled tokens of `groups`: the generator's log-probs against a forward of
    `model` (at SAMPLING's temperature)."""
    from qgrpo.core.scoring import token_logprobs

    rows = [(g.prompt_ids, c) for g in groups for c in g.completions]
    T = max(len(p) + len(c.token_ids) for p, c in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c.token_ids)] = torch.tensor(p + c.token_ids)
    with torch.no_grad():
        ref = token_logprobs(model, ids, SAMPLING.temperature)
    gaps = [(ref[i, len(p):len(p) + len(c.token_ids)] - torch.tensor(c.logprobs)).abs()
            for i, (p, c) in enumerate(rows)]
    return float(torch.cat(gaps).mean())


# ------------------------------------------------------------------------------------------------ quantized layers

# Per-token log-prob error vs an fp32 forward of the same bf16 weights, on `tiny_llama()` (8 x 32 random tokens).
# Measured over seeds 0-4 (mean / max): bf16 0.010-0.012 / 0.04-0.05, int8 0.026-0.028 / 0.09-0.13,
# int4 0.29-0.35 / 0.97-1.67, nf4 0.30-0.34 / 1.0-1.7. Bounds are ~2x the worst seen. 4-bit errors are large
# because this random model has large logits (init std 0.1) and 4 bits at group 64 add ~9% noise per weight.
LOGPROB_BOUNDS = {  # precision: (mean abs diff, max abs diff), in nats
    "bf16": (0.03, 0.15),
    "int8": (0.06, 0.30),
    "int4": (0.60, 3.00),
    "nf4": (0.60, 3.00),
}


def tiny_llama(seed=0, tie=False, intermediate=256):
    """A seeded random bf16 Llama (2 layers, hidden 128, vocab 64) in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=intermediate, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=64, tie_word_embeddings=tie, initializer_range=0.1,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def next_token_logprobs(model, ids) -> torch.Tensor:
    """Log-probs of tokens 1.. of each row of `ids` [B, T] under `model` (temperature 1), [B, T - 1], in float32."""
    with torch.no_grad():
        logits = model(ids).logits.float()
    return logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]


# ------------------------------------------------------------------------------------------------ runs of the CLI


def train_args(model: str, out: Path | str, *extra: str) -> list[str]:
    """`qgrpo train` arguments for a short configs/tiny.toml run of `model` into `out`: 8 prompts x 8 completions a
    step, no evaluation, progress bar or TensorBoard, rollouts flushed every step; `extra` are more --set values."""
    sets = [f"model.path='{model}'", f"run.output_dir='{out}'", "run.progress=false", "run.eval=false",
            "run.tensorboard=false", "rollout.prompts_per_step=8", "rollout.group_size=8", "run.rollouts_flush_every=1",
            *extra]
    return ["train", TINY, *[a for s in sets for a in ("--set", s)]]


def run_dir_in(out: Path) -> Path:
    """The one run directory a run wrote under its output_dir `out`."""
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return run_dir


def read_metrics(run_dir: Path) -> list[dict]:
    """Every record of the run's metrics.jsonl (steps and events), in order."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_metrics(run_dir: Path) -> list[dict]:
    """The run's per-step records (those with reward/mean), in order."""
    return [m for m in read_metrics(run_dir) if "reward/mean" in m]


# The learning smoke's bar (a short run of configs/tiny.toml at lr 1e-2): the mean reward of the last 10 steps is at
# least this far above that of the first 3. Measured over 30 steps on a 2-core AVX2-only EPYC: torch 0.143 -> 0.235,
# vLLM int8 0.150 -> 0.246, MLX int4 0.153 -> 0.238 (the integer format is learnt first, the sums after). The full
# curves (300 steps, last 10 at least 0.3 above the first 10) are in `make test-slow`.
SMOKE_GAIN = 0.05
SMOKE_STEPS = 30  # the smokes' length (tests/conftest.py: torch_smoke_run, and the vLLM and MLX ones)


def reward_moved(run_dir: Path) -> tuple[float, float]:
    """(mean reward of the first 3 steps, of the last 10) of a short run, after checking every step's loss and
    mismatch are finite (NaN never passes), but on the steps the precision guard skipped (an injected NaN)."""
    import math

    rows = step_metrics(run_dir)
    trained = [r for r in rows if not r.get("guard/skipped")]
    assert len(trained) >= len(rows) - 2 and all(
        math.isfinite(r["loss/total"]) and math.isfinite(r["mismatch/kl_mu_old"]) for r in trained)
    return sum(r["reward/mean"] for r in rows[:3]) / 3, sum(r["reward/mean"] for r in rows[-10:]) / 10


# ------------------------------------------------------------------------------------------------ stand-ins


class CountingSampler:
    """The prompt sampler's stand-in: the prompts are the ids 0, 1, 2, ... drawn in order; `cursor` is the next."""

    def __init__(self):
        self.cursor = 0

    def next(self, n):
        items = list(range(self.cursor, self.cursor + n))
        self.cursor += n
        return items


# The CUDA compute capability each torch-generator precision needs: int4 runs torch's tinygemm (Ampere or newer), fp8
# float8 tensor cores (Ada or Hopper); int8 and nf4 run anywhere CUDA does.
MIN_CAPABILITY = {"bf16": (0, 0), "int8": (0, 0), "nf4": (0, 0), "int4": (8, 0), "fp8": (8, 9)}


def skip_below_capability(precision: str) -> None:
    """Skip a `cuda` test when this GPU cannot run `precision` (MIN_CAPABILITY)."""
    import pytest

    cap = torch.cuda.get_device_capability()
    if cap < MIN_CAPABILITY[precision]:
        pytest.skip(f"{precision} on CUDA needs compute capability >= {MIN_CAPABILITY[precision]}, this GPU is {cap}")


def rerun_in_triton_interpreter(test_file: str) -> None:
    """Run `test_file`'s ``*_in_interpreter`` tests in a fresh Python with TRITON_INTERPRET=1 (Triton reads it at its
    first import, so this process cannot switch to it); fail with their output unless all pass and none skip."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "in_interpreter",
                          str(Path(test_file).resolve())], cwd=root, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout.splitlines()[-1], run.stdout[-2000:]


class FakePool:
    """A rollout source (cluster/run/source.py) over a plain function instead of Ray actors: `generate(items,
    sampling, step) -> (groups, stats)` runs in a thread per call; what it raises, `collect` raises. `sent` lists
    (slot, step, items) per call; `owners` the threads that claimed it (RolloutPool.own)."""

    def __init__(self, generate, actors: int = 1):
        from concurrent.futures import ThreadPoolExecutor

        self.generate, self.actors, self.sent, self.owners = generate, [None] * actors, [], []
        self.threads = ThreadPoolExecutor(8, thread_name_prefix="fake-actor")

    def own(self, owner):
        self.owners.append(owner)

    def split(self, items):
        from qgrpo.cluster.run.workers import split_prompts

        return split_prompts(items, len(self.actors))

    def free_slots(self, busy):
        return [s for s in range(len(self.actors)) if s not in busy]

    def submit(self, slot, items, sampling, step, held_out=False):
        import time

        from qgrpo.cluster.run.source import Call

        self.sent.append((slot, step, list(items)))
        future = self.threads.submit(self.generate, items, sampling, step)
        return Call(future, slot, tuple(str(getattr(i, "prompt_id", i)) for i in items), step, time.monotonic(),
                    60.0, held_out)

    def wait(self, calls, timeout):
        from concurrent.futures import FIRST_COMPLETED, wait

        done, _ = wait([c.ref for c in calls], timeout, return_when=FIRST_COMPLETED)
        return [c for c in calls if c.ref in done]

    def collect(self, call):
        from qgrpo.cluster.run.source import ChunkResult

        return ChunkResult(*call.ref.result())

    def overdue(self, calls):
        pass

    def announce(self):
        return []

    def close(self):
        self.threads.shutdown(wait=False)
