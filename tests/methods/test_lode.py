"""Tar+LODE (methods/lode.py): LODE's inter-task loss against the two-way cross-entropy of
its code, the weight beta = rho |N| / |O| (the code's rho / t on equal tasks), the term a
client adds to TARGET's against hand values with one shared head and with one head per task
(the old classes scored by their own heads, ``TaskHeads.combined``), rho = 0 is TARGET bit
for bit, the stacked trainer equals the sequential one, and the refused settings."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedforget.config import TrainSpec
from fedforget.data.scenario import Scenario, resolve_scenario
from fedforget.methods import METHODS, ClientContext, RunInfo, check_params, make_params
from fedforget.methods.base import STEP_TERMS, TASK
from fedforget.methods.lode import LODE, TargetLODE, inter_task_loss
from fedforget.models import Classifier
from fedforget.partition import PartitionSpec
from fedforget.utils import FedForgetError

from .conftest import CPU, SMALL_CNN, SPLIT, run, strip
from .test_target import TINY, same_engines


def split_info(tasks=3, per_task=2):
    n = tasks * per_task
    spec = resolve_scenario({"kind": "split", "tasks": tasks, "classes_per_task": per_task}, n, (5,), "s")
    return RunInfo(CPU, n, 0, 2, TrainSpec(), Scenario.build(spec, n, (5,), tasks), (5,))


def client(model, task, method):
    ctx = ClientContext(
        cid=0, round=1, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        global_params={k: v.detach().clone() for k, v in model.state_dict().items()}, broadcast={}, state={},
        n_samples=8, lr=0.1, local_epochs=1, batch_size=4, task=task,
    )  # fmt: skip
    method.client_begin(ctx)
    return ctx


def test_inter_task_loss_is_the_two_way_cross_entropy_at_the_new_side():
    """[C lode_er.py inter_cls] CE([lse(z[O]), lse(z[N])], 1), the mean over rows; with a
    mask, each stack entry's mean over its real rows; classes outside O u N play no part."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 5, 7, generator=g) * 3
    old = torch.tensor([[1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    new = torch.tensor([[0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 1, 1, 0]], dtype=torch.bool)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float)
    got = inter_task_loss(z, old, new, mask)
    for j, n in enumerate([3, 5]):
        two = torch.stack([torch.logsumexp(z[j, :n][:, old[j]], 1), torch.logsumexp(z[j, :n][:, new[j]], 1)], 1)
        want = F.cross_entropy(two, torch.ones(n, dtype=torch.long))
        assert math.isclose(float(got[j]), float(want), rel_tol=1e-6)
        # = -log of the new classes' share of the softmax over O u N
        p = torch.softmax(z[j, :n][:, old[j] | new[j]], 1)[:, -int(new[j].sum()) :].sum(1)
        assert math.isclose(float(got[j]), float(-p.log().mean()), rel_tol=1e-5)
    z2 = z.clone()
    z2[..., 6] += 50.0  # a class of neither set
    torch.testing.assert_close(inter_task_loss(z2, old, new, mask), got)
    torch.testing.assert_close(inter_task_loss(z[1:], old[1:], new[1:]), got[1:])


def test_beta_is_rho_times_new_over_old_classes_the_codes_rho_over_t():
    info = split_info(tasks=3)
    method = TargetLODE(make_params("target_lode", {"rho": 0.3}), info)
    model = Classifier(nn.Identity(), 5, 6)
    assert method.decoupling(client(model, 0, method)) is None  # task 0: TARGET's CE alone [C]
    for t in (1, 2):
        spec = method.decoupling(client(model, t, method))
        assert math.isclose(spec.beta, 0.3 / t)  # [C] rho / self.task on equal tasks
        assert spec.new.nonzero().flatten().tolist() == info.scenario.task_classes[t]
        assert sorted(spec.old.nonzero().flatten().tolist()) == sorted(
            c for s in range(t) for c in info.scenario.task_classes[s]
        )
    assert TargetLODE(make_params("target_lode", {"rho": 0.0}), info).decoupling(client(model, 2, method)) is None


@pytest.mark.parametrize("heads", ["shared", "per_task"])
def test_client_loss_adds_beta_times_the_inter_term_of_the_scored_logits(heads):
    """A client of task 2 adds beta * L_inter to TARGET's terms: with one head, of its logits;
    with one head per task, of the combined logits (each old class by its own frozen head,
    the new ones by the active head), the scores the task-agnostic prediction reads."""
    info = split_info(tasks=3)
    method = TargetLODE(make_params("target_lode", {"rho": 0.5}), info)
    torch.manual_seed(1)
    model = Classifier(nn.Sequential(nn.Linear(5, 4), nn.Tanh()), 4, 6)
    if heads == "per_task":
        model.use_task_heads(info.scenario.task_classes)
        model.set_task(2)
    ctx = client(model, 2, method)
    x, y = torch.randn(8, 5), torch.tensor([4, 5, 4, 5, 5, 4, 4, 5])
    features, logits = model.forward_with_features(x)
    terms = method.client_loss(ctx, x, y, features, logits)
    assert list(terms)[:1] == [TASK] and STEP_TERMS not in terms  # no pool: no KD
    z = model.head.combined(features) if heads == "per_task" else logits
    old, new = [0, 1, 2, 3], [4, 5]
    hand = (torch.logsumexp(z[:, old + new], 1) - torch.logsumexp(z[:, new], 1)).mean()
    assert math.isclose(float(terms[LODE].detach()), 0.5 * 2 / 4 * float(hand.detach()), rel_tol=1e-5)
    # the old heads get no gradient (frozen), the body and the new head do
    terms[LODE].backward()
    if heads == "per_task":
        assert all(h.weight.grad is None for h in model.head.heads[:2])
        assert model.head.heads[2].weight.grad.abs().sum() > 0
    assert model.body[0].weight.grad.abs().sum() > 0


def stream(make_run_config, method, params, heads="shared", model="mlp", **train):
    return make_run_config(
        dataset="digits", model=model, model_options=SMALL_CNN if model == "cnn2d" else None, method=method,
        params=params, scenario={**SPLIT, "incremental": "class", "heads": heads},
        partition=PartitionSpec("dirichlet", clients=5, alpha=0.5, min_size=5, seed=0),
        **{"rounds": 3, "batch_size": 32, "local_epochs": 2, "sample_rate": 0.75, "eval_local_models": False,
           "eval_every": 1, "optimizer": {"lr": 0.05, "momentum": 0.9}, "device": "cpu", **train},
    )  # fmt: skip


def test_rho_zero_is_target_and_rho_changes_the_run(make_run_config):
    _, rows_t = run(stream(make_run_config, "target", TINY, client_engine="sequential"))
    _, rows_0 = run(stream(make_run_config, "target_lode", {**TINY, "rho": 0.0}, client_engine="sequential"))
    rename = [{k.replace("target_lode_", "target_"): v for k, v in r.items()} for r in strip(rows_0)]
    assert rename == strip(rows_t)
    _, rows_1 = run(stream(make_run_config, "target_lode", {**TINY, "rho": 1.0}, client_engine="sequential"))
    assert rows_1[-1]["target_lode_inter"] > 0 and "target_lode_inter" not in rows_1[0]  # from task 1
    assert strip(rows_1, "target")[-1] != strip(rows_t, "target")[-1]  # other weights, other test metrics


@pytest.mark.parametrize(
    "model,heads",
    [("mlp", "shared"),  # every step batched (stacked_forward)
     ("cnn2d", "per_task")],  # the old classes by their own frozen heads; replicas and tails
)  # fmt: skip
def test_trains_stacked_as_sequential(make_run_config, run_engines, assert_same_metrics, model, heads):
    """Issue 32: L_inter as live terms of a stack (each client's mean over its real rows),
    beside TARGET's KD step terms, within 1e-5 of one client after another."""
    rc = stream(make_run_config, "target_lode", {**TINY, "rho": 1.0}, heads=heads, model=model)
    _, rows_s, _ = same_engines(run_engines(rc), assert_same_metrics, False)
    assert rows_s[-1]["target_lode_inter"] > 0 and rows_s[-1]["target_lode_kd"] > 0


@pytest.mark.parametrize(
    "params,match", [({"ce": "all"}, "ce='all'"), ({"rho": -0.1}, "rho=-0.1"), ({"lode": 1}, "unknown")]
)
def test_bad_params_name_the_value(params, match):
    with pytest.raises(FedForgetError, match=match):
        check_params("target_lode", params)


def test_domain_streams_and_asynchronous_boundaries_are_refused_before_any_job():
    cls = METHODS.get("target_lode")
    with pytest.raises(FedForgetError, match="scenario.kind='rotated'"):
        cls.check_scenario({"kind": "rotated", "tasks": 2})
    cls.check_scenario({"kind": "split", "tasks": 2})
    cls.check_scenario(None)
    with pytest.raises(FedForgetError, match=r"method 'target_lode'.*scenario.boundaries=.*allowed: sync"):
        cls.check_scenario({"kind": "split", "tasks": 2, "boundaries": {"samples_per_window": 5, "window_rounds": 1}})


def test_defaults():
    p = check_params("target_lode", {})  # rho: FedProTIP's code, 0.01 / task on equal tasks
    assert p["rho"] == 0.01 and p == {**check_params("target", {}), "rho": 0.01}
