"""The GPU plan (cluster.config.plan.gpu_plan): every actor that asks for a GPU or a share of one is placed at once, as
Ray would, or the config is refused naming the roles and the GPUs; `qgrpo check --gpus` and the presets."""
from pathlib import Path

import pytest

from qgrpo.cluster.config.plan import GPUNode, RoleRequest, gpu_plan, nodes_from_counts, nodes_from_ray, role_requests
from qgrpo.cluster.config.schema import load_config

ROOT = Path(__file__).resolve().parents[1]


def _req(role, count, gpus, **kw):
    return RoleRequest(role, count, 1.0, gpus, **kw)


def test_shares_of_one_gpu_that_add_up_fit():
    lines, problems = gpu_plan([_req("rollout", 1, 0.3), _req("reference", 1, 0.2), _req("learner", 1, 0.5)],
                               nodes_from_counts([1]))
    assert problems == []
    assert lines == ["node 0 GPU 0: learner rank 0 (0.5) + rollout actor 0 (0.3) + reference (0.2) = 1 of 1"]


def test_shares_that_do_not_fit_name_the_roles_and_the_gpu():
    _, (msg,) = gpu_plan([_req("rollout", 2, 0.5), _req("reference", 1, 0.2), _req("learner", 1, 0.5)],
                         nodes_from_counts([1]))
    assert msg.startswith("learner.num_gpus / reference.num_gpus / rollout.num_gpus: the GPU plan oversubscribes GPU 0 "
                          "of node 0")
    assert "rollout actor 1 (0.5)" in msg and "reference (0.2)" in msg and "1.7 GPUs in all and there are 1" in msg


def test_fractions_that_sum_below_the_total_can_still_not_fit():
    # 3 x 0.6 = 1.8 <= 2 GPUs, but no GPU holds two of them: Ray would wait forever for the third
    _, (msg,) = gpu_plan([_req("rollout", 3, 0.6)], nodes_from_counts([2]))
    assert "cannot be arranged so that each GPU holds at most 1" in msg


def test_whole_gpus_of_one_actor_sit_on_one_node():
    assert gpu_plan([_req("learner", 2, 1)], nodes_from_counts([1, 1]))[1] == []  # a rank per node
    lines, problems = gpu_plan([_req("learner", 4, 1), _req("rollout", 3, 1), _req("reference", 1, 1)],
                               nodes_from_counts([8]))
    assert problems == [] and len(lines) == 8


def test_the_search_backtracks_where_first_fit_fails():
    # first fit puts 0.5 + 0.3 on GPU 0, then 0.5 and 0.7 cannot share GPU 1; 0.5 + 0.5 and 0.7 + 0.3 fit
    lines, problems = gpu_plan([_req("learner", 1, 0.7), _req("rollout", 2, 0.5), _req("reference", 1, 0.3)],
                               nodes_from_counts([2]))
    assert problems == [], problems
    assert sorted(lines) == ["node 0 GPU 0: learner rank 0 (0.7) + reference (0.3) = 1 of 1",
                             "node 0 GPU 1: rollout actor 0 (0.5) + rollout actor 1 (0.5) = 1 of 1"]


def test_real_nodes_take_only_the_roles_pinned_to_them():
    nodes = nodes_from_ray([{"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"GPU": 1, "CPU": 8}},
                            {"Alive": True, "NodeManagerAddress": "10.0.0.2",
                             "Resources": {"GPU": 1, "CPU": 8, "rollout_node": 1}}])
    pinned = _req("rollout", 2, 0.5, resources={"rollout_node": 1})
    assert gpu_plan([pinned], nodes)[1] == []  # both halves of the pinned node's GPU
    _, (msg,) = gpu_plan([_req("rollout", 3, 0.5, resources={"rollout_node": 1})], nodes)
    assert "rollout.num_gpus" in msg
    assert nodes[1].takes(pinned) and not nodes[0].takes(pinned)
    assert GPUNode("x", 1, any_role=True).takes(pinned)  # a node given by its GPU count alone (--gpus)


def test_no_gpu_asked_no_plan():
    assert gpu_plan([_req("rollout", 2, 0), _req("learner", 1, 0)], nodes_from_counts([0])) == ([], [])


def _check(monkeypatch, capsys, *argv: str) -> tuple[int, str, str]:
    """`qgrpo check ARGV` in this process, from the project folder as a user types it: (exit code, stdout, stderr)."""
    from qgrpo.cluster.cli.app import main

    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    rc = main(["check", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("preset,gpus", [("gpu_single.toml", "1"), ("gpu_node.toml", "8"), ("cluster.toml", "4,1,1")])
def test_gpu_presets_pass_qgrpo_check(preset, gpus, monkeypatch, capsys):
    rc, out, err = _check(monkeypatch, capsys, f"configs/{preset}", "--gpus", gpus)
    assert rc == 0, out + err
    assert f"  GPU plan:  on --gpus {gpus}:\n    node 0 GPU 0: " in out  # check's report: stdout
    assert out.endswith("qgrpo check: OK: train would start\n")


def test_check_refuses_an_oversubscribed_gpu_plan(monkeypatch, capsys):
    rc, out, err = _check(monkeypatch, capsys, "configs/gpu_single.toml", "--gpus", "1", "--set",
                          "rollout.num_gpus=0.5")
    assert rc == 2, out + err
    assert "the GPU plan oversubscribes GPU 0 of node 0" in out
    assert "learner rank 0 (0.5)" in out and "rollout actor 0 (0.5)" in out
    assert "Traceback" not in out + err


def test_check_without_gpus_here_refuses_as_train_would_and_points_at_gpus(monkeypatch, capsys):
    """Without --gpus, check checks this machine, as train would run on it: a GPU config on a machine without a GPU
    (none visible, on any machine) is refused (CPUs made to fit here, so that the GPU plan is the one problem),
    naming --gpus for another machine."""
    import qgrpo.core.devices

    monkeypatch.setattr(qgrpo.core.devices, "visible_gpu_count", lambda: 0)
    rc, out, err = _check(monkeypatch, capsys, "configs/gpu_single.toml", "--set", "rollout.num_cpus=0", "--set",
                          "learner.num_cpus=0", "--set", "reference.num_cpus=0")
    assert rc == 2, out + err
    assert "(node 0: 0 GPUs)" in out and "this machine has no GPU: `qgrpo check CONFIG --gpus N`" in out
    assert out.endswith("qgrpo check: REFUSED: 1 problem\n")


def test_the_one_gpu_preset_shares_its_gpu_within_vllms_memory_share():
    cfg = load_config(ROOT / "configs" / "gpu_single.toml")
    share = {r.role: r.gpus for r in role_requests(cfg)}
    assert sum(share.values()) <= 1.0 and share["rollout"] < 1
    assert cfg.rollout.vllm.memory_share(cfg.rollout.num_gpus) <= share["rollout"]
