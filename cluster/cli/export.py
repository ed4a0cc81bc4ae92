"""Export an HF checkpoint folder (e.g. a qgrpo `checkpoints/step_*`) into a folder that mlx-lm loads.

Only JSON and safetensors are read (safetensors headers are plain JSON): nothing is ever unpickled, and pickled files
(`*.bin`, `*.pt`, ...) are not copied.
"""
from __future__ import annotations

import fnmatch
import json
import shutil
import struct
import tempfile
from pathlib import Path

from qgrpo.rollout.backends.common import mlx_config
from qgrpo.rollout.modeling import nanochat
from qgrpo.rollout.modeling.models import add_top_level_rope_theta

# What an mlx-lm folder needs: the config, the weights, the tokenizer, the generation defaults. Everything else in a
# checkpoint (optimizer/, trainer_state.json, pickles, run files) is left behind.
COPY_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
# safetensors dtypes mlx-lm loads as model weights (bf16 is loaded but computes slowly on the MLX CPU backend).
FLOAT_DTYPES = {"BF16", "F32", "F16"}
_MAX_HEADER = 100 * 1024 * 1024


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file ({name: {dtype, shape, data_offsets}, "__metadata__": ...})."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise ValueError(f"{path} is not a safetensors file (header length {n})")
        try:
            return json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path} is not a safetensors file (bad header: {e})") from None


def _check_source(src: Path) -> tuple[dict, list[Path], dict[str, str]]:
    if not src.is_dir():
        raise ValueError(f"export: {src} is not a folder; pass a checkpoint folder (config.json + *.safetensors)")
    config_path = src / "config.json"
    if not config_path.is_file():
        raise ValueError(f"export: {config_path} is missing; pass an HF model folder such as a qgrpo "
                         f"checkpoints/step_* folder (config.json + *.safetensors + tokenizer files)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"export: {config_path} is not valid JSON: {e}") from None
    if not config.get("model_type"):
        raise ValueError(f"export: {config_path} has no model_type; mlx-lm picks the architecture from it")
    weights = sorted(src.glob("*.safetensors"))
    if not weights:
        pickled = sorted(p.name for p in src.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".pkl"})
        hint = (f" (found {', '.join(pickled)}: pickled weights are not read; re-save the model with "
                f"save_pretrained(..., safe_serialization=True))") if pickled else ""
        raise ValueError(f"export: no *.safetensors weights in {src}{hint}")
    dtypes: dict[str, str] = {}
    for w in weights:
        for name, info in safetensors_header(w).items():
            if name != "__metadata__":
                dtypes[name] = info["dtype"]
    odd = sorted(f"{k}: {v}" for k, v in dtypes.items() if v not in FLOAT_DTYPES)
    if odd:
        raise ValueError(f"export: weights in {src} are not plain floating point ({', '.join(odd[:5])}); export a "
                         f"bf16/fp32 checkpoint (quantize inside MLX with nn.quantize instead)")
    return config, weights, dtypes


def export_for_mlx(src: str | Path, dst: str | Path, *, overwrite: bool = False) -> Path:
    """Copy the HF checkpoint folder `src` into `dst` (created; returned) in a form `mlx_lm.load(dst)` loads.

    - config.json gets a top-level `rope_theta` (taken from `rope_parameters["rope_theta"]`: transformers 5 writes the
      RoPE base only there, and mlx-lm silently falls back to its default base 10000 without the top-level key), a
      `rope_scaling` when `rope_parameters` scales, and an explicit `tie_word_embeddings` (preserved when present).
    - Weights are copied as they are (safetensors, bf16 or fp32; fp16 too). A qgrpo checkpoint is bf16 and stays bf16:
      mlx-lm loads it, but bf16 matmuls are slow on the MLX CPU backend; convert to fp32 inside MLX for CPU speed
      (`model.set_dtype(mx.float32)`). Non-float (quantized) weights are refused.
    - nanochat: tensors renamed to nanochat's own names, which mlx-lm's nanochat model reads
    (rollout/modeling/nanochat.py).
    - Tokenizer files, chat template and generation_config.json are copied; optimizer/, trainer_state.json and any
      other file (pickles included) are not.
    - Written into a temporary folder next to `dst` and renamed into place: a crash leaves no half-written export.
      An existing non-empty `dst` is refused unless `overwrite=True` (then replaced only after the new copy is done).

    Raises ValueError when `src` is not an exportable checkpoint (no config.json, no safetensors, odd dtypes).
    """
    src = Path(src).expanduser().resolve()
    dst = Path(dst).expanduser().resolve()
    if dst == src or src in dst.parents:
        raise ValueError(f"export: the destination {dst} must lie outside the checkpoint folder {src}")
    config, weights, dtypes = _check_source(src)
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"export: {dst} exists and is not a folder")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise ValueError(f"export: {dst} already exists and is not empty; choose a new folder, delete it, or replace "
                         "it (`qgrpo export --overwrite`, overwrite=True from Python)")

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}-", dir=dst.parent))
    try:
        tmp.chmod(0o755)
        renaming = nanochat.is_nanochat(config) and not nanochat.native_names(set(dtypes))
        if renaming:
            nanochat.check_mlx_compatible(config)
        for f in sorted(src.iterdir()):
            if not (f.is_file() and f.name != "config.json" and any(fnmatch.fnmatch(f.name, p) for p in COPY_PATTERNS)):
                continue
            if renaming and f.suffix == ".safetensors":  # mlx-lm's nanochat model reads nanochat's own tensor names
                from safetensors.torch import load_file, save_file

                save_file({nanochat.to_native(k): v for k, v in load_file(str(f)).items()}, str(tmp / f.name),
                          metadata={"format": "mlx"})
            elif renaming and f.name == "model.safetensors.index.json":
                index = json.loads(f.read_text())
                index["weight_map"] = {nanochat.to_native(k): v for k, v in index["weight_map"].items()}
                (tmp / f.name).write_text(json.dumps(index, indent=1))
            else:
                shutil.copy2(f, tmp / f.name)
        cfg = mlx_config(config, set(dtypes))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        add_top_level_rope_theta(tmp / "config.json")  # no-op unless a RoPE base sits somewhere else
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    try:
        if dst.exists():  # an empty folder, or overwrite=True: set it aside, put the new copy in place, then delete it
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}-old-", dir=dst.parent))
            dst.rename(old / dst.name)
        tmp.rename(dst)
    except BaseException:
        if old is not None and (old / dst.name).exists() and not dst.exists():
            (old / dst.name).rename(dst)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return dst
