"""The field reference, docs/reference/config.md, generated from the schema: one table per section with each field's
type, default, allowed values and description (the field's docstring).

    python -m qgrpo.cluster.config.reference          # write the file
    python -m qgrpo.cluster.config.reference --check  # exit 1 when the file is not what the schema gives now
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any

import annotated_types as at

from qgrpo.cluster.config.errors import bounds
from qgrpo.cluster.config.fields import PATH_KINDS, path_kind
from qgrpo.cluster.config.tomlio import value_text

DOC = Path(__file__).resolve().parents[2] / "docs" / "reference" / "config.md"
COMMAND = "python -m qgrpo.cluster.config.reference"
_BOUNDS = (at.Ge, at.Gt, at.Le, at.Lt)


def sections(cls: type, prefix: str = "") -> list[tuple[str, type]]:
    """(table name, dataclass) for `cls`'s sections, nested ones ([rollout.vllm]) and list items (rewards.functions)
    right after the section holding them."""
    out = []
    for name, info in cls.__pydantic_fields__.items():
        tp, path = info.annotation, f"{prefix}{name}"
        args = typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            out += [(path, tp)] + sections(tp, f"{path}.")
        elif typing.get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]):
            out += [(f"{path}[]", args[0])] + sections(args[0], f"{path}[].")
    return out


def type_name(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return type(typing.get_args(tp)[0]).__name__
    if typing.get_origin(tp) is typing.Annotated:
        return type_name(typing.get_args(tp)[0])
    if typing.get_origin(tp) is list:
        item = typing.get_args(tp)[0]
        return "list of tables" if dataclasses.is_dataclass(item) else f"list of {type_name(item)}"
    if typing.get_origin(tp) is dict:
        return "table"
    return "table" if dataclasses.is_dataclass(tp) else getattr(tp, "__name__", str(tp))


def default_text(info: Any, path: str) -> str:
    if dataclasses.is_dataclass(info.annotation):
        return f"see [{path}]"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
        value = [dataclasses.asdict(v) for v in value]
    return f"`{value_text(value)}`"


def allowed_text(info: Any) -> str:
    if typing.get_origin(info.annotation) is typing.Literal:
        return ", ".join(f"`{v}`" for v in typing.get_args(info.annotation))
    parts = []
    if any(isinstance(m, _BOUNDS) for m in info.metadata):
        parts.append(bounds(info))
    if any(isinstance(m, at.MinLen) for m in info.metadata):
        parts.append("not empty")
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    parts += [extra["allowed"]] if "allowed" in extra else []
    return "; ".join(parts)


def description_text(info: Any) -> str:
    """The field's docstring, then, for a field marked as a path (fields.PATH_KINDS), how a relative one is read."""
    kind = path_kind(info)
    return " ".join(t for t in (info.description or "", PATH_KINDS[kind] if kind else "") if t)


def _cell(text: str) -> str:
    """Markdown table cell: one line, pipes escaped, tags shown as text (a code span shows its text as it is)."""
    text = " ".join(text.split()).replace("|", "\\|")
    return text if text.startswith("`") and text.endswith("`") else text.replace("<", "&lt;")


def rows(name: str, cls: type) -> list[str]:
    """The table of `cls`'s fields, `name` being where they sit (e.g. "rollout.vllm")."""
    lines = ["| field | type | default | allowed | description |", "|---|---|---|---|---|"]
    for field, info in cls.__pydantic_fields__.items():
        cells = [f"`{field}`", type_name(info.annotation), default_text(info, f"{name}.{field}"), allowed_text(info),
                 description_text(info)]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines + [""]


def table(name: str, cls: type) -> list[str]:
    """A section's heading, its own docstring when it has one, and its fields."""
    head = f"## [{name}]" if not name.endswith("[]") else f"## {name[:-2]}: each item"
    doc = cls.__doc__ if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}(") else ""
    return [head, ""] + ([_cell(doc), ""] if doc else []) + rows(name, cls)


def render() -> str:
    """The whole reference, as the schema gives it now."""
    from qgrpo.cluster.config.mlx_grpo import MLXGRPOKeys
    from qgrpo.cluster.config.schema import schema

    lines = ["# Configuration reference", "",
             f"Generated from the schema (cluster/config/sections.py, training.py; [algo] from learner/objective/) by "
             f"`{COMMAND}`; do not edit.",
             "A config is a TOML file of these sections; any field may also be set with `--set section.key=value`.",
             "Every field is optional: a field left out takes its default. An unknown key is an error.",
             "How a relative path is read (a config file's folder, or the working directory): "
             "[configuration.md](../configuration.md#relative-paths).", ""]
    for name, cls in sections(schema()):
        lines += table(name, cls)
    lines += ["## MLX-GRPO keys", "",
              "An MLX-GRPO config (its flat keys, or an [mlx_grpo] table) is read as ours and translated "
              "(cluster/config/mlx_grpo.py; `qgrpo migrate` writes the translation). Each key and what it becomes:",
              ""]
    lines += rows("mlx_grpo", MLXGRPOKeys)
    return "\n".join(lines).rstrip("\n") + "\n"


def write_page(doc: Path, text: str, command: str, check: bool) -> int:
    """Write a generated page, or with `check` only compare: 1 when `doc` differs from `text` (told how to
    regenerate it with `command`). Shared by the generated pages (this one, bench/publish.py's)."""
    if check:
        same = doc.is_file() and doc.read_text() == text
        print(f"{doc}: {'up to date' if same else f'out of date; regenerate it with `{command}`'}", file=sys.stderr)
        return 0 if same else 1
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    print(f"wrote {doc}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="Write docs/reference/config.md from the schema.")
    parser.add_argument("--check", action="store_true", help="exit 1 when the file differs from the schema's")
    return write_page(DOC, render(), COMMAND, parser.parse_args(argv).check)


if __name__ == "__main__":
    sys.exit(main())
