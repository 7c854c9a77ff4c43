"""FedAvgM (Hsu, Qi, Brown: "Measuring the Effects of Non-Identical Data Distribution for
Federated Visual Classification", 2019): FedAvg with momentum on the server.

Clients train exactly as in FedAvg. The server treats the change the clients' average would
make as a pseudo-gradient and takes a momentum step along it [P Sec. 3]:

    Delta_t = w_t - sum_k p_k w_k^(t+1),   p_k = n_k / sum_{j in S} n_j
    v_t     = beta v_(t-1) + Delta_t,       v_0 = 0
    w_(t+1) = w_t - eta_s v_t

``server_momentum`` is beta (the paper's experiments: 0.9 among others), ``server_lr`` is
eta_s (the paper: 1; Flower's FedAvgM also takes one). beta = 0 and eta_s = 1 give FedAvg's
average (up to rounding). Decisions [D]: the momentum step applies to trainable parameters;
floating buffers (BatchNorm running statistics) take FedAvg's n_k-weighted average, as in
FedNova here, since they are not the sum of gradient steps. The velocity lives in the
server state (checkpointed with the run).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .base import FedAvg, ServerContext, Upload, upload_weights, weighted_average
from .params import number
from .registry import METHODS

VELOCITY = "fedavgm_velocity"  # server.state: {parameter: v}


@dataclass(frozen=True)
class FedAvgMParams:
    server_momentum: float = number(0.9, minimum=0, exclusiveMaximum=1)  # beta [P]
    server_lr: float = number(1.0, exclusiveMinimum=0)  # eta_s [P]


@METHODS.register("fedavgm")
class FedAvgM(FedAvg):
    name = "fedavgm"
    Params = FedAvgMParams

    def server_aggregate(self, server: ServerContext, uploads: Sequence[Upload]) -> None:
        """FedAvg's average, then w_t - eta_s v_t for the trainable parameters."""
        avg = weighted_average([u.params for u in uploads], upload_weights(uploads, self.info.train.client_weights))
        velocity = server.state.setdefault(VELOCITY, {})
        w = server.global_params
        for name, param in server.model.named_parameters():
            if not param.requires_grad:
                continue
            delta = w[name] - avg[name]
            v = velocity.get(name)
            v = delta if v is None else self.p.server_momentum * v + delta
            velocity[name] = v
            avg[name] = w[name] - self.p.server_lr * v
        server.global_params = avg

    def server_metrics(self, server: ServerContext, uploads: Sequence[Upload]) -> dict[str, float]:
        """||v_t||, the norm of the server's velocity over the trainable parameters."""
        v = server.state.get(VELOCITY) or {}
        norm = torch.sqrt(sum((t.double() ** 2).sum() for t in v.values())) if v else torch.zeros(())
        return {"velocity_norm": float(norm)}
