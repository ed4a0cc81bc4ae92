"""The `ray up` example and its config agree: every role of configs/cluster.toml fits the node types of
cluster/ray_cluster.yaml (at their max_workers), and the YAML starts Ray from the project's own environment."""
from pathlib import Path

import yaml

from cluster.config import load_config
from cluster.placement import infeasible, role_requests

ROOT = Path(__file__).resolve().parents[1]


def _nodes(spec: dict) -> list[dict]:
    """The nodes `ray up` would start at full size, as ray.nodes() describes them."""
    out = []
    for name, t in spec["available_node_types"].items():
        count = 1 if name == spec["head_node_type"] else t["max_workers"]
        out += [{"Alive": True, "Resources": dict(t["resources"]), "Labels": {}}] * count
    return out


def test_the_example_config_fits_the_example_cluster():
    spec = yaml.safe_load((ROOT / "cluster" / "ray_cluster.yaml").read_text())
    cfg = load_config(ROOT / "configs" / "cluster.toml")
    assert infeasible(role_requests(cfg), _nodes(spec)) == []
    # and would not with one node type missing: the pinning is real
    spec["available_node_types"].pop("rollout")
    (problem,) = infeasible(role_requests(cfg), _nodes(spec))
    assert problem.startswith("rollout:") and "'rollout_node'" in problem


def test_nodes_run_ray_from_the_projects_environment():
    spec = yaml.safe_load((ROOT / "cluster" / "ray_cluster.yaml").read_text())
    starts = spec["head_start_ray_commands"] + spec["worker_start_ray_commands"]
    assert all("qgrpo/.venv/bin/ray" in c for c in starts)
    assert any("make install" in c for c in spec["setup_commands"])
    assert "**/.venv" in spec["rsync_exclude"]
