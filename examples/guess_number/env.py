"""Guess the number: the environment hides a digit (the row's answer) and answers each guess with "+" (the number is
higher) or "-" (lower), in characters the tiny model's tokenizer has (digits and + - = * / and space). A guess that is
not one digit is answered with "/". The episode ends when the digit is guessed; the score is 1 for finding it, less
`turn_penalty` for every guess before the right one (0 if it is not found within environment.max_turns), so a model
that learns to search halves the range each turn scores highest.

The interface is qgrpo's environment contract (docs/environments.md): a new instance per trajectory, `reset` from the
dataset row, `step` per model turn, `score` at the end.
"""
from __future__ import annotations

from qgrpo.rollout.environments import Environment, StepResult


class GuessNumber(Environment):
    def __init__(self, turn_penalty: float = 0.0):
        self.turn_penalty = turn_penalty
        self.hidden, self.guesses, self.found = 0, 0, False

    def reset(self, row: dict) -> list[dict]:
        self.hidden, self.guesses, self.found = int(row["answer"]), 0, False
        return [{"role": "user", "content": str(row["prompt"])}]

    def step(self, turn: str) -> StepResult:
        self.guesses += 1
        guess = turn.strip()
        if len(guess) != 1 or not guess.isdigit():
            return StepResult([{"role": "user", "content": "/"}])
        if int(guess) == self.hidden:
            self.found = True
            return StepResult([], done=True)
        return StepResult([{"role": "user", "content": "+" if self.hidden > int(guess) else "-"}])

    def score(self) -> float:
        return max(0.0, 1.0 - self.turn_penalty * (self.guesses - 1)) if self.found else 0.0
