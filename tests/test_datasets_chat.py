"""Datasets for users' own tasks: chat-format prompt columns, per-row system prompts, saved Hugging Face `datasets`
folders (hf_disk), every column of a row reaching PromptItem.columns, and the rg_entry that rebuilds a reasoning-gym
entry in another process."""
import json

import pytest

from qgrpo.cluster.config.schema import ConfigError, Example, TaskConfig, load_config
from qgrpo.rollout.data.datasets import RESERVED_COLUMNS, DatasetError
from qgrpo.rollout.data.tasks import check_task, make_task

INSTRUCTION = "Give the final answer inside <answer></answer>."


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def chat(*turns):
    return [{"role": r, "content": c} for r, c in turns]


def jsonl_cfg(path, **kw) -> TaskConfig:
    return TaskConfig(**{"name": "jsonl", "path": path, "eval_size": 1, "prompt_column": "messages", **kw})


def test_default_instruction_is_empty(tmp_path):
    assert TaskConfig().instruction == ""
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"What is {i} + 1?", "answer": i + 1} for i in range(3)])
    cfg = load_config(None, ["model.path='builtin:tiny-digits'", "task.name='jsonl'", f"task.path='{path}'",
                             "task.eval_size=1"])
    assert cfg.task.instruction == ""
    assert make_task(cfg.task, 0).item(1).prompt == "What is 1 + 1?"  # the user's text, nothing appended


def test_chat_rows_become_history_and_prompt(tmp_path):
    rows = [
        {"messages": chat(("system", "You add."), ("user", "1+1?"), ("assistant", "2"), ("user", "2+2?")),
         "answer": 4, "level": "easy"},
        {"messages": chat(("user", "3+3?")), "answer": "6"},  # no "level": its column is null
        {"messages": "5+5?", "answer": 10, "level": "hard"},  # plain prompts may sit beside chat rows
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = jsonl_cfg(path, instruction=INSTRUCTION)
    assert check_task(cfg, 0) == []
    train, held = make_task(cfg, 0), make_task(cfg, 0, "eval")
    first = train.item(0)
    assert first.prompt == "2+2?\n" + INSTRUCTION and first.reference == "4"
    assert first.history == (("system", "You add."), ("user", "1+1?"), ("assistant", "2"))
    assert first.columns == {"messages": rows[0]["messages"], "answer": 4, "level": "easy"}
    second = train.item(1)
    assert (second.prompt, second.history) == ("3+3?\n" + INSTRUCTION, ())
    assert second.columns == {"messages": rows[1]["messages"], "answer": "6", "level": None}
    assert held.item(0).prompt == "5+5?\n" + INSTRUCTION and held.item(0).history == ()
    assert json.loads(json.dumps(first.columns)) == first.columns

    # task.system_prompt only where a row has no system turn of its own; examples after the system turn, before the
    # row's own earlier turns
    shots = [Example("Calculate 4 - 1.", "<answer>3</answer>")]
    task = make_task(jsonl_cfg(path, system_prompt="Be brief.", examples=shots), 0)
    shot_turns = (("user", "Calculate 4 - 1."), ("assistant", "<answer>3</answer>"))
    assert task.item(0).history == (("system", "You add."),) + shot_turns + (("user", "1+1?"), ("assistant", "2"))
    assert task.item(1).history == (("system", "Be brief."),) + shot_turns
    assert task.item(1).prompt == "3+3?" and task.item(1).columns == second.columns


def test_chat_turns_in_the_prompt_tokens(tmp_path, tiny_model_path):
    from transformers import AutoTokenizer

    from qgrpo.rollout.backends.common import format_prompt

    path = write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": chat(("system", "S"), ("user", "U1"), ("assistant", "A1"), ("user", "U2")), "answer": 1}] * 2)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tok.chat_template = ("{% for m in messages %}{{ m.role[0] }}:{{ m.content }};{% endfor %}"
                         "{% if add_generation_prompt %}a:{% endif %}")
    item = make_task(jsonl_cfg(path), 0).item(0)
    assert format_prompt(tok, item, chat_template=True) == tok("s:S;u:U1;a:A1;u:U2;a:", add_special_tokens=False)[
        "input_ids"]


def test_malformed_chat_turns_reported_by_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"messages": chat(("user", "fine")), "answer": 1},
        {"messages": ["hello"], "answer": 1},
        {"messages": chat(("user", "a"), ("bot", "b"), ("user", "c")), "answer": 1},
        {"messages": [{"role": "user"}], "answer": 1},
        {"messages": chat(("user", "  ")), "answer": 1},
        {"messages": chat(("user", "q"), ("assistant", "a")), "answer": 1},
        {"messages": chat(("user", "q"), ("system", "late"), ("user", "q2")), "answer": 1},
        {"messages": [], "answer": 1},
        {"messages": {"role": "user", "content": "q"}, "answer": 1},
        {"messages": [{"content": "q"}], "answer": 1},
        {"messages": [{"role": "user", "content": ["part"]}], "answer": 1},
    ])
    problems = check_task(jsonl_cfg(path, eval_size=0), 0)
    expected = [
        "line 2: 'messages'[0] is a str, expected an object with 'role' and 'content'",
        "line 3: 'messages'[1] has role 'bot'; roles are system, user, assistant",
        "line 4: 'messages'[0] has no 'content'",
        "line 5: 'messages'[0] has empty content",
        "line 6: 'messages' ends with a turn of role 'assistant'; the last turn must be the user's",
        "line 7: 'messages'[1] is a system turn; only the first turn may be one",
        "line 8: 'messages' is an empty list",
        "line 9: 'messages' is a dict",
        "line 10: 'messages'[0] has no 'role'; roles are system, user, assistant",
        "line 11: 'messages'[0] content is a list, expected a string",
    ]
    assert len(problems) == len(expected), problems
    for fragment, problem in zip(expected, problems):
        assert problem.startswith(f"task.path: {path!r} ") and fragment in problem, (fragment, problem)
    assert "expected a string, a number or a list of chat turns" in problems[7]
    with pytest.raises(DatasetError) as e:
        make_task(jsonl_cfg(path, eval_size=0), 0)
    assert e.value.problems == problems


def test_chat_rows_need_the_chat_template(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": "plain", "answer": 1},
                                                 {"messages": chat(("user", "q")), "answer": 2}, ])
    problems = check_task(jsonl_cfg(path, eval_size=0, chat_template=False), 0)
    assert len(problems) == 1 and problems[0].startswith("task.chat_template: false, but the prompt column 'messages'")
    assert "line 2" in problems[0] and "set task.chat_template = true, or use plain-text prompts" in problems[0]
    assert check_task(jsonl_cfg(path, eval_size=0), 0) == []


def test_system_column(tmp_path):
    rows = [{"q": "a?", "answer": 1, "sys": "Answer in French."}, {"q": "b?", "answer": 2, "sys": None},
            {"q": "c?", "answer": 3, "sys": ""}, {"q": "d?", "answer": 4}]
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    cfg = TaskConfig(name="jsonl", path=path, prompt_column="q", system_column="sys", eval_size=0)
    assert check_task(cfg, 0) == []
    items = [make_task(cfg, 0).item(i) for i in range(4)]
    assert [it.history for it in items] == [(("system", "Answer in French."),), (), (), ()]
    assert items[0].columns == {"q": "a?", "answer": 1, "sys": "Answer in French."} and items[3].columns["sys"] is None
    fallback = make_task(TaskConfig(name="jsonl", path=path, prompt_column="q", system_column="sys", eval_size=0,
                                    system_prompt="Be brief."), 0)
    assert [fallback.item(i).history for i in range(2)] == [(("system", "Answer in French."),),
                                                            (("system", "Be brief."),)]
    # the system column's turn comes before the row's chat turns
    path2 = write_jsonl(tmp_path / "c.jsonl", [
        {"messages": chat(("user", "hi"), ("assistant", "hello"), ("user", "q")), "answer": 1, "sys": "S"},
        {"messages": chat(("system", "own"), ("user", "q")), "answer": 1, "sys": "S"},
        {"messages": "q", "answer": 1, "sys": 7}])
    problems = check_task(jsonl_cfg(path2, eval_size=0, system_column="sys"), 0)
    assert [p.split(f"{path2!r} ")[1] for p in problems] == [
        "line 2: both 'sys' and a system turn in 'messages'; keep one",
        "line 3: 'sys' is a int, expected a string (null: no system turn)"]
    ok = write_jsonl(tmp_path / "ok.jsonl", [
        {"messages": chat(("user", "hi"), ("assistant", "hello"), ("user", "q")), "answer": 1, "sys": "S"}])
    assert make_task(jsonl_cfg(ok, eval_size=0, system_column="sys"), 0).item(0).history == (
        ("system", "S"), ("user", "hi"), ("assistant", "hello"))
    missing = check_task(TaskConfig(name="jsonl", path=path, prompt_column="q", system_column="role", eval_size=0), 0)
    assert missing == [f"task.system_column: column 'role' is not in {path!r}; columns present: 'q', 'answer', 'sys'; "
                       'set task.system_column to one of them (or "" for no system column)']


def test_parquet_rows_carry_every_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({
        "prompt": [chat(("system", "S"), ("user", f"q{i}")) for i in range(3)],
        "answer": [f"{i}" for i in range(3)],
        "tests": [[i, i + 1] for i in range(3)],
        "weight": [0.5, 1.0, 2.0],
    }), path)
    cfg = TaskConfig(name="parquet", path=str(path), eval_size=1)
    assert check_task(cfg, 0) == []
    it = make_task(cfg, 0).item(1)
    assert (it.prompt, it.history, it.reference) == ("q1", (("system", "S"),), "1")
    assert it.columns == {"prompt": chat(("system", "S"), ("user", "q1")), "answer": "1", "tests": [1, 2],
                          "weight": 1.0}
    assert make_task(cfg, 0, "eval").item(0).meta == {"split": "eval", "task": "parquet", "row": 2}


@pytest.mark.parametrize("reserved", ["completions", "item_ids"])
def test_reserved_column_name_is_refused(tmp_path, reserved):
    assert reserved in RESERVED_COLUMNS
    path = write_jsonl(tmp_path / "r.jsonl", [{"prompt": "q", "answer": 1, reserved: "x"}] * 3)
    problems = check_task(TaskConfig(name="jsonl", path=path, eval_size=1), 0)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"task.path: column {reserved!r} in {path!r} has the name of a keyword argument")
    assert "rename the column" in problems[0]


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face datasets folders (save_to_disk)


@pytest.fixture
def saved(tmp_path):
    datasets = pytest.importorskip("datasets")

    def rows(prefix, n):
        return {"question": [f"{prefix}{i}?" for i in range(n)], "answer": list(range(n)),
                "source": [f"{prefix}-src" for _ in range(n)]}

    single, both = tmp_path / "single", tmp_path / "dict"
    datasets.Dataset.from_dict(rows("s", 5)).save_to_disk(str(single))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows("t", 6)),
                          "test": datasets.Dataset.from_dict(rows("e", 3))}).save_to_disk(str(both))
    return str(single), str(both)


def hf_cfg(path, **kw) -> TaskConfig:
    return TaskConfig(**{"name": "hf_disk", "path": path, "prompt_column": "question", "eval_size": 2, **kw})


def test_hf_disk_dataset_and_dataset_dict(saved):
    single, both = saved
    assert check_task(hf_cfg(single), 0) == []
    train, held = make_task(hf_cfg(single), 0), make_task(hf_cfg(single), 0, "eval")
    assert len(train) == 3 and len(held) == 2  # the last eval_size rows are held out
    it = train.item(1)
    assert (it.prompt, it.reference, it.meta) == ("s1?", "1", {"split": "train", "task": "hf_disk", "row": 1})
    assert it.columns == {"question": "s1?", "answer": 1, "source": "s-src"}
    assert held.item(1).prompt == "s4?"

    # a DatasetDict: task.split trains, task.eval_split (its first eval_size rows) is the eval set
    cfg = hf_cfg(both, eval_split="test")
    assert check_task(cfg, 0) == []
    train, held = make_task(cfg, 0), make_task(cfg, 0, "eval")
    assert len(train) == 6 and [held.item(i).prompt for i in range(2)] == ["e0?", "e1?"]
    assert held.item(0).columns["source"] == "e-src"
    # no eval_split: the last rows of the training split are held out
    assert [make_task(hf_cfg(both), 0, "eval").item(i).prompt for i in range(2)] == ["t4?", "t5?"]
    # a separate held-out folder
    held = make_task(hf_cfg(both, eval_path=single), 0, "eval")
    assert len(make_task(hf_cfg(both, eval_path=single), 0)) == 6 and held.item(0).prompt == "s0?"


def test_hf_disk_through_the_config(saved):
    _, both = saved
    cfg = load_config(None, ["model.path='builtin:tiny-digits'", "task.name='hf_disk'", f"task.path='{both}'",
                             "task.prompt_column='question'", "task.eval_split='test'", "task.eval_size=3",
                             f"task.instruction='{INSTRUCTION}'"])
    assert make_task(cfg.task, 0).item(0).prompt == "t0?\n" + INSTRUCTION


def test_hf_disk_problems(saved, tmp_path):
    single, both = saved
    (tmp_path / "empty").mkdir()
    empty = str(tmp_path / "empty")
    problems = check_task(hf_cfg(empty), 0)
    assert len(problems) == 1 and problems[0].startswith(f"task.path: {empty!r} is not a dataset folder written by "
                                                         "Dataset.save_to_disk")
    assert check_task(hf_cfg(str(tmp_path / "none")), 0) == [f"task.path: folder {str(tmp_path / 'none')!r} does "
                                                             "not exist"]
    assert "is a file; hf_disk reads a folder" in check_task(hf_cfg(single + "/state.json"), 0)[0]
    assert check_task(hf_cfg(both, split="validation"), 0) == [
        f"task.split: {both!r} has the splits 'train', 'test', not 'validation'; set task.split to one of them"]
    problems = check_task(hf_cfg(single, eval_split="test"), 0)
    assert len(problems) == 1 and problems[0].startswith(f"task.eval_split: {single!r} holds one Dataset without "
                                                         "splits")
    problems = check_task(hf_cfg(both, eval_split="test", eval_size=5), 0)
    assert problems == [f"task.eval_size: {both!r} split 'test' has 3 rows, fewer than task.eval_size=5; set "
                        "task.eval_size=3 or less"]
    problems = check_task(hf_cfg(both, answer_column="label"), 0)
    assert problems[0].startswith(f"task.answer_column: column 'label' is not in {both!r} split 'train'; columns "
                                  "present: 'question', 'answer', 'source'")


def test_task_fields_only_where_read():
    base = ["model.path='builtin:tiny-digits'"]
    with pytest.raises(ConfigError) as e:
        load_config(None, base + ["task.system_column='sys'", "task.split='test'", "task.eval_split='test'"])
    assert [p.split(":")[0] for p in e.value.problems] == ["task.system_column", "task.split", "task.eval_split"]
    with pytest.raises(ConfigError, match="task.system_column: 'answer' is also the prompt or answer column"):
        load_config(None, base + ["task.name='jsonl'", "task.path='x.jsonl'", "task.system_column='answer'"])
    with pytest.raises(ConfigError, match="task.path: missing; set the folder written by save_to_disk"):
        load_config(None, base + ["task.name='hf_disk'"])


# ---------------------------------------------------------------------------------------------------------------
# reasoning-gym: the entry rebuilt elsewhere from the item's columns


@pytest.mark.parametrize("split", ["train", "eval"])
def test_rg_entry_rebuilds_the_entry(split):
    reasoning_gym = pytest.importorskip("reasoning_gym")
    cfg = TaskConfig(name="rg:basic_arithmetic", params={"min_terms": 2, "max_terms": 3, "min_digits": 1,
                                                         "max_digits": 2}, size=500, eval_size=20)
    task = make_task(cfg, 5, split)
    for i in (0, 7, 13):
        item = task.item(i)
        columns = json.loads(json.dumps(item.columns))  # what a verifier in another process receives
        assert set(columns) == {"question", "answer", "metadata", "rg_entry"}
        e = columns["rg_entry"]
        assert e["task"] == "basic_arithmetic" and e["params"] == cfg.params
        entry = reasoning_gym.create_dataset(e["task"], size=e["size"], seed=e["seed"], **e["params"])[e["index"]]
        rebuilt = reasoning_gym.create_dataset(e["task"], size=e["size"], seed=e["seed"], **e["params"])
        assert entry["question"] == columns["question"] == item.prompt and entry["answer"] == columns["answer"]
        for answer in (item.reference, str(float(item.reference) + 1), "no idea"):
            assert rebuilt.score_answer(answer, entry) == task.score_answer(answer, item)
        assert task.score_answer(item.reference, item) == 1.0


def test_digit_sum_has_no_columns():
    item = make_task(TaskConfig(), 0).item(0)
    assert not item.columns
