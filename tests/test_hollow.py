"""Held-out accuracy beside trivial baselines: the majority baseline (scored on the train split's most common answer by
the run's own metric), the diversity of the answers, and the warnings when a gain is hollow (rollout/answer_stats.py),
in the summary of `qgrpo train`, in `qgrpo eval` and in `qgrpo report`; then one tiny run on a skewed dataset."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from qgrpo.cluster.cli.app import main, summary
from qgrpo.cluster.config.schema import load_config
from qgrpo.cluster.report.build import report
from qgrpo.core.records import Completion, GroupRollout, PromptItem
from qgrpo.rollout.answer_stats import (
    describe_answers,
    diversity,
    eval_answer_stats,
    hollow_warnings,
    majority_baseline,
    read_answers,
    step_answer_metrics,
    verdict_lines,
)
from qgrpo.rollout.data.tasks import make_task
from qgrpo.rollout.evaluate import score_eval
from qgrpo.rollout.rewards import ANSWER_READERS, CHECKS, completion_with_answer

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.toml")
EVAL_SIZE = 20


def skewed_rows(n: int = 100) -> list[dict]:
    """80% of the answers are 4 (every row but each fifth), the rest 0..9 in turn; prompts the tiny model can write."""
    return [{"prompt": f"{i // 10}+{i % 10}=", "answer": "4" if i % 5 else str(i // 5 % 10)} for i in range(n)]


@pytest.fixture
def skewed_file(tmp_path) -> Path:
    path = tmp_path / "skewed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in skewed_rows()))
    return path


def skewed_overrides(path: Path) -> list[str]:
    return ["task.name='jsonl'", f"task.path='{path}'", "task.instruction=''", f"task.eval_size={EVAL_SIZE}"]


class Listed:
    """A train split of given references (len = how many)."""

    def __init__(self, refs: list[str]):
        self.refs = refs

    def __len__(self) -> int:
        return len(self.refs)

    def item(self, i: int) -> PromptItem:
        return PromptItem(f"t{i}", f"q{i}", self.refs[i % len(self.refs)])


def items(refs: list[str]) -> list[PromptItem]:
    return [PromptItem(f"e{i}", f"q{i}", r) for i, r in enumerate(refs)]


def groups_answering(prompts: list[PromptItem], texts: list[str]) -> list[GroupRollout]:
    """One greedy completion per prompt, as the held-out evaluation gets them."""
    return [GroupRollout(item=it, prompt_ids=[1], completions=[Completion([1], [0.0], "stop", t)], policy_version=0,
                         generator_id="test", precision="bf16") for it, t in zip(prompts, texts)]


# ---------------------------------------------------------------------------------------------------- answers


def test_answers_are_read_as_the_reward_reads_them():
    texts = ["<answer>3</answer> no, <answer>4</answer>", "<answer>4.0</answer>", "<answer> +4 </answer>", "7",
             "<answer>5</answer>"]
    # answer_correct reads the last tagged answer, compares numbers by value, and "7" untagged is no answer
    assert diversity(read_answers(texts, "answer_correct")) == {"given": 4, "distinct": 2, "top": "4", "top_share": 0.6}
    # correct reads the first integer: 3, 4, 4, 7, 5
    assert diversity(read_answers(texts, "correct")) == {"given": 5, "distinct": 4, "top": "4", "top_share": 0.4}
    assert diversity([None, None]) == {"given": 0, "distinct": 0, "top": None, "top_share": 0.0}
    # the readers are the rewards' own: a completion read as the reference scores 1, another answer 0 (the verifiers'
    # readers are tested with them: they need their task's rows)
    for metric, read in ((m, r) for m, r in ANSWER_READERS.items() if m in CHECKS):
        c = completion_with_answer(metric, "12")
        assert read(c) == "12" and CHECKS[metric](c, "12") == 1.0 and CHECKS[metric](c, "13") == 0


def test_step_metrics_cover_the_whole_batch():
    prompts = items(["4", "5"])
    groups = [GroupRollout(item=it, prompt_ids=[1], completions=[Completion([1], [0.0], "stop", t) for t in texts],
                           policy_version=0, generator_id="g", precision="int4")
              for it, texts in zip(prompts, (["4", "4", "x", "4"], ["4", "5", "6", "04"]))]
    # 8 completions, 7 answers: 4 (five times, "04" is 4), 5, 6; no answer in "x"
    assert step_answer_metrics(groups, "correct") == {"answers/distinct": 3, "answers/top_share": 5 / 8}


# ---------------------------------------------------------------------------------------------------- baseline


def test_majority_comes_from_the_train_split_and_is_scored_by_the_metric():
    train = Listed(["4"] * 6 + ["7"] * 3 + ["1"])  # train's majority: 4 (60%)
    held = items(["7", "7", "7", "4.0", "+4", "2"])  # eval's majority would be 7 (50%)
    b = majority_baseline(train, held, "answer_correct")
    assert b["majority_answer"] == "4" and b["majority_train_share"] == 0.6
    assert b["majority_accuracy"] == pytest.approx(2 / 6)  # "4.0" and "+4" are 4 by value, as for the policy
    assert (b["train_items"], b["train_size"], b["n"]) == (10, 10, 6)
    assert majority_baseline(train, held, "exact")["majority_accuracy"] == 0.0  # exact: "4" is not "4.0"


def test_majority_of_a_large_or_unbounded_train_split_is_a_bounded_sample():
    train = Listed(["1"] * 1500 + ["2"] * 3500)  # the whole split's majority is 2, its first 2,000 items' is 1
    b = majority_baseline(train, items(["1", "2"]), "correct")
    assert (b["majority_answer"], b["train_items"], b["train_size"]) == ("1", 2000, 5000)
    assert "the first 2,000 train items of 5,000" in verdict_lines({"n": 2}, b)[0]
    digits = make_task(load_config(TINY).task, 0)  # digit_sum: no length
    assert majority_baseline(digits, items(["3"]), "correct", sample=50)["train_size"] is None


def test_baseline_of_a_skewed_file(skewed_file):
    cfg = load_config(TINY, skewed_overrides(skewed_file))
    held = [make_task(cfg.task, 0, "eval").item(i) for i in range(EVAL_SIZE)]
    b = majority_baseline(make_task(cfg.task, 0), held, "correct")
    assert b["majority_answer"] == "4" and (b["train_items"], b["train_size"]) == (80, 80)
    assert b["majority_accuracy"] == sum(it.reference == "4" for it in held) / EVAL_SIZE == 0.8
    assert "the whole train split, 80 items" in verdict_lines({"n": EVAL_SIZE}, b)[0]


# ---------------------------------------------------------------------------------------------------- warnings


def evals_of(texts: list[str]) -> tuple[dict, dict]:
    """(eval result, baseline) for held-out prompts whose references are 80% "4" and that were answered `texts`."""
    refs = [r["answer"] for r in skewed_rows(EVAL_SIZE * 5)][-EVAL_SIZE:]
    held = items(refs)
    return score_eval(groups_answering(held, texts), "correct"), majority_baseline(Listed(["4", "4", "1"]), held,
                                                                                    "correct")


COLLAPSED = ["4"] * EVAL_SIZE  # 80% right, as always answering 4 is
DIVERSE = [r["answer"] for r in skewed_rows(EVAL_SIZE * 5)][-EVAL_SIZE:]  # every answer right, as varied as the refs


def test_warnings_for_a_collapsed_policy_and_none_for_a_good_one():
    ev, b = evals_of(COLLAPSED)
    assert ev["accuracy"] == b["majority_accuracy"] == 0.8 and ev["answers_top_share"] == 1.0
    no_better, collapse = hollow_warnings(ev, b)
    assert no_better == ("warning: held-out accuracy 80.0% is no better than always answering '4', the train split's "
                         "most common answer, which scores 80.0%")
    assert collapse.startswith("warning: the policy may have collapsed onto one answer: 100% of its 20 held-out "
                               "answers are '4' (1 distinct; the references have")
    ev, b = evals_of(DIVERSE)
    assert ev["accuracy"] == 1.0 and hollow_warnings(ev, b) == []


def test_collapse_rule_spares_few_answers_when_the_references_have_few():
    yes_no = items(["yes", "no"] * 10)
    ev = {"n": 20, "accuracy": 1.0, **eval_answer_stats(groups_answering(yes_no, ["yes", "no"] * 10), "exact")}
    assert hollow_warnings(ev, None) == []  # two distinct answers, as the references have
    ev = {"n": 20, "accuracy": 0.0, **eval_answer_stats(groups_answering(items([str(i) for i in range(20)]),
                                                                         ["1", "2"] * 10), "correct")}
    assert "collapsed onto 2 answers: 50%" in hollow_warnings(ev, None)[0]
    few = {"n": 20, "accuracy": 0.0, **eval_answer_stats(groups_answering(items([str(i) for i in range(20)]),
                                                                          ["1"] * 5 + ["x"] * 15), "correct")}
    assert hollow_warnings(few, None) == []  # 5 answers given: too few to call it a collapse


def test_answer_sentence_counts_completions_without_an_answer():
    six = items([str(i) for i in range(6)])
    ev = {"n": 6, **eval_answer_stats(groups_answering(six, ["11"] + ["no idea"] * 5), "correct")}
    assert describe_answers(ev) == "1 of 6 completions gave an answer, 1 distinct; the most common, '11', 1 time (17%)"
    ev = {"n": 6, **eval_answer_stats(groups_answering(six, ["no idea"] * 6), "correct")}
    assert describe_answers(ev) == "none of the 6 completions gave an answer the judge reads"
    ev = {"n": 6, **eval_answer_stats(groups_answering(six, ["4", "4", "4", "5", "6", "4"]), "correct")}
    assert describe_answers(ev) == "all 6 completions gave an answer, 3 distinct; the most common, '4', 4 times (67%)"


@pytest.mark.parametrize("texts, warned", [(COLLAPSED, True), (DIVERSE, False)])
def test_train_summary_says_it(texts, warned):
    ev, b = evals_of(texts)
    base, _ = evals_of(["0"] * EVAL_SIZE)
    text = summary({"last": {"step": 30, "reward/mean": 0.5}, "evals": {0: base, 30: ev}, "baseline": b,
                    "checkpoint": "ckpt"}, "runs/x", 60.0)
    assert f"{base['accuracy']:.1%} before (base model) -> {ev['accuracy']:.1%} after" in text
    assert "majority baseline: always answering '4' scores 80.0% (correct; the most common answer of the whole " \
           "train split, 3 items, 67% of them)" in text
    assert "held-out answers: " in text
    assert ("warning: held-out accuracy" in text) is warned and ("may have collapsed" in text) is warned


@pytest.mark.parametrize("texts, warned", [(COLLAPSED, True), (DIVERSE, False)])
def test_report_says_it(tmp_path, texts, warned):
    ev, b = evals_of(texts)
    lines = [{"time": 1.0, "event": "baseline", **b}, {"time": 2.0, "event": "eval", "step": 0, "split": "eval",
                                                       **evals_of(["0"] * EVAL_SIZE)[0]},
             {"time": 3.0, "step": 1, "reward/mean": 0.5, "answers/distinct": 3, "answers/top_share": 0.5},
             {"time": 4.0, "event": "eval", "step": 1, "split": "eval", **ev}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    md = (report(tmp_path) / "summary.md").read_text()
    assert "against: base model 0.000; majority baseline: always answering '4' scores 80.0%" in md
    assert "held-out answers at step 1: " in md and "Answers of the training completions" in md
    assert ("## Warnings" in md) is warned and ("no better than always answering '4'" in md) is warned
    assert ("may have collapsed" in md) is warned


@pytest.mark.parametrize("texts, warned", [(COLLAPSED, True), (DIVERSE, False)])
def test_eval_command_says_it(tiny_model_path, skewed_file, monkeypatch, capsys, texts, warned):
    """`qgrpo eval` with the generator replaced by canned answers: the baseline comes from the real train split."""
    import qgrpo.rollout.evaluate

    def canned(model_path, task, n, max_new_tokens, metric, train_task=None, **_):
        res = score_eval(groups_answering([task.item(i) for i in range(n)], texts), metric)
        return {**res, "baseline": (b := majority_baseline(train_task, [task.item(i) for i in range(n)], metric)),
                "warnings": hollow_warnings(res, b)}

    monkeypatch.setattr(qgrpo.rollout.evaluate, "evaluate_model", canned)
    assert main(["eval", tiny_model_path, "--config", TINY, *sum((["--set", o] for o in skewed_overrides(skewed_file)),
                                                                [])]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out.strip().splitlines()[-1])["baseline"]["majority_answer"] == "4"
    assert "qgrpo eval: majority baseline: always answering '4' scores 80.0%" in out.err
    assert ("qgrpo eval: warning: held-out accuracy" in out.err) is warned and ("collapsed" in out.err) is warned


# ---------------------------------------------------------------------------------------------------- end to end


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
def test_tiny_run_on_a_skewed_file(ray_session, tiny_model_path, tmp_path, skewed_file, capsys):
    out = tmp_path / "runs"
    sets = [f"model.path='{tiny_model_path}'", f"run.output_dir='{out}'", "run.steps=2", "run.progress=false",
            "run.eval=true", "run.tensorboard=false", "algo.kl_coeff=0", "rollout.prompts_per_step=4",
            "rollout.group_size=4", *skewed_overrides(skewed_file)]
    assert main(["train", TINY, *sum((["--set", s] for s in sets), [])]) == 0
    (run_dir,) = out.iterdir()
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "reward/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(0 < m["answers/top_share"] <= 1 or m["answers/distinct"] == 0 for m in steps)
    assert all(isinstance(m["answers/distinct"], int) for m in steps)
    (baseline,) = [m for m in lines if m.get("event") == "baseline"]
    assert (baseline["majority_answer"], baseline["majority_accuracy"], baseline["train_items"]) == ("4", 0.8, 80)
    evals = [m for m in lines if m.get("event") == "eval"]
    assert [e["step"] for e in evals] == [0, 2] and all("answers_top_share" in e for e in evals)
    # a 2-step policy cannot beat answering 4 (80%) by 2 points on these prompts: on record, and in the summary
    assert any(m.get("event") == "warning" and m["step"] == 2 and "no better than" in m["message"] for m in lines)
    err = capsys.readouterr().err
    assert "majority baseline: always answering '4' scores 80.0%" in err and "warning: held-out accuracy" in err
    assert main(["report", str(run_dir)]) == 0
    assert "## Warnings" in (run_dir / "report" / "summary.md").read_text()
