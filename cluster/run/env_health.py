"""Failing environments and runs that cannot learn, made loud (the driver's `TrainingRun.log_step` calls both each
step, after the rewards' own health, cluster/run/rewarding.py).

`EnvHealth` reads the step's fresh sample (rollouts.sample): the trajectories that ended as "env_error" and, from
their last turn (rollout/episodes.py `Episodes._failed`), the error and the user's line that raised it. A step with
failures gives an "env_errors" event (a warning line on the terminal and in metrics.jsonl); each distinct error's
traceback goes to RUN_DIR/env_errors.log once; the run stops (RunFailed) when the environment failed on every
trajectory for environment.max_failed_steps steps in a row, whatever environment.on_error says: a run whose every
score is the 0 of a failure learns nothing.

`SignalWatch` reads the step's metrics: no group with a reward spread (reward/groups_with_signal 0.0: every
completion of a prompt scored alike, so every advantage is 0) and, for an environment with tools, no trajectory that
called one (episode/called_tool_frac 0.0), each for NO_SIGNAL_STEPS steps in a row, give a warning with the likely
causes and their fixes; so do an agent program's tools offered but never called (agent/tool_offers without
agent/tool_calls_<P>), its calls cut at max_tokens (agent/cut_calls) past CUT_SHARE of a step's calls, naming
environment.turn_tokens and environment.max_context, and its calls on no trained branch (agent/untrained_calls) past
UNTRAINED_SHARE of a step's calls, naming the forks' likely causes (agent/forks_<kind>) and environment.branches.
Once per streak: the metrics say so on every step line; a warning repeated every step would bury the other lines of
a long run without saying more. A step with signal (or a call) ends the streak, and the next streak warns again.
"""
from __future__ import annotations

from pathlib import Path

from qgrpo.core.records import GroupRollout

ERROR_LOG = "env_errors.log"  # in the run directory: the tracebacks of failed environment calls
LOGGED_ERRORS = 50  # distinct errors written to ERROR_LOG at most (an error naming the model's text differs each time)
NO_SIGNAL_STEPS = 3  # steps in a row without a reward spread (or a tool call) before a warning


def env_failures(groups: list[GroupRollout]) -> tuple[int, int, list[dict]]:
    """(failed, of, the failed trajectories' error turns) of a step's multi-turn trajectories: those that ended as
    "env_error", of all; single-turn completions are not counted."""
    comps = [c for g in groups for c in g.completions if c.turns is not None]
    failed = [c for c in comps if c.finish_reason == "env_error"]
    turns = [c.turns[-1] if c.turns and c.turns[-1].get("error") else {"error": "the environment failed"}
             for c in failed]
    return len(failed), len(comps), turns


def drop_traces(groups: list[GroupRollout]) -> None:
    """The tracebacks off the error turns (they are in ERROR_LOG; the rollouts Parquet keeps the error and where)."""
    for g in groups:
        for c in g.completions:
            if c.turns and "trace" in c.turns[-1]:
                del c.turns[-1]["trace"]


class EnvHealth:
    """Per step (`end_step`): an "env_errors" event with a message when trajectories ended as "env_error", the new
    distinct errors' tracebacks in RUN_DIR/env_errors.log, and `broken` set when every trajectory failed for
    max_failed_steps steps in a row (`stop_if_broken` raises it). `failures` are the totals for the run's end."""

    def __init__(self, name: str, max_failed_steps: int, on_error: str, run_dir: Path | None):
        self.name = name.rpartition("/")[2]  # "env.py:GuessNumber", not the folder it was read from
        self.limit, self.on_error = max_failed_steps, on_error
        self.log = run_dir / ERROR_LOG if run_dir is not None else None
        self.streak = 0
        self.totals = {"failed": 0, "of": 0, "steps": 0, "error": "", "where": ""}
        self.logged: set[str] = set()
        self.broken: str | None = None

    def _where(self) -> str:
        return f"; tracebacks in {self.log}" if self.log is not None and self.log.is_file() else ""

    def _write(self, step: int, turns: list[dict]) -> None:
        """Each error not logged yet, once, with the traceback one of its turns carries."""
        if self.log is None:
            return
        by: dict[str, dict] = {}
        for t in turns:
            seen = t.get("where") or str(t.get("error"))
            if seen not in by or ("trace" in t and "trace" not in by[seen]):
                by[seen] = t
        for seen, t in by.items():
            if seen in self.logged or len(self.logged) >= LOGGED_ERRORS:
                continue
            self.logged.add(seen)
            call = f" ({t['call']})" if t.get("call") else ""
            trace = t.get("trace") or "(no traceback: the call did not raise, e.g. it timed out or its worker died)"
            with self.log.open("a") as f:
                f.write(f"step {step}: environment {self.name}{call}: {t.get('error')}\n{trace}\n\n")

    def end_step(self, step: int, groups: list[GroupRollout]) -> list[dict]:
        """The step's env_errors event (none without failures); `broken` says why the run must stop."""
        failed, of, turns = env_failures(groups)
        self.totals["of"] += of
        self.streak = self.streak + 1 if of and failed == of else 0
        self.broken = None
        if not failed:
            return []
        self._write(step, turns)
        first = turns[0]
        error, where = str(first.get("error")), str(first.get("where") or "")
        t = self.totals
        t.update(failed=t["failed"] + failed, steps=t["steps"] + 1, error=t["error"] or error,
                 where=t["where"] or where)
        at = f" at {where}" if where else ""
        kinds = len({u.get("where") or str(u.get("error")) for u in turns})
        more = f" and {kinds - 1} other error{'s' * (kinds > 2)}" if kinds > 1 else ""
        event = {"event": "env_errors", "step": step, "failed": failed, "of": of, "error": error, "where": where,
                 "errors": kinds, "log": ERROR_LOG,
                 "message": f"environment {self.name} failed on {failed} of {of} trajectories ({error}{at}{more}); "
                            "they ended as \"env_error\" with a score of 0 (environment.on_error = \"end\"); step() "
                            "must answer any text the model can write, e.g. with a message telling the model what "
                            f"was wrong, rather than raise{self._where()}"}
        if self.limit and self.streak >= self.limit:
            self.broken = (f"environment {self.name} failed on every trajectory for {self.streak} steps in a row "
                           f"({error}{at}){self._where()}; fix it (environment.max_failed_steps = {self.limit} stops "
                           "a run whose environment is broken, whatever environment.on_error says)")
        return [event]

    def stop_if_broken(self) -> None:
        """Raises RunFailed when the environment failed on every trajectory for max_failed_steps steps in a row."""
        if self.broken:
            from qgrpo.cluster.run.supervisor import RunFailed  # Ray's and torch's imports: only for a run that stops

            raise RunFailed(self.broken)

    def failures(self) -> dict:
        """The run's totals ({} when no trajectory failed): failed, of, steps, the first error and where."""
        return {"name": self.name, **self.totals} if self.totals["failed"] else {}


class SignalWatch:
    """Warnings for a run that cannot learn: no reward spread in any group, or (an environment with tools) no tool
    called, for NO_SIGNAL_STEPS steps in a row; once per streak. `tools`: the environment's tools' names;
    `turn_tokens`: an environment's turn length, or an agent's call cap (0: none). For an agent program (`agent`),
    from the agent/* metrics: tools offered on its calls but none called for NO_SIGNAL_STEPS steps, and calls cut at
    max_tokens past CUT_SHARE of a step's calls and calls that trained nothing past UNTRAINED_SHARE
    (`agent_warnings`); `max_context` names the room the calls share, `branches` environment.branches."""

    def __init__(self, tools: list[str] | None = None, turn_tokens: int = 0, steps: int = NO_SIGNAL_STEPS,
                 agent: bool = False, max_context: int = 0, branches: str = "main", temperature: float = 1.0,
                 model: str = ""):
        self.tools, self.turn_tokens, self.steps = list(tools or []), turn_tokens, steps
        self.agent, self.max_context, self.branches = agent, max_context, branches
        self.temperature, self.model = temperature, model  # what tool_parse_warnings names beside the precision
        self.flat = self.silent = self.offered = self.cutting = self.untrained = 0

    @classmethod
    def of(cls, cfg, tools: list[str] | None = None) -> SignalWatch:
        """The watch of a run of `cfg` (`tools`: a tool environment's tools' names), its turn length and, for an
        agent program, its call cap, read as the run reads them (cluster/config/turns.py)."""
        from qgrpo.cluster.config.turns import agent_call_cap
        from qgrpo.rollout.environments.kinds import capabilities

        env = cfg.environment
        sampling = {"temperature": cfg.rollout.temperature, "model": cfg.model.path}
        if capabilities(env.name).endpoint:  # its calls' own metrics (agent/*), capped by environment.turn_tokens
            return cls([], agent_call_cap(cfg), agent=True, max_context=env.max_context, branches=env.branches,
                       **sampling)
        return cls(tools, env.turn_tokens or cfg.rollout.max_new_tokens, max_context=env.max_context, **sampling)

    def end_step(self, step: int, m: dict) -> list[dict]:
        """The step's warning events from its metrics `m` (reward/groups_with_signal, episode/called_tool_frac,
        agent/*)."""
        events = []
        signal = m.get("reward/groups_with_signal")
        self.flat = self.flat + 1 if signal is not None and signal == 0 else 0
        if self.flat == self.steps:
            events.append({"event": "warning", "step": step, "kind": "no_signal", "steps": self.flat,
                           "message": self._flat(m)})
        called = m.get("episode/called_tool_frac")
        self.silent = self.silent + 1 if self.tools and called is not None and called == 0 else 0
        if self.silent == self.steps:
            events.append({"event": "warning", "step": step, "kind": "no_tool_calls", "steps": self.silent,
                           "tools": self.tools, "message": self._silent(m)})
        return events + self.agent_warnings(step, m) + tool_parse_warnings(step, m, self.temperature, self.model)

    # --- agent programs (agent/* metrics of cluster/run/agents.py) ---
    def agent_warnings(self, step: int, m: dict) -> list[dict]:
        """An agent's tools offered (agent/tool_offers > 0) but never called (agent/tool_calls_<P> 0) for `steps`
        steps in a row; calls cut at max_tokens (agent/cut_calls) past CUT_SHARE of the step's agent/calls. Each
        once per streak."""
        if not self.agent or "agent/calls" not in m:
            return []
        events = []
        offers, calls = m.get("agent/tool_offers", 0), m.get("agent/calls", 0)
        tool_calls = sum(v for k, v in m.items() if k.startswith("agent/tool_calls_"))
        self.offered = self.offered + 1 if offers and not tool_calls else 0
        if self.offered == self.steps:
            events.append({"event": "warning", "step": step, "kind": "no_agent_tool_calls", "steps": self.offered,
                           "message": self._unused(m)})
        cut = m.get("agent/cut_calls", 0)
        self.cutting = self.cutting + 1 if calls and cut >= max(CUT_SHARE * calls, 1) else 0
        if self.cutting == 1:
            events.append({"event": "warning", "step": step, "kind": "cut_calls", "cut": cut, "calls": calls,
                           "message": self._agent_cut(m)})
        untrained = m.get("agent/untrained_calls", 0)
        self.untrained = self.untrained + 1 if calls and untrained > UNTRAINED_SHARE * calls else 0
        if self.untrained == 1:
            events.append({"event": "warning", "step": step, "kind": "untrained_calls", "untrained": untrained,
                           "calls": calls, "causes": self._fork_causes(m), "message": self._untrained(m)})
        return events

    @staticmethod
    def _fork_causes(m: dict) -> list[str]:
        """The forks' kinds this step, most first (agent/forks_<kind>)."""
        counts = {k[len("agent/forks_"):]: v for k, v in m.items() if k.startswith("agent/forks_") and v}
        return sorted(counts, key=lambda k: -counts[k])

    def _untrained(self, m: dict) -> str:
        untrained, calls = m.get("agent/untrained_calls", 0), m.get("agent/calls", 0)
        words = {
            "history": "the agent rewrote, trimmed or summarised its earlier messages: each rewrite starts a new "
                       "branch (send the history back as it was, appending only)",
            "answer": "answers sent back edited without their tool-call ids, or left out (send the assistant "
                      "message back as returned: its tool-call ids link it even when its text changed)",
            "template": "the chat template renders earlier turns differently once new messages follow and cannot "
                        "render the new ones apart",
            "tokens": "token-in prompts that extend no earlier call's tokens (re-tokenized history)",
            "route": "a chat call after a token-in call in one episode (keep to one route)",
            "second_child": "calls continuing a call that already had a continuation: retries, calls in flight "
                            "together, sub-agents sharing the session",
            "other": "forks of another kind"}
        causes = [f"{words.get(k, k)} (agent/forks_{k} {m.get(f'agent/forks_{k}', 0)})" for k in self._fork_causes(m)]
        setting = ("environment.branches = \"drop\" leaves out every episode that forked (agent/dropped_episodes "
                   f"{m.get('agent/dropped_episodes', 0)})" if self.branches == "drop" else
                   "environment.branches = \"main\" trains each episode's main branch only (the most sampled "
                   "tokens); the calls on its other branches are counted, not trained")
        return (f"{untrained} of the {calls} agent calls this step are on no trained branch (agent/untrained_calls): "
                f"{setting}; likely causes: " + ("; ".join(causes) or "none recorded") + "; each call's fork and its "
                "reason are in the session's record (GET /v1/sessions/SID under `qgrpo serve`; docs/agents.md, "
                "Sessions)")

    def _cap(self) -> str:
        return (f"environment.turn_tokens = {self.turn_tokens} caps every call" if self.turn_tokens else
                "environment.turn_tokens = 0 (no cap per call)")

    def _agent_cut(self, m: dict) -> str:
        cut, calls, capped = m.get("agent/cut_calls", 0), m.get("agent/calls", 0), m.get("agent/capped_calls", 0)
        head = (f"{cut} of the {calls} agent calls this step ended at their max_tokens (agent/cut_calls): each ends "
                "mid-sentence, and a tool call cut mid-JSON does not parse")
        if capped:
            room = f" (environment.max_context = {self.max_context})" if self.max_context else ""
            return (f"{head}; {capped} asked more tokens than the run grants (agent/capped_calls): {self._cap()}, and "
                    f"each call gets at most the room left in environment.max_context{room}; raise "
                    "environment.turn_tokens (or set it to 0: each call gets what it asks, up to that room) or "
                    "environment.max_context")
        return (f"{head}; none asked more than the run grants ({self._cap()}), so the agent's own max_tokens cut "
                "them: ask for more in the agent")

    def _unused(self, m: dict) -> str:
        causes = ["the model does not know the chat template's tool format: a small model rarely calls a tool it is "
                  "only told about; put a worked exchange (a question, the call, the tool's answer, the final "
                  "answer) in the agent's messages (examples/agent_calculator)",
                  "the prompt does not ask for the tool: say when to use it"]
        cut, bad = m.get("agent/cut_calls", 0), sum(v for k, v in m.items()
                                                    if k.startswith("agent/tool_parse_failures_"))
        if cut:
            causes.insert(0, f"{cut} of the {m.get('agent/calls', 0)} calls this step ended at max_tokens, which "
                             f"cuts a tool call before its JSON closes ({self._cap()}; agent/capped_calls "
                             f"{m.get('agent/capped_calls', 0)}): raise environment.turn_tokens or the agent's "
                             "max_tokens")
        if bad:
            causes.insert(0, f"{bad} tool calls this step did not parse (agent/tool_parse_failures_*)")
        return (f"the agent offered tools on its calls (agent/tool_offers {m.get('agent/tool_offers', 0)}) and the "
                f"model called none for {self.offered} steps in a row (agent/tool_calls_* 0); likely causes: "
                + "; ".join(causes) + "; `qgrpo check` plays one episode and says which")

    def _flat(self, m: dict) -> str:
        mean = m.get("reward/mean")
        level = f" (reward/mean {mean:.3f})" if isinstance(mean, (int, float)) else ""
        causes = ["the task is too hard (every answer scores the same low reward) or too easy for the model: try "
                  "an easier task or a larger model, or more completions per prompt (rollout.group_size)",
                  "a reward that reads the wrong column or answer format always gives the same score: run "
                  "`qgrpo check` and look at the rewards' stand-in scores and at RUN_DIR/rollouts"]
        if "episode/turns" in m:
            causes.append(self._cut(m) or "the environment's score never differs between trajectories")
            if self.tools and m.get("episode/called_tool_frac") == 0:
                causes.append(f"the model never calls {self._names()}: put worked exchanges in the prompt "
                              "(docs/environments.md, Tools)")
        return (f"no group had a reward spread for {self.flat} steps in a row (reward/groups_with_signal 0.0"
                f"{level}): every completion of a prompt scored alike, so every advantage is 0 and nothing is "
                "learned; likely causes: " + "; ".join(causes))

    def _names(self) -> str:
        return ("the tool " if len(self.tools) == 1 else "the tools ") + ", ".join(repr(t) for t in self.tools)

    def _cut(self, m: dict) -> str:
        cut = m.get("episode/finish_length", 0.0)
        if not cut:
            return ""
        size = f" ({self.turn_tokens})" if self.turn_tokens else ""
        return (f"{cut:.0%} of the trajectories ended on a turn cut at environment.turn_tokens{size}: raise it so a "
                "whole turn fits")

    def _silent(self, m: dict) -> str:
        size = f" ({self.turn_tokens} tokens now)" if self.turn_tokens else ""
        causes = ["a small model rarely calls a tool it has only been told about: put worked exchanges in the prompt, "
                  "a question, the call, the tool's answer and the final answer (examples/calculator; "
                  "docs/environments.md, Tools)",
                  f"environment.turn_tokens{size} too small for a whole call (the call's JSON is cut, so no call "
                  "parses): raise it",
                  "the calls are not in the format the environment parses (<tool_call>{\"name\": ..., \"arguments\": "
                  "{...}}</tool_call> for a ToolEnvironment): look at the model's turns in RUN_DIR/rollouts"]
        cut = self._cut(m)
        if cut:
            causes.insert(1, cut)
        return (f"no trajectory called {self._names()} for {self.silent} steps in a row (episode/called_tool_frac "
                "0.0); likely causes: " + "; ".join(causes) + "; and a reward that reads the wrong column scores "
                "a trajectory that used the tool no better than one that did not")


CUT_SHARE = 0.25  # of an agent's calls in a step, the share ended at max_tokens past which it warns
UNTRAINED_SHARE = 0.25  # of an agent's calls in a step, the share on no trained branch past which it warns
PARSE_SHARE = 0.25  # of the tool calls a model wrote in a step, the share that failed to parse past which it warns


QUIET_MISMATCH = 0.01  # mismatch/kl_mu_old (nats a sampled token) below which the format barely moves the samples


def tool_parse_warnings(step: int, m: dict, temperature: float = 1.0, model: str = "") -> list[dict]:
    """A warning where an agent's model wrote tool calls the endpoint could not parse (agent/tool_parse_failures_<P>
    against agent/tool_calls_<P>, P the rollout precision), with the causes the run can weigh: the sampling
    temperature and the model (`model`: its path or name), and for a quantized P what the step measured of it, the
    sampler's mismatch with the BF16 policy on the tokens it sampled (mismatch/kl_mu_old, the learner's k3 estimate):
    below QUIET_MISMATCH the format barely moved the samples, and precision is named last; above, first. Without that
    measurement precision is one possible cause among the others, never the cause."""
    out = []
    for key, bad in m.items():
        if not key.startswith("agent/tool_parse_failures_") or not bad:
            continue
        precision = key.rsplit("_", 1)[1]
        wrote = bad + m.get(f"agent/tool_calls_{precision}", 0)
        if bad >= 2 and bad >= PARSE_SHARE * wrote:
            causes = [f"sampling at rollout.temperature = {temperature:g}" + (
                      " (at 1 a small model writes malformed calls at any precision: try 0.7, or put worked calls "
                      "in the prompt)" if temperature >= 0.9 else ""),
                      "the model" + (f" ({model})" if model else "") + " too small to keep the call format"]
            kl = m.get("mismatch/kl_mu_old")
            if precision != "bf16":
                if kl is None or kl != kl:
                    causes.append(f"the {precision} format (not measured this step: compare rollout.precision = "
                                  "\"bf16\")")
                elif kl < QUIET_MISMATCH:
                    causes.append(f"the {precision} format, unlikely: the sampler and the BF16 policy differ by "
                                  f"{kl:.4f} nats a sampled token this step (mismatch/kl_mu_old)")
                else:
                    causes.insert(0, f"the {precision} format: the sampler and the BF16 policy differ by {kl:.4f} "
                                     "nats a sampled token this step (mismatch/kl_mu_old): compare rollout.precision "
                                     "= \"bf16\"")
            out.append({"event": "warning", "step": step, "kind": "tool_parse_failures", "precision": precision,
                        "mismatch_kl": kl,
                        "message": f"at rollout.precision = {precision!r}, {bad} of the {wrote} tool calls the model "
                                   "wrote this step could not be parsed (<tool_call>{\"name\": ..., \"arguments\": "
                                   "{...}}</tool_call>); possible causes: " + "; ".join(causes)
                                   + " (docs/agents.md#failures)"})
    return out
