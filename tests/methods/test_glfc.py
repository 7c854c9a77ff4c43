"""GLFC and LGA (methods/glfc.py, methods/lga.py): the class-aware compensation weights and
the relation-distillation target on hand-built batches, the proxy server's label inference,
gradient inversion and best-model selection on a toy case, LGA's gradient-adaptive
category-balanced weights, weighted distillation, radius and feature augmentation, split-digits
runs of both, FedGP over GLFC, exact resume mid-task and at a task boundary, refusal of
domain-incremental streams, hyperparameter validation."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from fedforget.config import TrainSpec
from fedforget.data.scenario import Scenario, resolve_scenario
from fedforget.engine import Simulation
from fedforget.methods import ClientContext, RunInfo, ServerContext, Upload, check_params
from fedforget.methods.glfc import (
    BEST,
    BEST_ACC,
    GLFC,
    KEY,
    MONITOR,
    OLD,
    PROTO,
    compensation_weights,
    encoder_gradient,
    relation_target,
)  # fmt: skip
from fedforget.methods.lga import LGA, RADIUS, adaptive_weights, augment_features, pooled_radius
from fedforget.models import Classifier
from fedforget.parse import parse_config
from fedforget.utils import FedForgetError

from .conftest import (
    BN_SHORT,
    CPU,
    SMALL_CNN,
    SMALL_RESNET,
    checkpoint_keeper,
    digits_cfg,
    replay_stream_cfg,
    run,
    same,
    strip,
)  # fmt: skip
from .conftest import GLFC_FAST as FAST

# a hand-built batch at task 1 of a 2 x 2 split stream (classes 0, 1 old; 2, 3 new): row i's
# softmax over the 4 seen classes is P[i] (logits = log P through an identity model)
P = [[0.1, 0.1, 0.5, 0.3], [0.05, 0.05, 0.1, 0.8], [0.2, 0.3, 0.25, 0.25], [0.1, 0.6, 0.2, 0.1]]
Y = [2, 3, 0, 1]


def split_info(incremental="class"):
    raw = {
        "kind": "split",
        "tasks": 2,
        "classes_per_task": 2,
        "incremental": incremental,
        "rounds_per_task": 1,
    }
    sc = Scenario.build(resolve_scenario(raw, 4, (4,), "scenario"), 4, (4,), 2)
    return RunInfo(CPU, num_classes=4, seed=0, num_clients=2, train=TrainSpec(), scenario=sc)


def identity_model(scale=1.0):
    m = Classifier(nn.Identity(), 4, 4)
    with torch.no_grad():
        m.head.weight.copy_(scale * torch.eye(4))
        m.head.bias.zero_()
    return m


def hand_ctx(method, old=None, task=1, memory=(0, 1)):
    """A client at ``task`` whose memory holds rows of the classes ``memory`` (none: empty)."""
    model = identity_model()
    state = {KEY: {"y": torch.tensor(memory, dtype=torch.long)}} if memory else {}
    ctx = ClientContext(
        cid=0, round=2, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), global_params={},
        broadcast={OLD: old}, state=state, n_samples=4, lr=0.1, local_epochs=1, batch_size=4, task=task,
    )  # fmt: skip
    method.client_begin(ctx)
    return ctx, torch.tensor(P).log(), torch.tensor(Y)


# ------------------------------------------------------------------ GLFC's local losses
def test_compensation_weights_on_a_hand_built_batch():
    # |G_i| = 1 - P_{y_i}: 0.5, 0.2 (new rows), 0.8, 0.4 (old rows); G_n = 0.35, G_o = 0.6
    w_hand = [0.5 / 0.35, 0.2 / 0.35, 0.8 / 0.6, 0.4 / 0.6]
    g = torch.tensor([0.5, 0.2, 0.8, 0.4])
    w = compensation_weights(g, torch.tensor([False, False, True, True]))
    torch.testing.assert_close(w, torch.tensor(w_hand))
    ce = [-math.log(P[i][Y[i]]) for i in range(4)]
    loss_hand = sum(wi * c for wi, c in zip(w_hand, ce)) / 4  # L_GC, no old model
    method = GLFC(GLFC.Params(), split_info())
    ctx, x, y = hand_ctx(method)
    assert math.isclose(method.step_loss(ctx, x, y).item(), loss_hand, rel_tol=1e-6)
    # the code's sigmoid form: G_i = sigmoid(z_y) - 1, each row's mean binary cross-entropy
    sig = GLFC(GLFC.Params(loss="sigmoid"), split_info())
    ctx, x, y = hand_ctx(sig)
    s = [[p / (1 + p) for p in row] for row in P]  # sigmoid(log p)
    g = [1 - s[i][Y[i]] for i in range(4)]
    w = [
        g[0] / ((g[0] + g[1]) / 2),
        g[1] / ((g[0] + g[1]) / 2),
        g[2] / ((g[2] + g[3]) / 2),
        g[3] / ((g[2] + g[3]) / 2),
    ]
    bce = [
        sum(-math.log(s[i][c]) if c == Y[i] else -math.log(1 - s[i][c]) for c in range(4)) / 4
        for i in range(4)
    ]
    assert math.isclose(
        sig.step_loss(ctx, x, y).item(), sum(a * b for a, b in zip(w, bce)) / 4, rel_tol=1e-6
    )


def test_relation_distillation_target_on_a_hand_built_example():
    """Y_hat: the one-hot label with the old classes' entries replaced by the old model's
    softmax over the old classes; L = 0.5 L_GC + 0.5 KL(Y_hat || P) (literal, rows summed)."""
    old = identity_model(2.0)  # old logits 2 log P: old-class probabilities p^2 / sum p^2
    q = [
        [P[i][0] ** 2 / (P[i][0] ** 2 + P[i][1] ** 2), P[i][1] ** 2 / (P[i][0] ** 2 + P[i][1] ** 2)]
        for i in range(4)
    ]
    target = [q[0] + [1.0, 0.0], q[1] + [0.0, 1.0], q[2] + [0.0, 0.0], q[3] + [0.0, 0.0]]
    # row 2: 0.04 / 0.13, 0.09 / 0.13 on the old classes, nothing on the new ones
    assert [round(v, 4) for v in target[2]] == [0.3077, 0.6923, 0.0, 0.0]
    got = relation_target(torch.tensor(Y), torch.ones(4, 4, dtype=torch.bool), torch.tensor([True, True, False, False]),
                          2 * torch.tensor(P).log(), "softmax")  # fmt: skip
    torch.testing.assert_close(got, torch.tensor(target))
    kl = [
        sum(t * (math.log(t) - math.log(p)) for t, p in zip(target[i], P[i]) if t > 0)
        for i in range(4)
    ]
    w = [0.5 / 0.35, 0.2 / 0.35, 0.8 / 0.6, 0.4 / 0.6]
    gc = sum(wi * -math.log(P[i][Y[i]]) for i, wi in enumerate(w)) / 4
    method = GLFC(GLFC.Params(), split_info())
    ctx, x, y = hand_ctx(method, old=old.state_dict())
    assert math.isclose(
        method.step_loss(ctx, x, y).item(), 0.5 * gc + 0.5 * sum(kl) / 4, rel_tol=1e-6
    )
    # task-IL trains as class-IL (its mask is the evaluator's, at test: Scenario.masked), so
    # the target is the same (it masked each row to its task's classes before 2026-12-06)
    task_il = GLFC(GLFC.Params(), split_info("task"))
    rt = task_il.row_task(torch.tensor(Y), 1)
    t = relation_target(
        torch.tensor(Y), task_il.allowed(rt, 1), task_il.old[1], 2 * torch.tensor(P).log(), "softmax"
    )
    torch.testing.assert_close(t, torch.tensor(target))


# ------------------------------------------------------------------ the proxy server
def test_proxy_server_reconstructs_and_selects_the_model_best_on_its_samples():
    """Prototype gradients of three 4-d samples through Gamma: the proxy infers their labels,
    inverts them (L-BFGS) close to the samples, then keeps the global model most accurate on
    the reconstructed set, which becomes the next task's old model."""
    info = RunInfo(CPU, num_classes=3, seed=0, num_clients=2, train=TrainSpec(rounds=6))
    method = GLFC(GLFC.Params(recon_iters=4, recon_keep=2), info)
    xs, ys = 3 * torch.eye(3, 4), torch.tensor([0, 1, 2])
    grads = [encoder_gradient(method.encoder((4,)), xs[i : i + 1], ys[i : i + 1]) for i in range(3)]

    def model(weight):
        m = Classifier(nn.Identity(), 4, 3)
        with torch.no_grad():
            m.head.weight.copy_(torch.tensor(weight))
            m.head.bias.zero_()
        return m

    candidates = {  # head weights: accuracy 1/3, 1, 2/3 on the samples
        "A": model([[1.0, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]),
        "B": model([[1.0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]]),
        "C": model([[1.0, 0, 0, 0], [0, 1, 1, 0], [0, 0, 0, 0]]),
    }
    server = ServerContext(
        1, candidates["A"].state_dict(), Classifier(nn.Identity(), 4, 3), CPU, None
    )
    method.server_init(server)
    up = Upload(0, 3, {}, 1, extras={PROTO: {"grads": grads, "shape": (4,)}})
    accs = {}
    for rnd, name in enumerate("ACB", start=1):
        server.round, server.global_params = rnd, candidates[name].state_dict()
        method.proxy_step(server, [up] if rnd == 1 else [])
        mon = server.state[MONITOR]
        accs[name] = float((candidates[name](mon["x"]).argmax(1) == mon["y"]).double().mean())
    mon = server.state[MONITOR]
    assert mon["y"].tolist() == [0, 0, 1, 1, 2, 2]  # labels from the gradients, 2 iterates each
    assert (mon["x"] - xs.repeat_interleave(2, 0)).abs().max() < 1e-2  # inverted samples
    assert accs == pytest.approx({"A": 1 / 3, "C": 2 / 3, "B": 1.0})
    best = max(accs, key=accs.get)
    assert all(
        torch.equal(server.state[BEST][k], candidates[best].state_dict()[k])
        for k in server.state[BEST]
    )
    assert server.state[BEST_ACC] == 1.0
    server.task = 1
    method.server_task_begin(server)  # the best model of task 0 is task 1's old model
    assert server.state[OLD] is server.state[BEST] and server.state[BEST_ACC] == 0.0
    assert method.server_broadcast(server)[OLD] is server.state[OLD]


# ------------------------------------------------------------------ LGA
def test_lga_gradient_adaptive_category_balanced_weights():
    g = torch.tensor([0.5, 0.2, 0.8, 0.4, 0.01])
    # task 2: rows 0, 1 new; row 2 of task 0; rows 3, 4 of task 1
    rt = torch.tensor([2, 2, 0, 1, 1])
    a = [v ** (2 / 3) for v in g.tolist()]  # g^(t / (t + 1))
    new = (a[0] + a[1]) / 2
    upto1 = (a[2] + a[3] + a[4]) / 3  # cumulative: task 0's group is row 2, task <= 1's rows 2-4
    cum = [a[0] / new, a[1] / new, 1 + a[2] / upto1, a[3] / upto1, max(a[4] / upto1, 0.5)]
    torch.testing.assert_close(
        adaptive_weights(g, rt, 2, "cumulative", 0.5, 5.0), torch.tensor(cum)
    )
    only1 = (a[3] + a[4]) / 2
    per_task = [a[0] / new, a[1] / new, 1.0, a[3] / only1, max(a[4] / only1, 0.5)]
    torch.testing.assert_close(adaptive_weights(g, rt, 2, "task", 0.5, 5.0), torch.tensor(per_task))
    assert torch.equal(
        adaptive_weights(g, torch.zeros(5, dtype=torch.long), 0, "cumulative", 0.5, 5.0),
        torch.ones(5),
    )


def test_lga_weights_the_distillation_too():
    """lam (L_GC + L_RD) with both terms weighted by w (exponent 1/2 at task 1)."""
    old = identity_model(2.0)
    a = [math.sqrt(1 - P[i][Y[i]]) for i in range(4)]
    w = [
        a[0] / ((a[0] + a[1]) / 2),
        a[1] / ((a[0] + a[1]) / 2),
        a[2] / ((a[2] + a[3]) / 2),
        a[3] / ((a[2] + a[3]) / 2),
    ]
    q = [
        [P[i][0] ** 2 / (P[i][0] ** 2 + P[i][1] ** 2), P[i][1] ** 2 / (P[i][0] ** 2 + P[i][1] ** 2)]
        for i in range(4)
    ]
    target = [q[0] + [1.0, 0.0], q[1] + [0.0, 1.0], q[2] + [0.0, 0.0], q[3] + [0.0, 0.0]]
    kl = [
        sum(t * (math.log(t) - math.log(p)) for t, p in zip(target[i], P[i]) if t > 0)
        for i in range(4)
    ]
    ce = [-math.log(P[i][Y[i]]) for i in range(4)]
    method = LGA(LGA.Params(), split_info())
    ctx, x, y = hand_ctx(method, old=old.state_dict())
    expected = sum(wi * c for wi, c in zip(w, ce)) / 4 + sum(wi * k for wi, k in zip(w, kl)) / 4
    assert math.isclose(method.step_loss(ctx, x, y).item(), expected, rel_tol=1e-6)


def test_lga_weights_are_one_for_a_client_without_memory():
    """The code's w = 1 while the client's learned_classes is empty: a client at task 1 that
    had no rows in task 0 (empty memory) trains by plain CE; GLFC weights it either way [P]."""
    ce = [-math.log(P[i][Y[i]]) for i in range(4)]
    lga = LGA(LGA.Params(), split_info())
    ctx, x, y = hand_ctx(lga, memory=())
    assert math.isclose(lga.step_loss(ctx, x, y).item(), sum(ce) / 4, rel_tol=1e-6)
    ctx, x, y = hand_ctx(lga)  # a memory: the weights of test_lga_weights_the_distillation_too
    assert not math.isclose(lga.step_loss(ctx, x, y).item(), sum(ce) / 4, rel_tol=1e-3)
    w = lga.row_weights(torch.tensor([[0.5, 0.2], [0.5, 0.2]]), torch.ones(2, 2, dtype=torch.long), 1, 1,
                        torch.tensor([[True, True], [True, False]]), torch.tensor([[True], [False]]))  # fmt: skip
    assert w[1].tolist() == [1.0, 0.0] and w[0].tolist() != [1.0, 1.0]  # a stack: per client; padding 0
    glfc = GLFC(GLFC.Params(), split_info())
    ctx, x, y = hand_ctx(glfc, memory=())
    assert not math.isclose(glfc.step_loss(ctx, x, y).item(), sum(ce) / 4, rel_tol=1e-3)


def test_lga_radius_and_prototype_augmentation():
    gen = torch.Generator().manual_seed(0)
    f = torch.randn(9, 3, generator=gen)
    y = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1])

    def sums(rows):
        cls = y[rows].unique()
        oh = (y[rows][:, None] == cls[None]).double()
        return {
            "classes": cls,
            "n": oh.sum(0),
            "sum": oh.T @ f[rows].double(),
            "sq": oh.T @ (f[rows].double() ** 2).sum(1),
        }

    stats = [sums(torch.arange(0, 6)), sums(torch.arange(6, 9))]  # two clients, class 1 split
    traces = [torch.cov(f[y == c].T.double()).trace() / 3 for c in (0, 1)]
    assert math.isclose(pooled_radius(stats), math.sqrt(sum(traces) / 2), rel_tol=1e-9)
    fa, rows = augment_features(f, y, 2.0, 5, torch.Generator().manual_seed(1))
    assert torch.bincount(rows, minlength=9).tolist() == [5] * 9
    scale = torch.stack([f[y == c].var(0) ** 2 for c in (0, 1)])[y[rows]]
    e = fa - f[rows]
    assert ((e * e).sum(1) <= 0.1 * scale.sum(1) + 1e-7).all() and (e != 0).any()
    # the warm-up: the first proxy_init rounds of a task score 0
    info = RunInfo(CPU, num_classes=2, seed=0, num_clients=1, train=TrainSpec(rounds=4))
    lga = LGA(LGA.Params(proxy_init=2), info)
    server = ServerContext(2, {}, None, CPU, None)
    m = Classifier(nn.Identity(), 3, 2)
    assert lga.monitor_accuracy(server, m, f, y) == 0.0
    server.round = 3
    server.state[RADIUS] = 0.0
    exact = float((m(f).argmax(1) == y).double().mean())
    assert lga.monitor_accuracy(server, m, f, y) == exact  # radius 0: the features themselves


# ------------------------------------------------------------------ runs
def test_split_digits_runs_and_fedgp_over_glfc(make_run_config):
    """GLFC on split digits (3 tasks): exemplars of the ended tasks, distillation from the
    proxy's old model from task 1 on, prototype gradients in each task's first round;
    FedGP over GLFC with rate 0 is GLFC bit for bit, with rate 1 it projects."""
    sim, rows = run(digits_cfg(make_run_config, "glfc", FAST, eval_every=1))
    assert [r["glfc_old_model"] for r in rows[1:]] == [0.0, 1.0, 1.0]
    assert (
        "glfc_rd" not in rows[1]
        and rows[2]["glfc_rd"] > 0
        and rows[3]["glfc_memory"] > rows[2]["glfc_memory"] > 0
    )
    assert all(
        r["glfc_proto_grads"] > 0
        and r["glfc_recon_samples"] > 0
        and 0 <= r["glfc_monitor_acc"] <= 1
        for r in rows[1:]
    )
    tasks = {
        int(t) for st in sim.client_state.values() for t in sim.method.class_task[st[KEY]["y"]]
    }
    assert tasks == {0, 1, 2}  # every ended task, the last one too
    assert all(t["accuracy"] == 0.0 for t in rows[1]["_tasks"][1:])  # unseen classes are not scored
    _, rows_off = run(
        digits_cfg(
            make_run_config,
            "fedgp",
            {"base": "glfc", "base_params": FAST, "rate": 0.0},
            eval_every=1,
        )
    )
    assert strip(rows_off, "fedgp_") == strip(rows, "glfc_")
    _, rows_gp = run(digits_cfg(make_run_config, "fedgp", {"base": "glfc", "base_params": FAST}))
    assert rows_gp[-1]["fedgp_glfc_old_model"] == 1.0 and rows_gp[-1]["fedgp_proj_share"] > 0


def test_lga_split_digits_run(make_run_config):
    sim, rows = run(digits_cfg(make_run_config, "lga", {**FAST, "proxy_init": 0}))
    radius = sim.server.state[RADIUS]  # from the clients' task-0 feature sums, not the initial 0.15
    assert radius > 0 and radius != 0.15 and rows[-1]["lga_radius"] == radius
    assert rows[-1]["lga_old_model"] == 1.0 and rows[-1]["lga_rd"] > 0 and rows[-1]["lga_w_old"] > 0


def test_resume_mid_task_and_at_a_task_boundary(make_run_config):
    """LGA (GLFC's state and the radius): checkpoints after round 3 (task 1's first round)
    and round 4 (task 1's end); the resumed runs give the same rows, weights, server and
    client state (memories, old and best models, monitor set, radius)."""
    params = {**FAST, "proxy_init": 0}
    rc = digits_cfg(make_run_config, "lga", params, rounds=6, sample_rate=0.75, eval_every=1)
    scenario = {**rc.dataset.scenario, "rounds_per_task": 2}
    rc = replace(rc, dataset=replace(rc.dataset, scenario=scenario))
    saved, keep = checkpoint_keeper()
    full = Simulation(rc, device=CPU)
    status, rows_full, _ = full.run(progress=False, on_checkpoint=keep)
    assert status == "completed" and full.server.state[OLD] is not None
    for stop in (3, 4):
        resumed = Simulation(rc, device=CPU)
        status, rows, _ = resumed.run(
            progress=False, resume=next(c for c in saved if c["round"] == stop)
        )
        assert status == "completed" and strip(rows) == strip(rows_full)
        assert same(resumed.server.state, full.server.state) and same(
            resumed.client_state, full.client_state
        )
        assert same(resumed.global_params, full.global_params)


# ------------------------------------------------------------------ stacked trainer
@pytest.mark.parametrize(
    "method,model,incremental,loss,order",
    [("glfc", "mlp", "class", "softmax", "natural"),  # every step batched (stacked_forward)
     ("lga", "cnn2d", "task", "sigmoid", "natural"),  # wide steps client by client in replicas (live_alone), tails batched
     ("glfc", "resnet8", "class", "softmax", "natural"),  # BatchNorm: clients whose joined batches differ run apart
     # the stack's padding rows (label 0) of a task whose classes are all masked: NaN weights
     # that the group means summed (found in review; the run diverged)
     ("glfc", "mlp", "task", "softmax", "shuffled")],
)  # fmt: skip
def test_trains_stacked_as_sequential(make_run_config, run_engines, assert_same_metrics, method, model, incremental,
                                      loss, order):  # fmt: skip
    """Issue 32, 3: GLFC's and LGA's step in the stacked trainer, each client's share of its
    memory joined to its minibatch in one forward (``JoinedLive``), its weights normalised
    over its own rows' groups, distilled against the old model, within 1e-5 of one client
    after another (metrics with the proxy's monitor accuracy and the diagnostics, weights,
    memories)."""
    bn = model == "resnet8"  # drop_last: no 1-row batch through BatchNorm (as iCaRL's test)
    params = {**FAST, "memory_size": 30, "loss": loss, **({"proxy_init": 0} if method == "lga" else {})}
    if order == "shuffled":  # without the proxy, whose inversion grows rounding (its recon loss 1.5e-5 apart)
        params["proxy"] = False
    rc = replay_stream_cfg(make_run_config, method, params, model,
                           SMALL_RESNET if bn else SMALL_CNN if model == "cnn2d" else None, incremental,
                           class_order=order, eval_every=1, drop_last=bn, rounds=4,
                           # (at BN_SHORT's lr 0.005 every step stacked put glfc_gc 1.6e-4 apart after 4 rounds)
                           **{**BN_SHORT, "optimizer": {**BN_SHORT["optimizer"], "lr": 0.002}} if bn else {})  # fmt: skip
    out = run_engines(rc)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v)
    assert rows_s[-1][f"{method}_rd"] > 0 and rows_s[-1][f"{method}_memory"] > 0
    for k, v in seq.global_params.items():  # running statistics included
        torch.testing.assert_close(v.float(), vec.global_params[k].float(), atol=1e-4 if bn else 1e-5, rtol=1e-5, msg=k)
    for cid, st in seq.fed.clients.items():  # the memories the two trainers' models chose
        if KEY in st:
            assert torch.equal(st[KEY]["y"], vec.fed.clients[cid][KEY]["y"]), cid


def test_stack_of_clients_on_different_tasks(make_run_config, run_engines, assert_same_metrics, monkeypatch):
    """Asynchronous task boundaries: a round's clients may be on different tasks, each with
    its own old classes, groups and exponent (LGA: t / (t + 1)) in one stack. Without the
    proxy (its L-BFGS inversion turns the trainers' rounding differences into matching
    losses 5e-4 apart here)."""
    rc = replay_stream_cfg(make_run_config, "lga", {"memory_size": 30, "proxy": False}, eval_every=1,
                           sample_rate=1.0)  # fmt: skip
    scenario = {**rc.dataset.scenario, "boundaries": {"samples_per_window": 40, "window_rounds": 1}}
    rc = replace(rc, dataset=replace(rc.dataset, scenario=scenario))
    mixed, loss = [], LGA.glfc_loss

    def spy(self, logits, y, task, *args, **kw):
        mixed.append(isinstance(task, torch.Tensor))
        return loss(self, logits, y, task, *args, **kw)

    monkeypatch.setattr(LGA, "glfc_loss", spy)
    out = run_engines(rc)
    assert any(mixed)  # some stacked steps held clients of two tasks
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v)
    for k, v in seq.global_params.items():
        torch.testing.assert_close(v, vec.global_params[k], atol=1e-5, rtol=1e-5, msg=k)


def test_fedgp_over_glfc_trains_stacked(make_run_config, run_engines, assert_same_metrics):
    """FedGP's projection (step terms) over a base whose step is live terms over joined rows
    (GLFC; iCaRL likewise, tests/methods/test_graphs.py): stacked, within 1e-5 of one client
    after another, on a CNN (wide steps client by client: step terms after live ones there)."""
    rc = replay_stream_cfg(make_run_config, "fedgp", {"base": "glfc", "base_params": {**FAST, "memory_size": 30},
                           "buffer_size": 20}, model="cnn2d", model_options=SMALL_CNN, eval_every=2, rounds=4)  # fmt: skip
    out = run_engines(rc)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v)
    assert rows_s[-1]["fedgp_proj_share"] > 0
    for k, v in seq.global_params.items():
        torch.testing.assert_close(v, vec.global_params[k], atol=1e-5, rtol=1e-5, msg=k)


# ------------------------------------------------------------------ validation
def test_domain_incremental_streams_are_refused(minimal_config):
    for name, params in (("glfc", {}), ("lga", {}), ("fedgp", {"base": "glfc"})):
        cfg = dict(minimal_config)
        cfg["experiments"] = [{
            **minimal_config["experiments"][0],
            "datasets": [{"name": "digits", "model": "cnn2d", "scenario": {"kind": "rotated", "tasks": 2, "rounds_per_task": 1}}],
            "methods": [{"name": name, "params": params}], "train": {"rounds": 2},
        }]  # fmt: skip
        with pytest.raises(FedForgetError, match="scenario.kind='rotated'"):
            parse_config(cfg)


@pytest.mark.parametrize(
    "name,field,value",
    [("glfc", "loss", "ce"), ("glfc", "memory_size", -1), ("glfc", "recon_iters", 0), ("glfc", "recon_lr", 0.0),
     ("glfc", "proxy", "yes"), ("lga", "old_groups", "class"), ("lga", "weight_max", 0.1), ("lga", "augment", 0)],
)  # fmt: skip
def test_bad_hyperparameters_are_rejected(name, field, value):
    with pytest.raises(FedForgetError, match=field):
        check_params(name, {field: value})


def test_defaults():
    glfc = check_params("glfc", {})
    assert glfc == {
        "memory_size": 2000, "loss": "softmax", "lambda_gc": 0.5, "lambda_rd": 0.5, "perturb_iters": 50,
        "perturb_lr": 0.2, "recon_iters": 250, "recon_lr": 0.5, "recon_keep": 20, "recon_inner": 20,
        "best_per_task": True, "proxy": True,
    }  # fmt: skip
    assert check_params("lga", {}) == {
        **glfc, "lambda_gc": 1.0, "lambda_rd": 1.0, "weight_min": 0.5, "weight_max": 5.0,
        "old_groups": "cumulative", "proxy_init": 6, "radius_init": 0.15, "augment": 5,
    }  # fmt: skip
