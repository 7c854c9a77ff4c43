"""MOON: l_con on hand-chosen vectors, mu = 0 is FedAvg, the first participation trains as
FedAvg, the stored previous model is the client's upload and is what the next round
contrasts against, first_prev = init uses w^0, config validation, a short run."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from fedforget.config import TrainSpec
from fedforget.methods import ClientContext, RunInfo, ServerContext, make_params
from fedforget.methods.moon import (
    MOON,
    flatten_state,
    model_contrastive_loss,
    unflatten_state,
)
from fedforget.models import build_model
from fedforget.parse import parse_config
from fedforget.utils import FedForgetError

from .conftest import run_method

CPU = torch.device("cpu")


def test_l_con_hand_computed():
    # row 1: z = (1,2,2), |z| = 3; z_glob = (2,1,-2), |.| = 3, z.z_glob = 2+2-4 = 0 -> sim 0;
    #        z_prev = (0,3,4), |.| = 5, z.z_prev = 0+6+8 = 14 -> sim 14/15.
    #        tau = 0.5: logits [0, 28/15]; l = -log(1/(1+e^{28/15})) = log(1 + e^{28/15})
    # row 2: z = (1,0,0), z_glob = (2,0,0) -> sim 1, z_prev = (0,1,0) -> sim 0;
    #        logits [2, 0]; l = -log(e^2/(e^2+1)) = log(1 + e^{-2})
    z = torch.tensor([[1.0, 2, 2], [1, 0, 0]])
    z_glob = torch.tensor([[2.0, 1, -2], [2, 0, 0]])
    z_prev = torch.tensor([[0.0, 3, 4], [0, 1, 0]])
    want = (math.log1p(math.exp(28 / 15)) + math.log1p(math.exp(-2))) / 2  # batch mean
    got = model_contrastive_loss(z[None], z_glob[None], z_prev[None], tau=0.5)  # one client: a stack of one
    assert float(got[0]) == pytest.approx(want, rel=1e-6)
    # z_prev = z_glob: l_con = log 2 whatever z is (why "global as prev" = no gradient)
    same = model_contrastive_loss(z[None], z_glob[None], z_glob[None], tau=0.5)
    assert float(same[0]) == pytest.approx(math.log(2), rel=1e-6)
    # a stack of two: the second client holds the first row and a padding row (masked out)
    two = model_contrastive_loss(torch.stack([z, z]), torch.stack([z_glob, z_glob]), torch.stack([z_prev, z_prev]),
                                 tau=0.5, mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]))  # fmt: skip
    torch.testing.assert_close(two, torch.tensor([want, math.log1p(math.exp(28 / 15))]))


def tiny(params, seed=0):
    torch.manual_seed(seed)
    model = build_model("mlp", (4,), 3, {"hidden": [5]})
    method = MOON(make_params("moon", params), RunInfo(CPU, 3, 0, 4, TrainSpec()))
    return method, model


def make_ctx(model, state, rnd=1):
    glob = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return ClientContext(0, rnd, model, opt, glob, {}, state, 8, 0.1, 1, 8)


def local_steps(method, ctx, x, y, n=3):
    for _ in range(n):
        ctx.optimizer.zero_grad(set_to_none=True)
        method.client_step(ctx, x, y)
        ctx.optimizer.step()
        ctx.steps += 1


def test_prev_model_is_the_upload_and_is_contrasted_next_round():
    method, model = tiny({"mu": 2.0, "tau": 0.5})
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    state: dict = {}
    ctx = make_ctx(model, state)
    method.client_begin(ctx)
    assert list(method.client_loss(ctx, x, y, *model.forward_with_features(x))) == ["task"]  # no prev yet
    local_steps(method, ctx, x, y)
    up = method.client_end(ctx)
    stored = unflatten_state(state["prev"], up.params)
    assert stored.keys() == up.params.keys()
    for k, v in up.params.items():
        assert torch.equal(stored[k], v), k
    assert "l_con" not in ctx.stats  # skipped, so not reported

    # next round: a different global model; the client contrasts against its upload
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ctx2 = make_ctx(model, state, rnd=2)
    method.client_begin(ctx2)
    for k, v in method.scratch(ctx2).prev.state_dict().items():
        assert torch.equal(v, up.params[k]), k
    for k, v in method.scratch(ctx2).glob.state_dict().items():
        assert torch.equal(v, ctx2.global_params[k]), k
    with torch.no_grad():  # move the local model off the global one
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    feats, logits = model.forward_with_features(x)
    got = method.client_loss(ctx2, x, y, feats, logits)["contrastive"]
    # independent reference: fresh models loaded from the two state dicts
    g, prev = copy.deepcopy(model), copy.deepcopy(model)
    g.load_state_dict(ctx2.global_params)
    prev.load_state_dict(up.params)
    want = 2.0 * model_contrastive_loss(feats[None], g.features(x)[None], prev.features(x)[None], 0.5)[0]
    torch.testing.assert_close(got, want)
    got.backward()  # the frozen copies take no gradient
    assert all(p.grad is None for p in method.scratch(ctx2).glob.parameters())
    assert all(p.grad is None for p in method.scratch(ctx2).prev.parameters())


def test_first_prev_init_contrasts_against_initial_global():
    method, model = tiny({"first_prev": "init"})
    w0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    method.server_init(ServerContext(0, w0, copy.deepcopy(model), CPU, None))
    with torch.no_grad():  # the global model of a later round differs from w^0
        for p in model.parameters():
            p.mul_(1.5)
    ctx = make_ctx(model, {}, rnd=3)
    method.client_begin(ctx)
    assert method.scratch(ctx).active
    for k, v in method.scratch(ctx).prev.state_dict().items():
        assert torch.equal(v, w0[k]), k


TRAIN = dict(local_epochs=2, sample_rate=0.5, optimizer={"lr": 0.1, "momentum": 0.9})


def test_mu_zero_is_fedavg_bit_exact(make_run_config):
    ref, _ = run_method(make_run_config, "fedavg", {}, rounds=3, **TRAIN)
    sim, _ = run_method(make_run_config, "moon", {"mu": 0.0}, rounds=3, **TRAIN)
    for k, v in ref.global_params.items():
        assert torch.equal(sim.global_params[k], v), k
    assert all("prev" not in s for s in sim.client_state.values())  # nothing stored


def test_first_participation_is_fedavg_later_rounds_are_not(make_run_config):
    # round 1: every client is new, l_con is skipped -> FedAvg exactly
    ref, _ = run_method(make_run_config, "fedavg", {}, rounds=1, **TRAIN)
    sim, _ = run_method(make_run_config, "moon", {"mu": 1.0}, rounds=1, **TRAIN)
    for k, v in ref.global_params.items():
        assert torch.equal(sim.global_params[k], v), k
    # all clients every round: round 2 contrasts against round 1's uploads
    ref, _ = run_method(make_run_config, "fedavg", {}, rounds=2, local_epochs=2)
    sim, rows = run_method(make_run_config, "moon", {"mu": 1.0}, rounds=2, local_epochs=2)
    assert any(not torch.equal(sim.global_params[k], v) for k, v in ref.global_params.items())
    assert "moon_l_con" not in rows[1] and math.isfinite(rows[2]["moon_l_con"])


@pytest.mark.parametrize(
    "params,field",
    [({"mu": -1}, "mu"), ({"mu": float("inf")}, "mu"), ({"tau": 0}, "tau"),
     ({"tau": -0.5}, "tau"), ({"tau": "hot"}, "tau"), ({"first_prev": "global"}, "first_prev"),
     ({"temperature": 1}, "temperature")],
)  # fmt: skip
def test_bad_params_rejected(minimal_config, params, field):
    minimal_config["experiments"][0]["methods"] = [{"name": "moon", "params": params}]
    with pytest.raises(FedForgetError) as ei:
        parse_config(minimal_config)
    assert field in str(ei.value) and "moon" in str(ei.value)


def test_defaults(minimal_config):
    minimal_config["experiments"][0]["methods"] = [{"name": "moon"}]
    (rc,) = parse_config(minimal_config).runs()
    assert rc.method.params == {"mu": 1.0, "tau": 0.5, "first_prev": "skip"}


@pytest.mark.parametrize("first_prev", ["skip", "init"])
def test_short_run_finite(make_run_config, first_prev):
    params = {"first_prev": first_prev}
    sim, rows = run_method(
        make_run_config, "moon", params, dataset="digits", rounds=3, batch_size=32
    )
    assert all(math.isfinite(r["global_model_test_acc"]) for r in rows)
    assert rows[-1]["global_model_test_acc"] > rows[0]["global_model_test_acc"]
    assert math.isfinite(rows[-1]["moon_l_con"])
    flat = flatten_state(sim.global_params)
    assert all(s["prev"].shape == flat.shape for s in sim.client_state.values())
