"""Agent programs as a source of the rollout stream (cluster/run/stream.py): each row of a step is played as G
episodes by the user's agent (rollout/agents/, in actors/agent_runner.py) against the run's endpoint
(actors/endpoint_actor.py), which sends every call through the rollout pool's link (actors/pool_link.py); each episode
is one session, its calls stitched by exact tokens into the row trained on.

`AgentEpisodes` has the rollout pool's dispatch (split, free_slots, submit, wait, collect, overdue, generate), so one
stream, one admission pump and one staleness rule serve both kinds of rollout: a step's sessions open when the rule
admits the step, never by discarding finished episodes. A chunk is one row's G episodes (rollout.group_size), at most
environment.concurrency episodes at once in the runner, each within environment.episode_timeout_s. A sync that lands
during a call is applied between two decode steps (the call's answer spans both versions).

What survives which death (docs/agents.md, "When a process dies"):
- a rollout actor: the pool counts it and replaces it (faults.max_replacements in a row end the run); the endpoint's
  calls waiting on it go to the replacement (same weights): the episodes go on and lose nothing.
- the endpoint actor: its sessions are gone. A new endpoint starts (RUN_DIR/endpoint.json rewritten), and the
  episodes in flight are played again from their start, in new sessions (counted: agent/replayed_episodes).
- the agent runner: replaced; its episodes in flight are played again from their start (counted the same way).
- an agent that blocks the runner's event loop past twice its deadline: the runner is replaced and those episodes
  fail with that cause (environment.on_error), since they would block again.
Deaths of the endpoint or the runner past faults.max_replacements in a row end the run at the step with how to
resume. A failed episode follows environment.on_error (rollout/agents/contract.py).

Per step the chunks report agent/* metrics: calls, forks, the branches beside the main one (counted, not trained),
tool calls, tool-call parse failures, failed and replayed episodes, calls cut or capped by max_tokens, calls that
offered tools, with the rollout precision in the metric's name for the two tool figures, so a format that breaks
tool calling shows in the run's curves and warnings.
"""
from __future__ import annotations

import itertools
import json
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from qgrpo.actors.ray_errors import fault_of
from qgrpo.cluster.config.turns import agent_call_cap, agent_call_default
from qgrpo.cluster.run.source import Call, ChunkResult
from qgrpo.cluster.run.supervisor import RunFailed, Supervisor, get_within
from qgrpo.core import faults
from qgrpo.core.records import GenerationStats, PromptItem, SamplingParams

ENDPOINT_FILE = "endpoint.json"  # RUN_DIR/endpoint.json: the run's endpoint address, model name, how to reach it
REPORTS_S = 5.0  # the endpoint's long poll of failures
CALL_S = 120.0  # a call to the endpoint actor (open or close sessions, push a link): past it, the endpoint is hung
START_S = {"endpoint": 300.0, "runner": 120.0}  # to start each (the agent's file loads in the runner)
BLOCKED = ("the agent runner did not answer within twice environment.episode_timeout_s: an agent blocked its event "
           "loop (a blocking call inside async code: use the async client, or a plain def, which runs on a thread)")
STATS = ("calls", "forks", "branches", "tool_calls", "tool_parse_failures", "model_tokens", "cut_calls",
         "capped_calls", "tool_offers")
NAMES = {"endpoint": "the endpoint actor", "runner": "the agent runner"}


def _here():
    """On the driver's node: the agent runner reaches the endpoint there (environment.endpoint_host, 127.0.0.1 by
    default); the rollout actors behind it may be anywhere in the cluster."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
            "runtime_env": {"env_vars": faults.env()}}


@dataclass(eq=False)
class EpisodeCall(Call):
    """One chunk's episodes in flight in the runner (AgentEpisodes.submit)."""

    items: list = field(default_factory=list)
    sids: list[str] = field(default_factory=list)
    runner: str = ""  # the runner's actor id, and the endpoint's generation, when the chunk was sent
    endpoint: int = 0


class AgentEpisodes:
    """The episodes of the agent environment.name names, a rollout source (cluster/run/source.py). `pool`: the
    rollout actors (RolloutPool); `run_dir`: where endpoint.json goes."""

    def __init__(self, cfg, pool, run_dir: Path | None = None):
        from qgrpo.rollout.environments.loader import environment_spec

        env, ro = cfg.environment, cfg.rollout
        self.cfg, self.pool, self.run_dir = cfg, pool, run_dir
        self.spec = environment_spec(env.name, env.params)
        self.model = env.served_model
        self.key = secrets.token_urlsafe(32)  # every call must carry it (the agent's client has it as its API key)
        self.limits = {"max_calls": env.max_turns, "max_context": env.max_context, "max_tokens": agent_call_cap(cfg)}
        self.defaults = {"temperature": ro.temperature, "top_p": ro.top_p, "top_k": ro.top_k}
        self.episodes: dict[int, int] = {}  # id of a call in flight -> its episodes (environment.concurrency bounds)
        self.supervisor = Supervisor(cfg.faults.max_replacements, pool.events)  # the endpoint's and the runner's
        self.generation = 0  # endpoints started
        self.replayed: dict[str, int] = {}  # prompt id -> its episodes played again (not yet reported)
        self.blocked: set[str] = set()  # runners replaced for blocking: their chunks fail, not replay
        self.watch_ref = None
        self._tokenizer = None
        self.endpoint, self.address = self._start_endpoint()
        self.runner, self.runner_id = self._runner()
        pool.watch(self._push)

    # --- the two actors ---
    def _start_endpoint(self):
        from qgrpo.actors.endpoint_actor import EndpointActor

        env = self.cfg.environment
        kwargs = {"host": env.endpoint_host, "port": env.endpoint_port if not self.generation else 0,
                  "max_tokens": agent_call_default(self.cfg), "chat_template":
                  self.cfg.task.chat_template, "open_sessions": False, "defaults": self.defaults}
        endpoint = EndpointActor.options(**_here()).remote(self.model, self.pool.policy_path, self.pool.link(),
                                                           api_key=self.key, **kwargs)
        address = get_within(endpoint.start.remote(), START_S["endpoint"], "starting the endpoint actor")
        self.generation += 1
        self.address = address
        if self.run_dir is not None:
            (Path(self.run_dir) / ENDPOINT_FILE).write_text(json.dumps(self.info(), indent=1) + "\n")
        return endpoint, address

    def _runner(self):
        from qgrpo.actors.agent_runner import AgentRunner

        runner = AgentRunner.options(**_here()).remote(self.spec, self.cfg.environment.concurrency)
        get_within(runner.ready.remote(), START_S["runner"], "starting the agent runner")  # the agent's file loads
        return runner, runner._actor_id.hex()

    def _restart(self, which: str) -> None:
        """A new endpoint or runner after its process died (counted by the supervisor first)."""
        if which == "endpoint":
            _kill(self.endpoint)
            self.watch_ref = None
            self.endpoint, _ = self._start_endpoint()
            self.pool.events.append({"event": "endpoint_restarted", "address": self.address,
                                     "base_url": f"{self.address}/v1"})
        else:
            _kill(self.runner)
            self.runner, self.runner_id = self._runner()
            self.pool.events.append({"event": "agent_runner_restarted"})

    def _settle(self, which: str, get, stage: str) -> tuple[bool, object]:
        """The supervisor's policy on one call to the endpoint or the runner (cluster/run/supervisor.py): a dead
        one is counted and started again; past faults.max_replacements in a row the run ends. Its failures in a
        row start again only when a chunk is done (`collect`), not when a call merely answers."""
        return self.supervisor.settle(which, get, name=NAMES[which], stage=stage, event=f"{which}_failed",
                                      replace=lambda _: self._restart(which), work=False)

    def _endpoint(self, method: str, *args):
        """A call to the endpoint actor; one that died meanwhile is started again (the call goes to the new one)."""
        stage = f"agent episodes: the endpoint's {method}"
        while True:
            ok, out = self._settle("endpoint", lambda: get_within(
                getattr(self.endpoint, method).remote(*args), CALL_S, stage), stage)
            if ok:
                return out

    def _push(self, link) -> None:
        """The pool's watcher: its actors changed (a replacement, a resize, the precision ladder)."""
        try:
            get_within(self.endpoint.set_link.remote(link), CALL_S, "agent episodes: the endpoint's set_link")
        except ray.exceptions.RayError:  # the endpoint died: the one started next takes the pool's link as it is
            pass

    def info(self) -> dict:
        """What RUN_DIR/endpoint.json holds."""
        return {"address": self.address, "base_url": f"{self.address}/v1", "model": self.model,
                "session_base_url": f"{self.address}/sessions/SESSION_ID/v1", "agent": self.spec.name}

    def announce(self) -> list[tuple[dict, str]]:
        """(the run log's event, the line for stderr) at the start of a run."""
        return [({"event": "endpoint", **self.info()},
                 f"qgrpo: agents call the endpoint at {self.address}/v1 (model {self.model!r}; "
                 f"RUN_DIR/{ENDPOINT_FILE})")]

    # --- the rollout source, for the stream ---
    def own(self, owner: int | None) -> None:
        self.pool.own(owner)

    def split(self, items: list[PromptItem]) -> list[list[PromptItem]]:
        """One chunk per row: a row's episodes are sent, collected and played again together."""
        return [[item] for item in items]

    def free_slots(self, busy: set[int]) -> list[int]:
        """Rows to send now: while fewer episodes than the runner plays at once (environment.concurrency) are in
        flight, as many rows of rollout.group_size episodes as fit (at least one), so that a chunk's episodes start
        when sent and its deadline runs from then; a held-out row is one episode, and more of them follow at the
        next poll."""
        free = self.cfg.environment.concurrency - sum(self.episodes.values())
        n = max(1, free // self.cfg.rollout.group_size) if free > 0 else 0
        return list(itertools.islice((s for s in itertools.count() if s not in busy), n))

    def submit(self, slot: int, items: list[PromptItem], sampling: SamplingParams, step: int,
               held_out: bool = False) -> EpisodeCall:
        """A row's episodes: `sampling.group_size` sessions opened at the endpoint (greedy ones for a held-out row),
        played by the runner; its deadline is twice the episodes' (environment.episode_timeout_s) per round of
        environment.concurrency episodes, and 30 s."""
        from qgrpo.rollout.agents.contract import AgentClient, episode_row

        env = self.cfg.environment
        G = 1 if held_out else sampling.group_size
        tag = "e" if held_out else "s"
        # s<step>-<row>-<episode>-<random>: readable in logs, never guessable (the key is needed besides)
        sids = [f"{tag}{step}-{i}-{g}-{secrets.token_hex(12)}" for i in range(len(items)) for g in range(G)]
        self._endpoint("open_sessions", sids, 0 if held_out else step, {**self.limits, "greedy": held_out})
        episodes = [(episode_row(items[k // G]), AgentClient(f"{self.address}/sessions/{sid}/v1", self.key,
                                                             self.model, sid)) for k, sid in enumerate(sids)]
        ref = self.runner.run.remote(episodes, env.episode_timeout_s, step, held_out)
        rounds = -(-len(sids) // env.concurrency)
        self.episodes[id(ref)] = len(sids)
        return EpisodeCall(ref, slot, tuple(i.prompt_id for i in items), step, time.monotonic(),
                           2 * env.episode_timeout_s * rounds + 30, held_out, list(items), sids, self.runner_id,
                           self.generation)

    def wait(self, calls: list[EpisodeCall], timeout: float) -> list[EpisodeCall]:
        """The calls done, waiting up to `timeout`; meanwhile the endpoint's reports of failed rollout calls are taken
        to the pool (counted, a dead actor replaced and a new link pushed)."""
        if self.watch_ref is None:
            self.watch_ref = self.endpoint.reports.remote(REPORTS_S)
        by_ref = {c.ref: c for c in calls}
        ready, _ = ray.wait([*by_ref, self.watch_ref], num_returns=1, timeout=max(timeout, 0.0))
        if self.watch_ref in ready:
            self._reports()
        return [by_ref[r] for r in ready if r in by_ref]

    def _reports(self) -> None:
        ref, self.watch_ref = self.watch_ref, None
        stage = "an agent's call to the endpoint"
        ok, reports = self._settle("endpoint", lambda: ray.get(ref), stage)
        if ok:
            self.pool.take_reports(reports, stage)

    def collect(self, call: EpisodeCall) -> ChunkResult | None:
        """A finished chunk's groups, stats and agent/* metrics; None where the endpoint or the runner died under
        it: its episodes are played again from their start (the stream sends the chunk again, first)."""
        from qgrpo.rollout.agents.contract import Outcome

        stage = "held-out agent episodes" if call.held_out else f"agent episodes at step {call.step}"
        self.episodes.pop(id(call.ref), None)
        blocked = call.runner in self.blocked
        if not blocked:
            try:
                outcomes = ray.get(call.ref)
            except ray.exceptions.RayError as e:
                fault = fault_of(e)
                if fault is None:
                    raise
                blocked = call.runner in self.blocked  # killed for blocking meanwhile: its episodes fail
                if not blocked:
                    if call.runner == self.runner_id:  # counted once per death: the other chunks it held replay
                        self.supervisor.failed("runner", NAMES["runner"], fault.cause, stage, "runner_failed")
                        if fault.gone:
                            self._restart("runner")
                    return self._replay(call)
        if call.endpoint != self.generation:  # its sessions died with the endpoint
            return self._replay(call)
        ok, sessions = self._settle("endpoint", lambda: get_within(
            self.endpoint.close_sessions.remote(call.sids), CALL_S, stage), stage)
        if not ok:  # the endpoint died under these episodes
            return self._replay(call)
        if blocked:
            outcomes = [Outcome(sid, error=BLOCKED, timed_out=True) for sid in call.sids]
        self.supervisor.served("endpoint")  # a chunk done: both processes' failures in a row start again
        self.supervisor.served("runner")
        return self._groups(call, outcomes, sessions)

    def _replay(self, call: EpisodeCall) -> None:
        if call.endpoint == self.generation:
            try:
                get_within(self.endpoint.close_sessions.remote(call.sids), 60, "closing sessions")
            except ray.exceptions.RayError:
                pass
        for pid in call.prompt_ids:
            self.replayed[pid] = self.replayed.get(pid, 0) + len(call.sids) // len(call.prompt_ids)
        return None

    def overdue(self, calls: list[EpisodeCall]) -> None:
        """An agent that blocks its event loop (a blocking call inside async code) keeps the runner from keeping
        deadlines: past a call's deadline the runner is replaced and its chunks' episodes fail with that cause.
        (The rollout actors' deadline applies to each model call inside the endpoint's link.)"""
        now = time.monotonic()
        if any(now - c.sent > c.deadline_s and c.runner == self.runner_id for c in calls):
            self.blocked.add(self.runner_id)
            _kill(self.runner)
            self.runner, self.runner_id = self._runner()

    # --- a chunk's rows ---
    def _groups(self, call: EpisodeCall, outcomes, sessions: dict):
        from qgrpo.rollout.agents.rows import branch_counts, episode_group
        from qgrpo.rollout.endpoint.sessions import FORK_KINDS

        G, groups, problems = len(call.sids) // len(call.items), [], []
        branches = self.cfg.environment.branches
        stats = dict.fromkeys(STATS, 0)
        more = {"untrained_calls": 0, "dropped": 0, "edited_answers": 0, "second_children": 0}
        kinds = dict.fromkeys(FORK_KINDS.values(), 0)  # every kind on every step: the curves have no gaps
        for i, item in enumerate(call.items):
            ss = [sessions.get(sid) for sid in call.sids[i * G:(i + 1) * G]]
            for s in ss:
                if s is not None:
                    st = s.stats()
                    for k in stats:
                        stats[k] += st.get(k, 0) - (1 if k == "branches" and st.get(k) else 0)
                    counted = branch_counts(s, branches)
                    more["untrained_calls"] += counted["untrained_calls"]
                    more["dropped"] += counted["dropped"]
                    more["edited_answers"] += st.get("edited_answers", 0)
                    more["second_children"] += st.get("second_children", 0)
                    for kind, n in st.get("fork_kinds", {}).items():
                        kinds[kind] = kinds.get(kind, 0) + n
            version = min((s.calls[0].spans[0][1] for s in ss if s is not None and s.calls),
                          default=self.pool.version())
            group, bad = episode_group(item, outcomes[i * G:(i + 1) * G], ss, version, "agents", self.pool.precision,
                                       self._prompt(item), branches)
            groups.append(group)
            problems += [f"row {item.prompt_id}: {p}" for p in bad]
        if problems and self.cfg.environment.on_error == "fail" and not call.held_out:
            raise RunFailed(f"agent episode failed: {problems[0]} (environment.on_error = \"fail\"; \"end\" ends the "
                            "episode with a score of 0 instead)")
        prec = self.pool.precision
        replayed = sum(self.replayed.pop(pid, 0) for pid in call.prompt_ids)
        metrics = {"agent/calls": stats["calls"], "agent/forks": stats["forks"],
                   "agent/untrained_branches": stats["branches"], f"agent/tool_calls_{prec}": stats["tool_calls"],
                   f"agent/tool_parse_failures_{prec}": stats["tool_parse_failures"],
                   "agent/failed_episodes": len(problems), "agent/replayed_episodes": replayed,
                   "agent/cut_calls": stats["cut_calls"], "agent/capped_calls": stats["capped_calls"],
                   "agent/tool_offers": stats["tool_offers"], "agent/untrained_calls": more["untrained_calls"],
                   "agent/dropped_episodes": more["dropped"], "agent/edited_answers": more["edited_answers"],
                   "agent/forks_second_child": more["second_children"],
                   **{f"agent/forks_{kind}": n for kind, n in kinds.items()}}
        gen = GenerationStats("agents", time.monotonic() - call.sent, stats["model_tokens"],
                              min(g.policy_version for g in groups))
        return ChunkResult(groups, gen, metrics)

    def _prompt(self, item) -> list[int]:
        """The row's prompt as the generators format it: the prompt of a group none of whose episodes called."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from qgrpo.actors.common import local_model

            self._tokenizer = AutoTokenizer.from_pretrained(local_model(self.pool.policy_path, skip=("optimizer",)))
        from qgrpo.rollout.backends.common import format_prompt

        return format_prompt(self._tokenizer, item, self.cfg.task.chat_template)

    def close(self) -> None:
        for actor in (self.runner, self.endpoint):
            _kill(actor)


def _kill(actor) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass

