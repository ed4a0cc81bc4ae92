"""The objective's choices, without torch: the loss and the advantages check their arguments against these, and the
[algo] section (generated from learner/objective/settings.py) takes its allowed values from them, so the two cannot
drift and `qgrpo` starts without importing torch. The policy losses are not listed here: they are the registry's
names (learner/objective/losses.py)."""

SCALES = ("std", "none")  # group_advantages(scale=...): GRPO's std scaling, or Dr. GRPO's none
KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("token_mean", "seq_mean", "constant")
# The sampler/learner mismatch correction r = pi_old / mu (learner/objective/corrections.py): at which level r is taken
# (per token; the product over a sequence; its geometric mean) and what the bounds [is_floor, is_cap] do to it
# (truncate: clamp; mask: keep r inside, 0 outside; reject: 1 inside, 0 outside; none: weight 1).
IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("truncate", "mask", "reject", "none")
# The least importance-weight cap C: [is_floor, C] must contain 1, so that a token the sampler got exactly right is
# never masked out. C = 1 is allowed: truncation then only ever lowers weights.
IS_CAP_MIN = 1.0
