"""Data-free synthesis on the server: a generator trained against the global model so that
its samples stand in for the data of earlier tasks. The machinery TARGET
(``methods/target.py``) and LANDER (``methods/lander.py``) share; not a method.

Tags: [P] paper, [C] the authors' code (zj-jayzhang/Federated-Class-Continual-Learning
``methods/target.py``, ``GlobalSynthesizer``; tmtuan1307/LANDER ``methods/lander.py``,
``NAYER``), [D] our decision.

One synthesis (``Synthesizer.run``), at the end of task t, with the teacher T = the task's
final global model (frozen, eval mode) scoring only the classes learned so far (tasks 0..t:
the code's classifier has no outputs for later classes [C]) and a student S (a copy of the
model, re-initialised). For rounds r = 0 .. R-1, a batch
of ``syn_batch`` targets y and generator inputs, ``g_steps`` Adam steps (betas 0.5, 0.999 [C])
on::

    L_gen = bn * L_BN(x) + oh * CE(T(x), y) + adv * L_adv(x) [+ the variant's terms]

- L_BN [P, C: DeepInversion]: over every BatchNorm layer l of T, ||sigma2_l - var_l(x)||_2 +
  ||mu_l - mean_l(x)||_2 (running statistics against the batch's, L2 norms, not squared);
  with ``bn_momentum`` m > 0 the batch statistics are mixed with an exponential average over
  the previous rounds, (1 - m) * batch + m * avg, the average updated after each round from
  its last step [C ``bn_mmt``]. A model without BatchNorm has no such term [D]: it is
  dropped (diagnostic ``bn_layers`` = 0, a warning in the log); the other terms still apply.
- L_adv [P "boundary support", C]: -mean_i 1[argmax S(x_i) = argmax T(x_i)] KL(T(x_i) ||
  S(x_i)) (softmax, T = 1): the generator seeks samples the student has not learned yet,
  near the teacher's decision boundary; from round ``warmup`` on [C]. The student starts
  from the model's own initialisation (``student_init: model`` [D]); ``code``: the code's
  ``weight_init`` (Xavier-normal weights, N(0, 1) biases) [C], with which LANDER's student
  diverged (NaN in its first rounds) on split digits with the BatchNorm-free cnn2d.
- the kept sample of a round is the iterate with the lowest L_gen [C ``best_inputs``];
  the pool keeps the newest ``syn_size`` rows [D] (the code reads the first ``nums`` files
  in name order).
- after each round from ``warmup`` on, S learns from T on the pool so far [C ``kd_train``]:
  ``student_steps`` SGD steps on batches of ``student_batch`` rows of T^2 * KL(T/T || S/T)
  (temperature ``student_temperature``).

TARGET's generator [C ``Generator``, ``GlobalSynthesizer``]: z ~ N(0, I) in R^nz -> Linear ->
[2 ngf, H/4, W/4] -> BN -> up x2 -> conv3 -> BN -> LeakyReLU(0.2) -> up x2 -> conv3 (ngf) ->
BN -> LeakyReLU -> conv3 (C channels) -> sigmoid, cropped to H x W [D: H, W not multiples of
4 start from the rounded-up size]. The image in [0, 1] becomes a model input as the data
pipeline makes one of a stored image: normalised by its per-channel mean / std where it
normalises stored (uint8) images, which the clients report at the task end, else as it is
(float datasets such as digits hold [0, 1] images) [C: the code's dataset normaliser].
Inputs of rank 1 or 2 (tabular, sequences) get a fully connected generator [D]: Linear ->
BN1d -> LeakyReLU, twice (width 8 ngf), Linear to the input size, no squashing (those
datasets are standardised).
Meta-learning [C, ``is_maml``]: a meta generator persists over the rounds; each round trains
a fresh copy (``fast``) jointly with its z (lr ``lr_z``); fomaml: the fast copy's gradient of
every step is summed into the meta generator, which takes one Adam step (lr lr_g * g_steps)
at the round's last step; reptile: after the round, one Adam step along 67 (w_meta - w_fast).
``reset_l0`` [C]: at round 120 + warmup the meta generator's first Linear and BatchNorm get
N(0, 0.02) weights and zero biases.

Randomness is keyed [D]: module initialisation and any dropout under a global seed
torch_seed(seed, task, 0xB0, INIT) restored afterwards (``keyed_scope``); z, targets, noisy
layers, student and augmentation batches from CPU generators keyed (seed, task, 0xB0, what,
round). ``augment`` [C generation-time ``aug``; D default off]: each row shifted by a random
crop of its 4-pixel zero padding and mirrored with probability 1/2, before the teacher (and
the student's batches); the real data's augmentation is the dataset's own setting, and
mirroring digits changes their class.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..utils import torch_seed
from .distill import kd_loss
from .params import boolean, choice, integer, number

log = logging.getLogger(__name__)

SYNTH_STREAM = 0xB0  # keyed randomness of the server's synthesis
INIT, NOISE, TARGETS, STUDENT, AUGMENT = range(5)  # its sub-streams
BETAS = (0.5, 0.999)  # Adam betas of the generator [C]
REPTILE_SCALE = 67.0  # reptile's meta gradient: 67 (w_meta - w_fast) [C]
RESET_L0_ROUND = 120  # + warmup: the round of ``reset_l0`` [C]
CHUNK = 1024  # rows per teacher forward when scoring the pool


# ----------------------------------------------------------------------------- helpers


def keyed_generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded by torch_seed(*keys)."""
    return torch.Generator().manual_seed(torch_seed(*keys))


@contextmanager
def keyed_scope(seed: int, device: torch.device) -> Iterator[None]:
    """The global RNG (CPU, and ``device`` if CUDA) seeded by ``seed`` inside, restored after:
    module initialisation and dropout inside draw keyed values and leave the run's RNG as
    it was."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def features_and_logits(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(penultimate features, logits of every class): per-task heads give each class its
    newest head's logit (``TaskHeads.combined``)."""
    z = model.features(x)
    return z, model.head_logits(z)


def reset_(model: nn.Module) -> None:
    """Every submodule's own initialisation (``reset_parameters``), from the global RNG."""
    for m in model.modules():
        if m is not model and hasattr(m, "reset_parameters"):
            m.reset_parameters()


def reinit_(model: nn.Module, gen: torch.Generator) -> None:
    """The code's ``weight_init`` [C], keyed: Conv1d weights N(0, 1), Conv2d / Linear
    Xavier-normal, their biases N(0, 1); BatchNorm weights N(1, 0.02), biases 0."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv1d):
                nn.init.normal_(m.weight, generator=gen)
            elif isinstance(m, (nn.Conv2d, nn.Conv3d, nn.Linear)):
                nn.init.xavier_normal_(m.weight, generator=gen)
            elif isinstance(m, _BatchNorm) and m.affine:
                nn.init.normal_(m.weight, 1.0, 0.02, generator=gen)
                nn.init.zeros_(m.bias)
                continue
            else:
                continue
            if m.bias is not None:
                nn.init.normal_(m.bias, generator=gen)


def boundary_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """L_adv = -mean_i 1[argmax s_i = argmax t_i] KL(softmax t_i || softmax s_i) [C]."""
    agree = (student.argmax(1) == teacher.argmax(1)).to(teacher.dtype)
    logp_t = F.log_softmax(teacher, 1)
    kl = (logp_t.exp() * (logp_t - F.log_softmax(student, 1))).sum(1)
    return -(kl * agree).mean()


def crop_flip(x: torch.Tensor, gen: torch.Generator, pad: int = 4) -> torch.Tensor:
    """Each image of ``x`` [B, C, H, W] cropped at a random offset from its ``pad``-pixel zero
    padding and mirrored with probability 1/2 (the code's kornia RandomCrop + RandomHorizontalFlip
    [C]); differentiable in x. Other ranks: unchanged."""
    if x.dim() != 4:
        return x
    b, _, h, w = x.shape
    dy = torch.randint(0, 2 * pad + 1, (b,), generator=gen).to(x.device)
    dx = torch.randint(0, 2 * pad + 1, (b,), generator=gen).to(x.device)
    flip = (torch.rand(b, generator=gen) < 0.5).to(x.device)
    padded = F.pad(x, (pad, pad, pad, pad))
    ys = dy[:, None] + torch.arange(h, device=x.device)  # [B, H]
    xs = dx[:, None] + torch.arange(w, device=x.device)  # [B, W]
    xs = torch.where(flip[:, None], xs.flip(1), xs)
    rows = torch.arange(b, device=x.device)[:, None, None]
    return padded.permute(0, 2, 3, 1)[rows, ys[:, :, None], xs[:, None, :]].permute(0, 3, 1, 2)


# ----------------------------------------------------------------------------- generators


class ImageDecoder(nn.Module):
    """TARGET's generator body [C ``Generator``]: v [B, nz] -> images [B, C, H, W] in [0, 1]."""

    def __init__(self, nz: int, ngf: int, shape: Sequence[int]) -> None:
        super().__init__()
        c, h, w = (int(s) for s in shape)
        self.shape = (c, h, w)
        self.h0, self.w0 = -(-h // 4), -(-w // 4)
        self.l1 = nn.Linear(nz, 2 * ngf * self.h0 * self.w0)
        self.conv_blocks = nn.Sequential(
            nn.BatchNorm2d(2 * ngf), nn.Upsample(scale_factor=2),
            nn.Conv2d(2 * ngf, 2 * ngf, 3, padding=1, bias=False), nn.BatchNorm2d(2 * ngf),
            nn.LeakyReLU(0.2), nn.Upsample(scale_factor=2),
            nn.Conv2d(2 * ngf, ngf, 3, padding=1, bias=False), nn.BatchNorm2d(ngf), nn.LeakyReLU(0.2),
            nn.Conv2d(ngf, c, 3, padding=1), nn.Sigmoid(),
        )  # fmt: skip

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        out = self.l1(v).view(len(v), -1, self.h0, self.w0)
        _, h, w = self.shape
        return self.conv_blocks(out)[:, :, :h, :w]

    def first_layers(self) -> list[nn.Module]:
        """The layers ``reset_l0`` re-initialises (the code's "l1.0" and "conv_blocks.0")."""
        return [self.l1, self.conv_blocks[0]]


class VectorDecoder(nn.Module):
    """The generator body for inputs of rank 1 or 2 [D]: v [B, nz] -> x [B, *shape]."""

    def __init__(self, nz: int, ngf: int, shape: Sequence[int]) -> None:
        super().__init__()
        self.shape = tuple(int(s) for s in shape)
        width = 8 * ngf
        self.l1 = nn.Linear(nz, width)
        self.body = nn.Sequential(
            nn.BatchNorm1d(width), nn.LeakyReLU(0.2), nn.Linear(width, width),
            nn.BatchNorm1d(width), nn.LeakyReLU(0.2), nn.Linear(width, math.prod(self.shape)),
        )  # fmt: skip

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return self.body(self.l1(v)).view(len(v), *self.shape)

    def first_layers(self) -> list[nn.Module]:
        return [self.l1, self.body[0]]


def make_decoder(nz: int, ngf: int, shape: Sequence[int]) -> nn.Module:
    """ImageDecoder for [C, H, W] inputs, VectorDecoder otherwise."""
    return ImageDecoder(nz, ngf, shape) if len(shape) == 3 else VectorDecoder(nz, ngf, shape)


# ----------------------------------------------------------------------------- BN statistics


def _norm(d: torch.Tensor) -> torch.Tensor:
    """||d||_2, finite wherever it fits a float32 [D]: a generator far from the data can drive
    a deep layer's batch variance past 1e19, whose square overflows float32 (the loss, then the
    generator and its pool, became inf / NaN at smoke scale); there the norm is taken in
    float64. Elsewhere it is the float32 norm, bit for bit."""
    n = torch.linalg.vector_norm(d)
    return torch.where(torch.isfinite(n), n, torch.linalg.vector_norm(d.double()).to(n.dtype))


class BNStatsLoss:
    """L_BN over ``model``'s BatchNorm layers (forward hooks; ``close()`` removes them): after
    a forward, ``loss()`` is sum_l ||var_l - mix(var)||_2 + ||mean_l - mix(mean)||_2, with
    mix(s) = (1 - m) s + m avg(s) once a round has ended (``end_round``) and s before."""

    def __init__(self, model: nn.Module, momentum: float) -> None:
        self.layers = [
            m for m in model.modules()
            if isinstance(m, _BatchNorm) and m.running_mean is not None and m.running_var is not None
        ]  # fmt: skip
        self.momentum = float(momentum)
        self.avg: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.last: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.terms: dict[int, torch.Tensor] = {}
        self.handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.layers)]

    def _hook(self, i: int):
        def hook(
            module: _BatchNorm, inputs: tuple[torch.Tensor, ...], output: torch.Tensor
        ) -> None:
            x = inputs[0]
            dims = [0, *range(2, x.dim())]
            mean, var = x.mean(dims), x.var(dims, unbiased=False)
            self.last[i] = (mean, var)
            if i in self.avg and self.momentum > 0:
                m, (a_mean, a_var) = self.momentum, self.avg[i]
                mean, var = (1 - m) * mean + m * a_mean, (1 - m) * var + m * a_var
            self.terms[i] = _norm(module.running_var - var) + _norm(module.running_mean - mean)

        return hook

    def loss(self, like: torch.Tensor) -> torch.Tensor:
        """The last forward's L_BN (0 without BatchNorm layers)."""
        return sum(self.terms.values(), like.new_zeros(()))

    def end_round(self) -> None:
        """avg <- the last step's statistics (first round), else m avg + (1 - m) last [C]."""
        if self.momentum == 0:
            return
        m = self.momentum
        for i, (mean, var) in self.last.items():
            mean, var = mean.detach(), var.detach()
            if i in self.avg:
                a_mean, a_var = self.avg[i]
                mean, var = m * a_mean + (1 - m) * mean, m * a_var + (1 - m) * var
            self.avg[i] = (mean, var)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


# ----------------------------------------------------------------------------- hyperparameters


@dataclass(frozen=True)
class SynthesisParams:
    """The hyperparameters TARGET and LANDER share (defaults: TARGET's; see each method)."""

    kd: float = number(25.0, minimum=0)  # weight of the clients' KD term [C TARGET README --kd 25]
    temperature: float = number(2.0, exclusiveMinimum=0)  # the clients' KD temperature [C _KD_loss(..., 2)]
    ce: str = choice("task", ("task", "all"))  # the clients' CE over their task's classes [C] | all classes [D]
    replay_batch: int = integer(0, minimum=0)  # synthetic rows per local step; 0: the method's rule [C]
    syn_size: int = integer(8000, minimum=1)  # synthetic rows kept [P fedprotip App. E.3; C --nums 8000]
    syn_batch: int = integer(256, minimum=2)  # rows per synthesis round [P fedprotip App. E.3; C]
    syn_rounds: int = integer(10, minimum=1)  # synthesis rounds [C cifar100 syn_round]
    g_steps: int = integer(10, minimum=1)  # generator steps per round [C]
    warmup: int = integer(20, minimum=0)  # rounds before the student learns / the adversarial term [C]
    lr_g: float = number(0.002, exclusiveMinimum=0)  # generator Adam lr [C]
    lr_z: float = number(0.01, exclusiveMinimum=0)  # lr of the round's free inputs (TARGET: z) [C]
    nz: int = integer(256, minimum=1)  # generator input width [C]
    ngf: int = integer(64, minimum=1)  # generator width [C]
    bn: float = number(10.0, minimum=0)  # weight of L_BN [C]
    oh: float = number(0.5, minimum=0)  # weight of the CE on the targets [C]
    adv: float = number(1.0, minimum=0)  # weight of L_adv [C]
    bn_momentum: float = number(0.9, minimum=0, exclusiveMaximum=1)  # mixing of the BN statistics over rounds [C bn_mmt]
    student_steps: int = integer(400, minimum=0)  # student KD steps per round [C kd_steps]
    student_batch: int = integer(256, minimum=1)  # rows per student step [C sample_batch_size]
    student_lr: float = number(0.2, exclusiveMinimum=0)  # [C]
    student_temperature: float = number(20.0, exclusiveMinimum=0)  # [C T]
    augment: bool = boolean(False)  # generation-time crop + flip [C] (off: [D])
    student_init: str = choice("model", ("model", "code"))  # the student's re-initialisation: the model's own [D] | code [C]


# ----------------------------------------------------------------------------- the synthesis


@dataclass
class SynthesisResult:
    x: torch.Tensor  # the pool [N, *shape], newest rows last
    y: torch.Tensor  # each row's generator target (class id) [N]
    losses: list[list[float]]  # L_gen of every step of every round
    stats: dict[str, float]


class Synthesizer:
    """TARGET's synthesis at one task end (module docstring); LANDER subclasses it
    (``lander.LanderSynthesizer``) and changes the generator, its inputs, the extra terms
    and the student's loss. ``classes``: the learned classes (the teacher's outputs);
    ``key``: (seed, task) of its randomness."""

    student_momentum, student_wd = 0.9, 1e-4  # [C TARGET]
    student_cosine = (200, 2e-4)  # T_max, eta_min of the student's cosine schedule [C]

    def __init__(self, p: Any, teacher: nn.Module, classes: torch.Tensor, shape: Sequence[int],
                 device: torch.device, key: tuple[int, int],
                 normalize: tuple[Sequence[float], Sequence[float]] | None = None) -> None:  # fmt: skip
        self.p, self.teacher, self.device, self.key = p, teacher, device, key
        self.classes = classes.to(device)
        self.shape = tuple(int(s) for s in shape)
        self.normalize = None  # per-channel (mean, std) of the model's image inputs
        if normalize is not None and len(self.shape) == 3:
            self.normalize = tuple(
                torch.tensor(v, dtype=torch.float32, device=device).view(-1, 1, 1)
                for v in normalize
            )
        with keyed_scope(torch_seed(*key, SYNTH_STREAM, INIT), device):
            self.generator = self.make_generator().to(device).train()
            self.student = copy.deepcopy(teacher)
            for q in self.student.parameters():
                q.requires_grad_(True)
            if p.student_init == "code":
                reinit_(self.student, keyed_generator(*key, SYNTH_STREAM, INIT, 1))
            else:
                reset_(self.student)
            self.student.to(device)
        self.meta_opt = self.make_meta_optimizer()
        self.student_opt = torch.optim.SGD(self.student.parameters(), lr=p.student_lr,
                                           momentum=self.student_momentum, weight_decay=self.student_wd)  # fmt: skip
        t_max, eta_min = self.student_cosine
        self.student_sched = torch.optim.lr_scheduler.CosineAnnealingLR(
            self.student_opt, t_max, eta_min
        )
        self.bn = BNStatsLoss(teacher, p.bn_momentum)
        self.pool_x: list[torch.Tensor] = []
        self.pool_y: list[torch.Tensor] = []
        self.student_loss_last = math.nan

    # ------------------------------------------------------------ the variant's parts
    def make_generator(self) -> nn.Module:
        """TARGET: the meta generator (z -> input)."""
        return make_decoder(self.p.nz, self.p.ngf, self.shape)

    def make_meta_optimizer(self) -> torch.optim.Optimizer | None:
        return torch.optim.Adam(
            self.generator.parameters(), self.p.lr_g * self.p.g_steps, betas=BETAS
        )

    def rounds(self) -> int:
        return self.p.syn_rounds

    def begin_round(self, r: int) -> SimpleNamespace:
        """The round's state: ``targets`` (positions in ``classes``), ``groups`` (what Adam
        optimises), ``inputs()`` (the batch the teacher sees). TARGET: a fresh copy of the
        meta generator and a fresh z."""
        p, dev = self.p, self.device
        if p.reset_l0 and r + 1 == RESET_L0_ROUND + p.warmup:
            with keyed_scope(torch_seed(*self.key, SYNTH_STREAM, INIT, 2), dev), torch.no_grad():
                for m in self.generator.first_layers():
                    nn.init.normal_(m.weight, 0.0, 0.02)
                    nn.init.zeros_(m.bias)
        gen = keyed_generator(*self.key, SYNTH_STREAM, NOISE, r)
        z = torch.randn(p.syn_batch, p.nz, generator=gen).to(dev).requires_grad_(True)
        targets = torch.randint(0, len(self.classes), (p.syn_batch,), generator=gen).to(dev)
        fast = copy.deepcopy(self.generator)
        groups = [{"params": list(fast.parameters())}, {"params": [z], "lr": p.lr_z}]
        return SimpleNamespace(
            targets=targets, groups=groups, fast=fast, inputs=lambda: self.model_input(fast(z))
        )

    def model_input(self, g: torch.Tensor) -> torch.Tensor:
        """The generator's image in [0, 1] as the model sees its data: normalised by the
        data pipeline's per-channel mean / std where it has them [C: the code's normalizer]."""
        if self.normalize is None:
            return g
        mean, std = self.normalize
        return (g - mean) / std

    def extra_loss(self, st: SimpleNamespace, features: torch.Tensor) -> torch.Tensor | None:
        """The variant's further generator terms (TARGET: none)."""
        return None

    def after_backward(self, st: SimpleNamespace, step: int) -> None:
        """fomaml: the fast copy's gradient summed into the meta generator; its Adam step at
        the round's last step [C]."""
        if self.p.meta != "fomaml":
            return
        meta = list(self.generator.parameters())
        if step == 0:
            self.meta_opt.zero_grad(set_to_none=False)
        for pm, pf in zip(meta, st.fast.parameters()):
            if pm.grad is None:
                pm.grad = torch.zeros_like(pm)
            if pf.grad is not None:
                pm.grad.add_(pf.grad)
        if step == self.p.g_steps - 1:
            self.meta_opt.step()

    def end_round(self, st: SimpleNamespace) -> None:
        """reptile: one Adam step along 67 (w_meta - w_fast) [C]."""
        if self.p.meta != "reptile":
            return
        self.meta_opt.zero_grad(set_to_none=False)
        with torch.no_grad():
            for pm, pf in zip(self.generator.parameters(), st.fast.parameters()):
                pm.grad = REPTILE_SCALE * (pm - pf)
        self.meta_opt.step()

    def stores(self, r: int) -> bool:
        """TARGET keeps every round's batch [C]."""
        return True

    def adversarial(self, r: int) -> bool:
        """L_adv from round ``warmup`` on (the code's ep >= warmup, ep = r + 1) [C]."""
        return r + 1 >= self.p.warmup

    def trains_student(self, r: int) -> bool:
        """The student learns after rounds r >= warmup [C]."""
        return r >= self.p.warmup

    def student_optimizer(self) -> torch.optim.Optimizer:
        return self.student_opt

    def after_student(self) -> None:
        self.student_sched.step()

    def student_extra(self, s_feat: torch.Tensor, t_feat: torch.Tensor) -> torch.Tensor | None:
        return None

    def teacher_features(self, features: torch.Tensor, model: nn.Module) -> torch.Tensor:
        """What the variant's terms read of a forward (TARGET: the features)."""
        return features

    # ------------------------------------------------------------ the loop
    def outputs(self, model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the variant's features, logits of the learned classes) of ``x``."""
        z, logits = features_and_logits(model, x)
        return self.teacher_features(z, model), logits[:, self.classes]

    def run(self) -> SynthesisResult:
        p = self.p
        losses: list[list[float]] = []
        self.teacher.eval()
        try:
            for r in range(self.rounds()):
                losses.append(self.round(r))
        finally:
            self.bn.close()
        if self.pool_x:
            x, y = torch.cat(self.pool_x)[-p.syn_size :], torch.cat(self.pool_y)[-p.syn_size :]
        else:
            x = torch.zeros(0, *self.shape, device=self.device)
            y = torch.zeros(0, dtype=torch.long, device=self.device)
        stats = {
            "bn_layers": float(len(self.bn.layers)),
            "gen_loss_first": sum(losses[0]) / len(losses[0]),
            "gen_loss_last": sum(losses[-1]) / len(losses[-1]),
            "pool_rows": float(len(x)),
        }
        if not math.isnan(self.student_loss_last):
            stats["student_kd_last"] = self.student_loss_last
        return SynthesisResult(x, self.classes[y], losses, stats)

    def round(self, r: int) -> list[float]:
        p = self.p
        st = self.begin_round(r)
        opt = torch.optim.Adam(st.groups, lr=p.lr_g, betas=BETAS)
        aug = keyed_generator(*self.key, SYNTH_STREAM, AUGMENT, r) if p.augment else None
        adversarial = p.adv > 0 and self.adversarial(r)
        self.student.eval()
        best, best_x, out = math.inf, None, []
        with keyed_scope(torch_seed(*self.key, SYNTH_STREAM, INIT, 3, r), self.device):
            for step in range(p.g_steps):
                x = st.inputs()
                xa = crop_flip(x, aug) if aug is not None else x
                feats, t_out = self.outputs(self.teacher, xa)
                loss = p.bn * self.bn.loss(t_out) + p.oh * F.cross_entropy(t_out, st.targets)
                if adversarial:
                    loss = loss + p.adv * boundary_loss(self.outputs(self.student, xa)[1], t_out)
                extra = self.extra_loss(st, feats)
                if extra is not None:
                    loss = loss + extra
                value = float(loss.detach())
                if best_x is None or value < best:
                    best, best_x = value, x.detach().clone()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                self.after_backward(st, step)
                opt.step()
                out.append(value)
            self.bn.end_round()
            self.end_round(st)
            if self.stores(r):
                self.pool_x.append(best_x)
                self.pool_y.append(st.targets)
            if self.trains_student(r) and p.student_steps > 0 and self.pool_x:
                self.train_student(r)
        return out

    def train_student(self, r: int) -> None:
        """``student_steps`` steps of T^2 KL(T || S) (+ the variant's term) on batches of the
        pool so far [C ``kd_train``]."""
        p = self.p
        pool = torch.cat(self.pool_x)[-p.syn_size :]
        gen = keyed_generator(*self.key, SYNTH_STREAM, STUDENT, r)
        opt = self.student_optimizer()
        self.student.train()
        for _ in range(p.student_steps):
            xb = pool[torch.randperm(len(pool), generator=gen)[: p.student_batch].to(self.device)]
            if p.augment:
                xb = crop_flip(xb, gen)
            with torch.no_grad():
                t_feat, t_out = self.outputs(self.teacher, xb)
            s_feat, s_out = self.outputs(self.student, xb)
            loss = kd_loss(s_out, t_out, p.student_temperature)
            extra = self.student_extra(s_feat, t_feat)
            if extra is not None:
                loss = loss + extra
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            self.student_loss_last = float(loss.detach())
        self.after_student()
        self.student.eval()


@torch.no_grad()
def score_pool(
    model: nn.Module, x: torch.Tensor, map_features: Any = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits of every class [N, C], map_features(model, features) [N, ...] or None) of the
    pool rows ``x`` under ``model`` in eval mode (its train/eval mode restored)."""
    was = model.training
    model.eval()
    logits, feats = [x.new_zeros(0, model.head.out_features)], []  # an empty pool scores to [0, C]
    try:
        for s in range(0, len(x), CHUNK):
            z, out = features_and_logits(model, x[s : s + CHUNK])
            logits.append(out)
            if map_features is not None:
                feats.append(map_features(model, z))
    finally:
        model.train(was)
    return torch.cat(logits), (torch.cat(feats) if feats else None)
