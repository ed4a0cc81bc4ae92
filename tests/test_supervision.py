"""One owner for the rollout pool and one supervisor for every fault (cluster/run/stream.py, source.py, supervisor.py,
actors/ray_errors.py), without Ray processes:

- every kind of error Ray can raise into the driver ends the run at the step with the line to resume from its last
  checkpoint, never a traceback; the fault policy reads each kind once (a lost process, failed work, or neither);
- the supervisor counts failures in a row, replaces a process that is gone, and ends the run past the limit;
- the stream's pump is the one thread that calls its source, never under the stream's lock; a held-out evaluation
  and the driver's operations on the pool run there too; a pool owned by the pump refuses any other thread.

The whole-run check (an agent runner killed during a held-out evaluation at max_staleness = 2) is
tests/test_agents.py's staleness-2 run; a served endpoint that dies is replaced in tests/test_serve.py.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray.exceptions as E

from qgrpo.actors.ray_errors import cause_of, fault_of
from qgrpo.cluster.run.supervisor import RunFailed, StageTimeout, Supervisor

# Every error of Ray's the driver can meet, with what the fault policy makes of it: True, a lost process (replace it,
# send the work again); False, work that failed in a live process (count it, send it again); None, no one process's
# fault (the run ends at the step).
KINDS = {
    "ActorDiedError": (lambda: E.ActorDiedError(), True),
    "ActorUnavailableError": (lambda: E.ActorUnavailableError("the actor is restarting", b"\0" * 16), True),
    "WorkerCrashedError": (lambda: E.WorkerCrashedError(), True),
    "NodeDiedError": (lambda: E.NodeDiedError("node 10.0.0.2 died"), True),
    "OutOfMemoryError": (lambda: E.OutOfMemoryError("Task was killed due to the node running low on memory."), True),
    "RayTaskError": (lambda: E.RayTaskError("generate", "Traceback (most recent call last):\n  ...\nValueError: bad",
                                            ValueError("bad")), False),
    "ActorUnschedulableError": (lambda: E.ActorUnschedulableError("no node has 4 GPUs"), None),
    "GetTimeoutError": (lambda: E.GetTimeoutError("Get timed out: some object(s) not ready."), None),
    "ObjectLostError": (lambda: E.ObjectLostError("ab" * 14, "addr", "workers.py:1"), None),
    "OwnerDiedError": (lambda: E.OwnerDiedError("ab" * 14, "addr", "workers.py:1"), None),
    "ObjectFetchTimedOutError": (lambda: E.ObjectFetchTimedOutError("ab" * 14, "addr", "workers.py:1"), None),
    "ObjectStoreFullError": (lambda: E.ObjectStoreFullError("the object store is full"), None),
    "OutOfDiskError": (lambda: E.OutOfDiskError("the disk is full"), None),
    "TaskCancelledError": (lambda: E.TaskCancelledError(), None),
    "RuntimeEnvSetupError": (lambda: E.RuntimeEnvSetupError("pip failed"), None),
    "RaySystemError": (lambda: E.RaySystemError("GCS unreachable"), None),
    "LocalRayletDiedError": (lambda: E.LocalRayletDiedError(), None),
    "PendingCallsLimitExceeded": (lambda: E.PendingCallsLimitExceeded("too many calls queued"), None),
}


def test_the_list_of_kinds_names_every_error_ray_defines():
    """A new Ray error class is a new kind to decide on (or a class that cannot reach the driver, listed here)."""
    unreachable = {"RayError", "RayActorError", "ActorAlreadyExistsError", "ActorHandleNotFoundError",
                   "ActorPlacementGroupRemoved", "AsyncioActorExit", "AuthenticationError", "CrossLanguageError",
                   "ObjectFreedError", "ObjectReconstructionFailedError", "ObjectRefStreamEndOfStreamError",
                   "OufOfBandObjectRefSerializationException", "PlasmaObjectNotAvailable", "RayCgraphCapacityExceeded",
                   "RayChannelError", "RayChannelTimeoutError", "RayDirectTransportError",
                   "ReferenceCountingAssertionError", "RpcError", "StreamingGeneratorReplayInconsistentError",
                   "TaskPlacementGroupRemoved", "TaskUnschedulableError", "UnserializableException",
                   "UserCodeException"}
    defined = {n for n in dir(E) if isinstance(getattr(E, n), type) and issubclass(getattr(E, n), E.RayError)}
    assert defined - unreachable == set(KINDS)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_of_ray_error_is_read_once_and_named_in_one_line(kind):
    make, gone = KINDS[kind]
    err = make()
    fault = fault_of(err)
    assert (None if fault is None else fault.gone) == gone
    cause = cause_of(err)
    assert cause.startswith(kind) and "\n" not in cause and len(cause) <= len(kind) + 302
    if kind == "RayTaskError":  # a remote traceback: the exception raised there
        assert cause.endswith("ValueError: bad")


class _Run:
    """The driver's TrainingRun as far as the loop's fault handling needs it: its first step raises `error`."""

    error: BaseException

    def __init__(self, cfg, run_dir, *args):
        from qgrpo.core.storage import RunDir

        self.cfg, self.dir = cfg, RunDir.of(run_dir)
        self.state, self.eval_task, self.evals, self.baseline = SimpleNamespace(step=1), None, {}, None
        self.workers = None
        self.written: list[dict] = []
        self.log = SimpleNamespace(write=self.written.append)
        self.samples = SimpleNamespace(flush=lambda: None)
        self.closed = None

    def scale(self, step):
        pass

    def close(self, failing, stopping=False):
        self.closed = failing


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_any_ray_error_ends_the_run_at_the_step_with_how_to_resume(kind, tmp_path, monkeypatch):
    """Raised where a step's rollouts are taken (the pump's errors surface there) or by any call of the step."""
    from qgrpo.cluster.config.schema import load_config
    from qgrpo.cluster.run import driver

    (tmp_path / "checkpoints" / "step_000001").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000001" / "trainer_state.json").write_text("{}")
    runs: list[_Run] = []

    class Run(_Run):
        def __init__(self, *args):
            super().__init__(*args)
            runs.append(self)

    Run.failed = driver.TrainingRun.failed

    def step_data(run, step, clock):
        raise KINDS[kind][0]()

    monkeypatch.setattr(driver, "TrainingRun", Run)
    monkeypatch.setattr(driver, "step_data", step_data)
    cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"), ["run.steps=3"])
    with pytest.raises(RunFailed) as got:
        driver.train(cfg, tmp_path, "unused")
    text = str(got.value)
    assert f"step 2: {kind}" in text and "the run stopped at step 2" in text
    assert f"--resume {tmp_path}" in text and "step_000001" in text and "Traceback" not in text
    assert runs[0].closed is True and runs[0].written[-1]["event"] == "failed"


def test_the_supervisor_replaces_a_lost_process_resends_and_ends_the_run_past_the_limit():
    events: list[dict] = []
    sup = Supervisor(2, events)
    replaced: list[str] = []

    def settle(err):
        def get():
            if err is not None:
                raise err
            return "answer"
        return sup.settle(0, get, name="rollout actor torch-0", stage="generate at step 3",
                          event="rollout_actor_failed", replace=replaced.append, prompt_ids=["p1"])

    assert settle(KINDS["ActorDiedError"][0]()) == (False, None) and len(replaced) == 1  # replaced, resent
    assert settle(KINDS["RayTaskError"][0]()) == (False, None) and len(replaced) == 1  # counted, kept
    assert sup.failing(0) and [e["failures_in_a_row"] for e in events] == [1, 2]
    assert settle(None) == (True, "answer") and not sup.failing(0)  # an answer: the count starts again
    settle(KINDS["ActorDiedError"][0]())
    settle(KINDS["ActorDiedError"][0]())
    with pytest.raises(RunFailed, match=r"generate at step 3: rollout actor torch-0 failed 3 times in a row "
                                        r"\(faults.max_replacements = 2\); last cause: ActorDiedError.*prompts p1"):
        settle(KINDS["ActorDiedError"][0]())
    with pytest.raises(E.ObjectStoreFullError):  # no one process's fault: not counted, raised
        settle(KINDS["ObjectStoreFullError"][0]())
    with pytest.raises(StageTimeout, match=r"generate at step 3: no result within 10 s \(torch-0 held p1\); raise "
                                           "faults.generate_timeout_s"):
        sup.overdue(["torch-0 held p1"], 10, "generate at step 3", "faults.generate_timeout_s")


class _Source:
    """A rollout source that records, for every call, the thread and whether the stream's lock was held."""

    def __init__(self, lock_of):
        self.lock_of, self.calls, self.owner = lock_of, [], None
        self.waits = 0

    def _note(self, name):
        self.calls.append((name, threading.get_ident(), self.lock_of()._is_owned()))

    def own(self, owner):
        self.owner = owner

    def split(self, items):
        return [items[i:i + 2] for i in range(0, len(items), 2)]

    def free_slots(self, busy):
        return [s for s in range(2) if s not in busy]

    def submit(self, slot, items, sampling, step, held_out=False):
        from qgrpo.cluster.run.source import Call

        self._note("submit")
        return Call(items, slot, tuple(str(i) for i in items), step, time.monotonic(), 60.0, held_out)

    def wait(self, calls, timeout):
        self._note("wait")
        return list(calls)

    def collect(self, call):
        from qgrpo.cluster.run.source import ChunkResult
        from qgrpo.core.records import GenerationStats

        self._note("collect")
        self.waits += 1
        if self.waits == 2:  # the second chunk's process failed once: sent again
            return None
        tag = "eval" if call.held_out else f"s{call.step}"
        return ChunkResult([SimpleNamespace(tag=f"{tag}:{i}", policy_version=0) for i in call.ref],
                           GenerationStats("fake", 0.0, 1, 0))

    def overdue(self, calls):
        self._note("overdue")

    def announce(self):
        return []

    def close(self):
        pass


def test_the_pump_is_the_one_thread_that_calls_the_source_and_never_under_the_streams_lock():
    from qgrpo.cluster.run.stream import RolloutStream
    from qgrpo.core.records import SamplingParams
    from qgrpo.learner.objective.staleness import admission
    from tests.helpers import CountingSampler

    ro = SimpleNamespace(prompts_per_step=4, group_size=1, max_new_tokens=2, temperature=1.0, top_p=1.0, top_k=0)
    holder: dict = {}
    def lock():
        while "stream" not in holder:  # the pump starts inside the constructor
            time.sleep(0.001)
        return holder["stream"].cv

    source = _Source(lock)
    stream = holder["stream"] = RolloutStream(source, CountingSampler(), ro, seed=0, rule=admission(2, 1),
                                              start_step=0, published=0, steps=3)
    try:
        first = stream.take(0)
        held_out = stream.evaluate(["a", "b", "c"], SamplingParams(1, 2, 0.0))
        pump = stream.on_pump(threading.get_ident)  # the driver's operations run on the pump
        assert source.owner == pump and pump != threading.get_ident()
        rest = [stream.take(s) for s in (1, 2)]
    finally:
        stream.close()
    assert [g.tag for g in first.groups] == ["s1:0", "s1:1", "s1:2", "s1:3"]  # the failed chunk sent again
    assert [g.tag for g in held_out] == ["eval:a", "eval:b", "eval:c"]
    assert [r.groups[0].tag for r in rest] == ["s2:4", "s3:8"]
    assert {t for _, t, _ in source.calls} == {pump}
    assert not any(locked for _, _, locked in source.calls)
    assert source.owner is None  # closed: the pool is any thread's again


def test_a_pool_owned_by_the_pump_refuses_another_thread():
    from qgrpo.cluster.run.workers import RolloutPool

    pool = RolloutPool.__new__(RolloutPool)  # no actors: only the guard is under test
    pool.owner = None
    pool.own(threading.get_ident() + 1)
    for call in (lambda: pool.submit(0, [], None, 1), lambda: pool.load(None, 1.0), lambda: pool.resize(2),
                 lambda: pool.set_precision("int8"), lambda: pool.take_reports({}, "x")):
        with pytest.raises(RuntimeError, match="the rollout stream's pump owns the pool: run it through the "
                                               "supply's on_pump"):
            call()
