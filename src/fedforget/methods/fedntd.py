"""FedNTD: federated not-true distillation.

Paper: Gihun Lee, Minchan Jeong, Yongjin Shin, Sangmin Bae, Se-Young Yun, "Preservation of
the Global Knowledge by Not-True Distillation in Federated Learning", NeurIPS 2022 (arXiv 2106.03097).

Client k distils the global model of this round (frozen at the start of local training)
into its local model on the NOT-TRUE classes only. With z^l, z^g the local and global
logits of a sample with label y over C classes, for every class c != y:

    q~_tau(c) = exp(z_c / tau) / sum_{c' != y} exp(z_c' / tau)       (softmax without class y)
    L_NTD     = sum_{c != y} q~^g_tau(c) * log( q~^g_tau(c) / q~^l_tau(c) ) = KL(q~^g || q~^l)
    L         = L_CE(q^l, y) + beta * tau^2 * L_NTD

L_NTD is averaged over the minibatch (``ntd_loss``); the global logits carry no gradient.
The server is FedAvg.

Decisions
- The tau^2 factor: METHODS.md's form and one version of the official code
  (Lee-Gihun/FedNTD, algorithms/fedntd/criterion.py, commit 57789c8:
  ``(self.tau ** 2) * self.KLDiv(...)``); another stored version of that file (043269e) has no
  tau^2. With the default tau = 1 the two agree.
- Defaults tau = 1, beta = 1: the official config (config/fedntd.json) and METHODS.md.
- The true class is removed by a gather of the C - 1 other columns (the official code's
  ``refine_as_not_true``), for local and global logits alike; with C = 2 one class is left,
  q~ = 1 and L_NTD = 0.
- The frozen global model is in eval mode [C]: the official code deep-copies its one shared
  client model (``_keep_global``), which the previous client's ``_get_local_stats``
  (``evaluate_model``) left in eval mode, so its copy is in eval mode for every client but
  the run's very first (in train mode there). With BatchNorm (the ResNets) it normalises by the
  global running statistics; the models without BatchNorm or dropout give the same logits
  either way, and so do the ResNets with ``norm: batch_stateless`` (no running statistics:
  the batch's in both modes, the code's ResNets).
- beta = 0 is FedAvg exactly: no global copy is made and no extra loss is returned.
- Both trainers [D, issue 32]: the distillation is a loss of the step's own logits, stated
  once for a stack of clients (``ntd_loss``; a client alone is a stack of one): the
  sequential trainer adds it in ``client_loss``, the stacked trainer in the batched forward
  (``client_live_terms``), each client's the mean over its real rows.
- Diagnostic ``l_ntd``: per client, the mean of tau^2 * L_NTD over its steps; metrics
  column ``fedntd_l_ntd``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import ClientContext, FedAvg, LiveStep, LiveTerms, Upload, frozen_model
from .params import number
from .registry import METHODS
from .shared import StepSums, on_stack, rows_mean


def not_true_logits(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[..., C] -> [..., C-1]: each row without its true-class column ``y`` [...], other
    columns in order."""
    c = logits.shape[-1]
    cols = torch.arange(c - 1, device=logits.device).expand(*y.shape, c - 1)
    cols = cols + (cols >= y.unsqueeze(-1)).long()  # skip column y
    return logits.gather(-1, cols)


def ntd_loss(
    local_logits: torch.Tensor, global_logits: torch.Tensor, y: torch.Tensor, tau: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """tau^2 * KL(q~^g_tau || q~^l_tau) of each client of a stack [G], the mean over its
    rows: logits [G, B, C], ``y`` [G, B]; ``mask`` [G, B] its real rows (None: every row,
    the batch mean as one client's step always took it). No gradient into the global logits."""
    log_q_local = F.log_softmax(not_true_logits(local_logits, y) / tau, dim=-1)
    q_global = F.softmax(not_true_logits(global_logits.detach(), y) / tau, dim=-1)
    if mask is None:
        return tau**2 * torch.stack([F.kl_div(lq, qg, reduction="batchmean") for lq, qg in zip(log_q_local, q_global)])
    per_row = F.kl_div(log_q_local, q_global, reduction="none").sum(-1)
    return tau**2 * rows_mean(per_row, mask)


@dataclass(frozen=True)
class FedNTDParams:
    beta: float = number(1.0, minimum=0)  # weight of the not-true distillation; 0 = FedAvg
    tau: float = number(1.0, exclusiveMinimum=0)  # softmax temperature


@METHODS.register("fedntd")
class FedNTD(FedAvg):
    """FedAvg whose local loss adds beta * tau^2 * KL over the not-true classes to the global model."""

    name = "fedntd"
    own_upload = True
    live_terms = True  # the distillation of the step's logits (client_live_terms)
    Params = FedNTDParams

    def client_begin(self, ctx: ClientContext) -> None:
        if self.p.beta == 0:
            return
        s = self.scratch(ctx)
        s.glob = frozen_model(ctx, "fedntd_glob")  # frozen w^t, reused across clients
        s.glob.load_state_dict(ctx.global_params)
        s.sums = StepSums.own(2, self.info.device)  # sum of L_NTD, steps

    def client_loss(self, ctx, x, y, features, logits) -> dict[str, torch.Tensor]:
        terms = super().client_loss(ctx, x, y, features, logits)
        if self.p.beta == 0:
            return terms
        with torch.no_grad():
            global_logits = self.scratch(ctx).glob(x)
        l_ntd = ntd_loss(logits.unsqueeze(0), global_logits.unsqueeze(0), y.unsqueeze(0), self.p.tau)[0]
        self.scratch(ctx).sums.add(l_ntd.detach(), 1)
        terms["ntd"] = self.p.beta * l_ntd
        return terms

    def client_live_terms(self, ctxs: Sequence[ClientContext]) -> LiveTerms | None:
        """beta * L_NTD of each client of a stack on the step's own logits, against the
        frozen global model's (one forward over the stack's rows); summed per client in
        one tensor for ``l_ntd``."""
        if self.p.beta == 0:
            return None
        sums = StepSums.shared([self.scratch(c) for c in ctxs], 2, self.info.device)
        glob = self.scratch(ctxs[0]).glob  # one frozen global model for the stack (client_begin)

        def live(lo: int, hi: int, w, step) -> LiveStep:
            l_ntd = ntd_loss(step.logits, on_stack(glob, step.x), step.y, self.p.tau, step.row_mask())
            sums[0, lo:hi] += l_ntd.detach()
            sums[1, lo:hi] += 1
            return LiveStep(loss=self.p.beta * l_ntd)

        return live

    def client_end(self, ctx: ClientContext) -> Upload:
        if self.p.beta > 0:
            total, steps = self.scratch(ctx).sums.values()
            ctx.stats["l_ntd"] = total / max(steps, 1)
        return super().client_end(ctx)
