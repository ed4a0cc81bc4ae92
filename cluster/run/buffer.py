"""The rollout stream's state in a checkpoint (cluster/run/stream.py: RolloutStream.snapshot / restore), as JSON:
the steps drawn beyond the step trained, their chunks' prompts and the groups already generated. Records are plain
dataclasses of JSON-safe fields."""
from __future__ import annotations

import dataclasses
import json

from qgrpo.core import storage
from qgrpo.core.records import Completion, GenerationStats, GroupRollout, PromptItem

BUFFER_FILE = "rollout_buffer.json"  # a checkpoint's copy of the stream's state (RolloutStream.snapshot)


def item_json(item: PromptItem) -> dict:
    return dataclasses.asdict(item)


def item_of(d: dict) -> PromptItem:
    return PromptItem(**{**d, "history": tuple(tuple(turn) for turn in d.get("history") or ())})


def group_json(g: GroupRollout) -> dict:
    return {**dataclasses.asdict(g), "item": item_json(g.item)}


def group_of(d: dict) -> GroupRollout:
    return GroupRollout(**{**d, "item": item_of(d["item"]),
                            "completions": [Completion(**c) for c in d["completions"]]})


def stats_json(st: GenerationStats) -> dict:
    return dataclasses.asdict(st)


def stats_of(d: dict) -> GenerationStats:
    return GenerationStats(**d)


def write_buffer(checkpoint, state: dict) -> None:
    """The stream's snapshot into a checkpoint folder (a path or URI) being written."""
    storage.write_text(storage.join(checkpoint, BUFFER_FILE), json.dumps(state))


def read_buffer(checkpoint) -> dict | None:
    """A checkpoint's stream snapshot, or None where it holds none."""
    f = storage.join(checkpoint, BUFFER_FILE)
    return json.loads(storage.read_text(f)) if storage.is_file(f) else None
