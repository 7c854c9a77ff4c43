"""Server-side ensemble distillation on an unlabelled public set: the step that FedDF, FedET
and FedProj share.

The student (the server model, loaded with the FedAvg average theta_avg) is trained for E_d
epochs of shuffled minibatches B of the public inputs x_pub, minimising per batch

    L(theta) = T^2 * KL( softmax(Z_teacher[B] / T) || softmax(f(x_B; theta) / T) )   (1)
             + batch_loss(B, features, logits)                                      (2)
             + extra_loss(student)                                                  (3)

(1) is the distillation loss of Hinton et al. (2015): KL summed over classes and averaged
over the rows of the batch ("batchmean"); the T^2 factor keeps gradient magnitudes
comparable across temperatures. The teacher is either a tensor of already-ensembled logits
[N_pub, C] or a callable giving one batch's teacher logits. (2) holds method-specific
per-sample terms (FedET's pseudo-label cross-entropy and diversity KL, FedProj's feature
distillation); (3) terms of the parameters alone (FedProj's alpha * ||theta - theta_avg||^2),
whose gradient is added to every step.

The batch order comes from a generator seeded by the caller (``DistillSpec.seed``), so a
distillation is reproducible and independent of the global torch RNG. The optimizer is
built afresh for every call (as in the FedDF and FedProj code: one solver per round).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .params import choice, integer, number
from .shared import rows_mean

# stream tag for the keyed seed of the distillation batch order (the engine uses 0x51-0x53)
DISTILL_STREAM = 0x54

OPTIMIZERS = ("adam", "sgd")
SCHEDULES = ("constant", "cosine")

# teacher logits for the rows ``idx`` of the public set (inputs ``xb = x_pub[idx]``)
TeacherFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# (idx, student features, student logits) -> scalar, the batch mean of per-sample terms
BatchLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# student -> scalar, a term of the parameters alone
ExtraLoss = Callable[[nn.Module], torch.Tensor]


def softened_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float
) -> torch.Tensor:
    """KL(softmax(teacher/T) || softmax(student/T)), summed over classes, mean over rows.

    Both sides go through log_softmax (``log_target=True``): the loss and its gradient are
    exactly 0 when the student's logits equal the teacher's, and a teacher probability that
    underflows to 0 gives no 0 * log 0 = NaN."""
    t = float(temperature)
    return F.kl_div(
        F.log_softmax(student_logits / t, dim=1),
        F.log_softmax(teacher_logits / t, dim=1),
        reduction="batchmean",
        log_target=True,
    )


def softened_kl_stacked(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``softened_kl`` of each client of a stack: logits [G, N, C] -> [G], each the mean over
    its rows (the same terms; summed in another order, so equal to rounding); ``mask`` [G, N]:
    over its real rows (1.0) only."""
    t = float(temperature)
    kl = F.kl_div(
        F.log_softmax(student_logits / t, dim=-1),
        F.log_softmax(teacher_logits / t, dim=-1),
        reduction="none",
        log_target=True,
    )
    if mask is None:
        return kl.sum(-1).mean(-1)
    return rows_mean(kl.sum(-1), mask)


def kd_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float
) -> torch.Tensor:
    """T^2 * KL(softmax(teacher/T) || softmax(student/T)) (``softened_kl`` times T^2)."""
    t = float(temperature)
    return t * t * softened_kl(student_logits, teacher_logits, temperature)


@torch.no_grad()
def public_logits(model: nn.Module, x: torch.Tensor, batch_size: int = 1024) -> torch.Tensor:
    """A model's logits on the whole public set: eval mode, no grad, batched; the model's
    train/eval mode is restored."""
    was_training = model.training
    model.eval()
    out = torch.cat([model(x[s : s + batch_size]) for s in range(0, len(x), batch_size)])
    model.train(was_training)
    return out


@dataclass(frozen=True)
class DistillSpec:
    """How one distillation runs (see ``DistillParams`` for the config-facing names)."""

    epochs: int
    temperature: float = 1.0
    optimizer: str = "adam"  # adam | sgd
    lr: float = 1e-3
    momentum: float = 0.0  # sgd only
    batch_size: int = 128
    schedule: str = "constant"  # constant | cosine (annealed to 0 over all steps of the call)
    max_grad_norm: float = 0.0  # > 0: clip the gradient's global L2 norm (FedDF code: 5)
    seed: int = 0  # batch order


@dataclass
class DistillStats:
    """Diagnostics of one distillation; the objective is measured in eval mode over the
    whole public set before the first and after the last step."""

    steps: int
    loss_before: float  # (1) + (2) + (3)
    loss_after: float
    kl_before: float | None  # (1) alone: T^2 * KL(teacher || student); None without a teacher
    kl_after: float | None

    def as_metrics(self) -> dict[str, float]:
        out = {
            "distill_steps": float(self.steps),
            "distill_loss_before": self.loss_before,
            "distill_loss_after": self.loss_after,
        }
        if self.kl_before is not None:
            out.update(distill_kl_before=self.kl_before, distill_kl_after=self.kl_after)
        return out


def _teacher_batch(
    teacher: torch.Tensor | TeacherFn | None, idx: torch.Tensor, xb: torch.Tensor
) -> torch.Tensor | None:
    if teacher is None:
        return None
    if isinstance(teacher, torch.Tensor):
        return teacher[idx]
    return teacher(idx, xb)


def _forward(student: nn.Module, xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(student, "forward_with_features"):
        return student.forward_with_features(xb)
    logits = student(xb)
    return logits, logits  # a plain module has no separate feature output


def _data_terms(
    student: nn.Module,
    x: torch.Tensor,
    idx: torch.Tensor,
    teacher: torch.Tensor | TeacherFn | None,
    temperature: float,
    batch_loss: BatchLoss | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(terms (1) + (2), term (1) or None) on the batch ``idx``."""
    xb = x[idx]
    features, logits = _forward(student, xb)
    zt = _teacher_batch(teacher, idx, xb)
    kd = kd_loss(logits, zt, temperature) if zt is not None else None
    loss = kd if kd is not None else logits.new_zeros(())
    if batch_loss is not None:
        loss = loss + batch_loss(idx, features, logits)
    return loss, kd


@torch.no_grad()
def distill_objective(
    student: nn.Module,
    x: torch.Tensor,
    teacher: torch.Tensor | TeacherFn | None,
    temperature: float,
    batch_loss: BatchLoss | None = None,
    extra_loss: ExtraLoss | None = None,
    batch_size: int = 1024,
) -> tuple[float, float | None]:
    """(L, term (1)) over the whole public set, in eval mode: batch means weighted by batch
    size, so the result is the mean over all rows; (3) is added once."""
    was_training = student.training
    student.eval()
    n = len(x)
    total = torch.zeros((), device=x.device, dtype=torch.float64)
    kl_total = torch.zeros((), device=x.device, dtype=torch.float64)
    for s in range(0, n, batch_size):
        idx = torch.arange(s, min(s + batch_size, n), device=x.device)
        loss, kd = _data_terms(student, x, idx, teacher, temperature, batch_loss)
        total += loss.double() * len(idx) / n
        if kd is not None:
            kl_total += kd.double() * len(idx) / n
    if extra_loss is not None:
        total += extra_loss(student).double()
    student.train(was_training)
    return total.item(), (kl_total.item() if teacher is not None else None)


def distill(
    student: nn.Module,
    x: torch.Tensor,
    teacher: torch.Tensor | TeacherFn | None,
    spec: DistillSpec,
    batch_loss: BatchLoss | None = None,
    extra_loss: ExtraLoss | None = None,
) -> DistillStats:
    """Train ``student`` in place on the public inputs ``x`` [N_pub, ...] to minimise
    L = (1) + (2) + (3) (module docstring) for ``spec.epochs`` epochs; return diagnostics.

    ``teacher``: ensembled teacher logits [N_pub, C], a callable (idx, x[idx]) -> logits, or
    None when ``batch_loss`` carries the whole data term (FedET). The student's train/eval
    mode is restored afterwards."""
    n = len(x)
    if teacher is None and batch_loss is None and extra_loss is None:
        raise ValueError("distill: nothing to minimise (no teacher, batch_loss or extra_loss)")
    if isinstance(teacher, torch.Tensor) and teacher.shape[0] != n:
        raise ValueError(
            f"distill: teacher logits have {teacher.shape[0]} rows, the public set {n}"
        )
    if spec.optimizer not in OPTIMIZERS:
        raise ValueError(f"distill: optimizer={spec.optimizer!r}; allowed: {OPTIMIZERS}")
    if spec.schedule not in SCHEDULES:
        raise ValueError(f"distill: schedule={spec.schedule!r}; allowed: {SCHEDULES}")
    t = spec.temperature

    def objective() -> tuple[float, float | None]:
        return distill_objective(student, x, teacher, t, batch_loss, extra_loss, spec.batch_size)

    loss_before, kl_before = objective()
    params = [p for p in student.parameters() if p.requires_grad]
    if spec.optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=spec.lr)
    else:
        opt = torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum)
    total_steps = spec.epochs * math.ceil(n / spec.batch_size)
    sched = None
    if spec.schedule == "cosine" and total_steps > 0:
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_steps)

    was_training = student.training
    student.train()
    gen = torch.Generator().manual_seed(int(spec.seed))
    steps = 0
    for _ in range(spec.epochs):
        perm = torch.randperm(n, generator=gen).to(x.device)
        for s in range(0, n, spec.batch_size):
            idx = perm[s : s + spec.batch_size]
            opt.zero_grad(set_to_none=True)
            loss, _ = _data_terms(student, x, idx, teacher, t, batch_loss)
            if extra_loss is not None:
                loss = loss + extra_loss(student)
            loss.backward()
            if spec.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, spec.max_grad_norm)
            opt.step()
            if sched is not None:
                sched.step()
            steps += 1
    student.train(was_training)
    loss_after, kl_after = objective()
    return DistillStats(steps, loss_before, loss_after, kl_before, kl_after)


# ----------------------------------------------------------------------------- method params


@dataclass(frozen=True)
class DistillParams:
    """Config-facing hyperparameters of the server distillation; a method's ``Params``
    subclasses this and overrides the defaults that its paper fixes (``redefault``)."""

    distill_epochs: int = integer(1, minimum=0)  # E_d: passes over the public set per round (0 = no distillation)
    distill_optimizer: str = choice("adam", OPTIMIZERS)  # adam | sgd
    distill_lr: float = number(1e-3, exclusiveMinimum=0)
    distill_momentum: float = number(0.0, minimum=0, exclusiveMaximum=1)  # sgd only
    distill_batch_size: int = integer(128, minimum=1)
    distill_schedule: str = choice("constant", SCHEDULES)  # constant | cosine
    distill_max_grad_norm: float = number(0.0, minimum=0)  # 0 = no clipping

    def distill_spec(self, seed: int, temperature: float = 1.0) -> DistillSpec:
        return DistillSpec(
            epochs=self.distill_epochs,
            temperature=temperature,
            optimizer=self.distill_optimizer,
            lr=float(self.distill_lr),
            momentum=float(self.distill_momentum),
            batch_size=self.distill_batch_size,
            schedule=self.distill_schedule,
            max_grad_norm=float(self.distill_max_grad_norm),
            seed=seed,
        )
