"""qgrpo: GRPO fine-tuning of language models with rollouts from quantized copies of the policy and a BF16 DeepSpeed
learner, on Ray.

The distribution maps the repository's top-level folders under this one name (pyproject.toml, `package-dir`):
`qgrpo.core` is core/, `qgrpo.rollout` is rollout/, and so on, so that nothing of ours takes a common top-level name
(`core`, `cluster`) in a user's environment. This file imports nothing heavy.
"""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("qgrpo")
except PackageNotFoundError:  # the source tree without an install (a Ray job's uploaded copy is installed beside it)
    __version__ = "0+unknown"
