"""A new policy loss is one function and one registry entry with its own parameters, in one file: registered here,
from this test module, a toy loss with one parameter reaches [algo] (a config file and `--set`), its bounds are
checked by the config, the generated reference documents it, the learner's loss computes with it, and it is gone
again once removed."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from qgrpo.cluster.config.reference import render
from qgrpo.cluster.config.schema import ConfigError, load_config
from qgrpo.cluster.run.learners import learner_settings
from qgrpo.learner.objective.knobs import knob
from qgrpo.learner.objective.loss import aggregation_weights, grpo_loss
from qgrpo.learner.objective.losses import LOSSES, register_loss, unregister_loss
from tests.helpers import TINY


@dataclass(frozen=True)
class ToyParams:
    scale: float = knob(2.0, "policy_loss = \"toy\": the factor on REINFORCE's -A log pi.", gt=0)


def toy_term(logp, old, adv, m, p: ToyParams):
    """-scale A log pi: REINFORCE scaled, nothing clipped."""
    none = m.new_zeros(m.shape)
    return -p.scale * adv * logp, none, none


@pytest.fixture
def toy():
    register_loss("toy", ToyParams, summary="a test's REINFORCE, scaled")(toy_term)
    yield
    unregister_loss("toy")


def _config(tmp_path, algo: str, overrides=()):
    """configs/tiny.toml with `algo` (TOML lines) at the top of its [algo] table."""
    text = open(TINY).read().replace("\n[algo]\n", f"\n[algo]\n{algo}\n", 1)
    assert algo in text
    path = tmp_path / "toy.toml"
    path.write_text(text)
    return load_config(path, list(overrides), check_environment=False)


def test_a_registered_loss_reaches_algo_set_and_the_reference(toy, tmp_path):
    cfg = _config(tmp_path, 'policy_loss = "toy"\ntoy_scale = 3.5')
    assert (cfg.algo.policy_loss, cfg.algo.toy_scale) == ("toy", 3.5)
    cfg = _config(tmp_path, 'policy_loss = "toy"', ["algo.toy_scale=0.25"])
    assert cfg.algo.toy_scale == 0.25
    assert _config(tmp_path, 'policy_loss = "toy"').algo.toy_scale == 2.0  # its default
    with pytest.raises(ConfigError, match=r"algo\.toy_scale: must be > 0"):
        _config(tmp_path, 'policy_loss = "toy"\ntoy_scale = -1.0')
    reference = render()
    assert '"toy" (a test\'s REINFORCE, scaled)' in reference
    assert "| `toy_scale` | float | `2.0` | > 0 |" in reference and "the factor on REINFORCE's -A log pi" in reference

    # The learner is given the loss and its parameters, and the loss computes with them.
    objective = learner_settings(cfg).objective
    assert objective.policy_loss == "toy" and objective.loss_params == ToyParams(scale=0.25)
    logp = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    loss, _ = grpo_loss(logp, logp.detach(), logp.detach(), None, torch.tensor([1.0]), mask,
                        aggregation_weights(mask, "token_mean"), objective)
    assert loss.item() == pytest.approx(-0.25 * (-1.0 - 2.0) / 2)


def test_a_removed_loss_is_no_longer_accepted(tmp_path):
    register_loss("toy", ToyParams, summary="a test's REINFORCE, scaled")(toy_term)
    unregister_loss("toy")
    assert "toy" not in LOSSES
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, 'policy_loss = "toy"\ntoy_scale = 3.5')
    assert "algo.policy_loss: must be grpo, gspo, cispo or sapo" in str(err.value)
    assert "algo.toy_scale" in str(err.value)
    assert "toy_scale" not in render()


def test_a_loss_cannot_take_another_loss_s_key():
    @dataclass(frozen=True)
    class Cap:
        cap: float = knob(1.0, "a cap", ge=1)

    with pytest.raises(ValueError, match="'cispo_cap' is already 'cispo'"):
        register_loss("other", Cap, prefix="cispo_", summary="x")(toy_term)
    assert "other" not in LOSSES
