"""`model.compute_dtype = "auto"` decided by measurement on the CPU roles of a local run: each role's own work timed at
the run's shapes in each precision this CPU computes natively, the faster one taken per role.

A CPU's flags say which precisions are worth trying, not which is faster: a 2-core Xeon listing AVX512-BF16 without
AMX multiplied bf16 at 148 GFLOP/s against fp32's 256, and the default job's learner took 22.5 s a step in bf16
against 12.8 in fp32, while a 2-core Zen 4 EPYC with the same flag ran the learner 1.5x faster in bf16. So each CPU
role's own work (the learner's train_step, the reference's scoring, the torch generator's prefill and decode step) is
timed as its actor runs it, in a child process (cluster/run/role_timing.py), and the step estimate
(cluster/config/machine.py) scales the timings to the run's micro-batches and decode steps.

The flags prune the trials: where bf16 would be emulated (no AVX512-BF16, AMX or ARM BF16) only fp32 is timed; a
forced precision (model.compute_dtype or the role's own compute_dtype = "bf16" | "fp32") is timed alone, for the
estimate. fp32 is taken only where bf16's step measured at least FP32_MARGIN times fp32's: on a 2-core Zen 4 the two
generator precisions of the default job measured 0.92-1.09x of each other from one call to the next, and bf16 holds
half the activations.

Each measurement is kept in the qgrpo cache (core/measured.py) under this machine's key (the processor, the kernels'
capability, native bf16, the role's threads and OpenMP wait, torch's version) and the role's shape and model
architecture, so a second `check` or `train` of the same job on the same machine measures nothing. The choice becomes
the effective config's [learner|reference|rollout].compute_dtype, which the run directory's config.toml records with
the times behind it (`note`) and the start event as `compute_auto`; the user's file is never touched. On a cluster, or
on a GPU, each role resolves "auto" itself by its device (core/cpu.py: compute_dtype).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

from qgrpo.cluster.run.role_timing import Shape, Timing, in_child, shape_of
from qgrpo.core import measured

ROLES = ("learner", "reference", "rollout")
FP32_MARGIN = 1.10  # fp32 is chosen where bf16's time is at least this many times fp32's
CACHE_FILE = "compute_rates.json"  # under the cache root, by machine key (core/measured.py)
NOTE = "# model.compute_dtype = \"auto\" measured: "  # the comment line under the run's config.toml
# "0": the CPU roles are not timed: "auto" follows the CPU's flags (core/cpu.py) and the estimate the measured product
# rate, as on a cluster; for scripted checks of many configs (the test suite sets it)
TIME_ROLES = "QGRPO_TIME_ROLES"


def enabled() -> bool:
    """Whether this process times the CPU roles before a local run (TIME_ROLES unset or not "0")."""
    import os

    return os.environ.get(TIME_ROLES, "1").strip() != "0"


def resolve_here(cfg, model_path: str, say=None) -> ComputeChoice | None:
    """`resolve` for a local run of `cfg` on this machine: the first train row's prompt as the run renders it (an
    environment's first turn as the episode loop does), the roles' threads and OpenMP waits as a local run sets them.
    None where the model's tokenizer cannot be read (the estimate then says why there is none)."""
    import os

    from qgrpo.cluster.config.machine import environment_probe
    from qgrpo.cluster.run.cpu_waits import role_threads, role_waits

    try:
        from transformers import AutoTokenizer

        from qgrpo.rollout.backends.common import format_prompt
        from qgrpo.rollout.data.tasks import make_task

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        prompt = len(format_prompt(tokenizer, make_task(cfg.task, cfg.run.seed).item(0), cfg.task.chat_template))
    except Exception:  # noqa: BLE001 - machine_report names what cannot be sized
        return None
    if cfg.environment.name:
        try:
            prompt = environment_probe(cfg, tokenizer)[0]
        except Exception:  # noqa: BLE001 - check's environment probe names what is wrong with it
            pass
    cores = os.cpu_count() or 1
    threads = role_threads(cfg, cores)
    waits = {role: w["wait"] for role, w in role_waits(cfg, True, cores, threads).items()}
    return resolve(cfg, model_path, prompt, threads, len(tokenizer), waits, say)


@dataclass
class RoleChoice:
    role: str
    setting: str  # "auto", "bf16" or "fp32"
    dtype: str  # chosen
    why: str
    timings: list[Timing] = field(default_factory=list)
    units: float = 1.0  # the run's units a step (groups for learner and reference, decode steps for rollout)
    calls: int = 1  # the calls a step makes (micro-batches; generation calls)

    def timing(self, dtype: str | None = None) -> Timing | None:
        return next((t for t in self.timings if t.dtype == (dtype or self.dtype) and not t.error), None)

    def step_seconds(self, dtype: str | None = None) -> float:
        t = self.timing(dtype)
        return t.seconds(self.units, self.calls) if t else math.nan


@dataclass
class ComputeChoice:
    roles: dict[str, RoleChoice]

    def applied(self, cfg):
        """`cfg` with each measured role's compute_dtype set to its choice (the effective config, not the file)."""
        for role, c in self.roles.items():
            if c.setting == "auto":
                cfg = dataclasses.replace(cfg, **{role: dataclasses.replace(getattr(cfg, role), compute_dtype=c.dtype)})
        return cfg

    def lines(self) -> list[str]:
        """'learner fp32 (auto: measured bf16 21.0 s, fp32 13.1 s a step, fp32 1.60x faster)' and the like, one per
        role."""
        return [f"{role} {c.dtype} ({c.why})" for role, c in self.roles.items()]

    @property
    def note(self) -> str:
        return NOTE + "; ".join(self.lines()) + "\n"

    @property
    def record(self) -> dict:
        return {r: {"setting": c.setting, "chosen": c.dtype, "why": c.why, "units": c.units, "calls": c.calls,
                    "timings": [t.to_dict() for t in c.timings]} for r, c in self.roles.items()}


def candidates(setting: str, native_bf16: bool | None) -> tuple[list[str], str]:
    """(the precisions to time, why no other) for a role's setting on this CPU: a forced one alone; "auto": bf16 and
    fp32 where bf16 is native or unknown, fp32 alone where bf16 products would be emulated."""
    if setting != "auto":
        return [setting], f"{setting} as set"
    if native_bf16 is False:
        return ["fp32"], "no native bf16 on this CPU: bf16 products would be emulated, several times slower"
    return ["bf16", "fp32"], ""


def decide(role: str, setting: str, timings: list[Timing], units: float, calls: int, pruned: str = "") -> RoleChoice:
    """The role's choice from its timings (a pure function: tests give it rates): a forced setting as it is; "auto":
    fp32 where bf16's step measured at least FP32_MARGIN times fp32's, else bf16; a precision that could not run is
    not chosen."""
    ok = {t.dtype: t for t in timings if not t.error}
    step = {d: t.seconds(units, calls) for d, t in ok.items()}

    def said(d: str) -> str:
        return f"{d} {_span(step[d])}" if d in step else f"{d} could not run"

    measured_words = ", ".join(said(t.dtype) for t in timings) + " a step"
    if setting != "auto":
        return RoleChoice(role, setting, setting, f"{_role_field(role)} = \"{setting}\"; measured {measured_words}",
                          timings, units, calls)
    if not step:
        errors = "; ".join(f"{t.dtype}: {t.error}" for t in timings)
        return RoleChoice(role, setting, timings[0].dtype if timings else "fp32",
                          f"auto: no precision could be timed ({errors})", timings, units, calls)
    if len(step) == 1:
        (only,) = step
        return RoleChoice(role, setting, only, f"auto: {pruned or 'the only one that ran'}; measured "
                          f"{measured_words}", timings, units, calls)
    ratio = step["bf16"] / max(step["fp32"], 1e-9)
    if ratio >= FP32_MARGIN:
        chosen, words = "fp32", f"fp32 {ratio:.2f}x faster"
    elif ratio > 1:
        chosen, words = "bf16", f"fp32 {ratio:.2f}x faster, within the {FP32_MARGIN:.2f}x that keeps bf16"
    else:
        chosen, words = "bf16", f"bf16 {1 / max(ratio, 1e-9):.2f}x faster"
    return RoleChoice(role, setting, chosen, f"auto: measured {measured_words}, {words}", timings, units, calls)


def _role_field(role: str) -> str:
    return f"{role}.compute_dtype"


def _span(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def run_units(cfg, role: str, shape: Shape) -> tuple[float, int]:
    """(units, calls) of `role` in one step of `cfg`: groups and micro-batches for the learner (times its updates) and
    the reference; decode steps (the longest completion's tokens) and one call for the generator."""
    ro = cfg.rollout
    groups = ro.prompts_per_step
    if role == "learner":
        le = cfg.learner
        per_rank = math.ceil(groups * ro.group_size / le.world_size)
        micro = math.ceil(per_rank / le.micro_batch_per_rank)
        updates = cfg.algo.updates_per_batch
        return updates * per_rank / ro.group_size, updates * micro
    if role == "reference":
        from qgrpo.rollout.backends.reference import MICRO_BATCH

        return groups, math.ceil(groups * ro.group_size / MICRO_BATCH)
    from qgrpo.cluster.config.machine import decode_steps

    return decode_steps(cfg), 1


def probed_roles(cfg) -> list[str]:
    """The roles whose compute dtype is this module's to measure: those computing in torch on this machine's CPU."""
    from qgrpo.rollout.backends import REGISTRY

    out = []
    if not cfg.learner.num_gpus:
        out.append("learner")
    if cfg.reference_actor and not cfg.reference.num_gpus and REGISTRY[cfg.reference.backend].compute_dtype:
        out.append("reference")
    if not cfg.rollout.num_gpus and REGISTRY[cfg.rollout.backend].compute_dtype:
        out.append("rollout")
    return out


def _model_digest(model_path: str) -> str:
    """The architecture's digest: config.json's bytes (the weights' values do not change a rate)."""
    try:
        return hashlib.sha256((Path(model_path) / "config.json").read_bytes()).hexdigest()[:16]
    except OSError:
        return "unknown"


def probe_key(cfg, role: str, dtype: str, shape: Shape, model_path: str) -> str:
    parts = [role, dtype, _model_digest(model_path), f"p{shape.prompt}", f"c{shape.completion}", f"g{shape.group}"]
    if role == "learner":
        le = cfg.learner
        parts += [le.mode, le.attention, f"ckpt{int(le.gradient_checkpointing)}", f"shared{int(shape.shared)}"]
        if le.mode != "full":
            parts.append(f"r{le.lora.rank}")
    elif role == "reference":
        parts += [cfg.reference.precision, f"q{cfg.rollout.group_size_quant}", f"shared{int(shape.shared)}"]
    else:
        ro = cfg.rollout
        parts += [ro.backend, ro.precision, f"q{ro.group_size_quant}", f"rows{shape.prompts}x{shape.group}"]
    return ":".join(parts)


def resolve(cfg, model_path: str, prompt_tokens: int, threads: dict[str, int], vocab: int, waits: dict | None = None,
            say=None) -> ComputeChoice:
    """Every probed role's choice (module docstring); measurements come from the cache where it has them, the rest
    are made in a child process per OpenMP wait (`waits`: {role: "passive" | "spin"}, cluster/run/cpu_waits.py), which
    starts with that wait as the role's actor does and holds the models while it measures. `threads`: each role's
    torch threads (cluster/run/cpu_waits.py: role_threads); `say(text)`: told before measuring."""
    from qgrpo.core.cpu import isa

    cpu = isa()
    shape = shape_of(cfg, prompt_tokens)
    plan: dict[str, tuple[str, list[str], str]] = {}  # role -> (setting, dtypes, why pruned)
    kept: dict[tuple[str, str], Timing] = {}
    missing: dict[str, list[tuple[str, str, int, str, str]]] = {}  # wait -> jobs (role, dtype, threads, machine, key)
    for role in probed_roles(cfg):
        setting = cfg.compute_dtype_of(role)
        dtypes, pruned = candidates(setting, cpu.native_bf16)
        plan[role] = (setting, dtypes, pruned)
        n = threads.get(role) or 1
        machine = measured.machine_key(n, f"{(waits or {}).get(role, 'passive')} wait")
        for dtype in dtypes:
            key = probe_key(cfg, role, dtype, shape, model_path)
            value = measured.recall(CACHE_FILE, machine, key)
            if value is not None:
                kept[role, dtype] = Timing(**{**value, "cached": True})
            else:
                missing.setdefault((waits or {}).get(role, "passive"), []).append((role, dtype, n, machine, key))
    if missing and say:
        jobs = [j for group in missing.values() for j in group]
        say(f"timing {len(jobs)} role and precision pair{'s' * (len(jobs) != 1)} of this job (" + ", ".join(
            f"{role} {dtype}" for role, dtype, *_ in jobs) + "): once per machine and model, about 10-60 s each")
    for wait, jobs in missing.items():
        results = in_child(cfg, model_path, shape, vocab, wait, [(role, dtype, n) for role, dtype, n, *_ in jobs])
        for (role, dtype, _, machine, key), t in zip(jobs, results):
            if not t.error:
                measured.remember(CACHE_FILE, machine, key, {k: v for k, v in t.to_dict().items() if k != "cached"})
            kept[role, dtype] = t
    roles = {}
    for role, (setting, dtypes, pruned) in plan.items():
        units, calls = run_units(cfg, role, shape)
        roles[role] = decide(role, setting, [kept[role, d] for d in dtypes], units, calls, pruned)
    return ComputeChoice(roles)


__all__ = ["ROLES", "FP32_MARGIN", "TIME_ROLES", "NOTE", "Timing", "RoleChoice", "ComputeChoice", "candidates",
           "decide", "enabled", "shape_of", "run_units", "resolve", "resolve_here", "probed_roles"]
