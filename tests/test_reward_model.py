"""The reward model ([reward_model]): the builtin tiny classifier, scoring in-process against a manual forward of the
classifier, the Ray actors against in-process scoring, the folder checks and the config rules."""
from __future__ import annotations

import json
import os
import shutil

import pytest

# Conversations of different lengths (so a batch is padded), with and without earlier turns.
PROMPTS = ["3+4", "12+5", "1", "99*3", "7-7", "2+2+2+2+2+2"]
COMPLETIONS = ["7", "17", "", "297 ", "0", "12"]
HISTORIES = [None, [("user", "1+1"), ("assistant", "2")], [], None, [{"role": "system", "content": "0"}], None]


@pytest.fixture(scope="module")
def reward_path(tmp_path_factory) -> str:
    from qgrpo.rollout.modeling.models import resolve_model_path

    cache = os.environ.get("QGRPO_TEST_CACHE") or str(tmp_path_factory.mktemp("qgrpo-cache"))
    return resolve_model_path("builtin:tiny-reward", cache)


@pytest.fixture(scope="module")
def fp32(reward_path):
    from qgrpo.rollout.rewards.classifier import RewardClassifier

    return RewardClassifier(reward_path, "fp32", batch_size=16)


def manual_scores(path: str) -> list[float]:
    """Each conversation alone (no padding) through AutoModelForSequenceClassification, read as transformers does."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    out = []
    for p, c, h in zip(PROMPTS, COMPLETIONS, HISTORIES):
        turns = [t if isinstance(t, dict) else {"role": t[0], "content": t[1]} for t in h or []]
        text = tok.apply_chat_template(turns + [{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                                       tokenize=False)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out.append(model(input_ids=ids).logits[0, 0].item())
    return out


def test_builtin_is_a_seeded_one_label_classifier_with_a_chat_template(reward_path, tmp_path):
    from safetensors.torch import load_file

    from qgrpo.rollout.rewards.classifier import build_tiny_reward

    cfg = json.loads(open(os.path.join(reward_path, "config.json")).read())
    assert cfg["architectures"] == ["LlamaForSequenceClassification"]
    assert len(cfg["id2label"]) == 1 and cfg["pad_token_id"] == 0
    for seed, name in ((0, "again"), (1, "other")):
        build_tiny_reward(tmp_path / name, seed=seed)
    a, b, c = (load_file(os.path.join(p, "model.safetensors")) for p in (reward_path, tmp_path / "again",
                                                                          tmp_path / "other"))
    assert all((a[k] == b[k]).all() for k in a)  # the same seed builds the same weights
    assert not (a["score.weight"] == c["score.weight"]).all()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(reward_path)
    text = tok.apply_chat_template([{"role": "user", "content": "3+4"}, {"role": "assistant", "content": "7"}],
                                   tokenize=False)
    assert text == "<bos>3+4=7<eos>" and tok.unk_token_id not in tok(text, add_special_tokens=False)["input_ids"]


def test_scores_equal_a_manual_forward_batched_or_one_by_one(reward_path, fp32):
    from qgrpo.rollout.rewards.classifier import RewardClassifier

    expected = manual_scores(reward_path)
    batched = fp32.score(PROMPTS, COMPLETIONS, HISTORIES)
    single = RewardClassifier(reward_path, "fp32", batch_size=1).score(PROMPTS, COMPLETIONS, HISTORIES)
    assert max(expected) - min(expected) > 0.1  # the scores differ, so a misread position would show
    assert batched == pytest.approx(expected, abs=1e-4)
    assert single == pytest.approx(expected, abs=1e-4)
    # The history counts: the same question and answer after an earlier exchange scores differently.
    assert abs(fp32.score(["12+5"], ["17"])[0] - batched[1]) > 1e-3


def test_bf16_and_int8_stay_close_to_fp32(reward_path, fp32):
    from qgrpo.rollout.quantization.quant import quant_config_summary
    from qgrpo.rollout.rewards.classifier import RewardClassifier

    ref = fp32.score(PROMPTS, COMPLETIONS, HISTORIES)
    for precision in ("bf16", "int8"):
        rc = RewardClassifier(reward_path, precision, batch_size=4)
        assert rc.score(PROMPTS, COMPLETIONS, HISTORIES) == pytest.approx(ref, abs=0.15), precision
    summary = quant_config_summary(rc.model)
    assert summary["precision"] == "int8" and summary["quantized_linears"] == 15  # 2 x 7 per layer + the score head


def test_truncation_keeps_the_end_and_lengths_must_match(reward_path):
    from qgrpo.rollout.rewards.classifier import RewardClassifier

    rc = RewardClassifier(reward_path, "fp32", max_length=4)
    full = RewardClassifier(reward_path, "fp32").encode(["12+5"], ["17"])[0]
    assert rc.encode(["12+5"], ["17"]) == [full[-4:]] and rc.truncated == 1
    with pytest.raises(ValueError, match="one of each per completion"):
        rc.score(["1", "2"], ["1"])
    with pytest.raises(ValueError, match="reward_model.precision"):
        RewardClassifier(reward_path, "int4")


def test_without_a_chat_template_the_turns_are_joined_as_text(reward_path):
    from transformers import AutoTokenizer

    from qgrpo.rollout.rewards.classifier import encode_chat

    tok = AutoTokenizer.from_pretrained(reward_path)
    tok.chat_template = None
    assert encode_chat(tok, "3+4", "7", [("user", "1+1")]) == tok("1+1\n\n3+4\n7")["input_ids"]


def test_classifier_problems_refuse_what_is_not_a_one_label_classifier(reward_path, tiny_model_path, tmp_path):
    from qgrpo.rollout.rewards.classifier import classifier_problems

    assert classifier_problems(reward_path) == []
    (msg,) = classifier_problems(tiny_model_path)
    assert msg.startswith("reward_model.path:") and "a causal LM (LlamaForCausalLM)" in msg
    assert "num_labels = 1" in msg  # the fix
    two = tmp_path / "two"
    shutil.copytree(reward_path, two)
    cfg = json.loads((two / "config.json").read_text())
    (two / "config.json").write_text(json.dumps({**cfg, "id2label": {"0": "bad", "1": "good"}}))
    (two / "tokenizer.json").unlink()
    (two / "tokenizer_config.json").unlink()
    labels, tokenizer = classifier_problems(str(two))
    assert "2 labels" in labels and "no tokenizer files" in tokenizer
    assert "does not exist" in classifier_problems(str(tmp_path / "none"))[0]


def test_actors_score_as_the_classifier_does_in_process(ray_session, reward_path, fp32):
    import ray

    from qgrpo.actors.reward_model_actor import score_on, start_reward_models
    from qgrpo.cluster.config.sections import RewardModelConfig

    rm = RewardModelConfig(path=reward_path, precision="fp32", num_actors=2, batch_size=3, threads=1)
    actors = start_reward_models(rm, reward_path)
    try:
        got = score_on(actors, PROMPTS, COMPLETIONS, HISTORIES, timeout_s=rm.timeout_s)
        assert got == pytest.approx(fp32.score(PROMPTS, COMPLETIONS, HISTORIES), abs=1e-5)
        info = ray.get(actors[0].info.remote())
        assert info["architecture"] == "LlamaForSequenceClassification" and info["precision"] == "fp32"
        assert info["device"] == "cpu" and info["threads"] == 1
        assert score_on(actors, [], [], None) == []
        with pytest.raises(TimeoutError, match="reward_model.timeout_s"):  # 1200 conversations take far longer
            score_on(actors, PROMPTS * 200, COMPLETIONS * 200, HISTORIES * 200, timeout_s=0.01)
    finally:
        for a in actors:
            ray.kill(a)


def _rm_problems(data: dict) -> list[str]:
    from qgrpo.cluster.config.schema import check

    _, problems = check(data, check_environment=False)
    return [p for p in problems if "reward_model" in p]


def test_config_links_the_reward_model_and_its_reward_entry():
    entry = {"rewards": {"functions": [{"name": "answer_correct"}, {"name": "reward_model", "weight": 0.5}]}}
    assert _rm_problems({}) == []
    assert _rm_problems({**entry, "reward_model": {"path": "builtin:tiny-reward"}}) == []
    (unused,) = _rm_problems({"reward_model": {"path": "builtin:tiny-reward"}})
    assert unused.startswith("reward_model.path:") and '{name = "reward_model", weight = 1.0}' in unused
    (missing,) = _rm_problems(entry)
    assert missing.startswith("rewards.functions[1]:") and "reward_model.path is empty" in missing


def test_config_rules_of_the_reward_model_section(monkeypatch):
    from qgrpo.rollout.options import QUANT_SERVED

    entry = {"rewards": {"functions": [{"name": "reward_model"}]}}

    def problems(**rm) -> list[str]:
        return _rm_problems({**entry, "reward_model": {"path": "builtin:tiny-reward", **rm}})

    assert "causal LM" in problems(path="builtin:tiny-digits")[0]
    assert "unknown builtin model 'nope'" in problems(path="builtin:nope")[0]
    assert problems(precision="int8", num_gpus=0.5) == []
    assert "reward_model.precision" in problems(precision="int4")[0]
    assert problems(num_gpus=2)[0].startswith("reward_model.num_gpus: 2 GPUs per actor")
    assert problems(resources={"GPU": 1})[0].startswith("reward_model.resources.GPU:")
    assert problems(batch_size=0)[0].startswith("reward_model.batch_size")
    monkeypatch.setitem(QUANT_SERVED, "cuda", ("bf16",))  # what rollout/quantization/quant.py runs: int8 gone on CUDA
    (msg,) = problems(precision="int8", num_gpus=1)
    assert "int8 is not served on cuda" in msg and "bf16, fp32" in msg


def test_preflight_checks_the_folder_the_path_names(reward_path, tiny_model_path, tmp_path):
    from qgrpo.cluster.config.preflight import reward_model_problems
    from qgrpo.cluster.config.schema import Config
    from qgrpo.cluster.config.sections import ModelConfig, RewardModelConfig

    def problems(path: str, cache_dir: str = "") -> list[str]:
        return reward_model_problems(Config(model=ModelConfig(cache_dir=cache_dir),
                                            reward_model=RewardModelConfig(path=path)))

    assert problems("") == [] and problems(reward_path) == []
    assert problems("builtin:tiny-reward", os.path.dirname(os.path.dirname(reward_path))) == []
    assert "a causal LM (LlamaForCausalLM)" in problems(tiny_model_path)[0]
    assert "does not exist" in problems(str(tmp_path / "none"))[0]
    assert "hf download nobody-here/no-such-reward-model" in problems("nobody-here/no-such-reward-model")[0]
