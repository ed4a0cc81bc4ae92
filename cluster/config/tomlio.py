"""TOML in and out: `--set section.key=value` overrides read against the schema, a config (or the part of one a
translation set) written back as TOML that loads as the same config, and the relative paths of a config file read
against its folder (anchor_paths, driven by the schema's path marks).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import tomllib
import typing
from pathlib import Path
from typing import Any

from qgrpo.cluster.config.errors import field_at
from qgrpo.cluster.config.fields import path_kind

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


# ---------------------------------------------------------------------------------------------------------------------
# Relative paths of a config file

MODULE_PREFIXES = ("openenv:", "agent:")  # a FILE.py:NAME spec after one of these still names a file


def _anchored_file(value: str, folder: Path, cwd: Path) -> str:
    """A file or folder ("file"): a relative one is read against `folder`, unless it is found only against `cwd` (a
    config written before this rule), which leaves it as written; absolute paths, ~ and URIs are left as written."""
    if not value or "://" in value or Path(value).expanduser().is_absolute():
        return value
    here = folder / value
    return value if not here.exists() and (cwd / value).exists() else str(here.resolve())


def _anchored_module_file(spec: str, folder: Path, cwd: Path) -> str:
    """FILE.py:NAME ("module_file"): the file, anchored as a "file"; MODULE:NAME and anything else as written."""
    prefix = next((p for p in MODULE_PREFIXES if spec.startswith(p)), "")
    target, sep, name = spec[len(prefix):].rpartition(":")
    if not sep or not target.endswith(".py"):
        return spec
    return f"{prefix}{_anchored_file(target, folder, cwd)}:{name}"


def _anchored_model(value: str, folder: Path, cwd: Path) -> str:
    """A model ("path_or_hub"): builtin:NAME is left as written, and so is a value that may be a Hub id (ORG/NAME,
    rollout.models.HUB_ID) unless a folder of that name is beside the config file (a local folder wins over the
    cache, as in rollout.models.resolve_model_path). Every other value (./NAME, ../NAME, NAME, a/b/c) can only be a
    folder: anchored as a "file", so a missing one is named where it was looked for."""
    from qgrpo.rollout.modeling.models import BUILTIN_PREFIX, HUB_ID

    if not value or value.startswith(BUILTIN_PREFIX) or (HUB_ID.match(value) and not (folder / value).exists()):
        return value
    return _anchored_file(value, folder, cwd)


ANCHORS = {"file": _anchored_file, "module_file": _anchored_module_file, "path_or_hub": _anchored_model,
           "cwd": lambda value, folder, cwd: value}  # every kind of fields.PATH_KINDS; "cwd" is never anchored


def _anchor_table(table: dict, cls: type, folder: Path, cwd: Path) -> None:
    for key, info in cls.__pydantic_fields__.items():
        value, args = table.get(key), typing.get_args(info.annotation)
        inner = args[0] if typing.get_origin(info.annotation) is list and args else None
        if dataclasses.is_dataclass(info.annotation):  # a nested section: [rollout.vllm]
            if isinstance(value, dict):
                _anchor_table(value, info.annotation, folder, cwd)
        elif inner is not None and dataclasses.is_dataclass(inner):  # a list of tables: rewards.functions
            for item in value if isinstance(value, list) else []:
                if isinstance(item, dict):
                    _anchor_table(item, inner, folder, cwd)
        elif (kind := path_kind(info)) and isinstance(value, str):
            table[key] = ANCHORS[kind](value, folder, cwd)


def anchor_paths(data: dict, folder: Path, schema: type, cwd: Path | None = None) -> None:
    """In place: the relative paths a config file names are read against the file's own folder, as tools that read
    config files do, so a config works from any directory. Which values are paths, and of what kind, the schema says
    (`setting(path=KIND)`, fields.PATH_KINDS): every marked field of every section, nested section and list of tables
    is anchored by its kind, except "cwd" ones (run.output_dir). A path found only against the working directory (a
    config written before this rule) is left as it is; one found nowhere is anchored at the file's folder, so the
    error names where it was looked for. Values of the wrong type are left for validation to name. `schema`: the
    Config class (cluster/config/schema.py passes it: this module sits below the schema)."""
    _anchor_table(data, schema, folder, cwd or Path.cwd())
