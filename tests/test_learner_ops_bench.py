"""bench/learner_ops.py's accounting: a profiled forward, backward and optimizer step of a small stand-in model lands
in the buckets it should (the decoder's and the head's products, the optimizer), and the buckets add up to the
profiled time: no operator counted twice, waits of an idle thread left out."""
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import learner_ops  # noqa: E402

VOCAB = 97


def test_buckets_add_up_and_name_the_head_and_the_optimizer():
    torch.manual_seed(0)
    trunk, head = torch.nn.Linear(256, 256), torch.nn.Linear(256, VOCAB, bias=False)
    opt = torch.optim.AdamW([*trunk.parameters(), *head.parameters()], lr=1e-3)
    x, y = torch.randn(2048, 256), torch.randint(0, VOCAB, (2048,))

    def step():
        logits = head(torch.relu(trunk(x)))
        torch.nn.functional.cross_entropy(logits, y).backward()
        opt.step()
        opt.zero_grad()

    step()
    idle = threading.Thread(target=threading.Event().wait, args=(0.5,))  # only waits, on a lock, meanwhile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof:
        idle.start()
        t0 = time.perf_counter()
        step()
        wall = time.perf_counter() - t0
        idle.join()  # its 0.5 s wait ends after the step: counted, it would exceed the step's wall time
    seconds, flops = defaultdict(float), defaultdict(float)
    for e in prof.events():
        k = learner_ops.bucket(e, VOCAB)
        if k != "waiting":
            seconds[k] += e.self_cpu_time_total / 1e6
        if e.name in learner_ops.MATMULS:
            flops[k] += learner_ops.matmul_flops(e)
    assert set(seconds) <= set(learner_ops.BUCKETS), set(seconds) - set(learner_ops.BUCKETS)
    # The head's product (256 x 97) forward and its two backward products, the trunk's likewise.
    assert flops["matmul: log-prob head"] >= 3 * 2 * 2048 * 256 * VOCAB * 0.99, flops
    assert flops["matmul: decoder"] > 0 and seconds["optimizer"] > 0, seconds
    # Each event's own time once: the buckets never exceed the wall time of the step (the idle thread's wait out).
    # (20 ms of slack: the profiler's own events around the step.)
    assert 0 < sum(seconds.values()) <= wall + 0.02, (sum(seconds.values()), wall)


def test_the_plain_linear_heads_own_forward_and_backward_are_the_heads():
    """The fused head (core/scoring.py's _LinearHeadLogprobs: its softmax and gradient formed by hand, not by autograd
    nodes) is counted as the head: its products (forward, the backward's recomputation, two gradient products) in
    "matmul: log-prob head", its exp, subtractions and scatter in the head's own bucket, none in "elementwise"."""
    from qgrpo.core import scoring

    torch.manual_seed(0)
    head = torch.nn.Linear(256, VOCAB, bias=False)
    assert scoring._plain_linear(head)
    h, y = torch.randn(512, 256, requires_grad=True), torch.randint(0, VOCAB, (512,))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof:
        lp, ent = scoring.head_logprobs(head, h, y, 0.7, with_entropy=True, chunk=128)
        (lp.sum() + ent.sum()).backward()
    flops, softmax = defaultdict(float), defaultdict(int)
    for e in prof.events():
        k = learner_ops.bucket(e, VOCAB)
        if e.name in learner_ops.MATMULS:
            flops[k] += learner_ops.matmul_flops(e)
        if e.name in ("aten::exp", "aten::exp_", "aten::amax", "aten::gather", "aten::scatter_add_", "aten::tanh"):
            softmax[k] += 1
    assert flops["matmul: log-prob head"] >= 4 * 2 * 512 * 256 * VOCAB * 0.99, flops
    # 4 chunks: exp, amax, gather forward and exp, scatter in the backward, each once per chunk
    assert set(softmax) == {"log-prob head (softmax, gather)"} and sum(softmax.values()) >= 20, dict(softmax)
