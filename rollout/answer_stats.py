"""Is a held-out accuracy gain real? Trivial baselines, answer diversity and plain-word warnings.

- Majority baseline: the accuracy of always giving the most common reference answer of the TRAIN split, scored on
  the held-out prompts by the run's own judge of accuracy (rollout/rewards/judge.py; the answer is written as a
  completion the judge reads, so "4.0" counts against "4" exactly as it would for the policy). The train split can
  be large or unbounded: its first MAJORITY_SAMPLE items are counted (the whole split when it is smaller).
- Answer diversity: answers are read from completions by the judge's own reader (`Judge.read`) and compared by
  `answer_key`. `distinct` counts the different answers given;
  `top_share` is the share of the most common answer among ALL completions, those without an answer included, so a
  policy that mostly gives no answer does not look collapsed.
- Warnings, when
  - the held-out accuracy does not beat the majority baseline by more than BEAT_MARGIN (2 points), or
  - the held-out answers collapse: at least COLLAPSE_MIN_ANSWERS answers were given and either COLLAPSE_SHARE (90%)
    or more of all held-out completions give one answer, a larger share than the references' most common answer
    has, or at most COLLAPSE_DISTINCT (2) distinct answers were given where the references have more. Comparing
    with the references keeps a yes/no task, or a held-out split that is itself mostly one answer, from warning.

Pure functions of plain records; the driver, `qgrpo eval` and `qgrpo report` all call them.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from qgrpo.core.records import GroupRollout, PromptItem
from qgrpo.rollout.rewards import answer_key
from qgrpo.rollout.rewards.judge import Judge, as_judge

MAJORITY_SAMPLE = 2_000  # train items whose references are counted for the majority answer
BEAT_MARGIN = 0.02  # held-out accuracy <= majority baseline + 2 points: no better than the baseline
COLLAPSE_SHARE = 0.9
COLLAPSE_DISTINCT = 2
COLLAPSE_MIN_ANSWERS = 10  # fewer answers than this say little about collapse


def diversity(answers: Sequence[str | None]) -> dict[str, Any]:
    """{given, distinct, top, top_share} of parsed answers (None: no answer). `top` is the most common answer as first
    written (ties: the first seen), `top_share` its count over ALL entries, None included."""
    keys = [answer_key(a) for a in answers]
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        return {"given": 0, "distinct": 0, "top": None, "top_share": 0.0}
    key, count = counts.most_common(1)[0]
    top = next(a for a, k in zip(answers, keys) if k == key)
    return {"given": sum(counts.values()), "distinct": len(counts), "top": top, "top_share": count / len(answers)}


def read_answers(texts: Sequence[str], metric: "str | Judge") -> list[str | None]:
    """The answers of `texts` as the judge `metric` (or the built-in of that name) reads them."""
    read = as_judge(metric).read
    return [read(t) for t in texts]


def step_answer_metrics(groups: list[GroupRollout], metric: "str | Judge") -> dict[str, float]:
    """`answers/distinct` and `answers/top_share` over every completion of a training step (the whole batch)."""
    d = diversity(read_answers([c.text for g in groups for c in g.completions], metric))
    return {"answers/distinct": d["distinct"], "answers/top_share": d["top_share"]}


def eval_answer_stats(groups: list[GroupRollout], metric: "str | Judge") -> dict[str, Any]:
    """Diversity of the held-out answers (one greedy completion per prompt), and of the references they answer."""
    policy = diversity(read_answers([g.completions[0].text for g in groups], metric))
    refs = diversity([g.item.reference for g in groups])
    return {"answers_given": policy["given"], "answers_distinct": policy["distinct"], "answers_top": policy["top"],
            "answers_top_share": policy["top_share"], "references_distinct": refs["distinct"],
            "references_top_share": refs["top_share"]}


def majority_baseline(train_task, eval_items: list[PromptItem], metric: "str | Judge",
                      sample: int = MAJORITY_SAMPLE) -> dict[str, Any]:
    """Accuracy on `eval_items` of always answering the most common reference of the train split's first `sample`
    items, judged by `metric` (a Judge, or a built-in's name) on a completion it reads as that answer. Raises
    JudgeError when the judge (a user's function, a URL) fails."""
    judge = as_judge(metric)
    try:
        size = len(train_task)
    except TypeError:  # digit_sum is unbounded
        size = None
    n = sample if size is None else min(sample, size)
    train = diversity([train_task.item(i).reference for i in range(n)])
    completion = judge.as_completion(train["top"] or "")
    accuracy = sum(judge.correct([completion] * len(eval_items), eval_items)) / max(len(eval_items), 1)
    return {"majority_answer": train["top"], "majority_accuracy": accuracy, "majority_train_share": train["top_share"],
            "train_items": n, "train_size": size, "metric": judge.name, "n": len(eval_items)}


# ---------------------------------------------------------------------------------------------------- words


def _quote(answer: Any, limit: int = 40) -> str:
    s = str(answer)
    return repr(s if len(s) <= limit else s[:limit] + "...")


def describe_baseline(b: dict) -> str:
    """One sentence: what always answering the train split's most common answer scores."""
    n, size = b["train_items"], b.get("train_size")
    sample = (f"the whole train split, {n:,} items" if size is not None and n >= size
              else f"the first {n:,} train items" + (f" of {size:,}" if size else ""))
    return (f"always answering {_quote(b['majority_answer'])} scores {b['majority_accuracy']:.1%} ({b['metric']}; "
            f"the most common answer of {sample}, {b['majority_train_share']:.0%} of them)")


def describe_answers(ev: dict) -> str | None:
    """One sentence on the held-out answers: how many completions gave one the judge reads, how many distinct, and
    the most common with its count over all completions; None for an evaluation that did not record it."""
    if ev.get("answers_distinct") is None:
        return None
    n, distinct = ev["n"], ev["answers_distinct"]
    given = ev.get("answers_given", n)
    if not given:
        return f"none of the {n} completions gave an answer the judge reads"
    gave = f"all {n} completions gave an answer" if given == n else f"{given} of {n} completions gave an answer"
    top = ""
    if ev.get("answers_top") is not None:
        count = round(ev["answers_top_share"] * n)
        top = f"; the most common, {_quote(ev['answers_top'])}, {count} time{'s' * (count != 1)} ({count / n:.0%})"
    return f"{gave}, {distinct} distinct{top}"


def collapsed(ev: dict) -> bool:
    """The held-out answers collapsed onto one or two answers (the rule is in the module docstring)."""
    given, distinct, share = ev.get("answers_given"), ev.get("answers_distinct"), ev.get("answers_top_share")
    if given is None or distinct is None or share is None or given < COLLAPSE_MIN_ANSWERS:
        return False
    ref_share, ref_distinct = ev.get("references_top_share", 0.0), ev.get("references_distinct", COLLAPSE_DISTINCT + 1)
    return (share >= COLLAPSE_SHARE and share > ref_share) or distinct <= COLLAPSE_DISTINCT < ref_distinct


def hollow_warnings(ev: dict, baseline: dict | None) -> list[str]:
    """Plain-word warnings for one held-out evaluation; [] when its accuracy beats the majority baseline and its
    answers did not collapse."""
    out = []
    acc = ev.get("accuracy")
    if baseline and acc is not None and acc <= baseline["majority_accuracy"] + BEAT_MARGIN:
        out.append(f"warning: held-out accuracy {acc:.1%} is no better than always answering "
                   f"{_quote(baseline['majority_answer'])}, the train split's most common answer, which scores "
                   f"{baseline['majority_accuracy']:.1%}")
    if collapsed(ev):
        onto = "one answer" if ev["answers_top_share"] >= COLLAPSE_SHARE else f"{ev['answers_distinct']} answers"
        out.append(f"warning: the policy may have collapsed onto {onto}: {ev['answers_top_share']:.0%} of its "
                   f"{ev['n']} held-out answers are {_quote(ev['answers_top'])} ({ev['answers_distinct']} distinct; "
                   f"the references have {ev.get('references_distinct', '?')}, the most common "
                   f"{ev.get('references_top_share', 0.0):.0%} of them)")
    return out


def verdict_lines(ev: dict, baseline: dict | None) -> list[str]:
    """The baseline, the answers and the warnings of one held-out evaluation, one line each."""
    lines = [f"majority baseline: {describe_baseline(baseline)}"] if baseline else []
    answers = describe_answers(ev)
    return lines + ([f"held-out answers: {answers}"] if answers else []) + hollow_warnings(ev, baseline)
