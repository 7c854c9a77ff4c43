"""Tar+LODE: TARGET whose clients learn each new task with LODE's decoupled loss (Liang, Li:
"Loss Decoupling for Task-Agnostic Continual Learning", NeurIPS 2023; the authors' code
liangyanshuo/Loss-Decoupling-for-Task-Agnostic-Continual-Learning, ``code/models/lode_er.py``),
the Tar+LODE row of FedProTIP's Table 5 (papers/fedprotip.md Sec. 6.4: LODE "applied to the
generative replay method TARGET"). Tags: [P] a paper, [C] LODE's code, [D] our decision. The
LODE paper's body was not readable through this project's search tools (its abstract only);
where its equations could differ from the code, the code is followed and tagged [C].

LODE [P abstract, C ``LODEER.observe``]: a new task asks two things of the model, to tell the
new classes apart (intra-task) and to tell them from the old ones (inter-task); a replay
method's CE on the new rows mixes both, LODE splits it and weighs the two apart. On a row
(x, y) of task t >= 1, with z its logits, N the task's classes and O the classes of tasks
0..t-1::

    L_intra = CE(z[N], y)                                    (the CE over the new classes alone)
    L_inter = CE([lse(z[O]), lse(z[N])], 1) = lse(z[O u N]) - lse(z[N])
    L       = L_intra + beta * L_inter + (the replay method's terms on its replayed rows)

lse = log-sum-exp [C ``logmeanexp_previous``, which despite its name takes ``logsumexp``; its
inter-task target is the new side, ``torch.ones_like(y)``]; each term the mean over the step's
rows [C]. beta = rho * |N| / |O| [D: the code's ``rho / task`` with its equal tasks, |N| / |O|
= 1 / t; written with the class counts so that unequal splits keep its meaning]. Task 0 (no
old classes): TARGET's CE alone [C: the code's first task has no decoupled loss]. N is the
task's classes [D: the code's ``new_classes`` also holds the classes of tasks not yet started,
as mammoth's head scores every class from the start; TARGET's classifier has no outputs for
them, C ``IncrementalNet.update_fc``]. The code's ER version halves its whole loss (its ER
averages the CE of the new and the replayed batch); over TARGET, TARGET's scale is kept [D].

Over TARGET [D; FedProTIP gives one sentence]: TARGET's CE with ``ce: task`` (its code's) is
already the CE over the row's task's classes, so it is L_intra; LODE adds beta * L_inter on
the clients' real rows, and TARGET's KD on the synthetic rows stays as it is (the replay
term of LODE's ER and DER++ versions, left unchanged there too [C]). The server, the
generator, the pool and the prediction are TARGET's (``methods/target.py``). With one head
per task (FedProTIP's layout: the classifier grows, earlier heads frozen) z is the combined
logits the task-agnostic prediction reads (``TaskHeads.combined``): each old class by its own
frozen head on the step's body features, the new ones by the active head, so L_inter trains
the body and the new head against the old heads' scores, as LODE's growing single classifier
does in its code (mammoth's one head over every class).

Where it is defined: split streams (class- or task-incremental) and one-task runs (no old
classes: TARGET). Refused: domain-incremental streams (every class is in every task: no new
classes to set against old ones), and ``ce: all`` (L_intra is the CE over the new classes).

Hyperparameter: ``rho`` = 0.01 [C: FedProTIP's Tar+LODE, seohyeon-cha/FedProTIP
``client/client_target.py``: ``rho = 0.01 / self._cur_task`` on its equal 10-class tasks, which
is beta = 0.01 |N| / |O|; the paper states none. LODE's own code uses 0.01-0.5 across its
settings, 0.1 for DER++ on seq-cifar100 (``utils/best_args.py``)]; rho = 0 is TARGET (its runs'
metrics).

Both trainers [D, issue 32]: L_inter is a term of the step's own forward pass, written once
(``inter_task_loss``, ``scores``) for a stack of clients and called on a stack of one in
``client_loss``; the old heads' rows are the global weights, the same for every client. The
stacked trainer composes no step terms that see the step (TARGET's KD on its synthetic batch)
over live terms, so the whole step is live terms here (``client_live_terms``: the CE, beta *
L_inter and TARGET's KD through ``synthetic_stack``, as LANDER's step). Equal to one client
after another within 1e-5 (tests/methods/test_lode.py, one head and one head per task).

Diagnostics (``target_lode_<key>``): ``inter`` (mean L_inter over the round's steps, task >= 1)
besides TARGET's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from ..data.scenario import DOMAIN_KINDS
from ..models import TaskHeads
from ..utils import FedForgetError
from .base import ClientContext, LiveStep, LiveTerms, StepBatch
from .params import number
from .registry import METHODS
from .shared import StepSums, require, rows_mean
from .target import TARGET

LODE = "lode"  # client_loss's key of beta * L_inter
KD = "kd"  # and of TARGET's kd * KD on the synthetic batch


def inter_task_loss(z: torch.Tensor, old: torch.Tensor, new: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """L_inter = lse(z[O u N]) - lse(z[N]) per row of logits ``z`` [..., n, C] (the CE of the
    two-way logits [lse(z[O]), lse(z[N])] at the new side), ``old`` / ``new`` bool [..., C]
    (one class set per leading index); the mean over the rows, or over each stack entry's real
    rows where ``mask`` [..., n] (1.0 on them) is given: [...]."""
    floor = torch.finfo(z.dtype).min
    both = (old | new).unsqueeze(-2)
    per = torch.logsumexp(z.masked_fill(~both, floor), -1) - torch.logsumexp(z.masked_fill(~new.unsqueeze(-2), floor), -1)
    if mask is None:
        return per.mean(-1)
    return rows_mean(per, mask)


@METHODS.register("target_lode")
class TargetLODE(TARGET):
    name = "target_lode"
    # [D] L_inter is a loss of the step's own forward (its logits, and with per-task heads its
    # body features under the old heads' frozen rows), and the stacked trainer composes no step
    # terms that see the step over live terms: the whole step is live terms (``client_live_terms``:
    # TARGET's CE, beta * L_inter and TARGET's KD on the synthetic batch, as LANDER's step),
    # beside ``client_loss`` for a client alone
    live_terms = True
    live_heads = True
    sees_step = False  # (TARGET's step terms do)

    @dataclass(frozen=True)
    class Params(TARGET.Params):
        rho: float = number(0.01, minimum=0)  # L_inter's weight beta = rho |N| / |O| [C FedProTIP: 0.01 / task]

        def check(self) -> None:
            require(self.ce == "task", "ce", self.ce, "task (LODE's intra-task loss is the CE over the new task's classes)")

    @classmethod
    def check_scenario(cls, scenario: dict[str, Any] | None, params: Any = None) -> None:
        """Split streams and one-task runs; not domain-incremental streams, nor asynchronous
        task boundaries (a window's rows of an older task would be set against the client's
        task's new classes: LODE's code decouples the current task's rows only) [D]."""
        kind = (scenario or {}).get("kind", "none")
        if kind in DOMAIN_KINDS:
            raise FedForgetError(
                f"method 'target_lode' sets a task's new classes against the old ones; on a domain-incremental "
                f"stream every task holds every class: scenario.kind={kind!r}; allowed: split, none"
            )
        if scenario and scenario.get("boundaries", "sync") != "sync":
            raise FedForgetError(
                "method 'target_lode' sets each row against its client's task's new classes, and an asynchronous "
                "window mixes a client's older tasks' rows into its steps: "
                f"scenario.boundaries={scenario['boundaries']!r}; allowed: sync"
            )

    def decoupling(self, ctx: ClientContext) -> SimpleNamespace | None:
        """The client's task's LODE terms for the round: ``beta``, ``old`` / ``new`` (bool
        [C]) and, with per-task heads, each old class's row of its own (frozen, global) head
        (``weight`` [C, F], ``bias`` [C], zero on the other classes); None in task 0, or rho = 0."""
        t = ctx.task
        if t == 0 or self.p.rho == 0:
            return None
        new = self.class_mask[t]
        old = self.class_mask[:t].any(0) & ~new
        n_old = int(old.sum())
        if n_old == 0:
            return None
        out = SimpleNamespace(beta=self.p.rho * int(new.sum()) / n_old, old=old, new=new, weight=None, bias=None)
        if isinstance(getattr(ctx.model, "head", None), TaskHeads):
            g = ctx.global_params
            out.weight = torch.zeros_like(g["head.heads.0.weight"])
            out.bias = torch.zeros_like(g["head.heads.0.bias"])
            for s in range(t):
                cls = torch.tensor(self.task_classes[s], dtype=torch.long, device=out.weight.device)
                out.weight[cls] = g[f"head.heads.{s}.weight"][cls]
                out.bias[cls] = g[f"head.heads.{s}.bias"][cls]
        return out

    @staticmethod
    def scores(old: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, features: torch.Tensor,
               logits: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """[a, n, C] logits L_inter reads from the stack's body ``features`` [a, n, F] and its
        (active head's) ``logits`` [a, n, C]: the logits themselves with one head; with per-task
        heads the ``old`` classes ([a, C]) by their own heads' rows (``weight`` [a, C, F],
        ``bias`` [a, C]), as ``TaskHeads.combined`` scores them."""
        if weight is None:
            return logits
        old_z = torch.baddbmm(bias.unsqueeze(1), features, weight.transpose(1, 2))
        return torch.where(old.unsqueeze(1), old_z, logits)

    def client_begin(self, ctx: ClientContext) -> None:
        super().client_begin(ctx)
        self.scratch(ctx).lode = self.decoupling(ctx)

    def client_step_terms(self, ctxs: Sequence[ClientContext]) -> None:
        """None: TARGET's KD is in this method's ``client_loss`` and live terms."""
        return None

    def client_loss(self, ctx, x, y, features, logits) -> dict[str, torch.Tensor]:
        """TARGET's CE over the task's classes (L_intra), beta * L_inter (``inter_task_loss``)
        from task 1, and TARGET's KD on the step's synthetic batch (``kd_term``) once a pool
        exists; a stack's: ``client_live_terms``."""
        terms = super().client_loss(ctx, x, y, features, logits)  # FedAvg's CE (no step terms here)
        sp = self.scratch(ctx).lode
        if sp is not None:
            one = [None if v is None else v.unsqueeze(0) for v in (sp.old, sp.weight, sp.bias)]
            z = self.scores(*one, features.unsqueeze(0), logits.unsqueeze(0))
            inter = inter_task_loss(z, one[0], sp.new.unsqueeze(0))[0]
            self.note(ctx, "inter", inter)
            terms[LODE] = sp.beta * inter
        rep = self.synthetic_batch(ctx)
        if rep is not None:
            terms[KD] = self.p.kd * self.kd_term(ctx, rep)
        return terms

    def client_live_terms(self, ctxs: Sequence[ClientContext]) -> LiveTerms | None:
        """``client_loss``'s step for a stack of clients, each client's terms the mean over its
        real rows: the stacked trainer's CE (over each row's task's classes), beta * L_inter
        (``inter_task_loss`` of ``scores``) and the KD on each client's synthetic batch
        (``synthetic_stack``, ``kd_stack``); None in task 0 without a pool (the CE alone)."""
        scr = [self.scratch(c) for c in ctxs]
        specs = [s.lode for s in scr]
        pool = scr[0].pool is not None  # one pool for every client: the round's broadcast
        lode = any(sp is not None for sp in specs)
        if not pool and not lode:
            return None
        keys = (("inter",) if lode else ()) + (("kd",) if pool else ())
        sums = StepSums.shared(scr, len(keys), self.info.device, "step_sums")
        for s in scr:
            s.sum_keys = keys
        dev, C = self.info.device, self.info.num_classes
        if lode:  # per client (a client without old classes: beta 0 over a harmless pair of sets)
            ref = next(sp for sp in specs if sp is not None)
            old = torch.stack([sp.old if sp else torch.zeros(C, dtype=torch.bool, device=dev) for sp in specs])
            new = torch.stack([sp.new if sp else torch.ones(C, dtype=torch.bool, device=dev) for sp in specs])
            beta = torch.tensor([sp.beta if sp else 0.0 for sp in specs], device=dev)
            weight = bias = None
            if ref.weight is not None:
                weight = torch.stack([sp.weight if sp else torch.zeros_like(ref.weight) for sp in specs])
                bias = torch.stack([sp.bias if sp else torch.zeros_like(ref.bias) for sp in specs])
        old_pool = scr[0].old if pool else None

        def live(lo: int, hi: int, w: dict[str, torch.Tensor], step: StepBatch) -> LiveStep:
            total = step.loss
            if lode:
                z = self.scores(old[lo:hi], None if weight is None else weight[lo:hi],
                                None if bias is None else bias[lo:hi], step.features, step.logits)  # fmt: skip
                inter = inter_task_loss(z, old[lo:hi], new[lo:hi], step.row_mask())
                sums[0, lo:hi] += inter.detach()
                total = total + beta[lo:hi] * inter
            if pool:
                kd = self.kd_stack(self.synthetic_stack(ctxs, lo, hi, w, step), old_pool)
                sums[len(keys) - 1, lo:hi] += kd.detach()
                total = total + self.p.kd * kd
            return LiveStep(total=total)

        return live
