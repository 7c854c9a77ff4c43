"""FedProx: the proximal gradient mu (w - w_g) on a hand-checked tiny model, mu = 0 is FedAvg
bit for bit, hyperparameter validation, a short run."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedforget.config import TrainSpec
from fedforget.methods import ClientContext, FedAvg, RunInfo, check_params
from fedforget.methods.base import NoParams
from fedforget.methods.fedprox import FedProx
from fedforget.models import Classifier
from fedforget.parse import parse_config
from fedforget.partition import PartitionSpec
from fedforget.utils import FedForgetError

from .conftest import CPU, run

INFO = RunInfo(CPU, num_classes=2, seed=0, num_clients=4, train=TrainSpec())


def tiny_model(w, b) -> Classifier:
    """Identity body + linear head with the given weights: logits = x w^T + b."""
    m = Classifier(nn.Identity(), len(w[0]), len(w))
    with torch.no_grad():
        m.head.weight.copy_(torch.tensor(w))
        m.head.bias.copy_(torch.tensor(b))
    return m


def grads_and_loss(method, model, global_params, x, y):
    ctx = ClientContext(
        cid=0, round=1, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        global_params=global_params, broadcast={}, state={}, n_samples=len(y), lr=0.1,
        local_epochs=1, batch_size=len(y),
    )  # fmt: skip
    model.zero_grad(set_to_none=True)
    method.client_begin(ctx)
    loss = method.client_step(ctx, x, y)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, loss.item()


def test_proximal_gradient_is_mu_times_distance():
    w, b = [[1.0, 2.0], [3.0, 4.0]], [1.0, -1.0]
    global_params = {
        "head.weight": torch.tensor([[1.0, 1.0], [1.0, 1.0]]),
        "head.bias": torch.tensor([0.0, 0.0]),
    }
    x, y = torch.tensor([[0.5, -1.0], [2.0, 0.0]]), torch.tensor([0, 1])
    g_avg, l_avg = grads_and_loss(FedAvg(NoParams(), INFO), tiny_model(w, b), global_params, x, y)
    g_prox, l_prox = grads_and_loss(
        FedProx(FedProx.Params(mu=0.5), INFO), tiny_model(w, b), global_params, x, y
    )
    # w - w_g = [[0, 1], [2, 3]], b - b_g = [1, -1]; mu (w - w_g) with mu = 0.5:
    expected = {
        "head.weight": torch.tensor([[0.0, 0.5], [1.0, 1.5]]),
        "head.bias": torch.tensor([0.5, -0.5]),
    }
    for n in expected:
        torch.testing.assert_close(g_prox[n] - g_avg[n], expected[n], rtol=0, atol=1e-6)
    # (mu/2) ||w - w_g||^2 = 0.25 * (0 + 1 + 4 + 9 + 1 + 1) = 4
    assert l_prox - l_avg == pytest.approx(4.0, abs=1e-6)


def test_mu_zero_is_fedavg_bit_exact(make_run_config):
    kw = dict(
        partition=PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=5),
        rounds=2, sample_rate=0.5, local_epochs=2, eval_local_models=False,
        optimizer={"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4},
    )  # fmt: skip
    avg, _ = run(make_run_config(method="fedavg", **kw))
    prox, _ = run(make_run_config(method="fedprox", params={"mu": 0.0}, **kw))
    assert avg.global_params.keys() == prox.global_params.keys()
    for k in avg.global_params:
        assert torch.equal(avg.global_params[k], prox.global_params[k]), k
    # and mu > 0 does change the result
    prox1, _ = run(make_run_config(method="fedprox", params={"mu": 1.0}, **kw))
    assert not torch.equal(avg.global_params["head.weight"], prox1.global_params["head.weight"])


def test_default_mu():
    assert check_params("fedprox", {}) == {"mu": 1.0}


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), "1", True])
def test_bad_mu_rejected_at_parse(minimal_config, bad):
    minimal_config["experiments"][0]["methods"] = [{"name": "fedprox", "params": {"mu": bad}}]
    with pytest.raises(FedForgetError) as ei:
        parse_config(minimal_config)
    msg = str(ei.value)
    assert "methods[0].params" in msg and "fedprox" in msg and f"mu={bad!r}" in msg


def test_short_run_finite(make_run_config):
    cfg = make_run_config(
        method="fedprox", params={"mu": 0.01}, rounds=3,
        partition=PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=5),
    )  # fmt: skip
    _, rows = run(cfg)
    assert all(math.isfinite(r["global_model_test_acc"]) for r in rows)
    assert all(r["fedprox_dist_to_global"] > 0 for r in rows[1:])
