"""cluster/config/preflight.py: the checks between a valid config and starting Ray, on the real tiny model and
tokenizer."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from qgrpo.cluster.config.preflight import (
    TRAIN_SAMPLE,
    length_hints,
    model_context,
    precision_hints,
    preflight,
    sample_items,
)
from qgrpo.cluster.config.schema import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
SMOLLM2 = ROOT / "configs" / "smollm2_arith.toml"


def tiny_cfg(model: str, tmp_path: Path, *overrides: str):
    return load_config(TINY, [f"model.path='{model}'", f"run.output_dir='{tmp_path / 'runs'}'", *overrides])


def only(problems: list[str], field: str) -> str:
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{field}: "), problems
    return problems[0]


def test_tiny_preset_is_clean(tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the preset's own output_dir ("runs", relative) resolves here
    cfg = load_config(TINY, [f"model.path='{tiny_model_path}'"])
    assert preflight(cfg, tiny_model_path, 2) == []
    assert preflight(cfg, tiny_model_path, None) == []


def test_smollm2_preset_is_clean_when_the_model_is_cached(tmp_path, monkeypatch):
    """The default job with its real model, if a cache already holds it (the conversion takes ~45 s: not done here)."""
    from qgrpo.rollout.modeling.models import builtin_cache_dir

    folder = builtin_cache_dir("smollm2-135m-instruct", os.environ.get("QGRPO_TEST_CACHE", ""))
    if not (folder / "config.json").is_file():
        pytest.skip(f"builtin:smollm2-135m-instruct is not converted in {folder} (set QGRPO_TEST_CACHE)")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(SMOLLM2, [f"model.path='{folder}'"])
    assert preflight(cfg, str(folder), 2) == []
    ctx = model_context(str(folder))
    bad = load_config(SMOLLM2, [f"model.path='{folder}'", f"rollout.max_new_tokens={ctx}"])
    assert "exceed the model's context" in only(preflight(bad, str(folder), 2), "rollout.max_new_tokens")


# ----------------------------------------------------------------------------------------------------------------
# 1. run.output_dir


def test_output_dir_under_a_file(tiny_model_path, tmp_path):
    (tmp_path / "afile").write_text("not a folder")
    cfg = tiny_cfg(tiny_model_path, tmp_path, f"run.output_dir='{tmp_path / 'afile' / 'runs'}'")
    msg = only(preflight(cfg, tiny_model_path, None), "run.output_dir")
    assert "afile" in msg and "not a folder" in msg and "writ" in msg
    assert not (tmp_path / "afile" / "runs").exists()


def test_output_dir_that_is_a_file(tiny_model_path, tmp_path):
    (tmp_path / "afile").write_text("")
    cfg = tiny_cfg(tiny_model_path, tmp_path, f"run.output_dir='{tmp_path / 'afile'}'")
    assert "a file" in only(preflight(cfg, tiny_model_path, None), "run.output_dir")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_output_dir_under_a_read_only_folder(tiny_model_path, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        cfg = tiny_cfg(tiny_model_path, tmp_path, f"run.output_dir='{ro / 'deep' / 'runs'}'")
        msg = only(preflight(cfg, tiny_model_path, None), "run.output_dir")
        assert "not writable" in msg and str(ro) in msg
    finally:
        ro.chmod(0o700)


def test_output_dir_not_created_yet_is_fine(tiny_model_path, tmp_path):
    cfg = tiny_cfg(tiny_model_path, tmp_path, f"run.output_dir='{tmp_path / 'a' / 'b' / 'c'}'")
    assert preflight(cfg, tiny_model_path, None) == []
    assert not (tmp_path / "a").exists()  # nothing is created


# ----------------------------------------------------------------------------------------------------------------
# 2. Context length


def test_max_new_tokens_beyond_the_context(tiny_model_path, tmp_path):
    ctx = json.loads((Path(tiny_model_path) / "config.json").read_text())["max_position_embeddings"]
    assert model_context(tiny_model_path) == ctx == 64
    # digit_sum with max_operand=3: "<bos>3+1=" is 5 tokens, so 59 new tokens fit and 60 do not
    assert preflight(tiny_cfg(tiny_model_path, tmp_path, f"rollout.max_new_tokens={ctx - 5}"), tiny_model_path, 2) == []
    msg = only(preflight(tiny_cfg(tiny_model_path, tmp_path, f"rollout.max_new_tokens={ctx - 4}"), tiny_model_path, 2),
               "rollout.max_new_tokens")
    assert f"{ctx - 4} new tokens + the longest prompt (5 tokens)" in msg and f"context of {ctx} positions" in msg
    assert f"rollout.max_new_tokens <= {ctx - 5}" in msg and "max_position_embeddings" in msg
    for n in (200, 100_000):
        msg = only(preflight(tiny_cfg(tiny_model_path, tmp_path, f"rollout.max_new_tokens={n}"), tiny_model_path, 2),
                   "rollout.max_new_tokens")
        assert f"{n} new tokens" in msg


def test_longest_prompt_counts_worked_examples(tiny_model_path, tmp_path):
    """The examples are part of every formatted prompt: a long one pushes the prompt past the context."""
    example = "task.examples=[{question='" + "1+" * 40 + "1=', completion='41'}]"
    problems = preflight(tiny_cfg(tiny_model_path, tmp_path, example), tiny_model_path, 2)
    assert "the prompt alone" in next(p for p in problems if p.startswith("rollout.max_new_tokens: "))
    # plain-text formatting puts blank lines between turns, and this character vocabulary has no newline
    assert "from the formatting" in next(p for p in problems if p.startswith("task.name: "))


def test_vllm_max_model_len(tiny_model_path, tmp_path):
    short = tiny_cfg(tiny_model_path, tmp_path, "rollout.backend='vllm'", "rollout.precision='bf16'",
                     "rollout.max_new_tokens=20", "rollout.vllm.max_model_len=16")
    msg = only(preflight(short, tiny_model_path, 2), "rollout.vllm.max_model_len")
    assert "max_model_len of 16 tokens" in msg and "rollout.max_new_tokens <= 11" in msg
    long = tiny_cfg(tiny_model_path, tmp_path, "rollout.backend='vllm'", "rollout.precision='bf16'",
                    "rollout.vllm.max_model_len=128")
    assert "context of 64" in only(preflight(long, tiny_model_path, 2), "rollout.vllm.max_model_len")
    ok = tiny_cfg(tiny_model_path, tmp_path, "rollout.backend='vllm'", "rollout.precision='bf16'",
                  "rollout.vllm.max_model_len=64")
    assert preflight(ok, tiny_model_path, 2) == []


def test_fp8_kv_cache_on_vllm_cpu_is_refused_where_the_cpu_lacks_avx512_and_amx(tiny_model_path, tmp_path,
                                                                               monkeypatch):
    """vllm-cpu refuses an fp8 KV cache at engine start without AVX-512 or AMX: preflight says so first, for a local
    run (cpus given), on the CPU as vLLM's probes see it (faked here, so it is tested on every machine)."""
    from qgrpo.core.cpu import isa_from
    from qgrpo.rollout.backends import vllm_kv

    vllm = ["rollout.backend='vllm'", "rollout.precision='int8'"]
    fp8 = tiny_cfg(tiny_model_path, tmp_path, *vllm, "rollout.vllm.kv_cache_dtype='fp8'")
    monkeypatch.setattr(vllm_kv, "engine_isa", lambda: isa_from({"avx2", "fma"}, "AVX2", {}, name="AMD EPYC 7B13"))
    msg = only(preflight(fp8, tiny_model_path, 2), "rollout.vllm.kv_cache_dtype")
    assert '"fp8" on CPU needs x86 with AVX-512 or AMX' in msg and "(AMD EPYC 7B13, x86_64) has neither" in msg
    assert 'set rollout.vllm.kv_cache_dtype = "auto"' in msg and "rollout.num_gpus = 1" in msg
    assert preflight(fp8, tiny_model_path, None) == []  # a cluster's nodes, not this CPU, run the actors
    # a bf16 cache; the actors on CUDA GPUs; the torch backend (no vLLM cache)
    for fine in ([*vllm], [*vllm, "rollout.vllm.kv_cache_dtype='fp8'", "rollout.num_gpus=1"],
                 ["rollout.vllm.kv_cache_dtype='fp8'"]):
        assert preflight(tiny_cfg(tiny_model_path, tmp_path, *fine), tiny_model_path, 2) == [], fine
    monkeypatch.setattr(vllm_kv, "engine_isa", lambda: isa_from({"avx512f"}, "AVX512", {}, name="AMD EPYC 9B14"))
    assert preflight(fp8, tiny_model_path, 2) == []


# ----------------------------------------------------------------------------------------------------------------
# 3. Unknown tokens


def test_words_on_the_character_tokenizer_are_unknown(tiny_model_path, tmp_path):
    cfg = tiny_cfg(tiny_model_path, tmp_path, "task.name='rg:basic_arithmetic'", "rollout.max_new_tokens=1",
                   "task.instruction=''", "task.params={min_terms=2, max_terms=2, min_digits=1, max_digits=1}")
    problems = preflight(cfg, tiny_model_path, 2)
    msg = next(p for p in problems if p.startswith("task.name: "))
    assert "rg:basic_arithmetic" in msg and "'<unk>'" in msg and tiny_model_path in msg
    assert "Calculate" in msg and "% of their tokens are unknown" in msg
    assert "choose a task this tokenizer can write, or a model whose tokenizer covers it" in msg


def test_unknown_token_shared_with_eos(tiny_model_path, tmp_path):
    """A tokenizer whose unknown token is also its EOS: only the prompt texts are checked (templates may hold EOS)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model, ignore=shutil.ignore_patterns("*.safetensors"))  # tokenizer + config only
    tc = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**tc, "eos_token": tc["unk_token"]}))
    assert preflight(tiny_cfg(str(model), tmp_path), str(model), 2) == []
    words = tiny_cfg(str(model), tmp_path, "task.name='rg:basic_arithmetic'", "rollout.max_new_tokens=1",
                     "task.instruction=''")
    assert any(p.startswith("task.name: ") and "unknown" in p for p in preflight(words, str(model), 2))


def test_sample_is_bounded_and_includes_eval(tmp_path):
    cfg = load_config(TINY, [f"run.output_dir='{tmp_path}'", "task.eval_size=7"])
    assert len(sample_items(cfg)) == TRAIN_SAMPLE + 7
    cfg = load_config(TINY, [f"run.output_dir='{tmp_path}'", "task.eval_size=7", "run.eval=false"])
    assert len(sample_items(cfg)) == TRAIN_SAMPLE


def test_longest_rows_of_a_file_are_sampled(tiny_model_path, tmp_path):
    """A user file's one long row, far past the first TRAIN_SAMPLE rows, is still found."""
    rows = [{"prompt": "1+1=", "answer": "2"}] * (TRAIN_SAMPLE + 200) + [{"prompt": "1+" * 40 + "1=", "answer": "41"}]
    rows += [{"prompt": "2+2=", "answer": "4"}] * 10
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tiny_cfg(tiny_model_path, tmp_path, "task.name='jsonl'", f"task.path='{path}'", "task.instruction=''",
                   "task.eval_size=10")
    assert "longest prompt (83 tokens)" in only(preflight(cfg, tiny_model_path, 2), "rollout.max_new_tokens")


# ----------------------------------------------------------------------------------------------------------------
# 4. CPUs


def test_too_many_rollout_actors(tiny_model_path, tmp_path):
    cfg = tiny_cfg(tiny_model_path, tmp_path, "rollout.num_actors=64")
    problems = preflight(cfg, tiny_model_path, 2)
    assert problems and all(p.split(":")[0] in ("rollout.num_actors", "rollout.num_cpus") for p in problems)
    msg = next(p for p in problems if p.startswith("rollout.num_actors: "))
    assert "64 rollout actors on 2 CPUs" in msg and "--ray-address" in msg
    assert preflight(cfg, tiny_model_path, None) == []  # a cluster of unknown size: not judged
    assert preflight(cfg, tiny_model_path, 64) == []


def test_too_many_learner_ranks(tiny_model_path, tmp_path):
    cfg = tiny_cfg(tiny_model_path, tmp_path, "learner.world_size=4")
    problems = preflight(cfg, tiny_model_path, 2)
    assert "4 learner ranks on 2 CPUs" in next(p for p in problems if p.startswith("learner.world_size: "))
    # and 1 + 4 Ray CPUs are more than twice the 2 cores: the learner's share names the second message
    assert [p.split(":")[0] for p in problems] == ["learner.world_size", "learner.num_cpus"]


def test_ray_cpus_may_share_cores_twice_over(tiny_model_path, tmp_path):
    # 2 actors + 1 rank + the reference (kl_coeff > 0) = 4 logical CPUs on 2 cores is fine (twice over)
    fine = tiny_cfg(tiny_model_path, tmp_path, "reference.num_cpus=1", "rollout.num_actors=2")
    assert preflight(fine, tiny_model_path, 2) == []
    heavy = tiny_cfg(tiny_model_path, tmp_path, "rollout.num_cpus=2", "rollout.num_actors=2", "learner.num_cpus=1")
    msg = only(preflight(heavy, tiny_model_path, 2), "rollout.num_cpus")
    assert "asks Ray for 5 CPUs" in msg and "--ray-address" in msg
    # the reference actor exists only with a KL term, so its CPUs count only then
    no_kl = tiny_cfg(tiny_model_path, tmp_path, "reference.num_cpus=8", "algo.kl_coeff=0")
    assert preflight(no_kl, tiny_model_path, 2) == []
    kl = tiny_cfg(tiny_model_path, tmp_path, "reference.num_cpus=8")
    assert "10 CPUs" in only(preflight(kl, tiny_model_path, 2), "reference.num_cpus")


# ----------------------------------------------------------------------------------------------------------------
# Hints: rollout.max_new_tokens against what task.instruction asks for


def _file_cfg(tiny_model_path, tmp_path, *overrides):
    path = tmp_path / "data.jsonl"
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(60)]  # train answers 0..108
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tiny_cfg(tiny_model_path, tmp_path, "task.name='jsonl'", f"task.path='{path}'", "task.eval_size=5",
                    *overrides)


def test_length_hint_names_the_field_and_a_value(tiny_model_path, tmp_path):
    ask = "task.instruction='Give the final answer inside <answer></answer>.'"
    # the character tokenizer: '<answer>100</answer>' (the first longest answer) is 20 tokens, 21 with the end token
    (hint,) = length_hints(_file_cfg(tiny_model_path, tmp_path, ask, "rollout.max_new_tokens=8"), tiny_model_path)
    assert hint.startswith("rollout.max_new_tokens: 8 new tokens are fewer than task.instruction asks for")
    assert "'<answer>100</answer>' alone takes 21 tokens" in hint
    assert hint.endswith("set rollout.max_new_tokens = 24 or more")
    assert length_hints(_file_cfg(tiny_model_path, tmp_path, ask, "rollout.max_new_tokens=21"), tiny_model_path) == []
    assert length_hints(_file_cfg(tiny_model_path, tmp_path, ask, "rollout.max_new_tokens=20"), tiny_model_path)


def test_length_hint_counts_thinking_and_worked_examples(tiny_model_path, tmp_path):
    think = "task.instruction='Think briefly, then give only the final answer inside <answer></answer>.'"
    (hint,) = length_hints(_file_cfg(tiny_model_path, tmp_path, think, "rollout.max_new_tokens=24"), tiny_model_path)
    assert "asks the model to think first" in hint and hint.endswith("= 56 or more")  # 21 + 32, rounded up to 8s
    example = "task.examples=[{question='1+1=', completion='1 + 1 = 2 so the answer is <answer>2</answer>'}]"
    (hint,) = length_hints(_file_cfg(tiny_model_path, tmp_path, "task.instruction='Answer in <answer></answer>.'",
                                     example, "rollout.max_new_tokens=24"), tiny_model_path)
    assert "the worked example's completion" in hint and "takes 46 tokens" in hint and hint.endswith("= 48 or more")


def test_no_length_hint_without_tags_or_for_digit_sum(tiny_model_path, tmp_path):
    assert length_hints(_file_cfg(tiny_model_path, tmp_path, "task.instruction='Answer briefly.'",
                                  "rollout.max_new_tokens=1"), tiny_model_path) == []
    digits = tiny_cfg(tiny_model_path, tmp_path, "task.instruction='Answer in <answer></answer>.'")
    assert length_hints(digits, tiny_model_path) == []  # digit_sum shows no instruction


def test_output_dir_where_no_folder_can_be_made_even_by_root(tmp_path):
    """os.access lets root through everywhere; /proc takes no folder all the same. The probe leaves nothing behind."""
    from qgrpo.cluster.config.preflight import output_dir_problems

    (msg,) = output_dir_problems("/proc/qgrpo-runs")
    assert msg.startswith("run.output_dir: '/proc/qgrpo-runs' cannot be created: its nearest existing parent '/proc'")
    assert output_dir_problems(str(tmp_path / "runs")) == [] and not list(tmp_path.iterdir())


def test_int4_on_a_gpu_with_the_torch_backend_hints_that_it_costs_time(tiny_model_path, tmp_path):
    gpu = ("rollout.backend='torch'", "rollout.num_gpus=0.5")
    (hint,) = precision_hints(tiny_cfg(tiny_model_path, tmp_path, *gpu, "rollout.precision='int4'"))
    assert hint.startswith('rollout.precision = "int4" decodes slower than bf16 with the torch backend on cuda: '
                           "0.27-0.82x of bf16's tokens/s")
    assert "docs/quantization.md#on-a-gpu" in hint and 'choose "int8"' in hint
    assert "0.46-0.52x" in precision_hints(tiny_cfg(tiny_model_path, tmp_path, *gpu, "rollout.precision='nf4'"))[0]
    # int8 on a GPU, and int4 on a CPU (where it is measured by another bench), get none
    assert precision_hints(tiny_cfg(tiny_model_path, tmp_path, *gpu, "rollout.precision='int8'")) == []
    assert precision_hints(tiny_cfg(tiny_model_path, tmp_path, "rollout.backend='torch'", "rollout.num_gpus=0",
                                    "rollout.precision='int4'")) == []
