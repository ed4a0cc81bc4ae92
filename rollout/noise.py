"""Scheduled exploration noise in the rollout generators (``rollout.norm_noise``): QeRL's Adaptive Quantization Noise
(Huang et al., "QeRL: Beyond Efficiency - Quantization-enhanced Reinforcement Learning for LLMs", 2025, section 3.3).

QeRL found that the noise of a quantized policy raises its sampling entropy and helps exploration, and adds more of
it on a schedule: at each sync the generators' RMSNorm weights get Gaussian noise, w + z with z ~ N(0, sigma^2), in
the norms that feed each layer's attention and MLP. A norm weight scales an input channel of the linear layers after
it, so this is a multiplicative perturbation of their (quantized) weights, column by column, at the cost of one
vector per norm; the quantized weights themselves are untouched.

The standard deviation decays exponentially over ``stages`` equal stretches of the run (QeRL's eq. 7):

    sigma_k = start * (end / start) ** (k / (stages - 1)),   k = floor(version * stages / horizon), capped at stages - 1

where ``version`` is the policy version of the sync and ``horizon`` the versions the run makes (run.steps x
algo.updates_per_batch). The draws are seeded by the version and the tensor's name, so every rollout actor serves the
same noisy policy and a version sent again is served identically. The noisy policy is the sampler mu: its log-probs
are the ones the actors return, and the importance weights pi_old / mu correct for it as for the quantization. The
generators hold the weights they loaded at the start until the first sync, without noise.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

# The norms in front of the attention and MLP projections (Llama, Qwen2/3, Mistral, SmolLM2, NanoChat's HF export).
NOISE_SUFFIXES = ("input_layernorm.weight", "post_attention_layernorm.weight")


@dataclass(frozen=True)
class NormNoise:
    start: float  # sigma of the first stage; 0 = off
    end: float  # sigma of the last stage
    stages: int  # K: stretches of the run with one sigma each
    horizon: int  # policy versions the schedule spans (run.steps x algo.updates_per_batch)

    def sigma(self, version: int) -> float:
        """The standard deviation of the noise served at `version` (0 when off)."""
        if self.start <= 0:
            return 0.0
        if self.stages == 1:
            return self.start
        k = min(self.stages - 1, max(0, version) * self.stages // max(1, self.horizon))
        return self.start * (self.end / self.start) ** (k / (self.stages - 1))

    def apply(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream with noise of `sigma(version)` added to the norm weights named in NOISE_SUFFIXES, the rest
        passed through as they come (lazily: a stream of buckets stays a stream)."""
        sigma = self.sigma(version)
        for name, t in tensors:
            if sigma > 0 and name.endswith(NOISE_SUFFIXES):
                t = noisy(t, sigma, version, name)
            yield name, t


def noisy(t: torch.Tensor, sigma: float, version: int, name: str) -> torch.Tensor:
    """`t` + z, z ~ N(0, sigma^2) drawn in float32 from a generator seeded by (version, name), in `t`'s dtype."""
    g = torch.Generator().manual_seed(zlib.crc32(f"norm_noise/{version}/{name}".encode()))
    z = torch.randn(t.shape, generator=g, dtype=torch.float32) * sigma
    return (t.float().cpu() + z).to(device=t.device, dtype=t.dtype)

