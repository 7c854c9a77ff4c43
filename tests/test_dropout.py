"""Keyed dropout (fedforget.dropout, issue 32): masks keyed by (client, round, step, layer,
call, element), the same in both trainers."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.func import vmap

from fedforget import models
from fedforget.dropout import (
    DropoutKey,
    KeyedCalls,
    KeyedDropout,
    keep_mask,
    keep_scale,
    keyed_modules,
    set_dropout_key,
)
from fedforget.engine import Simulation
from fedforget.methods import METHODS
from fedforget.models import Classifier, build_model
from fedforget.partition import PartitionSpec
from fedforget.vectorized import stacked_forward, stacked_supported, why_not_vectorized

from .conftest import GPU_TOL_FACTOR

KEYS = torch.tensor([5, 77, 2**62 + 3])


def mask(key, step=4, salt=9, shape=(10, 7), p=0.5):
    return keep_mask(DropoutKey(key, step), salt, shape, p, torch.float32)


def test_keep_rate_scale_and_independence():
    m = mask(KEYS[0], shape=(200_000,), p=0.3)
    kept = m > 0
    assert m.unique().tolist() == pytest.approx([0.0, 1 / 0.7])
    assert kept.float().mean().item() == pytest.approx(0.7, abs=0.005)
    # neighbouring elements, other clients, steps and salts (layer, call): agreement of
    # independent draws, p^2 + (1 - p)^2 = 0.58
    agree = lambda a, b: ((a > 0) == (b > 0)).float().mean().item()  # noqa: E731
    assert agree(m[1:], m[:-1]) == pytest.approx(0.58, abs=0.01)
    for other in (mask(KEYS[1], shape=(200_000,), p=0.3), mask(KEYS[0], step=5, shape=(200_000,), p=0.3),
                  mask(KEYS[0], salt=10, shape=(200_000,), p=0.3)):  # fmt: skip
        assert agree(m, other) == pytest.approx(0.58, abs=0.01)
    assert torch.equal(m, mask(KEYS[0], shape=(200_000,), p=0.3))  # a pure function of its key
    assert not mask(KEYS[0], p=1.0).any()


def test_a_stack_draws_each_clients_own_masks_and_padding_rows_change_nothing():
    stacked = mask(KEYS, step=torch.tensor(4))
    for g in range(3):
        alone = mask(KEYS[g])
        assert torch.equal(stacked[g], alone)
        assert torch.equal(mask(KEYS[g], shape=(13, 7))[:10], alone)  # 3 padding rows appended
    by_vmap = vmap(lambda k: mask(k, step=torch.tensor(4)))(KEYS)
    assert torch.equal(by_vmap, stacked)


def test_a_stacked_encoders_masks_are_each_clients_own_on_its_real_rows():
    """``KeyedCalls.draw_stack`` (a training encoder stacked): client j's keep mask over its
    ``rows[j]`` real rows, scaled by ``keep_scale``, is the mask it draws alone with its host
    key (``draw``), its padding rows dropped, one salt for the whole call; a stack without
    host keys is refused."""
    stack, alone = KeyedCalls(), KeyedCalls()
    hosts, rows = (5, 77, 2**62 + 3), [4, 1, 0]
    set_dropout_key([stack], DropoutKey(torch.tensor(hosts), 3, hosts=hosts, rows=rows))
    first, second = stack.draw_stack((3, 4, 2, 5), 0.5), stack.draw_stack((3, 4, 2, 5), 0.3)
    assert stack.calls == 2 and first.dtype == torch.bool
    for j, (host, r) in enumerate(zip(hosts, rows)):
        set_dropout_key([alone], DropoutKey(torch.tensor(host), 3, host=host))
        for got, p in ((first, 0.5), (second, 0.3)):
            want = alone.draw((r, 2, 5), torch.float32, p) if r else None
            assert torch.equal(got[j, :r].float() * keep_scale(p), want) if r else True
            assert not got[j, r:].any()
    assert 0 < first[0].float().mean() < 1 and keep_scale(0.5) == 2.0 and keep_scale(1.0) == 0.0
    set_dropout_key([stack], DropoutKey(torch.tensor(hosts), torch.tensor(3)))
    with pytest.raises(RuntimeError, match="host keys"):
        stack.draw_stack((3, 4, 2, 5), 0.5)


def test_attention_with_kept_masks_differentiates_as_autograd_does():
    """``vectorized._KeptAttention`` ((softmax(s) * keep * scale) @ v, keeping the
    probabilities and the bool mask for its backward): the output and the gradients of the
    scores and v that autograd gives the same operators written out."""
    from fedforget.vectorized import _KeptAttention

    g = torch.Generator().manual_seed(0)
    s, v, out_grad = torch.randn(2, 3, 4, 6, 6, generator=g), torch.randn(2, 3, 4, 6, 5, generator=g), torch.randn(2, 3, 4, 6, 5, generator=g)
    keep = torch.rand(2, 3, 4, 6, 6, generator=g) >= 0.3
    s1, v1 = s.clone().requires_grad_(), v.clone().requires_grad_()
    out = _KeptAttention.apply(s1, keep, 1 / 0.7, v1)
    out.backward(out_grad)
    s2, v2 = s.clone().requires_grad_(), v.clone().requires_grad_()
    want = (s2.softmax(-1) * (keep.float() * (1 / 0.7))) @ v2
    want.backward(out_grad)
    assert torch.equal(out, want)
    assert torch.allclose(s1.grad, s2.grad, atol=1e-6) and torch.allclose(v1.grad, v2.grad, atol=1e-6)
    assert s1.grad.abs().sum() > 0 and v1.grad.abs().sum() > 0


def test_module_modes_channelwise_and_call_counts():
    d = KeyedDropout(0.5, channelwise=True)
    x = torch.randn(6, 4, 3, 3)
    assert torch.equal(d.eval()(x), x)
    d.train()
    torch.manual_seed(0)
    want = nn.Dropout2d(0.5)(x)
    torch.manual_seed(0)
    assert torch.equal(d(x), want)  # no key: torch's Dropout2d on torch's generator
    set_dropout_key([d], DropoutKey(KEYS[0], 0))
    a, b = d(x), d(x)
    m = (a != 0).float()
    assert torch.equal(m, m[:, :, :1, :1].expand_as(m))  # one draw per (row, channel)
    assert not torch.equal(a, b)  # a second forward in the step draws fresh masks
    set_dropout_key([d], DropoutKey(KEYS[0], 0))
    assert torch.equal(d(x), a)
    with pytest.raises(ValueError, match="p=1.5"):
        KeyedDropout(1.5)


def _dropout_cnn(input_shape, num_classes, norm="none"):
    c, h, w = input_shape
    bn = [nn.BatchNorm2d(8)] if norm == "batch" else []
    body = nn.Sequential(
        nn.Conv2d(c, 8, 3, padding=1), nn.ReLU(), KeyedDropout(0.2, channelwise=True),
        nn.Conv2d(8, 8, 3, padding=1), *bn, nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(8 * (h // 2) * (w // 2), 32), nn.ReLU(), KeyedDropout(0.5),
    )  # fmt: skip
    return Classifier(body, 32, num_classes)


@pytest.fixture
def dropout_model():
    name = "test_dropout_cnn"
    models.register(name, rank=3, norm="none")(_dropout_cnn)
    yield name
    for table in (models.MODELS._items, models.MODEL_INPUT_RANK, models.MODEL_DEFAULTS):
        table.pop(name, None)


def test_stacked_forward_draws_each_clients_masks():
    model = _dropout_cnn((1, 8, 8), 4).train()
    assert stacked_supported(model) is None
    params = {k: torch.stack([v.detach() + 0.01 * g for g in range(3)]) for k, v in model.named_parameters()}
    x = torch.randn(3, 5, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    drop = keyed_modules(model)
    set_dropout_key(drop, DropoutKey(KEYS, 2))
    out = stacked_forward(model, params, x)
    for g in range(3):
        set_dropout_key(drop, DropoutKey(KEYS[g], 2))
        alone = torch.func.functional_call(model, {k: v[g] for k, v in params.items()}, (x[g],))
        assert torch.allclose(out[g], alone, atol=1e-6)


@pytest.mark.parametrize(
    "batch_size,norm",
    [(8, "none"), (32, "none"), (16, "batch")],
    ids=["stacked-forward", "wide-steps-client-by-client", "batchnorm-vmap"],
)
def test_dropout_model_stacked_equals_sequential(
    make_run_config, run_engines, assert_same_metrics, assert_same_weights, dropout_model, batch_size, norm
):
    """A model with keyed dropout trains stacked (stacked_forward; a CPU's wide steps client
    by client; the vmap path of a BatchNorm model) with the masks each client draws alone:
    the same metrics and weights within 1e-5. Dropout acts (other weights than without it),
    and a rerun is bit-identical."""
    part = PartitionSpec("dirichlet", clients=6, alpha=0.5, min_size=10, seed=0)
    # [D] BatchNorm: one round (running statistics drift with float summation order, as in
    # tests/test_vectorized.py)
    rc = make_run_config(dataset="digits", model=dropout_model, model_options={"norm": norm},
                         rounds=1 if norm == "batch" else 2, local_epochs=2, batch_size=batch_size,
                         sample_rate=0.5, optimizer={"lr": 0.05, "momentum": 0.9}, partition=part)  # fmt: skip
    out = run_engines(rc)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v)
    assert_same_weights(seq, vec)
    again = Simulation(replace(rc, train=replace(rc.train, client_engine="sequential")))
    again.run(progress=False)
    assert all(torch.equal(v, again.global_params[k]) for k, v in seq.global_params.items())
    if norm == "none":
        no_drop = Simulation(replace(rc, train=replace(rc.train, client_engine="sequential")))
        for m in keyed_modules(no_drop.model):
            m.p = 0.0
        no_drop.run(progress=False)
        assert not torch.allclose(no_drop.global_params["head.weight"], seq.global_params["head.weight"])


def test_fedgp_replies_draw_each_clients_keyed_masks(make_run_config, run_engines, assert_same_metrics, dropout_model):
    """FedGP's round-end reply runs the model in training mode: on a model with keyed dropout
    each client draws its reply key's masks (``reply_key``), so the stacked trainer (one pass
    for the group), the sequential one and its lanes (allowed: no global draw) give the same
    g_ref within 1e-5, whatever torch's generator holds."""
    from fedforget.methods.fedgp import STATE_KEY

    part = PartitionSpec("dirichlet", clients=6, alpha=0.5, min_size=10, seed=0)
    rc = make_run_config(dataset="digits", model=dropout_model, method="fedgp", params={"buffer_size": 20, "ref_batch_size": 6},
                         rounds=3, batch_size=8, sample_rate=0.5, partition=part, optimizer={"lr": 0.05})  # fmt: skip
    out = run_engines(rc)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert_same_metrics(rows_s, rows_v)
    torch.manual_seed(123)  # another global generator state: no reply reads it
    lanes = Simulation(replace(rc, train=replace(rc.train, client_engine="sequential", concurrent_clients=2)))
    assert lanes.run(progress=False)[0] == "completed"
    tol = 1e-5 * GPU_TOL_FACTOR
    for other in (vec, lanes):
        for n, v in seq.server.state[STATE_KEY].items():
            torch.testing.assert_close(other.server.state[STATE_KEY][n], v, rtol=tol, atol=tol / 10)


def test_the_fedgp_cnn_is_stacked_and_torch_dropout_is_not():
    fedavg = METHODS.get("fedavg")
    cnn = build_model("cnn_fedgp", (1, 28, 28), 10)
    assert len(keyed_modules(cnn)) == 2 and why_not_vectorized(fedavg, cnn, "sgd") is None
    plain = Classifier(nn.Sequential(nn.Flatten(), nn.Dropout(0.1)), 4, 2)
    assert "torch's dropout" in why_not_vectorized(fedavg, plain, "sgd")


def test_step_graphs_keep_the_dropout_inputs_at_one_address():
    """Captured steps read the clients' keys and the step counter from persistent tensors:
    the same addresses while groups fit, reallocated (graphs dropped) for a larger group."""
    from fedforget.cudagraph import StepGraphs

    g = StepGraphs()
    g.stack({"w": torch.zeros(2)}, ["w"], 3, momentum=False)
    keys, step = g.dropout_inputs(KEYS)
    assert torch.equal(keys, KEYS) and step.shape == ()
    g.graphs["k"], g.seen = ("graph", None), {"k"}
    keys2, step2 = g.dropout_inputs(KEYS[:2].flip(0))
    assert keys2.data_ptr() == keys.data_ptr() and step2.data_ptr() == step.data_ptr() and "k" in g.graphs
    assert torch.equal(keys2, KEYS[:2].flip(0))
    keys3, _ = g.dropout_inputs(torch.arange(5))
    assert len(keys3) == 5 and keys3.data_ptr() != keys.data_ptr() and not g.graphs


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_dropout_steps_under_cuda_graphs_replay_the_eager_steps(make_run_config, run_engines, assert_same_metrics, dropout_model, monkeypatch, device):
    """On a GPU, a keyed-dropout model's captured steps read each step's number and the
    clients' keys from persistent tensors: graphs give the eager steps' bits, and both the
    sequential trainer's metrics within 1e-5. On a CPU through the tape (fedforget.cudagraph),
    at batch 8: steps a CPU batches."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a GPU (benchmarks/gpu.sh runs this where one is)")
    rc = make_run_config(dataset="digits", model=dropout_model, rounds=4, sample_rate=0.5, device=device,
                         max_parallel_clients=2, batch_size=32 if device == "cuda" else 8,
                         optimizer={"lr": 0.05, "momentum": 0.9},
                         partition=PartitionSpec("dirichlet", clients=8, alpha=0.3, min_size=5, seed=0))  # fmt: skip
    monkeypatch.setenv("FEDFORGET_CUDA_GRAPHS", "0")
    eager = run_engines(rc, device=torch.device(device))
    monkeypatch.setenv("FEDFORGET_CUDA_GRAPHS", "1" if device == "cuda" else "tape")
    graphed = Simulation(replace(rc, train=replace(rc.train, client_engine="vectorized")))
    _, rows_g, _ = graphed.run(progress=False)
    assert graphed.trainer.step_graphs.replays > 0
    assert_same_metrics(eager["vectorized"][1], rows_g, tol=0.0)
    assert_same_metrics(eager["sequential"][1], rows_g)


@pytest.mark.parametrize(
    "method,params",
    [("fedsol", {"rho": 1.0}), ("fedsol", {"rho": 1.0, "perturb": "all"}), ("fedsam", {"rho": 0.1}),
     ("moon", {"first_prev": "init"})],
    ids=["fedsol-head", "fedsol-all", "fedsam", "moon"],
)  # fmt: skip
def test_live_terms_draw_the_masks_of_a_client_alone(
    make_run_config, run_engines, assert_same_metrics, assert_same_weights, dropout_model, method, params
):
    """Live terms on a model with keyed dropout (batch 20 on a CPU: wide steps client by
    client in replicas, tails batched): a second full pass draws the step's second masks,
    FedSOL's head-only pass none (it reuses the first pass's features), MOON's previous
    models none (eval mode, as the frozen copies): within 1e-5 of the sequential trainer."""
    part = PartitionSpec("dirichlet", clients=6, alpha=0.5, min_size=10, seed=0)
    rc = make_run_config(dataset="digits", model=dropout_model, method=method, params=params, rounds=2,
                         local_epochs=2, batch_size=20, sample_rate=0.5, optimizer={"lr": 0.05, "momentum": 0.9},
                         partition=part)  # fmt: skip
    out = run_engines(rc)
    assert_same_metrics(out["sequential"][1], out["vectorized"][1])
    assert_same_weights(out["sequential"][0], out["vectorized"][0])
