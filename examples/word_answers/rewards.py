"""A reward of this example's own for word answers, named in config.toml as
{function = "examples/word_answers/rewards.py:names_capital"} and, by its name, as the judge of held-out accuracy
(rewards.eval_metric = "names_capital").

It is called once per batch with keyword arguments holding one entry per completion (`completions`, `references`,
...; docs/rewards.md) and returns one float per completion. Self-contained: the standard library only.
"""
from __future__ import annotations

import re
import unicodedata


def _plain(text: str) -> str:
    """Lower case, accents dropped ("Brasília" -> "brasilia"), punctuation as spaces, spaces collapsed."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return " ".join(re.sub(r"[^a-z0-9]+", " ", text.lower()).split())


def first_sentence(text: str) -> str:
    """Up to the first full stop, question mark, exclamation mark or line break that ends a sentence."""
    return re.split(r"(?<=[.!?])\s|\n", text.strip(), maxsplit=1)[0]


def names_capital(completions: list[str], references: list[str], **kwargs) -> list[float]:
    """1.0 when the first sentence of the completion names the reference capital as whole words ("The capital of
    Belgium is Brussels." for "Brussels"; "Washington" alone is not "Washington, D.C."), else 0.0. Only the first
    sentence counts, so a list of guesses that reaches the right city late earns nothing."""
    out = []
    for completion, reference in zip(completions, references):
        said, capital = f" {_plain(first_sentence(completion))} ", f" {_plain(reference)} "
        out.append(float(capital.strip() != "" and capital in said))
    return out
