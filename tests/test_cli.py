"""The `qgrpo` command itself: its version, and a handler for every subcommand its parser offers (no Ray, no model)."""
from __future__ import annotations

import argparse
import subprocess
import sys

import qgrpo
from qgrpo.cluster.cli.app import COMMANDS, _parser


def test_version_from_a_subprocess(tmp_path):
    # From another folder, as a user runs it: the installed package answers, not the checkout on sys.path.
    proc = subprocess.run([sys.executable, "-m", "qgrpo", "--version"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"qgrpo {qgrpo.__version__}\n"


def test_every_subcommand_has_a_handler():
    (sub,) = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(sub.choices) == set(COMMANDS)
