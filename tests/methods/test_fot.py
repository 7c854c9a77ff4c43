"""FOT: the projected aggregated update is orthogonal to the bases (biases free or frozen);
with no bases it is FedAvg bit for bit (aggregation, and a split-digits run at threshold 0);
the sum of the clients' sketches is the sketch of their concatenated residuals; the server's
expansion recovers a planted subspace and counts the captured energy (GPM's criterion);
communication accounting and a split-digits run with both sketch models; the trainers hold one
summed sketch, not one a client; resumes with asynchronous reports waiting."""

from __future__ import annotations

import math
import time

import pytest
import torch

from fedforget.activations import layer_dim, layer_inputs
from fedforget.config import PartitionSpec, TrainSpec
from fedforget.engine import Simulation
from fedforget.methods import RunInfo, ServerContext, Upload, make_params, weighted_average
from fedforget.methods.base import Summed
from fedforget.methods.fot import (
    BASES,
    COMM,
    FOT,
    Sketcher,
    fot_expand,
    sketch_layers,
    sketch_width,
)
from fedforget.methods.shared import projected_layers
from fedforget.models import build_model
from fedforget.utils import FedForgetError, torch_seed

from .conftest import (
    CPU,
    SMALL_CNN,
    SPLIT,
    checkpoint_keeper,
    digits_cfg,
    gen,
    projector,
    run,
    strip,
)


def method(params=None):
    return FOT(make_params("fot", params or {}), RunInfo(CPU, 10, 0, 3, TrainSpec(rounds=4)))


def server_and_uploads(seed=0, n=3):
    torch.manual_seed(seed)
    model = build_model("cnn2d", (1, 8, 8), 10)
    glob = {k: v.detach().clone() for k, v in model.state_dict().items()}
    uploads = [
        Upload(k, 10 * (k + 1), {key: v + 0.1 * torch.randn(v.shape, generator=gen(100 * seed + k)) for key, v in glob.items()}, 5)
        for k in range(n)
    ]  # fmt: skip
    return ServerContext(1, glob, model, CPU, None), uploads


def random_bases(model, seed):
    return {
        name: torch.linalg.qr(torch.randn(layer_dim(m), max(1, layer_dim(m) // 3), generator=gen(seed + i)))[0]
        for i, (name, m) in enumerate(projected_layers(model).items()) if i % 2 == 0
    }  # fmt: skip


# ----------------------------------------------------------------------------- FedProject


@pytest.mark.parametrize("bias", ["free", "freeze"])
def test_projected_global_update_is_orthogonal_to_the_bases(bias):
    server, uploads = server_and_uploads()
    fedavg = weighted_average([u.params for u in uploads], [u.n_samples for u in uploads])
    bases = random_bases(server.model, 7)
    server.state[BASES] = bases
    method({"bias": bias}).server_aggregate(server, uploads)
    new = server.global_params
    old = server.global_params
    for name, layer in projected_layers(server.model).items():
        key = f"{name}.weight"
        delta = (new[key] - old[key]).reshape(layer.weight.shape[0], -1)
        if name in bases:
            assert (delta @ bases[name]).abs().max() < 1e-5, name
            # the removed part is the update's component in span(U)
            full = (fedavg[key] - old[key]).reshape(delta.shape)
            torch.testing.assert_close(
                delta, full - full @ bases[name] @ bases[name].T, atol=1e-6, rtol=0
            )
        else:
            assert torch.equal(new[key], fedavg[key]), name
        bias_key = f"{name}.bias"
        expected = old[bias_key] if bias == "freeze" else fedavg[bias_key]
        assert torch.equal(new[bias_key], expected)


def test_with_no_bases_the_aggregation_is_fedavg_bit_for_bit():
    server, uploads = server_and_uploads(seed=1)
    fedavg = weighted_average([u.params for u in uploads], [u.n_samples for u in uploads])
    for state in ({}, {BASES: {}}):
        server.state = dict(state)
        method({"bias": "freeze"}).server_aggregate(server, uploads)
        new = server.global_params
        assert all(torch.equal(new[k], v) for k, v in fedavg.items())


def test_before_its_first_basis_fot_is_fedavg_bit_for_bit(make_run_config):
    """Task 0's round (no basis exists while it trains and aggregates; a threshold of 0, which
    would keep none ever, is refused): FOT's client step and aggregation are FedAvg's, bit
    for bit."""
    sims = [Simulation(digits_cfg(make_run_config, m)) for m in ("fedavg", "fot")]
    rows = [strip([s.run_round(1, time.perf_counter())], "fot_") for s in sims]
    assert rows[0] == rows[1]
    assert all(torch.equal(v, sims[1].global_params[k]) for k, v in sims[0].global_params.items())


# ----------------------------------------------------------------------------- GPSE


def test_sum_of_client_sketches_is_the_sketch_of_the_concatenation():
    d, s = 6, sketch_width(6, 5)
    rs = [torch.randn(d, n, generator=gen(n)) for n in (7, 3, 12)]
    seeds = [torch_seed(0, 1, k, 0x72, 0) for k in range(3)]
    ys = []
    for r, sd in zip(rs, seeds):
        sk = Sketcher(d, s, gen(sd), CPU)
        sk.add(r[:, :2])  # in pieces: the Gaussian rows follow the columns in order
        sk.add(r[:, 2:])
        ys.append(sk.y)
    blocks = []
    for r, sd in zip(rs, seeds):  # the clients' Gaussian matrices, replayed
        sk = Sketcher(d, s, gen(sd), CPU)
        blocks += [sk.draw(2), sk.draw(r.shape[1] - 2)]
    g = torch.cat(blocks)  # [sum n_k, s]: one row per column of the concatenation
    torch.testing.assert_close(sum(ys), torch.cat(rs, 1) @ g, atol=1e-4, rtol=1e-5)


def test_client_sketch_removes_the_old_span_and_reports_its_ratio():
    torch.manual_seed(0)
    model = build_model("mlp", (6,), 4, {"hidden": [5]}).eval()
    x = torch.randn(9, 6, generator=gen(1))
    layers = projected_layers(model)
    u = torch.linalg.qr(torch.randn(6, 2, generator=gen(2)))[0]
    rep = sketch_layers(model, x, {"body.1": u}, 5.0, "energy", [0, 0, 0, 0x72], chunk=4)
    norm = sketch_layers(model, x, {"body.1": u}, 5.0, "norm", [0, 0, 0, 0x72], chunk=4)
    a = layer_inputs(model, x, layers)["body.1"]
    r = a - u @ (u.T @ a)
    assert rep["n"] == 9 and set(rep["ratio"]) == set(rep["y"].parts) == set(layers)
    assert isinstance(rep["y"], Summed)  # a client's share of the sum the server reads
    assert rep["ratio"]["body.1"] == pytest.approx(float((r * r).sum() / (a * a).sum()), rel=1e-5)
    assert norm["ratio"]["body.1"] == pytest.approx(math.sqrt(rep["ratio"]["body.1"]), rel=1e-6)
    assert rep["y"].parts["body.1"].shape == (6, 30)
    assert (u.T @ rep["y"].parts["body.1"]).abs().max() < 1e-4  # the old span is gone
    assert rep["ratio"]["head"] == 1.0  # no basis: everything is residual


def test_expansion_recovers_a_planted_subspace_and_counts_captured_energy():
    q = torch.linalg.qr(torch.randn(10, 5, generator=gen(3)))[0]
    old, new = q[:, :3], q[:, 3:]
    # task 0: the clients' inputs lie in span(old)
    ys = [
        (old @ torch.randn(3, 40, generator=gen(k))) @ torch.randn(40, 50, generator=gen(10 + k))
        for k in range(3)
    ]
    u = fot_expand(None, sum(ys), 1.0, 0.999)
    assert u.shape == (10, 3)
    torch.testing.assert_close(projector(u), projector(old), atol=1e-4, rtol=0)
    # task 1: residuals in span(new); a captured share of 0.95 already meets eps = 0.9
    y = new @ torch.randn(2, 50, generator=gen(4))
    assert fot_expand(u, y, 0.05, 0.9) is u
    u2 = fot_expand(u, y, 0.5, 0.999)  # needs the new directions
    assert u2.shape == (10, 5)
    torch.testing.assert_close(u2[:, :3], u)
    torch.testing.assert_close(projector(u2), projector(q), atol=1e-4, rtol=0)
    torch.testing.assert_close(u2.T @ u2, torch.eye(5), atol=1e-5, rtol=0)


def test_expansion_target_is_gpm_energy_criterion():
    # rho = 0.5 residual, eps = 0.9: the residual must give (0.5 - 0.1) / 0.5 = 0.8 of ||Y||^2;
    # Y's energies 6, 3, 1 (shares .6, .9, 1): two directions
    basis = torch.eye(6)[:, 3:]
    y = torch.zeros(6, 4)
    y[0, 0], y[1, 1], y[2, 2] = math.sqrt(6), math.sqrt(3), 1.0
    u = fot_expand(basis, y, 0.5, 0.9)
    assert u.shape == (6, 5)
    torch.testing.assert_close(
        projector(u[:, 3:]), projector(torch.eye(6)[:, :2]), atol=1e-6, rtol=0
    )


def test_bad_params_are_refused():
    bads = ({"threshold": -0.1}, {"sketch_factor": 0}, {"samples": -1}, {"sketch_model": "server"},
            {"residual_ratio": "l1"}, {"bias": "augment"}, {"threshold_step": float("nan")})  # fmt: skip
    for bad in bads:
        with pytest.raises(FedForgetError, match=next(iter(bad))):
            make_params("fot", bad)


# ----------------------------------------------------------------------------- runs


@pytest.mark.parametrize("sketch_model", ["local", "global"])
def test_split_digits_run_expands_bases_and_records_communication(make_run_config, sketch_model):
    params = {
        "sketch_model": sketch_model,
        "sketch_factor": 1.0,
        "samples": 24 if sketch_model == "global" else 0,
    }
    sim, rows = run(digits_cfg(make_run_config, "fot", params, sample_rate=0.75))
    bases = sim.server.state[BASES]
    layers = projected_layers(sim.server.model)
    assert set(bases) == set(layers)
    for u in bases.values():
        torch.testing.assert_close(
            u.T @ u, torch.eye(u.shape[1], device=u.device), atol=1e-5, rtol=0
        )
    ranks = [r["fot_basis_rank"] for r in rows[1:]]
    assert all(0 < a <= b for a, b in zip(ranks, ranks[1:])), ranks
    comm = sim.server.state[COMM]
    assert [c["task"] for c in comm] == [0, 1, 2]
    model_mb = sum(v.numel() * 4 for v in sim.global_params.values()) / 1e6
    sketch_mb = (
        sum(layer_dim(m) * sketch_width(layer_dim(m), 1.0) * 4 for m in layers.values()) / 1e6
    )
    for rnd, c in zip(rows[1:], comm):
        assert rnd["fot_comm_model_mb"] == pytest.approx(model_mb) == c["comm_model_mb"]
        assert rnd["fot_comm_sketch_mb"] == pytest.approx(sketch_mb)
        assert rnd["fot_comm_task_mb"] == pytest.approx(model_mb + sketch_mb)
        with_data = [k for k in range(4) if sim.clients.size(k, c["task"])]
        if sketch_model == "global":  # every client with data in the task
            assert c["sketch_clients"] == len(with_data)
        else:  # the clients trained in the task's last round
            assert 0 < c["sketch_clients"] <= min(3, len(with_data))


def test_resume_after_a_task_end_equals_the_uninterrupted_run(make_run_config):
    """The bases (server.state) survive a checkpoint taken at a task's end; the local
    sketches of a task's last round never outlive their round."""

    rc = digits_cfg(make_run_config, "fot", {"sketch_factor": 1.0})
    _, rows_full = run(rc)
    saved, keep = checkpoint_keeper()

    Simulation(rc, device=CPU).run(progress=False, on_checkpoint=keep)
    assert all("fot_pending" not in c["server_state"] for c in saved)
    assert saved and saved[0]["round"] == 1 and saved[0]["server_state"][BASES]
    status, rows, msg = Simulation(rc, device=CPU).run(progress=False, resume=saved[0])
    assert status == "completed", msg
    assert strip(rows) == strip(rows_full)
    lost = {**saved[0], "server_state": {}}  # not vacuous: without the bases it differs
    _, rows_lost, _ = Simulation(rc, device=CPU).run(progress=False, resume=lost)
    assert strip(rows_lost) != strip(rows_full)


@pytest.mark.parametrize(("engine", "sketch_model"), [("sequential", "local"), ("batched", "local"), ("sequential", "global")])
def test_the_server_holds_one_summed_sketch_not_one_a_client(make_run_config, monkeypatch, engine, sketch_model):
    """The trainers fold each client's sketches into the running sum as its report arrives
    (methods.base.SummedTotal): when a client sketches, at most one earlier client's sketches
    are alive (the first, until the second is added), and the server reads one total of every
    reporting client (its bits: tests/methods/test_protocol.py). Local sketches ride on the
    round's uploads (each trainer folds its own way); global ones are task-end replies, one
    client at a time with either trainer (FOT states no stacked replies)."""
    import gc
    import weakref

    from fedforget.methods import fot

    shares, collected, made = [], [], fot.sketch_layers

    def sketch(*args, **kw):
        gc.collect()
        assert sum(r() is not None for r in shares) <= 1, "earlier clients' sketches are still held"
        out = made(*args, **kw)
        shares.append(weakref.ref(out["y"]))
        return out

    seen = FOT.server_collect

    def collect(self, exchange, server, replies):
        if sketch_model == "local":
            replies = server.state.get(fot.PENDING, {})
        totals = {id(r["y"]) for r in replies.values()}
        collected.append((len(totals), [r["y"].clients for r in replies.values()], len(replies)))
        return seen(self, exchange, server, replies if sketch_model == "global" else {})

    monkeypatch.setattr(fot, "sketch_layers", sketch)
    monkeypatch.setattr(FOT, "server_collect", collect)
    params = {"sketch_model": sketch_model, "sketch_factor": 1.0}
    run(digits_cfg(make_run_config, "fot", params, sample_rate=0.75, client_engine=engine))
    assert len(collected) == 3 and len(shares) > 3
    for distinct, clients, n in collected:
        assert distinct == 1 and clients == [n] * n and n >= 1


def test_resume_with_asynchronous_reports_waiting_equals_the_uninterrupted_run(make_run_config):
    """Under asynchronous boundaries a client that moves on reports before the server's task end:
    its sketches wait in the checkpointed task reports (a ``Summed`` share, not folded: the
    server sums every report in the clients' order) and a resume from there gives the same run."""
    scenario = {**SPLIT, "tasks": 3, "rounds_per_task": 2, "boundaries": {"samples_per_window": 70, "window_rounds": 2}}
    rc = make_run_config(
        dataset="digits", model="cnn2d", model_options=SMALL_CNN, method="fot",
        params={"sketch_model": "global", "sketch_factor": 1.0, "samples": 24}, scenario=scenario,
        partition=PartitionSpec("dirichlet", clients=5, alpha=0.5, min_size=10, seed=0),
        rounds=6, batch_size=32, eval_local_models=False, sample_rate=0.75,
    )  # fmt: skip
    _, rows_full = run(rc)
    saved, keep = checkpoint_keeper()
    Simulation(rc, device=CPU).run(progress=False, on_checkpoint=keep)
    waiting = [c for c in saved if c["tasks"]["reports"]]
    assert waiting and all(isinstance(r["y"], Summed) for c in waiting for r in c["tasks"]["reports"].values())
    for c in waiting:
        status, rows, msg = Simulation(rc, device=CPU).run(progress=False, resume=c)
        assert status == "completed", msg
        assert strip(rows) == strip(rows_full), c["round"]
