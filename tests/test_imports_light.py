"""The math modules and package roots import without the heavy stack (Ray, DeepSpeed, vLLM, MLX, ...)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("ray", "deepspeed", "vllm", "mlx", "transformers", "torchao", "bitsandbytes")

SCRIPT = f"""
import sys
import qgrpo, qgrpo.learner.objective.loss, qgrpo.learner.objective.advantages, qgrpo.rollout.backends
import qgrpo.cluster.config, qgrpo.cluster.run, qgrpo.cluster.rundir, qgrpo.cluster.report, qgrpo.cluster.cli
heavy = [m for m in sys.modules if m.split(".")[0] in {HEAVY!r}]
print(",".join(sorted(heavy)))
"""


def test_math_modules_import_no_heavy_packages():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    loaded = [m for m in proc.stdout.strip().split(",") if m]
    assert loaded == [], f"importing the math modules loaded heavy packages: {loaded}"


def test_check_detects_a_heavy_import():
    # The same check must fail when a heavy package is imported (guards against a vacuous test).
    proc = subprocess.run(
        [sys.executable, "-c", "import safetensors, sys; sys.modules['ray.fake'] = safetensors\n" + SCRIPT],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ray.fake"


def test_the_command_and_the_config_start_without_torch():
    # `qgrpo --help`, `qgrpo check`'s schema and `qgrpo scale` should start in a fraction of a second: the schema takes
    # its choices from torch-free modules (learner/objective/options.py, knobs.py, losses.py), not from the loss itself.
    script = "import sys, qgrpo.cluster.cli.app, qgrpo.cluster.config.schema; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stdout + proc.stderr
