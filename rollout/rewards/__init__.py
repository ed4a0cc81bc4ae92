"""Rewards: the built-ins, verifiers, a user's own functions, remote endpoints and a reward model, all called the same
way (the calling convention: rollout/rewards/calls.py) and combined by rollout/rewards/scoring.py."""
from qgrpo.rollout.rewards.builtin import (  # noqa: F401
    ANSWER_READERS,
    CHECKS,
    ON_ERROR,
    REWARD_FUNCTIONS,
    RewardError,
    answer_correct,
    answer_format,
    answer_key,
    answers_match,
    completion_with_answer,
    correct,
    exact,
    extract_answer,
    extract_integer,
    integer_format,
    last_number,
    lenient_answer,
    lenient_correct,
    text_answer,
    text_match,
)
from qgrpo.rollout.rewards.verifiers import math_verify, rg_score

REWARD_FUNCTIONS.update(rg_score=rg_score, math_verify=math_verify)
MODEL_REWARD = "reward_model"  # scored by the [reward_model] actors, not called in a reward worker
ENVIRONMENT_REWARD = "environment"  # the environment's score: added by [environment].weight, never listed by name
REWARD_NAMES = (*(n for n in REWARD_FUNCTIONS if n != ENVIRONMENT_REWARD), MODEL_REWARD)  # rewards.functions[].name
