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
