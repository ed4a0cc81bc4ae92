"""Where each role runs: what one actor of a role asks Ray for, and whether the cluster can ever give it (the Ray
side, creating the learner's placement group and waiting for busy resources, is cluster/run/placement.py).

Every role (rollout, reference, learner) asks per actor for CPUs, GPUs, memory, custom resources (nodes started with
`ray start --resources '{"rollout_node": 8}'`) and node labels (`ray start --labels pool=spot`). Learner ranks are
gang-scheduled through one placement group (all ranks start or none; `learner.placement_strategy` PACK/SPREAD/
STRICT_PACK/STRICT_SPREAD), so a half-started learner never holds resources while waiting for its other ranks.

A request no node of the cluster can ever satisfy is refused before any actor starts, naming the role and the resource
(`infeasible`); Ray itself would wait forever. What only a busy cluster delays waits up to
`faults.schedule_timeout_s` (cluster/run/placement.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# The resources Ray defines on every node: set through num_cpus/num_gpus/memory_gb, never as custom resources.
RAY_BUILTIN_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})
_GB = 2**30


@dataclass
class RoleRequest:
    """What one actor of a role asks for, and how many actors the role has."""

    role: str  # "rollout" | "reference" | "learner": also the config section the message points at
    count: int
    cpus: float
    gpus: float = 0.0
    memory_gb: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    strategy: str = ""  # placement-group strategy for gang-scheduled roles ("" = independent actors)

    def bundle(self) -> dict[str, float]:
        b = {"CPU": self.cpus, "GPU": self.gpus, "memory": self.memory_gb * _GB, **self.resources}
        return {k: float(v) for k, v in b.items() if v}

    def actor_options(self, group=None, bundle: int = -1) -> dict:
        """`.options(...)` for one actor of this role; in placement group `group` (bundle `bundle`), whose bundles
        carry the node labels."""
        opts: dict = {"num_cpus": self.cpus, "num_gpus": self.gpus}
        if self.memory_gb:
            opts["memory"] = int(self.memory_gb * _GB)
        if self.resources:
            opts["resources"] = dict(self.resources)
        if group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, bundle)
        elif self.labels:
            opts["label_selector"] = dict(self.labels)
        return opts

    def describe(self) -> str:
        parts = [f"{k}={v:g}" for k, v in self.bundle().items() if k != "memory"]
        if self.memory_gb:
            parts.append(f"memory={self.memory_gb:g} GB")
        parts += [f"label {k}={v}" for k, v in self.labels.items()]
        return f"{{{', '.join(parts) or 'nothing'}}}"


def role_requests(cfg) -> list[RoleRequest]:
    ro, ref, le = cfg.rollout, cfg.reference, cfg.learner

    def req(role: str, count: int, sec, strategy: str = "") -> RoleRequest:
        return RoleRequest(role, count, sec.num_cpus, sec.num_gpus, sec.memory_gb,
                           {k: float(v) for k, v in sec.resources.items()},
                           {k: str(v) for k, v in sec.node_labels.items()}, strategy)

    out = [req("rollout", ro.num_actors, ro)]
    if cfg.reference_actor:  # the reference actor exists only with a KL term (and not when the learner scores it)
        out.append(req("reference", 1, ref))
    out.append(req("learner", le.world_size, le, le.placement_strategy))
    if cfg.reward_model.path:
        out.append(req("reward_model", cfg.reward_model.num_actors, cfg.reward_model))
    return out


def _fits(node: dict, bundle: dict[str, float], labels: dict[str, str]) -> bool:
    have, lab = node.get("Resources", {}), node.get("Labels", {})
    return all(have.get(k, 0.0) >= v for k, v in bundle.items()) and all(lab.get(k) == v for k, v in labels.items())


def infeasible(requests: list[RoleRequest], nodes: list[dict]) -> list[str]:
    """Why a request can never be placed on these nodes (`ray.nodes()`, totals, not what is free now); [] if it can.
    One line per role, naming the missing resource (or label) and the fix."""
    alive = [n for n in nodes if n.get("Alive", n.get("alive"))]
    problems = []
    for r in requests:
        bundle = r.bundle()
        hosts = [n for n in alive if _fits(n, bundle, r.labels)]
        need = {"STRICT_SPREAD": r.count}.get(r.strategy, 1)
        if len(hosts) >= need and (r.strategy != "STRICT_PACK" or any(
                _fits(n, {k: v * r.count for k, v in bundle.items()}, r.labels) for n in alive)):
            continue
        if hosts:  # each actor fits somewhere, the strategy asks for more than that
            problems.append(f"learner.placement_strategy: {r.strategy} needs {need if need > 1 else r.count} "
                            f"{'distinct nodes' if need > 1 else 'ranks on one node'} for {r.role} "
                            f"({r.count} x {r.describe()}), the cluster has {len(hosts)} node(s) that fit one; use "
                            "PACK or SPREAD, or add nodes")
            continue
        problems.append(f"{r.role}: asks per actor for {r.describe()}, which no node of this "
                        f"cluster ({len(alive)} node(s)) can ever give: {_missing(bundle, r.labels, alive)}; "
                        f"{_fix(r)}")
    return problems


def _missing(bundle: dict[str, float], labels: dict[str, str], nodes: list[dict]) -> str:
    """The first resource (or label) that rules out every node, with the most any node has of it."""
    for k, v in bundle.items():
        most = max((n.get("Resources", {}).get(k, 0.0) for n in nodes), default=0.0)
        if most < v:
            shown = (lambda x: f"{x / _GB:g} GB") if k == "memory" else (lambda x: f"{x:g}")
            return (f"resource {k!r}: needs {shown(v)}, " +
                    (f"the largest node has {shown(most)}" if most else "no node has it"))
    for k, v in labels.items():
        seen = sorted({str(n.get("Labels", {}).get(k)) for n in nodes if k in n.get("Labels", {})})
        if not any(n.get("Labels", {}).get(k) == v for n in nodes):
            return f"node label {k}={v}: " + (f"nodes carry {k}={'|'.join(seen)}" if seen else "no node carries it")
    return "no single node has all of it at once"


def _fix(r: RoleRequest) -> str:
    keys = {"rollout": "rollout.num_cpus/num_gpus/memory_gb/resources/node_labels",
            "reference": "reference.num_cpus/num_gpus/memory_gb/resources/node_labels",
            "learner": "learner.num_cpus/num_gpus/memory_gb/resources/node_labels"}[r.role]
    return f"lower it in {keys}, or add a node that has it (ray start --resources / --labels)"


def placement_problems(section: str, sec) -> list[str]:
    """Config rules for the free-form resource tables every role has: custom resources and node labels (the bounds
    of its CPUs, GPUs and memory are declared with the fields)."""
    p = []
    for key, value in sec.resources.items():
        if key in RAY_BUILTIN_RESOURCES:
            p.append(f"{section}.resources.{key}: set it with {section}.num_cpus/num_gpus/memory_gb, not as a custom "
                     "resource")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            p.append(f"{section}.resources.{key}: must be a number > 0 (the amount of the custom resource per actor), "
                     f"got {value!r}")
    for key, value in sec.node_labels.items():
        if not isinstance(value, str) or not value:
            p.append(f"{section}.node_labels.{key}: must be a non-empty string (the label's value), got {value!r}")
    return p


# ---------------------------------------------------------------------------------------------------------------------
# The GPU plan: can every actor that asks for a GPU (or a share of one) get it at once?
#
# Ray places a whole-GPU request (num_gpus = 1, 2, ...) on that many free GPUs of one node, and a fractional one
# (0 < num_gpus < 1) on one GPU that still has that share free; roles that share a GPU this way must add up to at most
# 1 per GPU. `infeasible` checks each actor alone; a plan whose actors fit one by one but not together would leave Ray
# waiting for resources that never come (faults.schedule_timeout_s later). `gpu_plan` places them all, exactly (a
# small search: a job has tens of actors), and says which GPU each lands on, or which roles oversubscribe which GPU.

_EPS = 1e-9
_SEARCH_LIMIT = 200_000  # placement attempts before giving up the search (then the plan is not refused)


@dataclass
class GPUNode:
    """A node as the plan sees it: its GPUs, and (for a real cluster) its resources and labels."""

    name: str
    gpus: int
    resources: dict[str, float] = field(default_factory=dict)  # empty: any custom resource (a node from --gpus)
    labels: dict[str, str] = field(default_factory=dict)
    any_role: bool = False  # a node described by GPU count alone: every role may go there

    def takes(self, r: RoleRequest) -> bool:
        if self.any_role:
            return True
        return (all(self.resources.get(k, 0.0) >= v for k, v in r.bundle().items() if k != "GPU")
                and all(self.labels.get(k) == v for k, v in r.labels.items()))


def nodes_from_counts(counts: list[int]) -> list[GPUNode]:
    """Nodes given by their GPU counts (`qgrpo check --gpus 8` or `--gpus 4,1,1`): every role may go anywhere."""
    return [GPUNode(f"node {i}", n, any_role=True) for i, n in enumerate(counts)]


def nodes_from_ray(nodes: list[dict]) -> list[GPUNode]:
    """The alive nodes of `ray.nodes()` (their totals)."""
    alive = [n for n in nodes if n.get("Alive", n.get("alive"))]
    return [GPUNode(n.get("NodeManagerAddress") or n.get("NodeID", f"node {i}")[:12], int(n["Resources"].get("GPU", 0)),
                    dict(n.get("Resources", {})), dict(n.get("Labels", {}))) for i, n in enumerate(alive)]


def _actor_names(r: RoleRequest) -> list[str]:
    if r.role == "learner":
        return [f"learner rank {i}" for i in range(r.count)]
    if r.role == "rollout":
        return [f"rollout actor {i}" for i in range(r.count)]
    return [r.role if r.count == 1 else f"{r.role} {i}" for i in range(r.count)]


def gpu_plan(requests: list[RoleRequest], nodes: list[GPUNode]) -> tuple[list[str], list[str]]:
    """(plan lines "node GPU i: who (share) + ... = total", problems). Problems name the roles and the GPUs they
    would oversubscribe and the fields to change; [] when every GPU-asking actor fits at once (or the search gave up,
    which never refuses a plan). num_gpus above 1 is whole (cluster.config.schema.gpu_problems refuses more than 1)."""
    demands = [(name, r) for r in requests if r.gpus > 0 for name in _actor_names(r)]
    if not demands:
        return [], []
    free = [[1.0] * n.gpus for n in nodes]
    held: list[list[list[str]]] = [[[] for _ in range(n.gpus)] for n in nodes]
    # Whole GPUs first, then the largest shares: the order a person would place them in, and the search's.
    order = sorted(demands, key=lambda d: -d[1].gpus)
    budget = [_SEARCH_LIMIT]

    def place(k: int) -> bool:
        if k == len(order):
            return True
        budget[0] -= 1
        if budget[0] < 0:
            raise TimeoutError
        name, r = order[k]
        tried: set = set()
        for ni, node in enumerate(nodes):
            if not node.takes(r):
                continue
            if r.gpus >= 1:
                idle = [g for g in range(node.gpus) if free[ni][g] >= 1.0 - _EPS]
                if len(idle) < r.gpus:
                    continue
                pick = idle[:int(r.gpus)]
                for g in pick:
                    free[ni][g] = 0.0
                    held[ni][g].append(f"{name} (1)")
                if place(k + 1):
                    return True
                for g in pick:
                    free[ni][g] = 1.0
                    held[ni][g].pop()
                continue
            for g in range(node.gpus):
                key = (ni if not node.any_role else "any", round(free[ni][g], 6))  # equal GPUs: try one of them
                if free[ni][g] + _EPS < r.gpus or key in tried:
                    continue
                tried.add(key)
                free[ni][g] -= r.gpus
                held[ni][g].append(f"{name} ({r.gpus:g})")
                if place(k + 1):
                    return True
                free[ni][g] += r.gpus
                held[ni][g].pop()
        return False

    def lines() -> list[str]:
        out = []
        for ni, node in enumerate(nodes):
            for g in range(node.gpus):
                if held[ni][g]:
                    out.append(f"{node.name} GPU {g}: {' + '.join(held[ni][g])} = {1.0 - free[ni][g]:.2g} of 1")
        return out

    try:
        if place(0):
            return lines(), []
    except TimeoutError:
        return ["(too many actors to check the GPU plan exactly; not checked)"], []
    return [], [_oversubscribed(demands, nodes)]


def _oversubscribed(demands: list[tuple[str, RoleRequest]], nodes: list[GPUNode]) -> str:
    """The one problem of a plan that does not fit: the fields, the GPUs, every GPU-asking actor, and why."""
    total = sum(n.gpus for n in nodes)
    asked = sum(r.gpus for _, r in demands)
    whole = [f"{name} ({r.gpus:g})" for name, r in demands]
    where = ", ".join(f"{n.name}: {n.gpus} GPU{'s' * (n.gpus != 1)}" for n in nodes) or "no GPUs"
    fields = " / ".join(f"{role}.num_gpus" for role in sorted({r.role for _, r in demands}))
    if asked > total + _EPS:
        why = f"they ask for {asked:g} GPUs in all and there are {total}"
    else:
        why = "the shares cannot be arranged so that each GPU holds at most 1 (a fractional request sits on one GPU)"
    shared = [f"GPU {g} of {n.name}" for n in nodes for g in range(n.gpus)]
    return (f"{fields}: the GPU plan oversubscribes {', '.join(shared[:4]) or 'the GPUs'}"
            f"{' and more' if len(shared) > 4 else ''} ({where}): {' + '.join(whole)}: {why}; lower {fields} so that "
            "the roles sharing a GPU add up to at most 1, fewer actors, or more GPUs")
