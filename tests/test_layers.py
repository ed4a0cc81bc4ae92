"""The layout's rules, checked on the source: no module imports from a layer above its own (lazy imports inside
functions, `import_module("...")` and `__import__("...")` of a constant, and the "qgrpo.module:name" strings a spec
resolves included), no two modules import each other through any chain (the same, but for those strings; imports for
type checkers only are not imports at run time), nothing outside rollout/backends/ knows a backend by name (compares
one, looks its spec up by a constant, imports its module), pyproject.toml installs every package folder under
`qgrpo`. Sizes (modules per folder, lines per file and per function) are guides, not rules: a test warns past them, so
that files are split by concept, not cut to a ruler.

Layers, lowest first: the package root (`qgrpo/__init__`, its version) and core < rollout, learner (siblings: neither
imports the other) < actors < cluster.config < cluster.rundir < cluster.run < cluster.report < cluster.cli <
`qgrpo/__main__`.
"""
from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "rollout", "learner", "actors", "cluster")
# "" is the package root (qgrpo/__init__: __version__ only, imports nothing); __main__ runs the CLI, above it all.
LAYERS = {"": 0, "core": 0, "rollout": 1, "learner": 1, "actors": 2, "cluster": 3, "cluster.config": 3,
          "cluster.rundir": 4, "cluster.run": 5, "cluster.report": 6, "cluster.cli": 7, "__main__": 8}
MAX_MODULES = 12  # per folder: past it, a warning
MAX_FILE_LINES = 400  # past it, a warning
MAX_FUNCTION_LINES = 80  # past it, a warning
# A "module:name" string naming our code (BackendSpec.target, reference_scorer, preflight): the module it names is
# imported where the string is resolved, which is the module holding it (rollout/backends: `_load`).
TARGET = re.compile(r"qgrpo(\.\w+)+:\w+")
BACKENDS = ROOT / "rollout" / "backends"
# Modules of rollout/backends/ that belong to no one backend, which code outside may import: what every generator
# shares (prompt ids, stop tokens, weight streams, the fingerprint probe: common.py; which version sampled which
# tokens: versions.py), the compute dtype the torch generator and the torch reference scorer share (compute.py), and
# the reference scorers' contract with its factory (reference.py: make_reference_scorer, as make_generator is for the
# generators; the torch scorer beside it, which the CPU roles' timing calls).
SHARED_BACKEND_MODULES = {"common", "compute", "versions", "reference"}


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


def _named(node: ast.AST, targets: bool = True) -> list[str]:
    """The modules (dotted, any package) `node` imports: an import statement; `importlib.import_module` or
    `__import__` of a string constant; with `targets`, a "qgrpo.module:name" string constant (TARGET)."""
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (getattr(node.func, "attr", "") == "import_module"
                 or getattr(node.func, "id", "") in ("import_module", "__import__"))):
        return [node.args[0].value]
    if targets and isinstance(node, ast.Constant) and isinstance(node.value, str) and TARGET.fullmatch(node.value):
        return [node.value.split(":")[0]]
    return []


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module without `qgrpo.`) of every import of our own code in the file, string-loaded ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        for name in _named(node):
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
    fake.write_text("from qgrpo.learner.objective.loss import grpo_loss\n")
    assert _upward(fake, "rollout.probe") == [
        "probe.py:1 (rollout) imports qgrpo.learner.objective.loss (learner)",
        "probe.py:1 (rollout) imports qgrpo.learner.objective.loss.grpo_loss (learner)"]
    assert _layer("rollout.backends.torch_backend") == "rollout" and _layer("cluster.run.driver") == "cluster.run"


def test_the_layer_check_sees_modules_loaded_by_name(tmp_path):
    # A rollout module that reaches the run layer through a string is found as if it imported it.
    fake = tmp_path / "probe.py"
    fake.write_text("import importlib\nm = importlib.import_module('qgrpo.cluster.run.driver')\n"
                    "n = __import__('qgrpo.actors.rollout_actor')\nTARGET = 'qgrpo.cluster.cli.app:main'\n"
                    "fine = importlib.import_module('qgrpo.core.records'), "
                    "'qgrpo.rollout.quantization.quant:quantize_model'\n")
    assert _upward(fake, "rollout.probe") == ["probe.py:2 (rollout) imports qgrpo.cluster.run.driver (cluster.run)",
                                              "probe.py:3 (rollout) imports qgrpo.actors.rollout_actor (actors)",
                                              "probe.py:4 (rollout) imports qgrpo.cluster.cli.app (cluster.cli)"]


def test_no_own_code_imports_top_level_names():
    # Everything of ours is imported as qgrpo.X: a bare `import core` would load a second copy (or someone else's).
    bad = []
    for p in _sources(*PACKAGES, "tests", "bench"):
        for node in ast.walk(ast.parse(p.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            bad += [f"{p.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in PACKAGES]
    assert bad == [], "imports without the qgrpo. prefix:\n" + "\n".join(bad)


def test_sizes_past_the_guides_are_reported():
    """Not a rule: a warning per folder, file or function past its guide (pytest's warnings summary lists them)."""
    import warnings

    folders = {p.parent for p in _sources(*PACKAGES, "bench")}
    big = [f"{d.relative_to(ROOT)}: {n} modules (guide {MAX_MODULES})" for d in sorted(folders)
           if (n := len([p for p in d.glob("*.py") if p.name != "__init__.py"])) > MAX_MODULES]
    big += [f"{p.relative_to(ROOT)}: {n} lines (guide {MAX_FILE_LINES})" for p in _sources(*PACKAGES, "bench")
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    for p in _sources(*PACKAGES, "bench"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    big.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines (guide "
                               f"{MAX_FUNCTION_LINES})")
    for line in big:
        warnings.warn(line, UserWarning, stacklevel=1)


def _backend_comparisons(path: Path, names) -> list[str]:
    """`file:line` of each comparison with one of `names` (the registered backends): `x == "vllm"`, `x != "torch"`,
    `x in ("vllm", "torch")` (a tuple, list, set or dict of constants), and `case "mlx":`."""
    def named(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        items = node.keys if isinstance(node, ast.Dict) else node.elts if isinstance(
            node, (ast.Tuple, ast.List, ast.Set)) else []
        return any(isinstance(i, ast.Constant) and i.value in names for i in items)

    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare) and any(named(n) for n in [node.left, *node.comparators]):
            bad.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{node.lineno}")
        elif isinstance(node, ast.MatchValue) and named(node.value):
            bad.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{node.lineno}")
    return bad


def test_no_backend_name_is_compared_outside_the_backends():
    """What a backend can do is its spec's to say (rollout/backends: BackendSpec), so a new backend is added there
    alone: no module outside rollout/backends/ decides by comparing a value with a backend's name."""
    from qgrpo.rollout.backends import REGISTRY

    inside = ROOT / "rollout" / "backends"
    bad = [b for p in _sources(*PACKAGES) if not p.is_relative_to(inside) for b in _backend_comparisons(p, REGISTRY)]
    assert bad == [], "backend names compared (ask the spec in rollout/backends instead):\n" + "\n".join(bad)


def test_the_backend_comparison_check_can_fail(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("a = b == 'vllm'\nc = d.backend in ('torch', 'x')\nif 'mlx' != e: pass\n"
                     "match f:\n    case 'torch': pass\nbackend: str = 'torch'\ng = h == 'nccl'\n")
    assert _backend_comparisons(probe, {"torch", "vllm", "mlx"}) == ["probe.py:1", "probe.py:2", "probe.py:3",
                                                                       "probe.py:5"]


def _backend_by_name(path: Path, module: str | None = None) -> list[str]:
    """How `path` (the module `module`, dotted without `qgrpo.`) knows a backend by name other than comparing it, one
    `file:line what` each: a spec looked up by a string constant (`REGISTRY["torch"]`), and an import of one backend's
    module (qgrpo.rollout.backends.X, X not in SHARED_BACKEND_MODULES), by a statement or a string. [] for a module
    of rollout/backends/, where the backends are named."""
    if (module or _module(path)).startswith("rollout.backends"):
        return []
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    bad: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Subscript) and "REGISTRY" in (getattr(node.value, "id", ""),
                                                               getattr(node.value, "attr", ""))
                and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
            bad.append((node.lineno, f"REGISTRY[{node.slice.value!r}]"))
    for line, target in _imports(path):
        parts = target.split(".")
        if parts[:2] != ["rollout", "backends"] or len(parts) < 3 or parts[2] in SHARED_BACKEND_MODULES:
            continue
        if (BACKENDS / f"{parts[2]}.py").is_file() or (BACKENDS / parts[2] / "__init__.py").is_file():
            bad.append((line, f"imports qgrpo.rollout.backends.{parts[2]}"))
    # by line; once each (`from m import a` names both m and m.a)
    return [f"{where}:{line} {what}" for line, what in sorted(set(bad))]


def test_no_backend_is_known_by_name_outside_the_backends():
    """Code above the backends asks the spec of the backend the config names (`REGISTRY[cfg.rollout.backend]`); what
    is one backend's own (its generator, reference scorer, pre-run checks) its spec names as "module:name", resolved
    in rollout/backends. A constant lookup or an import of a backend's module would tie that code to one backend."""
    bad = [b for p in _sources(*PACKAGES) for b in _backend_by_name(p)]
    assert bad == [], ("backends known by name (ask the spec of the configured backend; a capability or hook on "
                       "BackendSpec; or list a module every backend shares in SHARED_BACKEND_MODULES):\n"
                       + "\n".join(bad))


def test_the_backend_name_check_can_fail(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from qgrpo.rollout.backends import REGISTRY, vllm_kv\nfrom qgrpo.rollout import backends\n"
                     "a = REGISTRY['torch'].served('cpu')\nb = backends.REGISTRY[\"vllm\"]\n"
                     "c = REGISTRY[cfg.rollout.backend]\nfrom qgrpo.rollout.backends.common import probe_ids\n"
                     "def f():\n    from qgrpo.rollout.backends.mlx_backend import import_mlx\n"
                     "g = 'qgrpo.rollout.backends.mlx_reference:MLXReferenceScorer'\n")
    assert _backend_by_name(probe, "cluster.config.probe") == [
        "probe.py:1 imports qgrpo.rollout.backends.vllm_kv", "probe.py:3 REGISTRY['torch']",
        "probe.py:4 REGISTRY['vllm']", "probe.py:8 imports qgrpo.rollout.backends.mlx_backend",
        "probe.py:9 imports qgrpo.rollout.backends.mlx_reference"]
    assert _backend_by_name(probe, "rollout.backends.probe") == []  # the backends' own package may


def _runtime_imports(path: Path) -> set[str]:
    """The modules of ours (without `qgrpo.`) `path` imports when it runs: at the top, inside functions, and by
    `importlib.import_module` or `__import__` of a constant; not what an `if TYPE_CHECKING:` block imports for type
    checkers. Nor a spec's "module:name" strings: the registry names its backends so as not to import them, and each
    backend imports the registry's base class; that is a plug-in, loaded when chosen, not two modules tangled."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
                   for stmt in node.body for n in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        found |= {n.removeprefix("qgrpo.") for n in _named(node, targets=False) if n.startswith("qgrpo.")}
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph` (module -> the modules it imports): its strongly connected parts of two or more
    modules, each sorted (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    modules = {_module(p): p for p in _sources(*PACKAGES)}
    graph = {m: {t for t in _runtime_imports(p) if t in modules and t != m} for m, p in modules.items()}
    assert circles(graph) == [], "modules that import each other:\n" + "\n".join(map(str, circles(graph)))


def test_the_circle_check_can_fail(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("def f():\n    from qgrpo.x.b import g\n")
    b.write_text("import importlib\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from qgrpo.x.c import h\n"
                 "m = importlib.import_module('qgrpo.x.a')\nn = __import__('qgrpo.x.d')\nt = 'qgrpo.x.e:Plugin'\n")
    # the type-only import and the plug-in's name left out
    assert _runtime_imports(a) == {"x.b", "x.b.g"} and _runtime_imports(b) == {"x.a", "x.d"}
    assert circles({"x.a": {"x.b"}, "x.b": {"x.a"}, "x.c": {"x.a"}}) == [["x.a", "x.b"]]
    assert circles({"x.a": {"x.b"}, "x.b": {"x.c"}}) == []


def test_pyproject_installs_every_package_folder():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setup["package-dir"] == {"qgrpo": "."}
    folders = {"qgrpo"} | {"qgrpo." + _module(p) for p in _sources(*PACKAGES) if p.name == "__init__.py"}
    assert set(setup["packages"]) == folders
    # A folder of modules without __init__.py would import here (a namespace package) and be missing once installed
    bare = sorted({str(p.parent.relative_to(ROOT)) for p in _sources(*PACKAGES)
                   if not (p.parent / "__init__.py").is_file()})
    assert bare == [], f"folders of modules without an __init__.py: {bare}"


@pytest.mark.parametrize("name", ["core", "cluster", "rollout", "learner", "actors"])
def test_no_top_level_module_of_ours_is_installed(name, tmp_path):
    # From a folder other than the checkout, only `qgrpo` is importable: nothing of ours shadows a user's `core`.
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", f"import importlib.util as u; print(u.find_spec({name!r}))"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stdout + proc.stderr


# The rollout actors are the pool's (cluster/run/workers.py) and, in another process, its link's (actors/pool_link.py);
# their own module defines them. Anyone else reaches them through the pool's API or a link (RolloutPool.link()).
POOL_MODULES = {"cluster/run/workers.py", "actors/pool_link.py", "actors/rollout_actor.py"}
ROLLOUT_METHODS = {"generate", "complete", "load_weights", "last_load", "serving", "set_threads", "fixed_length"}


def _pool_back_doors(path: Path) -> list[str]:
    """Every way `path` reaches the rollout actors behind the pool: a `.actors` / `._actors` attribute of anything
    (a pool's, a link's), that name looked up (getattr/setattr/hasattr, `vars(x)[...]`, `x.__dict__[...]`), a
    PoolLink built from handles, the actor class itself, or a rollout actor's method called remotely."""
    bad = []
    names = {"actors", "_actors"}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Attribute) and node.attr in names:
            bad.append((line, f".{node.attr}"))
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in names:
            bad.append((line, f"[{node.slice.value!r}]"))
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
            strings = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if name in ("getattr", "setattr", "hasattr") and names & set(strings):
                bad.append((line, f"{name}(..., {strings[0]!r})"))
            elif name == "PoolLink":
                bad.append((line, "PoolLink(...)"))
            elif (name == "remote" and isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Attribute)
                  and fn.value.attr in ROLLOUT_METHODS):
                bad.append((line, f".{fn.value.attr}.remote(...)"))
        elif isinstance(node, ast.Name) and node.id in ("RolloutActor", "_RolloutActor"):
            bad.append((line, node.id))
    return [f"{path.name}:{line} {what}" for line, what in sorted(bad)]


def test_no_raw_rollout_actor_handle_outside_the_pool_and_its_link():
    bad = [b for p in _sources(*PACKAGES) if p.relative_to(ROOT).as_posix() not in POOL_MODULES
           for b in _pool_back_doors(p)]
    assert bad == [], "the rollout actors reached past the pool:\n" + "\n".join(bad)


def test_the_back_door_check_can_fail(tmp_path):
    fake = tmp_path / "probe.py"
    fake.write_text("def f(pool, workers, link, a):\n    n = len(workers.rollout.actors)\n"
                    "    hs = getattr(pool, 'actors')\n    link = PoolLink(hs)\n    a.complete.remote([], None)\n"
                    "    return vars(pool)['actors'], RolloutActor\n")
    assert _pool_back_doors(fake) == ["probe.py:2 .actors", "probe.py:3 getattr(..., 'actors')",
                                      "probe.py:4 PoolLink(...)", "probe.py:5 .complete.remote(...)",
                                      "probe.py:6 RolloutActor", "probe.py:6 ['actors']"]


# The rooms of rollout/, lowest first, by job: a room imports only from itself and the rooms below it. The helpers
# every part reads (options, noise); the quantized formats and their kernels; the models; the data; the generators and
# scorers (backends); rewards, with the answers' statistics above them; environments and the episode loop, the
# held-out evaluation and the precision trials over them; the endpoint; the agent contract beside and above it.
ROOMS = ("options", "noise", "quantization", "modeling", "data", "backends", "rewards", "answer_stats", "environments",
         "episodes", "evaluate", "precision_trials", "endpoint", "agents")


def test_the_rooms_name_every_part_of_rollout():
    parts = {p.stem if p.is_file() else p.name for p in (ROOT / "rollout").iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert parts == set(ROOMS)


def _room(module: str) -> str:
    """The room of rollout/ a module (dotted, without `qgrpo.`) is in: one of ROOMS, or "" (not in one)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "rollout" and len(parts) > 1 and parts[1] in ROOMS else ""


def _up_a_floor(path: Path, module: str | None = None) -> list[str]:
    """`file:line` imports of `path` (the module `module`) that run up from its room of rollout/ to a higher one,
    lazy imports and "qgrpo.module:name" strings included."""
    here = _room(module or _module(path))
    bad = []
    for line, target in _imports(path):
        there = _room(target)
        if here and there and ROOMS.index(there) > ROOMS.index(here):
            bad.append(f"{path.name}:{line} ({here}) imports qgrpo.{target} ({there})")
    return bad


def test_no_room_of_rollout_imports_a_room_above_it():
    bad = [b for p in _sources("rollout") for b in _up_a_floor(p)]
    assert bad == [], "imports up a floor inside rollout/:\n" + "\n".join(bad)


def test_the_room_check_can_fail(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from qgrpo.rollout.rewards.calls import load_function\n"
                     "def f():\n    from qgrpo.rollout.agents import probe\n"
                     "T = 'qgrpo.rollout.episodes:episode_setup'\nfrom qgrpo.rollout.data.tasks import make_task\n")
    assert _up_a_floor(probe, "rollout.environments.probe") == [
        "probe.py:3 (environments) imports qgrpo.rollout.agents (agents)",
        "probe.py:3 (environments) imports qgrpo.rollout.agents.probe (agents)",
        "probe.py:4 (environments) imports qgrpo.rollout.episodes (episodes)"]
    assert _up_a_floor(probe, "rollout.agents.probe") == []
