"""Prompt sources. A task is indexable: `item(i)` is a pure function of (task settings, seed, i), so the data cursor
of a run is one integer and resuming needs nothing else.

Three kinds, chosen by `task.name`:
- `digit_sum`: built in, for the tiny model trained from scratch (bare "3+4=" prompts, no instruction);
- `rg:NAME`: a reasoning-gym generator (`reasoning_gym.create_dataset(NAME, size, seed, **task.params)`);
- `jsonl` / `parquet` / `hf_disk`: a user file or saved `datasets` folder (rollout/data/datasets.py), plain or chat
rows. The last two append `task.instruction` to each question and carry JSON-safe `meta` for logs and `columns` for the
reward functions (their keyword arguments).
`check_task` reports every problem of a task as text before any expensive work; `make_task` raises on them.
"""
from __future__ import annotations

import dataclasses
import difflib
import random
from dataclasses import dataclass
from typing import Callable, Protocol

from qgrpo.core.records import PromptItem
from qgrpo.rollout.data.datasets import FORMATS, DatasetError, FileTask, json_safe, load_splits

RG_PREFIX = "rg:"
RG_SEED_STRIDE = 2**32  # run seed s uses reasoning-gym seeds s * 2**32 + [0, 2**32): runs never share entries
SPLITS = ("train", "eval")


class Task(Protocol):
    name: str

    def item(self, index: int) -> PromptItem: ...


@dataclass(frozen=True)
class DigitSum:
    """`3+4=` -> `7` (with `modulus` 3: `1`). Small enough that a randomly initialised tiny model can learn it with
    GRPO in minutes, so the whole loop can be tested end to end without a model hub. Held-out data uses another seed
    (`split`)."""

    seed: int = 0
    max_operand: int = 9
    num_operands: int = 2
    split: str = "train"
    name: str = "digit_sum"
    modulus: int = 0  # the answer is the sum modulo this (0: the sum itself)

    def item(self, index: int) -> PromptItem:
        rng = random.Random(f"{self.name}/{self.split}/{self.seed}/{index}")
        xs = [rng.randint(0, self.max_operand) for _ in range(self.num_operands)]
        return PromptItem(
            prompt_id=f"{self.name}-{self.split}-{index}",
            prompt="+".join(map(str, xs)) + "=",
            reference=str(sum(xs) % self.modulus if self.modulus else sum(xs)),
        )


class RGTask:
    """A reasoning-gym generator. reasoning-gym draws entry `j` of a dataset seeded S with `Random(S + j)`: datasets
    seeded 0 and 1 are the same stream shifted by one. Hence run seed `s` maps to S = s * RG_SEED_STRIDE (runs with
    seeds 0 and 1 see unrelated prompts), and:

    - train: `item(i)` is entry `i % task.size` of the dataset seeded S;
    - eval: `item(i)`, i < task.eval_size, is entry `i` of the dataset seeded S + task.eval_seed_offset;
      config validation requires `size <= eval_seed_offset`, so no eval entry reuses a train entry's generator seed.
    - Easy settings have few distinct questions (2-term 1-digit basic_arithmetic has about 3,000, and 91 of 100 eval
      questions also occur among 10,000 train entries), so the train split skips any entry whose question is in the
      eval split, taking the next entry of the pool instead: train never shows an eval question.

    An item's `columns` (the reward functions' keyword arguments) hold the entry's question, answer and metadata, and
    `rg_entry` = {task, params, seed, index, size}: `reasoning_gym.create_dataset(task, size=size, seed=seed,
    **params)[index]` rebuilds the entry in another process, for its dataset's `score_answer`.
    """

    def __init__(self, task_cfg, seed: int, split: str = "train"):
        import reasoning_gym

        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.name, self.split, self.instruction = task_cfg.name, split, task_cfg.instruction
        self.size, self.eval_size = task_cfg.size, task_cfg.eval_size
        rg_name, params = task_cfg.name[len(RG_PREFIX):], dict(task_cfg.params)
        self._rg_name, self._params = rg_name, json_safe(params)
        base = seed * RG_SEED_STRIDE
        self._eval = reasoning_gym.create_dataset(rg_name, size=max(self.eval_size, 1),
                                                  seed=base + task_cfg.eval_seed_offset, **params)
        if split == "eval":
            self._ds = self._eval
            self._exclude: frozenset[str] = frozenset()
        else:
            self._ds = reasoning_gym.create_dataset(rg_name, size=self.size, seed=base, **params)
            self._exclude = frozenset(self._eval[k]["question"] for k in range(self.eval_size))

    def __len__(self) -> int:
        return self.size if self.split == "train" else self.eval_size

    def _train_entry(self, index: int) -> tuple[int, dict]:
        j = index % self.size
        for _ in range(self.size):
            e = self._ds[j]
            if e["question"] not in self._exclude:
                return j, e
            j = (j + 1) % self.size
        raise ValueError(f"{self.name}: every one of the task.size={self.size} train questions is also in the eval "
                         "split; the generator has too few distinct questions for a held-out set (raise the difficulty "
                         "in task.params or lower task.eval_size)")

    def entry(self, index: int) -> tuple[int, dict]:
        """(dataset index, reasoning-gym entry {question, answer, metadata}) behind `item(index)`."""
        if self.split == "train":
            return self._train_entry(index)
        if not 0 <= index < self.eval_size:
            raise IndexError(f"{self.name} eval split has task.eval_size={self.eval_size} items; index {index} "
                             "is out of range")
        return index, self._ds[index]

    def item(self, index: int) -> PromptItem:
        j, e = self.entry(index)
        return PromptItem(
            prompt_id=f"{self.name}-{self.split}-{index}",
            prompt=f"{e['question']}\n{self.instruction}" if self.instruction else e["question"],
            reference=str(e["answer"]),
            meta={"split": self.split, "task": self.name, "rg_seed": self._ds.seed, "index": j, "entry": json_safe(e)},
            columns={"question": e["question"], "answer": json_safe(e["answer"]),
                     "metadata": json_safe(e.get("metadata", {})),
                     "rg_entry": {"task": self._rg_name, "params": self._params, "seed": self._ds.seed, "index": j,
                                  "size": self._ds.size}},
        )

    def score_answer(self, answer: str | None, item: PromptItem) -> float:
        """reasoning-gym's own verifier for an extracted answer. Some tasks accept answers other than the reference
        (countdown: any expression reaching the target) or give partial credit, which `(completion, reference)`
        rewards cannot see; this is the hook for a verifier that gets the item."""
        if item.meta["rg_seed"] != self._ds.seed:
            raise ValueError(f"item {item.prompt_id!r} comes from another split or seed than this task")
        return float(self._ds.score_answer(answer, self._ds[item.meta["index"]]))


def _file_task(seed: int, cfg, split: str = "train") -> FileTask:
    train, held, problems = load_splits(cfg)
    if problems:
        raise DatasetError(problems)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return FileTask(name=cfg.name, rows=train if split == "train" else held, split=split, instruction=cfg.instruction)


# name -> factory(seed, task config section, split); "rg:NAME" is resolved by make_task
TASKS: dict[str, Callable[..., Task]] = {
    "digit_sum": lambda seed, cfg, split="train": DigitSum(
        seed=seed, max_operand=cfg.max_operand, num_operands=cfg.num_operands, split=split, modulus=cfg.modulus
    ),
    "jsonl": _file_task,
    "parquet": _file_task,
    "hf_disk": _file_task,
}


class WithHistory:
    """A task whose items carry earlier chat turns: `task.system_prompt` as a system turn, then the worked examples of
    `task.examples` as user/assistant pairs (few-shot prompting), then the item's own earlier turns (a chat row's).
    An item with a system turn of its own (a chat row's, or task.system_column's) keeps it instead of
    `task.system_prompt`. Each example question gets `task.instruction` appended exactly as the real questions do
    (digit_sum has none)."""

    def __init__(self, task: Task, system_prompt: str, examples, instruction: str):
        self.task, self.name = task, task.name
        self.system = (("system", system_prompt),) if system_prompt else ()
        shots = []
        for ex in examples:
            q = f"{ex.question}\n{instruction}" if instruction and task.name != "digit_sum" else ex.question
            shots += [("user", q), ("assistant", ex.completion)]
        self.shots = tuple(shots)
        self.history = self.system + self.shots  # the turns every item gets (unless it has its own system turn)

    def item(self, index: int) -> PromptItem:
        it = self.task.item(index)
        own = it.history
        if own and own[0][0] == "system":
            return dataclasses.replace(it, history=own[:1] + self.shots + own[1:])
        return dataclasses.replace(it, history=self.system + self.shots + own)

    def __len__(self) -> int:
        return len(self.task)

    def __getattr__(self, name: str):  # entry(), score_answer(), split, ... of the wrapped task
        return getattr(self.task, name)


def make_task(task_cfg, seed: int, split: str = "train") -> Task:
    """The task of a config section. User files are read and checked here (DatasetError lists every problem)."""
    if task_cfg.name.startswith(RG_PREFIX):
        task = RGTask(task_cfg, seed, split)
    else:
        task = TASKS[task_cfg.name](seed, task_cfg, split)
    system, examples = getattr(task_cfg, "system_prompt", ""), getattr(task_cfg, "examples", ())
    return WithHistory(task, system, examples, task_cfg.instruction) if system or examples else task


def rg_config_problems(task_cfg) -> list[str]:
    """Config-time check of an `rg:` task: the generator exists and accepts `task.params`. Imports reasoning-gym."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError:
        return ["task.name: rg: tasks need reasoning-gym; `pip install reasoning-gym` or choose another task"]
    name = task_cfg.name[len(RG_PREFIX):]
    if name not in DATASETS:
        close = difflib.get_close_matches(name, DATASETS, n=3)
        hint = (f"did you mean {', '.join(RG_PREFIX + c for c in close)}?" if close
                else f"reasoning-gym has: {', '.join(sorted(DATASETS))}")
        return [f"task.name: unknown reasoning-gym task {name!r}; {hint}"]
    problems = [f"task.params.{k}: set by qgrpo, not a generator setting; use "
                f"{'run.seed' if k == 'seed' else 'task.size'} instead"
                for k in ("seed", "size") if k in task_cfg.params]
    params = {k: v for k, v in task_cfg.params.items() if k not in ("seed", "size")}
    try:
        reasoning_gym.create_dataset(name, size=1, seed=0, **params)[0]
    except Exception as e:  # the generator's own validation: TypeError for unknown keys, AssertionError for values
        config_cls = DATASETS[name][1]
        accepted = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
        problems.append(f"task.params: reasoning-gym's {name} rejects {params} ({type(e).__name__}: {e}); "
                        f"its settings are: {', '.join(accepted)}")
    return problems


def check_task(task_cfg, seed: int) -> list[str]:
    """Every problem of the configured task as text, [] if it can be used. Reads user files completely and draws the
    first items of both splits, so call it before starting Ray or loading models."""
    name = task_cfg.name
    if name in FORMATS:
        return load_splits(task_cfg)[2] or example_leaks(task_cfg, seed)
    if name.startswith(RG_PREFIX):
        problems = rg_config_problems(task_cfg)
        if problems:
            return problems
    elif name not in TASKS:
        return [f"task.name: unknown task {name!r}"]
    try:
        for split in SPLITS:
            task = make_task(task_cfg, seed, split)
            if split == "train" or task_cfg.eval_size > 0:
                task.item(0)
    except Exception as e:  # a generator that fails on real indices
        return [f"task: building the {split} split of {name!r} failed ({type(e).__name__}: {e})"]
    return example_leaks(task_cfg, seed)


def example_leaks(task_cfg, seed: int) -> list[str]:
    """A worked example whose question is also a held-out question would show the model that answer in every prompt
    of the evaluation: report it (eval questions are drawn for this; call only after the task itself checked out)."""
    if not task_cfg.examples or task_cfg.eval_size == 0:
        return []
    held = make_task(task_cfg, seed, "eval")  # a WithHistory: its user turns are the examples as the model sees them
    try:
        n = len(held)
    except TypeError:  # digit_sum is unbounded
        n = task_cfg.eval_size
    questions = {held.item(i).prompt for i in range(n)}
    shown = [content for role, content in held.history if role == "user"]
    return [f"task.examples[{i}]: its question {ex.question!r} is also in the held-out eval split, so evaluation would "
            "show the answer; use another question" for i, ex in enumerate(task_cfg.examples) if shown[i] in questions]


class PromptSampler:
    """Hands out prompts in order; `cursor` is the index of the next one (saved in checkpoints)."""

    def __init__(self, task: Task, cursor: int = 0):
        self.task = task
        self.cursor = cursor

    def next(self, n: int) -> list[PromptItem]:
        items = [self.task.item(self.cursor + i) for i in range(n)]
        self.cursor += n
        return items
