import torch

from qgrpo.actors.weights import pack_buckets, unpack_bucket


def test_buckets_roundtrip_exactly():
    torch.manual_seed(0)
    named = [(f"w{i}", torch.randn(i + 3, 17).to(torch.bfloat16)) for i in range(10)]
    named.append(("f32", torch.randn(5)))
    buckets = list(pack_buckets(named, bucket_bytes=400))
    assert len(buckets) > 1, "small bucket size must split the stream"
    back = [x for b in buckets for x in unpack_bucket(b)]
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, a), (_, b) in zip(named, back):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_one_bucket_when_it_fits():
    named = [("a", torch.ones(4, 4, dtype=torch.bfloat16)), ("b", torch.zeros(8, dtype=torch.bfloat16))]
    assert len(list(pack_buckets(named, bucket_bytes=1 << 20))) == 1
