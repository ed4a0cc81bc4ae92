"""The outer layer, above actors/, learner/, rollout/ and core/: the config (config), the run on Ray (run), the run
directory's state (rundir), reports (report) and the `qgrpo` command (cli). Each sub-package imports only from its
own level or below, in that order (tests/test_layers.py)."""
