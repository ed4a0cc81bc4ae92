import re
import subprocess
import sys
from pathlib import Path

import pytest

from qgrpo.cluster.config.schema import ConfigError, config_from_dict, load_config, schema

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


# Presets whose model folder the user puts in place (a missing one is an error saying so: tests/test_nanochat.py);
# checked here with the builtin model of the same architecture and shape.
USER_MODEL = {"nanochat_d20.toml": "builtin:tiny-nanochat-d20", "nanochat_d32.toml": "builtin:tiny-nanochat-d32"}


def test_presets_are_valid():
    from qgrpo.rollout.data.tasks import check_task

    for preset in sorted((ROOT / "configs").glob("*.toml")):
        cfg = load_config(preset, [f"model.path='{USER_MODEL[preset.name]}'"] if preset.name in USER_MODEL else [])
        assert check_task(cfg.task, cfg.run.seed) == [], preset  # includes: no worked example is a held-out question


def test_override_types_and_values():
    cfg = load_config(TINY, ["learner.lr=1e-4", "rollout.precision=int8", "run.progress=false", "algo.is_cap=3"])
    assert cfg.learner.lr == 1e-4 and cfg.rollout.precision == "int8" and cfg.run.progress is False
    assert cfg.algo.is_cap == 3.0 and isinstance(cfg.algo.is_cap, float)


# (override, a fragment the message must contain: the field name and its rule)
BAD = [
    ("rollout.bogus=1", "rollout.bogus: unknown key"),
    ("nosection.x=1", "nosection: unknown key"),
    ("rollout.group_size=1", "rollout.group_size: must be >= 2"),
    ("learner.lr=-0.1", "learner.lr: must be in (0, 1)"),
    ("rollout.precision=int3", "rollout.precision: 'int3' is not served by the torch backend"),
    ("rollout.backend='tensorrt'", "rollout.backend: unknown backend 'tensorrt'; choose one of torch, vllm, mlx"),
    ("reference.precision=fp8", "reference.precision: fp8 on the torch reference is not served on cpu "
                                "(reference.num_gpus = 0); choose one of bf16, int8, int4, nf4, or set "
                                "reference.num_gpus >= 1 to score on a CUDA GPU"),
    ("reference.backend='vllm'", "reference.backend: unknown backend 'vllm'; choose one of torch, mlx"),
    ("rollout.vllm.kv_cache_gb=0", "rollout.vllm.kv_cache_gb: must be > 0"),
    ("rollout.vllm.gpu_memory_utilization=1.5", "rollout.vllm.gpu_memory_utilization: must be in [0, 1]"),
    ("learner.num_gpus=2", "learner.num_gpus: 2 GPUs per actor, but each DeepSpeed rank trains on one GPU"),
    ("rollout.vllm.swap=4", "rollout.vllm.swap: unknown key; known keys of [rollout.vllm] are"),
    ("algo.clip_low=0.3", "algo.clip_low: must be <= algo.clip_high"),
    ("model.path='/nonexistent/model'", "model.path: folder '/nonexistent/model' does not exist"),
    ("model.path=''", "model.path: missing"),
    ("rollout.temperature=0", "rollout.temperature: must be > 0"),
    ("algo.kl_estimator='k4'", "algo.kl_estimator: must be k1, k2 or k3"),
    ("learner.zero_stage=4", "learner.zero_stage: must be 0, 1, 2 or 3"),
    ("rollout.num_actors=0", "rollout.num_actors: must be >= 1"),
    ("rewards.functions=[{name='nope', weight=1.0}]", "rewards.functions[0].name: unknown reward 'nope'"),
    ("learner.lr='fast'", "learner.lr: expected float"),
    ("algo.loss_agg='mean'", "algo.loss_agg: must be token_mean, seq_mean or constant"),
    ("algo.is_cap=0.5", "algo.is_cap: must be >= 1"),
    ("algo.policy_loss='ppo'", "algo.policy_loss: must be grpo, gspo, cispo or sapo"),
    ("algo.is_level='chunk'", "algo.is_level: must be token, sequence or geometric"),
    ("algo.is_floor=1.5", "algo.is_floor: must be in 0..1"),
    ("algo.top_entropy_quantile=0", "algo.top_entropy_quantile: must be in (0, 1]"),
    ("algo.m2_threshold=-0.04", "algo.m2_threshold: must be >= 0 (0 = off)"),
    ("rollout.top_p=1.5", "rollout.top_p: must be in (0, 1]"),
    ("task.name='gsm9k'", "task.name: unknown task 'gsm9k'"),
]


@pytest.mark.parametrize("override,fragment", BAD, ids=[b[0] for b in BAD])
def test_each_invalid_value_is_named(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [override])
    assert fragment in str(e.value), str(e.value)


def test_all_problems_reported_at_once_by_cli(tmp_path):
    out = tmp_path / "runs"
    # one value per field; an unknown backend would hide the precision check, which depends on the backend
    used = [(o, f) for o, f in BAD
            if not o.startswith(("model.path", "learner.lr='", "rollout.backend", "reference.backend"))]
    args = [f"--set={o}" for o, _ in used] + [f"--set=run.output_dir='{out}'"]
    proc = subprocess.run([sys.executable, "-m", "qgrpo", "train", str(TINY), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    for _, fragment in used:
        assert fragment in proc.stderr, (fragment, proc.stderr)
    assert proc.stderr.count("\n  - ") >= 10
    assert not out.exists(), "a rejected config must not create a run directory"
    assert "Traceback" not in proc.stderr


# Backend/precision/platform combinations the backend registry refuses (each backend declares what it serves).
BACKEND_BAD = [
    (["rollout.backend=vllm", "rollout.precision=int4"], "rollout.precision: 'int4' is not served by the vllm backend; "
                                                         "choose one of bf16, int8, fp8"),
    (["rollout.backend=torch", "rollout.precision=fp4"], "rollout.precision: 'fp4' is not served by the torch backend"),
    (["reference.precision=fp4"], "reference.precision: 'fp4' is not served by the torch reference; choose one of"),
    (["rollout.backend=torch", "rollout.precision=fp8"],
     "rollout.precision: fp8 on torch needs a CUDA GPU per rollout actor (set rollout.num_gpus >= 1); on CPU choose "
     "one of bf16, int8, int4, nf4"),
    (["rollout.backend=vllm", "rollout.precision=fp8"],
     "rollout.precision: fp8 on vllm needs a CUDA GPU per rollout actor (set rollout.num_gpus >= 1); on CPU choose one "
     "of bf16, int8"),
    (["rollout.backend=vllm", "rollout.vllm.tensor_parallel_size=2"], "rollout.vllm.tensor_parallel_size: 2 is not "
                                                                      "supported; one engine per rollout actor"),
    (["rollout.backend=vllm", "rollout.num_gpus=0.3", "rollout.vllm.gpu_memory_utilization=0.5"],
     "rollout.vllm.gpu_memory_utilization: 0.5 of the GPU's memory, but each rollout actor holds "
     "rollout.num_gpus = 0.3"),
    (["learner.world_size=2", "learner.num_gpus=0.5"], "learner.num_gpus: 0.5 of a GPU per rank with "
                                                       "learner.world_size = 2: two ranks could land on one GPU"),
    (["algo.kl_coeff=0.01", "reference.backend=mlx", "reference.num_gpus=1"],
     "reference.num_gpus: the mlx reference runs on Apple silicon or the CPU, never on CUDA"),
]


@pytest.mark.parametrize("overrides,fragment", BACKEND_BAD, ids=[" ".join(b[0]) for b in BACKEND_BAD])
def test_backend_combinations_are_checked_against_the_registry(overrides, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    assert fragment in str(e.value), str(e.value)


def test_backend_table_round_trips_and_unavailable_backend_is_named(monkeypatch):
    import tomllib

    from qgrpo.cluster.config.schema import config_from_dict
    from qgrpo.cluster.config.tomlio import to_toml
    from qgrpo.rollout.backends import REGISTRY

    cfg = load_config(TINY, ["rollout.backend=vllm", "rollout.precision=int8", "rollout.vllm.max_model_len=256"])
    again = config_from_dict(tomllib.loads(to_toml(cfg.to_dict())))  # the saved effective config loads as it was
    assert again.rollout.vllm.max_model_len == 256 and again.rollout.backend == "vllm"
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "vllm" else object())
    with pytest.raises(ConfigError, match="rollout.backend: vllm needs the `vllm` package, which is not installed"):
        load_config(TINY, ["rollout.backend=vllm", "rollout.precision=int8"])
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(ConfigError, match="rollout.backend: vllm does not run on darwin"):
        load_config(TINY, ["rollout.backend=vllm", "rollout.precision=int8"])
    assert REGISTRY["torch"].problems("int4", 0) == []


def test_bad_toml_file(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[run\nsteps = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(f)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def test_config_is_not_rewritten(tmp_path):
    """Validation rejects, never repairs: the value the user gave is the value in the error."""
    with pytest.raises(ConfigError, match="got 0.25 > 0.2"):
        load_config(TINY, ["algo.clip_low=0.25"])


# ---------------------------------------------------------------------------------------------------------------------
# The schema as the one source: TOML written back, --set read against the field types, the environment checks apart


def test_to_toml_writes_nested_sections_as_tables_and_loads_as_the_same_config():
    import tomllib

    from qgrpo.cluster.config.schema import config_from_dict, to_toml

    cfg = load_config(TINY, ["rollout.vllm.max_model_len=256", "learner.lora.target_modules=['q_proj']",
                             "rollout.resources={\"rollout node\" = 1}", "task.system_prompt='a \"b\"\\n|c'"])
    text = to_toml(cfg)
    assert "[rollout.vllm]\n" in text and "[learner.lora]\n" in text and 'resources = { "rollout node" = 1 }' in text
    assert config_from_dict(tomllib.loads(text)).to_dict() == cfg.to_dict()


def test_overrides_are_read_against_the_field_type():
    assert load_config(TINY, ["run.name=2024"]).run.name == "2024"  # a text field takes the bare word as text
    with pytest.raises(ConfigError, match="run.seed: expected int, got str 'x'"):
        load_config(TINY, ["run.seed=x"])
    with pytest.raises(ConfigError, match="run.progress: expected bool, got int 1"):
        load_config(TINY, ["run.progress=1"])  # never reinterpreted as true


def test_environment_checks_are_apart_from_the_rules():
    from qgrpo.cluster.config.schema import Config, validate

    missing = "model.path='/nonexistent/model'"
    assert load_config(TINY, [missing], check_environment=False).model.path == "/nonexistent/model"
    with pytest.raises(ConfigError, match="model.path: folder '/nonexistent/model' does not exist"):
        load_config(TINY, [missing])
    cfg = Config()
    cfg.model.path = "/nonexistent/model"
    assert validate(cfg) == []  # the rules alone touch nothing on this machine


def test_a_rule_is_not_judged_on_a_value_standing_in_for_a_bad_one():
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["algo.clip_high=-1", "algo.clip_low=0.3"])
    assert e.value.problems == ["algo.clip_high: must be >= 0, got -1"]  # no "got 0.3 > 0.2" against the default


def test_an_unknown_key_names_the_nearest_one():
    with pytest.raises(ConfigError, match=r"rollout.temprature: unknown key; did you mean rollout.temperature\?$"):
        load_config(TINY, ["rollout.temprature=0.5"])


def test_is_cap_takes_the_bound_the_loss_needs():
    from qgrpo.learner.objective.loss import IS_CAP_MIN
    from qgrpo.learner.objective.settings import objective_settings

    assert load_config(TINY, [f"algo.is_cap={IS_CAP_MIN}"]).algo.is_cap == IS_CAP_MIN
    objective_settings(is_cap=IS_CAP_MIN, kl_coeff=0.0)  # the loss takes what the config lets through
    with pytest.raises(ConfigError, match=r"algo.is_cap: must be >= 1 \(C in min\(pi_old/mu, C\)"):
        load_config(TINY, ["algo.is_cap=0.99"])


def test_config_is_still_a_dataclass_that_pickles_and_is_validated_after_changes():
    import dataclasses
    import pickle

    from qgrpo.cluster.config.schema import validate

    cfg = load_config(TINY)
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # as Ray sends it to actors
    assert dataclasses.asdict(cfg.learner.lora) == {"rank": 16, "alpha": 32.0, "dropout": 0.0,
                                                    "target_modules": ["all-linear"]}
    assert dataclasses.replace(cfg.learner, lr=1e-4).lr == 1e-4
    cfg.rollout.group_size = 1
    assert validate(cfg) == ["rollout.group_size: must be >= 2 (advantages compare completions within a group), got 1"]


ALGO_COMBINATIONS = [
    (["algo.policy_loss='gspo'"], "algo.loss_agg: policy_loss = \"gspo\" clips one ratio per sequence"),
    (["algo.is_mode='none'", "algo.is_level='sequence'"], "algo.is_mode: \"none\" applies no correction"),
    (["algo.is_mode='none'", "algo.is_floor=0.5"], "algo.is_mode: \"none\" applies no correction"),
    (["algo.is_mode='reject'", "algo.is_floor=1.0", "algo.is_cap=1.0"], "algo.is_floor: equal to algo.is_cap"),
    (["algo.kl_coeff=0", "algo.kl_bias_correction=true"], "algo.kl_bias_correction: corrects the KL term"),
    (["algo.m2_threshold=nan"], "algo.m2_threshold: must be >= 0 (0 = off), got nan"),
    (["algo.m2_threshold=inf"], "algo.m2_threshold: inf masks no token, so M2PO's mask would be on in name only; "
                                "set 0 to turn it off, or a finite threshold"),
    (["algo.dynamic_sampling=true", "algo.overlap=true"], "algo.dynamic_sampling: cannot run with algo.overlap"),
    (["algo.overlong_buffer=3"], "algo.overlong_buffer: must be < rollout.max_new_tokens (3)"),
    (["sync.requantize='stochastic'", "rollout.precision='bf16'"], "sync.requantize: 'stochastic' needs a quantized"),
    (["sync.requantize='error_feedback'", "rollout.precision='nf4'"], "set sync.requantize = \"nearest\" or change"),
    (["sync.requantize='exact'"], "sync.requantize: must be"),
    (["learner.fake_quant='rollout'", "learner.mode='lora'"], "learner.fake_quant: \"rollout\" needs learner.mode"),
    (["learner.fake_quant='rollout'", "rollout.precision='nf4'"], "rollout.precision 'nf4' has none"),
    (["sync.adapters_only=true"], "sync.adapters_only: needs learner.mode = \"lora\" or \"qlora\""),
    (["sync.adapters_only=true", "learner.mode='qlora'", "rollout.backend='mlx'", "rollout.precision='int8'"],
     "sync.adapters_only: built for rollout.backend = \"torch\" and \"vllm\" (mlx's adapter loading is not built), "
     "got 'mlx'; set sync.adapters_only = false or another rollout.backend"),
    (["sync.adapters_only=true", "learner.mode='lora'", "sync.transport='collective'"],
     "sync.adapters_only: travels by sync.transport = \"object_store\" only"),
    (["sync.adapters_only=true", "learner.mode='lora'", "sync.requantize='error_feedback'"],
     "sync.adapters_only: the generators' quantized base never changes"),
    (["sync.adapters_only=true", "learner.mode='lora'", "rollout.norm_noise=0.01"],
     "sync.adapters_only: the norm weights are not sent"),
]


def test_adapters_only_loads_with_an_adapter_learner():
    for mode in ("lora", "qlora"):
        assert load_config(TINY, ["sync.adapters_only=true", f"learner.mode='{mode}'"]).sync.adapters_only
    cfg = load_config(TINY, ["sync.adapters_only=true", "learner.mode='lora'", "rollout.backend='vllm'",
                             "rollout.precision='int8'"])
    from qgrpo.rollout.backends import REGISTRY

    # the vLLM engine starts with LoRA support of the learner's rank, beside its own settings; the torch generator
    # needs nothing for adapters (it wraps its layers as they arrive); full updates (rank 0) start no LoRA support
    rank = cfg.learner.lora.rank
    vllm = REGISTRY["vllm"].generator_options(cfg.rollout, adapter_rank=rank)
    assert vllm["lora_rank"] == rank and vllm["options"]["max_model_len"] == cfg.rollout.vllm.max_model_len
    assert "lora_rank" not in REGISTRY["vllm"].generator_options(cfg.rollout)
    options = {"cuda_graphs": True, "fused_step": True, "quantize_head": False, "onednn": True}
    assert REGISTRY["torch"].generator_options(cfg.rollout, "fp32", adapter_rank=16) == {"compute_dtype": "fp32",
                                                                                 "options": options}


def test_fake_quant_reaches_the_learner_with_the_generators_grid():
    from qgrpo.cluster.run.learners import learner_settings

    off = learner_settings(load_config(TINY))
    assert off.fake_quant_grid is None
    on = learner_settings(load_config(TINY, ["learner.fake_quant='rollout'", "rollout.group_size_quant=32"]))
    assert on.fake_quant_grid.family == "affine" and on.fake_quant_grid.group == 32 and on.fake_quant_head


def test_requantize_modes_load_where_a_grid_is_emulated():
    for precision in ("int8", "int4"):
        for mode in ("stochastic", "error_feedback"):
            assert load_config(TINY, [f"rollout.precision='{precision}'", f"sync.requantize='{mode}'"]
                               ).sync.requantize == mode


@pytest.mark.parametrize("overrides,fragment", ALGO_COMBINATIONS, ids=[" ".join(o) for o, _ in ALGO_COMBINATIONS])
def test_algo_combinations_that_mean_nothing_are_refused(overrides, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    assert fragment in str(e.value), str(e.value)


def test_algo_recipes_load_and_reach_the_learner():
    from qgrpo.cluster.run.learners import learner_settings
    from qgrpo.learner.objective.losses import loss_keys

    recipes = {
        "trl_default": ["algo.is_level='sequence'", "algo.is_mode='mask'", "algo.is_cap=3"],
        "icepop": ["algo.is_mode='mask'", "algo.is_floor=0.5", "algo.is_cap=5"],
        "geo_rs": ["algo.is_level='geometric'", "algo.is_mode='reject'", "algo.is_floor=0.999", "algo.is_cap=1.001"],
        "gspo": ["algo.policy_loss='gspo'", "algo.loss_agg='seq_mean'", "algo.clip_low=3e-4", "algo.clip_high=4e-4"],
        "cispo": ["algo.policy_loss='cispo'", "algo.cispo_cap=4"],
        "sapo": ["algo.policy_loss='sapo'", "algo.sapo_tau_neg=1.2"],
        "dapo": ["algo.dynamic_sampling=true", "algo.overlong_buffer=1", "algo.overlong_filter=true",
                 "algo.clip_high=0.28"],
        "areal_m2po": ["algo.is_mode='mask'", "algo.is_cap=5", "algo.m2_threshold=0.04", "algo.overlap=true"],
        "entropy": ["algo.entropy_coeff=0.01", "algo.top_entropy_quantile=0.2", "algo.offpolicy_mask_kl=0.5",
                    "algo.kl_bias_correction=true"],
    }
    for name, overrides in recipes.items():
        cfg = load_config(TINY, overrides)
        objective = learner_settings(cfg).objective
        spec = objective.loss
        for o in overrides:  # every [algo] value reaches the learner as given: a knob, or the loss's parameter
            field = o.split("=", 1)[0].removeprefix("algo.")
            got = (getattr(objective, field) if field not in loss_keys()
                   else getattr(objective.loss_params, field.removeprefix(spec.prefix)))
            assert got == getattr(cfg.algo, field), (name, field)


def test_trls_names_are_told_their_field_here():
    """An unknown key that is GRPOConfig's name for one of our fields names that field, in whatever table it stands;
    every field named exists."""
    import re

    from qgrpo.cluster.config.errors import TRL_KEYS

    cfg = load_config(ROOT / "configs" / "tiny.toml", check_environment=False).to_dict()
    for key, target in TRL_KEYS.items():
        for path in re.findall(r"\b([a-z_]+)\.([a-z_0-9]+)\b", target):
            if path[0] != "docs":
                assert path[1] in cfg[path[0]], (key, path)
    with pytest.raises(ConfigError, match=r"rollout.num_generations: unknown key; 'num_generations' is TRL's name: "
                                          r"here it is rollout.group_size"):
        load_config(ROOT / "configs" / "tiny.toml", ["rollout.num_generations=8"], check_environment=False)
    with pytest.raises(ConfigError, match=r"learning_rate: unknown key; 'learning_rate' is TRL's name: here it is "
                                          r"learner.lr"):
        config_from_dict({**cfg, "learning_rate": 1e-6}, check_environment=False)


def test_a_configs_paths_are_read_against_its_own_folder(tmp_path, monkeypatch):
    """An example checks from any directory: its data and reward files are next to it. A path that exists only from
    the working directory (a config written before the rule) still loads; --set values stay the working directory's."""
    from qgrpo.cluster.config.tomlio import anchor_paths

    folder = ROOT / "examples" / "own_rewards"
    for where in (tmp_path, folder, ROOT):
        monkeypatch.chdir(where)
        cfg = load_config(folder / "config.toml")
        assert cfg.task.path == str(folder / "problems.jsonl")
        assert cfg.rewards.functions[0].function == f"{folder / 'rewards.py'}:within_tolerance"
    monkeypatch.chdir(ROOT)
    old = {"task": {"path": "examples/own_rewards/problems.jsonl"}, "rewards": {"functions": [{"name": "correct"}]}}
    anchor_paths(old, folder, schema())
    assert old["task"]["path"] == "examples/own_rewards/problems.jsonl"  # found from here only: left as written
    gone = {"task": {"path": "nowhere.jsonl", "eval_path": "s3://bucket/eval.jsonl"}}
    anchor_paths(gone, folder, schema())
    assert gone["task"] == {"path": str(folder / "nowhere.jsonl"), "eval_path": "s3://bucket/eval.jsonl"}
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.jsonl").write_text('{"question": "1+1", "answer": 2}\n' * 4)
    cfg = load_config(folder / "config.toml", ["task.path='mine.jsonl'", "task.eval_size=1"])
    assert cfg.task.path == "mine.jsonl"  # an override is the command line's: the working directory's


def test_model_paths_and_the_cache_are_read_against_the_configs_folder(tmp_path, monkeypatch):
    """model.path, reward_model.path and model.cache_dir resolve like the data files; run.output_dir stays the
    working directory's, as TRL's output_dir; a Hub id and builtin:NAME are never changed."""
    from qgrpo.cluster.config.tomlio import anchor_paths

    tmp_path = tmp_path.resolve()
    folder, elsewhere = tmp_path / "exp", tmp_path / "elsewhere"
    for d in (folder / "mymodel", folder / "rm", folder / "runs", elsewhere / "legacy-model"):
        d.mkdir(parents=True)
    (folder / "config.toml").write_text('[run]\noutput_dir = "runs"\n\n[model]\npath = "mymodel"\n'
                                        'cache_dir = "cache"\n\n[reward_model]\npath = "./rm"\n\n[rewards]\n'
                                        'functions = [{name = "correct"}, {name = "reward_model", weight = 0.1}]\n')
    monkeypatch.chdir(elsewhere)
    cfg = load_config(folder / "config.toml", check_environment=False)
    assert cfg.model.path == str(folder / "mymodel")  # a folder beside the config, not in the working directory
    assert cfg.model.cache_dir == str(folder / "cache")  # not there yet (made on first use): the config's folder
    assert cfg.reward_model.path == str(folder / "rm")
    assert cfg.run.output_dir == "runs"  # the working directory's, though a runs/ is beside the config
    # --set values are the command line's
    cfg = load_config(folder / "config.toml", ["model.path='mymodel'", "model.cache_dir='cache'"],
                      check_environment=False)
    assert (cfg.model.path, cfg.model.cache_dir) == ("mymodel", "cache")
    # A folder found nowhere is named where it was looked for: beside the config
    (folder / "missing.toml").write_text('[model]\npath = "gone-model"\n')
    with pytest.raises(ConfigError, match=re.escape(f"model.path: folder '{folder / 'gone-model'}' does not exist")):
        load_config(folder / "missing.toml")

    def anchored(model: str, reward_model: str = "") -> tuple[str, str]:
        data = {"model": {"path": model}, "reward_model": {"path": reward_model}}
        anchor_paths(data, folder, schema(), cwd=elsewhere)
        return data["model"]["path"], data["reward_model"]["path"]

    hub = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert anchored(hub, "builtin:tiny-reward") == (hub, "builtin:tiny-reward")  # never changed
    assert anchored("builtin:smollm2-135m-instruct", hub) == ("builtin:smollm2-135m-instruct", hub)
    (folder / "org" / "name").mkdir(parents=True)  # a folder of a Hub id's shape beside the config wins, as in
    assert anchored("org/name")[0] == str(folder / "org" / "name")  # resolve_model_path (a folder over the cache)
    assert anchored("legacy-model")[0] == "legacy-model"  # found from the working directory only: left as written
    # Found nowhere: a value that can only be a folder is anchored (its error names where it was looked for); one of
    # a Hub id's shape is left for the Hub cache (or the working directory) to answer
    assert anchored("gone")[0] == str(folder / "gone")
    assert anchored("../models/gone")[0] == str(tmp_path / "models" / "gone")
    assert anchored("./org/gone")[0] == str(folder / "org" / "gone")
    assert anchored("org/gone")[0] == "org/gone"
    assert anchored("/abs/model", "~/rm") == ("/abs/model", "~/rm")
    assert anchored("", "") == ("", "")


# A str field whose name says it holds a path but which is read as it is, with the reason (none today: run.output_dir
# is marked "cwd", read against the working directory on purpose).
NOT_PATHS: dict[str, str] = {}


def _schema_fields(cls: type, loc: tuple = ()):
    """(location, FieldInfo) of every leaf field of `cls`: a location is a tuple of keys, "[]" standing for an item
    of a list of tables (rewards.functions[])."""
    import dataclasses
    import typing

    for name, info in cls.__pydantic_fields__.items():
        args = typing.get_args(info.annotation)
        if dataclasses.is_dataclass(info.annotation):
            yield from _schema_fields(info.annotation, (*loc, name))
        elif typing.get_origin(info.annotation) is list and args and dataclasses.is_dataclass(args[0]):
            yield from _schema_fields(args[0], (*loc, name, "[]"))
        else:
            yield (*loc, name), info


def test_every_path_field_is_marked_and_every_marked_field_is_anchored(tmp_path):
    """Which fields are paths is the schema's mark (setting(path=KIND)), so a new path field cannot be forgotten:
    every str field named ...path, ...dir or ...file is marked (or listed in NOT_PATHS with its reason), and
    anchor_paths anchors every marked field wherever it sits (sections, nested sections, lists of tables)."""
    from qgrpo.cluster.config.fields import PATH_KINDS, path_kind
    from qgrpo.cluster.config.tomlio import anchor_paths

    fields = list(_schema_fields(schema()))
    dotted = {".".join(loc).replace(".[]", "[]"): info for loc, info in fields}
    named = {k for k, info in dotted.items() if info.annotation is str and k.endswith(("path", "dir", "file"))}
    unmarked = sorted(k for k in named if not path_kind(dotted[k]) and k not in NOT_PATHS)
    assert unmarked == [], f"path fields without setting(path=KIND) (cluster/config/fields.py PATH_KINDS): {unmarked}"
    assert set(NOT_PATHS) <= set(dotted), "NOT_PATHS names a field the schema no longer has"
    marked = {k: path_kind(info) for k, info in dotted.items() if path_kind(info)}
    assert marked == {"run.output_dir": "cwd", "model.path": "path_or_hub", "model.cache_dir": "file",
                      "task.path": "file", "task.eval_path": "file", "rewards.functions[].function": "module_file",
                      "environment.name": "module_file", "reward_model.path": "path_or_hub"}
    assert set(marked.values()) <= set(PATH_KINDS)

    folder, cwd = tmp_path.resolve() / "cfg", tmp_path.resolve() / "cwd"
    folder.mkdir()
    cwd.mkdir()
    relative = {"file": "data/x.jsonl", "module_file": "lib/x.py:fn", "path_or_hub": "./models/x", "cwd": "out"}
    data: dict = {}
    for loc, info in fields:
        if kind := path_kind(info):
            table = data
            for i, key in enumerate(loc[:-1]):
                if key == "[]":
                    continue
                if i + 1 < len(loc) - 1 and loc[i + 1] == "[]":
                    table = table.setdefault(key, [{}])[0]
                else:
                    table = table.setdefault(key, {})
            table[loc[-1]] = relative[kind]
    anchor_paths(data, folder, schema(), cwd=cwd)
    for loc, info in fields:
        if kind := path_kind(info):
            value: object = data
            for key in loc:
                value = value[0] if key == "[]" else value[key]
            want = relative[kind] if kind == "cwd" else str(folder / relative[kind])
            assert value == want, (loc, kind, value)
