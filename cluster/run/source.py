"""What the rollout stream (cluster/run/stream.py) dispatches to: a rollout source. Two implement it, the rollout pool
(cluster/run/workers.py: RolloutPool, a chunk is one generation call on a rollout actor) and the agent episodes
(cluster/run/agents.py: AgentEpisodes, a chunk is one row's episodes played by the agent runner against the endpoint).

The stream's pump is the only thread that calls a source's processes once the stream is open: a source needs no
lock, and the driver's own operations on the pool (a weight sync, a resize, the precision ladder) run on the pump as
jobs (RolloutStream.on_pump). `split` and `free_slots` are pure (no call to a process, no change): the stream calls
them under its own lock when it draws and picks. A source supervises its processes itself (cluster/run/supervisor.py):
`collect` returns None for a chunk whose process failed, which the stream sends again, first.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from qgrpo.core.records import GenerationStats, GroupRollout, PromptItem, SamplingParams


@dataclass(eq=False)
class Call:
    """One chunk in flight on a source (`submit`)."""

    ref: Any  # what `wait` waits on (a Ray object ref)
    slot: int  # the process's place in the source
    prompt_ids: tuple[str, ...]
    step: int  # the generators' (1-based) step, for messages
    sent: float  # time.monotonic() when sent: its deadline runs from here
    deadline_s: float  # how long it may run (the source's own deadline for its kind of work)
    held_out: bool = False  # a held-out evaluation's, not a training step's


@dataclass
class ChunkResult:
    """A finished chunk: its groups (in prompt order), the generation's stats, and metrics to sum over the step's
    chunks (agent/*; none for the pool)."""

    groups: list[GroupRollout]
    stats: GenerationStats
    metrics: dict = field(default_factory=dict)


class RolloutSource(Protocol):
    def own(self, owner: int | None) -> None:
        """From now on only thread `owner` calls the source, and the pool under it (None: any)."""

    def split(self, items: list[PromptItem]) -> list[list[PromptItem]]:
        """A draw's prompts as chunks (whole groups each)."""

    def free_slots(self, busy: set[int]) -> list[int]:
        """The slots that may take a chunk now (`busy`: those with one in flight), best first."""

    def submit(self, slot: int, items: list[PromptItem], sampling: SamplingParams, step: int,
               held_out: bool = False) -> Call:
        """Send one chunk; returns once it is on its way."""

    def wait(self, calls: list[Call], timeout: float) -> list[Call]:
        """The calls done, waiting up to `timeout` seconds for the first."""

    def collect(self, call: Call) -> ChunkResult | None:
        """A finished call's result; None where its process failed (counted, replaced): send it again."""

    def overdue(self, calls: list[Call]) -> None:
        """Act on calls past their own deadline (raise StageTimeout, or replace a blocked process)."""

    def announce(self) -> list[tuple[dict, str]]:
        """(an event for the run log, a line for stderr) to say when the run starts."""

    def close(self) -> None:
        """End what the source started for the stream (the pool's actors are the workers' to end)."""
