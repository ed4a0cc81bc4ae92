"""docs/reference/config.md is what the schema gives now, and every field of the schema says what it is for."""
import dataclasses

from qgrpo.cluster.config.mlx_grpo import MLXGRPOKeys
from qgrpo.cluster.config.reference import COMMAND, DOC, render, sections
from qgrpo.cluster.config.schema import Config


def test_reference_is_generated_from_the_schema():
    assert DOC.is_file(), f"{DOC} is missing; generate it with `{COMMAND}`"
    assert DOC.read_text() == render(), f"{DOC} is out of date with the schema; regenerate it with `{COMMAND}`"


def test_every_field_has_a_description():
    tables = [(name, cls) for name, cls in sections(Config)] + [("mlx_grpo", MLXGRPOKeys)]
    bare = [f"{name}.{field}" for name, cls in [("", Config), *tables]
            for field, info in cls.__pydantic_fields__.items() if not (info.description or "").strip()]
    assert bare == [], f"fields without a description (a docstring under the field): {bare}"


def test_every_section_and_nested_table_is_in_the_reference():
    text = render()
    for name, cls in sections(Config):
        heading = f"## [{name}]" if not name.endswith("[]") else f"## {name[:-2]}: each item"
        assert heading in text, heading
        assert all(f"| `{f.name}` |" in text for f in dataclasses.fields(cls)), name
