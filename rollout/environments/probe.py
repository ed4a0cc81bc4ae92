"""`qgrpo check` (and `qgrpo train`, before Ray starts) refuses an environment that cannot run, naming it.

Two stages, as for rewards. `load_problems` (with the config's other checks that need no model): the file is read,
NAME is in it, it is an Environment subclass or a factory, environment.params bind to its parameters, and a class's
tools have JSON schemas. `probe_environment` (with the reward calls): one instance made and reset from the first train
row, its tools' schemas checked, one step taken with a stand-in turn (the row's reference answer, as a model that
answers at once would write it), and its score read, each call under environment.timeout_s as a worker runs it
(rollout/environments/host.py). Then each of `other_turns` (a wrong answer, an empty turn, a long one, a malformed tool
call: what a model in training writes) from a fresh reset, stepped and scored: an environment whose step raises on
any of them is refused, since in a run each such turn would end its trajectory as "env_error" with a score of 0, on
most turns of a model that has not learned the task yet. Neither needs the model or the episode loop.

Both check what the episode loop plays (an environment whose kind has `episode_loop`, rollout/environments/kinds.py)
and answer [] for anything else: an agent program's checks are rollout/agents/probe.py's.
"""
from __future__ import annotations

from qgrpo.rollout.environments.contract import EnvFailure, row_of
from qgrpo.rollout.environments.host import EnvHost
from qgrpo.rollout.environments.kinds import capabilities
from qgrpo.rollout.environments.loader import (
    NAME_FIELD,
    EnvironmentLoadError,
    checked_tools,
    environment_spec,
    factory_of,
)
from qgrpo.rollout.environments.tools import tool_name
from qgrpo.rollout.rewards.probe import Probe, first_row, reported, wrong_answer

KEY = "check"


def load_problems(env_cfg) -> list[str]:
    """The environment named by `env_cfg` ([environment]) is read, imported in this process and its params bound;
    [] when it loads (or none is set, or it is not played by the episode loop)."""
    if not capabilities(env_cfg.name).episode_loop:
        return []
    try:
        factory_of(environment_spec(env_cfg.name, env_cfg.params))
    except EnvironmentLoadError as e:
        return [str(e)]
    return []


def stand_in_turn(item) -> str:
    """The model turn the probe steps with: the row's reference answer (a text without tool calls)."""
    return str(item.reference)


LONG_WORDS = 300  # words of the long stand-in turn (about as many tokens: a turn cut at turn_tokens mid-sentence)


def other_turns(item, tools: list) -> dict[str, str]:
    """What a model in training writes besides the answer, by name: a wrong answer (rollout/rewards/probe.py's, as
    the reward probe uses), an empty turn, a long turn that ends mid-sentence, a tool call whose JSON is cut short
    (naming the environment's first tool, if any)."""
    name = tool_name(tools[0]) if tools else "calculate"
    return {"a wrong answer": wrong_answer(str(item.reference)), "an empty turn": "",
            "a long turn": " ".join(["the answer might be"] * (LONG_WORDS // 4)) + " so",
            "a malformed tool call": f'<tool_call>{{"name": "{name}", "arguments": {{"</tool_call>'}


def probe_environment(env_cfg, item) -> Probe:
    """One trajectory of the environment on `item` (a train PromptItem): reset, a step with `stand_in_turn`, score."""
    out = Probe()
    head = f"{NAME_FIELD} ({env_cfg.name})"
    try:
        host = EnvHost(factory_of(environment_spec(env_cfg.name, env_cfg.params)), env_cfg.timeout_s)
    except EnvironmentLoadError as e:
        out.problems.append(str(e))
        return out
    on = f"train row {item.prompt_id}"
    fix = {"reset": "fix reset(row) (it gets the row's prompt, answer and columns)",
           "step": "fix step(turn) (it gets the model's turn as text and returns a StepResult)",
           "score": "fix score() (a finite number)"}

    def failed(what: str, r: EnvFailure) -> bool:
        if not isinstance(r, EnvFailure):
            return False
        if r.timed_out:
            out.problems.append(f"{head}: {what} on {on} did not return within environment.timeout_s = "
                                f"{env_cfg.timeout_s:g} s; make it faster or raise environment.timeout_s")
        else:
            at = f" at {r.where}" if r.where else ""
            out.problems.append(f"{head}: {what} on {on} raised {r.error}{at}; {fix[what]}")
        return True

    (first,) = host.reset([KEY], [row_of(item)])
    if failed("reset", first):
        return out
    env = host.envs[KEY]
    try:
        tools = checked_tools(getattr(env, "tools", []), type(env).__name__)
    except EnvironmentLoadError as e:
        out.problems.append(str(e))
        return out
    turn = stand_in_turn(item)
    (step,) = host.step([KEY], [turn])
    if failed("step", step):
        return out
    (score,) = host.score([KEY])
    if failed("score", score):
        return out
    if step.done and score <= 0:
        out.hints.append(f"{head}: a first turn answering {turn[:40]!r}, the reference answer of {on}, ended the "
                         f"episode with a score of {score:g}; if the environment judges answers, make sure it reads "
                         "them as the task's references are written")
    host.drop([KEY])
    others = other_turns(item, tools)
    for n, (what, text) in enumerate(others.items()):
        if not _answers(host, f"{KEY}-{n}", item, what, text, head, env_cfg.timeout_s, out):
            return out
    answer = "done" if step.done else f"{len(step.messages)} message{'s' * (len(step.messages) != 1)}"
    out.found = (f"{env_cfg.name.rpartition(':')[2]}: reset gives {len(first)} message{'s' * (len(first) != 1)}"
                 + (f" and {len(tools)} tool{'s' * (len(tools) != 1)}" if tools else "")
                 + f", a step with {turn[:20]!r} answers {answer}, score {score:g}; it answers "
                 + ", ".join(others))
    return out


def _answers(host: EnvHost, key: str, item, what: str, text: str, head: str, timeout_s: float, out: Probe) -> bool:
    """A fresh trajectory on `item` stepped with the stand-in turn `text` and scored; False (a problem in `out`)
    when a call raised or passed its deadline."""
    (first,) = host.reset([key], [row_of(item)])
    if isinstance(first, EnvFailure):  # reset answered the reference's trajectory: a flaky reset, named as such
        out.problems.append(f"{head}: reset on train row {item.prompt_id} failed the second time it was called "
                            f"({first.error}{' at ' + first.where if first.where else ''}); reset(row) must work for "
                            "every trajectory of a row")
        return False
    shown = repr(text if len(text) <= 40 else text[:37] + "...")
    for call in ("step", "score"):
        (r,) = host.step([key], [text]) if call == "step" else host.score([key])
        if not isinstance(r, EnvFailure):
            continue
        if r.timed_out:
            out.problems.append(f"{head}: {call} after {what} ({shown}) did not return within environment.timeout_s "
                                f"= {timeout_s:g} s; make it faster or raise environment.timeout_s")
        else:
            at = f" at {r.where}" if r.where else ""
            out.problems.append(
                f"{head}: {call} after {what} ({shown}) raised {r.error}{at}; {call}() must answer any text the "
                "model can write: answer a turn it cannot use with a message telling the model so (e.g. "
                "StepResult([{\"role\": \"user\", \"content\": \"answer with one number\"}])), or end the "
                "episode with done=True and a low score, rather than raise (in a run, every such turn would end its "
                "trajectory as \"env_error\" with a score of 0)")
        host.drop([key])
        return False
    host.drop([key])
    return True


def probe_environment_checks(cfg, progress=None) -> list[str]:
    """`probe_environment` on the first train row of `cfg`'s task, for `qgrpo check` and `qgrpo train` before Ray
    starts: what passed told to `progress`; returns the problems ([] also when no environment is set, or it is not
    played by the episode loop)."""
    if not capabilities(cfg.environment.name).episode_loop or (item := first_row(cfg)) is None:
        return []
    return reported(probe_environment(cfg.environment, item), progress, "env calls")
