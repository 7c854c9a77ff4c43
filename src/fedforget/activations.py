"""Layer inputs as matrices, and projection of weight gradients against a basis of them:
the shared tool of the gradient-projection methods (GPM, FOT, FedProTIP).

GPM (Saha et al., 2021, Sec. 4; papers/fedprotip.md Sec. 3.2) writes every layer l as a
matrix product of its weight and its input: for a Linear layer y = W x, W [out, d_in]; for a
convolution, the weight reshaped to [out, in*k(*k)] times the input unfolded (im2col) to one
column per output position, [in*k(*k), positions]. The *representation matrix* of layer l on
m samples stacks those columns, a_l [d_l, m] (Linear) or [d_l, m * positions] (conv). A
weight update dW with dW a = 0 for every column a of a_l leaves the layer's output on those
inputs unchanged, which is what projecting the gradient, G <- G - G U U^T with U an
orthonormal basis of span(a_l), achieves.

- ``find_layers(model, skip)``: every nn.Linear, nn.Conv1d and nn.Conv2d of a model, named by
  its parameter prefix (its weight is ``f"{name}.weight"``), in module order, leaving out the
  modules inside any module of the types ``skip`` (the methods skip per-task heads).
- ``layer_inputs(model, x, layers)``: one forward pass with a forward hook on each of
  ``layers`` (removed afterwards, also on error); returns each layer's input matrix.
- ``input_matrix(module, x)``: the matrix of one input batch: Linear [d_in, m] (leading dims
  flattened into columns), Conv2d ``F.unfold`` with the layer's kernel, stride, padding and
  dilation, Conv1d the same on a height-1 image; conv columns are ordered sample-major
  (sample 0's positions, then sample 1's, ...). Its rows match ``weight_matrix(module)``'s
  columns: weight_matrix(m) @ input_matrix(m, x) is the layer's output before the bias.
- ``project_out(grad, basis)``: G - G U U^T on the weight (or its gradient) reshaped to
  [out, d_l], returned in the weight's shape; ``Projector(basis)`` the same map for many
  steps against one basis, as G P with P = I - U U^T formed once where that is cheaper.

Bias: the representation holds the weight's inputs only (no constant row for the bias), as
in GPM's and FOT's code, where the projected layers have no bias (GPM) or a bias outside the
projection (FOT's MLP). What a method does with biases is the method's choice (GPM freezes
them after the first task, FOT leaves them to FedAvg; see methods/gpm.py, methods/fot.py).
Grouped convolutions and non-zero padding modes are refused (no model of the project has
them; their im2col is not this one).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .utils import FedForgetError

LAYER_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d)


def find_layers(model: nn.Module, skip: Sequence[type] = ()) -> dict[str, nn.Module]:
    """{parameter prefix: module} of every Linear / Conv1d / Conv2d of ``model`` in module
    order, without the modules inside a module of a type in ``skip``."""
    out: dict[str, nn.Module] = {}
    skip = tuple(skip)

    def walk(module: nn.Module, prefix: str) -> None:
        if skip and isinstance(module, skip):
            return
        if isinstance(module, nn.MultiheadAttention):  # its projections are no module calls
            raise FedForgetError(
                f"layer {prefix or 'model'}: nn.MultiheadAttention is not supported by the activation-based "
                "methods (their per-layer input bases are defined for Linear/Conv1d/Conv2d layers called as modules)"
            )
        if isinstance(module, LAYER_TYPES):
            check_layer(prefix, module)
            out[prefix] = module
            return
        for name, child in module.named_children():
            walk(child, f"{prefix}.{name}" if prefix else name)

    walk(model, "")
    return out


def check_layer(name: str, module: nn.Module) -> None:
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        if module.groups != 1:
            raise FedForgetError(
                f"layer {name}: grouped convolution (groups={module.groups}) is not supported"
            )
        if module.padding_mode != "zeros":
            raise FedForgetError(
                f"layer {name}: padding_mode={module.padding_mode!r}; supported: 'zeros'"
            )
        if isinstance(module.padding, str):
            raise FedForgetError(
                f"layer {name}: padding={module.padding!r}; supported: integer padding"
            )


def layer_dim(module: nn.Module) -> int:
    """d_l: the number of rows of the layer's representation (in_features, or in * k(*k))."""
    return module.weight[0].numel()


def weight_matrix(module: nn.Module) -> torch.Tensor:
    """The layer's weight as [out, d_l] (a view)."""
    return module.weight.reshape(module.weight.shape[0], -1)


def input_matrix(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The representation [d_l, columns] of the input batch ``x`` of ``module``."""
    if isinstance(module, nn.Linear):
        return x.reshape(-1, x.shape[-1]).T
    if isinstance(module, nn.Conv2d):
        cols = F.unfold(x, module.kernel_size, module.dilation, module.padding, module.stride)
    elif isinstance(module, nn.Conv1d):
        (k,), (d,), (p,), (s,) = module.kernel_size, module.dilation, module.padding, module.stride
        cols = F.unfold(x.unsqueeze(2), (1, k), (1, d), (0, p), (1, s))
    else:
        raise FedForgetError(f"no representation for a {type(module).__name__}")
    # [B, d_l, L] -> [d_l, B * L], sample-major columns
    return cols.permute(1, 0, 2).reshape(cols.shape[1], -1)


def layer_inputs(
    model: nn.Module, x: torch.Tensor, layers: dict[str, nn.Module] | Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """{name: representation matrix} of ``layers`` (a ``find_layers`` dict, names of it, or
    None for every layer) on the input batch ``x``: one forward pass of ``model`` as it is
    (train/eval mode unchanged, no gradient), hooks removed afterwards. A layer the forward
    pass does not reach is absent from the result; one it reaches twice gets both inputs'
    columns."""
    if layers is None:
        layers = find_layers(model)
    elif not isinstance(layers, dict):
        every = find_layers(model)
        layers = {n: every[n] for n in layers}
    seen: dict[str, list[torch.Tensor]] = {}

    def hook_for(name: str, module: nn.Module):
        def hook(mod: nn.Module, args: tuple, output: torch.Tensor) -> None:
            seen.setdefault(name, []).append(input_matrix(module, args[0].detach()))

        return hook

    handles = [m.register_forward_hook(hook_for(n, m)) for n, m in layers.items()]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return {n: v[0] if len(v) == 1 else torch.cat(v, 1) for n, v in seen.items()}


def project_out(grad: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """G - G U U^T with G = ``grad`` reshaped to [out, d_l] and U = ``basis`` [d_l, r]
    (orthonormal columns), in ``grad``'s shape. Computed as G - (G U) U^T: O(out d_l r)."""
    g = grad.reshape(grad.shape[0], -1)
    u = basis.to(g.dtype)
    return (g - (g @ u) @ u.T).reshape(grad.shape)


class Projector:
    """``project_out(., basis)`` for many gradients against one basis U [d, r]: as two thin
    products, G - (G U) U^T (2 out d r flops), or, where r > d / 2, as one product with
    P = I - U U^T formed once (out d^2 flops) [D]. Equal up to float rounding."""

    def __init__(self, basis: torch.Tensor) -> None:
        d, r = basis.shape
        self.dense = 2 * r > d
        self.m = torch.eye(d, dtype=basis.dtype, device=basis.device) - basis @ basis.T if self.dense else basis

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        if not self.dense:
            return project_out(grad, self.m)
        g = grad.reshape(grad.shape[0], -1)
        return (g @ self.m.to(g.dtype)).reshape(grad.shape)
