"""FL+iCaRL (methods/icarl.py): herding's order (Alg. 4) on hand-built features,
ReduceExemplarSet keeping the first m of each class (Alg. 5), the task-end exemplar update
and its feature sums, NME scores (Alg. 1) against a hand computation from clients' reports,
the loss's targets (Alg. 3) on a hand-built batch, split-digits runs (class-IL shared head,
task-IL per-task heads) scored by NME, exact resume mid-task and at a task boundary, FedGP
over iCaRL, and the streams and hyperparameters it refuses."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedforget.config import TrainSpec
from fedforget.data.scenario import Scenario, resolve_scenario
from fedforget.engine import Simulation
from fedforget.methods import ClientContext, RunInfo, ServerContext, check_params
from fedforget.methods.base import ROUND_END, TASK_END
from fedforget.methods.icarl import (
    FEATS,
    KEY,
    PREV,
    ICaRL,
    icarl_loss,
    icarl_targets,
    reduce_exemplars,
)
from fedforget.models import Classifier
from fedforget.parse import parse_config
from fedforget.utils import FedForgetError

from .conftest import (
    BN_SHORT,
    CPU,
    SMALL_CNN,
    SMALL_RESNET,
    SPLIT,
    checkpoint_keeper,
    digits_cfg,
    replay_stream_cfg,
    run,
    same,
    strip,
)


def identity_model(dim=2, classes=4):
    """features(x) = x: hand-built inputs are the features."""
    torch.manual_seed(0)
    return Classifier(nn.Identity(), dim, classes)


def info(classes=4, scenario=None, **train):
    return RunInfo(
        CPU, num_classes=classes, seed=0, num_clients=3, train=TrainSpec(**train), scenario=scenario
    )


def context(model, state, task=0, rnd=3, data=None, broadcast=None, n=4, bs=4):
    return ClientContext(
        cid=1, round=rnd, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        global_params={}, broadcast=broadcast or {}, state=state, n_samples=n, lr=0.1,
        local_epochs=1, batch_size=bs, task=task, data=data,
    )  # fmt: skip


class View:
    """A stand-in for a client's TaskView: all() -> (x, y, no mask)."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def all(self):
        return self.x, self.y


def line(values):
    """1-D features embedded in 2-D rows (v, 0)."""
    v = torch.tensor(values, dtype=torch.float32)
    return torch.stack([v, torch.zeros_like(v)], 1)


# ------------------------------------------------------------------ exemplars
def test_reduce_keeps_the_first_m_of_each_class():
    store = {
        "x": torch.arange(7.0).unsqueeze(1), "y": torch.tensor([0, 0, 0, 1, 1, 1, 1]),
        "task": torch.zeros(7, dtype=torch.long), "rank": torch.tensor([0, 1, 2, 0, 1, 2, 3]),
    }  # fmt: skip
    out = reduce_exemplars(store, 2)
    assert out["x"].squeeze(1).tolist() == [0.0, 1.0, 3.0, 4.0]
    assert out["rank"].tolist() == [0, 1, 0, 1] and out["y"].tolist() == [0, 0, 1, 1]


def test_task_ends_construct_then_reduce_and_report_feature_sums():
    """K = 6, raw features. Task 0 (classes 0, 1): m = 6 // 2 = 3, class 0's herding order
    [4, 2, 3] of the example above. Task 1 (class 2): m = 6 // 3 = 2, classes 0, 1 keep their
    first two, class 2 gets its own two. The report: per-class sums and counts."""
    method = ICaRL(ICaRL.Params(buffer_size=6, normalize=False), info())
    model, state = identity_model(), {}
    x0 = torch.cat([line([0.0, 10.0, 4.0, 6.0, 5.5]), line([-1.0, -3.0, -2.0])])
    y0 = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1])
    rep = method.client_reply(TASK_END, context(model, state, task=0, data=View(x0, y0)))
    st = state[KEY]
    assert st["x"][:3, 0].tolist() == [5.5, 4.0, 6.0]  # class 0: herding order
    assert st["x"][3:, 0].tolist() == [-2.0, -1.0, -3.0]  # class 1: mean -2 first
    assert st["rank"].tolist() == [0, 1, 2, 0, 1, 2] and st["task"].tolist() == [0] * 6
    assert st["seen"].tolist() == [True, True, False, False]
    assert rep["counts"].tolist() == [3, 3, 0, 0]
    torch.testing.assert_close(rep["sums"][:2, 0], torch.tensor([15.5, -6.0]))

    x1, y1 = line([7.0, 9.0, 8.0]), torch.tensor([2, 2, 2])
    rep = method.client_reply(TASK_END, context(model, state, task=1, data=View(x1, y1)))
    st = state[KEY]
    assert st["x"][:, 0].tolist() == [5.5, 4.0, -2.0, -1.0, 8.0, 7.0]  # 7 and 9 tie: the lower row
    assert st["y"].tolist() == [0, 0, 1, 1, 2, 2] and st["task"].tolist() == [0, 0, 0, 0, 1, 1]
    assert rep["counts"].tolist() == [2, 2, 2, 0]
    torch.testing.assert_close(rep["sums"][:3, 0], torch.tensor([9.5, -3.0, 15.0]))


def test_normalised_features_enter_herding_and_the_sums():
    """normalize: phi(x) = x / ||x||; (3, 4) and (6, 8) are the same feature."""
    method = ICaRL(ICaRL.Params(buffer_size=4), info())
    state = {}
    x = torch.tensor([[3.0, 4.0], [6.0, 8.0], [0.0, 5.0], [1.0, 0.0]])
    rep = method.client_reply(TASK_END,
        context(identity_model(), state, data=View(x, torch.zeros(4, dtype=torch.long)))
    )
    # phi = (.6,.8), (.6,.8), (0,1), (1,0); mean (.55,.65): (.6,.8) first (distance^2 .025)
    assert state[KEY]["rank"].tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(rep["sums"][0], torch.tensor([2.2, 2.6]))
    assert state[KEY]["x"][0].tolist() == [3.0, 4.0]


# ------------------------------------------------------------------ NME
def test_nme_scores_equal_the_hand_computation():
    """Reports of three clients; class 1's stale report (client 2, round 2) is left out
    because clients 0 holds it in round 5; class 2 has only the stale one. Normalised means:
    mu0 = (2, 1)/sqrt(5), mu1 = (0, 1), mu2 = (0, -1); class 3 has none."""
    model = identity_model()
    f = lambda *v: torch.tensor(v)  # noqa: E731
    state = {FEATS: {
        0: {"sums": f([2.0, 0], [0, 3], [0, 0], [0, 0]), "counts": f(2, 3, 0, 0), "round": 5},
        1: {"sums": f([0.0, 1], [0, 0], [0, 0], [0, 0]), "counts": f(1, 0, 0, 0), "round": 5},
        2: {"sums": f([0.0, 0], [5, 5], [0, -2], [0, 0]), "counts": f(0, 1, 2, 0), "round": 2},
    }}  # fmt: skip
    server = ServerContext(5, {}, model, CPU, None, state)
    method = ICaRL(ICaRL.Params(), info())
    x = torch.tensor([[1.0, 1.0], [1.0, -3.0]])
    r2, r10, r50 = math.sqrt(2), math.sqrt(10), math.sqrt(50)
    # ||a - b||^2 = 2 - 2 a.b for unit vectors
    d = torch.tensor([
        [2 - 2 * 3 / math.sqrt(10), 2 - 2 / r2, 2 + 2 / r2],
        [2 - 2 * (2 - 3) / r50, 2 + 2 * 3 / r10, 2 - 2 * 3 / r10],
    ])  # fmt: skip
    expected = torch.cat([-d, (-d).min(1, keepdim=True).values - 30.0], 1)
    scores = method.eval_predict(server, model, x, None)
    torch.testing.assert_close(scores, expected)
    assert scores.argmax(1).tolist() == [0, 2]
    # another model (a client's local one) and no reports: the logits
    other = identity_model()
    torch.testing.assert_close(method.eval_predict(server, other, x, None), other(x))
    empty = ServerContext(5, {}, model, CPU, None, {})
    torch.testing.assert_close(method.eval_predict(empty, model, x, None), model(x))


# ------------------------------------------------------------------ the loss
def test_targets_are_previous_outputs_on_old_classes_and_one_hot_on_new():
    q = torch.tensor([[0.9, 0.2, 0.7, 0.5], [0.1, 0.6, 0.3, 0.8]])
    old = torch.tensor([True, True, False, False])
    t = icarl_targets(torch.tensor([2, 0]), q, old, 4)
    # row 1 is an exemplar of old class 0: its own label counts only through q
    assert torch.equal(t, torch.tensor([[0.9, 0.2, 1.0, 0.0], [0.1, 0.6, 0.0, 0.0]]))
    assert icarl_targets(torch.tensor([2, 0]), None, old, 4).tolist() == [
        [0, 0, 1, 0],
        [1, 0, 0, 0],
    ]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_local_loss_is_bce_with_distillation_targets_on_the_seen_classes(reduction):
    """Split 3 tasks x 2 classes, task 1: old classes {0, 1} take the previous model's
    sigmoid outputs, new {2, 3} one-hot, {4, 5} (unseen) are left out; the step's rows
    and all exemplars (one step per epoch here) enter one mean."""
    scen = resolve_scenario(
        {"kind": "split", "tasks": 3, "classes_per_task": 2}, 6, (3,), "scenario"
    )
    sc = Scenario.build(scen, 6, (3,), 3)
    method = ICaRL(ICaRL.Params(reduction=reduction), info(6, sc))
    torch.manual_seed(0)
    model = Classifier(nn.Sequential(nn.Linear(3, 5), nn.ReLU()), 5, 6)
    prev = Classifier(nn.Sequential(nn.Linear(3, 5), nn.ReLU()), 5, 6)
    g = torch.Generator().manual_seed(1)
    ex_x, ex_y = torch.randn(2, 3, generator=g), torch.tensor([0, 1])
    state = {KEY: {"x": ex_x, "y": ex_y, "task": torch.zeros(2, dtype=torch.long), "rank": torch.zeros(2, dtype=torch.long),
                   "seen": torch.tensor([True] * 4 + [False] * 2), "refreshed": -1}}  # fmt: skip
    ctx = context(model, state, task=1, broadcast={PREV: prev.state_dict()}, n=4, bs=4)
    method.client_begin(ctx)
    x, y = torch.randn(4, 3, generator=g), torch.tensor([2, 3, 3, 2])
    loss = method.step_loss(ctx, x, y)
    xa, ya = torch.cat([x, ex_x]), torch.cat([y, ex_y])
    g_new, q = torch.sigmoid(model(xa)), torch.sigmoid(prev(xa)).detach()
    target = torch.cat([q[:, :2], F.one_hot(ya, 6)[:, 2:4].float()], 1)
    bce = -(target * g_new[:, :4].log() + (1 - target) * (1 - g_new[:, :4]).log())
    expected = bce.mean() if reduction == "mean" else bce.sum(1).mean()
    torch.testing.assert_close(loss, expected)
    # task 0: one-hot over task 0's classes alone, no previous model
    ctx0 = context(model, {}, task=0, broadcast={PREV: prev.state_dict()})
    method.client_begin(ctx0)
    y0 = torch.tensor([0, 1, 1, 0])
    p0 = torch.sigmoid(model(x))[:, :2]
    t0 = F.one_hot(y0, 6)[:, :2].float()
    bce0 = -(t0 * p0.log() + (1 - t0) * (1 - p0).log())
    torch.testing.assert_close(
        method.step_loss(ctx0, x, y0), bce0.mean() if reduction == "mean" else bce0.sum(1).mean()
    )
    assert (
        icarl_loss(torch.zeros(1, 6), torch.zeros(1, 6), torch.ones(6, dtype=torch.bool), "mean")
        > 0
    )


def test_each_epoch_passes_once_over_the_exemplars():
    """7 exemplars over 3 steps per epoch (10 rows, batch 4): shares 2, 2, 3 of a keyed
    permutation, a new one per epoch; together every exemplar once per epoch."""
    method = ICaRL(ICaRL.Params(), info())
    ex = torch.arange(7.0).unsqueeze(1).repeat(1, 2)
    state = {KEY: {"x": ex, "y": torch.zeros(7, dtype=torch.long), "task": torch.zeros(7, dtype=torch.long),
                   "rank": torch.arange(7), "seen": torch.ones(4, dtype=torch.bool), "refreshed": -1}}  # fmt: skip
    ctx = context(
        identity_model(),
        state,
        data=View(torch.zeros(10, 2), torch.zeros(10, dtype=torch.long)),
        bs=4,
    )
    method.client_begin(ctx)
    epochs = []
    for _ in range(2):
        got = []
        for _ in range(3):
            got.append(method.exemplar_batch(ctx)[0][:, 0].tolist())
            ctx.steps += 1
        assert [len(g) for g in got] == [2, 2, 3]
        assert sorted(sum(got, [])) == list(range(7))
        epochs.append(sum(got, []))
    assert epochs[0] != epochs[1]  # a new permutation per epoch


# ------------------------------------------------------------------ runs
def icarl_cfg(make_run_config, params=None, scenario=None, **train):
    rc = digits_cfg(make_run_config, "icarl", {"buffer_size": 12, **(params or {})}, **train)
    if scenario:
        rc = replace(rc, dataset=replace(rc.dataset, scenario={**rc.dataset.scenario, **scenario}))
    return rc


def nme_accuracy(sim, t):
    """Task t's test accuracy by NME recomputed from the clients' exemplars on the global
    model (the last round ends a task: every client reported on it)."""
    model = sim.model_with(sim.global_params).eval()
    c = sim.num_classes
    sums, counts = torch.zeros(c, model.feature_dim, dtype=torch.float64), torch.zeros(c)
    with torch.no_grad():
        for st in sim.client_state.values():
            z = F.normalize(model.features(st[KEY]["x"]), dim=1).double()
            sums.index_add_(0, st[KEY]["y"], z)
            counts += torch.bincount(st[KEY]["y"], minlength=c)
        means = F.normalize(sums / counts.clamp_min(1).unsqueeze(1), dim=1).float()
        right = n = 0
        for x, y in sim.evaluator.test.batches(t, sim.scenario, 256):
            z = F.normalize(model.features(x), dim=1)
            d = torch.cdist(z, means).masked_fill(counts == 0, math.inf)
            if sim.scenario.masked:
                d = d.masked_fill(~sim.scenario.class_mask(CPU)[t], math.inf)
            right += int((d.argmin(1) == y).sum())
            n += len(y)
    return right / n


@pytest.mark.parametrize("setting", ["class", "task"])
def test_split_digits_run_scores_by_nme(make_run_config, setting):
    """Class-IL (shared head) and task-IL (per-task heads): the run completes, each client
    holds at most K rows and m = K // (classes it saw) per class, the accuracy matrix rows
    are NME's (recomputed by hand from the exemplars), the logits' accuracy beside them."""
    scen = {"incremental": setting, **({"heads": "per_task"} if setting == "task" else {})}
    sim, rows = run(icarl_cfg(make_run_config, scenario=scen))
    assert rows[-1]["icarl_mean_classes"] == 6.0
    for st in sim.client_state.values():
        ex = st[KEY]
        m = 12 // int(ex["seen"].sum())
        assert len(ex["y"]) <= 12
        assert torch.bincount(ex["y"]).max() <= m
        assert set(ex["task"].tolist()) <= {0, 1, 2}
    last = rows[-1]["_tasks"]
    for t in range(3):
        assert last[t]["accuracy"] == pytest.approx(nme_accuracy(sim, t), abs=1e-9)
        assert 0.0 <= last[t]["logits"] <= 1.0
    assert rows[-1]["icarl_exemplars"] > 0


def test_resume_mid_task_and_at_a_task_boundary_is_exact(make_run_config):
    rc = icarl_cfg(make_run_config, scenario={"rounds_per_task": 2}, rounds=6, checkpoint_every=1,
                   sample_rate=0.75, eval_every=1)  # fmt: skip
    full = Simulation(rc, device=CPU)
    saved, keep = checkpoint_keeper()
    status, rows_full, _ = full.run(progress=False, on_checkpoint=keep)
    assert status == "completed"
    for stop in (3, 4):  # the middle of task 1, the end of task 1
        ckpt = next(c for c in saved if c["round"] == stop)
        resumed = Simulation(rc, device=CPU)
        status, rows_res, _ = resumed.run(progress=False, resume=ckpt)
        assert status == "completed"
        assert strip(rows_res) == strip(rows_full)
        for k, v in full.global_params.items():
            assert torch.equal(v, resumed.global_params[k])
        assert same(resumed.client_state, full.client_state)
        assert same(resumed.server.state, full.server.state)


def test_fedgp_over_icarl(make_run_config):
    """FedGP's reference gradient comes from iCaRL's exemplars (no own buffer); it projects
    from task 1 on; off (rate 0), it is iCaRL bit for bit, NME columns included."""
    _, rows_b = run(icarl_cfg(make_run_config))
    gp = {"base": "icarl", "base_params": {"buffer_size": 12}}
    sim, rows_g = run(digits_cfg(make_run_config, "fedgp", {**gp, "rate": 0.0}))
    assert strip(rows_g, "fedgp_") == strip(rows_b, "icarl_")
    sim, rows = run(digits_cfg(make_run_config, "fedgp", gp))
    assert not sim.method.own_buffer and sim.method.replay is sim.method.base.replay
    assert rows[1].get("fedgp_proj_share", 0.0) == 0.0  # task 0: no exemplars, no g_ref
    assert any(r["fedgp_proj_share"] > 0 for r in rows[2:])
    assert rows[-1]["fedgp_icarl_exemplars"] > 0 and rows[-1]["fedgp_icarl_mean_classes"] == 6.0
    assert rows[-1]["fedgp_ref_clients"] == 4.0
    assert set(sim.client_state[0]) == {KEY}  # one memory per client


# ------------------------------------------------------------------ refusals, hyperparameters
def raw_config(scenario, method=None):
    return {"experiments": [{
        "name": "e", "datasets": [{"name": "digits", "model": "cnn2d", "scenario": scenario}],
        "partitions": [{"scheme": "iid", "clients": 2}], "methods": [method or {"name": "icarl"}],
        "seeds": [0], "train": {"rounds": 2},
    }]}  # fmt: skip


@pytest.mark.parametrize(
    "scenario, match",
    [
        ({"kind": "rotated", "tasks": 2, "rounds_per_task": 1}, "scenario.kind='rotated'"),
        (
            {"kind": "permuted", "tasks": 2, "rounds_per_task": 1, "incremental": "task"},
            "scenario.kind='permuted'",
        ),
        (
            {**SPLIT, "tasks": 2, "boundaries": {"samples_per_window": 20, "window_rounds": 1}},
            "scenario.boundaries=",
        ),
    ],
)
def test_domain_incremental_and_asynchronous_streams_are_refused(scenario, match):
    for method in ({"name": "icarl"}, {"name": "fedgp", "params": {"base": "icarl"}}):
        with pytest.raises(FedForgetError, match=match):
            parse_config(raw_config(scenario, method))
    parse_config(raw_config({**SPLIT, "tasks": 2}))  # split streams are fine


@pytest.mark.parametrize(
    "params, match",
    [
        ({"buffer_size": -1}, "buffer_size=-1"),
        ({"normalize": "yes"}, "normalize='yes'"),
        ({"reduction": "max"}, "reduction='max'"),
    ],
)
def test_bad_hyperparameters_name_the_value(params, match):
    with pytest.raises(FedForgetError, match=match):
        check_params("icarl", params)


def test_defaults():
    assert check_params("icarl", {}) == {"buffer_size": 200, "normalize": True, "reduction": "sum"}


def test_round_end_refreshes_the_means_on_the_new_model():
    """After a round's aggregation a client that trained sends its sums on the new global
    model; its task end in the same round already did (no second message)."""
    method = ICaRL(ICaRL.Params(buffer_size=4, normalize=False), info())
    state, model = {}, identity_model()
    method.client_reply(TASK_END,
        context(model, state, rnd=3, data=View(line([1.0, 2.0]), torch.tensor([0, 1])))
    )
    assert method.client_reply(ROUND_END, context(model, state, rnd=3)) is None
    model.body = nn.Linear(2, 2)  # the representation changed
    with torch.no_grad():
        model.body.weight.copy_(torch.tensor([[2.0, 0.0], [0.0, 1.0]]))
        model.body.bias.zero_()
    rep = method.client_reply(ROUND_END, context(model, state, rnd=4))
    torch.testing.assert_close(rep["sums"][:2], torch.tensor([[2.0, 0.0], [4.0, 0.0]]))
    server = ServerContext(4, {}, model, CPU, None, {})
    method.server_collect(ROUND_END, server, {1: rep})
    assert server.state[FEATS][1]["round"] == 4


@pytest.mark.parametrize(
    "model,incremental,reduction",
    [("mlp", "class", "sum"),  # every step batched (stacked_forward)
     ("cnn2d", "task", "mean"),  # wide steps client by client in replicas (live_alone), tails batched
     ("resnet8", "class", "sum")],  # BatchNorm: clients whose joined batches differ run apart
)  # fmt: skip
def test_icarl_trains_stacked_as_sequential(make_run_config, run_engines, assert_same_metrics, model, incremental,
                                            reduction):  # fmt: skip
    """Issue 32, 3: iCaRL's step in the stacked trainer, each client's share of its exemplars
    joined to its minibatch in one forward (``JoinedLive``; its BatchNorm statistics see
    both), distilled against the previous model on the old classes, each client's mean
    BCE over its rows, within 1e-5 of one client after another (metrics with the NME
    accuracy, exemplars, weights)."""
    bn = model == "resnet8"  # drop_last: no 1-row batch through BatchNorm (as A-GEM's and DER's test)
    rc = replay_stream_cfg(make_run_config, "icarl", {"buffer_size": 30, "reduction": reduction}, model,
                           SMALL_RESNET if bn else SMALL_CNN if model == "cnn2d" else None, incremental,
                           eval_every=1, drop_last=bn, **BN_SHORT if bn else {})  # fmt: skip
    out = run_engines(rc)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert vec.engine_info["client_engine"] == "vectorized"
    assert_same_metrics(rows_s, rows_v)
    for k, v in seq.global_params.items():  # running statistics included
        torch.testing.assert_close(v.float(), vec.global_params[k].float(), atol=1e-4 if bn else 1e-5, rtol=1e-5, msg=k)
    for cid, st in seq.fed.clients.items():  # the exemplars the two trainers' models chose
        if "icarl" in st:
            assert torch.equal(st["icarl"]["y"], vec.fed.clients[cid]["icarl"]["y"]), cid
