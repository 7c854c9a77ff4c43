"""MOON: model-contrastive federated learning.

Paper: Qinbin Li, Bingsheng He, Dawn Song, "Model-Contrastive Federated Learning", CVPR 2021.

Client k in round t trains w from the global weights w^t with (paper Eq. 3 and Eq. 4):

    z      = R_w(x)                  representation of x by the local model being trained
    z_glob = R_{w^t}(x)              by the global model of this round (frozen)
    z_prev = R_{w_k^{t-1}}(x)        by the client's own model from the last round it took part
    l_con  = -log( exp(sim(z, z_glob)/tau) / (exp(sim(z, z_glob)/tau) + exp(sim(z, z_prev)/tau)) )
    l      = l_sup(w; (x, y)) + mu * l_con(w; w_k^{t-1}; w^t; x)

sim is the cosine similarity, l_sup the cross-entropy, both averaged over the minibatch
(``model_contrastive_loss`` below; l_con is a 2-way cross-entropy with the global model's
view as the positive, as in the official code). The server is FedAvg.

Decisions
- Representation R: the body's output (``Classifier.features``, the penultimate features),
  as the FedSOL/FedNTD code does. The paper adds a 2-layer projection head after the base
  encoder and feeds its output to the classifier; our models are body + linear head and no
  method changes them, so there is no projection head.
- w_k^{t-1} is what client k uploaded the last round it was sampled (not necessarily round
  t-1 under partial participation; the official code likewise keeps each client's last
  trained net). It lives in ``ctx.state["prev"]`` as one flat tensor of the uploaded floating
  state (``flatten_state``), in state_dict order, on the training device.
- First participation (no w_k^{t-1} yet), ``first_prev``:
  * ``skip`` (default): l_con is left out for that client-round, so it trains as FedAvg.
    This is exactly what the official code (QinbinLi/MOON) does in round 1, where the model
    pool is empty and the contrastive cross-entropy has a single (positive) logit, i.e. is 0.
    It is also gradient-equivalent to using the global model as z_prev (then l_con = log 2,
    constant). For clients first sampled later the official code contrasts against that
    client's own, independently initialised and never trained net, an artefact not copied.
  * ``init``: use the initial global model w^0 as z_prev, as the FedNTD/FedSOL code does
    (its prev_locals start as w^0 for every client).
- The frozen global and previous models are in eval mode (the official code sets both to
  eval): with BatchNorm (the ResNets) each normalises by its own running statistics (the
  previous model's are kept with its weights), in both trainers.
- Defaults mu = 1, tau = 0.5: tau 0.5 is the paper's; mu 1 is the paper's for CIFAR-100 and
  Tiny-ImageNet (5 for CIFAR-10). The FedSOL code runs mu 0.1, tau 1 (METHODS.md).
- mu = 0 is FedAvg exactly: nothing is copied, computed or stored.
- Both trainers [D, issue 32]: l_con is a loss of the step's own features, stated once for
  a stack of clients (``model_contrastive_loss``; a client alone is a stack of one): the
  sequential trainer adds it in ``client_loss``, the stacked trainer in the batched forward
  (``client_live_terms``), z_glob by one forward of the frozen global model over the stack's
  rows, z_prev by one stacked forward of the clients' previous models (no dropout, as the
  frozen copies in eval mode), each client's l_con the mean over its real rows.
- Diagnostic ``l_con``: per client, the mean of l_con over its steps (clients that skipped
  it report nothing); metrics column ``moon_l_con``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import (
    ClientContext,
    FedAvg,
    LiveStep,
    LiveTerms,
    Params,
    ServerContext,
    Upload,
    flatten_state,
    frozen_model,
)
from .params import choice, number
from .registry import METHODS
from .shared import StepSums, on_stack, rows_mean

FIRST_PREV = ("skip", "init")


def unflatten_state(flat: torch.Tensor, like: Params) -> Params:
    """Inverse of ``flatten_state``: the floating entries of ``like``, filled from ``flat``."""
    keys = [k for k, v in like.items() if torch.is_floating_point(v)]
    parts = flat.split([like[k].numel() for k in keys])
    return {k: p.view_as(like[k]) for k, p in zip(keys, parts)}


@torch.no_grad()
def load_flat(model: nn.Module, flat: torch.Tensor) -> None:
    state = model.state_dict(keep_vars=True)
    tensors = [t for t in state.values() if torch.is_floating_point(t)]
    parts = flat.split([t.numel() for t in tensors])
    torch._foreach_copy_(tensors, [p.view_as(t) for p, t in zip(parts, tensors)])


def model_contrastive_loss(
    z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """MOON's l_con (Eq. 3) of each client of a stack [G], averaged over its rows: a 2-way
    cross-entropy over [sim(z, z_glob), sim(z, z_prev)] / tau with the first (the global
    view) as the target. ``z``, ``z_glob``, ``z_prev`` [G, B, F]; ``mask`` [G, B] each
    client's real rows (None: every row, the batch mean as one client's step took it)."""
    pos = F.cosine_similarity(z, z_glob, dim=-1)
    neg = F.cosine_similarity(z, z_prev, dim=-1)
    logits = torch.stack([pos, neg], dim=-1) / tau  # [G, B, 2]
    if mask is None:
        target = torch.zeros(z.shape[1], dtype=torch.long, device=z.device)
        return torch.stack([F.cross_entropy(lg, target) for lg in logits])
    per_row = -F.log_softmax(logits, dim=-1)[..., 0]
    return rows_mean(per_row, mask)


@dataclass(frozen=True)
class MOONParams:
    mu: float = number(1.0, minimum=0)  # weight of l_con; 0 = FedAvg
    tau: float = number(0.5, exclusiveMinimum=0)  # temperature of l_con
    first_prev: str = choice("skip", FIRST_PREV)  # z_prev before a client's first upload: skip l_con | init (w^0)


@METHODS.register("moon")
class MOON(FedAvg):
    """FedAvg whose local loss adds mu * l_con (global view positive, own previous model negative)."""

    name = "moon"
    own_upload = True
    client_model_copies = 1  # its previous local model
    live_terms = True  # l_con of the step's own features (client_live_terms)
    Params = MOONParams

    def __init__(self, params: MOONParams, info) -> None:
        super().__init__(params, info)
        self._w0: torch.Tensor | None = None  # flat w^0, for first_prev = init

    def server_init(self, server: ServerContext) -> None:
        if self.p.mu > 0 and self.p.first_prev == "init":
            self._w0 = flatten_state(server.global_params).clone()

    def client_begin(self, ctx: ClientContext) -> None:
        s = self.scratch(ctx)
        s.active = False  # l_con is on for this client
        if self.p.mu == 0:
            return
        prev = ctx.state.get("prev", self._w0)
        if prev is None:  # first participation with first_prev = skip: FedAvg this round
            return
        s.glob = frozen_model(ctx, "moon_glob")  # frozen w^t, reused across clients
        s.prev = frozen_model(ctx, "moon_prev")  # frozen w_k^{t-1}
        s.glob.load_state_dict(ctx.global_params)
        load_flat(s.prev, prev)
        s.active, s.sums = True, StepSums.own(2, self.info.device)  # sum of l_con, steps

    def client_loss(self, ctx, x, y, features, logits) -> dict[str, torch.Tensor]:
        terms = super().client_loss(ctx, x, y, features, logits)
        s = self.scratch(ctx)
        if not s.active:
            return terms
        with torch.no_grad():
            z_glob = s.glob.features(x)
            z_prev = s.prev.features(x)
        l_con = model_contrastive_loss(features[None], z_glob[None], z_prev[None], self.p.tau)[0]
        s.sums.add(l_con.detach(), 1)
        terms["contrastive"] = self.p.mu * l_con
        return terms

    def client_live_terms(self, ctxs: Sequence[ClientContext]) -> LiveTerms | None:
        """mu * l_con of each client of a stack whose l_con is on (a previous model; the
        others train as FedAvg, a zero term), on the step's own features: z_glob from the
        frozen global model, z_prev from the stack of the clients' previous models (built
        once for the round); summed per client in one tensor for ``l_con``."""
        act = [self.scratch(c).active for c in ctxs]
        if not any(act):
            return None
        sums = StepSums.shared([self.scratch(c) for c in ctxs], 2, self.info.device)
        like = {k: v for k, v in ctxs[0].global_params.items() if torch.is_floating_point(v)}
        prevs = [unflatten_state(c.state.get("prev", self._w0), like) if a else like for c, a in zip(ctxs, act)]
        prev = {k: torch.stack([q[k] for q in prevs]) for k in prevs[0]}
        on = torch.tensor(act, dtype=torch.float32, device=self.info.device)
        glob = next(self.scratch(c).glob for c, a in zip(ctxs, act) if a)  # one for the stack (client_begin)

        def live(lo: int, hi: int, w, step) -> LiveStep:
            z_glob = on_stack(glob.features, step.x)
            z_prev = step.features_of({k: v[lo:hi] for k, v in prev.items()}, step.x)
            l_con = model_contrastive_loss(step.features, z_glob, z_prev, self.p.tau, step.row_mask()) * on[lo:hi]
            sums[0, lo:hi] += l_con.detach()
            sums[1, lo:hi] += on[lo:hi]
            return LiveStep(loss=self.p.mu * l_con, has=on[lo:hi] > 0)

        return live

    def client_end(self, ctx: ClientContext) -> Upload:
        up = super().client_end(ctx)
        if self.p.mu > 0:
            ctx.state["prev"] = flatten_state(up.params)  # w_k for this client's next round
        s = self.scratch(ctx)
        if s.active:
            total, steps = s.sums.values()
            ctx.stats["l_con"] = total / max(steps, 1)
        return up
