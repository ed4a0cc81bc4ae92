"""configs/tiny.toml learns: int4 rollouts with truncated importance sampling, real Ray and DeepSpeed, from a randomly
initialised model. The bar: the mean reward of the last 10 steps exceeds that of the first 10 by at least 0.3. The
wall time is printed, not asserted (the machine is shared; speed belongs in bench/)."""
import json
import math
import time
from pathlib import Path

from qgrpo.cluster.cli.app import main
from qgrpo.cluster.config.schema import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


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
