"""FedSAM: eps* = rho g/||g|| has norm rho, the step uses the gradient at w + eps*, w is
restored bit-exactly, rho = 0 is FedAvg, config validation, a short run."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from fedforget.config import TrainSpec
from fedforget.engine import Simulation
from fedforget.methods import ClientContext, RunInfo, make_params
from fedforget.methods.fedsam import FedSAM
from fedforget.models import build_model
from fedforget.parse import parse_config
from fedforget.utils import FedForgetError

CPU = torch.device("cpu")


def tiny_setup(method_cls, params, seed=0):
    """A 4-5-3 MLP, one minibatch of 8 and a ClientContext around them."""
    torch.manual_seed(seed)
    model = build_model("mlp", (4,), 3, {"hidden": [5]})
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    method = method_cls(make_params(method_cls.name, params), RunInfo(CPU, 3, 0, 4, TrainSpec()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx = ClientContext(0, 1, model, opt, {}, {}, {}, 8, 0.1, 1, 8)
    method.client_begin(ctx)
    return method, model, ctx, x, y


def record_eps(method):
    """Wrap method.perturbation to keep what it returns."""
    seen, orig = [], method.perturbation
    # one client's step: a stack of one; kept per client, as its own tensors
    method.perturbation = lambda ps, gs: seen.append([e[0] for e in orig(ps, gs)]) or orig(ps, gs)
    return seen


def grads_at(model, x, y, shift=None):
    """grad of CE at w (+ shift), on a deep copy: independent of the method's code."""
    m = copy.deepcopy(model)
    if shift is not None:
        with torch.no_grad():
            for p, e in zip(m.parameters(), shift):
                p.add_(e)
    m.zero_grad(set_to_none=True)
    loss = F.cross_entropy(m(x), y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in m.parameters()]


def test_perturbation_norm_is_rho_and_direction_is_g():
    method, model, ctx, x, y = tiny_setup(FedSAM, {"rho": 0.37})
    seen = record_eps(method)
    method.client_step(ctx, x, y)
    (eps,) = seen
    _, g = grads_at(model, x, y)
    norm = math.sqrt(sum(float(e.double().pow(2).sum()) for e in eps))
    assert norm == pytest.approx(0.37, rel=1e-6)  # float32 rounding only
    # eps = rho g / ||g||: same direction as g, element by element
    gnorm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in g))
    for e, gi in zip(eps, g):
        torch.testing.assert_close(e.double(), 0.37 * gi.double() / gnorm, rtol=1e-5, atol=1e-8)


def alone(method, params, grads):
    """``perturbation`` (written for a stack of clients) of one client: a stack of one."""
    return [e[0] for e in method.perturbation([p[None] for p in params], [g[None] for g in grads])]


def test_perturbation_hand_computed():
    # g = ([3, 0], [-4]): ||g|| = sqrt(9 + 0 + 16) = 5, rho = 0.5 -> eps = 0.1 g = ([0.3, 0], [-0.4])
    method, *_ = tiny_setup(FedSAM, {"rho": 0.5})
    w = [torch.tensor([1.0, -2.0]), torch.tensor([0.5])]
    eps = alone(method, w, [torch.tensor([3.0, 0.0]), torch.tensor([-4.0])])
    torch.testing.assert_close(eps[0], torch.tensor([0.3, 0.0]))
    torch.testing.assert_close(eps[1], torch.tensor([-0.4]))
    # a stack of two clients: one norm per client; the second's g = ([0, 6], [8]), norm 10
    stack = method.perturbation([torch.stack([v, v]) for v in w],
                                [torch.tensor([[3.0, 0.0], [0.0, 6.0]]), torch.tensor([[-4.0], [8.0]])])  # fmt: skip
    torch.testing.assert_close(stack[0], torch.tensor([[0.3, 0.0], [0.0, 0.3]]))
    torch.testing.assert_close(stack[1], torch.tensor([[-0.4], [0.4]]))


def test_zero_gradient_gives_zero_perturbation():
    method, *_ = tiny_setup(FedSAM, {"rho": 0.5})
    eps = alone(method, [torch.ones(3)], [torch.zeros(3)])
    assert torch.equal(eps[0], torch.zeros(3))  # the norm guard: no 0/0


def test_step_gradient_is_gradient_at_perturbed_weights_and_weights_restored():
    method, model, ctx, x, y = tiny_setup(FedSAM, {"rho": 0.5})
    w0 = {k: v.clone() for k, v in model.state_dict().items()}
    loss_w, g = grads_at(model, x, y)
    gnorm = torch.linalg.vector_norm(torch.cat([t.flatten() for t in g]))
    eps = [0.5 * t / gnorm for t in g]
    loss_adv, g_adv = grads_at(model, x, y, shift=eps)

    loss = method.client_step(ctx, x, y)

    for k, v in model.state_dict().items():
        assert torch.equal(v, w0[k]), k  # bit-exact restore
    assert torch.equal(loss, loss_w)  # the unperturbed loss is returned
    for p, ga in zip(model.parameters(), g_adv):
        torch.testing.assert_close(p.grad, ga, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(g_adv[0], g[0])  # the perturbation mattered
    assert loss_adv > loss_w  # and went uphill
    method.client_end(ctx)  # steps = 0 here: the diagnostic divides by max(steps, 1)
    assert ctx.stats["sharpness"] == pytest.approx(float(loss_adv - loss_w), rel=1e-4)


@pytest.mark.parametrize("name", ["fedsam", "fedasam"])
def test_rho_zero_is_fedavg_bit_exact(make_run_config, name):
    def run(method, params):
        rc = make_run_config(
            method=method, params=params, rounds=2, local_epochs=2, sample_rate=0.5,
            optimizer={"lr": 0.1, "momentum": 0.9},
        )  # fmt: skip
        sim = Simulation(rc, device=CPU)
        status, rows, msg = sim.run(progress=False)
        assert status == "completed", msg
        return sim, rows

    ref, ref_rows = run("fedavg", {})
    sim, rows = run(name, {"rho": 0.0})
    assert sim.global_params.keys() == ref.global_params.keys()
    for k, v in ref.global_params.items():
        assert torch.equal(sim.global_params[k], v), k
    for a, b in zip(rows, ref_rows):  # same unperturbed training loss, step for step
        assert a.get("sampled_clients_local_train_loss_mean") == b.get(
            "sampled_clients_local_train_loss_mean"
        )
    assert rows[-1][f"{name}_sharpness"] == 0.0


@pytest.mark.parametrize(
    "params,field",
    [({"rho": -0.1}, "rho"), ({"rho": float("nan")}, "rho"), ({"rho": "big"}, "rho"),
     ({"rho": True}, "rho"), ({"gamma": 1}, "gamma")],
)  # fmt: skip
def test_bad_params_rejected(minimal_config, params, field):
    minimal_config["experiments"][0]["methods"] = [{"name": "fedsam", "params": params}]
    with pytest.raises(FedForgetError) as ei:
        parse_config(minimal_config)
    assert field in str(ei.value) and "fedsam" in str(ei.value)


def test_good_params_accepted(minimal_config):
    minimal_config["experiments"][0]["methods"] = [{"name": "fedsam", "params": {"rho": 0.05}}]
    (rc,) = parse_config(minimal_config).runs()
    assert rc.method.params == {"rho": 0.05}


def test_short_run_finite(make_run_config):
    rc = make_run_config(dataset="digits", method="fedsam", rounds=2, batch_size=32)
    sim = Simulation(rc, device=CPU)
    status, rows, msg = sim.run(progress=False)
    assert status == "completed", msg
    assert math.isfinite(rows[-1]["global_model_test_acc"])
    assert all(math.isfinite(r["fedsam_sharpness"]) and r["fedsam_sharpness"] > 0 for r in rows[1:])
