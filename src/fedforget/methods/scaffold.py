"""SCAFFOLD, option II (Karimireddy, Kale, Mohri, Reddi, Stich, Suresh: "SCAFFOLD: Stochastic
Controlled Averaging for Federated Learning", ICML 2020), Algorithm 1.

Server control variate c and client control variates c_i are flat tensors over the trainable
parameters, all initialised to ZERO (server.state["c"], ctx.state["c"]). x is the broadcast
global model, y_i the client's local model:

    local step:  y_i <- y_i - eta_l (g_i(y_i) - c_i + c)              # ``client_step_terms``
    option II:   c_i^+ = c_i - c + (x - y_i) / (K eta_l)              # ``client_end``
    upload:      (Delta y_i, Delta c_i) = (y_i - x, c_i^+ - c_i);  c_i <- c_i^+
    server:      x <- x + eta_g (1/|S|) sum_{i in S} Delta y_i        # ``server_aggregate``
                 c <- c + (|S|/N) (1/|S|) sum_{i in S} Delta c_i      # ``server_aggregate``

K is the number of local steps the client actually took (ctx.steps), eta_l this round's
local lr (ctx.lr), N the number of clients (RunInfo.num_clients), eta_g = ``server_lr``.
c is sent to the clients through ``server_broadcast``.

Decisions [D] (METHODS.md states option II with K eta_l; its rule puts the paper's form in the
default, and the momentum item below is where this default departs from it):
- Aggregation is the paper's uniform mean over S (FedAvg weights by n_k); with eta_g = 1 and
  equal n_k both agree. The FedSOL code (algorithms/scaffold) weights by n_k:
  ``weighting: samples`` gives x <- x + eta_g sum_i (n_i / sum_S n) Delta y_i.
- Momentum: option II assumes plain SGD, where x - y_i = eta_l sum_k (g_k - c_i + c). With
  heavy-ball momentum rho the same gradients move the weights about 1/(1 - rho) times
  further, so (x - y_i)/(K eta_l) over-estimates the corrected mean gradient by up to that
  factor. [D] ``divisor: effective_steps`` (default) divides by a_i eta_l, a_i the
  momentum-corrected step count of FedNova: exactly the paper's K eta_l for rho = 0, and the
  correct denominator under momentum (the FedSOL code's "adaptive_divison", on in its
  SCAFFOLD config, configs/baselines/scaffold.json, momentum 0.9). ``divisor: steps`` keeps
  K eta_l whatever the momentum; with lr 0.05 and momentum 0.9 it diverged on every seed of
  the Dirichlet digits runs of config/experiments/baselines_embedded.yaml.
- Weight decay is applied by the optimizer after the correction (it is part of g_i), as in
  the public implementations. Floating buffers are averaged, without eta_g. SGD only.
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
    split_stacked,
    upload_weights,
    weighted_average,
)
from .base import Params as StateDict
from .params import choice, number
from .registry import METHODS
from .shared import (
    WEIGHTINGS,
    effective_steps,
    own_weighting,
    refuse_held,
    refuse_task_heads,
    require_sgd,
)

if TYPE_CHECKING:  # pragma: no cover
    from ..train_spec import TrainSpec

DIVISORS = ("steps", "effective_steps")


def _flat(params: StateDict, names: Sequence[str]) -> torch.Tensor:
    return torch.cat([params[n].reshape(-1) for n in names])


@METHODS.register("scaffold")
class Scaffold(FedAvg):
    name = "scaffold"
    step_terms = True
    own_upload = True
    client_model_copies = 1  # c_i

    @dataclass(frozen=True)
    class Params:
        server_lr: float = number(1.0, exclusiveMinimum=0)  # eta_g
        weighting: str = choice("uniform", WEIGHTINGS)  # mean over S: paper "uniform", FedSOL code "samples"
        divisor: str = choice("effective_steps", DIVISORS)  # a_i eta_l (= K eta_l without momentum) or K eta_l

    @classmethod
    def check_train(cls, train: TrainSpec, params: Any = None) -> None:
        require_sgd(cls.name, train, "option II's control variate assumes SGD steps")
        own_weighting(cls.name, train)

    @classmethod
    def check_model(cls, model: str, params: Any = None, options: dict[str, Any] | None = None) -> None:
        refuse_held(cls.name, options, "its control variates are one vector over the trained parameters, which change at the second task")

    @classmethod
    def check_scenario(cls, scenario: dict[str, Any] | None, params: Any = None) -> None:
        refuse_task_heads(cls.name, scenario, "its control variates are one vector over the trained parameters, "
                          "which change at every task; the paper defines none for a head that stops or starts training")

    # ---------------------------------------------------------------- server side
    def server_init(self, server: ServerContext) -> None:
        self.names = [n for n, p in server.model.named_parameters() if p.requires_grad]
        server.state["c"] = torch.zeros_like(_flat(server.global_params, self.names))

    def server_broadcast(self, server: ServerContext) -> dict:
        return {"c": server.state["c"]}

    def server_aggregate(self, server: ServerContext, uploads: Sequence[Upload]) -> None:
        weights = upload_weights(uploads, self.p.weighting)
        new = weighted_average([u.params for u in uploads], weights)
        total = float(sum(weights))
        x = server.global_params
        for name in self.names:  # x + eta_g * mean_S (y_i - x)
            step = torch.zeros_like(x[name])
            for u, w in zip(uploads, weights):
                step.add_(u.params[name] - x[name], alpha=w / total)
            new[name] = x[name] + self.p.server_lr * step
        server.global_params = new
        mean_dc = torch.stack([u.extras["delta_c"] for u in uploads]).mean(0)
        # a new tensor, not in place: this round's broadcast still references the old c
        server.state["c"] = server.state["c"] + (len(uploads) / self.info.num_clients) * mean_dc

    def server_metrics(self, server: ServerContext, uploads: Sequence[Upload]) -> dict[str, float]:
        return {"c_norm": float(server.state["c"].norm())}

    # ---------------------------------------------------------------- client side
    def client_begin(self, ctx: ClientContext) -> None:
        c = ctx.broadcast["c"]
        if "c" not in ctx.state:  # c_i = 0 before the client's first round
            ctx.state["c"] = torch.zeros_like(c)
        self.scratch(ctx).names = [n for n, p in ctx.model.named_parameters() if p.requires_grad]

    def client_step_terms(self, ctxs: Sequence[ClientContext]) -> StepTerms:
        """The correction c - c_i added to every step's gradient (no loss term), per client
        of the stack; on a client alone (a stack of one) FedAvg's ``client_grad`` adds it."""
        corr = split_stacked([ctx.broadcast["c"] - ctx.state["c"] for ctx in ctxs], ctxs[0].model)
        return lambda lo, hi, w: (None, {n: d[lo:hi] for n, d in corr.items()}, None)

    def client_end(self, ctx: ClientContext) -> Upload:
        up = super().client_end(ctx)
        c, c_i = ctx.broadcast["c"], ctx.state["c"]
        if ctx.steps == 0:  # no local step: nothing to estimate, c_i unchanged
            up.extras["delta_c"] = torch.zeros_like(c_i)
            return up
        k = ctx.steps
        if self.p.divisor == "effective_steps":
            k = effective_steps(ctx.steps, ctx.optimizer.param_groups[0].get("momentum", 0.0))
        with torch.no_grad():
            moved = _flat(ctx.global_params, self.scratch(ctx).names) - _flat(up.params, self.scratch(ctx).names)  # x - y_i
            c_plus = c_i - c + moved / (k * ctx.lr)
        up.extras["delta_c"] = c_plus - c_i
        ctx.state["c"] = c_plus
        return up
