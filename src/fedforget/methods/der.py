"""FL+DER and FL+DER++: FedAvg whose clients train with Dark Experience Replay (Buzzega,
Boschini, Porrello, Abati, Calderara: "Dark Experience for General Continual Learning: a
Strong, Simple Baseline", NeurIPS 2020), the FL+CL baseline of FedGP (papers/fedgp.md
Sec. 5.1.1, Algorithm 5 without FedGP's projection).

Client step, for each minibatch (x, y) of client k, with its buffer M^k [P: the DER paper's
DER and DER++ objectives and its Algorithm 1; fedgp.md Alg. 5]:

    z      = h(x; w)                                   (the training forward's logits)
    L      = CE(z, y)
           + alpha * MSE(h(x'; w), z')                 (x', z') ~ one buffer batch
           [+ beta * CE(h(x''; w), y'')]               DER++: a second, independent batch
    w     <- optimizer step on grad L;  offer (x, y, z) to M^k (z detached: the logits at insertion)

MSE is ``F.mse_loss``'s mean over the batch *and* the classes [C: the DER code, which the
alpha values below are tuned for]; the paper writes ||.||_2^2 (a sum over classes), i.e. C times
larger (the paper's own tables use the code). The stored logits are the raw training-forward logits of every class (not masked in
task-incremental scenarios) [C: the DER code stores ``outputs.data``]; replayed rows are
scored with their own task's head where heads are per task, and DER++'s CE runs over every
class (task-IL trains as class-IL, as the step's CE does: ``Scenario.masked``).
No buffer terms while the buffer is empty [C], nor for a zero weight (alpha = 0 skips the
replay forward entirely, so alpha = beta = 0 is FedAvg bit for bit).

The buffer [D/C]: a reservoir of ``buffer_size`` rows per client, each sample offered once
per task on the client's first pass over the task's data (``replay.py``; FedGP's code; the
DER code offers every step of every epoch). Memory batches: uniform without replacement
from the buffer, drawn from a generator keyed (seed, round, client, task, 0x82); the two
DER++ batches are successive draws of it; every step's draws and every offer's placement
are made at the client's start (``replay.ReplayPlan``, as A-GEM's), so the steps run no host
work and the stacked trainer captures them in CUDA graphs. Buffer rows are kept as the step saw them
(augmented where the dataset is) and not augmented again when replayed [C: FedGP's code,
shenghongdai/Fed-A-GEM models/Update_booster.py, stores its ``DatasetSplit``'s transformed
image and replays with ``transform=None``; the DER code (Mammoth) stores the unaugmented
row and re-augments it at each replay]. Replay forwards run in training mode (BatchNorm
statistics see them), as in the DER code.

One registered method, ``der``, with ``plus: bool`` (DER++ when true) [D]: the two share
everything but one term, and one name keeps their configs and results side by side
(``method: {name: der, params: {plus: true}, label: derpp}``).

Hyperparameters: ``alpha`` = 1.0 [P, fedgp.md Table 18: 1 everywhere but S-CIFAR-10, where
it is 0.3]; ``beta`` = 0.5 [D: the DER paper picks beta per benchmark and buffer
size; 0.5 is its value for S-CIFAR-10, not checked here against its appendix; FedGP runs DER,
not DER++]; ``plus`` = false (FedGP's FL+DER);
``buffer_size`` = 200 [P, fedgp.md]; ``memory_batch_size`` = 32 (FedGP's batch size; the
DER code's minibatch_size defaults to the batch size). These follow FedGP's tables, not
mammoth's best arguments per benchmark and buffer (its ``best_args``), which set other alpha
and beta values: a table's DER/DER++ row names its alpha and beta in the config.

Both trainers run this one step (``client_step_terms``, which ``sees_step``): the buffer
batches, the replay terms (in the model's own forward for a client alone, per-task heads
routed per row; one stacked forward of every client's batch in the stacked trainer, each
client's mean over its own rows), the offers of the step's rows with its logits. The
replayed rows update each client's own BatchNorm statistics and draw their keyed dropout
masks as alone (as A-GEM's). A client alone computes what this file computed before the
step was written as terms, bit for bit (checked on split digits: DER and DER++, class-IL
and task-IL, shared and per-task heads, MLP and cnn2d, and FedGP over DER).

Diagnostics (``der_<key>``): ``mse`` (mean over steps of the logit MSE, before alpha),
``buffer_size`` (rows held after the round), means over the round's clients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import ClientContext, ClientShape, FedAvg, PlannedTerms, RunInfo, StepBatch, Upload
from .params import boolean, integer, number
from .registry import METHODS
from .replay import Replay, buffer_bytes
from .shared import StepSums

MEMORY_STREAM = 0x82  # keyed randomness of DER's memory batches


@METHODS.register("der")
class DER(FedAvg):
    name = "der"
    one_task_per_class = True  # its replay buffer labels a row's task by its class (methods.replay)
    own_upload = True
    step_terms = True
    sees_step = True  # the memory batches and the buffer's offers: the step's rows and logits

    @dataclass(frozen=True)
    class Params:
        alpha: float = number(1.0, minimum=0)  # logit-replay weight [P, fedgp.md Table 18]; 0.3 for S-CIFAR-10
        beta: float = number(0.5, minimum=0)  # DER++ label-replay weight [D]; used only with plus
        plus: bool = boolean(False)  # DER++ (a second buffer batch with its labels)
        buffer_size: int = integer(200, minimum=0)  # rows per client [P, fedgp.md]; 0: no memory (FedAvg)
        memory_batch_size: int = integer(32, minimum=1)  # rows per buffer batch [D: FedGP's batch size]

        def check(self) -> None:
            if not self.plus and self.beta != type(self).__dataclass_fields__["beta"].default:  # a DER run records the default
                raise ValueError(f"beta={self.beta!r} without plus: true would do nothing (DER++'s label replay); allowed: plus: true, or no beta")

    def __init__(self, params, info: RunInfo) -> None:
        super().__init__(params, info)
        self.replay = Replay(info, params.buffer_size, MEMORY_STREAM)

    @classmethod
    def client_kept_bytes(cls, params, shape: ClientShape) -> int:
        """Its buffer: ``buffer_size`` rows of (x, y, task, the logits of every class)."""
        return buffer_bytes(params.buffer_size, shape, floats=shape.num_classes)

    def client_begin(self, ctx: ClientContext) -> None:
        s = self.scratch(ctx)
        p = self.p  # the round's memory batches (one per replay term) and offers
        self.replay.plan(ctx, s, int(p.alpha > 0) + int(p.plus and p.beta > 0), p.memory_batch_size)
        s.stack = None

    def client_step_terms(self, ctxs: Sequence[ClientContext]) -> PlannedTerms:
        """The replay terms of each client of the stack: alpha * MSE on one buffer batch [+
        beta * CE on another], drawn before this step's rows (and logits) enter its buffer;
        per client, the sum of the MSE values and the steps with one (``s.stack``)."""
        p = self.p
        sums = StepSums.shared([self.scratch(c) for c in ctxs], 2, self.info.device, "stack")

        def terms(lo: int, hi: int, w: dict[str, torch.Tensor], step: StepBatch):
            # each client's batches (alpha's, then DER++'s), drawn before the step's rows and
            # logits are offered (the step changes only w; the logits kept are its forward's)
            per_client = []
            for j, c in enumerate(ctxs[lo:hi]):
                n = step.rows[j]
                # the logits kept in float32 whatever the step's precision (bf16 autocast),
                # as the code's buffer holds them [C: FedGP / mammoth init_tensors]
                x, y, z = step.x[j, :n], step.y[j, :n], step.logits[j, :n].float()
                per_client.append(self.replay.step(c, self.scratch(c), step.k, x, y, logits=z))
            draws = list(zip(*per_client))  # per replay term, each client's batch
            parts = []
            if p.alpha > 0 and any(m is not None for m in draws[0]):
                mse, has = self.replayed(w, step, list(draws[0]), "mse")
                sums[0, lo:hi] += mse.detach() * has
                sums[1, lo:hi] += has
                parts.append(p.alpha * mse)
            if p.plus and p.beta > 0 and any(m is not None for m in draws[-1]):
                parts.append(p.beta * self.replayed(w, step, list(draws[-1]), "ce")[0])
            if not parts:
                return None, None, None
            return (parts[0] if len(parts) == 1 else parts[0] + parts[1]), None, None

        return self.replay.planned(terms, [self.scratch(c) for c in ctxs])

    def replayed(self, w: dict[str, torch.Tensor], step: StepBatch, mems: list, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(each client's loss on its buffer batch [G], differentiable in w; whether it had
        one [G]): ``mse`` the MSE between the logits and the stored ones (F.mse_loss's mean
        over rows and classes), ``ce`` the cross-entropy on the stored labels over every
        class; 0 for a client without a batch."""
        has = self.replay.has(mems, step.x.device, torch.float32)
        if len(mems) == 1:  # a client alone: the batch's mean, as it always was
            m = mems[0]
            logits = step.forward(w, m["x"].unsqueeze(0), m["task"].unsqueeze(0))[0]
            if kind == "mse":
                return F.mse_loss(logits, m["logits"]).unsqueeze(0), has
            return F.cross_entropy(logits, m["y"]).unsqueeze(0), has
        pad, mask, rows = self.replay.padded(mems, ("x", "y", "task", "logits"))
        logits = step.forward(w, pad["x"], pad["task"], rows)
        n = mask.sum(1).clamp_min(1.0)
        if kind == "mse":
            sq = (logits - pad["logits"].to(logits.dtype)).pow(2).mean(-1) * mask
            return sq.sum(1) / n, has
        per = F.cross_entropy(logits.flatten(0, 1), pad["y"].flatten(), reduction="none").view_as(mask)
        # padding rows left out, not multiplied by 0 (a non-finite value of one would be NaN)
        return per.masked_fill(mask == 0, 0.0).sum(1) / n, has

    def client_end(self, ctx: ClientContext) -> Upload:
        up = super().client_end(ctx)
        s = self.scratch(ctx)
        s.plan.finish(ctx.state)
        mse, steps = s.stack.values()
        if steps > 0:
            ctx.stats["mse"] = mse / steps
        ctx.stats["buffer_size"] = float(self.replay.buffer.size(ctx.state))
        return up
