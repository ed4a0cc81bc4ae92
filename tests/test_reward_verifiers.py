"""The verifiers out of the box: reasoning-gym's own scorer as `rg_score`, math-verify as `math_verify`."""
from __future__ import annotations

import threading

import pytest
import reasoning_gym

from qgrpo.cluster.config.schema import TaskConfig
from qgrpo.core.records import Completion
from qgrpo.rollout.data.tasks import make_task
from qgrpo.rollout.rewards.calls import reward_kwargs
from qgrpo.rollout.rewards.verifiers import math_verifier, math_verify, rg_score


def tagged(answer: str) -> str:
    return f"Let me think.\n<answer>{answer}</answer>"


def entry(task: str, index: int, seed: int = 7, size: int = 20, **params) -> dict:
    return {"task": task, "params": params, "seed": seed, "index": index, "size": size}


# ---------------------------------------------------------------------------------------------------------------
# rg_score


@pytest.mark.parametrize("task", ["spell_backward", "letter_jumble", "word_sorting"])
def test_rg_score_is_the_tasks_own_score_answer(task):
    ds = reasoning_gym.create_dataset(task, size=20, seed=7)
    e, rg = ds[3], entry(task, 3)
    right = e["answer"]
    wrong = right[::-1] if right[::-1] != right else right + "x"
    answers = [right, wrong, right[:-1] + "#", "completely off"]
    scores = rg_score([tagged(a) for a in answers] + ["no tags at all"], [rg] * 5, question=[e["question"]] * 5)
    assert scores[0] == 1.0 and all(s < 1.0 for s in scores[1:4])
    direct = [ds.score_answer(a, e) for a in answers] + [ds.score_answer(None, e)]
    assert scores == pytest.approx(direct, abs=1e-12)
    assert scores[4] == 0.0


def test_rg_score_gives_partial_credit_where_the_task_does():
    ds = reasoning_gym.create_dataset("spell_backward", size=20, seed=7)
    i = next(k for k in range(20) if len(ds[k]["answer"]) >= 5)
    right = ds[i]["answer"]
    near = right[:-1] + ("a" if right[-1] != "a" else "b")  # one letter off
    scores = rg_score([tagged(right), tagged(near), tagged("")], [entry("spell_backward", i)] * 3)
    assert scores[0] == 1.0 and 0.5 < scores[1] < 1.0 and scores[2] == 0.0
    assert scores[1] == pytest.approx((len(right) - 1) / len(right), abs=1e-9)


def test_rg_score_reads_the_last_answer_block_and_skips_rows_without_an_entry():
    ds = reasoning_gym.create_dataset("spell_backward", size=20, seed=7)
    right, rg = ds[0]["answer"], entry("spell_backward", 0)
    scores = rg_score([f"<answer>nope</answer> no: <answer>{right}</answer>", f"<answer>{right}</answer> <answer>x",
                       tagged(right)], [rg, rg, None])
    assert scores == [1.0, 1.0, None]


def test_rg_score_uses_the_params_and_the_rows_of_an_rg_task():
    cfg = TaskConfig(name="rg:word_sorting", params={"min_words": 3, "max_words": 4}, size=50, eval_size=10)
    task = make_task(cfg, 1, "eval")
    items = [task.item(i) for i in range(4)]
    assert all(it.columns["rg_entry"]["params"] == {"min_words": 3, "max_words": 4} for it in items)

    def done(text: str) -> Completion:
        return Completion([1, 2], [-0.1, -0.1], "stop", text)

    kwargs = reward_kwargs(items + items, [done(tagged(it.reference)) for it in items] + [done("<answer>a, b</answer>")
                                                                                         for _ in items])
    scores = rg_score(**kwargs)
    assert scores[:4] == [1.0] * 4 and all(s < 1.0 for s in scores[4:])
    assert scores == [task.score_answer(rg_text, it) for rg_text, it in
                      zip([it.reference for it in items] + ["a, b"] * 4, items + items)]


def test_rg_score_refuses_an_entry_it_cannot_rebuild_faithfully():
    ds = reasoning_gym.create_dataset("spell_backward", size=20, seed=7)
    with pytest.raises(ValueError, match="asks a different question than the row"):
        rg_score([tagged("x")], [entry("spell_backward", 1)], question=[ds[2]["question"]])
    with pytest.raises(ValueError, match="rg_entry of completion 0 is .*expected \\{task: str"):
        rg_score([tagged("x")], [{"task": "spell_backward", "index": 1}])
    with pytest.raises(ValueError, match="cannot rebuild reasoning-gym entry"):
        rg_score([tagged("x")], [entry("no_such_task", 0)])


# ---------------------------------------------------------------------------------------------------------------
# math_verify

CASES = [  # (reference, completion, score)
    ("0.5", tagged(r"\frac{1}{2}"), 1.0),
    (r"\frac{1}{2}", tagged("0.5"), 1.0),
    (r"\frac{1}{2}", tagged("1/2"), 1.0),
    ("2", tagged("x=2"), 1.0),
    ("x=2", tagged("2"), 1.0),
    ("x=2", tagged("x = 2"), 1.0),
    ("y=2", tagged("x=2"), 0.0),
    (r"\sqrt{2}", tagged("sqrt(2)"), 1.0),
    (r"$\boxed{\frac{3}{4}}$", tagged("0.75"), 1.0),
    ("7", r"First 3+4 ... so the answer is $\boxed{7}$.", 1.0),  # no tags: the whole completion, boxed first
    ("7", r"so the answer is $\boxed{8}$.", 0.0),
    ("7", tagged(r"\boxed{7}"), 1.0),
    ("7", tagged("8"), 0.0),
    ("7", tagged(""), 0.0),
    ("7", "", 0.0),
    ("1,234", tagged("1234"), 1.0),
    ("1e-7", tagged("0.0000001"), 1.0),
    ("(1, 2)", tagged("(1,2)"), 1.0),
    ("(1, 2)", tagged("2"), 0.0),
    ("1/3", tagged("0.333"), 0.0),
    ("-3", tagged("-3.0"), 1.0),
]


@pytest.mark.parametrize("reference,completion,score", CASES)
def test_math_verify(reference, completion, score):
    assert math_verify([completion], [reference]) == [score]


def test_math_verify_tolerance_is_float_rounding_decimals():
    refs = ["0.1", "0.1", "10", "10", "1/3", "1/3"]
    answers = ["0.1000004", "0.1000006", "10.0000001", "10.001", "0.3333333", "0.33"]
    assert math_verify([tagged(a) for a in answers], refs) == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    loose = math_verifier(float_rounding=2)
    assert loose([tagged(a) for a in answers], refs) == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]


def test_math_verify_does_not_apply_to_references_that_are_not_math():
    refs = ["Paris", r"\text{blue}", "", "Paris"]
    assert math_verify([tagged("Paris"), tagged("blue"), tagged("1"), tagged("Prais")], refs) == [None] * 4


def test_math_verify_works_in_a_worker_thread():
    """The reward pool calls functions in worker threads, where math_verify's signal-based timeout raises ValueError
    unless it is turned off."""
    refs, completions = [c[0] for c in CASES], [c[1] for c in CASES]
    got: dict = {}

    def run():
        try:
            got["scores"] = math_verify(completions, refs)
        except Exception as e:  # reported below, with the thread's error
            got["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert "error" not in got, got.get("error")
    assert got["scores"] == [c[2] for c in CASES]
