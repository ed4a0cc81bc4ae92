"""configs/tiny.toml learns: int4 rollouts with truncated importance sampling, real Ray and DeepSpeed, from a randomly
initialised model. In `make test` a smoke: the shared 30-step run (tests/conftest.py: torch_smoke_run, which also
survives a killed rollout actor) moves the reward (tests/helpers.py: SMOKE_GAIN). In `make test-slow` the curve: 300
steps, the mean reward of the last 10 steps exceeds that of the first 10 by at least 0.3. The wall time is printed,
not asserted (the machine is shared; speed belongs in bench/)."""
import json
import math
import time
from pathlib import Path

import pytest

from qgrpo.cluster.cli.app import main
from qgrpo.cluster.config.schema import load_config
from tests.helpers import SMOKE_GAIN, SMOKE_STEPS, reward_moved, step_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


def test_a_short_run_moves_the_reward(torch_smoke_run):
    assert len(step_metrics(torch_smoke_run)) == SMOKE_STEPS
    first, last = reward_moved(torch_smoke_run)
    print(f"tiny smoke: reward first3={first:.3f} last10={last:.3f}")
    assert last - first >= SMOKE_GAIN, (first, last)


@pytest.mark.slow  # ~110 s here; the smoke above is in `make test`
def test_tiny_config_learns(ray_session, tiny_model_path, tmp_path):
    cfg = load_config(TINY)
    assert cfg.rollout.precision == "int4" and cfg.algo.is_mode == "truncate"
    t0 = time.monotonic()
    rc = main(["train", str(TINY), "--set", f"model.path='{tiny_model_path}'", "--set", f"run.output_dir='{tmp_path}'",
               "--set", "run.progress=false"])
    elapsed = time.monotonic() - t0
    assert rc == 0
    (run_dir,) = tmp_path.iterdir()
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    assert len(rows) == cfg.run.steps
    first = sum(r["reward/mean"] for r in rows[:10]) / 10
    last = sum(r["reward/mean"] for r in rows[-10:]) / 10
    print(f"tiny: reward first10={first:.3f} last10={last:.3f} in {elapsed:.0f} s")
    assert all(math.isfinite(r["mismatch/kl_mu_old"]) and math.isfinite(r["loss/total"]) for r in rows)
    assert last - first >= 0.3, (first, last)
