"""Multi-turn rollouts against an environment, token in, token out (runs inside a rollout actor).

A trajectory starts from the environment's first messages (`reset`), rendered by the chat template into the group's
prompt ids. Then, turn by turn, every live trajectory's next model turn is generated together from its token ids
(`Generator.continue_ids`), the environment answers each turn (`step`, off the actor, with deadlines: the env client),
and its answer is rendered by the chat template and appended as tokens. A model turn is never re-tokenized: the
trajectory's ids are exactly the tokens the generator sampled plus the rendered environment turns, so the log-probs
the loss compares (sampler, learner, reference) are of the same tokens. `Completion.model_mask` marks the model's
tokens; the environment's carry log-prob 0.0 and are masked out of the loss (learner/batch.py).

A trajectory ends when the environment says done (finish "stop"; "length" when the model's turn it ended on was cut
at `turn_tokens` without a stop token, as a single-turn completion cut at max_new_tokens is), after `max_turns` model
turns ("max_turns"), when its tokens reach `max_context` ("context"), or when the environment fails and
`on_error = "end"` ("env_error": its error, and where in the user's file it was raised, is the last observation and
its score 0). A cut turn the environment answers does not end the trajectory: the model's next turn follows.
Rendering an environment turn: the chat template of the history plus the new messages, less the template of the
history alone; the text between the model's stop token and the new messages (e.g. a newline after "<|im_end|>") is
the template's own, found once per tokenizer (`assistant_tail`).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from qgrpo.core.records import Completion, GroupRollout, PromptItem, SamplingParams
from qgrpo.rollout.backends.versions import VersionSpans
from qgrpo.rollout.environments.contract import EnvFailure, row_of


class EpisodeError(RuntimeError):
    """An environment failed under on_error = "fail", or broke the contract (a group whose first messages differ)."""


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int  # model turns per trajectory
    turn_tokens: int  # new tokens per model turn
    max_context: int  # tokens of a whole trajectory, prompt included
    on_error: str = "end"  # "end": the trajectory ends with its error, score 0; "fail": the step fails


@dataclass(frozen=True)
class EpisodeSetup:
    """What a rollout actor needs to run episodes: the environment (rollout/environments/loader.py's EnvSpec, its
    file's source included), the limits, and its workers' deadline and number."""

    spec: object  # EnvSpec
    limits: EpisodeLimits
    timeout_s: float
    num_workers: int
    num_cpus: float = 0.0


def episode_setup(env_cfg, max_new_tokens: int, base=None) -> EpisodeSetup | None:
    """From the [environment] section (None when it names none this loop plays: no environment, or an agent program,
    which plays against the endpoint); `base`: where a relative FILE.py is."""
    from qgrpo.rollout.environments.kinds import capabilities
    from qgrpo.rollout.environments.loader import environment_spec

    if not capabilities(env_cfg.name).episode_loop:
        return None

    limits = EpisodeLimits(env_cfg.max_turns, env_cfg.turn_tokens or max_new_tokens, env_cfg.max_context,
                           env_cfg.on_error)
    return EpisodeSetup(environment_spec(env_cfg.name, env_cfg.params, base), limits, env_cfg.timeout_s,
                        env_cfg.num_workers, env_cfg.num_cpus)


def tools_for(tokenizer, tools: list) -> tuple[list[dict] | None, str]:
    """(schemas for the chat template, "") when the template renders `tools=`; (None, a system message describing
    them and the call format) when it ignores them (SmolLM2's); (None, "") without tools."""
    if not tools:
        return None, ""
    from qgrpo.rollout.environments.tools import tool_schema, tools_prompt

    schemas = [tool_schema(f) for f in tools]
    probe = [{"role": "user", "content": "q"}]
    if render(tokenizer, probe, schemas, True) != render(tokenizer, probe, None, True):
        return schemas, ""
    return None, tools_prompt(tools)


@dataclass
class Trajectory:
    key: str
    item: PromptItem
    messages: list[dict] = field(default_factory=list)  # the conversation so far, as text (for rendering, rewards)
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # everything after the prompt: model and environment turns
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: VersionSpans = field(default_factory=VersionSpans)  # which version sampled which of `ids`
    turns: list[dict] = field(default_factory=list)
    finish: str = ""
    score: float = 0.0
    error: str | None = None
    stopped: bool = True  # the last model turn ended with a stop token (else the template's stop text is added)
    cut: bool = False  # the last model turn was cut at turn_tokens, without a stop token

    @property
    def done(self) -> bool:
        return bool(self.finish)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    def end(self, finish: str, error: str | None = None) -> None:
        self.finish, self.error = finish, error


def render(tokenizer, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def assistant_tail(tokenizer, stop_text: str) -> str:
    """The text a chat template puts after an assistant message's stop token (SmolLM2: "\\n" after "<|im_end|>"; a
    template that ends the message with the stop token: "")."""
    marker = "qgrpo-marker-7f3a"
    text = render(tokenizer, [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}], None, False)
    after = text[text.index(marker) + len(marker):]
    return after[after.index(stop_text) + len(stop_text):] if stop_text and stop_text in after else ""


def environment_turn_ids(tokenizer, history: list[dict], new: list[dict], tools: list[dict] | None, tail: str,
                         stop_text: str, stopped: bool) -> list[int]:
    """The tokens of the environment's `new` messages after the model's last turn, with the next assistant header:
    the chat template's rendering of history + new, less its rendering of history, preceded by what the template
    puts after an assistant message (and the stop token itself when the model's turn was cut before it)."""
    before = render(tokenizer, history, tools, False)
    after = render(tokenizer, history + new, tools, True)
    if not after.startswith(before):
        raise EpisodeError("the chat template renders the conversation differently once the environment's turn is "
                           "added, so its tokens cannot be appended to the sampled ones; use a template whose "
                           "rendering of a conversation is a prefix of its rendering of any continuation")
    return encode(tokenizer, ("" if stopped else stop_text) + tail + after[len(before):])


class PlainText:
    """Rendering without a chat template (a tokenizer that has none, or task.chat_template = false), as the
    generators format such prompts (rollout/backends/common.format_prompt): the first messages' texts, each followed
    by a blank line but the last, with the tokenizer's own special tokens; an environment turn's texts appended as
    they are, after the model's stop token."""

    def __init__(self, tokenizer, stop_text: str):
        self.tokenizer, self.stop_text = tokenizer, stop_text

    def prompt(self, messages: list[dict]) -> list[int]:
        text = "".join(f"{m['content']}\n\n" for m in messages[:-1]) + messages[-1]["content"]
        return list(self.tokenizer(text)["input_ids"])

    def turn(self, history: list[dict], new: list[dict], stopped: bool) -> list[int]:
        return encode(self.tokenizer, ("" if stopped else self.stop_text) + "".join(m["content"] for m in new))


class ChatTemplate:
    """Rendering by the tokenizer's chat template, with the tools' schemas where it renders them."""

    def __init__(self, tokenizer, stop_text: str, tools: list[dict] | None):
        self.tokenizer, self.stop_text, self.tools = tokenizer, stop_text, tools
        self.tail = assistant_tail(tokenizer, stop_text)

    def prompt(self, messages: list[dict]) -> list[int]:
        return encode(self.tokenizer, render(self.tokenizer, messages, self.tools, True))

    def turn(self, history: list[dict], new: list[dict], stopped: bool) -> list[int]:
        return environment_turn_ids(self.tokenizer, history, new, self.tools, self.tail, self.stop_text, stopped)


class Episodes:
    """The episode loop of one rollout actor: `gen` (its generator, with `continue_ids`), its tokenizer and stop
    tokens, an env client (`reset`, `step`, `score`, `drop` over keys, off the actor, with deadlines: each result a
    value or an EnvFailure), the tools' schemas (rendered by the chat template, or described in a system message
    by `tools_text` when the template ignores them), the limits. `chat_template` False (or a tokenizer without one):
    plain text, as the generators format prompts then."""

    def __init__(self, gen, tokenizer, stop_ids: list[int], client, limits: EpisodeLimits,
                 tools: list[dict] | None = None, tools_text: str = "", chat_template: bool = True):
        self.gen, self.tokenizer, self.client, self.limits = gen, tokenizer, client, limits
        self.tools_text = tools_text
        self.stop_ids = set(stop_ids)
        self.env_seconds = 0.0  # time spent waiting on the environment, summed over `run` calls
        self.traced: set[str] = set()  # the errors whose traceback a turn of the current `run` call carries
        stop_text = tokenizer.decode([stop_ids[0]]) if stop_ids else ""
        self.text = (ChatTemplate(tokenizer, stop_text, tools) if chat_template and tokenizer.chat_template
                     else PlainText(tokenizer, stop_text))

    def run(self, items: list[PromptItem], sampling: SamplingParams, key: str, policy_version: int,
            generator_id: str, precision: str) -> list[GroupRollout]:
        """group_size trajectories per item; one GroupRollout per item, a Completion per trajectory."""
        G = sampling.group_size
        trajs = [Trajectory(f"{key}/{i}/{g}", it) for i, it in enumerate(items) for g in range(G)]
        self.traced: set[str] = set()  # the errors whose traceback a turn of this call already carries
        try:
            self._reset(trajs)
            for turn in range(self.limits.max_turns):
                live = [t for t in trajs if not t.done]
                if not live:
                    break
                self._model_turn(live, sampling, turn)
                self._environment_turn([t for t in live if not t.done])
            for t in trajs:
                if not t.done:
                    t.end("max_turns")
            scores = self.client.score([t.key for t in trajs if t.error is None])
            for t, s in zip([t for t in trajs if t.error is None], scores, strict=True):
                self._failed(t, s, "score") if _is_failure(s) else setattr(t, "score", float(s))
        finally:
            self.client.drop([t.key for t in trajs])
        return [self._group(items[i], trajs[i * G:(i + 1) * G], policy_version, generator_id, precision)
                for i in range(len(items))]

    def _failed(self, t: Trajectory, failure, call: str) -> None:
        """The trajectory ends with the failure as its last turn: the error, where the user's code raised it (the
        driver's warnings name it: cluster/run/env_health.py) and, for the first failure with that error in this
        call, its traceback (for RUN_DIR/env_errors.log; the driver drops it before the rollouts are written)."""
        at = f" at {failure.where}" if failure.where else ""
        message = f"environment {call} failed for row {t.item.prompt_id}: {failure.error}{at}"
        if self.limits.on_error == "fail":
            raise EpisodeError(f"{message} (environment.on_error = \"fail\"; \"end\" ends the trajectory instead)")
        t.score = 0.0
        turn = {"role": "user", "content": f"[environment error] {failure.error}", "start": len(t.ids),
                "end": len(t.ids), "tool_calls": [], "error": str(failure.error), "where": failure.where,
                "call": call}
        seen = failure.where or str(failure.error)
        if failure.trace and seen not in self.traced:
            self.traced.add(seen)
            turn["trace"] = failure.trace
        t.turns.append(turn)
        t.end("env_error", str(failure.error))

    def _reset(self, trajs: list[Trajectory]) -> None:
        first = self.client.reset([t.key for t in trajs], [row_of(t.item) for t in trajs])
        by_item: dict[str, list[dict]] = {}
        for t, messages in zip(trajs, first, strict=True):
            if _is_failure(messages):
                self._failed(t, messages, "reset")
                continue
            messages = ([{"role": "system", "content": self.tools_text}] + list(messages)
                        if self.tools_text else list(messages))
            if by_item.setdefault(t.item.prompt_id, messages) != messages:
                raise EpisodeError(f"the environment's reset gave the trajectories of row {t.item.prompt_id} "
                                   "different first messages; GRPO compares the trajectories of one prompt, so "
                                   "reset must be a function of the row (draw anything random from the row's seed)")
        for t in trajs:  # a trajectory whose reset failed keeps its group's prompt (it has no turn of its own)
            t.messages = list(by_item.get(t.item.prompt_id, [{"role": "user", "content": t.item.prompt}]))
            t.prompt_ids = self.text.prompt(t.messages)

    def _model_turn(self, live: list[Trajectory], sampling: SamplingParams, turn: int) -> None:
        lim = self.limits
        for t in live:
            if t.length >= lim.max_context:
                t.end("context")
        live = [t for t in live if not t.done]
        if not live:
            return
        budget = max(min(lim.turn_tokens, lim.max_context - t.length) for t in live)
        seed = None if sampling.seed is None else sampling.seed + 7919 * (turn + 1)
        version = self.gen.policy_version  # an update lands only inside a turn's decode (or after the whole call)
        comps = self.gen.continue_ids([t.prompt_ids + t.ids for t in live],
                                      dataclasses.replace(sampling, group_size=1, max_new_tokens=budget, seed=seed))
        for t, c in zip(live, comps, strict=True):
            room = min(lim.turn_tokens, lim.max_context - t.length)
            tokens, lps = list(c.token_ids[:room]), list(c.logprobs[:room])
            text = c.text if len(tokens) == len(c.token_ids) else self.tokenizer.decode(tokens,
                                                                                       skip_special_tokens=True)
            start = len(t.ids)
            t.versions.extend(start, c.versions(version)[:room])  # the turn's versions, from its first token on
            t.ids += tokens
            t.logprobs += lps
            t.mask += [1] * len(tokens)
            t.turns.append({"role": "assistant", "content": text, "start": start, "end": len(t.ids),
                            "tool_calls": [], "error": None})
            t.messages.append({"role": "assistant", "content": text})
            t.stopped = bool(tokens) and tokens[-1] in self.stop_ids
            t.cut = not t.stopped and len(tokens) >= lim.turn_tokens
            if t.length >= lim.max_context and not t.stopped:
                t.end("context")

    def _environment_turn(self, live: list[Trajectory]) -> None:
        if not live:
            return
        t0 = time.perf_counter()
        results = self.client.step([t.key for t in live], [t.messages[-1]["content"] for t in live])
        self.env_seconds += time.perf_counter() - t0
        for t, r in zip(live, results, strict=True):
            if _is_failure(r):
                self._failed(t, r, "step")
                continue
            if r.info.get("tool_calls"):
                t.turns[-1]["tool_calls"] = list(r.info["tool_calls"])
            if r.info.get("tool_errors"):
                t.turns[-1]["tool_errors"] = int(r.info["tool_errors"])
            if r.done and not r.messages:
                t.end("length" if t.cut else "stop")
                continue
            start = len(t.ids)
            ids = self.text.turn(t.messages, list(r.messages), t.stopped)
            t.ids += ids
            t.logprobs += [0.0] * len(ids)
            t.mask += [0] * len(ids)
            if ids and not t.versions:  # the environment's tokens carry the last model token's version, or now's
                t.versions.change(start, self.gen.policy_version)
            for m in r.messages:
                t.turns.append({"role": m.get("role", "user"), "content": m.get("content", ""), "start": start,
                                "end": len(t.ids), "tool_calls": [], "error": r.info.get("error")})
            t.messages += list(r.messages)
            if r.done:
                t.end("length" if t.cut else "stop")
            elif t.length >= self.limits.max_context:
                t.end("context")

    def _group(self, item: PromptItem, trajs: list[Trajectory], version: int, generator_id: str,
               precision: str) -> GroupRollout:
        comps = []
        for t in trajs:
            last = next((x["content"] for x in reversed(t.turns) if x["role"] == "assistant"), "")
            comps.append(Completion(token_ids=t.ids, logprobs=t.logprobs, finish_reason=t.finish, text=last,
                                    model_mask=t.mask, turns=t.turns, env_score=t.score,
                                    token_versions=t.versions.token_versions(len(t.ids), version)))
        return GroupRollout(item=item, prompt_ids=trajs[0].prompt_ids, completions=comps, policy_version=version,
                            generator_id=generator_id, precision=precision)


def _is_failure(x) -> bool:
    return isinstance(x, EnvFailure)


FINISHES = ("stop", "length", "max_turns", "context", "env_error")


def episode_metrics(groups: list[GroupRollout]) -> dict[str, float]:
    """What a step's multi-turn trajectories did (nothing for single-turn completions): model turns, tool calls and
    tool errors per trajectory, the share that called a tool at all, environment tokens per trajectory, and the share
    of each finish reason (episode/finish_length, episode/finish_context and episode/finish_max_turns: the truncated
    trajectories; length: the environment ended the trajectory on a model turn cut at turn_tokens)."""
    comps = [c for g in groups for c in g.completions if c.turns is not None]
    if not comps:
        return {}
    n = len(comps)
    calls = [sum(len(t.get("tool_calls") or []) for t in c.turns) for c in comps]
    m = {"episode/turns": sum(sum(t["role"] == "assistant" for t in c.turns) for c in comps) / n,
         "episode/tool_calls": sum(calls) / n,
         "episode/tool_errors": sum(t.get("tool_errors", 0) for c in comps for t in c.turns) / n,
         "episode/called_tool_frac": sum(x > 0 for x in calls) / n,
         "episode/env_tokens": sum(len(c.token_ids) - c.model_tokens for c in comps) / n}
    for reason in FINISHES:
        m[f"episode/finish_{reason}"] = sum(c.finish_reason == reason for c in comps) / n
    return m
