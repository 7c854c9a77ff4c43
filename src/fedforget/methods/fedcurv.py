"""FedCurv (Shoham, Avidor, Keren, Israel, Benditkis, Mor-Yosef, Zeitak: "Overcoming
Forgetting in Federated Learning on Non-IID Data", NeurIPS 2019 FL workshop,
arXiv:1910.07796), a CFL baseline of FedGP (papers/fedgp.md Sec. 5.1.1).

EWC (Kirkpatrick et al. 2017) across clients: client s in round t minimises [P: the
paper's FedCurv objective]

    L_s(w) + lam * sum_{j != s} sum_i I_j[i] (w[i] - w^_j[i])^2

where w^_j are client j's local weights after its last local training and I_j the diagonal
of the Fisher information of its model on its data. Expanded,

    penalty = lam * sum_i ( w[i]^2 U[i] - 2 w[i] V[i] + C[i] ),
    U = sum_{j != s} u_j,  V = sum_{j != s} v_j,  C = sum_{j != s} c_j,
    u_j = I_j,  v_j = I_j * w^_j,  c_j = I_j * w^_j^2   (elementwise),

so clients send (u_j, v_j) with their weights, the server broadcasts only the sums over all
clients and client s subtracts its own last (u_s, v_s), kept in ``ctx.state`` [P: the
paper's communication scheme]. C is a constant (no gradient) that makes the penalty's value
the sum of squares above; the OpenFL implementation sends it too [C] (it costs one more
vector per client and round; without it the reported loss could be negative). The
gradient is 2 lam (w * U - V).

Choices and tags:
- Sums over clients: each client's latest upload counts (with partial participation a
  client sampled earlier keeps its last values in the sums) [D]. Clients upload the change
  of their (u, v, c) since their previous upload, the server adds the changes to its sums
  (no per-client copy on the server, compatible with secure aggregation) [D]. U - u_s and
  C - c_s are clamped at 0 (float round-off of the running sums) [D]. Round 1: no sums yet,
  no penalty (FedAvg's step).
- Fisher [D: empirical Fisher]: I_j = mean over n samples of (d/dw log p(y | x; w))^2 at
  the client's weights after local training, with the observed label y (the empirical
  Fisher, as the OpenFL code; EWC's paper samples y from the model), the model in eval
  mode [C: OpenFL], over every class (the same likelihood the client trains; task-IL trains as class-IL).
  Per-sample gradients (torch.func), not squared minibatch gradients: the OpenFL code
  squares each minibatch's mean gradient (a batch-size-dependent underestimate) and keeps
  only the last batch's (an overwrite where a sum was meant) -- not copied.
- n = ``fisher_samples`` = 256 rows of the client's data of the round (its current task),
  drawn without replacement, keyed (seed, round, client, task, 0x83) [D]; 0 or more than the
  client holds: all of them. Fisher of the current task only: FedCurv ties clients together
  within a round, it does not remember earlier tasks (FedGP's FedCurv row is close to FL).
- Parameters: every model parameter enters the stored vectors (a fixed layout); the penalty
  covers those that train in the current task (all, unless heads are per task).
- ``lam`` = 0.5 [D]: the paper's MNIST lambda is not reproduced here. With I_j a mean over
  samples and L_s a mean loss, the Laplace approximation of client j's log-likelihood gives
  lam = N_j / (2 N_s), i.e. 0.5 for equally sized clients. lam = 0 is FedAvg.

Diagnostics (``fedcurv_<key>``, means over the round's clients): ``fisher_mean`` (mean of
I_s over parameters), ``penalty_end`` (the penalty at the client's trained weights, before
lam).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..utils import torch_seed
from .base import (
    ClientContext,
    FedAvg,
    ServerContext,
    StepTerms,
    Upload,
    client_sums,
)
from .params import integer, number
from .registry import METHODS

FISHER_STREAM = 0x83  # keyed randomness of the Fisher samples
SUMS = "fedcurv_sums"  # server.state and broadcast key: (U, V, C) over all clients, flat
OWN = ("fedcurv_u", "fedcurv_v", "fedcurv_c")  # ctx.state keys: the client's last upload
DELTA = "fedcurv_delta"  # upload key: change of (u, v, c) since the client's previous upload
CHUNK_FLOATS = 1 << 27  # per-sample gradients held at once (512 MB of float32)


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter of ``model``, flattened in ``named_parameters`` order."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def fisher_diagonal(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The empirical Fisher diagonal, mean over rows of (grad_w log p(y | x; w))^2, with the
    model as it is (its mode included), flat over all parameters (0 for those that do not
    train); every class's logit counts (task-IL trains as class-IL: ``Scenario.masked``)."""
    named = list(model.named_parameters())
    train = {n: p.detach() for n, p in named if p.requires_grad}
    rest = {n: p.detach() for n, p in named if not p.requires_grad}
    rest.update(dict(model.named_buffers()))

    def loglik(p, xi, yi):
        logits = functional_call(model, {**p, **rest}, (xi.unsqueeze(0),))
        return -F.cross_entropy(logits, yi.view(1))  # log p(y | x)

    per_sample = vmap(grad(loglik), in_dims=(None, 0, 0))
    acc = {n: torch.zeros_like(p) for n, p in train.items()}
    n_params = sum(p.numel() for p in train.values())
    chunk = max(1, min(len(y), CHUNK_FLOATS // max(n_params, 1)))
    # [D] on a CPU, attention (a ViT's) through torch's math kernel: vmap has no batching rule
    # for the CPU's fused attention and runs it row by row (a 'performance drop' warning); a
    # GPU's fused kernels have theirs
    kernels = sdpa_kernel(SDPBackend.MATH) if x.device.type == "cpu" else nullcontext()
    with torch.no_grad(), kernels:
        for s in range(0, len(y), chunk):
            g = per_sample(train, x[s : s + chunk], y[s : s + chunk])
            for n in acc:
                acc[n] += g[n].pow(2).sum(0)
    out = [
        (acc[n] / max(len(y), 1)).reshape(-1)
        if p.requires_grad
        else torch.zeros(p.numel(), device=p.device)
        for n, p in named
    ]
    return torch.cat(out)


@METHODS.register("fedcurv")
class FedCurv(FedAvg):
    name = "fedcurv"
    step_terms = True
    own_upload = True
    client_model_copies = 3  # its last upload's u, v and c (OWN)

    @dataclass(frozen=True)
    class Params:
        lam: float = number(0.5, minimum=0)  # penalty weight lambda [D]
        fisher_samples: int = integer(256, minimum=0)  # rows per Fisher estimate [D]; 0: all of the client's

    # ---------------------------------------------------------------- server side
    def server_broadcast(self, server: ServerContext) -> dict:
        sums = server.state.get(SUMS)
        return {} if sums is None else {SUMS: sums}

    def server_aggregate(self, server: ServerContext, uploads: Sequence[Upload]) -> None:
        super().server_aggregate(server, uploads)  # FedAvg's average
        deltas = [u.extras[DELTA] for u in uploads]
        total = [torch.stack([d[i] for d in deltas]).sum(0) for i in range(3)]
        sums = server.state.get(SUMS)
        server.state[SUMS] = tuple(total if sums is None else [s + t for s, t in zip(sums, total)])

    # ---------------------------------------------------------------- client side
    def client_begin(self, ctx: ClientContext) -> None:
        """The penalty's (U, V, C) of the other clients, split per trainable parameter."""
        s = self.scratch(ctx)
        s.by_name = {}
        sums = ctx.broadcast.get(SUMS)
        if sums is None or self.p.lam == 0:
            return
        own = [ctx.state.get(k) for k in OWN]
        U, V, C = (t if o is None else t - o for t, o in zip(sums, own))
        named = list(ctx.model.named_parameters())
        sizes = [p.numel() for _, p in named]
        views = [t.split(sizes) for t in (U.clamp_min(0), V, C.clamp_min(0))]
        for (n, p), u, v, c in zip(named, *views):
            if p.requires_grad:
                s.by_name[n] = (u.view_as(p), v.view_as(p), c.view_as(p))

    def client_step_terms(self, ctxs: Sequence[ClientContext]) -> StepTerms | None:
        """The penalty, per client of the stack: lam * sum(w^2 U - 2 w V + C) with each
        client's own (U, V, C) (its gradient 2 lam (w U - V) by autograd, on a client alone
        or the stack)."""
        if not self.scratch(ctxs[0]).by_name:
            return None  # round 1 (or lam = 0): no penalty for anyone
        lam = self.p.lam
        stacked = {  # name -> (U, V, C) of every client, stacked [G, *shape]
            n: [torch.stack([self.scratch(c).by_name[n][i] for c in ctxs]) for i in range(3)]
            for n in self.scratch(ctxs[0]).by_name
        }

        def terms(lo: int, hi: int, w: dict[str, torch.Tensor]):
            vals = [
                client_sums(w[n] * w[n] * u[lo:hi] - 2 * w[n] * v[lo:hi] + c[lo:hi])
                for n, (u, v, c) in stacked.items()
            ]
            return lam * torch.stack(vals).sum(0), None, None

        return terms

    def penalty(self, ctx: ClientContext) -> torch.Tensor | None:
        """sum_i w^2 U - 2 w V + C over the client's trainable parameters (before lam),
        from the one definition in ``client_step_terms``."""
        terms = self._own_terms(ctx)
        if terms is None or self.p.lam == 0:
            return None
        w = {n: p.unsqueeze(0) for n, p in ctx.model.named_parameters() if p.requires_grad}
        return terms(0, 1, w)[0][0] / self.p.lam

    def client_end(self, ctx: ClientContext) -> Upload:
        up = super().client_end(ctx)
        with torch.no_grad():
            pen = self.penalty(ctx)
        if pen is not None:
            ctx.stats["penalty_end"] = float(pen)
        fisher = self.client_fisher(ctx)
        w_hat = flat_params(ctx.model)
        new = (fisher, fisher * w_hat, fisher * w_hat * w_hat)  # (u, v, c) of this client
        old = [ctx.state.get(k) for k in OWN]
        up.extras[DELTA] = tuple(n if o is None else n - o for n, o in zip(new, old))
        for k, v in zip(OWN, new):
            ctx.state[k] = v
        ctx.stats["fisher_mean"] = float(fisher.mean())
        return up

    def client_fisher(self, ctx: ClientContext) -> torch.Tensor:
        """I_s on ``fisher_samples`` rows of the client's data of the round, eval mode."""
        view, m = ctx.data, self.p.fisher_samples
        if m == 0 or m >= len(view):
            x, y = view.all()
        else:
            gen = torch.Generator().manual_seed(
                torch_seed(self.info.seed, ctx.round, ctx.cid, ctx.task, FISHER_STREAM)
            )
            x, y = view.sample(m, gen)
        model = ctx.model
        was = model.training
        model.eval()
        try:
            return fisher_diagonal(model, x, y)
        finally:
            model.train(was)
