"""The precision ladder: what the driver does when the learner's guard skips a step.

The guard itself runs inside the learner (learner/engine.py: non-finite sampler or reference log-probs, loss or
gradients, or a sampler mismatch above guard.max_mismatch_kl, skip the optimizer step on every rank together). This
class turns a skipped step into the next move: the quantized generators go one rung up (int4/nf4 -> int8 -> bf16),
or the quantized reference when its log-probs were the non-finite ones or the generators are already at the top.
When nothing is left to step up, `guard.max_skips_at_top` skipped steps in a row stop the run.
"""
from __future__ import annotations

from qgrpo.cluster.config.schema import GuardConfig
from qgrpo.rollout.backends import device_of, next_rung

BITS = {"int4": 4, "nf4": 4, "int8": 8, "fp8": 8, "bf16": 16}


class GuardStop(RuntimeError):
    pass


class PrecisionLadder:
    def __init__(self, cfg: GuardConfig, backend: str, rollout: str, reference: str | None, state: dict | None = None,
                 reference_backend: str = "torch", rollout_gpus: float = 0.0, reference_gpus: float = 0.0):
        """`rollout_gpus`/`reference_gpus`: the roles' num_gpus: a rung is taken only if served on their device."""
        self.cfg, self.backend, self.reference_backend = cfg, backend, reference_backend
        self.devices = device_of(rollout_gpus), device_of(reference_gpus)
        self.rollout, self.reference = rollout, reference  # reference None: no reference actor in this run
        self.skipped_total, self.skips_at_top = 0, 0
        if state:  # a resumed run keeps its rung and counts
            self.rollout = state["rollout_precision"]
            self.reference = state["reference_precision"] if reference is not None else None
            self.skipped_total, self.skips_at_top = state["skipped_total"], state["skips_at_top"]

    def after_step(self, skipped: str, step: int) -> tuple[str | None, str | None]:
        """`skipped`: the learner's reason ("" = the update was taken). Returns (new rollout precision, new reference
        precision), None where nothing changes; raises GuardStop when the run cannot go on."""
        if not skipped:
            self.skips_at_top = 0
            return None, None
        self.skipped_total += 1
        if self.cfg.ladder:
            up_rollout = next_rung(self.backend, self.rollout, self.devices[0])
            up_reference = (next_rung(self.reference_backend, self.reference, self.devices[1])
                            if self.reference is not None else None)
            moves = [(up_rollout, None), (None, up_reference)]
            if skipped == "reference_logprobs":
                moves.reverse()
            for r, f in moves:
                if r or f:
                    self.rollout, self.reference = r or self.rollout, f or self.reference
                    return r, f
        self.skips_at_top += 1
        if self.skips_at_top >= self.cfg.max_skips_at_top:
            raise GuardStop(
                f"precision guard: {self.skips_at_top} steps in a row skipped, the last at step {step} ({skipped}), "
                f"with the generators at {self.rollout}" + (f" and the reference at {self.reference}" if
                                                            self.reference else "")
                + (" and nothing left to step up" if self.cfg.ladder else " (guard.ladder = false)")
                + f" (guard.max_skips_at_top = {self.cfg.max_skips_at_top}); the policy itself gives non-finite "
                "values: lower learner.lr or learner.grad_clip, or resume from an earlier checkpoint")
        return None, None

    def state(self) -> dict:
        return {"rollout_precision": self.rollout, "reference_precision": self.reference,
                "skipped_total": self.skipped_total, "skips_at_top": self.skips_at_top}

    def metrics(self, skipped: str) -> dict:
        m = {"guard/skipped": int(bool(skipped)), "guard/skipped_total": self.skipped_total,
             "guard/rollout_bits": BITS[self.rollout], "rollout/precision": self.rollout}
        if skipped:
            m["guard/reason"] = skipped
        if self.reference is not None:
            m["guard/reference_bits"] = BITS[self.reference]
        return m
