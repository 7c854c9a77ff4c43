"""FedSAM: every client trains locally with Sharpness-Aware Minimization (SAM) on its own
cross-entropy; the server is FedAvg.

Papers: Qu, Li, Duan, Liu, Tang, Lu, "Generalized Federated Learning via Sharpness Aware
Minimization", ICML 2022; Caldarola, Caputo, Ciccone, "Improving Generalization in
Federated Learning by Seeking Flat Minima", ECCV 2022. The optimizer is SAM (Foret,
Kleiner, Mobahi, Neyshabur, "Sharpness-Aware Minimization for Efficiently Improving
Generalization", ICLR 2021).

SAM solves min_w max_{||eps||_2 <= rho} L(w + eps) with one re-scaled gradient step for the
inner maximisation (p = 2 in Foret et al., Sec. 2), then takes the base-optimizer step with
the gradient at the perturbed point, dropping the second-order term (Foret et al., Sec. 2).
One minibatch step of client k:

    g       = grad_w L_k(w)                                   (first forward/backward pass)
    eps*(w) = rho * g / ||g||_2                                (``perturbation``)
    w.grad <- grad_w L_k(w) |_{w + eps*(w)}                    (second pass, at w + eps*)
    w      <- optimizer step from w (not from w + eps*), with w.grad

``||g||_2`` is the norm over all trainable parameters jointly (one global norm, as in SAM
and both FedSAM codes). L_k is the minibatch loss (``batch_loss``: the sum of ``client_loss``'s
terms, FedSAM's own being the CE alone), in both passes.

Decisions
- Guard: eps = rho * g / max(||g||, 1e-12), so g = 0 gives eps = 0 and otherwise ||eps|| =
  rho up to float rounding. The public codes add 1e-12 (davda54/sam, whose SAM(rho,
  adaptive) interface FedSOL's code uses) or 1e-16 (SamsungLabs/ASAM, copied by Caldarola et
  al.) to the norm instead; no difference in float32 for any norm above ~2e-5.
- w is restored by copying back a saved copy of the weights (bit-exact), not by w + eps -
  eps, which is what the public codes do and is not exact in floating point.
- Buffers (BatchNorm running statistics) are restored after the second pass, so they are
  updated once per step, at w, as with FedSOL's code (which disables running-stat updates
  in the second pass); the stacked trainer's second pass updates copies of them.
- The returned loss (the engine's training-loss metric) is L_k(w), the unperturbed loss, as
  in both public codes.
- Diagnostic ``sharpness``: per client, the mean over its steps of L_k(w + eps*) - L_k(w)
  (SAM's sharpness term at the first-order maximiser); the metrics column is
  ``fedsam_sharpness`` (``fedasam_sharpness`` for FedASAM).
- Both trainers: the sequential trainer runs ``client_step``; the stacked trainer runs the
  same perturbation (``perturbation``, written once for a stack of clients: one norm per
  client) through ``client_live_terms``, its second pass in the batched forward (issue 32).
- Default rho = 0.5 (METHODS.md; FedSOL's fedsam config; Caldarola et al.'s released
  scripts). That is 10x the radius SAM itself is usually run with on CIFAR-10 (0.05), so a
  sweep should include 0.05.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .base import ClientContext, FedAvg, LiveStep, LiveTerms, Upload
from .params import number
from .registry import METHODS
from .shared import NORM_GUARD, client_norms, per_client


@dataclass(frozen=True)
class FedSAMParams:
    rho: float = number(0.5, minimum=0)  # SAM neighbourhood radius; 0 = FedAvg (two passes, same gradient)


@METHODS.register("fedsam")
class FedSAM(FedAvg):
    """FedAvg with SAM local steps: eps* = rho * g / ||g||, step with grad L_k(w + eps*)."""

    name = "fedsam"
    own_upload = True
    live_terms = True  # its second pass at w + eps (client_live_terms)
    Params = FedSAMParams

    @torch.no_grad()
    def perturbation(
        self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """eps* = rho * g / ||g||_2 for each client of a stack (``params`` and ``grads``
        [G, ...]; one norm per client over all its parameters). FedASAM overrides this."""
        scale = self.p.rho / client_norms(grads).clamp_min(NORM_GUARD)
        return [g * per_client(scale, g, True) for g in grads]

    def client_begin(self, ctx: ClientContext) -> None:
        self.scratch(ctx).gap = torch.zeros((), device=self.info.device)  # sum over steps of L(w + eps) - L(w)

    def client_live_terms(self, ctxs: Sequence[ClientContext]) -> LiveTerms:
        """The step of a stack of clients: g = grad L_k(w) from the step's own forward,
        eps* per client, the update gradient from the trainer's second pass at w + eps*;
        each client's gap L_k(w + eps*) - L_k(w) summed in its slot of one tensor."""
        gaps = torch.zeros(len(ctxs), device=self.info.device)
        for i, c in enumerate(ctxs):
            self.scratch(c).gap = gaps[i]  # a view: the stack's sums land in it

        def live(lo: int, hi: int, w, step) -> LiveStep:
            g = step.grad(step.loss.sum(), w)
            eps = self.perturbation([v.detach() for v in w.values()], list(g.values()))

            def done(grads, adv: torch.Tensor) -> None:
                gaps[lo:hi] += adv - step.loss.detach()

            return LiveStep(eps=dict(zip(w, eps)), done=done)

        return live

    def client_step(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model = ctx.model
        loss = self.batch_loss(ctx, x, y)
        loss.backward()  # g = grad L_k(w)
        params = [p for p in model.parameters() if p.grad is not None]
        buffers = list(model.buffers())
        with torch.no_grad():
            eps = [e[0] for e in self.perturbation([p[None] for p in params], [p.grad[None] for p in params])]
            w = [p.detach().clone() for p in params]
            saved_buffers = [b.detach().clone() for b in buffers]
            torch._foreach_add_(params, eps)  # w + eps*
        for p in params:
            p.grad = None
        loss_adv = self.batch_loss(ctx, x, y)
        loss_adv.backward()  # .grad = grad L_k at w + eps*: what the optimizer steps with
        with torch.no_grad():
            torch._foreach_copy_(params, w)  # back to w, bit-exact
            if buffers:
                torch._foreach_copy_(buffers, saved_buffers)
            self.scratch(ctx).gap += loss_adv.detach() - loss.detach()
        return loss.detach()

    def client_end(self, ctx: ClientContext) -> Upload:
        ctx.stats["sharpness"] = self.scratch(ctx).gap.item() / max(ctx.steps, 1)
        return super().client_end(ctx)
