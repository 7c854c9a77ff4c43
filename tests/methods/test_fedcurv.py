"""FedCurv (methods/fedcurv.py): the per-sample empirical Fisher against a loop of
single-sample gradients, the penalty and its gradient against lam sum_{j != k} I_j (w - w_j)^2
computed client by client, the server's sums against the clients' own (u, v, w), round 1
and lam = 0 equal to FedAvg, hyperparameter validation; on a ViT, the Fisher's per-sample
gradients batched (no row-by-row fallback for attention on a CPU)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedforget.config import TrainSpec
from fedforget.methods import ClientContext, RunInfo, check_params
from fedforget.methods.fedcurv import OWN, SUMS, FedCurv, fisher_diagonal, flat_params
from fedforget.models import Classifier, build_model
from fedforget.parse import parse_config
from fedforget.partition import PartitionSpec
from fedforget.utils import FedForgetError

from .conftest import CPU, TINY_VIT, run

INFO = RunInfo(CPU, num_classes=3, seed=0, num_clients=3, train=TrainSpec())


def tiny_model(seed: int = 0) -> Classifier:
    torch.manual_seed(seed)
    return Classifier(nn.Sequential(nn.Linear(4, 5), nn.Tanh()), 5, 3)


def looped_fisher(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean of squared single-row gradients of log p(y | x), one row at a time."""
    acc = 0
    for i in range(len(y)):
        model.zero_grad()
        F.log_softmax(model(x[i : i + 1]), -1)[0, y[i]].backward()
        acc = acc + torch.cat([p.grad.reshape(-1) for p in model.parameters()]) ** 2
    return acc / len(y)


def test_fisher_is_the_mean_of_squared_per_sample_gradients():
    model = tiny_model()
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(9, 4, generator=gen), torch.randint(0, 2, (9,), generator=gen)
    got = fisher_diagonal(model, x, y)
    assert torch.allclose(got, looped_fisher(model, x, y), atol=1e-7)
    # class 2, in no row's label: its head row and bias (the last parameters) still get some,
    # through the softmax (task-IL trains every class's logit, as class-IL)
    assert got[-3:][2] > 0


def test_fisher_of_a_vit_is_batched_and_the_mean_of_squared_per_sample_gradients():
    """Attention under the Fisher's vmap: on a CPU torch has no batching rule for its fused
    attention and would run it row by row, warning of a performance drop; the math kernel
    runs batched (within rounding of the fused one)."""
    torch.manual_seed(0)
    model = build_model("vit", (3, 8, 8), 3, {**TINY_VIT, "layers": 2}).eval()
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 3, 8, 8, generator=gen), torch.randint(0, 3, (6,), generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "performance drop" of the row-by-row fallback
        got = fisher_diagonal(model, x, y)
    assert torch.allclose(got, looped_fisher(model, x, y), rtol=1e-4, atol=1e-6)


def test_penalty_and_gradient_are_the_sum_over_the_other_clients():
    """Clients 0, 1, 2 with Fisher diagonals I_j and weights w_j; client 1's penalty from the
    broadcast sums minus its own upload equals lam * sum_{j in {0, 2}} I_j (w - w_j)^2,
    its gradient 2 lam sum_j I_j (w - w_j)."""
    model, lam = tiny_model(), 0.7
    n = flat_params(model).numel()
    gen = torch.Generator().manual_seed(3)
    fisher = [torch.rand(n, generator=gen) for _ in range(3)]
    w_hat = [torch.randn(n, generator=gen) for _ in range(3)]
    uvw = [(f, f * w, f * w * w) for f, w in zip(fisher, w_hat)]
    sums = tuple(sum(t[i] for t in uvw) for i in range(3))
    state = dict(zip(OWN, uvw[1]))
    ctx = ClientContext(
        cid=1, round=2, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        global_params={}, broadcast={SUMS: sums}, state=state, n_samples=4, lr=0.1, local_epochs=1, batch_size=4,
    )  # fmt: skip
    method = FedCurv(FedCurv.Params(lam=lam), INFO)
    method.client_begin(ctx)
    model.zero_grad()
    x = torch.zeros(2, 4)
    pen = method.client_loss(ctx, x, torch.zeros(2, dtype=torch.long), *model.forward_with_features(x))["step_terms"]
    pen.backward()
    w = flat_params(model)
    expected = lam * sum((fisher[j] * (w - w_hat[j]) ** 2).sum() for j in (0, 2))
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert torch.allclose(pen, expected, rtol=1e-5)
    assert torch.allclose(grad, 2 * lam * sum(fisher[j] * (w - w_hat[j]) for j in (0, 2)), atol=1e-5)


def _cfg(make_run_config, method, params=None, rounds=3):
    return make_run_config(method=method, params=params, rounds=rounds, sample_rate=0.5, local_epochs=2,
                           partition=PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=5, seed=0))  # fmt: skip


def test_server_sums_are_the_clients_latest_uploads(make_run_config):
    """Half the clients per round: the server's (U, V, W) equal the sums of every client's
    last (u, v, w) (clients not sampled lately count with their earlier values); the
    penalty changes training from round 2 on; round 1 is FedAvg's."""
    sim, rows = run(_cfg(make_run_config, "fedcurv", {"fisher_samples": 0}))
    sums = sim.server.state[SUMS]
    for i, key in enumerate(OWN):
        own = [st[key] for st in sim.client_state.values() if key in st]
        assert len(own) >= 3
        assert torch.allclose(sums[i], torch.stack(own).sum(0), atol=1e-6)
    _, rows_avg = run(_cfg(make_run_config, "fedavg"))
    key = "global_model_test_loss"
    assert rows[1][key] == rows_avg[1][key] and rows[3][key] != rows_avg[3][key]
    assert rows[2]["fedcurv_penalty_end"] > 0 and rows[2]["fedcurv_fisher_mean"] > 0


def test_zero_lambda_is_fedavg_bit_for_bit(make_run_config):
    _, rows_avg = run(_cfg(make_run_config, "fedavg"))
    _, rows = run(_cfg(make_run_config, "fedcurv", {"lam": 0.0, "fisher_samples": 8}))
    strip = lambda r: {k: v for k, v in r.items() if not k.endswith("_s") and not k.startswith("fedcurv_")}  # noqa: E731
    assert [strip(r) for r in rows] == [strip(r) for r in rows_avg]


@pytest.mark.parametrize("field,value", [("lam", -1.0), ("lam", float("inf")), ("fisher_samples", -1), ("fisher_samples", 1.5)])
def test_bad_hyperparameters_are_rejected(minimal_config, field, value):
    minimal_config["experiments"][0]["methods"] = [{"name": "fedcurv", "params": {field: value}}]
    with pytest.raises(FedForgetError, match=field):
        parse_config(minimal_config)


def test_defaults():
    assert check_params("fedcurv", {}) == {"lam": 0.5, "fisher_samples": 256}
