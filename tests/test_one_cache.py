"""`make train` and a bare `qgrpo train` build and reuse builtin models in one cache: the Makefile's environment
resolves the cache to the same folder as the plain command's (core/storage.cache_root, which every caller uses)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("from qgrpo.core.storage import cache_root; from qgrpo.rollout.modeling.models import builtin_cache_dir; "
         "print(cache_root()); print(builtin_cache_dir('tiny-digits'))")


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("QGRPO_CACHE", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    return {**env, "HOME": str(home), **extra}


def _bare(env: dict[str, str]) -> str:
    return subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=True).stdout


def _through_make(env: dict[str, str]) -> str:
    """The probe run by a target added to the Makefile, so it sees exactly the environment make gives its recipes."""
    recipe = f"cache-probe: ; @{sys.executable} -c \"{PROBE}\""
    return subprocess.run(["make", "-s", "--no-print-directory", "-f", "Makefile", "--eval", recipe, "cache-probe"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=True).stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_and_the_bare_command_resolve_one_cache(tmp_path):
    bare = _bare(_env(tmp_path))
    assert bare.splitlines()[0] == str(tmp_path / ".cache" / "qgrpo")  # the documented default
    assert _through_make(_env(tmp_path)) == bare


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_a_cache_the_user_sets_is_the_one_make_uses(tmp_path):
    env = _env(tmp_path, QGRPO_CACHE=str(tmp_path / "mine"))
    assert _through_make(env) == _bare(env)
    assert _through_make(env).splitlines()[0] == str(tmp_path / "mine")
