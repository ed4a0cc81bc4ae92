"""The `ray up` example and its config agree: every role of configs/cluster.toml fits the node types of
cluster/ray_cluster.yaml (at their max_workers), and the YAML starts Ray from the project's own environment."""
from pathlib import Path

import yaml

from qgrpo.cluster.config.plan import gpu_plan, infeasible, nodes_from_ray, role_requests
from qgrpo.cluster.config.schema import load_config

ROOT = Path(__file__).resolve().parents[1]


def _nodes(spec: dict) -> list[dict]:
    """The nodes `ray up` would start at full size, as ray.nodes() describes them."""
    out = []
    for name, t in spec["available_node_types"].items():
        count = 1 if name == spec["head_node_type"] else t["max_workers"]
        out += [{"Alive": True, "NodeManagerAddress": f"{name}-{i}", "Resources": dict(t["resources"]), "Labels": {}}
                for i in range(count)]
    return out


def test_the_example_config_fits_the_example_cluster():
    spec = yaml.safe_load((ROOT / "cluster" / "ray_cluster.yaml").read_text())
    cfg = load_config(ROOT / "configs" / "cluster.toml")
    assert infeasible(role_requests(cfg), _nodes(spec)) == []
    # every GPU role at once, on the node types it is pinned to; none on the head, which has no GPU
    lines, problems = gpu_plan(role_requests(cfg), nodes_from_ray(_nodes(spec)))
    assert problems == [] and any("reference (1)" in line for line in lines), (lines, problems)
    assert cfg.reference.num_gpus == 1 and "head_node" not in cfg.reference.resources
    # and would not with one node type missing: the pinning is real
    spec["available_node_types"].pop("rollout")
    (problem,) = infeasible(role_requests(cfg), _nodes(spec))
    assert problem.startswith("rollout:") and "'rollout_node'" in problem


def test_nodes_run_ray_from_the_projects_environment():
    spec = yaml.safe_load((ROOT / "cluster" / "ray_cluster.yaml").read_text())
    starts = spec["head_start_ray_commands"] + spec["worker_start_ray_commands"]
    assert all("qgrpo/.venv/bin/ray" in c for c in starts)
    assert any("make install-cuda" in c for c in spec["setup_commands"])
    assert "**/.venv" in spec["rsync_exclude"]
