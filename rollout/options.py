"""Rollout-side choices, without torch: rollout/advantages.py implements them and the config schema (cluster/config)
builds its allowed values from them, so the two cannot drift and `qgrpo` starts without importing torch."""

SCALES = ("std", "none")  # group_advantages(scale=...): GRPO's std scaling, or Dr. GRPO's none

# sync.requantize (rollout/requantize.py): how a rollout actor rounds received weights onto its format's grid, and the
# (backend, precision) pairs whose grid it emulates (the others serve "nearest" only).
REQUANTIZE_MODES = ("nearest", "stochastic", "error_feedback")
REQUANTIZE_FORMATS = (("torch", "int8"), ("torch", "int4"), ("vllm", "int8"))
