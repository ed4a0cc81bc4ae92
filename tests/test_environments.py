"""Multi-turn environments (rollout/environments/, actors/env_worker.py): the contract's checks of what an
environment answers, tools and ToolEnvironment, loading an environment as a config names it, the [environment]
section and its rules, `qgrpo check`'s refusals of a bad environment before Ray, the two examples' environments, and
(real Ray) the environment workers: results in key order, an environment that raises or sleeps past its deadline
answered by an EnvFailure in its place, a worker that stops answering killed and replaced."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pytest

from qgrpo.cluster.config.schema import ConfigError, load_config
from qgrpo.core.records import PromptItem
from qgrpo.rollout.environments import (
    EnvFailure,
    Environment,
    EnvironmentLoadError,
    EnvironmentOutputError,
    StepResult,
    ToolEnvironment,
    ToolSchemaError,
    environment_spec,
    environment_tools,
    load_environment,
    row_of,
    tool_schema,
    tools_prompt,
)
from qgrpo.rollout.environments.contract import reset_env, score_env, step_env
from qgrpo.rollout.environments.host import EnvHost
from qgrpo.rollout.environments.probe import load_problems, probe_environment
from qgrpo.rollout.environments.tools import parse_tool_calls

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
GUESS = ROOT / "examples" / "guess_number"
CALC = ROOT / "examples" / "calculator"

ENV_FILE = '''
import time
from qgrpo.rollout.environments import Environment, StepResult, ToolEnvironment


class Echo(Environment):
    """Answers each turn with it reversed; done after `turns` turns; +1 per turn that says "ok"."""

    def __init__(self, turns: int = 2):
        self.turns, self.seen = turns, 0

    def reset(self, row):
        return [{"role": "user", "content": str(row["prompt"])}]

    def step(self, turn):
        self.seen += 1
        return StepResult([{"role": "user", "content": turn[::-1]}], done=self.seen >= self.turns,
                          reward=1.0 if turn == "ok" else 0.0)


class Raises(Echo):
    def step(self, turn):
        if turn == "boom":
            raise ValueError("no boom here")
        return super().step(turn)


class Strict(Echo):
    """Reads every turn as a number: passes a step with the reference answer, raises on an empty turn."""

    def step(self, turn):
        float(turn)
        return super().step(turn)


class Sleeps(Echo):
    def step(self, turn):
        if turn == "sleep":
            time.sleep(30)
        return super().step(turn)


class Spins(Echo):
    def step(self, turn):
        if turn == "spin":
            import re
            re.match(r"(a+)+$", "a" * 40 + "b")  # never gives the interpreter back
        return super().step(turn)


def make_echo(turns: int = 1):
    return Echo(turns)


def make_nothing():
    return object()


class NotAnEnv:
    pass


def undocumented(x):
    return x


class BadTool(ToolEnvironment):
    tools = [undocumented]
'''


@pytest.fixture
def env_file(tmp_path) -> Path:
    path = tmp_path / "envs.py"
    path.write_text(ENV_FILE)
    return path


def _item(prompt: str = "3+4", answer: str = "7", **columns) -> PromptItem:
    return PromptItem("jsonl-train-0", prompt, answer, columns=columns or None)


# ---------------------------------------------------------------------------------------------------------------
# The contract


class _Bare(Environment):
    def __init__(self, answer=None):
        self.answer = answer

    def reset(self, row):
        return self.answer

    def step(self, turn):
        return self.answer


def test_row_of_gives_prompt_answer_and_columns():
    assert row_of(_item(level=3)) == {"prompt": "3+4", "answer": "7", "level": 3}


def test_contract_checks_what_an_environment_answers():
    with pytest.raises(EnvironmentOutputError, match="reset returned a str; expected a list of messages"):
        reset_env(_Bare("hello"), {})
    with pytest.raises(EnvironmentOutputError, match="reset returned no messages"):
        reset_env(_Bare([]), {})
    with pytest.raises(EnvironmentOutputError, match="'content' in message 0"):
        reset_env(_Bare([{"role": "user", "content": 3}]), {})
    with pytest.raises(EnvironmentOutputError, match="step returned a list; expected a StepResult"):
        step_env(_Bare([{"role": "user", "content": "x"}]), "turn")
    with pytest.raises(EnvironmentOutputError, match="no messages and done=False"):
        step_env(_Bare(StepResult([])), "turn")
    with pytest.raises(EnvironmentOutputError, match="reward step returned is nan"):
        step_env(_Bare(StepResult([], done=True, reward=float("nan"))), "turn")
    env = _Bare()
    env.score = lambda: "1"
    with pytest.raises(EnvironmentOutputError, match="the score is '1'"):
        score_env(env)


def test_default_score_sums_the_step_rewards_of_its_own_instance():
    a, b = _Bare(StepResult([{"role": "user", "content": "x"}], reward=0.5)), _Bare(StepResult([], True, 2.0))
    step_env(a, "t")
    step_env(a, "t")
    step_env(b, "t")
    assert score_env(a) == 1.0 and score_env(b) == 2.0 and score_env(_Bare()) == 0.0


# ---------------------------------------------------------------------------------------------------------------
# Tools


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. "2 * 3".
    """
    if "/ 0" in expression:
        raise ZeroDivisionError("division by zero")
    return str(eval(expression, {"__builtins__": {}}))  # a test's own tool


def no_docs(expression: str) -> str:
    return expression


class Calc(ToolEnvironment):
    tools = [calculate]


def test_tool_schema_from_signature_and_docstring():
    schema = tool_schema(calculate)
    assert schema["function"]["name"] == "calculate"
    assert schema["function"]["parameters"]["properties"]["expression"]["type"] == "string"
    with pytest.raises(ToolSchemaError, match="tool 'no_docs': its JSON schema cannot be made.*Args:"):
        tool_schema(no_docs)
    text = tools_prompt([calculate])
    assert '"name": "calculate"' in text and "<tool_call>" in text and tools_prompt([]) == ""


def test_parse_tool_calls():
    calls = parse_tool_calls('a <tool_call>{"name": "calculate", "arguments": {"expression": "1+1"}}</tool_call> b '
                             '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
                             '<tool_call>{oops}</tool_call><tool_call>[1]</tool_call>')
    assert calls[0] == {"name": "calculate", "arguments": {"expression": "1+1"}}
    assert calls[1] == {"name": "f", "arguments": {"x": 1}}  # arguments written as a JSON string
    assert calls[2].startswith("the tool call is not JSON") and "a JSON object with a \"name\"" in calls[3]
    assert parse_tool_calls("the answer is 6") == []


def test_tool_environment_runs_calls_and_ends_on_an_answer():
    env = Calc()
    assert env.reset({"prompt": "2*3?", "answer": "6"}) == [{"role": "user", "content": "2*3?"}]
    r = step_env(env, '<tool_call>{"name": "calculate", "arguments": {"expression": "2 * 3"}}</tool_call>')
    assert r.messages == [{"role": "tool", "content": "6"}] and not r.done and r.info["tool_errors"] == 0
    assert r.info["tool_calls"] == [{"name": "calculate", "arguments": {"expression": "2 * 3"}, "error": None}]
    r = step_env(env, '<tool_call>{"name": "calculate", "arguments": {"expression": "1 / 0"}}</tool_call>'
                      '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
                      '<tool_call>{"name": "calculate", "arguments": {"expr": "1"}}</tool_call>')
    assert r.info["tool_errors"] == 3 and not r.done
    assert [m["content"] for m in r.messages] == [
        "error: ZeroDivisionError: division by zero", "error: there is no tool 'nope'; the tools are calculate",
        "error: calculate: missing a required argument: 'expression'"]
    r = step_env(env, "It is 6.")
    assert r.done and r.messages == [] and env.final == "It is 6."


# ---------------------------------------------------------------------------------------------------------------
# Loading


def test_load_a_class_a_factory_and_a_module(env_file, tmp_path, monkeypatch):
    env = load_environment(f"{env_file}:Echo", {"turns": 3})()
    assert isinstance(env, Environment) and env.turns == 3
    assert load_environment(f"{env_file}:make_echo")().turns == 1
    monkeypatch.chdir(tmp_path)  # a relative file is read against the working directory
    assert load_environment("envs.py:Echo")().turns == 2
    monkeypatch.syspath_prepend(str(tmp_path))
    assert type(load_environment("envs:Echo")()).__name__ == "Echo"
    assert environment_tools(load_environment(f"{ROOT}/examples/calculator/env.py:Calculator"))[0].__name__ == \
        "calculate"


@pytest.mark.parametrize("name, params, error", [
    ("envs.py", {}, r"environment.name: 'envs.py' is not FILE.py:NAME or MODULE:NAME"),
    ("gone.py:Echo", {}, r"environment.name: cannot read 'gone.py'"),
    ("envs.py:Eco", {}, r"environment.name: .*envs.py has no 'Eco'; its functions: .*Echo"),
    ("no_such_module_xyz:Echo", {}, r"environment.name: cannot import module 'no_such_module_xyz'"),
    ("envs.py:Echo", {"rounds": 2}, r"environment.params: \{rounds\} does not bind to Echo's parameters \(turns\)"),
    ("envs.py:NotAnEnv", {}, r"environment.name: .*NotAnEnv is a class but not an Environment subclass"),
    ("envs.py:BadTool", {}, r"environment.name: BadTool: tool 'undocumented': its JSON schema cannot be made"),
])
def test_load_errors_name_the_field_and_the_fix(env_file, monkeypatch, name, params, error):
    monkeypatch.chdir(env_file.parent)
    with pytest.raises(EnvironmentLoadError, match=error):
        load_environment(name, params)


def test_a_factory_must_make_an_environment(env_file):
    factory = load_environment(f"{env_file}:make_nothing")
    with pytest.raises(EnvironmentLoadError, match=r"make_nothing\(\*\*environment.params\) returned a object"):
        factory()


def test_the_spec_carries_the_file_so_workers_need_not_find_it(env_file):
    spec = environment_spec(f"{env_file}:Echo", {"turns": 1})
    env_file.unlink()
    from qgrpo.rollout.environments import factory_of

    assert factory_of(spec)().turns == 1


# ---------------------------------------------------------------------------------------------------------------
# The host of a worker: each call under its own deadline, failures as values in their places


def test_host_answers_every_entry_failures_in_their_places(env_file):
    host = EnvHost(load_environment(f"{env_file}:Raises"), timeout_s=5)
    first = host.reset(["a", "b"], [{"prompt": "p"}, {"prompt": "q"}])
    assert first == [[{"role": "user", "content": "p"}], [{"role": "user", "content": "q"}]]
    a, b = host.step(["a", "b"], ["boom", "ok"])
    assert isinstance(a, EnvFailure) and a.key == "a" and a.error == "ValueError: no boom here"
    assert "envs.py" in a.where and "raise ValueError" in a.where  # the user's own line
    assert b.messages == [{"role": "user", "content": "ko"}] and b.reward == 1.0
    again, score = host.step(["a"], ["ok"])[0], host.score(["b"])[0]
    assert isinstance(again, EnvFailure) and "an earlier call of it failed" in again.error
    assert score == 1.0
    assert host.drop(["a", "b"]) == 0


def test_host_deadline_answers_the_others(env_file):
    host = EnvHost(load_environment(f"{env_file}:Sleeps"), timeout_s=0.5)
    host.reset(["a", "b"], [{"prompt": "p"}, {"prompt": "q"}])
    started = time.monotonic()
    a, b = host.step(["a", "b"], ["sleep", "ok"])
    assert time.monotonic() - started < 5
    assert a == EnvFailure("a", "timed out after 0.5 s", timed_out=True)
    assert not isinstance(b, EnvFailure) and host.stuck() == 1


# ---------------------------------------------------------------------------------------------------------------
# [environment]: the section, its rules, the file anchored at the config's folder


def _config_file(tmp_path: Path, env: str, extra: str = "") -> Path:
    config = tmp_path / "config.toml"
    config.write_text(TINY.read_text() + f"\n[environment]\n{env}\n" + extra)
    return config


def _problems(path: Path, overrides: list[str] = ()) -> list[str]:
    try:
        load_config(path, list(overrides))
    except ConfigError as e:
        return e.problems
    return []


def test_environment_is_off_by_default_and_its_file_is_read_against_the_config(env_file, tmp_path, monkeypatch):
    assert load_config(TINY).environment.name == ""
    sub = tmp_path / "sub"
    sub.mkdir()
    monkeypatch.chdir(sub)
    cfg = load_config(_config_file(tmp_path, 'name = "envs.py:Echo"\nparams = {turns = 3}\nmax_context = 64'))
    assert cfg.environment.name == f"{env_file}:Echo" and cfg.environment.params == {"turns": 3}


def test_environment_rules(tmp_path, env_file):
    config = _config_file(tmp_path, 'name = "envs.py:Echo"\nmax_context = 64')
    assert _problems(config) == []
    assert any(p.startswith("environment.name: 'envs.py' is not FILE.py:NAME")
               for p in _problems(config, ["environment.name=envs.py"]))
    labelled = "rewards.functions=[{name='correct', label='environment'}]"
    problems = _problems(config, ["environment.max_context=3", labelled])
    assert any(p.startswith("environment.max_context: 3 tokens for a whole trajectory leave no room beside one "
                            "model turn of 3 tokens (rollout.max_new_tokens") for p in problems), problems
    assert any(p.startswith("rewards.functions[0]: its metric name 'environment' is the environment's score's")
               for p in problems), problems
    assert _problems(config, [labelled, "environment.weight=0"]) == []  # no score of the environment's among them
    assert _problems(TINY, [labelled]) == []
    problems = _problems(TINY, ["environment.params={turns=2}"])
    assert any(p.startswith("environment.params: set, but environment.name is \"\"") for p in problems)
    assert any(p.startswith("environment.on_error:") for p in _problems(config, ["environment.on_error=zero"]))


def test_a_backend_that_cannot_continue_is_refused(tmp_path, env_file, monkeypatch):
    import dataclasses

    from qgrpo.rollout.backends import REGISTRY

    monkeypatch.setitem(REGISTRY, "torch", dataclasses.replace(REGISTRY["torch"], multi_turn=False))
    problems = _problems(_config_file(tmp_path, 'name = "envs.py:Echo"\nmax_context = 64'))
    assert any(p.startswith("rollout.backend: 'torch' cannot continue a trajectory from its token ids")
               for p in problems), problems


def test_max_context_against_the_models_context(tmp_path, env_file):
    from qgrpo.cluster.config.preflight import trajectory_problems

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    cfg = load_config(_config_file(tmp_path, 'name = "envs.py:Echo"\nmax_context = 65'))
    assert [p[:60] for p in trajectory_problems(cfg, str(model))] == [
        "environment.max_context: 65 tokens exceed the model's context of 64 positions"[:60]]
    cfg.environment.max_context = 64
    assert trajectory_problems(cfg, str(model)) == []


# ---------------------------------------------------------------------------------------------------------------
# qgrpo check: refusals before Ray, and the probe (reset and one step on a train row)


def _checked(config: Path, overrides: list[str] = ()):
    from qgrpo.cluster.cli.train import checked_config

    return checked_config(argparse.Namespace(config=str(config), overrides=list(overrides)))


@pytest.mark.parametrize("override, error", [
    ("environment.name='gone.py:Echo'", "environment.name: cannot read 'gone.py'"),
    ("environment.name='envs.py:Eco'", "has no 'Eco'"),
    ("environment.params={rounds=1}", "environment.params: {rounds} does not bind to Echo's parameters"),
    ("environment.name='envs.py:BadTool'", "tool 'undocumented': its JSON schema cannot be made"),
])
def test_check_refuses_a_bad_environment_naming_it(tmp_path, env_file, monkeypatch, override, error):
    from qgrpo.cluster.cli.train import Refused

    monkeypatch.chdir(tmp_path)  # --set values are read against the working directory
    config = _config_file(tmp_path, 'name = "envs.py:Echo"\nmax_context = 64')
    assert _checked(config).environment.name.endswith("envs.py:Echo")
    with pytest.raises(Refused, match=error.replace("(", r"\(").replace(")", r"\)")):
        _checked(config, [override])


def test_probe_resets_and_steps_on_a_train_row(env_file, tmp_path):
    section = load_config(_config_file(tmp_path, 'name = "envs.py:Raises"\nmax_context = 64')).environment
    found = probe_environment(section, _item(answer="ok"))
    assert found.problems == [] and "reset gives 1 message, a step with 'ok' answers 1 message, score 1" in found.found
    found = probe_environment(section, _item(answer="boom"))
    assert found.problems == [f"environment.name ({section.name}): step on train row jsonl-train-0 raised ValueError: "
                              f"no boom here at {found.problems[0].split(' at ', 1)[1]}"]
    assert "raise ValueError" in found.problems[0] and "fix step(turn)" in found.problems[0]
    section.name, section.timeout_s = section.name.replace(":Raises", ":Sleeps"), 0.3
    found = probe_environment(section, _item(answer="sleep"))
    assert found.problems and "did not return within environment.timeout_s = 0.3 s" in found.problems[0]
    section.name = section.name.replace(":Sleeps", ":BadTool")
    assert "tool 'undocumented'" in load_problems(section)[0]


def test_probe_steps_with_what_a_model_in_training_writes_and_refuses_a_step_that_raises(env_file, tmp_path):
    section = load_config(_config_file(tmp_path, 'name = "envs.py:Strict"\nmax_context = 64')).environment
    found = probe_environment(section, _item(answer="7"))  # the reference and the wrong answer (11) are numbers
    line = f"{env_file}:32 in step: float(turn)"
    assert found.problems == [
        f"environment.name ({section.name}): step after an empty turn ('') raised ValueError: could not convert "
        f"string to float: '' at {line}; step() must answer any text the model can write: answer a turn it cannot "
        'use with a message telling the model so (e.g. StepResult([{"role": "user", "content": "answer with one '
        'number"}])), or end the episode with done=True and a low score, rather than raise (in a run, every such '
        'turn would end its trajectory as "env_error" with a score of 0)']
    section.name = section.name.replace(":Strict", ":Echo")  # answers anything: every stand-in passes
    found = probe_environment(section, _item(answer="7"))
    assert found.problems == [] and found.found.endswith(
        "it answers a wrong answer, an empty turn, a long turn, a malformed tool call")


# ---------------------------------------------------------------------------------------------------------------
# The examples' environments


def _example(folder: Path, name: str):
    return load_environment(f"{folder / 'env.py'}:{name}")


def test_guess_number_answers_in_the_tiny_models_characters():
    from qgrpo.rollout.modeling.models import _TINY_CHARS

    env = _example(GUESS, "GuessNumber")()
    env.turn_penalty = 0.1
    first = reset_env(env, {"prompt": "0-9", "answer": 6})
    said = [step_env(env, t) for t in ("5", "8", "x", "6")]
    assert [r.messages for r in said[:3]] == [[{"role": "user", "content": c}] for c in "+-/"]
    assert said[3].done and said[3].messages == []
    assert score_env(env) == pytest.approx(0.7)  # found at the 4th guess: 3 guesses before it
    assert all(ch in _TINY_CHARS for text in [first[0]["content"], "+", "-", "/"] for ch in text)
    lost = _example(GUESS, "GuessNumber")()
    reset_env(lost, {"prompt": "0-9", "answer": 6})
    step_env(lost, "1")
    assert score_env(lost) == 0.0
    rows = [json.loads(line) for line in (GUESS / "games.jsonl").read_text().splitlines()]
    assert {r["prompt"] for r in rows} == {"0-9"} and sorted({r["answer"] for r in rows}) == list(range(10))


def test_calculator_tool_and_score():
    sys.path.insert(0, str(CALC))
    try:
        env = _example(CALC, "Calculator")()
    finally:
        sys.path.remove(str(CALC))
    reset_env(env, {"prompt": "Calculate 314 * 365.", "answer": 114610})
    r = step_env(env, '<tool_call>{"name": "calculate", "arguments": {"expression": "314 * 365"}}</tool_call>')
    assert r.messages == [{"role": "tool", "content": "114610"}]
    r = step_env(env, '<tool_call>{"name": "calculate", "arguments": {"expression": "__import__(\'os\')"}}'
                      '</tool_call>')
    assert r.info["tool_errors"] == 1 and r.messages[0]["content"].startswith("error: ValueError: only numbers")
    step_env(env, "So it is <answer>114,610</answer>.")
    assert score_env(env) == 1.0
    wrong = _example(CALC, "Calculator")()
    reset_env(wrong, {"prompt": "Calculate 314 * 365.", "answer": 114610})
    step_env(wrong, "<answer>114600</answer>")
    assert score_env(wrong) == 0.0


def test_calculator_worked_exchanges_are_right_and_come_before_the_question():
    """The calculator shows two worked exchanges before each question: each call parses, the tool gives the result
    shown, the final answer scores 1 on it, and the question with its instruction comes last, as the row gave it."""
    sys.path.insert(0, str(CALC))
    try:
        env = _example(CALC, "Calculator")()
    finally:
        sys.path.remove(str(CALC))
    prompt = "Calculate 314 * 365.\nGive the final answer inside <answer></answer>."
    first = reset_env(env, {"prompt": prompt, "answer": 114610})
    assert first[-1] == {"role": "user", "content": prompt} and len(first) == 9
    for user, call, result, answer in (first[i:i + 4] for i in range(0, 8, 4)):
        assert [m["role"] for m in (user, call, result, answer)] == ["user", "assistant", "tool", "assistant"]
        assert user["content"].endswith("\nGive the final answer inside <answer></answer>.")
        demo = type(env)()
        reset_env(demo, {"prompt": user["content"], "answer": int(result["content"])})
        assert step_env(demo, call["content"]).messages == [{"role": "tool", "content": result["content"]}]
        step_env(demo, answer["content"])
        assert score_env(demo) == 1.0


@pytest.mark.parametrize("folder", [GUESS, CALC], ids=lambda p: p.name)
def test_examples_pass_the_environment_checks(folder, monkeypatch):
    from qgrpo.rollout.environments.probe import probe_environment_checks

    monkeypatch.chdir(ROOT)
    cfg = _checked(folder.relative_to(ROOT) / "config.toml")
    assert cfg.environment.name and load_problems(cfg.environment) == []
    assert probe_environment_checks(cfg) == []


# ---------------------------------------------------------------------------------------------------------------
# Real Ray: the workers and their client


def _client(env_file: Path, name: str, timeout_s: float = 5.0, workers: int = 2, slack_s: float = 30.0):
    from qgrpo.actors.env_worker import EnvClient

    client = EnvClient(environment_spec(f"{env_file}:{name}", {}), timeout_s, num_workers=workers, slack_s=slack_s)
    client.wait_ready(60)
    return client


def test_workers_answer_in_key_order_failures_in_place(ray_session, env_file):
    client = _client(env_file, "Raises")
    try:
        keys = [f"k{i}" for i in range(5)]
        first = client.reset(keys, [{"prompt": f"p{i}"} for i in range(5)])
        assert [m[0]["content"] for m in first] == [f"p{i}" for i in range(5)]
        assert sorted(client.home.values()) == [0, 0, 0, 1, 1]  # spread over both workers
        out = client.step(keys, ["ab", "boom", "ok", "cd", "boom"])
        assert [o.messages[0]["content"] for o in out if not isinstance(o, EnvFailure)] == ["ba", "ko", "dc"]
        assert [(o.key, o.error) for o in out if isinstance(o, EnvFailure)] == [
            ("k1", "ValueError: no boom here"), ("k4", "ValueError: no boom here")]
        out = client.step(keys, ["ok"] * 5)
        assert [o.done for o in out if not isinstance(o, EnvFailure)] == [True, True, True]
        assert isinstance(out[1], EnvFailure) and "an earlier call failed" in out[1].error
        assert client.score(keys) == [pytest.approx(v) if v is not None else out[i] for i, v in
                                      enumerate([1.0, None, 2.0, 1.0, None])]
        client.drop(keys)
        assert "never reset" in client.score(["k0"])[0].error and client.replaced == 0
    finally:
        client.close(0)


def test_a_sleeping_environment_passes_its_deadline(ray_session, env_file):
    client = _client(env_file, "Sleeps", timeout_s=1.0, workers=1)
    try:
        client.reset(["a", "b"], [{"prompt": "p"}, {"prompt": "q"}])
        a, b = client.step(["a", "b"], ["sleep", "ok"])
        assert a == EnvFailure("a", "timed out after 1 s", timed_out=True) and b.reward == 1.0
        client.drop(["b"])  # the worker holds nothing now, and a call still runs in it: replaced
        client.drop(["a"])
        assert client.replaced == 1
        assert client.reset(["c"], [{"prompt": "r"}]) == [[{"role": "user", "content": "r"}]]
    finally:
        client.close(0)


def test_a_worker_that_stops_answering_is_replaced(ray_session, env_file):
    client = _client(env_file, "Spins", timeout_s=1.0, workers=1, slack_s=2.0)
    try:
        client.reset(["a", "b", "c"], [{"prompt": "p"}] * 3)
        started = time.monotonic()
        a, b = client.step(["a", "b"], ["spin", "ok"])
        assert time.monotonic() - started < 20
        assert a.timed_out and b.timed_out and a.error.startswith("timed out after 4 s")
        assert client.replaced == 1
        (c,) = client.step(["c"], ["ok"])  # held by the worker that was killed
        assert isinstance(c, EnvFailure) and c.error.startswith("its environment was lost: timed out")
        client.wait_ready(60)  # the replacement starts (within slack_s, in a run)
        assert client.reset(["d"], [{"prompt": "q"}]) == [[{"role": "user", "content": "q"}]]
        assert client.step(["d"], ["ok"])[0].reward == 1.0
    finally:
        client.close(0)


def test_a_worker_that_cannot_load_the_environment_names_it(ray_session, tmp_path):
    from qgrpo.actors.env_worker import EnvClient, EnvWorkersFailed

    broken = tmp_path / "broken.py"
    broken.write_text("def oops(:\n")
    client = EnvClient(environment_spec(f"{broken}:Env", {}), 5.0, num_workers=1)
    try:
        with pytest.raises(EnvWorkersFailed, match=r"could not start: .*environment.name: importing .*broken.py "
                                                    r"failed \(SyntaxError"):
            client.wait_ready()
    finally:
        client.close(0)


def test_the_rewards_need_not_tell_right_from_wrong_when_the_environment_does(monkeypatch):
    """The calculator's only reward function is a format reward: with its environment, whose score judges the answer,
    the reward probe gives no "no reward scores the reference answer" hint; without it, it does."""
    from qgrpo.rollout.rewards.probe import probe_checks

    class Told:
        def __init__(self):
            self.hints = []

        def hint(self, text):
            self.hints.append(text)

        def passed(self, what, found):
            pass

    monkeypatch.chdir(ROOT)
    with_env, without = Told(), Told()
    probe_checks(load_config(CALC / "config.toml", [], check_environment=False), progress=with_env)
    probe_checks(load_config(CALC / "config.toml", ["environment.name=''"], check_environment=False), progress=without)
    assert with_env.hints == [] and without.hints[0].startswith("no reward scores the reference answer")
