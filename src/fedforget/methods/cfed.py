"""CFeD (Ma, Xie, Wang, Chen, Shou: "Continual Federated Learning Based on Knowledge
Distillation", IJCAI 2022), the CFL baseline of FedGP (papers/fedgp.md Sec. 5.1.1, Table 1,
App. A.9 Table 18).

What the paper states [P, its abstract; the body could not be read, see below]: clients
and the server each hold an unlabelled surrogate dataset of their own; knowledge
distillation on it runs on the clients (to mitigate forgetting of old tasks) and on the
server (to mitigate client drift); after the first task CFeD gives different clients
different objectives, *learning* the new task or *reviewing* old tasks. The details below
come from the authors' public code (lianziqt/CFeD: train_eval_fed.py ``train_CFeD``,
update.py ``update_weights_CFeD_new/_old`` and ``GlobalUpdate``, loss.py) [C].

Surrogate data [P, D]: the public set S (``datasets[].public``, its labels never read) is
split once, by a permutation keyed (seed, 0xCFE0), into K + 1 disjoint near-equal parts:
part k is client k's surrogate set S_k, part K the server's S_0 [P: "each party
independently"; the code gives each client an IID shard and lets the server reuse one
client's shard]. The split is the same whether or not the server distils. Surrogate rows
are never augmented [C: the code feeds its CIFAR arrays to the model as they are
(utils.py ``CifarIterater``), with no train transform on any data].

Objectives (round r of task t, m clients sampled) [C]:
- t = 0: every client *learns*: FedAvg's local step, CE on its task data.
- t >= 1: floor(review_ratio * m) of the sampled clients *review*, the others *learn*
  (code: int(0.4 m) reviewers, int(0.6 m) learners). The server assigns the roles: a
  permutation of the sampled clients keyed (seed, round, 0xCFE1), its first ones review
  (``server_broadcast``) [D: keyed; the code draws the two groups independently from all
  clients, so a client may do both and some sampled ones neither].
- A reviewer's local loss on a surrogate minibatch x of S_k [C loss.py, update.py]:

      L_rev(w) = kd_weight * KD_T(f(x; w), f(x; w_{t-1}))
      KD_T(z, z_old) = -1/|x| sum_x sum_c softmax(z_old/T)_c log softmax(z/T)_c      (1)

  the cross-entropy of the temperature-softened old output (LwF's L_old), no T^2 factor,
  where w_{t-1} is the global model at the end of task t-1 (code: ``init_model``, the
  global model when the task starts). Its gradient equals that of KL(old || new).
  Which scores [C, D]: the model's whole output, every class (the code distils the full
  single-head output); with one head per task, the task-agnostic output of heads 0..t-1
  (``TaskHeads.combined`` as it scored at the end of task t-1: old classes from their own
  heads, the others from head t-1; every head the reviewer uses is frozen, so the body
  learns) [D]. ``review_classes: old`` keeps only the classes of tasks < t [D, LwF's old
  outputs]. Task-IL masks are not applied to (1) (the code has none).
- Steps [D]: a reviewer takes the steps the engine's local loop gives every client (E
  epochs of its task data's minibatches), each on a surrogate minibatch of the same size,
  read from successive permutations of S_k keyed (seed, round, client, task, 0xCFE2); the
  code runs E epochs over S_k instead. The engine has one local loop for all methods, and
  FedGP's per-step projection and buffer need every step to pass through it. For the same
  reason a sampled client without data in the task (which the engine does not train) does
  not review either, so fewer than floor(review_ratio * m) may review in such a round.
- The teacher's scores f(S; w_{t-1}) are computed once per task by the server (eval mode,
  no grad) at the task's start and kept in ``server.state`` (the checkpoint holds them, so
  a resumed run is exact); a reviewer reads its rows of them [D: the same numbers a client
  holding w_{t-1} computes; the code evaluates ``init_model`` in train mode, with dropout
  and batch statistics, not copied].
- Aggregation: FedAvg over learners and reviewers, weighted by n_k (a reviewer trains on as
  many surrogate rows as it has task rows) [D; the code averages uniformly over clients with
  equal shards, where the two agree].

Server distillation (every round, ``server_distill``) [P abstract; C ``GlobalUpdate``]: the
student starts at the FedAvg average and minimises kd_weight * KD_T(student, teacher) (1)
on S_0 for ``distill_epochs`` epochs (Adam); the teachers are the round's local models
(learners and reviewers) and the global model broadcast this round, in that order, and row
j of S_0 takes the eval-mode logits of teacher j mod M [C: ``GlobalDataSetSplit`` labels
each fetched row with the next teacher in turn; there the turn runs on across epochs, here
a row keeps its teacher in every epoch]. Batch order keyed (seed, round, 0xCFE3). With one
head per task, the current task's head and the body train (``set_task``), other heads stay.

Trainers [D]: a client alone runs ``client_step``. The stacked trainer runs a reviewer's step
with its surrogate rows in place of its minibatch (``client_live_terms`` returning
``JoinedLive(replaces=True)``: as many rows as its minibatch holds at that step, drawn from
the same stream in the same order; with BatchNorm its statistics see them alone, as alone),
its loss kd_weight * (1) against the teacher's scores of those rows, a learner's the task
loss of its minibatch, in one stacked forward. Equal within 1e-5 (tests/methods/test_cfed.py:
MLP, CNN, ResNet-8, FedGP over CFeD). Eager on a GPU (the surrogate rows are drawn on the host
each step); with one head per task (the old heads' combined scores) one client after another.

FedGP (App. A.9 Table 18) ran CFeD with CIFAR-100 as the surrogate of sequential CIFAR-10,
CIFAR-10 for sequential CIFAR-100, and "No server distillation included": its Table 1 rows
are ``server_distill: false`` (the client-side review/learn split alone); the paper default
here is true (the authors' CIFAR config has ``server_distillation = False`` as well).

Hyperparameters (``Params``; defaults and sources):
- ``review_ratio`` = 0.4 [C] (share of the sampled clients reviewing after task 0);
- ``temperature`` T = 2 [C loss/update.py, LwF's T]; ``kd_weight`` = 0.1 [C: the
  DistillationLoss ``frac``, in both client and server distillation];
- ``review_classes`` = all [C] | old [D];
- ``server_distill`` = true [P; FedGP Table 1: false]; ``distill_epochs`` = None: the
  run's local epochs [C: the server runs ``local_ep`` epochs]; ``distill_optimizer`` adam,
  ``distill_lr`` = 5e-5 [C: Adam at the clients' ``learning_rate``, 5e-5 in the code's
  configs]; ``distill_batch_size`` = 128 [C]; ``distill_schedule`` constant,
  ``distill_max_grad_norm`` 0 [C].
The local optimizer (the code's CIFAR-10 config: Adam 5e-5, 10 local epochs, 20 rounds per
task) is the experiment's ``train`` block.

Refused [P, fedgp.md Sec. 5.1.1: CFeD needs task boundaries]: asynchronous boundaries, and
runs without a public set (``needs_public``); a public set with fewer than K + 1 rows.

What could not be verified: the paper's method section (its equations, the share of
reviewing clients, the server's teacher ensemble, whether reviewers also learn). The stored
copies of the paper reach only the abstract; everything marked [C] is the authors' code.

Diagnostics (``cfed_<key>``): ``review_share`` (share of the round's clients reviewing),
``review_loss`` (mean of (1) times kd_weight over reviewers' steps), ``reviewers``, and
the server distillation's ``distill_*``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from ..schedule import sample_clients  # the engine's schedule: the round's sampled clients
from ..utils import FedForgetError, torch_seed
from .base import ClientContext, FedAvg, JoinedLive, LiveStep, ServerContext, StepBatch, Upload
from .distill import DistillParams, DistillStats, distill, public_logits
from .params import boolean, choice, number, one_of, redefault
from .registry import METHODS
from .shared import StepSums

SPLIT_STREAM, ROLE_STREAM, REVIEW_STREAM, SERVER_STREAM = 0xCFE0, 0xCFE1, 0xCFE2, 0xCFE3
TEACHER = "cfed_teacher"  # server.state / broadcast: w_{t-1}'s scores on the public set [N, C]
PUBLIC_X = "cfed_public_x"  # broadcast: the public inputs
PARTS = "cfed_parts"  # broadcast: the K + 1 surrogate parts (row indices of the public set)
REVIEWERS = "cfed_reviewers"  # broadcast: the clients reviewing this round
GLOBAL = "cfed_global"  # broadcast: this round's global weights (a teacher of the server)
REVIEW_CLASSES = ("all", "old")


def kd_rows(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """(1)'s per-row term [..., B]: -sum_c softmax(teacher/T)_c * log_softmax(student/T)_c."""
    t = float(temperature)
    return -(F.softmax(teacher / t, dim=-1) * F.log_softmax(student / t, dim=-1)).sum(-1)


def soft_cross_entropy(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """(1): -1/B sum_rows sum_c softmax(teacher/T)_c * log_softmax(student/T)_c [C loss.py]: a
    cross-entropy to softened targets, without distill.kd_loss's T^2 (nor its KL's constant)."""
    return kd_rows(student, teacher, temperature).mean()


def old_scores(model: torch.nn.Module, x: torch.Tensor, upto: int) -> torch.Tensor:
    """The scores of tasks 0..upto's model on ``x``: the logits (shared head), or with one
    head per task ``TaskHeads.combined`` as it scores at the end of task ``upto``."""
    head = getattr(model, "head", None)
    if not hasattr(head, "combined"):
        return model(x)
    active = head.active
    head.active = upto
    try:
        return head.combined(model.features(x))
    finally:
        head.active = active


def split_parts(n: int, parties: int, seed: int) -> list[torch.Tensor]:
    """Rows 0..n-1 in ``parties`` disjoint near-equal parts, by a permutation keyed (seed,
    SPLIT_STREAM): parts 0..K-1 the clients', part K the server's."""
    gen = torch.Generator().manual_seed(torch_seed(seed, SPLIT_STREAM))
    return list(torch.randperm(n, generator=gen).tensor_split(parties))


def reviewers(seed: int, rnd: int, sampled: Sequence[int], ratio: float) -> list[int]:
    """The sampled clients that review in round ``rnd``: the first floor(ratio * m) of a
    permutation of ``sampled`` keyed (seed, round, ROLE_STREAM)."""
    k = math.floor(ratio * len(sampled) + 1e-9)
    gen = torch.Generator().manual_seed(torch_seed(seed, rnd, ROLE_STREAM))
    order = torch.randperm(len(sampled), generator=gen).tolist()
    return sorted(sampled[i] for i in order[:k])


@METHODS.register("cfed")
class CFeD(FedAvg):
    name = "cfed"
    one_task_per_class = True  # its old classes are the union of the earlier tasks' (surrogate distillation)
    # [D] a reviewer's step (the old model's scores distilled on its surrogate rows, which take
    # the place of its minibatch) is live terms over replaced rows (``client_live_terms``,
    # ``JoinedLive(replaces=True)``), a learner's FedAvg's; the surrogate rows are drawn on the
    # host each step (eager on a GPU). With one head per task (its combined old scores) one
    # client after another
    live_terms = True
    capturable_terms = False
    own_upload = True
    needs_public = True

    @dataclass(frozen=True)
    class Params(DistillParams):
        review_ratio: float = number(0.4, minimum=0, maximum=1)  # [C] share of sampled clients reviewing after task 0
        temperature: float = number(2.0, exclusiveMinimum=0)  # [C] T of (1), clients and server
        kd_weight: float = number(0.1, minimum=0)  # [C] DistillationLoss frac, clients and server
        review_classes: str = choice("all", REVIEW_CLASSES)  # all [C] | old [D]: the classes (1) compares
        server_distill: bool = boolean(True)  # [P]; FedGP Table 1 runs false (A.9)
        distill_epochs: int | None = one_of(None, {"type": "null"}, {"type": "integer", "minimum": 0})  # None: train.local_epochs [C]
        distill_lr: float = redefault(DistillParams, "distill_lr", 5e-5)  # [C] Adam at the clients' learning rate

    @classmethod
    def check_scenario(cls, scenario: dict[str, Any] | None, params: Any = None) -> None:
        if scenario and scenario.get("boundaries", "sync") != "sync":
            raise FedForgetError(
                f"method 'cfed' needs task boundaries (it keeps the previous task's model from the "
                f"moment a task changes, fedgp.md Sec. 5.1.1): scenario.boundaries={scenario['boundaries']!r}; allowed: sync"
            )

    # ---------------------------------------------------------------- server side
    def server_init(self, server: ServerContext) -> None:
        k = self.info.num_clients
        if server.public is None:
            raise FedForgetError(f"method '{self.name}' needs a public set, but the run has none (datasets[].public)")
        n = len(server.public.x)
        if n < k + 1:
            raise FedForgetError(
                f"method 'cfed' splits the public set into {k + 1} surrogate sets (one per client and the "
                f"server's), but it has {n} rows; allowed: at least {k + 1} rows (a larger public fraction)"
            )
        server.public.y = None  # unlabelled surrogate data
        self.parts = [p.to(server.public.x.device) for p in split_parts(n, k + 1, self.info.seed)]

    def server_task_begin(self, server: ServerContext) -> None:
        """Task t >= 1: the scores of w_{t-1} (server.model holds the global weights, the
        end of task t-1) on the public set, the reviewers' teacher for the whole task."""
        if server.task == 0:
            server.state.pop(TEACHER, None)
            return
        model, x, bs = server.model, server.public.x, self.info.train.eval_batch_size
        was = model.training
        model.eval()
        with torch.no_grad():
            z = torch.cat([old_scores(model, x[s : s + bs], server.task - 1) for s in range(0, len(x), bs)])
        model.train(was)
        server.state[TEACHER] = z

    def server_broadcast(self, server: ServerContext) -> dict[str, Any]:
        teacher = server.state.get(TEACHER)
        review = []
        if teacher is not None:
            t = self.info.train
            sampled = sample_clients(self.info.seed, server.round, self.info.num_clients, t.sample_rate)
            review = reviewers(self.info.seed, server.round, sampled, self.p.review_ratio)
        return {PUBLIC_X: server.public.x, PARTS: self.parts, TEACHER: teacher,
                REVIEWERS: frozenset(review), GLOBAL: server.global_params}  # fmt: skip

    def server_aggregate(self, server: ServerContext, uploads: Sequence[Upload]) -> None:
        super().server_aggregate(server, uploads)  # FedAvg's average
        if self.p.server_distill and self.epochs() > 0:
            server.state["cfed_distill_stats"] = self.distill_server(server, uploads)

    def epochs(self) -> int:
        e = self.p.distill_epochs
        return self.info.train.local_epochs if e is None else e

    def server_teacher(self, server: ServerContext, uploads: Sequence[Upload], rows: torch.Tensor) -> torch.Tensor:
        """Teacher logits on S_0: row j from teacher j mod M, teachers = the round's local
        models, then the broadcast global model (eval mode) [C]."""
        model, x = server.model, server.public.x[rows]
        teachers = [u.params for u in uploads] + [server.broadcast[GLOBAL]]
        out = None
        for i, params in enumerate(teachers[: len(rows)]):  # M > |S_0|: the first |S_0| teach
            sel = torch.arange(i, len(rows), len(teachers), device=x.device)
            model.load_state_dict(params)
            z = public_logits(model, x[sel], self.info.train.eval_batch_size)
            out = z.new_zeros(len(rows), z.shape[1]) if out is None else out
            out[sel] = z
        return out

    def distill_server(self, server: ServerContext, uploads: Sequence[Upload]) -> DistillStats:
        """kd_weight * (1) on the server's surrogate set, from the FedAvg average."""
        rows, model = self.parts[-1], server.model
        model.set_task(server.task)
        zt = self.server_teacher(server, uploads, rows)
        model.load_state_dict(server.global_params)
        w, t = float(self.p.kd_weight), self.p.temperature

        def batch_loss(idx: torch.Tensor, features: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            return w * soft_cross_entropy(logits, zt[idx], t)

        spec = replace(self.p, distill_epochs=self.epochs()).distill_spec(
            torch_seed(self.info.seed, server.round, SERVER_STREAM)
        )
        stats = distill(model, server.public.x[rows], None, spec, batch_loss)
        server.global_params = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return stats

    def server_metrics(self, server: ServerContext, uploads: Sequence[Upload]) -> dict[str, float]:
        review = server.broadcast.get(REVIEWERS, frozenset())
        out = {"reviewers": float(sum(u.cid in review for u in uploads))}
        stats = server.state.pop("cfed_distill_stats", None)
        if stats is not None:
            out.update(stats.as_metrics())
        return out

    # ---------------------------------------------------------------- client side
    def client_begin(self, ctx: ClientContext) -> None:
        s = self.scratch(ctx)
        b = ctx.broadcast
        s.review = b[TEACHER] is not None and ctx.cid in b[REVIEWERS]
        s.loss_sum, s.n = torch.zeros((), device=self.info.device), 0
        if not s.review:
            return
        s.part = b[PARTS][ctx.cid]
        s.gen = torch.Generator().manual_seed(torch_seed(self.info.seed, ctx.round, ctx.cid, ctx.task, REVIEW_STREAM))
        s.order, s.pos = torch.empty(0, dtype=torch.long), 0
        s.cols = None
        if self.p.review_classes == "old":
            sc = self.info.scenario
            s.cols = torch.tensor(sorted({c for cls in sc.task_classes[: ctx.task] for c in cls}), device=self.info.device)

    def surrogate_rows(self, s, m: int) -> torch.Tensor:
        """The next m rows of the reviewer's surrogate stream (successive keyed
        permutations of its part S_k), as public-set row indices."""
        while len(s.order) - s.pos < m:
            s.order = torch.cat([s.order[s.pos :], torch.randperm(len(s.part), generator=s.gen)])
            s.pos = 0
        idx = s.order[s.pos : s.pos + m].to(s.part.device)
        s.pos += m
        return s.part[idx]

    def review_loss(self, ctx: ClientContext, m: int) -> torch.Tensor:
        """L_rev on the reviewer's next m surrogate rows (differentiable in ctx.model)."""
        s, b = self.scratch(ctx), ctx.broadcast
        rows = self.surrogate_rows(s, m)
        z, zt = old_scores(ctx.model, b[PUBLIC_X][rows], ctx.task - 1), b[TEACHER][rows]
        if s.cols is not None:
            z, zt = z[:, s.cols], zt[:, s.cols]
        return self.p.kd_weight * soft_cross_entropy(z, zt, self.p.temperature)

    def client_step(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        s = self.scratch(ctx)
        if not s.review:  # a learner: FedAvg's step on its task data [C]
            return super().client_step(ctx, x, y)
        loss = self.review_loss(ctx, len(y))  # a reviewer: (1) on as many surrogate rows
        loss.backward()
        s.loss_sum += loss.detach()
        s.n += 1
        return loss

    def client_live_terms(self, ctxs: Sequence[ClientContext]) -> JoinedLive | None:
        """A stack's step: each reviewer's next surrogate rows (``surrogate_rows``, as many as
        its minibatch holds at that step) in place of its minibatch (``JoinedLive(replaces=
        True)``), its loss kd_weight * (1) against the teacher's scores of those rows (its
        mean over them), a learner's the task loss: ``client_step`` of each client alone.
        None in a round without reviewers (task 0): FedAvg's step."""
        scratches = [self.scratch(c) for c in ctxs]
        if not any(s.review for s in scratches):
            return None
        dev, p = self.info.device, self.p
        table = StepSums.shared(scratches, 1, dev, "stack")  # per client: its steps' review losses
        b = ctxs[0].broadcast
        review = torch.tensor([s.review for s in scratches], device=dev)
        cols = next((s.cols for s in scratches if s.review), None)  # one task: the same classes
        picked: dict[int, torch.Tensor] = {}  # the step's surrogate rows of each reviewer

        def rows(lo: int, hi: int, k: int, counts: Sequence[int]) -> list:
            out = []
            for j, n in zip(range(lo, hi), counts):
                if not scratches[j].review:
                    out.append(None)
                    continue
                picked[j] = self.surrogate_rows(scratches[j], n)
                out.append((b[PUBLIC_X][picked[j]], torch.zeros(n, dtype=torch.long, device=dev)))
            return out

        def live(lo: int, hi: int, w: dict[str, torch.Tensor], step: StepBatch) -> LiveStep:
            z, mask = step.logits, step.row_mask()
            zt = z.new_zeros(z.shape)  # the teacher's scores of each reviewer's rows
            for j in range(lo, hi):
                if j in picked:
                    r = picked.pop(j)
                    zt[j - lo, : len(r)] = b[TEACHER][r]
            if cols is not None:
                z, zt = z[..., cols], zt[..., cols]
            kd = p.kd_weight * (kd_rows(z, zt, p.temperature) * mask).sum(1) / mask.sum(1)
            rv = review[lo:hi]
            table[0, lo:hi] += kd.detach() * rv
            return LiveStep(total=torch.where(rv, kd, step.loss))

        return JoinedLive(live, rows, replaces=True)

    def client_end(self, ctx: ClientContext) -> Upload:
        up = super().client_end(ctx)
        s = self.scratch(ctx)
        if getattr(s, "stack", None) is not None and s.review:  # trained in a stack: its sums
            s.loss_sum, s.n = s.stack.column()[0], ctx.steps
        ctx.stats["review_share"] = float(s.review)
        if s.n:
            ctx.stats["review_loss"] = s.loss_sum.item() / s.n
        return up
