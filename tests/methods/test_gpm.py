"""FL+GPM: the energy rule on hand-made spectra (first task and with captured energy), bases
orthonormal and capped at d, the projected gradient orthogonal to the memory, a projected
client round (wd = 0, momentum = 0) leaving the model's outputs on old inputs unchanged, the
pooled (global) memory equal to GPM on the clients' concatenated representations, and split
digits runs with both memories (threshold 0: FedAvg bit for bit)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from fedforget.activations import layer_inputs, weight_matrix
from fedforget.config import TrainSpec
from fedforget.engine import Simulation
from fedforget.methods import ClientContext, RunInfo, check_params, make_params
from fedforget.methods.gpm import BASES, GPM, gpm_update, representation_factors
from fedforget.methods.shared import energy_rank, projected_layers, threshold_at
from fedforget.models import build_model
from fedforget.partition import PartitionSpec
from fedforget.utils import FedForgetError

from .conftest import CPU, checkpoint_keeper, digits_cfg, gen, held_stacks, projector, run, strip


def orthonormal(d, r, seed):
    return torch.linalg.qr(torch.randn(d, r, generator=gen(seed), dtype=torch.float64))[0]


# ----------------------------------------------------------------------------- the rule


def test_energy_rank_picks_the_smallest_rank_reaching_the_threshold():
    sq = torch.tensor([9.0, 4.0, 1.0, 0.25])  # cumulative shares .632, .912, .982, 1
    total = float(sq.sum())
    assert [energy_rank(sq, total, 0.0, th) for th in (0.5, 0.6315, 0.9, 0.95, 0.99, 1.0)] == [
        1,
        1,
        2,
        3,
        4,
        4,
    ]
    # with captured energy (Eq. 9): 0.7 + 9/14.25 >= 0.9 after one direction
    assert energy_rank(sq, total, 0.7, 0.9) == 1
    assert energy_rank(sq, total, 0.95, 0.9) == 0  # already captured: nothing added
    assert energy_rank(sq, total, 0.0, 0.0) == 0  # threshold 0: no memory
    # numerical zeros are never kept, even for threshold 1
    assert energy_rank(torch.tensor([1.0, 1e-20]), 1.0, 0.0, 1.0) == 1


def test_threshold_schedule():
    assert threshold_at(0.97, 0.003, 0) == 0.97
    assert threshold_at(0.97, 0.003, 5) == pytest.approx(0.985)
    assert threshold_at(0.99, 0.01, 3) == 1.0


def hand_matrix():
    """A [6, 5] = Q diag(3, 2, 1, 0.5) V^T: energies 9, 4, 1, 0.25 along Q's columns."""
    q, v = orthonormal(6, 4, 1), orthonormal(5, 4, 2)
    return (q * torch.tensor([3.0, 2.0, 1.0, 0.5], dtype=torch.float64)) @ v.T, q


def test_memory_update_on_a_hand_made_spectrum():
    a, q = hand_matrix()
    m = gpm_update(None, a, 0.9)  # first task: 9 + 4 of 14.25 >= 0.9
    assert m.shape == (6, 2) and m.dtype == torch.float32
    torch.testing.assert_close(projector(m), projector(q[:, :2]), atol=1e-6, rtol=0)
    # second update on the same task: captured 13/14.25 = .912; 0.97 needs the third direction
    m2 = gpm_update(m, a, 0.97)
    assert m2.shape == (6, 3)
    torch.testing.assert_close(m2[:, :2], m)  # old directions kept as they were
    torch.testing.assert_close(projector(m2), projector(q[:, :3]), atol=1e-6, rtol=0)
    assert gpm_update(m2, a, 0.97) is m2  # nothing more needed
    assert gpm_update(None, torch.zeros(6, 5), 0.97) is None  # no energy, no memory



def test_the_codes_first_rank_keeps_one_direction_fewer():
    """update_GPM's first memory: r = #(cumulative ratios < eps) [C], Eq. 5's smallest r
    reaching eps minus one; later memories use the smallest r in both (issue 36)."""
    a, q = hand_matrix()  # ratios 9, 13, 14, 14.25 of 14.25: 0.632, 0.912, 0.982, 1.0
    assert gpm_update(None, a, 0.9).shape == (6, 2)  # paper: 0.912 >= 0.9 at r = 2
    code = gpm_update(None, a, 0.9, "code")
    assert code.shape == (6, 1)  # code: one ratio (0.632) below 0.9
    torch.testing.assert_close(projector(code), projector(q[:, :1]), atol=1e-6, rtol=0)
    assert gpm_update(code, a, 0.97, "code").shape == (6, 3)  # later: smallest r, as the paper
    assert check_params("gpm", {})["task0_rank"] == "paper"


def test_bases_stay_orthonormal_and_at_most_d_columns():
    m = None
    for t in range(6):
        a = torch.randn(12, 3, generator=gen(10 + t)) @ torch.randn(
            3, 40, generator=gen(20 + t)
        )  # rank 3
        m = gpm_update(
            m, a + 0.01 * torch.randn(12, 40, generator=gen(30 + t)), threshold_at(0.97, 0.01, t)
        )
        torch.testing.assert_close(m.T @ m, torch.eye(m.shape[1]), atol=1e-5, rtol=0)
    m = gpm_update(m, torch.randn(12, 50, generator=gen(3)), 1.0)
    assert m.shape == (12, 12)
    torch.testing.assert_close(m.T @ m, torch.eye(12), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- the client step


def client(model, bases, lr=0.1, params=None, rounds=10):
    method = GPM(
        make_params("gpm", {"memory": "global", **(params or {})}),
        RunInfo(CPU, 10, 0, 2, TrainSpec(rounds=rounds)),
    )
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0, weight_decay=0.0)
    ctx = ClientContext(cid=0, round=3, model=model, optimizer=opt, global_params={}, broadcast={BASES: bases},
                        state={}, n_samples=8, lr=lr, local_epochs=1, batch_size=8, task=1)  # fmt: skip
    method.client_begin(ctx)
    return method, ctx


def old_memory(model, x_old):
    layers = projected_layers(model)
    factors = representation_factors(model, layers, x_old)
    return {n: gpm_update(None, f, 1.0) for n, f in factors.items()}


def test_projected_gradient_is_orthogonal_to_the_memory_and_biases_are_dropped():
    torch.manual_seed(0)
    model = build_model("cnn2d", (1, 8, 8), 10)
    bases = old_memory(model, torch.randn(3, 1, 8, 8, generator=gen(1)))
    method, ctx = client(model, bases)
    method.client_step(ctx, torch.randn(8, 1, 8, 8, generator=gen(2)), torch.arange(8))
    method.client_grad(ctx)
    for name, layer in projected_layers(model).items():
        g = layer.weight.grad.reshape(layer.weight.shape[0], -1)
        assert (g @ bases[name]).abs().max() < 1e-5 * max(g.abs().max().item(), 1.0), name
        assert layer.bias.grad is None  # frozen (bias: freeze)
    method, ctx = client(model, bases, params={"bias": "free"})
    method.client_step(ctx, torch.randn(8, 1, 8, 8, generator=gen(2)), torch.arange(8))
    method.client_grad(ctx)
    assert all(layer.bias.grad is not None for layer in projected_layers(model).values())


def test_projected_steps_leave_outputs_on_old_inputs_unchanged():
    """wd = 0, momentum = 0, biases frozen: every layer's output on inputs in the span of its
    memory is unchanged, so the whole model's logits on the old inputs are too."""
    torch.manual_seed(0)
    model = build_model("cnn2d", (1, 8, 8), 10)
    x_old = torch.randn(4, 1, 8, 8, generator=gen(1))
    bases = old_memory(model, x_old)
    assert any(u.shape[1] < u.shape[0] for u in bases.values())  # not every layer is frozen
    before_old, before_new = model(x_old).detach(), None
    layers = projected_layers(model)
    outs_before = {
        n: weight_matrix(m) @ a
        for (n, m), a in zip(layers.items(), layer_inputs(model, x_old, layers).values())
    }
    method, ctx = client(model, bases, lr=0.5)
    x_new = torch.randn(8, 1, 8, 8, generator=gen(2))
    before_new = model(x_new).detach()
    for _ in range(3):
        ctx.optimizer.zero_grad(set_to_none=True)
        method.client_step(ctx, x_new, torch.arange(8) % 10)
        method.client_grad(ctx)
        ctx.optimizer.step()
    after_old = model(x_old).detach()
    torch.testing.assert_close(after_old, before_old, atol=1e-4, rtol=1e-4)
    for (n, m), a in zip(layers.items(), layer_inputs(model, x_old, layers).values()):
        torch.testing.assert_close(weight_matrix(m) @ a, outs_before[n], atol=1e-4, rtol=1e-4)
    assert (model(x_new).detach() - before_new).abs().max() > 1e-2  # it did learn


def test_pooled_memory_is_gpm_on_the_concatenated_representations():
    torch.manual_seed(0)
    model = build_model("cnn2d", (1, 8, 8), 10)
    layers = projected_layers(model)
    xs = [torch.randn(n, 1, 8, 8, generator=gen(40 + n)) for n in (3, 5, 20)]
    factors = [representation_factors(model, layers, x, chunk=4) for x in xs]
    raw = [layer_inputs(model, x, layers) for x in xs]
    for name in layers:
        pooled = gpm_update(None, torch.cat([f[name] for f in factors], 1), 0.97)
        direct = gpm_update(None, torch.cat([r[name] for r in raw], 1), 0.97)
        assert pooled.shape == direct.shape, name
        torch.testing.assert_close(projector(pooled), projector(direct), atol=1e-4, rtol=0)
        for f, r in zip(factors, raw):  # each factor has its representation's Gram matrix
            torch.testing.assert_close(
                f[name] @ f[name].T, r[name] @ r[name].T, atol=1e-3, rtol=1e-4
            )
            assert f[name].shape[1] <= min(r[name].shape)


def test_bad_params_are_refused():
    for bad in (
        {"memory": "server"},
        {"samples": 0},
        {"threshold": 1.5},
        {"threshold_step": -0.1},
        {"bias": "augment"},
    ):
        with pytest.raises(FedForgetError, match=next(iter(bad))):
            make_params("gpm", bad)


# ----------------------------------------------------------------------------- runs


@pytest.mark.parametrize("memory", ["global", "local"])
def test_split_digits_run_builds_orthonormal_memories(make_run_config, memory):
    sim, rows = run(digits_cfg(make_run_config, "gpm", {"memory": memory, "samples": 40}))
    ends = rows[1:]  # every round ends a task
    ranks = [r["gpm_basis_rank"] for r in ends]
    assert all(0 < a <= b for a, b in zip(ranks, ranks[1:])), ranks  # grows with the tasks
    assert all(0 < r["gpm_basis_fill"] <= 1 for r in ends)
    memories = (
        [sim.server.state[BASES]]
        if memory == "global"
        else [s[BASES] for s in sim.client_state.values() if BASES in s]
    )
    assert memories and all(memories)
    for bases in memories:
        for u in bases.values():
            torch.testing.assert_close(
                u.T @ u, torch.eye(u.shape[1], device=u.device), atol=1e-5, rtol=0
            )


def test_before_its_first_memory_gpm_is_fedavg_bit_for_bit(make_run_config):
    """Task 0's round (no memory exists while it trains and aggregates; a threshold of 0,
    which would keep none ever, is refused): GPM's step and aggregation are FedAvg's."""
    sims = [Simulation(digits_cfg(make_run_config, m), device=CPU) for m in ("fedavg", "gpm")]
    rows = [strip([s.run_round(1, time.perf_counter())], "gpm_") for s in sims]
    assert rows[0] == rows[1]
    assert all(torch.equal(v, sims[1].global_params[k]) for k, v in sims[0].global_params.items())


def test_resume_after_a_task_end_equals_the_uninterrupted_run(make_run_config):
    """The clients' memories (ctx.state) survive a checkpoint taken at a task's end."""

    rc = digits_cfg(make_run_config, "gpm", {"samples": 40}, sample_rate=0.75)
    _, rows_full = run(rc)
    saved, keep = checkpoint_keeper()

    Simulation(rc, device=CPU).run(progress=False, on_checkpoint=keep)
    assert saved and saved[0]["round"] == 1
    sim = Simulation(rc, device=CPU)
    status, rows, msg = sim.run(progress=False, resume=saved[0])
    assert status == "completed", msg
    assert strip(rows) == strip(rows_full)
    lost = {**saved[0], "client_state": {}}  # not vacuous: without the memories it differs
    _, rows_lost, _ = Simulation(rc, device=CPU).run(progress=False, resume=lost)
    assert strip(rows_lost) != strip(rows_full)


@pytest.mark.parametrize("name", ["gpm", "fot", "fedprotip"])
def test_a_zero_threshold_is_refused(name):
    """eps = 0 keeps no basis: the method would silently be FedAvg."""
    with pytest.raises(FedForgetError, match=r"threshold=0; allowed: a finite number > 0 and <= 1"):
        check_params(name, {"threshold": 0})


def test_per_layer_thresholds_as_in_the_codes_pmnist():
    """``threshold`` may give one value per projected layer (issue 36, 4); another length is
    refused naming the layers."""
    model = build_model("mlp", (6,), 3, {"hidden": [5, 4]})
    layers = projected_layers(model)
    m = make_params("gpm", {"threshold": [0.95, 0.99, 0.99], "threshold_step": 0.01})
    method = GPM(m, RunInfo(CPU, num_classes=3, seed=0, num_clients=2, train=TrainSpec()))
    eps = method.thresholds(layers, 2)
    assert list(eps.values()) == pytest.approx([0.97, 1.0, 1.0])  # + 0.01 x 2, capped at 1
    wrong = GPM(make_params("gpm", {"threshold": [0.9, 0.9]}), method.info)
    with pytest.raises(FedForgetError, match=r"threshold has 2 values for 3 projected layers"):
        wrong.thresholds(layers, 0)
    assert check_params("gpm", {})["threshold"] == 0.97


def test_per_layer_thresholds_of_another_length_stop_the_run_before_training(make_run_config, monkeypatch):
    """The list's length is checked when the model is built (``model_init``), before round 0
    trains: not at the first task end, after a task's training."""
    rc = make_run_config(dataset="digits", model="cnn2d", model_options={"channels": [4, 8], "hidden": 16},
                         method="gpm", params={"threshold": [0.9]},
                         scenario={"kind": "split", "tasks": 2, "classes_per_task": 5, "rounds_per_task": 1})  # fmt: skip
    from fedforget.trainers import LocalTrainer

    trained, original = [], LocalTrainer.train_client
    monkeypatch.setattr(LocalTrainer, "train_client", lambda self, *a, **k: trained.append(1) or original(self, *a, **k))
    with pytest.raises(FedForgetError, match=r"method 'gpm': threshold has 1 values for 4 projected layers"):
        Simulation(rc, device=CPU).run(progress=False)
    assert not trained


# ----------------------------------------------------------------------------- the stacked trainer
@pytest.mark.parametrize("memory", ["local", "global"])
def test_gpm_trains_stacked_as_sequential(make_run_config, run_engines, assert_same_metrics, monkeypatch, memory):
    """GPM's projection and held biases are the step terms' gradient map: each client's rows
    against its own memory (local) or the broadcast's (global). On an MLP (every step
    batched) with a pool partition where a client holds no task-0 rows (so it has no memory
    in task 1 while the others hold their biases: a stack of held and free clients,
    ``Held``), 2 local epochs with momentum and weight decay: metrics and global weights
    within 1e-5 of the sequential trainer."""
    mixed = held_stacks(monkeypatch)
    rc = digits_cfg(make_run_config, "gpm", {"samples": 32, "memory": memory}, local_epochs=2, sample_rate=1.0,
                    optimizer={"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3})  # fmt: skip
    rc = replace(rc, dataset=replace(rc.dataset, model="mlp", model_options={}),
                 partition=PartitionSpec("dirichlet", clients=4, alpha=0.1, min_size=10, seed=3))  # fmt: skip
    out = run_engines(rc, CPU)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v)
    for k, v in seq.global_params.items():
        torch.testing.assert_close(v, vec.global_params[k], atol=1e-5, rtol=1e-5)
    if memory == "local":
        assert mixed, "no stack mixed held and free clients: the partition no longer leaves a client without task-0 rows"
