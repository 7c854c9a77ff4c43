"""FedProTIP: projected local training, aggregated core bases and task identity prediction
(papers/fedprotip.md Sec. 4.1-4.4, Alg. 1, App. C-E; the authors' code seohyeon-cha/FedProTIP:
client/client_fedprotip.py, server/server_fedprotip.py). Symbols as in the paper; tags:
[P] paper, [C] authors' code, [D] our decision. Representations (Linear inputs, conv inputs
as im2col columns, weights as [out, d_l]) and projection: ``fedforget.activations``.

Training, task t = 0, 1, ... (Eq. 4-5) [P]: every local step, for every projected layer l,
G_l <- G_l - G_l Phi_l Phi_l^T with Phi_l = Phi_l^(1:t-1) the GLOBAL bases of the earlier tasks
(broadcast). Layers: every Linear / Conv outside per-task heads (``shared.projected_layers``; the
shared head too, FedProTIP(-t)); each per-task head trains on its task only, older ones are
frozen by the engine. FedAvg aggregates. The step is stated once as the gradient map of
``client_step_terms`` (``shared.projection_map``): a client alone applies it to its own
gradient (the sequential trainer), the stacked trainer to each client of a stack (every
client projects against the same global bases), with a shared head (FedProTIP(-t)) or
per-task heads (the active task's head in the stack, ``fedforget.vectorized``).

Core bases, client k at the end of task t (the TASK_END reply, ``report_bases``: the task's final global model,
eval mode) [P]: min(``samples``, n_k) inputs of its task data; of each layer's representation
a_l [d_l, columns] m_s = ``samples`` columns drawn uniformly without replacement (all if fewer;
512 [P App. D.2]); keyed (seed, task, client, 0x7A). a~ = a - Phi Phi^T a (Eq. 6); SVD a~ = U S V^T
(Eq. 7); r_l = the smallest r with mass(1..r) >= eps_t (Eq. 8), eps_t = ``threshold`` +
``threshold_step`` * t, at most 1; U_{l,k} = U[:, :r_l] (float32).
- ``energy``: sigma [P, Eq. 8: sum of singular values of a~] | sigma2 [C, GPM's rule: total =
  ||a||_F^2 before Eq. 6, the energy already in span(Phi) counted: (||a||^2 - ||a~||^2 +
  sum_{i<=r} s_i^2) / ||a||^2 >= eps, so r may be 0]. Smallest r for both (``shared.energy_rank``;
  the code's first task keeps one fewer) [D].
- ``threshold`` = 0.7, ``threshold_step`` = 0.001 [P Sec. 6, App. E.3]; the code's CIFAR-100
  config uses 0.775, App. D.1 uses 0.95 for a ResNet-18 trained from scratch.
- ``svd``: randomized [P] | exact [C: np.linalg.svd]. Randomized: Halko-Martinsson-Tropp range
  finder (Alg. 4.4, as torch.svd_lowrank, 2 power iterations) with a Gaussian test matrix from a
  generator keyed (seed, task, client, 0x7B, layer), float64, of rank q = min(d_l, m_s): Eq. 8's
  denominator sums ALL singular values of a~, which a rank-q sketch with smaller q would truncate
  (r biased low). With q full, the result equals the exact SVD up to rounding; the saving the
  paper gets is the m_s-column sample, which both options share [D].
Server (the TASK_END collect, ``collect_bases``; Eq. 9, App. C) [P]: per layer, clients in id order, each one's
residual U_k - P P^T U_k against P = [Phi^(1:t-1), Phi^(t) so far] (the old part only cleans
rounding: U_k is orthogonal to it already), orthonormalised by an SVD that drops directions with
singular value <= 1e-4 (already in the span up to float32 rounding of the clients' bases), then
re-projected and QR'd [D]; Phi^(t) spans the union of the U_k; Phi <- [Phi, Phi^(t)], checked
Phi^T Phi = I. Per-task ranks are kept (``fedprotip_blocks``): TIP needs U_L^(t) per task.
- ``bias``: freeze [C: the code zeroes 1-D gradients from task 2 on] | free. Once bases exist,
  the gradients of every 1-D parameter outside the per-task heads are dropped (p.grad = None: no
  decay either), as ``gpm``. Early layers [P App. E.2: "After learning the first task, we
  freeze the first two residual blocks of ResNet"; C: every method's server freezes them, for
  a pretrained network]: the paper configs freeze them for every method through the model
  option ``freeze_stages`` (``Classifier.hold_after_first_task``; those layers are no
  projected layers, so they get no bases, as in the code). ``freeze_early`` (default off, and
  refused beside ``freeze_stages``) is FedProTIP's own older form of it, kept for models
  without stages: from the second task on (once the first task's bases exist [D]: with
  synchronous boundaries the same round; asynchronous ones then hold every client alike), the
  first floor(n/2) projected layers in module order (on ResNet-18 the stem, layer1, layer2: 10
  of its 20 convolutions, the set ``freeze_stages: 2`` freezes; tested equal) are frozen
  (weights, biases) and never get bases.
- Exact invariance needs wd = 0: weight decay, added by the optimizer after the projection,
  breaks it (the paper trains with wd 5e-4); momentum keeps it (its buffer sums projected steps).

TIP (Sec. 4.4) [P]: a_L = the input of the final layer, model.features(x). Its core bases are
extracted as for a layer (key ``@features``, Eq. 8 [P]; the code takes a fixed rank 20/K) and
used for TIP only. Reference (Eq. 10): omega_k^(tau,t) = ||U_L^(t) U_L^(t)T a_L^(tau)||. a_L^(tau)
summarises client k's task-tau data [D]: the root mean square over its m_s samples of the
per-sample relevance, omega = sqrt(tr(U^T C_tau U)), C_tau = mean_i a_i a_i^T, the second moment
(f x f, kept in ctx.state, no raw data): the scale of the per-sample test relevance, and what
the code's batch Frobenius norm ||A U U^T||_F computes up to sqrt(B) (it keeps raw activations
instead). Alg. 1 line 13: at each task end, after the server has aggregated the task's bases,
the client recomputes omega_k^(tau) in R^(t+1) for every tau it had data in against the
GLOBAL U_L^(1:t) [P Sec. 4.4: "the global task-specific core bases"; Alg. 1 writes the
client's own U_k^(t)], in the AFTER_TASK exchange (``report_references``: a second
task-end message, on the server's new broadcast); the server keeps each client's latest
vectors, padding missing later entries with 0 [D].
Test time (Eq. 11, ``route``): omega_hat^(t) = ||U_L^(t)T a_L^te|| over the learned tasks;
``tip``: sample [P] one routing per input: each client votes the argmax over its tasks of the
cosine with its references, majority decides, ties -> lowest task id [D]; batch [C] one
relevance vector per test batch (the RMS over its rows, the code's Frobenius norm), one routing
for all rows: the evaluator's batches hold one task each, so this inflates task-agnostic
accuracy; none: FedProTIP(-t), one shared classifier, default logits.
Scores (``eval_predict``): the routed task's head logits on that task's classes, the other classes at
the row's lowest such logit - 30 (finite, so the evaluator's cross-entropy stays finite; softmax
mass outside < C e^-30) [D]; task given (task-aware): that task's head; before the first task
end: the model's logits. tip != none needs per_task heads, tip none shared ones (checked at
construction; one-task runs route nothing and accept either).

``route`` (public) and ``FedProTIP.route_inputs`` give the routed task per input, for a TIP
accuracy per task (App. Table 14).

Communication per client per task (Table 9), the row of a task's last round, columns
``fedprotip_<key>``, and ``server.state["fedprotip_comm"]``: ``comm_model_mb`` (one model upload),
``comm_bases_mb`` (float32 U_k of every layer and @features), ``comm_refs_mb`` (float32 omega's),
means over the ``reporting_clients``, ``comm_task_mb`` (their sum); ``basis_fill_<layer>`` (each projected
layer's rank / d_l: the share of its input space the bases span; per-task heads excepted,
every layer of a shared-head model), ``basis_fill_mean`` (their mean over the layers),
``basis_rank`` (sum of ranks), ``features_rank`` (TIP's U_L, all
tasks). MB = 10^6 bytes.

Weighted Gaussian sketch (App. F.2, Eq. 40, Table 19) [P], ``sketch`` (default None: each
client sends its U_{l,k}, as above): instead of its bases, client k sends, per layer (and
@features), B_k = U_k diag(sigma_k) G_k [d_l, s_l] (float32), sigma_k the singular values of a~
that U_k keeps (Eq. 7-8), G_k [r_k, s_l] standard Gaussian, independent per client, drawn from a
generator keyed (seed, task, client, 0x7C, layer); s_l = ``sketch`` columns, or d_l with
``full``. The server sees only the sum B = sum_k B_k (what secure aggregation reveals): each
client's sketches are a ``Summed`` share, which the trainers add to the running float64 sum in
client id order as its report arrives (``SummedTotal``), so a task end holds the sum and the
sketch at hand, not one sketch per client [D: memory; 346 MB a client with ``full`` on the
32 px ResNet-18 of Table 19, benchmarks/sketch_memory.py; the server's earlier float64 sum
of the stacked sketches gave the same bits in the 8 runs compared (4 to 12 clients), but a
sum over a stack is not an ordered sum (random shares of very different scales round
otherwise from 5 clients on), so a run from before 2026-12-06 may differ in the last bits].
It takes Phi^(t) as an
orthonormal basis of span(B - Phi^(1:t-1) Phi^(1:t-1)^T B) (``sketch_bases``): the directions
whose singular value exceeds max(d_l, s_l) * eps_float32 * the largest (numpy's
``matrix_rank`` tolerance for the float32 sketches), found by a randomized range finder that
grows until it meets a numerical zero (``range_svd``; keyed (seed, task, 0x7D, layer)) [D: the
paper does not say how the server reads B]. With s_l >= sum_k r_k that span is, almost surely, the union of the U_k (Eq. 9's);
with fewer columns it keeps s_l directions, weighted towards the larger singular values
(Table 19's trade-off). ``comm_bases_mb`` then counts d_l * s_l floats per layer and client
(Table 19's MB/task; s_l may exceed d_l, as the paper's 128 columns for every layer).

Global projection (Sec. 6.3, Fig. 5) [P], ``projection: global`` (default local): the
baseline FedProTIP is compared with. Clients train without projection (the holds stay:
``bias: freeze`` and ``freeze_early`` are not projections); the server projects the
aggregated update of each layer with bases out of their span, W <- W_old + (W - W_old)(I - Phi
Phi^T) (``shared.project_update``, FOT's FedProject). Bases, references and TIP are as above.

Known differences from the code, beside those above: it grows one shared basis client after
client with GPM's rule (client k's directions chosen against clients 1..k-1's of the same task)
instead of Eq. 9; its relevance vector leaves out the first task's subspace and two learned tasks
are told apart by a threshold on one entry; its references are the mean cosine over batches of
raw activations it keeps; its 1-D gradients are zeroed, not dropped (weight decay still moves
them); its column samples are unkeyed (np.random).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..activations import layer_dim, layer_inputs
from ..models import TaskHeads
from ..utils import FedForgetError, torch_seed
from .base import (
    AFTER_TASK,
    TASK_END,
    ClientContext,
    FedAvg,
    RunInfo,
    ServerContext,
    Summed,
    Upload,
    masked_logits,
    summed_total,
)
from .params import boolean, choice, integer, number, one_of
from .registry import METHODS
from .shared import (
    CHUNK,
    REL_TOL,
    energy_rank,
    float32_mb,
    floor_unscored,
    project_update,
    projected_layers,
    projection_map,
    state_mb,
    threshold_at,
)

SAMPLE_STREAM, SVD_STREAM, SKETCH_STREAM = 0x7A, 0x7B, 0x7C  # keyed randomness: inputs and
# columns, the randomized SVD's test matrices, the weighted Gaussian sketches' G_k
RANGE_STREAM = 0x7D  # keyed randomness: the server's range finder on the summed sketches
SKETCH_FULL = "full"  # sketch: s_l = d_l
PROJECTIONS = ("local", "global")
FEATURES = "@features"  # the final layer's input a_L (TIP's subspaces); never a layer name
BASES, BLOCKS = "fedprotip_bases", "fedprotip_blocks"  # server.state / broadcast
ENDED, REFS, COMM = "fedprotip_ended", "fedprotip_refs", "fedprotip_comm"  # server.state
SUMMARY = "fedprotip_summary"  # ctx.state: {task: C_tau [f, f]}
ENERGIES, SVDS, TIPS, BIAS = (
    ("sigma", "sigma2"),
    ("randomized", "exact"),
    ("sample", "batch", "none"),
    ("freeze", "free"),
)
NITER = 2  # power iterations of the randomized SVD (torch.svd_lowrank's default)
ORTH_TOL = 1e-4  # residual directions of unit columns below this are already in the span
_PROJECTION_LOCK = threading.Lock()  # client_step_terms: one projection map built for the lanes


# ----------------------------------------------------------------------------- core bases


def randomized_svd(
    a: torch.Tensor, q: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(U [d, q], s [q]) of ``a`` [d, n] by the randomized range finder with NITER power
    iterations (float64), the Gaussian test matrix drawn from ``generator`` (CPU)."""
    omega = torch.randn(a.shape[1], q, generator=generator, dtype=torch.float64).to(a.device)
    y = a @ omega
    for _ in range(NITER):
        y = a @ (a.T @ torch.linalg.qr(y).Q)
    basis = torch.linalg.qr(y).Q
    ub, s, _ = torch.linalg.svd(basis.T @ a, full_matrices=False)
    return basis @ ub, s


def core_rank(
    s: torch.Tensor, eps: float, energy: str, total: float | None = None, captured: float = 0.0
) -> int:
    """r of Eq. 8 for the singular values ``s`` (descending) of a~: sigma: the smallest r with
    sum_{i<=r} s_i / sum_i s_i >= eps; sigma2: with captured + sum_{i<=r} s_i^2 / total >= eps.
    total = ||a||_F^2 before Eq. 6 (default sum s^2); values with s^2 <= REL_TOL * total are
    numerical zeros, never kept (a~ = 0 gives r = 0)."""
    s = s.double()
    sq = s * s
    total = float(sq.sum()) if total is None else total
    if total <= 0:
        return 0
    if energy == "sigma":
        keep = s[sq > REL_TOL * total]
        return energy_rank(keep, float(keep.sum()), 0.0, eps) if len(keep) else 0
    return energy_rank(sq, total, captured, eps)


def core_bases(a: torch.Tensor, phi: torch.Tensor | None, eps: float, energy: str, svd: str,
               generator: torch.Generator) -> torch.Tensor:  # fmt: skip
    """U [d, r] (float32, orthonormal, orthogonal to ``phi``) of the representation ``a``
    [d, m]: Eq. 6-8."""
    return core_svd(a, phi, eps, energy, svd, generator)[0]


def core_svd(a: torch.Tensor, phi: torch.Tensor | None, eps: float, energy: str, svd: str,
             generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(U [d, r] as ``core_bases``, the singular values [r] of a~ it keeps, float64)."""
    a = a.double()
    m = phi.double() if phi is not None else a.new_zeros(a.shape[0], 0)
    resid = a - m @ (m.T @ a)
    q = min(resid.shape)
    if svd == "exact":
        u, s, _ = torch.linalg.svd(resid, full_matrices=False)
    else:
        u, s = randomized_svd(resid, q, generator)
    total = float((a * a).sum())
    captured = 1.0 - float((resid * resid).sum()) / total if total > 0 else 0.0
    r = min(core_rank(s, eps, energy, total, captured), a.shape[0] - m.shape[1])
    return u[:, :r].float(), s[:r]


def weighted_sketch(u: torch.Tensor, s: torch.Tensor, cols: int, generator: torch.Generator) -> torch.Tensor:
    """B_k = U_k diag(sigma_k) G_k [d, cols] (float32, as sent; Eq. 40) of a client's core
    basis ``u`` [d, r] and its singular values ``s`` [r], G_k [r, cols] standard Gaussian from
    ``generator`` (CPU)."""
    g = torch.randn(u.shape[1], cols, generator=generator, dtype=torch.float64).to(u.device)
    return ((u.double() * s.to(u.device).double()) @ g).float()


def sketch_bases(old: torch.Tensor | None, total: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Phi^(t) [d, r] (float64, orthonormal, orthogonal to ``old``) from the sum ``total`` [d,
    s] of the clients' weighted sketches: a basis of its span beyond ``old``, r its numerical
    rank (singular values above max(d, s) * eps_float32 * the largest). The span is found by
    ``range_svd`` (``generator``: its test matrices; default seeded 0)."""
    b = total.double()
    if old is not None:
        ref = old.double().to(b.device)
        b = b - ref @ (ref.T @ b)
    if b.numel() == 0:
        return b.new_zeros(b.shape[0], 0)
    q, s = range_svd(b, generator if generator is not None else torch.Generator().manual_seed(0))
    tol = max(b.shape) * torch.finfo(torch.float32).eps * float(s[0]) if len(s) else 0.0
    q = q[:, s > tol]
    if old is not None and q.shape[1]:  # a clean-up: re-projected, re-orthonormalised
        q = torch.linalg.qr(q - ref @ (ref.T @ q)).Q
    return q


RANGE_START = 64  # range_svd's first number of test columns


def range_svd(b: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(U [d, k], s [k]): the leading left singular vectors and values of ``b`` [d, s]
    (float64) until they include a numerical zero, or all of them [D]. A randomized range
    finder (Halko et al., Alg. 4.4, one power iteration) of k = 64, 128, ... test columns:
    once the k-th singular value found is at most max(d, s) * eps_float32 * the largest, the
    k columns hold the whole numerical range of ``b``; at k = min(d, s) the exact SVD. The
    sum of the sketches has rank sum_k r_k at most, far below min(d_l, s_l): with s_l = d_l an
    exact SVD costs O(d_l^3) per layer and task end (d_l = 4608 in ResNet-18's widest layers),
    these steps O(d_l s_l k)."""
    d, cols = b.shape
    full, k = min(d, cols), RANGE_START
    while k < full:
        omega = torch.randn(cols, k, generator=generator, dtype=torch.float64).to(b.device)
        y = torch.linalg.qr(b @ omega).Q
        y = torch.linalg.qr(b @ (b.T @ y)).Q
        u, s, _ = torch.linalg.svd(y.T @ b, full_matrices=False)
        if s[-1] <= max(d, cols) * torch.finfo(torch.float32).eps * s[0]:
            return y @ u, s
        k *= 2
    u, s, _ = torch.linalg.svd(b, full_matrices=False)
    return u, s


def aggregate_bases(old: torch.Tensor | None, clients: Sequence[torch.Tensor]) -> torch.Tensor:
    """Phi^(t) [d, r] (float64, orthonormal, orthogonal to ``old``) spanning the union of the
    clients' bases ``clients`` (Eq. 9: each one's residual against what is there, in order)."""
    d = clients[0].shape[0] if clients else (old.shape[0] if old is not None else 0)
    dev = clients[0].device if clients else None
    ref = old.double() if old is not None else torch.zeros(d, 0, dtype=torch.float64, device=dev)
    new = ref.new_zeros(d, 0)
    for u in clients:
        p = torch.cat([ref, new.to(ref.device)], 1)
        u = u.double().to(p.device)
        resid = u - p @ (p.T @ u)
        if resid.shape[1] == 0:
            continue
        q, s, _ = torch.linalg.svd(resid, full_matrices=False)
        q = q[:, s > ORTH_TOL]
        if q.shape[1]:  # a clean-up: re-projected, re-orthonormalised
            new = torch.cat([new, torch.linalg.qr(q - p @ (p.T @ q)).Q], 1)
    return new


def check_orthonormal(name: str, phi: torch.Tensor, new: int, tol: float = 1e-4) -> None:
    """Phi^T Phi = I on the ``new`` last columns of ``phi`` (against all of them), or raise."""
    r = phi.shape[1]
    gram = phi.double().T @ phi[:, r - new :].double()
    eye = torch.eye(r, dtype=gram.dtype, device=gram.device)[:, r - new :]
    if new and (gram - eye).abs().max() > tol:
        raise FedForgetError(f"fedprotip: layer {name}: the aggregated bases are not orthonormal")


def sample_representations(model: nn.Module, layers: dict[str, nn.Module], x: torch.Tensor, m: int,
                           generator: torch.Generator, features: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:  # fmt: skip
    """({layer: a [d_l, <= m]}: m columns of each layer's representation of ``x``, drawn
    uniformly without replacement from all of them (layer by layer in forward order, from
    ``generator``), all when fewer; the features [n, f] of ``x`` or None). Eval mode, restored."""
    was, n = model.training, len(x)
    model.eval()
    keep: dict[str, torch.Tensor | None] = {}
    parts: dict[str, list[torch.Tensor]] = {}
    feats = []
    try:
        with torch.no_grad():
            for s in range(0, n, CHUNK):
                xs = x[s : s + CHUNK]
                for name, a in layer_inputs(model, xs, layers).items():
                    per = a.shape[1] // len(xs)  # columns per sample
                    if name not in keep:
                        total = per * n
                        keep[name] = (
                            torch.randperm(total, generator=generator)[:m].sort().values
                            if total > m
                            else None
                        )
                    idx = keep[name]
                    if idx is not None:
                        idx = idx[(idx >= s * per) & (idx < s * per + a.shape[1])] - s * per
                        a = a[:, idx.to(a.device)]
                    parts.setdefault(name, []).append(a)
                if features:
                    feats.append(model.features(xs))
    finally:
        model.train(was)
    return {k: torch.cat(v, 1) for k, v in parts.items()}, torch.cat(feats) if features else None


# ----------------------------------------------------------------------------- TIP


def relevance(z: torch.Tensor, blocks: Sequence[torch.Tensor]) -> torch.Tensor:
    """[B, T]: ||U_t U_t^T z_i|| = ||U_t^T z_i|| of each row of ``z`` [B, f] and task block."""
    return torch.stack([(z @ u.to(z)).norm(dim=1) for u in blocks], 1)


def references(second_moment: torch.Tensor, blocks: Sequence[torch.Tensor]) -> torch.Tensor:
    """omega [T] (Eq. 10): sqrt(tr(U_t^T C U_t)), the RMS of the per-sample relevance of the
    samples whose second moment is C."""
    c = second_moment.double()
    return torch.stack(
        [((c @ u.double()) * u.double()).sum().clamp_min(0).sqrt() for u in blocks]
    ).float()


def route(z: torch.Tensor, blocks: Sequence[torch.Tensor], refs: dict[int, dict[int, torch.Tensor]],
          batch: bool = False) -> torch.Tensor:  # fmt: skip
    """The predicted task [B] (long) of each row of the final-layer inputs ``z`` [B, f], given
    the learned tasks' bases ``blocks`` (U_L^(t) [f, r_t], t < T) and every client's reference
    vectors ``refs`` {client: {task: omega}} (Eq. 11; vectors shorter than T padded with 0):
    each client votes the task whose reference is most cosine-similar, the majority decides,
    ties -> the lowest task id. ``batch``: one relevance vector (the rows' RMS), one task."""
    T = len(blocks)
    w = relevance(z.double(), blocks)
    if batch:
        w = w.pow(2).mean(0, keepdim=True).sqrt()
    w = F.normalize(w, dim=1)
    votes = torch.zeros(w.shape[0], T, dtype=torch.long, device=z.device)
    for cid in sorted(refs):
        tasks = sorted(t for t in refs[cid] if t < T)
        if not tasks:
            continue
        om = torch.stack(
            [F.pad(refs[cid][t].to(w)[:T], (0, max(0, T - len(refs[cid][t])))) for t in tasks]
        )
        pick = torch.tensor(tasks, device=z.device)[(w @ F.normalize(om, dim=1).T).argmax(1)]
        votes += F.one_hot(pick, T)
    out = votes.argmax(1)  # the first maximum: the lowest task id
    return out.expand(len(z)) if batch else out


def routed_scores(heads: TaskHeads, z: torch.Tensor, task: torch.Tensor) -> torch.Tensor:
    """[B, C]: row i's logits from head task[i] on that task's classes, its lowest such logit
    minus ``shared.OUTSIDE_GAP`` elsewhere."""
    n = int(task.max()) + 1
    rows = torch.arange(len(z), device=z.device)
    logits = torch.stack([h(z) for h in heads.heads[:n]])[task, rows]
    mask = torch.zeros(n, heads.out_features, dtype=torch.bool, device=z.device)
    for t in range(n):
        mask[t, heads.task_classes[t]] = True
    return floor_unscored(logits, mask[task])


def split_blocks(
    bases: dict[str, torch.Tensor], blocks: dict[str, list[int]], key: str = FEATURES
) -> list[torch.Tensor]:
    """The per-task blocks of ``bases[key]`` (U^(t), t = 0 .. ended-1)."""
    if key not in bases:
        return []
    return list(torch.split(bases[key], blocks[key], dim=1))


@METHODS.register("fedprotip")
class FedProTIP(FedAvg):
    name = "fedprotip"
    step_terms = True  # the projection is a gradient map of the step terms: trains stacked too
    own_predict = True
    shared_projection = True  # one map for every client: the broadcast's bases (Fig. 2's P)
    exchanges = (TASK_END, AFTER_TASK)  # core bases, then references against the global ones

    @dataclass(frozen=True)
    class Params:
        threshold: float = number(0.7, exclusiveMinimum=0, maximum=1)  # eps after task 0 [P; code config 0.775; 0.95 from scratch]; > 0 (0 keeps no basis: FedAvg) [D]
        threshold_step: float = number(0.001, minimum=0)  # + per task [P]
        energy: str = choice("sigma", ENERGIES)  # sigma: Eq. 8 [P] | sigma2: GPM's energy rule [C]
        samples: int = integer(512, minimum=1)  # m_s, columns per layer (and inputs) per client and task [P]
        svd: str = choice("randomized", SVDS)  # randomized [P] | exact [C]
        tip: str = choice("sample", TIPS)  # sample [P] | batch [C] | none: FedProTIP(-t)
        freeze_early: bool = boolean(False)  # freeze the first half of the layers after task 0 [P, C: which]; the model's freeze_stages does it for every method
        bias: str = choice("freeze", BIAS)  # freeze: 1-D parameters fixed once bases exist [C] | free
        # None: clients send their bases [P] | full | s: a weighted Gaussian sketch of s_l = d_l | s columns [P App. F.2]
        sketch: str | int | None = one_of(
            None, {"type": "null"}, {"enum": [SKETCH_FULL]}, {"type": "integer", "minimum": 1}, added=True
        )
        # local: every local step projected (Eq. 4-5) [P] | global: the aggregated update only (Sec. 6.3's baseline) [P Fig. 5]
        projection: str = choice("local", PROJECTIONS, added=True)

    @classmethod
    def check_model(cls, model: str, params: Any = None, options: dict[str, Any] | None = None) -> None:
        """``freeze_early`` or the model's ``freeze_stages``, not both: each freezes the early
        layers from the second task on (the model's for every method), and freeze_early would
        take half of the layers left."""
        if params is not None and params.freeze_early and (options or {}).get("freeze_stages"):
            raise FedForgetError(
                f"method 'fedprotip': freeze_early=True and model.options.freeze_stages={options['freeze_stages']} "
                f"both freeze early layers after the first task (the model option for every method); allowed: "
                f"one of them (freeze_early: false with freeze_stages)"
            )

    @classmethod
    def check_scenario(cls, scenario: dict[str, Any] | None, params: Any = None) -> None:
        """tip sample | batch needs per-task heads, tip none a shared head (one-task runs
        route nothing and accept either)."""
        if params is None or not scenario or int(scenario.get("tasks") or 1) <= 1:
            return
        want = "shared" if params.tip == "none" else "per_task"
        if scenario.get("heads", "shared") != want:
            why = "one shared classifier (FedProTIP(-t))" if want == "shared" else "one head per task to route inputs to"
            raise FedForgetError(
                f"method 'fedprotip': tip={params.tip!r} needs {why}, scenario.heads={want!r}; "
                f"got scenario.heads={scenario.get('heads')!r} (or, for these heads, tip: {'none' if want == 'per_task' else 'sample | batch'})"
            )

    def __init__(self, params: Any, info: RunInfo) -> None:
        super().__init__(params, info)
        sc = info.scenario
        if sc is not None:
            self.check_scenario({"tasks": sc.tasks, "heads": sc.heads}, params)
        self.routes = params.tip != "none" and (sc is None or sc.heads == "per_task")
        self._projection: tuple | None = None  # client_step_terms' map of the last bases it met

    def basis_layers(self, model: nn.Module) -> dict[str, nn.Module]:
        """The projected layers that get bases: all, or (freeze_early) all but the first half."""
        layers = projected_layers(model)
        early = len(layers) // 2 if self.p.freeze_early else 0
        return dict(list(layers.items())[early:])

    # ---------------------------------------------------------------- server side
    def server_broadcast(self, server: ServerContext) -> dict[str, Any]:
        return {BASES: server.state.get(BASES, {}), BLOCKS: server.state.get(BLOCKS, {})}

    def server_aggregate(self, server: ServerContext, uploads: Sequence[Upload]) -> None:
        """FedAvg; with ``projection: global``, then the aggregated update of every layer with
        bases projected out of their span (``project_update``, as FOT's FedProject)."""
        old = server.global_params
        super().server_aggregate(server, uploads)
        bases = server.state.get(BASES)
        if self.p.projection == "global" and bases:
            new = dict(server.global_params)
            project_update(new, old, {k: u for k, u in bases.items() if u.shape[1]})
            server.global_params = new

    def server_collect(self, exchange: str, server: ServerContext, replies: dict[int, Any]) -> None:
        """TASK_END: the clients' core bases (``collect_bases``); AFTER_TASK: their
        reference vectors (``collect_references``)."""
        if exchange == TASK_END:
            self.collect_bases(server, replies)
        else:
            self.collect_references(server, replies)

    def collect_bases(self, server: ServerContext, reports: dict[int, Any]) -> None:
        """Alg. 1: each layer's new global core basis from the clients' (``aggregate_bases``;
        with ``sketch``, from the sum of their sketches: ``sketch_bases``), appended to the
        old ones; the task's communication and basis diagnostics."""
        st, order = server.state, sorted(reports)
        bases, blocks = dict(st.get(BASES, {})), {k: list(v) for k, v in st.get(BLOCKS, {}).items()}
        ended = st.get(ENDED, 0)
        if self.p.sketch is None:
            sent = [n for c in order for n in reports[c]["bases"]]
        else:  # the server sees only the sum of the sketches (secure aggregation), summed as they came
            total = summed_total(reports[c]["bases"] for c in order) if order else None
            sent = total.names() if total else []
        names = list(dict.fromkeys(sent + list(bases)))
        for i, name in enumerate(names):
            old = bases.get(name)
            if name not in sent:
                new = None
            elif self.p.sketch is None:
                ups = [reports[c]["bases"][name].to(server.device) for c in order if name in reports[c]["bases"]]
                new = aggregate_bases(old, ups)
            else:
                g = torch.Generator().manual_seed(torch_seed(self.info.seed, server.task, RANGE_STREAM, i))
                new = sketch_bases(old, total.part(name).to(server.device), g)
            if new is not None:
                new = new.to(server.device).float()
                bases[name] = new if old is None else torch.cat([old, new], 1)
                check_orthonormal(name, bases[name], new.shape[1])
            rank = 0 if new is None else new.shape[1]
            blocks[name] = blocks.get(name, []) + [0] * (ended - len(blocks.get(name, []))) + [rank]
        st[BASES], st[BLOCKS], st[ENDED] = bases, blocks, ended + 1
        n = max(len(order), 1)
        comm = {
            "task": server.task, "reporting_clients": len(order), "comm_model_mb": state_mb(server.global_params),
            "comm_bases_mb": float32_mb(
                [u for c in order for u in reports[c]["bases"].values()] if self.p.sketch is None
                else [total.shape(k) for _ in order for k in sent]  # every client's: the total's shapes
            ) / n,  # fmt: skip
            "comm_refs_mb": 0.0,  # collect_references
        }  # fmt: skip
        comm["comm_task_mb"] = comm["comm_model_mb"] + comm["comm_bases_mb"]
        st.setdefault(COMM, []).append(comm)
        layers = projected_layers(server.model)
        fill = {k: bases[k].shape[1] / layer_dim(m) if k in bases else 0.0 for k, m in layers.items()}
        st["fedprotip_task_end"] = {  # server_metrics adds the task's COMM entry, complete by then
            "basis_fill_mean": sum(fill.values()) / max(len(fill), 1),
            **{f"basis_fill_{k.replace('.', '_')}": v for k, v in fill.items()},
            "basis_rank": float(sum(bases[k].shape[1] for k in layers if k in bases)),
            "features_rank": float(bases[FEATURES].shape[1]) if FEATURES in bases else 0.0,
        }

    def collect_references(self, server: ServerContext, replies: dict[int, Any]) -> None:
        """Each client's latest reference vectors (Eq. 10, against the global bases)."""
        st = server.state
        refs = st.setdefault(REFS, {})
        refs.update({c: replies[c] for c in sorted(replies)})
        mb = float32_mb(w for r in replies.values() for w in r.values()) / max(len(replies), 1)
        comm = st[COMM][-1]
        comm["comm_refs_mb"] = mb
        comm["comm_task_mb"] = comm["comm_model_mb"] + comm["comm_bases_mb"] + mb

    def server_metrics(self, server: ServerContext, uploads: Sequence[Upload]) -> dict[str, float]:
        """At a task's last round: its communication and basis sizes."""
        end = server.state.pop("fedprotip_task_end", None)
        if end is None:
            return {}
        comm = server.state[COMM][-1]
        return {**{k: float(v) for k, v in comm.items() if k != "task"}, **end}

    def routing(self, server: ServerContext, model: nn.Module) -> bool:
        """Whether TIP routes (references exist, per-task heads)."""
        heads = getattr(model, "head", None)
        return self.routes and bool(server.state.get(REFS)) and isinstance(heads, TaskHeads)

    def route_features(self, server: ServerContext, z: torch.Tensor) -> torch.Tensor:
        blocks = split_blocks(server.state[BASES], server.state[BLOCKS])
        return route(z, blocks, server.state[REFS], batch=self.p.tip == "batch")

    def route_inputs(
        self, server: ServerContext, model: nn.Module, x: torch.Tensor
    ) -> torch.Tensor | None:
        """The task TIP routes each input of ``x`` to, [B] (None where it does not route:
        before the first task end, tip none): for an evaluator's per-task TIP accuracy."""
        return (
            self.route_features(server, model.features(x)) if self.routing(server, model) else None
        )

    def eval_predict(
        self, server: ServerContext, model: nn.Module, x: torch.Tensor, task: int | None
    ) -> torch.Tensor:
        if task is not None or not self.routing(server, model):
            return model.logits(x, task)  # type: ignore[operator]
        z = model.features(x)
        return routed_scores(model.head, z, self.route_features(server, z))  # type: ignore[arg-type]

    def eval_counts(
        self, server: ServerContext, model: nn.Module, x: torch.Tensor, y: torch.Tensor, task: int
    ) -> dict[str, torch.Tensor]:
        """Rows of task ``task``'s test batch counted correct [D]: ``agnostic`` (no TIP: the
        model's logits, with per-task heads each class's newest head), and where TIP routes,
        ``tip_sample`` / ``tip_batch`` (task-agnostic, per-sample / per-batch routing: the
        batch is one task's, as the authors' code tests) and ``task_id_sample`` /
        ``task_id_batch`` (rows routed to their own task: TIP accuracy, Table 14). The
        task-aware accuracy (the task's head, or the shared head, on the task's classes) is
        the evaluator's, as for every method (``evaluation.TASK_AWARE``)."""
        sc = self.info.scenario
        if sc is None or sc.tasks <= 1:
            return {}
        z = model.features(x)  # one body pass for every count
        plain = model.head_logits(z, None)  # type: ignore[operator]
        if sc.masked:  # task-IL: the evaluator's mask on the scores
            plain = masked_logits(plain, sc.class_mask(x.device)[task])
        out = {"agnostic": (plain.argmax(1) == y).sum()}
        if not self.routing(server, model):
            return out
        heads = model.head
        blocks = split_blocks(server.state[BASES], server.state[BLOCKS])
        for mode in ("sample", "batch"):
            routed = route(z, blocks, server.state[REFS], batch=mode == "batch")
            out[f"tip_{mode}"] = (routed_scores(heads, z, routed).argmax(1) == y).sum()  # type: ignore[arg-type]
            out[f"task_id_{mode}"] = (routed == task).sum()
        return out

    # ---------------------------------------------------------------- client side
    def client_step_terms(self, ctxs: Sequence[ClientContext]) -> Any:
        """G - G Phi Phi^T against the global bases of the broadcast, one for every client,
        and the parameters held fixed (``projection_map``): the 1-D ones once bases exist
        (``bias: freeze``), and with ``freeze_early`` the early layers' once the first
        task's bases exist [D: the code freezes them after task 0; with synchronous
        boundaries that is the same round, and it holds for every client of a stack]."""
        bases = ctxs[0].broadcast.get(BASES) or {}
        model = ctxs[0].model
        # [D] the map is built once per broadcast bases (they change at task ends), not once
        # per client and round: its Projectors form I - U U^T where r > d / 2, ResNet-18's
        # most of a sequential round on a CPU (results/cpu-2026-12-05: 29.9 s a round before,
        # 9.9 s after, 10 clients of split CIFAR-shaped blobs); the same map, so the same bits.
        # Kept: the bases themselves (their tensors, so no id is reused), their versions and
        # the parameter names
        names = tuple(n for n, _ in model.named_parameters())
        tensors, versions = tuple(bases.values()), tuple(u._version for u in bases.values())
        # [D] the lanes (train.concurrent_clients) share one map: the first to need it builds
        # it, and on a GPU, each lane on a CUDA stream of its own, its I - U U^T is complete
        # before another lane reads it (and no lane's map is dropped while another reads it)
        with _PROJECTION_LOCK:
            memo = self._projection
            if (memo is None or memo[0] is not bases or len(memo[1]) != len(tensors)
                    or any(a is not b for a, b in zip(memo[1], tensors)) or memo[2] != (versions, names)):
                early = []
                if self.p.freeze_early and bases:
                    early = [n for n in projected_layers(model) if n not in self.basis_layers(model)]
                gmap = projection_map(model, bases, self.p.bias == "freeze", early, project=self.p.projection == "local")
                dev = next(model.parameters()).device
                if dev.type == "cuda":
                    torch.cuda.current_stream(dev).synchronize()
                self._projection = memo = (bases, tensors, (versions, names), gmap)
        gmap = memo[3]
        if gmap is None:
            return None
        return lambda lo, hi, w: (None, None, gmap)

    def client_reply(self, exchange: str, ctx: ClientContext) -> Any:
        """TASK_END: the client's core bases (``report_bases``); AFTER_TASK: its reference
        vectors against the new global bases (``report_references``)."""
        return self.report_bases(ctx) if exchange == TASK_END else self.report_references(ctx)

    def report_bases(self, ctx: ClientContext) -> Any:
        """Alg. 1 lines 9-11: each layer's core basis of the client's task representations
        beyond the global bases it received (with ``sketch``: its weighted Gaussian sketch,
        Eq. 40, in its place), and (TIP) the summary C_tau of its features."""
        seed, t, k = self.info.seed, ctx.task, ctx.cid
        gen = torch.Generator().manual_seed(torch_seed(seed, t, k, SAMPLE_STREAM))
        x, _ = ctx.data.sample(self.p.samples, gen)
        layers = self.basis_layers(ctx.model)
        reps, z = sample_representations(ctx.model, layers, x, self.p.samples, gen, self.routes)
        if z is not None:
            reps[FEATURES] = z.T
        bases = ctx.broadcast.get(BASES) or {}
        eps = threshold_at(self.p.threshold, self.p.threshold_step, t)
        out = {}
        for i, (name, a) in enumerate(reps.items()):
            g = torch.Generator().manual_seed(torch_seed(seed, t, k, SVD_STREAM, i))
            u, s = core_svd(a, bases.get(name), eps, self.p.energy, self.p.svd, g)
            if self.p.sketch is None:
                out[name] = u
            else:  # Eq. 40: only the sketch leaves the client
                cols = a.shape[0] if self.p.sketch == SKETCH_FULL else int(self.p.sketch)
                gk = torch.Generator().manual_seed(torch_seed(seed, t, k, SKETCH_STREAM, i))
                out[name] = weighted_sketch(u, s, cols, gk)
        if z is not None:  # a_L^(t) for the references (report_references)
            z = z.double()
            ctx.state.setdefault(SUMMARY, {})[t] = (z.T @ z / len(z)).float()
        return {"bases": out if self.p.sketch is None else Summed(out)}

    def report_references(self, ctx: ClientContext) -> Any:
        """Alg. 1 line 13, Eq. 10: omega_k^(tau) in R^(t+1) of every task tau the client had
        data in, against the GLOBAL U_L^(1:t) the server has just aggregated (Sec. 4.4: "the
        global task-specific core bases") [P]."""
        summary = ctx.state.get(SUMMARY)
        if not self.routes or not summary:
            return None
        blocks = split_blocks(ctx.broadcast.get(BASES) or {}, ctx.broadcast.get(BLOCKS) or {})
        return {tau: references(c, blocks) for tau, c in sorted(summary.items())}
