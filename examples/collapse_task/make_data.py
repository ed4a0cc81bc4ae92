"""Writes examples/collapse_task/problems.jsonl: comparisons of two numbers from 10 to 199 whose answer is one of three
words, "greater", "less" or "equal", each exactly a third of the train rows and a third of the held-out rows.

A task on which a policy can collapse: any one word is right a third of the time, so always giving the same answer
scores the majority baseline (33%) and still earns reward on a third of the prompts. The numbers of a pair are close
(1 to 9 apart, or equal), so the leading digits alone often do not decide.

Deterministic: the same seed writes the same file. Run from the project folder:

    .venv/bin/python examples/collapse_task/make_data.py            # 240 train rows, then 99 held-out rows
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
ANSWERS = ("greater", "less", "equal")
QUESTION = "Is {a} greater than, less than, or equal to {b}? Answer with one word: greater, less or equal."
LOW, HIGH = 10, 199  # 190 numbers: enough distinct "equal" pairs for both parts
EXAMPLE_PAIR = (53, 49)  # config.toml's worked example: never a row here


def pair(rng: random.Random, answer: str) -> tuple[int, int]:
    a = rng.randint(LOW, HIGH)
    if answer == "equal":
        return a, a
    d = rng.randint(1, 9)
    b = a - d if answer == "greater" else a + d
    return (a, b) if LOW <= b <= HIGH else pair(rng, answer)


def rows(rng: random.Random, per_answer: int, taken: set[tuple[int, int]]) -> list[dict]:
    """`per_answer` rows of each answer, pairs not in `taken` (which they join), in a shuffled order."""
    out = []
    for answer in ANSWERS:
        for _ in range(per_answer):
            while (p := pair(rng, answer)) in taken:
                pass
            taken.add(p)
            out.append({"question": QUESTION.format(a=p[0], b=p[1]), "answer": answer})
    rng.shuffle(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train", type=int, default=80, help="train rows per answer")
    ap.add_argument("--held-out", type=int, default=33, help="held-out rows per answer (config.toml: task.eval_size "
                    "= 3 x this)")
    ap.add_argument("--out", type=Path, default=HERE / "problems.jsonl")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    taken = {EXAMPLE_PAIR}
    held = rows(rng, args.held_out, taken)  # drawn first, so that held-out pairs never recur in training
    train = rows(rng, args.train, taken)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in train + held))
    print(f"{args.out.name}: {len(train)} train rows, then {len(held)} held-out rows; each answer a third of both")


if __name__ == "__main__":
    main()
