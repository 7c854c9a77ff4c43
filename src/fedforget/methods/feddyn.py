"""FedDyn (Acar, Zhao, Matas Navarro, Mattina, Whatmough, Saligrama: "Federated Learning Based
on Dynamic Regularization", ICLR 2021), Algorithm 1.

Client k in the sampled set P_t starts from the broadcast server model theta^{t-1} and
minimises the dynamically regularised loss (``client_step_terms`` adds the last two terms)

    L_k(theta) - <grad L_k(theta_k^{t-1}), theta> + (alpha/2) ||theta - theta^{t-1}||^2

over the trainable parameters. Its linear-term state grad L_k(theta_k^{t-1}) ("grad" in
ctx.state, a flat tensor, zero before the client's first round) is then updated with the
first-order condition of that problem (``client_end``):

    grad L_k(theta_k^t) = grad L_k(theta_k^{t-1}) - alpha (theta_k^t - theta^{t-1})

The server keeps h (server.state["h"], zero at the start; ``server_aggregate``):

    h^t     = h^{t-1} - alpha (1/m) sum_{k in P_t} (theta_k^t - theta^{t-1})   # m = all clients
    theta^t = (1/|P_t|) sum_{k in P_t} theta_k^t - (1/alpha) h^t

so h^t = (1/m) sum_k grad L_k(theta_k^t) at every round (a test checks this).

Decisions where paper and public code differ:
- The mean over P_t is uniform, as in the paper and the authors' code. The FedSOL code
  (algorithms/feddyn/Server.py) weights it by n_k instead: ``weighting: samples``.
- The authors' code scales alpha per client by mean(n)/n_k and clips gradient norms at 10;
  the paper and the FedSOL code do neither, and neither is done here.
- Floating buffers (BatchNorm statistics, if any) are averaged with the same weights and get
  no h correction; h and the client state cover trainable parameters only.
Hyperparameter: alpha = 0.1 (FedSOL code, configs/baselines/feddyn.json).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .base import (
    ClientContext,
    FedAvg,
    ServerContext,
    StepTerms,
    Upload,
    client_sums,
    split_stacked,
    upload_weights,
    weighted_average,
)
from .params import choice, number
from .registry import METHODS
from .shared import WEIGHTINGS, own_weighting, refuse_held, refuse_task_heads

if TYPE_CHECKING:  # pragma: no cover
    from ..train_spec import TrainSpec


@METHODS.register("feddyn")
class FedDyn(FedAvg):
    name = "feddyn"
    step_terms = True
    own_upload = True
    client_model_copies = 1  # h_i

    @dataclass(frozen=True)
    class Params:
        alpha: float = number(0.1, exclusiveMinimum=0)  # dynamic regulariser weight (FedSOL code: 0.1)
        weighting: str = choice("uniform", WEIGHTINGS)  # mean over sampled clients: paper "uniform", FedSOL "samples"

    @classmethod
    def check_train(cls, train: TrainSpec, params: Any = None) -> None:
        own_weighting(cls.name, train)

    @classmethod
    def check_model(cls, model: str, params: Any = None, options: dict[str, Any] | None = None) -> None:
        refuse_held(cls.name, options, "each client's gradient state is one vector over its trained parameters, which change at the second task")

    @classmethod
    def check_scenario(cls, scenario: dict[str, Any] | None, params: Any = None) -> None:
        refuse_task_heads(cls.name, scenario, "each client's gradient state is one vector over its trained "
                          "parameters, which change at every task: a new head would read the last one's")

    # ---------------------------------------------------------------- server side
    def server_init(self, server: ServerContext) -> None:
        names = [n for n, p in server.model.named_parameters() if p.requires_grad]
        server.state["h"] = {n: torch.zeros_like(server.global_params[n]) for n in names}

    def server_aggregate(self, server: ServerContext, uploads: Sequence[Upload]) -> None:
        weights = upload_weights(uploads, self.p.weighting)
        new = weighted_average([u.params for u in uploads], weights)
        alpha, m = self.p.alpha, self.info.num_clients
        prev = server.global_params  # theta^{t-1}, until written below
        for name, h in server.state["h"].items():
            moved = torch.zeros_like(h)
            for u in uploads:
                moved.add_(u.params[name] - prev[name])
            h.sub_(moved, alpha=alpha / m)  # h^t = h^{t-1} - alpha/m sum (theta_k^t - theta^{t-1})
            new[name] = new[name] - h / alpha  # theta^t = mean theta_k^t - h^t / alpha
        server.global_params = new

    def server_metrics(self, server: ServerContext, uploads: Sequence[Upload]) -> dict[str, float]:
        h = server.state["h"].values()
        return {"h_norm": float(torch.stack([t.pow(2).sum() for t in h]).sum().sqrt())}

    # ---------------------------------------------------------------- client side
    def client_begin(self, ctx: ClientContext) -> None:
        params = [(n, p) for n, p in ctx.model.named_parameters() if p.requires_grad]
        if "grad" not in ctx.state:  # grad L_k(theta_k^0) = 0
            ctx.state["grad"] = torch.zeros(
                sum(p.numel() for _, p in params), device=params[0][1].device
            )
        views = ctx.state["grad"].split([p.numel() for _, p in params])
        # (theta, theta^{t-1}, grad L_k(theta_k^{t-1})) per parameter, for this client only
        self.scratch(ctx).terms = [(p, ctx.global_params[n], g.view_as(p)) for (n, p), g in zip(params, views)]

    def client_step_terms(self, ctxs: Sequence[ClientContext]) -> StepTerms:
        """The dynamic regulariser, per client of the stack: (alpha/2) ||theta -
        theta^{t-1}||^2 - <grad L_k(theta_k^{t-1}), theta> (its gradient alpha (theta -
        theta^{t-1}) - grad L_k(theta_k^{t-1}) by autograd, on a client alone or the stack)."""
        alpha, wg = self.p.alpha, ctxs[0].global_params
        g = split_stacked([ctx.state["grad"] for ctx in ctxs], ctxs[0].model)

        def terms(lo: int, hi: int, w: dict[str, torch.Tensor]):
            sq = torch.stack([client_sums((w[n] - wg[n]).pow(2)) for n in g]).sum(0)
            lin = torch.stack([client_sums(g[n][lo:hi] * w[n]) for n in g]).sum(0)
            return 0.5 * alpha * sq - lin, None, None

        return terms

    def client_end(self, ctx: ClientContext) -> Upload:
        up = super().client_end(ctx)
        with torch.no_grad():
            for w, wg, g in self.scratch(ctx).terms:  # in place on the flat ctx.state["grad"]
                g.sub_(w - wg, alpha=self.p.alpha)
        return up
