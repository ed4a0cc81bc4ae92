"""Every config under configs/ and examples/ loads as it is (`load_config`, run from the project folder as the docs
say), the examples' own data checks out, and each example does what examples/README.md says: the own_rewards
functions score hand-made completions as documented, the chat rows become the turns the model sees, and the
reward-model example trains one step on real Ray (the one slow test here, about a minute)."""
from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from qgrpo.cluster.config.schema import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.toml")) + sorted((ROOT / "examples").rglob("*.toml"))
EXAMPLES = [p for p in CONFIGS if p.is_relative_to(ROOT / "examples")]
# Presets whose model folder the user puts in place (configs/nanochat_*.toml: models/nanochat-d20 ...): the missing
# folder must be their only problem.
USER_MODEL = {"nanochat_d20.toml", "nanochat_d32.toml"}


def _not_installed_here() -> set[str]:
    """Config messages saying a backend cannot run on this machine (e.g. MLX after `make install-cuda`)."""
    from qgrpo.rollout.backends import REGISTRY

    return {msg for spec in REGISTRY.values() for key in ("rollout.backend", "reference.backend")
            for msg in spec.unavailable(key)}


def _load(path: Path) -> list[str]:
    try:
        load_config(path)
    except ConfigError as e:
        return e.problems
    return []


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_config_loads(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # paths in configs (task.path) are read against the current directory
    problems = _load(path)
    if path.name in USER_MODEL and not Path(tomllib.loads(path.read_text())["model"]["path"]).is_dir():
        assert problems and all(p.startswith("model.path: folder") for p in problems), problems
        return
    elsewhere = [p for p in problems if p in _not_installed_here()]
    if elsewhere and len(elsewhere) == len(problems):
        pytest.skip(f"{path.name}: {elsewhere[0]}")
    assert problems == [], f"{path.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_there_are_examples():
    assert (ROOT / "examples" / "own_task" / "config.toml") in EXAMPLES
    assert (ROOT / "examples" / "README.md").is_file()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_example_data_checks_out(path, monkeypatch):
    # Every row is read and checked, the held-out split is cut, and no worked example is a held-out question.
    from qgrpo.rollout.data.datasets import FORMATS, load_splits
    from qgrpo.rollout.data.tasks import check_task

    monkeypatch.chdir(ROOT)
    cfg = load_config(path)
    assert check_task(cfg.task, cfg.run.seed) == []
    if cfg.task.name in FORMATS:
        train, held, problems = load_splits(cfg.task)
        assert problems == [] and len(held) == cfg.task.eval_size and len(train) > 0


def test_own_task_data_is_what_the_readme_says():
    from qgrpo.rollout.data.datasets import read_rows

    rows, problems = read_rows(str(ROOT / "examples" / "own_task" / "problems.jsonl"), "jsonl", "question", "answer")
    assert problems == [] and len(rows) == 40 and len({r.prompt for r in rows}) == 40
    assert all(float(r.answer) == int(r.answer) for r in rows)  # whole-number answers


# ---------------------------------------------------------------------------------------------------------------
# The examples with a task, rewards or a reward model of their own (examples/README.md has a section for each)

OWN_REWARDS = ROOT / "examples" / "own_rewards" / "config.toml"
CHAT = ROOT / "examples" / "chat_task" / "config.toml"
REWARD_MODEL = ROOT / "examples" / "reward_model" / "config.toml"
REWARDS_FILE = "examples/own_rewards/rewards.py"


def test_every_example_has_a_readme_section():
    readme = (ROOT / "examples" / "README.md").read_text()
    for path in (OWN_REWARDS, CHAT, REWARD_MODEL):
        assert path in EXAMPLES
    for folder in sorted({p.parent.name for p in EXAMPLES}):
        assert f"## {folder}" in readme, folder
        assert f"qgrpo check examples/{folder}/config.toml" in readme, folder


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_example_passes_what_qgrpo_check_checks_before_the_model(path, monkeypatch):
    # `qgrpo check` = checked_config (config, data, reward functions imported and their signatures checked against
    # the columns, the reward model's section) + the model preflight, which needs the model and is left out here.
    import argparse

    from qgrpo.cluster.cli.train import checked_config
    from qgrpo.rollout.data.tasks import make_task
    from qgrpo.rollout.rewards.scoring import reward_problems

    monkeypatch.chdir(ROOT)
    cfg = checked_config(argparse.Namespace(config=str(path.relative_to(ROOT)), overrides=[]))
    columns = set(make_task(cfg.task, cfg.run.seed).item(0).columns or {}) if cfg.task.path else None
    assert reward_problems(cfg.rewards, columns) == []


def _config(path: Path, overrides: list[str] | None = None):
    return load_config(path, overrides or [])


def _item(task, question: str):
    """The train item of `task` whose row asks `question`."""
    return next(it for it in (task.item(i) for i in range(len(task))) if it.columns["question"] == question)


def _groups(pairs: list) -> list:
    """GroupRollouts of (PromptItem, [(completion text, number of tokens), ...]) pairs."""
    from qgrpo.core.records import Completion, GroupRollout

    return [GroupRollout(item, [1, 2, 3], [Completion(list(range(100, 100 + n)), [0.0] * n, "stop", text)
                                           for text, n in comps], 0, "g", "int8") for item, comps in pairs]


def _own(name: str):
    """A function of rewards.py, loaded as a reward worker loads it (from the source the driver reads)."""
    from qgrpo.rollout.rewards.calls import load_function, read_source

    field = f"rewards.functions[{name}].function"
    return load_function(read_source(f"{REWARDS_FILE}:{name}", field, ROOT), field)


@pytest.fixture
def own_task(monkeypatch):
    from qgrpo.rollout.data.tasks import make_task

    monkeypatch.chdir(ROOT)
    cfg = _config(OWN_REWARDS)
    return cfg, make_task(cfg.task, cfg.run.seed)


INCHES = "Convert 10 inches to centimetres (1 inch = 2.54 cm)."  # answer 25.4, tolerance 0.1
PARCEL = "A parcel weighs 2400 grams. What is its weight in kilograms?"  # answer 2.4, tolerance null


def test_own_rewards_data_has_tolerances_and_exact_rows(own_task):
    from qgrpo.rollout.data.datasets import read_rows

    rows, problems = read_rows(str(ROOT / "examples" / "own_rewards" / "problems.jsonl"), "jsonl", "question", "answer")
    assert problems == [] and len(rows) == 40 and len({r.prompt for r in rows}) == 40
    tolerances = [r.columns["tolerance"] for r in rows]
    assert 5 <= sum(t is not None for t in tolerances) <= 35 and all(t is None or t > 0 for t in tolerances)
    assert any("." in r.answer for r in rows) and any("." not in r.answer for r in rows)
    held = [r.columns["tolerance"] for r in rows[-own_task[0].task.eval_size:]]
    assert None in held and any(t is not None for t in held)  # the held-out rows have both kinds


def test_within_tolerance_reads_the_rows_own_tolerance(own_task):
    from qgrpo.core.records import PromptItem
    from qgrpo.rollout.rewards.calls import call_reward, group_kwargs

    _, task = own_task
    inches, parcel = _item(task, INCHES), _item(task, PARCEL)
    assert (inches.reference, inches.columns["tolerance"]) == ("25.4", 0.1)
    assert (parcel.reference, parcel.columns["tolerance"]) == ("2.4", None)
    words = PromptItem("hand-0", "Capital of France?", "Paris", columns={"question": "Capital of France?",
                                                                        "answer": "Paris", "tolerance": None})
    cases = [
        (inches, "10 x 2.54 = 25.4\n<answer>25.4</answer>", 1.0),
        (inches, "<answer>25.5</answer>", 1.0),  # exactly 0.1 away: in (decimals, not floats)
        (inches, "<answer>25.33 cm</answer>", 1.0),
        (inches, "<answer>25.6</answer>", 0.0),
        (inches, "10 x 2.54 = 25.40", 1.0),  # no tags: the last number
        (inches, "<answer>25.4</answer> no, <answer>30</answer>", 0.0),  # the last block counts
        (inches, "<answer>about twenty-five</answer> 25.4", 0.0),  # a block without a number is no answer
        (parcel, "<answer>2.4</answer>", 1.0),
        (parcel, "<answer>2.40</answer>", 1.0),  # null tolerance: the exact value, 2.40 == 2.4
        (parcel, "<answer>2.41</answer>", 0.0),
        (parcel, "<answer>2,400</answer>", 0.0),
        (parcel, "", 0.0),
        (words, "<answer>Paris</answer>", None),  # a reference that is not a number: does not apply
    ]
    kwargs = group_kwargs(_groups([(item, [(text, 5)]) for item, text, _ in cases]))
    assert kwargs["tolerance"][0] == 0.1 and kwargs["tolerance"][7] is None  # the column, one entry per completion
    assert call_reward(_own("within_tolerance"), kwargs) == [want for _, _, want in cases]


def test_length_penalty_counts_tokens_past_the_budget(own_task):
    from qgrpo.core.records import Completion
    from qgrpo.rollout.rewards.calls import call_reward, reward_kwargs

    _, task = own_task
    item = _item(task, PARCEL)
    lengths = [0, 10, 32, 33, 40, 48]
    comps = [Completion(list(range(n)), [0.0] * n, "length" if n == 48 else "stop", "x" * (200 - n)) for n in lengths]
    got = call_reward(_own("length_penalty"), reward_kwargs([item] * len(comps), comps))
    assert got == pytest.approx([0.0, 0.0, 0.0, -0.0625, -0.5, -1.0], abs=1e-12)  # tokens counted, not characters


def test_own_rewards_config_weights_sum_as_documented(own_task):
    # The configured entries, scored the way a reward worker scores a step: 1 x within_tolerance + 0.1 x
    # length_penalty + 0.2 x answer_format per completion, and each entry's mean as reward/LABEL.
    from qgrpo.rollout.rewards.calls import group_kwargs
    from qgrpo.rollout.rewards.scoring import Scores, combine, entries_from_config, make_callable, score_batch

    cfg, task = own_task
    entries = entries_from_config(cfg.rewards, ROOT)
    assert [(e.label, e.weight, e.kind) for e in entries] == [
        ("within_tolerance", 1.0, "function"), ("length_penalty", 0.1, "function"), ("answer_format", 0.2, "builtin")]
    comps = [("<answer>25.45</answer>", 8), ("25.4", 48), ("<answer>26</answer>", 40)]  # (text, tokens)
    kwargs = group_kwargs(_groups([(_item(task, INCHES), comps)]))
    scores = Scores(len(kwargs["completions"]))
    for result in score_batch(entries, {e.label: make_callable(e) for e in entries}, kwargs):
        assert result.error == "", result.error
        scores.add(result, 0, scores.n)
    totals, metrics = combine(entries, scores, kwargs["item_ids"], cfg.rewards.on_error)
    assert totals == pytest.approx([1.0 + 0.2, 1.0 - 0.1, -0.05 + 0.2], abs=1e-9)
    assert metrics["reward/within_tolerance"] == pytest.approx(2 / 3) and metrics["reward/errors"] == 0
    assert metrics["reward/length_penalty"] == pytest.approx((0.0 - 1.0 - 0.5) / 3)


def test_own_rewards_check_refuses_a_wrong_name_or_a_missing_column(monkeypatch):
    # The checks the examples pass can fail: a misspelt function, and a column the signature needs but the data lacks.
    import argparse

    from qgrpo.cluster.cli.train import Refused, checked_config
    from qgrpo.rollout.rewards.scoring import reward_problems

    monkeypatch.chdir(ROOT)
    typo = f"rewards.functions=[{{function='{REWARDS_FILE}:within_tolerence'}}]"
    with pytest.raises(Refused, match=r"rewards.functions\[0\].function: .*no 'within_tolerence'.*within_tolerance"):
        checked_config(argparse.Namespace(config=str(OWN_REWARDS), overrides=[typo]))
    (problem,) = reward_problems(_config(OWN_REWARDS).rewards, {"question", "answer"})
    assert problem.startswith("rewards.functions[0].function: requires 'tolerance'"), problem


def test_chat_rows_become_items_with_their_history(monkeypatch):
    # Each conversation, read here straight from the JSON: its system turn (else task.system_prompt), the worked
    # example, its earlier turns, then its last user turn with the instruction, which is the prompt.
    from qgrpo.rollout.data.tasks import make_task

    monkeypatch.chdir(ROOT)
    cfg = _config(CHAT)
    t = cfg.task
    rows = [json.loads(line) for line in (ROOT / t.path).read_text().splitlines() if line.strip()]
    assert len(rows) == 40
    shots = tuple((role, text) for ex in t.examples for role, text in (
        ("user", f"{ex.question}\n{t.instruction}"), ("assistant", ex.completion)))
    kinds = set()
    items = [make_task(t, cfg.run.seed, "train").item(i) for i in range(len(rows) - t.eval_size)]
    items += [make_task(t, cfg.run.seed, "eval").item(i) for i in range(t.eval_size)]
    for row, item in zip(rows, items, strict=True):
        turns = [(m["role"], m["content"]) for m in row["messages"]]
        own_system = turns[:1] if turns[0][0] == "system" else []
        earlier = turns[len(own_system):-1]
        kinds.add((bool(own_system), bool(earlier)))
        system = tuple(own_system) or (("system", t.system_prompt),)
        assert item.history == system + shots + tuple(earlier), item.prompt_id
        assert item.prompt == f"{turns[-1][1]}\n{t.instruction}" and turns[-1][0] == "user"
        assert item.reference == str(row["answer"])
        assert item.columns["messages"] == row["messages"]  # the reward functions get the turns as they were
    assert kinds == {(False, False), (True, False), (False, True), (True, True)}  # every kind of row is there


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
def test_reward_model_example_trains_a_step_and_logs_the_model_reward(ray_session, tiny_model_path, tmp_path,
                                                                    monkeypatch):
    from qgrpo.cluster.cli.app import main

    monkeypatch.chdir(ROOT)
    cache = Path(tiny_model_path).parents[1]  # the test cache: CACHE/models/tiny-digits-vN
    out = tmp_path / "runs"
    rc = main(["train", str(REWARD_MODEL.relative_to(ROOT)), "--set", "run.steps=1", "--set", f"run.output_dir='{out}'",
               "--set", f"model.cache_dir='{cache}'", "--set", "run.eval=false", "--set", "run.progress=false"])
    assert rc == 0
    (run_dir,) = out.iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (step,) = [m for m in rows if "reward/mean" in m]
    assert step["step"] == 1 and step["reward/errors"] == 0
    model, correct = step["reward/reward_model"], step["reward/correct"]
    assert model == model and abs(model) < 1e3 and 0.0 <= correct <= 1.0
    # every completion gets both rewards, so the mean total is the weighted sum of the means (weights 1 and 0.1)
    assert step["reward/mean"] == pytest.approx(correct + 0.1 * model, abs=1e-4)
    assert (run_dir / "checkpoints" / "step_000001" / "model.safetensors").is_file()


# ---------------------------------------------------------------------------------------------------------------
# `qgrpo check` itself, whole, on every shipped config and example, as a user types it from the project folder:
# config, data, each reward called once, an environment's or agent's probe episode, the model's preflight, the
# machine's rates and the run's estimate. A change in the core that breaks an example fails here.

GPU_PRESETS = {"gpu_single.toml", "gpu_node.toml", "cluster.toml"}  # their roles ask for GPUs (tests/test_gpu_plan.py)
CHECKED = [p for p in CONFIGS if p.parent == ROOT / "configs" or p.name == "config.toml"]


@pytest.mark.heavy
@pytest.mark.parametrize("path", CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_qgrpo_check_passes_on_every_shipped_config_this_machine_serves(path, monkeypatch, capsys):
    """Exit 0 and "OK: train would start"; on a machine that cannot serve the config, the one refusal that says why:
    the GPU presets without a GPU name `--gpus`, the nanochat presets the model folder the user puts in place."""
    import torch

    from qgrpo.cluster.cli.app import main

    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    rel = str(path.relative_to(ROOT))
    rc = main(["check", rel])
    out, err = capsys.readouterr()
    if path.name in GPU_PRESETS and torch.cuda.is_available():
        # whether this machine's GPUs fit the preset is its own question: tests/test_gpu_plan.py checks each preset
        # for the GPU counts it was written for (--gpus)
        assert rc in (0, 2) and "Traceback" not in out + err, out + err
        return
    if path.name in GPU_PRESETS:
        assert rc == 2, out + err
        assert "this machine has no GPU: `qgrpo check CONFIG --gpus N`" in out, out
        assert re.search(r"qgrpo check: REFUSED: \d+ problems?$", out.rstrip()) and "Traceback" not in out + err
        return
    if path.name in USER_MODEL and not Path(tomllib.loads(path.read_text())["model"]["path"]).is_dir():
        assert rc == 2 and "model.path: folder" in out + err, out + err
        return
    elsewhere = [m for m in _not_installed_here() if m in out + err]
    if rc == 2 and elsewhere:
        pytest.skip(f"{rel}: {elsewhere[0]}")
    assert rc == 0, f"qgrpo check {rel} refused:\n{out}\n{err}"
    assert out.rstrip().endswith("qgrpo check: OK: train would start"), out
