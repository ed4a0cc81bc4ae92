"""The episode loop of multi-turn rollouts (rollout/episodes.py) with SmolLM2's real tokenizer and chat template, and
stand-ins for the generator and the environment client only: the tokens of a trajectory are the model's as sampled
and the environment's as the template renders them, appended; the masks, log-probs, turns and finish reasons."""
from __future__ import annotations

import dataclasses

import pytest
from transformers import AutoTokenizer

from qgrpo.core.records import Completion, PromptItem, SamplingParams
from qgrpo.learner.batch import pack_rollouts
from qgrpo.rollout.environments.contract import EnvFailure, StepResult
from qgrpo.rollout.episodes import FINISHES, EpisodeError, EpisodeLimits, Episodes, episode_metrics, render
from qgrpo.rollout.modeling.models import resolve_model_path

IM_END = 2  # SmolLM2's <|im_end|>, its stop token


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve_model_path("builtin:smollm2-135m-instruct", None))


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


class ScriptedGenerator:
    """Answers each continue_ids call with the next scripted turn of each row (token ids), log-prob -0.5 a token;
    a turn ending in the stop token finishes with "stop". Records what it was given."""

    policy_version = 0

    def __init__(self, tok, turns: dict[int, list[list[int]]]):
        self.tok, self.turns, self.calls = tok, turns, []

    def continue_ids(self, sequences, sampling):
        self.calls.append(([list(s) for s in sequences], sampling))
        out = []
        for s in sequences:
            row = self.row_of(s)
            ids = self.turns[row].pop(0)[:sampling.max_new_tokens]
            out.append(Completion(ids, [-0.5] * len(ids), "stop" if ids and ids[-1] == IM_END else "length",
                                  self.tok.decode(ids, skip_special_tokens=True)))
        return out

    def row_of(self, sequence):  # rows are told apart by the digit of their prompt
        return int(self.tok.decode(sequence).split("guess ")[1][0])


class GuessClient:
    """A higher/lower game held in this process: the hidden number is the row's answer; keys -> state."""

    def __init__(self, fail_step_for=(), fail_reset_for=()):
        self.state, self.fail_step_for, self.fail_reset_for, self.dropped = {}, fail_step_for, fail_reset_for, []

    def reset(self, keys, rows):
        out = []
        for k, r in zip(keys, rows):
            self.state[k] = {"answer": int(r["answer"]), "found": False}
            out.append(EnvFailure(k, "ValueError: bad row") if r["answer"] in self.fail_reset_for else
                       [{"role": "user", "content": r["prompt"]}])
        return out

    def step(self, keys, turns):
        out = []
        for k, text in zip(keys, turns):
            s = self.state[k]
            if str(s["answer"]) in self.fail_step_for:
                out.append(EnvFailure(k, "RuntimeError: the game broke"))
                continue
            guess = int(text.strip()[:1]) if text.strip()[:1].isdigit() else -1
            if guess == s["answer"]:
                s["found"] = True
                out.append(StepResult([], done=True, reward=1.0))
            else:
                out.append(StepResult([{"role": "user", "content": "higher" if guess < s["answer"] else "lower"}]))
        return out

    def score(self, keys):
        return [1.0 if self.state[k]["found"] else 0.0 for k in keys]

    def drop(self, keys):
        self.dropped += list(keys)


def _item(n: int, answer: int) -> PromptItem:
    return PromptItem(f"row{n}", f"guess {n}: a digit", str(answer))


def test_a_trajectory_is_the_sampled_tokens_plus_the_rendered_environment_turns(tok):
    five, three = _ids(tok, "5") + [IM_END], _ids(tok, "3") + [IM_END]
    gen = ScriptedGenerator(tok, {1: [five, three]})
    gen.policy_version = 7
    episodes = Episodes(gen, tok, [IM_END], GuessClient(), EpisodeLimits(max_turns=4, turn_tokens=8, max_context=512))
    (group,) = episodes.run([_item(1, 3)], SamplingParams(1, 8, seed=5), "k", 7, "gen-0", "int8")
    (c,) = group.completions
    assert c.finish_reason == "stop" and c.env_score == 1.0 and c.text == "3"
    assert group.policy_version == 7 and c.token_versions is None  # one version sampled every token
    # The model's tokens are exactly those sampled; between them the environment's "lower" as the template puts it
    messages = [{"role": "user", "content": "guess 1: a digit"}, {"role": "assistant", "content": "5"},
                {"role": "user", "content": "lower"}, {"role": "assistant", "content": "3"}]
    whole = _ids(tok, render(tok, messages, None, False))
    assert group.prompt_ids + c.token_ids == whole[:-1]  # the template adds "\n" after the last <|im_end|>
    p = len(group.prompt_ids)
    env = whole[p + len(five):len(whole) - 1 - len(three)]
    assert c.token_ids == five + env + three
    assert c.model_mask == [1] * len(five) + [0] * len(env) + [1] * len(three)
    assert c.logprobs == [-0.5] * len(five) + [0.0] * len(env) + [-0.5] * len(three)
    assert [(t["role"], t["content"]) for t in c.turns] == [("assistant", "5"), ("user", "lower"), ("assistant", "3")]
    assert [c.token_ids[t["start"]:t["end"]] for t in c.turns] == [five, env, three]
    # The second turn was generated from the whole history's tokens
    assert gen.calls[1][0] == [group.prompt_ids + five + env]
    # The learner's loss mask is the model's tokens only
    packed = pack_rollouts([group], 0, 8)
    assert packed.completion_mask[0, p:p + len(c.token_ids)].tolist() == [float(x) for x in c.model_mask]


def test_a_weight_update_inside_a_turn_is_recorded_token_by_token(tok):
    """An update lands between the two tokens of the first model turn (the generator says so in that turn's
    token_versions): the trajectory's token_versions carry it, the environment's tokens take the version of the model
    turn before them, and the next turn is sampled by the new version throughout."""
    five, three = _ids(tok, "5") + [IM_END], _ids(tok, "3") + [IM_END]
    assert len(five) == 2

    class Updated(ScriptedGenerator):
        def continue_ids(self, sequences, sampling):
            out = super().continue_ids(sequences, sampling)
            if len(self.calls) == 1:
                out[0] = dataclasses.replace(out[0], token_versions=[0, 1])
                self.policy_version = 1  # the update was applied inside this call
            return out

    gen = Updated(tok, {1: [five, three]})
    episodes = Episodes(gen, tok, [IM_END], GuessClient(), EpisodeLimits(max_turns=4, turn_tokens=8, max_context=512))
    (group,) = episodes.run([_item(1, 3)], SamplingParams(1, 8, seed=5), "k", 0, "gen-0", "int8")
    (c,) = group.completions
    env = len(c.token_ids) - len(five) - len(three)
    assert group.policy_version == 0 and c.token_versions == [0, 1] + [1] * env + [1, 1]


def test_a_model_turn_is_never_retokenized(tok):
    """"higher" sampled as "high" + "er" (not the tokenizer's own split): the trajectory keeps the sampled tokens,
    where a re-tokenized history would hold other ones."""
    split = _ids(tok, "high") + _ids(tok, "er") + [IM_END]
    assert _ids(tok, "higher") != split[:-1]  # the tokenizer's own split differs
    gen = ScriptedGenerator(tok, {2: [split, _ids(tok, "9") + [IM_END]]})
    episodes = Episodes(gen, tok, [IM_END], GuessClient(), EpisodeLimits(max_turns=2, turn_tokens=8, max_context=512))
    (group,) = episodes.run([_item(2, 9)], SamplingParams(1, 8), "k", 0, "gen-0", "bf16")
    c = group.completions[0]
    assert c.token_ids[:len(split)] == split and c.finish_reason == "stop"
    retokenized = _ids(tok, render(tok, [{"role": "user", "content": "guess 2: a digit"},
                                          {"role": "assistant", "content": "higher"}], None, False))
    assert retokenized[len(group.prompt_ids):len(group.prompt_ids) + len(split)] != split
    assert gen.calls[1][0][0][len(group.prompt_ids):len(group.prompt_ids) + len(split)] == split


def test_max_turns_and_the_context_budget_end_trajectories(tok):
    wrong = _ids(tok, "0") + [IM_END]
    gen = ScriptedGenerator(tok, {3: [wrong] * 5})
    episodes = Episodes(gen, tok, [IM_END], GuessClient(), EpisodeLimits(max_turns=2, turn_tokens=8, max_context=512))
    c = episodes.run([_item(3, 7)], SamplingParams(1, 8), "k", 0, "g", "bf16")[0].completions[0]
    assert c.finish_reason == "max_turns" and c.env_score == 0.0
    assert sum(t["role"] == "assistant" for t in c.turns) == 2

    gen = ScriptedGenerator(tok, {3: [wrong] * 5})
    prompt = len(_ids(tok, render(tok, [{"role": "user", "content": "guess 3: a digit"}], None, True)))
    episodes = Episodes(gen, tok, [IM_END], GuessClient(),
                        EpisodeLimits(max_turns=9, turn_tokens=8, max_context=prompt + 5))
    c = episodes.run([_item(3, 7)], SamplingParams(1, 8), "k", 0, "g", "bf16")[0].completions[0]
    assert c.finish_reason == "context" and len(group_len := c.token_ids) + prompt >= prompt + 5 and group_len


def test_environment_failures_follow_on_error(tok):
    gen = ScriptedGenerator(tok, {4: [_ids(tok, "1") + [IM_END]] * 4})
    client = GuessClient(fail_step_for=("6",))
    episodes = Episodes(gen, tok, [IM_END], client, EpisodeLimits(max_turns=3, turn_tokens=8, max_context=512))
    group = episodes.run([_item(4, 6)], SamplingParams(2, 8), "k", 0, "g", "bf16")[0]
    assert [c.finish_reason for c in group.completions] == ["env_error", "env_error"]
    assert all(c.env_score == 0.0 and "the game broke" in c.turns[-1]["error"] for c in group.completions)
    assert sorted(client.dropped) == ["k/0/0", "k/0/1"]  # every trajectory's environment is released

    gen = ScriptedGenerator(tok, {4: [_ids(tok, "1") + [IM_END]] * 4})
    strict = Episodes(gen, tok, [IM_END], GuessClient(fail_step_for=("6",)),
                      EpisodeLimits(max_turns=3, turn_tokens=8, max_context=512, on_error="fail"))
    with pytest.raises(EpisodeError, match="row4.*the game broke.*on_error"):
        strict.run([_item(4, 6)], SamplingParams(1, 8), "k", 0, "g", "bf16")


def test_a_trajectory_ended_on_a_turn_cut_at_turn_tokens_finishes_length(tok):
    # "7" then a space and more, cut at 2 tokens without the stop token: the environment reads the guess and ends the
    # game, but the model's turn did not end, so the trajectory is truncated ("length"), as a single-turn completion
    # cut at max_new_tokens is; with room for the stop token the same game finishes "stop"
    cut = _ids(tok, "7 is it")
    assert len(cut) > 2
    for turn_tokens, finish in ((2, "length"), (len(cut) + 1, "stop")):
        gen = ScriptedGenerator(tok, {3: [cut + [IM_END]]})
        episodes = Episodes(gen, tok, [IM_END], GuessClient(),
                            EpisodeLimits(max_turns=3, turn_tokens=turn_tokens, max_context=512))
        c = episodes.run([_item(3, 7)], SamplingParams(1, 8), "k", 0, "g", "bf16")[0].completions[0]
        assert c.finish_reason == finish and c.env_score == 1.0
    # a cut turn the environment answers does not end the trajectory: the next turn ("7" and the stop token) does
    gen = ScriptedGenerator(tok, {3: [_ids(tok, "0 or"), _ids(tok, "7") + [IM_END]]})
    episodes = Episodes(gen, tok, [IM_END], GuessClient(), EpisodeLimits(max_turns=3, turn_tokens=2, max_context=512))
    group = episodes.run([_item(3, 7)], SamplingParams(1, 8), "k", 0, "g", "bf16")[0]
    assert group.completions[0].finish_reason == "stop"
    assert sum(t["role"] == "assistant" for t in group.completions[0].turns) == 2
    m = episode_metrics([group])
    assert m["episode/finish_length"] == 0.0 and m["episode/finish_stop"] == 1.0 and "length" in FINISHES


def test_a_failed_turn_carries_the_users_line_and_one_traceback(tok):
    class Traced(GuessClient):
        def step(self, keys, turns):
            return [EnvFailure(k, "ValueError: no", "env.py:9 in step: int(turn)", trace="Traceback ...\nValueError")
                    for k in keys]

    gen = ScriptedGenerator(tok, {4: [_ids(tok, "1") + [IM_END]] * 3})
    episodes = Episodes(gen, tok, [IM_END], Traced(), EpisodeLimits(max_turns=3, turn_tokens=8, max_context=512))
    group = episodes.run([_item(4, 6)], SamplingParams(3, 8), "k", 0, "g", "bf16")[0]
    last = [c.turns[-1] for c in group.completions]
    assert all(t["error"] == "ValueError: no" and t["where"] == "env.py:9 in step: int(turn)" and t["call"] == "step"
               for t in last)
    assert [("trace" in t) for t in last] == [True, False, False]  # one traceback per distinct error and call


@pytest.mark.heavy  # 17 s: a real learner on a real trajectory
def test_the_learner_scores_a_real_trajectory_as_the_generator_sampled_it(tok):
    """SmolLM2 at bf16 plays the game for real (torch generator, temperature 1): the learner's bf16 log-probs of each
    whole trajectory (one forward, as the learner scores a batch) equal the generator's on every model token, and
    the loss mask is exactly the model's tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from qgrpo.core.scoring import token_logprobs
    from qgrpo.rollout.backends.torch_backend import TorchGenerator

    path = resolve_model_path("builtin:smollm2-135m-instruct", None)
    gen = TorchGenerator(path, precision="bf16", compute_dtype="bf16")
    episodes = Episodes(gen, gen.tokenizer, gen.stop_ids, GuessClient(),
                        EpisodeLimits(max_turns=3, turn_tokens=10, max_context=512))
    groups = episodes.run([_item(5, 7), _item(6, 2)], SamplingParams(2, 10, temperature=1.0, seed=3), "k", 0,
                          "torch-0", "bf16")
    batch = pack_rollouts(groups, 0, 10).train_batch(torch.zeros(4))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    learner = token_logprobs(model, batch.input_ids).detach()
    gaps, shifted = [], []
    for row, c in enumerate(c for g in groups for c in g.completions):
        assert sum(t["role"] == "assistant" for t in c.turns) >= 2 or c.finish_reason == "stop"
        p = len(groups[row // 2].prompt_ids)
        span = slice(p, p + len(c.token_ids))
        mask = torch.tensor(c.model_mask, dtype=torch.bool)
        assert torch.equal(batch.completion_mask[row, span].bool(), mask)
        got, want = learner[row, span][mask], torch.tensor(c.logprobs)[mask]
        assert torch.isfinite(got).all() and torch.isfinite(want).all()
        gaps.append((got - want).abs())
        # a control: the learner's log-probs one token off (what a history shifted by a token would give)
        shifted.append((learner[row, p - 1:p - 1 + len(c.token_ids)][mask] - want).abs())
        assert torch.all(torch.tensor(c.logprobs)[~mask] == 0.0)
    gap, off = torch.cat(gaps), torch.cat(shifted)
    # bf16 rounding between a KV-cached decode and one full forward, which depends on the CPU's bf16 kernels: measured
    # mean 0.03, max 0.14 nats a token on an AMD EPYC; mean 0.051, max 0.24 on an Intel Xeon with AMX. A token off
    # (the control below) is more than 1 nat.
    assert len(gap) > 20 and gap.mean() < 0.08 and gap.max() < 0.5, (gap.mean(), gap.max())
    assert off.mean() > 1.0, off.mean()  # the comparison tells misaligned tokens apart
