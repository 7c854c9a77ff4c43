"""FedProTIP: Eq. 8's rank for sigma and sigma^2 on hand-made spectra (randomized SVD = exact);
the server's aggregation orthonormal, spanning exactly the union of the clients' bases, in
client order; projected gradients orthogonal to the bases (conv and linear); a projected round
(wd = 0, momentum = 0) leaving the first layer's outputs on old inputs in span(Phi) unchanged,
which it does not without projection; a client's task-end report over two tasks (bases)
and after-task reply (references = the RMS relevance against the global U_L); TIP routing on tasks in
orthogonal feature subspaces (per sample and per batch, ties, padding), the routed scores; parameter and head checks; split
digits runs (per-task heads bit-identical, communication columns, FedProTIP(-t)) and a resume
from a mid-task checkpoint."""

from __future__ import annotations

import re
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fedforget.activations import input_matrix, layer_dim, project_out, weight_matrix
from fedforget.config import TrainSpec
from fedforget.data.scenario import Scenario, resolve_scenario
from fedforget.engine import Simulation
from fedforget.methods import (
    ClientContext,
    RunInfo,
    ServerContext,
    Upload,
    check_params,
    make_params,
)
from fedforget.methods.base import AFTER_TASK, TASK_END, Summed
from fedforget.methods.fedprotip import (
    BASES,
    BLOCKS,
    COMM,
    FEATURES,
    RANGE_STREAM,
    REFS,
    SUMMARY,
    FedProTIP,
    aggregate_bases,
    core_bases,
    core_rank,
    range_svd,
    references,
    route,
    routed_scores,
    sketch_bases,
    split_blocks,
    weighted_sketch,
)
from fedforget.methods.shared import projected_layers, state_mb
from fedforget.metrics import GEOMETRY_ROWS, GEOMETRY_STREAM
from fedforget.models import TaskHeads, build_model
from fedforget.partition import PartitionSpec
from fedforget.utils import FedForgetError, torch_seed

from .conftest import CPU, SMALL_CNN, SPLIT, checkpoint_keeper, gen, projector, run, strip

PER_TASK = {**SPLIT, "heads": "per_task"}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread is faster, and steadier on a busy 2-core machine (the runs'
    make_run_config sets threads=1 too)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def digits(make_run_config, params, scenario=PER_TASK, **train):
    """conftest.digits_cfg with a scenario of choice (per-task heads by default)."""
    return make_run_config(
        dataset="digits", model="cnn2d", model_options=SMALL_CNN, method="fedprotip", params=params, scenario=scenario,
        partition=PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=10, seed=0),
        **{"rounds": 3, "batch_size": 32, "eval_local_models": False, "eval_every": 3, **train},
    )  # fmt: skip


def orthonormal(d, r, seed):
    return torch.linalg.qr(torch.randn(d, r, generator=gen(seed), dtype=torch.float64))[0]


def method(params=None, scenario=None):
    return FedProTIP(
        make_params("fedprotip", params or {}),
        RunInfo(CPU, 10, 0, 4, TrainSpec(rounds=3), scenario),
    )


# ----------------------------------------------------------------------------- core bases


def test_core_rank_sigma_and_sigma2_on_hand_made_spectra():
    # sigma shares .462 .769 .923 1; sigma^2 shares .632 .912 .982 1
    s = torch.tensor([3.0, 2.0, 1.0, 0.5])
    assert [core_rank(s, e, "sigma") for e in (0.4, 0.6, 0.9, 0.95, 1.0)] == [1, 2, 3, 4, 4]
    assert [core_rank(s, e, "sigma2") for e in (0.4, 0.6, 0.9, 0.95, 1.0)] == [1, 1, 2, 3, 4]
    # sigma^2 with energy already in span(Phi) (GPM): total 28.5, captured 0.5: .816, .956
    assert core_rank(s, 0.9, "sigma2", total=28.5, captured=0.5) == 2
    assert core_rank(s, 0.9, "sigma2", total=28.5, captured=0.95) == 0
    assert core_rank(s, 0.9, "sigma", total=28.5, captured=0.95) == 3  # Eq. 8: a~ alone
    # numerical zeros are never kept; nothing left: r = 0
    assert core_rank(torch.tensor([1.0, 1e-9]), 1.0, "sigma") == 1
    assert core_rank(torch.tensor([1e-9, 1e-10]), 0.7, "sigma", total=1.0) == 0
    assert core_rank(torch.zeros(3), 0.7, "sigma") == 0


@pytest.mark.parametrize("energy", ["sigma", "sigma2"])
def test_rank_rule_is_monotone_in_eps(energy):
    """On random spectra (some with energy already captured): a larger eps never keeps fewer."""
    eps = torch.linspace(0, 1, 41).tolist()
    for seed in range(20):
        s = torch.rand(12, generator=gen(seed)).sort(descending=True).values ** 3
        captured = 0.3 * (seed % 2)
        total = float((s * s).sum()) / (1 - captured)
        ranks = [core_rank(s, e, energy, total, captured) for e in eps]
        assert ranks == sorted(ranks) and ranks[0] == 0 and ranks[-1] >= 1, (seed, ranks)


@pytest.mark.parametrize("svd", ["randomized", "exact"])
def test_core_bases_on_a_hand_made_matrix(svd):
    q, v = orthonormal(6, 4, 1), orthonormal(5, 4, 2)
    a = (q * torch.tensor([3.0, 2.0, 1.0, 0.5], dtype=torch.float64)) @ v.T
    u = core_bases(a, None, 0.6, "sigma", svd, gen(3))
    assert u.shape == (6, 2) and u.dtype == torch.float32
    torch.testing.assert_close(projector(u), projector(q[:, :2]), atol=1e-5, rtol=0)
    assert core_bases(a, None, 0.6, "sigma2", svd, gen(3)).shape == (6, 1)
    # an old basis: Eq. 6 removes its span, the residual's spectrum is 2, 1, 0.5 (.571 .857)
    u = core_bases(a, q[:, :1].float(), 0.6, "sigma", svd, gen(3))
    torch.testing.assert_close(projector(u), projector(q[:, 1:3]), atol=1e-5, rtol=0)
    assert core_bases(a, q.float(), 0.6, "sigma", svd, gen(3)).shape == (6, 0)  # nothing left


def test_aggregation_is_orthonormal_and_spans_the_union_in_client_order():
    q = orthonormal(10, 8, 4)
    old = q[:, :2]
    u0 = q[:, 2:5]  # clients' bases orthogonal to the old span, overlapping each other
    u1 = torch.linalg.qr(torch.stack([q[:, 3] + q[:, 4], q[:, 5]], 1))[0]
    u2 = q[:, 2:4] @ orthonormal(2, 2, 5)  # inside client 0's span
    u3 = torch.linalg.qr(q[:, 5:8] @ torch.randn(3, 2, generator=gen(6), dtype=torch.float64))[0]
    clients = [u.float() for u in (u0, u1, u2, u3)]  # as transmitted
    new = aggregate_bases(old.float(), clients)
    phi = torch.cat([old, new], 1)
    torch.testing.assert_close(
        phi.T @ phi, torch.eye(phi.shape[1], dtype=phi.dtype), atol=1e-6, rtol=0
    )
    union = torch.cat([u.double() for u in clients], 1)
    assert new.shape[1] == torch.linalg.matrix_rank(union, atol=1e-4) == 6  # q_2 .. q_7
    for u in clients:  # every client's basis lies in the aggregated span
        assert (u.double() - new @ (new.T @ u.double())).norm() < 1e-5
    assert (new - union @ torch.linalg.pinv(union) @ new).norm() < 1e-5  # and nothing else
    # through the server hook: client id order, per-task blocks, global Phi^T Phi = I
    m, server = method(), ServerContext(1, {}, build_model("mlp", (10,), 4), CPU, None)
    server.state[BASES], server.state[BLOCKS], server.state["fedprotip_ended"] = (
        {"l": old.float()},
        {"l": [2]},
        1,
    )
    m.server_collect(TASK_END, server, {7: {"bases": {"l": clients[1]}}, 3: {"bases": {"l": clients[0]}}})
    phi = server.state[BASES]["l"]
    assert server.state[BLOCKS]["l"] == [2, 4]
    torch.testing.assert_close(phi.T @ phi, torch.eye(6), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        projector(phi[:, 2:5]), projector(u0), atol=1e-5, rtol=0
    )  # client 3 first


def test_weighted_gaussian_sketch_recovers_the_union_or_its_leading_directions():
    """App. F.2 (Eq. 40): B_k = U_k diag(sigma_k) G_k; the server reads the sum. With as many
    columns as the union's rank it spans exactly what Eq. 9 aggregates from the bases
    themselves; with fewer, that many orthonormal directions inside the union, orthogonal
    to the old bases; zero sketches add nothing."""
    q = orthonormal(12, 9, 7)
    old = q[:, :2].float()
    us = [q[:, 2:5], torch.linalg.qr(q[:, 4:8] @ orthonormal(4, 3, 8))[0]]  # overlapping in q_4
    sig = [torch.tensor([3.0, 1.0, 0.2], dtype=torch.float64), torch.tensor([2.0, 0.5, 0.1], dtype=torch.float64)]
    b = [weighted_sketch(u.float(), s, 12, gen(10 + k)) for k, (u, s) in enumerate(zip(us, sig))]
    g0 = torch.randn(3, 12, generator=gen(10), dtype=torch.float64)
    torch.testing.assert_close(b[0].double(), (us[0].float().double() * sig[0]) @ g0, atol=1e-5, rtol=1e-6)
    assert b[0].dtype == torch.float32 and b[0].shape == (12, 12)
    phi = sketch_bases(old, b[0].double() + b[1].double())
    union = aggregate_bases(old, [u.float() for u in us])
    assert phi.shape[1] == union.shape[1] == 6  # q_2 .. q_7
    torch.testing.assert_close(projector(phi), projector(union), atol=1e-5, rtol=0)
    torch.testing.assert_close(phi.T @ phi, torch.eye(6, dtype=phi.dtype), atol=1e-6, rtol=0)
    assert (old.double().T @ phi).abs().max() < 1e-6
    few = sketch_bases(old, sum(weighted_sketch(u.float(), s, 2, gen(20 + k)).double() for k, (u, s) in enumerate(zip(us, sig))))
    assert few.shape[1] == 2 and (few - union @ (union.T @ few)).norm() < 1e-5  # inside the union
    assert (old.double().T @ few).abs().max() < 1e-6
    assert sketch_bases(old, torch.zeros(12, 5)).shape == (12, 0)


@pytest.mark.parametrize("rank", [90, 250])
def test_range_svd_finds_the_numerical_range_of_a_low_rank_sum(rank):
    """The server's range finder on a 250 x 240 sum of rank 90 (stops at 128 test columns)
    or of full numerical rank (falls back to the exact SVD): the directions it keeps (above
    the float32 rank tolerance) span what the exact SVD's do, with the same count."""
    d, cols = 250, 240
    left = orthonormal(d, min(rank, cols), 70) * torch.logspace(0, -2, min(rank, cols), dtype=torch.float64)
    b = (left @ torch.randn(min(rank, cols), cols, generator=gen(71), dtype=torch.float64)).float().double()
    tol = lambda s: max(d, cols) * torch.finfo(torch.float32).eps * float(s[0])  # noqa: E731
    u, s = range_svd(b, gen(72))
    ue, se, _ = torch.linalg.svd(b, full_matrices=False)
    keep, keep_e = u[:, s > tol(s)], ue[:, se > tol(se)]
    assert keep.shape[1] == keep_e.shape[1] == min(rank, cols)
    assert len(s) == (128 if rank == 90 else cols)
    torch.testing.assert_close(projector(keep), projector(keep_e), atol=1e-6, rtol=0)


@pytest.mark.parametrize("sketch", ["full", 3])
def test_sketched_task_end_reports_and_aggregation(sketch):
    """Through the hooks: a client's sketched report is [d_l, s_l] per layer (s_l = d_l for
    full), keyed; from one client the full sketch aggregates to the span its own bases do,
    3 columns to at most 3 directions inside it; comm_bases_mb counts d_l * s_l floats."""
    torch.manual_seed(0)
    model = build_model("cnn2d", (1, 8, 8), 10, SMALL_CNN)
    x = torch.randn(12, 1, 8, 8, generator=gen(30))
    data = SimpleNamespace(sample=lambda n, g: (x[:n], None))

    def report(params):
        m, ctx = client(model, {}, task=0, params={"samples": 64, **params}, data=data)
        server = ServerContext(1, {}, model, CPU, None)
        rep = m.client_reply(TASK_END, ctx)
        sent = rep["bases"].parts if isinstance(rep["bases"], Summed) else rep["bases"]
        sent = dict(sent)  # what the server reads (a share is not consumed unfolded)
        m.server_collect(TASK_END, server, {0: rep})
        return sent, server.state

    plain, st_plain = report({})
    assert not isinstance(plain, Summed)  # bases are sent as they are: the server concatenates them
    sk, st = report({"sketch": sketch})
    assert set(sk) == set(plain) == {*projected_layers(model), FEATURES}
    layers = projected_layers(model)
    dims = {k: layer_dim(m) for k, m in layers.items()} | {FEATURES: plain[FEATURES].shape[0]}
    for name, b in sk.items():
        cols = dims[name] if sketch == "full" else sketch
        assert b.shape == (dims[name], cols) and b.dtype == torch.float32, name
        phi, own = st[BASES][name].double(), plain[name].double()
        if sketch == "full":
            torch.testing.assert_close(projector(phi), projector(own), atol=1e-5, rtol=0, msg=name)
        else:
            assert phi.shape[1] <= min(3, own.shape[1]) and (phi - own @ (own.T @ phi)).norm() < 1e-4, name
    assert torch.equal(report({"sketch": sketch})[0][FEATURES], sk[FEATURES])  # keyed
    expected = sum(d * (d if sketch == "full" else sketch) for d in dims.values()) * 4 / 1e6
    assert st[COMM][-1]["comm_bases_mb"] == pytest.approx(expected)
    assert st_plain[COMM][-1]["comm_bases_mb"] == pytest.approx(sum(u.numel() for u in plain.values()) * 4 / 1e6)


# ----------------------------------------------------------------------------- local training


def client(model, broadcast, task=1, lr=0.1, params=None, data=None):
    m = method(params)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0, weight_decay=0.0)
    ctx = ClientContext(cid=0, round=2, model=model, optimizer=opt, global_params={}, broadcast=broadcast,
                        state={}, n_samples=8, lr=lr, local_epochs=1, batch_size=8, task=task, data=data)  # fmt: skip
    m.client_begin(ctx)
    return m, ctx


TINY_VIT = {"image_size": 8, "patch_size": 4, "layers": 1, "heads": 2, "hidden_dim": 8, "mlp_dim": 16}


@pytest.mark.parametrize("model_name", ["cnn2d", "vit"])
def test_projected_gradient_is_orthogonal_to_the_bases_conv_and_linear(model_name):
    """Every projected layer's gradient is orthogonal to its bases; on a ViT (Table 7) these
    include the attention's in_proj and out_proj (models.SelfAttention)."""
    torch.manual_seed(0)
    model = build_model(model_name, (1, 8, 8), 10, SMALL_CNN if model_name == "cnn2d" else TINY_VIT)
    layers = projected_layers(model)
    if model_name == "vit":
        assert {n.rsplit(".", 1)[-1] for n in layers} >= {"in_proj", "out_proj", "conv_proj", "0", "3", "head"}
    bases = {n: orthonormal(weight_matrix(m).shape[1], max(1, weight_matrix(m).shape[1] // 3), i).float()
             for i, (n, m) in enumerate(layers.items())}  # fmt: skip
    m, ctx = client(model, {BASES: bases})
    m.client_step(ctx, torch.randn(8, 1, 8, 8, generator=gen(2)), torch.arange(8))
    m.client_grad(ctx)
    kinds = set()
    for name, layer in layers.items():
        g = layer.weight.grad.reshape(layer.weight.shape[0], -1)
        scale = g.abs().max().item()
        assert scale > 1e-6 and (g @ bases[name]).abs().max() < 1e-6 * max(scale, 1.0), name
        assert layer.bias.grad is None  # bias: freeze
        kinds.add(type(layer).__name__)
    assert kinds == {"Conv2d", "Linear"}
    if model_name == "vit":  # the 1-D LayerNorm parameters are held too; the tokens are not
        params = dict(model.named_parameters())
        assert all(params[n].grad is None for n in params if ".ln" in n)
        assert params["body.vit.class_token"].grad is not None


@pytest.mark.parametrize("project", [True, False])
def test_a_projected_round_keeps_first_layer_outputs_on_old_inputs(project):
    """Task 0's bases from the method's own task end (client, then server), then three
    steps on task 1 (wd 0, momentum 0): the first layer's outputs on the old inputs' part in
    span(Phi) stay put (its inputs do not depend on the weights: exact); without the bases
    they move."""
    torch.manual_seed(0)
    model = build_model("cnn2d", (1, 8, 8), 10, SMALL_CNN)
    x_old, x_new = (
        torch.randn(16, 1, 8, 8, generator=gen(1)),
        torch.randn(8, 1, 8, 8, generator=gen(2)),
    )
    data = SimpleNamespace(sample=lambda m, g: (x_old[:m], None))
    m, ctx = client(model, {}, task=0, params={"threshold": 0.3, "samples": 64}, data=data)
    server = ServerContext(1, {}, model, CPU, None)
    m.server_collect(TASK_END, server, {0: m.client_reply(TASK_END, ctx)})
    conv = projected_layers(model)["body.0"]
    phi = server.state[BASES]["body.0"]
    assert 0 < phi.shape[1] < phi.shape[0]  # a proper subspace
    a = input_matrix(conv, x_old)
    a_in = phi @ (phi.T @ a)
    before = weight_matrix(conv) @ a_in + conv.bias[:, None]
    m, ctx = client(model, m.server_broadcast(server) if project else {}, lr=0.5)
    for _ in range(3):
        ctx.optimizer.zero_grad(set_to_none=True)
        m.client_step(ctx, x_new, torch.arange(8))
        m.client_grad(ctx)
        ctx.optimizer.step()
    after = weight_matrix(conv) @ a_in + conv.bias[:, None]
    if project:
        torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    else:
        assert (after - before).abs().max() > 1e-2


def test_task_end_reports_bases_then_references_against_the_global_bases():
    """Alg. 1 lines 12-13 for one client over two tasks: the task-end report holds bases of
    every layer and of the final layer's input; after the server's aggregation the
    after-task reply holds the references of each task it had data in = the RMS of its
    samples' relevance against the GLOBAL U_L of every learned task (Sec. 4.4)."""
    torch.manual_seed(0)
    model = build_model("cnn2d", (1, 8, 8), 10, SMALL_CNN)
    xs = [torch.randn(12, 1, 8, 8, generator=gen(20 + t)) for t in range(2)]
    server, state, reports, replies = ServerContext(1, {}, model, CPU, None), {}, [], []
    for t, x in enumerate(xs):
        data = SimpleNamespace(sample=lambda n, g, x=x: (x[:n], None))
        m, ctx = client(
            model, method().server_broadcast(server), task=t, params={"samples": 64}, data=data
        )
        ctx.state = state
        reports.append(m.client_reply(TASK_END, ctx))
        assert model.training  # the mode is restored
        assert "refs" not in reports[-1]
        m.server_collect(TASK_END, server, {0: reports[-1]})
        ctx.broadcast = m.server_broadcast(server)  # as the engine's after-task pass gives it
        replies.append(m.client_reply(AFTER_TASK, ctx))
        m.server_collect(AFTER_TASK, server, {0: replies[-1]})
        assert server.state[REFS][0] is replies[-1]
        assert server.state[COMM][-1]["comm_refs_mb"] == sum(w.numel() * 4 for w in replies[-1].values()) / 1e6
    assert set(reports[0]["bases"]) == {*projected_layers(model), FEATURES}
    with torch.no_grad():
        z = [model.eval().features(x).double() for x in xs]
    glob = [u.double() for u in split_blocks(server.state[BASES], server.state[BLOCKS])]
    own0 = reports[0]["bases"][FEATURES].double()
    torch.testing.assert_close(projector(glob[0]), projector(own0), atol=1e-6, rtol=0)
    torch.testing.assert_close(replies[0][0].double(), relevance_rms(z[0], glob[:1]), atol=1e-5, rtol=1e-4)
    assert set(replies[1]) == {0, 1} and set(state[SUMMARY]) == {0, 1} and len(glob) == 2
    for tau in (0, 1):
        expected = relevance_rms(z[tau], glob)
        torch.testing.assert_close(replies[1][tau].double(), expected, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- TIP


def task_features(q, task, n, seed):
    """Rows in task ``task``'s 4-dim subspace of R^12 (non-negative-like: a mean offset)."""
    c = 1.0 + 0.3 * torch.randn(n, 4, generator=gen(seed), dtype=torch.float64)
    return c @ q[:, 4 * task : 4 * task + 4].T + 0.02 * torch.randn(
        n, 12, generator=gen(seed + 1), dtype=torch.float64
    )


def test_route_recovers_tasks_in_orthogonal_subspaces():
    q = orthonormal(12, 12, 8)
    blocks = [q[:, 4 * t : 4 * t + 2] for t in range(3)]  # U_L^(t): part of each task's span
    holdings = {0: [0, 1, 2], 1: [0, 2], 2: [1, 2]}  # the tasks each client had data in
    refs = {}
    for k, tasks in holdings.items():
        refs[k] = {}
        for t in tasks:
            z = task_features(q, t, 40, 100 * k + t)
            refs[k][t] = references(z.T @ z / len(z), blocks)
            rms = relevance_rms(z, blocks)  # Eq. 10's summary: the RMS of the per-sample relevance
            torch.testing.assert_close(refs[k][t].double(), rms, atol=1e-5, rtol=1e-5)
    tests = [task_features(q, t, 30, 1000 + t) for t in range(3)]
    z = torch.cat(tests)
    truth = torch.arange(3).repeat_interleave(30)
    assert torch.equal(route(z, blocks, refs), truth)
    for t, zt in enumerate(tests):  # per batch: one routing for all rows
        assert torch.equal(route(zt, blocks, refs, batch=True), torch.full((30,), t))
    mixed = route(torch.cat([tests[0][:5], tests[2]]), blocks, refs, batch=True)
    assert torch.equal(mixed, torch.full((35,), 2))
    # ties: lowest task id; short vectors padded with 0; a learned task without bases counts
    e = torch.eye(3)
    tie = {0: {1: e[1]}, 1: {2: e[2]}}
    assert route(z[:4], blocks, tie).tolist() == [1] * 4
    short = {0: {0: torch.tensor([1.0]), 1: torch.tensor([0.0, 1.0])}}
    assert route(tests[1][:3], blocks[:2] + [q[:, :0]], short).tolist() == [1] * 3


def relevance_rms(z, blocks):
    return torch.stack([(z @ u).norm(dim=1).pow(2).mean().sqrt() for u in blocks])


def test_routed_scores_use_the_routed_head_on_its_classes():
    torch.manual_seed(0)
    heads = TaskHeads(5, 6, [[0, 1], [2, 3], [4, 5]])
    z, task = torch.randn(4, 5), torch.tensor([0, 2, 1, 2])
    scores = routed_scores(heads, z, task)
    y = torch.tensor([1, 4, 3, 5])
    assert torch.isfinite(F.cross_entropy(scores, y))
    for i, t in enumerate(task.tolist()):
        cls = heads.task_classes[t]
        torch.testing.assert_close(scores[i, cls], heads.heads[t](z[i])[cls])
        others = [c for c in range(6) if c not in cls]
        assert scores[i, others].max() <= scores[i, cls].min() - 29.9
        assert scores[i].argmax().item() in cls


# ----------------------------------------------------------------------------- checks


def test_bad_params_are_refused_naming_the_value():
    bads = ({"threshold": 1.5}, {"threshold": 0}, {"threshold_step": -0.1}, {"energy": "l1"}, {"samples": 0}, {"svd": "qr"},
            {"tip": "oracle"}, {"freeze_early": "yes"}, {"bias": "augment"}, {"sketch": 0}, {"sketch": "half"},
            {"sketch": 1.5}, {"sketch": True}, {"projection": "server"})  # fmt: skip
    for bad in bads:
        ((k, v),) = bad.items()
        with pytest.raises(FedForgetError, match=re.escape(f"{k}={v!r}")):
            check_params("fedprotip", bad)
    assert check_params("fedprotip", {})["samples"] == 512


def scenario(heads, tasks=3):
    raw = {**SPLIT, "heads": heads, "tasks": tasks}
    return Scenario.build(resolve_scenario(raw, 10, (1, 8, 8), "scenario"), 10, (1, 8, 8), tasks)


def test_tip_needs_per_task_heads_and_tip_none_a_shared_one():
    with pytest.raises(
        FedForgetError,
        match=r"tip='sample'.*scenario.heads='per_task'.*got scenario.heads='shared' \(or, for these heads, tip: none\)",
    ):
        method({}, scenario("shared"))
    with pytest.raises(
        FedForgetError,
        match=r"tip='none'.*scenario.heads='shared'.*got scenario.heads='per_task' \(or, for these heads, tip: sample \| batch\)",
    ):
        method({"tip": "none"}, scenario("per_task"))
    assert method({"tip": "batch"}, scenario("per_task")).routes
    assert not method({}, scenario("shared", tasks=1)).routes  # one task: nothing to route
    # the same check when the config is validated, before any job
    from fedforget.parse import parse_config

    raw = {"experiments": [{
        "name": "e", "seeds": [0], "train": {"rounds": 3},
        "datasets": [{"name": "digits", "model": "cnn2d", "scenario": {**SPLIT, "heads": "shared"}}],
        "partitions": [{"scheme": "iid", "clients": 2}], "methods": [{"name": "fedprotip"}],
    }]}  # fmt: skip
    with pytest.raises(FedForgetError, match=r"datasets\[0\].scenario \(method 'fedprotip'\): method 'fedprotip': tip='sample'"):
        parse_config(raw)


# ----------------------------------------------------------------------------- runs


def test_split_digits_run_heads_frozen_bases_references_and_communication(make_run_config):
    rc = digits(make_run_config, {"samples": 64})
    heads = {}

    def keep(row):
        heads[row["round"]] = {
            k: v.clone() for k, v in sim.global_params.items() if k.startswith("head.")
        }

    sim = Simulation(rc, device=CPU)
    status, rows, msg = sim.run(progress=False, on_row=keep)
    assert status == "completed", msg
    for t in range(3):  # head t trained in round t + 1 only, bit-identical afterwards
        key = f"head.heads.{t}.weight"
        assert not torch.equal(heads[t + 1][key], heads[t][key])
        assert all(torch.equal(heads[r][key], heads[t + 1][key]) for r in range(t + 1, 4))
    st = sim.server.state
    assert st["fedprotip_ended"] == 3 and all(len(b) == 3 for b in st[BLOCKS].values())
    for name, phi in st[BASES].items():
        torch.testing.assert_close(
            phi.T @ phi, torch.eye(phi.shape[1]), atol=1e-5, rtol=0, msg=name
        )
        assert sum(st[BLOCKS][name]) == phi.shape[1]
    assert len(split_blocks(st[BASES], st[BLOCKS])) == 3 and FEATURES in st[BASES]
    with_data = {k for k in range(4) if any(sim.clients.size(k, t) for t in range(3))}
    assert set(st[REFS]) == with_data
    for k, refs in st[REFS].items():  # each client's latest vectors: one entry per task so far
        assert set(refs) == set(sim.client_state[k][SUMMARY]) and all(
            len(w) >= 1 for w in refs.values()
        )
    model_mb = state_mb(sim.global_params)
    for row, comm in zip(rows[1:], st[COMM]):
        assert row["fedprotip_comm_model_mb"] == pytest.approx(model_mb)
        assert row["fedprotip_comm_bases_mb"] > 0 or comm["task"] > 0
        assert row["fedprotip_comm_task_mb"] == pytest.approx(
            model_mb + comm["comm_bases_mb"] + comm["comm_refs_mb"]
        )
        assert 0 < row["fedprotip_basis_fill_mean"] <= 1 and row["fedprotip_features_rank"] > 0
        per_layer = [v for k, v in row.items() if k.startswith("fedprotip_basis_fill_") and k != "fedprotip_basis_fill_mean"]
        assert per_layer and all(0 <= v <= 1 for v in per_layer)  # issue 33, 4: each layer's own fill
        assert row["fedprotip_basis_fill_mean"] == pytest.approx(sum(per_layer) / len(per_layer))
    assert rows[1]["fedprotip_comm_refs_mb"] == pytest.approx(4e-6)  # one scalar per client
    assert all(r["global_model_test_loss"] < 1e3 for r in rows)  # routed scores stay finite
    x = sim.evaluator.test.x[:40]
    routed = sim.method.route_inputs(sim.server, sim.model_with(sim.global_params).eval(), x)
    assert routed.shape == (40,) and 0 <= int(routed.min()) and int(routed.max()) < 3
    # the other inference modes per task (eval_counts): tip sample is the run's own accuracy;
    # task identity accuracy = the share of a task's test rows routed to it
    modes = {"task_aware", "agnostic", "tip_sample", "tip_batch", "task_id_sample", "task_id_batch"}
    assert {k for r in rows[0]["_tasks"] for k in r} & modes == {"task_aware", "agnostic"}  # no references yet
    model = sim.model_with(sim.global_params).eval()
    for r in rows[-1]["_tasks"]:
        assert modes <= set(r) and r["tip_sample"] == r["accuracy"]
        ((xt, yt),) = sim.evaluator.test.batches(r["task"], sim.scenario, 10**6)
        own = (sim.method.route_inputs(sim.server, model, xt) == r["task"]).double().mean()
        assert r["task_id_sample"] == pytest.approx(float(own))
        cls = torch.tensor(sim.scenario.task_classes[r["task"]])
        with torch.no_grad():
            pred = cls[model.head.heads[r["task"]](model.features(xt))[:, cls].argmax(1)]
        assert r["task_aware"] == pytest.approx(float((pred == yt).double().mean()))
        with torch.no_grad():
            newest = model.head.combined(model.features(xt)).argmax(1)
        assert r["agnostic"] == pytest.approx(float((newest == yt).double().mean()))
    # one body pass per scoring of a test batch: TIP's scores, the task-aware ones, eval_counts
    passes = []
    model.body.register_forward_hook(lambda *a: passes.append(1))
    ev = sim.evaluator
    batches = sum(1 for _ in ev.test.batches(0, sim.scenario, ev.batch_size))
    ev.task_scores(model, 0)
    assert len(passes) == 3 * batches


def test_split_digits_run_on_a_vit_with_bases_of_its_attention(make_run_config):
    """FedProTIP on a (tiny) ViT, per-task heads, TIP: every attention projection gets bases."""
    rc = digits(make_run_config, {"samples": 32})
    rc = replace(rc, dataset=replace(rc.dataset, model="vit", model_options=TINY_VIT))
    sim, rows = run(rc)
    bases = sim.server.state[BASES]
    for kind in ("self_attention.in_proj", "self_attention.out_proj", "mlp.0", "mlp.3"):
        phi = bases[f"body.vit.encoder.layers.encoder_layer_0.{kind}"]
        assert phi.shape[1] > 0, kind
    assert rows[-1]["fedprotip_basis_fill_body_vit_encoder_layers_encoder_layer_0_self_attention_in_proj"] > 0


def test_fedprotip_minus_t_runs_with_a_shared_head(make_run_config):
    sim, rows = run(digits(make_run_config, {"tip": "none", "samples": 32}, scenario=SPLIT))
    st = sim.server.state
    assert "head" in st[BASES] and FEATURES not in st[BASES] and not st.get(REFS)
    assert all(r["fedprotip_comm_refs_mb"] == 0 for r in rows[1:])


def test_resume_from_a_mid_task_checkpoint_equals_the_uninterrupted_run(make_run_config):
    rc = digits(make_run_config, {"samples": 48}, scenario={**PER_TASK, "rounds_per_task": 2},
                    rounds=6, sample_rate=0.5, eval_every=1)  # fmt: skip
    full, rows_full = run(rc)
    saved, keep = checkpoint_keeper()

    class Crash(Exception):
        pass

    def crash(row):
        if row["round"] == 3:
            raise Crash

    with pytest.raises(Crash):
        Simulation(rc, device=CPU).run(progress=False, on_row=crash, on_checkpoint=keep)
    ckpt = saved[-1]
    assert ckpt["round"] == 3 and ckpt["tasks"]["server"] == 1 and ckpt["server_state"][REFS]
    torch.manual_seed(12345)
    resumed = Simulation(rc, device=CPU)
    status, rows, msg = resumed.run(progress=False, resume=ckpt)
    assert status == "completed", msg
    assert strip(rows) == strip(rows_full)
    assert all(torch.equal(v, resumed.global_params[k]) for k, v in full.global_params.items())
    lost = {**ckpt, "server_state": {}}  # not vacuous: without the bases and references it differs
    _, rows_lost, _ = Simulation(rc, device=CPU).run(progress=False, resume=lost)
    assert strip(rows_lost) != strip(rows_full)


@pytest.mark.parametrize(
    "model,params",
    [
        ("cnn2d", {"tip": "none", "samples": 32}),
        ("cnn2d", {"tip": "none", "samples": 32, "freeze_early": True}),
        ("mlp", {"tip": "none", "samples": 32, "freeze_early": True, "bias": "free"}),
    ],
    ids=["cnn2d", "cnn2d-early", "mlp-early-free"],
)
def test_fedprotip_minus_t_trains_stacked_as_sequential(
    make_run_config, run_engines, assert_same_metrics, assert_same_weights, model, params
):  # fmt: skip
    """FedProTIP(-t) (one shared head) on the stacked trainer: its projection and held
    parameters are the step terms' gradient map (``projection_map``), the same for every
    client of the stack; metrics within 1e-5 of the sequential trainer's (cnn2d on a CPU: wide
    steps client by client, tails batched; an MLP: every step batched), 2 local epochs with
    momentum and weight decay, the frozen parameters untouched by both."""
    rc = digits(make_run_config, params, scenario=SPLIT, local_epochs=2, sample_rate=0.75,
                optimizer={"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3})  # fmt: skip
    rc = replace(rc, dataset=replace(rc.dataset, model=model, model_options=SMALL_CNN if model == "cnn2d" else {}))
    out = run_engines(rc)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v)
    assert seq.server.state[BASES]
    assert_same_weights(seq, vec)


def test_split_digits_run_with_a_sketch(make_run_config):
    """A whole run sends sketches of s_l = 4 columns: every task adds at most 4 directions
    per layer, the bases stay orthonormal, TIP routes, and each task's comm_bases_mb is the
    sketches' size."""
    sim, rows = run(digits(make_run_config, {"samples": 32, "sketch": 4}))
    st = sim.server.state
    for name, phi in st[BASES].items():
        torch.testing.assert_close(phi.T @ phi, torch.eye(phi.shape[1]), atol=1e-5, rtol=0, msg=name)
        assert all(r <= 4 for r in st[BLOCKS][name]) and sum(st[BLOCKS][name]) == phi.shape[1]
    assert st[REFS] and len(split_blocks(st[BASES], st[BLOCKS])) == 3
    model = sim.model_with(sim.global_params)
    dims = [layer_dim(m) for m in projected_layers(model).values()] + [st[BASES][FEATURES].shape[0]]
    for comm in st[COMM]:
        clients = comm["reporting_clients"]
        assert clients and comm["comm_bases_mb"] == pytest.approx(sum(dims) * 4 * 4 / 1e6)


def test_the_server_holds_one_summed_sketch_not_one_a_client(make_run_config, monkeypatch):
    """Sketches are ``Summed`` shares the trainers fold as the reports arrive: when a client
    sketches, at most one earlier client's sketches are alive (the first, until the second is
    added), and the server reads one total of every reporting client (the task-end replies
    come one client at a time with either trainer; the fold's paths: tests/methods/test_fot.py)."""
    import gc
    import weakref

    shares, collected = [], []
    made, seen = FedProTIP.report_bases, FedProTIP.collect_bases

    def report(self, ctx):
        gc.collect()
        assert sum(r() is not None for r in shares) <= 1, "earlier clients' sketches are still held"
        out = made(self, ctx)
        shares.append(weakref.ref(out["bases"]))
        return out

    def collect(self, server, reports):
        totals = {id(r["bases"]) for r in reports.values()}
        collected.append((len(totals), [r["bases"].clients for r in reports.values()], len(reports)))
        return seen(self, server, reports)

    monkeypatch.setattr(FedProTIP, "report_bases", report)
    monkeypatch.setattr(FedProTIP, "collect_bases", collect)
    sim, _ = run(digits(make_run_config, {"samples": 32, "sketch": 4}))
    assert len(collected) == 3 and len(shares) > 3 and sim.server.state[BASES]
    for distinct, clients, n in collected:
        assert distinct == 1 and clients == [n] * n and n >= 1


def test_asynchronous_task_ends_sum_the_waiting_sketches_in_client_order(make_run_config, monkeypatch):
    """Under asynchronous boundaries clients that moved on reported in earlier rounds: their
    sketches wait unfolded (``Summed``) and the server's new bases are ``sketch_bases`` of their
    float64 sum in client id order, each layer keyed by its place."""
    seen, checked = FedProTIP.collect_bases, []

    def collect(self, server, reports):
        order = sorted(reports)
        if reports and all(isinstance(reports[c]["bases"], Summed) for c in order):
            old = dict(server.state.get(BASES, {}))
            names = list(reports[order[0]]["bases"].parts)
            total = {n: sum(reports[c]["bases"].parts[n].double() for c in order) for n in names}
            seen(self, server, reports)
            for i, n in enumerate(names):
                g = torch.Generator().manual_seed(torch_seed(0, server.task, RANGE_STREAM, i))
                new = sketch_bases(old.get(n), total[n], g).float()
                assert torch.equal(server.state[BASES][n][:, old[n].shape[1] if n in old else 0 :], new), n
            checked.append(len(order))
            return None
        return seen(self, server, reports)

    monkeypatch.setattr(FedProTIP, "collect_bases", collect)
    scenario = {**SPLIT, "rounds_per_task": 2, "boundaries": {"samples_per_window": 70, "window_rounds": 2}}
    run(make_run_config(
        dataset="digits", model="cnn2d", model_options=SMALL_CNN, method="fedprotip", scenario=scenario,
        params={"samples": 24, "sketch": 4, "tip": "none"}, rounds=6, batch_size=32, eval_local_models=False,
        partition=PartitionSpec("dirichlet", clients=5, alpha=0.5, min_size=10, seed=0), sample_rate=0.75,
    ))  # fmt: skip
    assert checked and max(checked) > 1


def test_global_projection_projects_the_aggregated_update_not_the_steps():
    """Sec. 6.3's baseline (projection: global): a client's step map only holds (1-D
    parameters: no projection of its weight gradients); the server's new weights are
    FedAvg's with each based layer's update W - W_old projected out of span(Phi) (and only
    those: a layer without bases, the features key, keep FedAvg's)."""
    torch.manual_seed(0)
    model = build_model("cnn2d", (1, 8, 8), 10, SMALL_CNN)
    layers = list(projected_layers(model))
    old = {k: v.detach().clone() for k, v in model.state_dict().items()}
    d0 = layer_dim(projected_layers(model)[layers[0]])
    bases = {layers[0]: orthonormal(d0, 3, 40).float(), FEATURES: orthonormal(128, 2, 41).float()}
    ups = [
        Upload(k, 10 + k, {n: v + 0.1 * torch.randn(v.shape, generator=gen(50 + k)) for n, v in old.items()}, 1)
        for k in range(3)
    ]
    results = {}
    for proj in ("local", "global"):
        m = method({"projection": proj})
        server = ServerContext(1, dict(old), model, CPU, None)
        server.state[BASES] = bases
        m.server_aggregate(server, ups)
        results[proj] = server.global_params
    fedavg, glob = results["local"], results["global"]
    w = f"{layers[0]}.weight"
    delta = (glob[w] - old[w]).reshape(glob[w].shape[0], -1).double()
    assert (delta @ bases[layers[0]].double()).abs().max() < 1e-6  # the update leaves span(Phi)
    torch.testing.assert_close(glob[w], old[w] + project_out(fedavg[w] - old[w], bases[layers[0]]))
    assert all(torch.equal(glob[k], fedavg[k]) for k in old if k != w)
    # the local step: the weight gradients pass unprojected, the biases are held
    grads = {f"{n}.weight": torch.randn(1, *old[f"{n}.weight"].shape, generator=gen(60)) for n in layers}
    grads |= {f"{n}.bias": torch.randn(1, *old[f"{n}.bias"].shape, generator=gen(61)) for n in layers}
    for proj in ("local", "global"):
        m, ctx = client(model, {BASES: bases, BLOCKS: {}}, params={"projection": proj})
        out = m.client_step_terms([ctx])(0, 1, {})[2](grads)
        assert all(out[f"{n}.bias"] is None for n in layers)
        assert torch.equal(out[w], grads[w]) == (proj == "global")


def test_split_digits_run_with_global_projection(make_run_config):
    """A whole run with projection: global: once bases exist, every round's global update of
    each based layer is orthogonal to the bases the round was broadcast with."""
    snaps = []

    def keep(row):
        snaps.append(({k: v.clone() for k, v in sim.global_params.items()}, dict(sim.server.state.get(BASES, {}))))

    sim = Simulation(digits(make_run_config, {"samples": 32, "projection": "global"}), device=CPU)
    status, rows, msg = sim.run(progress=False, on_row=keep)
    assert status == "completed", msg
    checked = 0
    for (before, bases), (after, _) in zip(snaps, snaps[1:]):
        for name, u in bases.items():
            key = f"{name}.weight"
            if key in after and u.shape[1]:
                delta = (after[key] - before[key]).reshape(after[key].shape[0], -1).double()
                assert (delta @ u.double()).abs().max() < 1e-5, name
                checked += 1
    assert checked >= 2


# ----------------------------------------------------------------------------- Fig. 2: rho and beta


def test_projection_geometry_is_fig2s_rho_and_beta(make_run_config, monkeypatch):
    """The diagnostic projection_geometry at each round's broadcast weights W: rho_t =
    ||P g_t||^2 / ||g_t||^2 and beta_tau = ||P g_tau|| / ||g_tau||, recomputed here with an
    independent P (each based layer's weight gradient G - G U U^T, the 1-D parameters held:
    bias freeze) on the rows the engine drew; task 0 has no bases: rho = 1."""
    seen = {}
    real = Simulation.projection_geometry

    def keep(self, rnd, params, lr):
        seen[rnd] = ({k: v.clone() for k, v in params.items()}, dict(self.server.broadcast.get(BASES) or {}))
        return real(self, rnd, params, lr)

    monkeypatch.setattr(Simulation, "projection_geometry", keep)
    rc = digits(make_run_config, {"threshold": 0.9, "tip": "none"}, scenario=SPLIT, rounds=3, diagnostics=("projection_geometry",))
    sim = Simulation(rc, device=CPU)
    status, rows, msg = sim.run(progress=False)
    assert status == "completed", msg
    rows = [r for r in rows if r["round"] >= 1]  # (round 0: the initial evaluation)
    assert rows[0]["projection_task"] == 0 and rows[0]["projection_rho"] == 1.0
    model = sim.model_with(sim.global_params)
    layers = projected_layers(model)
    for row in rows[1:]:
        rnd, t = row["round"], int(row["projection_task"])
        params, bases = seen[rnd]
        assert t == rnd - 1 and bases  # one round per task: the bases of tasks < t
        model.load_state_dict(params)
        model.set_task(t)
        model.eval()
        for tau in range(t + 1):
            pos = (sim.clients.task == tau).nonzero().squeeze(1)
            g_rows = torch.Generator().manual_seed(torch_seed(rc.seed, rnd, tau, GEOMETRY_STREAM))
            x, y = sim.clients.batch(pos[torch.randperm(len(pos), generator=g_rows)[:GEOMETRY_ROWS]])
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            logits = model.row_logits(x, torch.full((len(y),), tau))
            grads = torch.autograd.grad(F.cross_entropy(logits, y), [p for _, p in named], allow_unused=True)
            whole = kept = 0.0
            for (n, p), g in zip(named, grads):
                g = torch.zeros_like(p) if g is None else g.double()
                whole += float(g.pow(2).sum())
                layer = n.rsplit(".", 1)[0]
                if p.dim() == 1:
                    continue  # held (bias: freeze)
                if n.endswith(".weight") and layer in bases and layer in layers and bases[layer].shape[1]:
                    m = g.reshape(g.shape[0], -1)
                    g = m - m @ projector(bases[layer])
                kept += float(g.pow(2).sum())
            want = kept / whole
            if tau == t:
                assert row["projection_rho"] == pytest.approx(want, rel=1e-5)
            else:
                assert row[f"projection_beta_task{tau}"] == pytest.approx(want**0.5, rel=1e-3, abs=1e-6)  # float32 P
        assert 0 < row["projection_rho"] < 1 and all(0 <= row[f"projection_beta_task{k}"] <= 1 for k in range(t))


def test_projection_geometry_needs_a_shared_projection():
    from fedforget.parse import parse_config

    raw = {"experiments": [{
        "name": "geo", "datasets": [{"name": "iris", "model": "mlp"}],
        "partitions": [{"scheme": "iid", "clients": 2}], "methods": [{"name": "fedavg"}, {"name": "fedprotip"}],
        "seeds": [0], "train": {"rounds": 2, "diagnostics": ["projection_geometry"]}}]}  # fmt: skip
    with pytest.raises(FedForgetError, match=r"projection_geometry needs .*method 'fedavg'"):
        parse_config(raw)


@pytest.mark.parametrize(
    "method,model,params",
    [
        ("fedprotip", "cnn2d", {"samples": 32}),
        ("fedprotip", "mlp", {"samples": 32, "freeze_early": True}),
        ("fedavg", "mlp", {}),
        ("fot", "cnn2d", {}),
        ("fedprox", "mlp", {"mu": 0.1}),
    ],
    ids=["fedprotip-cnn2d", "fedprotip-mlp-early", "fedavg-mlp", "fot-cnn2d", "fedprox-mlp"],
)
def test_per_task_heads_train_stacked_as_sequential(
    make_run_config, run_engines, assert_same_metrics, assert_same_weights, method, model, params
):  # fmt: skip
    """Per-task heads on the stacked trainer (issue 32: FedProTIP's own tables): the active
    task's head trains in the stack, the other heads are left out of it (as a client alone,
    whose optimizer skips them); metrics and weights within 1e-5 of the sequential trainer's
    (2 local epochs, momentum and weight decay; cnn2d on a CPU: wide steps client by client in
    replicas, whose active head follows the model's; an MLP: every step stacked_forward's)."""
    rc = digits(make_run_config, params, local_epochs=2, sample_rate=0.75,
                optimizer={"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3})  # fmt: skip
    rc = replace(rc, method=replace(rc.method, name=method, label=method),
                 dataset=replace(rc.dataset, model=model, model_options=SMALL_CNN if model == "cnn2d" else {}))  # fmt: skip
    out = run_engines(rc)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert vec.engine_info["client_engine"] == "vectorized"
    assert_same_metrics(rows_s, rows_v)
    assert_same_weights(seq, vec)
    assert isinstance(vec.model.head, TaskHeads) and len(vec.model.head.heads) == 3
