"""Tasks by name (reasoning-gym generators, user JSONL/Parquet files) and the <answer>-tag rewards."""
import json

import pytest

from qgrpo.cluster.config.schema import ConfigError, TaskConfig, load_config
from qgrpo.rollout.data.datasets import MAX_REPORTED, DatasetError
from qgrpo.rollout.data.tasks import RG_SEED_STRIDE, PromptSampler, check_task, make_task
from qgrpo.rollout.rewards import (
    REWARD_FUNCTIONS,
    answer_correct,
    answer_format,
    answers_match,
    extract_answer,
    last_number,
    lenient_correct,
)

EASY = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
INSTRUCTION = "Think briefly, then give only the final answer inside <answer></answer>."


def rg_cfg(**kw) -> TaskConfig:
    return TaskConfig(**{"name": "rg:basic_arithmetic", "params": dict(EASY), "size": 2000, "eval_size": 50,
                         "eval_seed_offset": 1_000_000, "instruction": INSTRUCTION, **kw})


@pytest.fixture(scope="module")
def rg_tasks():
    pytest.importorskip("reasoning_gym")
    cfg = rg_cfg()
    return make_task(cfg, 3, "train"), make_task(cfg, 3, "eval")


# ---------------------------------------------------------------------------------------------------------------
# reasoning-gym


def test_rg_task_by_name(rg_tasks):
    train, _ = rg_tasks
    it = train.item(0)
    entry = it.meta["entry"]
    assert it.prompt == entry["question"] + "\n" + INSTRUCTION
    assert it.reference == entry["answer"] and it.meta["split"] == "train"
    assert entry["metadata"]["num_terms"] == 2 and entry["metadata"]["num_digits"] == 1
    assert json.loads(json.dumps(it.meta)) == it.meta  # JSON-safe (reasoning-gym metadata holds tuples)
    # the reference is the value of the expression (basic_arithmetic divides exactly)
    assert float(it.reference) == eval(entry["metadata"]["expression"])
    assert len(train) == 2000


def test_rg_deterministic_by_seed(rg_tasks):
    train, _ = rg_tasks
    again = make_task(rg_cfg(), 3, "train")
    assert [train.item(i) for i in range(20)] == [again.item(i) for i in range(20)]
    a, b = train.item(5), train.item(5 + 2000)  # indices wrap modulo task.size; prompt_id keeps the cursor index
    assert (a.prompt, a.meta) == (b.prompt, b.meta) and b.prompt_id == "rg:basic_arithmetic-train-2005"
    other = make_task(rg_cfg(), 4, "train")
    assert [train.item(i).prompt for i in range(20)] != [other.item(i).prompt for i in range(20)]
    # reasoning-gym draws entry j with Random(S + j); run seeds are spread so seed 4 is not seed 3 shifted by one
    assert other.item(0).meta["rg_seed"] - train.item(0).meta["rg_seed"] == RG_SEED_STRIDE
    resumed = PromptSampler(again, cursor=7).next(3)
    assert resumed == [train.item(i) for i in range(7, 10)]


def test_rg_train_and_eval_are_disjoint(rg_tasks):
    train, held = rg_tasks
    cfg = rg_cfg()
    assert len(held) == cfg.eval_size
    evals = [held.item(i) for i in range(cfg.eval_size)]
    assert all(e.meta["split"] == "eval" for e in evals)
    # generator seeds: train uses S..S+size-1, eval S+offset..S+offset+eval_size-1
    t_seed, e_seed = train.item(0).meta["rg_seed"], evals[0].meta["rg_seed"]
    assert e_seed - t_seed == cfg.eval_seed_offset >= cfg.size
    # the easy generator repeats questions; the train split skips those in the eval split
    eval_questions = {e.meta["entry"]["question"] for e in evals}
    train_questions = [train.item(i).meta["entry"]["question"] for i in range(cfg.size)]
    assert not eval_questions & set(train_questions)
    with pytest.raises(IndexError, match="eval_size=50"):
        held.item(cfg.eval_size)


def test_rg_config_errors_all_at_once():
    pytest.importorskip("reasoning_gym")
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.path='builtin:tiny-digits'", "task.name='rg:basic_arithmatic'", "task.eval_size=-1",
                           "rollout.group_size=1"])
    msg = str(e.value)
    assert "task.name: unknown reasoning-gym task 'basic_arithmatic'; did you mean rg:basic_arithmetic" in msg
    assert "task.eval_size: must be >= 0" in msg and "rollout.group_size: must be >= 2" in msg

    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.path='builtin:tiny-digits'", "task.name='rg:basic_arithmetic'",
                           "task.params={min_terms=2, bogus=1}", "task.eval_seed_offset=10", "task.size=100"])
    msg = str(e.value)
    assert len(e.value.problems) == 2
    assert e.value.problems[0].startswith("task.eval_seed_offset: must be in task.size..")
    assert "task.params: reasoning-gym's basic_arithmetic rejects" in msg and "'bogus'" in msg
    assert "its settings are: min_terms, max_terms" in msg

    with pytest.raises(ConfigError, match=r"task.params: .*AssertionError: min_terms must be positive"):
        load_config(None, ["model.path='builtin:tiny-digits'", "task.name='rg:basic_arithmetic'",
                           "task.params={min_terms=0}"])
    with pytest.raises(ConfigError, match="task.params.seed: set by qgrpo"):
        load_config(None, ["model.path='builtin:tiny-digits'", "task.name='rg:chain_sum'", "task.params={seed=1}"])


def test_rg_params_from_toml(tmp_path):
    pytest.importorskip("reasoning_gym")
    f = tmp_path / "rg.toml"
    f.write_text('[model]\npath = "builtin:tiny-digits"\n[task]\nname = "rg:chain_sum"\neval_size = 8\n'
                 "params = { min_terms = 2, max_terms = 2, min_digits = 1, max_digits = 1 }\n")
    cfg = load_config(f)
    assert cfg.task.params == EASY and cfg.task.chat_template is True
    assert check_task(cfg.task, cfg.run.seed) == []
    with pytest.raises(ConfigError, match="task.params: expected a table"):
        load_config(f, ["task.params=3"])
    with pytest.raises(ConfigError, match="task.params: only rg: tasks take generator settings"):
        load_config(f, ["task.name='digit_sum'"])


def test_system_prompt_and_examples_become_chat_turns_before_every_question(tmp_path):
    pytest.importorskip("reasoning_gym")
    f = tmp_path / "ex.toml"
    f.write_text('[model]\npath = "builtin:tiny-digits"\n[task]\nname = "rg:basic_arithmetic"\neval_size = 20\n'
                 "params = { min_terms = 2, max_terms = 2, min_digits = 1, max_digits = 1 }\n"
                 f'instruction = "{INSTRUCTION}"\n'
                 'examples = [{ question = "Calculate 3 - 8.", completion = "3 - 8 = -5\\n<answer>-5</answer>" }]\n')
    cfg = load_config(f)
    assert check_task(cfg.task, 0) == []
    shots = (("user", "Calculate 3 - 8.\n" + INSTRUCTION), ("assistant", "3 - 8 = -5\n<answer>-5</answer>"))
    assert make_task(load_config(f, ["task.system_prompt='Be brief.'"]).task, 0).item(0).history == (
        ("system", "Be brief."),) + shots
    for split in ("train", "eval"):
        task = make_task(cfg.task, 0, split)
        it = task.item(1)
        assert it.history == shots
        # everything else is the zero-shot item, and the wrapped task still answers entry()/score_answer()
        zero = make_task(rg_cfg(size=cfg.task.size, eval_size=20), 0, split)
        assert it.prompt == zero.item(1).prompt and it.meta == zero.item(1).meta and len(task) == len(zero)
        assert task.score_answer(it.reference, it) == 1.0
    with pytest.raises(ConfigError, match=r"task.examples\[0\]: question and completion must both be non-empty"):
        load_config(f, ["task.examples=[{question='Calculate 1 + 1.', completion=''}]"])
    with pytest.raises(ConfigError, match=r"task.examples\[0\].answer: unknown key"):
        load_config(f, ["task.examples=[{question='Calculate 1 + 1.', answer='2'}]"])


def test_example_from_the_eval_split_is_refused():
    pytest.importorskip("reasoning_gym")
    import dataclasses

    from qgrpo.cluster.config.schema import Example

    cfg = rg_cfg(eval_size=20)
    question = make_task(cfg, 0, "eval").item(5).meta["entry"]["question"]
    leaky = dataclasses.replace(cfg, examples=[Example("Calculate 9 + 9.", "x"), Example(question, "x")])
    problems = check_task(leaky, 0)
    assert len(problems) == 1 and problems[0].startswith("task.examples[1]: its question")
    assert "held-out eval split" in problems[0]


def test_examples_in_the_prompt_tokens(tiny_model_path):
    """The generator renders history turns before the question: as chat turns, or as plain text without a template."""
    from transformers import AutoTokenizer

    from qgrpo.core.records import PromptItem
    from qgrpo.rollout.backends.common import format_prompt

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    item = PromptItem("p", "2+2=", "4", history=(("user", "1+1="), ("assistant", "2")))
    assert format_prompt(tok, item, chat_template=False) == tok("1+1=\n\n2\n\n2+2=")["input_ids"]
    assert format_prompt(tok, PromptItem("p", "2+2=", "4"), False) == tok("2+2=")["input_ids"]
    # With a chat template every turn is rendered in order, then the generation prompt.
    tok.chat_template = ("{% for m in messages %}{{ m.role[0] }}:{{ m.content }};{% endfor %}"
                         "{% if add_generation_prompt %}a:{% endif %}")
    expected = tok("u:1+1=;a:2;u:2+2=;a:", add_special_tokens=False)["input_ids"]
    assert format_prompt(tok, item, chat_template=True) == expected


# ---------------------------------------------------------------------------------------------------------------
# user files


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def file_cfg(path, **kw) -> TaskConfig:
    return TaskConfig(**{"name": "jsonl", "path": path, "eval_size": 2, "instruction": INSTRUCTION, **kw})


def test_jsonl_dataset_and_holdout(tmp_path):
    rows = [json.dumps({"prompt": f"{i}+1=?", "answer": i + 1, "extra": [1]}) for i in range(5)]
    path = write_jsonl(tmp_path / "d.jsonl", rows[:2] + [""] + rows[2:])  # blank lines are skipped
    cfg = file_cfg(path)
    assert check_task(cfg, 0) == []
    train, held = make_task(cfg, 0, "train"), make_task(cfg, 0, "eval")
    assert len(train) == 3 and len(held) == 2  # the last eval_size rows are held out
    it = train.item(0)
    assert it.prompt == "0+1=?\n" + INSTRUCTION and it.reference == "1" and it.meta == {
        "split": "train", "task": "jsonl", "line": 1}
    assert train.item(3) == PromptSampler(train, 3).next(1)[0] and train.item(3).prompt == it.prompt  # wraps
    assert held.item(1).reference == "5" and held.item(1).meta["line"] == 6
    with pytest.raises(IndexError):
        held.item(2)
    # a separate held-out file: all of path trains, the first eval_size rows of eval_path are held out
    ev = write_jsonl(tmp_path / "e.jsonl", [json.dumps({"prompt": "q", "answer": "a"})] * 3)
    train, held = make_task(file_cfg(path, eval_path=ev), 0), make_task(file_cfg(path, eval_path=ev), 0, "eval")
    assert len(train) == 5 and len(held) == 2 and held.item(0).reference == "a"
    plain = make_task(file_cfg(path, instruction="", prompt_column="answer", answer_column="prompt"), 0)
    assert plain.item(0).prompt == "1" and plain.item(0).reference == "0+1=?"


def test_parquet_dataset(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"question": [f"q{i}" for i in range(4)], "solution": [1.5, 2.0, 3.0, 4.0]}), path)
    cfg = TaskConfig(name="parquet", path=str(path), prompt_column="question", answer_column="solution", eval_size=1,
                     instruction=INSTRUCTION)
    assert check_task(cfg, 0) == []
    train, held = make_task(cfg, 0), make_task(cfg, 0, "eval")
    assert [train.item(i).reference for i in range(3)] == ["1.5", "2.0", "3.0"]
    assert held.item(0).prompt.startswith("q3\n")
    assert held.item(0).meta == {"split": "eval", "task": "parquet", "row": 3}
    assert answer_correct("<answer>2</answer>", train.item(1).reference) == 1.0


def test_malformed_rows_reported_together(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        '{"prompt": "ok", "answer": "1"}',
        '{"prompt": "broken", ',
        '[1, 2]',
        '{"prompt": null, "answer": "3"}',
        '{"prompt": "no answer"}',
        '{"prompt": "flag", "answer": true}',
        '{"prompt": "  ", "answer": {"x": 1}}',
        '{"prompt": "ok", "answer": 7}',
    ])
    problems = check_task(file_cfg(path, eval_size=0), 0)
    expected = ["line 2: invalid JSON", "line 3: expected a JSON object, got list", "line 4: 'prompt' is null",
                "line 5: no 'answer' field", "line 6: 'answer' is a boolean",
                "line 7: 'prompt' is empty; 'answer' is a dict"]
    assert len(problems) == len(expected), problems
    for fragment, problem in zip(expected, problems):
        assert problem.startswith("task.path: ") and fragment in problem, (fragment, problem)
    with pytest.raises(DatasetError) as e:
        make_task(file_cfg(path, eval_size=0), 0)
    assert e.value.problems == problems


def test_many_malformed_rows_are_capped(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", ['{"prompt": "p", "answer": null}'] * (MAX_REPORTED + 10))
    problems = check_task(file_cfg(path, eval_size=0), 0)
    assert len(problems) == MAX_REPORTED + 1
    assert f"line {MAX_REPORTED}: 'answer' is null" in problems[MAX_REPORTED - 1]
    assert "10 more malformed lines (30 in all" in problems[-1]


def test_malformed_parquet_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a", None, "c", ""], "answer": ["1", "2", None, "4"]}), path)
    problems = check_task(TaskConfig(name="parquet", path=str(path), eval_size=0), 0)
    assert [p.split("' ", 1)[1] for p in problems] == [
        "row 1: 'prompt' is null", "row 2: 'answer' is null", "row 3: 'prompt' is empty"]


def test_missing_column_names_the_present_ones(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"question": "q", "answer": "1"})] * 3)
    problems = check_task(file_cfg(path), 0)
    assert problems == [f"task.prompt_column: column 'prompt' is not in {path!r}; columns present: 'question', "
                        "'answer'; set task.prompt_column to one of them"]
    pq_path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"input": ["q"], "target": ["1"]}), pq_path)
    problems = check_task(TaskConfig(name="parquet", path=str(pq_path)), 0)
    assert len(problems) == 2 and all("columns present: 'input', 'target'" in p for p in problems)
    assert problems[0].startswith("task.prompt_column:") and problems[1].startswith("task.answer_column:")


def test_file_problems_before_any_work(tmp_path):
    assert check_task(file_cfg(str(tmp_path / "none.jsonl")), 0) == [
        f"task.path: file {str(tmp_path / 'none.jsonl')!r} does not exist"]
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"prompt": "q", "answer": "1"})] * 2)
    assert "leaves none to train on" in check_task(file_cfg(path), 0)[0]
    not_parquet = tmp_path / "d.parquet"
    not_parquet.write_text("hello")
    assert "cannot read" in check_task(TaskConfig(name="parquet", path=str(not_parquet)), 0)[0]
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.path='builtin:tiny-digits'", "task.name='jsonl'", "task.eval_path='/no/such.jsonl'"])
    assert [p.split(";")[0].split(" '")[0] for p in e.value.problems] == ["task.path: missing", "task.eval_path: file"]


# ---------------------------------------------------------------------------------------------------------------
# <answer> extraction and rewards


@pytest.mark.parametrize("text,expected", [
    ("<answer>7</answer>", "7"),
    ("think... <answer>\n  42 \n</answer>\n", "42"),
    ("<answer>3</answer> wait, no: <answer>4</answer>", "4"),  # the last block wins
    ("<answer>3</answer> then <answer>4", "3"),  # an unclosed last tag is not a block
    ("<answer><answer>5</answer></answer>", "5"),  # nested: the inner pair
    ("<answer>5</answer></answer>", "5"),
    ("<answer></answer>", ""),
    ("<Answer>5</Answer>", None),  # tags are case-sensitive
    ("<answer>7", None),
    ("7", None),
    ("", None),
    (None, None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("answer,reference,match", [
    ("7", "7", True), ("7.0", "7", True), ("7.", "7", True), ("1,234", "1234", True), ("1234", "1,234", True),
    ("-3", "-3", True), ("+3", "3", True), ("-3", "3", False), ("0.5", ".5", True), ("12,34", "1234", False),
    ("7 apples", "7", False), ("Paris.", "paris", True), ("New  York", "new york", True), ("", "", False),
    (None, "7", False), ("1e3", "1000", False), ("  7  ", "7", True),
])
def test_answers_match(answer, reference, match):
    assert answers_match(answer, reference) is match


def test_last_number():
    assert last_number("5 - -4 is 9.") == "9" and last_number("total 1,234.50 dollars") == "1,234.50"
    assert last_number("3 apples and -2") == "-2" and last_number("none") is None and last_number("") is None


def test_answer_rewards():
    assert answer_correct("so <answer>7.0</answer>", "7") == 1.0
    assert answer_correct("7", "7") == 0.0  # no tags, no credit
    assert answer_correct("<answer>7 apples</answer>", "7") == 0.0
    assert answer_correct("<answer>1</answer><answer>1,000</answer>", "1000") == 1.0
    assert lenient_correct("I think it is 7.", "7") == 1.0  # no tags: the last number
    assert lenient_correct("3 + 4 = 7 apples", "7") == 1.0
    assert lenient_correct("<answer></answer> 7", "7") == 0.0  # tags present: their (empty) content counts
    assert lenient_correct("nothing", "7") == 0.0 and lenient_correct("", "7") == 0.0

    assert answer_format("x <answer>7</answer>", "") == 1.0
    assert answer_format("<answer> </answer>", "") == 0.5  # empty
    assert answer_format("<answer>1</answer> <answer>2</answer>", "") == 0.5  # several
    assert answer_format("<answer>1</answer> <answer>", "") == 0.5  # stray tag
    assert answer_format("<answer>7", "") == 0.0 and answer_format("7", "") == 0.0 and answer_format("", "") == 0.0
    assert {"answer_correct", "answer_format", "lenient_correct", "correct", "exact"} <= set(REWARD_FUNCTIONS)


def test_digit_sum_modulus_answers_the_sum_modulo():
    """task.modulus = 3: the collapse-prone digit_sum of bench/loss_variants.py's second comparison: the answer is the
    sum modulo 3, the three answers about equally common (operands 0..9: 34 / 33 / 33 of 100 pairs)."""
    plain = make_task(TaskConfig(name="digit_sum"), seed=0)
    mod = make_task(TaskConfig(name="digit_sum", modulus=3), seed=0)
    for i in range(50):
        a, b = plain.item(i), mod.item(i)
        assert a.prompt == b.prompt and b.reference == str(int(a.reference) % 3)
    answers = [mod.item(i).reference for i in range(3000)]
    assert set(answers) == {"0", "1", "2"}
    assert all(0.30 < answers.count(x) / 3000 < 0.37 for x in "012")
