"""What a run leaves in its run directory: checkpoints (checkpoint), resuming from them (resume), the metrics and event
log (runlog) and the sampled completions (rollout_log)."""
