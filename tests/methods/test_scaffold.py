"""SCAFFOLD option II: a two-step local run with hand-computed control variates, the server
updates of x (eta_g, uniform or n_k weights) and c (|S|/N factor), first-round uploads equal
FedAvg's with c = c_i = 0, the momentum divisor, validation, a short run."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedforget.config import TrainSpec
from fedforget.engine import Simulation
from fedforget.methods import ClientContext, RunInfo, ServerContext, Upload, check_params
from fedforget.methods.base import TASK
from fedforget.methods.scaffold import Scaffold
from fedforget.methods.shared import effective_steps
from fedforget.models import Classifier
from fedforget.parse import parse_config
from fedforget.partition import PartitionSpec
from fedforget.utils import FedForgetError

from .conftest import CPU, run

INFO = RunInfo(CPU, num_classes=1, seed=0, num_clients=4, train=TrainSpec())  # N = 4


def tiny_model(w: float, b: float) -> Classifier:
    """Identity body + 1x1 linear head: logit = w x + b; flat parameter order [w, b]."""
    m = Classifier(nn.Identity(), 1, 1)
    with torch.no_grad():
        m.head.weight.fill_(w)
        m.head.bias.fill_(b)
    return m


def sd(w: float, b: float):
    return {"head.weight": torch.tensor([[w]]), "head.bias": torch.tensor([b])}


class Quadratic(Scaffold):
    """SCAFFOLD with a loss whose gradient is easy by hand: 0.5 (logit - y)^2."""

    def client_loss(self, ctx, x, y, features, logits):
        terms = super().client_loss(ctx, x, y, features, logits)
        terms[TASK] = 0.5 * ((logits - y) ** 2).sum()
        return terms


def local_run(method, model, c, c_i, lr, momentum, steps, x, y):
    """The engine's client loop for one client (see Simulation.train_client)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    ctx = ClientContext(
        cid=0, round=1, model=model, optimizer=opt, global_params=sd(*model_wb(model)),
        broadcast={"c": c}, state={} if c_i is None else {"c": c_i}, n_samples=1, lr=lr,
        local_epochs=1, batch_size=1,
    )  # fmt: skip
    method.client_begin(ctx)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        method.client_step(ctx, x, y)
        method.client_grad(ctx)
        opt.step()
        ctx.steps += 1
    return method.client_end(ctx), ctx


def model_wb(model):
    return model.head.weight.item(), model.head.bias.item()


def test_two_steps_control_variates_hand_computed():
    method = Quadratic(Scaffold.Params(), INFO)
    model = tiny_model(1.0, 0.0)  # x = w_g = [1, 0]
    c, c_i = torch.tensor([0.5, 0.0]), torch.tensor([0.0, 0.5])  # c - c_i = [0.5, -0.5]
    x_in, y = torch.tensor([[1.0]]), torch.tensor([[0.0]])
    up, ctx = local_run(method, model, c, c_i, lr=0.5, momentum=0.0, steps=2, x=x_in, y=y)
    # step 1: logit = 1, g = [1, 1], g - c_i + c = [1.5, 0.5]
    #         y = [1, 0] - 0.5*[1.5, 0.5] = [0.25, -0.25]
    # step 2: logit = 0.25 - 0.25 = 0, g = [0, 0], g - c_i + c = [0.5, -0.5]
    #         y = [0.25, -0.25] - 0.5*[0.5, -0.5] = [0, 0]
    assert model_wb(model) == (0.0, 0.0)
    assert up.steps == ctx.steps == 2
    # c_i+ = c_i - c + (x - y)/(K eta_l) = [0, 0.5] - [0.5, 0] + [1, 0]/(2*0.5) = [0.5, 0.5]
    torch.testing.assert_close(ctx.state["c"], torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(up.extras["delta_c"], torch.tensor([0.5, 0.0]))  # c_i+ - c_i


def test_control_variates_start_at_zero():
    method = Quadratic(Scaffold.Params(), INFO)
    server = ServerContext(0, sd(1.0, 2.0), tiny_model(1.0, 2.0), CPU, None)
    method.server_init(server)
    assert torch.equal(server.state["c"], torch.zeros(2))
    c = method.server_broadcast(server)["c"]
    up, ctx = local_run(method, tiny_model(1.0, 2.0), c, None, 0.5, 0.0, 1,
                        torch.tensor([[1.0]]), torch.tensor([[0.0]]))  # fmt: skip
    # c_i created at 0; one plain step: x - y = 0.5 * g with g = [3, 3] -> c_i+ = g = [3, 3]
    torch.testing.assert_close(ctx.state["c"], torch.tensor([3.0, 3.0]))
    torch.testing.assert_close(up.extras["delta_c"], torch.tensor([3.0, 3.0]))


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_server_updates_hand_computed(weighting):
    method = Scaffold(Scaffold.Params(server_lr=0.5, weighting=weighting), INFO)
    server = ServerContext(1, sd(4.0, 0.0), tiny_model(4.0, 0.0), CPU, None)
    method.server_init(server)
    server.state["c"] = torch.tensor([1.0, 1.0])
    uploads = [
        Upload(0, 1, sd(2.0, 2.0), 2, {"delta_c": torch.tensor([1.0, 2.0])}),  # n = 1
        Upload(3, 3, sd(0.0, 4.0), 2, {"delta_c": torch.tensor([3.0, 4.0])}),  # n = 3
    ]
    old_c = server.state["c"]
    method.server_aggregate(server, uploads)  # the weights, then c
    new = server.global_params
    if weighting == "uniform":
        # mean (y_i - x) = ([-2, 2] + [-4, 4]) / 2 = [-3, 3]; x + 0.5 * [-3, 3] = [2.5, 1.5]
        exp = (2.5, 1.5)
    else:
        # 0.25*[-2, 2] + 0.75*[-4, 4] = [-3.5, 3.5]; x + 0.5 * [-3.5, 3.5] = [2.25, 1.75]
        exp = (2.25, 1.75)
    torch.testing.assert_close(new["head.weight"], torch.tensor([[exp[0]]]))
    torch.testing.assert_close(new["head.bias"], torch.tensor([exp[1]]))
    # c + |S|/N * mean dc = [1, 1] + (2/4) * [2, 3] = [2, 2.5]  (never weighted by n_k)
    torch.testing.assert_close(server.state["c"], torch.tensor([2.0, 2.5]))
    assert torch.equal(old_c, torch.tensor([1.0, 1.0]))  # the broadcast tensor is not mutated


@pytest.mark.parametrize("divisor", ["steps", "effective_steps"])
def test_momentum_divisor(divisor):
    """Constant gradient g = [1, 1] (loss = logit, x = 1), 3 steps with momentum 0.9: the
    weights move by eta_l * a * g with a = 5.61 (FedNova's effective steps), not eta_l * 3 * g."""

    class Linear(Scaffold):
        def client_loss(self, ctx, x, y, features, logits):
            terms = super().client_loss(ctx, x, y, features, logits)
            terms[TASK] = logits.sum()
            return terms

    method = Linear(Scaffold.Params(divisor=divisor), INFO)
    model = tiny_model(0.0, 0.0)
    up, ctx = local_run(method, model, torch.zeros(2), None, 0.1, 0.9, 3,
                        torch.tensor([[1.0]]), torch.tensor([[0.0]]))  # fmt: skip
    a = effective_steps(3, 0.9)
    assert a == pytest.approx(5.61)
    torch.testing.assert_close(torch.tensor(model_wb(model)), torch.full((2,), -0.1 * a))
    # steps: c_i+ = 0.1*a*g / (3*0.1) = (5.61/3) g (over-estimate); effective_steps: exactly g
    expected = 1.0 if divisor == "effective_steps" else a / 3
    torch.testing.assert_close(ctx.state["c"], torch.full((2,), expected))


def test_first_round_equals_fedavg(make_run_config):
    # iid: 4 clients x 30 samples, so FedAvg's n_k weights are uniform too
    kw = dict(rounds=1, local_epochs=2, eval_local_models=False,
              optimizer={"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4})  # fmt: skip
    avg = Simulation(make_run_config(method="fedavg", **kw), device=CPU)
    sc = Simulation(make_run_config(method="scaffold", **kw), device=CPU)
    sc.server.broadcast = sc.method.server_broadcast(sc.server)  # c = 0, as run_round would send
    for cid in range(4):  # with c = c_i = 0 the local updates are FedAvg's, bit for bit
        up_avg, loss_avg, _ = avg.trainer.train_client(cid, 1, 0.1)
        up_sc, loss_sc, _ = sc.trainer.train_client(cid, 1, 0.1)
        assert loss_avg == loss_sc
        for k in up_avg.params:
            assert torch.equal(up_avg.params[k], up_sc.params[k]), (cid, k)
    # the aggregate is x + mean(y_i - x) (uniform) vs sum_k n_k/n y_k: equal up to rounding here
    avg, _ = run(make_run_config(method="fedavg", **kw))
    sc, _ = run(make_run_config(method="scaffold", **kw))
    for k in avg.global_params:
        torch.testing.assert_close(sc.global_params[k], avg.global_params[k], rtol=0, atol=1e-6)
    assert sc.server.state["c"].abs().sum() > 0  # and c has moved for round 2


def test_short_run_finite(make_run_config):
    cfg = make_run_config(
        method="scaffold", rounds=3, sample_rate=0.5,
        partition=PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=5),
    )  # fmt: skip
    sim, rows = run(cfg)
    assert all(math.isfinite(r["global_model_test_acc"]) for r in rows)
    assert all(r["scaffold_c_norm"] > 0 for r in rows[1:])
    assert all("c" in s for s in sim.client_state.values())


def test_adam_rejected(make_run_config):
    with pytest.raises(FedForgetError, match="train.optimizer.name='sgd'"):
        Simulation(make_run_config(method="scaffold", optimizer={"name": "adam"}), device=CPU)


def test_defaults():
    assert check_params("scaffold", {}) == {
        "server_lr": 1.0,
        "weighting": "uniform",
        "divisor": "effective_steps",
    }


@pytest.mark.parametrize(
    "params,field",
    [({"server_lr": 0}, "server_lr=0"), ({"server_lr": float("inf")}, "server_lr=inf"),
     ({"weighting": "n"}, "weighting='n'"), ({"divisor": "K"}, "divisor='K'")],
)  # fmt: skip
def test_bad_params_rejected_at_parse(minimal_config, params, field):
    minimal_config["experiments"][0]["methods"] = [{"name": "scaffold", "params": params}]
    with pytest.raises(FedForgetError) as ei:
        parse_config(minimal_config)
    msg = str(ei.value)
    assert "methods[0].params" in msg and "scaffold" in msg and field in msg
