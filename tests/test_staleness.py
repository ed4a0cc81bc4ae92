"""The admission rule of every rollout supply (learner/objective/staleness.py), by hand: which step's prompts may be
drawn given the weights the actors hold and the step the driver takes, and how tokens' ages are counted."""
from __future__ import annotations

import pytest

from qgrpo.learner.objective.staleness import Admission, admission, token_ages


@pytest.mark.parametrize("S, U, expected", [
    (0, 1, [0, 1, 2, 3, 4, 5]),  # synchronous: step c waits for the weights of step c
    (1, 1, [0, 0, 1, 2, 3, 4]),  # one sync behind
    (2, 1, [0, 0, 0, 1, 2, 3]),
    (0, 2, [0, 0, 2, 2, 4, 4]),  # update_every = 2: the synchronous run samples steps 2 and 3 from step 2's weights
    (1, 2, [0, 0, 0, 0, 2, 2]),  # ... and one sync (two steps) earlier
])
def test_a_step_waits_for_the_weights_the_bound_names(S, U, expected):
    assert [Admission(S, U, None).oldest_weights(c) for c in range(6)] == expected


def _drawn(rule: Admission, held: int, asked: int, steps: int = 8) -> list[int]:
    return [c for c in range(steps) if rule.admits(c, held, asked)]


def test_synchronous_draws_only_the_step_asked_for_once_its_weights_are_held():
    rule = admission(0, 1)
    assert rule == Admission(0, 1, 0) and rule.synchronous
    assert _drawn(rule, held=0, asked=-1) == []  # nothing before the driver asks
    assert _drawn(rule, held=0, asked=0) == [0]
    assert _drawn(rule, held=2, asked=1) == [0, 1]  # steps up to the one asked (earlier ones are drawn already)
    assert _drawn(rule, held=2, asked=3) == [0, 1, 2]  # step 3 waits for step 3's weights
    rule = admission(0, 2)  # update_every = 2: step 1 shares step 0's weights, still drawn only when asked
    assert _drawn(rule, held=0, asked=0) == [0] and _drawn(rule, held=0, asked=1) == [0, 1]
    assert _drawn(rule, held=0, asked=2) == [0, 1]


def test_overlap_is_staleness_one_drawn_one_step_ahead():
    rule = admission(0, 1, overlap=True)
    assert rule == Admission(1, 1, 1) and not rule.synchronous
    assert _drawn(rule, held=0, asked=-1) == [0]  # step 0 starts before the driver asks
    assert _drawn(rule, held=0, asked=0) == [0, 1]  # taking step 0 starts step 1, on the same weights
    assert _drawn(rule, held=1, asked=1) == [0, 1, 2]
    assert _drawn(rule, held=0, asked=1) == [0, 1]  # step 2 also needs step 1's weights


def test_a_stream_draws_whatever_the_bound_admits():
    rule = admission(2, 1)
    assert rule == Admission(2, 1, None) and not rule.synchronous
    assert _drawn(rule, held=0, asked=-1) == [0, 1, 2]
    assert _drawn(rule, held=3, asked=0) == [0, 1, 2, 3, 4, 5]
    assert _drawn(admission(1, 2), held=2, asked=0) == [0, 1, 2, 3, 4, 5]  # weights of step 2: up to step 5


def test_impossible_rules_are_refused():
    for bad in ((-1, 1, 0), (0, 0, 0), (0, 1, -1)):
        with pytest.raises(ValueError, match="Admission"):
            Admission(*bad)


def test_token_ages_count_model_tokens_behind_the_policy_trained_from():
    # a completion sampled by version 3, one that a sync reached after two tokens, and a multi-turn one whose
    # environment tokens (mask 0) are not the model's
    ages = token_ages([([3, 3], None), ([3, 3, 4, 4, 4], None), ([2, 2, 2, 2], [1, 0, 0, 1])], trained_from=4)
    assert ages == {1: 4, 0: 3, 2: 2}
    assert token_ages([], 4) == {}
