"""The commands qgrpo prints run as printed (core/invocation.py): the way the user started qgrpo, each case
built in a temporary folder with real files, and the printed command run through a shell where the user is."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from qgrpo.core.invocation import Invocation, qgrpo_command, tool_command


def _venv(tmp: Path) -> Path:
    """A fake environment: bin/python (a link to this interpreter), bin/qgrpo and bin/tensorboard scripts."""
    bin_ = tmp / "proj" / ".venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "python").symlink_to(sys.executable)
    for name in ("qgrpo", "tensorboard"):
        script = bin_ / name
        script.write_text(f"#!/bin/sh\necho {name} \"$@\"\n")
        script.chmod(0o755)
    return bin_


def _which(found: dict[str, str]):
    return lambda name: found.get(name)


def test_a_script_typed_by_its_path_is_printed_by_that_path(tmp_path):
    bin_ = _venv(tmp_path)
    how = Invocation(argv0=".venv/bin/qgrpo", executable=str(bin_ / "python"), which=_which({}),
                     cwd=str(tmp_path / "proj"))
    assert qgrpo_command("train", "--resume", "runs/a b", how=how) == ".venv/bin/qgrpo train --resume 'runs/a b'"
    assert tool_command("tensorboard", "tensorboard.main", "--logdir", "runs/x", how=how) == \
        ".venv/bin/tensorboard --logdir runs/x"


def test_a_script_on_path_is_printed_by_its_name(tmp_path):
    bin_ = _venv(tmp_path)
    found = {"qgrpo": str(bin_ / "qgrpo"), "tensorboard": str(bin_ / "tensorboard")}
    how = Invocation(argv0=str(bin_ / "qgrpo"), executable=str(bin_ / "python"), which=_which(found),
                     cwd=str(tmp_path))
    assert qgrpo_command("report", "runs/r", how=how) == "qgrpo report runs/r"
    assert tool_command("tensorboard", "tensorboard.main", how=how) == "tensorboard"


def test_another_qgrpo_on_path_does_not_stand_for_this_one(tmp_path):
    bin_ = _venv(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    (other / "qgrpo").write_text("#!/bin/sh\n")
    how = Invocation(argv0=str(bin_ / "qgrpo"), executable=str(bin_ / "python"),
                     which=_which({"qgrpo": str(other / "qgrpo")}), cwd="/")
    assert qgrpo_command("report", "r", how=how) == f"{bin_ / 'qgrpo'} report r"


def test_python_dash_m_is_printed_as_python_dash_m(tmp_path):
    bin_ = _venv(tmp_path)
    main = str(Path(__file__).resolve().parents[1] / "__main__.py")
    on_path = Invocation(argv0=main, executable=str(bin_ / "python"), which=_which({"python": str(bin_ / "python")}),
                         cwd=str(tmp_path))
    assert qgrpo_command("report", "r", how=on_path) == "python -m qgrpo report r"
    off_path = Invocation(argv0=main, executable=str(bin_ / "python"), which=_which({}), cwd=str(tmp_path / "proj"))
    assert qgrpo_command("report", "r", how=off_path) == ".venv/bin/python -m qgrpo report r"


def test_a_process_that_is_not_the_command_names_the_script_beside_its_interpreter(tmp_path):
    bin_ = _venv(tmp_path)
    how = Invocation(argv0="/usr/lib/python3/pytest", executable=str(bin_ / "python"), which=_which({}),
                     cwd=str(tmp_path / "proj"))
    assert qgrpo_command("check", "c.toml", how=how) == ".venv/bin/qgrpo check c.toml"
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)
    none = Invocation(argv0="", executable=str(bare / "python"), which=_which({}), cwd=str(tmp_path))
    assert qgrpo_command("check", how=none) == "bare/python -m qgrpo check"
    assert tool_command("tensorboard", "tensorboard.main", "--logdir", "x", how=none) == \
        "bare/python -m tensorboard.main --logdir x"


def test_the_printed_command_runs_in_a_shell_where_the_user_is(tmp_path):
    """The line a user would paste, run by /bin/sh in the folder they started qgrpo from, with a PATH that lacks the
    environment's bin (not activated): it reaches the script."""
    bin_ = _venv(tmp_path)
    proj = tmp_path / "proj"
    how = Invocation(argv0=".venv/bin/qgrpo", executable=str(bin_ / "python"), which=_which({}), cwd=str(proj))
    line = qgrpo_command("train", "--resume", "runs/my run", how=how)
    out = subprocess.run(["/bin/sh", "-c", line], cwd=proj, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and out.stdout == "qgrpo train --resume runs/my run\n", (line, out)


@pytest.mark.skipif(not (Path(sys.executable).parent / "qgrpo").is_file(), reason="qgrpo not installed as a script")
def test_this_environment_prints_a_runnable_command():
    """In this process (pytest, not the command): the printed command reaches this environment's qgrpo."""
    line = qgrpo_command("--help")
    out = subprocess.run(["/bin/sh", "-c", line], capture_output=True, text=True,
                         env={**os.environ, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0 and "train" in out.stdout, (line, out.stderr[-2000:])
