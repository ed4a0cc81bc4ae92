"""What the learner, the reference scorer and the rollout backends share: the typed records that pass between
stages and the per-token log-prob forward. Imports nothing heavy."""
