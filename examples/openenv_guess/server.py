"""Guess the number as an OpenEnv environment: the game of examples/guess_number, written against OpenEnv's server
interface (openenv-core: an `Environment` with typed `Action` and `Observation`) instead of qgrpo's contract, so that
qgrpo plays it through its OpenEnv adapter (`environment.name = "openenv:server.py:GuessEnvironment"`), in its own
environment workers, or over the network once served:

    .venv/bin/python examples/openenv_guess/server.py --port 8000     # then environment.name = "openenv:http://..."

The episode hides a digit: the row's "answer" when reset is given one (qgrpo passes the row's keys that reset names),
else one drawn from the seed. Each guess is answered "+" (higher), "-" (lower) or "/" (not one digit); the right
guess ends the episode with a reward of 1, less `turn_penalty` per guess before it.
"""
from __future__ import annotations

import argparse
import random
import uuid
from typing import Any, Optional

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    guess: str  # the model's turn


class GuessObservation(Observation):
    feedback: str = ""  # "+", "-" or "/" after a guess; "" at reset (the row's prompt is the question)


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # no state shared between instances: one per session

    def __init__(self, turn_penalty: float = 0.1):
        super().__init__()
        self.turn_penalty = turn_penalty
        self.hidden, self._state = 0, State(episode_id=None, step_count=0)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, answer: Any = None,
              **kwargs: Any) -> GuessObservation:
        self.hidden = int(answer) if answer is not None else random.Random(seed).randrange(10)
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return GuessObservation(feedback="")

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        guess = action.guess.strip()
        if len(guess) != 1 or not guess.isdigit():
            return GuessObservation(feedback="/")
        if int(guess) == self.hidden:
            reward = max(0.0, 1.0 - self.turn_penalty * (self._state.step_count - 1))
            return GuessObservation(feedback="=", done=True, reward=reward)
        return GuessObservation(feedback="+" if self.hidden > int(guess) else "-")

    @property
    def state(self) -> State:
        return self._state


def main() -> None:
    ap = argparse.ArgumentParser(description="Serve the guessing game as an OpenEnv server (HTTP and WebSocket).")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-sessions", type=int, default=256, help="concurrent episodes (one per trajectory)")
    args = ap.parse_args()
    import uvicorn
    from openenv.core.env_server.http_server import create_fastapi_app

    app = create_fastapi_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=args.max_sessions)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
