"""CFeD (methods/cfed.py): the distillation loss (1) on a hand-built example (temperature,
no T^2, which scores: the whole output, the old heads' task-agnostic scores, old classes
only), the keyed review/learn split (none in the first task, floor(0.4 m) after), a
reviewer's step on its own surrogate rows, the disjoint surrogate split, the server
distillation (round-robin teachers, FedAvg average as the start, nothing else changed,
off = FedAvg's aggregate), split-digits runs with a public set, exact resume mid-task and
at a task boundary, FedGP over CFeD, validation."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedforget.config import TrainSpec
from fedforget.data.scenario import Scenario
from fedforget.engine import Simulation, sample_clients
from fedforget.methods import ClientContext, RunInfo, ServerContext, Upload, check_params
from fedforget.methods.base import weighted_average
from fedforget.methods.cfed import (
    GLOBAL,
    PARTS,
    PUBLIC_X,
    REVIEW_STREAM,
    REVIEWERS,
    SERVER_STREAM,
    TEACHER,
    CFeD,
    old_scores,
    reviewers,
    soft_cross_entropy,
    split_parts,
)
from fedforget.methods.distill import DistillSpec, distill
from fedforget.models import Classifier
from fedforget.parse import parse_config
from fedforget.utils import FedForgetError, torch_seed

from .conftest import CPU, PUBLIC, checkpoint_keeper, digits_cfg, run, strip

SPLIT3 = {"kind": "split", "tasks": 3, "classes_per_task": 2, "rounds_per_task": 2}


@pytest.fixture
def cfed_cfg(make_run_config, digits_public_root):
    """Split digits, 3 tasks x 2 rounds, 4 clients of which 3 sampled (1 reviewer after task 0)."""

    def make(method="cfed", params=None, scenario=SPLIT3, **train):
        rc = digits_cfg(make_run_config, method, params, **{"rounds": 6, "sample_rate": 0.75, **train})
        rc = replace(rc, data_dir=str(digits_public_root), dataset=replace(rc.dataset, public=PUBLIC))
        sc = {**rc.dataset.scenario, **scenario}
        return replace(rc, dataset=replace(rc.dataset, scenario=sc))

    return make


# ------------------------------------------------------------------ the loss (1)
def test_kd_loss_on_a_hand_built_example():
    s, t = [1.0, 2.0, 0.0], [0.0, 2.0, 1.0]

    def hand(T):
        pt = [math.exp(v / T) for v in t]
        pt = [p / sum(pt) for p in pt]
        lse = math.log(sum(math.exp(v / T) for v in s))
        return -sum(p * (v / T - lse) for p, v in zip(pt, s))

    st, tt = torch.tensor([s, t], dtype=torch.float64), torch.tensor([t, t], dtype=torch.float64)
    # row 2 compares the teacher with itself: its teacher entropy counts (a cross-entropy, not a KL)
    h2 = -sum(p * math.log(p) for p in (lambda e: [x / sum(e) for x in e])([math.exp(v / 2) for v in t]))
    assert soft_cross_entropy(st, tt, 2.0).item() == pytest.approx((hand(2.0) + h2) / 2, abs=1e-12)
    assert soft_cross_entropy(st[:1], tt[:1], 2.0).item() == pytest.approx(hand(2.0), abs=1e-12)  # 1.0806...
    assert soft_cross_entropy(st[:1], tt[:1], 1.0).item() == pytest.approx(hand(1.0), abs=1e-12)
    assert hand(1.0) != pytest.approx(hand(2.0))  # T matters; no T^2 factor: the values are bare
    # its gradient is that of KL(old || new): (softmax(s/T) - softmax(t/T)) / (T B)
    z = st[:1].clone().requires_grad_()
    soft_cross_entropy(z, tt[:1], 2.0).backward()
    want = (F.softmax(st[:1] / 2, 1) - F.softmax(tt[:1] / 2, 1)) / 2
    assert torch.allclose(z.grad, want)


def heads_model():
    torch.manual_seed(0)
    m = Classifier(nn.Sequential(nn.Linear(4, 5), nn.ReLU()), 5, 6)
    m.use_task_heads([[0, 1], [2, 3], [4, 5]])
    m.set_task(2)
    return m


def test_old_scores_are_the_whole_output_or_the_old_heads_task_agnostic_scores():
    torch.manual_seed(1)
    x = torch.randn(3, 4)
    shared = Classifier(nn.Sequential(nn.Linear(4, 5), nn.ReLU()), 5, 6)
    assert torch.equal(old_scores(shared, x, 1), shared(x))  # every class of the one head
    m = heads_model()
    z = m.features(x)
    h0, h1 = m.head.heads[0](z), m.head.heads[1](z)
    # end of task 1: classes 0, 1 from head 0; 2, 3 from head 1; the later ones from head 1
    want = torch.cat([h0[:, :2], h1[:, 2:]], 1)
    assert torch.allclose(old_scores(m, x, 1), want)
    assert m.head.active == 2  # restored


def reviewer_setup(params=None, heads=False):
    """A CFeD reviewer on task 1 (of a 3 x 2-class split), 2 clients, a 20-row public set."""
    sc = Scenario.build({"kind": "split", "tasks": 3, "classes_per_task": 2, "class_order": "natural",
                         "incremental": "class", "rounds_per_task": 1, "heads": "shared",
                         "boundaries": "sync", "seed": 0, "rotation": [0, 180]}, 6, (4,), 3)  # fmt: skip
    info = RunInfo(CPU, num_classes=6, seed=3, num_clients=2, train=TrainSpec(), scenario=sc)
    method = CFeD(CFeD.Params(**(params or {})), info)
    if heads:
        model = heads_model()
        model.set_task(1)
    else:
        torch.manual_seed(0)
        model = Classifier(nn.Sequential(nn.Linear(4, 5), nn.ReLU()), 5, 6)
    gen = torch.Generator().manual_seed(5)
    x_pub, teacher = torch.randn(20, 4, generator=gen), torch.randn(20, 6, generator=gen)
    parts = split_parts(20, 3, seed=3)
    b = {PUBLIC_X: x_pub, PARTS: parts, TEACHER: teacher, REVIEWERS: frozenset({1}), GLOBAL: {}}
    ctx = ClientContext(
        cid=1, round=4, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), global_params={},
        broadcast=b, state={}, n_samples=8, lr=0.1, local_epochs=1, batch_size=4, task=1,
    )  # fmt: skip
    method.client_begin(ctx)
    return method, ctx, model, x_pub, teacher, parts


@pytest.mark.parametrize("classes", ["all", "old"])
def test_a_reviewer_distils_the_old_model_on_its_own_surrogate_rows(classes):
    method, ctx, model, x_pub, teacher, parts = reviewer_setup({"review_classes": classes})
    x, y = torch.randn(5, 4), torch.tensor([2, 3, 2, 3, 2])  # its task batch: not used
    loss = method.client_step(ctx, x, y)
    # the first 5 rows of its stream: a permutation of its part keyed (seed, round, client, task)
    gen = torch.Generator().manual_seed(torch_seed(3, 4, 1, 1, REVIEW_STREAM))
    rows = parts[1][torch.randperm(len(parts[1]), generator=gen)[:5]]
    z, zt = model(x_pub[rows]), teacher[rows]
    if classes == "old":  # the classes of task 0 only
        z, zt = z[:, :2], zt[:, :2]
    want = 0.1 * soft_cross_entropy(z, zt, 2.0)
    assert torch.allclose(loss, want)
    g = torch.autograd.grad(want, list(model.parameters()))
    assert all(torch.allclose(p.grad, gi) for p, gi in zip(model.parameters(), g))
    assert set(rows.tolist()) <= set(parts[1].tolist())  # never another party's rows


def test_a_reviewer_with_task_heads_trains_the_body_through_frozen_old_heads():
    method, ctx, model, x_pub, teacher, parts = reviewer_setup(heads=True)
    method.client_step(ctx, torch.randn(4, 4), torch.tensor([2, 3, 2, 3]))
    assert model.body[0].weight.grad.abs().sum() > 0
    assert all(p.grad is None for h in model.head.heads for p in h.parameters())


def test_the_stream_wraps_over_successive_permutations_of_the_part():
    method, ctx, *_ , parts = reviewer_setup()
    s = method.scratch(ctx)
    n = len(parts[1])  # 7 rows
    got = torch.cat([method.surrogate_rows(s, 4) for _ in range(4)])  # 16 rows: > 2 passes
    assert sorted(got[:n].tolist()) == sorted(parts[1].tolist())  # first pass: each row once
    assert sorted(got[n : 2 * n].tolist()) == sorted(parts[1].tolist())


def test_a_learner_takes_fedavgs_step():
    method, ctx, model, *_ = reviewer_setup()
    ctx.broadcast = {**ctx.broadcast, REVIEWERS: frozenset({0})}
    method.client_begin(ctx)
    x, y = torch.randn(4, 4), torch.tensor([2, 3, 3, 2])
    loss = method.client_step(ctx, x, y)
    assert torch.allclose(loss, F.cross_entropy(model(x), y))


# ------------------------------------------------------------------ roles and parts
def test_the_review_learn_split_is_keyed_and_as_the_code_says():
    for m in range(1, 11):
        sampled = list(range(0, 2 * m, 2))
        r = reviewers(0, 7, sampled, 0.4)
        assert len(r) == math.floor(0.4 * m) and set(r) <= set(sampled)  # int(0.4 m) [C]
        assert r == reviewers(0, 7, list(sampled), 0.4)  # keyed: the same draw again
    draws = {tuple(reviewers(0, rnd, list(range(10)), 0.4)) for rnd in range(1, 9)}
    assert len(draws) > 1  # a fresh draw each round
    assert reviewers(0, 3, list(range(10)), 0.0) == [] and reviewers(0, 3, list(range(10)), 1.0) == list(range(10))
    # the broadcast: nobody reviews without an old model (the first task); afterwards the
    # reviewers are among the round's sampled clients
    info = RunInfo(CPU, num_classes=3, seed=0, num_clients=10, train=TrainSpec(sample_rate=0.5))
    method = CFeD(CFeD.Params(), info)
    method.parts = split_parts(30, 11, 0)
    server = ServerContext(5, {}, None, CPU, SimpleNamespace(x=torch.zeros(30, 2)))
    assert method.server_broadcast(server)[REVIEWERS] == frozenset()
    server.state[TEACHER] = torch.zeros(30, 3)
    got = method.server_broadcast(server)[REVIEWERS]
    sampled = sample_clients(0, 5, 10, 0.5)
    assert got == frozenset(reviewers(0, 5, sampled, 0.4)) and len(got) == 2


def test_surrogate_parts_are_disjoint_near_equal_and_keyed():
    parts = split_parts(23, 5, seed=1)
    rows = torch.cat(parts).tolist()
    assert sorted(rows) == list(range(23)) and {len(p) for p in parts} == {4, 5}
    assert all(torch.equal(a, b) for a, b in zip(parts, split_parts(23, 5, seed=1)))
    assert not all(torch.equal(a, b) for a, b in zip(parts, split_parts(23, 5, seed=2)))


# ------------------------------------------------------------------ server distillation
def server_setup(params):
    info = RunInfo(CPU, num_classes=6, seed=2, num_clients=2, train=TrainSpec(local_epochs=2))
    method = CFeD(CFeD.Params(**params), info)
    model = heads_model()
    gen = torch.Generator().manual_seed(9)
    pub = SimpleNamespace(x=torch.randn(25, 4, generator=gen), y=None)
    server = ServerContext(3, {}, model, CPU, pub, task=1)
    method.server_init(server)

    def noisy(scale):
        return {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}

    glob = noisy(0.0)
    uploads = [Upload(0, 10, noisy(0.5), 3), Upload(1, 30, noisy(0.5), 3)]
    server.broadcast = method.server_broadcast(server)
    server.broadcast[GLOBAL] = glob
    return method, server, uploads, glob


def test_server_distillation_is_as_specified():
    method, server, uploads, glob = server_setup({"distill_lr": 1e-2})
    avg = weighted_average([u.params for u in uploads], [u.n_samples for u in uploads])
    method.server_aggregate(server, uploads)  # FedAvg's average, then the distillation
    new = server.global_params
    # by hand: S_0 = the last part; row j of it labelled by teacher j mod 3 (clients 0, 1, then
    # the broadcast global model), eval mode; the student starts at the FedAvg average and takes
    # Adam steps on 0.1 * (1) at T = 2 for the run's 2 local epochs, batch order keyed
    rows = method.parts[-1]
    x = server.public.x[rows]
    ref = heads_model()
    ref.set_task(1)
    zt = torch.zeros(len(rows), 6)
    for j in range(len(rows)):
        ref.load_state_dict([uploads[0].params, uploads[1].params, glob][j % 3])
        ref.eval()
        with torch.no_grad():
            zt[j] = ref(x[j : j + 1])[0]
    ref.load_state_dict(avg)
    spec = DistillSpec(epochs=2, optimizer="adam", lr=1e-2, batch_size=128, seed=torch_seed(2, 3, SERVER_STREAM))
    distill(ref, x, None, spec, lambda idx, f, z: 0.1 * soft_cross_entropy(z, zt[idx], 2.0))
    for k, v in ref.state_dict().items():
        assert torch.allclose(new[k], v, atol=1e-6), k
    # what trains: the body and the current task's head; the other heads are untouched
    changed = {k for k in avg if not torch.equal(avg[k], new[k])}
    assert changed == {k for k in avg if k.startswith("body.") or k.startswith("head.heads.1.")}
    assert method.server_metrics(server, uploads)["distill_steps"] == 2.0


@pytest.mark.parametrize("params", [{"server_distill": False}, {"distill_epochs": 0}])
def test_no_server_distillation_leaves_fedavgs_aggregate(params):
    method, server, uploads, _ = server_setup(params)
    method.server_aggregate(server, uploads)
    avg = weighted_average([u.params for u in uploads], [u.n_samples for u in uploads])
    assert server.global_params.keys() == avg.keys()
    assert all(torch.equal(server.global_params[k], v) for k, v in avg.items())


# ------------------------------------------------------------------ runs
def test_split_digits_run_with_a_public_set(cfed_cfg):
    sim, rows = run(cfed_cfg())
    share = [r["cfed_review_share"] for r in rows[1:]]
    assert share[:2] == [0.0, 0.0]  # task 0: everybody learns
    assert share[2:] == [pytest.approx(1 / 3)] * 4  # then floor(0.4 * 3) = 1 of 3 reviews
    assert [r["cfed_reviewers"] for r in rows[1:]] == [0, 0, 1, 1, 1, 1]
    assert all(r["cfed_distill_steps"] > 0 for r in rows[1:])
    assert all(r["cfed_review_loss"] > 0 for r in rows[3:])
    z = sim.server.state[TEACHER]
    assert z.shape == (len(sim.server.public.x), 10) and torch.isfinite(z).all()


def test_task_il_run_with_task_heads_and_old_classes(cfed_cfg):
    scen = {"incremental": "task", "heads": "per_task", "rounds_per_task": 1}
    _, rows = run(cfed_cfg(params={"review_classes": "old", "server_distill": False}, scenario=scen, rounds=3))
    assert [r["cfed_reviewers"] for r in rows[1:]] == [0, 1, 1]
    assert "cfed_distill_steps" not in rows[-1]


def test_resume_mid_task_and_at_a_task_boundary_is_exact(cfed_cfg):
    rc = cfed_cfg(checkpoint_every=1)
    full = Simulation(rc, device=CPU)
    saved, keep = checkpoint_keeper()
    status, rows, _ = full.run(progress=False, on_checkpoint=keep)
    assert status == "completed"
    for stop in (3, 4):  # the middle of task 1; the end of task 1 (task 2's teacher made on resume)
        sim = Simulation(rc, device=CPU)
        status, resumed, _ = sim.run(progress=False, resume=next(c for c in saved if c["round"] == stop))
        assert status == "completed" and strip(resumed) == strip(rows)
        assert torch.equal(sim.server.state[TEACHER], full.server.state[TEACHER])
        for k, v in full.global_params.items():
            assert torch.equal(v, sim.global_params[k]), k


def test_fedgp_over_cfed_runs(cfed_cfg):
    params = {"base": "cfed", "base_params": {"server_distill": False}, "buffer_size": 20}
    _, rows = run(cfed_cfg("fedgp", params))
    assert [r["fedgp_cfed_reviewers"] for r in rows[1:]] == [0, 0, 1, 1, 1, 1]
    assert rows[-1]["fedgp_ref_clients"] > 0 and "fedgp_proj_share" in rows[-1]


# ------------------------------------------------------------------ stacked trainer
@pytest.mark.parametrize(
    "method,model,params",
    [("cfed", "mlp", {"review_classes": "old"}),  # every step batched (stacked_forward)
     ("cfed", "cnn2d", {"server_distill": False}),  # wide steps client by client (live_alone), tails batched
     ("cfed", "resnet8", {}),  # BatchNorm: a reviewer's statistics see its surrogate rows alone
     ("fedgp", "cnn2d", {"base": "cfed", "base_params": {"server_distill": False}, "buffer_size": 20})],
)  # fmt: skip
def test_trains_stacked_as_sequential(cfed_cfg, run_engines, assert_same_metrics, method, model, params):
    """Issue 32, 3: CFeD's step in the stacked trainer, a reviewer's surrogate rows in place of
    its minibatch (``JoinedLive(replaces=True)``), its distillation against the teacher's
    scores beside the learners' task loss, within 1e-5 of one client after another (and
    FedGP's projection after it)."""
    from .conftest import BN_SHORT, SMALL_CNN, SMALL_RESNET

    opts = {"mlp": None, "cnn2d": SMALL_CNN, "resnet8": SMALL_RESNET}[model]
    rc = cfed_cfg(method, params, sample_rate=1.0, drop_last=model == "resnet8", eval_every=2,
                  **BN_SHORT if model == "resnet8" else {})
    rc = replace(rc, dataset=replace(rc.dataset, model=model, model_options=opts))
    out = run_engines(rc)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    # FedGP's cos(g, g_ref) is left out: a task's first review step distils the teacher's own
    # weights (w = w_{t-1}), whose gradient is rounding noise in either trainer, so its cosine is too
    assert_same_metrics(*([{k: v for k, v in r.items() if k != "fedgp_cos_before"} for r in rows] for rows in (rows_s, rows_v)))
    prefix = "fedgp_cfed_" if method == "fedgp" else "cfed_"
    assert rows_s[-1][prefix + "reviewers"] >= 1 and rows_s[-1][prefix + "review_loss"] > 0
    for k, v in seq.global_params.items():  # running statistics included
        torch.testing.assert_close(v.float(), vec.global_params[k].float(), atol=1e-5, rtol=1e-5, msg=k)


# ------------------------------------------------------------------ validation
def test_config_refuses_cfed_without_a_public_set_or_task_boundaries(minimal_config):
    ex = minimal_config["experiments"][0]
    ex["methods"] = [{"name": "cfed"}]
    with pytest.raises(FedForgetError, match=r"method 'cfed' needs a public set"):
        parse_config(minimal_config)
    ex["methods"] = [{"name": "fedgp", "params": {"base": "cfed"}}]
    with pytest.raises(FedForgetError, match=r"method 'fedgp' needs a public set"):
        parse_config(minimal_config)
    ex["methods"] = [{"name": "cfed"}]
    ex["datasets"][0]["public"] = PUBLIC
    ex["datasets"][0]["scenario"] = {"kind": "split", "tasks": 3, "classes_per_task": 1, "rounds_per_task": 1,
                                     "boundaries": {"samples_per_window": 5, "window_rounds": 1}}  # fmt: skip
    ex["train"] = {"rounds": 3}
    with pytest.raises(FedForgetError, match=r"needs task boundaries.*allowed: sync"):
        parse_config(minimal_config)
    ex["datasets"][0]["scenario"]["boundaries"] = "sync"
    assert parse_config(minimal_config).runs()[0].method.params["review_ratio"] == 0.4


def test_too_small_a_public_set_is_refused():
    info = RunInfo(CPU, num_classes=3, seed=0, num_clients=4, train=TrainSpec())
    server = ServerContext(0, {}, None, CPU, SimpleNamespace(x=torch.zeros(4, 2), y=None))
    with pytest.raises(FedForgetError, match="into 5 surrogate sets.*it has 4 rows"):
        CFeD(CFeD.Params(), info).server_init(server)
    with pytest.raises(FedForgetError, match="needs a public set"):
        CFeD(CFeD.Params(), info).server_init(ServerContext(0, {}, None, CPU, None))


@pytest.mark.parametrize(
    "field, value, match",
    [("review_ratio", 1.5, "review_ratio=1.5"), ("review_classes", "new", "all | old"),
     ("temperature", 0, "temperature=0"), ("kd_weight", -1, "kd_weight=-1"),
     ("server_distill", "yes", "true | false"), ("distill_epochs", -1, "distill_epochs=-1"),
     ("distill_lr", 0, "distill_lr=0")],
)  # fmt: skip
def test_bad_hyperparameters_name_the_value(field, value, match):
    with pytest.raises(FedForgetError, match=match):
        check_params("cfed", {field: value})


def test_defaults():
    p = check_params("cfed", {})
    assert (p["review_ratio"], p["temperature"], p["kd_weight"], p["review_classes"]) == (0.4, 2.0, 0.1, "all")
    assert (p["server_distill"], p["distill_epochs"], p["distill_optimizer"], p["distill_lr"],
            p["distill_batch_size"]) == (True, None, "adam", 5e-5, 128)  # fmt: skip
    assert copy.deepcopy(p) == p
