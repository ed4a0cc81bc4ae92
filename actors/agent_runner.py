"""The Ray actor that plays agent episodes (rollout/agents/): the user's async function, many episodes at once on
one event loop, at most environment.concurrency of them, each against its own session of the endpoint. It runs off
the driver so that an agent that blocks its event loop or crashes its process costs its episodes, not the run: the
rollout supply waits for a batch of episodes with a deadline and replaces a runner that passed it; a runner whose
process dies is replaced and its batches' episodes are played again from their start (cluster/run/agents.py)."""
from __future__ import annotations

import asyncio
import os
import signal

import ray

from qgrpo.core import faults
from qgrpo.rollout.agents.contract import AgentClient, Outcome, load_agent, play


class _AgentRunner:
    def __init__(self, spec, concurrency: int):
        """`spec`: the EnvSpec of environment.name (its file's source travels in it)."""
        self.spec, self.concurrency = spec, concurrency
        self.fn = load_agent(spec)
        self.sem: asyncio.Semaphore | None = None

    async def run(self, episodes: list[tuple[dict, AgentClient]], timeout_s: float, step: int = 0,
                  held_out: bool = False) -> list[Outcome]:
        """Each (row, client) played once, at most `concurrency` at a time; an Outcome per episode, in order.
        `step`: the generators' (1-based) step, or for `held_out` episodes the steps trained, for the drills of
        core/faults.py."""
        if self.sem is None:
            self.sem = asyncio.Semaphore(self.concurrency)
        kill = faults.fires("agent_runner.kill_eval" if held_out else "agent_runner.kill", step)

        async def one(row: dict, client: AgentClient) -> Outcome:
            async with self.sem:
                out = await play(self.fn, row, client, timeout_s, self.spec.params)
            if kill:  # a drill: this process dies with the batch's other episodes in flight
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        return list(await asyncio.gather(*(one(r, c) for r, c in episodes)))

    async def ready(self) -> bool:
        return True


AgentRunner = ray.remote(num_cpus=0, max_concurrency=1000)(_AgentRunner)
