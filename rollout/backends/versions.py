"""Which policy version sampled which tokens of a completion: one record, `VersionSpans`, for every backend.

With in-flight weight updates (algo.max_staleness > 0) a load may land between two decode steps, so the tokens of one
completion can come from more than one policy version. Each generator records that the same way, as change points
[(first token, version), ...]: the first at token 0 (the version the call began with), then one where a later version
took over; a version's span runs to the next point's token (two points may share a token: a span of no tokens).

- torch and MLX: the Generator base class starts one per call (`Generator._versions_start`) and its `_boundary` adds
  a change point where a load landed between two decode steps; all the call's rows share it.
- vLLM: each completion's own `CompletionOutput.weight_versions` spans become one (vllm_backend.py, one line).
- multi-turn episodes (rollout/episodes.py): a trajectory's spans gather its model turns' versions at their offsets
  in the trajectory (an environment's tokens carry the version of the model turn before them).

`token_versions` is the one conversion to a Completion's token_versions (per-token versions, None where every token
is the reference version: the group's policy_version). Pure Python, nothing imported.
"""
from __future__ import annotations

from typing import Iterable, Iterator


class VersionSpans:
    """Change points [(first token, version), ...] of one completion's tokens (or of one call's rows, which share
    them). `VersionSpans(v)` starts at version `v` at token 0; `VersionSpans()` is empty until its first change;
    iterating yields the points."""

    __slots__ = ("points",)

    def __init__(self, version: int | None = None, changes: Iterable[tuple[int, int]] = ()):
        self.points: list[tuple[int, int]] = [] if version is None else [(0, version)]
        for first, v in changes:
            self.change(first, v)

    def change(self, first: int, version: int) -> bool:
        """From token `first` on, `version` samples. Nothing is recorded where it is the version already current;
        True if a point was added."""
        if self.points and self.points[-1][1] == version:
            return False
        self.points.append((first, version))
        return True

    def extend(self, first: int, versions: Iterable[int]) -> None:
        """Tokens `first`, `first` + 1, ... were sampled by `versions` (a per-token list, e.g. a turn's)."""
        for i, v in enumerate(versions):
            self.change(first + i, v)

    @property
    def version(self) -> int | None:
        """The first version (the one the call began with); None while empty."""
        return self.points[0][1] if self.points else None

    @property
    def last(self) -> int | None:
        """The version sampling now; None while empty."""
        return self.points[-1][1] if self.points else None

    def token_versions(self, n: int, version: int | None = None) -> list[int] | None:
        """This completion's token_versions, of its first `n` tokens (see `token_versions`)."""
        return token_versions(self.points, n, version)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self.points)

    def __len__(self) -> int:
        return len(self.points)

    def __eq__(self, other) -> bool:
        return isinstance(other, VersionSpans) and self.points == other.points

    def __repr__(self) -> str:
        return f"VersionSpans({self.points})"


def token_versions(changes: Iterable[tuple[int, int]] | None, n: int, version: int | None = None) -> list[int] | None:
    """The versions of a completion's `n` tokens from change points [(first token, version), ...] (a VersionSpans or
    a list, from token 0; points past the n-th token change nothing): Completion.token_versions, None where every
    token is `version` (by default the first point's, the version the call began with) or nothing was recorded."""
    points = list(changes or ())
    if not points:
        return None
    if version is None:
        version = points[0][1]
    out: list[int] = []
    for k, (_, v) in enumerate(points):
        stop = min(points[k + 1][0], n) if k + 1 < len(points) else n
        out += [v] * (stop - len(out))
    return out if any(v != version for v in out) else None
