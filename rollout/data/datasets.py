"""User datasets: a JSONL or Parquet file, or a Hugging Face `datasets` folder written by `save_to_disk` ("hf_disk"),
with a prompt column and an answer column.

The data is read completely and checked once, before Ray starts (`rollout.tasks.check_task`, then `make_task`), so a
bad row stops the run with its line or row number instead of failing hours later:

- a missing file or folder; a folder that is not a saved dataset; a missing split or column (the message names the
  splits or columns present); a column named like a reward keyword argument (`RESERVED_COLUMNS`);
- JSONL: a line that is not valid JSON, or not a JSON object (line N, counted from 1, blank lines skipped);
- a row whose answer is missing, null, empty, or not a string or number (`task.answer_column = ""`: the rows have no
  answer column, and every reference is ""), or whose prompt is none of: a string, a number, a list of chat turns
  (JSONL "line N", Parquet and hf_disk "row N" counted from 0). All malformed rows are reported at once, the first
  `MAX_REPORTED` of them by number.

Numbers are read as text ("7", "2.5"); the reward functions compare numbers by value.

Chat rows: the prompt column may hold [{"role": ..., "content": ...}, ...] turns, roles system, user or assistant,
content a non-empty string, a system turn only first, the last turn the user's. That last turn is the question
(`Row.prompt`, where task.instruction is appended); the earlier turns become `Row.history`, rendered by the tokenizer's
chat template before it. `task.system_column` names a column whose text (null or empty: none) is the row's system turn.

Every column of a row, JSON-safe, is `Row.columns` (the prompt and answer columns included; JSONL: every key seen in
the file, null where a line lacks it): reward functions receive them as keyword arguments.

Held-out data: `task.eval_path` names a second file (or saved folder) whose first `task.eval_size` rows are the eval
split; hf_disk may instead name a split of the same folder in `task.eval_split`. Without either, the LAST
`task.eval_size` rows of `task.path` are held out and the train split is the rows before them.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from dataclasses import field as _field
from functools import lru_cache
from pathlib import Path
from typing import Any

from qgrpo.core.records import PromptItem

FORMATS = ("jsonl", "parquet", "hf_disk")
ROLES = ("system", "user", "assistant")
# keyword arguments every reward function gets from qgrpo itself: a column of that name would collide with one
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "references", "item_ids", "finish_reasons",
                    "env_scores", "turns")
MAX_REPORTED = 20  # malformed rows listed one by one; the rest are counted


class DatasetError(ValueError):
    """All problems of a dataset, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid dataset ({len(problems)} problem{'s' * (len(problems) != 1)}):\n{lines}")


class _Refused(Exception):
    """A problem that stops reading a dataset, already worded as `field: what; fix`."""


def json_safe(x: Any) -> Any:
    """Columns and metadata hold tuples, sets, Decimals, dates and numpy scalars; what reaches verifiers in other
    processes and the logs must survive json.dumps."""
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, (set, frozenset)):
        return sorted((json_safe(v) for v in x), key=repr)
    if hasattr(x, "tolist") and callable(x.tolist):  # numpy scalar or array
        return json_safe(x.tolist())
    if hasattr(x, "item") and callable(x.item):
        return json_safe(x.item())
    return str(x)


@dataclass(frozen=True)
class Row:
    prompt: str  # the question: the prompt column's text, or the content of its last (user) turn
    answer: str  # "" when task.answer_column = "" (no answer column)
    number: int  # JSONL: line number (from 1); Parquet and hf_disk: row index (from 0)
    history: tuple[tuple[str, str], ...] = ()  # the row's system turn, then its earlier chat turns
    columns: dict = _field(default_factory=dict)  # every column of the row, JSON-safe
    chat: bool = False  # the prompt column held chat turns


def _cell(row: dict, column: str, expected: str = "a string or number") -> tuple[str | None, str | None]:
    """(text, None) for a usable value, (None, what is wrong) otherwise."""
    if column not in row:
        return None, f"no {column!r} field"
    v = row[column]
    if v is None:
        return None, f"{column!r} is null"
    if isinstance(v, bool):  # bool is an int in Python; true/false is almost surely a mistake here
        return None, f"{column!r} is a boolean ({v}), expected {expected}"
    if isinstance(v, str):
        return (v, None) if v.strip() else (None, f"{column!r} is empty")
    if isinstance(v, int):
        return str(v), None
    if isinstance(v, float):
        return (str(v), None) if math.isfinite(v) else (None, f"{column!r} is {v}, expected a finite number")
    if type(v).__name__ == "Decimal":  # Parquet decimal columns
        return str(v), None
    return None, f"{column!r} is a {type(v).__name__} ({str(v)[:40]}), expected {expected}"


def _chat_turns(turns: list, column: str) -> tuple[tuple[tuple[str, str], ...] | None, str | None]:
    """((role, content), ...) of a prompt cell holding chat turns, or (None, every thing wrong with them)."""
    if not turns:
        return None, f"{column!r} is an empty list; expected chat turns ending with a user turn"
    wrong, out = [], []
    for k, turn in enumerate(turns):
        at = f"{column!r}[{k}]"
        if not isinstance(turn, dict):
            wrong.append(f"{at} is a {type(turn).__name__}, expected an object with 'role' and 'content'")
            continue
        role, content = turn.get("role"), turn.get("content")
        if role is None:
            wrong.append(f"{at} has no 'role'; roles are {', '.join(ROLES)}")
        elif not isinstance(role, str) or role not in ROLES:
            wrong.append(f"{at} has role {role!r}; roles are {', '.join(ROLES)}")
        elif role == "system" and k > 0:
            wrong.append(f"{at} is a system turn; only the first turn may be one")
        if content is None:
            wrong.append(f"{at} has no 'content'")
        elif not isinstance(content, str):
            wrong.append(f"{at} content is a {type(content).__name__}, expected a string")
        elif not content.strip():
            wrong.append(f"{at} has empty content")
        out.append((role, content))
    if not wrong and out[-1][0] != "user":
        wrong.append(f"{column!r} ends with a turn of role {out[-1][0]!r}; the last turn must be the user's (the "
                     "question the model answers)")
    return (None, "; ".join(wrong)) if wrong else (tuple(out), None)


def _row_parts(rec: dict, names: tuple[str, str, str]) -> tuple[dict, list[tuple[str, str]]]:
    """The pieces of one record, and (column, what is wrong) for each bad cell."""
    prompt_column, answer_column, system_column = names
    raw = rec.get(prompt_column)
    if isinstance(raw, (list, tuple)):
        turns, p_err = _chat_turns(list(raw), prompt_column)
    else:
        text, p_err = _cell(rec, prompt_column, "a string, a number or a list of chat turns")
        turns = None if p_err else (("user", text),)
    answer, a_err = _cell(rec, answer_column) if answer_column else ("", None)  # "": rows without answers
    system, s_err = rec.get(system_column) if system_column else None, None
    if system is not None and not isinstance(system, str):
        s_err = f"{system_column!r} is a {type(system).__name__}, expected a string (null: no system turn)"
        system = None
    wrong = [(c, e) for c, e in ((prompt_column, p_err), (answer_column, a_err), (system_column, s_err)) if e]
    if system and system.strip() and turns and turns[0][0] == "system":
        wrong.append((system_column, f"both {system_column!r} and a system turn in {prompt_column!r}; keep one"))
    history = (("system", system),) if system and system.strip() else ()
    return {"turns": turns, "answer": answer, "history": history, "chat": isinstance(raw, (list, tuple))}, wrong


def _jsonl_records(path: Path, errors: list[tuple[int, str]]) -> tuple[list[tuple[int, dict]], list[str]]:
    """(line number, object) for each line that parses; columns in order of first appearance."""
    records, columns = [], {}
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                errors.append((n, f"not valid UTF-8 ({e.reason} at byte {e.start})"))
                continue
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                errors.append((n, f"invalid JSON ({e.msg} at column {e.colno})"))
                continue
            if not isinstance(obj, dict):
                errors.append((n, f"expected a JSON object, got {type(obj).__name__}"))
                continue
            columns.update(dict.fromkeys(obj))
            records.append((n, obj))
    return records, list(columns)


def _parquet_records(path: Path) -> tuple[list[tuple[int, dict]], list[str]]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    return list(enumerate(table.to_pylist())), list(table.column_names)


def _hf_records(path: str, split: str, split_field: str, field: str) -> tuple[list[tuple[int, dict]], list[str], str]:
    """Rows of a `save_to_disk` folder (a DatasetDict: its split `split`), its columns, and how to name it."""
    p = Path(path).expanduser()
    if not ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file()):
        raise _Refused(f"{field}: {path!r} is not a dataset folder written by Dataset.save_to_disk or "
                       "DatasetDict.save_to_disk (it has neither state.json nor dataset_dict.json); save the data "
                       f"with save_to_disk and point {field} there, or set task.name to 'jsonl' or 'parquet' for a "
                       "file")
    try:
        import datasets
    except ImportError:
        raise _Refused("task.name: hf_disk needs the `datasets` package; `pip install datasets`") from None
    ds = datasets.load_from_disk(str(p))
    where = repr(path)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise _Refused(f"{split_field}: {path!r} has the splits {', '.join(map(repr, ds))}, not {split!r}; set "
                           f"{split_field} to one of them")
        ds, where = ds[split], f"{path!r} split {split!r}"
    elif split != "train":
        fix = ('set task.eval_split = "" (the last task.eval_size rows are then held out, or all of task.eval_path '
               "is the eval set)" if split_field == "task.eval_split" else 'leave task.split = "train"')
        raise _Refused(f"{split_field}: {path!r} holds one Dataset without splits, so split {split!r} cannot be "
                       f"picked; {fix}, or save a DatasetDict")
    data = ds.with_format(None)[:]
    columns = list(ds.column_names)
    return [(i, {c: data[c][i] for c in columns}) for i in range(ds.num_rows)], columns, where


@lru_cache(maxsize=8)
def _read(path: str, fmt: str, names: tuple[str, str, str], split: str, split_field: str, field: str, stamp: tuple):
    """(rows, problems) of one data source; `stamp` (its sizes and modification times) only keys the cache."""
    label = "line" if fmt == "jsonl" else "row"
    errors: list[tuple[int, str]] = []
    where = repr(path)
    try:
        if fmt == "jsonl":
            records, columns = _jsonl_records(Path(path).expanduser(), errors)
        elif fmt == "parquet":
            records, columns = _parquet_records(Path(path).expanduser())
        else:
            records, columns, where = _hf_records(path, split, split_field, field)
    except _Refused as e:
        return (), [str(e)]
    except Exception as e:  # unreadable: pyarrow raises ArrowInvalid and friends, open() raises OSError
        return (), [f"{field}: cannot read {path!r} as {fmt} ({type(e).__name__}: {e})"]

    problems = [f"{field}: column {c!r} in {where} has the name of a keyword argument that qgrpo passes to reward "
                f"functions ({', '.join(RESERVED_COLUMNS)}); rename the column in the data (and the task.*_column "
                "naming it)" for c in columns if c in RESERVED_COLUMNS]
    keys = ("prompt_column", "answer_column", "system_column")
    missing = [c for c in names if c and c not in columns]
    for key, c in zip(keys, names):
        if c and c in missing:
            present = ", ".join(repr(x) for x in columns) or "none"
            none = ' (or "" for no system column)' if key == "system_column" else ""
            problems.append(f"task.{key}: column {c!r} is not in {where}; columns present: {present}; "
                            f"set task.{key} to one of them{none}")
    rows = []
    for n, rec in records:
        parts, wrong = _row_parts(rec, names)
        wrong = [e for c, e in wrong if c not in missing]
        if wrong:
            errors.append((n, "; ".join(wrong)))
        elif not missing:
            *earlier, (_, question) = parts["turns"]
            rows.append(Row(question, parts["answer"], n, parts["history"] + tuple(earlier),
                            {c: json_safe(rec.get(c)) for c in columns}, parts["chat"]))
    errors.sort()
    for n, msg in errors[:MAX_REPORTED]:
        problems.append(f"{field}: {where} {label} {n}: {msg}")
    if len(errors) > MAX_REPORTED:
        problems.append(f"{field}: {where}: {len(errors) - MAX_REPORTED} more malformed {label}s "
                        f"({len(errors)} in all; the first {MAX_REPORTED} are listed)")
    if not problems and not rows:
        problems.append(f"{field}: {where} has no rows")
    return tuple(rows), problems


def _stamp(p: Path) -> tuple:
    """What changes when the data changes: a file's size and time, or those of every file in a folder."""
    if p.is_file():
        st = p.stat()
        return st.st_size, st.st_mtime_ns
    return tuple(sorted((str(f.relative_to(p)), f.stat().st_size, f.stat().st_mtime_ns)
                        for f in p.rglob("*") if f.is_file()))


def read_rows(path: str, fmt: str, prompt_column: str = "prompt", answer_column: str = "answer",
              field: str = "task.path", system_column: str = "", split: str = "train",
              split_field: str = "task.split") -> tuple[tuple[Row, ...], list[str]]:
    """All rows of a JSONL or Parquet file or a saved `datasets` folder (its split `split` when it is a DatasetDict;
    `split_field` names the field that chose it) and every problem found; `field` names the config field in messages.
    Cached on the path and the data's sizes and modification times, so checking and then loading reads it once."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown dataset format {fmt!r}; choose one of {', '.join(FORMATS)}")
    what = "folder written by save_to_disk" if fmt == "hf_disk" else f"{fmt} file"
    if not path:
        cols = f"{prompt_column!r} and {answer_column!r} columns" if answer_column else f"a {prompt_column!r} column"
        return (), [f"{field}: missing; set the path of a {what} with {cols}"]
    problem = path_problem(path, fmt, field)
    if problem:
        return (), [problem]
    names = (prompt_column, answer_column, system_column)
    rows, problems = _read(str(path), fmt, names, split, split_field, field, _stamp(Path(path).expanduser()))
    return rows, list(problems)


def path_problem(path: str, fmt: str, field: str) -> str | None:
    """Whether the data `path` names is there (a file, or a folder for hf_disk): the problem, or None."""
    p = Path(path).expanduser()
    if fmt != "hf_disk":
        return None if p.is_file() else f"{field}: file {path!r} does not exist"
    if p.is_dir():
        return None
    if p.is_file():
        return (f"{field}: {path!r} is a file; hf_disk reads a folder written by save_to_disk (for a .jsonl or "
                ".parquet file set task.name to 'jsonl' or 'parquet')")
    return f"{field}: folder {path!r} does not exist"


def load_splits(task_cfg) -> tuple[tuple[Row, ...], tuple[Row, ...], list[str]]:
    """(train rows, eval rows, problems) for `task.name` "jsonl", "parquet" or "hf_disk"; the split is described
    above."""
    t, fmt = task_cfg, task_cfg.name
    columns = (t.prompt_column, t.answer_column)
    rows, problems = read_rows(t.path, fmt, *columns, "task.path", t.system_column, t.split)
    if t.eval_path or (fmt == "hf_disk" and t.eval_split):
        if t.eval_path:
            split_field = "task.eval_split" if t.eval_split else "task.split"
            held, eval_problems = read_rows(t.eval_path, fmt, *columns, "task.eval_path", t.system_column,
                                            t.eval_split or t.split, split_field)
            source = repr(t.eval_path)
        else:
            held, eval_problems = read_rows(t.path, fmt, *columns, "task.path", t.system_column, t.eval_split,
                                            "task.eval_split")
            source = f"{t.path!r} split {t.eval_split!r}"
        problems += [e for e in eval_problems if e not in problems]  # a missing column is reported once
        if not eval_problems and len(held) < t.eval_size:
            problems.append(f"task.eval_size: {source} has {len(held)} rows, fewer than task.eval_size={t.eval_size}; "
                            f"set task.eval_size={len(held)} or less")
        train, held = rows, held[:t.eval_size]
    else:
        if rows and len(rows) <= t.eval_size:
            problems.append(f"task.eval_size: {t.path!r} has {len(rows)} rows; holding out the last "
                            f"task.eval_size={t.eval_size} leaves none to train on; lower task.eval_size or set "
                            "task.eval_path to a separate held-out file")
        cut = len(rows) - t.eval_size
        train, held = rows[:cut], rows[cut:]
    chat = next((r for r in train + held if r.chat), None)
    if chat and not t.chat_template:
        problems.append(f"task.chat_template: false, but the prompt column {t.prompt_column!r} holds chat turns "
                        f"(e.g. {'line' if fmt == 'jsonl' else 'row'} {chat.number}), which only the tokenizer's "
                        "chat template can render; set task.chat_template = true, or use plain-text prompts")
    return train, held, problems


@dataclass(frozen=True)
class FileTask:
    """Rows of a user dataset as a task. Train: `item(i)` is row `i % len`; eval: `item(i)` for i < len only."""

    name: str  # "jsonl" | "parquet" | "hf_disk"
    rows: tuple[Row, ...]
    split: str
    instruction: str

    def __len__(self) -> int:
        return len(self.rows)

    def item(self, index: int) -> PromptItem:
        if self.split == "train":
            row = self.rows[index % len(self.rows)]
        elif 0 <= index < len(self.rows):
            row = self.rows[index]
        else:
            raise IndexError(f"{self.name} eval split has {len(self.rows)} items (task.eval_size); "
                             f"index {index} is out of range")
        where = "line" if self.name == "jsonl" else "row"
        return PromptItem(
            prompt_id=f"{self.name}-{self.split}-{index}",
            prompt=f"{row.prompt}\n{self.instruction}" if self.instruction else row.prompt,
            reference=row.answer,
            meta={"split": self.split, "task": self.name, where: row.number},
            history=row.history,
            columns=dict(row.columns),
            chat=row.chat,
        )
