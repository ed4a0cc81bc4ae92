"""A corpus of a newcomer's mistakes, from the README and the docs alone: each is refused by `qgrpo check` and by
`qgrpo train` with exit status 2, every problem of the config at once, one line each, and never a traceback; neither
starts Ray or writes anything (no run directory, the folder holds what the test put there and nothing more).

Each case is a folder of its own holding the README's "Your own task" config (my_task.toml) and what the case copies
or writes beside it, run in-process through the CLI's entry point from that folder, as a user types it there.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from qgrpo.cluster.cli.app import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "word_answers"
CONFIG = "my_task.toml"


def readme_task() -> str:
    """The TOML block of the README's "Your own task" section, as a user copies it."""
    section = ROOT.joinpath("README.md").read_text().split("## Your own task", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```toml\n(.*?)```", section, re.S).group(1)


def _copy(folder: Path, *names: str) -> None:
    """The example's files the README names, at the paths its config gives them (relative to the config)."""
    (folder / "examples" / "word_answers").mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copy(EXAMPLE / name, folder / "examples" / "word_answers" / name)


def _rewards(folder: Path, text: str | bytes) -> None:
    _copy(folder, "capitals.jsonl")
    path = folder / "examples" / "word_answers" / "rewards.py"
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)


def _both(folder: Path) -> None:
    _copy(folder, "capitals.jsonl", "rewards.py")


def _config(folder: Path, edit) -> None:
    _both(folder)
    (folder / CONFIG).write_text(edit(readme_task()))


def _rows(folder: Path, extra: str) -> None:
    _both(folder)
    with open(folder / "examples" / "word_answers" / "capitals.jsonl", "a") as f:
        f.write(extra)


# (id, what the folder gets beside the README's config, the --set values, what the problems must say, how many)
CASES = [
    ("readme-without-rewards-py", lambda d: _copy(d, "capitals.jsonl"), [],
     ["rewards.functions[0].function: cannot read", "examples/word_answers/rewards.py",
      "a relative path in a config file is read against the file's folder"], 1),
    ("readme-without-either-file", lambda d: None, [],
     ["task.path: file", "capitals.jsonl' does not exist", "rewards.functions[0].function: cannot read"], 2),
    ("reward-file-fails-at-import", lambda d: _rewards(d, "import no_such_package_xyz\n"), [],
     ["rewards.functions[0].function: importing", "ModuleNotFoundError", "fix the file"], 1),
    ("reward-file-syntax-error", lambda d: _rewards(d, "def names_capital(completions:\n"), [],
     ["rewards.functions[0].function: importing", "SyntaxError"], 1),
    ("reward-file-exits-at-import", lambda d: _rewards(d, "import sys\nsys.exit(0)\n"), [],
     ["rewards.functions[0].function: importing", "SystemExit: 0"], 1),
    ("reward-file-not-utf8", lambda d: _rewards(d, "# caf\xe9\n".encode("latin-1")),
     [], ["rewards.functions[0].function:", "is not UTF-8 text", "save it as UTF-8"], 1),
    ("function-not-in-file", lambda d: _rewards(
        d, "def capital(completions, **kw):\n    return [0.0] * len(completions)\n"), [],
     ["rewards.functions[0].function:", "has no 'names_capital'", "its functions: capital"], 1),
    ("function-needs-a-missing-column", lambda d: _rewards(
        d, "def names_capital(completions, rubric):\n    return [0.0] * len(completions)\n"), [],
     ["rewards.functions[0].function: requires 'rubric'"], 1),
    ("function-raises-when-called", lambda d: _rewards(
        d, "def names_capital(completions, **kw):\n    raise ValueError('no capital here')\n"), [],
     ["rewards.functions[0]", "ValueError: no capital here"], None),
    ("data-row-not-json", lambda d: _rows(d, '{"question": "Capital of Peru?", "answer": "Lima"\n'), [],
     ["task.path:"], 1),
    ("data-without-the-answer-column", _both, ["task.answer_column='solution'"], ["task.answer_column", "solution"],
     None),
    ("toml-syntax-error", lambda d: _config(d, lambda t: t.replace('eval_size = 20', 'eval_size = ')), [],
     ["my_task.toml: not valid TOML"], 1),
    ("config-not-utf8", lambda d: (d / CONFIG).write_bytes(readme_task().replace("one short", "une tr\xe8s courte")
                                                            .encode("latin-1")), [],
     ["my_task.toml: not UTF-8 text", "save it as UTF-8"], 1),
    ("config-file-not-there", lambda d: (d / CONFIG).unlink(), [], ["config file", "does not exist"], 1),
    ("field-in-the-wrong-section", _both, ["train.steps=3"], ["train: unknown key; did you mean run.steps?"], 1),
    ("misspelled-field", lambda d: _config(d, lambda t: t.replace("eval_size", "eval_sise")), [],
     ["task.eval_sise: unknown key; did you mean task.eval_size?"], 1),
    ("trl-name", _both, ["run.max_steps=10"], ["'max_steps' is TRL's name: here it is run.steps"], 1),
    ("wrong-type", _both, ["run.steps='ten'"], ["run.steps: expected int"], 1),
    ("unknown-builtin-reward", _both, ['rewards.functions=[{name="nope"}]', "rewards.eval_metric=''"],
     ["rewards.functions[0].name: unknown reward 'nope'; choose one of correct, "], 1),
    ("environment-judge-without-environment", _both, ["rewards.eval_metric='environment'"],
     ["rewards.eval_metric: 'environment' judges held-out trajectories", "no environment is set"], 1),
    ("judge-that-is-no-reward", _both, ["rewards.eval_metric='accuracy'"],
     ["rewards.eval_metric: 'accuracy' is neither"], 1),
    ("number-reward-on-words", _both, ['rewards.functions=[{name="correct"}]', "rewards.eval_metric=''"],
     ["rewards.functions", "correct read integers only", "references are words"], 1),
    ("environment-file-not-there", _both, ["environment.name='game.py:Game'", "environment.max_context=2048"],
     ["environment.name: cannot read 'game.py'"], 1),
    ("environment-fails-at-import", lambda d: (_both(d), (d / "game.py").write_text("raise RuntimeError('boom')\n")),
     ["environment.name='game.py:Game'", "environment.max_context=2048"],
     ["environment.name: importing", "RuntimeError: boom"], 1),
    ("model-folder-not-there", _both, ["model.path='./my-model'"], ["model.path: folder", "does not exist"], 1),
    ("malformed-set", _both, ["run.steps"], ["--set run.steps: expected section.key=value"], 1),
    ("several-at-once", lambda d: None, ["train.steps=3", "run.steps=0"],
     ["train: unknown key; did you mean run.steps?", "run.steps: must be >= 1", "task.path: file"], 3),
]


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def _refused(capsys, monkeypatch, argv: list[str]) -> tuple[str, str]:
    """(the refusal's problems block, the whole output) of one in-process run, asserting what every refusal shares.
    Train must refuse before it would start Ray (`_start_ray`, which other tests' Ray in this process would hide)."""
    import ray

    from qgrpo.cluster.cli import train

    def start_ray(*args, **kwargs):
        raise AssertionError("train went on to start Ray")

    monkeypatch.setattr(train, "_start_ray", start_ray)
    had_ray = ray.is_initialized()
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, out + err
    assert "Traceback" not in out + err, out + err
    assert ray.is_initialized() == had_ray, "Ray started before the refusal"
    text = out if argv[0] == "check" else err
    block = text[text.index("qgrpo: "):].splitlines()
    if argv[0] == "check":
        assert block[-1].startswith("qgrpo check: REFUSED: "), text
        block = block[:-1]
    block = [line for line in block if not line.startswith("qgrpo: hint:")]
    return "\n".join(block), out + err


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_newcomers_mistake_is_refused_cleanly(case, tmp_path, monkeypatch, capsys):
    name, setup, sets, says, count = case
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("QGRPO_CACHE", str(tmp_path.parent / f"{tmp_path.name}-cache"))  # no model is built anyway
    folder = tmp_path / "my_task"
    folder.mkdir()
    (folder / CONFIG).write_text(readme_task())
    setup(folder)
    monkeypatch.chdir(folder)
    before = _files(folder)
    argv = [CONFIG, *(a for s in sets for a in ("--set", s))]
    blocks = []
    for command in ("check", "train"):
        block, everything = _refused(capsys, monkeypatch, [command, *argv])
        for words in says:
            assert words in block, everything
        problems = [line for line in block.splitlines()[1:]]
        if block.startswith("qgrpo: invalid config ("):  # "section.field: what is wrong; the fix", one line each
            assert problems and all(line.startswith("  - ") for line in problems), block
            n = int(block.split("(", 1)[1].split()[0])
            assert n == len(problems) and (count is None or n == count), block
        blocks.append(block)
        assert _files(folder) == before, f"{command} wrote into the folder"
    assert blocks[0] == blocks[1], "check and train refuse in the same words"
    assert not list(tmp_path.parent.glob(f"{tmp_path.name}-cache"))


def test_an_unwritable_output_dir_is_refused_before_ray(tiny_model_path, tmp_path, monkeypatch, capsys):
    """/proc takes no folder even for root, whom every permission check lets through: refused by check and train
    alike before Ray starts, not once the run directory is made."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(tmp_path)
    argv = [str(ROOT / "configs" / "tiny.toml"), "--set", f"model.path={json.dumps(tiny_model_path)}",
            "--set", "run.output_dir='/proc/qgrpo-runs'"]
    for command in ("check", "train"):
        block, everything = _refused(capsys, monkeypatch, [command, *argv])
        assert "  - run.output_dir: '/proc/qgrpo-runs' cannot be created" in block, everything
    assert not list(tmp_path.iterdir()) and not Path("/proc/qgrpo-runs").exists()
