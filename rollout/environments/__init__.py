"""Multi-turn environments: the contract (contract.py), tools and the environment that runs them (tools.py), the
kinds of environment a config can name and what each can do (kinds.py), and loading the one a config names
(loader.py). The episode loop that plays them is rollout/episodes.py; the Ray workers
that host them, off the rollout actors, actors/env_worker.py. How to write one: docs/environments.md."""
from qgrpo.rollout.environments.contract import (  # noqa: F401
    EnvFailure,
    Environment,
    EnvironmentOutputError,
    StepResult,
    row_of,
)
from qgrpo.rollout.environments.kinds import Capabilities, capabilities  # noqa: F401
from qgrpo.rollout.environments.loader import (  # noqa: F401
    EnvironmentLoadError,
    EnvSpec,
    environment_spec,
    environment_tools,
    factory_of,
    load_environment,
)
from qgrpo.rollout.environments.tools import (  # noqa: F401
    ToolEnvironment,
    ToolSchemaError,
    tool_schema,
    tools_prompt,
)
