"""GLFC: Global-Local Forgetting Compensation (Dong, Wang, Fang, Sun, Xu, Wang, Zhu:
"Federated Class-Incremental Learning", CVPR 2022; code conditionWang/FCIL: GLFC.py,
ProxyServer.py, myNetwork.py, Fed_utils.py, option.py), a baseline of papers/fedgp.md
Table 1 and papers/fedprotip.md Tables 1-3. Tags: [P] paper, [C] authors' code, [D] ours.
The paper's parts are named by its section titles (its PDF was not at hand: the formulas
below are the paper's as its secondary descriptions give them, and agree with the authors'
code except where a difference is stated). LGA (``lga.py``) extends it.

Client k, task t (classes Y^t new, the classes of the tasks before t old, C^p of them):

1. Exemplar memory [P, C ``_construct_exemplar_set``]: at the end of each task
   (the TASK_END reply: the task's final global model, its data) the client keeps, for
   every class it learned, m = floor(memory_size / #classes it has learned) exemplars
   chosen by iCaRL herding on L2-normalised features (greedy: the k-th exemplar brings the
   mean of the first k closest to the class mean); older classes keep the first m of their
   herding order [C ``_reduce_exemplar_sets``]. [D] herding without repeats (the code may
   pick one image twice), so a class keeps min(m, its samples). Memory rows join local
   training as the code's mixed loader does [C]: each epoch visits every memory row once,
   a keyed permutation (seed, round, client, task, 0xC1) cut into one slice per minibatch
   and appended to it (the engine draws the current minibatches). Memory rows are augmented
   like the minibatch's own where the dataset declares an augmentation (``ctx.augment_rows``:
   a new crop and flip at each step) [C: the code's ``getTrainData`` puts the exemplar images
   into the training dataset's ``TrainData``, read through its ``train_transform``
   (RandomCrop padding 4, RandomHorizontalFlip, ColorJitter: fl_main.py; the ColorJitter is
   not reproduced, as for the private rows)]; the old model distils on the same rows [C].
2. Class-aware gradient compensation [P]: per row, G_i = P_{y_i}(x_i) - 1, the
   gradient of the loss at the true class's logit; w_i = |G_i| / G_bar, G_bar the mean |G|
   over the minibatch's rows of the same group (new classes, old classes) [P; C
   ``efficient_old_class_weight``], detached;  L_GC = mean_i w_i * CE_i.
   [P] the first task (all rows new) is weighted too; the code uses w = 1 there.
3. Class-semantic relation distillation [P; C ``_compute_loss``]: with the old model
   Theta^{t-1} (from the proxy server), the target Y_hat_i is the one-hot label over the seen
   classes whose old-class entries are replaced by the old model's probabilities over the
   old classes (its output layer holds only them [C]); L_RD = mean_i KL(Y_hat_i || P_i),
   taken literally (sum_c Y_hat log(Y_hat / P), 0 log 0 = 0): a new row's target sums to 2,
   which equals 2 KL to the normalised target up to a constant [D]. KL(P || Y_hat) (the
   order the paper writes) is infinite at Y_hat's zeros, so the distillation direction is
   used [D]. Loss [C]: L_GC alone without an old model, else lambda_gc L_GC + lambda_rd L_RD.
   ``loss``: softmax [P: CE and KL] | sigmoid [C: per-class binary cross-entropy, targets
   sigmoid(old logits), G_i = sigmoid(z_{y_i}) - 1, each row's mean over its classes].
   Scored classes [C]: the classes seen so far (the code grows its output layer per task;
   task-IL trains as class-IL, its mask the evaluator's: ``Scenario.masked``); per-task
   heads: each class's newest head. ``eval_predict`` likewise scores only
   the seen classes (unseen ones at the row's lowest seen logit - 30, finite) [C].
4. Task transitions [D]: the code's clients detect a new task themselves (mean prediction
   entropy of the global model on their data rising by > 1.2); here the engine's task hooks
   tell clients the boundaries (``ctx.task``, the TASK_END exchange), so no detection runs.
5. Proxy server S_P [P; C ProxyServer.py]:
   - In the first round of each task (when the code's clients detect it), every client
     that trains sends, after local training and for each class of its task data, the
     perturbed prototype gradient: prototype = the row whose normalised feature is nearest
     to the class mean (the trained local model) [C ``prototype_mask``]; perturbed by
     ``perturb_iters`` SGD steps on the input (lr ``perturb_lr``, weight decay 1e-5)
     minimising the local model's loss on its label [C]; then the gradient of CE(Gamma(x'),
     y) w.r.t. the gradient-encoding network Gamma. Gamma: the LeNet of DLG [C myNetwork.LeNet:
     conv5x5 12 ch stride 2 / 2 / 1, sigmoid, linear], every weight and bias ~ U(-0.5, 0.5)
     [C weights_init], shared by all (a function of (seed, input shape, classes): keyed
     0xC2, rebuilt where needed, never sent); [D] inputs that are not images [C, H, W] get
     an MLP Flatten-Linear(64)-Sigmoid-Linear(64)-Sigmoid-Linear(C).
   - After aggregation the proxy infers each gradient's label (argmin over classes of the
     row sums of the last layer's weight gradient [C ``gradient2label``]) and reconstructs
     a sample by gradient inversion: dummy x ~ N(0, I) (keyed 0xC3), L-BFGS (lr
     ``recon_lr``, ``recon_inner`` iterations per step) for ``recon_iters`` steps on
     sum_l ||grad_l Gamma(x) - grad_l||^2; the last ``recon_keep`` iterates are kept [C num_image]. They
     replace the monitor set [C]; [D] iterates that are not finite are dropped, and the
     code's clip to [0, 1] (its images are uint8) is not done.
   - Every round the proxy scores the new global model on the monitor set (accuracy over
     the seen classes); if it is >= the best so far, the model becomes the best [C]. At each
     task's start the best becomes the old model Theta^{t-1} that every client of the task
     distils from (the code: the best model of the previous task, best_model_1/2) [C].
     ``best_per_task`` [D: the code's evident intent; it resets an unused ``last_perf``]
     resets the best accuracy at each task start; false keeps the code's behaviour (never
     reset, so a new task's models must beat the older tasks' best accuracy).
   - ``proxy: false`` [D, the paper's ablation without S_P]: the old model is the previous
     task's final global model; no prototype gradients, no reconstruction.
   Not replicated: the code's new clients joining per task, its 60 % class subsets per
   client (the partition decides), its learning-rate steps (the engine's schedule),
   its uint8 image round trips.

Trainers [D]: a client alone runs ``step_loss``; the stacked trainer runs the same step as
live terms over joined rows (``client_live_terms`` returning ``JoinedLive``): each client's
share of its memory (``memory_rows``, augmented on the host at step k as alone) joins its
minibatch in the stacked forward (with BatchNorm, clients whose joined batches differ in size
run apart), the old model scores the stack's rows in one forward, and ``glfc_loss`` (one
definition for both) takes each client's group means, row means and task (asynchronous
boundaries may put a stack's clients on different tasks) over its own real rows. Equal
within 1e-5 (tests/methods/test_glfc.py: MLP class-IL, CNN task-IL, ResNet-8, clients on
different tasks, FedGP over GLFC). Eager on a GPU (``capturable_terms = False``: the
memory's shares are cut on the host each step); per-task heads train one client after
another (the stacked path scores with one head).

Hyperparameters (defaults, source): ``memory_size`` 2000 [P fedprotip.md E.3, "following
the original paper", CIFAR-100 (1000 on its other datasets); C option.py; fedgp.md Table 1
uses 200, "a buffer size of 200 whenever methods require it"]; ``loss`` softmax [P] (sigmoid [C]); ``lambda_gc`` 0.5,
``lambda_rd`` 0.5 [C]; ``perturb_iters`` 50, ``perturb_lr`` 0.2 [C: learning rate / 10 with
its 2.0; FedProTIP's code 0.2 on CIFAR-100]; ``recon_iters`` 250 [C]; ``recon_lr`` 0.5
[P fedprotip.md E.3, CIFAR-100 and DomainNet; the GLFC code 0.1]; ``recon_keep`` 20 [C];
``recon_inner`` 20 [C: torch's LBFGS max_iter default];
``best_per_task`` true [D]; ``proxy`` true [P]. Domain-incremental streams (rotated,
permuted, domains) are refused: old and new classes do not exist there [P fedprotip.md Table 1,
fedgp.md Table 1].

State: ctx.state["glfc"] = {x, y, rank (herding position), classes (learned)};
server.state: glfc_old / glfc_best (weights or None), glfc_best_acc, glfc_monitor ({x, y}
or None). Diagnostics (``glfc_<key>``): per client, gc and rd (the loss terms, mean per
step), memory (rows), proto (gradients sent); per round, proto_grads, recon_samples,
recon_loss (mean final matching loss), monitor_acc, best_acc, old_model (1 if one is
broadcast).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from ..data.scenario import DOMAIN_KINDS
from ..utils import FedForgetError, torch_seed
from .base import (
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
)
from .params import boolean, choice, integer, number
from .registry import METHODS
from .shared import (
    StepSums,
    embed_rows,
    floor_unscored,
    group_normalise,
    head_scores,
    herding,
    on_stack,
    rows_mean,
)

MEMORY_STREAM, ENCODER_STREAM, RECON_STREAM = 0xC1, 0xC2, 0xC3  # keyed randomness
KEY = "glfc"  # ctx.state: the exemplar memory
OLD, BEST, BEST_ACC, MONITOR = "glfc_old", "glfc_best", "glfc_best_acc", "glfc_monitor"
PROTO = "glfc_proto"  # Upload.extras: the perturbed prototype gradients
LOSSES = ("softmax", "sigmoid")
PERTURB_WD = 1e-5  # [C] weight decay of the prototype perturbation


# ----------------------------------------------------------------------------- scoring
def class_scores(model: nn.Module, x: torch.Tensor, top: int) -> torch.Tensor:
    return head_scores(model, model.features(x), top)


def true_class_gap(
    logits: torch.Tensor, y: torch.Tensor, allowed: torch.Tensor, loss: str
) -> torch.Tensor:
    """|G_i| = |P_{y_i}(x_i) - 1| [..., N] (detached; logits [..., N, C]): softmax over the
    allowed classes, or the sigmoid of the true logit."""
    z = logits.detach()
    if loss == "sigmoid":
        p = torch.sigmoid(z.gather(-1, y[..., None]))[..., 0]
    else:
        p = torch.softmax(z.masked_fill(~allowed, float("-inf")), -1).gather(-1, y[..., None])[..., 0]
    return (p - 1).abs()


def compensation_weights(g: torch.Tensor, old: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """GLFC's w_i = |G_i| / G_bar, G_bar the mean |G| over the rows of the same group
    (old / new classes); ``real``: a stack's real rows (bool [G, N]), the groups' only ones."""
    groups = [~old, old] if real is None else [~old & real, old & real]
    return group_normalise(g, groups)


def row_losses(
    logits: torch.Tensor, target: torch.Tensor, allowed: torch.Tensor, loss: str
) -> torch.Tensor:
    """Per-row loss [..., N] against ``target`` [..., N, C] (zero outside ``allowed``):
    softmax: sum_c target (log target - log P) (CE for a one-hot target, the literal KL
    otherwise); sigmoid: the mean over the allowed classes of the binary cross-entropy."""
    if loss == "sigmoid":
        bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
        a = allowed.to(bce.dtype)
        return (bce * a).sum(-1) / a.sum(-1).clamp_min(1)
    logp = torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), -1).masked_fill(
        ~allowed, 0.0
    )
    return (torch.xlogy(target, target) - target * logp).sum(-1)


def relation_target(
    y: torch.Tensor,
    allowed: torch.Tensor,
    old_cols: torch.Tensor,
    old_logits: torch.Tensor,
    loss: str,
) -> torch.Tensor:
    """Y_hat [..., N, C]: the one-hot label over the allowed classes with the old classes'
    entries replaced by the old model's probabilities over them (softmax over the old
    classes a row may score; sigmoid per class)."""
    onehot = F.one_hot(y, allowed.shape[-1]).to(old_logits.dtype) * allowed
    oldm = allowed & old_cols
    if loss == "sigmoid":
        q = torch.sigmoid(old_logits)
    else:
        q = torch.softmax(old_logits.masked_fill(~oldm, float("-inf")), -1)
    return torch.where(oldm, q.nan_to_num(0.0), onehot)


# ----------------------------------------------------------------------------- proxy server
def gradient_encoder(input_shape: Sequence[int], num_classes: int, seed: int) -> nn.Module:
    """Gamma, the gradient-encoding network: DLG's LeNet for images [C, H, W] (conv5x5, 12
    channels, strides 2, 2, 1, padding 2, sigmoid, linear) [C], an MLP otherwise [D]; every
    weight and bias ~ U(-0.5, 0.5) [C weights_init] from a generator keyed (seed, 0xC2)."""
    shape = tuple(int(s) for s in input_shape)
    # layers built without their default initialisation, which would draw from the global
    # generator (clients trained at once must not: train.concurrent_clients) [D]
    conv, linear = partial(skip_init, nn.Conv2d), partial(skip_init, nn.Linear)
    if len(shape) == 3:
        c = shape[0]
        body = nn.Sequential(
            conv(c, 12, 5, padding=2, stride=2), nn.Sigmoid(),
            conv(12, 12, 5, padding=2, stride=2), nn.Sigmoid(),
            conv(12, 12, 5, padding=2, stride=1), nn.Sigmoid(), nn.Flatten(),
        )  # fmt: skip
        with torch.no_grad():
            hidden = body(torch.zeros(1, *shape)).shape[1]
        net = nn.Sequential(body, linear(hidden, num_classes))
    else:
        net = nn.Sequential(
            nn.Flatten(), linear(math.prod(shape), 64), nn.Sigmoid(),
            linear(64, 64), nn.Sigmoid(), linear(64, num_classes),
        )  # fmt: skip
    gen = torch.Generator().manual_seed(torch_seed(seed, ENCODER_STREAM))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.rand(p.shape, generator=gen) - 0.5)
    return net


def encoder_gradient(encoder: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """grad of CE(Gamma(x), y) w.r.t. Gamma's parameters, one sample (x [1, ...])."""
    loss = F.cross_entropy(encoder(x), y)
    return [g.detach() for g in torch.autograd.grad(loss, list(encoder.parameters()))]


def gradient_label(grads: Sequence[torch.Tensor]) -> int:
    """The label of a one-sample gradient [C gradient2label]: the class whose last-layer
    weight-gradient row sums lowest (only the true class's is negative: p - 1 < 0 times
    positive sigmoid features)."""
    return int(grads[-2].sum(-1).argmin())


def reconstruct(encoder: nn.Module, grads: Sequence[torch.Tensor], label: int, shape: Sequence[int], iters: int,
                lr: float, keep: int, generator: torch.Generator, inner: int = 20) -> tuple[torch.Tensor, float]:  # fmt: skip
    """Gradient inversion [C ProxyServer.reconstruction]: x ~ N(0, I), L-BFGS on
    sum_l ||grad_l CE(Gamma(x), label) - grads_l||^2; (the last ``keep`` finite iterates
    [k, *shape], the final matching loss)."""
    dev = grads[0].device
    x = torch.randn(1, *shape, generator=generator).to(dev).requires_grad_(True)
    yl = torch.tensor([label], device=dev)
    params = list(encoder.parameters())
    opt = torch.optim.LBFGS([x], lr=lr, max_iter=inner)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        dg = torch.autograd.grad(F.cross_entropy(encoder(x), yl), params, create_graph=True)
        diff = sum(((a - b) ** 2).sum() for a, b in zip(dg, grads))
        x.grad = torch.autograd.grad(diff, x)[0]
        return diff.detach()

    kept = []
    for it in range(iters):
        opt.step(closure)
        if it >= iters - keep and bool(torch.isfinite(x).all()):
            kept.append(x.detach().clone())
    final = float(closure()) if iters else float("nan")
    out = torch.cat(kept) if kept else x.new_zeros(0, *shape)
    return out, final


@dataclass(frozen=True)
class GLFCParams:
    memory_size: int = integer(2000, minimum=0)  # exemplars per client [P; fedprotip.md E.3; fedgp.md: 200]
    loss: str = choice("softmax", LOSSES)  # softmax [P] | sigmoid [C]
    lambda_gc: float = number(0.5, minimum=0)  # [C]
    lambda_rd: float = number(0.5, minimum=0)  # [C]
    perturb_iters: int = integer(50, minimum=0)  # [C]
    perturb_lr: float = number(0.2, minimum=0)  # [C]
    recon_iters: int = integer(250, minimum=1)  # [C]
    recon_lr: float = number(0.5, exclusiveMinimum=0)  # [P fedprotip.md E.3; code 0.1]
    recon_keep: int = integer(20, minimum=1)  # [C]
    recon_inner: int = integer(20, minimum=1)  # L-BFGS iterations per step [C: torch's default max_iter]
    best_per_task: bool = boolean(True)  # [D]
    proxy: bool = boolean(True)  # [P]; false: the previous task's final model is the old model [D]


@METHODS.register("glfc")
class GLFC(FedAvg):
    name = "glfc"
    one_task_per_class = True  # its old and new classes are per task (class-aware gradient compensation, proxy server)
    # [D] the step (its rows and its share of the memory in one forward, weighted per group and
    # distilled against the old model) is live terms over joined rows (``client_live_terms``,
    # ``JoinedLive``) beside ``step_loss`` for a client alone, one ``glfc_loss`` for both; each
    # step's share is cut and augmented on the host, so it runs eagerly on a GPU. Per-task
    # heads (GLFC's routing of each row to its task's head) train one client after another
    live_terms = True
    capturable_terms = False
    own_upload = True
    own_predict = True
    exchanges = (TASK_END,)
    Params = GLFCParams
    report_w_old = False  # the mean weight of old rows is 1 by construction in GLFC

    @classmethod
    def check_scenario(cls, scenario: dict[str, Any] | None, params: Any = None) -> None:
        """Class-incremental streams only: a domain stream has no old and new classes."""
        if scenario and scenario.get("kind") in DOMAIN_KINDS:
            raise FedForgetError(
                f"method '{cls.name}' needs a split (class-incremental) stream: scenario.kind="
                f"{scenario['kind']!r} (incremental: {scenario.get('incremental')!r}) is domain-incremental, "
                f"where {cls.name.upper()} is not defined; allowed: scenario.kind split | none"
            )

    @classmethod
    def client_kept_bytes(cls, params: Any, shape: ClientShape) -> int:
        """Its exemplar memory: at most ``memory_size`` rows (m per learned class, m =
        floor(memory_size / classes)), each x (as the model sees it), y and rank (int64); the
        learned classes (int64, at most every class)."""
        return min(params.memory_size, shape.rows) * (shape.row_bytes + 2 * 8) + 8 * shape.num_classes

    def __init__(self, params: Any, info: RunInfo) -> None:
        super().__init__(params, info)
        sc = info.scenario
        if sc is not None:
            self.check_scenario({"kind": sc.kind, "incremental": sc.incremental}, params)
        dev, c = info.device, info.num_classes
        classes = sc.task_classes if sc is not None else [list(range(c))]
        self.tasks = len(classes)
        self.rounds_per_task = sc.rounds_per_task if sc is not None else info.train.rounds
        self.class_task = torch.full((c,), -1, dtype=torch.long)
        for t, cls in enumerate(classes):
            self.class_task[cls] = t
        self.class_task = self.class_task.to(dev)
        t_ids = torch.arange(self.tasks, device=dev)[:, None]
        known = self.class_task >= 0
        self.seen = known & (self.class_task[None] <= t_ids)  # [T, C]: classes of tasks <= t
        self.old = known & (self.class_task[None] < t_ids)  # [T, C]: classes of tasks < t
        self._encoders: dict[tuple[int, ...], nn.Module] = {}  # Gamma per input shape (a constant)

    # ---------------------------------------------------------------- helpers
    def encoder(self, shape: Sequence[int]) -> nn.Module:
        key = tuple(int(s) for s in shape)
        if key not in self._encoders:  # lanes building it at once: the first kept, one for all [D]
            built = gradient_encoder(key, self.info.num_classes, self.info.seed).to(self.info.device)
            return self._encoders.setdefault(key, built)
        return self._encoders[key]

    def task_start(self, rnd: int) -> bool:
        sc = self.info.scenario
        return sc.starts_task(rnd) if sc is not None else rnd == 1

    def row_task(self, y: torch.Tensor, task: int | torch.Tensor) -> torch.Tensor:
        """Each row's task: its class's (split streams), else the client's (``task``: an int,
        or a stack's [G, 1] for rows ``y`` [G, N])."""
        t = self.class_task[y]
        return torch.where(t >= 0, t, torch.full_like(t, task) if isinstance(task, int) else task.expand_as(t))

    def allowed(self, row_task: torch.Tensor, task: int | torch.Tensor) -> torch.Tensor:
        """bool [..., N, C]: the classes a row may score, the seen ones (task-IL trains as
        class-IL: its mask is the evaluator's, ``Scenario.masked``)."""
        return self.seen[task].expand(*row_task.shape, -1)

    # ---------------------------------------------------------------- server side
    def server_init(self, server: ServerContext) -> None:
        server.state.update({OLD: None, BEST: None, BEST_ACC: 0.0, MONITOR: None})

    def server_broadcast(self, server: ServerContext) -> dict[str, Any]:
        return {OLD: server.state.get(OLD)}

    def server_task_begin(self, server: ServerContext) -> None:
        """The old model of task t: the proxy's best model of task t-1 [C best_model_1];
        without the proxy, task t-1's final global model [D]."""
        st = server.state
        if server.task == 0:
            return
        if self.p.proxy:
            st[OLD] = st[BEST]
            if self.p.best_per_task:
                st[BEST_ACC] = 0.0
        else:
            st[OLD] = {k: v.detach().clone() for k, v in server.global_params.items()}

    def server_aggregate(self, server: ServerContext, uploads: Sequence[Upload]) -> None:
        """FedAvg's average, then the proxy server's step on it (``proxy_step``)."""
        super().server_aggregate(server, uploads)
        self.proxy_step(server, uploads)

    def proxy_step(self, server: ServerContext, uploads: Sequence[Upload]) -> None:
        """The proxy server [C]: the monitor set inverted from the clients' prototype
        gradients, and the best global model on it so far (the next task's old model)."""
        if not self.p.proxy:
            return
        st = server.state
        pool = [g for u in uploads for g in u.extras.get(PROTO, {}).get("grads", [])]
        stats: dict[str, float] = {"proto_grads": float(len(pool))}
        if pool:
            shape = next(u.extras[PROTO]["shape"] for u in uploads if PROTO in u.extras)
            st[MONITOR], loss = self.reconstruct_pool(server, pool, shape)
            stats.update(recon_samples=float(len(st[MONITOR]["y"])), recon_loss=loss)
        if st.get(MONITOR) is not None and len(st[MONITOR]["y"]):
            model = server.model
            model.load_state_dict(server.global_params)
            acc = self.monitor_accuracy(server, model, st[MONITOR]["x"], st[MONITOR]["y"])
            stats["monitor_acc"] = acc
            if acc >= st[BEST_ACC]:  # [C] ties: the newer model
                st[BEST_ACC] = acc
                st[BEST] = {k: v.detach().clone() for k, v in server.global_params.items()}
            stats["best_acc"] = st[BEST_ACC]
        st["glfc_round"] = stats

    def reconstruct_pool(self, server: ServerContext, pool: list[list[torch.Tensor]], shape: Sequence[int]) -> tuple[dict[str, torch.Tensor], float]:  # fmt: skip
        """The monitor set {x, y} reconstructed from the round's prototype gradients."""
        enc = self.encoder(shape)
        xs, ys, losses = [], [], []
        for i, grads in enumerate(pool):
            grads = [g.to(self.info.device) for g in grads]
            label = gradient_label(grads)
            gen = torch.Generator().manual_seed(
                torch_seed(self.info.seed, server.round, i, RECON_STREAM)
            )
            p = self.p
            x, loss = reconstruct(enc, grads, label, shape, p.recon_iters, p.recon_lr, p.recon_keep,
                                  gen, p.recon_inner)  # fmt: skip
            xs.append(x)
            ys.append(torch.full((len(x),), label, dtype=torch.long, device=x.device))
            losses.append(loss)
        finite = [v for v in losses if math.isfinite(v)]
        mean = sum(finite) / len(finite) if finite else math.nan
        return {"x": torch.cat(xs), "y": torch.cat(ys)}, mean

    @torch.no_grad()
    def monitor_accuracy(
        self, server: ServerContext, model: nn.Module, x: torch.Tensor, y: torch.Tensor
    ) -> float:
        """The model's accuracy on the monitor set over the seen classes [C monitor]."""
        was = model.training
        model.eval()
        t = min(server.task, self.tasks - 1)
        rt = self.row_task(y, t)
        logits = class_scores(model, x, t)
        pred = logits.masked_fill(~self.allowed(rt, t), float("-inf")).argmax(1)
        model.train(was)
        return float((pred == y).double().mean())

    def server_metrics(self, server: ServerContext, uploads: Sequence[Upload]) -> dict[str, float]:
        out = server.state.pop("glfc_round", {})
        out["old_model"] = float(server.state.get(OLD) is not None)
        return out

    def eval_predict(
        self, server: ServerContext, model: nn.Module, x: torch.Tensor, task: int | None
    ) -> torch.Tensor:
        """The logits over the classes seen so far [C]; the others at the row's lowest seen
        logit - 30 (finite)."""
        z = model.logits(x, task)  # type: ignore[operator]
        return floor_unscored(z, self.seen[min(server.task, self.tasks - 1)])

    # ---------------------------------------------------------------- client side
    def client_begin(self, ctx: ClientContext) -> None:
        s = self.scratch(ctx)
        t = ctx.task
        s.chunks = self.memory_schedule(ctx)
        mem = ctx.state.get(KEY)
        s.learned = mem is not None and len(mem["y"]) > 0  # the code's learned_classes non-empty
        s.old = None
        old = ctx.broadcast.get(OLD)
        if old is not None and bool(self.old[t].any()):
            s.old = frozen_model(ctx, "glfc_old")  # a frozen buffer for the broadcast old model
            s.old.load_state_dict(old)
            s.old.eval()
        s.sums = StepSums.own(4, self.info.device)  # per step: L_GC, L_RD, sum of old rows' w, old rows

    def memory_schedule(self, ctx: ClientContext) -> list[torch.Tensor]:
        """Memory rows per step: each epoch a keyed permutation of the memory cut into one
        slice per minibatch (the code's loader mixes memory and current rows) [C/D]."""
        mem = ctx.state.get(KEY)
        m = 0 if mem is None else len(mem["y"])
        if m == 0 or ctx.data is None:
            return []
        steps = self.info.train.epoch_steps(len(ctx.data), ctx.batch_size)
        gen = torch.Generator().manual_seed(
            torch_seed(self.info.seed, ctx.round, ctx.cid, ctx.task, MEMORY_STREAM)
        )
        dev = mem["y"].device
        out: list[torch.Tensor] = []
        for _ in range(ctx.local_epochs):
            out += [c.to(dev) for c in torch.tensor_split(torch.randperm(m, generator=gen), steps)]
        return out

    def memory_rows(self, ctx: ClientContext, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Local step ``k``'s (default ``ctx.steps``) share of the memory (x augmented as the
        step's own rows, y), or None."""
        s = self.scratch(ctx)
        k = ctx.steps if k is None else k
        if k >= len(s.chunks) or not len(s.chunks[k]):
            return None
        mem, idx = ctx.state[KEY], s.chunks[k]
        return ctx.augment_rows(mem["x"][idx], idx, MEMORY_STREAM, k), mem["y"][idx]

    def row_weights(self, g: torch.Tensor, row_task: torch.Tensor, task: int | torch.Tensor, top: int,
                    real: torch.Tensor | None = None, learned: bool | torch.Tensor = True) -> torch.Tensor:  # fmt: skip
        """w_i of L_GC (GLFC: old / new groups), per client of a stack (``task`` [G, 1], the
        highest ``top``; ``real``: its real rows; ``learned``: whether the client's memory
        holds any class, [G, 1] of a stack; GLFC weights either way [P])."""
        return compensation_weights(g, row_task < task, real)

    def distill_weights(self, w: torch.Tensor) -> torch.Tensor:
        """Per-row weights of L_RD (GLFC: none)."""
        return torch.ones_like(w)

    def client_step(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One forward on the step's rows and its share of the memory: ``step_loss``, differentiated."""
        loss = self.step_loss(ctx, x, y)
        loss.backward()
        return loss

    def step_loss(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The step of a client alone: its rows and its share of the memory in one forward,
        ``glfc_loss``."""
        s, t = self.scratch(ctx), ctx.task
        mem = self.memory_rows(ctx)
        if mem is not None:
            x, y = torch.cat([x, mem[0].to(x.dtype)]), torch.cat([y, mem[1]])
        logits = class_scores(ctx.model, x, t)
        old_logits = None
        if s.old is not None:
            with torch.no_grad():
                old_logits = class_scores(s.old, x, t)
        loss, sums = self.glfc_loss(logits, y, t, t, old_logits, learned=s.learned)
        s.sums.add(*sums)
        return loss

    def glfc_loss(self, logits: torch.Tensor, y: torch.Tensor, task: int | torch.Tensor, top: int,
                  old_logits: torch.Tensor | None, has_old: torch.Tensor | None = None,
                  mask: torch.Tensor | None = None, learned: bool | torch.Tensor = True) -> tuple[torch.Tensor, list[torch.Tensor]]:  # fmt: skip
        """(the step's loss, its diagnostics [L_GC, L_RD, sum of the old rows' w, old rows])
        from its logits [N, C] of rows y [N] (a client alone, task ``task``) or [G, N, C] of a
        stack (``task`` [G, 1] or one int, ``top`` the highest, ``mask`` [G, N] 1.0 on real
        rows; each value then [G], each client's own): L_GC alone without old logits (or
        where ``has_old`` [G] is False), else lambda_gc L_GC + lambda_rd L_RD; ``learned``
        (one bool, or [G, 1] of a stack): whether the client's memory holds a class
        (``row_weights``)."""
        p = self.p
        real = None if mask is None else mask > 0
        rt = self.row_task(y, task)
        allowed = self.allowed(rt, task)
        g = true_class_gap(logits, y, allowed, p.loss)
        w = self.row_weights(g, rt, task, top, real, learned)
        onehot = F.one_hot(y, allowed.shape[-1]).to(logits.dtype)
        gc = rows_mean(w * row_losses(logits, onehot, allowed, p.loss), mask)
        old = rt < task if real is None else (rt < task) & real
        sums = [gc.detach(), torch.zeros_like(gc), (w * old).sum(-1).detach(), old.sum(-1).to(gc.dtype)]
        if old_logits is None:
            return gc, sums
        target = relation_target(y, allowed, self.old[task], old_logits, p.loss)
        rd = rows_mean(self.distill_weights(w) * row_losses(logits, target, allowed, p.loss), mask)
        loss = p.lambda_gc * gc + p.lambda_rd * rd
        if has_old is not None:
            loss, rd = torch.where(has_old, loss, gc), rd * has_old
        sums[1] = rd.detach()
        return loss, sums

    def client_live_terms(self, ctxs: Sequence[ClientContext]) -> JoinedLive:
        """The step for a stack of clients: each client's rows and its share of the memory
        (``memory_rows``) joined in one forward (``JoinedLive``), the old model over the
        stack's rows in one forward, ``glfc_loss`` per client (its own task, group means
        and row means over its real rows): ``step_loss`` of each client alone."""
        scratches = [self.scratch(c) for c in ctxs]
        table = StepSums.shared(scratches, 4, self.info.device, "sums")
        tasks = [c.task for c in ctxs]
        task_t = torch.tensor(tasks, device=self.info.device)[:, None]
        flags = [s.old is not None for s in scratches]
        has_old = torch.tensor(flags, device=self.info.device)
        learned = [s.learned for s in scratches]
        learned_t = torch.tensor(learned, device=self.info.device)[:, None]
        old = next((s.old for s in scratches if s.old is not None), None)  # one frozen model, one broadcast

        def rows(lo: int, hi: int, k: int) -> list:
            return [self.memory_rows(ctx, k) for ctx in ctxs[lo:hi]]

        def live(lo: int, hi: int, w: dict[str, torch.Tensor], step: StepBatch) -> LiveStep:
            one = len(set(tasks[lo:hi])) == 1
            old_logits = None
            if any(flags[lo:hi]):
                with torch.no_grad():
                    old_logits = on_stack(lambda v: old.head(old.features(v)), step.x)
            loss, sums = self.glfc_loss(step.logits, step.y, tasks[lo] if one else task_t[lo:hi], max(tasks[lo:hi]),
                                        old_logits, None if all(flags[lo:hi]) else has_old[lo:hi], step.row_mask(),
                                        True if all(learned[lo:hi]) else learned_t[lo:hi])  # fmt: skip
            table[:, lo:hi] += torch.stack(sums)
            return LiveStep(total=loss)

        return JoinedLive(live, rows)

    def client_end(self, ctx: ClientContext) -> Upload:
        up = super().client_end(ctx)
        s = self.scratch(ctx)
        steps = max(ctx.steps, 1)
        gc, rd, w_old, n_old = s.sums.values()
        ctx.stats["gc"] = gc / steps
        if s.old is not None:
            ctx.stats["rd"] = rd / steps
        if self.report_w_old and n_old > 0:
            ctx.stats["w_old"] = w_old / n_old
        mem = ctx.state.get(KEY)
        ctx.stats["memory"] = float(0 if mem is None else len(mem["y"]))
        if self.p.proxy and self.task_start(ctx.round) and ctx.data is not None and len(ctx.data):
            grads, shape = self.prototype_gradients(ctx)
            up.extras[PROTO] = {"grads": grads, "shape": shape}
            ctx.stats["proto"] = float(len(grads))
        return up

    def prototype_gradients(
        self, ctx: ClientContext
    ) -> tuple[list[list[torch.Tensor]], tuple[int, ...]]:
        """Per class of the client's task data: the perturbed prototype's gradient of Gamma
        [C prototype_mask]."""
        model, t, p = ctx.model, ctx.task, self.p
        x, y = ctx.data.all()
        protos, _ = herding(embed_rows(model, x, normalize=True), y, sorted(set(y.tolist())), 1)
        xp, yp = x[protos].detach().clone(), y[protos]
        was = model.training
        model.eval()
        rt = self.row_task(yp, t)
        allowed = self.allowed(rt, t)
        onehot = F.one_hot(yp, allowed.shape[1]).to(xp.dtype)
        for _ in range(p.perturb_iters):  # rows are independent: the sum of their losses
            xp.requires_grad_(True)
            loss = row_losses(
                class_scores(model, xp, t), onehot, allowed, p.loss
            ).sum()
            (grad,) = torch.autograd.grad(loss, xp)
            xp = (xp - p.perturb_lr * (grad + PERTURB_WD * xp)).detach()
        model.train(was)
        enc = self.encoder(x.shape[1:])
        grads = [encoder_gradient(enc, xp[i : i + 1], yp[i : i + 1]) for i in range(len(yp))]
        return grads, tuple(int(v) for v in x.shape[1:])

    def client_reply(self, exchange: str, ctx: ClientContext) -> Any:
        """The exemplar memory after task ``ctx.task`` (its final global model) [P, C]."""
        self.update_memory(ctx)
        return None

    def update_memory(self, ctx: ClientContext) -> None:
        x, y = ctx.data.all()
        mem = ctx.state.get(KEY)
        dev = y.device
        learned = (
            mem["classes"] if mem is not None else torch.zeros(0, dtype=torch.long, device=dev)
        )
        new = sorted(set(y.tolist()) - set(learned.tolist()))
        classes = torch.cat([learned, torch.tensor(new, dtype=torch.long, device=dev)])
        m = self.p.memory_size // max(len(classes), 1)
        if mem is not None and len(mem["y"]):
            keep = mem["rank"] < m  # [C] the first m of each class's herding order
            mem = {k: mem[k][keep] for k in ("x", "y", "rank")}
        else:
            mem = {"x": x[:0].detach().clone(), "y": y[:0].clone(), "rank": y[:0].clone()}
        idx, rank = herding(embed_rows(ctx.model, x, normalize=True), y, new, m)
        ctx.state[KEY] = {
            "x": torch.cat([mem["x"], x[idx].detach()]),
            "y": torch.cat([mem["y"], y[idx]]),
            "rank": torch.cat([mem["rank"], rank]),
            "classes": classes,
        }
