"""FedET: the variance-weighted consensus and the diversity target on a hand example, the
server loss by hand, guards (uniform outputs, no dissent), distill_epochs = 0 is FedAvg
bit-exactly, short runs (hard and soft targets), config validation."""

from __future__ import annotations

import math

import pytest
import torch

from fedforget.methods import make_params
from fedforget.methods.fedet import fedet_loss, variance_weighted_consensus
from fedforget.parse import parse_config
from fedforget.utils import FedForgetError

from .conftest import PUBLIC, run


@pytest.fixture
def run_cfg(public_run_cfg):
    def make(method="fedet", params=None, **train):
        return public_run_cfg(method, params, **train)

    return make


# Hand example: 2 clients (A, B), 2 public samples, 3 classes. Logits are log-probabilities,
# so softmax returns the probabilities below. The variance over C = 3 classes of a
# probability vector is sigma^2 = (1/3) sum_c (p_c - 1/3)^2 = (3 sum_c p_c^2 - 1) / 9.
#   sample 1: A = (0.8, 0.1, 0.1): sum p^2 = 0.66 -> 9 sigma^2 = 0.98
#             B = (0.2, 0.5, 0.3): sum p^2 = 0.38 -> 9 sigma^2 = 0.14
#     alpha = (0.98, 0.14) / 1.12 = (0.875, 0.125)
#     s_bar = 0.875 A + 0.125 B = (0.7 + 0.025, 0.0875 + 0.0625, 0.0875 + 0.0375)
#           = (0.725, 0.15, 0.125) -> y_hat = 0; B (argmax 1) dissents -> s_div = B
#   sample 2: A = (0.3, 0.4, 0.3): sum p^2 = 0.34 -> 9 sigma^2 = 0.02
#             B = (0.7, 0.2, 0.1): sum p^2 = 0.54 -> 9 sigma^2 = 0.62
#     alpha = (0.02, 0.62) / 0.64 = (0.03125, 0.96875)
#     s_bar = 0.03125 A + 0.96875 B = (0.009375 + 0.678125, 0.0125 + 0.19375, 0.009375 + 0.096875)
#           = (0.6875, 0.20625, 0.10625) -> y_hat = 0; A (argmax 1) dissents -> s_div = A
PROBS = torch.tensor(
    [
        [[0.8, 0.1, 0.1], [0.3, 0.4, 0.3]],  # client A: sample 1, sample 2
        [[0.2, 0.5, 0.3], [0.7, 0.2, 0.1]],  # client B
    ],
    dtype=torch.float64,
)


def test_variance_weighted_consensus_by_hand():
    c = variance_weighted_consensus(PROBS.log())
    torch.testing.assert_close(
        c.alpha, torch.tensor([[0.875, 0.03125], [0.125, 0.96875]]), atol=1e-6, rtol=0
    )
    torch.testing.assert_close(
        c.s_bar, torch.tensor([[0.725, 0.15, 0.125], [0.6875, 0.20625, 0.10625]]), atol=1e-6, rtol=0
    )  # fmt: skip
    assert c.y_hat.tolist() == [0, 0]
    assert c.has_div.tolist() == [True, True]
    torch.testing.assert_close(
        c.s_div, torch.tensor([[0.2, 0.5, 0.3], [0.3, 0.4, 0.3]]), atol=1e-6, rtol=0
    )
    # the plain mean would give sample 2 weight 1/2 each: the weighting is what differs
    assert not torch.allclose(c.s_bar[1], PROBS[:, 1].mean(0).float(), atol=1e-3)


def test_fedet_loss_by_hand():
    c = variance_weighted_consensus(PROBS.log())
    logits = torch.zeros(2, 3)  # uniform student q = (1/3, 1/3, 1/3)
    lam = 0.05
    # CE(q, y_hat) = ln 3 for both samples.
    # KL(s_div || q) = ln 3 + sum_c s_c ln s_c:
    #   sample 1, s = (0.2, 0.5, 0.3): 0.2 ln 0.2 + 0.5 ln 0.5 + 0.3 ln 0.3 = -1.029653 -> KL = 0.068959
    #   sample 2, s = (0.3, 0.4, 0.3): 2 * 0.3 ln 0.3 + 0.4 ln 0.4       = -1.088900 -> KL = 0.009712
    kl1 = math.log(3) + 0.2 * math.log(0.2) + 0.5 * math.log(0.5) + 0.3 * math.log(0.3)
    kl2 = math.log(3) + 2 * 0.3 * math.log(0.3) + 0.4 * math.log(0.4)
    assert kl1 == pytest.approx(0.068959, abs=1e-6) and kl2 == pytest.approx(0.009712, abs=1e-6)
    expected = math.log(3) + lam * (kl1 + kl2) / 2
    got = fedet_loss(logits, c.y_hat, c.s_div.float(), c.has_div, lam)
    assert got.item() == pytest.approx(expected, rel=1e-6)
    # soft target: KL(s_bar || q) replaces the CE term
    kl_bar = sum(
        math.log(3) + sum(p * math.log(p) for p in row) for row in c.s_bar.tolist()
    ) / 2  # fmt: skip
    soft = fedet_loss(logits, c.y_hat, c.s_div.float(), c.has_div, lam, c.s_bar.float())
    assert soft.item() == pytest.approx(kl_bar + lam * (kl1 + kl2) / 2, rel=1e-5)


def test_guards_uniform_outputs_and_no_dissent():
    # all clients uniform: no variance anywhere -> uniform weights, no NaN, no dissent
    c = variance_weighted_consensus(torch.zeros(3, 4, 5))
    torch.testing.assert_close(c.alpha, torch.full((3, 4), 1 / 3))
    assert torch.isfinite(c.s_bar).all() and not c.has_div.any()
    assert torch.equal(c.s_div, torch.zeros(4, 5))
    # clients agree on sample 0 -> no diversity term there; the loss stays finite
    z = torch.tensor([[[4.0, 0.0, 0.0], [0.0, 3.0, 0.0]], [[3.0, 1.0, 0.0], [2.0, 0.0, 0.0]]])
    c = variance_weighted_consensus(z)
    assert c.has_div.tolist() == [False, True]
    assert torch.equal(c.s_div[0], torch.zeros(3))
    loss = fedet_loss(torch.randn(2, 3), c.y_hat, c.s_div, c.has_div, 0.05)
    assert torch.isfinite(loss)


def test_zero_distill_epochs_is_fedavg_bit_exactly(run_cfg):
    sim_et, rows_et = run(run_cfg("fedet", {"distill_epochs": 0}))
    sim_avg, rows_avg = run(run_cfg("fedavg"))
    for k, v in sim_avg.global_params.items():
        assert torch.equal(sim_et.global_params[k], v), k
    acc = [r["global_model_test_acc"] for r in rows_et]
    assert acc == [r["global_model_test_acc"] for r in rows_avg]


@pytest.mark.parametrize("target", ["hard", "soft"])
def test_short_run_distils(run_cfg, target):
    params = {"distill_epochs": 5, "distill_batch_size": 4, "consensus_target": target}
    sim, rows = run(run_cfg("fedet", params))
    sim_avg, _ = run(run_cfg("fedavg"))
    assert all(math.isfinite(r["global_model_test_acc"]) for r in rows)
    for r in rows[1:]:
        assert r["fedet_distill_steps"] == 15  # 12 public rows, batches of 4, 5 epochs
        assert r["fedet_distill_loss_after"] < r["fedet_distill_loss_before"]
        assert 0 <= r["fedet_dissent_share"] <= 1
        assert 1 / 4 <= r["fedet_alpha_max_mean"] <= 1
        assert "fedet_distill_kl_before" not in r  # no FedDF-style teacher
    assert any(not torch.equal(v, sim_avg.global_params[k]) for k, v in sim.global_params.items())


def test_config_rejects_fedet_without_public_set(minimal_config):
    minimal_config["experiments"][0]["methods"] = [{"name": "fedet"}]
    with pytest.raises(FedForgetError, match=r"method 'fedet' needs a public set"):
        parse_config(minimal_config)


@pytest.mark.parametrize(
    "field,value",
    [
        ("diversity_weight", -0.1),
        ("diversity_weight", "0.05"),
        ("consensus_target", "median"),
        ("distill_epochs", 1.5),
        ("distill_lr", -1e-3),
    ],
)
def test_bad_hyperparameters_are_rejected(minimal_config, field, value):
    ex = minimal_config["experiments"][0]
    ex["datasets"][0]["public"] = PUBLIC
    ex["methods"] = [{"name": "fedet", "params": {field: value}}]
    with pytest.raises(FedForgetError, match=rf"{field}={value!r}"):
        parse_config(minimal_config)


def test_defaults_and_no_temperature():
    p = make_params("fedet", {})
    assert (p.diversity_weight, p.consensus_target) == (0.05, "hard")
    assert (p.distill_optimizer, p.distill_lr, p.distill_batch_size) == ("adam", 1e-3, 128)
    assert (p.distill_epochs, p.distill_schedule) == (1, "constant")
    with pytest.raises(FedForgetError, match="unknown hyperparameter"):
        make_params("fedet", {"temperature": 3.0})
