"""The rollout supply of agent programs (cluster/run/supply.py's protocol): each step's rows are played as episodes
by the user's agent (rollout/agents.py) against the run's endpoint (actors/endpoint_actor.py), served by the rollout
actors; each episode is one session, its calls stitched by exact tokens into the row trained on.

A step's episodes start once the staleness rule admits the step (learner/objective/staleness.py: the same rule as the
stream's): the bound is kept by when sessions open, never by discarding finished episodes. `algo.max_staleness = 0`
opens a step's sessions when the driver asks for it, after the sync before it, so every token of the step comes from
one version; with S > 0 later steps' episodes run while the learner trains, and a sync that lands during a call is
applied between two decode steps (the call's answer spans both versions; a branch's staleness is its oldest token's).

G episodes per row (rollout.group_size) run concurrently, at most environment.concurrency at once, each within
environment.episode_timeout_s. A failed episode follows environment.on_error (rollout/agents.py). Per step the
supply reports agent/* metrics: calls, forks, the branches beside the main one (counted, not trained), tool calls,
tool-call parse failures and failed episodes, with the rollout precision in the metric's name for the two tool
figures, so a format that breaks tool calling shows in the run's curves and warnings.
"""
from __future__ import annotations

import threading
import time

import ray

from qgrpo.cluster.run.supply import StepRollouts
from qgrpo.core.records import GenerationStats, GroupRollout
from qgrpo.learner.objective.staleness import admission

POLL_S = 0.05


def _here():
    """On the driver's node: the agent runner reaches the endpoint there (environment.endpoint_host, 127.0.0.1 by
    default); the rollout actors behind it may be anywhere in the cluster."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
ENDPOINT_FILE = "endpoint.json"  # RUN_DIR/endpoint.json: the run's endpoint address, model name, how to reach it


class AgentSupply:
    """Episodes of the agent environment.name names, step by step. `pool`: the rollout actors (RolloutPool)."""

    restored = 0

    def __init__(self, cfg, pool, sampler, start_step: int, published: int):
        from qgrpo.actors.endpoint_actor import EndpointActor
        from qgrpo.rollout.environments.loader import environment_spec

        env, ro, a = cfg.environment, cfg.rollout, cfg.algo
        self.cfg, self.pool, self.sampler = cfg, pool, sampler
        self.rule = admission(a.max_staleness, a.update_every, a.overlap)
        self.spec = environment_spec(env.name, env.params)
        self.model = env.served_model
        self.limits = {"max_calls": env.max_turns, "max_context": env.max_context,
                       "max_tokens": env.turn_tokens or ro.max_new_tokens}
        self.endpoint = EndpointActor.options(scheduling_strategy=_here()).remote(
            self.model, pool.policy_path, list(pool.actors), host=env.endpoint_host, port=env.endpoint_port,
            max_tokens=env.turn_tokens or ro.max_new_tokens, chat_template=cfg.task.chat_template,
            open_sessions=False, defaults={"temperature": ro.temperature, "top_p": ro.top_p, "top_k": ro.top_k})
        self.address = ray.get(self.endpoint.start.remote(), timeout=300)
        self.runner = self._runner()
        self.steps, self.held, self.held_version = cfg.run.steps, start_step, published
        self.asked, self.next_step = start_step - 1, start_step
        self.launched: dict[int, dict] = {}  # step -> its episodes in flight
        self.done: dict[int, StepRollouts] = {}
        self.error: BaseException | None = None
        self.paused = False
        self.episodes = 0
        self.cv = threading.Condition()
        self.stop = threading.Event()
        self._tokenizer = None
        self.thread = threading.Thread(target=self._pump, name="agent-supply", daemon=True)
        self.thread.start()

    def _runner(self):
        from qgrpo.actors.agent_runner import AgentRunner

        runner = AgentRunner.options(scheduling_strategy=_here()).remote(self.spec, self.cfg.environment.concurrency)
        ray.get(runner.ready.remote(), timeout=120)  # the agent's file loads there, or this raises
        return runner

    def info(self) -> dict:
        """What RUN_DIR/endpoint.json holds."""
        return {"address": self.address, "base_url": f"{self.address}/v1", "model": self.model,
                "session_base_url": f"{self.address}/sessions/SESSION_ID/v1", "agent": self.spec.name}

    # --- the pump ---
    def _admit(self) -> None:
        while (not self.paused and self.next_step < self.steps
               and self.rule.admits(self.next_step, self.held, self.asked)):
            self._launch(self.next_step)
            self.next_step += 1

    def _launch(self, step: int, items=None, greedy: bool = False, group_size: int | None = None) -> dict:
        from qgrpo.rollout.agents import AgentClient, episode_row

        G = group_size or self.cfg.rollout.group_size
        items = items if items is not None else self.sampler.next(self.cfg.rollout.prompts_per_step)
        tag = f"e{step}" if greedy else f"s{step}"
        sids = [f"{tag}-{i}-{g}-{self.episodes}" for i in range(len(items)) for g in range(G)]
        self.episodes += 1
        ray.get(self.endpoint.open_sessions.remote(sids, step, {**self.limits, "greedy": greedy}))
        episodes = [(episode_row(items[k // G]), AgentClient(f"{self.address}/sessions/{sid}/v1", sid, self.model,
                                                             sid)) for k, sid in enumerate(sids)]
        entry = {"items": items, "sids": sids, "G": G, "cursor": self.sampler.cursor, "t0": time.monotonic(),
                 "ref": self.runner.run.remote(episodes, self.cfg.environment.episode_timeout_s)}
        if not greedy:
            self.launched[step] = entry
        return entry

    def _pump(self) -> None:
        try:
            while not self.stop.is_set():
                with self.cv:
                    self._admit()
                    flight = dict(self.launched)
                if not flight:
                    with self.cv:
                        self.cv.wait(POLL_S)
                    continue
                refs = {e["ref"]: s for s, e in flight.items()}
                ready, _ = ray.wait(list(refs), num_returns=1, timeout=POLL_S)
                for ref in ready:
                    step = refs[ref]
                    out = self._collect(step, flight[step])
                    with self.cv:
                        self.launched.pop(step, None)
                        self.done[step] = out
                        self.cv.notify_all()
                self._overdue(flight)
        except BaseException as e:  # noqa: BLE001 - raised in the driver by take()
            with self.cv:
                self.error = e
                self.cv.notify_all()

    def _overdue(self, flight: dict) -> None:
        """An agent that blocks its event loop (a blocking call inside async code) keeps the runner from keeping
        deadlines: past twice the deadline the runner is replaced and the step's episodes failed with that cause."""
        limit = 2 * self.cfg.environment.episode_timeout_s + 30
        for step, e in flight.items():
            if time.monotonic() - e["t0"] > limit:
                ray.kill(self.runner, no_restart=True)
                self.runner = self._runner()
                with self.cv:
                    for s, other in list(self.launched.items()):
                        self.done[s] = self._collect(s, other, blocked=True)
                        self.launched.pop(s)
                    self.cv.notify_all()
                return

    def _collect(self, step: int, entry: dict, blocked: bool = False, greedy: bool = False) -> StepRollouts:
        from qgrpo.rollout.agents import Outcome, episode_group

        if blocked:
            why = ("the agent runner did not answer within twice environment.episode_timeout_s: an agent blocked "
                   "its event loop (a blocking call inside async code: use the async client, or a plain def, which "
                   "runs on a thread)")
            outcomes = [Outcome(sid, error=why, timed_out=True) for sid in entry["sids"]]
        else:
            outcomes = ray.get(entry["ref"])
        sessions = ray.get(self.endpoint.close_sessions.remote(entry["sids"]))
        G, groups, problems, stats = entry["G"], [], [], {"calls": 0, "forks": 0, "branches": 0, "tool_calls": 0,
                                                          "tool_parse_failures": 0, "model_tokens": 0}
        for i, item in enumerate(entry["items"]):
            ss = [sessions.get(sid) for sid in entry["sids"][i * G:(i + 1) * G]]
            for s in ss:
                if s is not None:
                    st = s.stats()
                    for k in stats:
                        stats[k] += st[k] - (1 if k == "branches" and st[k] else 0)
            version = min((s.calls[0].spans[0][1] for s in ss if s is not None and s.calls), default=self.held_version)
            group, bad = episode_group(item, outcomes[i * G:(i + 1) * G], ss, version, "agents", self.pool.precision,
                                       self._prompt(item))
            groups.append(group)
            problems += [f"row {item.prompt_id}: {p}" for p in bad]
        if problems and self.cfg.environment.on_error == "fail" and not greedy:
            from qgrpo.cluster.run.workers import RunFailed

            raise RunFailed(f"agent episode failed: {problems[0]} (environment.on_error = \"fail\"; \"end\" ends the "
                            "episode with a score of 0 instead)")
        seconds = time.monotonic() - entry["t0"]
        prec = self.pool.precision
        metrics = {"agent/calls": stats["calls"], "agent/forks": stats["forks"],
                   "agent/untrained_branches": stats["branches"],
                   f"agent/tool_calls_{prec}": stats["tool_calls"],
                   f"agent/tool_parse_failures_{prec}": stats["tool_parse_failures"],
                   "agent/failed_episodes": len(problems), "agent/seconds": seconds}
        gen = GenerationStats("agents", seconds, stats["model_tokens"], min(g.policy_version for g in groups))
        return StepRollouts(groups, [gen], entry["cursor"], stream=metrics)

    def _prompt(self, item) -> list[int]:
        """The row's prompt as the generators format it: the prompt of a group none of whose episodes called."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from qgrpo.actors.common import local_model

            self._tokenizer = AutoTokenizer.from_pretrained(local_model(self.pool.policy_path, skip=("optimizer",)))
        from qgrpo.rollout.backends.common import format_prompt

        return format_prompt(self._tokenizer, item, self.cfg.task.chat_template)

    # --- the driver's side ---
    def take(self, step: int) -> StepRollouts:
        with self.cv:
            self.asked = max(self.asked, step)
            self.cv.notify_all()
            while step not in self.done:
                if self.error is not None:
                    raise self.error
                self.cv.wait(1.0)
            out = self.done.pop(step)
        return out

    def more(self, step: int, n: int, round_: int) -> StepRollouts:
        raise RuntimeError("dynamic sampling (algo.dynamic_sampling) is not served for agent programs")

    def evaluate(self, items) -> list[GroupRollout]:
        """Held-out rows played once each, at temperature 0 (the endpoint samples these sessions greedily whatever
        the agent asks), their episodes judged by the run's metric."""
        entry = self._launch(-1, items=items, greedy=True, group_size=1)
        done, _ = ray.wait([entry["ref"]], timeout=2 * self.cfg.environment.episode_timeout_s + 30)
        return self._collect(-1, entry, blocked=not done, greedy=True).groups

    def advance(self, done: int, version: int) -> None:
        with self.cv:
            self.held, self.held_version = done, version
            self.cv.notify_all()

    def pause(self) -> None:
        """Open no new sessions and wait for the episodes in flight (before the actors change)."""
        with self.cv:
            self.paused = True
            while self.launched and self.error is None:
                self.cv.wait(1.0)
            if self.error is not None:
                raise self.error
        ray.get(self.endpoint.pause.remote())

    def resume(self) -> None:
        ray.get(self.endpoint.resume.remote(list(self.pool.actors)))
        with self.cv:
            self.paused = False
            self.cv.notify_all()

    def snapshot(self) -> dict | None:
        """Episodes are not kept across a checkpoint: a resume plays the steps beyond it again from the sampler's
        cursor (None: the checkpoint's own cursor says it all). Under S > 0 the steps drawn ahead are drawn again."""
        return None

    def stats(self) -> dict:
        return ray.get(self.endpoint.stats.remote())

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for actor in (self.runner, self.endpoint):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
