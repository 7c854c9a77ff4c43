"""FL+iCaRL: FedAvg whose clients learn with iCaRL (Rebuffi, Kolesnikov, Sperl, Lampert:
"iCaRL: Incremental Classifier and Representation Learning", CVPR 2017), the FL+CL baseline
of FedGP (papers/fedgp.md Sec. 5.1.1, Table 1 row FL+iCaRL, buffer 200). FedGP's code builds
its continual baselines on the Mammoth library: its ``models/icarl.py`` is the [C] reference
here (read, not run). Symbols as in the iCaRL paper; tags: [P] paper, [C] Mammoth's code,
[D] our decision.

Exemplars, client k, at the end of each task t (the TASK_END reply: the task's final global
model, eval mode, and the client's data of the task) [P Alg. 2]:
- the client's memory holds at most K = ``buffer_size`` rows; m = floor(K / s) per class,
  s = the number of classes the client has had data of so far [P: m = K / t; floor: C].
- ReduceExemplarSet [P Alg. 5]: each older class keeps the first m rows of its ordered list.
- ConstructExemplarSet [P Alg. 4]: for each class y of the task's data, with
  phi = the L2-normalised features (``model.features``; ``normalize``) of its n_y rows and
  mu = their mean, for k = 1 .. min(m, n_y)::

      p_k = argmin_{x not yet chosen} || mu - (phi(x) + sum_{j<k} phi(p_j)) / k ||

  (a chosen row is never chosen again [C: Mammoth adds 1e6 to it; the paper's P is a set];
  ties: the lowest row). mu is not re-normalised here [D: the paper re-normalises "the
  results of any operation on feature vectors"; Mammoth compares with the plain mean, and a
  re-normalised running mean would make 1/k irrelevant]. Float64 [D] (``shared.herding``).
- Stored in ``ctx.state["icarl"]`` (checkpointed): ``x`` (rows as the model sees them), ``y``,
  ``task``, ``rank`` (the row's position in its class's ordered list: Alg. 5 keeps rank < m)
  and ``seen`` (bool [C], the classes the client has had data of).

Training on task t [P Alg. 3]: the client's task data together with its exemplars. The
engine iterates the task data (its batches and step count, as FedAvg); each step appends
a share of the exemplars, a keyed permutation of them per local epoch split over the
epoch's steps (generator keyed (seed, round, client, task, 0x1CA0, epoch)), so every local
epoch passes once over D = task data + exemplars, as Mammoth's ``icarl_replay`` merges the
buffer into the task's training set [C]; the batches are then larger by |P| / steps [D].
Exemplars are augmented like the task's rows where the dataset declares an augmentation
(``ctx.augment_rows``: a new crop and flip at each step, keyed by the store index) [C:
Mammoth's ``icarl_replay`` (utils/buffer.py) refolds the buffer to uint8 images appended to
the training dataset's ``data``, so they pass through its train transform every epoch]; the
previous model's targets q are computed on the same augmented rows [C].
Loss, over the classes seen so far S_t = the classes of tasks 0 .. t (the scenario's; all
classes in a one-task run), with g = sigmoid(scores)::

    L = BCE(scores[:, S_t], target[:, S_t]),  target_y = q_y(x) = sigmoid(prev(x))_y  for y in tasks < t
                                             target_y = [y == y_i]                 for y in task t

(distillation targets on the old classes for every row, exemplars included, whose own label
then counts only through q [P Alg. 3, C]); task 0: one-hot targets only. ``reduction``: mean
over rows and classes [C: F.binary_cross_entropy_with_logits] | sum: over classes, mean over
rows [P: Alg. 3 sums over both; the mean over the minibatch rows is ours]. The scores are the
model's logits (per-task heads: each class's own task's head, ``TaskHeads.combined``; old heads
are frozen, so distillation through them trains the body only). Task-incremental streams
train the same loss, unmasked (Mammoth trains one model for both settings [C]; masking each
row to its task would drop the distillation term).
The previous model [P: Theta before the update] is the GLOBAL model at the end of the
previous task [D], in eval mode [C: Mammoth's old_net = deepcopy(net.eval())]: the server
keeps one copy (``server.state["icarl_prev"]``, checkpointed) and broadcasts it -- the model
every client received at that task end, which a real client would keep itself. Its outputs
are recomputed at each step, not stored [D; the same numbers: it is fixed, in eval mode].

Nearest-mean-of-exemplars classification (``eval_predict``) [P Alg. 1]: y* = argmin_y
|| phi(x) - mu_y ||, mu_y the (re-normalised [P]) mean of phi over class y's exemplars; the
scores are -|| phi(x) - mu_y ||^2 [C: Mammoth returns minus the squared distance]; a class
without a mean scores the row's lowest score minus 30 (finite, for the evaluator's loss).
How the means reach the server [D]: a client sends, per class, the sum of phi over its
exemplars and their count, computed on the current global model: at each task end (every
client with data in the task, after updating its exemplars) and after each round's
aggregation (every sampled client with exemplars, trained in the round or not: the ROUND_END
reply reads only the exemplars, ``round_end_untrained``), so the means follow the
representation, as the paper's prototypes do (Sec. 2.1: computed from the exemplars with the
current features; Mammoth recomputes them at each evaluation). The server keeps each client's latest report with its
round; mu_y = sum of the sums / sum of the counts over the clients whose report for y is the
newest one of any client holding y (so no mean mixes features of two models; with all
clients sampled, the current model's). Within a task, the task's own classes have no
exemplars yet, so NME scores only the older classes until the task ends (as Mammoth would
mid-task); the accuracy matrix rows are taken at task ends, after the exemplar update.
Before the first task end (no means): the model's logits [D]. Only the server's model (the
global weights the means belong to) is scored by NME; another model (a client's local model,
``local_models_global_test_acc``) by its logits [D]. ``eval_counts`` adds ``logits``: the
network's own sigmoid classifier (arg-max of the logits, the task's classes in task-IL) at
every evaluation, beside NME's accuracy.

FedGP over iCaRL (``{name: fedgp, params: {base: icarl}}``) [D]: FedGP computes its reference
gradient on iCaRL's exemplars (``replay``: the store read as a replay buffer, as FedGP reads
A-GEM's and DER's buffers: one memory M^k per client, fedgp.md Alg. 5-6, "a buffer size of
200 ... whenever methods require it"), so FedGP's buffer size is iCaRL's ``buffer_size``;
there is no reference gradient until the first task end (no exemplars yet). FedGP's code has
no iCaRL (its public repository lists FedAvg, FedCurv, FedProx, A-GEM, DER): unchecked.

Streams: split (class-IL, task-IL; shared or per-task heads) and one-task runs. Refused:
domain-incremental streams (``scenario.kind`` rotated / permuted / domains: iCaRL is "incompatible
with Domain-IL" [P fedgp.md Table 1]; new classes do not arrive there) and asynchronous task
boundaries (``scenario.boundaries``: iCaRL needs task boundaries to snapshot the model and
update its exemplars [P fedgp.md Sec. 5.1.1]; a window would mix old and new classes).

Hyperparameters: ``buffer_size`` K = 200 rows per client [P fedgp.md Sec. 5.1.1 and Table 1
caption: "a buffer size of 200"; the iCaRL paper's 2000 is for one learner on CIFAR-100];
``normalize`` = true (L2-normalised features for herding and NME [P iCaRL Sec. 2.1]; false:
raw features and plain means [C: Mammoth]); ``reduction`` = sum [P: Alg. 3; the project's
rule, METHODS.md: where paper and code differ the default follows the paper] | mean [C:
Mammoth's loss, whose learning rates FedGP's CL baselines use; FedGP's public code has no
iCaRL, so which one its FL+iCaRL row ran cannot be checked].

Both trainers [D, issue 32]: a client alone takes ``client_step`` (``step_loss``); a stack
takes the same step as live terms over joined rows (``client_live_terms`` returning
``JoinedLive``): each client's share of its exemplars joins its minibatch in the stacked
forward (after its real rows; with BatchNorm, clients whose joined batches differ in size run
apart, so the statistics see each client's joined batch alone), the previous model scores the
stack's rows in one forward, and each client's loss is its mean over its rows. Per-task
heads: one client after another (the stacked step's logits are the active head's). FedGP over
iCaRL trains one client after another too (a plug-in's terms over a base's live terms are not
composed). Equal within 1e-5 (tests/methods/test_icarl.py: MLP, CNN task-IL, ResNet-8).

Diagnostics (``icarl_<key>``): ``exemplars`` (rows held after the round, mean over the round's
clients), ``mean_classes`` (classes with an NME mean on the server).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..data.scenario import DOMAIN_KINDS
from ..models import TaskHeads
from ..utils import FedForgetError, torch_seed
from .base import (
    ROUND_END,
    TASK_END,
    ClientContext,
    ClientShape,
    FedAvg,
    JoinedLive,
    LiveStep,
    RunInfo,
    ServerContext,
    StepBatch,
    Upload,
    frozen_model,
    masked_logits,
)
from .params import boolean, choice, integer
from .registry import METHODS
from .replay import Replay, Reservoir
from .shared import (
    class_means,
    class_report,
    embed_rows,
    herding,
    keep_reports,
    nme_scores,
    on_stack,
    report_bytes,
    rows_mean,
)

if TYPE_CHECKING:  # pragma: no cover
    from ..train_spec import TrainSpec

EXEMPLAR_STREAM = 0x1CA0  # keyed randomness: the order exemplars join the steps of an epoch
KEY = "icarl"  # ctx.state: the exemplar store
PREV, FEATS = "icarl_prev", "icarl_feats"  # server.state: previous model, clients' feature sums
ROWS = ("x", "y", "task", "rank")  # the store's per-row tensors
REDUCTIONS = ("mean", "sum")


# ----------------------------------------------------------------------------- the parts


def reduce_exemplars(store: dict[str, torch.Tensor], m: int) -> dict[str, torch.Tensor]:
    """ReduceExemplarSet [P Alg. 5]: the rows of ``store`` whose rank in their class's
    ordered list is below m (the first m of each class)."""
    keep = store["rank"] < m
    return {k: store[k][keep] for k in ROWS}


def icarl_targets(
    y: torch.Tensor, q: torch.Tensor | None, old: torch.Tensor, num_classes: int
) -> torch.Tensor:
    """[B, C]: the previous model's sigmoid outputs ``q`` on the old classes (bool ``old``
    [C]), one-hot labels elsewhere [P Alg. 3]; one-hot everywhere without a previous model."""
    target = F.one_hot(y, num_classes).to(torch.float32)
    if q is None:
        return target
    return torch.where(old.unsqueeze(0), q.to(target.dtype), target)


def icarl_loss(
    scores: torch.Tensor, target: torch.Tensor, seen: torch.Tensor, reduction: str, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Sigmoid binary cross-entropy of ``scores`` against ``target`` on the classes ``seen``
    (bool [C]): mean over rows and classes (mean) or summed over classes, mean over rows (sum).
    A stack's (scores and target [G, m, C], ``mask`` [G, m] 1.0 on each client's real rows):
    each client's, [G]."""
    bce = F.binary_cross_entropy_with_logits(scores[..., seen], target[..., seen], reduction="none")
    if mask is None:
        return bce.mean() if reduction == "mean" else bce.sum(1).mean()
    per_row = bce.mean(-1) if reduction == "mean" else bce.sum(-1)
    return rows_mean(per_row, mask)


class ExemplarView(Reservoir):
    """The exemplar store in a client's state read as a replay buffer (rows ``x``, ``y``,
    ``task``), for FedGP's reference gradient over iCaRL; iCaRL alone never reads it.
    Read-only: herding, not reservoir offers, fills it."""

    def __init__(self, key: str = KEY) -> None:
        super().__init__(0, key)

    def size(self, state: dict[str, Any]) -> int:
        st = state.get(self.key)
        return 0 if st is None else len(st["y"])

    def seen(self, state: dict[str, Any]) -> int:
        return self.size(state)

    def rows(self, state: dict[str, Any]) -> dict[str, torch.Tensor]:
        st = state.get(self.key)
        return {} if st is None else {k: st[k] for k in ("x", "y", "task")}

    def sample(
        self, state: dict[str, Any], m: int, generator: torch.Generator
    ) -> dict[str, torch.Tensor] | None:
        """min(m, size) exemplars drawn uniformly without replacement (CPU ``generator``)."""
        n = self.size(state)
        if n == 0:
            return None
        st = state[self.key]
        idx = torch.randperm(n, generator=generator)[:m].to(st["y"].device)
        return {k: st[k][idx] for k in ("x", "y", "task")}

    def offer(self, *args: Any, **kwargs: Any) -> int:
        raise TypeError("iCaRL's exemplars are chosen by herding at task ends, not offered")

    def offer_budget(self, ctx: ClientContext, train: TrainSpec) -> int:
        return 0


@METHODS.register("icarl")
class ICaRL(FedAvg):
    name = "icarl"
    one_task_per_class = True  # its exemplar sets and class means are per task's new classes
    # [D] the step (its rows and its share of the exemplars in one forward, distilled against
    # the previous model) is live terms over joined rows (``client_live_terms``, ``JoinedLive``)
    # beside ``client_step`` for a client alone; each step's share is cut on the host
    live_terms = True
    capturable_terms = False
    own_upload = True
    own_predict = True
    exchanges = (TASK_END, ROUND_END)  # exemplars at a task end, class means each round
    round_end_untrained = True  # the class-mean report reads the exemplars, not the round's rows

    @dataclass(frozen=True)
    class Params:
        buffer_size: int = integer(200, minimum=0)  # K exemplars per client [P, fedgp.md]
        normalize: bool = boolean(True)  # L2-normalised features [P] | raw [C]
        reduction: str = choice("sum", REDUCTIONS)  # BCE summed over classes, mean over rows [P] | mean over both [C]

    @classmethod
    def check_scenario(cls, scenario: dict[str, Any] | None, params: Any = None) -> None:
        """Split streams and one-task runs; not domain-incremental streams, nor asynchronous
        task boundaries."""
        if not scenario:
            return
        kind = scenario.get("kind", "none")
        if kind in DOMAIN_KINDS:
            raise FedForgetError(
                f"method 'icarl' is not defined for domain-incremental streams (every task holds every class; "
                f"FedGP Table 1: iCaRL is incompatible with Domain-IL): scenario.kind={kind!r}; allowed: split, none"
            )
        b = scenario.get("boundaries", "sync")
        if b != "sync":
            raise FedForgetError(
                f"method 'icarl' needs task boundaries (it snapshots the model and updates its exemplars at "
                f"each task end): scenario.boundaries={b!r}; allowed: sync"
            )

    @classmethod
    def client_kept_bytes(cls, params: Any, shape: ClientShape) -> int | None:
        """Its exemplars: at most ``buffer_size`` rows (m per class, m = floor(K / s) for
        its s classes), each x (as the model sees it), y, task and rank (int64); ``seen``, a
        bool per class; and its class report, which the server keeps (``report_bytes``)."""
        report = report_bytes(shape)
        exemplars = min(params.buffer_size, shape.rows) * (shape.row_bytes + 3 * 8) + shape.num_classes
        return None if report is None else exemplars + report

    def __init__(self, params: Any, info: RunInfo) -> None:
        super().__init__(params, info)
        sc = info.scenario
        if sc is not None:
            window = (
                None
                if sc.window is None
                else dict(zip(("samples_per_window", "window_rounds"), sc.window))
            )
            self.check_scenario({"kind": sc.kind, "boundaries": window or "sync"}, params)
        # each class's task (split streams); classes in no task never count as seen
        never = 1 << 30
        task_of_class = torch.full(
            (info.num_classes,), never if sc is not None else 0, dtype=torch.long
        )
        if sc is not None:
            for t, cls in enumerate(sc.task_classes):
                task_of_class[cls] = t
        self.task_of_class = task_of_class.to(info.device)
        # the exemplars as a replay buffer: what FedGP over iCaRL reads for g_ref
        self.replay = Replay(info, 0, EXEMPLAR_STREAM, key=KEY)
        self.replay.buffer = ExemplarView(KEY)

    # ---------------------------------------------------------------- features
    def features(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """phi(x): the model's penultimate features, L2-normalised (``normalize``)."""
        z = model.features(x).flatten(1)
        return F.normalize(z, dim=1) if self.p.normalize else z

    def embed(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """phi of the rows ``x`` in eval mode (``shared.embed_rows``)."""
        return embed_rows(model, x, self.p.normalize)

    def feature_report(self, ctx: ClientContext) -> dict[str, torch.Tensor]:
        """Per class: the sum of phi over the client's exemplars and their count, on
        ``ctx.model`` (the current global weights; ``shared.class_report``)."""
        st = ctx.state[KEY]
        report = class_report(self.embed(ctx.model, st["x"]), st["y"], self.info.num_classes)
        st["refreshed"] = ctx.round
        return report

    # ---------------------------------------------------------------- server side
    def server_broadcast(self, server: ServerContext) -> dict[str, Any]:
        prev = server.state.get(PREV)
        return {} if prev is None else {PREV: prev}

    def server_collect(self, exchange: str, server: ServerContext, replies: dict[int, Any]) -> None:
        """TASK_END: the task's final global model becomes the previous model; both
        exchanges: the clients' feature sums (on the global model, after an exemplar update)
        replace their older ones."""
        if exchange == TASK_END:
            server.state[PREV] = {k: v.detach().clone() for k, v in server.global_params.items()}
        keep_reports(server.state.setdefault(FEATS, {}), replies, server.round)

    def server_metrics(self, server: ServerContext, uploads: Sequence[Upload]) -> dict[str, float]:
        cm = class_means(server.state.get(FEATS) or {}, self.p.normalize, server.device)
        return {} if cm is None else {"mean_classes": float(cm[1].sum())}

    def eval_predict(
        self, server: ServerContext, model: nn.Module, x: torch.Tensor, task: int | None
    ) -> torch.Tensor:
        """NME scores (Alg. 1) on the server's model once class means exist; else logits."""
        cm = None
        if model is server.model:
            cm = class_means(server.state.get(FEATS) or {}, self.p.normalize, x.device)
        if cm is None or not bool(cm[1].any()):
            return model.logits(x, task)  # type: ignore[operator]
        return nme_scores(self.features(model, x), *cm)

    def eval_counts(
        self, server: ServerContext, model: nn.Module, x: torch.Tensor, y: torch.Tensor, task: int
    ) -> dict[str, torch.Tensor]:
        """``logits``: rows the network's own classifier gets right (task-IL: the task's
        head and classes)."""
        sc = self.info.scenario
        aware = sc is not None and sc.task_aware
        logits = model.logits(x, task if aware else None)  # type: ignore[operator]
        if sc is not None and sc.masked:
            logits = masked_logits(logits, sc.class_mask(x.device)[task])
        return {"logits": (logits.argmax(1) == y).sum()}

    # ---------------------------------------------------------------- client side
    def client_begin(self, ctx: ClientContext) -> None:
        s = self.scratch(ctx)
        st = ctx.state.get(KEY)
        s.rows = (st["x"], st["y"]) if st is not None and len(st["y"]) else None
        n = len(ctx.data) if ctx.data is not None else ctx.n_samples
        s.steps_per_epoch = self.info.train.epoch_steps(n, ctx.batch_size)  # the engine's steps per local epoch
        s.epoch, s.perm = -1, None
        s.old = self.task_of_class < ctx.task
        s.seen = self.task_of_class <= ctx.task
        prev = ctx.broadcast.get(PREV)
        s.prev = None
        if ctx.task > 0 and prev is not None:
            s.prev = frozen_model(ctx, "icarl_prev")  # a reusable frozen model, loaded per client
            s.prev.load_state_dict(prev)
            if isinstance(s.prev.head, TaskHeads):
                s.prev.head.active = ctx.task  # old classes scored by their own heads

    def exemplar_batch(self, ctx: ClientContext, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Local step ``k``'s (default ``ctx.steps``) share of the exemplars: rows lo..hi of the
        epoch's permutation, augmented as the step's own rows are (``ctx.augment_rows``).
        Called once per step, in step order."""
        s = self.scratch(ctx)
        if s.rows is None:
            return None
        k = ctx.steps if k is None else k
        n = len(s.rows[1])
        epoch, j = divmod(k, s.steps_per_epoch)
        if epoch != s.epoch:
            key = torch_seed(self.info.seed, ctx.round, ctx.cid, ctx.task, EXEMPLAR_STREAM, epoch)
            s.perm = torch.randperm(n, generator=torch.Generator().manual_seed(key)).to(
                s.rows[1].device
            )
            s.epoch = epoch
        lo, hi = j * n // s.steps_per_epoch, (j + 1) * n // s.steps_per_epoch
        if hi <= lo:
            return None
        idx = s.perm[lo:hi]
        return ctx.augment_rows(s.rows[0][idx], idx, EXEMPLAR_STREAM, k), s.rows[1][idx]

    def client_step(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One forward on the step's rows and its share of the exemplars: ``step_loss``, differentiated."""
        loss = self.step_loss(ctx, x, y)
        loss.backward()
        return loss

    def step_loss(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Alg. 3 on the step's rows and its share of the exemplars."""
        s = self.scratch(ctx)
        mem = self.exemplar_batch(ctx)
        if mem is not None:
            x, y = torch.cat([x, mem[0].to(x.dtype)]), torch.cat([y, mem[1]])
        scores = ctx.model.logits(x)  # per-task heads: each class's newest (TaskHeads.combined)
        q = None
        if s.prev is not None:
            with torch.no_grad():
                q = torch.sigmoid(s.prev.logits(x))
        target = icarl_targets(y, q, s.old, self.info.num_classes)
        return icarl_loss(scores, target, s.seen, self.p.reduction)

    def client_live_terms(self, ctxs: Sequence[ClientContext]) -> JoinedLive:
        """Alg. 3 for a stack of clients: each client's step rows and its share of the
        exemplars (``exemplar_batch``) joined in one forward (``JoinedLive``), the sigmoid BCE
        of their logits against the previous model's outputs on the old classes (one forward
        over the stack's rows) and one-hot labels elsewhere, on the seen classes, each
        client's mean over its rows: ``step_loss`` of a client alone (``icarl_targets``, the
        BCE of ``icarl_loss``)."""
        s0 = self.scratch(ctxs[0])
        prev, old, seen, c = s0.prev, s0.old, s0.seen, self.info.num_classes  # the same for every client

        def rows(lo: int, hi: int, k: int) -> list:
            return [self.exemplar_batch(ctx, k) for ctx in ctxs[lo:hi]]

        def live(lo: int, hi: int, w: dict[str, torch.Tensor], step: StepBatch) -> LiveStep:
            q = None
            if prev is not None:
                with torch.no_grad():
                    q = torch.sigmoid(on_stack(prev.logits, step.x)).flatten(0, 1)
            target = icarl_targets(step.y.flatten(), q, old, c).view(*step.y.shape, c)
            return LiveStep(total=icarl_loss(step.logits, target, seen, self.p.reduction, step.row_mask()))

        return JoinedLive(live, rows)

    def client_end(self, ctx: ClientContext) -> Upload:
        up = super().client_end(ctx)
        st = ctx.state.get(KEY)
        ctx.stats["exemplars"] = float(len(st["y"])) if st is not None else 0.0
        return up

    def client_reply(self, exchange: str, ctx: ClientContext) -> dict[str, torch.Tensor] | None:
        """TASK_END: the exemplar update (``update_exemplars``); ROUND_END: the feature sums
        of the client's exemplars on the new global model (None before its first task end,
        or where its task end already sent them this round)."""
        if exchange == TASK_END:
            return self.update_exemplars(ctx)
        st = ctx.state.get(KEY)
        if st is None or st.get("refreshed") == ctx.round:
            return None
        return self.feature_report(ctx)

    def update_exemplars(self, ctx: ClientContext) -> dict[str, torch.Tensor]:
        """Alg. 2's exemplar update (Alg. 5, then Alg. 4 for the task's classes) on the
        task's final global model; returns the feature sums for the class means."""
        x, y = ctx.data.all()
        c = self.info.num_classes
        st = ctx.state.get(KEY)
        seen = torch.bincount(y, minlength=c) > 0
        if st is not None:
            seen = seen | st["seen"]
        m = self.p.buffer_size // max(int(seen.sum()), 1)
        new_classes = torch.unique(y)
        parts: list[dict[str, torch.Tensor]] = []
        if st is not None:
            kept = reduce_exemplars(st, m)
            again = torch.isin(kept["y"], new_classes)  # a class seen again is rebuilt [D]
            parts.append({k: v[~again] for k, v in kept.items()})
        if m > 0 and len(y):
            pick, rank = herding(self.embed(ctx.model, x).double(), y, new_classes.tolist(), m)
            parts.append({"x": x[pick], "y": y[pick], "task": torch.full_like(pick, ctx.task), "rank": rank})
        if parts:
            store = {k: torch.cat([p[k] for p in parts]) for k in ROWS}
        else:
            store = {
                "x": x[:0], "y": y[:0], "task": y[:0].clone(), "rank": y[:0].clone(),
            }  # fmt: skip
        ctx.state[KEY] = {**store, "seen": seen, "refreshed": -1}
        return self.feature_report(ctx)
