import pytest

from qgrpo.rollout.data.tasks import DigitSum, PromptSampler
from qgrpo.rollout.rewards import REWARD_FUNCTIONS, correct, exact, extract_integer


def test_digit_sum_is_deterministic_and_split():
    a, b = DigitSum(seed=1), DigitSum(seed=1)
    assert [a.item(i) for i in range(5)] == [b.item(i) for i in range(5)]
    held = DigitSum(seed=1, split="eval")
    assert [a.item(i).prompt for i in range(20)] != [held.item(i).prompt for i in range(20)]
    it = DigitSum(seed=0, max_operand=4).item(3)
    x, y = it.prompt.rstrip("=").split("+")
    assert int(x) + int(y) == int(it.reference) and max(int(x), int(y)) <= 4


def test_sampler_cursor_resumes():
    s = PromptSampler(DigitSum(seed=2))
    first = s.next(3) + s.next(2)
    again = PromptSampler(DigitSum(seed=2), cursor=3).next(2)
    assert first[3:] == again and s.cursor == 5


@pytest.mark.parametrize("text,expected", [("7", "7"), (" 12 apples", "12"), ("-3", "-3"), ("abc", None), ("", None)])
def test_extract_integer(text, expected):
    assert extract_integer(text) == expected


def test_correct_and_exact():
    assert correct("7", "7") == 1.0 and correct("07", "7") == 1.0 and correct("0", "0") == 1.0
    assert correct("72", "7") == 0.0 and correct("x", "7") == 0.0
    assert exact(" 7 ", "7") == 1.0 and exact("7 apples", "7") == 0.0


def test_registry_names():
    assert {"correct", "exact", "integer_format"} <= set(REWARD_FUNCTIONS)
