"""The preflight line with this machine's numbers: what the CPU roles compute in (model.compute_dtype, core/cpu.py),
the bf16 and fp32 matrix-product rates measured in about a second, and the step time they give the configured job,
so that a user knows before the run whether it takes minutes or hours.

The estimate counts a step's matrix-product work and divides it by the measured rate of the chosen dtype:
- tokens: each prompt once (the learner and the reference share a group's prompt, the generator prefills it once)
  plus every completion at rollout.max_new_tokens;
- per token 2 N FLOPs for a forward (N: the model's parameters, the output head included), 3 forwards' worth for the
  learner's forward and backward, 4 with gradient checkpointing, one for the reference, one for the generator.
It leaves out attention, the optimizer, syncs and Ray, and decoding one token at a time runs below the rate; on the
default job it came within a factor of two of the measured step (docs/performance.md#plain-x86-cpus).
"""
from __future__ import annotations

from dataclasses import dataclass

from qgrpo.cluster.config.schema import Config


@dataclass(frozen=True)
class MachineReport:
    cpu: str  # the processor in words (core/cpu.py: ISA.words)
    dtype: str  # what the CPU roles compute in: "bf16" or "fp32"
    why: str
    rates: dict  # GFLOP/s of bf16 and fp32 products, measured here
    step_s: float  # the estimate of one step, seconds (nan when the model could not be sized)

    def lines(self, steps: int) -> list[str]:
        rate = f"bf16 {self.rates['bf16']:.0f} and fp32 {self.rates['fp32']:.0f} GFLOP/s measured"
        cpu = "" if self.cpu in self.why else f"{self.cpu}; "
        out = [f"compute: {self.dtype} on the CPU roles ({self.why})", f"machine: {cpu}{rate} on this CPU"]
        if self.step_s == self.step_s:
            total = self.step_s * steps
            out.append(f"expected: about {_span(self.step_s)} per step, {_span(total)} for {steps} steps "
                       f"(a rough figure from the step's matrix-product work at that {self.dtype} rate)")
        return out


def _span(seconds: float) -> str:
    if seconds < 1:
        return "under 1 s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def model_parameters(model_path: str) -> int:
    """The parameters of the model at `model_path`, counted on the meta device (nothing is loaded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in model.parameters())
    head = model.get_output_embeddings()
    if head is not None and head.weight is model.get_input_embeddings().weight:
        n += head.weight.numel()  # a tied head is stored once and multiplied twice
    return n


def step_flops(cfg: Config, params: int, prompt_tokens: int) -> float:
    """The matrix-product FLOPs of one step (module docstring)."""
    ro = cfg.rollout
    tokens = ro.prompts_per_step * (prompt_tokens + ro.group_size * ro.max_new_tokens)
    learner = 4 if cfg.learner.gradient_checkpointing else 3
    forwards = learner * cfg.algo.updates_per_batch + (1 if cfg.reference_actor else 0) + 1
    return 2.0 * params * tokens * forwards


def machine_report(cfg: Config, model_path: str, seconds: float = 1.0) -> MachineReport:
    """What this machine does for the configured job (module docstring); about `seconds` of measurement."""
    from qgrpo.core.cpu import compute_dtype, isa, matmul_rates

    dtype, why = compute_dtype(cfg.model.compute_dtype, "cpu")
    rates = matmul_rates(seconds)
    try:
        from transformers import AutoTokenizer

        from qgrpo.rollout.backends.common import format_prompt
        from qgrpo.rollout.tasks import make_task

        prompt = len(format_prompt(AutoTokenizer.from_pretrained(model_path), make_task(cfg.task, cfg.run.seed).item(0),
                                   cfg.task.chat_template))
        step = step_flops(cfg, model_parameters(model_path), prompt) / (rates[dtype] * 1e9)
    except Exception:  # a model transformers cannot size: the line goes without the estimate
        step = float("nan")
    return MachineReport(isa().words(), dtype, why, rates, step)
