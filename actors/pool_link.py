"""The rollout pool (cluster/run/workers.py: RolloutPool) as a process other than the driver calls it: the endpoint
actor (actors/endpoint_actor.py) sends an agent's calls through a PoolLink, never to a raw actor handle.

The link keeps what the pool does for the stream's calls: each call has the generation deadline
(faults.generate_timeout_s); a failure is reported back (`take_reports`, fetched by whoever holds the pool: the
rollout supply), which counts it (`RolloutPool.failed`), replaces an actor whose process is gone and pushes the new
handles (`update`). A call whose actor died waits for the replacement and is sent to it again, within its deadline:
the replacement has loaded the same weights, and an agent's call is a pure function of its prompt and sampling, so
the episode goes on where it was and loses nothing. A call past its deadline (a hung generator) is reported as such
and fails; the supply ends the run at the step boundary, as it does for a hung generate.
"""
from __future__ import annotations

import asyncio
import time

import ray

from qgrpo.actors.ray_errors import fault_of

POLL_S = 0.05


class LinkError(RuntimeError):
    """A call the pool could not serve (its actor hung, or was not replaced within the deadline)."""


def actor_id(handle) -> str:
    return handle._actor_id.hex()


class PoolLink:
    """The actors' handles as the pool last pushed them, and the calls' outcomes for the pool to count."""

    def __init__(self, actors: list, timeout_s: float = 600.0):
        self.actors = list(actors)
        self.timeout_s = timeout_s
        self.reports: list[dict] = []  # failures not yet taken by the pool's holder
        self.served: set[int] = set()  # slots that answered since the last take (their failures in a row end)

    @property
    def slots(self) -> int:
        return len(self.actors)

    def follow(self, link: PoolLink) -> None:
        """Take the actors of the pool's newer link (after a replacement, a resize, the precision ladder); the calls,
        reports and deadline stay this link's."""
        self.actors = list(link.actors)

    async def serving(self) -> dict:
        """What the endpoint needs of the generators: precision, version, stop tokens (actor 0's)."""
        return await self.actors[0].serving.remote()

    async def complete(self, slot: int, sequences: list[list[int]], sampling) -> tuple[int, list]:
        """`RolloutActor.complete` on the actor at `slot`, within the deadline; sent again to the replacement of an
        actor that died meanwhile."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            handle = self.actors[slot % len(self.actors)]
            try:
                out = await asyncio.wait_for(_awaitable(handle.complete.remote(sequences, sampling)),
                                             max(deadline - time.monotonic(), 0.01))
            except asyncio.TimeoutError:
                why = f"no answer within {self.timeout_s:.0f} s (faults.generate_timeout_s)"
                self._report(slot, handle, why, dead=False, hung=True)
                raise LinkError(f"the rollout actor serving this session gave {why}; the run stops at this "
                                "step") from None
            except ray.exceptions.RayError as e:  # the supervisor's policy (cluster/run/supervisor.py), reported
                fault = fault_of(e)
                if fault is None:
                    raise
                self._report(slot, handle, fault.cause, dead=fault.gone)
                if not fault.gone:  # the work failed in a live actor: the call fails
                    raise
                if not await self._replaced(slot, handle, deadline):
                    raise LinkError("the rollout actor serving this session died and was not replaced within "
                                    f"{self.timeout_s:.0f} s (faults.generate_timeout_s)") from None
                continue
            self.served.add(slot % len(self.actors))
            return out

    async def _replaced(self, slot: int, handle, deadline: float) -> bool:
        gone = actor_id(handle)
        while time.monotonic() < deadline:
            if actor_id(self.actors[slot % len(self.actors)]) != gone:
                return True
            await asyncio.sleep(POLL_S)
        return False

    def _report(self, slot: int, handle, cause: str, dead: bool, hung: bool = False) -> None:
        self.reports.append({"slot": slot % len(self.actors), "actor_id": actor_id(handle), "cause": cause,
                             "dead": dead, "hung": hung})

    async def take_reports(self, wait_s: float) -> dict:
        """{"failures": [...], "served": [slots]}: what happened since the last take, waiting up to `wait_s` for a
        failure (a long poll: the holder keeps one in flight and learns of a death at once)."""
        deadline = time.monotonic() + wait_s
        while not self.reports and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        out = {"failures": self.reports, "served": sorted(self.served)}
        self.reports, self.served = [], set()
        return out


async def _awaitable(ref):
    return await ref
