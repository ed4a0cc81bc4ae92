"""Held-out accuracy by the task's own judge (rollout/rewards/judge.py): text_match for word answers, any reward entry
by its label with a threshold, the default chosen from the references, and what `check` says about it."""
import dataclasses
import json
import textwrap
import tomllib
from pathlib import Path

import pytest

from qgrpo.cluster.config.schema import ConfigError, config_from_dict
from qgrpo.core.records import Completion, GroupRollout, PromptItem
from qgrpo.rollout.answer_stats import majority_baseline
from qgrpo.rollout.evaluate import score_eval
from qgrpo.rollout.rewards import text_match
from qgrpo.rollout.rewards.judge import choose_judge, numeric

ROOT = Path(__file__).resolve().parents[1]


def _cfg(rewards: dict, **task) -> object:
    return config_from_dict({"model": {"path": "builtin:tiny-digits"}, "rewards": rewards, "task": task},
                            check_environment=False)


def _items(refs: list[str]) -> list[PromptItem]:
    return [PromptItem(f"p{i}", f"q{i}", r) for i, r in enumerate(refs)]


def _groups(items: list[PromptItem], texts: list[str]) -> list[GroupRollout]:
    return [GroupRollout(item=it, prompt_ids=[1], completions=[Completion([1], [0.0], "stop", t)], policy_version=0,
                         generator_id="test", precision="bf16") for it, t in zip(items, texts)]


@pytest.mark.parametrize("completion, reference, want", [
    ("The capital of Belgium is Brussels.", "Brussels", 1.0),
    ("brussels", "Brussels", 1.0),
    ("<answer> Paris </answer>", "paris", 1.0),
    ("<answer>Lyon</answer> The capital is Paris.", "Paris", 0.0),  # tags present: only their answer counts
    ("Brusselsprout", "Brussels", 0.0),
    ("It is in New York City.", "New York", 1.0),
    ("Washington", "Washington, D.C.", 0.0),
    ("7.0", "7", 1.0),
    ("17", "7", 0.0),
    ("", "Paris", 0.0),
    ("anything", "", 0.0),
])
def test_text_match_reads_a_sentence_the_way_a_user_would(completion, reference, want):
    assert text_match(completion, reference) == want


def test_the_default_judge_follows_the_references():
    words, numbers = ["Brussels", "Paris"], ["4", "1,234", "-2.5"]
    assert numeric(numbers) and not numeric(words) and not numeric([])
    assert choose_judge(_cfg({}).rewards, words).name == "text_match"  # the default reward `correct` reads integers
    assert choose_judge(_cfg({}).rewards, numbers).name == "correct"
    mine = {"functions": [{"function": "mine.py:score"}]}
    assert choose_judge(_cfg(mine).rewards, numbers).name == "lenient_correct"
    assert choose_judge(_cfg(mine).rewards, words).name == "text_match"
    tagged = {"functions": [{"name": "answer_format"}, {"name": "answer_correct"}]}
    assert choose_judge(_cfg(tagged).rewards, words).name == "answer_correct"  # it compares words as text


def test_eval_metric_names_any_entry_by_its_label_and_is_checked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text("def score(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    cfg = _cfg({"functions": [{"function": "mine.py:score", "label": "judge"}, {"name": "answer_format"}],
                "eval_metric": "judge", "eval_threshold": 0.8})
    judge = choose_judge(cfg.rewards, ["Paris"])
    assert (judge.name, judge.builtin, judge.entry.kind, judge.threshold) == ("judge", "", "function", 0.8)
    fmt = choose_judge(_cfg({"functions": [{"name": "answer_correct", "label": "acc"}], "eval_metric": "acc"}).rewards)
    assert (fmt.name, fmt.builtin) == ("acc", "answer_correct")
    with pytest.raises(ConfigError, match=r"rewards.eval_metric: 'jugde' is neither a built-in accuracy reward .* "
                                          r"nor the label of a rewards.functions entry \(judge, answer_format\)"):
        _cfg({"functions": [{"function": "mine.py:score", "label": "judge"}, {"name": "answer_format"}],
              "eval_metric": "jugde"})


def test_a_user_function_judges_held_out_answers_with_its_threshold(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text(textwrap.dedent('''
        def closeness(completions, references, **kwargs):
            # 1.0 for the reference itself, 0.6 when it is named in a sentence, 0.0 otherwise
            return [1.0 if c.strip() == r else 0.6 if r in c else 0.0 for c, r in zip(completions, references)]
    '''))
    items = _items(["Paris", "Rome", "Oslo", "Bern"])
    texts = ["Paris", "It is Rome.", "Madrid", "Bern"]
    for threshold, accuracy in ((0.5, 0.75), (0.9, 0.5)):
        cfg = _cfg({"functions": [{"function": "mine.py:closeness"}], "eval_metric": "closeness",
                    "eval_threshold": threshold})
        judge = choose_judge(cfg.rewards, [it.reference for it in items])
        ev = score_eval(_groups(items, texts), judge, details=True)
        assert ev["accuracy"] == accuracy and ev["metric"] == "closeness"
        assert ev["score_mean"] == pytest.approx((1.0 + 0.6 + 0.0 + 1.0) / 4)
        assert [d["correct"] for d in ev["details"]] == [s >= threshold for s in (1.0, 0.6, 0.0, 1.0)]
        assert "lenient_accuracy" not in ev  # a number reader says nothing about words
    # The majority baseline asks the same judge: always answering "Rome" is right once in four
    train = type("Listed", (), {"__len__": lambda self: 3, "item": lambda self, i: _items(["Rome", "Rome", "Oslo"])[i]})
    assert majority_baseline(train(), items, judge)["majority_accuracy"] == 0.25


def _write(tmp_path: Path, rows: list[dict], toml: str) -> Path:
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "config.toml"
    path.write_text(textwrap.dedent(toml))
    return path


CAPITALS = [{"question": f"What is the capital of {c}?", "answer": a}
            for c, a in [("France", "Paris"), ("Italy", "Rome"), ("Norway", "Oslo"), ("Peru", "Lima"),
                         ("Japan", "Tokyo"), ("Kenya", "Nairobi")] * 3]


def test_check_refuses_a_number_reward_on_word_answers_and_names_the_judge(tmp_path, monkeypatch, capsys):
    """No [rewards] on word references: the default `correct` could never score one, so check refuses before the
    model is touched, naming the field and the fix; with a reward that reads words it names the held-out judge."""
    from qgrpo.cluster.cli.app import main

    monkeypatch.chdir(tmp_path)
    base = '''
        [model]
        path = "builtin:smollm2-135m-instruct"
        [task]
        name = "jsonl"
        path = "data.jsonl"
        prompt_column = "question"
        eval_size = 6
    '''
    config = _write(tmp_path, CAPITALS, base)
    assert main(["check", str(config)]) == 2
    out = capsys.readouterr()
    said = out.out + out.err
    assert "rewards.functions (not set, so the default): correct read integers only, and 6 of 6 references are " \
           "words (e.g. 'Paris')" in said and '[{name = "text_match"}]' in said
    config = _write(tmp_path, CAPITALS, base + '''
        [rewards]
        functions = [{ name = "text_match" }, { name = "correct", weight = 0.1 }]
        eval_metric = "correct"
    ''')
    main(["check", str(config), "--set", "rewards.eval_metric=''"])
    said = "".join(capsys.readouterr())
    assert "held-out:  text_match (built-in text_match; correct when its score >= 0.5); the references are words" \
           in said
    main(["check", str(config)])
    said = "".join(capsys.readouterr())
    assert "hint: held-out accuracy is scored by correct, which reads numbers, but 6 of 6 references are words " \
           "(e.g. 'Paris'): it can never count them correct" in said


def test_a_user_config_inherits_the_default_jobs_settings():
    """Every learning setting the default job sets (all but its model, task, rewards and names) is the schema's
    default, so a config of one's own that leaves them out trains as the default job does."""
    job = tomllib.loads((ROOT / "configs" / "smollm2_arith.toml").read_text())
    cfg = config_from_dict({"model": {"path": "builtin:smollm2-135m-instruct"}}, check_environment=False).to_dict()
    own = {"model", "task", "rewards"}
    differ = {f"{section}.{key}": (value, cfg[section][key]) for section, table in job.items() if section not in own
              for key, value in table.items() if key != "name" and cfg[section][key] != value}
    assert differ == {}
    assert (cfg["run"]["steps"], cfg["rollout"]["precision"], cfg["learner"]["lr"], cfg["run"]["eval"]) == \
        (30, "int8", 1e-5, True)


def test_rows_without_answers_need_a_judge_of_ones_own(tmp_path, monkeypatch, capsys):
    """task.answer_column = "": a built-in judge has nothing to compare with, so held-out accuracy needs the user's
    own reward named as its judge (or run.eval = false)."""
    from qgrpo.cluster.cli.app import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text("def short(completions, **kwargs):\n    return [float(len(c) < 40) for c in "
                                      "completions]\n")
    rows = [{"question": f"Say something about {c['answer']}."} for c in CAPITALS]
    config = _write(tmp_path, rows, '''
        [model]
        path = "builtin:smollm2-135m-instruct"
        [task]
        name = "jsonl"
        path = "data.jsonl"
        prompt_column = "question"
        answer_column = ""
        eval_size = 6
        [rewards]
        functions = [{ function = "mine.py:short" }]
    ''')
    assert main(["check", str(config)]) == 2
    said = "".join(capsys.readouterr())
    assert "run.eval: the held-out rows have no reference answers (task.answer_column = ''), so text_match can never " \
           "count an answer correct; set rewards.eval_metric to the label of a reward of your own" in said
    main(["check", str(config), "--set", "rewards.eval_metric='short'"])
    said = "".join(capsys.readouterr())
    assert "run.eval: the held-out rows" not in said and "held-out:  short (rewards.functions[0] (function)" in said


def test_the_readme_snippet_is_the_word_answers_example(monkeypatch, tmp_path):
    """The README's own-task snippet, as written, is examples/word_answers/config.toml, whose run is quoted there."""
    import re

    from qgrpo.cluster.config.schema import load_config

    monkeypatch.chdir(ROOT)
    readme = (ROOT / "README.md").read_text()
    snippet = re.search(r"```toml\n(.*?)```", readme[readme.index("## Your own task"):], re.S).group(1)
    (tmp_path / "my_task.toml").write_text(snippet)  # saved in the project folder, as the README says: its
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # paths are read against the file's own folder
    assert load_config(tmp_path / "my_task.toml").to_dict() == \
        load_config(ROOT / "examples" / "word_answers" / "config.toml").to_dict()


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
def test_a_run_judges_held_out_answers_by_the_users_function(ray_session, tiny_model_path, tmp_path, monkeypatch,
                                                            capsys):
    """A real run of the tiny model whose held-out judge is a graded function of the user's: the accuracy it logs is
    the share of answers that function scores at or above the threshold, and the baseline asks the same function."""
    from qgrpo.cluster.cli.app import main
    from qgrpo.rollout.rewards.calls import load_function, read_source

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text(textwrap.dedent('''
        def near(completions, references, **kwargs):
            # 1.0 for the sum, 0.6 one off, else 0.0
            out = []
            for c, r in zip(completions, references):
                digits = "".join(ch for ch in c if ch.isdigit())[:2]
                off = abs(int(digits) - int(r)) if digits else 99
                out.append(1.0 if off == 0 else 0.6 if off == 1 else 0.0)
            return out
    '''))
    rc = main(["train", str(ROOT / "configs" / "tiny.toml"), "--set", f"model.path='{tiny_model_path}'",
               "--set", f"run.output_dir='{tmp_path / 'runs'}'", "--set", "run.steps=2", "--set", "run.progress=false",
               "--set", "run.save_every=0", "--set", "task.eval_size=40", "--set", "rewards.eval_metric='near'",
               "--set", "rewards.eval_threshold=0.5",
               "--set", "rewards.functions=[{name='correct'}, {function='mine.py:near', weight=0.5}]"])
    assert rc == 0
    err = capsys.readouterr().err
    (run_dir,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    near = load_function(read_source("mine.py:near", "test"), "test")
    evals = {r["step"]: r for r in rows if r.get("event") == "eval"}
    assert sorted(evals) == [0, 2]
    for step, ev in evals.items():
        answers = [json.loads(line) for line in (run_dir / "evals" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        scores = near([a["completion"] for a in answers], [a["reference"] for a in answers])
        assert [a["score"] for a in answers] == scores and len(scores) == 40
        assert ev["metric"] == "near" and ev["accuracy"] == sum(s >= 0.5 for s in scores) / 40
        assert ev["score_mean"] == pytest.approx(sum(scores) / 40)
    (baseline,) = [r for r in rows if r.get("event") == "baseline"]
    assert baseline["metric"] == "near"
    (judge,) = [r for r in rows if r.get("event") == "judge"]
    assert judge["judge"].startswith("near (rewards.functions[1] (function); correct when its score >= 0.5)")
    assert f"held-out accuracy (near, 40 prompts, greedy, int4 generator): {evals[0]['accuracy']:.1%} before" in err


def test_the_step_accuracy_reads_back_an_entrys_scores_and_judges_the_rest():
    """A judge that is one of the step's rewards is not computed twice: its scores are read back from the groups; a
    built-in judge that is not among them (text_match by default on words) judges the texts itself."""
    items = _items(["Paris", "Rome"])
    groups = _groups(items, ["It is Paris.", "Milan"])
    judge = choose_judge(_cfg({"functions": [{"name": "text_match"}]}).rewards, ["Paris"])
    assert judge.sample_accuracy(groups) == 0.5  # no scores on the groups: judged here
    # scores that differ from what text_match would say: read back
    groups = [dataclasses.replace(g, scores={"text_match": score}) for g, score in zip(groups, ([0.0], [1.0]))]
    assert judge.sample_accuracy(groups) == 0.5 and judge.sample_accuracy(groups[:1]) == 0.0


def _env_cfg(rewards: dict) -> object:
    return config_from_dict({"model": {"path": "builtin:tiny-digits"}, "rewards": rewards, "rollout": {
        "backend": "torch"}, "environment": {"name": "env.py:Game", "max_context": 512}}, check_environment=False)


def test_the_environment_judges_held_out_trajectories_by_its_own_score():
    """rewards.eval_metric = "environment": a trajectory is correct when the environment scored it at or above the
    threshold, whatever its text says; an answer that is no trajectory (the majority baseline's) cannot be judged."""
    from qgrpo.rollout.rewards.judge import JudgeError

    cfg = _env_cfg({"eval_metric": "environment", "eval_threshold": 0.8})
    judge = choose_judge(cfg.rewards, ["3", "4", "5"], environment=cfg.environment)
    assert judge.environment and not judge.builtin
    items = _items(["3", "4", "5"])
    trajectories = [Completion([1], [0.0], "stop", text, turns=[], env_score=score)
                    for text, score in (("<answer>3</answer>", 0.2), ("wrong", 0.9), ("5", None))]
    groups = [GroupRollout(item=it, prompt_ids=[1], completions=[c], policy_version=0, generator_id="test",
                           precision="bf16") for it, c in zip(items, trajectories)]
    res = score_eval(groups, judge)
    assert (res["accuracy"], res["metric"]) == (pytest.approx(1 / 3), "environment")
    assert judge.sample_accuracy(groups) == pytest.approx(1 / 3)
    assert "environment's own score" in judge.describe() and ">= 0.8" in judge.describe()
    with pytest.raises(JudgeError, match="scores trajectories of the environment"):
        judge.scores(["3"], items[:1])  # texts alone: no env_score to read
    with pytest.raises(JudgeError, match="scores trajectories of the environment"):
        train = type("Listed", (), {"__len__": lambda self: 2, "item": lambda self, i: _items(["3", "3"])[i]})
        majority_baseline(train(), items, judge)


def test_the_environment_as_judge_needs_an_environment():
    from qgrpo.rollout.rewards.judge import JudgeError

    with pytest.raises(ConfigError, match=r"rewards.eval_metric: 'environment' judges held-out trajectories by the "
                                          r"environment's own score, but no environment is set"):
        _cfg({"eval_metric": "environment"})
    assert _env_cfg({"eval_metric": "environment"}).rewards.eval_metric == "environment"
    with pytest.raises(JudgeError, match="no \\[environment\\] is set"):
        choose_judge(_cfg({}).rewards.__class__(eval_metric="environment"), environment=_cfg({}).environment)
