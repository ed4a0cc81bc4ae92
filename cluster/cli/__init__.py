"""The `qgrpo` command: its subcommands (app), `qgrpo submit` to a Ray cluster (submit) and `qgrpo export` (export)."""
