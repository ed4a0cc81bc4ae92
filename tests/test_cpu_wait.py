"""rollout.cpu_wait: the OpenMP wait policy of the rollout actors (core/cpu.py wait_env, actors/common.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from qgrpo.actors.common import thread_env
from qgrpo.cluster.config.schema import ConfigError, load_config
from qgrpo.core.cpu import CPU_WAITS, SPIN_COUNT, current_wait, wait_env
from tests.helpers import TINY


def test_each_wait_sets_the_spin_count_itself():
    # Both set GOMP_SPINCOUNT, which libgomp takes over the policy's own count: what the driver's environment passes
    # on (a PASSIVE, a spin count) cannot turn one into the other.
    assert wait_env("passive") == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}
    assert wait_env("spin") == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": str(SPIN_COUNT)} and SPIN_COUNT > 0
    assert thread_env(2, "spin")["OMP_NUM_THREADS"] == "2" and thread_env(0)["GOMP_SPINCOUNT"] == "0"
    with pytest.raises(ValueError, match="cpu_wait 'busy'"):
        wait_env("busy")


@pytest.mark.parametrize("wait", CPU_WAITS)
def test_a_process_reads_back_the_wait_it_started_with(wait, monkeypatch):
    for k, v in wait_env(wait).items():
        monkeypatch.setenv(k, v)
    assert current_wait() == wait


def test_the_config_field_names_its_values():
    assert load_config(TINY).rollout.cpu_wait == "passive"
    assert load_config(TINY, ["rollout.cpu_wait='spin'"]).rollout.cpu_wait == "spin"
    with pytest.raises(ConfigError, match="rollout.cpu_wait") as e:
        load_config(TINY, ["rollout.cpu_wait='busy'"])
    assert "passive" in str(e.value) and "spin" in str(e.value)


# Idle worker threads between short parallel regions: with "spin" they burn CPU until they sleep, with "passive" they
# sleep at once. The process's CPU time beyond the main thread's shows which one libgomp obeyed.
_PROBE = """
import json, resource, time, torch
torch.set_num_threads(2)
x = torch.ones(1 << 20)
torch.add(x, x)
t0 = time.thread_time()
r0 = resource.getrusage(resource.RUSAGE_SELF)
for _ in range(200):
    torch.add(x, x)  # one parallel region of both threads
    time.sleep(0.002)
r1 = resource.getrusage(resource.RUSAGE_SELF)
main = time.thread_time() - t0
print(json.dumps({"others_s": (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) - main}))
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores: a worker thread beside the main one")
def test_libgomp_obeys_the_spin_count_over_a_passive_policy():
    def others(env: dict) -> float:
        env = {**os.environ, **env, "OMP_NUM_THREADS": "2"}
        out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])["others_s"]

    passive = others(wait_env("passive"))
    # 200,000 spins: ~2 ms after each of the 200 regions at libgomp's "100,000 spins a millisecond" (within 5x by
    # CPU), about 0.4 s of a worker's CPU time where a sleeping worker spends none. The same variable carries
    # rollout.cpu_wait's smaller count, too short to tell apart from noise this way.
    spin = others({**wait_env("passive"), "GOMP_SPINCOUNT": "200000"})
    assert spin > passive + 0.08, (passive, spin)
