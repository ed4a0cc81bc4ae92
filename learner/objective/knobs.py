"""How the objective declares a setting (plain Python): `knob` is a dataclass field carrying its description, allowed
values or bounds, from which cluster/config/training.py generates the [algo] section. Used by the objective's own
record (settings.py) and by each policy loss's parameters (losses.py)."""
from __future__ import annotations

import dataclasses
from typing import Any

REGISTERED = "registered policy losses"  # knob(choices=REGISTERED): the allowed values are LOSSES' names


def knob(default: Any, doc: str, *, choices: tuple | str = (), template: str = "must be {either}", why: str = "",
         **bounds: float) -> Any:
    """A setting of the objective: its default, its description (the config reference's), its allowed values
    (`choices`, with the wording of their error; see cluster/config/fields.choice) or its bounds (ge, gt, le, lt) and
    why they are what they are. The config generates the [algo] field from this; nothing here checks a value."""
    return dataclasses.field(default=default, metadata={"doc": " ".join(doc.split()), "choices": choices,
                                                        "template": template, "why": why, "bounds": bounds})


def knobs(cls: type) -> list[dataclasses.Field]:
    """The knobs of a settings record (the fields declared with `knob`)."""
    return [f for f in dataclasses.fields(cls) if "doc" in f.metadata]
