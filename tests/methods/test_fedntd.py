"""FedNTD: the not-true KL on hand logits, the true class left out of both models, the
tau^2 scaling, the method's loss uses the global model frozen at client_begin, beta = 0 is
FedAvg, config validation, a short run."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from fedforget.config import TrainSpec
from fedforget.methods import ClientContext, RunInfo, make_params
from fedforget.methods.fedntd import FedNTD, not_true_logits, ntd_loss
from fedforget.models import build_model
from fedforget.parse import parse_config
from fedforget.utils import FedForgetError

from .conftest import run_method

CPU = torch.device("cpu")


def test_not_true_logits_drops_the_label_column():
    z = torch.tensor([[0.0, 1, 2, 3], [10, 11, 12, 13], [20, 21, 22, 23]])
    got = not_true_logits(z, torch.tensor([0, 2, 3]))
    assert torch.equal(got, torch.tensor([[1.0, 2, 3], [10, 11, 13], [20, 21, 22]]))


# 3 classes. Sample 1, y = 0: local [5, 0, 0] -> not-true [0, 0] -> q~l = [1/2, 1/2];
#   global [-3, 0, ln 3] -> not-true [0, ln 3] -> q~g = [1/4, 3/4];
#   KL(q~g || q~l) = 1/4 ln((1/4)/(1/2)) + 3/4 ln((3/4)/(1/2)) = 1/4 ln(1/2) + 3/4 ln(3/2).
# Sample 2, y = 2: local [ln 2, 0, 7] -> q~l = [2/3, 1/3]; global [0, 0, -1] -> q~g = [1/2, 1/2];
#   KL = 1/2 ln((1/2)/(2/3)) + 1/2 ln((1/2)/(1/3)) = 1/2 ln(3/4) + 1/2 ln(3/2).
LOCAL = torch.tensor([[5.0, 0, 0], [math.log(2), 0, 7]])
GLOBAL = torch.tensor([[-3.0, 0, math.log(3)], [0, 0, -1]])
Y = torch.tensor([0, 2])
KL1 = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
KL2 = 0.5 * math.log(0.75) + 0.5 * math.log(1.5)


def one(local, glob, y, tau):
    """``ntd_loss`` (written for a stack of clients) of one client's batch: a stack of one."""
    return ntd_loss(local[None], glob[None], y[None], tau)[0]


def test_ntd_loss_hand_computed():
    got = one(LOCAL, GLOBAL, Y, tau=1.0)
    assert float(got) == pytest.approx((KL1 + KL2) / 2, rel=1e-6)  # batch mean
    assert float(one(LOCAL[:1], GLOBAL[:1], Y[:1], tau=1.0)) == pytest.approx(KL1, rel=1e-6)
    # a stack of two clients: the second holds sample 1 and a padding row (masked out)
    stack = ntd_loss(torch.stack([LOCAL, LOCAL]), torch.stack([GLOBAL, GLOBAL]), torch.stack([Y, Y]), 1.0,
                     mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]))  # fmt: skip
    torch.testing.assert_close(stack, torch.tensor([(KL1 + KL2) / 2, KL1]))


def test_tau_squared_scaling():
    # logits x2 with tau = 2 give the same q~, so the loss is tau^2 = 4 times the KL
    got = one(2 * LOCAL, 2 * GLOBAL, Y, tau=2.0)
    assert float(got) == pytest.approx(4 * (KL1 + KL2) / 2, rel=1e-6)


def test_true_class_left_out_of_both_models():
    torch.manual_seed(0)
    local, glob = torch.randn(6, 5), torch.randn(6, 5)
    y = torch.tensor([0, 1, 2, 3, 4, 2])
    base = one(local, glob, y, tau=1.5)
    rows = torch.arange(6)
    for target in (local, glob):
        moved = target.clone()
        moved[rows, y] += torch.tensor([9.0, -7, 3, 100, -50, 0.5])
        args = (moved, glob) if target is local else (local, moved)
        assert torch.equal(one(*args, y, tau=1.5), base)
    # and no gradient reaches a true-class logit
    local = local.requires_grad_()
    one(local, glob, y, tau=1.5).backward()
    assert torch.all(local.grad[rows, y] == 0)
    assert local.grad.abs().sum() > 0
    # a one-class-left problem (C = 2) has nothing to distil
    assert (
        float(one(torch.randn(4, 2), torch.randn(4, 2), torch.tensor([0, 1, 1, 0]), 1.0)) == 0
    )


def test_method_distils_the_global_model_frozen_at_client_begin():
    torch.manual_seed(0)
    model = build_model("mlp", (4,), 3, {"hidden": [5]})
    method = FedNTD(
        make_params("fedntd", {"beta": 0.7, "tau": 2.0}), RunInfo(CPU, 3, 0, 4, TrainSpec())
    )
    glob = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx = ClientContext(0, 1, model, opt, glob, {}, {}, 8, 0.1, 1, 8)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    method.client_begin(ctx)
    feats, logits = model.forward_with_features(x)
    assert float(method.client_loss(ctx, x, y, feats, logits)["ntd"].detach()) == pytest.approx(0, abs=1e-7)
    with torch.no_grad():  # local training moves the model
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    feats, logits = model.forward_with_features(x)
    got = method.client_loss(ctx, x, y, feats, logits)["ntd"]
    g = copy.deepcopy(model)
    g.load_state_dict(glob)
    want = (
        0.7
        * 4.0
        * F.kl_div(
            F.log_softmax(not_true_logits(logits, y) / 2, 1),
            F.softmax(not_true_logits(g(x), y) / 2, 1),
            reduction="batchmean",
        )
    )
    torch.testing.assert_close(got, want)
    assert float(got.detach()) > 0
    got.backward()
    assert all(p.grad is None for p in method.scratch(ctx).glob.parameters())
    method.client_end(ctx)
    assert ctx.stats["l_ntd"] > 0


def test_the_frozen_global_model_scores_by_the_head_the_client_trains():
    """Per-task heads: the frozen copy, made at the first client's task, scores a later
    client's rows by that client's head (it scored by task 0's before 2026-12-06), its
    heads still frozen."""
    torch.manual_seed(0)
    model = build_model("mlp", (4,), 6, {"hidden": [5]})
    model.use_task_heads([[0, 1], [2, 3], [4, 5]])
    method = FedNTD(make_params("fedntd", {"beta": 1.0}), RunInfo(CPU, 6, 0, 4, TrainSpec()))
    glob = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x, frozen = torch.randn(8, 4), {}  # the trainer's frozen copies, shared by its clients
    for task in (0, 2, 1):
        model.set_task(task)
        ctx = ClientContext(task, 1, model, None, glob, {}, {}, 8, 0.1, 1, 8, task=task, frozen=frozen)
        method.client_begin(ctx)
        g = method.scratch(ctx).glob
        assert g.head.active == task and not any(p.requires_grad for p in g.parameters())
        torch.testing.assert_close(g(x), model.head.heads[task](model.body(x)), rtol=0, atol=0)


def test_beta_zero_is_fedavg_bit_exact(make_run_config):
    train = dict(rounds=2, local_epochs=2, sample_rate=0.5, optimizer={"lr": 0.1, "momentum": 0.9})
    ref, _ = run_method(make_run_config, "fedavg", {}, **train)
    sim, _ = run_method(make_run_config, "fedntd", {"beta": 0.0}, **train)
    for k, v in ref.global_params.items():
        assert torch.equal(sim.global_params[k], v), k
    other, _ = run_method(make_run_config, "fedntd", {"beta": 1.0}, **train)
    assert any(not torch.equal(other.global_params[k], v) for k, v in ref.global_params.items())


@pytest.mark.parametrize(
    "params,field",
    [({"beta": -1}, "beta"), ({"beta": float("nan")}, "beta"), ({"tau": 0}, "tau"),
     ({"tau": True}, "tau"), ({"mu": 1}, "mu")],
)  # fmt: skip
def test_bad_params_rejected(minimal_config, params, field):
    minimal_config["experiments"][0]["methods"] = [{"name": "fedntd", "params": params}]
    with pytest.raises(FedForgetError) as ei:
        parse_config(minimal_config)
    assert field in str(ei.value) and "fedntd" in str(ei.value)


def test_defaults(minimal_config):
    minimal_config["experiments"][0]["methods"] = [{"name": "fedntd"}]
    (rc,) = parse_config(minimal_config).runs()
    assert rc.method.params == {"beta": 1.0, "tau": 1.0}


def test_short_run_finite(make_run_config):
    _, rows = run_method(make_run_config, "fedntd", {}, dataset="digits", rounds=3, batch_size=32)
    assert all(math.isfinite(r["global_model_test_acc"]) for r in rows)
    assert rows[-1]["global_model_test_acc"] > rows[0]["global_model_test_acc"]
    assert all(math.isfinite(r["fedntd_l_ntd"]) for r in rows[1:])
