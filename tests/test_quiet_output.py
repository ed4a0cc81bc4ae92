"""What qgrpo prints is its own: the expected noise of its libraries (torchao's CUDA-only kernels failing to load on a
CPU torch, DeepSpeed guessing its accelerator, Ray's token-auth notice) is dropped at its source in the driver and in
the actors, other messages of the same loggers still show, and a clean run ends without Ray reporting a dead worker.
The user's reward file here imports torchao and DeepSpeed, as a file of one's own may."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
NOISE = ("Failed to load", "Setting accelerator to CPU", "Token authentication is enabled", "is an Enum subclass",
         "is incompatible with gradient checkpointing", "worker died", "SYSTEM_ERROR")
CHECKPOINTING = ("logging.getLogger('transformers.utils.generic').warning('`use_cache=True` is incompatible with "
                 "gradient checkpointing. Setting `use_cache=False`.')\n")
IMPORTS = "import logging, torchao, deepspeed\n"
SAY = ("logging.getLogger('torchao').warning('torchao: a real problem')\n"
       "logging.getLogger('DeepSpeed').warning('DeepSpeed: a real problem')\n")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "DS_ACCELERATOR", "RAY_ADDRESS")}
    return {**env, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr


def test_the_filters_drop_the_noise_and_nothing_else():
    quiet = _python("from qgrpo.actors.common import quiet_libraries\nquiet_libraries()\n" + IMPORTS + SAY
                    + CHECKPOINTING)
    assert not [n for n in NOISE if n in quiet], quiet
    assert "torchao: a real problem" in quiet and "DeepSpeed: a real problem" in quiet  # the loggers still speak


def test_without_the_filters_this_machine_shows_the_noise():
    """The other side of the test above: the libraries installed here do print it (when they stop, this test says
    the filters may go)."""
    loud = _python(IMPORTS)
    if sys.platform == "linux" and "+cpu" in __import__("torch").__version__:
        assert "Failed to load" in loud and "Setting accelerator to CPU" in loud, loud


def _noisy_rewards(tmp_path: Path, tiny_model_path: str) -> list[str]:
    """tiny.toml (its model from the test cache) with one more reward, from a file of the user's that imports torchao
    and DeepSpeed."""
    (tmp_path / "rewards.py").write_text(
        "import deepspeed  # noqa: F401\nimport torchao  # noqa: F401\n\n\n"
        "def short(completions, **kwargs):\n    return [1.0 if len(c) <= 2 else 0.0 for c in completions]\n")
    functions = ('[{ name = "correct", weight = 0.8 }, { name = "integer_format", weight = 0.2 }, '
                 f'{{ function = "{tmp_path / "rewards.py"}:short", weight = 0.1 }}]')
    cache = Path(tiny_model_path).parents[1]  # CACHE/models/tiny-digits-vN
    sets = [f"rewards.functions={functions}", f"run.output_dir='{tmp_path / 'runs'}'", f"model.cache_dir='{cache}'",
            "run.eval=false", "run.progress=false", "run.steps=2", "run.save_every=0"]
    return [str(TINY), *(a for s in sets for a in ("--set", s))]


def _qgrpo(*argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qgrpo", *argv], env=_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.ray  # a qgrpo process of its own
def test_check_of_a_task_whose_rewards_import_noisy_libraries(tmp_path, tiny_model_path):
    proc = _qgrpo("check", *_noisy_rewards(tmp_path, tiny_model_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "qgrpo check: OK: train would start"
    both = proc.stdout + proc.stderr
    assert not [n for n in NOISE if n in both], both


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
@pytest.mark.ray  # a qgrpo process of its own
def test_a_short_run_prints_no_library_noise_and_no_dead_worker(tmp_path, tiny_model_path):
    """Driver, rollout, reference and learner actors and a reward worker that imports the noisy libraries: a clean
    two-step run, and Ray does not report any of its actors as dead at the end."""
    proc = _qgrpo("train", *_noisy_rewards(tmp_path, tiny_model_path))
    both = proc.stdout + proc.stderr
    assert proc.returncode == 0, both
    assert "qgrpo: done in" in proc.stderr
    assert not [n for n in NOISE if n.lower() in both.lower()], both
