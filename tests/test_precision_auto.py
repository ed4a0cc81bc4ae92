"""`rollout.precision = "auto"`: the trials pick the fastest precision the precision guard accepts (stand-in
generators whose speeds and log-probs are known), the config accepts auto where some precision can serve, `qgrpo
check` prints the trials, and a real run records its choice in config.toml and its start event and keeps it on
resume."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from qgrpo.cluster.config.schema import ConfigError, load_config
from qgrpo.core.records import Completion, GroupRollout, PromptItem, SamplingParams
from qgrpo.rollout.precision_trials import Trial, choose, measure, mismatch_k3
from tests.helpers import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


class StandIn:
    """A generator whose time per sampled token and log-probs are set: every sampled token is 7 with log-prob
    `logprob`; its score of any token is `score`."""

    def __init__(self, precision: str, seconds_per_token: float, logprob: float = -1.0, score: float = -1.0):
        self.precision, self.seconds_per_token, self.logprob, self.score_value = precision, seconds_per_token, \
            logprob, score
        self.closed = False

    def generate(self, items, sampling):
        n = len(items) * sampling.group_size * sampling.max_new_tokens
        time.sleep(n * self.seconds_per_token)
        return [GroupRollout(item, [1, 2, 3], [Completion([7] * sampling.max_new_tokens,
                                                          [self.logprob] * sampling.max_new_tokens, "length", "")
                                               for _ in range(sampling.group_size)], 0, "stand-in", self.precision)
                for item in items]

    def score(self, token_ids):
        return [self.score_value] * (len(token_ids) - 1)

    def memory_bytes(self):
        return {"linear": 2 ** 20, "total": 2 ** 21}

    def close(self):
        self.closed = True


ITEMS = [PromptItem(f"p{i}", "question", "answer") for i in range(2)]
SAMPLING = SamplingParams(group_size=2, max_new_tokens=4, temperature=0.7, top_p=0.9)


def _measure(made: dict, max_kl: float = 2.0) -> list[Trial]:
    def make(precision):
        gen = made[precision]
        if isinstance(gen, Exception):
            raise gen
        return gen
    return measure(make, list(made), ITEMS, SAMPLING, max_kl)


def test_the_fastest_precision_is_chosen():
    made = {"bf16": StandIn("bf16", 4e-3), "int8": StandIn("int8", 2e-3), "int4": StandIn("int4", 1e-3)}
    trials = _measure(made)
    assert [t.precision for t in trials] == ["bf16", "int8", "int4"]  # in the order asked
    assert choose(trials).precision == "int4"
    rates = {t.precision: t.tokens_per_s for t in trials}
    assert rates["int4"] > rates["int8"] > rates["bf16"] > 0
    assert all(t.tokens == 16 and t.memory_mb == 2.0 for t in trials)
    assert all(g.closed for g in made.values())  # one model held at a time: each closed after its trial


def test_the_guard_rejects_non_finite_log_probs_and_a_large_mismatch():
    made = {"bf16": StandIn("bf16", 4e-3, score=-1.0),
            "int8": StandIn("int8", 2e-3, logprob=-1.0),  # the reference scores its tokens as it does: KL 0
            "int4": StandIn("int4", 1e-3, logprob=-4.0),  # r = pi / mu = e^3: k3 = e^3 - 1 - 3
            "nf4": StandIn("nf4", 5e-4, logprob=math.nan)}
    trials = {t.precision: t for t in _measure(made, max_kl=2.0)}
    assert trials["nf4"].rejected == "16 sampled log-probs not finite" and trials["nf4"].mismatch_kl is None
    assert trials["int4"].mismatch_kl == pytest.approx(math.expm1(3.0) - 3.0)
    assert trials["int4"].rejected.startswith("mismatch KL 16.1 > guard.max_mismatch_kl 2")
    assert trials["int8"].mismatch_kl == pytest.approx(0.0) and trials["int8"].accepted
    assert trials["bf16"].mismatch_kl is None  # the reference itself
    assert choose(list(trials.values())).precision == "int8"
    # guard.max_mismatch_kl = 0 (no bound): int4 passes, nf4 still not
    assert choose(_measure(made, max_kl=0.0)).precision == "int4"


def test_a_precision_that_cannot_run_here_is_left_out():
    made = {"bf16": StandIn("bf16", 2e-3), "int4": RuntimeError("no int4 kernel for this CPU\nmore")}
    trials = _measure(made)
    assert trials[1].error == "RuntimeError: no int4 kernel for this CPU" and not trials[1].accepted
    assert choose(trials).precision == "bf16"


def test_mismatch_k3_reads_the_completion_tokens_scores():
    class Scorer:
        def score(self, ids):  # log-prob of token t is -t / 10
            return [-t / 10 for t in ids[1:]]
    ids, prompt_len, mu = [5, 6, 7, 8, 9], 3, [-0.5, -1.5]  # completion tokens 8, 9
    lr = [-0.8 + 0.5, -0.9 + 1.5]
    expected = sum(math.expm1(x) - x for x in lr) / 2
    assert mismatch_k3(Scorer(), [(ids, prompt_len, mu)]) == pytest.approx(expected)


def test_no_accepted_precision_is_one_error_naming_the_field():
    from qgrpo.cluster.run.precision_auto import choice

    cfg = load_config(TINY, ["rollout.precision=\"auto\""], check_environment=False)
    trials = [Trial("bf16", error="OSError: out of memory").to_dict(),
              Trial("int8", tokens_per_s=9.0, rejected="4 sampled log-probs not finite").to_dict()]
    with pytest.raises(ValueError, match=r"rollout.precision: \"auto\" found no precision") as e:
        choice(cfg, trials)
    assert "cannot run here: OSError" in str(e.value) and "rejected: 4 sampled" in str(e.value)
    made = choice(cfg, [*trials, Trial("int4", tokens_per_s=5.0).to_dict()])
    assert made.cfg.rollout.precision == "int4" and cfg.rollout.precision == "auto"  # the given config unchanged
    assert made.record["choice"] == "int4" and len(made.record["trials"]) == 3
    assert made.note.startswith("# rollout.precision = \"auto\" chose int4 by trial: bf16 could not run, int8 9.0")


# ---------------------------------------------------------------------------------------------------------------------
# The config


def test_the_config_accepts_auto_and_tries_what_the_run_can_use():
    from qgrpo.cluster.run.precision_auto import candidates

    def cfg(*sets):
        return load_config(TINY, ["rollout.precision=\"auto\"", *sets], check_environment=False)

    assert candidates(cfg()) == ["bf16", "int8", "int4", "nf4"]  # what torch serves on CPU
    # re-rounding onto a grid, or simulating it in the learner, needs an emulated grid: those alone are tried
    assert candidates(cfg("sync.requantize=\"stochastic\"")) == ["int8", "int4"]
    assert candidates(cfg("learner.fake_quant=\"rollout\"")) == ["int8", "int4"]
    with pytest.raises(ConfigError, match="rollout.precision: \"auto\" tries the precisions with a grid"):
        cfg("rollout.backend=\"mlx\"", "sync.requantize=\"stochastic\"", "reference.backend=\"mlx\"")
    with pytest.raises(ConfigError, match="rollout.precision: 'fast' is not served by the torch backend"):
        load_config(TINY, ["rollout.precision=\"fast\""], check_environment=False)


# ---------------------------------------------------------------------------------------------------------------------
# check, train and resume on the tiny model


@pytest.fixture(autouse=True)
def _this_machine(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def _args(tiny_model_path, out, *sets):
    base = [f"model.path='{tiny_model_path}'", f"run.output_dir='{out}'", "run.progress=false",
            "rollout.precision=\"auto\"", *sets]
    return [str(TINY), *(a for s in base for a in ("--set", s))]


def test_check_prints_the_trials_and_the_choice(tiny_model_path, tmp_path, capsys):
    from qgrpo.cluster.cli.app import main

    assert main(["check", *_args(tiny_model_path, tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    (head,) = [line for line in lines if line.startswith("  precision: auto tried 4 precisions")]
    rows = lines[lines.index(head) + 2:lines.index(head) + 6]
    assert [r.split()[0] for r in rows] == ["bf16", "int8", "int4", "nf4"]
    chosen = [r.split()[0] for r in rows if r.endswith("chosen")]
    assert len(chosen) == 1 and head.endswith(f"{chosen[0]} chosen")
    rates = {r.split()[0]: float(r.split()[1]) for r in rows if "cannot run" not in r and "rejected" not in r}
    assert rates[chosen[0]] == max(rates.values())  # the fastest of those the guard accepted
    assert lines[-1] == "qgrpo check: OK: train would start"
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # a whole run: `make test-slow` (docs/testing.md)
@pytest.mark.ray
def test_a_run_records_its_choice_and_keeps_it_on_resume(ray_session, tiny_model_path, tmp_path, capsys):
    from qgrpo.cluster.cli.app import main

    out = tmp_path / "runs"
    assert main(["train", *_args(tiny_model_path, out, "run.steps=1")]) == 0
    err = capsys.readouterr().err
    (run,) = out.iterdir()
    saved = (run / "config.toml").read_text()
    start = next(m for m in read_metrics(run) if m.get("event") == "start")
    record = start["precision_auto"]
    chosen = record["choice"]
    accepted = [t for t in record["trials"] if not t["error"] and not t["rejected"]]
    assert chosen == max(accepted, key=lambda t: t["tokens_per_s"])["precision"]
    assert "qgrpo: precision: auto tried 4 precisions" in err and f"{chosen} chosen" in err
    assert load_config(run / "config.toml").rollout.precision == chosen  # a valid preset, the choice in it
    assert f"# rollout.precision = \"auto\" chose {chosen} by trial: " in saved
    assert {g["precision"] for g in start["generators"]} == {chosen}
    # resumed from the user's file, which still says auto: the run keeps its choice, without new trials
    ckpt = run / "checkpoints" / "step_000001"
    assert main(["train", *_args(tiny_model_path, out, "run.steps=2"), "--resume", str(ckpt)]) == 0
    err = capsys.readouterr().err
    assert f"rollout.precision: auto: {chosen}, the resumed run's choice" in err and "auto tried" not in err
    resumed_saved = (run / "config.toml").read_text()
    assert load_config(run / "config.toml").rollout.precision == chosen
    assert saved.splitlines()[-2].startswith("# rollout.precision = \"auto\" chose ")
    assert saved.splitlines()[-2] == resumed_saved.splitlines()[-2]  # the note of the trials, kept
    resumed = [m for m in read_metrics(run) if m.get("event") == "resume"][-1]
    assert {g["precision"] for g in resumed["generators"]} == {chosen} and "precision_auto" not in resumed
    json.dumps(record)  # JSON-safe as written
