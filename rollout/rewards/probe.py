"""`qgrpo check` (and `qgrpo train`, before Ray starts) calls every reward once, so that a reward that raises, hangs,
returns garbage or cannot be reached is refused before anything starts, not at step 1.

The call is the one a step makes (rollout/rewards/calls.py): the keywords of the convention, the rows' own columns
included, for stand-in completions of the first PROBE_ROWS rows of the train split, built as training builds them
(`make_task(...).item(i)`). Each row gets four completions: its reference answer tagged (`<answer>REF</answer>`) and
bare (`REF`), and a wrong answer written the same two ways (`wrong_answer`: a number sharing no digit with a numeric
reference, else a word unlike it). `completion_ids` holds one stand-in id per character (the tokenizer is not
loaded yet); `finish_reasons` are "stop".

Each entry is called once under its own deadline, as a step calls it (`call_with_deadline`): built-ins and user
functions get their entry's timeout_s; a URL gets at most URL_WAIT_S, and a URL that only runs out of that shorter
wait is a hint, not a problem (a slow server is not refused). The reward model is not called (its classifier is not
loaded before Ray starts). A hung function's thread cannot be stopped: it is a daemon thread, so the process still
exits once check reports it (train refuses, so no run starts beside it).

What it finds: a problem per entry that raised (with the user's own line, `failure_trace`), passed its deadline,
returned the wrong count or a non-finite or non-number value, or (a URL) could not be reached or answered garbage;
and a hint when no reward scores the reference answer above the wrong one on any row (a reward that cannot read the
task's answers, such as `correct` on the word "Brussels", gives training nothing to learn from).
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path

from qgrpo.rollout.rewards.builtin import NUMBER_READERS, completion_with_answer
from qgrpo.rollout.rewards.scoring import (
    CallResult,
    RewardEntry,
    call_with_deadline,
    entries_from_config,
    make_callable,
)

PROBE_ROWS = 2  # train rows the stand-in completions answer
URL_WAIT_S = 10.0  # the longest check waits for a URL (its timeout_s when shorter)
FORMS = ("answer_correct", "exact")  # completion_with_answer's two ways to write an answer: tagged, bare
WORDS = ("xylophone", "zeppelin")  # wrong answers to a reference that is not a number


@dataclass
class Probe:
    problems: list[str] = field(default_factory=list)  # one line each, "rewards.functions[i] (LABEL): ...; fix"
    hints: list[str] = field(default_factory=list)  # what runs but likely wastes the run
    found: str = ""  # what passed, in a few words


def wrong_answer(reference: str) -> str:
    """An answer unlike `reference`: for a number, one sharing none of its digits and longer (7 -> 11, 150 -> 2222),
    so no tolerance or substring match takes it for the reference; for anything else, a word it does not contain."""
    ref = str(reference).strip()
    number = ref.lstrip("+-").replace(",", "")
    if number.replace(".", "", 1).isdigit():
        digit = next((d for d in "123456789" if d not in number), "")
        return digit * (len(number) + 1) if digit else "-1"  # -1: a reference holding every digit 1-9
    return next(w for w in WORDS if w not in ref.casefold())


def stand_ins(item) -> list[str]:
    """The completions of one row: its reference answer tagged and bare, then the wrong answer written so."""
    return [completion_with_answer(f, a) for a in (str(item.reference), wrong_answer(item.reference)) for f in FORMS]


def probe_kwargs(items: list) -> dict[str, list]:
    """The keywords of one call on the stand-in completions of `items` (PromptItems), four per row."""
    from qgrpo.core.records import Completion
    from qgrpo.rollout.rewards.calls import reward_kwargs

    rows = [(it, text) for it in items for text in stand_ins(it)]
    return reward_kwargs([it for it, _ in rows], [Completion([ord(c) for c in t], [0.0] * len(t), "stop", t)
                                                  for _, t in rows])


def _deadline(entry: RewardEntry) -> float:
    return min(entry.timeout_s, URL_WAIT_S) if entry.kind == "url" else entry.timeout_s


def _call(entry: RewardEntry, kwargs: dict[str, list]) -> CallResult:
    try:  # a URL's attempts share the probe's deadline, as a step's share the entry's
        fn = make_callable(dataclasses.replace(entry, timeout_s=_deadline(entry)))
    except Exception as e:  # reward_problems imported it already; a second failure is still reported
        return CallResult(entry.label, None, f"{type(e).__name__}: {e}")
    return call_with_deadline(entry.label, fn, kwargs, _deadline(entry))


def _failure(entry: RewardEntry, r: CallResult, rows: int, n: int) -> tuple[str, str]:
    """("problem" or "hint", the line) for a failed call."""
    head, on = f"{entry.field} ({entry.label})", f"{n} stand-in completions of {rows} train rows"
    fix = {"builtin": "install what it needs or choose another reward",
           "function": "fix the function (check calls each reward once on the reference answer and a wrong one)"}
    if entry.kind == "url":
        wait = _deadline(entry)
        if r.timed_out or "timed out" in r.error:
            if wait < entry.timeout_s:
                return "hint", (f"{entry.field}.url: {entry.target} did not answer {on} within the {wait:g} s "
                                f"check waits (its timeout_s is {entry.timeout_s:g} s), so it was not checked; make "
                                "sure it is up before the run starts")
            return "problem", (f"{entry.field}.url: {entry.target} did not answer {on} within its timeout of "
                               f"{wait:g} s; make sure the server is up and fast enough, or raise {entry.field}"
                               ".timeout_s")
        return "problem", (f"{entry.field}.url: calling it on {on} failed: {r.error.split(': ', 1)[-1]}; start the "
                           "server or fix the URL; it must answer a JSON list of one number (or null) per completion")
    if r.timed_out:
        return "problem", (f"{head}: calling it on {on} did not return within its timeout of {entry.timeout_s:g} "
                           "s; make it faster (a step's calls hold group_size completions per prompt), or raise "
                           f"{entry.field}.timeout_s")
    if r.error.startswith("RewardOutputError: "):
        return "problem", f"{head}: called on {on}: {r.error.removeprefix('RewardOutputError: ')}; {fix[entry.kind]}"
    at = f" at {r.where.removeprefix(str(Path.cwd()) + '/')}" if r.where else ""  # a file under the cwd: as named
    return "problem", f"{head}: calling it on {rows} rows of the train split raised {r.error}{at}; {fix[entry.kind]}"


def _tells(entry: RewardEntry, values: list, rows: int) -> bool:
    """Whether `entry` favours a reference answer over the wrong one written the same way, on some row."""
    k = len(FORMS)  # a row's values: its k right completions, then its k wrong ones
    pairs = [(values[2 * k * i + j], values[2 * k * i + k + j]) for i in range(rows) for j in range(k)]
    return any(entry.weight * (r - w) > 0 for r, w in pairs if r is not None and w is not None)


def _gives(entry: RewardEntry, values: list) -> str:
    k, label = len(FORMS), entry.label
    right, wrong = [v for v in values[:k] if v is not None], [v for v in values[k:2 * k] if v is not None]
    if not right and not wrong:
        return f"{label} returns None (does not apply)"
    if right and wrong and len(set(right + wrong)) == 1:
        return f"{label} gives {round(right[0], 3)} to both"
    return (f"{label} gives {round(max(right, default=0.0), 3)} to the reference and "
            f"{round(max(wrong, default=0.0), 3)} to the wrong one")


def _signal_hint(entries: list[RewardEntry], results: dict[str, CallResult], items: list) -> str:
    ref = str(items[0].reference)
    texts = stand_ins(items[0])
    gives = ", ".join(_gives(e, results[e.label].values) for e in entries)
    readers = [e.target for e in entries if e.kind == "builtin" and e.target in NUMBER_READERS]
    words = [it.reference for it in items if wrong_answer(it.reference) in WORDS]
    why = (f" ({', '.join(readers)} read{'s' * (len(readers) == 1)} a number, and references such as {words[0]!r} "
           "are words)") if readers and words else ""
    return (f"no reward scores the reference answer above a wrong one on the train rows: {gives}, on "
            f"{texts[0]!r} / {texts[1]!r} against {texts[2]!r} / {texts[3]!r} (reference {ref!r}){why}; training "
            "gets no signal from a right answer: use a reward that reads answers as the references are written "
            "(answer_correct or text_match for words in <answer> tags, math_verify for mathematics), or fix "
            "your function's parsing")


def probe_rewards(rewards_cfg, items: list, here: bool = True, signal: bool = True) -> Probe:
    """Every entry of `rewards_cfg` but the reward model, called once on the stand-in completions of `items` (the
    train rows). `here`: the run's reward workers call URLs from this machine; otherwise (a cluster, --gpus) a URL
    that cannot be reached from here is a hint, not a problem. `signal`: hint when no reward tells the reference
    answer from a wrong one (False where another score carries the signal: an environment's)."""
    out = Probe()
    entries = entries_from_config(rewards_cfg)
    kwargs, n = probe_kwargs(items), len(items) * 2 * len(FORMS)
    results: dict[str, CallResult] = {}
    for e in entries:
        if e.kind == "model":
            continue
        r = results[e.label] = _call(e, kwargs)
        if r.values is None:
            kind, line = _failure(e, r, len(items), n)
            if e.kind == "url" and not here:
                kind, line = "hint", f"{line} (from this machine; the run's reward workers call it from the cluster)"
            (out.problems if kind == "problem" else out.hints).append(line)
    ok = [e for e in entries if e.label in results and results[e.label].values is not None]
    tells = [e.label for e in ok if _tells(e, results[e.label].values, len(items))]
    if signal and not tells and len(ok) == len(entries):  # every reward answered (none is the model) and none tells
        out.hints.append(_signal_hint(ok, results, items))
    model = len(results) < len(entries)
    out.found = (f"{len(results)} reward{'s' * (len(results) != 1)} called once on the reference answer and a wrong "
                 f"one of {len(items)} train rows"
                 + (f"; {', '.join(tells)} score{'s' * (len(tells) == 1)} the reference higher" if tells else "")
                 + ("; reward_model not called (check does not load it)" if model else ""))
    return out


def probe_checks(cfg, here: bool = True, progress=None) -> list[str]:
    """`probe_rewards` on the first PROBE_ROWS train rows of `cfg`'s task, for `qgrpo check` and `qgrpo train`
    before Ray starts: hints and what passed told to `progress` (cluster/cli/train.py's Progress; without one, hints
    are printed on stderr); returns the problems, [] when every reward answered."""
    from qgrpo.rollout.data.tasks import make_task

    if not cfg.rewards.functions:  # [] with an [environment]: its own score alone, probed with it
        return []
    try:
        task = make_task(cfg.task, cfg.run.seed)
        try:
            size = len(task)
        except TypeError:  # generated without end
            size = PROBE_ROWS
        items = [task.item(i) for i in range(min(PROBE_ROWS, size))]
    except Exception:  # check_task reports the task's own problems
        return []
    if not items:
        return []
    env = cfg.environment  # an environment's score is a reward of its own, probed by itself
    probe = probe_rewards(cfg.rewards, items, here, signal=not (env.name and env.weight))
    return reported(probe, progress, "calls")


def first_row(cfg):
    """The first train row (a PromptItem) of `cfg`'s task, which the environment's and the agent's probes play;
    None when the task cannot be read (check_task reports the task's own problems)."""
    from qgrpo.rollout.data.tasks import make_task

    try:
        return make_task(cfg.task, cfg.run.seed).item(0)
    except Exception:  # noqa: BLE001 - reported by check_task
        return None


def reported(probe, progress, what: str) -> list[str]:
    """A probe's hints told (on `progress`, the check's report, else stderr), its pass counted as `what`; its
    problems returned."""
    for hint in probe.hints:
        if progress is not None:
            progress.hint(hint)
        else:
            print(f"qgrpo: hint: {hint}", file=sys.stderr)
    if not probe.problems and progress is not None:
        progress.passed(what, probe.found)
    return probe.problems
