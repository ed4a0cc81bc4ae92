"""The timings behind `model.compute_dtype = "auto"` (cluster/run/compute_auto.py decides from them): each CPU role's
own work on batches of the run's shape, in a child process started as the role's actor is.

- learner: `Learner.train_step` (DeepSpeed and the optimizer included) on one micro-batch of the run's groups, or as
  many groups as fit in BUDGET_S, and on half of it: a fixed part per call and a part per group;
- reference: the reference scorer at reference.precision on the same batches;
- rollout: the torch generator at the run's rollout precision (bf16 where that is "auto") on one actor's prompts x
  group_size rows, sampling SHORT_TOKENS and LONG_TOKENS tokens a row: its prefill and one decode step.

A call's time grows slower than its size at few rows, so the larger size is the run's own wherever the budget allows.
`in_child` runs the jobs in a fresh Python process with the given OpenMP wait and thread count (an actor's
environment, which the driver's process does not have) and a one-rank gloo group for the learner, so the driver holds
no model; a job that fails there comes back as a Timing with its error.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

SHORT_TOKENS, LONG_TOKENS = 2, 10  # the generator's two calls: tokens sampled per row
BUDGET_S = 20.0  # the longest call a learner or reference measurement makes at the larger size (_fit)


@dataclass
class Timing:
    """One role in one precision: `fixed` seconds per call plus `per_unit` seconds per group (learner, reference) or
    per decode step (rollout, where `fixed` is the prefill of its rows); `error`: why it could not run."""

    dtype: str
    fixed: float = 0.0
    per_unit: float = 0.0
    cached: bool = False
    error: str = ""

    def seconds(self, units: float, calls: int = 1) -> float:
        return calls * self.fixed + units * self.per_unit

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Shape:
    """The probes' batches: groups of `group` completions of `completion` tokens after a `prompt`-token prompt;
    the generator's rows are `prompts` (one actor's share of a step) x `group`."""

    prompt: int
    completion: int
    group: int
    prompts: int
    shared: bool  # the learner and the reference run each group's prompt once (single-turn runs)


def shape_of(cfg, prompt_tokens: int) -> Shape:
    """The probes' batches for a run of `cfg` whose first prompt is `prompt_tokens` long."""
    from qgrpo.cluster.config.machine import expected_completion

    ro = cfg.rollout
    completion, turns = expected_completion(cfg)
    return Shape(prompt=max(int(prompt_tokens), 1), completion=max(int(round(completion)), 1), group=ro.group_size,
                 prompts=math.ceil(ro.prompts_per_step / ro.num_actors),
                 shared=cfg.learner.shared_prompt and turns == 1)


def _tokens(shape: Shape, groups: int, vocab: int):
    """A batch of `groups` groups as the learner gets it: (input_ids, prompt_lens, group_ids, seq_lens)."""
    import torch

    g = torch.Generator().manual_seed(0)
    rows = groups * shape.group
    length = shape.prompt + shape.completion
    ids = torch.randint(10, max(vocab - 10, 11), (rows, length), generator=g)
    for i in range(groups):
        ids[i * shape.group:(i + 1) * shape.group, :shape.prompt] = ids[i * shape.group, :shape.prompt]
    prompt_lens = torch.full((rows,), shape.prompt)
    group_ids = torch.arange(groups).repeat_interleave(shape.group)
    return ids, prompt_lens, group_ids, torch.full((rows,), length)


def _fit(call, most: int, budget_s: float) -> tuple[float, float]:
    """(fixed, per unit) seconds of `call(n)`: a warm-up call at one unit, then one call at each of two sizes, the
    larger `most` units (the run's own, say a micro-batch's groups), or as many as the warm-up says fit in
    `budget_s`; the smaller half of it. A call's time grows slower than its size at few rows (the products run
    below their rate), so the larger size is the run's own wherever the budget allows."""
    t0 = time.perf_counter()
    call(1)
    warm = time.perf_counter() - t0
    big = max(2, min(most, int(budget_s / max(warm, 1e-3))))
    small = max(1, big // 2)
    best = {}
    for n in (small, big):
        t0 = time.perf_counter()
        call(n)
        best[n] = time.perf_counter() - t0
    per = max((best[big] - best[small]) / (big - small), 0.0)
    return max(best[small] - small * per, 0.0), per


def _micro_groups(cfg, role: str) -> int:
    """The groups of one of the run's micro-batches for `role` (the learner's per rank; the reference's
    MICRO_BATCH rows)."""
    from qgrpo.rollout.backends.reference import MICRO_BATCH

    ro, le = cfg.rollout, cfg.learner
    rows = math.ceil(ro.prompts_per_step * ro.group_size / le.world_size) if role == "learner" \
        else ro.prompts_per_step * ro.group_size
    rows = min(rows, le.micro_batch_per_rank if role == "learner" else MICRO_BATCH)
    return max(1, math.ceil(rows / ro.group_size))


def time_learner(cfg, model_path: str, dtype: str, shape: Shape, vocab: int) -> Timing:
    """The learner's own step (learner/engine.py: Learner.train_step, DeepSpeed and the optimizer included) on a
    batch of groups of the run's shape, one micro-batch a call."""
    import torch

    from qgrpo.cluster.run.learners import learner_settings
    from qgrpo.learner.batch import TrainBatch
    from qgrpo.learner.engine import Learner

    most = _micro_groups(cfg, "learner")
    settings = learner_settings(cfg)
    settings = dataclasses.replace(settings, compute_dtype=dtype, world_size=1, zero_stage=0,
                                   micro_batch_per_rank=most * shape.group, sequences_per_rank=most * shape.group,
                                   objective=dataclasses.replace(settings.objective, updates_per_batch=1),
                                   guard=False)
    learner = Learner(model_path, settings, device="cpu")

    def call(groups: int) -> None:
        ids, prompt_lens, group_ids, seq_lens = _tokens(shape, groups, vocab)
        rows = ids.shape[0]
        mask = torch.zeros(ids.shape)
        mask[:, shape.prompt:] = 1
        learner.micro_batch = rows
        batch = TrainBatch(input_ids=ids, completion_mask=mask, mu_logp=-2.0 * mask,
                           advantages=torch.linspace(-1, 1, rows), policy_versions=torch.zeros(rows, dtype=torch.long),
                           ref_logp=-2.0 * mask, total_sequences=rows, total_tokens=float(mask.sum()),
                           max_new_tokens=shape.completion,
                           **({"prompt_lens": prompt_lens, "group_ids": group_ids, "seq_lens": seq_lens}
                              if shape.shared else {}))
        learner.train_step(batch)

    fixed, per = _fit(call, most, BUDGET_S)
    return Timing(dtype, fixed, per)


def time_reference(cfg, model_path: str, dtype: str, shape: Shape, vocab: int) -> Timing:
    """The reference scorer (rollout/backends/reference.py) at reference.precision on groups of the run's shape."""
    from qgrpo.rollout.backends.reference import ReferenceScorer

    most = _micro_groups(cfg, "reference")
    scorer = ReferenceScorer(model_path, cfg.reference.precision, cfg.rollout.group_size_quant,
                             micro_batch=most * shape.group, device="cpu", compute_dtype=dtype)

    def call(groups: int) -> None:
        ids, prompt_lens, group_ids, seq_lens = _tokens(shape, groups, vocab)
        if shape.shared:
            scorer.score(ids, cfg.rollout.temperature, prompt_lens, group_ids, seq_lens)
        else:
            scorer.score(ids, cfg.rollout.temperature)

    fixed, per = _fit(call, most, BUDGET_S)
    return Timing(dtype, fixed, per)


def time_rollout(cfg, model_path: str, dtype: str, shape: Shape, vocab: int) -> Timing:
    """The torch generator as a rollout actor builds it, on one actor's prompts x group_size rows: the prefill (the
    fixed part) and one decode step, from calls sampling SHORT_TOKENS and LONG_TOKENS tokens a row."""
    from qgrpo.cluster.run.precision_auto import trial_items
    from qgrpo.cluster.run.workers import generator_kwargs
    from qgrpo.core.records import SamplingParams
    from qgrpo.rollout.backends import AUTO, make_generator

    ro = cfg.rollout
    precision = "bf16" if ro.precision == AUTO else ro.precision
    probe = dataclasses.replace(cfg, rollout=dataclasses.replace(ro, compute_dtype=dtype))
    items = trial_items(cfg, shape.prompts)
    gen = make_generator(ro.backend, **generator_kwargs(probe, model_path, precision, f"compute-{dtype}", 0))
    steps: dict[int, int] = {}

    def call(tokens: int) -> int:
        t0 = time.perf_counter()
        groups = gen.generate(items, SamplingParams(shape.group, tokens, temperature=ro.temperature,
                                                    seed=cfg.run.seed))
        steps[tokens] = max(len(c.token_ids) for g in groups for c in g.completions)
        return time.perf_counter() - t0

    try:
        call(SHORT_TOKENS)  # warm-up
        short = min(call(SHORT_TOKENS) for _ in range(2))
        long = min(call(LONG_TOKENS) for _ in range(2))
    finally:
        gen.close()
    per = max((long - short) / max(steps[LONG_TOKENS] - steps[SHORT_TOKENS], 1), 0.0)
    return Timing(dtype, max(short - steps[SHORT_TOKENS] * per, 0.0), per)


TIMERS = {"learner": time_learner, "reference": time_reference, "rollout": time_rollout}


def in_child(cfg, model_path: str, shape: Shape, vocab: int, wait: str, jobs: list[tuple[str, str, int]]
              ) -> list[Timing]:
    """`jobs` ((role, dtype, threads)) measured in a fresh Python process started with `wait`'s OpenMP environment
    and a one-rank gloo group for the learner; a job that fails there, or a child that dies, gives Timings with the
    error."""
    import os
    import pickle
    import socket
    import subprocess
    import sys
    import tempfile

    from qgrpo.actors.common import thread_env

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, **thread_env(max(n for _, _, n in jobs), wait), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    with tempfile.TemporaryDirectory(prefix="qgrpo-compute-") as tmp:
        given, taken = Path(tmp) / "jobs.pkl", Path(tmp) / "timings.pkl"
        given.write_bytes(pickle.dumps((cfg, model_path, shape, vocab, jobs)))
        code = f"import sys; from {__name__} import _child; _child(sys.argv[1], sys.argv[2])"
        done = subprocess.run([sys.executable, "-c", code, str(given), str(taken)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if taken.is_file():
            return [Timing(**t) for t in pickle.loads(taken.read_bytes())]
    tail = (done.stderr or "").strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
    return [Timing(dtype, error=f"the measuring process failed: {tail[0][:200]}") for _, dtype, _ in jobs]


def _child(given: str, taken: str) -> None:
    """The child's side of in_child: each job timed, its Timing (or error) written back as it comes."""
    import gc
    import pickle

    import torch

    from qgrpo.actors.common import quiet_libraries

    quiet_libraries()
    cfg, model_path, shape, vocab, jobs = pickle.loads(Path(given).read_bytes())
    out = []
    for role, dtype, threads in jobs:
        torch.set_num_threads(threads)
        try:
            t = TIMERS[role](cfg, model_path, dtype, shape, vocab)
        except Exception as e:  # noqa: BLE001 - a precision that cannot run here is left out, with why
            first = (str(e).splitlines() or [""])[0][:160]
            t = Timing(dtype, error=f"{type(e).__name__}: {first}")
        gc.collect()
        out.append(t.to_dict())
        Path(taken).write_bytes(pickle.dumps(out + [Timing(d, error="not reached").to_dict()
                                                    for _, d, _ in jobs[len(out):]]))


__all__ = ["Timing", "Shape", "shape_of", "TIMERS", "in_child", "SHORT_TOKENS", "LONG_TOKENS", "BUDGET_S"]
