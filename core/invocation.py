"""The commands qgrpo prints (resume a run, open its report or its TensorBoard), written so that they run as printed
where the user typed the command that printed them.

A virtual environment's scripts are on PATH only while it is activated: a user who typed `.venv/bin/qgrpo train ...`
gets `command not found` from a printed `qgrpo report ...`. So a printed command starts the way this process started:
- `qgrpo` when the `qgrpo` PATH finds is the script this process runs;
- the script's path as it was typed (`.venv/bin/qgrpo`) when PATH finds another `qgrpo` or none;
- `PYTHON -m qgrpo` after `python -m qgrpo`, PYTHON being the name PATH finds this interpreter by (`python`,
  `python3`), else its path;
- in a process that is not the command (Python code, a test, a Ray job's entrypoint): `qgrpo` when PATH finds the
  script beside this interpreter, else that script's path, else `PYTHON -m qgrpo`.
Another tool of the same environment (tensorboard) is named the same way: by name when PATH finds the one beside this
interpreter, else by that one's path, else `PYTHON -m MODULE`. A path under the working directory is written relative
to it, and every word is quoted for a POSIX shell.
"""
from __future__ import annotations

import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from typing import Callable


def _same(a: str | None, b: str | None) -> bool:
    if not a or not b:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


@dataclass
class Invocation:
    """How this process was started, for the commands it prints: `argv0` (sys.argv[0]), `executable` (sys.executable),
    `which` (shutil.which) and `cwd` are parameters so that a test can give each case."""

    argv0: str = field(default_factory=lambda: sys.argv[0] if sys.argv else "")
    executable: str = field(default_factory=lambda: sys.executable)
    which: Callable[[str], str | None] = shutil.which
    cwd: str = field(default_factory=os.getcwd)

    def _path(self, path: str) -> str:
        """`path` relative to the working directory when it lies under it, else absolute."""
        full = os.path.abspath(os.path.join(self.cwd, path))
        rel = os.path.relpath(full, self.cwd)
        return rel if not rel.startswith("..") else full

    def python(self) -> str:
        """This interpreter by the name PATH finds it by, else by its path."""
        for name in ("python", "python3"):
            if _same(self.which(name), self.executable):
                return name
        return self._path(self.executable)

    def _beside(self, name: str) -> str | None:
        """The script `name` in this interpreter's bin directory (a virtual environment's), if there is one."""
        if not self.executable:
            return None
        script = os.path.join(os.path.dirname(self.executable), name)
        return script if os.path.isfile(script) and os.access(script, os.X_OK) else None

    def tool(self, name: str, module: str) -> list[str]:
        """The words that start the environment's script `name` (or `python -m module`) from where the user is."""
        beside = self._beside(name)
        if beside is None:
            found = self.which(name)
            return [name] if found else [self.python(), "-m", module]
        return [name] if _same(self.which(name), beside) else [self._path(beside)]

    def qgrpo(self) -> list[str]:
        """The words that start qgrpo the way this process was started (module docstring)."""
        argv0 = self.argv0
        base = os.path.basename(argv0)
        if base == "__main__.py":  # python -m qgrpo (or -m qgrpo.cluster.cli)
            return [self.python(), "-m", "qgrpo"]
        if base == "qgrpo" and os.path.isfile(os.path.join(self.cwd, argv0)):
            if _same(self.which("qgrpo"), os.path.join(self.cwd, argv0)):
                return ["qgrpo"]
            return [argv0 if os.sep in argv0 else self._path(argv0)]
        return self.tool("qgrpo", "qgrpo")


def qgrpo_command(*args, how: Invocation | None = None) -> str:
    """`qgrpo ARGS...` as a line the user can paste where they started qgrpo (module docstring)."""
    how = how or Invocation()
    return shlex.join([*how.qgrpo(), *map(str, args)])


def tool_command(name: str, module: str, *args, how: Invocation | None = None) -> str:
    """Another script of qgrpo's environment (`tensorboard`, module `tensorboard.main`) with ARGS, as a line the user
    can paste (module docstring)."""
    how = how or Invocation()
    return shlex.join([*how.tool(name, module), *map(str, args)])
