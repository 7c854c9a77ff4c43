"""FedNova: a_i against hand values and against momentum SGD itself, the aggregate on hand
tensors, equal step counts = FedAvg, unequal ones differ, validation, a short run."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedforget.config import TrainSpec
from fedforget.engine import Simulation
from fedforget.methods import RunInfo, ServerContext, Upload
from fedforget.methods.base import NoParams
from fedforget.methods.fednova import FedNova
from fedforget.methods.shared import effective_steps
from fedforget.models import Classifier
from fedforget.parse import parse_config
from fedforget.partition import PartitionSpec
from fedforget.utils import FedForgetError

from .conftest import CPU, run

INFO = RunInfo(CPU, num_classes=1, seed=0, num_clients=4, train=TrainSpec())


@pytest.mark.parametrize(
    "tau,rho,expected",
    [
        (3, 0.0, 3.0),  # plain SGD: a_i = tau_i
        # (3 - 0.9 (1 - 0.729)/0.1)/0.1 = (3 - 2.439)/0.1 = 5.61
        # = (1 - 0.9^3 + 1 - 0.9^2 + 1 - 0.9)/(1 - 0.9) = (0.271 + 0.19 + 0.1)/0.1
        (3, 0.9, 5.61),
        (1, 0.9, 1.0),  # one step: momentum has no history
        (0, 0.9, 0.0),
        (3, 1.0, 6.0),  # the schema's largest momentum: 1 + 2 + 3 (it divided by 0 before)
    ],
)
def test_effective_steps_hand_values(tau, rho, expected):
    assert effective_steps(tau, rho) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("rho", [0.0, 0.5, 0.9, 1.0])
def test_effective_steps_is_torch_sgd_displacement(rho):
    """Under a constant gradient g, tau steps of torch SGD(momentum=rho) move w by lr a g."""
    w = torch.zeros(3, requires_grad=True)
    g = torch.tensor([1.0, -2.0, 0.5])
    opt = torch.optim.SGD([w], lr=0.1, momentum=rho)
    for _ in range(7):
        opt.zero_grad()
        (g * w).sum().backward()
        opt.step()
    torch.testing.assert_close(w.detach(), -0.1 * effective_steps(7, rho) * g)


def sd(w: float, b: float):
    return {"head.weight": torch.tensor([[w]]), "head.bias": torch.tensor([b])}


def test_aggregate_hand_computed():
    model = Classifier(nn.Identity(), 1, 1)
    server = ServerContext(1, sd(4.0, 1.0), model, CPU, None)
    method = FedNova(NoParams(), INFO)
    uploads = [
        Upload(0, 1, sd(2.0, 0.0), 1, {"a": 1.0}),  # n = 1 -> p = 0.25, a = 1
        Upload(1, 3, sd(2.0, 3.0), 2, {"a": 2.0}),  # n = 3 -> p = 0.75, a = 2
    ]
    method.server_aggregate(server, uploads)
    new = server.global_params
    # tau_eff = 0.25*1 + 0.75*2 = 1.75
    # weight: d = (4-2)/1 = 2, (4-2)/2 = 1; sum p d = 0.5 + 0.75 = 1.25; 4 - 1.75*1.25 = 1.8125
    # bias:   d = (1-0)/1 = 1, (1-3)/2 = -1; sum p d = 0.25 - 0.75 = -0.5; 1 + 1.75*0.5 = 1.875
    # (FedAvg would give weight 0.25*2 + 0.75*2 = 2, bias 0.25*0 + 0.75*3 = 2.25)
    torch.testing.assert_close(new["head.weight"], torch.tensor([[1.8125]]))
    torch.testing.assert_close(new["head.bias"], torch.tensor([1.875]))
    assert method.server_metrics(server, uploads) == {"tau_eff": 1.75}


KW = dict(rounds=2, local_epochs=2, eval_local_models=False,
          optimizer={"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4})  # fmt: skip


def test_equal_steps_equals_fedavg(make_run_config):
    # iid: 4 clients x 30 samples, batch 16 -> 2 steps/epoch for everyone; momentum on
    avg, _ = run(make_run_config(method="fedavg", **KW))
    nova, rows = run(make_run_config(method="fednova", **KW))
    assert rows[-1]["fednova_tau_eff"] == pytest.approx(effective_steps(4, 0.9))
    for k in avg.global_params:
        torch.testing.assert_close(nova.global_params[k], avg.global_params[k], rtol=0, atol=1e-6)


def test_unequal_steps_differs_from_fedavg_and_finite(make_run_config):
    part = PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=5)
    avg, _ = run(make_run_config(method="fedavg", partition=part, **{**KW, "rounds": 3}))
    nova, rows = run(make_run_config(method="fednova", partition=part, **{**KW, "rounds": 3}))
    assert len({avg.clients.size(k) for k in range(4)}) > 1  # different n_k -> different tau_i
    assert all(math.isfinite(r["global_model_test_acc"]) for r in rows)
    diff = (nova.global_params["head.weight"] - avg.global_params["head.weight"]).abs().max()
    assert diff > 1e-4


def test_adam_rejected(make_run_config):
    with pytest.raises(FedForgetError, match="train.optimizer.name='sgd'"):
        Simulation(make_run_config(method="fednova", optimizer={"name": "adam"}), device=CPU)


def test_unknown_hyperparameter_rejected_at_parse(minimal_config):
    minimal_config["experiments"][0]["methods"] = [{"name": "fednova", "params": {"rho": 0.9}}]
    with pytest.raises(FedForgetError) as ei:
        parse_config(minimal_config)
    msg = str(ei.value)
    assert "methods[0].params" in msg and "['rho']" in msg and "fednova" in msg


@pytest.mark.parametrize("name", ["fednova", "scaffold"])
def test_adam_rejected_at_config_validation(minimal_config, name):
    """SGD-only methods fail at parse time (dry run), before any job starts."""
    ex = minimal_config["experiments"][0]
    ex["methods"] = [{"name": "fedavg"}, {"name": name, "train": {"optimizer": {"name": "adam"}}}]
    with pytest.raises(FedForgetError, match=rf"methods\[1\].*'{name}'.*sgd"):
        parse_config(minimal_config)
    ex["methods"] = [{"name": name}]
    assert parse_config(minimal_config).runs()
