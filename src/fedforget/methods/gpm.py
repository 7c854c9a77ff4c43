"""FL+GPM: Gradient Projection Memory (Saha, Garg, Roy, ICLR 2021) on the clients of FedAvg,
the "FL+CL" baseline of the FedGP paper (papers/fedgp.md Sec. 5, Table 1: "FedAvg (FL) with
continual learning solutions applied to clients"); GPM as papers/fedprotip.md Sec. 3.2
summarises it and the authors' code (sahagobinda/GPM, main_cifar100.py) computes it.

GPM, per layer l (representations and projection: ``fedforget.activations``):
- After a task, the representation a_l [d_l, columns] of ``samples`` (125 [C]) training inputs
  of the task, taken with the task's final model in eval mode: the layer's inputs (Linear) or
  their im2col columns (conv).
- Memory update (GPM Eq. 8-9, the code's ``update_GPM``): remove the part in span(M_l),
  a_hat = a - M M^T a; SVD a_hat = U S V^T; with total = ||a||_F^2 and the energy already
  captured, c = (total - ||a_hat||_F^2) / total, keep the smallest r with
  c + sum_{i<=r} s_i^2 / total >= eps_l (r = 0 if c >= eps_l already); M_l <- [M_l, U_:r]
  (at most d_l columns). For the first task c = 0 (Eq. 5).
- eps_l = ``threshold`` + ``threshold_step`` * t after task t = 0, 1, ... [C: 0.97 + 0.003 t,
  CIFAR-100], capped at 1, the same for every layer.
- Training on later tasks, every step (``client_grad``): G_l <- G_l - G_l M_l M_l^T on each
  layer's weight gradient reshaped to [out, d_l].

Federated, which memory: ``memory``
- ``local`` [P, default]: every client keeps its own GPM (``ctx.state``) built from its own
  samples of each task it had data in, and projects its own steps with it; FedAvg aggregates.
  This is the paper's "CL solution applied to clients"; it does not say which model the
  client's representation comes from: the task's final global model [D] (what a client holds
  after the last round; the TASK_END exchange).
- ``global`` [D]: the clients' representations of the task are pooled on the server, which
  runs the memory update on their concatenation (GPM on the union of the clients' samples)
  and broadcasts the memory; every client projects with it. A client sends a factor F_k of
  its representation, F_k F_k^T = a_k a_k^T (``d_l x min(d_l, columns)``, float32), instead
  of a_k itself: the same SVD of the pooled matrix (U and s^2 depend on a a^T only), less
  traffic and memory for convolutions.

Switches and their sources ([P] paper, [C] authors' code, [D] our decision):
- ``samples`` = 125 [C] (CIFAR-100; the code's PMNIST uses 300), drawn with a generator keyed
  (seed, task, client, 0x70). The code unfolds only the first 24 / 100 of them for its conv
  layers to bound the matrix width; here every sample is used for every layer, the Gram
  matrix being accumulated in chunks [D].
- ``threshold`` = 0.97, ``threshold_step`` = 0.003 [C, CIFAR-100]; ``threshold`` may be a list,
  one value per projected layer in the model's order (the code's PMNIST setting, [0.95, 0.99,
  0.99]); a list of another length is refused at the first task end, naming the layers.
- ``task0_rank``: the code's rule for a layer's first memory keeps one direction fewer than
  Eq. 5 (``r = np.sum(np.cumsum(sval_ratio) < threshold)``, "#+1" commented out; later tasks
  use the smallest r reaching eps, as Eq. 9). ``paper`` [P, default] applies Eq. 5; ``code``
  [C] the count. A table's GPM row depends on it (a review reported a gap of several accuracy
  points on split digits task-IL; not re-measured here); the shipped configs run the
  default, ``paper``.
- ``bias``: freeze [C] | free. GPM's networks have no biases in the projected layers, and its
  code zeroes the gradient of every 1-D parameter (BatchNorm's affine) outside the task heads
  from the second task on; here, once a memory exists, the gradients of every 1-D trainable
  parameter outside the per-task heads (biases of the projected layers, norm affines) are
  dropped (``p.grad = None``: the optimizer skips them, weight decay included). With freeze
  and weight decay 0, a step leaves the outputs of every projected layer on inputs in the
  span of its memory unchanged (SGD momentum keeps that: its buffer sums projected
  gradients). Weight decay, which the optimizer adds after the projection, and Adam's
  per-coordinate scaling break it (as in any GPM; the GPM code trains without decay).
- Layers: every Linear / Conv1d / Conv2d of the model (ResNet shortcuts included), a shared
  head too (as the code's PMNIST MLP), per-task heads excepted (each trains on its own task
  only; older ones are frozen by the engine) [C].
- The model's BatchNorm running statistics are buffers, not projected (GPM's code uses
  BatchNorm without running statistics). The representations are taken in eval mode, so a
  BatchNorm layer normalises them with its running statistics; the code's BatchNorm keeps no
  running statistics and normalises with the batch's [D, documented difference: it matters for
  ResNets, not for the networks without BatchNorm; the ResNets' ``norm: batch_stateless`` is the code's].

Trainers: the projection and the held parameters are the gradient map of
``client_step_terms`` (``shared.projection_map``; ``each_client`` with local memories), so
GPM trains on the stacked trainer too where the model allows (one shared head): a client
alone is a stack of one; in a stack each client's rows are projected against its own memory,
and a client without one (no rows in the earlier tasks) keeps its biases free while the
others hold theirs (``base.Held``: the optimizer's update of those rows is undone).

Diagnostics (rows of a task's last round, columns ``gpm_<key>``): ``basis_fill``, the mean
over layers of rank(M_l) / d_l (local memory: mean over the reporting clients too), and
``basis_rank``, the summed ranks (per client, local).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..activations import layer_dim, layer_inputs
from ..utils import FedForgetError, torch_seed
from .base import TASK_END, ClientContext, ClientShape, FedAvg, ServerContext
from .params import choice, integer, number, one_of
from .registry import METHODS
from .shared import (
    CHUNK,
    REL_TOL,
    each_client,
    energy_rank,
    extend_basis,
    left_singular,
    projected_layers,
    projection_map,
    threshold_at,
)

SAMPLE_STREAM = 0x70  # keyed randomness: the representation samples
BASES = "gpm_bases"  # server.state / broadcast (global) or ctx.state (local): {layer: M [d_l, r]}
MEMORIES = ("local", "global")
BIAS = ("freeze", "free")


# ----------------------------------------------------------------------------- GPM's rule
# (threshold_at, energy_rank, left_singular, extend_basis: ``shared``, with FOT and FedProTIP)


def gpm_update(
    basis: torch.Tensor | None, a: torch.Tensor, threshold: float, first_rank: str = "paper"
) -> torch.Tensor | None:
    """GPM's memory update of one layer (Eq. 8-9): the basis [d, r'] (float32, orthonormal
    columns) after adding the directions of the representation ``a`` [d, n] (or any factor F
    with F F^T = a a^T) that ``threshold`` asks for; ``basis`` itself when none are needed.
    ``first_rank`` (the layer's first memory only): ``paper``, the smallest r whose energy
    reaches ``threshold`` (Eq. 5), or ``code``, the number of cumulative energy ratios below
    it (the authors' ``update_GPM``: one direction fewer where the threshold is reached)."""
    a = a.double()
    total = float((a * a).sum())
    if total <= 0:
        return basis
    m = basis.double() if basis is not None else None
    resid = a - m @ (m.T @ a) if m is not None else a
    captured = 1.0 - float((resid * resid).sum()) / total
    u, sq = left_singular(resid)
    if m is None and first_rank == "code":  # [C] r = np.sum(np.cumsum(sval_ratio) < threshold)
        keep = sq[sq > REL_TOL * total].double()
        r = int((torch.cumsum(keep, 0) / total < threshold).sum())
    else:
        r = energy_rank(sq, total, captured, threshold)
    r = min(r, a.shape[0] - (0 if m is None else m.shape[1]))
    if r <= 0:
        return basis
    return extend_basis(m, u[:, :r]).float()


# ----------------------------------------------------------------------------- representations


def gram_factor(gram: torch.Tensor) -> torch.Tensor:
    """F [d, k] (float32) with F F^T = ``gram`` (float64, symmetric PSD), k = its numerical
    rank: the eigenvectors scaled by sqrt(eigenvalue)."""
    lam, vec = torch.linalg.eigh(gram)
    keep = lam > REL_TOL * max(float(lam.max()), 0.0)
    return (vec[:, keep] * lam[keep].sqrt()).flip(1).float()


def representation_factors(
    model: nn.Module, layers: dict[str, nn.Module], x: torch.Tensor, chunk: int = CHUNK
) -> dict[str, torch.Tensor]:
    """{layer: F} with F F^T = a a^T for the representation a [d_l, columns] of the inputs
    ``x`` (the model in eval mode, restored afterwards), float32: a itself while it has at
    most d_l columns, else a factor of its Gram matrix (accumulated over chunks of ``chunk``
    samples in float64)."""
    was = model.training
    model.eval()
    parts: dict[str, list[torch.Tensor]] = {}
    grams: dict[str, torch.Tensor] = {}
    try:
        for s in range(0, len(x), chunk):
            for name, mat in layer_inputs(model, x[s : s + chunk], layers).items():
                m = mat.double()
                if name in grams:
                    grams[name] += m @ m.T
                    continue
                parts.setdefault(name, []).append(m)
                if sum(p.shape[1] for p in parts[name]) > m.shape[0]:  # wider than tall
                    a = torch.cat(parts.pop(name), 1)
                    grams[name] = a @ a.T
    finally:
        model.train(was)
    out = {n: torch.cat(p, 1).float() for n, p in parts.items()}
    out.update({n: gram_factor(g) for n, g in grams.items()})
    return out


@METHODS.register("gpm")
class GPM(FedAvg):
    name = "gpm"
    step_terms = True  # the projection is a gradient map of the step terms: trains stacked too
    exchanges = (TASK_END,)

    @dataclass(frozen=True)
    class Params:
        memory: str = choice("local", MEMORIES)  # local: each client's own GPM [P] | global: pooled [D]
        samples: int = integer(125, minimum=1)  # representation samples per client and task [C]
        # eps after the first task [C, CIFAR-100]; > 0 (0 keeps no basis: FedAvg) [D]; or one per
        # projected layer, in the model's order (the code's PMNIST [0.95, 0.99, 0.99])
        threshold: float | list[float] = one_of(
            0.97, {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            {"type": "array", "items": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "minItems": 1},
        )
        threshold_step: float = number(0.003, minimum=0)  # + per task [C]
        bias: str = choice("freeze", BIAS)  # freeze: 1-D parameters fixed once a memory exists [C] | free
        # a layer's first memory: smallest r reaching eps [P Eq. 5] | ratios below eps, one fewer [C]
        task0_rank: str = choice("paper", ("paper", "code"), added=True)

    @classmethod
    def table_note(cls, params: dict[str, Any]) -> str:
        """The task-0 rank rule that ran (issue 36: the tables say which)."""
        rule = params.get("task0_rank", "paper")  # runs recorded before the switch: the paper's
        what = "Eq. 5's smallest r reaching eps" if rule == "paper" else "the code's count below eps, one fewer"
        return f"GPM task0_rank={rule} ({what})"

    @classmethod
    def client_kept_bytes(cls, params: Any, shape: ClientShape) -> int | None:
        """``memory: local``: its bases, M_l [d_l, r_l] float32 for every projected layer, at
        most d_l columns each (r_l <= d_l: GPM Eq. 8-9), a bound a long stream can reach;
        ``global``: none (the server's, broadcast). None where the model's layers are unknown."""
        if params.memory == "global":
            return 0
        if shape.model is None:
            return None
        return sum(4 * layer_dim(m) ** 2 for m in projected_layers(shape.model).values())

    def model_init(self, model: nn.Module) -> None:
        """[D] A per-layer ``threshold`` list of another length than the model's projected
        layers is refused when the model is built, before any training (it was first read at
        the first task end)."""
        self.thresholds(projected_layers(model), 0)

    # ---------------------------------------------------------------- server side
    def server_broadcast(self, server: ServerContext) -> dict[str, Any]:
        if self.p.memory == "global":
            return {BASES: server.state.get(BASES, {})}
        return {}

    def server_collect(self, exchange: str, server: ServerContext, replies: dict[int, Any]) -> None:
        if not replies:
            return
        if self.p.memory == "local":  # each client updated its own memory: diagnostics only
            fills = [r["fill"] for r in replies.values()]
            ranks = [r["rank"] for r in replies.values()]
            server.state["gpm_task_end"] = {
                "basis_fill": sum(fills) / len(fills),
                "basis_rank": sum(ranks) / len(ranks),
            }
            return
        bases = dict(server.state.get(BASES, {}))
        eps = self.thresholds(projected_layers(server.model), server.task)
        order = sorted(replies)
        for name in replies[order[0]]:
            pooled = torch.cat([replies[c][name].to(server.device) for c in order], 1)
            new = gpm_update(bases.get(name), pooled, eps[name], self.p.task0_rank)
            if new is not None:
                bases[name] = new
        server.state[BASES] = bases
        server.state["gpm_task_end"] = self.basis_stats(bases, projected_layers(server.model))

    def thresholds(self, layers: dict[str, nn.Module], task: int) -> dict[str, float]:
        """eps per projected layer after ``task``: ``threshold`` (one number, or one per layer
        in ``layers``' order) + ``threshold_step`` * task, capped at 1 [C: the code's
        ``threshold`` array per layer]."""
        base = self.p.threshold
        if isinstance(base, (list, tuple)):
            if len(base) != len(layers):
                raise FedForgetError(
                    f"method 'gpm': threshold has {len(base)} values for {len(layers)} projected layers "
                    f"({', '.join(layers)}); allowed: one number, or one per layer"
                )
            return {n: threshold_at(b, self.p.threshold_step, task) for n, b in zip(layers, base)}
        return dict.fromkeys(layers, threshold_at(base, self.p.threshold_step, task))

    @staticmethod
    def basis_stats(
        bases: dict[str, torch.Tensor], layers: dict[str, nn.Module]
    ) -> dict[str, float]:
        fill = [bases[n].shape[1] / layer_dim(m) if n in bases else 0.0 for n, m in layers.items()]
        return {
            "basis_fill": sum(fill) / max(len(fill), 1),
            "basis_rank": float(sum(b.shape[1] for b in bases.values())),
        }

    def server_metrics(self, server: ServerContext, uploads: Sequence) -> dict[str, float]:
        return server.state.pop("gpm_task_end", {})

    # ---------------------------------------------------------------- client side
    def memory_of(self, ctx: ClientContext) -> dict[str, torch.Tensor]:
        if self.p.memory == "global":
            return ctx.broadcast.get(BASES) or {}
        return ctx.state.get(BASES) or {}

    def client_step_terms(self, ctxs: Sequence[ClientContext]) -> Any:
        """G - G M M^T against each client's memory (``memory: local``: its own, so a stack
        projects each client's rows against its own bases, ``shared.each_client``; ``global``:
        the broadcast's, one map for all), the 1-D parameters held once that memory exists
        (``bias: freeze``; a stack may mix held and free clients: ``base.Held``)."""
        freeze = self.p.bias == "freeze"
        if self.p.memory == "global":
            maps = [projection_map(ctxs[0].model, self.memory_of(ctxs[0]), freeze)]
        else:
            maps = [projection_map(c.model, self.memory_of(c), freeze) for c in ctxs]
        if all(m is None for m in maps):
            return None
        shared = len(maps) == 1
        return lambda lo, hi, w: (None, None, lambda g: each_client(maps if shared else maps[lo:hi], g))

    def client_reply(self, exchange: str, ctx: ClientContext) -> Any:
        gen = torch.Generator().manual_seed(
            torch_seed(self.info.seed, ctx.task, ctx.cid, SAMPLE_STREAM)
        )
        x, _ = ctx.data.sample(self.p.samples, gen)
        layers = projected_layers(ctx.model)
        factors = representation_factors(ctx.model, layers, x)
        if self.p.memory == "global":
            return factors
        bases = dict(ctx.state.get(BASES, {}))
        eps = self.thresholds(layers, ctx.task)
        for name, f in factors.items():
            new = gpm_update(bases.get(name), f, eps[name], self.p.task0_rank)
            if new is not None:
                bases[name] = new
        ctx.state[BASES] = bases
        stats = self.basis_stats(bases, layers)
        return {"fill": stats["basis_fill"], "rank": stats["basis_rank"]}
