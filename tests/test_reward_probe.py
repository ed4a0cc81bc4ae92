"""rollout/rewards/probe.py: `qgrpo check` (and `qgrpo train`, before Ray) calls every reward once on stand-in
completions of two train rows, and refuses one that raises, hangs, returns garbage or cannot be reached. Real user
files, a real HTTP server and the real config loader; the tiny builtin model on a small jsonl task."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from qgrpo.cluster.config.schema import load_config
from qgrpo.rollout.data.tasks import make_task
from qgrpo.rollout.rewards import probe
from qgrpo.rollout.rewards.probe import probe_checks, probe_rewards, wrong_answer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
NUMBERS = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(9)]
CAPITALS = [{"prompt": f"Capital of {c}?", "answer": a} for c, a in
            (("Belgium", "Brussels"), ("France", "Paris"), ("Peru", "Lima"), ("Chile", "Santiago"))]


@pytest.fixture(autouse=True)
def _this_machine(monkeypatch):
    """URLs are judged from this machine unless told of a cluster: a RAY_ADDRESS around the tests must not tell."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def _sets(tiny_model_path: str, tmp_path: Path, rewards: str, rows: list[dict] = NUMBERS) -> list[str]:
    """--set overrides of configs/tiny.toml: the tiny model from the test cache, a jsonl task of `rows`, `rewards`."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = Path(tiny_model_path).parents[1]  # CACHE/models/tiny-digits-vN
    return [f"model.cache_dir='{cache}'", f"run.output_dir='{tmp_path / 'runs'}'", "task.name='jsonl'",
            f"task.path='{data}'", "task.eval_size=2", f"rewards.functions=[{rewards}]"]


def _check(capsys, tiny_model_path, tmp_path, rewards: str, rows: list[dict] = NUMBERS,
           command: str = "check") -> tuple[int, str]:
    """`qgrpo check` (or train) through the CLI's entry function: (exit status, everything it printed)."""
    from qgrpo.cluster.cli.app import main

    sets = _sets(tiny_model_path, tmp_path, rewards, rows)
    rc = main([command, str(TINY), *(a for s in sets for a in ("--set", s))])
    out, err = capsys.readouterr()
    return rc, out + err


def _file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "mine.py"
    path.write_text(body)
    return path


def _line(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


# ---------------------------------------------------------------------------------------------------------------------
# What check refuses


def test_a_raising_reward_is_refused_naming_its_file_and_line(tiny_model_path, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the file named relative to the working directory, as the message names it
    path = _file(tmp_path, "def parse(completions, **kwargs):\n"
                           "    out = []\n"
                           "    for c in completions:\n"
                           "        out.append(float(c))  # '<answer>1</answer>' is no float\n"
                           "    return out\n")
    for command in ("check", "train"):  # one function before Ray: train refuses it the same way
        rc, text = _check(capsys, tiny_model_path, tmp_path, "{function='mine.py:parse'}", command=command)
        assert rc == 2, text
        assert (f"rewards.functions[0] (parse): calling it on 2 rows of the train split raised ValueError: could not "
                f"convert string to float: '<answer>1</answer>' at mine.py:{_line(path, 'float(c)')} in parse: "
                "out.append(float(c))") in text
        assert "fix the function (check calls each reward once on the reference answer and a wrong one)" in text
        assert "  model:" not in text  # refused before the model is touched
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("body, expected", [
    ("return [1.0]", "returned 1 values for 8 completions; expected one per completion"),
    ("return [float('nan')] * len(completions)", "value 0 is nan; expected a finite float"),
    ("return ['high'] * len(completions)", "value 0 is a str (high); expected a float or None"),
    ("return 1.0", "returned a float; expected a list of 8 floats"),
], ids=["count", "nan", "string", "scalar"])
def test_a_reward_returning_garbage_is_refused(tiny_model_path, tmp_path, capsys, body, expected):
    path = _file(tmp_path, f"def score(completions, **kwargs):\n    {body}\n")
    rc, text = _check(capsys, tiny_model_path, tmp_path, f"{{function='{path}:score', weight=0.5}}")
    assert rc == 2, text
    assert f"rewards.functions[0] (score): called on 8 stand-in completions of 2 train rows: {expected}" in text
    assert "; fix the function (check calls each reward once on the reference answer and a wrong one)" in text
    assert "qgrpo check: REFUSED: 1 problem" in text


def test_an_unreachable_url_is_refused(tiny_model_path, tmp_path, capsys):
    with socket.socket() as s:  # a port that was free a moment ago and that nobody listens on now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    t0 = time.monotonic()
    rc, text = _check(capsys, tiny_model_path, tmp_path, f"{{name='correct'}}, {{url='{url}', retries=1}}")
    assert rc == 2, text
    assert (f"rewards.functions[1].url: calling it on 8 stand-in completions of 2 train rows failed: remote reward "
            f"{url} failed after 2 attempts: connection refused") in text
    assert "start the server or fix the URL" in text and "qgrpo check: REFUSED: 1 problem" in text
    assert time.monotonic() - t0 < 30


class _Grader(BaseHTTPRequestHandler):
    """/score: 1.0 where the completion holds the reference; /garbage: not JSON; /slow: answers after 3 s."""

    def do_POST(self):  # noqa: N802  (http.server's name)
        batch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/slow":
            time.sleep(3)
        body = b"oops" if self.path == "/garbage" else json.dumps(
            [float(r in c) for c, r in zip(batch["completions"], batch["references"], strict=True)]).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except BrokenPipeError:  # /slow: the client gave up waiting
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def grader():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Grader)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_good_function_and_a_good_url_pass(tiny_model_path, tmp_path, capsys, grader):
    path = _file(tmp_path, "def tolerant(completions, references, **kwargs):\n"
                           "    return [float(r in c) for c, r in zip(completions, references)]\n")
    rc, text = _check(capsys, tiny_model_path, tmp_path,
                      f"{{function='{path}:tolerant'}}, {{url='{grader}/score', label='grader'}}")
    assert rc == 0, text
    assert ("  calls:     2 rewards called once on the reference answer and a wrong one of 2 train rows; tolerant, "
            "grader score the reference higher") in text
    assert "hint: no reward scores" not in text
    assert text.strip().endswith("qgrpo check: OK: train would start")


def test_a_url_answering_garbage_is_refused(tiny_model_path, tmp_path, capsys, grader):
    rc, text = _check(capsys, tiny_model_path, tmp_path, f"{{name='correct'}}, {{url='{grader}/garbage'}}")
    assert rc == 2, text
    assert f"rewards.functions[1].url: calling it on 8 stand-in completions of 2 train rows failed: remote reward " \
           f"{grader}/garbage failed after 1 attempt: the response is not JSON: 'oops'" in text


def test_a_slow_url_is_a_hint_past_the_probe_wait_and_a_problem_past_its_own_timeout(tiny_model_path, tmp_path,
                                                                                    grader, monkeypatch):
    monkeypatch.setattr(probe, "URL_WAIT_S", 1.0)
    items = [make_task(_cfg(tiny_model_path, tmp_path, "{name='correct'}").task, 0).item(i) for i in range(2)]
    for timeout, kind in ((60, "hint"), (1, "problem")):
        cfg = _cfg(tiny_model_path, tmp_path, f"{{url='{grader}/slow', retries=0, timeout_s={timeout}}}")
        found = probe_rewards(cfg.rewards, items)
        lines = found.hints if kind == "hint" else found.problems
        assert (found.problems if kind == "hint" else found.hints) == []
        assert len(lines) == 1 and lines[0].startswith(f"rewards.functions[0].url: {grader}/slow did not answer 8 "
                                                       "stand-in completions of 2 train rows within"), lines
        assert ("the 1 s check waits (its timeout_s is 60 s), so it was not checked" if kind == "hint"
                else "within its timeout of 1 s; make sure the server is up") in lines[0]


def test_an_unreachable_url_is_only_a_hint_when_checking_for_a_cluster(tiny_model_path, tmp_path):
    cfg = _cfg(tiny_model_path, tmp_path, "{name='correct'}, {url='http://127.0.0.1:9/score', retries=0}")
    items = [make_task(cfg.task, 0).item(i) for i in range(2)]
    here, there = probe_rewards(cfg.rewards, items, here=True), probe_rewards(cfg.rewards, items, here=False)
    assert len(here.problems) == 1 and here.problems[0].startswith("rewards.functions[1].url: ")
    assert there.problems == [] and len(there.hints) == 1
    assert there.hints[0].endswith("(from this machine; the run's reward workers call it from the cluster)")


HANG = """import time
from pathlib import Path


def stuck(completions, **kwargs):
    Path(__file__).with_name("called").write_text(repr(time.time()))
    time.sleep(600)
"""


def test_a_hanging_reward_makes_the_real_cli_exit_soon_after_its_timeout(tiny_model_path, tmp_path):
    """`.venv/bin/qgrpo check` as a user runs it: refused, and the process exits without waiting for the hung call."""
    path = _file(tmp_path, HANG)
    sets = _sets(tiny_model_path, tmp_path, f"{{function='{path}:stuck', timeout_s=1}}")
    qgrpo = Path(sys.executable).with_name("qgrpo")
    proc = subprocess.run([str(qgrpo), "check", str(TINY), *(a for s in sets for a in ("--set", s))], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    ended = time.time()
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text
    assert ("rewards.functions[0] (stuck): calling it on 8 stand-in completions of 2 train rows did not return within "
            "its timeout of 1 s; make it faster") in text and "raise rewards.functions[0].timeout_s" in text
    assert "qgrpo check: REFUSED: 1 problem" in text
    called = float((tmp_path / "called").read_text())
    assert ended - called < 1 + 8, "check waited for the hung call instead of exiting"


# ---------------------------------------------------------------------------------------------------------------------
# The hint: no reward tells the reference answer from a wrong one


def test_hint_when_correct_reads_numbers_and_the_references_are_words(tiny_model_path, tmp_path, capsys):
    """`correct` (the first integer) next to a format reward on word answers: every call succeeds, none tells."""
    _, text = _check(capsys, tiny_model_path, tmp_path, "{name='correct', weight=0.8}, {name='answer_format'}",
                     rows=CAPITALS)
    hint = next(line for line in text.splitlines() if line.startswith("qgrpo: hint: no reward"))
    assert hint.startswith("qgrpo: hint: no reward scores the reference answer above a wrong one on the train rows: "
                           "correct gives 0.0 to both, answer_format gives 1.0 to the reference and 1.0 to the wrong "
                           "one, on '<answer>Brussels</answer>' / 'Brussels' against '<answer>xylophone</answer>' / "
                           "'xylophone'")
    assert "(correct reads a number, and references such as 'Brussels' are words)" in hint
    assert "use a reward that reads answers as the references are written" in hint
    assert "  - rewards" not in text  # a hint, not a problem (the tiny tokenizer refuses these prompts, separately)


def test_no_hint_for_answer_correct_on_numbers(tiny_model_path, tmp_path, capsys):
    rc, text = _check(capsys, tiny_model_path, tmp_path, "{name='answer_correct'}, {name='answer_format', weight=0.2}")
    assert rc == 0, text
    assert "hint: no reward scores" not in text
    assert "answer_correct scores the reference higher" in text


def test_a_reward_model_is_not_called(tiny_model_path, tmp_path):
    cfg = _cfg(tiny_model_path, tmp_path, "{name='correct'}")
    items = [make_task(cfg.task, 0).item(i) for i in range(2)]
    with_model = load_config(TINY, _sets(tiny_model_path, tmp_path, "{name='exact'}, {name='reward_model'}") +
                             [f"reward_model.path='{tiny_model_path}'"], check_environment=False)
    found = probe_rewards(with_model.rewards, items)
    assert found.problems == [] and found.hints == []
    assert found.found.endswith("; exact scores the reference higher; reward_model not called (check does not load "
                                "it)")


class _Told:
    """What the probe tells `qgrpo check`'s report."""

    def __init__(self):
        self.hints, self.passed_lines = [], []

    def hint(self, text: str) -> None:
        self.hints.append(text)

    def passed(self, what: str, found: str) -> None:
        self.passed_lines.append(f"{what}: {found}")


@pytest.mark.parametrize("config", sorted((ROOT / "examples").glob("*/config.toml")) + sorted(
    (ROOT / "configs").glob("*.toml")), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_example_and_preset_passes_the_calls_without_a_hint(config, monkeypatch):
    monkeypatch.chdir(ROOT)
    told = _Told()
    cfg = load_config(config, [], check_environment=False)
    assert probe_checks(cfg, progress=told) == []
    assert told.hints == [] and len(told.passed_lines) == 1
    if cfg.environment.name:  # the environment's score tells right from wrong (its own probe: test_environments.py)
        return
    assert "scores the reference higher" in told.passed_lines[0] or "score the reference higher" in told.passed_lines[0]


def _cfg(tiny_model_path: str, tmp_path: Path, rewards: str):
    return load_config(TINY, _sets(tiny_model_path, tmp_path, rewards))


@pytest.mark.parametrize("reference, wrong", [("7", "11"), ("150", "2222"), ("-2.5", "1111"), ("1,609", "22222"),
                                              ("123456789", "-1"), ("Brussels", "xylophone"),
                                              ("Xylophone", "zeppelin")])
def test_the_wrong_answer_shares_nothing_with_the_reference(reference, wrong):
    assert wrong_answer(reference) == wrong
