"""How a reward is called, and how a configured reward becomes a callable.

The calling convention is TRL's: a reward function gets a batch of completions as keyword arguments, every value a
list with one entry per completion (a prompt's row is repeated for each of its completions), and returns one float
per completion, or None where it does not apply (a math verifier on a row that is not math):

    prompts         the question as the model saw it (its last user turn, task.instruction included); for a chat
                    row (PromptItem.chat), the whole conversation: [{"role", "content"}, ...], the system turn, the
                    worked examples and earlier turns, then that last user turn
    completions     the completion texts; for a chat row [{"role": "assistant", "content": TEXT}]
    completion_ids  the sampled token ids
    references      the reference answers
    item_ids        qgrpo's prompt ids ("jsonl-train-12")
    finish_reasons  "stop" (the model ended it) or "length" (cut at rollout.max_new_tokens); a multi-turn
                    trajectory's: "stop" (the environment ended it), "length" (ended on a turn cut at
                    environment.turn_tokens), "max_turns", "context" or "env_error"
    env_scores      (multi-turn, [environment]) the environment's score of each trajectory
    turns           (multi-turn) each trajectory's turns: [{"role", "content", "start", "end", "tool_calls",
                    "error"}, ...]; its `completions` entry is then the trajectory's messages after the prompt,
                    [{"role": "assistant", ...}, {"role": "user" or "tool", ...}, ...] (TRL's conversational shape)
    COLUMN          every column of the dataset row under its own name (reasoning-gym: question, answer, metadata,
                    rg_entry)

Chat rows get TRL's conversational shape, plain rows (and every row of digit_sum and rg: tasks) its standard one
(strings); `completion_text` reads a completion's text in either shape, as the built-ins do.

A function with **kwargs gets them all; one without gets only the keywords it names, and each of its parameters
without a default must be one of them. `async def` functions are awaited.

A user's function is named "FILE.py:NAME" (a file; relative to the config file's folder, or to the working directory
for a --set value) or "MODULE:NAME" (importable on every node). A file is read once in the driver and its source
shipped to the reward workers, so it need not exist on the nodes they run on.
"""
from __future__ import annotations

import asyncio
import hashlib
import importlib
import inspect
import math
import sys
import traceback
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from qgrpo.rollout.data.datasets import (
    RESERVED_COLUMNS as RESERVED,  # the keywords of the convention: no column may use one
)


def messages(item) -> list[dict[str, str]]:
    """The conversation `item` (a PromptItem) puts before its completions, as the generators give it to the chat
    template: its history turns, then the question as the last user turn."""
    return [{"role": r, "content": c} for r, c in item.history] + [{"role": "user", "content": item.prompt}]


def completion_text(completion: Any) -> Any:
    """The text of one entry of `completions`, in either shape: a string as it is; a conversational completion
    [{"role": "assistant", "content": TEXT}] -> TEXT (its last message's content; a multi-turn trajectory's: its
    last assistant message's, the model's final answer)."""
    if isinstance(completion, (list, tuple)):
        said = [m for m in completion if isinstance(m, dict) and m.get("role") == "assistant"]
        completion = said[-1] if said else (completion[-1] if completion else "")
    return completion.get("content") if isinstance(completion, dict) else completion


def reward_kwargs(items: list, completions: list) -> dict[str, list]:
    """The keyword arguments of one call: `items[i]` (a PromptItem) is the row of `completions[i]` (a Completion).
    Chat rows get the conversational shape (every entry a list of its own, so a function may change it)."""
    kwargs: dict[str, list] = {
        "prompts": [messages(it) if it.chat else it.prompt for it in items],
        "completions": [[{"role": t["role"], "content": t["content"]} for t in c.turns] if c.multi_turn
                        else [{"role": "assistant", "content": c.text}] if it.chat else c.text
                        for it, c in zip(items, completions, strict=True)],
        "completion_ids": [list(c.token_ids) for c in completions],
        "references": [it.reference for it in items],
        "item_ids": [it.prompt_id for it in items],
        "finish_reasons": [c.finish_reason for c in completions],
    }
    if any(c.multi_turn for c in completions):  # multi-turn trajectories (rollout/episodes.py)
        kwargs["env_scores"] = [c.env_score for c in completions]
        kwargs["turns"] = [[dict(t) for t in c.turns or []] for c in completions]
    names = dict.fromkeys(k for it in items for k in (it.columns or {}) if k not in RESERVED)
    for name in names:
        kwargs[name] = [(it.columns or {}).get(name) for it in items]
    return kwargs


def group_kwargs(groups: list) -> dict[str, list]:
    """`reward_kwargs` of every completion of `groups` (GroupRollouts), group after group."""
    items = [g.item for g in groups for _ in g.completions]
    return reward_kwargs(items, [c for g in groups for c in g.completions])


def slice_kwargs(kwargs: dict[str, list], start: int, stop: int) -> dict[str, list]:
    return {k: v[start:stop] for k, v in kwargs.items()}


# ---------------------------------------------------------------------------------------------------------------
# Loading a user's function


# How every relative path a config names is read (cluster/config/tomlio.anchor_paths), worded once for every message
RELATIVE_PATHS = "a relative path in a config file is read against the file's folder (a --set value: the working " \
    "directory)"


class RewardLoadError(ValueError):
    """A user's reward function that cannot be used: the message names the config field and the fix."""


@dataclass(frozen=True)
class Source:
    """Everything a worker on any node needs to load a user's function."""

    spec: str  # as configured: "my_rewards.py:tolerant" or "my_pkg.rewards:tolerant"
    path: str = ""  # the file's absolute path in the driver ("" for a module)
    text: str = ""  # the file's source ("" for a module)


def split_spec(spec: str, field: str) -> tuple[str, str]:
    """("my_rewards.py", "tolerant") for "my_rewards.py:tolerant"; RewardLoadError for anything else."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise RewardLoadError(f"{field}: {spec!r} is not FILE.py:FUNCTION or MODULE:FUNCTION, e.g. "
                              "\"my_rewards.py:tolerant_correct\"")
    return target, name


def read_source(spec: str, field: str, base: Path | None = None) -> Source:
    """The source of `spec`, read in the driver; a missing file says where it was looked for."""
    target, _ = split_spec(spec, field)
    if not target.endswith(".py"):
        return Source(spec)
    given = Path(target).expanduser()
    path = given if given.is_absolute() else (base or Path.cwd()) / given
    try:
        return Source(spec, str(path.resolve()), path.read_text(encoding="utf-8"))
    except OSError as e:
        looked = "" if str(path) == target else f", looked for at {str(path.resolve())!r}"
        raise RewardLoadError(f"{field}: cannot read {target!r} ({type(e).__name__}: {e.strerror or e}{looked}); "
                              f"put the file there or fix the path: {RELATIVE_PATHS}") from None
    except UnicodeDecodeError as e:
        raise RewardLoadError(f"{field}: {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start}); save it as "
                              "UTF-8") from None


_MODULES: dict[str, types.ModuleType] = {}


def _module_of_file(source: Source, field: str, runs_in: str = "every reward worker") -> types.ModuleType:
    key = hashlib.sha256(f"{source.path}\0{source.text}".encode()).hexdigest()[:16]
    if key in _MODULES:
        return _MODULES[key]
    name = f"qgrpo_user_rewards_{Path(source.path).stem}_{key}"
    module = types.ModuleType(name)
    module.__file__ = source.path
    folder = str(Path(source.path).parent)
    added = folder not in sys.path and Path(folder).is_dir()
    if added:  # the file's own helpers next to it, where the folder exists on this node
        sys.path.insert(0, folder)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    try:
        exec(compile(source.text, source.path, "exec"), module.__dict__)
    except (Exception, SystemExit) as e:  # a file that calls exit() on import must not end the command
        del sys.modules[name]
        raise RewardLoadError(f"{field}: importing {source.path} failed ({type(e).__name__}: {e}); fix the file "
                              f"(it is run once in {runs_in})") from e
    _MODULES[key] = module
    return module


def load_function(source: Source, field: str, runs_in: str = "every reward worker") -> Callable:
    """The callable `source` names, imported (a module) or executed from the shipped source (a file, run once in
    `runs_in`, as its import error says)."""
    target, name = split_spec(source.spec, field)
    if source.path:
        module = _module_of_file(source, field, runs_in)
    else:
        try:
            module = importlib.import_module(target)
        except Exception as e:
            raise RewardLoadError(f"{field}: cannot import module {target!r} ({type(e).__name__}: {e}); install it "
                                  "on every node, or name a file instead: \"path/to/file.py:FUNCTION\"") from e
    fn = getattr(module, name, None)
    if fn is None:
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise RewardLoadError(f"{field}: {target} has no {name!r}; its functions: {', '.join(found) or 'none'}")
    if not callable(fn):
        raise RewardLoadError(f"{field}: {source.spec} is a {type(fn).__name__}, not a function")
    return fn


def signature_problems(fn: Callable, field: str, available: set[str] | None = None) -> list[str]:
    """What stops `fn` from being called by the convention: positional-only parameters, or a required parameter that
    is not a keyword the call passes (`available`: the convention's keywords plus the dataset's columns; None = the
    columns are not known yet, so only the convention's are checked for a function that names none of them)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []  # a builtin without a signature: find out when called
    expected = f"expected fn(completions, **kwargs) -> list of floats (keywords: {', '.join(RESERVED)} and the " \
               "dataset's columns)"
    problems = [f"{field}: parameter {p.name!r} is positional-only; {expected}"
                for p in params if p.kind is p.POSITIONAL_ONLY]
    required = [p.name for p in params if p.default is p.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    known = set(RESERVED) | (available or set())
    if available is not None:
        missing = [n for n in required if n not in known]
        if missing:
            columns = ", ".join(sorted(available - set(RESERVED))) or "none"
            problems.append(f"{field}: requires {', '.join(map(repr, missing))}, which the call does not pass (the "
                            f"dataset's columns: {columns}); give it a default or take **kwargs; {expected}")
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params) or any(
        p.name in known for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    if not takes_any:
        problems.append(f"{field}: takes none of the keywords a reward gets; {expected}")
    return problems


def accepted_kwargs(fn: Callable, kwargs: dict[str, list]) -> dict[str, list]:
    """All of `kwargs` for a function with **kwargs, else only those it names."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


# ---------------------------------------------------------------------------------------------------------------
# Calling


class RewardOutputError(ValueError):
    """A reward function returned something other than one finite float (or None) per completion."""


def call_reward(fn: Callable, kwargs: dict[str, list]) -> list[float | None]:
    """`fn` called on `kwargs`, awaited if it is async, its result checked: one float or None per completion."""
    n = len(kwargs["completions"])
    out: Any = fn(**accepted_kwargs(fn, kwargs))
    if inspect.isawaitable(out):
        out = asyncio.run(_awaited(out))
    if hasattr(out, "tolist"):  # numpy arrays, torch tensors
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        raise RewardOutputError(f"returned a {type(out).__name__}; expected a list of {n} floats (None where the "
                                "function does not apply)")
    if len(out) != n:
        raise RewardOutputError(f"returned {len(out)} values for {n} completions; expected one per completion")
    values = []
    for i, v in enumerate(out):
        if v is None:
            values.append(None)
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RewardOutputError(f"value {i} is a {type(v).__name__} ({str(v)[:40]}); expected a float or None")
        if not math.isfinite(v):
            raise RewardOutputError(f"value {i} is {v}; expected a finite float (None where it does not apply)")
        values.append(float(v))
    return values


async def _awaited(awaitable):
    return await awaitable


_ROOT = Path(__file__).resolve().parents[2]
_OURS = tuple(str(_ROOT / d) + "/" for d in ("actors", "cluster", "core", "learner", "rollout"))


def _users(filename: str) -> bool:
    """A frame of the user's code: not qgrpo's, not Python's library, not an installed package."""
    return not (filename.startswith(_OURS) or "site-packages" in filename or "dist-packages" in filename
                or filename.startswith((sys.base_prefix, sys.prefix)) or filename.startswith("<"))


def failure_trace(exc: BaseException) -> tuple[str, str]:
    """(where, traceback) of a reward call that raised: `where` is the innermost frame outside qgrpo, the Python
    library and installed packages ("my_rewards.py:12 in tolerant: float(text)"; "" when every frame is ours), so a
    message can point at the user's own line; `traceback` is the whole formatted traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if _users(f.filename)]
    where = ""
    if mine:
        f = mine[-1]
        where = f"{f.filename}:{f.lineno} in {f.name}" + (f": {f.line.strip()}" if f.line else "")
    return where, "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
