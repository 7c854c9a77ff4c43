"""The loss-curvature tools of FedSOL Fig. 7 (fedforget.landscape) against a dense Hessian:
Hessian-vector products, the top eigenpairs by power iteration with deflation (ordered by
magnitude, as PyHessian finds them), independence of the batching, the loss grid."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedforget.landscape import hessian_vector, loss_grid, mean_loss, top_eigen


def tiny():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x = torch.randn(40, 4)
    y = torch.randint(0, 3, (40,))
    return model.double(), x.double(), y


def dense_hessian(model, x, y):
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def loss(w):
        parts = torch.split(w, [s.numel() for s in shapes])
        params = {n: t.view(s) for n, t, s in zip(names, parts, shapes)}
        return F.cross_entropy(functional_call(model, params, (x,)), y)

    return torch.autograd.functional.hessian(loss, flat)


def test_hessian_vector_products_and_batching():
    model, x, y = tiny()
    h = dense_hessian(model, x, y)
    v = torch.randn(h.shape[0], dtype=torch.float64)
    assert torch.allclose(hessian_vector(model, x, y, v), h @ v, atol=1e-10)
    assert torch.allclose(hessian_vector(model, x, y, v, batch=7), h @ v, atol=1e-10)  # uneven batches


def test_top_eigenpairs_are_the_largest_in_magnitude():
    model, x, y = tiny()
    h = dense_hessian(model, x, y)
    evals, evecs = torch.linalg.eigh(h)
    order = evals.abs().argsort(descending=True)[:3]
    values, vectors = top_eigen(model, x, y, top=3, iters=5000, tol=1e-12, seed=1)
    for k, i in enumerate(order.tolist()):
        assert abs(values[k] - evals[i].item()) <= 1e-6 * abs(evals[i].item()), (k, values, evals[order])
        assert abs(float(vectors[k] @ evecs[:, i])) > 0.999
        assert abs(float(vectors[k].norm()) - 1) < 1e-9
    assert abs(float(vectors[0] @ vectors[1])) < 1e-8  # deflated: orthogonal
    # the default tolerance: lambda_1 within 1 %; keyed start vectors: the same values again
    quick, _ = top_eigen(model, x, y, top=1, seed=1)
    assert abs(quick[0] - values[0]) <= 0.01 * abs(values[0])
    assert top_eigen(model, x, y, top=1, seed=1)[0] == quick


def test_loss_grid_is_the_loss_along_the_directions_and_restores_the_weights():
    model, x, y = tiny()
    before = [p.detach().clone() for p in model.parameters()]
    _, vectors = top_eigen(model, x, y, top=2, seed=0)
    coords, grid = loss_grid(model, x, y, vectors, radius=0.5, points=5)
    assert coords.tolist() == [-0.5, -0.25, 0.0, 0.25, 0.5]
    assert abs(grid[2, 2].item() - mean_loss(model, x, y)) < 1e-6
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # one corner by hand: w + 0.5 d1 - 0.5 d2
    with torch.no_grad():
        flat = torch.cat([p.reshape(-1) for p in model.parameters()]) + 0.5 * vectors[0] - 0.5 * vectors[1]
        torch.nn.utils.vector_to_parameters(flat, model.parameters())
    assert abs(grid[4, 0].item() - mean_loss(model, x, y)) < 1e-6
