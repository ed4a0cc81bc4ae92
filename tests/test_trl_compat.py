"""Coming from TRL (docs/from_trl.md): reward functions written for TRL's GRPOTrainer score a chat dataset unchanged
(conversational prompts and completions), the built-ins and a URL reward read chat rows too, rows need no answer
column, and each reward entry's own score is a column of the rollouts Parquet."""
from __future__ import annotations

import dataclasses
import json
import re
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from qgrpo.cluster.config.schema import ConfigError, Example, TaskConfig, config_from_dict
from qgrpo.core.records import Completion, GroupRollout, PromptItem
from qgrpo.rollout.data.tasks import check_task, make_task
from qgrpo.rollout.rewards import REWARD_FUNCTIONS
from qgrpo.rollout.rewards.calls import call_reward, completion_text, group_kwargs, load_function, read_source

ROOT = Path(__file__).resolve().parents[1]
INSTRUCTION = "Think in <think></think>, then answer in <answer></answer>."

# Reward functions as TRL's GRPOTrainer documentation writes them for conversational data: each completion is a list
# holding one assistant message, each prompt the list of messages the model was given.
TRL_FILE = '''
import re

def format_reward_func(completions, **kwargs):
    """1 for a completion that is exactly <think>...</think><answer>...</answer>."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(pattern, content) else 0.0 for content in contents]

def answer_reward(prompts, completions, answer, **kwargs):
    """1 for the row's answer in <answer> tags, when the model was given a system turn; None for a bare question."""
    out = []
    for prompt, completion, a in zip(prompts, completions, answer):
        if prompt[0]["role"] != "system":
            out.append(None)
            continue
        found = re.search(r"<answer>(.*?)</answer>", completion[0]["content"])
        out.append(1.0 if found and found.group(1).strip() == str(a) else 0.0)
    return out

def brevity(completion_ids, **kwargs):
    return [-0.01 * len(ids) for ids in completion_ids]
'''


def chat(*turns):
    return [{"role": r, "content": c} for r, c in turns]


ROWS = [
    {"messages": chat(("system", "You add."), ("user", "1+1?"), ("assistant", "2"), ("user", "2+2?")), "answer": 4},
    {"messages": chat(("user", "3+3?")), "answer": 6},
    {"messages": "5+5?", "answer": 10},  # a plain row beside the chat rows keeps strings
]
TEXTS = ["<think>2+2 is 4</think><answer>4</answer>", "I think 4", "<think>3 and 3</think><answer>7</answer>"]


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _groups(items: list[PromptItem], texts: list[str]) -> list[GroupRollout]:
    return [GroupRollout(it, [1, 2], [Completion(list(range(len(t))), [0.0] * len(t), "stop", t) for t in texts],
                         0, "g", "bf16") for it in items]


def _fn(path: Path, name: str):
    return load_function(read_source(f"{path}:{name}", "f"), "f")


@pytest.fixture
def chat_items(tmp_path) -> list[PromptItem]:
    path = _write(tmp_path / "chat.jsonl", ROWS + ROWS[:1])
    cfg = TaskConfig(name="jsonl", path=path, eval_size=1, prompt_column="messages", instruction=INSTRUCTION,
                     system_prompt="Be brief.", examples=[Example("1+2?", "<answer>3</answer>")])
    assert check_task(cfg, 0) == []
    task = make_task(cfg, 0)
    return [task.item(i) for i in range(3)]


def test_trl_conversational_rewards_score_a_chat_dataset_unchanged(chat_items, tmp_path):
    (tmp_path / "trl_rewards.py").write_text(TRL_FILE)
    first, second, plain = chat_items
    assert (first.chat, second.chat, plain.chat) == (True, True, False)
    kwargs = group_kwargs(_groups(chat_items, TEXTS))
    # prompts: the whole conversation as the model was given it: its own system turn (task.system_prompt where the
    # row has none), the worked example, the row's earlier turns, then the question with the instruction
    shot = chat(("user", f"1+2?\n{INSTRUCTION}"), ("assistant", "<answer>3</answer>"))
    assert kwargs["prompts"][0] == chat(("system", "You add."), *[(m["role"], m["content"]) for m in shot],
                                        ("user", "1+1?"), ("assistant", "2"), ("user", f"2+2?\n{INSTRUCTION}"))
    assert kwargs["prompts"][3] == chat(("system", "Be brief."), *[(m["role"], m["content"]) for m in shot],
                                        ("user", f"3+3?\n{INSTRUCTION}"))
    assert kwargs["prompts"][6] == f"5+5?\n{INSTRUCTION}"  # the plain row: the question as a string
    assert kwargs["completions"][:3] == [[{"role": "assistant", "content": t}] for t in TEXTS]
    assert kwargs["completions"][6:] == TEXTS
    assert kwargs["prompts"][0] is not kwargs["prompts"][1]  # each completion's own list: a function may change it
    json.dumps(kwargs)  # what a URL reward is sent

    # the plain row's strings would break a conversational function, as in TRL: score the chat rows
    chat_only = {k: v[:6] for k, v in kwargs.items()}
    assert call_reward(_fn(tmp_path / "trl_rewards.py", "format_reward_func"), chat_only) == [1.0, 0.0, 1.0] * 2
    assert call_reward(_fn(tmp_path / "trl_rewards.py", "answer_reward"), chat_only) == [1.0, 0.0, 0.0, 0.0, 0.0,
                                                                                         0.0]
    assert call_reward(_fn(tmp_path / "trl_rewards.py", "brevity"), kwargs) == [-0.01 * len(t) for t in TEXTS] * 3


def test_builtins_and_score_texts_read_chat_completions(chat_items):
    from qgrpo.rollout.rewards.scoring import score_texts

    chat_kwargs = group_kwargs(_groups(chat_items[:2], TEXTS))
    plain_items = [PromptItem(it.prompt_id, it.prompt, it.reference, columns=it.columns) for it in chat_items[:2]]
    plain_kwargs = group_kwargs(_groups(plain_items, TEXTS))
    assert plain_kwargs["completions"] == TEXTS * 2 and chat_kwargs["completions"] != plain_kwargs["completions"]
    for name in ("answer_correct", "answer_format", "lenient_correct", "math_verify", "correct", "exact"):
        got = call_reward(REWARD_FUNCTIONS[name], chat_kwargs)
        assert got == call_reward(REWARD_FUNCTIONS[name], plain_kwargs), name
    assert call_reward(REWARD_FUNCTIONS["answer_correct"], chat_kwargs) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    # held-out accuracy and answer statistics score texts of chat items
    assert score_texts("answer_correct", ["<answer>4</answer>", "<answer>5</answer>"], chat_items[:2]) == [1.0, 0.0]
    assert completion_text([{"role": "assistant", "content": "x"}]) == "x" and completion_text("y") == "y"


def test_rg_score_reads_a_conversational_completion():
    task = make_task(TaskConfig(name="rg:basic_arithmetic", size=20, eval_size=2), 0)
    item = task.item(0)
    right = [{"role": "assistant", "content": f"<answer>{item.reference}</answer>"}]
    wrong = [{"role": "assistant", "content": "<answer>no</answer>"}]
    scores = REWARD_FUNCTIONS["rg_score"](completions=[right, wrong], rg_entry=[item.columns["rg_entry"]] * 2,
                                          question=[item.columns["question"]] * 2)
    assert scores[0] == 1.0 and scores[1] < 1.0


class _Echo(BaseHTTPRequestHandler):
    """Keeps each request's JSON body; scores 1 for a completion whose assistant message says "4"."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        data = json.dumps([float(c[0]["content"].endswith("<answer>4</answer>")) for c in body["completions"]])
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data.encode())

    def log_message(self, *args):
        pass


def test_a_url_reward_is_sent_chat_rows_as_a_function_gets_them(chat_items):
    from qgrpo.rollout.rewards.remote import RemoteReward

    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    srv.bodies = []
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        kwargs = group_kwargs(_groups(chat_items[:2], TEXTS))
        got = call_reward(RemoteReward(f"http://127.0.0.1:{srv.server_address[1]}/score", timeout_s=5), kwargs)
    finally:
        srv.shutdown()
    assert got == [1.0, 0.0, 0.0] * 2
    (body,) = srv.bodies
    assert body["prompts"] == kwargs["prompts"] and body["completions"] == kwargs["completions"]


# ------------------------------------------------------------------------------------------- no answer column


def test_rows_without_an_answer_column(tmp_path):
    rows = [{"prompt": f"Write a haiku about {w}.", "topic": w} for w in ("rain", "snow", "wind", "fog")]
    path = _write(tmp_path / "open.jsonl", rows)
    cfg = TaskConfig(name="jsonl", path=path, eval_size=1, answer_column="")
    assert check_task(cfg, 0) == []
    item = make_task(cfg, 0).item(1)
    assert (item.prompt, item.reference, item.columns) == ("Write a haiku about snow.", "", rows[1])
    assert make_task(cfg, 0, "eval").item(0).reference == ""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": [r["prompt"] for r in rows]}), tmp_path / "open.parquet")
    assert check_task(TaskConfig(name="parquet", path=str(tmp_path / "open.parquet"), eval_size=1,
                                 answer_column=""), 0) == []
    # a configured answer column that a row lacks is still an error
    problems = check_task(TaskConfig(name="jsonl", path=path, eval_size=1), 0)
    assert problems and "column 'answer' is not in" in problems[0]
    some = _write(tmp_path / "some.jsonl", [{**r, "answer": "x"} for r in rows[:3]] + rows[3:])
    problems = check_task(TaskConfig(name="jsonl", path=some, eval_size=1), 0)
    assert len(problems) == 1 and "line 4: no 'answer' field" in problems[0]


def _config(task: dict, functions: list[dict]):
    return config_from_dict({"model": {"path": "builtin:tiny-digits"}, "task": task,
                             "rewards": {"functions": functions}}, check_environment=False)


def test_rewards_that_need_references_are_refused_without_an_answer_column():
    task = {"name": "jsonl", "path": "open.jsonl", "answer_column": ""}
    cfg = _config(task, [{"name": "answer_format"}, {"function": "mine.py:judge"}, {"url": "http://grader:8/s"}])
    assert cfg.task.answer_column == ""
    with pytest.raises(ConfigError) as e:
        _config(task, [{"name": "answer_format"}, {"name": "answer_correct"}, {"name": "math_verify"}])
    mine = [p for p in e.value.problems if "task.answer_column" in p]
    assert [p.split(":")[0] for p in mine] == ["rewards.functions[1]", "rewards.functions[2]"]
    assert mine[0].startswith("rewards.functions[1]: answer_correct compares completions with the reference answer")
    assert "set task.answer_column to the column of answers" in mine[0]
    with pytest.raises(ConfigError, match="must be two different names"):
        _config({**task, "prompt_column": ""}, [{"name": "answer_format"}])
    _config({"name": "digit_sum", "answer_column": ""}, [{"name": "correct"}])  # no rows read: nothing to refuse


# ---------------------------------------------------------------------------------- per-entry scores in Parquet


def _pool_groups() -> list[GroupRollout]:
    items = [PromptItem(f"jsonl-train-{i}", f"q{i}", str(i), columns={"kind": k}) for i, k in enumerate("ab")]
    return _groups(items, ["0", "1", "xx"])


def test_result_fills_each_entry_score_per_group(tmp_path):
    from qgrpo.cluster.run.rewarding import RewardPool

    (tmp_path / "mine.py").write_text(textwrap.dedent('''
        def only_a(completions, kind, **kwargs):
            return [1.0 if k == "a" else None for k in kind]

        def fails(completions, **kwargs):
            raise ValueError("down")
    '''))
    cfg = config_from_dict({"model": {"path": "builtin:tiny-digits"}, "rewards": {
        "num_workers": 0, "on_error": "zero", "functions": [
            {"name": "correct"}, {"function": str(tmp_path / "mine.py:only_a"), "label": "only a", "weight": 2},
            {"function": str(tmp_path / "mine.py:fails")}]}}, check_environment=False)
    pool = RewardPool(cfg)
    try:
        scored = pool.submit(_pool_groups()).result()
        groups, metrics = scored.groups, scored.metrics
    finally:
        pool.close()
    assert groups[0].scores == {"correct": [1.0, 0.0, 0.0], "only a": [1.0, 1.0, 1.0], "fails": [None] * 3}
    assert groups[1].scores == {"correct": [0.0, 1.0, 0.0], "only a": [None] * 3, "fails": [None] * 3}
    assert groups[0].rewards == [3.0, 2.0, 2.0] and groups[1].rewards == [0.0, 1.0, 0.0]
    assert metrics["reward/errors"] == 6


def test_rollout_parquet_has_a_column_per_entry(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from qgrpo.cluster.rundir.rollout_log import RolloutWriter, score_column

    assert score_column("answer_correct") == "reward_answer_correct" and score_column("only a") == "reward_only_a"
    scores = [{"correct": [1.0, 0.0, 0.0], "only a": [1.0, 1.0, 1.0], "only-a": [0.5] * 3},
              {"correct": [0.0, 1.0, 0.0], "only a": [None] * 3, "only-a": [None] * 3}]
    groups = [dataclasses.replace(g, rewards=[0.0] * 3, advantages=[0.0] * 3, scores=s)
              for g, s in zip(_pool_groups(), scores)]
    writer = RolloutWriter(tmp_path, flush_every=1)
    writer.add(1, groups, 0)
    resumed = RolloutWriter(tmp_path, flush_every=1)  # a resumed run: a new writer, the same entries
    resumed.add(2, groups[1:], 0)
    table = pq.read_table(tmp_path / "rollouts")
    assert {"reward_correct", "reward_only_a", "reward_only_a_2"} <= set(table.column_names)
    assert table.schema.field("reward_only_a").type == pa.float64()
    t = table.to_pydict()
    got = sorted(zip(t["step"], t["reward_correct"], t["reward_only_a"], t["reward_only_a_2"]), key=repr)
    assert got == sorted([(1, 1.0, 1.0, 0.5), (1, 0.0, 1.0, 0.5), (1, 0.0, 1.0, 0.5), (1, 0.0, None, None),
                          (1, 1.0, None, None), (1, 0.0, None, None), (2, 0.0, None, None), (2, 1.0, None, None),
                          (2, 0.0, None, None)], key=repr)
    # a group without scores (none computed) gets nulls; a column first seen later is null before it
    late = RolloutWriter(tmp_path / "late", flush_every=2)
    bare = [dataclasses.replace(g, rewards=[0.0] * 3, advantages=[0.0] * 3, scores=s)
            for g, s in zip(_pool_groups(), ({}, {"correct": [1.0, 1.0, 1.0]}))]
    late.add(1, bare, 0)
    late.close()
    assert pq.read_table(tmp_path / "late" / "rollouts").column("reward_correct").to_pylist() == [None] * 3 + [1.0] * 3


# ------------------------------------------------------------------------------------------- a real short run


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
def test_a_trl_reward_file_trains_on_chat_rows_without_answers(ray_session, tiny_model_path, tmp_path, monkeypatch):
    """Two steps of the tiny model on chat rows with no answer column, rewarded by TRL-style conversational functions
    and a built-in that reads the chat completions; each entry's score reaches the rollouts Parquet."""
    import pyarrow.parquet as pq

    from qgrpo.cluster.cli.app import main

    monkeypatch.chdir(tmp_path)
    rows = [{"messages": chat(("user", f"{a}+{b}=")), "level": "easy"} for a in range(4) for b in range(4)]
    _write(tmp_path / "data.jsonl", rows)
    (tmp_path / "trl_rewards.py").write_text(TRL_FILE + textwrap.dedent('''
        def saw_chat(prompts, completions, **kwargs):
            return [float(p[-1]["role"] == "user" and c[0]["role"] == "assistant" and isinstance(c[0]["content"], str))
                    for p, c in zip(prompts, completions)]
    '''))
    rc = main(["train", str(ROOT / "configs" / "tiny.toml"), "--set", f"model.path='{tiny_model_path}'",
               "--set", f"run.output_dir='{tmp_path / 'runs'}'", "--set", "run.steps=2", "--set", "run.progress=false",
               "--set", "run.eval=false", "--set", "task.name='jsonl'", "--set", "task.path='data.jsonl'",
               "--set", "task.eval_size=2", "--set", "task.prompt_column='messages'", "--set", "task.answer_column=''",
               "--set", "rollout.prompts_per_step=4", "--set", "rollout.group_size=4",
               "--set", "algo.overlong_buffer=0",
               "--set", "rewards.functions=[{function='trl_rewards.py:saw_chat'}, "
                        "{function='trl_rewards.py:format_reward_func'}, {name='integer_format', weight=0.5}]"])
    assert rc == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["reward/saw_chat"] == 1.0 and m["reward/errors"] == 0 for m in steps)
    t = pq.read_table(run_dir / "rollouts").to_pydict()
    assert len(t["step"]) == 2 * 4 * 4 and set(t["reference"]) == {""}
    assert set(t["reward_saw_chat"]) == {1.0} and set(t["reward_format_reward_func"]) <= {0.0, 1.0}
    for total, fmt, integer, text in zip(t["reward"], t["reward_format_reward_func"], t["reward_integer_format"],
                                         t["completion"]):
        assert integer == float(re.fullmatch(r"\s*-?\d+\s*", text) is not None)
        assert total == pytest.approx(1.0 + fmt + 0.5 * integer)
