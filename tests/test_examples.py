"""Every config under configs/ and examples/ loads as it is (`load_config`, run from the project folder as the docs
say), and the examples' own data checks out. Cheap: no model is built, nothing trains."""
from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from qgrpo.cluster.config.schema import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.toml")) + sorted((ROOT / "examples").rglob("*.toml"))
EXAMPLES = [p for p in CONFIGS if p.is_relative_to(ROOT / "examples")]
# Presets whose model folder the user puts in place (configs/nanochat_*.toml: models/nanochat-d20 ...): the missing
# folder must be their only problem.
USER_MODEL = {"nanochat_d20.toml", "nanochat_d32.toml"}


def _not_installed_here() -> set[str]:
    """Config messages saying a backend cannot run on this machine (e.g. MLX after `make install-cuda`)."""
    from qgrpo.rollout.backends import REGISTRY

    return {msg for spec in REGISTRY.values() for key in ("rollout.backend", "reference.backend")
            for msg in spec.unavailable(key)}


def _load(path: Path) -> list[str]:
    try:
        load_config(path)
    except ConfigError as e:
        return e.problems
    return []


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_config_loads(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # paths in configs (task.path) are read against the current directory
    problems = _load(path)
    if path.name in USER_MODEL and not Path(tomllib.loads(path.read_text())["model"]["path"]).is_dir():
        assert problems and all(p.startswith("model.path: folder") for p in problems), problems
        return
    elsewhere = [p for p in problems if p in _not_installed_here()]
    if elsewhere and len(elsewhere) == len(problems):
        pytest.skip(f"{path.name}: {elsewhere[0]}")
    assert problems == [], f"{path.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_there_are_examples():
    assert (ROOT / "examples" / "own_task" / "config.toml") in EXAMPLES
    assert (ROOT / "examples" / "README.md").is_file()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_example_data_checks_out(path, monkeypatch):
    # Every row is read and checked, the held-out split is cut, and no worked example is a held-out question.
    from qgrpo.rollout.datasets import FORMATS, load_splits
    from qgrpo.rollout.tasks import check_task

    monkeypatch.chdir(ROOT)
    cfg = load_config(path)
    assert check_task(cfg.task, cfg.run.seed) == []
    if cfg.task.name in FORMATS:
        train, held, problems = load_splits(cfg.task)
        assert problems == [] and len(held) == cfg.task.eval_size and len(train) > 0


def test_own_task_data_is_what_the_readme_says():
    from qgrpo.rollout.datasets import read_rows

    rows, problems = read_rows(str(ROOT / "examples" / "own_task" / "problems.jsonl"), "jsonl", "question", "answer")
    assert problems == [] and len(rows) == 40 and len({r.prompt for r in rows}) == 40
    assert all(float(r.answer) == int(r.answer) for r in rows)  # whole-number answers
