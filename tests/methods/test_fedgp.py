"""FedGP (methods/fedgp.py): the projection against g_ref (after it <g', g_ref> >= -tol,
unchanged without conflict, invariant to scaling g_ref, no NaN for a zero g_ref), the
ablations' manipulations on hand-built vectors, g_ref as the mean of the clients' buffer
gradients at the new global model, FedGP off (rate 0) equal to its base bit for bit, the
buffer shared with a replay base, the buffer policies, validation, resume mid-task."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from fedforget.dropout import DropoutKey, keyed_modules, set_dropout_key
from fedforget.engine import Simulation
from fedforget.methods import METHODS, check_params, make_params
from fedforget.methods.base import AFTER_TASK, grads_alone
from fedforget.methods.fedgp import REF_STREAM, STATE_KEY, FedGP, manipulate
from fedforget.methods.replay import KEY, Reservoir, sample_generator
from fedforget.models import build_model
from fedforget.partition import PartitionSpec
from fedforget.utils import FedForgetError
from fedforget.vectorized import (
    LOOP_MIN_ROWS,
    method_not_vectorized,
    reply_grads,
    stacked_replies_refused,
)

from ..conftest import GPU_TOL_FACTOR
from .conftest import (
    CPU,
    SMALL_CNN,
    SMALL_RESNET,
    SPLIT,
    checkpoint_keeper,
    digits_cfg,
    held_stacks,
    run,
    strip,
)


def flat(ts):
    return torch.cat([t.reshape(-1) for t in ts])


def parts(v, sizes=(3, 4)):
    """A flat vector as a list of tensors (parameters of two shapes)."""
    return list(v.split(list(sizes)))


def rand(seed, n=7):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ------------------------------------------------------------------ the manipulations
@pytest.mark.parametrize("seed", range(6))
def test_projection_removes_conflict_and_keeps_aligned(seed):
    g, r = rand(seed), rand(100 + seed)
    out, applied, cos = manipulate(parts(g), parts(r), "project", False, None)
    out = flat(out)
    dot = float(g @ r)
    assert math.isclose(float(cos), dot / float(g.norm() * r.norm()), rel_tol=1e-9)
    if dot < 0:
        assert bool(applied)
        assert float(out @ r) >= -1e-9  # <g', g_ref> >= -tol
        torch.testing.assert_close(out, g - dot / float(r @ r) * r)
    else:
        assert not bool(applied)
        assert torch.equal(out, g)  # no conflict: unchanged


def test_projection_invariant_to_scaling_g_ref():
    g, r = rand(1), -rand(1) + 0.1 * rand(2)  # conflicting
    base = flat(manipulate(parts(g), parts(r), "project", False, None)[0])
    for c in (1e-2, 3.0, 1e5):  # while ||c g_ref||^2 >> eps (1e-12)
        scaled = flat(manipulate(parts(g), parts(c * r), "project", False, None)[0])
        torch.testing.assert_close(scaled, base, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("how", ["project", "average", "rotate", "project_scale"])
@pytest.mark.parametrize("always", [False, True])
def test_zero_g_ref_changes_nothing(how, always):
    g = rand(3)
    out, applied, _ = manipulate(parts(g), parts(torch.zeros(7, dtype=torch.float64)), how, always, None)
    assert not bool(applied)
    assert torch.equal(flat(out), g) and torch.isfinite(flat(out)).all()


def test_ablation_manipulations_on_a_hand_built_pair():
    g = torch.tensor([1.0, 0.0, 0, 0, 0, 0, 0], dtype=torch.float64)
    r = torch.tensor([-1.0, 1.0, 0, 0, 0, 0, 0], dtype=torch.float64)  # 135 degrees from g
    m = lambda how, always=False: flat(manipulate(parts(g), parts(r), how, always, None)[0])  # noqa: E731
    torch.testing.assert_close(m("project"), torch.tensor([0.5, 0.5, 0, 0, 0, 0, 0], dtype=torch.float64))
    torch.testing.assert_close(m("average"), torch.tensor([0.0, 0.5, 0, 0, 0, 0, 0], dtype=torch.float64))
    s = 1 / math.sqrt(2)
    torch.testing.assert_close(m("project_scale"), torch.tensor([s, s, 0, 0, 0, 0, 0], dtype=torch.float64))
    # rotate: the bisector of g and g_ref (67.5 degrees from g), magnitude of g
    rot = m("rotate")
    assert math.isclose(float(rot.norm()), 1.0, rel_tol=1e-12)
    assert math.isclose(math.degrees(math.acos(float(rot @ g))), 67.5, rel_tol=1e-9)
    # aligned pair: only "always" manipulates
    r2 = torch.tensor([1.0, 1.0, 0, 0, 0, 0, 0], dtype=torch.float64)
    assert torch.equal(flat(manipulate(parts(g), parts(r2), "project", False, None)[0]), g)
    torch.testing.assert_close(
        flat(manipulate(parts(g), parts(r2), "project", True, None)[0]),
        torch.tensor([0.5, -0.5, 0, 0, 0, 0, 0], dtype=torch.float64),
    )
    # a closed gate (projection rate) leaves g as it is
    assert torch.equal(flat(manipulate(parts(g), parts(r), "project", False, torch.tensor(False))[0]), g)


# ------------------------------------------------------------------ runs
def fedgp_cfg(make_run_config, params=None, **train):
    return digits_cfg(make_run_config, "fedgp", params, **train)


def test_fedgp_off_equals_its_base_bit_for_bit(make_run_config):
    """rate 0: buffers fill and g_ref is computed every round, the training is the base's."""
    for base, bp in [("fedavg", {}), ("fedprox", {"mu": 0.01}), ("der", {"buffer_size": 50})]:
        _, rows_b = run(digits_cfg(make_run_config, base, bp))
        sim, rows_g = run(fedgp_cfg(make_run_config, {"base": base, "base_params": bp, "rate": 0.0}))
        assert strip(rows_g, "fedgp_") == strip(rows_b, f"{base}_"), base
        assert sim.server.state[STATE_KEY] is not None
        assert rows_g[-1]["fedgp_proj_share"] == 0.0


def test_fedgp_off_over_fedprotip_is_fedprotip(make_run_config):
    """A base with a task-end report and an after-task reply (FedProTIP's bases, then its
    references against the aggregated bases) and its own predict / eval_counts, through the
    plug-in: rate 0 gives FedProTIP's rows, per-task TIP columns included."""
    kw = dict(
        dataset="digits", model="cnn2d", model_options=SMALL_CNN, scenario={**SPLIT, "heads": "per_task"},
        partition=PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=10, seed=0),
        rounds=3, batch_size=32, eval_local_models=False, eval_every=1,
    )  # fmt: skip
    _, rows_b = run(make_run_config(method="fedprotip", params={"samples": 32}, **kw))
    sim, rows_g = run(make_run_config(method="fedgp", params={"base": "fedprotip", "base_params": {"samples": 32}, "rate": 0.0}, **kw))
    assert strip(rows_g, "fedgp_") == strip(rows_b, "fedprotip_")
    assert AFTER_TASK in sim.method.exchanges and sim.server.state["fedprotip_refs"]
    assert "tip_sample" in rows_g[-1]["_tasks"][0]


def test_fedgp_projects_and_reports(make_run_config):
    sim, rows = run(fedgp_cfg(make_run_config, {"buffer_size": 40}))
    assert "fedgp_proj_share" not in rows[1] or rows[1]["fedgp_proj_share"] == 0.0  # round 1: no g_ref
    assert "fedgp_cos_before" not in rows[1]
    later = rows[2:]
    assert all(0.0 <= r["fedgp_proj_share"] <= 1.0 for r in later)
    assert any(r["fedgp_proj_share"] > 0 for r in later)  # new tasks conflict with the buffer
    assert all(-1.0 <= r["fedgp_cos_before"] <= 1.0 for r in later)
    assert all(r["fedgp_buffer_size"] == 40.0 for r in later)
    assert rows[-1]["fedgp_ref_clients"] == 4.0 and rows[-1]["fedgp_ref_norm"] > 0


def test_g_ref_is_the_mean_buffer_gradient_at_the_new_global_model(make_run_config):
    """Recomputed by hand from the clients' buffers after round 1: the same keyed buffer
    batch, CE at the aggregated weights, mean over clients."""
    rc = fedgp_cfg(make_run_config, {"buffer_size": 16, "ref_batch_size": 5}, rounds=1)
    sim, _ = run(rc)
    model = sim.model_with(sim.global_params)
    model.train()
    grads = []
    for cid in range(4):
        mem = Reservoir(16).sample(sim.client_state[cid], 5, sample_generator(0, 1, cid, 0, REF_STREAM))
        model.zero_grad()
        F.cross_entropy(model(mem["x"]), mem["y"]).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    g_ref = sim.server.state[STATE_KEY]
    for n in grads[0]:
        torch.testing.assert_close(g_ref[n], sum(g[n] for g in grads) / 4)


def test_fedgp_over_a_replay_base_reads_its_buffer(make_run_config):
    sim, rows = run(fedgp_cfg(make_run_config, {"base": "agem", "base_params": {"buffer_size": 30}}))
    assert isinstance(sim.method, FedGP) and not sim.method.own_buffer
    assert sim.method.replay is sim.method.base.replay
    st = sim.client_state[0]
    assert set(st) == {"replay"} and Reservoir(30).size(st) == 30
    # the base's diagnostics keep their own names beside FedGP's
    assert "fedgp_agem_proj_share" in rows[-1] and "fedgp_proj_share" in rows[-1]


@pytest.mark.parametrize(
    "params, match",
    [
        ({"base": "fedgp"}, "base='fedgp'"),
        ({"base": "nope"}, "base='nope'"),
        ({"manipulation": "flip"}, "manipulation='flip'"),
        ({"apply": "sometimes"}, "apply='sometimes'"),
        ({"rate": 1.5}, "rate=1.5"),
        ({"buffer_policy": "fifo"}, "buffer_policy='fifo'"),
        ({"buffer_size": -1}, "buffer_size=-1"),
        ({"buffer_size": 0}, "buffer_size=0; allowed: null or an integer >= 1"),  # FedGP = its base
        ({"base": "der", "base_params": {"buffer_size": 0}}, "base_params.buffer_size=0 .base 'der'.: FedGP without"),
        ({"ref_batch_size": 0}, "ref_batch_size=0"),
        ({"base": "der", "buffer_size": 100}, "base_params.buffer_size=200"),
        ({"base": "agem", "buffer_policy": "sliding"}, "buffer_policy='sliding' over base 'agem'"),
        ({"base": "fedprox", "base_params": {"mu": -1}}, "mu=-1"),
    ],
)
def test_bad_params_name_the_value(params, match):
    with pytest.raises(FedForgetError, match=match):
        check_params("fedgp", params)


def test_resume_mid_task_gives_the_same_bytes(make_run_config):
    rc = fedgp_cfg(make_run_config, {"base": "der", "base_params": {"buffer_size": 20}}, rounds=6, checkpoint_every=1)
    rc = replace(rc, dataset=replace(rc.dataset, scenario={**rc.dataset.scenario, "rounds_per_task": 2}))
    full = Simulation(rc, device=CPU)
    saved, keep = checkpoint_keeper()
    status, rows_full, _ = full.run(progress=False, on_checkpoint=keep)
    assert status == "completed"
    mid = next(c for c in saved if c["round"] == 3)  # the middle of task 2
    resumed = Simulation(rc, device=CPU)
    status, rows_res, _ = resumed.run(progress=False, resume=mid)
    assert status == "completed"
    assert strip(rows_res) == strip(rows_full)
    for k, v in full.global_params.items():
        assert torch.equal(v, resumed.global_params[k])


def test_a_plugin_has_its_base_traits(make_run_config):
    """FedGP over joint trains on every task's data from round 1 (as joint does); over a
    method that needs a public set, the config must declare one."""
    from fedforget.parse import parse_config

    _, rows_j = run(digits_cfg(make_run_config, "joint", rounds=1))
    sim, rows_g = run(fedgp_cfg(make_run_config, {"base": "joint", "rate": 0.0}, rounds=1))
    assert strip(rows_g, "fedgp_") == strip(rows_j)
    raw = {"experiments": [{
        "name": "e", "datasets": [{"name": "iris", "model": "mlp"}],
        "partitions": [{"scheme": "iid", "clients": 2}],
        "methods": [{"name": "fedgp", "params": {"base": "fedproj"}}], "seeds": [0], "train": {"rounds": 1},
    }]}  # fmt: skip
    with pytest.raises(FedForgetError, match="method 'fedgp' needs a public set"):
        parse_config(raw)


def test_every_client_with_a_buffer_sends_g_ref_trained_or_not(make_run_config):
    """[P] "the server aggregates the local buffer gradients g_ref^k from client k in [K]":
    a sampled client with no rows of the round's task (Dirichlet 0.1 leaves some) still
    sends its buffer's gradient; g_ref is the mean over every client whose buffer has rows."""
    rc = fedgp_cfg(make_run_config, {"buffer_size": 16, "ref_batch_size": 5})
    rc = replace(rc, partition=PartitionSpec("dirichlet", clients=4, alpha=0.1, min_size=5, seed=2))
    sim, rows = run(rc)
    assert [sim.clients.size(cid, 2) for cid in (0, 3)] == [0, 0]  # they do not train in task 3
    with_buffer = [cid for cid in range(4) if Reservoir(16).size(sim.client_state.get(cid, {}))]
    last = rows[-1]
    assert last["fedgp_ref_clients"] == len(with_buffer)
    assert last["n_sampled_clients"] == 2 and with_buffer == [0, 1, 2, 3]
    model = sim.model_with(sim.global_params)
    model.train()
    grads = []
    for cid in with_buffer:
        st = sim.client_state[cid]
        mem = Reservoir(16).sample(st, 5, sample_generator(0, 3, cid, 2, REF_STREAM))
        model.zero_grad()
        F.cross_entropy(model(mem["x"]), mem["y"]).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    g_ref = sim.server.state[STATE_KEY]
    for n in grads[0]:
        torch.testing.assert_close(g_ref[n], sum(g[n] for g in grads) / len(grads))


# ------------------------------------------------------------------ the stacked trainer
@pytest.mark.parametrize("how", ["project", "average", "rotate", "project_scale"])
@pytest.mark.parametrize("always", [False, True])
def test_stacked_manipulation_is_each_clients_alone(how, always):
    """``manipulate(stacked=True)`` on a stack of 4 gradients (one g_ref, a gate per client)
    gives each client's own manipulation, applied flag and cos."""
    r = parts(rand(50))
    gs = [rand(s) for s in range(4)]
    gs[1] = -2.0 * flat(r)  # exactly opposite g_ref (rotate: no bisector)
    gate = torch.tensor([True, True, False, True])
    stack = [torch.stack([parts(g)[j] for g in gs]) for j in range(2)]
    out, applied, cos = manipulate(stack, r, how, always, gate, stacked=True)
    for i, g in enumerate(gs):
        o1, a1, c1 = manipulate(parts(g), r, how, always, gate[i])
        torch.testing.assert_close(flat([o[i] for o in out]), flat(o1), rtol=1e-12, atol=1e-12)
        assert bool(applied[i]) == bool(a1) and math.isclose(float(cos[i]), float(c1), abs_tol=1e-12)


def same_buffers(a, b):
    """Two clients' FedGP buffers: the same rows, counters and slots."""
    assert a.keys() == b.keys()
    for k, v in a.items():
        assert torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k], k


@pytest.mark.parametrize(
    "params",
    [
        {"buffer_size": 20},
        {"base": "fedprox", "base_params": {"mu": 0.01}, "manipulation": "rotate", "rate": 0.5},
        {"apply": "always", "manipulation": "project_scale", "buffer_policy": "random"},
        {"rate": 0.0},
    ],
    ids=["fedavg", "fedprox-rotate-rate", "always-scale", "off"],
)
def test_fedgp_trains_stacked_as_sequential(public_run_cfg, run_engines, assert_same_metrics, params):
    """FedGP over a stacked base trains stacked (its manipulation a gradient map of the step
    terms; its buffer offered the first epoch's minibatches at the client's end): metrics
    (the diagnostics included) within 1e-5 of the sequential trainer and the same buffers,
    on an MLP whose steps run batched; 4 rounds at 3 of 4 clients."""
    rc = public_run_cfg("fedgp", params, rounds=4, sample_rate=0.75, local_epochs=2, batch_size=8,
                        optimizer={"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3})  # fmt: skip
    out = run_engines(rc)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v)
    if params.get("rate", 1.0):
        assert any(r.get("fedgp_proj_share", 0) > 0 for r in rows_s)
    assert seq.fed.clients.keys() == vec.fed.clients.keys()
    for cid, st in seq.fed.clients.items():
        same_buffers(st[KEY], vec.fed.clients[cid][KEY])


def test_fedgp_on_conv_steps_of_a_task_stream_stacked(make_run_config, run_engines, assert_same_metrics):
    """Split digits, cnn2d on a CPU (wide steps client by client, their tails batched): the
    stacked trainer's metrics within 1e-5 of the sequential one's, over FedAvg, over DER
    (whose replay terms see the step) and over FedNTD (live terms: its distillation of the
    step's logits, then FedGP's map); over a base that keeps its own step (FedProj with
    ``local_lr_step``) FedGP stays sequential, naming the base."""
    rc = fedgp_cfg(make_run_config, {"buffer_size": 30}, local_epochs=2, sample_rate=0.75)
    out = run_engines(rc)
    assert_same_metrics(out["sequential"][1], out["vectorized"][1])
    der = fedgp_cfg(make_run_config, {"base": "der", "base_params": {"buffer_size": 30}}, sample_rate=0.75)
    out = run_engines(der)
    assert_same_metrics(out["sequential"][1], out["vectorized"][1])
    ntd = fedgp_cfg(make_run_config, {"base": "fedntd", "buffer_size": 30}, sample_rate=0.75)
    out = run_engines(ntd)
    assert_same_metrics(out["sequential"][1], out["vectorized"][1])
    assert any(r.get("fedgp_proj_share", 0) > 0 for r in out["vectorized"][1])
    own = {"base": "fedproj", "base_params": {"local_lr_step": True}}
    assert "over 'fedproj'" in method_not_vectorized(METHODS.get("fedgp"), "sgd", params=make_params("fedgp", own))


def test_fedgp_over_gpm_on_a_task_stream_stacked(make_run_config, run_engines, assert_same_metrics, monkeypatch):
    """Over a base whose own map projects and holds biases (GPM's memories exist from task 1),
    the base's map, then FedGP's, on every batched step of an MLP; a client without task-0
    rows has no memory, so a stack mixes held and free biases and FedGP manipulates those
    clients one by one (each leaving out what the base holds for it): within 1e-5 of the
    sequential trainer."""
    mixed = held_stacks(monkeypatch)
    rc = fedgp_cfg(make_run_config, {"base": "gpm", "base_params": {"samples": 16}, "buffer_size": 30},
                   local_epochs=2, sample_rate=1.0, optimizer={"lr": 0.05, "momentum": 0.9})  # fmt: skip
    rc = replace(rc, dataset=replace(rc.dataset, model="mlp", model_options={}),
                 partition=PartitionSpec("dirichlet", clients=4, alpha=0.1, min_size=10, seed=3))  # fmt: skip
    out = run_engines(rc)
    (seq, rows_s), (_, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v)
    assert any(st.get("gpm_bases") for st in seq.fed.clients.values())  # GPM's memories took part
    assert mixed and any(r.get("fedgp_proj_share", 0) > 0 for r in rows_s)


@pytest.mark.parametrize(
    "model,options,shape,rows",
    [
        ("mlp", {}, (1, 8, 8), 32),  # stacked_forward's batched matmuls
        ("resnet8", SMALL_RESNET, (3, 8, 8), 5),  # BatchNorm: each client's batch statistics
        ("cnn2d", SMALL_CNN, (1, 8, 8), LOOP_MIN_ROWS),  # a CPU's wide Conv2d stack: client by client
        ("cnn2d", SMALL_CNN, (1, 8, 8), 3),  # and a short one: one grouped convolution
        ("cnn_fedgp", {}, (1, 28, 28), 4),  # keyed dropout: each client's reply key
        ("cnn_fedgp", {}, (1, 28, 28), LOOP_MIN_ROWS),
    ],
)
def test_stacked_reply_gradients_are_each_clients_alone(model, options, shape, rows):
    """``reply_grads`` (the stacked trainer's) gives each client of a stack the gradient
    ``grads_alone`` gives it on the model at the global weights, its own loss on its own rows,
    within 1e-5 of the largest entry (at least 1); the global weights and the running
    statistics are left as they were."""
    torch.manual_seed(0)
    net = build_model(model, shape, 10, options)
    assert stacked_replies_refused(net) is None
    params = {k: v.detach().clone() for k, v in net.state_dict().items()}
    x, y = torch.randn(3, rows, *shape), torch.randint(0, 10, (3, rows))
    mask = torch.rand(3, rows, 10) > 0.3

    def losses(logits, lo):
        return torch.stack([F.cross_entropy(z.masked_fill(~mask[lo + i], -1e9), y[lo + i]) for i, z in enumerate(logits)])

    keys = [11, 5, 7, 3]  # the contexts' reply keys; the pass's clients are the last three
    stacked = reply_grads(net, params, keys)(x, None, losses, [1, 2, 3])
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in params.items())  # nothing moved
    drop = keyed_modules(net)
    assert (model == "cnn_fedgp") == bool(drop) and all(m.key is None for m in drop)  # the keys unset after
    for j in range(3):
        net.load_state_dict(params)
        set_dropout_key(drop, DropoutKey(torch.tensor(keys[j + 1]), 0, keys[j + 1]))  # the trainer's, alone
        alone = grads_alone(net)(x[j : j + 1], None, lambda z, lo, j=j: losses(z, lo + j))
        assert alone.keys() == stacked.keys()
        for n, v in alone.items():
            scale = max(1.0, float(v.abs().max()))  # BatchNorm over a few rows: gradients of size ~5
            assert float((stacked[n][j] - v[0]).abs().max()) <= 1e-5 * scale, (model, j, n)


def test_stacked_replies_are_refused_where_a_reply_routes_rows():
    """Per-task heads reply client by client, named."""
    net = build_model("mlp", (1, 8, 8), 10, {})
    net.use_task_heads([[0, 1, 2], [3, 4, 5]])
    assert "per-task heads" in stacked_replies_refused(net)


def test_the_stacked_trainer_takes_g_ref_a_stack_at_a_time(public_run_cfg, run_engines, assert_same_metrics, monkeypatch):
    """On the stacked trainer FedGP's round-end replies run through ``client_replies`` with
    several clients at once (groups of train.max_parallel_clients), g_ref within 1e-5 of
    the sequential trainer's."""
    sizes = []
    orig = FedGP.client_replies

    def spy(self, exchange, ctxs, grads):
        sizes.append(len(ctxs))
        return orig(self, exchange, ctxs, grads)

    monkeypatch.setattr(FedGP, "client_replies", spy)
    rc = public_run_cfg("fedgp", {"buffer_size": 20, "ref_batch_size": 6}, rounds=3, batch_size=8, max_parallel_clients=2)
    out = run_engines(rc)
    assert max(sizes) == 2  # the sequential trainer's are stacks of one
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v)
    for n, v in seq.server.state[STATE_KEY].items():
        torch.testing.assert_close(vec.server.state[STATE_KEY][n], v, rtol=1e-5 * GPU_TOL_FACTOR, atol=1e-6 * GPU_TOL_FACTOR)


def test_a_reply_stack_out_of_gpu_memory_names_the_setting(public_run_cfg, monkeypatch):
    """The round-end replies' stack runs out of GPU memory: one error naming the group's size,
    the exchange and ``train.max_parallel_clients``, as a training group's does."""
    import fedforget.trainers

    def grads(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB.")

    monkeypatch.setattr(fedforget.trainers, "reply_grads", lambda *a: grads)
    rc = public_run_cfg("fedgp", {"buffer_size": 20}, rounds=2, batch_size=8, max_parallel_clients=2)
    sim = Simulation(replace(rc, train=replace(rc.train, client_engine="vectorized")))
    want = (r"round 1: the batched engine's group of 2 clients ran out of GPU memory in the round_end replies "
            r"\(CUDA out of memory. Tried to allocate 1.00 GiB.\); set train.max_parallel_clients below 2 \(now 2\)")
    with pytest.raises(FedForgetError, match=want):
        sim.run(progress=False)
