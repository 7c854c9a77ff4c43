"""The curvature of a model's loss: the Hessian's top eigenvalues and eigenvectors, and the
loss over the plane they span (FedSOL Fig. 7: the loss landscapes of Li et al. 2018 along the
top-1 and top-2 Hessian eigenvectors, with lambda_1 and lambda_1 / lambda_5).

The loss is the mean cross-entropy of a model over fixed rows ``x``, ``y`` (evaluated in
batches of ``batch`` rows, each weighted by its share of the rows, so the value and its
derivatives do not depend on the batching up to rounding), the model as it is (eval mode:
BatchNorm's running statistics, no dropout) [D].

Hessian-vector products by double backward (Pearlmutter's trick: H v = d/dw (g(w) . v)),
over every parameter that requires a gradient, as one flat vector.

Top eigenpairs by power iteration with deflation [D, as PyHessian (Yao et al. 2020,
``hessian.eigenvalues``), which the papers FedSOL cites for lambda_1 / lambda_5 use]: for
k = 1..top, start from a Gaussian vector (keyed: ``torch_seed(seed, k, STREAM)``), then
repeat v <- H v' / ||H v'|| with v' = v made orthogonal to the eigenvectors already found
(Gram-Schmidt) and unit, lambda = v' . H v', until lambda changes by less than ``tol``
relative (or ``iters`` iterations). Each eigenvalue is the largest in magnitude on the
subspace orthogonal to the earlier ones, so the list is ordered by magnitude.

The landscape: L(w + a v_1 + b v_2) on a grid a, b in [-radius, radius] (``points`` each),
v_1, v_2 the unit top-2 eigenvectors [D: the figure does not give its range; unit
eigenvectors make the axes comparable between models, as in the cited work]."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .utils import torch_seed

STREAM = 0xE1  # keyed randomness of the power iteration's start vectors


def _params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _batches(x: torch.Tensor, y: torch.Tensor, batch: int):
    n = x.shape[0]
    for lo in range(0, n, batch):
        yield x[lo : lo + batch], y[lo : lo + batch], min(batch, n - lo) / n


def mean_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 512) -> float:
    """The mean cross-entropy of ``model`` over rows ``x``, ``y``."""
    with torch.no_grad():
        return float(sum(F.cross_entropy(model(xb), yb) * share for xb, yb, share in _batches(x, y, batch)))


def hessian_vector(model: nn.Module, x: torch.Tensor, y: torch.Tensor, v: torch.Tensor, batch: int = 512) -> torch.Tensor:
    """H v (flat) of the mean loss over the rows, H the Hessian in the trainable parameters."""
    params = _params(model)
    vs = torch.split(v, [p.numel() for p in params])
    out = torch.zeros_like(v)
    for xb, yb, share in _batches(x, y, batch):
        grads = torch.autograd.grad(F.cross_entropy(model(xb), yb) * share, params, create_graph=True)
        dot = sum((g * vi.view_as(g)).sum() for g, vi in zip(grads, vs))
        hv = torch.autograd.grad(dot, params, allow_unused=True)
        out += torch.cat([(torch.zeros_like(p) if h is None else h).reshape(-1) for p, h in zip(params, hv)])
    return out


def top_eigen(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, top: int = 5, iters: int = 100, tol: float = 1e-3,
    seed: int = 0, batch: int = 512,
) -> tuple[list[float], list[torch.Tensor]]:
    """([lambda_1, ..., lambda_top], their unit eigenvectors, flat) of the loss's Hessian by
    power iteration with deflation (module docstring)."""
    params = _params(model)
    n = sum(p.numel() for p in params)
    values: list[float] = []
    vectors: list[torch.Tensor] = []
    for k in range(top):
        gen = torch.Generator().manual_seed(torch_seed(seed, k, STREAM))
        v = torch.randn(n, generator=gen).to(device=params[0].device, dtype=params[0].dtype)
        value = None
        for _ in range(iters):
            for u in vectors:
                v = v - (v @ u) * u
            v = v / v.norm()
            hv = hessian_vector(model, x, y, v, batch)
            new = float(hv @ v)
            v = hv
            if value is not None and abs(new - value) <= tol * (abs(value) + 1e-12):
                value = new
                break
            value = new
        for u in vectors:  # the returned vector: orthogonal to the earlier ones, unit
            v = v - (v @ u) * u
        vectors.append(v / v.norm())
        values.append(float(value))
    return values, vectors


def loss_grid(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, directions: Sequence[torch.Tensor], radius: float = 1.0,
    points: int = 21, batch: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(coordinates [points], losses [points, points]): L(w + a d_1 + b d_2) for a (rows) and
    b (columns) on the grid; the model's weights are restored afterwards."""
    params = _params(model)
    base = [p.detach().clone() for p in params]
    d1, d2 = (torch.split(d, [p.numel() for p in params]) for d in directions[:2])
    coords = torch.linspace(-radius, radius, points)
    out = torch.empty(points, points)  # on the host: one value per grid point
    try:
        for i, a in enumerate(coords.tolist()):
            for j, b in enumerate(coords.tolist()):
                with torch.no_grad():
                    for p, w, u, v in zip(params, base, d1, d2):
                        p.copy_(w + a * u.view_as(p) + b * v.view_as(p))
                out[i, j] = mean_loss(model, x, y, batch)
    finally:
        with torch.no_grad():
            for p, w in zip(params, base):
                p.copy_(w)
    return coords, out
