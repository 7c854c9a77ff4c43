"""TARGET: federated class-continual learning by exemplar-free distillation (Zhang, Chen,
Zhuang, Lyu, ICCV 2023; the authors' code zj-jayzhang/Federated-Class-Continual-Learning,
``methods/target.py``), a baseline of FedProTIP's Tables 1-3 (papers/fedprotip.md Sec. 6,
App. E.3). Tags: [P] paper, [C] authors' code, [D] our decision. The TARGET paper's body was
not readable through this project's search tools (only its abstract); where it and the code
may differ, the code is what is followed and tagged [C].

Local training, task t (client k, minibatch (x, y) of its data) [P: CE on the new task plus
knowledge distillation from the previous global model on synthetic data; C ``_local_finetune``]::

    L = CE(z_task(x), y) + kd * KL( softmax(T_old(x^)[:, old] / tau) || softmax(f(x^)[:, old] / tau) )

- CE: ``ce: task`` [C]: over the classes of the row's task (the code scores its new classes
  alone, ``output[:, known:]``; in task 0 its classifier has only task 0's classes); in
  domain-incremental streams every class is the task's. ``ce: all``: every class [D].
- x^: synthetic pool rows at every local step, by ``replay_rule`` (randomness keyed (seed,
  round, client, task, 0xB1)); ``replay_batch`` > 0 fixes the rows per step under either:

  - ``steps`` (default) [D]: max(1, floor(syn_size / the client's own steps per epoch)) rows,
    a fresh uniform draw without replacement at every step; every epoch runs all of the
    client's minibatches.
  - ``code`` [C ``get_syn_data_loader``, ``_local_finetune``]: int(syn_size / iters) rows
    with the nominal, dataset-wide step count ``iters = ceil(dataset_size / (num_users *
    tasks * local_bs))`` (dataset_size: here the training split's rows, the code's constant
    per dataset, 50,000 for CIFAR-100; num_users: every client); each epoch shuffles the
    pool once and takes it batch by batch (the last one short), and the epoch zips the
    private and synthetic loaders, so it stops after min(private minibatches, ceil(pool /
    rows)) steps (``ClientContext.epoch_steps``; diagnostic ``target_epoch_steps``).

  Per local epoch of a client with 1,000 rows of a CIFAR-100 task (FedProTIP's layout: 5
  clients, 10 tasks, batch 64; a pool of 10 x 256 = 2,560 rows, syn_size 8,000): ``steps``
  trains 16 private minibatches with 500 pool rows each (8,000 replayed rows); ``code``
  has iters = 16, so 500 rows per step, and stops after ceil(2,560 / 500) = 6 steps (384
  private rows, 2,560 replayed). Measured cost on digits: docs/benchmarks.md
  (``benchmarks/continual_cost.py``, methods ``target`` and ``target_code``). In task 0 (no
  pool yet) the loss is the CE alone and every epoch is whole under both rules [C].
- x^ = A(pool rows): the drawn rows pass through the dataset's train augmentation (its
  ``augment`` block: keyed crop and flip, ``ctx.augment_rows`` with the pool index of each
  row and the stream 0xB1; a new crop at every step) [C: the code reads the pool through
  ``train_transform``, RandomCrop(pad 4) + horizontal flip, ``get_syn_data_loader``]; the
  identity where the dataset declares none. The padding is the dataset's ``augment.pad``
  (the code's 4 on CIFAR), with zeros in model-input space as the private rows'
  augmentation here (the code pads black pixels before normalising) [D].
- T_old: the global model at the end of the task that made the pool (the previous one)
  [C ``after_task``: ``_old_network``], frozen, in eval mode, scoring the same augmented
  rows x^ the student sees, without gradient, on the client [C ``_local_finetune``: the
  teacher's forward on ``syn_input``]. Its weights travel with the pool (``pool["teacher"]``,
  the task's final global weights, in server.state and every broadcast); each client
  loads them into one cached frozen copy of the model (as iCaRL's previous model). Without
  augmentation this is the KD of the teacher's logits on the pool rows as made, up to
  float rounding of the batch forward. ``old``: the classes learned up to that task.
- KL with temperature tau = ``temperature`` (2 [C]), batch mean, without a tau^2 factor: the
  code's ``_KD_loss`` is the soft-target cross-entropy, KL + the teacher's entropy, whose
  gradient this equals. kd = 25 [C README: --kd=25].
- The replayed rows go through the model in training mode (BatchNorm statistics see them)
  [C]; with per-task heads each class is scored by its newest head (earlier heads frozen).

Server, after the aggregation of task t's last round, for t < T - 1 (nothing later learns from
the last task's pool [C]): a generator trained data-free against the global model
(``synthesis.py``: L_gen = bn L_BN + oh CE + adv L_adv, meta-learned generator, student for
the boundary term) gives ``syn_size`` rows; the pool (rows, the generator's targets, the
teacher's weights) replaces the previous one in server.state["target_pool"] [C: the code's
clients read task_{t-1}'s images only] and goes to every client with each round's broadcast.
The generator's images in [0, 1] are normalised as the clients' data pipeline normalises
stored images (its per-channel mean / std: dataset constants, ``RunInfo.normalize``; no
rows), and used as they are where the data are (digits) [C: the code's
dataset normaliser]. The generator exists only during the task end (the code builds a new
one per task); what persists is the pool.
Models without BatchNorm (the small CNNs): the L_BN term is dropped [D] (diagnostic
``target_bn_layers`` = 0 and a warning); CE and the boundary term still shape the pool.

Prediction [C ``IncrementalNet.update_fc``: the classifier grows with the tasks]: in
task-agnostic evaluation, classes of tasks not yet started score the row's lowest learned
logit minus 30 (finite, so the test loss stays finite); task-aware evaluation is unchanged.

Hyperparameters (defaults; [P] fedprotip.md App. E.3, [C] the code's CIFAR-100 block):
``kd`` 25 [C], ``temperature`` 2 [C], ``ce`` task [C], ``replay_batch`` 0 (auto) [C], ``replay_rule`` steps [D],
``syn_size`` 8000 [P, C --nums], ``syn_batch`` 256 [P, C], ``syn_rounds`` 10 [C], ``g_steps``
10 [C], ``warmup`` 20 [C: with 10 rounds the student and the boundary term never start, as in
the code's CIFAR-100 setting], ``lr_g`` 0.002 [C], ``lr_z`` 0.01 [C], ``nz`` 256 [C], ``ngf`` 64
[C], ``bn`` 10 [C], ``oh`` 0.5 [C], ``adv`` 1 [C], ``bn_momentum`` 0.9 [C], ``meta`` fomaml [C
cifar100; reptile: the code's other datasets], ``reset_l0`` true [C], ``student_steps`` 400 [C
kd_steps], ``student_batch`` 256 [C], ``student_lr`` 0.2 (SGD, momentum 0.9, wd 1e-4, cosine to
2e-4 over 200 rounds) [C], ``student_temperature`` 20 [C], ``student_init`` model [D; code: the
code's weight_init, see synthesis.py], ``augment`` false [D].
FedProTIP's settings [P App. E.3]: DomainNet 12,800 rows in batches of 64, 200 rounds of 100
steps; ImageNet-R 12,800 rows, batches of 64, 40 rounds of 40 steps.

With the defaults a pool holds 10 x 256 = 2,560 rows (``syn_size`` is a cap, as the code's
nums); FedProTIP's 8k rows in batches of 256 take ``syn_rounds`` >= 32. FedProTIP's own code
(seohyeon-cha/FedProTIP server_target.py, client_target.py) runs 40 rounds of 40 generator
steps with ``warmup`` 10 on CIFAR-100 (a 10,000-row cap), and replays one pool batch beside
each private minibatch (``replay_rule: code``, ``replay_batch`` = its syn_bs: 256, 128 at 224
px, 64 outside CIFAR-100, where it also sets lr_g 2e-4, oh 0.1, bn 0.1, student temperature 5,
Reptile, no reset, student batches of 64): the FedProTIP paper configs' TARGET.

Not reproduced [D]: the code's local SGD (lr 0.01, momentum 0.9, weight decay 5e-4, a
constant rate: the cosine schedule in its code is the server student's, not the clients')
is a train setting, not the method's (``train.optimizer``); the data's augmentation is the
dataset's setting (``dataset.augment``), which the replayed synthetic rows follow as the
code's do.

Both trainers run one client step [D, issue 32]: the KD is a step term that sees the step
(``client_step_terms``; a client alone is a stack of one, computing what this file computed
before, bit for bit: ``benchmarks/fingerprints.py``), the CE's classes are data
(``label_classes``), and the code rule's cut epochs are the stacked trainer's too
(``ClientJob.epoch_steps``). Stacked, each client draws and augments its own synthetic rows
(its generator, its step), they go through the stack's weights as one padded batch
(``StepBatch.features_logits``: each client's BatchNorm statistics see its own rows, each
class scored by its newest head), and the teacher scores every client's rows in one forward;
each client's KD is the mean over its rows. The draws are host work at every step, so these
steps run eagerly on a GPU (``capturable_terms = False``). Equal to one client after another
within 1e-5 (tests/methods/test_target.py: MLP, CNN, ResNet-8, per-task heads, both rules).

Diagnostics (``target_<key>``): clients ``kd`` (mean KL over steps); at a task end
``bn_layers``, ``gen_loss_first`` / ``gen_loss_last`` (mean L_gen of the first / last round),
``pool_rows``, ``pool_target_acc`` (share of pool rows the teacher puts in their target
class), ``student_kd_last`` (when the student trained).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ..models import TaskHeads
from ..utils import FedForgetError
from .base import (
    TASK_END,
    ClientContext,
    FedAvg,
    RunInfo,
    ServerContext,
    StepBatch,
    StepTerms,
    Upload,
    frozen_copy,
    frozen_model,
)
from .distill import softened_kl, softened_kl_stacked
from .params import boolean, choice
from .registry import METHODS
from .shared import StepSums, floor_unscored, padded, rows_mask
from .synthesis import (
    SynthesisParams,
    Synthesizer,
    features_and_logits,
    keyed_generator,
    score_pool,
)

log = logging.getLogger(__name__)

REPLAY_STREAM = 0xB1  # keyed randomness of the clients' synthetic batches (rows, crops)
TEACHER = "teacher"  # pool key: the weights of the global model that made the pool
METAS = ("fomaml", "reptile")
REPLAY_RULES = ("steps", "code")


def target_replay_rows(replay_batch: int, syn_size: int, n_pool: int, n_samples: int, batch_size: int) -> int:
    """Synthetic rows per local step of a client with ``n_samples`` rows (``replay_rule:
    steps`` [D]): ``replay_batch``, or floor(syn_size / the client's steps per epoch), at
    most the pool's ``n_pool`` rows and at least 1."""
    if replay_batch:
        return min(replay_batch, n_pool)
    steps = max(1, math.ceil(n_samples / batch_size))
    return min(n_pool, max(1, syn_size // steps))


def code_replay_rows(replay_batch: int, syn_size: int, n_pool: int, dataset_rows: int, clients: int,
                     tasks: int, batch_size: int) -> int:  # fmt: skip
    """Synthetic rows per local step under ``replay_rule: code`` [C ``get_syn_data_loader``]:
    ``replay_batch``, or int(syn_size / iters) with the nominal, dataset-wide step count
    iters = ceil(dataset_rows / (clients * tasks * batch_size)); at most the pool's ``n_pool``
    rows (a loader's batch larger than its dataset is the whole dataset) and at least 1."""
    if replay_batch:
        return min(replay_batch, n_pool)
    iters = math.ceil(dataset_rows / (clients * tasks * batch_size))
    return min(n_pool, max(1, int(syn_size / iters)))


@METHODS.register("target")
class TARGET(FedAvg):
    name = "target"
    one_task_per_class = True  # each class's owner task (its synthetic rows' task, the seen classes)
    # [D] the KD on each step's synthetic batch is a step term that sees the step (its rows go
    # through the step's weights): both trainers run it (``client_step_terms``); the code
    # rule's cut epochs (epoch_steps) the stacked trainer cuts as a client alone does
    step_terms = True
    sees_step = True
    capturable_terms = False  # each step draws its rows and crops on the host
    own_upload = True
    own_predict = True
    exchanges = (TASK_END,)
    synthesizer: type[Synthesizer] = Synthesizer

    @dataclass(frozen=True)
    class Params(SynthesisParams):
        meta: str = choice("fomaml", METAS)  # the generator's meta-learning [C cifar100] | reptile [C]
        reset_l0: bool = boolean(True)  # re-initialise its first layers at round 120 + warmup [C]
        # synthetic rows per step: syn_size / the client's steps per epoch, every epoch whole [D]
        # | the code's: syn_size / a nominal step count, the epoch cut when the pool runs out [C]
        replay_rule: str = choice("steps", REPLAY_RULES, added=True)

    @classmethod
    def table_note(cls, params: dict[str, Any]) -> str:
        """The replay rule that ran (issue 36: the tables say which); '' for a subclass
        without the switch (LANDER replays by its own rule)."""
        if "replay_rule" not in cls.Params.__dataclass_fields__:
            return ""
        rule = params.get("replay_rule", "steps")  # runs recorded before the switch: steps
        what = ("syn_size / the client's steps, whole epochs [D]" if rule == "steps"
                else "the code's syn_size / nominal steps, epochs cut [C]")  # fmt: skip
        return f"TARGET replay_rule={rule} ({what})"

    def __init__(self, params: Any, info: RunInfo) -> None:
        super().__init__(params, info)
        sc, n = info.scenario, info.num_classes
        self.task_classes = (
            [list(c) for c in sc.task_classes] if sc is not None else [list(range(n))]
        )
        self.split = sc is not None and sc.kind == "split"
        # class -> its task (split streams: each class is in one task)
        owner = torch.zeros(n, dtype=torch.long)
        mask = torch.zeros(len(self.task_classes), n, dtype=torch.bool)
        for t in reversed(range(len(self.task_classes))):
            owner[self.task_classes[t]] = t
            mask[t, self.task_classes[t]] = True
        self.class_task, self.class_mask = owner.to(info.device), mask.to(info.device)
        if params.ce == "task" and self.split:  # the CE over the classes of each row's task
            self.label_classes = self.class_mask[self.class_task]
        self.pool_key, self.stats_key = f"{self.name}_pool", f"{self.name}_synthesis"
        self.warned = False

    def learned(self, task: int) -> torch.Tensor:
        """The classes of tasks 0..task, sorted (long, on the device)."""
        seen = self.class_mask[: task + 1].any(0)
        return seen.nonzero().flatten()

    def model_init(self, model: nn.Module) -> None:
        """Refuse models of discrete inputs: a generator cannot synthesise token ids."""
        if any(isinstance(m, nn.Embedding) for m in model.modules()):
            raise FedForgetError(
                f"method '{self.name}' synthesises real-valued inputs; the model embeds token ids "
                "(nn.Embedding); allowed: image, tabular or sequence models with real-valued inputs"
            )

    # ---------------------------------------------------------------- server side
    def server_broadcast(self, server: ServerContext) -> dict[str, Any]:
        pool = server.state.get(self.pool_key)
        return {} if pool is None else {self.pool_key: pool}

    def make_synthesizer(self, server: ServerContext, teacher: nn.Module, classes: torch.Tensor,
                         normalize: Any = None) -> Synthesizer:  # fmt: skip
        return self.synthesizer(self.p, teacher, classes, self.info.input_shape, server.device,
                                (self.info.seed, server.task), normalize)  # fmt: skip

    def teacher_map(self) -> Callable[[nn.Module, torch.Tensor], torch.Tensor] | None:
        """What the KD reads of the teacher's features besides its logits, as a function
        (model, features) -> [rows, ...] (TARGET: nothing)."""
        return None

    def server_collect(self, exchange: str, server: ServerContext, replies: dict[int, Any]) -> None:
        t = server.task
        if t >= len(self.task_classes) - 1:
            return  # no later task learns from it [C]
        if self.info.input_shape is None:
            raise FedForgetError(f"method '{self.name}' needs the input shape (RunInfo.input_shape) to synthesise inputs")  # fmt: skip
        teacher = frozen_copy(server.model)
        head = getattr(teacher, "head", None)
        if hasattr(head, "active"):  # per-task heads: task t's (not set_task: the copy stays frozen)
            head.active = t
        classes = self.learned(t)
        res = self.make_synthesizer(server, teacher, classes, self.info.normalize).run()
        weights = {k: v.detach().clone() for k, v in server.global_params.items()}
        server.state[self.pool_key] = {"x": res.x, "y": res.y, "task": t, TEACHER: weights}
        logits = score_pool(teacher, res.x)[0]  # the diagnostic below
        agree = classes[logits[:, classes].argmax(1)] == res.y if len(res.x) else torch.zeros(0)
        server.state[self.stats_key] = {**res.stats, "pool_target_acc": float(agree.float().mean()) if len(agree) else math.nan}  # fmt: skip
        if not res.stats["bn_layers"] and not self.warned:
            self.warned = True
            log.warning("%s: the model has no BatchNorm layer; the BN-statistics term of the generator's loss is dropped", self.name)  # fmt: skip

    def server_metrics(self, server: ServerContext, uploads: Sequence[Upload]) -> dict[str, float]:
        return server.state.pop(self.stats_key, None) or {}

    def eval_predict(self, server: ServerContext, model: nn.Module, x: torch.Tensor, task: int | None) -> torch.Tensor:  # fmt: skip
        """Task-agnostic: classes of tasks not yet started score the row's lowest learned
        logit minus ``shared.OUTSIDE_GAP`` [C: the code's classifier has no outputs for them]."""
        scores = model.logits(x, task)  # type: ignore[operator]
        seen = self.class_mask[: server.task + 1].any(0)
        if task is not None or bool(seen.all()):
            return scores
        return floor_unscored(scores, seen)

    # ---------------------------------------------------------------- client side
    def client_reply(self, exchange: str, ctx: ClientContext) -> Any:
        """Nothing: the task end is the server's synthesis (``server_collect``), which takes
        the dataset's normalisation constants from ``RunInfo.normalize`` [D: they came in the
        clients' replies until 2026-12-06, and under asynchronous boundaries a task end with
        no client moved on left the pool unnormalised]."""
        return None

    def client_begin(self, ctx: ClientContext) -> None:
        s = self.scratch(ctx)
        pool = ctx.broadcast.get(self.pool_key)
        s.pool = pool if pool is not None and len(pool["x"]) else None
        s.sums = {}
        s.order = None  # replay_rule code: this epoch's order of the pool's rows
        if s.pool is not None:
            s.gen = keyed_generator(self.info.seed, ctx.round, ctx.cid, ctx.task, REPLAY_STREAM)
            n_pool = len(s.pool["x"])
            if self.code_rule:
                s.rows = self.code_rows(ctx, n_pool)
                # [C _local_finetune] zip(private loader, synthetic loader): an epoch stops
                # at the shorter; the synthetic one holds ceil(n_pool / rows) batches
                private = math.ceil(self.info.train.epoch_rows(ctx.n_samples, ctx.batch_size) / ctx.batch_size)
                ctx.epoch_steps = min(private, math.ceil(n_pool / s.rows))
                ctx.stats["epoch_steps"] = float(ctx.epoch_steps)
            else:
                s.rows = self.replay_rows(ctx, n_pool)
            s.old = self.learned(s.pool["task"])
            s.teacher = self.teacher(ctx, s.pool)

    @property
    def code_rule(self) -> bool:
        """Whether the clients replay by the code's rule (``replay_rule: code``)."""
        return getattr(self.p, "replay_rule", "steps") == "code"

    def code_rows(self, ctx: ClientContext, n_pool: int) -> int:
        """Synthetic rows per step by the code's rule (``code_replay_rows``): the nominal step
        count of the training split's rows over every client and task."""
        sc = self.info.scenario
        rows = len(ctx.data.data.x) if ctx.data is not None else ctx.n_samples
        return code_replay_rows(self.p.replay_batch, self.p.syn_size, n_pool, rows, self.info.num_clients,
                                sc.tasks if sc is not None else 1, ctx.batch_size)  # fmt: skip

    def teacher(self, ctx: ClientContext, pool: dict[str, Any]) -> nn.Module:
        """The pool's teacher: one frozen eval-mode copy of the model (``frozen_model``,
        reloaded for each client, as iCaRL's previous model) holding the weights that made
        the pool, scoring each class by its newest head up to the pool's task."""
        teacher = frozen_model(ctx, f"{self.name}_teacher")
        teacher.load_state_dict(pool[TEACHER])
        if isinstance(teacher.head, TaskHeads):
            teacher.head.active = pool["task"]
        return teacher

    def replay_rows(self, ctx: ClientContext, n_pool: int) -> int:
        """Synthetic rows per step (``target_replay_rows``)."""
        return target_replay_rows(self.p.replay_batch, self.p.syn_size, n_pool, ctx.n_samples, ctx.batch_size)

    def note(self, ctx: ClientContext, key: str, value: torch.Tensor) -> None:
        """Add a per-step diagnostic (mean over the round's steps at client_end)."""
        sums = self.scratch(ctx).sums
        total, n = sums.get(key, (0.0, 0))
        sums[key] = (total + value.detach(), n + 1)

    def synthetic_rows(self, ctx: ClientContext, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Local step ``k``'s synthetic batch: (pool rows ``idx``, their train augmentation
        ``x``: ``ctx.augment_rows``, the rows themselves without one). ``replay_rule``
        steps: a fresh draw at every step; code: the epoch's shuffled loader, one batch per
        step [C]. Called once per step, in step order (the client's generator)."""
        s = self.scratch(ctx)
        x_pool = s.pool["x"]
        if self.code_rule:  # the epoch's shuffled loader, one batch per step [C]
            j = k % ctx.epoch_steps
            if j == 0:
                s.order = torch.randperm(len(x_pool), generator=s.gen)
            idx = s.order[j * s.rows : (j + 1) * s.rows].to(x_pool.device)
        else:  # a fresh draw at every step
            idx = torch.randperm(len(x_pool), generator=s.gen)[: s.rows].to(x_pool.device)
        return idx, ctx.augment_rows(x_pool[idx], idx, REPLAY_STREAM, k)

    def synthetic_batch(self, ctx: ClientContext) -> SimpleNamespace | None:
        """This step's synthetic batch (``synthetic_rows``), the model's ``features`` and
        ``logits`` (every class) on it, and the teacher's, without gradient, on the same
        ``x``: ``t_logits`` and ``t_feats`` (``teacher_map``, None for TARGET); None before
        the first pool. A client alone (LANDER's step)."""
        s = self.scratch(ctx)
        if s.pool is None:
            return None
        idx, x = self.synthetic_rows(ctx, ctx.steps)
        features, logits = features_and_logits(ctx.model, x)
        with torch.no_grad():
            t_logits, t_feats = score_pool(s.teacher, x, self.teacher_map())
        return SimpleNamespace(idx=idx, x=x, features=features, logits=logits,
                               t_logits=t_logits, t_feats=t_feats)  # fmt: skip

    def kd_term(self, ctx: ClientContext, rep: SimpleNamespace) -> torch.Tensor:
        """KL(softmax(T_old / tau) || softmax(f / tau)) over the old classes, batch mean."""
        s = self.scratch(ctx)
        kd = softened_kl(rep.logits[:, s.old], rep.t_logits[:, s.old], self.p.temperature)
        self.note(ctx, "kd", kd)
        return kd

    def synthetic_stack(self, ctxs: Sequence[ClientContext], lo: int, hi: int, w: dict[str, torch.Tensor],
                        step: StepBatch) -> SimpleNamespace:  # fmt: skip
        """Step ``step.k``'s synthetic batch of each client of ``ctxs[lo:hi]``
        (``synthetic_rows``) through the stack's weights ``w`` (``StepBatch.features_logits``:
        training mode, each class by its newest head) and the pool's teacher (no gradient; one
        forward over every client's rows): ``features`` [a, m, F], ``logits`` [a, m, C],
        ``t_logits`` [a, m, C], ``t_feats`` [a, m, ...] (``teacher_map``; None for TARGET),
        ``mask`` [a, m], 1.0 on each client's real rows (a client alone: its rows, unpadded,
        ``mask`` None)."""
        teacher = self.scratch(ctxs[lo]).teacher  # one pool, so one teacher's weights, for every client
        xs = [self.synthetic_rows(c, step.k)[1] for c in ctxs[lo:hi]]
        with torch.no_grad():
            t_logits, t_feats = score_pool(teacher, xs[0] if len(xs) == 1 else torch.cat(xs), self.teacher_map())
        if len(xs) == 1:
            feats, logits = step.features_logits(w, xs[0].unsqueeze(0))
            return SimpleNamespace(features=feats, logits=logits, t_logits=t_logits.unsqueeze(0),
                                   t_feats=None if t_feats is None else t_feats.unsqueeze(0), mask=None)  # fmt: skip
        rows = [len(x) for x in xs]
        mask = rows_mask(rows, t_logits)
        feats, logits = step.features_logits(w, padded(xs, rows), rows)
        t_feats = None if t_feats is None else padded(list(t_feats.split(rows)), rows)
        return SimpleNamespace(features=feats, logits=logits, t_logits=padded(list(t_logits.split(rows)), rows),
                               t_feats=t_feats, mask=mask)  # fmt: skip

    def kd_stack(self, rep: SimpleNamespace, old: torch.Tensor) -> torch.Tensor:
        """[a]: each client's KD on its synthetic batch (``synthetic_stack``), the mean over
        its rows of KL(softmax(T_old / tau) || softmax(f / tau)) over the old classes
        (``softened_kl``'s for a client alone)."""
        tau = self.p.temperature
        if rep.mask is None:
            return softened_kl(rep.logits[0][:, old], rep.t_logits[0][:, old], tau).unsqueeze(0)
        return softened_kl_stacked(rep.logits[..., old], rep.t_logits[..., old], tau, rep.mask)

    def client_step_terms(self, ctxs: Sequence[ClientContext]) -> StepTerms | None:
        """From task 1, kd times the KD on each client's synthetic batch of the step
        (``synthetic_stack``, ``kd_stack``): the model's logits of every class (each by its
        newest head) on it, through the step's weights in training mode, against the pool's
        teacher's on the same rows, over the old classes, each client's mean over its rows;
        None in task 0 (the task's CE alone [C]). The CE itself is FedAvg's over each row's
        classes (``label_classes``)."""
        scr = [self.scratch(c) for c in ctxs]
        if scr[0].pool is None:  # one pool for every client: the round's broadcast
            return None
        sums = StepSums.shared(scr, 1, self.info.device, "step_sums")
        for s in scr:
            s.sum_keys = ("kd",)
        old = scr[0].old

        def terms(lo: int, hi: int, w: dict[str, torch.Tensor], step: StepBatch):
            kd = self.kd_stack(self.synthetic_stack(ctxs, lo, hi, w, step), old)
            sums[0, lo:hi] += kd.detach()
            return self.p.kd * kd, None, None

        return terms

    def client_end(self, ctx: ClientContext) -> Upload:
        up = super().client_end(ctx)
        s = self.scratch(ctx)
        for key, (total, n) in s.sums.items():
            ctx.stats[key] = float(total) / n
        if getattr(s, "step_sums", None) is not None and ctx.steps:  # the step terms' (a stack's)
            for key, total in zip(s.sum_keys, s.step_sums.values()):
                ctx.stats[key] = total / ctx.steps
        return up
