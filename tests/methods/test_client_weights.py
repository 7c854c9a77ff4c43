"""``train.client_weights``: the server's model average weighs each upload by its client's
rows (samples, the default) or equally (uniform, the FedGP and FedProTIP codes' plain mean);
samples keeps every run's identity; FedDyn and SCAFFOLD, which weigh by their own
``weighting``, refuse uniform."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from fedforget.config import RunConfig
from fedforget.methods import METHODS, RunInfo, ServerContext, Upload, make_params
from fedforget.models import Classifier
from fedforget.parse import parse_config
from fedforget.train_spec import TrainSpec
from fedforget.utils import FedForgetError

from .conftest import CPU, run


def sd(w: float, b: float):
    return {"head.weight": torch.tensor([[w]]), "head.bias": torch.tensor([b])}


@pytest.mark.parametrize("name, weights, expected", [
    ("fedavg", "samples", (5.0, 3.0)),   # (1 * (2, 0) + 3 * (6, 4)) / 4
    ("fedavg", "uniform", (4.0, 2.0)),   # ((2, 0) + (6, 4)) / 2
    ("fedavgm", "uniform", (4.0, 2.0)),  # server_momentum 0: the average itself
    ("fednova", "uniform", (4.0, 2.0)),  # equal a_i: the plain mean's step
])  # fmt: skip
def test_the_average_weighs_uploads_by_rows_or_equally(name, weights, expected):
    info = RunInfo(CPU, num_classes=1, seed=0, num_clients=2, train=TrainSpec(client_weights=weights))
    method = METHODS.get(name, "method")(make_params(name, {"server_momentum": 0.0} if name == "fedavgm" else {}), info)
    server = ServerContext(1, sd(4.0, 1.0), Classifier(nn.Identity(), 1, 1), CPU, None)
    method.server_init(server)
    ups = [Upload(0, 1, sd(2.0, 0.0), 4), Upload(1, 3, sd(6.0, 4.0), 4)]
    for u in ups:
        u.extras["a"] = 4.0  # FedNova's effective steps, equal for both
    method.server_aggregate(server, ups)
    torch.testing.assert_close(server.global_params["head.weight"], torch.tensor([[expected[0]]]))
    torch.testing.assert_close(server.global_params["head.bias"], torch.tensor([expected[1]]))


def test_samples_keeps_the_run_identity_uniform_is_another_run(make_run_config):
    rc = make_run_config()
    assert rc.train.client_weights == "samples" and "client_weights" not in rc.to_dict()["train"]
    uni = replace(rc, train=replace(rc.train, client_weights="uniform"))
    assert uni.to_dict()["train"]["client_weights"] == "uniform" and uni.hash != rc.hash
    assert RunConfig.from_dict(uni.to_dict()) == uni


def test_uniform_changes_an_unequal_run(make_run_config):
    from fedforget.partition import PartitionSpec

    part = PartitionSpec("dirichlet", clients=4, alpha=0.3, min_size=5, seed=0)
    _, a = run(make_run_config(partition=part))
    _, b = run(make_run_config(partition=part, client_weights="uniform"))
    assert a[-1]["global_model_test_loss"] != pytest.approx(b[-1]["global_model_test_loss"], abs=1e-6)


@pytest.mark.parametrize("name", ["feddyn", "scaffold"])
def test_methods_with_their_own_weighting_refuse_uniform(minimal_config, name):
    minimal_config["experiments"][0]["methods"] = [{"name": name}]
    minimal_config["experiments"][0].setdefault("train", {})["client_weights"] = "uniform"
    with pytest.raises(FedForgetError, match=rf"method '{name}': train.client_weights='uniform' does nothing "
                       r"here.*set params.weighting"):  # fmt: skip
        parse_config(minimal_config)


def test_a_bad_value_is_refused_naming_it(minimal_config):
    minimal_config["experiments"][0].setdefault("train", {})["client_weights"] = "rows"
    with pytest.raises(FedForgetError, match=r"train.client_weights: 'rows' is not one of \['samples', 'uniform'\]"):
        parse_config(minimal_config)
