"""The learner's choices, without torch: the loss (learner/loss.py) checks its settings against these and the config
schema (cluster/config) builds its allowed values from them, so the two cannot drift and `qgrpo` starts without
importing torch."""

KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("token_mean", "seq_mean", "constant")
IS_MODES = ("truncate", "mask", "none")
# The least importance-weight cap C: [1/C, C] must contain 1, so that a token the sampler got exactly right keeps
# weight 1 (truncate) and is never masked out (mask). C = 1 is allowed: truncation then only ever lowers weights.
IS_CAP_MIN = 1.0
