"""KV caches for the shared-prompt forward (core/scoring.py) that gradient checkpointing can replay.

The shared-prompt forward runs each distinct prompt once, keeps its KV cache, and runs the completions on top of it.
Under gradient checkpointing each decoder layer runs again in the backward pass, and a transformers cache appends
the layer's keys and values at every call: replayed, a layer would see its own states twice. So transformers'
checkpointed layers drop any cache they are given, and the completions would attend to nothing of their prompt.

`ReplayLayer.update` is a pure function of the keys and values the layer held when its pass began and the new ones:
it stores and returns cat(start, new). A replayed call returns what the first one returned (recomputed from the same
inputs), and each pass has a cache object of its own (`prefix_cache` for the prompts, `suffix_cache` on top of it for
the completions), so replaying the prompt pass after the completion pass reads the prompt pass's own start (empty).
With these, the layers may keep the cache under checkpointing (`keep_cache_under_checkpointing`), which is what
transformers' `_can_checkpoint_with_cache` is for. Gradients reach the prompt pass through the cache tensors the
completion pass read, as without checkpointing.

Every layer must attend in full (`replayable`): a sliding-window layer crops its cache, which this layer does not.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class ReplayLayer(DynamicLayer):
    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None):
        super().__init__()
        self.start = None if keys is None else (keys, values)
        if keys is not None:
            self.keys, self.values, self.dtype, self.device = keys, values, keys.dtype, keys.device
            self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.start is None:
            self.keys, self.values = key_states, value_states
        else:
            self.keys = torch.cat([self.start[0], key_states], dim=-2)
            self.values = torch.cat([self.start[1], value_states], dim=-2)
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
        return self.keys, self.values


def prefix_cache() -> DynamicCache:
    """An empty cache for the prompt pass; each layer's slot is made at its first update."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = ReplayLayer
    return cache


def suffix_cache(prefix: DynamicCache, rows: torch.Tensor | None = None) -> DynamicCache:
    """A cache for the completion pass starting from `prefix`'s keys and values (their rows `rows`, when given)."""
    layers = [ReplayLayer(*((layer.keys, layer.values) if rows is None else (layer.keys[rows], layer.values[rows])))
              for layer in prefix.layers]
    cache = DynamicCache()
    cache.layers, cache.layer_class_to_replicate = layers, ReplayLayer
    return cache


def model_config(model):
    """The transformers config of `model`, through a DeepSpeed engine (`.module`) and a peft wrapper; None if none."""
    m = getattr(model, "module", model)
    if hasattr(m, "get_base_model"):
        m = m.get_base_model()
    return getattr(m, "config", None)


def replayable(model) -> bool:
    """Whether every layer of `model` attends in full (no sliding window, no other layer types)."""
    cfg = model_config(model)
    if cfg is None or any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        return False
    return getattr(cfg, "sliding_window", None) is None


def keep_cache_under_checkpointing(model) -> None:
    """Let `model`'s checkpointed layers keep the cache they are given (only this module's caches are given to them
    in training: core/scoring.py). Raises ValueError where a layer could not replay its cache."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if not replayable(model):
        cfg = model_config(model)
        raise ValueError(
            f"learner.gradient_checkpointing with learner.shared_prompt: {getattr(cfg, 'model_type', 'this model')} "
            "has sliding-window or mixed attention layers, whose prompt cache cannot be replayed under "
            "checkpointing; set learner.shared_prompt = false (checkpointing on full sequences) or "
            "learner.gradient_checkpointing = false")
    for m in model.modules():
        if isinstance(m, GradientCheckpointingLayer):
            m._can_checkpoint_with_cache = True
