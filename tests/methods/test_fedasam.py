"""FedASAM: eps* = rho T_w^2 g / ||T_w g||, T_w = |w| + eta, checked element-wise against
hand-computed values; the step uses the gradient at w + eps*, w is restored bit-exactly,
config validation, a short run. (rho = 0 == FedAvg is in test_fedsam.py, parametrised.)"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from fedforget.config import TrainSpec
from fedforget.engine import Simulation
from fedforget.methods import ClientContext, RunInfo, make_params
from fedforget.methods.fedasam import FedASAM
from fedforget.models import build_model
from fedforget.parse import parse_config
from fedforget.utils import FedForgetError

CPU = torch.device("cpu")


def method_with(**params):
    return FedASAM(make_params("fedasam", params), RunInfo(CPU, 3, 0, 4, TrainSpec()))


W = [torch.tensor([1.0, -2.0]), torch.tensor([0.5])]


def alone(method, params, grads):
    """``perturbation`` (written for a stack of clients) of one client: a stack of one."""
    return [e[0] for e in method.perturbation([p[None] for p in params], [g[None] for g in grads])]


def test_perturbation_hand_computed_eta0():
    # w = ([1, -2], [0.5]), g = ([2, 0.5], [-4]), eta = 0, rho = 0.6
    # T_w = |w| = ([1, 2], [0.5]);  T_w g = ([2, 1], [-2]);  ||T_w g|| = sqrt(4 + 1 + 4) = 3
    # eps = rho T_w (T_w g) / 3 = 0.2 * ([1*2, 2*1], [0.5*-2]) = ([0.4, 0.4], [-0.2])
    eps = alone(method_with(rho=0.6), W, [torch.tensor([2.0, 0.5]), torch.tensor([-4.0])])
    torch.testing.assert_close(eps[0], torch.tensor([0.4, 0.4]))
    torch.testing.assert_close(eps[1], torch.tensor([-0.2]))


def test_perturbation_hand_computed_eta():
    # w = ([1, -2], [0.5]), g = ([2, 0], [4]), eta = 0.5, rho = 0.5
    # T_w = |w| + 0.5 = ([1.5, 2.5], [1]);  T_w g = ([3, 0], [4]);  ||T_w g|| = 5
    # eps = 0.5 / 5 * ([1.5*3, 2.5*0], [1*4]) = ([0.45, 0], [0.4])
    m = method_with(rho=0.5, eta=0.5)
    eps = alone(m, W, [torch.tensor([2.0, 0.0]), torch.tensor([4.0])])
    torch.testing.assert_close(eps[0], torch.tensor([0.45, 0.0]))
    torch.testing.assert_close(eps[1], torch.tensor([0.4]))
    assert torch.equal(W[0], torch.tensor([1.0, -2.0]))  # the weights are not touched
    # a stack of two: each client its own norm (the second: w = ([2, 1], [1]), g = ([1, 0], [0]):
    # T_w g = ([2.5, 0], [0]), norm 2.5 -> eps = 0.2 * ([2.5 * 2.5, 0], [0]) = ([1.25, 0], [0]))
    stack = m.perturbation([torch.stack([W[0], torch.tensor([2.0, 1.0])]), torch.tensor([[0.5], [1.0]])],
                           [torch.tensor([[2.0, 0.0], [1.0, 0.0]]), torch.tensor([[4.0], [0.0]])])  # fmt: skip
    torch.testing.assert_close(stack[0], torch.tensor([[0.45, 0.0], [1.25, 0.0]]))
    torch.testing.assert_close(stack[1], torch.tensor([[0.4], [0.0]]))


def test_zero_gradient_and_zero_weight():
    m = method_with(rho=0.5)
    eps = alone(m, [torch.ones(2)], [torch.zeros(2)])
    assert torch.equal(eps[0], torch.zeros(2))  # norm guard: no 0/0
    # eta = 0: a zero weight is not perturbed, the other takes the whole radius in T_w^-1 norm
    eps = alone(m, [torch.tensor([0.0, 2.0])], [torch.tensor([1.0, 1.0])])
    assert eps[0][0] == 0
    assert (eps[0] / torch.tensor([1.0, 2.0]))[1] == pytest.approx(0.5)  # ||T_w^-1 eps|| = rho


def test_adaptive_norm_is_rho_on_a_model():
    # ASAM's constraint: ||T_w^{-1} eps*|| = rho (here eta = 0.01, so T_w > 0 everywhere)
    torch.manual_seed(0)
    model = build_model("mlp", (4,), 3, {"hidden": [5]})
    F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,))).backward()
    ps = list(model.parameters())
    eps = alone(method_with(rho=0.8, eta=0.01), [p.detach() for p in ps], [p.grad for p in ps])
    ratio = [e.double() / (p.detach().double().abs() + 0.01) for e, p in zip(eps, ps)]
    assert math.sqrt(sum(float(r.pow(2).sum()) for r in ratio)) == pytest.approx(0.8, rel=1e-5)


@pytest.mark.parametrize("eta", [0.0, 0.01])
def test_step_gradient_is_gradient_at_perturbed_weights_and_weights_restored(eta):
    torch.manual_seed(1)
    model = build_model("mlp", (4,), 3, {"hidden": [5]})
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    method = method_with(rho=0.5, eta=eta)
    ctx = ClientContext(0, 1, model, torch.optim.SGD(model.parameters(), lr=0.1), {}, {}, {}, 8, 0.1, 1, 8)  # fmt: skip
    method.client_begin(ctx)
    w0 = {k: v.clone() for k, v in model.state_dict().items()}

    # independent reference on a copy: g at w, eps by the formula in float64, g at w + eps
    ref = copy.deepcopy(model)
    loss_w = F.cross_entropy(ref(x), y)
    loss_w.backward()
    t = [p.detach().double().abs() + eta for p in ref.parameters()]
    tg = [ti * p.grad.double() for ti, p in zip(t, ref.parameters())]
    norm = math.sqrt(sum(float(v.pow(2).sum()) for v in tg))
    eps = [(0.5 * ti * v / norm).float() for ti, v in zip(t, tg)]
    with torch.no_grad():
        for p, e in zip(ref.parameters(), eps):
            p.add_(e)
    ref.zero_grad(set_to_none=True)
    F.cross_entropy(ref(x), y).backward()

    loss = method.client_step(ctx, x, y)

    for k, v in model.state_dict().items():
        assert torch.equal(v, w0[k]), k  # bit-exact restore
    assert torch.equal(loss, loss_w.detach())
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "params,field",
    [({"rho": -1.0}, "rho"), ({"eta": -0.01}, "eta"), ({"eta": float("inf")}, "eta"),
     ({"eta": "small"}, "eta"), ({"adaptive": True}, "adaptive")],
)  # fmt: skip
def test_bad_params_rejected(minimal_config, params, field):
    minimal_config["experiments"][0]["methods"] = [{"name": "fedasam", "params": params}]
    with pytest.raises(FedForgetError) as ei:
        parse_config(minimal_config)
    assert field in str(ei.value) and "fedasam" in str(ei.value)


def test_defaults(minimal_config):
    minimal_config["experiments"][0]["methods"] = [{"name": "fedasam"}]
    (rc,) = parse_config(minimal_config).runs()
    assert make_params("fedasam", rc.method.params).__dict__ == {"rho": 0.5, "eta": 0.0}


def test_short_run_finite(make_run_config):
    rc = make_run_config(dataset="digits", method="fedasam", params={"eta": 0.01}, rounds=2)
    sim = Simulation(rc, device=CPU)
    status, rows, msg = sim.run(progress=False)
    assert status == "completed", msg
    assert math.isfinite(rows[-1]["global_model_test_acc"])
    assert all(
        math.isfinite(r["fedasam_sharpness"]) and r["fedasam_sharpness"] > 0 for r in rows[1:]
    )
