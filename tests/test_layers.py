"""The layout's rules, checked on the source: no module imports from a layer above its own (lazy imports inside
functions included), folders and files stay small enough to read, and pyproject.toml installs every package folder
under `qgrpo`.

Layers, lowest first: the package root (`qgrpo/__init__`, its version) and core < rollout, learner (siblings: neither
imports the other) < actors < cluster.config < cluster.rundir < cluster.run < cluster.report < cluster.cli <
`qgrpo/__main__`.
"""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "rollout", "learner", "actors", "cluster")
# "" is the package root (qgrpo/__init__: __version__ only, imports nothing); __main__ runs the CLI, above it all.
LAYERS = {"": 0, "core": 0, "rollout": 1, "learner": 1, "actors": 2, "cluster": 3, "cluster.config": 3,
          "cluster.rundir": 4, "cluster.run": 5, "cluster.report": 6, "cluster.cli": 7, "__main__": 8}
MAX_MODULES = 12  # per folder
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80


def _sources(*tops: str) -> list[Path]:
    return sorted(p for top in tops for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def _layer(module: str) -> str:
    """The layer a module (dotted, without the `qgrpo.` prefix) belongs to: its longest prefix in LAYERS."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    return ""


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module without `qgrpo.`) of every import of our own code in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name == "qgrpo" or name.startswith("qgrpo."):
                found.append((node.lineno, name.removeprefix("qgrpo").removeprefix(".")))
    return found


def _upward(path: Path, module: str | None = None) -> list[str]:
    here = _layer(module or _module(path))
    bad = []
    for line, target in _imports(path):
        there = _layer(target)
        if target in LAYERS and target != there:  # a package root, e.g. `from qgrpo.cluster.run import driver`
            there = target
        sibling = {here.split(".")[0], there.split(".")[0]} == {"rollout", "learner"}
        if LAYERS[there] > LAYERS[here] or sibling:
            bad.append(f"{path.name}:{line} ({here or 'qgrpo'}) imports qgrpo.{target} ({there})")
    return bad


def test_no_module_imports_from_a_layer_above():
    bad = [b for p in _sources(*PACKAGES) for b in _upward(p)]
    assert bad == [], "imports that run up the layers:\n" + "\n".join(bad)


def test_the_layer_check_can_fail(tmp_path):
    # A module of core importing the run layer lazily, and rollout importing its sibling, are found (guards against
    # a vacuous check).
    fake = tmp_path / "probe.py"
    fake.write_text("import qgrpo.core.records\ndef f():\n    from qgrpo.cluster.run import driver\n")
    assert _upward(fake, "core.probe") == ["probe.py:3 (core) imports qgrpo.cluster.run (cluster.run)",
                                           "probe.py:3 (core) imports qgrpo.cluster.run.driver (cluster.run)"]
    fake.write_text("from qgrpo.learner.loss import grpo_loss\n")
    assert _upward(fake, "rollout.probe") == ["probe.py:1 (rollout) imports qgrpo.learner.loss (learner)",
                                              "probe.py:1 (rollout) imports qgrpo.learner.loss.grpo_loss (learner)"]
    assert _layer("rollout.backends.torch_backend") == "rollout" and _layer("cluster.run.driver") == "cluster.run"


def test_no_own_code_imports_top_level_names():
    # Everything of ours is imported as qgrpo.X: a bare `import core` would load a second copy (or someone else's).
    bad = []
    for p in _sources(*PACKAGES, "tests", "bench"):
        for node in ast.walk(ast.parse(p.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            bad += [f"{p.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in PACKAGES]
    assert bad == [], "imports without the qgrpo. prefix:\n" + "\n".join(bad)


def test_folders_and_files_stay_small():
    folders = {p.parent for p in _sources(*PACKAGES, "bench")}
    crowded = [f"{d.relative_to(ROOT)}: {n} modules" for d in sorted(folders)
               if (n := len([p for p in d.glob("*.py") if p.name != "__init__.py"])) > MAX_MODULES]
    long_files = [f"{p.relative_to(ROOT)}: {n} lines" for p in _sources(*PACKAGES, "bench")
                  if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert crowded == [] and long_files == [], f"over {MAX_MODULES} modules / {MAX_FILE_LINES} lines: " \
                                               f"{crowded + long_files}"


def test_functions_stay_short():
    long_functions = []
    for p in _sources(*PACKAGES, "bench"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long_functions.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert long_functions == [], f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long_functions)


def test_pyproject_installs_every_package_folder():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setup["package-dir"] == {"qgrpo": "."}
    folders = {"qgrpo"} | {"qgrpo." + _module(p) for p in _sources(*PACKAGES) if p.name == "__init__.py"}
    assert set(setup["packages"]) == folders


@pytest.mark.parametrize("name", ["core", "cluster", "rollout", "learner", "actors"])
def test_no_top_level_module_of_ours_is_installed(name, tmp_path):
    # From a folder other than the checkout, only `qgrpo` is importable: nothing of ours shadows a user's `core`.
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", f"import importlib.util as u; print(u.find_spec({name!r}))"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stdout + proc.stderr
