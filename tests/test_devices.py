"""Device discipline (core/devices.py and its callers), on this CPU: each decision a GPU run depends on is a function
checked here; the GPU paths themselves are in tests/test_cuda.py (`cuda` mark)."""
import pytest
import torch

from qgrpo.core import devices
from qgrpo.core.devices import DeviceError, device_from_ids, role_env, transport_backend, wait_for_gpu_memory

# ------------------------------------------------------------------------------------------------ the role's device


def test_a_role_without_gpus_sees_none():
    # Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone for zero-GPU actors: we clear it ourselves.
    assert role_env(0) == {"CUDA_VISIBLE_DEVICES": ""}
    assert role_env(0.0) == {"CUDA_VISIBLE_DEVICES": ""}
    assert role_env(0.25) == {} and role_env(1) == {}  # Ray sets it to the assigned GPUs


def test_device_follows_the_assigned_ids_not_the_node():
    assert device_from_ids([], cuda_available=True) == torch.device("cpu")  # a GPU node, no GPU asked
    assert device_from_ids(["3"], cuda_available=True) == torch.device("cuda", 0)  # only GPU 3 is visible: cuda:0
    with pytest.raises(DeviceError, match="learner rank.*assigned GPU\\(s\\) 0.*make install-cuda"):
        device_from_ids(["0"], cuda_available=False, role="learner rank")


def test_outside_ray_an_empty_visible_list_means_cpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what a GPU node's torch says
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert devices.visible_gpu_count() == 0
    assert devices.current_device() == torch.device("cpu")


def test_roles_get_their_environment(monkeypatch, tiny_model_path):
    """Every actor the workers start carries role_env of its num_gpus (captured at Ray's `.options`)."""
    import qgrpo.actors.reference_actor
    import qgrpo.actors.rollout_actor
    from qgrpo.cluster.config.plan import RoleRequest
    from qgrpo.cluster.config.schema import load_config
    from qgrpo.cluster.run.workers import RolloutPool

    seen = []

    class Capture:
        def __init__(self, **kw):
            seen.append(kw["runtime_env"]["env_vars"])

        def remote(self, *a, **k):
            return object()

    monkeypatch.setattr(qgrpo.cluster.run.workers.RolloutActor, "options", lambda **kw: Capture(**kw), raising=False)
    cfg = load_config(None, [f"model.path='{tiny_model_path}'"])
    RolloutPool(cfg, tiny_model_path, 0, "bf16", RoleRequest("rollout", 1, 1.0, 0.0), threads=1)
    RolloutPool(cfg, tiny_model_path, 0, "bf16", RoleRequest("rollout", 1, 1.0, 0.5), threads=1)
    assert seen[0]["CUDA_VISIBLE_DEVICES"] == "" and "CUDA_VISIBLE_DEVICES" not in seen[1]


# ------------------------------------------------------------------------------------------------ the learner
# (The learner's own device tests build a DeepSpeed engine in-process: tests/test_learner.py, which owns the one
# process group a test process has.)


def test_collective_device_is_cuda_under_nccl(monkeypatch):
    dist = torch.distributed
    assert devices.collective_device() == torch.device("cpu")  # gloo (or no group)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert devices.collective_device() == torch.device("cuda", 0)


def test_train_batch_to_moves_every_tensor():
    from qgrpo.learner.batch import TrainBatch

    b = TrainBatch(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2),
                   torch.zeros(2, dtype=torch.long), prompt_lens=torch.ones(2, dtype=torch.long), total_sequences=2)
    m = b.to("meta")
    assert all(getattr(m, f).device.type == "meta" for f in ("input_ids", "completion_mask", "mu_logp", "advantages",
                                                             "policy_versions", "prompt_lens"))
    assert m.ref_logp is None and m.total_sequences == 2


def test_reference_scorer_scores_on_its_device(tiny_model_path):
    from qgrpo.rollout.backends.reference import ReferenceScorer

    ref = ReferenceScorer(tiny_model_path, "bf16", device="cpu")
    assert next(ref.model.parameters()).device == ref.device == torch.device("cpu")
    out = ref.score(torch.randint(1, 10, (2, 5)))
    assert out.device.type == "cpu" and out.shape == (2, 5) and torch.isfinite(out).all()


# ------------------------------------------------------------------------------------------------ shared GPUs


def test_vllm_memory_share_follows_the_gpu_share():
    from qgrpo.rollout.backends import VLLMOptions

    o = VLLMOptions()
    assert o.memory_share(1) == pytest.approx(0.9) and o.memory_share(0.3) == pytest.approx(0.27)
    assert VLLMOptions(gpu_memory_utilization=0.2).memory_share(0.3) == 0.2  # the user's own, within the share
    (msg,) = VLLMOptions(gpu_memory_utilization=0.5).problems("rollout.vllm", 0.3)
    assert msg.startswith("rollout.vllm.gpu_memory_utilization: 0.5") and "rollout.num_gpus = 0.3" in msg
    assert VLLMOptions(gpu_memory_utilization=0.95).problems("rollout.vllm", 1) == []
    (tp,) = VLLMOptions(tensor_parallel_size=2).problems("rollout.vllm", 2)
    assert tp.startswith("rollout.vllm.tensor_parallel_size: 2 is not supported")


def test_an_engine_waits_for_the_killed_ones_memory():
    free = iter([2, 4, 9])  # GiB free of 10 as the killed engine's process goes away
    slept = []
    waited = wait_for_gpu_memory(0.8, 60, "rollout actor vllm-0", lambda: (next(free) * 2**30, 10 * 2**30),
                                 slept.append)
    assert len(slept) == 2 and waited >= 0
    with pytest.raises(DeviceError, match="rollout actor vllm-0: needs 8.0 GiB .* only 2.0 GiB stayed free"):
        wait_for_gpu_memory(0.8, 0, "rollout actor vllm-0", lambda: (2 * 2**30, 10 * 2**30), lambda s: None)


def test_allocator_cap_of_a_share():
    assert devices.allocator_fraction(0.5) == pytest.approx(0.45)
    assert devices.allocator_fraction(1.0) == pytest.approx(0.9)


# ------------------------------------------------------------------------------------------------ weight transport


def test_nccl_only_when_every_member_has_a_gpu_of_its_own():
    def gpu(name, *ids):
        return {"name": name, "device": "cuda", "gpus": [f"n1/{i}" for i in ids]}

    assert transport_backend([gpu("learner rank 0", 0), gpu("vllm-0", 1), gpu("vllm-1", 2)])[0] == "nccl"
    backend, why = transport_backend([gpu("learner rank 0", 0), {"name": "torch-0", "device": "cpu", "gpus": []}])
    assert backend == "gloo" and "torch-0 on the CPU" in why
    backend, why = transport_backend([gpu("learner rank 0", 0), gpu("vllm-0", 0)])  # fractional GPUs, one device
    assert backend == "gloo" and "learner rank 0 and vllm-0 share GPU 0" in why
    other_node = {"name": "vllm-1", "device": "cuda", "gpus": ["n2/0"]}
    assert transport_backend([gpu("learner rank 0", 0), other_node])[0] == "nccl"  # GPU 0 of another node


def test_the_group_is_formed_on_the_chosen_backend():
    """The driver asks every member where its tensors live and joins them all on the backend that serves that."""
    from qgrpo.actors.collective import CollectiveGroup

    class Ref:
        def __init__(self, value):
            self.value = value

    class Member:
        def __init__(self, info):
            self.info, self.joined = info, None
            self.collective_device_info = type("M", (), {"remote": lambda _: Ref(info)})()
            self.collective_host = type("M", (), {"remote": lambda _, t: Ref(("127.0.0.1", 1234))})()
            member = self

            class Join:
                def remote(self, *args):
                    member.joined = args[-1]
                    return Ref(None)

            self.collective_join = Join()
            self.collective_leave = type("M", (), {"remote": lambda _: None})()

    def wait(calls, seconds, stage):
        return {r: r.value for r in calls}

    host = Member({"device": "cuda", "gpus": ["n/0"]})
    shared = Member({"device": "cuda", "gpus": ["n/0"]})
    group = CollectiveGroup(wait)
    group._form(host, [shared], ["vllm-0"], 10.0, float("inf"))
    assert group.backend == "gloo" and host.joined == shared.joined == "cpu"
    own = Member({"device": "cuda", "gpus": ["n/1"]})
    group._form(host, [own], ["vllm-0"], 10.0, float("inf"))
    assert group.backend == "nccl" and host.joined == own.joined == "cuda"


def test_inside_a_ray_actor_the_device_is_decided_from_its_assignment(ray_session):
    """A real actor started as the workers start a zero-GPU role: no GPU visible, CPU device, no GPU share."""
    import os

    import ray

    @ray.remote(num_gpus=0)
    class Probe:
        def where(self):
            return (os.environ.get("CUDA_VISIBLE_DEVICES"), str(devices.current_device()), devices.assigned_gpus(),
                    devices.gpu_share(), devices.physical_gpus())

    probe = Probe.options(runtime_env={"env_vars": role_env(0)}).remote()
    try:
        visible, device, assigned, share, physical = ray.get(probe.where.remote())
    finally:
        ray.kill(probe)
    assert visible == "" and device == "cpu" and assigned == ([], 0.0) and share == 1.0 and physical == []
    assert devices.assigned_gpus() is None  # the driver: nothing assigned
