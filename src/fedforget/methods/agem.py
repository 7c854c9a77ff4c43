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
and FedGP) from a generator keyed (seed, round, client, task, 0x81). [D] Every step's draw and
every offer's placement are made at the client's start, from what the buffer will hold at
each step (``replay.ReplayPlan``): the same draws and buffer as step by step, and no host work
in the step, so the stacked trainer captures A-GEM's steps in CUDA graphs. Replayed rows are
scored over every class (task-IL trains as class-IL: ``Scenario.masked``) and with their own
task's head where heads are per task. Buffer rows are not augmented
again when replayed [C: FedGP's code (shenghongdai/Fed-A-GEM, models/Update_booster.py)
stores the step's transformed image (its ``DatasetSplit`` returns it as ``not_aug_inputs``)
and replays it with ``get_data(..., transform=None)``; the buffer here likewise keeps the
step's rows as the model saw them, augmented if the dataset is. Mammoth differs by variant:
its ``agem.py`` stores unaugmented rows and re-augments them
(``get_data(transform=self.transform)``); its ``agem_r.py``, the reservoir variant whose
filling this follows, stores ``not_aug_inputs`` and replays them unaugmented
(``buffer.get_data(minibatch_size, device=...)``, no transform)]. The memory forward runs in the
model's training mode (BatchNorm statistics see it), as in mammoth.

Both trainers run this one step (``client_step_terms``, which ``sees_step``): the memory
batch, g_ref (in the model's own forward for a client alone, per-task heads routed per row;
one stacked forward of every client's memory batch in the stacked trainer, each client's
mean over its own rows), the projection as the map of the step's gradient, the offers. The
replayed rows update each client's own BatchNorm statistics with its real rows only (one
vmap where every client has as many, else client by client), and keyed dropout draws their
masks as alone (the step's second call of each module). A client alone computes what
this file computed before the step was written as terms, bit for bit (checked on split
digits: class-IL and task-IL, shared and per-task heads, MLP and cnn2d, and FedGP over
A-GEM).

Hyperparameters [P/C, fedgp.md Sec. 5.1.1]: ``buffer_size`` = 200 (0: no memory, FedAvg
exactly); ``memory_batch_size`` = 32 (A-GEM's and FedGP's batch size).

Diagnostics (``agem_<key>``): ``proj_share`` (share of local steps projected), ``cos_before``
(mean cos(g, g_ref) over the steps with a memory batch), ``buffer_size`` (rows held after the
round), means over the round's clients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import ClientContext, ClientShape, FedAvg, PlannedTerms, RunInfo, StepBatch, Upload
from .params import integer
from .registry import METHODS
from .replay import Replay, buffer_bytes
from .shared import StepSums, project

MEMORY_STREAM = 0x81  # keyed randomness of A-GEM's memory batches


@METHODS.register("agem")
class AGEM(FedAvg):
    name = "agem"
    one_task_per_class = True  # its replay buffer labels a row's task by its class (methods.replay)
    own_upload = True
    step_terms = True
    sees_step = True  # the memory batch and the buffer's offers: the step's own rows

    @dataclass(frozen=True)
    class Params:
        buffer_size: int = integer(200, minimum=0)  # rows per client [P, fedgp.md]; 0: no memory (FedAvg)
        memory_batch_size: int = integer(32, minimum=1)  # rows of the reference batch [P, A-GEM; fedgp.md]

    def __init__(self, params, info: RunInfo) -> None:
        super().__init__(params, info)
        self.replay = Replay(info, params.buffer_size, MEMORY_STREAM)

    @classmethod
    def client_kept_bytes(cls, params, shape: ClientShape) -> int:
        """Its buffer: ``buffer_size`` rows of (x, y, task)."""
        return buffer_bytes(params.buffer_size, shape)

    def client_begin(self, ctx: ClientContext) -> None:
        s = self.scratch(ctx)
        self.replay.plan(ctx, s, 1, self.p.memory_batch_size)  # the round's memory batches and offers
        s.stack = None

    def client_step_terms(self, ctxs: Sequence[ClientContext]) -> PlannedTerms:
        """The step, for each client of the stack: its memory batch from its buffer (its
        plan's, ``replay.ReplayPlan``), g_ref = the gradient of the batch's cross-entropy
        (``reference``), the step's gradient projected against it (the map; no memory:
        unchanged), then the step's rows offered to the buffer. Per client: steps projected,
        the sum of cos(g, g_ref), steps with a memory batch (``s.stack``)."""
        dev = self.info.device
        sums = StepSums.shared([self.scratch(c) for c in ctxs], 3, dev, "stack")

        def terms(lo: int, hi: int, w: dict[str, torch.Tensor], step: StepBatch):
            mems = []
            for j, c in enumerate(ctxs[lo:hi]):  # the draws, then the step's rows enter the buffer
                n = step.rows[j]
                mems += self.replay.step(c, self.scratch(c), step.k, step.x[j, :n], step.y[j, :n])
            if all(m is None for m in mems):
                return None, None, None
            g_ref = self.reference(w, step, mems)
            has = self.replay.has(mems, dev)

            def gmap(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
                names = [n for n, v in grads.items() if v is not None]
                g, r = [grads[n] for n in names], [g_ref[n] for n in names]
                if hi - lo == 1:  # a client alone: its own flat vectors
                    new, projected, cos = project([a[0] for a in g], [b[0] for b in r], eps=0.0, norm_guard=0.0)
                    new = [a.unsqueeze(0) for a in new]
                else:  # A-GEM's update: eps = 0, no norm guard (a conflict implies g_ref != 0)
                    new, projected, cos = project(g, r, eps=0.0, norm_guard=0.0, stacked=True)
                sums[0, lo:hi] += projected
                sums[1, lo:hi] += torch.where(has, cos, torch.zeros_like(cos))
                sums[2, lo:hi] += has
                return {**grads, **dict(zip(names, new))}

            return None, None, gmap

        return self.replay.planned(terms, [self.scratch(c) for c in ctxs])

    def reference(self, w: dict[str, torch.Tensor], step: StepBatch, mems: list) -> dict[str, torch.Tensor]:
        """g_ref of each client of the stack: the gradient of the cross-entropy on its memory
        batch (every class scored: task-IL trains as class-IL), in its weights; zeros for a
        client without one."""
        if len(mems) == 1:  # a client alone: the batch's mean, as it always was
            m = mems[0]
            logits = step.forward(w, m["x"].unsqueeze(0), m["task"].unsqueeze(0))[0]
            loss = F.cross_entropy(logits, m["y"])
            return step.grad(loss, w)
        pad, mask, rows = self.replay.padded(mems)
        logits = step.forward(w, pad["x"], pad["task"], rows)
        per = F.cross_entropy(logits.flatten(0, 1), pad["y"].flatten(), reduction="none").view_as(mask)
        per = per.masked_fill(mask == 0, 0.0)  # padding rows left out (not times 0: NaN from a non-finite one)
        return step.grad((per.sum(1) / mask.sum(1).clamp_min(1.0)).sum(), w)

    def client_end(self, ctx: ClientContext) -> Upload:
        up = super().client_end(ctx)
        s = self.scratch(ctx)
        s.plan.finish(ctx.state)
        projected, cos, with_memory = s.stack.values()
        ctx.stats["proj_share"] = projected / max(ctx.steps, 1)
        if with_memory > 0:
            ctx.stats["cos_before"] = cos / with_memory
        ctx.stats["buffer_size"] = float(self.replay.buffer.size(ctx.state))
        return up
