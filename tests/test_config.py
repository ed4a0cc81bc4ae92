import subprocess
import sys
from pathlib import Path

import pytest

from cluster.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


def test_presets_are_valid():
    from rollout.tasks import check_task

    for preset in sorted((ROOT / "configs").glob("*.toml")):
        cfg = load_config(preset)
        assert check_task(cfg.task, cfg.run.seed) == [], preset  # includes: no worked example is a held-out question


def test_override_types_and_values():
    cfg = load_config(TINY, ["learner.lr=1e-4", "rollout.precision=int8", "run.progress=false", "algo.is_cap=3"])
    assert cfg.learner.lr == 1e-4 and cfg.rollout.precision == "int8" and cfg.run.progress is False
    assert cfg.algo.is_cap == 3.0 and isinstance(cfg.algo.is_cap, float)


# (override, a fragment the message must contain: the field name and its rule)
BAD = [
    ("rollout.bogus=1", "rollout.bogus: unknown key"),
    ("nosection.x=1", "nosection: unknown key"),
    ("rollout.group_size=1", "rollout.group_size: must be >= 2"),
    ("learner.lr=-0.1", "learner.lr: must be in (0, 1)"),
    ("rollout.precision=int3", "rollout.precision: unknown precision 'int3'"),
    ("algo.clip_low=0.3", "algo.clip_low: must be <= algo.clip_high"),
    ("model.path='/nonexistent/model'", "model.path: folder '/nonexistent/model' does not exist"),
    ("model.path=''", "model.path: missing"),
    ("rollout.temperature=0", "rollout.temperature: must be > 0"),
    ("algo.kl_estimator='k4'", "algo.kl_estimator: must be k1, k2 or k3"),
    ("learner.zero_stage=4", "learner.zero_stage: must be 0, 1, 2 or 3"),
    ("rollout.num_actors=0", "rollout.num_actors: must be >= 1"),
    ("rewards.functions=[{name='nope', weight=1.0}]", "rewards.functions[0].name: unknown reward 'nope'"),
    ("learner.lr='fast'", "learner.lr: expected float"),
    ("algo.loss_agg='mean'", "algo.loss_agg: must be token_mean, seq_mean or constant"),
    ("algo.is_cap=0.5", "algo.is_cap: must be > 1"),
    ("rollout.top_p=1.5", "rollout.top_p: must be in (0, 1]"),
    ("task.name='gsm9k'", "task.name: unknown task 'gsm9k'"),
]


@pytest.mark.parametrize("override,fragment", BAD, ids=[b[0] for b in BAD])
def test_each_invalid_value_is_named(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [override])
    assert fragment in str(e.value), str(e.value)


def test_all_problems_reported_at_once_by_cli(tmp_path):
    out = tmp_path / "runs"
    used = [(o, f) for o, f in BAD if not o.startswith(("model.path", "learner.lr='"))]  # one value per field
    args = [f"--set={o}" for o, _ in used] + [f"--set=run.output_dir='{out}'"]
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "train", str(TINY), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    for _, fragment in used:
        assert fragment in proc.stderr, (fragment, proc.stderr)
    assert proc.stderr.count("\n  - ") >= 10
    assert not out.exists(), "a rejected config must not create a run directory"
    assert "Traceback" not in proc.stderr


def test_bad_toml_file(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[run\nsteps = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(f)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def test_config_is_not_rewritten(tmp_path):
    """Validation rejects, never repairs: the value the user gave is the value in the error."""
    with pytest.raises(ConfigError, match="got 0.25 > 0.2"):
        load_config(TINY, ["algo.clip_low=0.25"])
