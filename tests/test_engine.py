"""The simulation engine: determinism, keyed client sampling, FedAvg == local SGD for one
client, run outputs, divergence handling."""

from __future__ import annotations

import csv
import json
import math
import uuid
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fedforget
from fedforget.config import RunConfig
from fedforget.data import load_dataset
from fedforget.engine import BASE_COLUMNS, INIT_STREAM, Simulation, sample_clients
from fedforget.methods import METHODS, FedAvg
from fedforget.models import build_model
from fedforget.partition import PartitionSpec, client_indices, make_partition, save_partition
from fedforget.runner import run_training
from fedforget.trainers import SHUFFLE_STREAM, Diverged, LocalLoss
from fedforget.utils import FedForgetError, Unchanged, torch_seed

CPU = torch.device("cpu")
TIMING = {"train_time_s", "eval_time_s", "elapsed_s"}


def _strip(rows):
    return [
        {k: v for k, v in r.items() if k not in TIMING and not k.endswith("_time_s")} for r in rows
    ]


def _run(cfg):
    sim = Simulation(cfg, device=CPU)
    status, rows, msg = sim.run(progress=False)
    assert status == "completed", msg
    return sim, rows


# ----------------------------------------------------------------------------- client sampling


@pytest.mark.parametrize(
    "clients,rate", [(10, 0.5), (20, 0.1), (7, 0.3), (5, 0.01), (4, 1.0), (3, 0.999), (100, 0.25)]
)
@pytest.mark.parametrize("seed", [0, 1, 17])
def test_sample_clients_size_sorted_distinct(seed, clients, rate):
    m = max(1, round(rate * clients))
    for rnd in range(1, 6):
        s = sample_clients(seed, rnd, clients, rate)
        assert len(s) == m
        assert s == sorted(set(s))
        assert all(isinstance(c, int) and 0 <= c < clients for c in s)


def test_sample_clients_keyed_by_seed_and_round_only():
    forward = [sample_clients(3, r, 20, 0.25) for r in range(1, 21)]
    np.random.seed(999)  # global RNG state must not matter
    torch.manual_seed(999)
    backward = [sample_clients(3, r, 20, 0.25) for r in range(20, 0, -1)][::-1]
    assert forward == backward
    assert len({tuple(s) for s in forward}) > 1  # rounds differ
    assert [sample_clients(4, r, 20, 0.25) for r in range(1, 21)] != forward  # seeds differ
    assert sample_clients(3, 5, 20, 1.0) == list(range(20))


def test_sample_clients_roughly_uniform():
    counts = np.zeros(10)
    for r in range(1, 1001):
        for c in sample_clients(0, r, 10, 0.3):
            counts[c] += 1
    assert counts.sum() == 3000
    assert counts.min() > 240 and counts.max() < 360  # expected 300 each


# ----------------------------------------------------------------------------- determinism


def test_same_config_same_metrics(make_run_config):
    cfg = make_run_config(
        partition=PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=5),
        sample_rate=0.5,
        rounds=3,
    )
    _, a = _run(cfg)
    _, b = _run(cfg)
    assert [r["round"] for r in a] == [0, 1, 2, 3]
    assert _strip(a) == _strip(b)
    assert all(r["n_sampled_clients"] == 2 for r in a[1:])


def test_same_config_same_metrics_digits_cnn(make_run_config):
    cfg = make_run_config(dataset="digits", model="cnn2d", model_options={"channels": [4, 8], "hidden": 16},
                          partition=PartitionSpec("iid", clients=4), batch_size=32, rounds=2, eval_local_models=False,
                          optimizer={"lr": 0.1, "momentum": 0.9})  # fmt: skip
    sim_a, a = _run(cfg)
    sim_b, b = _run(cfg)
    assert _strip(a) == _strip(b)
    for k in sim_a.global_params:
        assert torch.equal(sim_a.global_params[k], sim_b.global_params[k])
    assert a[-1]["global_model_test_acc"] > a[0]["global_model_test_acc"]  # it learns something


def test_training_seed_changes_metrics_not_partition(make_run_config):
    spec = PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=5, seed=0)
    sim0, a = _run(make_run_config(partition=spec, seed=0))
    sim1, b = _run(make_run_config(partition=spec, seed=1))
    assert _strip(a) != _strip(b)
    assert (
        a[0]["global_model_test_acc"] != b[0]["global_model_test_acc"]
        or a[0]["global_model_test_loss"] != b[0]["global_model_test_loss"]
    )
    assert sim0.clients.offsets == sim1.clients.offsets
    assert torch.equal(sim0.clients.rows, sim1.clients.rows)
    # and a different partition seed does change the client data
    sim2 = Simulation(
        make_run_config(
            partition=PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=5, seed=1)
        ),
        device=CPU,
    )
    assert sim2.clients.offsets != sim0.clients.offsets or not torch.equal(
        sim2.clients.rows, sim0.clients.rows
    )


def test_client_update_independent_of_client_order(make_run_config):
    cfg = make_run_config()
    sim = Simulation(cfg, device=CPU)
    up_first, loss_first, _ = sim.trainer.train_client(2, 1, 0.1)
    sim.trainer.train_client(0, 1, 0.1)
    sim.trainer.train_client(3, 1, 0.1)
    up_again, loss_again, _ = sim.trainer.train_client(2, 1, 0.1)
    assert loss_first == loss_again
    for k in up_first.params:
        assert torch.equal(up_first.params[k], up_again.params[k])
    assert up_first.n_samples == sim.clients.size(2) == 30
    assert up_first.steps == math.ceil(30 / cfg.train.batch_size)


def test_lr_decay_per_round(make_run_config):
    _, rows = _run(make_run_config(rounds=3, lr_decay=0.5, optimizer={"lr": 0.2}))
    assert [r["lr"] for r in rows[1:]] == pytest.approx([0.2, 0.1, 0.05])


def test_eval_every_skips_rounds_but_evaluates_last(make_run_config):
    _, rows = _run(make_run_config(rounds=3, eval_every=2, eval_local_models=False))
    assert "global_model_test_acc" not in rows[1]
    assert "global_model_test_acc" in rows[2] and "global_model_test_acc" in rows[3]
    assert all("local_models_global_test_acc_mean" not in r for r in rows)


def test_holdout_rows_never_trained_on(make_run_config, data_root, tmp_path):
    import shutil

    from fedforget.data import load_public, prepare_public

    root = tmp_path / "data"
    shutil.copytree(data_root / "iris", root / "iris")
    spec = {"source": "holdout", "fraction": 0.25, "seed": 0}
    prepare_public(spec, "iris", root)
    cfg = replace(make_run_config(public=spec), data_dir=str(root))
    sim = Simulation(cfg, device=CPU)
    assert sim.clients.offsets[-1][-1] == 120 - 30
    data = load_dataset("iris", root)
    held = load_public(spec, "iris", root, with_labels=False).excluded_train_rows
    order = np.concatenate(client_indices(make_partition(data.y_train, cfg.partition, held), 4))
    assert not set(order.tolist()) & set(held.tolist())
    assert sim.clients.rows.tolist() == order.tolist()  # client-sorted positions -> rows
    x, y = zip(*(sim.clients.slice(k) for k in range(4)))
    assert torch.equal(torch.cat(x), torch.as_tensor(data.x_train[order]))
    assert torch.equal(torch.cat(y), torch.as_tensor(data.y_train[order]))
    assert sim.server.public is not None and sim.server.public.y is None  # fedavg: no public labels


def test_stored_partition_is_used(make_run_config):
    cfg = make_run_config(partition=PartitionSpec("iid", clients=2))
    data = load_dataset("iris", cfg.data_dir)
    # store a deliberately different (but valid) assignment at the run's partition path
    assignment = np.where(np.arange(120) < 100, 0, 1).astype(np.int64)
    save_partition(cfg.partition_dir, assignment, cfg.partition, "iris", data.y_train, 3, None)
    sim = Simulation(cfg, device=CPU)
    assert sim.clients.offsets == [[0, 100], [100, 120]]


# ----------------------------------------------------------------------------- FedAvg == local SGD


@pytest.mark.parametrize("clients,rate", [(1, 1.0), (3, 0.3)])
def test_fedavg_single_client_equals_local_sgd(make_run_config, clients, rate):
    spec = PartitionSpec("iid", clients=clients, seed=2)
    cfg = make_run_config(partition=spec, sample_rate=rate, rounds=1, local_epochs=2, batch_size=8,
                          optimizer={"lr": 0.05, "momentum": 0.9}, seed=5)  # fmt: skip
    sim, rows = _run(cfg)
    (cid,) = sample_clients(cfg.seed, 1, clients, rate)

    # reproduce by hand: same init, same client data, same keyed batch order
    data = load_dataset("iris", cfg.data_dir)
    rows_k = client_indices(make_partition(data.y_train, spec), clients)[cid]
    x, y = torch.as_tensor(data.x_train[rows_k]), torch.as_tensor(data.y_train[rows_k])
    torch.manual_seed(torch_seed(cfg.seed, INIT_STREAM))
    model = build_model("mlp", (4,), 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(torch_seed(cfg.seed, 1, cid, SHUFFLE_STREAM))
    losses = []
    for _ in range(2):
        perm = torch.randperm(len(y), generator=gen)
        for s in range(0, len(y), 8):
            b = perm[s : s + 8]
            opt.zero_grad()
            loss = F.cross_entropy(model(x[b]), y[b])
            loss.backward()
            opt.step()
            losses.append(loss.item())
    expected = model.state_dict()
    assert set(expected) == set(sim.global_params)
    for k, v in expected.items():
        assert torch.equal(sim.global_params[k], v), k  # bit-identical
    assert rows[1]["sampled_clients_local_train_loss_mean"] == pytest.approx(
        np.mean(losses), rel=1e-5
    )
    assert rows[1]["n_sampled_clients"] == 1
    # the single local model is the global model
    assert rows[1]["local_models_global_test_acc_mean"] == pytest.approx(
        rows[1]["global_model_test_acc"]
    )


# ----------------------------------------------------------------------------- run outputs


def test_run_training_outputs(make_run_config, tmp_path):
    cfg = make_run_config(rounds=2)
    out = tmp_path / "run"
    rec = run_training(cfg, out, progress=False)
    with open(out / "metrics.csv", newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        body = list(reader)
    assert header == BASE_COLUMNS
    assert [int(r[0]) for r in body] == [0, 1, 2]
    assert body[0][header.index("lr")] == ""  # round 0: no training
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "completed" == rec["status"]
    assert run["config_hash"] == cfg.hash
    assert run["versions"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert run["versions"]["fedforget"] == fedforget.__version__ and "numpy" in run["versions"]
    assert RunConfig.from_dict(run["config"]).hash == cfg.hash
    assert run["rounds_completed"] == 2
    accs = [float(r[header.index("global_model_test_acc")]) for r in body[1:]]
    assert run["final_global_model_test_acc"] == pytest.approx(accs[-1])
    assert run["best_global_model_test_acc"] == pytest.approx(max(accs))
    assert run["device"] == "cpu"
    state = torch.load(out / "model.pt", weights_only=True)
    model = build_model("mlp", (4,), 3)
    model.load_state_dict(state)  # strict: same keys and shapes
    x = torch.as_tensor(load_dataset("iris", cfg.data_dir).x_test)
    y = torch.as_tensor(load_dataset("iris", cfg.data_dir).y_test)
    from fedforget.metrics import evaluate

    assert evaluate(model, x, y)[0] == pytest.approx(accs[-1])


# ----------------------------------------------------------------------------- divergence


@pytest.fixture
def nan_method():
    """A FedAvg variant whose loss becomes NaN from round 2 on, registered under a unique name."""
    name = f"test_nan_{uuid.uuid4().hex[:8]}"

    class NaNFromRound2(FedAvg):
        def client_loss(self, ctx, x, y, features, logits):
            terms = super().client_loss(ctx, x, y, features, logits)
            if ctx.round >= 2:
                terms["nan"] = logits.sum() * float("nan")
            return terms

    NaNFromRound2.name = name
    METHODS.register(name)(NaNFromRound2)
    yield name
    METHODS._items.pop(name, None)


def test_nan_loss_marks_run_diverged_and_keeps_rows(make_run_config, nan_method, tmp_path):
    cfg = make_run_config(method=nan_method, rounds=3)
    sim = Simulation(cfg, device=CPU)
    status, rows, msg = sim.run(progress=False)
    assert status == "diverged"
    assert [r["round"] for r in rows] == [0, 1]
    assert "round 2" in msg and "nan" in msg.lower()
    assert all(torch.isfinite(v).all() for v in sim.global_params.values())

    out = tmp_path / "div"
    rec = run_training(cfg, out, progress=False)  # no exception
    assert rec["status"] == "diverged"
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "diverged" and run["rounds_completed"] == 1
    assert run["final_global_model_test_acc"] is None
    assert run["best_global_model_test_acc"] is not None
    lines = (out / "metrics.csv").read_text().splitlines()
    assert lines[0].split(",") == BASE_COLUMNS and len(lines) == 3
    assert (out / "model.pt").exists()


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_a_number_that_overflows_in_training_is_divergence(make_run_config, engine):
    """FedRCL's temperature at 1e-300: a Python float of 1 / tau beyond float32, which torch
    refuses to convert (a traceback before): the run diverged, its rows so far kept."""
    sim = Simulation(make_run_config(method="fedrcl", params={"tau": 1e-300}, rounds=2, client_engine=engine), device=CPU)
    status, rows, msg = sim.run(progress=False)
    assert status == "diverged" and [r["round"] for r in rows] == [0]
    assert msg == "a number overflowed in round 1 (value cannot be converted to type float without overflow)"


def test_sequential_losses_are_read_at_the_round_end_unless_the_method_ends_clients_itself(
    make_run_config, tmp_path
):
    """One client after another, a FedAvg client's mean loss stays on the device
    (``LocalLoss``) until the round reads every client's at its end: the same number
    ``train_client`` reads at once. A method with its own ``client_end`` gets its client's
    loss read before that hook runs: a diverged client's end is never run."""
    sim = Simulation(make_run_config(), device=CPU)
    tr = sim.trainer
    _, (kept,), _ = tr.train_group({1: tr.round_view(1, 1)}, 1, 0.1)
    assert isinstance(kept, LocalLoss) and kept.cid == 1
    _, read, _ = tr.train_client(1, 1, 0.1)
    assert isinstance(read, float) and kept.value() == read
    _, losses, _, _, _ = tr.train_round(1, 0.1, {c: tr.round_view(c, 1) for c in (0, 1)})
    assert losses[1] == read and all(isinstance(x, float) for x in losses)

    name, ended = f"test_nanend_{uuid.uuid4().hex[:8]}", []

    class NaNOwnEnd(FedAvg):
        own_upload = True  # declared, as the protocol tests require of a method that writes client_end

        def client_loss(self, ctx, x, y, features, logits):
            return {"nan": logits.sum() * float("nan")} if ctx.cid == 2 else super().client_loss(ctx, x, y, features, logits)

        def client_end(self, ctx):
            ended.append(ctx.cid)
            return super().client_end(ctx)

    METHODS.register(name)(NaNOwnEnd)
    try:
        tr = Simulation(make_run_config(method=name), device=CPU).trainer
        _, (loss,), _ = tr.train_group({1: tr.round_view(1, 1)}, 1, 0.1)
        assert isinstance(loss, float) and ended == [1]
        with pytest.raises(Diverged, match="client 2 local loss is nan in round 1"):
            tr.train_round(1, 0.1, {c: tr.round_view(c, 1) for c in (0, 2, 3)})
        assert ended == [1, 0]
    finally:
        METHODS._items.pop(name, None)


def test_nan_from_first_round(make_run_config, tmp_path):
    name = f"test_nan1_{uuid.uuid4().hex[:8]}"

    class NaNAlways(FedAvg):
        def client_loss(self, ctx, x, y, features, logits):
            return {"nan": logits.sum() * float("nan")}

    METHODS.register(name)(NaNAlways)
    try:
        rec = run_training(make_run_config(method=name), tmp_path / "r", progress=False)
    finally:
        METHODS._items.pop(name, None)
    assert rec["status"] == "diverged" and rec["rounds_completed"] == 0
    assert rec["best_global_model_test_acc"] is None


def test_method_diagnostics_become_prefixed_columns(make_run_config, tmp_path):
    name = f"test_diag_{uuid.uuid4().hex[:8]}"

    class Diag(FedAvg):
        def client_end(self, ctx):
            ctx.stats["cid"] = float(ctx.cid)
            return super().client_end(ctx)

        def server_metrics(self, server, uploads):
            return {"uploads": len(uploads)}

    METHODS.register(name)(Diag)
    try:
        cfg = make_run_config(method=name, sample_rate=0.5, rounds=2)
        run_training(cfg, tmp_path / "r", progress=False)
    finally:
        METHODS._items.pop(name, None)
    with open(tmp_path / "r" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
        header = list(rows[0].keys())
    assert header == BASE_COLUMNS + sorted([f"{name}_cid", f"{name}_uploads"])
    for r in rows[1:]:
        sampled = sample_clients(cfg.seed, int(r["round"]), 4, 0.5)
        assert float(r[f"{name}_cid"]) == pytest.approx(np.mean(sampled))
        assert float(r[f"{name}_uploads"]) == 2
    assert rows[0][f"{name}_cid"] == ""  # round 0 has no training


def test_run_training_failure_is_recorded(make_run_config, tmp_path):
    from fedforget.utils import FedForgetError

    cfg = replace(make_run_config(), data_dir=str(tmp_path / "empty"))
    with pytest.raises(FedForgetError, match="not prepared"):
        run_training(cfg, tmp_path / "r", progress=False)
    run = json.loads((tmp_path / "r" / "run.json").read_text())
    assert run["status"] == "failed"
    assert "FedForgetError" in run["error"] and "not prepared" in run["error"]
    assert run["config_hash"] == cfg.hash
    assert not (tmp_path / "r" / "metrics.csv").exists()


def test_stored_partition_for_another_spec_is_refused(make_run_config, data_root, tmp_path):
    """A partition directory whose stored spec differs from the run's is never reused."""
    import dataclasses

    from fedforget.engine import Simulation
    from fedforget.pipeline import partition_one
    from fedforget.utils import FedForgetError

    rc = make_run_config()
    other = dataclasses.replace(rc.partition, seed=rc.partition.seed + 1)
    partition_one(rc.dataset, other, rc.data_dir, rc.partition_dir)  # wrong spec at the run's path
    with pytest.raises(FedForgetError, match="delete it to redraw"):
        Simulation(rc)


def test_drop_last_skips_trailing_partial_batches(make_run_config):
    """iris, 4 IID clients of 30 samples, batch 16: 2 steps per epoch (16 + 14), 1 with
    drop_last; a client smaller than a batch keeps its one batch."""
    rc = make_run_config(rounds=1, local_epochs=2, batch_size=16)
    steps = {}
    for drop in (False, True):
        sim = Simulation(replace(rc, train=replace(rc.train, drop_last=drop)), device=CPU)
        up, _, _ = sim.trainer.train_client(0, 1, 0.1)
        steps[drop] = up.steps
    assert steps == {False: 4, True: 2}
    big = make_run_config(rounds=1, batch_size=64, drop_last=True)
    up, _, _ = Simulation(big, device=CPU).trainer.train_client(0, 1, 0.1)
    assert up.steps == 1  # 30 samples < 64: one batch, not none


def test_drop_last_lets_batchnorm_models_train(make_run_config):
    """resnet8 with BatchNorm on 8x8 digits: stage 4 is 1x1, so a trailing batch of one
    sample cannot train: in either trainer the run stops with one error naming the client,
    its rows and train.drop_last (PyTorch's bare ValueError before); drop_last avoids it."""
    rc = make_run_config(dataset="digits", model="resnet8", rounds=1, batch_size=32, sample_rate=0.25,
                         partition=PartitionSpec("iid", clients=4, seed=0))  # fmt: skip
    n = Simulation(rc, device=CPU).clients.size(0)
    bs = n - 1 if n % 32 != 1 else 32  # a batch size leaving one sample over
    rc = replace(rc, train=replace(rc.train, batch_size=bs))
    want = rf"round 1: a minibatch of one row reached a BatchNorm layer.*client 0: {n} rows, train.batch_size {bs}.*train.drop_last: true"
    seq = Simulation(replace(rc, train=replace(rc.train, client_engine="sequential")), device=CPU).trainer
    with pytest.raises(FedForgetError, match=want):
        seq.train_client(0, 1, 0.01)
    stacked = Simulation(replace(rc, train=replace(rc.train, client_engine="vectorized")), device=CPU).trainer
    with pytest.raises(FedForgetError, match=want):
        stacked.train_clients_together([0], 1, 0.01)
    status, _, msg = Simulation(replace(rc, train=replace(rc.train, drop_last=True)), device=CPU).run(progress=False)
    assert status == "completed", msg


def test_unchanged_holds_a_tensor_until_it_is_written_into_or_gone():
    """``Unchanged``: the very tensor marked, with no write since (in place, through a view
    too); a new tensor of the same values, a written one, a freed one or one under a name
    it was not given does not hold."""
    u = Unchanged({"w"})
    a, b = torch.zeros(3), torch.zeros(3)
    u.mark("w", a)
    assert u.holds("w", a) and u.get("w") is a
    assert not u.holds("w", b) and not u.holds("w", None) and not u.holds("v", a)
    a.detach()[1:].add_(1)
    assert not u.holds("w", a) and u.get("w") is None
    u.mark("w", a)
    with torch.no_grad():
        a.mul_(2)
    assert not u.holds("w", a)
    u.mark("w", b)
    del b
    assert u.get("w") is None
    u.mark("v", a)
    assert not u.holds("v", a) and u.get("v") is None


def test_to_device_moves_nested_tensors_only():
    from fedforget.state import to_device

    t = torch.ones(2)
    state = {"c": t, "hist": [t, (t, 3)], "n": 5, "name": "x"}
    moved = to_device(state, CPU)
    assert moved["c"] is t  # already there: no copy
    assert moved["hist"][1][1] == 3 and moved["n"] == 5 and moved["name"] == "x"
    meta = to_device(state, torch.device("meta"))
    assert meta["c"].device.type == "meta" and meta["hist"][1][0].device.type == "meta"
    assert state["c"].device.type == "cpu"  # the input is left as it was


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_local_optimizer_is_multi_tensor_and_bitwise_equal_to_the_plain_loop(name):
    """make_optimizer asks for PyTorch's foreach kernels (faster on a CPU); 20 steps give the
    same weights bit for bit as the per-tensor implementation."""
    import copy

    from fedforget.config import OptimizerSpec
    from fedforget.trainers import make_optimizer

    torch.manual_seed(0)
    model = build_model("cnn2d", (1, 8, 8), 10)
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
    spec = OptimizerSpec(name=name, lr=0.05 if name == "sgd" else 1e-3, momentum=0.9, weight_decay=1e-4)
    runs = []
    for fast in (True, False):
        m = copy.deepcopy(model)
        opt = make_optimizer(m.parameters(), spec, spec.lr)
        assert opt.defaults["foreach"] is True
        if not fast:
            opt.defaults["foreach"] = False
            for group in opt.param_groups:
                group["foreach"] = False
        for _ in range(20):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
        runs.append([p.detach().clone() for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
