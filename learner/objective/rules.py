"""The objective's rules across its own settings (plain Python): combinations of [algo] keys that mean nothing or
that the driver cannot do. Each reads only the keys it is listed with (the config skips it when one of them has an
error of its own) and returns its problems, each naming the key and the fix. cluster/config/training.py registers
them with the config's other rules."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qgrpo.learner.objective.losses import LOSSES


def _clip_order(a: Any) -> list[str]:
    if a.clip_low <= a.clip_high:
        return []
    return [f"algo.clip_low: must be <= algo.clip_high (clip-higher widens the upper side), got {a.clip_low} > "
            f"{a.clip_high}; lower algo.clip_low or raise algo.clip_high"]


def _loss_aggregation(a: Any) -> list[str]:
    """A policy loss registered with its aggregation (GSPO: seq_mean) holds [algo].loss_agg to it."""
    need = LOSSES[a.policy_loss].loss_agg if a.policy_loss in LOSSES else None
    if need is None or a.loss_agg == need:
        return []
    if a.policy_loss == "gspo":
        why = "clips one ratio per sequence and averages over sequences"
        return [f"algo.loss_agg: policy_loss = \"gspo\" {why}; loss_agg = {a.loss_agg!r} would weight each sequence "
                f"by its length; set algo.loss_agg = \"seq_mean\""]
    return [f"algo.loss_agg: policy_loss = {a.policy_loss!r} is defined with loss_agg = {need!r}, got {a.loss_agg!r}; "
            f"set algo.loss_agg = {need!r}"]


def _correction_needed(a: Any) -> list[str]:
    if a.is_mode == "none" and (a.is_level != "token" or a.is_floor > 0):
        return ["algo.is_mode: \"none\" applies no correction, so algo.is_level and algo.is_floor have no effect; "
                "remove them, or choose is_mode = \"truncate\", \"mask\" or \"reject\""]
    if a.is_mode in ("mask", "reject") and a.is_floor == a.is_cap:
        return [f"algo.is_floor: equal to algo.is_cap ({a.is_cap}), is_mode = {a.is_mode!r} would drop every token "
                "whose ratio is not exactly 1; lower is_floor or raise is_cap"]
    return []


def _m2_threshold(a: Any) -> list[str]:
    """The knob's bounds refuse a negative or NaN threshold; an infinite one would mask nothing while reading as on."""
    if a.m2_threshold != float("inf"):
        return []
    return ["algo.m2_threshold: inf masks no token, so M2PO's mask would be on in name only; set 0 to turn it off, "
            "or a finite threshold on the mean squared log(pi_old/mu) such as 0.04"]


def _kl_correction(a: Any) -> list[str]:
    if not a.kl_bias_correction or a.kl_coeff > 0:
        return []
    return ["algo.kl_bias_correction: corrects the KL term, and algo.kl_coeff = 0 has none; set kl_coeff > 0 or "
            "kl_bias_correction = false"]


def _dynamic_sampling(a: Any) -> list[str]:
    if not (a.dynamic_sampling and a.overlap):
        return []
    return ["algo.dynamic_sampling: cannot run with algo.overlap (the next step's prompts are generated before this "
            "step knows how many more it needs); set one of them to false"]


def _max_staleness(a: Any) -> list[str]:
    if not a.max_staleness:
        return []
    other = "overlap" if a.overlap else "dynamic_sampling" if a.dynamic_sampling else ""
    if not other:
        return []
    why = ("is the one-step-off form of it; max_staleness = 1 covers it" if other == "overlap" else
           "needs to know after each step's rewards how many more prompts to draw, which a stream drew already")
    return [f"algo.max_staleness: cannot run with algo.{other} (it {why}); set algo.{other} = false or "
            "algo.max_staleness = 0"]


# ([algo] keys read, rule): the rule gets the [algo] record
RULES: list[tuple[tuple[str, ...], Callable[[Any], list[str]]]] = [
    (("clip_low", "clip_high"), _clip_order),
    (("policy_loss", "loss_agg"), _loss_aggregation),
    (("is_mode", "is_level", "is_floor", "is_cap"), _correction_needed),
    (("m2_threshold",), _m2_threshold),
    (("kl_bias_correction", "kl_coeff"), _kl_correction),
    (("dynamic_sampling", "overlap"), _dynamic_sampling),
    (("max_staleness", "overlap", "dynamic_sampling"), _max_staleness),
]
