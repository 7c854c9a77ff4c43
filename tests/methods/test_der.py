"""FL+DER / DER++ (methods/der.py): the local loss equals CE + alpha MSE(h(x'), z')
[+ beta CE(h(x''), y'')] on the buffer batches the keyed generator draws, the logits kept
are the training forward's, zero weights or no buffer are FedAvg bit for bit, a
class-IL run with per-task heads, hyperparameter validation."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedforget.config import TrainSpec
from fedforget.methods import ClientContext, RunInfo, check_params
from fedforget.methods.der import DER, MEMORY_STREAM
from fedforget.methods.replay import ReplayPlan, Reservoir, sample_generator
from fedforget.models import Classifier
from fedforget.parse import parse_config
from fedforget.partition import PartitionSpec
from fedforget.utils import FedForgetError

from .conftest import CPU, close_buffers, replay_stream_cfg, run

INFO = RunInfo(CPU, num_classes=3, seed=0, num_clients=2, train=TrainSpec())


# not `setup`: pytest 7 calls a module's setup() with the module (nose style) before its tests
def client_setup(params: dict):
    torch.manual_seed(0)
    model = Classifier(nn.Sequential(nn.Linear(4, 5), nn.ReLU()), 5, 3)
    gen = torch.Generator().manual_seed(1)
    state = {}
    Reservoir(10).offer(state, torch.randn(7, 4, generator=gen), torch.randint(0, 3, (7,), generator=gen),
                        torch.Generator(), task=0, logits=torch.randn(7, 3, generator=gen))  # fmt: skip
    ctx = ClientContext(
        cid=1, round=2, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        global_params={}, broadcast={}, state=state, n_samples=4, lr=0.1, local_epochs=1, batch_size=4,
    )  # fmt: skip
    method = DER(DER.Params(buffer_size=10, memory_batch_size=3, **params), INFO)
    method.client_begin(ctx)
    x, y = torch.randn(4, 4, generator=gen), torch.randint(0, 3, (4,), generator=gen)
    return method, ctx, model, state, x, y


@pytest.mark.parametrize("plus", [False, True])
def test_loss_equals_the_hand_formula(plus):
    method, ctx, model, state, x, y = client_setup({"alpha": 0.3, "beta": 0.7, "plus": plus})
    before = copy.deepcopy(state)
    loss = method.batch_loss(ctx, x, y)
    gen = sample_generator(0, 2, 1, 0, MEMORY_STREAM)  # the method's keyed draws, in order
    m1 = Reservoir(10).sample(before, 3, gen)
    expected = F.cross_entropy(model(x), y) + 0.3 * ((model(m1["x"]) - m1["logits"]) ** 2).mean()
    if plus:
        m2 = Reservoir(10).sample(before, 3, gen)
        expected = expected + 0.7 * F.cross_entropy(model(m2["x"]), m2["y"])
    assert torch.allclose(loss, expected, atol=1e-6)
    assert Reservoir(10).seen(state) == 7  # no offer outside the first pass (budget 0 here)


def test_offered_rows_keep_the_training_forward_logits():
    method, ctx, model, state, x, y = client_setup({})
    s = method.scratch(ctx)
    s.to_offer = 4  # inside the first pass: the round's plan made again with it
    s.plan = ReplayPlan(method.replay.buffer, ctx, s, 1, 3, torch.device("cpu"))
    logits = model(x)
    method.client_loss(ctx, x, y, None, logits)
    method.client_end(ctx)  # the buffer's counters
    rows = Reservoir(10).rows(state)
    assert Reservoir(10).seen(state) == 11 and Reservoir(10).size(state) == 10
    got = {int(i): r for i, r in enumerate(rows["x"]) if any(torch.equal(r, xi) for xi in x)}
    assert got  # some rows entered
    for i in got:
        j = next(j for j in range(4) if torch.equal(rows["x"][i], x[j]))
        assert torch.equal(rows["logits"][i], logits[j].detach()) and rows["y"][i] == y[j]


def test_empty_buffer_adds_nothing():
    method, ctx, model, state, x, y = client_setup({})
    ctx.state, ctx.scratch = {}, {}  # a client without a buffer, its round set up anew
    method.client_begin(ctx)
    assert torch.equal(method.batch_loss(ctx, x, y), F.cross_entropy(model(x), y))


@pytest.mark.parametrize("params", [{"alpha": 0.0}, {"alpha": 0.0, "beta": 0.0, "plus": True}, {"buffer_size": 0}])
def test_no_replay_term_is_fedavg_bit_for_bit(make_run_config, params):
    """alpha = 0 (and beta = 0 for DER++), or no buffer: FedAvg's run, every metric equal,
    while the buffer still fills (alpha = 0) -- over 3 rounds and 2 local epochs."""
    _, rows_avg = run(make_run_config(method="fedavg", rounds=3, local_epochs=2))
    sim, rows = run(make_run_config(method="der", params=params, rounds=3, local_epochs=2))
    strip = lambda r: {k: v for k, v in r.items() if not k.endswith("_s") and not k.startswith("der_")}  # noqa: E731
    assert [strip(r) for r in rows] == [strip(r) for r in rows_avg]
    filled = params.get("buffer_size", 200) > 0
    assert (rows[-1]["der_buffer_size"] > 0) == filled


def test_class_il_run_with_per_task_heads(make_run_config):
    """DER++ on split digits with one head per task: replayed rows of task 0 go through
    their own task's (frozen) head while task 1 trains; the buffers hold both tasks."""
    scenario = {"kind": "split", "tasks": 2, "classes_per_task": 2, "rounds_per_task": 2, "heads": "per_task", "leftover_classes": "drop"}
    rc = make_run_config(dataset="digits", model="cnn2d", method="der", params={"plus": True, "buffer_size": 20},
                         scenario=scenario, rounds=4, batch_size=32, eval_local_models=False)  # fmt: skip
    sim, rows = run(rc)
    assert rows[-1]["der_buffer_size"] == 20.0 and rows[-1]["der_mse"] >= 0
    tasks = set()
    for st in sim.client_state.values():
        tasks |= set(Reservoir(20).rows(st)["task"].tolist())
    assert tasks == {0, 1}


@pytest.mark.parametrize(
    "field,value", [("alpha", -0.1), ("beta", float("nan")), ("plus", "yes"), ("buffer_size", -2), ("memory_batch_size", 0)]
)
def test_bad_hyperparameters_are_rejected(minimal_config, field, value):
    minimal_config["experiments"][0]["methods"] = [{"name": "der", "params": {field: value}}]
    with pytest.raises(FedForgetError, match=field):
        parse_config(minimal_config)


def test_defaults():
    assert check_params("der", {}) == {
        "alpha": 1.0, "beta": 0.5, "plus": False, "buffer_size": 200, "memory_batch_size": 32,
    }  # fmt: skip


@pytest.mark.parametrize(
    "model,incremental,params,order",
    [("mlp", "class", {"buffer_size": 30}, "natural"),  # batched steps (stacked_forward)
     ("cnn2d", "task", {"buffer_size": 30, "plus": True, "memory_batch_size": 8}, "natural"),  # client by client, tails batched
     # the stack's padding rows (label 0, task 0) outside task 0's classes: an infinite CE
     # times the row mask 0 made the loss NaN (found in review; the run diverged)
     ("mlp", "task", {"buffer_size": 30, "plus": True}, "shuffled")],
    ids=["der-mlp-class-il", "derpp-cnn2d-task-il", "derpp-mlp-task-il-shuffled"],
)  # fmt: skip
def test_der_trains_stacked_as_sequential(make_run_config, run_engines, assert_same_metrics, model, incremental, params,
                                          order):  # fmt: skip
    """Issue 32, 3: DER's replay terms (each client's buffer batches, their MSE on the stored
    logits [and DER++'s CE], one stacked forward; the step's rows and logits offered) in the
    stacked trainer within 1e-5 of the sequential one, metrics and buffers, stored logits
    included."""
    out = run_engines(replay_stream_cfg(make_run_config, "der", params, model, incremental=incremental, class_order=order))
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v)
    assert any(r.get("der_mse", 0) > 0 for r in rows_s)
    assert all("logits" in st["replay"] for st in seq.fed.clients.values())
    close_buffers(seq, vec)


@pytest.mark.parametrize(
    "method,model,params",
    [("der", "mlp", {"buffer_size": 30, "plus": True}),  # batched steps (stacked_forward)
     ("agem", "cnn2d", {"buffer_size": 30})],  # client by client in replicas, tails batched
)
def test_replay_with_per_task_heads_trains_stacked_as_sequential(make_run_config, run_engines, assert_same_metrics,
                                                                   method, model, params):  # fmt: skip
    """Per-task heads in the stacked trainer with replayed rows: each replayed row through its
    own task's head (the earlier heads frozen at their global weights, as
    ``Classifier.row_logits`` routes them for a client alone), within 1e-5 of the sequential
    trainer, metrics and buffers."""
    opts = {"channels": [4, 8], "hidden": 16} if model == "cnn2d" else None
    out = run_engines(replay_stream_cfg(make_run_config, method, params, model, opts, heads="per_task"))
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert vec.engine_info["client_engine"] == "vectorized"
    assert_same_metrics(rows_s, rows_v)
    close_buffers(seq, vec)


@pytest.mark.parametrize(
    "method,params,batch",  # batch 8: every step batched (stacked_forward); 16: wide steps client by client on a CPU
    [("der", {"buffer_size": 30, "plus": True}, 16), ("agem", {"buffer_size": 30}, 8)],
)
def test_replay_on_a_keyed_dropout_model_trains_stacked_as_sequential(make_run_config, run_engines, assert_same_metrics,
                                                                       tmp_path, method, params, batch):  # fmt: skip
    """FedGP's MNIST CNN (keyed dropout): the replayed rows' forward is the step's second
    call of each dropout module, its masks each client's own (padding rows after the real
    ones), so A-GEM and DER++ train stacked on it as alone, within 1e-5."""
    from dataclasses import replace

    from fedforget.data import prepare_dataset

    opts = {"num_train": 300, "num_test": 60, "size": 16}
    prepare_dataset("blobs", opts, tmp_path)
    scenario = {"kind": "split", "tasks": 2, "classes_per_task": 5, "rounds_per_task": 2, "incremental": "class"}
    rc = make_run_config(dataset="blobs", options=opts, model="cnn_fedgp", method=method, params=params, scenario=scenario,
                         rounds=4, local_epochs=2, batch_size=batch, sample_rate=1.0, eval_local_models=False,
                         optimizer={"lr": 0.05}, partition=PartitionSpec("dirichlet", clients=3, alpha=0.5, min_size=5, seed=0))  # fmt: skip
    out = run_engines(replace(rc, data_dir=str(tmp_path)))
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v)
    close_buffers(seq, vec)


def test_buffer_logits_stay_float32_under_bf16(make_run_config):
    """The stored logits are the MSE targets: float32 whatever the step's precision (bf16
    autocast gives bf16 logits; the code's buffer holds float32)."""
    rc = replay_stream_cfg(make_run_config, "der", {"buffer_size": 20}, rounds=2, precision="bf16")
    sim, _ = run(rc)
    bufs = [st["replay"] for st in sim.fed.clients.values() if "replay" in st]
    assert bufs and all(b["logits"].dtype == torch.float32 for b in bufs)
