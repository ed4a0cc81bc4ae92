"""MLX-GRPO configs run as they are: flat keys or an [mlx_grpo] table, its --set overrides, the printed mapping,
unknown keys rejected, `qgrpo migrate` output loading as ours, and a real run of the tiny model from such a file."""
import json
import math
from pathlib import Path

import pytest

from qgrpo.cluster.cli.app import main
from qgrpo.cluster.config.mlx_grpo import translate
from qgrpo.cluster.config.schema import ConfigError, load_config
from qgrpo.learner.optim import lr_factor

# MLX-GRPO's own configs/nanochat_d32.toml, with a model that exists here
D32 = """model_name = "builtin:tiny-digits"
output_dir = "outputs/nanochat-d32-grpo"
run_name   = "nanochat-d32-v1"
learning_rate = 3e-6
num_epochs = 2
batch_size = 1
gradient_accumulation_steps = 4   # Effective batch size of 4
max_train_samples = 500
warmup_ratio = 0.05
max_grad_norm = 1.0
logging_steps = 1
num_generations = 4
max_new_tokens = 128
temperature = 0.8
clip_eps = 0.2
kl_coeff = 0.02
eval_steps = 25
eval_samples = 20
eval_every_updates = 25
eval_subset_size = 20
eval_max_new_tokens = 128
save_steps = 50
log_jsonl = true
seed = 42
use_compile = false
quantize_for_rollouts = false
"""


def _tabled(flat: str) -> str:
    return "[mlx_grpo]\n" + flat


@pytest.fixture
def files(tmp_path):
    (tmp_path / "flat.toml").write_text(D32)
    (tmp_path / "tabled.toml").write_text(_tabled(D32))
    return tmp_path


def test_flat_and_tabled_read_alike_and_map_counts_to_our_steps(files):
    notes: list[str] = []
    flat = load_config(files / "flat.toml", notes=notes)
    assert flat.to_dict() == load_config(files / "tabled.toml").to_dict()
    r, ro, a, le = flat.run, flat.rollout, flat.algo, flat.learner
    assert ro.prompts_per_step == 4 and ro.group_size == 4  # batch_size x accumulation; num_generations
    assert r.steps == 250  # ceil(500 / 4) x 2 epochs: one of our steps per MLX-GRPO optimizer update
    assert a.update_every == 2  # its default: model_old synced every 10 batch steps = 2.5 updates
    assert le.warmup_steps == 12 and le.lr_schedule == "cosine" and le.lr == 3e-6 and le.grad_clip == 1.0
    assert a.clip_low == a.clip_high == 0.2 and a.kl_coeff == 0.02 and a.kl_estimator == "k3"
    assert ro.precision == flat.reference.precision == "bf16"  # quantize_for_rollouts = false
    assert r.eval and r.eval_every == 6 and flat.task.eval_size == 20 and r.eval_max_new_tokens == 128
    assert r.save_every % a.update_every == 0 and r.save_every == 12
    assert flat.task.name == "rg:gsm_symbolic" and "<answer>" in flat.task.system_prompt and flat.task.size == 500
    assert (ro.temperature, ro.top_p, ro.max_new_tokens, r.seed, r.name) == (0.8, 0.95, 128, 42, "nanochat-d32-v1")
    assert "learning_rate = 3e-06 -> learner.lr = 3e-06" in notes
    assert any(n.startswith("use_compile = False -> no equivalent") for n in notes)
    assert any(n.startswith("update_every = 10 (MLX-GRPO default) -> algo.update_every = 2") for n in notes)


def test_quantize_for_rollouts_means_int4_group_64_generators_and_reference(files):
    cfg = load_config(files / "flat.toml", ["quantize_for_rollouts=true"])
    assert (cfg.rollout.precision, cfg.rollout.group_size_quant, cfg.reference.precision) == ("int4", 64, "int4")
    assert cfg.algo.is_mode == "truncate" and cfg.guard.ladder  # TIS and the precision ladder stay on


def test_overrides_in_both_forms(files):
    cfg = load_config(files / "flat.toml", ["learning_rate=1e-5", "num_generations=8", "rollout.threads=1"])
    assert cfg.learner.lr == 1e-5 and cfg.rollout.group_size == 8 and cfg.rollout.threads == 1


@pytest.mark.parametrize("bad, expect", [
    ("learning_rat = 1e-5", "learning_rat: not an MLX-GRPO key; known keys are: adam_beta1"),
    ('learning_rate = "fast"', "learning_rate: expected float (MLX-GRPO's type), got str 'fast'"),
    ('lr_scheduler_type = "linear"', "lr_scheduler_type: 'linear' is not served here"),
    ("gradient_accumulation_steps = 0", "gradient_accumulation_steps: must be >= 1"),
])
def test_bad_keys_and_values_are_one_clear_error(tmp_path, bad, expect):
    key = bad.split(" =")[0]
    kept = [line for line in D32.splitlines() if line.split(" =")[0].strip() != key]
    (tmp_path / "c.toml").write_text("\n".join(kept + [bad]) + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "c.toml")
    assert expect in str(e.value) and "read as an MLX-GRPO config" in str(e.value)


def test_a_translated_value_our_rules_reject_names_the_mlx_grpo_key(files):
    with pytest.raises(ConfigError) as e:
        load_config(files / "flat.toml", ["learning_rate=2.0"])
    assert "learning_rate -> learner.lr: must be in (0, 1), got 2.0" in str(e.value)


def test_our_sections_beside_the_keys_and_conflicts(tmp_path):
    (tmp_path / "c.toml").write_text(D32 + '[task]\nname = "digit_sum"\neval_size = 20\n'
                                     '[learner]\nmicro_batch_per_rank = 8\n')
    cfg = load_config(tmp_path / "c.toml")
    assert cfg.task.name == "digit_sum" and cfg.task.system_prompt == "" and cfg.learner.micro_batch_per_rank == 8
    (tmp_path / "d.toml").write_text(D32 + "[learner]\nlr = 1e-5\n")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "d.toml")
    expected = "learner.lr: set to 1e-05 in [learner] and to 3e-06 by the MLX-GRPO key learning_rate; keep one"
    assert expected in str(e.value)


def test_a_config_of_ours_is_not_taken_for_mlx_grpo():
    root = Path(__file__).resolve().parents[1]
    notes: list[str] = []
    load_config(root / "configs" / "tiny.toml", notes=notes)
    assert notes == []
    assert translate({"learning_rate": 1e-5})[0]["learner"]["lr"] == 1e-5


def test_migrate_writes_a_config_of_ours_and_keeps_existing_files(files, capsys):
    out = files / "ours.toml"
    assert main(["migrate", str(files / "tabled.toml"), "-o", str(out), "--set", "num_generations=8",
                 "--set", "rollout.precision=int8"]) == 0
    text = out.read_text()
    assert "# Written by `qgrpo migrate" in text and "#   learning_rate = 3e-06 -> learner.lr = 3e-06" in text
    notes: list[str] = []
    ours = load_config(out, notes=notes)
    assert notes == []  # read as ours, not translated again
    direct = load_config(files / "flat.toml", ["num_generations=8", "rollout.precision=int8"])
    assert ours.to_dict() == direct.to_dict()
    out.write_text("precious")
    assert main(["migrate", str(files / "flat.toml"), "-o", str(out)]) == 2
    assert out.read_text() == "precious" and "not overwritten" in capsys.readouterr().err


def test_check_prints_the_mapping(files, capsys):
    # The translated config keeps the tiny model, whose character tokenizer cannot write GSM questions: check refuses
    # it at pre-flight, as train would; the mapping comes first all the same.
    assert main(["check", str(files / "flat.toml")]) == 2
    out, err = capsys.readouterr()  # check's report on stdout; the mapping, from the config's loading, on stderr
    assert out.endswith("qgrpo check: REFUSED: 2 problems\n") and "contain the unknown token" in out
    assert "is an MLX-GRPO config, read as ours" in err
    assert "batch_size = 1 + gradient_accumulation_steps = 4 -> rollout.prompts_per_step = 4" in err
    assert "quantize_for_rollouts = False -> rollout.precision = 'bf16'" in err


def test_lr_schedules():
    assert [lr_factor(s, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = [lr_factor(s, 0, "cosine", 10) for s in range(10)]
    assert cos[0] == 1.0 and all(a > b > 0 for a, b in zip(cos, cos[1:]))
    assert cos[5] == pytest.approx(0.5)
    assert lr_factor(3, 2, "cosine", 10) == pytest.approx(0.5 * (1 + math.cos(0.3 * math.pi)))
    assert lr_factor(0, 2, "cosine", 10) == pytest.approx(0.5)  # warm-up ramp times the cosine


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
def test_mlx_grpo_config_trains_the_tiny_model(ray_session, tiny_model_path, tmp_path):
    """MLX-GRPO keys plus our [task]/[rewards] for the tiny model: a real run (Ray, DeepSpeed, int4 generators)."""
    cfg = tmp_path / "mlx.toml"
    cfg.write_text(f"""model_name = "{tiny_model_path}"
output_dir = "{tmp_path / 'out'}"
run_name = "mlx"
learning_rate = 1e-2
batch_size = 2
gradient_accumulation_steps = 2
max_train_samples = 16
num_epochs = 1
warmup_ratio = 0.25
num_generations = 8
max_new_tokens = 3
eval_steps = 4
eval_samples = 16
eval_max_new_tokens = 4
save_steps = 16
update_every = 4
quantize_for_rollouts = true
[task]
name = "digit_sum"
max_operand = 3
eval_size = 16
[rewards]
functions = [{{ name = "correct", weight = 1.0 }}]
""")
    assert main(["train", str(cfg), "--set", "run.progress=false"]) == 0
    (run,) = (tmp_path / "out").iterdir()
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "loss/lr" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]  # 16 samples / (2 x 2) per update
    assert [m["rollout/precision"] for m in steps] == ["int4"] * 4
    lrs = [m["loss/lr"] for m in steps]  # warm-up of 1 update, then cosine over 4 (loss/lr: the next update's)
    assert lrs == pytest.approx([1e-2 * lr_factor(s, 1, "cosine", 4) for s in range(1, 5)])
    assert [m["rollout/policy_versions"] for m in steps] == [[0], [0], [2], [2]]  # update_every 2 batch steps -> 1
    evals = [e for e in lines if e.get("event") == "eval"]
    assert [e["step"] for e in evals] == [0, 2, 4] and all(e["n"] == 16 for e in evals)
    assert (run / "checkpoints" / "step_000004" / "model.safetensors").is_file()


# ---------------------------------------------------------------------------------------------------------------------
# What a new user hit: MLX-GRPO's defaults taken for written values, migrate refusing a model folder not there yet,
# and an unknown key answered with the whole list of keys.


def test_a_field_only_our_section_writes_is_ours_not_a_conflict(tmp_path):
    # max_new_tokens is not written as an MLX-GRPO key: its default 512 gives way to [rollout]
    (tmp_path / "c.toml").write_text('model_name = "builtin:tiny-digits"\n[rollout]\nmax_new_tokens = 16\n')
    notes: list[str] = []
    assert load_config(tmp_path / "c.toml", notes=notes).rollout.max_new_tokens == 16
    assert "[rollout] max_new_tokens = 16 -> rollout.max_new_tokens = 16  (this file's, over the translation's 512)" \
        in notes
    assert not any(n.startswith("max_new_tokens = 512") for n in notes)  # the replaced mapping is not shown
    # written both ways, it is one
    (tmp_path / "d.toml").write_text('model_name = "builtin:tiny-digits"\nmax_new_tokens = 32\n'
                                     '[rollout]\nmax_new_tokens = 16\n')
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "d.toml")
    assert "rollout.max_new_tokens: set to 16 in [rollout] and to 32 by the MLX-GRPO key max_new_tokens" in str(e.value)


def test_migrate_writes_the_translation_when_the_model_folder_is_not_here_yet(tmp_path):
    import tomllib

    from qgrpo.cluster.cli.migrate import migrate
    from qgrpo.cluster.config.schema import config_from_dict

    model = tmp_path / "models" / "d32"  # where the user will put the model, later or on another machine
    data = tomllib.loads(D32.replace('"builtin:tiny-digits"', f'"{model}"'))
    text, warnings = migrate(data, ["num_generations=8", "rollout.threads=1"], "old.toml")
    assert len(warnings) == 1 and warnings[0].startswith(f"model.path: folder '{model}' does not exist"), warnings
    assert "# Not found on the machine that wrote this file" in text and "#   learning_rate = 3e-06 ->" in text
    cfg = config_from_dict(tomllib.loads(text), check_environment=False)  # the text is a config of ours
    assert (cfg.model.path, cfg.rollout.group_size, cfg.rollout.threads) == (str(model), 8, 1)
    with pytest.raises(ConfigError, match="model.path: folder"):  # where it trains, the folder must be there
        config_from_dict(tomllib.loads(text))
    with pytest.raises(ConfigError, match=r"learning_rate -> learner.lr: must be in \(0, 1\), got 2.0"):
        migrate(data, ["learning_rate=2.0"], "old.toml")  # a value our rules reject still stops it


@pytest.mark.parametrize("key, hint", [
    ("learning_rat", "did you mean learning_rate?"),
    ("num_generation", "did you mean num_generations?"),
    ("use_lora", 'its equivalent here is learner.mode = "lora" (in a [learner] table beside the MLX-GRPO keys, or '
                 "--set learner.mode=lora)"),
    ("lora_rank", "its equivalent here is learner.lora.rank"),
    ("qqq", "our own settings go in tables beside the keys: [run], [model]"),
])
def test_an_unknown_key_names_the_nearest_key_or_its_equivalent_here(key, hint):
    (problem,) = translate({"model_name": "builtin:tiny-digits", key: 1})[3]
    assert problem.startswith(f"{key}: not an MLX-GRPO key;") and hint in problem, problem
    assert "weight_decay" not in problem  # the 33 keys are not all listed: the reference lists them


def test_migrate_command_writes_with_a_warning_when_the_model_folder_is_not_here_yet(tmp_path, capsys):
    model = tmp_path / "models" / "nanochat-d32"  # not fetched yet
    (tmp_path / "mlx.toml").write_text(D32.replace('"builtin:tiny-digits"', json.dumps(str(model))))
    out = tmp_path / "ours.toml"
    assert main(["migrate", str(tmp_path / "mlx.toml"), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"qgrpo migrate: warning: model.path: folder '{model}' does not exist" in err and out.is_file()
    assert load_config(out, check_environment=False).model.path == str(model)
