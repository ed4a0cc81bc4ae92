"""Rollout-side choices, without torch: rollout/advantages.py implements them and the config schema (cluster/config)
builds its allowed values from them, so the two cannot drift and `qgrpo` starts without importing torch."""

SCALES = ("std", "none")  # group_advantages(scale=...): GRPO's std scaling, or Dr. GRPO's none
