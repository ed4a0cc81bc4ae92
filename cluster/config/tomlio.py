"""TOML in and out: `--set section.key=value` overrides read against the schema, and a config (or the part of one a
translation set) written back as TOML that loads as the same config.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import tomllib
from pathlib import Path
from typing import Any

from qgrpo.cluster.config.errors import field_at

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def parse_value(raw: str, text_field: bool = False) -> Any:
    """A value as written after `=`: a TOML value (1e-5, true, [1, 2], {a = 1}, 'quoted'), else the bare word as
    text (--set rollout.precision=int8). For a text field (`text_field`) an unquoted value is always the text
    itself, so --set run.name=2024 names the run "2024" instead of failing as an int."""
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
    return raw if text_field and not isinstance(value, str) else value


def is_text_field(schema: type | None, dotted: str) -> bool:
    """Whether `dotted` (e.g. "run.name") is a str field of `schema`."""
    if schema is None:
        return False
    info, _ = field_at(schema, tuple(dotted.split(".")))
    return info is not None and info.annotation is str


def set_path(data: dict, dotted: str, raw: str, problems: list[str], schema: type | None = None) -> None:
    """section.key=value, or section.table.key=value for a nested table such as [rollout.vllm], into `data`."""
    parts = dotted.split(".")
    if len(parts) < 2 or not all(parts):
        problems.append(f"--set {dotted}={raw}: expected section.key=value, e.g. --set learner.lr=1e-5")
        return
    value = parse_value(raw, is_text_field(schema, dotted))
    table = data
    for i, part in enumerate(parts[:-1]):
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            problems.append(f"--set {dotted}: [{'.'.join(parts[:i + 1])}] is not a table")
            return
    table[parts[-1]] = value


def apply_overrides(data: dict, overrides: list[str] | tuple[str, ...], problems: list[str],
                    schema: type | None = None) -> None:
    """Every `section.key=value` of `overrides` into `data`; malformed ones are problems."""
    for item in overrides:
        if "=" not in item:
            problems.append(f"--set {item}: expected section.key=value")
            continue
        key, raw = item.split("=", 1)
        set_path(data, key.strip(), raw.strip(), problems, schema)


# ---------------------------------------------------------------------------------------------------------------------
# Writing


def _key(k: str) -> str:
    return k if _BARE_KEY.fullmatch(k) else json.dumps(k)


def value_text(v: Any) -> str:
    """One value as TOML (inline tables and arrays for nested values)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v).replace("\x7f", "\\u007f")  # JSON's escapes are TOML's; DEL must be escaped in TOML
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if v != v else ("inf" if v > 0 else "-inf")
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {value_text(x)}" for k, x in v.items()) + " }" if v else "{}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(value_text(x) for x in v) + "]"
    return repr(v)


def _is_section(schema: type | None, loc: tuple) -> bool:
    """Whether `loc` is a nested section of the schema (a table of its own), not a free table such as task.params."""
    info = field_at(schema, loc)[0] if schema is not None else None
    return info is not None and dataclasses.is_dataclass(info.annotation)


def _table(name: str, table: dict, schema: type | None) -> list[str]:
    """[name] with its values, then its nested sections ([rollout.vllm]) as tables of their own."""
    nested = [k for k, v in table.items() if isinstance(v, dict) and _is_section(schema, (*name.split("."), k))]
    lines = [f"[{name}]"] + [f"{_key(k)} = {value_text(v)}" for k, v in table.items() if k not in nested] + [""]
    for k in nested:
        lines += _table(f"{name}.{k}", table[k], schema)
    return lines


def to_toml(data: Any, schema: type | None = None) -> str:
    """A config (a Config, or a dict of sections such as a translation's) as TOML: a table per section, nested
    sections of the schema as [section.name] tables, other tables inline. Loads back as the same values."""
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        schema = schema or type(data)
        data = dataclasses.asdict(data)
    lines: list[str] = []
    for section, table in data.items():
        lines += _table(section, table, schema)
    return "\n".join(lines)


def anchor_paths(data: dict, folder: Path, cwd: Path | None = None) -> None:
    """In place: the relative paths a config file names (task.path, task.eval_path, a reward function's FILE.py, the
    environment's FILE.py) are
    read against the file's own folder, as tools that read config files do, so a config works from any directory.
    A path found only against the working directory (a config written before this rule) is left as it is; one found
    nowhere is anchored at the file's folder, so the error names where it was looked for."""
    cwd = cwd or Path.cwd()

    def anchored(value: str) -> str:
        if not value or "://" in value or Path(value).expanduser().is_absolute():
            return value
        here = folder / value
        return value if not here.exists() and (cwd / value).exists() else str(here.resolve())

    task = data.get("task")
    if isinstance(task, dict):
        for key in ("path", "eval_path"):
            if isinstance(task.get(key), str):
                task[key] = anchored(task[key])
    rewards = data.get("rewards")
    for entry in rewards.get("functions", []) if isinstance(rewards, dict) else []:
        spec = entry.get("function") if isinstance(entry, dict) else None
        if isinstance(spec, str) and ".py:" in spec:
            target, name = spec.rsplit(":", 1)
            entry["function"] = f"{anchored(target)}:{name}"
    env = data.get("environment")
    spec = env.get("name") if isinstance(env, dict) else None
    if isinstance(spec, str) and ".py:" in spec:
        prefix = "openenv:" if spec.startswith("openenv:") else ""  # an OpenEnv environment's file
        target, name = spec[len(prefix):].rsplit(":", 1)
        env["name"] = f"{prefix}{anchored(target)}:{name}"

