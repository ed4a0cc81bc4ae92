"""One record of which policy version sampled which tokens (rollout/backends/versions.py: VersionSpans), for every
backend: change points -> a Completion's token_versions, as the torch and MLX decode loops (Generator._boundary),
vLLM's spans (vllm_backend.engine_versions) and multi-turn trajectories (rollout/episodes.py) record them. Pure
Python: no model, no engine."""
from __future__ import annotations

from dataclasses import dataclass

from qgrpo.rollout.backends.versions import VersionSpans, token_versions


def test_one_version_is_none():
    v = VersionSpans(3)
    assert list(v) == [(0, 3)] and v.version == v.last == 3
    assert v.token_versions(5) is None and v.token_versions(0) is None
    assert VersionSpans().token_versions(0) is None and VersionSpans().version is None


def test_a_change_gives_every_token_its_version():
    v = VersionSpans(3)
    assert v.change(2, 4)
    assert v.token_versions(5) == [3, 3, 4, 4, 4]
    assert v.token_versions(2) is None  # the change came after the last token
    assert v.token_versions(5, version=4) == [3, 3, 4, 4, 4]


def test_two_changes():
    v = VersionSpans(3, [(1, 4), (3, 6)])
    assert v.points == [(0, 3), (1, 4), (3, 6)] and v.last == 6
    assert v.token_versions(4) == [3, 4, 4, 6]
    assert v.token_versions(3) == [3, 4, 4]
    assert v.token_versions(7) == [3, 4, 4, 6, 6, 6, 6]


def test_a_change_at_column_0():
    """A later version took over before the first token: every token is its, the call's version stays the
    reference (the group's policy_version), so token_versions says so."""
    v = VersionSpans(5, [(0, 6)])
    assert v.points == [(0, 5), (0, 6)] and v.version == 5
    assert v.token_versions(3) == [6, 6, 6]
    assert v.token_versions(3, version=6) is None


def test_the_current_version_again_records_nothing():
    v = VersionSpans(3)
    assert not v.change(0, 3) and not v.change(4, 3)
    assert v.points == [(0, 3)] and v.token_versions(9) is None


def test_a_list_of_change_points_converts_the_same():
    assert token_versions(None, 4) is None and token_versions([], 4) is None
    assert token_versions([(0, 3)], 5) is None
    assert token_versions([(0, 3), (5, 4)], 5) is None
    assert token_versions([(0, 3), (2, 4)], 5) == VersionSpans(3, [(2, 4)]).token_versions(5) == [3, 3, 4, 4, 4]
    assert token_versions([(0, 3), (1, 4), (3, 6)], 4) == [3, 4, 4, 6]


def test_the_boundary_of_a_decode_loop_appends_a_change_point():
    """Generator._boundary (torch and MLX): a load applied by `step_boundary` starts a change point at that column;
    a boundary without a load records nothing."""
    from qgrpo.rollout.backends import Generator

    class Loop(Generator):
        generate = load_weights = score = memory_bytes = None

    gen = Loop()
    gen.policy_version = 2
    boundaries = []

    def boundary():  # the gate: a load waiting at the third boundary
        boundaries.append(0)
        if len(boundaries) == 3:
            gen.policy_version = 3

    gen.step_boundary = boundary
    gen._versions_start()
    changed = [gen._boundary(column) for column in range(1, 6)]
    assert changed == [False, False, True, False, False]
    assert list(gen._changes) == [(0, 2), (3, 3)] and gen._changes.version == 2
    assert gen._changes.token_versions(6) == [2, 2, 2, 3, 3, 3]


@dataclass
class Span:  # the shape of vllm.outputs.WeightVersionSpan: output tokens [start, end) sampled by weights `version`
    version: str
    start: int
    end: int


def test_vllm_shaped_spans():
    from qgrpo.rollout.backends.vllm_backend import engine_versions

    assert engine_versions(4, None).token_versions(3) is None  # the engine labelled nothing
    assert engine_versions(4, [Span("4", 0, 6)]).token_versions(6) is None
    mixed = engine_versions(4, [Span("4", 0, 2), Span("5", 2, 6)])
    assert list(mixed) == [(0, 4), (2, 5)] and mixed.token_versions(6) == [4, 4, 5, 5, 5, 5]
    # the request started after a load: its one span is the later version from token 0
    assert engine_versions(4, [Span("5", 0, 3)]).token_versions(3) == [5, 5, 5]
    # two loads at one step: a span of no tokens
    assert engine_versions(4, [Span("4", 0, 2), Span("5", 2, 2), Span("6", 2, 4)]).token_versions(4) == [4, 4, 6, 6]


def test_a_multi_turn_offset():
    """A trajectory (rollout/episodes.py): each model turn's versions from its first token on; the environment's
    tokens between turns carry the version of the model token before them."""
    t = VersionSpans()
    t.extend(0, [0, 0, 1])  # model turn 1: a load landed at its third token
    # environment turn: tokens 3..5, nothing recorded
    t.extend(6, [1, 1])  # model turn 2
    assert t.points == [(0, 0), (2, 1)]
    assert t.token_versions(8, version=0) == [0, 0, 1, 1, 1, 1, 1, 1]
    later = VersionSpans()
    later.extend(0, [0, 0])
    later.extend(5, [1, 2])  # turn 2 at offset 5, with a load at its second token
    assert later.points == [(0, 0), (5, 1), (6, 2)]
    assert later.token_versions(7, version=0) == [0, 0, 0, 0, 0, 1, 2]
    same = VersionSpans()
    same.extend(0, [7, 7])
    same.extend(4, [7])
    assert same.token_versions(5, version=7) is None  # one version sampled every token
