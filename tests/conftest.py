import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """The builtin tiny model, materialised once into a test cache (offline, seeded)."""
    from qgrpo.rollout.models import resolve_model_path

    cache = os.environ.get("QGRPO_TEST_CACHE") or str(tmp_path_factory.mktemp("qgrpo-cache"))
    return resolve_model_path("builtin:tiny-digits", cache)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the tests that need it; only this one is stopped at the end."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
