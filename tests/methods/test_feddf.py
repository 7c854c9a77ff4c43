"""FedDF: the teacher is the uniform mean of the clients' uploaded public logits (hand
check), clients upload their local model's eval-mode logits, distill_epochs = 0 is FedAvg
bit-exactly, a short run distils, config validation (public set required, bad values)."""

from __future__ import annotations

import math

import pytest
import torch

from fedforget.config import TrainSpec
from fedforget.engine import Simulation
from fedforget.methods import ClientContext, RunInfo, Upload, make_params
from fedforget.methods.feddf import PUBLIC_LOGITS, PUBLIC_X, FedDF
from fedforget.models import build_model
from fedforget.parse import parse_config
from fedforget.utils import FedForgetError

from .conftest import CPU, PUBLIC, run


@pytest.fixture
def run_cfg(public_run_cfg):
    def make(method="feddf", params=None, **train):
        return public_run_cfg(method, params, **train)

    return make


def method(params=None):
    info = RunInfo(CPU, 3, 0, 2, TrainSpec())
    return FedDF(make_params("feddf", params or {}), info)


def upload(cid, n, logits):
    return Upload(cid, n, {}, 1, {PUBLIC_LOGITS: torch.tensor(logits)})


# ----------------------------------------------------------------------------- teacher


def test_teacher_is_uniform_mean_of_client_logits():
    # two clients, two public samples, three classes; n_k = 10 and 30 must not weight it
    a = upload(0, 10, [[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    b = upload(1, 30, [[3.0, 2.0, 1.0], [2.0, 4.0, 6.0]])
    # row 0: ((1+3)/2, (2+2)/2, (3+1)/2) = (2, 2, 2); row 1: ((0+2)/2, (0+4)/2, (0+6)/2) = (1, 2, 3)
    expected = torch.tensor([[2.0, 2.0, 2.0], [1.0, 2.0, 3.0]])
    assert torch.equal(method().teacher_logits([a, b]), expected)


def test_probs_teacher_is_mean_of_tempered_softmax():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 5, 4, generator=g) * 3
    ups = [Upload(k, 1, {}, 1, {PUBLIC_LOGITS: z[k]}) for k in range(3)]
    t = 3.0
    teacher = method({"teacher_ensemble": "probs", "temperature": t}).teacher_logits(ups)
    torch.testing.assert_close(
        torch.softmax(teacher / t, -1), torch.softmax(z / t, -1).mean(0), atol=1e-6, rtol=0
    )


def test_client_uploads_eval_mode_logits_on_the_public_set():
    torch.manual_seed(0)
    model = build_model("mlp", (4,), 3, {"hidden": [5]})
    x_pub = torch.randn(9, 4)
    m = method()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx = ClientContext(0, 1, model, opt, {}, {PUBLIC_X: x_pub}, {}, 8, 0.1, 1, 8)
    model.train()
    up = m.client_end(ctx)
    assert model.training  # mode restored for the engine
    torch.testing.assert_close(up.extras[PUBLIC_LOGITS], model(x_pub).detach())
    assert set(up.params) == set(model.state_dict())


# ----------------------------------------------------------------------------- runs


def test_zero_distill_epochs_is_fedavg_bit_exactly(run_cfg):
    sim_df, rows_df = run(run_cfg("feddf", {"distill_epochs": 0}))
    sim_avg, rows_avg = run(run_cfg("fedavg"))
    assert sim_df.global_params.keys() == sim_avg.global_params.keys()
    for k, v in sim_avg.global_params.items():
        assert torch.equal(sim_df.global_params[k], v), k
    acc = [r["global_model_test_acc"] for r in rows_df]
    assert acc == [r["global_model_test_acc"] for r in rows_avg]


def test_short_run_distils_and_lowers_kl(run_cfg):
    sim, rows = run(run_cfg("feddf", {"distill_epochs": 5, "distill_batch_size": 4}))
    sim_avg, _ = run(run_cfg("fedavg"))
    assert len(rows) == 4
    assert all(math.isfinite(r["global_model_test_acc"]) for r in rows)
    n_pub = len(sim.server.public.x)  # 10% of iris' 120 training rows
    assert n_pub == 12
    for r in rows[1:]:
        assert r["feddf_distill_steps"] == 5 * 3  # 12 rows in batches of 4, 5 epochs
        assert r["feddf_distill_kl_after"] < r["feddf_distill_kl_before"]
    assert any(not torch.equal(v, sim_avg.global_params[k]) for k, v in sim.global_params.items())


def test_run_without_public_set_is_refused(make_run_config):
    with pytest.raises(FedForgetError, match="needs a public set"):
        Simulation(make_run_config(method="feddf"), device=CPU)


# ----------------------------------------------------------------------------- config


def test_config_rejects_feddf_without_public_set(minimal_config):
    minimal_config["experiments"][0]["methods"] = [{"name": "feddf"}]
    with pytest.raises(FedForgetError, match=r"method 'feddf' needs a public set"):
        parse_config(minimal_config)
    minimal_config["experiments"][0]["datasets"][0]["public"] = PUBLIC
    parse_config(minimal_config)  # accepted with one


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", 0),
        ("temperature", -1.0),
        ("distill_epochs", -1),
        ("distill_optimizer", "rmsprop"),
        ("distill_lr", 0),
        ("distill_batch_size", 0),
        ("distill_schedule", "linear"),
        ("teacher_ensemble", "median"),
    ],
)
def test_bad_hyperparameters_are_rejected(minimal_config, field, value):
    ex = minimal_config["experiments"][0]
    ex["datasets"][0]["public"] = PUBLIC
    ex["methods"] = [{"name": "feddf", "params": {field: value}}]
    with pytest.raises(FedForgetError, match=rf"{field}={value!r}"):
        parse_config(minimal_config)


def test_defaults():
    p = make_params("feddf", {})
    assert (p.temperature, p.distill_optimizer, p.distill_lr) == (1.0, "adam", 1e-3)
    assert (p.distill_batch_size, p.distill_schedule, p.distill_epochs) == (128, "cosine", 1)
    assert p.teacher_ensemble == "logits" and p.distill_max_grad_norm == 0.0
