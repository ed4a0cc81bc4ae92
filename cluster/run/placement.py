"""The Ray side of placement: the learner ranks' placement group, and waiting (with a visible message and a deadline)
while a busy cluster cannot give the resources yet. What each role asks for, and whether the cluster can ever give it,
is planned in cluster/config/plan.py before any of this runs."""
from __future__ import annotations

import sys
import time

from qgrpo.cluster.config.plan import RoleRequest

WAIT_MESSAGE_S = 30.0


def learner_group(r: RoleRequest):
    """The learner ranks' placement group (created, not yet waited for)."""
    from ray.util.placement_group import placement_group

    return placement_group([r.bundle() or {"CPU": 0.001}] * r.count, strategy=r.strategy or "PACK",
                           bundle_label_selector=[dict(r.labels)] * r.count if r.labels else None)


def wait_scheduled(pending: dict, seconds: float, what: str, message_every: float = WAIT_MESSAGE_S) -> None:
    """{ref: name} -> wait until every ref is ready or `seconds` pass; says every `message_every` what it waits for.
    Raises TimeoutError naming the roles still waiting and the setting to raise."""
    import ray

    refs, t0 = list(pending), time.monotonic()
    deadline, said = t0 + seconds, t0
    while refs:
        _, refs = ray.wait(refs, num_returns=len(refs), timeout=min(message_every, max(deadline - time.monotonic(), 0)))
        if not refs:
            return
        now = time.monotonic()
        names = ", ".join(sorted({pending[r] for r in refs}))
        if now >= deadline:
            raise TimeoutError(f"{what}: {names} could not be placed within {seconds:.0f} s "
                               "(faults.schedule_timeout_s): the cluster has the resources but they stay busy; free "
                               "them, add nodes, or raise faults.schedule_timeout_s")
        if now - said >= message_every * 0.9:
            print(f"qgrpo: waiting {now - t0:.0f} s for the cluster to free resources for {names} "
                  f"(giving up in {deadline - now:.0f} s, faults.schedule_timeout_s)", file=sys.stderr)
            said = now
