"""OpenEnv environments through the adapter (rollout/environments/openenv.py), with the real openenv-core: the
example's OpenEnv game (examples/openenv_guess/server.py) played in-process and over a real OpenEnv server (HTTP and
WebSocket, started here), what the adapter refuses and how it says so, and a two-step run through Ray with the
environment served."""
from __future__ import annotations

import functools
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("openenv.core", reason="openenv-core is the `openenv` extra (make install installs it)")

from qgrpo.rollout.environments import EnvFailure, EnvironmentLoadError, environment_spec, factory_of  # noqa: E402
from qgrpo.rollout.environments.host import EnvHost  # noqa: E402
from qgrpo.rollout.environments.openenv import OpenEnvAdapter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "examples" / "openenv_guess" / "server.py"
CONFIG = ROOT / "examples" / "openenv_guess" / "config.toml"
GAME = f"openenv:{SERVER}:GuessEnvironment"


def play(host: EnvHost, answers: list[int], guesses: list[list[str]]) -> tuple[list, list]:
    """Each trajectory k hides answers[k] and guesses guesses[k] in turn; (every step's results, the scores)."""
    keys = list(range(len(answers)))
    first = host.reset(keys, [{"prompt": "0-9", "answer": a} for a in answers])
    assert first == [[{"role": "user", "content": "0-9"}]] * len(answers)
    steps = [host.step(keys, [g[i] for g in guesses]) for i in range(len(guesses[0]))]
    return steps, host.score(keys)


def check_game(host: EnvHost) -> None:
    steps, scores = play(host, [7, 2, 4], [["5", "7"], ["5", "x"], ["0", "1"]])
    (a1, b1, c1), (a2, b2, c2) = steps
    assert a1.messages == [{"role": "user", "content": "+"}] and not a1.done  # 7 > 5
    assert b1.messages == [{"role": "user", "content": "-"}]  # 2 < 5
    assert b2.messages == [{"role": "user", "content": "/"}]  # "x" is not a digit
    assert a2.done and a2.messages == [] and a2.reward == pytest.approx(0.9)  # found on the second guess
    assert scores == [pytest.approx(0.9), 0.0, 0.0]  # the observations' rewards, summed
    assert host.drop([0, 1, 2]) == 0


def test_an_openenv_class_plays_in_process():
    check_game(EnvHost(factory_of(environment_spec(GAME, {"turn_penalty": 0.1})), timeout_s=10))


def test_reset_gets_a_seed_that_is_a_function_of_the_row_and_the_row_values_it_takes():
    make = factory_of(environment_spec(GAME))
    seen = []

    def record(env):
        reset = env.env.reset

        @functools.wraps(reset)  # the adapter reads reset's signature
        def wrapped(**kwargs):
            seen.append(kwargs)
            return reset(**kwargs)
        env.env.reset = wrapped
        return env

    for row in ({"prompt": "0-9", "answer": 3}, {"prompt": "0-9", "answer": 3}, {"prompt": "1-9", "answer": 3},
                {"prompt": "0-9", "answer": 3, "seed": 11, "level": "x"}):
        record(make()).reset(row)
    assert seen[0] == seen[1] == {"seed": seen[0]["seed"], "prompt": "0-9", "answer": 3}  # as a server passes them
    assert seen[2]["seed"] != seen[0]["seed"]  # another prompt, another episode
    assert seen[3]["seed"] == 11 and seen[3]["level"] == "x"  # the row's own seed; reset takes **kwargs: all columns
    named = factory_of(environment_spec(GAME, {"openenv": {"reset_args": ["answer"]}}))
    record(named()).reset({"prompt": "0-9", "answer": 3, "level": "x"})
    assert set(seen[-1]) == {"seed", "answer"}


def test_options_choose_fields_and_reset_args():
    env = factory_of(environment_spec(GAME, {"openenv": {"reset_args": [], "observation_field": "feedback"}}))()
    assert isinstance(env, OpenEnvAdapter)
    import random

    assert random.Random(5).randrange(10) != 4
    env.reset({"prompt": "0-9", "answer": 4, "seed": 5})
    assert env.env.hidden == random.Random(5).randrange(10)  # drawn from the row's seed: answer not passed
    assert env.to_text(env.env.step(env.to_action("0"))) in ("+", "-")


@pytest.mark.parametrize("params, words", [
    ({"openenv": {"action_field": "move"}}, ["action_field = 'move'", "GuessAction has no such field", "guess"]),
    ({"openenv": {"colour": 1}}, ["environment.params.openenv: unknown colour", "action_field"]),
    ({"openenv": {"reset_args": "answer"}}, ["reset_args is 'answer'", "list of the row's keys"]),
    ({"turn_penalty": 0.1, "size": 3}, ["environment.params", "size", "turn_penalty"]),
])
def test_bad_params_are_refused_naming_the_field(params, words):
    with pytest.raises(EnvironmentLoadError) as e:
        factory_of(environment_spec(GAME, params))
    for w in words:
        assert w in str(e.value)


def test_a_class_that_is_not_an_openenv_environment_is_refused(tmp_path):
    (tmp_path / "mine.py").write_text("from qgrpo.rollout.environments import Environment\n"
                                      "class Mine(Environment):\n    pass\n"
                                      "from openenv.core.env_server.types import Action, Observation, State\n"
                                      "from openenv.core.env_server.interfaces import Environment as OE\n"
                                      "class Two(Action):\n    x: int\n    y: int\n"
                                      "class Numbers(OE):\n"
                                      "    def reset(self, seed=None, episode_id=None, **kw): return Observation()\n"
                                      "    def step(self, action: Two, timeout_s=None, **kw): return Observation()\n"
                                      "    @property\n    def state(self): return State()\n")
    with pytest.raises(EnvironmentLoadError, match="not an OpenEnv Environment subclass.*drop the openenv: prefix"):
        factory_of(environment_spec(f"openenv:{tmp_path / 'mine.py'}:Mine"))
    with pytest.raises(EnvironmentLoadError, match="Two has no text field among x, y.*action_field"):
        factory_of(environment_spec(f"openenv:{tmp_path / 'mine.py'}:Numbers"))
    with pytest.raises(EnvironmentLoadError, match="cannot read"):
        environment_spec(f"openenv:{tmp_path / 'missing.py'}:Numbers")


@pytest.mark.parametrize("name", [GAME, "openenv:http://127.0.0.1:8000"])
def test_without_openenv_core_the_error_says_how_to_install_it(name, monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv.core", None)  # import openenv.core raises ImportError
    with pytest.raises(EnvironmentLoadError, match=r"openenv-core is not installed.*pip install 'qgrpo\[openenv\]'"):
        factory_of(environment_spec(name))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served():
    """The example's game served by a real OpenEnv server (uvicorn, HTTP + WebSocket) in a process of its own."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    import requests

    deadline = time.monotonic() + 60
    while True:
        try:
            if requests.get(f"{url}/health", timeout=1).ok:
                break
        except requests.RequestException:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the OpenEnv server did not start (exit {proc.poll()})")
        time.sleep(0.3)
    yield url
    proc.terminate()
    proc.wait(10)


def test_a_served_openenv_environment_plays_over_websockets(served):
    check_game(EnvHost(factory_of(environment_spec(f"openenv:{served}")), timeout_s=10))


def test_a_server_takes_no_constructor_params_and_a_dead_url_is_named(served):
    with pytest.raises(EnvironmentLoadError, match="given to the OpenEnv server.*openenv = "):
        factory_of(environment_spec(f"openenv:{served}", {"turn_penalty": 0.1}))
    dead = f"http://127.0.0.1:{free_port()}"
    host = EnvHost(factory_of(environment_spec(f"openenv:{dead}")), timeout_s=20)
    (failure,) = host.reset([0], [{"prompt": "0-9", "answer": 1}])
    assert isinstance(failure, EnvFailure) and "cannot read the action schema" in failure.error
    assert dead in failure.error


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
def test_the_served_game_trains_two_steps_through_ray(served, ray_session, tiny_model_path, tmp_path, monkeypatch):
    """`qgrpo check` passes the example, then two steps through Ray with every trajectory an OpenEnv session."""
    from qgrpo.cluster.cli.app import main

    monkeypatch.chdir(tmp_path)
    cache = Path(tiny_model_path).parents[1]
    out = tmp_path / "runs"
    sets = ["--set", f"model.cache_dir='{cache}'", "--set", f"environment.name='openenv:{served}'",
            "--set", "environment.params={}"]
    assert main(["check", str(CONFIG), *sets]) == 0
    rc = main(["train", str(CONFIG), *sets, "--set", "run.steps=2", "--set", f"run.output_dir='{out}'",
               "--set", "run.progress=false", "--set", "run.eval=false", "--set", "rollout.prompts_per_step=4",
               "--set", "rollout.group_size=4"])
    assert rc == 0
    (run_dir,) = out.iterdir()
    steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["episode/finish_env_error"] == 0.0 and m["episode/turns"] >= 1.0 and m["reward/errors"] == 0
    import pyarrow.parquet as pq

    rows = pq.read_table(run_dir / "rollouts").to_pylist()
    assert len(rows) == 2 * 4 * 4
    for r in rows:
        turns = json.loads(r["turns"])
        feedback = [t["content"] for t in turns if t["role"] != "assistant"]
        assert set(feedback) <= {"+", "-", "/"}  # what the server answered, shown to the model
        found = r["finish_reason"] in ("stop", "length")  # the server ended it (on a cut turn: "length")
        assert (r["reward_environment"] > 0) == found  # the server's reward, on the episode that found the digit
