"""The actors of one job and the few operations the driver needs from them. Knows nothing of any backend: the
rollout backend is a name, and the arguments its generator takes are what its spec gives (rollout/backends:
BackendSpec.generator_options), handed to the rollout actors.

Faults: every call to an actor has a deadline (`faults.*_timeout_s`, `sync.timeout_s` for the two halves of a sync
together) and raises StageTimeout naming the stage and the actors instead of hanging. A rollout actor that dies is
replaced (the replacement loads the last published weights before it serves) and the prompts it had not returned
are generated again by a live actor; `faults.max_replacements` failures in a row end the run. A learner or reference
failure ends the run (RunFailed), leaving the last complete checkpoint to resume from.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time

import ray
import torch

from qgrpo.actors.collective import CollectiveGroup
from qgrpo.actors.common import END_WAIT_S, end_actors, thread_env
from qgrpo.actors.ray_errors import cause_of
from qgrpo.actors.reference_actor import ReferenceActor
from qgrpo.actors.rollout_actor import RolloutActor
from qgrpo.actors.weights import WeightUpdate
from qgrpo.cluster.config.plan import RAY_BUILTIN_RESOURCES, RoleRequest, infeasible, role_requests
from qgrpo.cluster.config.schema import Config
from qgrpo.cluster.run.cpu_waits import role_threads, role_waits
from qgrpo.cluster.run.learners import start_learner_ranks
from qgrpo.cluster.run.placement import wait_scheduled
from qgrpo.cluster.run.source import Call, ChunkResult
from qgrpo.cluster.run.supervisor import RunFailed, StageTimeout, Supervisor, gather
from qgrpo.core.cpu import CPU_WAITS
from qgrpo.core.devices import role_env
from qgrpo.core.records import (
    PromptItem,
    SamplingParams,
    SyncAck,
    TrainStepResult,
    WeightSync,
)
from qgrpo.learner.batch import TrainBatch
from qgrpo.rollout.backends import REGISTRY
from qgrpo.rollout.episodes import episode_setup
from qgrpo.rollout.modeling.models import BUILTIN_PREFIX, hub_cache_folder
from qgrpo.rollout.noise import NormNoise


def split_prompts(items: list, n: int) -> list[list]:
    """Near-equal contiguous chunks, one per actor, empty ones left out (whole prompts: a group never spans
    generators)."""
    k, r = divmod(len(items), n)
    out, i = [], 0
    for a in range(n):
        j = i + k + (a < r)
        out.append(items[i:j])
        i = j
    return [c for c in out if c]


def generator_kwargs(cfg: Config, model_path: str, precision: str, generator_id: str, version: int) -> dict:
    """The keyword arguments of a rollout actor's generator (`make_generator`): a pool's, and a precision trial's
    (cluster/run/precision_auto.py), so that a trial times the generator the run will use."""
    ro = cfg.rollout
    return dict(model_path=model_path, precision=precision, group_size_quant=ro.group_size_quant,
                generator_id=generator_id, seed=cfg.run.seed, initial_version=version,
                chat_template=cfg.task.chat_template,
                **REGISTRY[ro.backend].generator_options(
                    ro, cfg.compute_dtype_of("rollout"),
                    adapter_rank=cfg.learner.lora.rank if cfg.sync.adapters_only else 0))


class _Refused(Exception):
    """An actor that is alive refused a weight update."""


def _loaded(ref):
    """A load's ack; an error of the load itself (not of the process) as _Refused."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        raise _Refused(cause_of(e)) from None


def _owned(method):
    """A pool method only its owner may call: the rollout stream's pump once the stream is open (RolloutPool.own)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self.owner is not None and self.owner != threading.get_ident():
            raise RuntimeError(f"RolloutPool.{method.__name__} called from thread {threading.current_thread().name} "
                               "while the rollout stream's pump owns the pool: run it through the supply's on_pump")
        return method(self, *args, **kwargs)
    return call


class RolloutPool:
    """The rollout actors, replaced when they die, moved up the precision ladder on request. One thread calls it:
    the driver's until the rollout stream opens, then the stream's pump (`own`), which runs the driver's operations
    (sync, resize, precision) as jobs of its own."""

    def __init__(self, cfg: Config, policy_path: str, policy_version: int, precision: str, request: RoleRequest,
                 threads: int, cores: int = 0, wait: str = ""):
        """`threads` per actor (0: the CPUs Ray gives each); `cores`: the machine's cores when every actor shares the
        driver's machine (local mode: threads follow the number of actors as it scales), else 0. `wait`: the actors'
        OpenMP wait (cluster/run/cpu_waits.py); "": rollout.cpu_wait where it names one, else passive."""
        self.cfg, self.policy_path, self.policy_version, self.precision = cfg, policy_path, policy_version, precision
        self.request, self.threads, self.cores = request, threads, cores
        self.cpu_wait = wait or (cfg.rollout.cpu_wait if cfg.rollout.cpu_wait in CPU_WAITS else "passive")
        self.owner: int | None = None  # the one thread that may call it (None: any; the driver's before the stream)
        self.last_update: WeightUpdate | None = None  # what every actor has loaded (replacements load it too)
        self.spawned = [0] * cfg.rollout.num_actors  # actors created per slot
        self.events: list[dict] = []  # for the run log (take_events)
        self.supervisor = Supervisor(cfg.faults.max_replacements, self.events)  # failures in a row per slot
        self.watchers: list = []  # called with a new link whenever the actors change (`watch`)
        # sync.transport = "collective": the broadcast group (its members, formed again when the actors change).
        self.group = CollectiveGroup(lambda calls, seconds, stage: gather(calls, seconds, stage, "sync.timeout_s")) \
            if cfg.sync.transport == "collective" else None
        # [environment]: multi-turn rollouts; each actor starts its own environment workers (rollout/episodes.py)
        self.episodes = episode_setup(cfg.environment, cfg.rollout.max_new_tokens)
        self.actors = [self._spawn(i) for i in range(cfg.rollout.num_actors)]

    def own(self, owner: int | None) -> None:
        """From now on only thread `owner` calls the pool (None: any)."""
        self.owner = owner

    @property
    def size(self) -> int:
        """The rollout actors the pool has now."""
        return len(self.actors)

    def name(self, slot: int) -> str:
        k = self.spawned[slot] - 1
        return f"{self.cfg.rollout.backend}-{slot}" + (f".{k}" if k else "")

    def _spawn(self, slot: int):
        ro = self.cfg.rollout
        if self.group is not None and self.last_update is None:  # a collective sync leaves it to learner rank 0
            self.last_update = self.group.last_published(self.cfg.sync.timeout_s)
        self.spawned[slot] += 1
        return RolloutActor.options(**self.request.actor_options(),
                                    runtime_env={"env_vars": {**thread_env(self.threads, self.cpu_wait),
                                                              **role_env(self.request.gpus)}}).remote(
            ro.backend, generator_kwargs(self.cfg, self.policy_path, self.precision, self.name(slot),
                                         self.policy_version),
            self.threads, self.last_update, self.cfg.sync.requantize, self.cfg.sync.visibility,
            NormNoise(ro.norm_noise, ro.norm_noise_end, ro.norm_noise_stages,
                      horizon=self.cfg.run.steps * self.cfg.algo.updates_per_batch),
            self.episodes,
        )

    def _replace(self, slot: int, stage: str) -> None:
        """A new actor at `slot` (its process is gone); it loads the last published weights before it serves."""
        name = self.name(slot)
        ray.kill(self.actors[slot], no_restart=True)
        self.actors[slot] = self._spawn(slot)
        self.events.append({"event": "rollout_actor_replaced", "stage": stage, "actor": name,
                            "replacement": self.name(slot), "weights_version": self.version()})
        self._changed()

    def _settle(self, slot: int, get, stage: str, prompt_ids: list[str], work: bool = True) -> tuple[bool, object]:
        """The supervisor's policy on one call to the actor at `slot` (cluster/run/supervisor.py); `work`: a
        generation (its answer starts the actor's failures in a row again)."""
        return self.supervisor.settle(slot, get, name=f"rollout actor {self.name(slot)}", stage=stage,
                                      event="rollout_actor_failed", replace=lambda _: self._replace(slot, stage),
                                      work=work, prompt_ids=prompt_ids)

    @_owned
    def take_reports(self, reports: dict, stage: str) -> None:
        """What a PoolLink reported (`PoolLink.take_reports`, fetched by the process holding the link's user): the
        slots that answered start their failures in a row again; a failure of the actor the pool holds at that slot
        is counted, and a dead one replaced (a report about an actor already replaced is old news). A hung call
        raises StageTimeout, as a hung generate does."""
        from qgrpo.actors.pool_link import actor_id

        for slot in reports["served"]:
            if slot < len(self.actors):
                self.supervisor.served(slot)
        for f in reports["failures"]:
            slot = f["slot"]
            if f["hung"]:
                self.supervisor.overdue([f"{self.name(slot)} {f['cause']}"], self.cfg.faults.generate_timeout_s,
                                        stage, "faults.generate_timeout_s")
            if slot < len(self.actors) and actor_id(self.actors[slot]) == f["actor_id"]:
                self.supervisor.failed(slot, f"rollout actor {self.name(slot)}", f["cause"], stage,
                                       "rollout_actor_failed", prompt_ids=[])
                if f["dead"]:
                    self._replace(slot, stage)

    def take_events(self) -> list[dict]:
        """The events since the last take (failures, replacements), for the run log."""
        n = len(self.events)  # the pump may append meanwhile: those stay for the next take
        out = self.events[:n]
        del self.events[:n]
        return out

    def watch(self, fn) -> None:
        """`fn(link)` is called with a new link (`link()`) each time the actors change (a replacement, a resize, the
        precision ladder): how a process that calls them through a PoolLink (the endpoint) learns of the new ones."""
        self.watchers.append(fn)

    def _changed(self) -> None:
        for fn in self.watchers:
            fn(self.link())

    def link(self):
        """The pool as another process calls it (actors/pool_link.py): the actors as they are now, the generation
        deadline; failures come back to `take_reports` through the process that holds the link."""
        from qgrpo.actors.pool_link import PoolLink

        return PoolLink(self.actors, self.cfg.faults.generate_timeout_s)

    def announce(self) -> list[tuple[dict, str]]:
        """Nothing to say at the start of a run (an agent source says where its endpoint is)."""
        return []

    def close(self) -> None:
        """Nothing: the actors are the workers' to end (Workers.shutdown)."""

    def version(self) -> int:
        """The policy version the actors hold (the last published one)."""
        return self.last_update.version if self.last_update is not None else self.policy_version

    # --- the rollout source (cluster/run/source.py), for the stream ---
    def split(self, items: list[PromptItem]) -> list[list[PromptItem]]:
        """A step's prompts as chunks, one per actor the pool has now."""
        return split_prompts(items, len(self.actors))

    def free_slots(self, busy: set[int]) -> list[int]:
        """The actors with no call in flight (`busy`: those with one), the ones that have not just failed first."""
        free = [s for s in range(len(self.actors)) if s not in busy]
        return sorted(free, key=self.supervisor.failing)

    @_owned
    def submit(self, slot: int, items: list[PromptItem], sampling: SamplingParams, step: int,
               held_out: bool = False) -> Call:
        """Send one chunk to the actor at `slot`; returns at once. A held-out chunk is the generators' step 0 (the
        drills of core/faults.py fire in training steps only)."""
        ref = self.actors[slot].generate.remote(items, sampling, 0 if held_out else step)
        return Call(ref, slot, tuple(i.prompt_id for i in items), step, time.monotonic(),
                    self.cfg.faults.generate_timeout_s, held_out)

    @_owned
    def wait(self, calls: list[Call], timeout: float) -> list[Call]:
        """The calls of `calls` that are done, waiting up to `timeout` seconds for the first."""
        by_ref = {c.ref: c for c in calls}
        ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=max(timeout, 0.0)) if calls else ([], [])
        return [by_ref[r] for r in ready]

    @_owned
    def collect(self, call: Call) -> ChunkResult | None:
        """A finished call's groups and stats; None where its actor failed: the failure is counted (and logged),
        a dead actor replaced, and the caller sends the chunk again. Too many failures in a row raise RunFailed."""
        stage = "held-out generation" if call.held_out else f"generate at step {call.step}"
        ok, out = self._settle(call.slot, lambda: ray.get(call.ref), stage, list(call.prompt_ids))
        return ChunkResult(*out) if ok else None

    @_owned
    def overdue(self, calls: list[Call]) -> None:
        """Raise StageTimeout if a call has run past its deadline (faults.generate_timeout_s) since it was sent."""
        now = time.monotonic()
        late = [c for c in calls if now - c.sent > c.deadline_s]
        if late:
            self.supervisor.overdue([f"{self.name(c.slot)} held {', '.join(c.prompt_ids)}" for c in late],
                                    late[0].deadline_s, f"generate at step {late[0].step}", "faults.generate_timeout_s")

    # --- the driver's operations (on the pump once the stream is open) ---
    @_owned
    def load(self, update: WeightUpdate, seconds: float) -> list[SyncAck]:
        """Every actor loads `update` within `seconds`; an actor lost meanwhile is replaced (and loads it)."""
        self.last_update = update
        pending = {a.load_weights.remote(update): i for i, a in enumerate(self.actors)}
        deadline, acks = time.monotonic() + seconds, []
        stage = f"weight sync to version {update.version}"
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                raise StageTimeout(f"weight sync: {', '.join(self.name(s) for s in pending.values())} did not load "
                                   f"version {update.version} within the sync budget (sync.timeout_s)")
            slot = pending.pop(ready[0])
            try:
                ok, ack = self._settle(slot, functools.partial(_loaded, ready[0]), stage, [], work=False)
            except _Refused as e:  # not a lost process: the update itself is refused (a fingerprint, a bad tensor)
                raise RunFailed(f"weight sync: {self.name(slot)} could not load version {update.version} "
                                f"({e})") from None
            if ok:
                acks.append(ack)
            else:  # a lost actor was replaced, and its replacement loaded the update as it started
                pending[self.actors[slot].last_load.remote()] = slot
        return acks

    @_owned
    def load_collective(self, learners: list, bucket_bytes: int, seconds: float
                        ) -> tuple[WeightUpdate, list[SyncAck]]:
        """Learner rank 0 broadcasts to every actor (the group formed again first if the actors changed). An actor
        lost meanwhile fails the sync (RunFailed, within `seconds`): a broadcast cannot go on without a member."""
        self.last_update = None  # rank 0 keeps the published buckets; `_spawn` fetches them for a new actor
        return self.group.sync(learners, self.actors, [self.name(s) for s in range(len(self.actors))], bucket_bytes,
                               seconds)

    @_owned
    def set_precision(self, precision: str) -> None:
        """Every actor restarts at `precision` with the last published weights (the precision ladder). The old ones
        release their engines first (best effort, within the generation deadline); a new engine on the same GPU
        also waits at start for the memory to be free (rollout/backends/vllm_backend.py)."""
        closing = [a.close.remote() for a in self.actors]
        ray.wait(closing, num_returns=len(closing), timeout=self.cfg.faults.generate_timeout_s)
        for a in self.actors:
            ray.kill(a)
        self.precision = precision
        self.actors = [self._spawn(i) for i in range(len(self.actors))]
        gather({a.info.remote(): self.name(i) for i, a in enumerate(self.actors)},
               self.cfg.faults.generate_timeout_s, f"restarting the rollout actors at {precision}",
               "faults.generate_timeout_s")
        self._changed()

    @_owned
    def info(self) -> list[dict]:
        return ray.get([a.info.remote() for a in self.actors])

    def starting(self) -> list:
        """One ref per actor that resolves once it serves (its info): for a caller that waits its own way."""
        return [a.info.remote() for a in self.actors]

    def wait_started(self, actors: list | None = None) -> list[dict]:
        """Wait (with the scheduling deadline and a message while the cluster is busy) until `actors` (all: None)
        serve."""
        actors = self.actors if actors is None else actors
        calls = {a.info.remote(): f"rollout actor {self.name(self.actors.index(a))}" for a in actors}
        wait_scheduled(calls, self.cfg.faults.schedule_timeout_s, "starting the rollout actors")
        return ray.get(list(calls))

    @_owned
    def resize(self, n: int) -> dict:
        """Add or remove rollout actors (between steps: nothing is in flight, so no prompt is dropped). New actors
        load the last published weights before they serve. Returns an event for the run log."""
        old = len(self.actors)
        event: dict = {"event": "scale", "role": "rollout", "from": old, "to": n}
        if n > old:
            problems = infeasible([dataclasses.replace(self.request, count=n)], ray.nodes())
            if problems:  # refused, not fatal: the run goes on with the actors it has
                return {**event, "to": old, "refused": problems[0]}
            self.spawned += [0] * max(n - len(self.spawned), 0)
            new = [self._spawn(i) for i in range(old, n)]
            self.actors += new
            try:
                event["started"] = self.wait_started(new)
            except (TimeoutError, ray.exceptions.RayError) as e:
                for a in new:
                    ray.kill(a)
                del self.actors[old:]
                return {**event, "to": old, "refused": cause_of(e)}
        else:
            for a in self.actors[n:]:
                ray.kill(a)
            del self.actors[n:]
        for slot in range(n, old):
            self.supervisor.in_a_row.pop(slot, None)
        if self.cores:  # local mode: the actors share this machine's cores
            self.threads = max(1, self.cores // n)
            ray.get([a.set_threads.remote(self.threads) for a in self.actors])
        self._changed()
        return event

    def end(self, wait_s: float) -> None:
        """End the actors (each exits by itself within `wait_s`, else is killed)."""
        end_actors(list(self.actors), wait_s)


class Workers:
    def __init__(self, cfg: Config, policy_path: str, reference_path: str, policy_version: int = 0,
                 rollout_precision: str | None = None, reference_precision: str | None = None):
        ro, le, ref = cfg.rollout, cfg.learner, cfg.reference
        self.cfg = cfg
        if le.mode != "full":  # an adapter checkpoint holds no model: every role starts from the base; the learner's
            policy_path = reference_path  # adapters, and the generators' merged weights, come with load()
        # A builtin model is materialised, and a Hub id found in the Hugging Face cache, by each actor on its own node
        # (the driver's caches are not on the others).
        builtin = (cfg.model.path.startswith(BUILTIN_PREFIX) and not cfg.model.cache_dir
                   or hub_cache_folder(cfg.model.path) is not None)
        policy_path = cfg.model.path if builtin and policy_path == reference_path else policy_path
        reference_path = cfg.model.path if builtin else reference_path
        self.reference_path = reference_path
        requests = {r.role: r for r in role_requests(cfg)}
        problems = infeasible(list(requests.values()), ray.nodes())
        if problems:
            raise Unplaceable(problems)
        # Threads: on one machine (local mode) the actors share the driver's cores; on a cluster each actor uses the
        # CPUs Ray gave it (threads = 0 resolves inside the actor), not the driver's machine's count.
        cores = (os.cpu_count() or 1) if _single_node() else 0
        self.cores = cores
        rollout_threads = ro.threads or cores // ro.num_actors
        # Each CPU role's OpenMP wait: spinning where the roles take turns on one machine (cluster/run/cpu_waits.py)
        self.waits = role_waits(cfg, bool(cores), cores, role_threads(cfg, cores))
        self.rollout = RolloutPool(cfg, policy_path, policy_version, rollout_precision or ro.precision,
                                   requests["rollout"], rollout_threads, cores if not ro.threads else 0,
                                   self.waits["rollout"]["wait"])
        # Rollout actors on a share of a GPU start alone: vLLM sizes its KV cache from the GPU memory it sees in use
        # while it profiles, and a learner or reference loading onto the same GPU meanwhile would skew that.
        shared_gpu = 0 < ro.num_gpus < 1
        started = self.rollout.wait_started() if shared_gpu else None
        self.reference_precision = reference_precision or ref.precision
        self.reference_request = requests.get("reference")
        self.reference = self._reference() if cfg.reference_actor else None
        self.learner_group, self.learners, setups = start_learner_ranks(cfg, policy_path, requests["learner"], cores,
                                                                           self.waits["learner"]["wait"])
        # Surface construction errors (bad model folder, DeepSpeed failure) here rather than at the first step.
        started = started or self.rollout.wait_started()
        self.placed = {"learner": ray.get(setups), "rollout": [{"actor": i["generator_id"], "node_id": i["node_id"]}
                                                               for i in started]}
        if self.reference is not None:
            node = self.reference.node.remote()
            wait_scheduled({node: "the reference actor"}, cfg.faults.schedule_timeout_s, "starting the reference actor")
            self.placed["reference"] = [{"node_id": ray.get(node)}]

    def _reference(self):
        threads = self.cfg.reference.threads or self.cores  # 0 on a cluster: the CPUs it was given
        return ReferenceActor.options(**self.reference_request.actor_options(),
                                      runtime_env={"env_vars": {**thread_env(threads, self.waits["reference"]["wait"]),
                                                                **role_env(self.reference_request.gpus)}}).remote(
            self.reference_path, self.reference_precision, self.cfg.rollout.group_size_quant, threads,
            self.cfg.reference.backend, self.cfg.compute_dtype_of("reference"))

    def set_reference_precision(self, precision: str) -> None:
        ray.kill(self.reference)
        self.reference_precision = precision
        self.reference = self._reference()

    # ------------------------------------------------------------------ the driver's operations

    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        rows = (batch.prompt_lens, batch.group_ids, batch.seq_lens) if self.cfg.learner.shared_prompt else ()
        ref = self.reference.score.remote(batch.input_ids, self.cfg.rollout.temperature, *rows)
        return gather({ref: "the reference actor"}, self.cfg.faults.reference_timeout_s, "reference scoring",
                      "faults.reference_timeout_s")[ref]

    def learn(self, batch: TrainBatch, step: int = 0) -> list[TrainStepResult]:
        """One learner step: every rank trains on its shard of `batch`; results in rank order."""
        n = len(self.learners)
        calls = {a.train_step.remote(batch.shard(r, n), step): f"learner rank {r}" for r, a in enumerate(self.learners)}
        out = gather(calls, self.cfg.faults.learn_timeout_s, f"learner step {step}", "faults.learn_timeout_s")
        return [out[ref] for ref in calls]

    def sync_weights(self) -> WeightSync:
        """One versioned transfer from learner rank 0 to every rollout actor; export and load share one deadline."""
        budget, t0 = self.cfg.sync.timeout_s, time.monotonic()
        bucket_bytes = int(self.cfg.sync.bucket_mb * 2**20)
        if self.cfg.sync.transport == "collective":
            update, acks = self.rollout.load_collective(self.learners, bucket_bytes, budget)
        else:
            adapters = self.cfg.sync.adapters_only  # the LoRA adapters alone (the generators keep their base)
            calls = {a.publish_weights.remote(bucket_bytes, "object_store", adapters): f"learner rank {r}"
                     for r, a in enumerate(self.learners)}
            out = gather(calls, budget, "weight export", "sync.timeout_s")
            update = out[next(iter(calls))]
            acks = self.rollout.load(update, budget - (time.monotonic() - t0))
        bad = [f"{a.generator_id}: {a.version}" for a in acks if a.version != update.version]
        if bad:
            raise RunFailed(f"rollout actors report versions {bad} after syncing version {update.version}")
        return WeightSync.of(update.version, update.nbytes, update.num_buckets, time.monotonic() - t0,
                             update.export_seconds, acks)

    def events(self) -> list[dict]:
        return self.rollout.take_events()

    def rollout_info(self) -> list[dict]:
        return self.rollout.info()

    def save(self, out_dir: str) -> None:
        calls = {a.save.remote(out_dir): f"learner rank {r}" for r, a in enumerate(self.learners)}
        gather(calls, self.cfg.faults.learn_timeout_s, "checkpoint save", "faults.learn_timeout_s")

    def load(self, ckpt_dir: str, version: int) -> None:
        calls = {a.load.remote(ckpt_dir, version): f"learner rank {r}" for r, a in enumerate(self.learners)}
        gather(calls, self.cfg.faults.learn_timeout_s, "loading the checkpoint", "faults.learn_timeout_s")
        if self.cfg.learner.mode != "full":  # the generators started from the base: give them the checkpoint's model
            self.sync_weights()

    def placement(self) -> dict:
        """Where each role's actors run: node ids, with each node's custom resources and labels (for the run log)."""
        nodes = {n["NodeID"]: n for n in ray.nodes()}

        def where(node_id: str) -> dict:
            n = nodes.get(node_id, {})
            custom = sorted(k for k in n.get("Resources", {}) if k not in RAY_BUILTIN_RESOURCES and ":" not in k)
            labels = {k: v for k, v in n.get("Labels", {}).items() if not k.startswith("ray.io/")}
            return {"node_id": node_id, "address": n.get("NodeManagerAddress"), "resources": custom, "labels": labels}

        return {role: [{**{k: v for k, v in a.items() if k != "node_id"}, **where(a["node_id"])} for a in actors]
                for role, actors in self.placed.items()}

    def shutdown(self, remove_group: bool = True) -> None:  # False: left to the job's end (driver.TrainingRun.close)
        end_actors(self.rollout.actors + self.learners + ([self.reference] if self.reference else []),
                   END_WAIT_S if remove_group else 0)  # a clean end: they exit by themselves; a signal: killed now
        if remove_group:
            ray.util.remove_placement_group(self.learner_group)


def _single_node() -> bool:
    """Every actor runs on the driver's machine (local mode, or a one-node cluster started on it)."""
    alive = [n for n in ray.nodes() if n["Alive"]]
    return len(alive) == 1 and alive[0]["NodeID"] == ray.get_runtime_context().get_node_id()


class Unplaceable(RunFailed):
    """A role asks for resources no node of the cluster has: refused before any actor starts."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("the cluster can never place these actors:\n" + "\n".join(f"  - {p}" for p in problems))
