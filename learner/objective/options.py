"""The learner's choices, without torch: the loss (learner/loss.py) checks its settings against these and the config
schema (cluster/config) builds its allowed values from them, so the two cannot drift and `qgrpo` starts without
importing torch."""

KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("token_mean", "seq_mean", "constant")
# The policy-gradient term (learner/objectives.py): PPO/GRPO clip on token ratios, GSPO's clip on the sequence ratio,
# CISPO's clipped stop-gradient weight on log pi, SAPO's soft gate.
POLICY_LOSSES = ("grpo", "gspo", "cispo", "sapo")
# The sampler/learner mismatch correction r = pi_old / mu (learner/corrections.py): at which level r is taken
# (per token; the product over a sequence; its geometric mean) and what the bounds [is_floor, is_cap] do to it
# (truncate: clamp; mask: keep r inside, 0 outside; reject: 1 inside, 0 outside; none: weight 1).
IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("truncate", "mask", "reject", "none")
# The least importance-weight cap C: [is_floor, C] must contain 1, so that a token the sampler got exactly right is
# never masked out. C = 1 is allowed: truncation then only ever lowers weights.
IS_CAP_MIN = 1.0
