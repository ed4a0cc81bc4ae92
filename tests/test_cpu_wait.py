"""cpu_wait: the OpenMP wait policy of the rollout actors, the learner and the reference (core/cpu.py wait_env,
actors/common.py; "auto": cluster/run/cpu_waits.py)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from qgrpo.actors.common import thread_env
from qgrpo.cluster.config.schema import ConfigError, load_config
from qgrpo.cluster.run.cpu_waits import ROLES, role_waits
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


@pytest.mark.parametrize("role", ROLES)
def test_the_config_fields_name_their_values(role):
    assert getattr(load_config(TINY), role).cpu_wait == "passive"
    assert getattr(load_config(TINY, [f"{role}.cpu_wait='spin'"]), role).cpu_wait == "spin"
    with pytest.raises(ConfigError, match=f"{role}.cpu_wait") as e:
        load_config(TINY, [f"{role}.cpu_wait='busy'"])
    assert all(w in str(e.value) for w in ("auto", "passive", "spin"))


AUTO = [f"{r}.cpu_wait='auto'" for r in ROLES]


def _waits(sets=(), local=True, cores=2, threads=None, cfg=None):
    cfg = cfg or load_config(TINY, AUTO + list(sets))
    return {r: w["wait"] for r, w in role_waits(cfg, local, cores, threads or dict.fromkeys(ROLES, cores)).items()}


def test_auto_spins_where_the_roles_take_turns_on_one_machine():
    # "passive" is the default, whatever the run; "auto" is asked for
    assert _waits(cfg=load_config(TINY)) == dict.fromkeys(ROLES, "passive")
    # the tiny preset: a synchronous supply, one rollout actor, one learner rank and the reference, each on both cores
    waits = role_waits(load_config(TINY, AUTO), True, 2, dict.fromkeys(ROLES, 2))
    assert {r: w["wait"] for r, w in waits.items()} == dict.fromkeys(ROLES, "spin")
    assert all(w["why"].startswith("auto: ") for w in waits.values())


@pytest.mark.parametrize("sets, reason", [
    (["algo.max_staleness=1"], "a stream"),
    (["algo.overlap=true"], "a stream"),
    ([], "[environment]"),
])
def test_auto_stays_passive_where_another_role_computes_at_the_same_time(sets, reason):
    cfg = load_config(TINY, AUTO + sets)
    if not sets:  # a multi-turn run: environment workers beside the generators
        cfg = dataclasses.replace(cfg, environment=dataclasses.replace(cfg.environment, name="env.py:Env"))
    waits = role_waits(cfg, True, 2, dict.fromkeys(ROLES, 2))
    assert {r: w["wait"] for r, w in waits.items()} == dict.fromkeys(ROLES, "passive")
    assert all(reason in w["why"] for w in waits.values()), waits


def test_auto_stays_passive_on_a_cluster_and_where_threads_exceed_the_cores():
    assert _waits(local=False, cores=0, threads=dict.fromkeys(ROLES, 0)) == dict.fromkeys(ROLES, "passive")
    # two rollout actors of two threads each on two cores take the cores from each other
    cfg = load_config(TINY, AUTO + ["rollout.num_actors=2"])
    assert _waits(cfg=cfg, threads={"rollout": 2, "learner": 2, "reference": 2})["rollout"] == "passive"
    assert _waits(cfg=cfg, threads={"rollout": 1, "learner": 2, "reference": 2})["rollout"] == "spin"
    assert _waits(["learner.world_size=2"], threads=dict.fromkeys(ROLES, 2))["learner"] == "passive"


def test_auto_stays_passive_for_gpu_roles_other_backends_and_a_reference_beside_a_reward_model():
    assert _waits(["learner.num_gpus=1"])["learner"] == "passive"
    cfg = load_config(TINY, AUTO)
    vllm = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, backend="vllm"))
    assert _waits(cfg=vllm) == {"rollout": "passive", "learner": "spin", "reference": "spin"}
    judged = dataclasses.replace(cfg, rewards=dataclasses.replace(
        cfg.rewards, functions=[*cfg.rewards.functions, dataclasses.replace(cfg.rewards.functions[0],
                                                                            name="reward_model")]))
    assert _waits(cfg=judged) == {"rollout": "spin", "learner": "spin", "reference": "passive"}


def test_a_wait_that_is_set_is_kept_everywhere():
    sets = ["rollout.cpu_wait='spin'", "learner.cpu_wait='passive'", "reference.cpu_wait='spin'"]
    for local in (True, False):
        waits = role_waits(load_config(TINY, sets + ["algo.max_staleness=1"]), local, 2, dict.fromkeys(ROLES, 2))
        assert [waits[r]["wait"] for r in ROLES] == ["spin", "passive", "spin"]
        assert waits["learner"]["why"] == "learner.cpu_wait = 'passive'"


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


def test_a_run_without_a_reference_actor_has_no_reference_wait():
    assert set(_waits(["algo.kl_coeff=0"])) == {"rollout", "learner"}
