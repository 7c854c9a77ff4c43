"""FedAvgM: the server momentum step on hand tensors over two rounds, beta = 0 and eta_s = 1
equal to FedAvg, momentum changes the run, validation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedforget.methods import RunInfo, ServerContext, Upload
from fedforget.methods.fedavgm import VELOCITY, FedAvgM, FedAvgMParams
from fedforget.models import Classifier
from fedforget.parse import parse_config
from fedforget.train_spec import TrainSpec
from fedforget.utils import FedForgetError

from .conftest import CPU, run, strip

INFO = RunInfo(CPU, num_classes=1, seed=0, num_clients=4, train=TrainSpec())


def sd(w: float, b: float):
    return {"head.weight": torch.tensor([[w]]), "head.bias": torch.tensor([b])}


def test_momentum_step_hand_computed_over_two_rounds():
    server = ServerContext(1, sd(4.0, 1.0), Classifier(nn.Identity(), 1, 1), CPU, None)
    method = FedAvgM(FedAvgMParams(server_momentum=0.5, server_lr=2.0), INFO)
    # round 1: average (n 1 : 3) weight 0.25*2 + 0.75*6 = 5, bias 0.25*0 + 0.75*4 = 3
    ups = [Upload(0, 1, sd(2.0, 0.0), 1), Upload(1, 3, sd(6.0, 4.0), 1)]
    method.server_aggregate(server, ups)
    new = server.global_params
    # Delta = w - avg = (-1, -2); v = Delta; w' = w - 2 v = (6, 5)
    torch.testing.assert_close(new["head.weight"], torch.tensor([[6.0]]))
    torch.testing.assert_close(new["head.bias"], torch.tensor([5.0]))
    server.global_params = new
    # round 2: average weight 7, bias 5: Delta = (-1, 0); v = 0.5 (-1, -2) + (-1, 0) = (-1.5, -1)
    # w' = (6, 5) - 2 (-1.5, -1) = (9, 7)
    method.server_aggregate(server, [Upload(0, 2, sd(7.0, 5.0), 1)])
    new = server.global_params
    torch.testing.assert_close(server.state[VELOCITY]["head.weight"], torch.tensor([[-1.5]]))
    torch.testing.assert_close(new["head.weight"], torch.tensor([[9.0]]))
    torch.testing.assert_close(new["head.bias"], torch.tensor([7.0]))
    assert method.server_metrics(server, [])["velocity_norm"] == pytest.approx((1.5**2 + 1) ** 0.5)


def test_no_momentum_and_unit_server_lr_is_fedavg(make_run_config):
    _, avg = run(make_run_config(method="fedavg", rounds=3))
    _, m = run(make_run_config(method="fedavgm", params={"server_momentum": 0.0}, rounds=3))
    rows = strip(m, "fedavgm_")
    for a, b in zip(strip(avg), rows):
        for k, v in a.items():
            if isinstance(v, float):
                assert b[k] == pytest.approx(v, abs=1e-6), k


def test_momentum_changes_the_run(make_run_config):
    _, avg = run(make_run_config(method="fedavg", rounds=3))
    _, m = run(make_run_config(method="fedavgm", rounds=3))
    assert m[-1]["global_model_test_loss"] != pytest.approx(avg[-1]["global_model_test_loss"], abs=1e-4)
    assert m[-1]["fedavgm_velocity_norm"] > 0


@pytest.mark.parametrize("params, match", [
    ({"server_momentum": 1.0}, "server_momentum=1.0; allowed: a finite number >= 0 and < 1"),
    ({"server_momentum": -0.1}, "server_momentum=-0.1"),
    ({"server_lr": 0}, "server_lr=0; allowed: a finite number > 0"),
])  # fmt: skip
def test_bad_values_are_refused_naming_them(minimal_config, params, match):
    minimal_config["experiments"][0]["methods"] = [{"name": "fedavgm", "params": params}]
    with pytest.raises(FedForgetError, match=match):
        parse_config(minimal_config)
