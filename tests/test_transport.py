"""The collective weight transport on real Ray + a real DeepSpeed learner (tiny model) and real rollout actors (torch
bf16 and int8): after a broadcast every actor reports the version and passes the fingerprint check, and the bf16
actor holds exactly the weights the object-store transport delivers for the same version; the group forms again
after a member is killed and after one is added (which first loads the published version, not the learner's newer
one); a member that dies mid-broadcast makes the sync raise instead of hanging; `sync.transport=collective` runs the
real job end to end."""
import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
import ray
import torch

from qgrpo.actors.collective import CollectiveGroup, CollectiveMember
from qgrpo.actors.learner_actor import start_learners
from qgrpo.actors.rollout_actor import RolloutActor
from qgrpo.actors.weights import ObjectStoreTransport
from qgrpo.cluster.run.supervisor import RunFailed, gather
from qgrpo.core.records import PromptItem, SamplingParams
from qgrpo.learner.batch import build_train_batch
from qgrpo.learner.objective.advantages import group_advantages
from qgrpo.learner.objective.settings import objective_settings
from qgrpo.learner.settings import LearnerSettings

ROOT = Path(__file__).resolve().parents[1]
ITEMS = [PromptItem(f"p{i}", f"{i % 5}+{(3 * i) % 5}=", str(i % 5 + (3 * i) % 5)) for i in range(8)]
SAMPLING = SamplingParams(group_size=4, max_new_tokens=4, temperature=1.0, seed=7)
BUCKET = 1 << 12  # small buckets: several broadcasts per sync
DEADLINE = 60.0  # per sync; the dying-member test uses a shorter group timeout
BOUND = {"bf16": 0.02, "int8": 0.05}  # fingerprint gaps, as in tests/test_sync.py


def _learner(model_path: str, ext_dir: str):
    (learner,), setups = start_learners(model_path, LearnerSettings(lr=5e-2, micro_batch_per_rank=16,
                                                                    sequences_per_rank=32,
                                                                    objective=objective_settings(kl_coeff=0.0)),
                                        1, ext_dir)
    ray.get(setups)
    return learner


def _rollout(model_path: str, precision: str, name: str, update=None):
    return RolloutActor.remote("torch", dict(model_path=model_path, precision=precision, generator_id=name), 1, update)


def _wait(calls: dict, seconds: float, stage: str) -> dict:
    return gather(calls, seconds, stage, "sync.timeout_s")


def _train_step(learner, rollout) -> int:
    """One real GRPO update with a large learning rate, so the weights move visibly; returns the new version."""
    groups, _ = ray.get(rollout.generate.remote(ITEMS, SAMPLING))
    rewards = torch.tensor([[float(c.token_ids[0] % 2) for c in g.completions] for g in groups])
    groups = [dataclasses.replace(g, advantages=a) for g, a in zip(groups, group_advantages(rewards).tolist())]
    return ray.get(learner.train_step.remote(build_train_batch(groups, 0, SAMPLING.max_new_tokens))).policy_version


def _master_weights(actor) -> dict[str, torch.Tensor]:
    """The weights a bf16 torch generator serves, read inside the actor (a test-only look, not an actor method); a
    layer packed for oneDNN (a float32 CPU) read back from its packed weight."""
    from qgrpo.rollout.backends.onednn import served_state_dict

    return ray.get(actor.__ray_call__.remote(
        lambda self: {n: t.clone() for n, t in served_state_dict(self.gen.model).items()}))


@pytest.fixture(scope="module")
def job(ray_session, tiny_model_path, tmp_path_factory):
    learner = _learner(tiny_model_path, str(tmp_path_factory.mktemp("ext")))
    actors = {"bf16": _rollout(tiny_model_path, "bf16", "torch-bf16"),
              "int8": _rollout(tiny_model_path, "int8", "torch-int8")}
    ray.get([learner.version.remote(), *[a.info.remote() for a in actors.values()]])  # start-up is not under test
    yield learner, actors
    for a in [learner, *actors.values()]:
        ray.kill(a)


def test_actors_import_this_worktree(job):
    learner, actors = job
    here = ray.get(actors["bf16"].__ray_call__.remote(
        lambda self: __import__("qgrpo.actors.collective").actors.collective.__file__))
    assert Path(here).resolve().parent.parent == ROOT


def test_collective_sync_delivers_what_the_object_store_delivers(job, tiny_model_path):
    learner, actors = job
    version = _train_step(learner, actors["bf16"])
    assert version == 1
    group = CollectiveGroup(_wait)
    update, acks = group.sync([learner], list(actors.values()), list(actors), BUCKET, DEADLINE)
    assert update.version == 1 and update.num_buckets > 1 and update.buckets == []
    assert [a.version for a in acks] == [1, 1]
    assert all(a.fingerprint_gap < BOUND[p] for a, p in zip(acks, actors)), acks
    assert all(ray.get(a.info.remote())["version"] == 1 for a in actors.values())
    after = ray.get(actors["int8"].generate.remote(ITEMS, SAMPLING))[0]
    assert {g.policy_version for g in after} == {1}

    # The same version through the object store: the bytes sent, and the bf16 weights they make, are identical.
    sent = dict(ObjectStoreTransport.receive(ray.get(learner.publish_weights.remote(BUCKET))))
    held = _master_weights(actors["bf16"])
    assert set(sent) <= set(held)
    assert all(torch.equal(held[n], t) for n, t in sent.items())
    fresh = _rollout(tiny_model_path, "bf16", "torch-bf16-os", ray.get(learner.publish_weights.remote(BUCKET)))
    other = _master_weights(fresh)
    assert held.keys() == other.keys() and all(torch.equal(held[n], other[n]) for n in held)
    untouched = _rollout(tiny_model_path, "bf16", "torch-bf16-initial")
    initial = _master_weights(untouched)
    assert not all(torch.equal(held[n], initial[n]) for n in held)  # the sync did move the weights
    ray.kill(fresh)
    ray.kill(untouched)


def test_group_forms_again_after_a_kill_and_an_add(job, tiny_model_path):
    learner, actors = job
    group = CollectiveGroup(_wait)
    group.sync([learner], list(actors.values()), list(actors), BUCKET, DEADLINE)
    first = group.generation
    published = ray.get(learner.version.remote())

    ray.kill(actors.pop("int8"))  # a lost member: the next sync forms a group of the survivors
    update, acks = group.sync([learner], [actors["bf16"]], ["bf16"], BUCKET, DEADLINE)
    assert group.generation == first + 1 and [a.version for a in acks] == [published] == [update.version]

    assert _train_step(learner, actors["bf16"]) == published + 1  # the learner moves past what was published
    added = _rollout(tiny_model_path, "int8", "torch-int8.1", group.last_published(DEADLINE))
    actors["int8"] = added  # the fixture kills it
    groups, stats = ray.get(added.generate.remote(ITEMS, SAMPLING))
    assert {g.policy_version for g in groups} == {published} and stats.policy_version == published
    assert ray.get(added.last_load.remote()).fingerprint_gap < BOUND["int8"]

    update, acks = group.sync([learner], [actors["bf16"], added], ["bf16", "int8.1"], BUCKET, DEADLINE)
    assert group.generation == first + 2
    assert update.version == published + 1 and [a.version for a in acks] == [published + 1] * 2


@ray.remote
class DiesMidBroadcast(CollectiveMember):
    """A member that takes the manifest and dies before the buckets arrive (a node lost mid-sync)."""

    def receive_weights(self):
        t = self._collective()
        n = t._broadcast(torch.empty(1, dtype=torch.int64))
        t._broadcast(torch.empty(int(n), dtype=torch.uint8))
        os._exit(1)


@pytest.mark.timeout(300)  # a hang fails here instead of stalling the suite
def test_member_dying_mid_broadcast_fails_the_sync(job):
    learner, actors = job
    group = CollectiveGroup(_wait)
    doomed = DiesMidBroadcast.remote()
    # The group's operations time out after 20 s; the sync must fail on the death itself, before its deadline.
    with pytest.raises(RunFailed, match=r"weight sync \(collective\): (doomed|learner rank 0) failed") as e:
        group.sync([learner], [actors["bf16"], doomed], ["bf16", "doomed"], BUCKET, 20.0)
    assert "did not finish within" not in str(e.value)  # not the deadline: the failure itself
    assert group.members == []  # forgotten: the next sync forms a new group
    # The survivors' broken broadcasts end at the group timeout; then a new group of them works.
    update, acks = group.sync([learner], [actors["bf16"]], ["bf16"], BUCKET, DEADLINE)
    assert [a.version for a in acks] == [update.version]


def test_transport_is_validated():
    from qgrpo.cluster.config.schema import Config, validate

    cfg = Config()
    cfg.sync.transport = "nccl"
    assert [p for p in validate(cfg) if p.startswith("sync.")] == \
        ["sync.transport: must be 'object_store' or 'collective', got 'nccl'"]


@pytest.mark.slow  # ~1 min; `make test-slow`
def test_train_end_to_end_with_the_collective_transport(ray_session, tiny_model_path, tmp_path, monkeypatch):
    """A 3-step job with sync.transport=collective, one of its two rollout actors killed at step 2: the replacement
    loads the published version from learner rank 0 before it serves, and the next sync forms the group again."""
    from qgrpo.cluster.cli.app import main

    monkeypatch.setenv("QGRPO_FAULTS", "rollout.kill@2")
    (tmp_path / "fault-state").mkdir()
    monkeypatch.setenv("QGRPO_FAULTS_STATE", str(tmp_path / "fault-state"))
    out = tmp_path / "runs"
    sets = [f"model.path='{tiny_model_path}'", f"run.output_dir='{out}'", "run.progress=false", "run.eval=false",
            "run.tensorboard=false", "rollout.prompts_per_step=8", "rollout.group_size=8", "run.steps=3",
            "rollout.num_actors=2", "sync.transport='collective'", "sync.timeout_s=60"]
    assert main(["train", str(ROOT / "configs" / "tiny.toml"), *[a for s in sets for a in ("--set", s)]]) == 0
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in rows if "reward/mean" in m]
    assert [m["rollout/policy_versions"] for m in steps] == [[0], [1], [2]]
    for m in steps:
        assert m["sync/buckets"] >= 1 and m["sync/nbytes"] > 0 and math.isfinite(m["sync/fingerprint_gap_max"])
    (replaced,) = [e for e in rows if e.get("event") == "rollout_actor_replaced"]
    assert replaced["step"] == 2 and replaced["weights_version"] == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_nccl_broadcast_between_two_gpus(ray_session):
    """The NCCL side of the same code: one bucket of bf16 weights from a GPU to a GPU, bit for bit."""
    from qgrpo.actors.weights import unpack_buckets

    @ray.remote(num_gpus=1)
    class Member(CollectiveMember):
        def host(self):
            return self._collective().host(30.0)

        def send(self, named):
            return self._collective().publish(1, [(n, t.cuda()) for n, t in named], 1 << 20, [], []).version

        def receive(self):
            _, buckets, _ = self._collective().receive()
            return dict(unpack_buckets(buckets))

    a, b = Member.remote(), Member.remote()
    addr, port = ray.get(a.host.remote())
    ray.get([m.collective_join.remote(addr, port, 1, r, 2, 30.0, "cuda") for r, m in enumerate((a, b))])
    named = [("w", torch.randn(64, 64).to(torch.bfloat16)), ("b", torch.randn(64).to(torch.bfloat16))]
    got, version = ray.get([b.receive.remote(), a.send.remote(named)])
    assert version == 1 and all(torch.equal(got[n], t) for n, t in named)
