"""Weight sync on real Ray + a real DeepSpeed learner: after one sync every rollout actor (torch bf16/int8/int4, vLLM
bf16/int8) reports the learner's version, passes the fingerprint check, and its sampled log-probs follow the new
weights (not the old ones, not garbage); syncing the original weights back restores the original greedy outputs."""
import dataclasses

import pytest
import ray
import torch

from qgrpo.actors.learner_actor import start_learners
from qgrpo.actors.rollout_actor import RolloutActor
from qgrpo.actors.weights import ObjectStoreTransport
from qgrpo.cluster.run.supervisor import StageTimeout, gather
from qgrpo.core.scoring import token_logprobs
from qgrpo.learner.batch import build_train_batch
from qgrpo.learner.objective.advantages import group_advantages
from qgrpo.learner.objective.settings import objective_settings
from qgrpo.learner.settings import LearnerSettings
from tests.helpers import GREEDY, ITEMS, SAMPLING, mean_gap

KINDS = (("torch", "bf16"), ("torch", "int8"), ("torch", "int4"), ("vllm", "bf16"), ("vllm", "int8"))
# Mean |log mu - log pi| over sampled tokens between a generator and a float32 forward of the weights it should hold.
# int4 group-64 on this tiny random model measured ~0.02-0.05; bound with margin. The old-vs-new gap must be larger.
# vLLM's int8 is W8A8 (activations quantized too, by oneDNN kernels that differ by ISA): its fingerprint gap measured
# 0.003 with AVX-512 and 0.097 with ONEDNN_MAX_CPU_ISA=AVX2, so it gets the bound of a 4-bit weight format.
BOUND = {"bf16": 0.02, "int8": 0.05, "int4": 0.15, ("vllm", "int8"): 0.15}


def _bound(backend: str, precision: str) -> float:
    return BOUND.get((backend, precision), BOUND[precision])


@pytest.fixture(scope="module")
def actors(ray_session, tiny_model_path, tmp_path_factory):
    rollouts = {(b, p): RolloutActor.remote(b, dict(model_path=tiny_model_path, precision=p, generator_id=f"{b}-{p}"),
                                            1)
                for b, p in KINDS}
    (learner,), setups = start_learners(
        tiny_model_path, LearnerSettings(lr=5e-2, micro_batch_per_rank=16, sequences_per_rank=32,
                                         objective=objective_settings(kl_coeff=0.0)),
        1, str(tmp_path_factory.mktemp("ext")))
    ray.get(setups)
    yield rollouts, learner
    for a in [*rollouts.values(), learner]:
        ray.kill(a)


def test_sync_moves_every_generator(actors, tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rollouts, learner = actors
    old_model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    before = {k: ray.get(a.generate.remote(ITEMS, SAMPLING))[0] for k, a in rollouts.items()}
    greedy_before = {k: _tokens(ray.get(a.generate.remote(ITEMS, GREEDY))[0]) for k, a in rollouts.items()}
    # One real GRPO update with a large learning rate so the weights move visibly.
    groups = before[("torch", "bf16")]
    rewards = torch.tensor([[float(c.token_ids[0] % 2) for c in g.completions] for g in groups])
    groups = [dataclasses.replace(g, advantages=a) for g, a in zip(groups, group_advantages(rewards).tolist())]
    metrics = ray.get(learner.train_step.remote(build_train_batch(groups, 0, SAMPLING.max_new_tokens)))
    assert metrics.policy_version == 1 and metrics.grad_norm > 0
    update = ray.get(learner.publish_weights.remote(1 << 12))  # small buckets: several objects
    assert update.version == 1 and len(update.buckets) > 1
    acks = wait_all([a.load_weights.remote(update) for a in rollouts.values()], 60, "sync")
    assert [a.version for a in acks] == [1] * len(KINDS)
    print("fingerprint gaps:", {a.generator_id: round(a.fingerprint_gap, 4) for a in acks})
    assert all(a.fingerprint_gap < _bound(b, p) for a, (b, p) in zip(acks, rollouts)), acks
    assert all(ray.get(a.info.remote())["version"] == 1 for a in rollouts.values())

    new_model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    new_model.load_state_dict({n: t.float() for n, t in ObjectStoreTransport.receive(update)}, strict=False)
    assert not torch.equal(new_model.lm_head.weight, old_model.lm_head.weight)
    for (b, p), a in rollouts.items():
        assert all(g.policy_version == 0 for g in before[(b, p)])
        after = ray.get(a.generate.remote(ITEMS, SAMPLING))[0]
        assert all(g.policy_version == 1 for g in after)
        gap_new, gap_old = mean_gap(after, new_model), mean_gap(after, old_model)
        print(f"{b} {p}: mean |log mu - log pi| vs new weights {gap_new:.4f}, vs old weights {gap_old:.4f}")
        assert gap_new < _bound(b, p), (b, p, gap_new)
        assert gap_old > 2 * gap_new, (b, p, gap_old, gap_new)
        # before the sync the same generator matched the old weights
        assert mean_gap(before[(b, p)], old_model) < _bound(b, p)

    # Sync the original weights back (as version 2, fingerprinted like any update): the original greedy outputs return.
    from safetensors.torch import load_file

    from qgrpo.rollout.backends.common import probe_ids

    original = load_file(f"{tiny_model_path}/model.safetensors")
    probe = probe_ids(AutoTokenizer.from_pretrained(tiny_model_path))
    with torch.no_grad():
        old_bf16 = old_model.to(torch.bfloat16)
        logprobs = token_logprobs(old_bf16, torch.tensor([probe]))[0, 1:].tolist()
    restore = ObjectStoreTransport(1 << 12).publish(2, original.items(), probe_ids=probe, probe_logprobs=logprobs)
    assert [a.version for a in wait_all([a.load_weights.remote(restore) for a in rollouts.values()], 60, "restore")] \
        == [2] * len(KINDS)
    for k, a in rollouts.items():
        assert _tokens(ray.get(a.generate.remote(ITEMS, GREEDY))[0]) == greedy_before[k], k


def wait_all(refs: list, seconds: float, stage: str) -> list:
    """Results in call order, with the driver's deadline."""
    out = gather({r: f"receiver {i}" for i, r in enumerate(refs)}, seconds, stage, "sync.timeout_s")
    return [out[r] for r in refs]


def _tokens(groups):
    return [c.token_ids for g in groups for c in g.completions]


def test_sync_deadline_raises(ray_session):
    @ray.remote
    def slow_receiver(seconds):
        import time

        time.sleep(seconds)
        return {"version": 1}

    ray.get([slow_receiver.remote(0), slow_receiver.remote(0)])  # worker start-up is not what this test measures
    slow = slow_receiver.remote(60)
    with pytest.raises(StageTimeout, match="weight sync: receiver 1 did not finish within 3 s; raise sync.timeout_s"):
        wait_all([slow_receiver.remote(0), slow], 3.0, "weight sync")
    ray.cancel(slow, force=True)  # free its CPU slot for the tests that follow


def test_a_fingerprint_failure_under_requantize_names_it(ray_session, tiny_model_path):
    """A load whose probe log-probs miss the tolerance stops the sync; under sync.requantize other than nearest the
    error says that the rounding mode may be the cause and what to do (docs/quantization.md)."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from qgrpo.rollout.backends.common import probe_ids

    actor = RolloutActor.remote("torch", dict(model_path=tiny_model_path, precision="int4", generator_id="ef-int4"),
                                1, None, "error_feedback")
    probe = probe_ids(AutoTokenizer.from_pretrained(tiny_model_path))
    update = ObjectStoreTransport(1 << 12).publish(1, load_file(f"{tiny_model_path}/model.safetensors").items(),
                                                   probe_ids=probe,
                                                   probe_logprobs=[-30.0] * (len(probe) - 1))  # no generator matches
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match=r"(?s)correlation.*sync.requantize = 'error_feedback'"
                                                            r".*use sync.requantize = \"nearest\""):
            ray.get(actor.load_weights.remote(update), timeout=120)
    finally:
        ray.kill(actor)
