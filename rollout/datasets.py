"""User datasets: a JSONL or Parquet file with one prompt column and one answer column.

The file is read completely and checked once, before Ray starts (`rollout.tasks.check_task`, then `make_task`), so a
bad row stops the run with its line or row number instead of failing hours later:

- missing file; a missing column (the message names the columns present);
- JSONL: a line that is not valid JSON, or not a JSON object (line N, counted from 1, blank lines skipped);
- a row whose prompt or answer is missing, null, empty, or not a string or number (JSONL "line N", Parquet "row N"
  counted from 0). All malformed rows are reported at once, the first `MAX_REPORTED` of them by number.

Numbers are read as text ("7", "2.5"); the reward functions compare numbers by value.

Held-out data: `task.eval_path` names a second file whose first `task.eval_size` rows are the eval split; without it
the LAST `task.eval_size` rows of `task.path` are held out and the train split is the rows before them.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from qgrpo.core.records import PromptItem

FORMATS = ("jsonl", "parquet")
MAX_REPORTED = 20  # malformed rows listed one by one; the rest are counted


class DatasetError(ValueError):
    """All problems of a dataset, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid dataset ({len(problems)} problem{'s' * (len(problems) != 1)}):\n{lines}")


@dataclass(frozen=True)
class Row:
    prompt: str
    answer: str
    number: int  # JSONL: line number (from 1); Parquet: row index (from 0)


def _cell(row: dict, column: str) -> tuple[str | None, str | None]:
    """(text, None) for a usable value, (None, what is wrong) otherwise."""
    if column not in row:
        return None, f"no {column!r} field"
    v = row[column]
    if v is None:
        return None, f"{column!r} is null"
    if isinstance(v, bool):  # bool is an int in Python; true/false is almost surely a mistake here
        return None, f"{column!r} is a boolean ({v}), expected a string or number"
    if isinstance(v, str):
        return (v, None) if v.strip() else (None, f"{column!r} is empty")
    if isinstance(v, int):
        return str(v), None
    if isinstance(v, float):
        return (str(v), None) if math.isfinite(v) else (None, f"{column!r} is {v}, expected a finite number")
    if type(v).__name__ == "Decimal":  # Parquet decimal columns
        return str(v), None
    return None, f"{column!r} is a {type(v).__name__} ({str(v)[:40]}), expected a string or number"


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


def _parquet_records(path: Path, prompt_column: str, answer_column: str):
    import pyarrow.parquet as pq

    f = pq.ParquetFile(path)
    columns = list(f.schema_arrow.names)
    wanted = [c for c in (prompt_column, answer_column) if c in columns]
    table = f.read(columns=list(dict.fromkeys(wanted)))
    data = {c: table.column(c).to_pylist() for c in wanted}
    return [(i, {c: data[c][i] for c in wanted}) for i in range(table.num_rows)], columns


@lru_cache(maxsize=8)
def _read(path: str, fmt: str, prompt_column: str, answer_column: str, field: str, _stamp: tuple):
    p = Path(path).expanduser()
    label = "line" if fmt == "jsonl" else "row"
    errors: list[tuple[int, str]] = []
    try:
        if fmt == "jsonl":
            records, columns = _jsonl_records(p, errors)
        else:
            records, columns = _parquet_records(p, prompt_column, answer_column)
    except Exception as e:  # unreadable file: pyarrow raises ArrowInvalid and friends, open() raises OSError
        return (), [f"{field}: cannot read {path!r} as {fmt} ({type(e).__name__}: {e})"]

    problems = []
    missing = [c for c in (prompt_column, answer_column) if c not in columns]
    for c in missing:
        key = "prompt_column" if c == prompt_column else "answer_column"
        present = ", ".join(repr(x) for x in columns) or "none"
        problems.append(f"task.{key}: column {c!r} is not in {path!r}; columns present: {present}; "
                        f"set task.{key} to one of them")
    rows = []
    for n, rec in records:
        (prompt, p_err), (answer, a_err) = _cell(rec, prompt_column), _cell(rec, answer_column)
        wrong = [e for c, e in ((prompt_column, p_err), (answer_column, a_err)) if e and c not in missing]
        if wrong:
            errors.append((n, "; ".join(wrong)))
        elif not missing:
            rows.append(Row(prompt, answer, n))
    errors.sort()
    for n, msg in errors[:MAX_REPORTED]:
        problems.append(f"{field}: {path!r} {label} {n}: {msg}")
    if len(errors) > MAX_REPORTED:
        problems.append(f"{field}: {path!r}: {len(errors) - MAX_REPORTED} more malformed {label}s "
                        f"({len(errors)} in all; the first {MAX_REPORTED} are listed)")
    if not problems and not rows:
        problems.append(f"{field}: {path!r} has no rows")
    return tuple(rows), problems


def read_rows(path: str, fmt: str, prompt_column: str = "prompt", answer_column: str = "answer",
              field: str = "task.path") -> tuple[tuple[Row, ...], list[str]]:
    """All rows of a JSONL or Parquet file and every problem found; `field` names the config field in messages.
    Cached on the file's path, size and modification time, so checking and then loading reads the file once."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown dataset format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if not path:
        return (), [f"{field}: missing; set the path of a {fmt} file with "
                    f"{prompt_column!r} and {answer_column!r} columns"]
    p = Path(path).expanduser()
    if not p.is_file():
        return (), [f"{field}: file {path!r} does not exist"]
    st = os.stat(p)
    rows, problems = _read(str(path), fmt, prompt_column, answer_column, field, (st.st_size, st.st_mtime_ns))
    return rows, list(problems)


def load_splits(task_cfg) -> tuple[tuple[Row, ...], tuple[Row, ...], list[str]]:
    """(train rows, eval rows, problems) for `task.name` "jsonl" or "parquet"; the split is described above."""
    t, fmt = task_cfg, task_cfg.name
    rows, problems = read_rows(t.path, fmt, t.prompt_column, t.answer_column, "task.path")
    if t.eval_path:
        held, eval_problems = read_rows(t.eval_path, fmt, t.prompt_column, t.answer_column, "task.eval_path")
        problems += [e for e in eval_problems if e not in problems]  # a missing column is reported once
        if not eval_problems and len(held) < t.eval_size:
            problems.append(f"task.eval_size: {t.eval_path!r} has {len(held)} rows, fewer than "
                            f"task.eval_size={t.eval_size}; set task.eval_size={len(held)} or less")
        return rows, held[:t.eval_size], problems
    if rows and len(rows) <= t.eval_size:
        problems.append(f"task.eval_size: {t.path!r} has {len(rows)} rows; holding out the last "
                        f"task.eval_size={t.eval_size} leaves none to train on; lower task.eval_size or set "
                        "task.eval_path to a separate held-out file")
    cut = len(rows) - t.eval_size
    return rows[:cut], rows[cut:], problems


@dataclass(frozen=True)
class FileTask:
    """Rows of a user dataset as a task. Train: `item(i)` is row `i % len`; eval: `item(i)` for i < len only."""

    name: str  # "jsonl" | "parquet"
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
        )
