"""Environments declare what they are (rollout/environments/kinds.py): each kind of environment.name ("" for none,
FILE.py:NAME, openenv:..., agent:...) gives a Capabilities record, and the code around it (the config's rules, `qgrpo
check`, the step estimate, the run's supply and health watches, scoring's words) reads that record, never asks which
kind a name is. Checked on the source, as tests/test_layers.py checks the layers: nothing outside the registry asks
the kind (an `is_agent`, a `kind_of`, a spec's kind compared with a kind's name, a name's prefix tested); the check
is shown able to fail. That no room of rollout/ imports a room above it is tests/test_layers.py's.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from qgrpo.rollout.environments.kinds import KINDS, PREFIXES, Capabilities, capabilities, kind_of
from tests.test_layers import PACKAGES, ROOT, _sources

# The environment registry: the modules that may tell the kinds apart.
REGISTRY = {ROOT / "rollout" / "environments" / "kinds.py", ROOT / "rollout" / "environments" / "loader.py"}
ASKS_KIND = {"is_agent", "kind_of"}  # functions whose answer is a kind, not a capability


@pytest.mark.parametrize("name, kind", [("", "task"), ("env.py:Echo", "environment"), ("pkg.envs:Echo", "environment"),
                                        ("openenv:server.py:Game", "openenv"), ("openenv:http://h:8000", "openenv"),
                                        ("agent:agent.py:play", "agent")])
def test_each_name_has_a_kind_and_its_kind_declares_what_it_is(name, kind):
    caps = capabilities(name)
    assert kind_of(name) == kind and caps is KINDS[kind] and isinstance(caps, Capabilities)
    # what the code around reads, per kind
    assert caps.episode_loop == (kind in ("environment", "openenv"))
    assert caps.endpoint == caps.forks == caps.asks_max_tokens == (not caps.redraws) == (kind == "agent")
    assert caps.tools_known == (kind == "environment")
    assert caps.own_score == {"task": "", "agent": "the agent's own reward"}.get(kind, "the environment's own score")


def test_a_spec_gives_its_kinds_capabilities(tmp_path):
    from qgrpo.rollout.environments.loader import environment_spec

    (tmp_path / "agent.py").write_text("async def play(row, client):\n    return 1.0\n")
    for name in (f"agent:{tmp_path / 'agent.py'}:play", f"{tmp_path / 'agent.py'}:play", "openenv:http://h:8000"):
        spec = environment_spec(name)
        assert spec.caps is capabilities(name) and spec.name == name


def test_the_rewards_words_name_each_kinds_own_score():
    from qgrpo.cluster.config.schema import check
    from qgrpo.rollout.rewards.scoring import rewards_applied

    model = {"model": {"path": "builtin:tiny-digits"}}
    for name, own in (("env.py:Echo", "the environment's own score"), ("agent:a.py:f", "the agent's own reward")):
        cfg, problems = check({**model, "environment": {"name": name}}, False)
        assert problems == []
        assert rewards_applied(cfg, capabilities(name).own_score) == \
            f"1 x {own} (reward/environment; rewards.functions = []: no other)"
    cfg, _ = check(model, False)  # no environment: no own score
    assert rewards_applied(cfg, capabilities("").own_score) == "1 x correct"


def _asks_kind(path: Path) -> list[str]:
    """`file:line what` of each place `path` asks which kind an environment is: a call, import or reference of
    `is_agent` or `kind_of`, a `.kind` compared with a kind's name (`spec.kind == "agent"`, `kind in ("agent",)`), a
    name's `startswith` of a kind's prefix ("agent:", "openenv:")."""
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    kinds, prefixes = set(KINDS), set(PREFIXES.values())

    def constants(node) -> set:
        items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}

    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        named = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else "")
        if named in ASKS_KIND:
            bad.append((node.lineno, named))
        elif isinstance(node, ast.ImportFrom) and any(a.name in ASKS_KIND for a in node.names):
            bad.append((node.lineno, "imports " + ", ".join(a.name for a in node.names if a.name in ASKS_KIND)))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(getattr(s, "attr", "") == "kind" for s in sides) and any(constants(s) & kinds for s in sides):
                bad.append((node.lineno, ".kind compared with a kind"))
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "startswith" and node.args
              and constants(node.args[0]) & prefixes):
            bad.append((node.lineno, "startswith a kind's prefix"))
    return [f"{where}:{line} {what}" for line, what in sorted(set(bad))]


def test_no_module_outside_the_registry_asks_which_kind_an_environment_is():
    """What an environment can do is its kind's Capabilities to say (rollout/environments/kinds.py): a new kind is
    added there alone. Everything else reads `capabilities(environment.name)` or a spec's `caps`."""
    here = Path(__file__).resolve()  # this file asks the registry itself
    files = [p for p in _sources(*PACKAGES, "bench", "tests", "examples") if p not in REGISTRY and p != here]
    bad = [b for p in files for b in _asks_kind(p)]
    assert bad == [], "kinds asked outside the environment registry (read a Capabilities field instead):\n" + \
        "\n".join(bad)


def test_the_kind_check_can_fail(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from qgrpo.rollout.environments.loader import is_agent\n"
                     "a = is_agent(cfg.environment.name)\nb = spec.kind == 'agent'\n"
                     "c = spec.kind in ('openenv', 'x')\nd = name.startswith('agent:')\n"
                     "e = kinds.kind_of(name)\nf = capabilities(name).endpoint\ng = 'is_agent(x)'\n"
                     "h = entry.kind == 'url'\n")
    assert _asks_kind(probe) == ["probe.py:1 imports is_agent", "probe.py:2 is_agent",
                                 "probe.py:3 .kind compared with a kind", "probe.py:4 .kind compared with a kind",
                                 "probe.py:5 startswith a kind's prefix", "probe.py:6 kind_of"]
