"""Writes problems.jsonl: 3-digit multiplications, "Calculate 123 * 456." with the product as the answer; 400 rows,
the last 100 of them held out by config.toml. Deterministic: `python make_data.py` writes the same file."""
import json
import random
from pathlib import Path

rng = random.Random(39)
with (Path(__file__).parent / "problems.jsonl").open("w") as f:
    for _ in range(400):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        f.write(json.dumps({"question": f"Calculate {a} * {b}.", "answer": a * b}) + "\n")
