"""FL+A-GEM: FedAvg whose clients train with Averaged Gradient Episodic Memory (Chaudhry,
Ranzato, Rohrbach, Elhoseiny: "Efficient Lifelong Learning with A-GEM", ICLR 2019), the
FL+CL baseline of FedGP (papers/fedgp.md Sec. 5.1.1, Algorithm 6 without FedGP's g_ref).

Client step, for each minibatch (x, y) of client k [P, A-GEM's projected update (Sec. 4 of
the paper); fedgp.md Alg. 6]:

    g     = grad_w CE(f(x; w), y)                        (the engine's backward)
    g_ref = grad_w CE(f(x'; w), y'),  (x', y') ~ one random batch of the client's buffer M^k
    g    <- g - (g . g_ref / g_ref . g_ref) g_ref        if g . g_ref < 0, else g unchanged
    w    <- optimizer step with g;  offer (x, y) to M^k

over one flat vector made of every parameter with a gradient [C, as FedGP's and mammoth's
code]. No projection while the buffer is empty [C]. ``g . g_ref < 0`` implies g_ref != 0, so
the division is safe and no epsilon is added [C: mammoth's ``project``]. (The indicator of
fedgp.md Eq. 5 and Alg. 6 is ``<= 0``: at equality the correction is 0 anyway.)

The memory M^k [D/C]: a reservoir of ``buffer_size`` rows per client, filled as FedGP's code
fills it (``replay.py``: each sample offered once per task, on the client's first pass over
the task's data, after the step that trained on it) -- mammoth's A-GEM-R variant; A-GEM's
paper fills a per-task episodic memory at task ends instead. The memory batch is drawn
uniformly without replacement from the buffer (it may hold current-task rows, as in A-GEM-R
and FedGP) from a generator keyed (seed, round, client, task, 0x81). Replayed rows are
scored with their own task's classes in task-incremental scenarios (mask of the row's task)
and with their own task's head where heads are per task. Buffer rows are not augmented
again when replayed [C: FedGP's code (shenghongdai/Fed-A-GEM, models/Update_booster.py)
stores the step's transformed image (its ``DatasetSplit`` returns it as ``not_aug_inputs``)
and replays it with ``get_data(..., transform=None)``; the buffer here likewise keeps the
step's rows as the model saw them, augmented if the dataset is. Mammoth differs by variant:
its ``agem.py`` stores unaugmented rows and re-augments them
(``get_data(transform=self.transform)``); its ``agem_r.py``, the reservoir variant whose
filling this follows, stores ``not_aug_inputs`` and replays them unaugmented
(``buffer.get_data(minibatch_size, device=...)``, no transform)]. The memory forward runs in the
model's training mode (BatchNorm statistics see it), as in mammoth.

Hyperparameters [P/C, fedgp.md Sec. 5.1.1]: ``buffer_size`` = 200 (0: no memory, FedAvg
exactly); ``memory_batch_size`` = 32 (A-GEM's and FedGP's batch size).

Diagnostics (``agem_<key>``): ``proj_share`` (share of local steps projected), ``cos_before``
(mean cos(g, g_ref) over the steps with a memory batch), ``buffer_size`` (rows held after the
round), means over the round's clients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import ClientContext, FedAvg, RunInfo, Upload, masked_logits
from .params import integer
from .registry import METHODS
from .replay import Replay
from .shared import project

MEMORY_STREAM = 0x81  # keyed randomness of A-GEM's memory batches


@METHODS.register("agem")
class AGEM(FedAvg):
    name = "agem"
    stacked = False
    own_upload = True

    @dataclass(frozen=True)
    class Params:
        buffer_size: int = integer(200, minimum=0)  # rows per client [P, fedgp.md]; 0: no memory (FedAvg)
        memory_batch_size: int = integer(32, minimum=1)  # rows of the reference batch [P, A-GEM; fedgp.md]

    def __init__(self, params, info: RunInfo) -> None:
        super().__init__(params, info)
        self.replay = Replay(info, params.buffer_size, MEMORY_STREAM)

    def client_begin(self, ctx: ClientContext) -> None:
        s = self.scratch(ctx)
        self.replay.begin(ctx, s)
        s.n_proj = torch.zeros((), device=self.info.device)
        s.cos_sum = torch.zeros((), device=self.info.device)
        s.n_mem = 0

    def reference_loss(self, ctx: ClientContext) -> torch.Tensor | None:
        """CE on one random buffer batch (None while the buffer is empty)."""
        mem = self.replay.sample(ctx, self.scratch(ctx), self.p.memory_batch_size)
        if mem is None:
            return None
        logits = self.replay.logits(ctx.model, mem["x"], mem["task"])
        return torch.nn.functional.cross_entropy(
            masked_logits(logits, self.replay.mask(mem["task"])), mem["y"]
        )

    def client_step(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = super().client_step(ctx, x, y)  # g in p.grad
        self.scratch(ctx).batch = (x, y)  # offered after the projection (client_grad)
        return loss

    def client_grad(self, ctx: ClientContext) -> None:
        s = self.scratch(ctx)
        loss_ref = self.reference_loss(ctx)
        if loss_ref is not None:
            params = [p for p in ctx.model.parameters() if p.grad is not None]
            g_ref = torch.autograd.grad(loss_ref, params, allow_unused=True)
            g_ref = [torch.zeros_like(p) if g is None else g for p, g in zip(params, g_ref)]
            g = [p.grad for p in params]
            with torch.no_grad():
                # A-GEM's update: eps = 0, no norm guard (a conflict implies g_ref != 0)
                g_new, projected, cos = project(g, g_ref, eps=0.0, norm_guard=0.0)
                torch._foreach_copy_(g, g_new)
                s.n_proj += projected
                s.cos_sum += cos
            s.n_mem += 1
        x, y = s.batch
        s.batch = None
        self.replay.offer(ctx, s, x, y)

    def client_end(self, ctx: ClientContext) -> Upload:
        up = super().client_end(ctx)
        s = self.scratch(ctx)
        ctx.stats["proj_share"] = s.n_proj.item() / max(ctx.steps, 1)
        if s.n_mem:
            ctx.stats["cos_before"] = s.cos_sum.item() / s.n_mem
        ctx.stats["buffer_size"] = float(self.replay.buffer.size(ctx.state))
        return up
