"""FedNova (Wang, Liu, Liang, Joshi, Poor: "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization", NeurIPS 2020).

Clients train exactly as in FedAvg. Client i's cumulative update is normalised by its
effective number of local steps ||a_i||_1 (written a_i below), the server rescales by tau_eff:

    d_i     = (w_g - w_i) / a_i                     # normalised update (eta G_i a_i / ||a_i||_1)
    tau_eff = sum_i p_i a_i,   p_i = n_i / sum_{j in S} n_j
    w_g    <- w_g - tau_eff * sum_i p_i d_i

For SGD with heavy-ball momentum rho (torch's SGD: buf <- rho buf + g, w <- w - eta buf) and
tau_i local steps, a_i = [1 - rho^tau, 1 - rho^(tau-1), ..., 1 - rho] / (1 - rho), so

    ||a_i||_1 = (tau_i - rho (1 - rho^tau_i) / (1 - rho)) / (1 - rho),   = tau_i for rho = 0

(``shared.effective_steps``). tau_i is the number of steps the client actually took (ctx.steps);
rho is read from the client's optimizer. Weight decay is part of the gradient and does not
change a_i. With equal a_i for every client the update is (in exact arithmetic) FedAvg's
sum_i p_i w_i.

Decisions: the normalisation applies to trainable parameters; floating buffers (BatchNorm
running statistics, if a model has them) take FedAvg's n_i-weighted average, since they are
not the sum of local gradient steps. Only SGD is supported (a_i is derived for it). The
FedNova code's optional server-side momentum is not implemented; the FedSOL code has none.
The FedSOL code (algorithms/fednova) computes the same a_i, p_i and tau_eff.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from .base import (
    ClientContext,
    FedAvg,
    NoParams,
    ServerContext,
    Upload,
    upload_weights,
    weighted_average,
)
from .registry import METHODS
from .shared import effective_steps, require_sgd

if TYPE_CHECKING:  # pragma: no cover
    from ..train_spec import TrainSpec


@METHODS.register("fednova")
class FedNova(FedAvg):
    name = "fednova"
    own_upload = True
    Params = NoParams

    @classmethod
    def check_train(cls, train: TrainSpec, params: Any = None) -> None:
        require_sgd(cls.name, train, "a_i is derived for SGD with momentum")

    def client_end(self, ctx: ClientContext) -> Upload:
        up = super().client_end(ctx)
        rho = ctx.optimizer.param_groups[0].get("momentum", 0.0)
        up.extras["a"] = effective_steps(ctx.steps, rho)
        return up

    def server_aggregate(self, server: ServerContext, uploads: Sequence[Upload]) -> None:
        weights = upload_weights(uploads, self.info.train.client_weights)  # p_i: n_i / n [P]; equal with client_weights: uniform
        new = weighted_average([u.params for u in uploads], weights)
        total = float(sum(weights))
        p = [w / total for w in weights]
        a = [float(u.extras["a"]) for u in uploads]
        tau_eff = sum(pi * ai for pi, ai in zip(p, a))
        w_g = server.global_params
        for name, param in server.model.named_parameters():
            if not param.requires_grad:
                continue
            # sum_i p_i d_i with d_i = (w_g - w_i) / a_i (a client with a_i = 0 did not move)
            acc = torch.zeros_like(w_g[name])
            for u, pi, ai in zip(uploads, p, a):
                if ai > 0:
                    acc.add_(w_g[name] - u.params[name], alpha=pi / ai)
            new[name] = w_g[name] - tau_eff * acc
        server.state["tau_eff"] = tau_eff
        server.global_params = new

    def server_metrics(self, server: ServerContext, uploads: Sequence[Upload]) -> dict[str, float]:
        return {"tau_eff": float(server.state["tau_eff"])}
