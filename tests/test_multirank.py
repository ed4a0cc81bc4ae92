"""Two DeepSpeed ranks (two Ray actors, one gloo group) on the same batch as one rank: the loss adds up, the
gradient norm matches (so the global normalisation and DeepSpeed's averaging cancel as intended), and under ZeRO-3
the exported weights are full tensors."""
import pytest
import ray

from qgrpo.actors.weights import ObjectStoreTransport
from tests.helpers import random_batch, start_ranks


@pytest.mark.parametrize("zero_stage", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_two_ranks_match_one(ray_session, tiny_model_path, tmp_path, zero_stage):
    batch = random_batch(32)
    one = start_ranks(tiny_model_path, 1, zero_stage, str(tmp_path))
    two = start_ranks(tiny_model_path, 2, zero_stage, str(tmp_path))
    try:
        (r1,) = ray.get([a.train_step.remote(batch) for a in one])
        r2 = ray.get([a.train_step.remote(batch.shard(i, 2)) for i, a in enumerate(two)])
        assert sum(r.stats["tokens"] for r in r2) == r1.stats["tokens"] == batch.total_tokens
        assert sum(r.loss for r in r2) == pytest.approx(r1.loss, rel=1e-2, abs=1e-4)
        assert r2[0].grad_norm == pytest.approx(r1.grad_norm, rel=0.02)
        updates = ray.get([a.publish_weights.remote(1 << 20) for a in two])
        assert updates[1] is None and updates[0].version == 1
        full = dict(ObjectStoreTransport.receive(updates[0]))
        single = dict(ObjectStoreTransport.receive(ray.get(one[0].publish_weights.remote(1 << 20))))
        assert {n: t.shape for n, t in full.items()} == {n: t.shape for n, t in single.items()}
    finally:
        for a in one + two:
            ray.kill(a)
