"""Typed run configuration: TOML presets + `--set section.key=value` overrides, every problem reported at once.

The schema is the one source: its sections (sections.py, training.py) are pydantic dataclasses whose fields declare
their types, bounds, allowed values and descriptions; from them come the validation, the coercion of TOML values and
`--set` strings (tomlio.py), the TOML the config is written back as, and docs/reference/config.md (reference.py).
A config is checked in three layers, all problems reported together, each naming the field, the rule and the fix:

1. each field on its own: type, bounds, allowed values (pydantic; errors.py words its errors);
2. rules that span fields (rules.py), skipped for fields that already failed 1;
3. with `check_environment` (the default): the files, folders and packages the config names
   (preflight.environment_problems). Only this layer looks at the machine.

Validation never changes a value: a bad value is an error, never repaired.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass, rebuild_dataclass

from qgrpo.cluster.config import training
from qgrpo.cluster.config.errors import field_path, problems_of
from qgrpo.cluster.config.fields import SECTION, setting
from qgrpo.cluster.config.rules import gpu_problems, rule_problems
from qgrpo.cluster.config.sections import (
    BACKEND_SECTIONS,
    EnvironmentConfig,
    Example,
    ModelConfig,
    ReferenceConfig,
    RewardModelConfig,
    RewardsConfig,
    RewardSpec,
    RolloutConfig,
    RunConfig,
    TaskConfig,
)
from qgrpo.cluster.config.tomlio import anchor_paths, apply_overrides, to_toml
from qgrpo.cluster.config.training import (
    ATTENTION,
    LEARNER_MODES,
    LR_SCHEDULES,
    MODE_ZERO_STAGES,
    OPTIMIZERS,
    AlgoConfig,
    FaultsConfig,
    GuardConfig,
    LearnerConfig,
    LoraConfig,
    SyncConfig,
)
from qgrpo.learner.objective import losses

__all__ = ["Config", "ConfigError", "load_config", "config_from_dict", "validate", "check", "gpu_problems", "to_toml",
           "RunConfig", "ModelConfig", "TaskConfig", "Example", "RewardSpec", "RewardsConfig", "EnvironmentConfig",
           "RolloutConfig",
           "BACKEND_SECTIONS", "ReferenceConfig", "AlgoConfig", "LoraConfig", "LearnerConfig", "SyncConfig",
           "FaultsConfig", "GuardConfig", "LR_SCHEDULES", "LEARNER_MODES", "OPTIMIZERS", "MODE_ZERO_STAGES",
           "ATTENTION", "schema"]


@dataclass(config=SECTION)
class Config:
    run: RunConfig = setting(default_factory=RunConfig)
    """[run]: the run directory, its length, checkpoints, logging and held-out evaluation."""
    model: ModelConfig = setting(default_factory=ModelConfig)
    """[model]: the model trained."""
    task: TaskConfig = setting(default_factory=TaskConfig)
    """[task]: where the prompts come from and how they are put to the model."""
    rewards: RewardsConfig = setting(default_factory=RewardsConfig)
    """[rewards]: how completions are scored."""
    environment: EnvironmentConfig = setting(default_factory=EnvironmentConfig)
    """[environment]: multi-turn rollouts against an environment (off by default)."""
    rollout: RolloutConfig = setting(default_factory=RolloutConfig)
    """[rollout]: the generators: backend, precision, sampling, group sizes, resources."""
    reference: ReferenceConfig = setting(default_factory=ReferenceConfig)
    """[reference]: the frozen reference model of the KL term."""
    reward_model: RewardModelConfig = setting(default_factory=RewardModelConfig)
    """[reward_model]: a sequence classifier scoring completions, one reward among rewards.functions."""
    algo: AlgoConfig = setting(default_factory=lambda: AlgoConfig())  # the current [algo] (see `schema`)
    """[algo]: the GRPO objective: advantages, clipping, KL, importance weights, weight syncs."""
    learner: LearnerConfig = setting(default_factory=LearnerConfig)
    """[learner]: the DeepSpeed learner: ranks, optimizer, memory savers, resources."""
    sync: SyncConfig = setting(default_factory=SyncConfig)
    """[sync]: how new weights travel from the learner to the generators."""
    faults: FaultsConfig = setting(default_factory=FaultsConfig)
    """[faults]: deadlines and retries."""
    guard: GuardConfig = setting(default_factory=GuardConfig)
    """[guard]: the precision guard and its ladder."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def compute_dtype_of(self, role: str) -> str:
        """What `role` ("learner", "reference", "rollout") computes in as set: its section's compute_dtype, else
        model.compute_dtype ("auto", "bf16" or "fp32"; "auto" resolved by cluster/run/compute_auto.py or
        core/cpu.py)."""
        return getattr(self, role).compute_dtype or self.model.compute_dtype

    @property
    def reference_actor(self) -> bool:
        """Whether the run has a reference actor: only with a KL term, and not when the learner's base scores it."""
        return self.algo.kl_coeff > 0 and not self.reference.from_learner


class ConfigError(ValueError):
    """All problems of a config, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid config ({len(problems)} problem{'s' * (len(problems) != 1)}):\n{lines}")


_ADAPTER = TypeAdapter(Config)
_BUILT = [losses.version()]


def schema() -> type[Config]:
    """Config as of the registered policy losses: when a loss was registered (or removed) since [algo] was generated,
    [algo] is generated again (training.algo_section) and Config rebuilt around it, so that a loss registered after
    import (a plug-in, a test's) reaches [algo], `--set` and the reference like a built-in one."""
    global _ADAPTER, AlgoConfig
    if _BUILT[0] != losses.version():
        training.AlgoConfig = AlgoConfig = training.algo_section()
        rebuild_dataclass(Config, force=True)
        _ADAPTER = TypeAdapter(Config)
        _BUILT[0] = losses.version()
    return Config


def _without(data: dict, locs: list[tuple]) -> dict:
    """`data` less the values at `locs` (a value inside a list takes its whole list), so that defaults stand in."""
    out = copy.deepcopy(data)
    for loc in locs:
        keys = [str(p) for p in loc[:next((i for i, p in enumerate(loc) if isinstance(p, int)), len(loc))]]
        table: Any = out
        for k in keys[:-1]:
            table = table.get(k) if isinstance(table, dict) else None
        if keys and isinstance(table, dict):
            table.pop(keys[-1], None)
    return out


def _environment_scores(data: dict[str, Any]) -> bool:
    """Whether the config's [environment] gives a score of its own (a name, and a weight that is not 0)."""
    env = data.get("environment")
    if not isinstance(env, dict) or not isinstance(env.get("name"), str) or not env["name"]:
        return False
    weight = env.get("weight", 1.0)
    return not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight != 0


# Defaults that depend on other fields, applied where the user left the field out (never over a value given): (the
# field, when it applies, the value). The effective config a run saves holds the value, so a resume reads the same.
CONTEXT_DEFAULTS: list[tuple[str, Any, Any]] = [
    # an environment or agent that scores its own trajectories: its score alone, not the default job's `correct`
    # beside it (which would double a 0/1 score and reward any final answer holding the reference)
    ("rewards.functions", _environment_scores, lambda: []),
]


def with_context_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with CONTEXT_DEFAULTS filled in where their field is left out; `data` itself when none applies."""
    out = data
    for dotted, applies, value in CONTEXT_DEFAULTS:
        section, key = dotted.split(".")
        table = data.get(section, {})
        if not isinstance(table, dict) or key in table or not applies(data):
            continue
        out = copy.deepcopy(out) if out is data else out
        out.setdefault(section, {})[key] = value()
    return out


def check(data: dict[str, Any], check_environment: bool = True) -> tuple[Config | None, list[str]]:
    """(the config, every problem of it): field errors first, then the rules spanning fields (judged with defaults
    standing in for the failed fields, rules reading those skipped), then the environment. The config is None only
    when the fields cannot be built even so. Fields left out take their defaults, those of CONTEXT_DEFAULTS read
    from the other fields."""
    problems: list[str] = []
    schema()
    data = with_context_defaults(data)
    try:
        cfg = _ADAPTER.validate_python(data)
        invalid: set[str] = set()
    except ValidationError as e:
        problems, where = problems_of(e, Config)
        invalid = {field_path(loc) for loc, unknown in where if not unknown}  # an unknown key stands for no field
        try:
            cfg = _ADAPTER.validate_python(_without(data, [loc for loc, _ in where]))
        except ValidationError:  # a schema bug rather than a user's error; the field errors say what was given
            return None, problems
    problems += rule_problems(cfg, invalid)
    if check_environment:
        from qgrpo.cluster.config.preflight import environment_problems

        problems += environment_problems(cfg)
    return cfg, problems


def validate(cfg: Config, check_environment: bool = False) -> list[str]:
    """Every problem of a built config (also of values set on it after it was built); [] when it is valid."""
    return check(dataclasses.asdict(cfg), check_environment)[1]


def _read(p: Path) -> dict[str, Any]:
    if p.is_dir():
        raise ConfigError([f"config file {str(p)!r} is a folder; name the TOML file in it, e.g. "
                           f"{str(p / 'config.toml')!r}"])
    if not p.is_file():
        raise ConfigError([f"config file {str(p)!r} does not exist; presets are in configs/, e.g. configs/tiny.toml"])
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([f"{p}: not valid TOML ({e}); fix the file there"]) from None
    except UnicodeDecodeError as e:
        raise ConfigError([f"{p}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8"]) from None
    except OSError as e:
        raise ConfigError([f"{p}: cannot be read ({type(e).__name__}: {e.strerror or e})"]) from None


def load_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = (),
                base: dict[str, Any] | None = None, notes: list[str] | None = None,
                check_environment: bool = True, machine: list[str] | None = None) -> Config:
    """Read a TOML preset, apply `section.key=value` overrides, build and validate. Raises ConfigError.
    Without a path, `base` (an effective config saved by a run, e.g. a checkpoint's) is the starting point. The
    file's relative paths (every field the schema marks as one: data, reward and environment files, model folders,
    the cache folder; not run.output_dir) are read against its own folder (tomlio.anchor_paths).
    An MLX-GRPO file (cluster/config/mlx_grpo.py) is translated first: its `key=value` overrides apply before the
    translation, ours after; how each key mapped is appended to `notes`. `check_environment=False` leaves out the
    checks of this machine (model folder, data files, packages): for a config meant for another machine. `machine`: a
    list that receives those problems of a valid config instead of raising them, so that `qgrpo check` reports them
    together with the checks that follow (a missing data file and a missing reward file at once)."""
    from qgrpo.cluster.config.mlx_grpo import is_mlx_grpo, name_origin, translate

    problems: list[str] = []
    origin: dict[str, str] = {}
    data: dict[str, Any] = copy.deepcopy(base) if base else {}
    if path is not None:
        p = Path(path)
        data = _read(p)
        if is_mlx_grpo(data):
            data, lines, origin, bad, overrides = translate(data, overrides)
            if bad:
                raise ConfigError([f"{x} (in {p}, read as an MLX-GRPO config)" for x in bad])
            if notes is not None:
                notes.extend(lines)
        anchor_paths(data, p.resolve().parent, schema=schema())  # the file's paths; --set values stay the cwd's
    apply_overrides(data, overrides, problems, schema())
    cfg, more = check(data, check_environment and machine is None)
    problems += more
    if check_environment and machine is not None and cfg is not None:
        from qgrpo.cluster.config.preflight import environment_problems

        found = environment_problems(cfg)
        (problems if problems else machine).extend(found if problems else [name_origin(x, origin) for x in found])
    if problems:
        raise ConfigError([name_origin(x, origin) for x in problems])
    return cfg


def config_from_dict(data: dict[str, Any], check_environment: bool = True) -> Config:
    """A config from nested dicts (a saved effective config); raises ConfigError with every problem."""
    cfg, problems = check(data, check_environment)
    if problems:
        raise ConfigError(problems)
    return cfg
