"""The real job end to end on real Ray + real DeepSpeed (int4 generators under error-feedback re-quantization, with
exploration noise in their norms): two steps change every trainable parameter, the checkpoint loads with
transformers, resume continues from the saved step, and a checkpoint of another model is refused."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qgrpo.cluster.cli.app import main
from qgrpo.cluster.config.schema import load_config
from qgrpo.rollout.rewards import correct
from tests.helpers import read_metrics

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def two_step_run(ray_session, tiny_model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    rc = main(["train", str(ROOT / "configs" / "tiny.toml"), "--set", f"model.path='{tiny_model_path}'",
               "--set", f"run.output_dir='{out}'", "--set", "run.steps=2", "--set", "run.progress=false",
               "--set", "learner.lr=1e-2", "--set", "algo.kl_coeff=0.01", "--set", "rollout.num_actors=2",
               "--set", "run.eval=true", "--set", "run.rollouts_flush_every=1",
               "--set", "sync.requantize='error_feedback'", "--set", "rollout.norm_noise=0.01",
               "--set", "rollout.cpu_wait='spin'", "--set", "learner.cpu_wait='auto'",
               "--set", "reference.cpu_wait='auto'"])
    assert rc == 0
    (run_dir,) = out.iterdir()
    return run_dir


def test_every_parameter_changed(two_step_run, tiny_model_path):
    before = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    ckpt = two_step_run / "checkpoints" / "step_000002"
    after = load_file(str(ckpt / "model.safetensors"))
    assert set(before) == set(after)
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    assert not unchanged, f"parameters that did not change: {unchanged}"
    assert all(torch.isfinite(t.float()).all() for t in after.values())


def test_run_directory_contents(two_step_run):
    cfg = load_config(two_step_run / "config.toml")  # the effective config is itself a valid preset
    assert cfg.run.steps == 2 and cfg.rollout.num_actors == 2
    rows = [m for m in read_metrics(two_step_run) if "step" in m and "reward/mean" in m]
    assert [m["step"] for m in rows] == [1, 2]
    for key in ("reward/mean", "reward/std", "loss/kl", "loss/clip_frac_low", "loss/clip_frac_high",
                "mismatch/log_ratio_mean", "mismatch/log_ratio_max", "mismatch/kl_mu_old", "perf/gen_tokens_per_s",
                "perf/learn_tokens_per_s", "rollout/policy_versions", "time/sync"):
        assert key in rows[0], key
        assert rows[0][key] == rows[0][key], f"{key} is NaN"
    assert rows[0]["rollout/policy_versions"] == [0] and rows[1]["rollout/policy_versions"] == [1]
    assert rows[1]["loss/kl"] > 0  # the reference is frozen while the policy moved
    # error feedback on the int4 actors: a step at lr 1e-2 moves a good share of the codes, and the served update
    # is of the bf16 update's size
    assert 0.01 < rows[0]["sync/code_change_frac_min"] <= 1 and 0.5 < rows[0]["sync/update_norm_ratio_min"] < 2
    # the first sync (version 1 of 2) served the sixth of ten noise stages: 1e-2 * (5e-4 / 1e-2) ** (5 / 9)
    assert rows[0]["sync/norm_noise"] == pytest.approx(1e-2 * 0.05 ** (5 / 9), rel=1e-9)
    start = next(m for m in read_metrics(two_step_run) if m.get("event") == "start")
    assert {g["precision"] for g in start["generators"]} == {"int4"} and len(start["generators"]) == 2
    assert {g["cpu_wait"] for g in start["generators"]} == {"spin"}  # the actors started with the run's wait
    # cpu_wait "auto" spins in a synchronous run on one machine
    assert start["cpu_waits"]["rollout"] == {"wait": "spin", "why": "rollout.cpu_wait = 'spin'"}
    assert start["cpu_waits"]["learner"]["wait"] == start["cpu_waits"]["reference"]["wait"] == "spin", start
    assert [r["cpu_wait"] for r in start["placement"]["learner"]] == ["spin"]  # as the rank's process started
    state = json.loads((two_step_run / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["policy_version"] == 2 and state["cursor"] == 2 * cfg.rollout.prompts_per_step


def test_checkpoint_loads_with_transformers(two_step_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = two_step_run / "checkpoints" / "step_000002"
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    tok = AutoTokenizer.from_pretrained(ckpt)
    out = model(**tok(["1+2="], return_tensors="pt"))
    assert torch.isfinite(out.logits).all()


def test_resume_continues_from_saved_step(two_step_run, tiny_model_path, tmp_path):
    import shutil

    run = shutil.copytree(two_step_run, tmp_path / two_step_run.name)  # the other tests read the 2-step run as it is
    ckpt = run / "checkpoints" / "step_000002"
    rc = main(["train", str(ROOT / "configs" / "tiny.toml"), "--set", f"model.path='{tiny_model_path}'",
               "--set", "run.steps=3", "--set", "run.progress=false", "--set", "learner.lr=1e-2",
               "--resume", str(ckpt)])
    assert rc == 0
    rows = [m for m in read_metrics(run) if "reward/mean" in m]
    assert [m["step"] for m in rows] == [1, 2, 3]
    assert rows[-1]["policy_version"] == 3 and rows[-1]["rollout/policy_versions"] == [2]
    state = json.loads((run / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    per_step = load_config(ROOT / "configs" / "tiny.toml").rollout.prompts_per_step
    assert state["step"] == 3 and state["cursor"] == 3 * per_step
    assert (run / "checkpoints" / "step_000002").is_dir()  # keep_last = 2


def test_resume_refuses_checkpoint_of_another_model(two_step_run, tmp_path, capsys):
    from transformers import LlamaConfig

    other = tmp_path / "other"
    other.mkdir()
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2).save_pretrained(other)
    ckpt = two_step_run / "checkpoints" / "step_000002"
    before = sorted(p.name for p in ckpt.iterdir())
    rc = main(["train", str(ROOT / "configs" / "tiny.toml"), "--set", f"model.path='{other}'", "--resume", str(ckpt)])
    assert rc == 2
    assert "from another model" in capsys.readouterr().err
    assert sorted(p.name for p in ckpt.iterdir()) == before


def test_rollouts_parquet_and_views(two_step_run):
    import pyarrow.parquet as pq

    cfg = load_config(two_step_run / "config.toml")
    table = pq.read_table(two_step_run / "rollouts")
    rows = table.to_pylist()
    assert {r["step"] for r in rows} == {1, 2} and {r["precision"] for r in rows} == {"int4"}
    assert table.num_rows == 2 * cfg.rollout.prompts_per_step * cfg.rollout.group_size
    assert {r["policy_version"] for r in rows if r["step"] == 2} == {1}
    assert {r["generator_id"] for r in rows} == {"torch-0", "torch-1"}
    assert all(r["mean_logprob"] <= 0 and isinstance(r["completion"], str) for r in rows)
    evals = [m for m in read_metrics(two_step_run) if m.get("event") == "eval"]
    assert [e["step"] for e in evals] == [0, 2]
    for e in evals:  # the logged accuracy is the judge's (tiny.toml: `correct`) on the answers kept beside it
        answers = [json.loads(line) for line in
                   (two_step_run / "evals" / f"step_{e['step']:06d}.jsonl").read_text().splitlines()]
        right = [correct(a["completion"], a["reference"]) for a in answers]
        assert e["metric"] == "correct" and len(answers) == e["n"] == cfg.task.eval_size
        assert [a["score"] for a in answers] == right and e["accuracy"] == sum(right) / e["n"]
    assert any((two_step_run / "tensorboard").glob("events.out.tfevents.*"))


def test_eval_command_on_checkpoint(two_step_run, tiny_model_path, capsys):
    """`qgrpo eval` on a checkpoint (and on a plain model folder, the base model) reports the share of the first n
    held-out prompts whose greedy answer is right: recomputed here from the model's own greedy answers (a bf16 torch
    generator, as the command builds one) judged by tiny.toml's judge, `correct`, applied directly, so a wrong
    judge, prompt set or count fails. The base model (seeded) gets some right (2 of 32 when written), so a judge
    that says no to everything fails too; the checkpoint after two steps may get none. 32 prompts: one batch, in the
    command as here, so the greedy answers are the same computation. Both compute in bf16: "auto" picks fp32 on a CPU
    without native bf16 (AVX2 only), where the random base model gets none of them right."""
    from qgrpo.core.records import SamplingParams
    from qgrpo.rollout.backends import backend_options, make_generator
    from qgrpo.rollout.data.tasks import make_task

    tiny, n = ROOT / "configs" / "tiny.toml", 32
    bf16 = "model.compute_dtype='bf16'"
    cfg = load_config(tiny, [bf16])
    items = [make_task(cfg.task, cfg.run.seed, split="eval").item(i) for i in range(n)]
    greedy = SamplingParams(group_size=1, max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0, seed=0)
    right = {}
    for name, model in (("checkpoint", two_step_run / "checkpoints" / "step_000002"), ("base", tiny_model_path)):
        assert main(["eval", str(model), "--config", str(tiny), "-n", str(n), "--set", bf16]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["n"] == n and out["precision"] == "bf16" and out["metric"] == "correct"
        gen = make_generator("torch", model_path=str(model), precision="bf16", generator_id="check",
                             chat_template=cfg.task.chat_template,
                             **backend_options("torch", cfg.rollout, cfg.model.compute_dtype))
        answers = [g.completions[0].text for g in gen.generate(items, greedy)]
        right[name] = sum(correct(a, it.reference) for a, it in zip(answers, items))
        assert out["accuracy"] == right[name] / n, (name, out["accuracy"], right[name])
    print(f"right of {n}: {right}")
    assert 0 < right["base"] < n
    assert main(["eval", str(two_step_run / "nope")]) == 2


def test_eval_command_with_the_vllm_backend(two_step_run, capsys):
    ckpt = two_step_run / "checkpoints" / "step_000002"
    tiny = str(ROOT / "configs" / "tiny.toml")
    assert main(["eval", str(ckpt), "--config", tiny, "-n", "12", "--backend", "vllm", "--precision", "int8"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["n"] == 12 and out["backend"] == "vllm" and out["precision"] == "int8"
    assert main(["eval", str(ckpt), "--config", tiny, "--backend", "vllm", "--precision", "int4"]) == 2
    assert "'int4' is not served by the vllm backend" in capsys.readouterr().err


def test_eval_command_uses_the_checkpoints_run_config(two_step_run, tmp_path, capsys):
    """Without --config, `qgrpo eval CHECKPOINT` evaluates as the run did: here a run config with eval_size 7."""
    import shutil

    ckpt = tmp_path / "step_000002"
    shutil.copytree(two_step_run / "checkpoints" / "step_000002", ckpt)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["config"]["task"]["eval_size"] = 7
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    capsys.readouterr()
    # At bf16, where the run's sync.requantize = "error_feedback" would be refused: evaluation neither syncs nor
    # learns, so the run's [sync] does not come along.
    assert main(["eval", str(ckpt), "--task", "digit_sum", "--precision", "bf16"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert out["n"] == 7 and out["task"] == "digit_sum" and "trainer_state.json" in captured.err
    assert out["precision"] == "bf16"

    (ckpt / "trainer_state.json").write_text("{not json")
    assert main(["eval", str(ckpt)]) == 2
    assert "--config" in capsys.readouterr().err


def test_report_on_the_real_run(two_step_run, capsys):
    """`qgrpo report` reads what the driver really wrote: every plot is a real non-empty PNG, nothing is missing."""
    assert main(["report", str(two_step_run)]) == 0
    out = two_step_run / "report"
    for name in ("reward.png", "accuracy.png", "kl.png", "mismatch.png", "time.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5_000, name
    md = (out / "summary.md").read_text()
    assert "Missing" not in md and "no eval events" not in md and "Rollout rows:" in md
