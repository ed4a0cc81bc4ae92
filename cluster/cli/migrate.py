"""`qgrpo migrate`: an MLX-GRPO config written out as one of ours. The translation itself is
cluster/config/mlx_grpo.py; this command checks that what it writes loads as our config, which needs the schema (the
translation module stays below the schema, so the two do not import each other)."""
from __future__ import annotations

import tomllib

from qgrpo.cluster.config.mlx_grpo import name_origin, translate
from qgrpo.cluster.config.preflight import environment_problems
from qgrpo.cluster.config.schema import Config, ConfigError, check, schema
from qgrpo.cluster.config.tomlio import apply_overrides, to_toml


def migrate(data: dict, overrides: list[str], source: str) -> tuple[str, list[str]]:
    """`qgrpo migrate`: an MLX-GRPO config (parsed) and its overrides as the text of one of our configs, and warnings.
    The text holds only the fields the translation set (the rest are our defaults), each key's mapping as a comment
    above, and is checked to load as our config; raises ConfigError when it would not. What only this machine lacks
    (the model folder, a data file, a package) does not stop the translation: it is returned as warnings."""
    ours, lines, origin, problems, rest = translate(data, overrides)
    apply_overrides(ours, rest, problems, schema())  # our own section.key=value overrides land in the file too
    if problems:
        raise ConfigError(problems)
    text = to_toml(ours, Config)
    cfg, problems = check(tomllib.loads(text), check_environment=False)  # what we write loads as our config
    if problems:
        raise ConfigError([name_origin(x, origin) for x in problems])
    warnings = environment_problems(cfg)
    header = [f"# Written by `qgrpo migrate {source}` from an MLX-GRPO config; how each key maps:"]
    header += [f"#   {line}" for line in lines]
    header += ["# Fields not listed here take our defaults (`qgrpo check` shows all)."]
    header += ["# Not found on the machine that wrote this file (check again where it trains):"] if warnings else []
    header += [f"#   {w}" for w in warnings]
    return "\n".join(header + [""]) + text, warnings
