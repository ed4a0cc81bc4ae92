"""What a role asks Ray for, against a cluster's nodes: a request no node can ever satisfy is named with its role and
resource before any actor starts; one a busy cluster only delays waits to its deadline and then says so."""
import pytest
import ray

from qgrpo.cluster.config.plan import RoleRequest, infeasible, role_requests
from qgrpo.cluster.config.schema import load_config
from qgrpo.cluster.run.placement import wait_scheduled


def _node(cpus: float, **resources) -> dict:
    labels = resources.pop("labels", {})
    return {"Alive": True, "Resources": {"CPU": cpus, "memory": 8 * 2**30, **resources}, "Labels": labels}


NODES = [_node(2, head_node=1), _node(4, learner_node=1, labels={"pool": "learn"}),
         _node(4, learner_node=1, labels={"pool": "learn"}), _node(8, GPU=1, rollout_node=4)]


def test_requests_follow_the_config():
    cfg = load_config("configs/tiny.toml", ["learner.world_size=2", "learner.resources={learner_node=1}",
                                            "learner.placement_strategy='STRICT_SPREAD'", "rollout.num_gpus=1",
                                            "rollout.memory_gb=2", "reference.node_labels={pool='learn'}"])
    req = {r.role: r for r in role_requests(cfg)}
    assert req["learner"].bundle() == {"CPU": 1.0, "learner_node": 1.0} and req["learner"].count == 2
    assert req["rollout"].actor_options() == {"num_cpus": 1.0, "num_gpus": 1.0, "memory": 2 * 2**30}
    assert req["reference"].actor_options()["label_selector"] == {"pool": "learn"}
    assert infeasible(list(req.values()), NODES) == []


@pytest.mark.parametrize("request_, words", [
    (RoleRequest("learner", 2, 1.0, resources={"gpu_node": 1}), ["learner:", "'gpu_node'", "no node has it"]),
    (RoleRequest("rollout", 1, 16.0), ["rollout:", "'CPU'", "needs 16", "largest node has 8"]),
    (RoleRequest("reference", 1, 0.0, memory_gb=64), ["reference:", "'memory'", "needs 64 GB", "has 8 GB"]),
    (RoleRequest("rollout", 1, 1.0, labels={"pool": "spot"}), ["rollout:", "node label pool=spot", "pool=learn"]),
    (RoleRequest("learner", 3, 1.0, resources={"learner_node": 1}, strategy="STRICT_SPREAD"),
     ["learner.placement_strategy", "STRICT_SPREAD needs 3 distinct nodes", "has 2 node(s)"]),
    (RoleRequest("learner", 2, 5.0, strategy="STRICT_PACK"), ["learner.placement_strategy", "ranks on one node"]),
])
def test_impossible_requests_name_the_role_and_resource(request_, words):
    (problem,) = infeasible([request_], NODES)
    assert all(w in problem for w in words), problem


def test_dead_nodes_do_not_count():
    dead = {**NODES[3], "Alive": False}
    assert infeasible([RoleRequest("rollout", 1, 1.0, gpus=1)], NODES[:3] + [dead])


def test_a_busy_cluster_waits_to_the_deadline_then_says_so(ray_session, capsys):
    """The request fits the cluster (4 CPUs) but not now (2 are held): it waits, says so, then gives up."""

    @ray.remote
    class Holder:
        def ready(self) -> bool:
            return True

    holder = Holder.options(num_cpus=2).remote()
    ray.get(holder.ready.remote())
    waiting = Holder.options(num_cpus=4).remote()
    try:
        with pytest.raises(TimeoutError, match=r"the learner could not be placed within 2 s .*schedule_timeout_s"):
            wait_scheduled({waiting.ready.remote(): "the learner"}, 2.0, "placing the learner ranks", message_every=0.5)
        assert "waiting" in capsys.readouterr().err
    finally:
        ray.kill(waiting)
        ray.kill(holder)
