"""The whole-step bench's parts that run without a GPU: the random checkpoint of a published shape that both trainers
load (bench/model_shapes.py save), and the GPU memory the side sampler reads from nvidia-smi (bench/sides.py), here from
a stand-in nvidia-smi on PATH that prints what the real one prints."""
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import model_shapes  # noqa: E402
import sides  # noqa: E402


def test_a_saved_random_checkpoint_loads_with_its_shape_and_tokenizer(tiny_model_path, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    out = model_shapes.save_random("tiny-qwen3", tiny_model_path, str(tmp_path / "m"))
    model = AutoModelForCausalLM.from_pretrained(out["folder"], dtype=torch.bfloat16)
    published = model_shapes.SHAPES["tiny-qwen3"][1]
    assert model.config.model_type == "qwen3" and model.config.num_hidden_layers == published["num_hidden_layers"]
    # the tiny tokenizer's vocabulary is smaller than the shape's: the published one is kept, and nothing is noted
    assert len(tok) < published["vocab_size"] == model.config.vocab_size == out["vocab"]
    assert out["vocab_note"] is None and out["parameters"] == sum(p.numel() for p in model.parameters())
    assert AutoTokenizer.from_pretrained(out["folder"])("1+2")["input_ids"] == tok("1+2")["input_ids"]
    ids = tok("1+2", return_tensors="pt")["input_ids"]
    assert torch.isfinite(model(ids).logits.float()).all()
    # seeded: the same shape and seed give the same weights
    again = model_shapes.save_random("tiny-qwen3", tiny_model_path, str(tmp_path / "m2"))
    assert (Path(again["folder"]) / "model.safetensors").read_bytes() == \
        (Path(out["folder"]) / "model.safetensors").read_bytes()


def test_a_vocabulary_smaller_than_the_tokenizers_is_widened_and_said(tiny_model_path, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    n = len(AutoTokenizer.from_pretrained(tiny_model_path))
    model_type, values = model_shapes.SHAPES["tiny-llama"]
    monkeypatch.setitem(model_shapes.SHAPES, "tiny-llama", (model_type, {**values, "vocab_size": n - 3}))
    out = model_shapes.save_random("tiny-llama", tiny_model_path, str(tmp_path / "m"))
    assert out["vocab"] == n and out["vocab_note"] == f"vocabulary {n} (the tokenizer's), not {n - 3}"


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    """An nvidia-smi that reports the pid in PID_FILE at 700 MiB, a stranger's pid at 9 GiB, and 12 GiB used."""
    pid_file = tmp_path / "pid"
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(f"""#!/bin/sh
case "$*" in
  *query-compute-apps*) echo "$(cat {pid_file}), 700"; echo "999999, 9216" ;;
  *query-gpu=memory.used*) echo "12288" ;;
esac
""")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    return pid_file


def test_the_sampler_names_the_gpu_memory_of_its_own_processes(fake_smi, tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        fake_smi.write_text(str(proc.pid))
        sampler = sides.MemorySampler(os.getpid(), interval=0.05, gpu=True)  # this test's process tree
        sampler.start()
        time.sleep(0.5)
        sampler.stop.set()
        sampler.join()
        sampler.finish()
        gpu = sampler.result({})["gpu"]
    finally:
        proc.kill()
        proc.wait()
    assert gpu["per_role_peak_mib"] == {"other": 700}  # the child, by its role; the stranger's pid is not ours
    assert gpu["unnamed_pids"] == [999999] and gpu["device_used_peak_mib"] == 12288 and gpu["error"] is None
    json.dumps(gpu)


def test_without_nvidia_smi_the_sampler_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi anywhere
    sampler = sides.MemorySampler(os.getpid(), gpu=True)
    sampler.sample()
    sampler.finish()
    gpu = sampler.result({})["gpu"]
    assert gpu["error"] and "nvidia-smi" in gpu["error"] and gpu["per_role_peak_mib"] == {}


def test_actor_processes_are_named_by_their_role():
    from qgrpo.actors.learner_actor import LearnerActor  # noqa: F401  (the classes whose titles are matched)
    from qgrpo.actors.rollout_actor import RolloutActor

    # Ray titles the process with the class the remote handle wraps (the threaded subclass)
    assert sides.role([f"ray::{RolloutActor.__ray_metadata__.class_name}.generate"], 5, 1) == "rollout"
    assert sides.role(["ray::LearnerActor.train_step"], 5, 1) == "learner"
    assert sides.role(["ray::ReferenceActor.score"], 5, 1) == "reference"
    assert sides.role(["ray::IDLE"], 5, 1) == "ray idle workers" and sides.role(["python"], 1, 1) == "driver"
