"""The building blocks of the config schema: strict scalar types, enumerations whose errors read as before, and
fields that carry why their bounds are what they are.

Every section is a pydantic dataclass (`SECTION`): still a dataclass (attribute access, `dataclasses.asdict` /
`replace`, pickling into Ray actors), validated by pydantic from TOML tables. A field's docstring is its description
(docs/reference/config.md is generated from them by `python -m qgrpo.cluster.config.reference`). A field that names
a file, a folder or a model says so with `setting(path=KIND)` (PATH_KINDS): that mark is how a relative path in a
config file is read (tomlio.anchor_paths walks the schema for it) and what the reference says of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, Strict
from pydantic.dataclasses import dataclass as pydantic_dataclass
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


# The kinds of path-valued fields (`setting(path=KIND)`), and what the field reference says of each. A relative path
# in a config file is read against the file's folder, as the tools that read config files do, so that a config works
# from any directory (tomlio.anchor_paths); a `--set` value is the command line's, read against the working directory.
PATH_KINDS = {
    "file": "A relative path in a config file is read against the file's folder (a `--set` value: the working "
            "directory).",
    "module_file": "A relative FILE.py in a config file is read against the file's folder (a `--set` value: the "
                   "working directory); MODULE:NAME is imported.",
    "path_or_hub": "A relative folder in a config file is read against the file's folder when it is there, or when "
                   "the value cannot be a Hub id (./NAME, ../NAME, NAME without a '/'); a Hub id and builtin:NAME are "
                   "left as written; a `--set` value: the working directory.",
    "cwd": "A relative path is read against the working directory, also in a config file (as TRL's output_dir).",
}


def path_kind(info: Any) -> str:
    """The PATH_KINDS mark of a field (its FieldInfo), "" for a field that names no path."""
    extra = info.json_schema_extra if info is not None else None
    return extra.get("path", "") if isinstance(extra, dict) else ""


def setting(default: Any = ..., *, why: str = "", fix: str = "", allowed: str = "", path: str = "",
            **constraints: Any) -> Any:
    """A field with bounds (ge, gt, le, lt, min_length, ...) and the words its error adds: `why` after the rule in
    parentheses, `fix` after the value given. `allowed` describes valid values the bounds cannot state (the precisions
    of each backend), for the field reference. `path` marks a field that names a file, folder or model, by its kind
    (PATH_KINDS): "file" (a file or folder), "module_file" (FILE.py:NAME or MODULE:NAME), "path_or_hub" (a folder,
    a Hub id or builtin:NAME) or "cwd" (read against the working directory, never the config file's folder)."""
    if path and path not in PATH_KINDS:
        raise ValueError(f"setting(path={path!r}): the kinds are {', '.join(PATH_KINDS)}")
    extra = {k: v for k, v in (("why", why), ("fix", fix), ("allowed", allowed), ("path", path)) if v}
    if "default_factory" in constraints:
        return Field(json_schema_extra=extra or None, **constraints)
    return Field(default, json_schema_extra=extra or None, **constraints)


_SCALARS = {"str": Str, "int": Int, "float": Float, "bool": Bool}


def generated_section(name: str, doc: str, module: str, entries: list[tuple[str, Any, dict]],
                      bases: tuple[type, ...] = ()) -> type:
    """A section generated from declarations made elsewhere (the objective's knobs, learner/objective/knobs.py; a
    backend's options, `options_section`): each entry is (key, default, metadata) with the metadata's "doc", "type"
    (str, int, float or bool), "choices" and "template" (an enumeration's values and error wording), "bounds" (ge, gt,
    le, lt), "why" and optionally "allowed" (valid values in words, for the reference). The section validates,
    documents and reads back exactly as one written by hand; it subclasses `bases` (their methods stay its own)."""
    annotations: dict[str, Any] = {}
    namespace: dict[str, Any] = {"__doc__": doc, "__module__": module, "__qualname__": name}
    for key, default, meta in entries:
        annotations[key] = (choice(tuple(meta["choices"]), meta["template"]) if meta["choices"]
                            else _SCALARS[meta["type"]])
        namespace[key] = setting(default, why=meta["why"], allowed=meta.get("allowed", ""), description=meta["doc"],
                                 **meta["bounds"])
    namespace["__annotations__"] = annotations
    return pydantic_dataclass(type(name, bases, namespace), config=SECTION)


def options_section(options: type, module: str) -> type:
    """A backend's [rollout.NAME] table generated from its options dataclass (rollout/backends: `option` fields carry
    the description and allowed values), named after it (VLLMOptions -> VLLMSection) in `module`, and a subclass of
    it: a config's table is the backend's options, with their methods (`problems`, its rules, kept with the backend
    that reads them)."""
    import dataclasses

    entries = [(f.name, f.default, {**f.metadata, "type": getattr(f.type, "__name__", f.type)})
               for f in dataclasses.fields(options)]
    name = options.__name__.removesuffix("Options") + "Section"
    return generated_section(name, options.__doc__ or "", module, entries, bases=(options,))


def role_resources(each: str, node: str, cpus: float = 0.0, gpus: str = "") -> type:
    """The Ray resources of one role's actors, defined once for [rollout], [reference], [reward_model] and [learner]:
    the section base each of them inherits, so its keys and attributes (cfg.rollout.num_gpus) are these fields. What
    differs between roles is in the arguments: `each` says whose the values are ("per rollout actor", "of the
    reference actor"), `node` names the custom resource of the example, `cpus` is num_cpus's default (1 for the
    roles that compute all the time, the rollout actors and the learner ranks) and `gpus` what a GPU share means for
    the role (a parenthesis after the sentence's subject)."""

    @pydantic_dataclass(config=SECTION)
    class RoleResources:
        num_cpus: Float = setting(cpus, ge=0, description=f"Ray CPU resource {each}.")
        num_gpus: Float = setting(0.0, ge=0, description=f"Ray GPU resource {each}{gpus}.")
        memory_gb: Float = setting(0.0, ge=0, why="0 = none reserved",
                                   description=f"Ray memory resource {each} (0 = none reserved).")
        resources: Table = setting(default_factory=dict, fix=f"e.g. {{{node} = 1}}",
                                   description=f"Custom Ray resources {each}, to pin it to node types started with "
                                   f"`ray start --resources '{{\"NAME\": N}}'`, e.g. {{{node} = 1}}.")
        node_labels: Table = setting(default_factory=dict, fix="e.g. {pool = \"spot\"}",
                                     description="Labels its node must carry (`ray start --labels`).")

    return RoleResources
