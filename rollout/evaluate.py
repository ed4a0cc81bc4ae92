"""Held-out accuracy: greedy completions of the task's eval split, each correct or not by the run's judge
(rollout/rewards/judge.py: a built-in, or any reward entry with a threshold), with how diverse the answers were
(rollout/answer_stats.py).

During training the rollout actors answer (at their own precision, recorded with the result); `qgrpo eval` builds a
generator in-process for any checkpoint or model folder.
"""
from __future__ import annotations

from qgrpo.core.records import GroupRollout, PromptItem, SamplingParams
from qgrpo.rollout.answer_stats import eval_answer_stats, hollow_warnings, majority_baseline
from qgrpo.rollout.rewards.calls import RewardLoadError
from qgrpo.rollout.rewards.judge import Judge, JudgeError, as_judge, choose_judge, numeric
from qgrpo.rollout.rewards.scoring import score_texts

REFERENCE_SAMPLE = 200  # eval references looked at to tell a task of numbers from one of words


def task_judge(rewards_cfg, eval_task, n: int, model=None, environment=None) -> Judge:
    """The judge of held-out accuracy for `eval_task`'s first `n` items (its references decide the default);
    `environment`: the [environment] section, for rewards.eval_metric = "environment"."""
    refs = [eval_task.item(i).reference for i in range(min(n, REFERENCE_SAMPLE))] if eval_task is not None else None
    return choose_judge(rewards_cfg, refs, model, environment)


def judge_check(cfg) -> tuple[str, list[str], list[str]]:
    """For `check` and `train` before anything starts: (the held-out judge in words, problems, warnings). A config
    whose every reward reads integers only (`correct`, `integer_format`: the default is `correct`) on references
    that are words is a problem: no completion could ever score."""
    from qgrpo.rollout.data.tasks import make_task
    from qgrpo.rollout.rewards.builtin import NUMBER_READERS
    from qgrpo.rollout.rewards.judge import is_number, judge_problems

    task = make_task(cfg.task, cfg.run.seed, split="eval" if cfg.run.eval else "train")
    refs = [task.item(i).reference for i in range(min(cfg.task.eval_size or REFERENCE_SAMPLE, REFERENCE_SAMPLE))]
    try:
        judge = choose_judge(cfg.rewards, refs, environment=cfg.environment)
    except (RewardLoadError, JudgeError) as e:  # e.g. the judge's file is missing (the reward checks name it too)
        return cfg.rewards.eval_metric, [str(e)], []
    words = [r for r in refs if r is not None and not is_number(r)]
    problems = []
    fns = cfg.rewards.functions
    if words and all(s.name in NUMBER_READERS for s in fns):
        default = " (not set, so the default)" if [s.name for s in fns] == ["correct"] and fns[0].weight == 1 else ""
        problems.append(
            f"rewards.functions{default}: {', '.join(s.name for s in fns)} read integers only, and {len(words)} of "
            f"{len(refs)} references are words (e.g. {str(words[0])[:40]!r}): no completion could ever score; set "
            "rewards.functions, e.g. [{name = \"text_match\"}] (the reference as the answer or named in it) or "
            "[{function = \"my_rewards.py:NAME\"}]")
    if cfg.run.eval and judge.builtin and not any(str(r or "").strip() for r in refs):
        problems.append(f"run.eval: the held-out rows have no reference answers (task.answer_column = "
                        f"{cfg.task.answer_column!r}), so {judge.name} can never count an answer correct; set "
                        "rewards.eval_metric to the label of a reward of your own that needs no reference, or "
                        "run.eval = false")
    found = judge.describe() if cfg.run.eval else f"off (run.eval = false); training accuracy by {judge.name}"
    return found, problems, judge_problems(judge, refs) if cfg.run.eval else []


def eval_items(task, n: int) -> list[PromptItem]:
    return [task.item(i) for i in range(n)]


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(group_size=1, max_new_tokens=max_new_tokens, temperature=0.0, seed=0)


def score_eval(groups: list[GroupRollout], metric: "str | Judge", details: bool = False) -> dict:
    """Accuracy (the share the judge counts correct), the judge's mean score, the answers' diversity and three
    samples. `lenient_accuracy` (the answer in tags, else the last number) only where the references are numbers.
    `details`: also every answer with its score, under "details". Raises JudgeError when the judge fails."""
    judge = as_judge(metric)
    texts, items = [g.completions[0].text for g in groups], [g.item for g in groups]
    scores = judge.scores(texts, items, [g.completions[0] for g in groups])
    out = {"accuracy": sum(float(s is not None and s >= judge.threshold) for s in scores) / len(groups),
           "score_mean": sum(s or 0.0 for s in scores) / len(groups)}
    if numeric([it.reference for it in items]):
        out["lenient_accuracy"] = sum(score_texts("lenient_correct", texts, items)) / len(groups)
    out.update(n=len(groups), metric=judge.name, precision=groups[0].precision, **eval_answer_stats(groups, judge),
               samples=[{"prompt": g.item.prompt, "reference": g.item.reference, "completion": g.completions[0].text}
                        for g in groups[:3]])
    if details:
        out["details"] = [{"prompt_id": g.item.prompt_id, "prompt": g.item.prompt, "reference": g.item.reference,
                           "completion": t, "score": sc, "correct": sc is not None and sc >= judge.threshold,
                           # a multi-turn trajectory's turns (its completion is the last model turn)
                           **({"turns": g.completions[0].turns} if g.completions[0].multi_turn else {})}
                          for g, t, sc in zip(groups, texts, scores)]
    return out


def evaluate_model(model_path: str, task, n: int, max_new_tokens: int, metric: "str | Judge" = "correct",
                   precision: str = "bf16", batch: int = 32, chat_template: bool = True, backend: str = "torch",
                   options: dict | None = None, train_task=None) -> dict:
    """In-process evaluation of a checkpoint or model folder (used by `qgrpo eval`), on any registered backend.
    With `train_task` (the train split) the result also holds the majority baseline and the warnings
    (rollout/answer_stats.py)."""
    from qgrpo.rollout.backends import make_generator

    gen = make_generator(backend, model_path=model_path, precision=precision,
                         generator_id=f"eval-{backend}-{precision}",
                         chat_template=chat_template, **(options or {}))
    items = eval_items(task, n)
    groups = []
    for i in range(0, n, batch):
        groups += gen.generate(items[i:i + batch], greedy(max_new_tokens))
    res = score_eval(groups, metric)
    if train_task is not None:
        res["baseline"] = majority_baseline(train_task, items, metric)
        res["warnings"] = hollow_warnings(res, res["baseline"])
    return res
