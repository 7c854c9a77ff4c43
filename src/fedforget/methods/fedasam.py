"""FedASAM: every client trains locally with Adaptive SAM (ASAM) on its own cross-entropy;
the server is FedAvg.

Papers: Caldarola, Caputo, Ciccone, "Improving Generalization in Federated Learning by
Seeking Flat Minima", ECCV 2022 (FedASAM); the optimizer is ASAM (Kwon, Kim, Park, Choi,
"ASAM: Adaptive Sharpness-Aware Minimization for Scale-Invariant Learning of Deep Neural
Networks", ICML 2021).

ASAM replaces SAM's ball ||eps||_2 <= rho by ||T_w^{-1} eps||_2 <= rho, with the
element-wise normalisation operator T_w = |w| + eta (Kwon et al.; eta > 0 keeps T_w
invertible where a weight is 0); the first-order maximiser is then

    eps*(w) = rho * T_w^2 (.) g / ||T_w (.) g||_2,      g = grad_w L_k(w),

which for eta = 0 is METHODS.md's  eps = rho * w^2 (.) g / || |w| (.) g ||. Everything else
(second pass at w + eps*, bit-exact restore of w, unperturbed loss returned, ``sharpness``
diagnostic) is FedSAM's; see ``fedsam.py``. Only ``perturbation`` differs.

Decisions (where the paper, the public codes and METHODS.md differ)
- eta defaults to 0, i.e. T_w = |w| exactly as METHODS.md writes it. That is also what the
  seed paper's baseline runs (FedSOL code: SAM with adaptive=True in davda54/sam's form,
  eps = rho * w^2 g / (|| |w| g || + 1e-12), no eta) and what Caldarola et al.'s experiment
  scripts pass (``-eta 0``). The ASAM code's own default is eta = 0.01 (SamsungLabs/ASAM);
  set ``eta: 0.01`` for it. With eta = 0 a weight that is exactly 0 is never perturbed.
- T_w applies to every trainable parameter, biases included (METHODS.md's formula; FedSOL's
  code). The SamsungLabs/ASAM code (and Caldarola et al.'s copy of it) scales only tensors
  whose name contains "weight" (T_w = 1 for biases); not replicated.
- Default rho = 0.5 (METHODS.md, FedSOL's fedasam config). ASAM's radius is relative to the
  weights' scale, so ASAM is usually run with a larger rho than SAM (the ASAM code's
  examples: rho 0.5 on CIFAR-10 and 1.0 on CIFAR-100, against SAM's 0.05 and 0.1); a sweep
  on a new dataset should include rho >= 1.
- Norm guard as FedSAM: divide by max(||T_w g||, 1e-12) (the codes add 1e-12 or 1e-16).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .fedsam import FedSAM, FedSAMParams
from .params import number
from .registry import METHODS
from .shared import NORM_GUARD, client_norms, per_client


@dataclass(frozen=True)
class FedASAMParams(FedSAMParams):
    eta: float = number(0.0, minimum=0)  # T_w = |w| + eta; ASAM's code uses 0.01, the FL baselines 0


@METHODS.register("fedasam")
class FedASAM(FedSAM):
    """FedSAM with ASAM's perturbation eps* = rho * T_w^2 g / ||T_w g||, T_w = |w| + eta."""

    name = "fedasam"
    Params = FedASAMParams

    @torch.no_grad()
    def perturbation(
        self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        t_w = torch._foreach_abs(list(params))
        if self.p.eta:
            torch._foreach_add_(t_w, self.p.eta)
        t_g = torch._foreach_mul(t_w, list(grads))  # T_w (.) g
        scale = self.p.rho / client_norms(t_g).clamp_min(NORM_GUARD)  # one per client of the stack
        return [t * tg * per_client(scale, tg, True) for t, tg in zip(t_w, t_g)]  # rho * T_w^2 (.) g / ||T_w g||
