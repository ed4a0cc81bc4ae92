"""Reward functions of the user's own: loading, the calling convention, deadlines, on_error, and the Ray reward pool
(real Ray workers; a run whose rewards come from a user file)."""
import dataclasses
import json
import re
import textwrap
import time
from pathlib import Path

import pytest

from qgrpo.cluster.config.schema import ConfigError, config_from_dict
from qgrpo.core.records import Completion, GroupRollout, PromptItem
from qgrpo.rollout.rewards import REWARD_FUNCTIONS, RewardError
from qgrpo.rollout.rewards.calls import (
    RELATIVE_PATHS,
    RESERVED,
    RewardLoadError,
    RewardOutputError,
    Source,
    call_reward,
    group_kwargs,
    load_function,
    read_source,
    signature_problems,
)
from qgrpo.rollout.rewards.scoring import CallResult, RewardEntry, Scores, call_with_deadline, combine, score_batch

ROOT = Path(__file__).resolve().parents[1]

USER_FILE = '''
import asyncio, time

def tolerant(completions, references, tolerance=None, **kwargs):
    out = []
    for c, r, t in zip(completions, references, tolerance):
        try:
            out.append(float(abs(float(c.strip()) - float(r)) <= float(t)))
        except ValueError:
            out.append(0.0)
    return out

def shortness(completion_ids):
    return [-0.01 * len(ids) for ids in completion_ids]

def only_hard(completions, difficulty, **kwargs):
    return [1.0 if d == "hard" else None for d in difficulty]

async def async_len(completions, **kwargs):
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]

def columns_seen(completions, **kwargs):
    return [float(sorted(kwargs) == sorted(SEEN)) for _ in completions]

SEEN = []

def sleeper(completions, **kwargs):
    time.sleep(30)
    return [0.0] * len(completions)

def raiser(completions, **kwargs):
    raise KeyError("no such field")

def wrong_count(completions, **kwargs):
    return [1.0]
'''


@pytest.fixture
def user_file(tmp_path) -> Path:
    p = tmp_path / "my_rewards.py"
    p.write_text(USER_FILE)
    return p


def _groups(rows: list[dict], texts: list[list[str]]) -> list[GroupRollout]:
    out = []
    for i, (row, group) in enumerate(zip(rows, texts)):
        item = PromptItem(f"jsonl-train-{i}", row["prompt"], str(row["answer"]), columns=row)
        comps = [Completion(list(range(len(t))), [0.0] * len(t), "stop", t) for t in group]
        out.append(GroupRollout(item, [1, 2], comps, 0, "g", "bf16"))
    return out


ROWS = [{"prompt": "half of 5?", "answer": 2.5, "tolerance": 0.1, "difficulty": "easy"},
        {"prompt": "pi?", "answer": 3.14159, "tolerance": 0.01, "difficulty": "hard"}]
TEXTS = [["2.5", "2.55", "3"], ["3.14", "3.2", "x"]]


def _fn(path: Path, name: str):
    return load_function(read_source(f"{path}:{name}", "f"), "f")


# ----------------------------------------------------------------------------------------------- the convention


def test_kwargs_carry_every_column_per_completion():
    kw = group_kwargs(_groups(ROWS, TEXTS))
    multi_turn = {"env_scores", "turns"}  # only for the trajectories of an [environment]
    assert set(RESERVED) - multi_turn <= set(kw) and not multi_turn & set(kw)
    assert {"prompt", "answer", "tolerance", "difficulty"} <= set(kw)
    assert all(len(v) == 6 for v in kw.values())
    assert kw["tolerance"] == [0.1] * 3 + [0.01] * 3 and kw["item_ids"][3] == "jsonl-train-1"
    assert kw["completion_ids"][1] == [0, 1, 2, 3] and kw["finish_reasons"] == ["stop"] * 6


def test_a_trajectory_reaches_rewards_as_its_messages_and_the_environment_s_score():
    """A multi-turn trajectory's completion is its messages after the prompt (TRL's conversational shape); its turns
    and the environment's score come as keywords; the built-ins read its last assistant message, and the
    "environment" built-in the score."""
    from qgrpo.rollout.rewards import REWARD_FUNCTIONS, REWARD_NAMES

    groups = _groups(ROWS[:1], [["5", "7", "1"]])
    turns = [{"role": "assistant", "content": "5", "start": 0, "end": 1, "tool_calls": [], "error": None},
             {"role": "user", "content": "lower", "start": 1, "end": 3, "tool_calls": [], "error": None},
             {"role": "assistant", "content": "3", "start": 3, "end": 4, "tool_calls": [], "error": None}]
    groups[0] = dataclasses.replace(groups[0], completions=[
        dataclasses.replace(c, turns=turns, env_score=score, model_mask=[1, 0, 0, 1])
        for c, score in zip(groups[0].completions, (1.0, 0.0, 0.5))])
    kw = group_kwargs(groups)
    assert kw["completions"][0] == [{"role": "assistant", "content": "5"}, {"role": "user", "content": "lower"},
                                    {"role": "assistant", "content": "3"}]
    assert kw["env_scores"] == [1.0, 0.0, 0.5] and kw["turns"][2][1]["content"] == "lower"
    assert call_reward(REWARD_FUNCTIONS["environment"], kw) == [1.0, 0.0, 0.5]
    assert call_reward(REWARD_FUNCTIONS["exact"], {**kw, "references": ["3"] * 3}) == [1.0] * 3  # the last answer
    assert "environment" not in REWARD_NAMES  # added by [environment].weight, never listed by name


def test_user_function_from_a_file(user_file):
    kw = group_kwargs(_groups(ROWS, TEXTS))
    assert call_reward(_fn(user_file, "tolerant"), kw) == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert call_reward(_fn(user_file, "shortness"), kw) == pytest.approx([-0.03, -0.04, -0.01, -0.04, -0.03, -0.01])
    assert call_reward(_fn(user_file, "only_hard"), kw) == [None] * 3 + [1.0] * 3
    assert call_reward(_fn(user_file, "async_len"), kw) == [3.0, 4.0, 1.0, 4.0, 3.0, 1.0]


def test_module_functions_and_builtins_share_the_signature(tmp_path, monkeypatch):
    kw = group_kwargs(_groups([{"prompt": "q", "answer": "7"}], [["<answer>7</answer>", "7"]]))
    (tmp_path / "graders_mod.py").write_text("def has_tags(completions, **kw):\n"
                                             "    return [float('<answer>' in c) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert call_reward(load_function(Source("graders_mod:has_tags"), "f"), kw) == [1.0, 0.0]
    with pytest.raises(RewardLoadError, match="is a dict, not a function"):
        load_function(Source("qgrpo.rollout.rewards:REWARD_FUNCTIONS"), "f")
    assert call_reward(REWARD_FUNCTIONS["answer_correct"], kw) == [1.0, 0.0]
    assert call_reward(REWARD_FUNCTIONS["lenient_correct"], kw) == [1.0, 1.0]


def test_load_errors_name_the_entry(tmp_path, user_file):
    rule = re.escape(RELATIVE_PATHS)
    looked = re.escape(f"looked for at {str(tmp_path / 'nope.py')!r}")
    with pytest.raises(RewardLoadError, match=rf"f: cannot read 'nope.py' \(FileNotFoundError.*{looked}\).*{rule}$"):
        read_source("nope.py:fn", "f", tmp_path)  # where it was looked for (a config file's folder), and the rule
    looked = re.escape(f"looked for at {str(Path.cwd() / 'nope.py')!r}")
    with pytest.raises(RewardLoadError, match=rf"f: cannot read 'nope.py' \(FileNotFoundError.*{looked}\).*{rule}$"):
        read_source("nope.py:fn", "f")  # a --set value: the working directory
    with pytest.raises(RewardLoadError, match=r"cannot read '/nowhere/nope.py' \(FileNotFoundError: [^,]*\); put"):
        read_source("/nowhere/nope.py:fn", "f")  # absolute (a config file's, anchored): tried where it says
    with pytest.raises(RewardLoadError, match=r"has no 'tolerent'; its functions: .*tolerant"):
        _fn(user_file, "tolerent")
    with pytest.raises(RewardLoadError, match="is not FILE.py:FUNCTION or MODULE:FUNCTION"):
        read_source("my_rewards.tolerant", "f")
    with pytest.raises(RewardLoadError, match="cannot import module 'no_such_module_xyz'"):
        load_function(Source("no_such_module_xyz:fn"), "f")
    bad = tmp_path / "bad.py"
    bad.write_text("import no_such_module_xyz\n")
    with pytest.raises(RewardLoadError, match=r"importing .*bad.py failed \(ModuleNotFoundError"):
        _fn(bad, "f")


def test_signature_problems(user_file):
    cols = {"prompt", "answer", "tolerance", "difficulty"}
    assert signature_problems(_fn(user_file, "tolerant"), "f", cols) == []
    assert signature_problems(_fn(user_file, "shortness"), "f", cols) == []

    def needs_unknown(completions, rubric):
        return []

    def positional(completions, /):
        return []

    def nothing(text=None):
        return []

    assert "requires 'rubric', which the call does not pass" in signature_problems(needs_unknown, "f", cols)[0]
    assert "positional-only" in signature_problems(positional, "f", cols)[0]
    assert "takes none of the keywords" in signature_problems(nothing, "f", cols)[0]


def test_outputs_are_checked(user_file):
    kw = group_kwargs(_groups(ROWS, TEXTS))
    with pytest.raises(RewardOutputError, match="returned 1 values for 6 completions"):
        call_reward(_fn(user_file, "wrong_count"), kw)
    with pytest.raises(RewardOutputError, match="value 1 is nan"):
        call_reward(lambda completions: [0.0, float("nan")] + [0.0] * 4, kw)
    with pytest.raises(RewardOutputError, match="value 0 is a str"):
        call_reward(lambda completions: ["1"] * 6, kw)
    with pytest.raises(RewardOutputError, match="returned a float"):
        call_reward(lambda completions: 1.0, kw)


# ----------------------------------------------------------------------------------------------- deadlines, on_error


def test_deadline_and_failures_are_reported(user_file):
    kw = group_kwargs(_groups(ROWS, TEXTS))
    t0 = time.perf_counter()
    r = call_with_deadline("sleeper", _fn(user_file, "sleeper"), kw, 0.3)
    assert r.timed_out and r.values is None and "within its timeout of 0.3 s" in r.error
    assert time.perf_counter() - t0 < 5
    r = call_with_deadline("raiser", _fn(user_file, "raiser"), kw, 5)
    assert not r.timed_out and r.error == "KeyError: 'no such field'"


def test_a_batch_call_that_raises_is_narrowed_to_the_rows_that_raise():
    """One row's bad column fails that row's completions only, named in the error; the others keep their scores."""
    rows = [{"prompt": f"q{i}", "answer": i} for i in range(4)]
    rows[3]["answer"] = "three"
    groups = _groups(rows, [["1", "2"]] * 4)
    kw = group_kwargs(groups)

    def as_number(completions, answer, **kwargs):
        return [float(int(a) == int(c)) for c, a in zip(completions, answer)]

    entry = RewardEntry("as_number", 1.0, "function", "f.py:as_number", 5.0, field="rewards.functions[0]")
    (r,) = score_batch([entry], {"as_number": as_number}, kw)
    assert r.raised == (6, 7) and r.values[:6] == [0.0, 0.0, 1.0, 0.0, 0.0, 1.0] and r.values[6:] == [None, None]
    assert r.error == "ValueError: invalid literal for int() with base 10: 'three'"
    s = Scores(8)
    s.add(r, 0, 8)
    with pytest.raises(RewardError, match=r"failed on prompt 'jsonl-train-3': ValueError"):
        combine([entry], s, kw["item_ids"], "fail")
    totals, m = combine([entry], s, kw["item_ids"], "zero")
    assert totals == [0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0] and m["reward/errors"] == 2

    def batch_only(completions, **kwargs):  # raises on the batch, never on one completion: the whole call fails
        if len(completions) > 1:
            raise RuntimeError("batch")
        return [1.0]

    (r,) = score_batch([dataclasses.replace(entry, label="b")], {"b": batch_only}, kw)
    assert r.values is None and r.raised == () and r.error == "RuntimeError: batch"


def _entries(*labels_weights):
    return [RewardEntry(label, w, "builtin", label, 5.0, field=f"rewards.functions[{i}]")
            for i, (label, w) in enumerate(labels_weights)]


def test_combine_weights_none_and_on_error():
    ids = ["p0", "p0", "p1", "p1"]
    entries = _entries(("a", 1.0), ("b", 0.5))
    s = Scores(4)
    s.add(CallResult("a", [1.0, 0.0, None, None]), 0, 4)
    s.add(CallResult("b", [1.0, 1.0, 1.0, None]), 0, 4)
    with pytest.raises(RewardError, match="no reward applies to a completion of prompt 'p1'"):
        combine(entries, s, ids, "fail")
    s.values["b"][3] = 0.0
    totals, m = combine(entries, s, ids, "fail")
    assert totals == [1.5, 0.5, 0.5, 0.0] and m["reward/a"] == 0.5 and m["reward/b"] == 0.75
    failed = Scores(4)
    failed.add(CallResult("a", [1.0, 1.0, 1.0, 1.0]), 0, 4)
    failed.add(CallResult("b", None, "KeyError: 'x'"), 2, 4)
    failed.add(CallResult("b", [1.0, 1.0]), 0, 2)
    with pytest.raises(RewardError, match=r"reward 'b' \(rewards.functions\[1\]\) failed on prompt 'p1': KeyError"):
        combine(entries, failed, ids, "fail")
    totals, m = combine(entries, failed, ids, "zero")
    assert totals == [1.5, 1.5, 1.0, 1.0] and m["reward/errors"] == 2


# ----------------------------------------------------------------------------------------------- config


def _cfg(functions, **rewards):
    return config_from_dict({"model": {"path": "builtin:tiny-digits"}, "rewards": {"functions": functions, **rewards}},
                            check_environment=False)


def test_config_entries():
    cfg = _cfg([{"name": "answer_correct"}, {"function": "my_rewards.py:tolerant", "weight": 0.5},
                {"url": "http://127.0.0.1:9/score", "timeout_s": 3}])
    assert [s.weight for s in cfg.rewards.functions] == [1.0, 0.5, 1.0]
    with pytest.raises(ConfigError, match=r"rewards.functions\[0\]: give exactly one of name .* got name and url"):
        _cfg([{"name": "correct", "url": "http://x/y"}])
    with pytest.raises(ConfigError, match="is not FILE.py:FUNCTION"):
        _cfg([{"function": "my_rewards.tolerant"}])
    with pytest.raises(ConfigError, match=r"metric name 'correct' is also rewards.functions\[0\]'s"):
        _cfg([{"name": "correct"}, {"function": "m.py:correct"}])
    with pytest.raises(ConfigError, match="unknown reward 'my_rewards.tolerant'.*function = "):
        _cfg([{"name": "my_rewards.tolerant"}])


# ----------------------------------------------------------------------------------------------- the Ray pool


def _pool_cfg(user_file, names, **rewards):
    fns = [{"function": f"{user_file}:{n}", "timeout_s": 3 if n == "sleeper" else 0} for n in names]
    return _cfg(fns, **rewards)


def test_pool_parallel_equals_serial(ray_session, user_file):
    from qgrpo.cluster.run.rewarding import RewardPool

    rows = [dict(ROWS[i % 2], prompt=f"q{i}") for i in range(6)]
    texts = [["2.5", "3.1416", str(i)] for i in range(6)]
    got = {}
    for workers in (0, 3):
        pool = RewardPool(_pool_cfg(user_file, ["tolerant", "shortness", "async_len"], num_workers=workers))
        groups = _groups(rows, texts)
        scored = pool.submit(groups).result()
        got[workers] = ([g.rewards for g in scored.groups],
                        {k: v for k, v in scored.metrics.items() if not k.startswith("time/")})
        pool.close()
    assert got[0] == got[3]
    assert set(got[3][1]) >= {"reward/tolerant", "reward/shortness", "reward/async_len", "reward/mean"}


def test_pool_timeout_and_raise_follow_on_error(ray_session, user_file):
    from qgrpo.cluster.run.rewarding import RewardPool

    pool = RewardPool(_pool_cfg(user_file, ["tolerant", "sleeper", "raiser"], on_error="zero", num_workers=2))
    groups = _groups(ROWS, TEXTS)
    t0 = time.monotonic()
    scored = pool.submit(groups).result()
    m = scored.metrics
    assert time.monotonic() - t0 < 20
    assert m["reward/errors"] == 12 and m["reward/workers_replaced"] == 2  # 2 rewards x 6 completions
    assert [g.rewards for g in scored.groups] == [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]  # tolerant alone counts
    assert [g.rewards for g in groups] == [[], []]  # the groups given are left as they were: values
    again = _groups(ROWS, TEXTS)
    pool.submit(again).result()  # the replacements score the next step
    pool.close()
    strict = RewardPool(_pool_cfg(user_file, ["tolerant", "raiser"], num_workers=1))
    with pytest.raises(RewardError, match=r"reward 'raiser' .* failed on prompt 'jsonl-train-0' and 1 more: KeyError"):
        strict.submit(_groups(ROWS, TEXTS)).result()
    strict.close()


def test_pool_worker_that_cannot_load_fails_first_step(ray_session, tmp_path):
    from qgrpo.cluster.run.rewarding import RewardPool, RewardWorkersFailed

    p = tmp_path / "r.py"
    p.write_text("def f(completions):\n    return [0.0] * len(completions)\n")
    pool = RewardPool(_cfg([{"function": f"{p}:f"}]))
    p.write_text("raise RuntimeError('broken on this node')\n")  # the driver read the good version: no error
    pool.close()
    pool = RewardPool(_cfg([{"function": f"{p}:f"}]))
    with pytest.raises(RewardWorkersFailed, match="broken on this node"):
        pool.submit(_groups(ROWS, TEXTS)).result()
    pool.close()


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
def test_run_trains_on_rewards_from_a_user_file(ray_session, tiny_model_path, tmp_path, monkeypatch):
    """A two-step run on a chat-format JSONL of the user's with a reward file in a temporary folder: each function's
    mean is logged, and the function saw the row's extra column. Chat rows give conversational completions, as in
    TRL: [{"role": "assistant", "content": TEXT}]."""
    from qgrpo.cluster.cli.app import main

    monkeypatch.chdir(tmp_path)
    # chat turns (one user turn: the tiny model's tokenizer cannot write the blank line between turns)
    rows = [{"messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": a + b, "tolerance": 1}
            for a in range(5) for b in range(5)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "mine.py").write_text(textwrap.dedent('''
        def near(completions, references, tolerance, **kwargs):
            out = []
            for c, r, t in zip(completions, references, tolerance):
                digits = "".join(ch for ch in c[0]["content"] if ch.isdigit())[:3]
                out.append(float(bool(digits) and abs(int(digits) - int(r)) <= t))
            return out

        def brevity(completion_ids):
            return [-0.1 * len(ids) for ids in completion_ids]
    '''))
    rc = main(["train", str(ROOT / "configs" / "tiny.toml"), "--set", f"model.path='{tiny_model_path}'",
               "--set", f"run.output_dir='{tmp_path / 'runs'}'", "--set", "run.steps=2", "--set", "run.progress=false",
               "--set", "task.name='jsonl'", "--set", "task.path='data.jsonl'", "--set", "task.eval_size=5",
               "--set", "task.prompt_column='messages'",
               "--set", "rewards.functions=[{function='mine.py:near'}, {function='mine.py:brevity', weight=0.5}]"])
    assert rc == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in rows if "reward/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert 0.0 <= m["reward/near"] <= 1.0 and m["reward/brevity"] < 0
        assert m["reward/mean"] == pytest.approx(m["reward/near"] + 0.5 * m["reward/brevity"], abs=1e-9)


def test_pool_reward_model_scores_as_the_classifier_in_process(ray_session, tmp_path):
    """[reward_model] actors behind the pool: their scores, weighted, are the rewards; equal to the classifier run in
    this process on the same chat-formatted conversations."""
    from qgrpo.cluster.run.rewarding import RewardPool
    from qgrpo.rollout.modeling.models import resolve_model_path
    from qgrpo.rollout.rewards.classifier import RewardClassifier

    path = resolve_model_path("builtin:tiny-reward", str(tmp_path))
    cfg = config_from_dict({"model": {"path": "builtin:tiny-digits"},
                            "reward_model": {"path": "builtin:tiny-reward", "precision": "fp32", "num_actors": 2},
                            "rewards": {"functions": [{"name": "reward_model", "weight": 0.5}]}},
                           check_environment=False)
    rows = [{"prompt": f"{a}+{a}=", "answer": 2 * a} for a in range(3)]
    texts = [[str(2 * a), str(2 * a + 1), "9"] for a in range(3)]
    pool = RewardPool(cfg, path)
    groups = _groups(rows, texts)
    scored = pool.submit(groups).result()
    m, groups = scored.metrics, scored.groups
    pool.close()
    local = RewardClassifier(path, precision="fp32").score([r["prompt"] for r in rows for _ in range(3)],
                                                           [t for g in texts for t in g])
    got = [r for g in groups for r in g.rewards]
    assert got == pytest.approx([0.5 * x for x in local], abs=1e-4)
    assert m["reward/reward_model"] == pytest.approx(sum(local) / len(local), abs=1e-4) and len(set(local)) > 1


def test_pool_remote_reward_that_is_down(ray_session):
    """A URL nothing listens on: on_error = "fail" names the reward, the URL and the cause; "zero" counts it."""
    import socket

    from qgrpo.cluster.run.rewarding import RewardPool

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    url = f"http://127.0.0.1:{port}/score"
    for on_error in ("fail", "zero"):
        pool = RewardPool(_cfg([{"name": "lenient_correct"}, {"url": url, "timeout_s": 3, "retries": 1}],
                               on_error=on_error))
        pending = pool.submit(_groups(ROWS, TEXTS))
        if on_error == "fail":
            with pytest.raises(RewardError, match=rf"reward 'remote' .*{port}.*(refused|Connection)"):
                pending.result()
        else:
            assert pending.result().metrics["reward/errors"] == 6
        pool.close()


def test_check_and_train_refuse_bad_rewards_before_ray(tiny_model_path, tmp_path, monkeypatch, capsys):
    """A missing file, a missing function, a wrong signature (a column the data does not have) and a reward-model
    folder that is not a classifier: all named at once by `check`, and by `train` before anything starts."""
    from qgrpo.cluster.cli.app import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": a + 1}) + "\n"
                                                 for a in range(9)))
    (tmp_path / "mine.py").write_text("def needs_rubric(completions, rubric):\n    return [0.0] * len(completions)\n")
    args = ["--set", f"model.path='{tiny_model_path}'", "--set", f"run.output_dir='{tmp_path / 'runs'}'",
            "--set", "task.name='jsonl'", "--set", "task.path='data.jsonl'", "--set", "task.eval_size=2",
            "--set", f"reward_model.path='{tiny_model_path}'",
            "--set", "rewards.functions=[{function='gone.py:f'}, {function='mine.py:nope'}, "
                     "{function='mine.py:needs_rubric'}, {name='reward_model'}]"]
    outputs = []
    for command in ("check", "train"):
        assert main([command, str(ROOT / "configs" / "tiny.toml"), *args]) == 2
        out, err = capsys.readouterr()
        outputs.append(out if command == "check" else err)  # check's report is on stdout, train's on stderr
    for err in outputs:
        assert "rewards.functions[0].function: cannot read 'gone.py'" in err
        assert "rewards.functions[1].function: mine.py has no 'nope'; its functions: needs_rubric" in err
        assert "rewards.functions[2].function: requires 'rubric', which the call does not pass" in err
        assert "reward_model.path" in err and "a causal LM (LlamaForCausalLM)" in err
    assert "qgrpo check: REFUSED: 4 problems" in outputs[0]
    assert not (tmp_path / "runs").exists()
