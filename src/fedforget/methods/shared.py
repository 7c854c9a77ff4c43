"""Shared math and parameter checks of the methods: what more than one method module uses,
in one place, so that no method imports a helper from another method's module. (A subclass
still imports its parent class and the constants of the parent's protocol: FedASAM(FedSAM),
FedET / FedProj(FedDF), LANDER(TARGET), LGA(GLFC), and the base modules ``replay.py``,
``synthesis.py``, ``plugin.py``.)

Sections:

- Parameter checks across fields, for ``Params.check()`` and ``check_train``: ``require``
  (the ValueError the config layer expects), ``require_sgd``. A single field's type and range
  are declared with the field itself (``fedforget.methods.params``).
- Local steps: ``effective_steps``, ||a||_1 of SGD with heavy-ball momentum (FedNova,
  SCAFFOLD's divisor).
- Steps of a stack of clients: ``client_norms``, ``tensor_norms``, the L2 norms of each
  client (SAM-style perturbations: FedSAM, FedASAM, FedSOL); ``on_stack``, a frozen
  model's logits or features on each client's rows (the global model of FedNTD's and MOON's
  terms; FedSOL's KL term reads its global logits through ``StepBatch.logits_of``, the
  step's own kernels, where it needs them exact).
- Step diagnostics: ``StepSums``, a client's running sums of its per-step values, one column
  of a table that a stack's clients share (FedNTD, MOON, FedRCL, DER, A-GEM, FedGP).
- Gradient projection: ``project``, the A-GEM-style projection of one gradient against a
  reference (FedProj Eq. 14; FedProj, A-GEM, FedGP), for one client or each of a stack
  (``flat_dot``, ``per_client``).
- Layer subspaces, GPM-style bases (GPM, FOT, FedProTIP): ``CHUNK``, ``REL_TOL``,
  ``threshold_at``, ``energy_rank``, ``left_singular``, ``extend_basis``,
  ``projected_layers``, ``one_d_params``, ``projection_map``, ``each_client``,
  ``project_update`` (the server-side projection of an aggregated update: FOT, FedProTIP's
  global projection) (representations and the projection itself: ``fedforget.activations``).
- Scores: ``OUTSIDE_GAP`` and ``floor_unscored`` (classes without a score at the row's lowest
  allowed score minus a gap: FedProTIP, GLFC / LGA, iCaRL, TARGET / LANDER); ``head_scores``
  (per-task heads' logits: GLFC, LGA).
- Exemplars: ``embed_rows`` (a model's features of stored rows, in eval mode), ``herding``
  (iCaRL's ConstructExemplarSet for every class at once: iCaRL, GLFC / LGA).
- Row weights: ``group_normalise`` (GLFC's gradient compensation, LGA's adaptive weights).
- Communication: ``MB``, ``state_mb``, ``float32_mb`` (FOT, FedProTIP; MB = 10^6 bytes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..activations import Projector, find_layers, project_out
from ..models import TaskHeads, normalises_by_batch
from ..utils import FedForgetError, host_to_device
from .base import Held

if TYPE_CHECKING:  # pragma: no cover
    from ..train_spec import TrainSpec
    from .base import ClientShape, GradMap
    from .base import Params as StateDict

CHUNK = 32  # samples per forward pass when collecting representations
REL_TOL = 1e-12  # directions with s^2 <= REL_TOL * total are numerical zeros, never kept
# a gradient norm below this counts as zero: SAM's perturbation is scaled as if the norm were
# this (g = 0 -> eps = 0); FedSOL's eps* and projection are 0 [D]
NORM_GUARD = 1e-12
OUTSIDE_GAP = 30.0  # classes outside the allowed ones: the row's lowest allowed score minus this
MB = 1e6  # bytes per megabyte of the communication columns


# ----------------------------------------------------------------------------- parameter checks


def require(ok: bool, name: str, value: object, allowed: str) -> None:
    """Raise the ValueError the config layer expects: field, value and allowed range."""
    if not ok:
        raise ValueError(f"{name}={value!r}; allowed: {allowed}")


def require_sgd(method: str, train: TrainSpec, why: str) -> None:
    """For ``check_train``: raise FedForgetError unless the local optimizer is SGD (``why``:
    the method's reason)."""
    name = train.optimizer.name
    if name != "sgd":
        raise FedForgetError(
            f"method '{method}' needs train.optimizer.name='sgd' ({why}); got '{name}'"
        )


WEIGHTINGS = ("uniform", "samples")  # the ``weighting`` of FedDyn's and SCAFFOLD's server means


def rows_mean(v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The mean of per-row values ``v``: over a client's rows (None: all of ``v``), or each
    client's over its real rows (``mask`` [G, N] 1.0 on them) of a stack's [G, N] (any
    leading shape: the last axis is the rows')."""
    return v.mean() if mask is None else (v * mask).sum(-1) / mask.sum(-1)


def own_weighting(method: str, train: TrainSpec) -> None:
    """For ``check_train`` of a method whose server step weighs clients by its own
    ``weighting`` hyperparameter (FedDyn, SCAFFOLD): ``train.client_weights`` other than its
    default would do nothing there, so it is refused, naming the parameter to set."""
    if train.client_weights != "samples":
        raise FedForgetError(
            f"method '{method}': train.client_weights={train.client_weights!r} does nothing here: its server step "
            f"weighs clients by its own parameter; allowed: samples (the default), and set params.weighting: "
            f"uniform | samples instead"
        )


def refuse_task_heads(method: str, scenario: dict[str, Any] | None, why: str) -> None:
    """For ``check_scenario``: raise FedForgetError where a stream of several tasks has one
    head per task (``why``: the method's reason) [D]."""
    if scenario and int(scenario.get("tasks") or 1) > 1 and scenario.get("heads", "shared") == "per_task":
        raise FedForgetError(
            f"method '{method}' is not defined for per-task heads ({why}): scenario.heads='per_task' "
            f"over {scenario['tasks']} tasks; allowed: scenario.heads shared"
        )


def refuse_held(method: str, options: dict[str, Any] | None, why: str) -> None:
    """For ``check_model``: raise FedForgetError where the model holds stages from the second
    task on (``freeze_stages``), which changes the trained parameters (``why``: the
    method's reason) [D]."""
    if (options or {}).get("freeze_stages"):
        raise FedForgetError(
            f"method '{method}' is not defined for a model that freezes stages after the first task ({why}): "
            f"model.options.freeze_stages={options['freeze_stages']}; allowed: freeze_stages 0"
        )


# ----------------------------------------------------------------------------- local steps


def effective_steps(tau: int, rho: float) -> float:
    """||a||_1 for tau steps of SGD with heavy-ball momentum rho (tau for rho = 0; its limit
    tau (tau + 1) / 2 for rho = 1, which the schema allows)."""
    if rho == 0:
        return float(tau)
    if rho == 1:
        return tau * (tau + 1) / 2.0
    return (tau - rho * (1.0 - rho**tau) / (1.0 - rho)) / (1.0 - rho)


# ----------------------------------------------------------------------------- perturbed steps


def client_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """[G]: the L2 norm of each client's flat vector made of ``tensors`` (each [G, ...]).
    A stack of one takes the norm of its tensors whole, as one client's step always did."""
    if len(tensors[0]) == 1:
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm([t[0] for t in tensors]))).unsqueeze(0)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.flatten(1), dim=1) for t in tensors]), dim=0)


def padded(parts: Sequence[torch.Tensor | None], rows: Sequence[int]) -> torch.Tensor:
    """Each client's rows ``parts[j]`` [rows[j], ...] (None: none) stacked [G, max(rows), ...],
    zero rows after each client's real ones."""
    first = next(p for p in parts if p is not None)
    out = first.new_zeros((len(parts), max(rows), *first.shape[1:]))
    for j, part in enumerate(parts):
        if part is not None:
            out[j, : rows[j]] = part
    return out


def rows_mask(rows: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """[G, max(rows)] float32 on ``like``'s device: 1.0 on each client's first ``rows[j]``
    entries (its real rows of a ``padded`` stack), filled on the device."""
    mask = like.new_zeros((len(rows), max(rows)), dtype=torch.float32)
    for j, r in enumerate(rows):
        if r:
            mask[j, :r].fill_(1.0)  # (a number set by [] = would be a host tensor)
    return mask


@torch.no_grad()
def on_stack(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """A frozen model's output [G, B, D] (float32) on each client's rows ``x`` [G, B, ...]:
    ``fn`` (its forward, or its ``features``) once over all rows; client by client where the
    model normalises a batch by its own statistics (``norm: batch_stateless``), whose output on
    a client's rows would otherwise see the other clients' (as a client alone, its rows only)."""
    owner = getattr(fn, "__self__", fn)
    if isinstance(owner, nn.Module) and normalises_by_batch(owner):
        return torch.stack([fn(xg).reshape(xg.shape[0], -1) for xg in x]).float()
    return fn(x.flatten(0, 1)).view(*x.shape[:2], -1).float()


class StepSums:
    """A client's running sums of a method's per-step diagnostics, left on the device and read
    once, at its end: column ``slot`` of a [n, G] table that the clients of a stack share (a
    stacked step adds the values of clients lo..hi-1 to ``table[r, lo:hi]`` at once), or of
    the client's own [n, 1] (a client alone, row by row: ``add``)."""

    def __init__(self, table: torch.Tensor, slot: int) -> None:
        self.table, self.slot = table, slot

    @classmethod
    def own(cls, n: int, device: torch.device) -> StepSums:
        return cls(torch.zeros(n, 1, device=device), 0)

    @classmethod
    def shared(cls, scratches: Sequence, n: int, device: torch.device, attr: str = "sums") -> torch.Tensor:
        """One [n, len(scratches)] table, each scratch's ``attr`` its column, in order; the
        table is returned for the stack's steps."""
        table = torch.zeros(n, len(scratches), device=device)
        for i, s in enumerate(scratches):
            setattr(s, attr, cls(table, i))
        return table

    def add(self, *values: torch.Tensor | float) -> None:
        """One step's values, one per row, each added in place to this client's cell."""
        for r, v in enumerate(values):
            self.table[r, self.slot] += v

    def column(self) -> torch.Tensor:
        """[n]: this client's sums (a view)."""
        return self.table[:, self.slot]

    def values(self) -> list[float]:
        """This client's sums, read to the host once."""
        return self.column().tolist()


class StepDraws:
    """A client's keyed draws of every local step (one row per step, in step order, on the
    device), made at its start, read one row per step at a count kept on the device [D]: the
    same draws in the same order as one per step, without a host draw or copy in the step,
    so a step captured in a CUDA graph reads each replay's own row (FedProj's memory batches,
    FedGP's projection-rate draws; A-GEM's and DER's replay plans). ``rows``: drawn on the
    host, sent to ``device`` without blocking (``utils.host_to_device``)."""

    def __init__(self, rows: torch.Tensor, device: torch.device) -> None:
        self.rows = host_to_device(rows, device)
        self.at = torch.zeros((), dtype=torch.long, device=device)

    def next(self) -> torch.Tensor:
        """This step's row; the count moves on."""
        row = self.rows.index_select(0, self.at.view(1))[0]  # (a 0-d index would be read on the host)
        self.at += 1
        return row


def tensor_norms(t: torch.Tensor) -> torch.Tensor:
    """Each client's L2 norm of its slice of ``t`` [G, ...], shaped [G, 1, ...] to scale it."""
    if len(t) == 1:
        return torch.linalg.vector_norm(t[0]).view(1, *[1] * (t.dim() - 1))
    return torch.linalg.vector_norm(t.flatten(1), dim=1).view(-1, *[1] * (t.dim() - 1))


# ----------------------------------------------------------------------------- gradient projection


def flat_dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], stacked: bool = False) -> torch.Tensor:
    """<a, b> of the flat vectors made of the tensors of ``a`` and ``b``: 0-d; ``stacked``:
    one per client [G] of a stack, ``a``'s tensors [G, ...] and each of ``b``'s [G, ...] or
    one shared by the stack (the shape of ``a``'s without G)."""
    if not stacked:
        return sum((x * y).sum() for x, y in zip(a, b))
    return sum((x * y).reshape(len(x), -1).sum(1) for x, y in zip(a, b))


def per_client(c: torch.Tensor, like: torch.Tensor, stacked: bool) -> torch.Tensor:
    """A per-client factor ``c`` ([G], or 0-d) shaped to scale ``like`` ([G, ...], or one
    client's tensor)."""
    return c.view(-1, *[1] * (like.dim() - 1)) if stacked else c


def project(
    g_new: Sequence[torch.Tensor],
    g_glob: Sequence[torch.Tensor],
    eps: float = 1e-8,
    norm_guard: float = 1e-6,
    coef_clamp: float = 0.0,
    always: bool = False,
    stacked: bool = False,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """FedProj's Eq. 14 on the flat vector made of the tensors of ``g_new`` and ``g_glob``.

    Returns (g_proj, projected, cos): g_proj = g_new - c * g_glob with
    c = <g_new,g_glob>/(||g_glob||^2 + eps) (clamped to [-coef_clamp, coef_clamp] when > 0)
    on conflict (<g_new,g_glob> < 0 and ||g_glob||^2 > norm_guard), else g_new unchanged;
    ``always``: whenever ||g_glob||^2 > norm_guard, conflict or not (FedGP's "Always"
    ablation, Table 7); ``projected`` a 0-d bool tensor, ``cos`` = cos(g_new, g_glob)
    before projection (0 when a norm is 0). Tensor-only: no host sync. FedProj, A-GEM and
    FedGP project with this one function. ``stacked``: the same for each client of a stack
    (the stacked trainer; ``flat_dot``), each value then one per client [G]."""
    dot = flat_dot(g_new, g_glob, stacked)
    gg = flat_dot(g_glob, g_glob, stacked and g_glob[0].dim() == g_new[0].dim())
    nn_ = flat_dot(g_new, g_new, stacked)
    conflict = ((dot < 0) | always) & (gg > norm_guard)
    coef = dot / (gg + eps)
    if coef_clamp > 0:
        coef = coef.clamp(-coef_clamp, coef_clamp)
    coef = torch.where(conflict, coef, torch.zeros_like(coef))
    out = [a - per_client(coef, a, stacked) * b for a, b in zip(g_new, g_glob)]
    denom = (nn_ * gg).sqrt()
    cos = torch.where(denom > 0, dot / denom.clamp_min(1e-30), torch.zeros_like(dot))
    return out, conflict, cos


# ----------------------------------------------------------------------------- layer subspaces (GPM's rule)


def threshold_at(base: float, step: float, task: int) -> float:
    """eps after task ``task`` (0-based): base + step * task, at most 1."""
    return min(1.0, base + step * task)


def energy_rank(sq_sigma: torch.Tensor, total: float, captured: float, threshold: float) -> int:
    """The smallest r >= 0 with captured + sum_{i<r} sq_sigma[i] / total >= threshold
    (``sq_sigma`` descending; GPM Eq. 5 / Eq. 9). Directions with sq_sigma <= REL_TOL * total
    are not counted: when they would be needed, every non-zero direction is kept."""
    if captured >= threshold or total <= 0:
        return 0
    keep = sq_sigma[sq_sigma > REL_TOL * total].double()
    reached = (captured + torch.cumsum(keep, 0) / total) >= threshold
    hit = torch.nonzero(reached)
    return int(hit[0]) + 1 if len(hit) else len(keep)


def left_singular(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(U [d, k], s^2 [k] descending) of ``a`` [d, n] (float64): an SVD when n < d, else an
    eigendecomposition of a a^T (the same U and s^2, d x d work). Where the eigensolver fails
    to converge (MKL's on a 4,608 x 4,608 a a^T of FOT's ResNet-18 sketches, found by
    benchmarks/task_end_cost.py on 2026-12-05), the SVD of ``a`` gives them instead of an
    error [D: a run that stopped there now goes on; one that did not is unchanged]."""
    d, n = a.shape
    if n >= d:
        try:
            lam, vec = torch.linalg.eigh(a @ a.T)
            return vec.flip(1), lam.flip(0).clamp_min(0)
        except torch.linalg.LinAlgError:
            pass
    u, s, _ = torch.linalg.svd(a, full_matrices=False)
    return u, s * s


def extend_basis(basis: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """[basis, new] with orthonormal columns (float64): ``new`` is made orthogonal to
    ``basis`` again and orthonormalised (QR), a numerical clean-up only (in exact arithmetic
    it already is orthonormal and orthogonal to the basis)."""
    if basis is not None:
        new = new - basis @ (basis.T @ new)
    q, r = torch.linalg.qr(new)
    q = q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0).to(q)  # keep each column's sign
    return q if basis is None else torch.cat([basis, q], 1)


def projected_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The layers GPM / FOT / FedProTIP project: every Linear and convolution outside per-task
    heads and outside the layers the model freezes from the second task on (``freeze_stages``,
    ``Classifier.held``: they never train once a memory exists, and get no bases, as the
    FedProTIP code collects none for its frozen layers [C])."""
    layers = find_layers(model, skip=(TaskHeads,))
    held = getattr(model, "held", frozenset())
    return {n: m for n, m in layers.items() if f"{n}.weight" not in held} if held else layers


def one_d_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every 1-D floating parameter outside the per-task heads (biases,
    norm affines): what ``bias: freeze`` holds fixed once a memory exists."""
    heads = {f"{n}." for n, m in model.named_modules() if isinstance(m, TaskHeads)}
    return [
        (n, p) for n, p in model.named_parameters()
        if p.dim() == 1 and p.is_floating_point() and not any(n.startswith(h) for h in heads)
    ]  # fmt: skip


def projection_map(
    model: nn.Module, bases: dict[str, torch.Tensor], freeze_bias: bool, frozen_layers: Sequence[str] = (),
    project: bool = True,
) -> GradMap | None:
    """GPM's step (GPM, FedProTIP) as a gradient map of ``client_step_terms`` (a client alone
    is a stack of one, ``base.map_grads``): for clients that share ``bases`` ({layer: U
    [d, r]}), each projected layer's weight gradient G <- G - G U U^T (every client's rows,
    ``Projector``; layers with a non-empty basis), and None, so that the optimizer skips them
    (no decay, no momentum), for the 1-D parameters once bases exist (``freeze_bias``) and
    every parameter of the layers ``frozen_layers``. ``project`` False: the holds only, no
    projection (FedProTIP's ``projection: global``). None where it changes nothing."""
    layers = projected_layers(model)
    proj = {f"{n}.weight": Projector(u) for n, u in bases.items() if project and n in layers and u.shape[1]}
    frozen = [n for n, _ in one_d_params(model)] if bases and freeze_bias else []
    frozen += [f"{n}.{k}" for n in frozen_layers for k, _ in layers[n].named_parameters()]
    if not proj and not frozen:
        return None

    def gmap(grads: StateDict) -> StateDict:
        out = dict(grads)
        for n, project in proj.items():
            g = grads.get(n)
            if g is not None:  # [G, out, ...] -> each client's rows against U
                out[n] = project(g.reshape(-1, *g.shape[2:])).reshape(g.shape)
        for n in frozen:
            out[n] = None
        return out

    return gmap


def project_update(new: StateDict, old: StateDict, bases: dict[str, torch.Tensor]) -> None:
    """The aggregated update projected out of the old tasks' subspaces, in place (FOT's
    FedProject; FedProTIP's ``projection: global``): for each layer with a basis U
    ({layer: U [d, r]}; keys that name no layer's weight in ``new`` are skipped),
    W_new <- W_old + (W_new - W_old)(I - U U^T) (``project_out``)."""
    for name, u in bases.items():
        key = f"{name}.weight"
        if key in new:
            new[key] = old[key] + project_out(new[key] - old[key], u)


def each_client(maps: Sequence[GradMap | None], grads: StateDict) -> StateDict:
    """Client i's own gradient map ``maps[i]`` (None: unchanged) applied to its slice of the
    stack ``grads`` ({name: [G, ...], None, or a ``base.Held``}, G = len(maps)): GPM's
    projection against each client's own memory, FedGP's manipulation where its base holds a
    parameter for some clients only. A client's slice leaves out (None) what is held for it;
    a parameter every client holds afterwards is None, one some hold a ``Held`` (a held row
    keeps its gradient: the optimizer puts that row back)."""
    if len(maps) == 1:  # a client alone, or one client of the stack: its map as it is
        return grads if maps[0] is None else maps[0](grads)

    def row(v: torch.Tensor | Held | None, i: int) -> torch.Tensor | None:
        if isinstance(v, Held):
            return None if bool(v.held[i]) else v.grad[i : i + 1]
        return None if v is None else v[i : i + 1]

    outs = []
    for i, m in enumerate(maps):
        rows = {n: row(v, i) for n, v in grads.items()}
        outs.append(rows if m is None else m(rows))
    out: StateDict = {}
    for n, v in grads.items():
        parts = [o.get(n) for o in outs]
        held = [p is None for p in parts]
        if v is None or all(held):
            out[n] = None
            continue
        g = v.grad if isinstance(v, Held) else v
        grad = torch.cat([g[i : i + 1] if p is None else p for i, p in enumerate(parts)])
        out[n] = Held(grad, host_to_device(torch.tensor(held), g.device)) if any(held) else grad
    return out


# ----------------------------------------------------------------------------- scores


def floor_unscored(
    scores: torch.Tensor, allowed: torch.Tensor, gap: float = OUTSIDE_GAP
) -> torch.Tensor:
    """``scores`` [B, C] on the ``allowed`` classes (bool [C], or [B, C] per row), the row's
    lowest allowed score minus ``gap`` elsewhere [D: finite, so the evaluator's cross-entropy
    stays finite; softmax mass outside < C e^-gap]."""
    floor = scores.masked_fill(~allowed, float("inf")).amin(1, keepdim=True) - gap
    return torch.where(allowed, scores, floor)


EMBED_CHUNK = 512  # rows per forward when embedding stored rows (``embed_rows``)


@torch.no_grad()
def embed_rows(model: nn.Module, x: torch.Tensor, normalize: bool) -> torch.Tensor:
    """phi of the rows ``x``: the model's penultimate features, L2-normalised where
    ``normalize``, in eval mode (restored), ``EMBED_CHUNK`` rows per forward, without
    gradient (iCaRL's herding and class means, SCR's prototypes)."""
    was = model.training
    model.eval()
    try:
        parts = []
        for s in range(0, len(x), EMBED_CHUNK):
            z = model.features(x[s : s + EMBED_CHUNK]).flatten(1)
            parts.append(F.normalize(z, dim=1) if normalize else z)
    finally:
        model.train(was)
    if not parts:
        return torch.zeros(0, getattr(model, "feature_dim", 0), device=x.device)
    return torch.cat(parts)


@torch.no_grad()
def herding(
    feats: torch.Tensor, labels: torch.Tensor, classes: Sequence[int], m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """iCaRL's ConstructExemplarSet [P iCaRL Alg. 4] for every class of ``classes`` at once
    (iCaRL, GLFC / LGA): of the rows ``feats`` [n, f] with ``labels`` [n], each class's first
    min(m, its rows) picks, each the row not yet chosen that brings the mean of the chosen
    rows closest (squared L2) to the mean of all the class's rows; ties: the lowest index.
    m = 1 picks the row closest to the class mean (GLFC's prototype). Returns (indices into
    ``feats``, each pick's rank in its class's order), class after class in the order of
    ``classes``. The distances are computed in ``feats``' dtype (iCaRL float64 [D], GLFC
    float32 [C])."""
    dev = feats.device
    if m <= 0 or not len(classes):
        e = torch.zeros(0, dtype=torch.long, device=dev)
        return e, e
    rows = [torch.nonzero(labels == c)[:, 0] for c in classes]
    n_max, k = max(len(r) for r in rows), len(classes)
    idx = torch.zeros(k, n_max, dtype=torch.long, device=dev)
    valid = torch.zeros(k, n_max, dtype=torch.bool, device=dev)
    for i, r in enumerate(rows):
        idx[i, : len(r)], valid[i, : len(r)] = r, True
    f = feats[idx] * valid[..., None]  # [k, n, f], zero rows after each class's own
    mu = f.sum(1) / valid.sum(1, keepdim=True).clamp_min(1)
    acc, free, at = torch.zeros_like(mu), valid.clone(), torch.arange(k, device=dev)
    picks = []
    for step in range(min(m, n_max)):
        cost = (mu[:, None] - (acc[:, None] + f) / (step + 1)).pow(2).sum(2)
        j = cost.masked_fill(~free, math.inf).argmin(1)  # [k]
        ok = free[at, j]  # a class with rows left
        acc = acc + f[at, j] * ok[:, None]
        free[at, j] = False
        picks.append(torch.where(ok, idx[at, j], -1))
    p = torch.stack(picks, 1).reshape(-1)  # class after class, each in its order
    r = torch.arange(len(picks), device=dev).repeat(k)  # each pick's rank in its class
    keep = p >= 0
    return p[keep], r[keep]


def class_report(z: torch.Tensor, y: torch.Tensor, num_classes: int) -> dict[str, torch.Tensor]:
    """A client's class report on its rows' features ``z`` [n, f] of labels ``y``: per class,
    ``sums`` [C, f] of the features and ``counts`` [C] (``class_means`` reads them)."""
    sums = torch.zeros(num_classes, z.shape[1], dtype=z.dtype, device=z.device).index_add_(0, y, z)
    return {"sums": sums, "counts": torch.bincount(y, minlength=num_classes)}


def report_bytes(shape: ClientShape) -> int | None:
    """[D] The bytes of one client's class report, which the server keeps for it across rounds
    (``class_report``, ``keep_reports``): float32 ``sums`` [C, f], f the model's feature width,
    and int64 ``counts`` [C]; None where only a hub config knows the model."""
    model = shape.model
    return None if model is None else shape.num_classes * (4 * model.feature_dim + 8)


def keep_reports(entries: dict[int, dict[str, Any]], replies: dict[int, Any], rnd: int) -> None:
    """The clients' class reports ``replies`` replace their older ones in ``entries`` (the
    server's state), stamped with the round ``rnd`` (``class_means`` uses the newest)."""
    for cid in sorted(replies):
        entries[cid] = {**replies[cid], "round": rnd}


def nme_scores(z: torch.Tensor, means: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
    """[B, C]: -||z_i - mu_c||^2 for the classes with a mean (bool ``known`` [C]), the row's
    lowest such score minus ``OUTSIDE_GAP`` for the others (nearest-class-mean scores:
    iCaRL's NME, SCR's NCM)."""
    means = means.to(z.dtype)
    d = z.pow(2).sum(1, keepdim=True) + means.pow(2).sum(1).unsqueeze(0) - 2.0 * z @ means.T
    return floor_unscored(-d, known)


def class_means(
    entries: dict[int, dict[str, Any]], normalize: bool, device: torch.device, average: bool = False
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(mu [C, f], known [C]) from the clients' reports {cid: {sums [C, f], counts [C],
    round}}: per class, over the clients whose report is the newest of those holding it (so
    no mean mixes features of two models), the pooled mean sum of the sums / sum of the
    counts (iCaRL), or with ``average`` the plain mean of those clients' own class means
    sums / counts, each L2-normalised first where ``normalize`` (SCR: the clients' class
    prototypes averaged); then L2-normalised (``normalize``)."""
    if not entries:
        return None
    cids = sorted(entries)
    counts = torch.stack([entries[c]["counts"].to(device) for c in cids])  # [K, C]
    rounds = torch.tensor([int(entries[c]["round"]) for c in cids], device=device)
    held = counts > 0
    stamp = torch.where(held, rounds.unsqueeze(1), torch.full_like(counts, -1))
    use = held & (stamp == stamp.max(0).values.unsqueeze(0))
    sums = torch.stack([entries[c]["sums"].to(device) for c in cids]).double()  # [K, C, f]
    if average:
        own = sums / counts.clamp_min(1).unsqueeze(2)
        if normalize:
            own = F.normalize(own, dim=2)
        total, n = (own * use.unsqueeze(2)).sum(0), use.sum(0)
    else:
        total, n = (sums * use.unsqueeze(2)).sum(0), (counts * use).sum(0)
    known = n > 0
    means = total / n.clamp_min(1).unsqueeze(1)
    if normalize:
        means = F.normalize(means, dim=1)
    return means.float(), known


def head_scores(model: nn.Module, z: torch.Tensor, top: int) -> torch.Tensor:
    """Logits [N, C] of features ``z``: the shared head, or with per-task heads (up to head
    ``top``) each class's newest head (task-IL trains as class-IL: ``Scenario.masked``)."""
    heads = getattr(model.head, "heads", None)
    if heads is None:
        return model.head(z)
    outs = torch.stack([h(z) for h in heads[: top + 1]])  # [T', N, C]
    owner = torch.full((outs.shape[2],), top, dtype=torch.long)
    for t in range(top + 1):
        owner[model.head.task_classes[t]] = t
    cls = torch.arange(outs.shape[2], device=z.device)
    return outs[owner.to(z.device), :, cls].T


# ----------------------------------------------------------------------------- row weights


def group_normalise(g: torch.Tensor, groups: Sequence[torch.Tensor]) -> torch.Tensor:
    """sum over groups (bool masks like ``g``) of g / mean(g over the group) on its rows
    [D: 0 for a group whose mean is 0, where the code divides by zero], along the last
    dimension: g [N] (a client's rows), or [G, N] (each client of a stack over its own rows).
    A group without rows adds nothing; a row outside every group (a stack's padding, whose g
    may be NaN) neither."""
    w = torch.zeros_like(g)
    for m in groups:
        mean = torch.where(m, g, 0.0).sum(-1, keepdim=True) / m.sum(-1, keepdim=True)  # nan where empty: not selected
        w = w + torch.where(m, g / mean.clamp_min(1e-12), torch.zeros_like(g))
    return w


# ----------------------------------------------------------------------------- communication


def state_mb(params: StateDict) -> float:
    """Megabytes of the floating tensors of a state dict (one model upload)."""
    return (
        sum(v.numel() * v.element_size() for v in params.values() if torch.is_floating_point(v))
        / MB
    )


def float32_mb(tensors: Iterable[torch.Tensor | torch.Size]) -> float:
    """Megabytes of ``tensors`` (or of tensors of these shapes) sent as float32 (4 bytes per
    entry, whatever their dtype)."""
    return sum(t.numel() * 4 for t in tensors) / MB
