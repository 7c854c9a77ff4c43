"""FOT: Federated Orthogonal Training (Bakman, Yaldiz, Ezzeldin, Avestimehr, ICLR 2024;
arXiv 2309.01289), as papers/fedprotip.md (Sec. 2.2, 4, App. E.3, F.2) and papers/fedgp.md
(App. A.6) describe it and the authors' code computes it (duygunuryldz/Federated_Orthogonal_
Training: trainer/*_trainer.py ``collect_activations``, FedAVGAggregator ``server_aggregate`` and
``expand_orth_set``).

Clients train as in FedAvg, unconstrained. The server keeps one orthonormal basis U_l
[d_l, r_l] per layer (the global principal subspace of the old tasks' layer inputs;
representations as in GPM, ``fedforget.activations``) and, from the task after the first on,
projects the *aggregated* update of each layer's weight (FedProject):

    dW = W_avg - W_old,   W_new = W_old + (dW - dW U U^T)   (weight reshaped to [out, d_l])

At a task's end (GPSE), each client k takes its layer inputs A_k [d_l, n_k] (the im2col
columns of all its samples of the task, eval mode), removes the part in span(U_l),
R_k = A_k - U U^T A_k, and sends the sketch Y_k = R_k G_k with G_k [n_k, s_l] standard normal,
one row per column of A_k, drawn by the client alone (s_l = ``sketch_factor`` * d_l), plus its
residual ratio rho_k = ||R_k||^2 / ||A_k||^2 and its sample count b_k. The server sees only
the sum Y = sum_k Y_k (secure aggregation), which is the sketch [R_1 ... R_K] [G_1; ...; G_K]
of the concatenated residuals, and the sample-weighted mean rho = sum_k b_k rho_k / sum_k b_k.
Each Y_k is a ``Summed`` share: the trainers add it to the running sum as its report arrives
(``SummedTotal``, float64, in the clients' order, the bits of the server's own ordered sum), so
a round holds the sum and the sketch at hand, not K sketches [D: memory; sum_l d_l s_l floats a
client, 1.85 GB on the CIFAR ResNet-18, benchmarks/sketch_memory.py].
GPM's criterion with the energy already captured (1 - rho) counted becomes a target share of
the residual energy, eps' = (rho - (1 - eps)) / rho: the smallest r whose top singular values
of Y reach eps' of ||Y||_F^2 add U_Y[:, :r] to U_l (re-orthonormalised: QR), at most d_l
columns. eps = ``threshold`` + ``threshold_step`` * t after task t = 0, 1, ... (capped at 1).

Switches and their sources ([P] paper, i.e. the FedProTIP / FedGP accounts of FOT, [C] the
authors' code, [D] our decision):
- ``threshold`` = 0.9, ``threshold_step`` = 0.01 [P, FedProTIP App. E.3: DomainNet and
  ImageNet-R; 0.87 + 0.01 for CIFAR-100].
- ``sketch_factor`` = 5 [P, App. E.3 "five times the feature size"; the code's ResNet and MLP
  trainers; its AlexNet trainer uses 1 for the convolutions].
- ``samples`` = 0: every sample of the client's task [C]; n > 0: n drawn without replacement
  with a generator keyed (seed, task, client, 0x71). G_k is drawn per layer with a generator
  keyed (seed, task, client, 0x72, layer index), on the model's device.
- ``sketch_model``: local [C, default] | global [D]. local: the clients trained in the task's
  last round sketch their *local* models right after local training (FedGP App. A.6: "the
  activations of each local model"; the code's ``FedAVGTrainer.train`` with task_end), and
  that round's aggregation still uses the old bases. global: every client with data in the
  task sketches the task's final *global* model after aggregation (the TASK_END exchange).
- ``residual_ratio``: energy [D] | norm [C]. energy: rho_k = ||R_k||_F^2 / ||A_k||_F^2, which
  makes eps' exactly GPM's energy criterion; the code sends the unsquared ratio of norms.
- Where the old bases already capture eps (eps' <= 0) no direction is added [D] (GPM's rule);
  the code always adds at least one. Cumulative share >= eps' [D] (code: >).
- ``bias``: free [C] | freeze. The code projects the weights of the listed layers only; the
  biases (its MLP has some) and BatchNorm parameters are averaged as in FedAvg. freeze: the
  aggregated update of every 1-D parameter outside the per-task heads is dropped once bases
  exist.
- Layers: every Linear / Conv1d / Conv2d outside per-task heads (a shared head included, as
  the code's MLP; per-task heads excluded, as the code's AlexNet / ResNet ``last``).
With no bases (the first task, one-task runs) FOT is FedAvg bit for bit.

Communication (FedProTIP Table 9, "Model + Act", per client per task), in the row of a
task's last round (columns ``fot_<key>``) and in ``server.state["fot_comm"]`` (one entry per
task): ``comm_model_mb`` (one model upload: the floating tensors of the state dict),
``comm_sketch_mb`` (the client's sketches, sum_l d_l * s_l float32 values), ``comm_task_mb``
(their sum), ``sketch_clients`` (how many clients sent sketches); MB = 10^6 bytes. Also
``basis_fill`` (mean over layers of r_l / d_l) and ``basis_rank`` (sum of r_l).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..activations import layer_dim, layer_inputs
from ..utils import torch_seed
from .base import (
    TASK_END,
    ClientContext,
    FedAvg,
    ServerContext,
    Summed,
    Upload,
    summed_total,
    upload_weights,
    weighted_average,
)
from .params import choice, integer, number
from .registry import METHODS
from .shared import (
    CHUNK,
    energy_rank,
    extend_basis,
    float32_mb,
    left_singular,
    one_d_params,
    project_update,
    projected_layers,
    state_mb,
    threshold_at,
)

SAMPLE_STREAM, SKETCH_STREAM = 0x71, 0x72  # keyed randomness: samples, Gaussian sketches
BASES = "fot_bases"  # server.state and broadcast: {layer: U [d_l, r_l]}
SKETCH = "fot_sketch"  # upload extras (sketch_model local): the client's report
PENDING = "fot_pending"  # server.state: the last round's local reports, until the task's end
COMM = "fot_comm"  # server.state: per task, the communication per client
SKETCH_MODELS = ("local", "global")
RATIOS = ("energy", "norm")
BIAS = ("free", "freeze")
BLOCK = 1 << 22  # Gaussian entries drawn at once (columns x s_l)


class Sketcher:
    """The running sketch Y = sum_j r_j g_j^T of one layer, g_j ~ N(0, I_s) one per column r_j
    added, drawn in order from ``generator`` (``add`` in blocks of at most BLOCK entries)."""

    def __init__(self, d: int, s: int, generator: torch.Generator, device: torch.device) -> None:
        self.y = torch.zeros(d, s, device=device)
        self.s, self.gen, self.device = s, generator, device

    def draw(self, cols: int) -> torch.Tensor:
        return torch.randn(cols, self.s, generator=self.gen, device=self.device)

    def add(self, r: torch.Tensor) -> None:
        step = max(1, BLOCK // self.s)
        for c in range(0, r.shape[1], step):
            block = r[:, c : c + step]
            self.y += block @ self.draw(block.shape[1])


def sketch_width(d: int, factor: float) -> int:
    return max(1, math.ceil(factor * d))


def fot_expand(
    basis: torch.Tensor | None, y: torch.Tensor, rho: float, eps: float
) -> torch.Tensor | None:
    """GPSE's update of one layer's basis from the aggregated sketch ``y`` [d, s] of the
    residuals and the mean residual ratio ``rho``: directions reaching eps' = (rho - (1 - eps))
    / rho of ||y||_F^2 are appended (float32, orthonormal columns); ``basis`` when none are."""
    if rho <= 0:
        return basis
    target = (rho - (1.0 - eps)) / rho
    if target <= 0:
        return basis
    u, sq = left_singular(y.double())
    r = energy_rank(sq, float(sq.sum()), 0.0, target)
    r = min(r, y.shape[0] - (0 if basis is None else basis.shape[1]))
    if r <= 0:
        return basis
    return extend_basis(None if basis is None else basis.double(), u[:, :r]).float()


@METHODS.register("fot")
class FOT(FedAvg):
    name = "fot"
    own_upload = True
    exchanges = (TASK_END,)

    @dataclass(frozen=True)
    class Params:
        threshold: float = number(0.9, exclusiveMinimum=0, maximum=1)  # eps after task 0 [P: DomainNet, ImageNet-R; CIFAR-100 0.87]; > 0 (0 keeps no basis: FedAvg) [D]
        threshold_step: float = number(0.01, minimum=0)  # + per task [P]
        sketch_factor: float = number(5.0, exclusiveMinimum=0)  # s_l = factor * d_l [P]
        samples: int = integer(0, minimum=0)  # per client and task; 0: all of its data [C]
        sketch_model: str = choice("local", SKETCH_MODELS)  # local: last round's local models [C] | global [D]
        residual_ratio: str = choice("energy", RATIOS)  # energy: ||R||^2/||A||^2 [D] | norm: ||R||/||A|| [C]
        bias: str = choice("free", BIAS)  # free: 1-D parameters averaged as in FedAvg [C] | freeze

    # ---------------------------------------------------------------- server side
    def server_broadcast(self, server: ServerContext) -> dict[str, Any]:
        return {BASES: server.state.get(BASES, {})}  # clients remove its span before sketching

    def server_aggregate(self, server: ServerContext, uploads: Sequence[Upload]) -> None:
        avg = weighted_average([u.params for u in uploads], upload_weights(uploads, self.info.train.client_weights))
        bases = server.state.get(BASES)
        if bases:  # without: FedAvg, bit for bit
            old = server.global_params
            project_update(avg, old, bases)  # FedProject
            if self.p.bias == "freeze":
                for name, _ in one_d_params(server.model):
                    avg[name] = old[name]
        server.global_params = avg
        pending = {u.cid: u.extras[SKETCH] for u in uploads if SKETCH in u.extras}
        if pending:  # sketch_model local: consumed by this round's TASK_END collect
            server.state[PENDING] = pending

    def server_collect(self, exchange: str, server: ServerContext, replies: dict[int, Any]) -> None:
        if self.p.sketch_model == "local":
            replies = server.state.pop(PENDING, {})
        if not replies:
            return
        order = sorted(replies)
        n = torch.tensor([float(replies[c]["n"]) for c in order], dtype=torch.float64)
        w = (n / n.sum()).tolist()
        eps = threshold_at(self.p.threshold, self.p.threshold_step, server.task)
        bases = dict(server.state.get(BASES, {}))
        # secure aggregation: the server sees the clients' sum only (summed as they arrived)
        total = summed_total(replies[c]["y"] for c in order)
        for name in total.names():
            rho = sum(wk * replies[c]["ratio"][name] for wk, c in zip(w, order)) if name in bases else 1.0
            new = fot_expand(bases.get(name), total.part(name).to(server.device), rho, eps)
            if new is not None:
                bases[name] = new
        server.state[BASES] = bases
        comm = {
            "task": server.task,
            "sketch_clients": len(order),
            "comm_model_mb": state_mb(server.global_params),
            "comm_sketch_mb": float32_mb(total.shape(k) for k in total.names()),  # a client's sketches
        }
        comm["comm_task_mb"] = comm["comm_model_mb"] + comm["comm_sketch_mb"]
        server.state.setdefault(COMM, []).append(comm)
        layers = projected_layers(server.model)
        fill = [bases[k].shape[1] / layer_dim(m) if k in bases else 0.0 for k, m in layers.items()]
        server.state["fot_task_end"] = {
            **{k: float(v) for k, v in comm.items() if k != "task"},
            "basis_fill": sum(fill) / max(len(fill), 1),
            "basis_rank": float(sum(b.shape[1] for b in bases.values())),
        }

    def server_metrics(self, server: ServerContext, uploads: Sequence[Upload]) -> dict[str, float]:
        return server.state.pop("fot_task_end", {})

    # ---------------------------------------------------------------- client side
    def ends_task(self, rnd: int) -> bool:
        sc = self.info.scenario
        return sc.ends_task(rnd) if sc is not None else rnd == self.info.train.rounds

    def client_end(self, ctx: ClientContext) -> Upload:
        up = super().client_end(ctx)
        if self.p.sketch_model == "local" and self.ends_task(ctx.round):
            up.extras[SKETCH] = self.client_sketch(ctx)  # on the local model just trained
        return up

    def client_reply(self, exchange: str, ctx: ClientContext) -> Any:
        if self.p.sketch_model == "global":
            return self.client_sketch(ctx)  # on the task's final global model
        return None

    def client_sketch(self, ctx: ClientContext) -> dict[str, Any]:
        """The client's GPSE report: {"n": samples, "ratio": {layer: rho_k}, "y":
        Summed({layer: R_k G_k [d_l, s_l]})} of ctx.model on its data of task ctx.task (the
        trainers fold the sketches into the round's sum as the reports arrive)."""
        if self.p.samples:
            gen = torch.Generator().manual_seed(
                torch_seed(self.info.seed, ctx.task, ctx.cid, SAMPLE_STREAM)
            )
            x, _ = ctx.data.sample(self.p.samples, gen)
        else:
            x, _ = ctx.data.all()
        bases = ctx.broadcast.get(BASES) or {}
        return sketch_layers(ctx.model, x, bases, self.p.sketch_factor, self.p.residual_ratio,
                             [self.info.seed, ctx.task, ctx.cid, SKETCH_STREAM])  # fmt: skip


def sketch_layers(
    model: nn.Module,
    x: torch.Tensor,
    bases: dict[str, torch.Tensor],
    factor: float,
    ratio: str,
    keys: Sequence[int],
    chunk: int = CHUNK,
) -> dict[str, Any]:
    """Residual sketches of every projected layer of ``model`` (eval mode, restored) on the
    inputs ``x``, processed ``chunk`` samples at a time; layer i's Gaussian rows come from a
    generator keyed (*keys, i) on ``x``'s device: {"n": len(x), "ratio": {layer: rho},
    "y": Summed({layer: sketch})}."""
    layers = projected_layers(model)
    dev = x.device
    sketchers, energy = {}, {}
    for i, (name, m) in enumerate(layers.items()):
        gen = torch.Generator(device=dev).manual_seed(torch_seed(*keys, i))
        sketchers[name] = Sketcher(layer_dim(m), sketch_width(layer_dim(m), factor), gen, dev)
        energy[name] = torch.zeros(2, dtype=torch.float64, device=dev)  # ||A||^2, ||R||^2
    was = model.training
    model.eval()
    try:
        for s in range(0, len(x), chunk):
            for name, a in layer_inputs(model, x[s : s + chunk], layers).items():
                u = bases.get(name)
                r = a - u @ (u.T @ a) if u is not None else a
                energy[name][0] += a.double().pow(2).sum()
                energy[name][1] += r.double().pow(2).sum()
                sketchers[name].add(r)
    finally:
        model.train(was)
    ratios = {}
    for name in sketchers:
        total, resid = energy[name].tolist()
        rho = resid / total if total > 0 else 0.0
        ratios[name] = math.sqrt(rho) if ratio == "norm" else rho
    return {"n": len(x), "ratio": ratios, "y": Summed({name: sk.y for name, sk in sketchers.items()})}
