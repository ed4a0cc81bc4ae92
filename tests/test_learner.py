"""The DeepSpeed learner in-process (one gloo rank): gradient accumulation over micro-batches gives the same update
statistics as one big micro-batch, ZeRO stages train, and the exported weights are what the engine holds."""

import pytest
import torch

from qgrpo.core.devices import dist_backend
from qgrpo.learner.objective.settings import objective_settings
from qgrpo.learner.settings import LearnerSettings
from tests.helpers import group_batch, identical, learner_state, random_batch

pytestmark = pytest.mark.usefixtures("dist_env")  # every test here builds learners in-process (tests/conftest.py)


def _learner(path, micro, zero_stage=0, lr=1e-3):
    from qgrpo.learner.engine import Learner

    return Learner(path, LearnerSettings(lr=lr, micro_batch_per_rank=micro, sequences_per_rank=16,
                                         zero_stage=zero_stage, grad_clip=0.0,
                                         objective=objective_settings(kl_coeff=0.0)))


def test_micro_batch_accumulation_matches_one_batch(tiny_model_path):
    batch = random_batch(32)
    one = _learner(tiny_model_path, micro=16).train_step(batch)
    four = _learner(tiny_model_path, micro=4).train_step(batch)
    assert one.stats["tokens"] == four.stats["tokens"] == batch.total_tokens
    assert four.loss == pytest.approx(one.loss, rel=1e-2, abs=1e-4)
    # Wrong accumulation (e.g. dividing by the number of micro-batches twice) would change the norm by 4x.
    assert four.grad_norm == pytest.approx(one.grad_norm, rel=0.02)
    assert one.grad_norm > 0 and one.policy_version == four.policy_version == 1


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_zero_stages_train_and_export(tiny_model_path, zero_stage):
    # lr 1e-2: an Adam step of 1e-3 is below bf16 resolution for weights near 1 (norm gains) and would not show.
    learner = _learner(tiny_model_path, micro=8, zero_stage=zero_stage, lr=1e-2)
    before = {n: t.clone() for n, t in learner.named_weights()}
    out = learner.train_step(random_batch(32))
    assert out.grad_norm > 0
    after = dict(learner.named_weights())
    assert set(after) == set(before)
    assert all(t.dtype == torch.bfloat16 and t.numel() > 0 for t in after.values())
    assert sum(not torch.equal(before[n], after[n]) for n in before) == len(before)


def test_several_updates_per_batch_make_the_clip_act(tiny_model_path):
    from qgrpo.learner.engine import Learner

    learner = Learner(tiny_model_path, LearnerSettings(
        lr=5e-2, micro_batch_per_rank=8, sequences_per_rank=16, grad_clip=0.0,
        objective=objective_settings(clip_low=0.05, clip_high=0.05, kl_coeff=0.0, updates_per_batch=3)))
    out = learner.train_step(random_batch(32))
    assert out.policy_version == 3
    s = out.stats
    assert s["tokens"] == 3 * random_batch(32).total_tokens  # statistics cover every pass
    assert s["clipped_low"] + s["clipped_high"] > 0, "pi_theta moved away from pi_old after the first update"


@pytest.mark.parametrize("policy_loss", ["gspo", "cispo", "sapo"])
def test_each_policy_loss_trains_with_entropy_and_sequence_corrections(tiny_model_path, policy_loss):
    """Two updates on one batch with each policy loss, a sequence-level masked correction, the entropy bonus and
    top-entropy masking: the step is taken, and the entropy logged is that of the model's distribution (between 0
    and log vocab)."""
    import math

    from qgrpo.learner.engine import Learner
    from qgrpo.learner.objective.loss import finalize_stats

    learner = Learner(tiny_model_path, LearnerSettings(
        lr=1e-2, micro_batch_per_rank=8, sequences_per_rank=16, grad_clip=0.0,
        objective=objective_settings(policy_loss=policy_loss, kl_coeff=0.0, is_level="sequence", is_mode="mask",
                                     is_cap=3.0, entropy_coeff=0.01, top_entropy_quantile=0.5, updates_per_batch=2,
                                     loss_agg="seq_mean" if policy_loss == "gspo" else "token_mean")))
    batch = group_batch(32)
    out = learner.train_step(batch)
    assert out.skipped == "" and out.policy_version == 2 and math.isfinite(out.loss) and out.grad_norm > 0
    m = finalize_stats(out.stats)
    vocab = learner.engine.module.config.vocab_size
    assert 0.0 < m["entropy/mean"] < math.log(vocab)
    assert m["entropy/masked_token_frac"] == pytest.approx(0.5, abs=0.15)  # the lower half of each micro-batch
    # mu_logp = -2 on every token, the model's own log-probs differ: the sequence-level weights are not all 1
    assert 0.0 < m["mismatch/ess"] <= 1.0 and m["mismatch/masked_seq_frac"] + m["is_weight_mean"] > 0


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_shared_prompt_learner_matches_full_forward(tiny_model_path, zero_stage):
    """Through the DeepSpeed engine (bf16), the shared-prompt forward gives the full forward's loss, gradient norm and
    update: a wrong cache hand-off or position would change all three."""
    from qgrpo.learner.engine import Learner

    batch = group_batch(32)
    outs, weights = [], []
    for shared in (False, True):
        learner = Learner(tiny_model_path, LearnerSettings(
            lr=1e-2, micro_batch_per_rank=8, sequences_per_rank=16, grad_clip=0.0, zero_stage=zero_stage,
            objective=objective_settings(kl_coeff=0.0), shared_prompt=shared))
        outs.append(learner.train_step(batch))
        weights.append({n: t.float() for n, t in learner.named_weights()})
    full, shared = outs
    assert shared.stats["tokens"] == full.stats["tokens"] == batch.total_tokens
    assert shared.loss == pytest.approx(full.loss, rel=2e-2, abs=1e-3)
    assert shared.grad_norm == pytest.approx(full.grad_norm, rel=2e-2) and full.grad_norm > 0
    diff = torch.cat([(weights[0][n] - weights[1][n]).abs().flatten() for n in weights[0]])
    # One Adam step of lr 1e-2 moves every weight by ~1e-2 in the direction of its gradient's sign. A weight whose
    # gradient is ~0 may flip sign between the two forwards (bf16 rounding) and differ by 2e-2; a wrong cache hand-off
    # or position flips a large share of them.
    flipped = float((diff > 1.5e-2).float().mean())
    print(f"zero {zero_stage}: {flipped:.2e} of weights moved the other way, mean |diff| {float(diff.mean()):.2e}")
    assert flipped < 2e-3 and float(diff.mean()) < 1e-3


@pytest.mark.parametrize("poison", ["sampler_logprobs", "reference_logprobs", "mismatch"])
def test_guard_skips_the_update_and_leaves_every_bit_unchanged(tiny_model_path, poison):
    """A poisoned batch takes no optimizer step: weights, Adam moments and step, the LR schedule and the policy version
    are bit-identical afterwards, and the reason is reported; the next clean batch trains normally."""
    from dataclasses import replace

    learner = _learner(tiny_model_path, micro=4)
    learner.objective = objective_settings(kl_coeff=0.01)
    batch = random_batch(32)
    batch = replace(batch, ref_logp=-2.0 * batch.completion_mask)
    clean = learner.train_step(batch)  # one real step first (no bound yet): the moments exist
    assert clean.skipped == ""
    # The bound: well above this batch's own mismatch, far below the poisoned one's.
    learner.max_mismatch_kl = 2 * clean.stats["kl_mu_old_sum"] / clean.stats["tokens"] + 0.5
    before, version = learner_state(learner), learner.version
    if poison == "sampler_logprobs":
        mu = batch.mu_logp.clone()
        mu[3, 5] = float("nan")
        bad = replace(batch, mu_logp=mu)
    elif poison == "reference_logprobs":
        ref = batch.ref_logp.clone()
        ref[7, 4] = float("inf")
        bad = replace(batch, ref_logp=ref)
    else:  # a sampler 6 nats less sure of every token than the policy: per-token KL(mu || pi_old) grows ~ e^6
        bad = replace(batch, mu_logp=batch.mu_logp - 6.0 * batch.completion_mask)
    out = learner.train_step(bad)
    assert out.skipped == poison and out.policy_version == version
    after = learner_state(learner)
    assert identical(before[0], after[0]) and identical(before[1], after[1]) and before[2] == after[2]
    assert learner.train_step(batch).skipped == ""
    assert learner.version == version + 1
    assert not identical(before[0], learner_state(learner)[0])


def test_guard_off_takes_the_step(tiny_model_path):
    """With guard.enabled = false a mismatch above the bound is not a reason to skip (the control of the test above)."""
    from dataclasses import replace

    learner = _learner(tiny_model_path, micro=4)
    learner.guard, learner.max_mismatch_kl = False, 0.01
    batch = random_batch(32)
    out = learner.train_step(replace(batch, mu_logp=batch.mu_logp - 6.0 * batch.completion_mask))
    assert out.skipped == "" and learner.version == 1


# ---------------------------------------------------------------- the device (core/devices.py)


def test_process_group_backend_follows_the_learners_device(monkeypatch):
    """A CPU learner on a node whose torch sees GPUs is a gloo learner; a GPU learner an NCCL one."""
    import deepspeed

    from qgrpo.learner import engine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU node
    asked = []
    monkeypatch.setattr(deepspeed, "init_distributed", lambda dist_backend: asked.append(dist_backend))
    engine._init_distributed(torch.device("cpu"))
    engine._init_distributed(torch.device("cuda", 0))
    assert asked == ["gloo", "nccl"] and dist_backend(torch.device("cuda", 0)) == "nccl"


def _two_rank_group(peer: list, monkeypatch) -> None:
    """Make this one-rank process group act as a two-rank one whose other rank issued the collectives in `peer`
    ((tensor, op) as it passed them, in order): each all-reduce adds the other rank's tensor, or takes the minimum,
    as asked. Like a real group it refuses a collective the other rank did not issue (different shape or op: a real
    group would hang there) and, like gloo and NCCL, a tensor off the device the group serves (`collective_device`)."""
    from qgrpo.core.devices import collective_device

    MIN = torch.distributed.ReduceOp.MIN

    def all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        assert tensor.device == collective_device(), f"a {tensor.device} tensor for a {collective_device()} group"
        assert peer, f"the other rank issued no all-reduce of {tuple(tensor.shape)} here"
        other, other_op = peer.pop(0)
        assert (other.shape, other_op) == (tensor.shape, op), (other.shape, other_op, tensor.shape, op)
        tensor.copy_(torch.minimum(tensor, other) if op == MIN else tensor + other)

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)


@pytest.mark.parametrize("poison", ["sampler_logprobs", "mismatch"])
def test_a_poisoned_shard_on_one_rank_skips_the_update_on_every_rank(tiny_model_path, monkeypatch, poison):
    """The guard decides on checks all-reduced over the ranks, so the ranks skip an update together. The other rank
    of a two-rank group is this learner's own collectives on a poisoned shard, recorded, then replayed into the
    collectives of a clean shard (`_two_rank_group`): the clean rank skips for the other rank's reason, and its
    weights, Adam moments and LR schedule stay bit-identical. A rank that decided on its own checks would step (or
    skip for another reason). The group takes only tensors on the device it serves: CPU ones under gloo here; under
    NCCL CUDA ones, as tests/test_cuda.py runs on a GPU."""
    from dataclasses import replace

    learner = _learner(tiny_model_path, micro=4)
    batch = random_batch(32)
    clean = learner.train_step(batch)  # one real step first: the moments exist
    assert clean.skipped == ""
    learner.max_mismatch_kl = 2 * clean.stats["kl_mu_old_sum"] / clean.stats["tokens"] + 0.5
    if poison == "sampler_logprobs":
        mu = batch.mu_logp.clone()
        mu[3, 5] = float("nan")
        bad = replace(batch, mu_logp=mu)
    else:  # a sampler 6 nats less sure of every token than the policy
        bad = replace(batch, mu_logp=batch.mu_logp - 6.0 * batch.completion_mask)
    before, version = learner_state(learner), learner.version

    peer, real = [], torch.distributed.all_reduce

    def record(tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        peer.append((tensor.clone(), op))
        return real(tensor, op=op, group=group, async_op=async_op)

    with monkeypatch.context() as m:
        m.setattr(torch.distributed, "all_reduce", record)
        assert learner.train_step(bad).skipped == poison  # the other rank, on its own
    assert peer
    with monkeypatch.context() as m:
        _two_rank_group(peer, m)
        out = learner.train_step(batch)
    assert out.skipped == poison and out.policy_version == version and not peer
    after = learner_state(learner)
    assert identical(before[0], after[0]) and identical(before[1], after[1]) and before[2] == after[2]
    assert learner.train_step(batch).skipped == "" and learner.version == version + 1  # alone again: it steps


def test_batch_moves_every_tensor_to_the_learners_device():
    """DeepSpeed moves the model, never the inputs: train_step moves the batch (TrainBatch.to) before the first
    forward. Every tensor goes, the optional ones too (a field left behind would meet a GPU model on the CPU), and
    the plain numbers stay as they are. Here the target is the meta device, the one other than the CPU that every
    machine has; tests/test_cuda.py trains a GPU learner on a CPU batch, as the driver sends it."""
    from dataclasses import fields, replace

    from qgrpo.learner.batch import TrainBatch

    batch = group_batch(32)
    batch = replace(batch, ref_logp=-1.0 * batch.completion_mask,
                    seq_lens=batch.prompt_lens + batch.completion_mask.sum(-1).long(),
                    token_versions=torch.zeros_like(batch.input_ids))
    assert all(getattr(batch, f.name) is not None for f in fields(TrainBatch))  # every field is set, so checked
    moved = batch.to("meta")
    for f in fields(TrainBatch):
        was, now = getattr(batch, f.name), getattr(moved, f.name)
        if torch.is_tensor(was):
            assert now.device.type == "meta" and now.shape == was.shape and now.dtype == was.dtype, f.name
        else:
            assert now == was, f.name


def test_fake_quant_learner_scores_like_its_int4_generators_and_trains(tiny_model_path, monkeypatch):
    """learner.fake_quant = "rollout" in the real learner: its log-probs are the int4 generator's on the same weights
    (pi_old = mu up to kernels), where the bf16 learner's are not, and an update still moves the weights."""
    import math

    # A ZeRO-3 learner built earlier in this process replaced torch.nn.functional.linear for good (DeepSpeed: "This
    # will persist unless manually reset"), and its replacement transposes the weight, which torchao's int4 tensor
    # does not implement. Generators and learners live in separate processes in a run; here they share one.
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as ZeroInit

    if hasattr(ZeroInit, "linear_bk"):
        monkeypatch.setattr(torch.nn.functional, "linear", ZeroInit.linear_bk)

    from qgrpo.learner.engine import Learner
    from qgrpo.rollout.backends import served_grid
    from qgrpo.rollout.backends.torch_backend import TorchGenerator

    generator = TorchGenerator(tiny_model_path, precision="int4")
    vocab = generator.model.config.vocab_size
    ids = torch.randint(3, vocab, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    gen = generator.score(ids)
    settings = dict(lr=1e-2, micro_batch_per_rank=16, sequences_per_rank=16, grad_clip=0.0,
                    objective=objective_settings(kl_coeff=0.0))
    plain = Learner(tiny_model_path, LearnerSettings(**settings)).score(ids)
    learner = Learner(tiny_model_path, LearnerSettings(**settings, fake_quant_grid=served_grid("torch", "int4", 64),
                                                       fake_quant_head=True))
    simulated = learner.score(ids)
    gap = sum(abs(a - b) for a, b in zip(simulated, gen)) / len(gen)
    plain_gap = sum(abs(a - b) for a, b in zip(plain, gen)) / len(gen)
    assert gap < 2e-3 and gap < plain_gap / 5, (gap, plain_gap)
    before = {n: p.detach().clone() for n, p in learner.engine.module.named_parameters()}
    out = learner.train_step(random_batch(vocab))
    assert out.skipped == "" and out.policy_version == 1 and math.isfinite(out.loss) and out.grad_norm > 0
    moved = [n for n, p in learner.engine.module.named_parameters() if not torch.equal(p, before[n])]
    assert "model.layers.0.mlp.up_proj.weight" in moved and "lm_head.weight" in moved
