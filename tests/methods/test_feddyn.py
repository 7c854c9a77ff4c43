"""FedDyn: server h update and client gradient-state update against hand values, first-round
gradient = FedProx(mu = alpha), the linear term's gradient, h = mean of the client states
over a run, hyperparameter validation, a short run."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedforget.config import TrainSpec
from fedforget.methods import ClientContext, RunInfo, ServerContext, Upload, check_params
from fedforget.methods.feddyn import FedDyn
from fedforget.methods.fedprox import FedProx
from fedforget.models import Classifier
from fedforget.parse import parse_config
from fedforget.partition import PartitionSpec
from fedforget.utils import FedForgetError

from .conftest import CPU, run

INFO = RunInfo(CPU, num_classes=1, seed=0, num_clients=4, train=TrainSpec())  # m = K = 4


def tiny_model(w, b) -> Classifier:
    """Identity body + linear head: state_dict = {head.weight: w, head.bias: b}."""
    m = Classifier(nn.Identity(), len(w[0]), len(w))
    with torch.no_grad():
        m.head.weight.copy_(torch.tensor(w))
        m.head.bias.copy_(torch.tensor(b))
    return m


def sd(w, b):
    return {"head.weight": torch.tensor(w), "head.bias": torch.tensor(b)}


def make_ctx(model, global_params, state=None):
    return ClientContext(
        cid=0, round=1, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        global_params=global_params, broadcast={}, state={} if state is None else state,
        n_samples=2, lr=0.1, local_epochs=1, batch_size=2,
    )  # fmt: skip


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_h_update_and_server_model_hand_computed(weighting):
    method = FedDyn(FedDyn.Params(alpha=0.5, weighting=weighting), INFO)
    prev = sd([[1.0]], [1.0])  # theta^{t-1}
    server = ServerContext(1, prev, tiny_model([[1.0]], [1.0]), CPU, None)
    method.server_init(server)
    assert all(torch.equal(h, torch.zeros_like(h)) for h in server.state["h"].values())
    server.state["h"] = sd([[0.5]], [-0.5])  # h^{t-1}
    uploads = [
        Upload(0, 1, sd([[2.0]], [3.0]), 2),  # client 0: n = 1
        Upload(2, 3, sd([[0.0]], [1.0]), 2),  # client 2: n = 3
    ]
    method.server_aggregate(server, uploads)
    new = server.global_params
    # weight: sum (theta_k - theta^{t-1}) = (2-1) + (0-1) = 0  -> h = 0.5 - (0.5/4)*0 = 0.5
    # bias:   sum = (3-1) + (1-1) = 2                          -> h = -0.5 - (0.5/4)*2 = -0.75
    # (h ignores the weighting: 1/m with m = all 4 clients)
    torch.testing.assert_close(server.state["h"]["head.weight"], torch.tensor([[0.5]]))
    torch.testing.assert_close(server.state["h"]["head.bias"], torch.tensor([-0.75]))
    # theta^t = mean theta_k - h/alpha
    if weighting == "uniform":
        # weight: (2+0)/2 - 0.5/0.5 = 0;  bias: (3+1)/2 + 0.75/0.5 = 3.5
        exp_w, exp_b = 0.0, 3.5
    else:
        # weight: 0.25*2 + 0.75*0 - 1 = -0.5;  bias: 0.25*3 + 0.75*1 + 1.5 = 3.0
        exp_w, exp_b = -0.5, 3.0
    torch.testing.assert_close(new["head.weight"], torch.tensor([[exp_w]]))
    torch.testing.assert_close(new["head.bias"], torch.tensor([exp_b]))


def test_client_state_update_hand_computed():
    method = FedDyn(FedDyn.Params(alpha=0.5), INFO)
    w_g = sd([[1.0, 2.0]], [0.0])
    state = {"grad": torch.tensor([1.0, 1.0, -1.0])}  # grad L_k(theta_k^{t-1}), flat [w, b]
    ctx = make_ctx(tiny_model([[1.0, 2.0]], [0.0]), w_g, state)
    method.client_begin(ctx)
    with torch.no_grad():  # "local training" ends at theta_k^t = [0, 4 | 1]
        ctx.model.head.weight.copy_(torch.tensor([[0.0, 4.0]]))
        ctx.model.head.bias.fill_(1.0)
    up = method.client_end(ctx)
    # theta_k^t - theta^{t-1} = [-1, 2 | 1]; grad <- [1, 1, -1] - 0.5 * [-1, 2, 1] = [1.5, 0, -1.5]
    torch.testing.assert_close(ctx.state["grad"], torch.tensor([1.5, 0.0, -1.5]))
    assert ctx.state["grad"] is state["grad"]  # updated in place, stays one flat tensor
    torch.testing.assert_close(up.params["head.weight"], torch.tensor([[0.0, 4.0]]))


def _grads(method, model, global_params, state=None):
    x, y = torch.tensor([[0.5, -1.0], [2.0, 0.0]]), torch.tensor([0, 1])
    ctx = make_ctx(model, global_params, state)
    model.zero_grad(set_to_none=True)
    method.client_begin(ctx)
    method.client_step(ctx, x, y)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, ctx


def test_first_round_gradient_is_fedprox_with_mu_alpha():
    w, b = [[1.0, 2.0], [3.0, 4.0]], [1.0, -1.0]
    w_g = sd([[0.5, 1.0], [1.0, -1.0]], [0.0, 0.5])  # away from w: the proximal part is non-zero
    g_dyn, ctx = _grads(FedDyn(FedDyn.Params(alpha=0.3), INFO), tiny_model(w, b), w_g)
    assert torch.equal(ctx.state["grad"], torch.zeros(6))  # state created at zero
    g_prox, _ = _grads(FedProx(FedProx.Params(mu=0.3), INFO), tiny_model(w, b), w_g)
    for n in g_prox:
        torch.testing.assert_close(g_dyn[n], g_prox[n], rtol=1e-6, atol=1e-7)


def test_linear_term_subtracts_the_state():
    w, b = [[1.0, 2.0], [3.0, 4.0]], [1.0, -1.0]
    w_g = sd([[0.5, 1.0], [1.0, -1.0]], [0.0, 0.5])
    v = torch.tensor([1.0, -2.0, 0.5, 0.25, 3.0, -1.0])  # flat [weight (row-major), bias]
    g_dyn, _ = _grads(FedDyn(FedDyn.Params(alpha=0.3), INFO), tiny_model(w, b), w_g, {"grad": v})
    g_prox, _ = _grads(FedProx(FedProx.Params(mu=0.3), INFO), tiny_model(w, b), w_g)
    # d/dw of -<v, w> is -v
    torch.testing.assert_close(g_dyn["head.weight"], g_prox["head.weight"] - v[:4].view(2, 2))
    torch.testing.assert_close(g_dyn["head.bias"], g_prox["head.bias"] - v[4:])


def test_h_is_mean_of_all_client_states_and_short_run(make_run_config):
    cfg = make_run_config(
        method="feddyn", params={"alpha": 0.1}, rounds=3, sample_rate=0.5,
        partition=PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=5),
        optimizer={"lr": 0.1, "momentum": 0.9},
    )  # fmt: skip
    sim, rows = run(cfg)
    assert all(math.isfinite(r["global_model_test_acc"]) for r in rows)
    assert rows[-1]["feddyn_h_norm"] > 0
    h = sim.server.state["h"]
    flat_h = torch.cat([t.reshape(-1) for t in h.values()])
    states = [sim.client_state.get(k, {}).get("grad") for k in range(4)]
    assert sum(s is not None for s in states) >= 2
    mean_state = sum(s for s in states if s is not None) / 4  # never-sampled clients: 0
    # h^t = (1/m) sum_k grad L_k(theta_k^t) (both start at 0, both move by -alpha * drift)
    torch.testing.assert_close(flat_h, mean_state, rtol=1e-5, atol=1e-6)


def test_defaults():
    assert check_params("feddyn", {}) == {"alpha": 0.1, "weighting": "uniform"}


@pytest.mark.parametrize(
    "params,field",
    [({"alpha": 0}, "alpha=0"), ({"alpha": -0.1}, "alpha=-0.1"),
     ({"alpha": float("nan")}, "alpha=nan"), ({"weighting": "size"}, "weighting='size'")],
)  # fmt: skip
def test_bad_params_rejected_at_parse(minimal_config, params, field):
    minimal_config["experiments"][0]["methods"] = [{"name": "feddyn", "params": params}]
    with pytest.raises(FedForgetError) as ei:
        parse_config(minimal_config)
    msg = str(ei.value)
    assert "methods[0].params" in msg and "feddyn" in msg and field in msg
