"""The building blocks of the config schema: strict scalar types, enumerations whose errors read as before, and
fields that carry why their bounds are what they are.

Every section is a pydantic dataclass (`SECTION`): still a dataclass (attribute access, `dataclasses.asdict` /
`replace`, pickling into Ray actors), validated by pydantic from TOML tables. A field's docstring is its description
(docs/reference/config.md is generated from them by `python -m qgrpo.cluster.config.reference`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, Strict
from pydantic_core import PydanticCustomError

# Unknown keys are errors (a typo never falls back to a default silently); field docstrings are the descriptions.
SECTION = ConfigDict(extra="forbid", use_attribute_docstrings=True)

# Strict scalars: a TOML value is taken as written. The one conversion is an int where a float is expected (3 -> 3.0);
# "3" is not an int and 1 is not true, so a value is never reinterpreted behind the user's back.
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
Table = dict[str, Any]  # a TOML table whose keys the section does not fix (generator settings, Ray resources)


@dataclass(frozen=True)
class Choice:
    """How the error of an enumerated field reads. `template` may use {either} ("a, b or c"), {quoted} ("'a' or
    'b'"), {listed} ("a, b, c") and {got} (the value given, as repr); without {got}, ", got VALUE" follows."""

    template: str = "must be one of {listed}"


def _no_bool(value: Any) -> Any:
    # Python's True == 1 would let `zero_stage = true` pass a Literal of ints as stage 1.
    if isinstance(value, bool):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


def choice(values: tuple, template: str = Choice.template) -> Any:
    """A Literal of `values` (owned by the module that uses them, so schema and code cannot drift) whose error reads
    as `template` (see Choice)."""
    literal = Literal[tuple(values)]  # type: ignore[valid-type]
    if all(isinstance(v, int) for v in values):
        return Annotated[literal, BeforeValidator(_no_bool), Choice(template)]
    return Annotated[literal, Choice(template)]


def setting(default: Any = ..., *, why: str = "", fix: str = "", allowed: str = "", **constraints: Any) -> Any:
    """A field with bounds (ge, gt, le, lt, min_length, ...) and the words its error adds: `why` after the rule in
    parentheses, `fix` after the value given. `allowed` describes valid values the bounds cannot state (the precisions
    of each backend), for the field reference."""
    extra = {k: v for k, v in (("why", why), ("fix", fix), ("allowed", allowed)) if v}
    if "default_factory" in constraints:
        return Field(json_schema_extra=extra or None, **constraints)
    return Field(default, json_schema_extra=extra or None, **constraints)
