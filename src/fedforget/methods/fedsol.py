"""FedSOL: Federated Stabilized Orthogonal Learning.

Paper: Gihun Lee, Minchan Jeong, Sangmook Kim, Jaehoon Oh, Se-Young Yun, "FedSOL: Stabilized
Orthogonal Learning with Proximal Restrictions in Federated Learning", CVPR 2024
(../shared/papers/fedsol.md); exact behaviour and defaults: METHODS.md "FedSOL".
Tags: [P] paper, [C] the authors' code (Lee-Gihun/FedSOL, read, not run), [D] our decision.

One local step of client k (Algorithm 1), w = w_k, w_g the broadcast global model:

    g_p   = grad_w L_p(w; w_g)                                  proximal gradient (Eq. 5)
    lambda^(m)[i] = |w^(m)[i] - w_g^(m)[i]| / ||w^(m) - w_g^(m)||_2               (Eq. 7)
    eps*  = rho * Lambda (.) g_p / ||g_p||_2                    adaptive perturbation (Eq. 8)
    w.grad <- grad_w L_local(w + eps*)                          (Eq. 6), no gradient through eps*
    w     <- optimizer step from w (restored bit-exactly before the step)

L_local is the cross-entropy; L_p the proximal loss; the server is FedAvg (or, in combined
mode, the base method's server). The Table 1 variants replace the perturbation by a direct
projection (Eq. 3) or by the auxiliary-loss form (Eq. 2).

Switches (``FedSOLParams``)
- ``rho`` (default 1.5) [P Table 5 / D]: perturbation strength; rho = 0 is FedAvg exactly.
  The paper's headline appears to be head perturbation with rho 1.5 (METHODS.md); the
  authors' config uses 1.0 with full-model perturbation.
- ``perturb: head|body|all`` (default head) [P Sec. 3.4]: which parameters are perturbed
  (head = ``model.head``, the final linear classifier; body = every other parameter). g_p
  and ||g_p|| are taken over the perturbed parameters only [C: the code zeroes the other
  gradients before the norm].
- ``adaptive`` (default true) [P Eq. 7-8]: Lambda as Eq. 7; false gives the fixed variant
  Lambda = 1 (||eps|| = rho, eps parallel to g_p) [P Sec. 3.3, C fedsol_fixed].
- ``lambda_norm: layer|column`` (default layer) [P Eq. 7 / C]: ``layer`` normalises
  |w - w_g| over each parameter tensor (a layer's weight and bias separately, the unit the
  code iterates over) [D]; ``column`` normalises over dim 0 of each tensor, as the code's
  ``F.normalize((p - ref_p).abs(), 2, dim=0)`` (for a 1-D bias: the whole vector) [C].
- ``proximal: kl|l2|base`` (default kl):
  * kl [P Sec. 4.1, C]: L_p = KL(softmax(z_g / T) || softmax(z / T)), batch mean, T =
    ``temperature`` = 3 [C], z_g the frozen global model's logits, no T^2 factor [C]. Its
    gradient is taken analytically at the logits, dL_p/dz = (softmax(z/T) - softmax(z_g/T))
    / (T B), then back-propagated [D]: identical logits give an exactly zero g_p (autograd
    through kl_div leaves rounding noise of ~1e-9 that the normalisation would blow up to a
    unit vector).
  * l2 [P Table 1 "L2 distance"]: L_p = (1/2) ||w - w_g||^2 over all trainable parameters.
  * base [P Table 4]: the proximal term of the ``base`` method (next item).
- Combined mode [P Table 4]: ``base: fedavg|fedprox|feddyn|scaffold|fednova|moon`` (default
  fedavg) and ``base_params`` (that method's hyperparameters). FedSOL is a plug-in
  (``methods/plugin.py``, ``OverBase``): an instance of the base method runs every hook but
  the local step: its server state, broadcast,
  aggregation (server_aggregate), client state and upload (SCAFFOLD's c and c_i, FedDyn's h and
  client gradient, FedNova's normalised averaging, MOON's previous-model store). With
  ``proximal: base`` the perturbation direction is the gradient of the base method's local
  term at w: FedProx (mu/2)||w - w_g||^2 -> mu (w - w_g); FedDyn -> alpha (w - w_g) - grad
  L_k(theta_k^{t-1}); SCAFFOLD's correction (gradient of the linear term <c - c_i, w>) ->
  c - c_i; MOON -> mu * grad l_con. FedNova has no local term (its FedNova paper form, which
  ours implements, changes only the aggregation), so ``base: fednova`` pairs FedNova's
  server with a ``kl`` or ``l2`` perturbation [D]. (The FedSOL code's FedNova adds a
  SCAFFOLD-like control variate c_i = weighted_d - d_i to every gradient, but its server
  never updates weighted_d, so c_i = -d_i; not reproduced.)
- ``base_loss`` (default false) [D]: whether the base method's own local term stays in the
  update. The paper contrasts the proximal objective "as an auxiliary objective alongside
  the original local objective (Base)" with "as proximal perturbation within FedSOL
  (Combined)", and Eq. 6 updates with the local loss only, so by default the term moves from
  the loss into the perturbation. true keeps it (the base's loss terms at w + eps, and the base's
  client_grad, e.g. SCAFFOLD's correction) and adds the perturbation on top. Note that
  SCAFFOLD's option-II c_i and FedDyn's client-gradient updates assume their term was in the
  update; with base_loss false they are still run unchanged (the base's state is kept).
- ``update: perturb|project|loss`` (default perturb): ``project`` is Table 1's direct
  projection (Eq. 3): g_u = g_l - <g_l, g_p>/||g_p||^2 g_p if <g_l, g_p> < 0, over the
  ``perturb`` parameters, g_l = grad CE at w [P]; ``loss`` is Table 1's "Base" usage (Eq. 2):
  CE + ``beta`` * L_p over all parameters whatever ``perturb`` says (for l2 it is FedProx
  with mu = beta) [P].
- Guards [D]: ||g_p|| below 1e-12 gives eps = 0 (and no projection); at the first local step
  w = w_g, so Lambda = 0 (adaptive) and g_p = 0 (kl, l2): eps = 0 and the step is FedAvg's.
  When eps = 0 the second forward/backward pass is skipped (same gradient).
- Restoring [D, as FedSAM]: w is copied back from a saved copy (bit-exact), not w + eps - eps.
  Buffers (BatchNorm running statistics) are updated by the first pass only, at w: they are
  restored after the second [C: the code disables running-stat updates in its second pass;
  as FedSAM here]. The head-only second pass runs no BatchNorm. The KL proximal term's
  frozen global model runs in eval mode (its running statistics, not the batch's) [D].
- Head perturbation reuses the first pass's body features [D]: with only the head perturbed
  the body output at w + eps equals the one at w, so the second pass recomputes only the head
  and back-propagates CE through the retained body graph; the gradient is exactly
  grad CE(w + eps). (The paper's 1.33x FLOPs count a second full forward.)
- The returned (logged) training loss is CE at the unperturbed w, as FedSAM and the code.

Both trainers [D, issue 32]: with base fedavg, update perturb and a kl or l2 proximal term
(Tables 1, 2, 3, 5: the paper's FedSOL), the stacked trainer runs the step for a stack of
clients (``client_live_terms``): g_p from the stacked forward's logits, Lambda and eps* by
the same functions as ``client_step`` (``lambdas``, ``perturbation``, ``kl_direction``,
``with_proximal``, ``conflict_removed``, written for a stack; a client alone is a stack of
one), and the second pass in the batched
forward (the head alone on the first pass's features when only the head moves); Table 1's
project and loss updates as a map of the step's gradient; Table 4's combined mode (update
perturb, base_loss false) with g_p the gradient of the base's step terms (FedProx, FedDyn,
SCAFFOLD's additions) or live loss (MOON), FedNova with its KL. With ``base_loss: true`` it
trains sequentially (the base's terms at w + eps in the update: not composed).

Diagnostics (ctx.stats, metrics columns ``fedsol_<key>``, mean over a client's steps, then
over clients):
- ``prox_loss`` [P Fig. 2a]: L_p(w; w_g) on the minibatch before each step (KL, L2, or the base
  method's term; SCAFFOLD's linear term has no value and reports none).
- ``cos_update_prox`` [P Fig. 2b]: cos(g_u, g_p) over the perturbed parameters, g_u the
  update gradient (grad CE at w + eps for perturb, the projected gradient for project, the
  full loss gradient for loss), over steps with g_p != 0.
- ``eps_norm``: ||eps||_2 (perturb); ``conflict_rate``: fraction of steps with <g_l, g_p> < 0
  (project).
- The base method's own diagnostics (e.g. ``l_con``, ``c_norm``, ``h_norm``) under the same
  prefix. Weight divergence, class-wise accuracy and local models' global accuracy are engine
  diagnostics (train.diagnostics).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..utils import FedForgetError
from .base import (
    TASK,
    ClientContext,
    LiveStep,
    LiveTerms,
    Upload,
    frozen_model,
    task_cross_entropy,
    total_loss,
)
from .params import boolean, choice, make_params, mapping, number
from .plugin import OverBase
from .registry import METHODS
from .shared import NORM_GUARD, client_norms, per_client, tensor_norms

PERTURBS = ("head", "body", "all")
LAMBDA_NORMS = ("layer", "column")
PROXIMALS = ("kl", "l2", "base")
BASES = ("fedavg", "fedprox", "feddyn", "scaffold", "fednova", "moon")
BASES_WITH_TERM = ("fedprox", "feddyn", "scaffold", "moon")  # have a local proximal term
UPDATES = ("perturb", "project", "loss")


def _sum64(values) -> torch.Tensor:
    """The float32 0-dim tensors ``values`` summed one after another in float64, on their
    device: Python's ``sum(float(v) for v in values)`` without reading them to the host."""
    total = None
    for v in values:
        total = v.double() if total is None else total + v.double()
    return total


def _client_dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> torch.Tensor:
    """[G] float64: each client's <a, b> over the tensors of a stack ([G, ...] each), each
    tensor's float32 sum added in float64 in order (``_sum64``, one per client); a stack of
    one sums each tensor whole, as one client's step always did."""
    if len(a[0]) == 1:
        return _sum64((x * y).sum() for x, y in zip(a, b)).view(1)
    return _sum64((x * y).flatten(1).sum(1) for x, y in zip(a, b))


DIAGNOSTICS = ("prox_loss", "cos_update_prox", "eps_norm", "conflict_rate")  # per step, averaged per client


def _step_value(key: str, row: list[float]) -> float | None:
    """One step's diagnostic from its logged inputs (None: the step has none)."""
    if key == "eps_norm":  # ||eps*||: the root of its squared norm
        return math.sqrt(row[0])
    if key == "cos_update_prox":  # cos(g_u, g_p) from g_u . g_p, ||g_u||^2 and ||g_p||
        dot, sq, g_norm = row
        un = math.sqrt(sq)
        return dot / (un * g_norm) if g_norm >= NORM_GUARD and un > 0 else None
    if math.isnan(row[0]):  # conflict_rate, prox_loss: a stacked client without one
        return None
    return row[0]


class StepLog:
    """Each client's per-step inputs of the diagnostics (float64 on the device: [diagnostic,
    step, input, client]), each written at the client's next row of that diagnostic, a count
    kept on the device [D]: no host read per step (it stalls a GPU), and a step captured in
    a CUDA graph writes its own row at each replay. Read once, at the client's end, where
    each step's value and their mean are taken in Python, in step order (as before: the same
    numbers, bit for bit; torch's float64 sqrt on a CPU is not always Python's)."""

    def __init__(self, rows: torch.Tensor, count: torch.Tensor) -> None:
        self.rows, self.count = rows, count
        self.cols = torch.arange(rows.shape[3], device=rows.device)  # the clients' columns

    @classmethod
    def new(cls, steps: int, clients: int, device: torch.device) -> StepLog:
        """Room for ``steps`` steps of each of ``clients`` clients."""
        rows = torch.full((len(DIAGNOSTICS), steps, 3, clients), math.nan, dtype=torch.float64, device=device)
        return cls(rows, torch.zeros(len(DIAGNOSTICS), clients, dtype=torch.long, device=device))

    def add(self, key: str, *values: torch.Tensor, lo: int = 0, hi: int | None = None) -> None:
        """One step's inputs of ``key`` for clients lo..hi-1 (default: all; 0-dim or
        [hi - lo] tensors each)."""
        k, hi = DIAGNOSTICS.index(key), self.rows.shape[3] if hi is None else hi
        at, cols = self.count[k, lo:hi], self.cols[lo:hi]
        for i, v in enumerate(values):
            self.rows[k, :, i].index_put_((at, cols), v.double().expand(hi - lo))
        self.count[k, lo:hi] += 1

    def client(self, j: int) -> StepLog:
        """Client j's (views)."""
        return StepLog(self.rows[..., j : j + 1], self.count[:, j : j + 1])

    def means(self) -> dict[str, float]:
        """{key: the mean of its steps' values} of a one-client log, keys without one left out."""
        counts, rows = self.count[:, 0].tolist(), self.rows[..., 0].tolist()
        out = {}
        for key, n, steps in zip(DIAGNOSTICS, counts, rows):
            values = [v for v in (_step_value(key, r) for r in steps[:n]) if v is not None]
            if values:
                out[key] = sum(values) / len(values)
        return out


def kl_direction(
    logits: torch.Tensor, z_g: torch.Tensor, t: float, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The KL proximal loss of each client of a stack and its gradient at the logits, no
    graph: L_p = KL(softmax(z_g / T) || softmax(z / T)), the mean over a client's rows, and
    dL_p/dz = (softmax(z/T) - softmax(z_g/T)) / (T B). ``logits``, ``z_g`` [G, B, C];
    ``mask`` [G, B] each client's real rows (None: every row; the padding rows get dz = 0)."""
    p_g = F.softmax(z_g / t, dim=-1)
    log_q = F.log_softmax(logits / t, dim=-1)
    if mask is None:  # every row real: the batch mean, as one client's step always took it
        value = torch.stack([F.kl_div(lq, pg, reduction="batchmean") for lq, pg in zip(log_q, p_g)])
        return (F.softmax(logits / t, dim=-1) - p_g) / (t * logits.shape[1]), value
    n = mask.sum(1)
    value = (F.kl_div(log_q, p_g, reduction="none").sum(-1) * mask).sum(1) / n
    dz = (F.softmax(logits / t, dim=-1) - p_g) / (t * n).view(-1, 1, 1) * mask.unsqueeze(-1)
    return dz, value


def with_proximal(g_l: Sequence[torch.Tensor], g_p: Sequence[torch.Tensor], beta: float) -> list[torch.Tensor]:
    """Eq. 2's gradient [P]: g_l + beta * g_p, tensor by tensor (a client alone's, or a
    stack's [G, ...])."""
    return [g + beta * gp for g, gp in zip(g_l, g_p)]


def conflict_removed(
    g_l: Sequence[torch.Tensor], g_p: Sequence[torch.Tensor], g_norm: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Eq. 3 [P] for each client of a stack (tensors [G, ...], ``g_norm`` [G] float64
    ||g_p||): g_l - <g_l, g_p> / ||g_p||^2 g_p where <g_l, g_p> < 0, g_l elsewhere and where
    ||g_p|| < NORM_GUARD; and each client's conflict (1.0 or 0.0; NaN without g_p: no
    record), decided on the device (no host read)."""
    dot = _client_dot(g_l, g_p)
    valid = g_norm >= NORM_GUARD
    coef = torch.where(valid & (dot < 0), -dot / g_norm.pow(2).clamp_min(NORM_GUARD), 0.0).float()
    rate = torch.where(valid, (dot < 0).double(), math.nan)
    return [g + per_client(coef, gp, True) * gp for g, gp in zip(g_l, g_p)], rate


@dataclass(frozen=True)
class FedSOLParams:
    rho: float = number(1.5, minimum=0)  # perturbation strength; 0 = FedAvg
    perturb: str = choice("head", PERTURBS)  # head | body | all (partial perturbation, Sec. 3.4)
    adaptive: bool = boolean(True)  # Lambda of Eq. 7; false: Lambda = 1 (fixed rho)
    lambda_norm: str = choice("layer", LAMBDA_NORMS)  # layer (paper Eq. 7) | column (authors' code)
    proximal: str = choice("kl", PROXIMALS)  # kl | l2 | base (the base method's local term)
    temperature: float = number(3.0, exclusiveMinimum=0)  # T of the KL proximal loss (code: 3)
    base: str = choice("fedavg", BASES)  # combined mode: the method whose server/state FedSOL keeps
    base_params: dict[str, Any] = mapping()  # its hyperparameters
    base_loss: bool = boolean(False)  # keep the base method's local term in the update too
    update: str = choice("perturb", UPDATES)  # perturb (FedSOL) | project (Eq. 3) | loss (Eq. 2)
    beta: float = number(1.0, minimum=0)  # weight of L_p for update = loss

    def check(self) -> None:
        if self.proximal == "base" and self.base not in BASES_WITH_TERM:
            raise ValueError(
                f"proximal='base' with base={self.base!r}: that method has no local proximal term; "
                f"allowed bases: {', '.join(BASES_WITH_TERM)} (or proximal kl | l2)"
            )
        if self.update == "loss" and self.proximal == "base":
            raise ValueError("update='loss' with proximal='base' is the base method itself; allowed proximal: kl, l2")
        try:
            make_params(self.base, dict(self.base_params), "base_params")
        except FedForgetError as e:
            raise ValueError(str(e)) from None


@METHODS.register("fedsol")
class FedSOL(OverBase):
    """Local step at the proximally perturbed weights: grad CE(w + rho Lambda g_p/||g_p||).
    The server side, and whatever the local step does not replace, is the base method's
    (``OverBase``; base fedavg outside combined mode)."""

    name = "fedsol"
    Params = FedSOLParams
    live_terms = True  # the stacked step (client_live_terms), for the forms ``trait`` names

    @classmethod
    def trait(cls, name: str, params: Any = None) -> bool:
        """``stacked``: base fedavg with a kl or l2 proximal term (Tables 1, 2, 3, 5), or the
        combined mode over a stacked base (Table 4: update perturb, base_loss false), whose
        step ``client_live_terms`` states for a stack; other forms run sequentially."""
        if name == "stacked":
            if params is None:
                return False
            if params.base == "fedavg":
                return params.proximal in ("kl", "l2")
            base = METHODS.get(params.base)
            base_params = make_params(params.base, dict(params.base_params))
            # combined mode (Table 4): the base's term moves into the perturbation
            return (params.update == "perturb" and not params.base_loss and base.trait("stacked", base_params)
                    and not base.trait("sees_step", base_params))  # fmt: skip
        return super().trait(name, params)

    # ---------------------------------------------------------------- client side
    def selects(self, name: str) -> bool:
        """Whether the parameter ``name`` is perturbed (or projected; all for update loss)."""
        return self.p.perturb == "all" or self.p.update == "loss" or name.startswith("head.") == (self.p.perturb == "head")

    def client_begin(self, ctx: ClientContext) -> None:
        model, sc = ctx.model, self.scratch(ctx)
        sc.buffers = list(model.buffers())  # BatchNorm statistics: restored after the second pass
        self.base.client_begin(ctx)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        head = self.p.perturb == "head"
        sel = [(n, p) for n, p in named if self.selects(n)]
        sc.all = [p for _, p in named]
        sc.sel = [p for _, p in sel]  # the perturbed (or projected) parameters
        sc.sel_global = [ctx.global_params[n] for n, _ in sel]
        sc.all_global = [ctx.global_params[n] for n, _ in named]
        sc.head_path = head and self.p.update == "perturb"
        if self.p.proximal == "kl":
            sc.glob = frozen_model(ctx, "fedsol_glob")  # frozen w_g for the KL proximal loss
            sc.glob.load_state_dict(ctx.global_params)
        sc.log = StepLog.new(ctx.max_steps, 1, self.info.device)  # the step diagnostics (a stack's: client_live_terms)

    def client_live_terms(self, ctxs: Sequence[ClientContext]) -> LiveTerms:
        """The step of a stack of clients (the forms ``trait`` stacks: base fedavg, proximal
        kl or l2): g_p from the step's own forward (kl: its logits against the frozen global
        model's, ``kl_direction``; l2: w - w_g); then, by ``update``: perturb, eps* by
        ``perturbation`` and the update gradient from the trainer's second pass at w + eps*;
        loss (Eq. 2), beta g_p added to the task loss's gradient (and beta L_p to the logged
        loss); project (Eq. 3), the conflicting component of the task gradient removed. Each
        client's diagnostics are logged per step as ``client_step`` logs them."""
        p, t = self.p, self.p.temperature
        glob = ctxs[0].global_params if ctxs else {}
        base_terms = self.base.client_step_terms(ctxs) if p.proximal == "base" and self.base.step_terms else None
        base_live = self.base.client_live_terms(ctxs) if p.proximal == "base" and self.base.live_terms else None
        stacked_glob: dict[str, torch.Tensor] = {}  # kl: w_g once per client of the stack, built at its first step
        # the stack's diagnostics, a column per client
        log = StepLog.new(max((c.max_steps for c in ctxs), default=1), len(ctxs), self.info.device)
        for j, c in enumerate(ctxs):
            self.scratch(c).log = log.client(j)

        def global_logits(lo: int, hi: int, w, step) -> torch.Tensor:
            """The frozen global model's logits on the step's rows, by the step's own kernels
            (``StepBatch.logits_of``; contiguous [G, ...] copies of w_g, as the stack's own
            weights are laid out): at w = w_g the step's logits bit for bit, so the KL
            gradient there is 0, as ``proximal_grad`` finds it on a client alone. With
            BatchNorm its running statistics come along (the frozen model in eval mode reads
            them; then the two differ at w = w_g, on a client alone too)."""
            if not stacked_glob:
                names = [*w, *(n for n in glob if n not in w and torch.is_floating_point(glob[n]))]
                stacked_glob.update({n: glob[n].unsqueeze(0).repeat(len(ctxs), *[1] * glob[n].dim()) for n in names})
            return step.logits_of({n: v[lo:hi] for n, v in stacked_glob.items()}, step.x)

        def live(lo: int, hi: int, w, step) -> LiveStep:
            sel = [n for n in w if self.selects(n)]
            if p.proximal == "base":  # combined mode: the gradient of the base's local term
                g_p, value = self._base_direction(lo, hi, w, step, sel, base_terms, base_live)
            elif p.proximal == "kl":
                with torch.no_grad():
                    z_g = global_logits(lo, hi, w, step)
                    dz, value = kl_direction(step.logits.detach(), z_g, t, step.row_mask())
                g = step.grad((step.logits * dz).sum(), {n: w[n] for n in sel})  # grad_outputs dz
                g_p = [g[n] for n in sel]
            else:
                with torch.no_grad():  # L_p = (1/2) ||w - w_g||^2 over every parameter, per client
                    d = [v - glob[n] for n, v in w.items()]
                    value = 0.5 * _client_dot(d, d)
                    g_p = [w[n].detach() - glob[n] for n in sel]
            g_norm = client_norms(g_p).double()
            if value is not None:
                self._record(ctxs[lo:hi], "prox_loss", value, log=log, lo=lo)

            def done(grads, adv) -> None:  # cos(g_u, g_p) over the selected parameters
                with torch.no_grad():
                    g_u = [grads[n] for n in sel]
                    dot, un = _client_dot(g_u, g_p), _client_dot(g_u, g_u)
                self._record(ctxs[lo:hi], "cos_update_prox", dot, un, g_norm, log=log, lo=lo)

            if p.update == "loss":  # Eq. 2: + beta g_p; the logged loss + beta L_p (no gradient)
                def plus(grads):
                    return {**grads, **dict(zip(sel, with_proximal([grads[n] for n in sel], g_p, p.beta)))}

                return LiveStep(loss=(value.double() * p.beta).float(), gmap=plus, done=done)
            if p.update == "project":  # Eq. 3, per client: g_l - <g_l, g_p>/||g_p||^2 g_p on conflict
                def project(grads):
                    g_u, rate = conflict_removed([grads[n] for n in sel], g_p, g_norm)
                    self._record(ctxs[lo:hi], "conflict_rate", rate, log=log, lo=lo)
                    return {**grads, **dict(zip(sel, g_u))}

                return LiveStep(gmap=project, done=done)
            eps = self.perturbation([w[n].detach() for n in sel], [glob[n] for n in sel], g_p, g_norm)
            sq = None if eps is None else _client_dot(eps, eps)
            zero = torch.zeros(hi - lo, dtype=torch.float64, device=g_norm.device)
            self._record(ctxs[lo:hi], "eps_norm", zero if sq is None else sq, log=log, lo=lo)
            return LiveStep(eps=None if eps is None else dict(zip(sel, eps)), done=done)

        return live

    def _base_direction(self, lo, hi, w, step, sel, base_terms, base_live) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """g_p of a stack in combined mode, as ``proximal_grad`` takes it for a client alone:
        the gradient of the base's local term at w (its step terms' loss, FedProx, FedDyn,
        or its live loss, MOON) plus the gradient additions of its step terms (SCAFFOLD's
        c - c_i), over the selected parameters; and the term's value per client (None:
        the base's term has none; NaN for a client the term does not apply to: no record)."""
        ext_loss, ext, has = None, None, None
        if base_terms is not None:
            ext_loss, ext, _ = base_terms(lo, hi, w)
        if base_live is not None:
            res = base_live(lo, hi, w, step)
            ext_loss, has = res.loss, res.has
        if ext_loss is not None and ext_loss.requires_grad:
            g = step.grad(ext_loss.sum(), {n: w[n] for n in sel})
            value = ext_loss.detach()
            if has is not None:
                value = torch.where(has, value, math.nan)
        else:
            g, value = {n: torch.zeros_like(w[n]) for n in sel}, None
        return [g[n] + ext[n] if ext and n in ext else g[n] for n in sel], value

    def _record(
        self, ctxs: Sequence[ClientContext], key: str, *values: float | torch.Tensor,
        log: StepLog | None = None, lo: int = 0,
    ) -> None:  # fmt: skip
        """One step's inputs of the diagnostic ``key`` for the clients ``ctxs`` into their sums
        (``StepLog``; ``client_end`` takes the means): a client alone's (0-dim tensors), or
        those of clients lo.. of a stack's ``log`` ([len(ctxs)] each)."""
        if log is None:
            (ctx,) = ctxs
            self.scratch(ctx).log.add(key, *values)
        else:
            log.add(key, *values, lo=lo, hi=lo + len(ctxs))

    def local_loss_from(self, ctx, x, y, features, logits) -> torch.Tensor:
        """L_local: CE, or the base method's loss terms (its CE first) if base_loss."""
        if self.p.base_loss:
            return total_loss(self.base.client_loss(ctx, x, y, features, logits))
        return task_cross_entropy(logits, y)

    # ---------------------------------------------------------------- proximal gradient g_p
    def proximal_grad(self, ctx, x, y, features, logits) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """(g_p over the selected parameters, L_p's value, a 0-dim tensor, or None); keeps the
        forward graph."""
        sc = self.scratch(ctx)
        params = sc.sel
        if self.p.proximal == "kl":
            t = self.p.temperature
            with torch.no_grad():
                dz, value = kl_direction(logits.detach().unsqueeze(0), sc.glob(x).unsqueeze(0), t)
                dz, value = dz[0], value[0]
            grads = torch.autograd.grad(logits, params, grad_outputs=dz, retain_graph=True, allow_unused=True)
            return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)], value
        if self.p.proximal == "l2":
            with torch.no_grad():
                d = [(w - wg).unsqueeze(0) for w, wg in zip(sc.all, sc.all_global)]
                value = 0.5 * _client_dot(d, d)[0]
                return [w.detach() - wg for w, wg in zip(params, sc.sel_global)], value
        # the base method's local term: grad of its loss terms beside the CE + what its
        # client_grad adds
        terms = self.base.client_loss(ctx, x, y, features, logits)
        del terms[TASK]
        extra = total_loss(terms) if terms else None
        value = None
        if extra is not None and extra.requires_grad:
            value = extra.detach()
            grads = torch.autograd.grad(extra, params, retain_graph=True, allow_unused=True)
            g_p = [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, grads)]
        else:
            g_p = [torch.zeros_like(p) for p in params]
        saved = [p.grad for p in sc.all]
        for p in sc.all:
            p.grad = torch.zeros_like(p)
        self.base.client_grad(ctx)  # additive corrections (SCAFFOLD: + c - c_i) on zero grads
        with torch.no_grad():
            g_p = [g + p.grad for g, p in zip(g_p, params)]
        for p, s in zip(sc.all, saved):
            p.grad = s
        return g_p, value

    # ---------------------------------------------------------------- Eq. 7-8
    @torch.no_grad()
    def lambdas(self, params: Sequence[torch.Tensor], global_params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Lambda of Eq. 7 per selected tensor of each client of a stack (``params`` [G, ...],
        ``global_params`` the broadcast ones, without G): |w - w_g| normalised per tensor
        (layer) or per dim-0 slice (column, the code's F.normalize(dim=0))."""
        out = []
        for w, wg in zip(params, global_params):
            d = (w - wg).abs()
            if self.p.lambda_norm == "column":
                out.append(F.normalize(d, p=2, dim=1, eps=NORM_GUARD))
            else:
                n = tensor_norms(d)
                out.append(torch.where(n > 0, d / n, 0.0))  # d = 0 where n = 0 (no host read)
        return out

    @torch.no_grad()
    def perturbation(
        self,
        params: Sequence[torch.Tensor],
        global_params: Sequence[torch.Tensor],
        g_p: Sequence[torch.Tensor],
        g_norm: torch.Tensor,
    ) -> list[torch.Tensor] | None:
        """eps* = rho * Lambda (.) g_p / ||g_p|| (Eq. 8; Lambda = 1 if not adaptive) for each
        client of a stack: the selected weights ``params`` and ``g_p`` [G, ...], ``g_norm``
        [G] (float64); None if rho = 0. [D] eps* = 0 where ||g_p|| < NORM_GUARD or Lambda
        = 0 (both at a client's first step, w = w_g), decided on the device without a host
        read: the second pass then runs at w itself and gives the first pass's gradient bit
        for bit (tested; with dropout it draws its own masks, as every second pass does)."""
        if self.p.rho == 0:
            return None
        # float64 rho / ||g_p||, as Python divided it (a scalar over a tensor would take the
        # reciprocal: another last bit); each client's, in float32 as it scales its tensors
        scale = torch.where(g_norm < NORM_GUARD, 0.0, torch.full_like(g_norm, self.p.rho) / g_norm).float()
        if self.p.adaptive:
            lam = self.lambdas(params, global_params)
            return [lm * g * per_client(scale, g, True) for lm, g in zip(lam, g_p)]
        return [g * per_client(scale, g, True) for g in g_p]

    # ---------------------------------------------------------------- one step
    def client_step(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model, sc = ctx.model, self.scratch(ctx)
        features, logits = model.forward_with_features(x)
        g_p, value = self.proximal_grad(ctx, x, y, features, logits)
        if value is not None:
            self._record([ctx], "prox_loss", value)
        # ||g_p||, float64 on the device (the exact value of the float32 norm): no host read
        g_norm = client_norms([g.unsqueeze(0) for g in g_p])[0].double()
        ce = task_cross_entropy(logits.detach(), y)

        if self.p.update == "loss":  # Eq. 2: L_local + beta * L_p (Table 1, "Base")
            loss = self.local_loss_from(ctx, x, y, features, logits)
            loss.backward()
            with torch.no_grad():
                grads = [p.grad for p in sc.sel]
                torch._foreach_copy_(grads, with_proximal(grads, g_p, self.p.beta))
            self._record_cos(ctx, g_p, g_norm)
            # + beta * L_p, rounded to float32 as a Python number added to a float32 tensor is
            return loss.detach() + (0.0 if value is None else (value.double() * self.p.beta).float())

        if self.p.update == "project":  # Eq. 3: remove the conflicting component
            self.local_loss_from(ctx, x, y, features, logits).backward()
            with torch.no_grad():
                grads = [p.grad for p in sc.sel]
                g_u, rate = conflict_removed([g[None] for g in grads], [g[None] for g in g_p], g_norm.view(1))
                torch._foreach_copy_(grads, [g[0] for g in g_u])
            self._record([ctx], "conflict_rate", rate[0])
            self._record_cos(ctx, g_p, g_norm)
            return ce

        eps = self.perturbation([p.unsqueeze(0) for p in sc.sel], sc.sel_global, [g.unsqueeze(0) for g in g_p], g_norm.view(1))
        if eps is None:  # rho = 0: grad CE(w) from the first pass
            self.local_loss_from(ctx, x, y, features, logits).backward()
            self._record([ctx], "eps_norm", torch.zeros((), device=g_norm.device))  # the squared norm
            self._record_cos(ctx, g_p, g_norm)
            return ce
        eps = [e[0] for e in eps]
        with torch.no_grad():
            w = [p.detach().clone() for p in sc.sel]
            torch._foreach_add_(sc.sel, eps)  # w + eps*
            self._record([ctx], "eps_norm", _client_dot([e[None] for e in eps], [e[None] for e in eps])[0])  # squared
        saved = None
        if sc.head_path:  # body unperturbed: reuse its output, recompute the head only
            loss_adv = self.local_loss_from(ctx, x, y, features, model.head(features))
        else:
            saved = [b.detach().clone() for b in sc.buffers]
            feats_adv, logits_adv = model.forward_with_features(x)
            loss_adv = self.local_loss_from(ctx, x, y, feats_adv, logits_adv)
        loss_adv.backward()  # .grad = grad L_local at w + eps* (Eq. 6)
        with torch.no_grad():
            torch._foreach_copy_(sc.sel, w)  # back to w, bit-exact
            if saved:  # running statistics as the first pass (at w) left them [C]
                torch._foreach_copy_(sc.buffers, saved)
        self._record_cos(ctx, g_p, g_norm)
        return ce

    def _record_cos(self, ctx: ClientContext, g_p: Sequence[torch.Tensor], g_norm: torch.Tensor) -> None:
        """cos(g_u, g_p) over the selected parameters (Fig. 2b), if g_p != 0."""
        sc = self.scratch(ctx)
        with torch.no_grad():
            g_u = [(torch.zeros_like(p) if p.grad is None else p.grad).unsqueeze(0) for p in sc.sel]
            g_p1 = [g.unsqueeze(0) for g in g_p]
            self._record([ctx], "cos_update_prox", _client_dot(g_u, g_p1)[0], _client_dot(g_u, g_u)[0], g_norm)

    def client_grad(self, ctx: ClientContext) -> None:
        if self.p.base_loss:
            self.base.client_grad(ctx)  # e.g. SCAFFOLD's + c - c_i

    def client_end(self, ctx: ClientContext) -> Upload:
        ctx.stats.update(self.scratch(ctx).log.means())
        return super().client_end(ctx)  # OverBase: the base's upload, its stats prefixed
