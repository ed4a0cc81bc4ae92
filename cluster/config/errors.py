"""pydantic's validation errors as our messages: "section.field: rule (why), got VALUE; fix", every one at once.

Each error carries its location (section, field, list index); the rule is read back from the field's own declaration
(its bounds, its Choice, its `why` and `fix`), so that a bound error names the whole bound ("in (0, 1)"), not the one
side pydantic happened to test.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Callable

import annotated_types as at
from pydantic import ValidationError

from qgrpo.cluster.config.fields import Choice

UNKNOWN_KEY_ERRORS = ("unexpected_keyword_argument", "extra_forbidden")  # dataclasses say the first, models the second
BOUND_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"}
TYPE_NAMES = {"int": "int", "float": "float", "string": "str", "bool": "bool"}  # pydantic's error type prefixes


def where(loc: tuple) -> str:
    """("task", "examples", 0, "answer") -> "task.examples[0].answer"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def field_path(loc: tuple) -> str:
    """The field an error is about, list indexes and what lies below them dropped: rules name fields this way."""
    parts = []
    for part in loc:
        if isinstance(part, int):
            break
        parts.append(str(part))
    return ".".join(parts)


def _item_type(tp: Any) -> Any:
    """The class inside list[...] (a list of tables), else tp."""
    args = typing.get_args(tp)
    return args[0] if typing.get_origin(tp) is list and args else tp


def field_at(cls: type, loc: tuple) -> tuple[Any, type | None]:
    """(the FieldInfo at `loc`, the dataclass holding it), walking nested sections and lists of tables; (None, the
    last dataclass reached) for a key the schema does not have."""
    info, owner = None, cls
    for i, part in enumerate(loc):
        if isinstance(part, int):  # an item of the list field just read: its keys are the item class's
            continue
        fields = getattr(owner, "__pydantic_fields__", None)
        if fields is None or part not in fields:
            return None, owner
        info = fields[part]
        inner = _item_type(info.annotation)
        if i < len(loc) - 1 and dataclasses.is_dataclass(inner):
            owner = inner
    return info, owner


def _num(v: Any) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() and abs(v) < 1e16 else str(v)


def bounds(info: Any) -> str:
    """The field's bounds in words: ">= 1", "> 0", "in (0, 1]", "in 0..9999"."""
    lo = hi = None
    for m in info.metadata:
        if isinstance(m, at.Ge):
            lo = ("[", m.ge)
        elif isinstance(m, at.Gt):
            lo = ("(", m.gt)
        elif isinstance(m, at.Le):
            hi = ("]", m.le)
        elif isinstance(m, at.Lt):
            hi = (")", m.lt)
    if lo and hi:
        if lo[0] == "[" and hi[0] == "]" and all(isinstance(v, int) for v in (lo[1], hi[1])):
            return f"in {lo[1]}..{hi[1]}"
        return f"in {lo[0]}{_num(lo[1])}, {_num(hi[1])}{hi[0]}"
    if lo:
        return f"{'>=' if lo[0] == '[' else '>'} {_num(lo[1])}"
    if hi:
        return f"{'<=' if hi[0] == ']' else '<'} {_num(hi[1])}"
    return "a finite number"


def _extra(info: Any, key: str) -> str:
    extra = info.json_schema_extra if info is not None else None
    return extra.get(key, "") if isinstance(extra, dict) else ""


def _shown(v: Any) -> str:
    return repr(v) if isinstance(v, str) else str(v)


def _either(values: list[str]) -> str:
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


def choice_rule(info: Any, got: Any) -> str:
    """An enumerated field's rule, worded by its Choice; ", got VALUE" unless the wording places the value."""
    values = [v for v in typing.get_args(info.annotation) if v != ""]  # "" (unset) is no choice to offer
    words = next((m for m in info.metadata if isinstance(m, Choice)), Choice())
    text = words.template.format(either=_either([str(v) for v in values]), listed=", ".join(map(str, values)),
                                 quoted=_either([repr(v) for v in values]), got=repr(got))
    return text if "{got}" in words.template else f"{text}, got {_shown(got)}"


def _expected(info: Any, kind: str, in_list: bool) -> str:
    """What a list or table field holds, in words, for type errors."""
    tp = _item_type(info.annotation) if info is not None else None
    keys = f"{{{', '.join(tp.__dataclass_fields__)}}}" if dataclasses.is_dataclass(tp) else ""
    if kind == "list_type":
        if keys:
            return f"a list of {keys} tables"
        return "a list of strings" if tp is not None and str in (tp, *typing.get_args(tp)) else "a list"
    return f"a {keys} table" if keys and in_list else "a table"


def message(err: dict, schema: type, unknown: Callable[[str, tuple, list[str]], str], type_note: str = "") -> str:
    """One pydantic error as our message."""
    loc, kind, got = err["loc"], err["type"], err.get("input")
    at_loc = where(loc)
    info, owner = field_at(schema, loc)
    why, fix = _extra(info, "why"), _extra(info, "fix")
    tail = f"; {fix}" if fix else ""
    if kind in UNKNOWN_KEY_ERRORS:
        known = list(getattr(owner, "__dataclass_fields__", {}))
        text = unknown(at_loc, loc, known)
        if "did you mean" in text or "TRL's name" in text or not (hint := elsewhere(schema, loc, got)):
            return text
        return f"{at_loc}: unknown key{hint}" if unknown is unknown_key else text + hint
    if kind == "literal_error" and info is not None:
        return f"{at_loc}: {choice_rule(info, got)}"
    if kind in BOUND_ERRORS and info is not None:
        return f"{at_loc}: must be {bounds(info)}{f' ({why})' if why else ''}, got {_shown(got)}{tail}"
    if kind in ("too_short", "string_too_short"):
        return f"{at_loc}: must not be empty, got {got!r}{tail}"
    prefix = kind.split("_")[0]
    if prefix in TYPE_NAMES and kind.endswith(("_type", "_parsing", "_from_float")):
        shown = repr(got) if isinstance(got, bool) else f"{type(got).__name__} {got!r}"
        return f"{at_loc}: expected {TYPE_NAMES[prefix]}{type_note}, got {shown}"
    if kind in ("list_type", "dict_type", "dataclass_type", "dataclass_args_type"):
        return f"{at_loc}: expected {_expected(info, kind, isinstance(loc[-1], int))}, got {got!r}{tail}"
    return f"{at_loc}: {err['msg']}, got {got!r}"


# GRPOConfig's names (TRL) for what our fields set, wherever in the file they are written: an unknown key with one
# of these names is told its equivalent (docs/from_trl.md has the whole mapping)
TRL_KEYS = {
    "num_generations": "rollout.group_size",
    "learning_rate": "learner.lr",
    "beta": "algo.kl_coeff",
    "epsilon": "algo.clip_low and algo.clip_high",
    "epsilon_high": "algo.clip_high (algo.cispo_cap for CISPO)",
    "max_completion_length": "rollout.max_new_tokens",
    "per_device_train_batch_size": "rollout.prompts_per_step (x rollout.group_size completions per step)",
    "num_iterations": "algo.updates_per_batch",
    "loss_type": "algo.loss_agg (and algo.policy_loss for cispo, sapo)",
    "scale_rewards": "algo.advantage_scale",
    "importance_sampling_level": "algo.policy_loss = \"gspo\"",
    "mask_truncated_completions": "algo.overlong_filter",
    "off_policy_mask_threshold": "algo.offpolicy_mask_kl",
    "use_bias_correction_kl": "algo.kl_bias_correction",
    "vllm_importance_sampling_mode": "algo.is_level and algo.is_mode",
    "vllm_importance_sampling_cap": "algo.is_cap",
    "reward_weights": "the weight of each rewards.functions entry",
    "lr_scheduler_type": "learner.lr_schedule",
    "max_grad_norm": "learner.grad_clip",
    "adam_beta1": "learner.beta1",
    "adam_beta2": "learner.beta2",
    "optim": "learner.optimizer",
    "bf16": "model.compute_dtype",
    "max_steps": "run.steps",
    "num_train_epochs": "run.steps (epochs x train rows / rollout.prompts_per_step)",
    "logging_steps": "run.log_every",
    "save_steps": "run.save_every",
    "save_total_limit": "run.keep_last",
    "eval_steps": "run.eval_every",
    "run_name": "run.name",
}


def unknown_key(at_loc: str, loc: tuple, known: list[str]) -> str:
    """Our sections: the key and what it is called here when it is TRL's name for one of our fields; else the nearest
    key of its table; else every key there is."""
    parent, key = where(loc[:-1]), str(loc[-1])
    if key in TRL_KEYS:
        return f"{at_loc}: unknown key; {key!r} is TRL's name: here it is {TRL_KEYS[key]} (docs/from_trl.md)"
    near = difflib.get_close_matches(key, known, n=1)
    if near:
        return f"{at_loc}: unknown key; did you mean {(parent + '.') if parent else ''}{near[0]}?"
    scope = f"keys of [{parent}]" if parent else "sections"
    return f"{at_loc}: unknown key; known {scope} are: {', '.join(sorted(known))}"


def elsewhere(schema: type, loc: tuple, got: Any) -> str:
    """"; did you mean run.steps?" for a key that is a field of another section: `train.steps` (an unknown section
    holding it), or `run.lr` (an unknown key of a section); "" when no section has a field of that name."""
    sections = {name: _item_type(info.annotation) for name, info in getattr(schema, "__pydantic_fields__", {}).items()
                if dataclasses.is_dataclass(_item_type(info.annotation))}
    keys = [str(k) for k in got] if len(loc) == 1 and isinstance(got, dict) else [str(loc[-1])] if len(loc) == 2 else []
    found = [f"{name}.{key}" for key in keys for name, cls in sections.items()
             if key in getattr(cls, "__dataclass_fields__", {}) and name != str(loc[0])]
    return f"; did you mean {_either(found)}?" if found else ""


def problems_of(error: ValidationError, schema: type, unknown: Callable = unknown_key,
                type_note: str = "") -> tuple[list[str], list[tuple[tuple, bool]]]:
    """(our messages, (the location, whether it is an unknown key) of each) for every error of a validation of
    `schema`."""
    order = {name: i for i, name in enumerate(getattr(schema, "__dataclass_fields__", {}))}
    # pydantic lists a table's unknown keys after its fields' errors; ours go section by section, as the file reads
    errs = sorted(error.errors(), key=lambda e: order.get(e["loc"][0] if e["loc"] else "", len(order)))
    return ([message(e, schema, unknown, type_note) for e in errs],
            [(e["loc"], e["type"] in UNKNOWN_KEY_ERRORS) for e in errs])
