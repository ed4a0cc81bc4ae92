"""The `qgrpo` command: the parser and dispatch table (app), `qgrpo train` (train), the other subcommands (commands),
`qgrpo submit` to a Ray cluster (submit) and `qgrpo export` (export)."""
