"""Rollout-side choices, without torch: the config schema (cluster/config) builds its allowed values from them, so
the two cannot drift and `qgrpo` starts without importing torch."""

# sync.requantize (rollout/requantize.py): how a rollout actor rounds received weights onto its format's grid. Which
# formats have a grid it emulates each backend's spec says (rollout/backends: BackendSpec.grids, EMULATED_FORMATS).
REQUANTIZE_MODES = ("nearest", "stochastic", "error_feedback")
