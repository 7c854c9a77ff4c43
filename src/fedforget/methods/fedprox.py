"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith: "Federated Optimization in
Heterogeneous Networks", MLSys 2020).

Client k minimises its local loss plus a proximal term that keeps it near the broadcast
global weights w^t (the paper's local objective h_k):

    h_k(w; w^t) = F_k(w) + (mu/2) ||w - w^t||^2

summed over the trainable parameters (``client_step_terms``, the term's one definition for
a client alone and for clients trained together), so each step's gradient is
grad F_k(w) + mu (w - w^t). Everything else is FedAvg: local SGD from w^t, server average
weighted by n_k (as the FedSOL code and the FedDyn authors' FedProx baseline do; the paper's
Algorithm 2 samples clients with probability p_k and averages uniformly, which has the same
expectation).
The paper's "inexact solvers" / variable local work is not simulated: every client runs the
configured local epochs (FedProx with fixed work, as in the FedSOL and FedProj comparisons).

Hyperparameter: mu = 1.0, the FedSOL code's value (configs/baselines/fedprox.json); the
METHODS.md grid is {0.001, 0.01, 0.1, 1}. mu = 0 is FedAvg exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .base import ClientContext, FedAvg, StepTerms, Upload, client_sums
from .params import number
from .registry import METHODS


@METHODS.register("fedprox")
class FedProx(FedAvg):
    name = "fedprox"
    step_terms = True
    own_upload = True

    @dataclass(frozen=True)
    class Params:
        mu: float = number(1.0, minimum=0)  # proximal weight; FedSOL code 1.0, grid {0.001, 0.01, 0.1, 1}

    def client_begin(self, ctx: ClientContext) -> None:
        # (w, w^t) pairs of this client's trainable parameters, for the distance diagnostic
        self.scratch(ctx).anchor = [
            (p, ctx.global_params[n]) for n, p in ctx.model.named_parameters() if p.requires_grad
        ]

    def client_step_terms(self, ctxs: Sequence[ClientContext]) -> StepTerms:
        """The proximal term, per client of the stack: (mu/2) ||w - w^t||^2 (its gradient
        mu (w - w^t) by autograd, on a client alone or the stack)."""
        mu, wg = self.p.mu, ctxs[0].global_params  # one broadcast for every client

        def terms(lo: int, hi: int, w: dict[str, torch.Tensor]):
            sq = torch.stack([client_sums((v - wg[n]).pow(2)) for n, v in w.items()]).sum(0)
            return 0.5 * mu * sq, None, None

        return terms

    def client_end(self, ctx: ClientContext) -> Upload:
        up = super().client_end(ctx)
        with torch.no_grad():
            sq = sum((w - wg).pow(2).sum() for w, wg in self.scratch(ctx).anchor)
        ctx.stats["dist_to_global"] = float(sq) ** 0.5  # ||w_k - w^t|| after local training
        return up
