"""Fed+SCR: FedAvg whose clients learn with Supervised Contrastive Replay (Mai, Li, Kim,
Sanner: "Supervised Contrastive Replay: Revisiting the Nearest Class Mean Classifier in
Online Class-Incremental Continual Learning", CVPR Workshops 2021; the authors' code
RaptorMai/online-continual-learning, ``agents/scr.py``, ``agents/base.py``, ``utils/loss.py``,
``models/resnet.py``), the Fed+SCR row of FedProTIP's Table 5 (papers/fedprotip.md Sec. 6.4:
"we average class prototypes across clients at inference time while keeping replay data
local, and perform model aggregation using FedAvg"). Tags: [P] a paper, [C] SCR's code, [D]
our decision. The SCR paper's body was not readable through this project's search tools; its
code is followed and tagged [C].

Client k, each local step on its minibatch (x, y) [C ``SupContrastReplay.train_learner``]:

1. a memory batch (x_m, y_m) of ``memory_batch_size`` rows drawn uniformly without
   replacement from the client's buffer [C random retrieve]; while the buffer is empty (a
   client's very first step) the minibatch alone [D: the code skips the update, ``if
   mem_x.size(0) > 0``; taking every step alike keeps both trainers' steps one rule];
2. X = [x; x_m] (labels Y; the code's order is [x_m; x], which SupCon does not see), and a
   second view X' = A(X) [C: the code contrasts the batch as it is with one augmented copy];
   x and the buffer's rows are the rows as the model sees them, so where the dataset declares
   an augmentation (the paper configs' crop and flip) the first view carries it too [D: the
   code's rows are un-augmented tensors];
3. z = normalize(g(f(X))), z' = normalize(g(f(X'))): f the model's body (its penultimate
   features), g the projection head g(h) = W2 relu(W1 h + b1) + b2 of width ``proj_dim``
   [C ``SupConResNet``: head 'mlp', dim_in -> dim_in -> 128], added to the model
   (``model_init``: part of the global weights, averaged by FedAvg); both forward passes in
   training mode (each updates BatchNorm's statistics, as the code's two calls do);
4. L = SupCon over the 2N rows [C ``SupConLoss``, contrast_mode 'all', as the code has it:
   without the SupCon paper's temperature / base_temperature factor]::

       L = -(1 / 2N) sum_i (1 / |P(i)|) sum_{p in P(i)} log( exp(z_i . z_p / T) / sum_{a != i} exp(z_i . z_a / T) )

   P(i): the other rows of i's class (its own other view included); ``supcon_loss``. The
   model's classifier is never trained (no cross-entropy) [C];
5. then the minibatch is offered to the buffer (reservoir [C reservoir update]; here
   ``methods/replay.py``: each row offered once per task, on the client's first pass,
   keyed draws [D, as A-GEM's and DER's buffers in this project]).

A [C: kornia ``RandomResizedCrop(scale=(0.2, 1))``, ``RandomHorizontalFlip()``,
``ColorJitter(0.4, 0.4, 0.4, 0.1, p=0.8)``, ``RandomGrayscale(p=0.2)``] (``scr_augment``),
per row from keyed draws (seed, round, client, local step, 0x5C2): a crop of area share
s ~ U(0.2, 1) and aspect ratio r ~ logU(3/4, 4/3) (width sqrt(s r), height sqrt(s / r),
each at most the image [D: torchvision's and kornia's retry loop is not drawn]) at a uniform
place, resized back: the box, a continuous region, sampled bilinearly at the output's pixel
centres [D: torchvision crops whole pixels, then resizes]; a horizontal flip with p 0.5; with p 0.8 brightness, contrast,
saturation factors ~ U(0.6, 1.4) and a hue shift ~ U(-0.1, 0.1) turns, applied in that order
[D: the libraries draw the order], each clamped to [0, 1] as torchvision's are; grayscale
with p 0.2. Colours act on pixel values: the data pipeline's normalisation undone and redone
(its mean / std), float images as stored taken as [0, 1] (digits); one-channel images get the
brightness and contrast only. ``views: dataset`` [D] instead takes A = the dataset's own
keyed augmentation (``ctx.augment_rows``: crop and flip; the identity where it declares none),
for inputs that are not images.

Inference [C ``ContinualLearner.evaluate``, ncm]: y* = argmin_c ||phi(x) - mu_c||^2 with
phi = normalize(f(x)) (the body's features, not the projection) and mu_c the normalised mean
of phi over class c's buffer rows; scores -||phi - mu_c||^2 (``shared.nme_scores``), classes
without a prototype at the row's lowest score minus 30 [D: the code draws a random mean for
them]. Federated [P]: each client sends, for each class of its buffer, the sum of phi over its
rows and their count, on the current global model in eval mode, after every aggregation
(ROUND_END, every sampled client: the report reads only the buffer); the server keeps each
client's latest report and mu_c = normalize(mean over clients of their own prototypes
normalize(sum / count)) (``shared.class_means`` with ``average``: "we average class
prototypes across clients" [P]; over the clients whose report for c is the newest, so no
prototype mixes two models' features [D]; the final normalisation [D], as the code normalises
every mean). Only the server's model is scored by NCM; a client's local model by its logits
[D]. Before the first report: the (untrained) logits.

Hyperparameters [C README, SCR on CIFAR-100: ``--mem_size 5000 --eps_mem_batch 100 --temp
0.07 --head mlp``]: ``buffer_size`` 5000 rows per client [C: the code's one learner; FedProTIP
states none], ``memory_batch_size`` 100, ``temperature`` 0.07, ``proj_dim`` 128 [C], ``views``
scr [C] | dataset [D]. The code's SGD lr 0.1, batch 10, one epoch (online) are train settings.

Both trainers [D, issue 32]: the step's whole loss is written once for a stack of clients
(``client_live_terms``): each client's memory batch joins its minibatch in the stacked forward
(``JoinedLive``), its second view goes through the stack's weights (``features_logits``; with
BatchNorm each client's statistics see its joined rows, then its view, as a client alone's
two forward passes), SupCon over each client's real rows (``supcon_loss``, ``project``), then
its real rows are offered to its buffer; ``client_step`` is the same for a client alone. The
classifier, outside the loss, gets no update in either (``outside``). Memory and view draws
are host work at every step (``capturable_terms = False``). Equal within 1e-5
(tests/methods/test_scr.py: CNN, per-task heads, ResNet-8).

Diagnostics (``scr_<key>``): ``buffer_size`` (rows held after the round), ``memory_steps``
(share of steps with a memory batch), ``proto_classes`` (classes with a prototype on the server).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..models import MODEL_INPUT_RANK
from ..utils import FedForgetError, torch_seed
from .base import (
    ROUND_END,
    ClientContext,
    ClientShape,
    FedAvg,
    JoinedLive,
    LiveStep,
    RunInfo,
    ServerContext,
    StepBatch,
    Upload,
)
from .params import choice, integer, number
from .registry import METHODS
from .replay import Replay, buffer_bytes
from .shared import (
    class_means,
    class_report,
    embed_rows,
    keep_reports,
    nme_scores,
    padded,
    report_bytes,
)

VIEW_STREAM = 0x5C2  # keyed randomness of the second view's augmentation
MEMORY_STREAM = 0x5C3  # keyed randomness of the memory batches
KEY = "scr"  # ctx.state: the buffer
PROTOS = "scr_protos"  # server.state: each client's latest class report
VIEWS = ("scr", "dataset")
LUMA = (0.299, 0.587, 0.114)  # grayscale weights (ITU-R 601-2, torchvision's and kornia's)


def supcon_loss(z: torch.Tensor, y: torch.Tensor, temperature: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """SCR's SupCon loss [C ``SupConLoss``, contrast_mode 'all'] of each client of a stack:
    ``z`` [G, V, N, d] the V views (L2-normalised) of its N rows, labels ``y`` [G, N], ``mask``
    [G, N] 1.0 on its real rows (None: all): every real row of every view an anchor against
    all the client's other real rows, its positives those of its class. [G]."""
    g, v, n = z.shape[:3]
    f = z.reshape(g, v * n, -1)
    f = f.to(torch.promote_types(f.dtype, torch.float32))
    labels = y.repeat(1, v)
    valid = torch.ones_like(labels, dtype=torch.bool) if mask is None else mask.bool().repeat(1, v)
    with torch.autocast(z.device.type, enabled=False):  # fp32 whatever the step's precision [D]
        logits = f @ f.transpose(1, 2) / temperature
    out = torch.eye(v * n, dtype=torch.bool, device=z.device) | ~valid.unsqueeze(1)  # self, padding
    log_prob = logits - torch.logsumexp(logits.masked_fill(out, float("-inf")), 2, keepdim=True)
    pos = (labels.unsqueeze(2) == labels.unsqueeze(1)) & ~out
    anchor = -(log_prob * pos).sum(2) / pos.sum(2).clamp_min(1)
    return (anchor * valid).sum(1) / valid.sum(1)


def project(w: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """z = normalize(g(h)) of body features ``h`` [G, N, F] through each client's projection
    head in the stacked weights ``w`` (``scr_head.*`` [G, ...]): [G, N, proj_dim]."""
    h = torch.relu(torch.baddbmm(w["scr_head.0.bias"].unsqueeze(1), h, w["scr_head.0.weight"].transpose(1, 2)))
    return F.normalize(torch.baddbmm(w["scr_head.2.bias"].unsqueeze(1), h, w["scr_head.2.weight"].transpose(1, 2)), dim=-1)


def outside(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """The step's gradient map: None for the classifier's parameters, which SCR's loss never
    reaches (a client alone leaves their gradient None: the optimizer skips them, no decay)."""
    return {n: None if n.startswith("head.") else g for n, g in grads.items()}


def gray(p: torch.Tensor) -> torch.Tensor:
    """[B, 1, H, W] luma of pixel values ``p`` [B, 3, H, W]."""
    w = torch.tensor(LUMA, dtype=p.dtype, device=p.device).view(1, 3, 1, 1)
    return (p * w).sum(1, keepdim=True)


def rgb_to_hsv(p: torch.Tensor) -> torch.Tensor:
    """[B, 3, H, W] hue (turns), saturation, value of RGB ``p`` in [0, 1]."""
    r, g, b = p.unbind(1)
    mx, mn = p.max(1).values, p.min(1).values
    d = mx - mn
    safe = torch.where(d > 0, d, torch.ones_like(d))
    h = torch.where(mx == r, ((g - b) / safe) % 6, torch.where(mx == g, (b - r) / safe + 2, (r - g) / safe + 4))
    h = torch.where(d > 0, h / 6, torch.zeros_like(h))
    s = torch.where(mx > 0, d / torch.where(mx > 0, mx, torch.ones_like(mx)), torch.zeros_like(mx))
    return torch.stack([h, s, mx], 1)


def hsv_to_rgb(q: torch.Tensor) -> torch.Tensor:
    """The inverse of ``rgb_to_hsv``."""
    h, s, v = q.unbind(1)
    k = lambda m: (m + h * 6) % 6  # noqa: E731
    f = lambda m: v - v * s * (torch.minimum(k(m), 4 - k(m)).clamp(0, 1))  # noqa: E731
    return torch.stack([f(5), f(3), f(1)], 1)


def view_draws(n: int, gen: torch.Generator) -> torch.Tensor:
    """[n, 11] float64 uniforms from ``gen`` (a CPU generator): one row of ``scr_augment``'s
    draws per image."""
    return torch.rand(n, 11, generator=gen, dtype=torch.float64)


def scr_augment(x: torch.Tensor, u: torch.Tensor, mean: Sequence[float] | None = None,
                std: Sequence[float] | None = None) -> torch.Tensor:  # fmt: skip
    """SCR's second view of images ``x`` [B, C, H, W] (model inputs; ``mean`` / ``std``: the
    pipeline's normalisation, None for pixel values as they are) by the draws ``u`` [B, 11]
    (``view_draws``): crop area share (0.2 + 0.8 u0), log aspect ratio, crop centre (u2, u3),
    flip (u4 < 0.5), colour jitter (u5 < 0.8) with brightness, contrast, saturation factors
    0.6 + 0.8 u6..u8 and hue shift -0.1 + 0.2 u9, grayscale (u10 < 0.2, three channels)."""
    b, c = x.shape[0], x.shape[1]
    u = u.to(x.device, torch.float32)
    area = 0.2 + 0.8 * u[:, 0]
    ratio = torch.exp(math.log(3 / 4) + (math.log(4 / 3) - math.log(3 / 4)) * u[:, 1])
    w, h = (area * ratio).sqrt().clamp(max=1.0), (area / ratio).sqrt().clamp(max=1.0)
    cx, cy = w / 2 + (1 - w) * u[:, 2], h / 2 + (1 - h) * u[:, 3]
    flip = torch.where(u[:, 4] < 0.5, -1.0, 1.0)
    zero = torch.zeros_like(w)
    theta = torch.stack([torch.stack([w * flip, zero, 2 * cx - 1], 1), torch.stack([zero, h, 2 * cy - 1], 1)], 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    out = F.grid_sample(x.float(), grid, mode="bilinear", padding_mode="border", align_corners=False)
    if mean is not None:
        m = torch.tensor(mean, device=x.device).view(1, -1, 1, 1)
        s = torch.tensor(std, device=x.device).view(1, -1, 1, 1)
        p = out * s + m
    else:
        p = out
    jitter = (u[:, 5] < 0.8).view(b, 1, 1, 1)
    f = (0.6 + 0.8 * u[:, 6:9]).view(b, 3, 1, 1, 1)  # brightness, contrast, saturation
    q = (p * f[:, 0]).clamp(0, 1)
    lum = gray(q) if c == 3 else q.mean(1, keepdim=True)
    q = ((q - lum.mean((2, 3), keepdim=True)) * f[:, 1] + lum.mean((2, 3), keepdim=True)).clamp(0, 1)
    if c == 3:
        g = gray(q)
        q = (g + (q - g) * f[:, 2]).clamp(0, 1)
        hsv = rgb_to_hsv(q)
        hue = (-0.1 + 0.2 * u[:, 9]).view(b, 1, 1)
        q = hsv_to_rgb(torch.stack([(hsv[:, 0] + hue) % 1.0, hsv[:, 1], hsv[:, 2]], 1)).clamp(0, 1)
    p = torch.where(jitter, q, p)
    if c == 3:
        p = torch.where((u[:, 10] < 0.2).view(b, 1, 1, 1), gray(p).expand(-1, 3, -1, -1), p)
    if mean is not None:
        p = (p - m) / s
    return p.to(x.dtype)


@METHODS.register("scr")
class SCR(FedAvg):
    name = "scr"
    one_task_per_class = True  # its buffer labels a row's task by its class (methods.replay)
    # [D] the step's whole loss is live terms over the minibatch joined with the memory batch
    # (``client_live_terms``, ``JoinedLive``), its augmented copy through the stack's weights
    # (``StepBatch.features_logits``), beside ``client_step`` for a client alone; the memory
    # draws, the views' draws and the offers are host work at every step
    live_terms = True
    live_heads = True  # (it reads the body's features, never a head)
    capturable_terms = False
    own_upload = True
    own_predict = True
    exchanges = (ROUND_END,)  # the clients' class prototypes, after each aggregation
    round_end_untrained = True  # the report reads the buffer, not the round's rows

    @dataclass(frozen=True)
    class Params:
        buffer_size: int = integer(5000, minimum=0)  # rows per client [C README --mem_size]; 0: no memory
        memory_batch_size: int = integer(100, minimum=1)  # rows per step from the buffer [C README --eps_mem_batch]
        temperature: float = number(0.07, exclusiveMinimum=0)  # SupCon's T [C --temp]
        proj_dim: int = integer(128, minimum=1)  # the projection head's output width [C feat_dim]
        views: str = choice("scr", VIEWS)  # the second view: SCR's augmentation [C] | the dataset's [D]

    @classmethod
    def check_model(cls, model: str, params: Any = None, options: dict[str, Any] | None = None) -> None:
        """SCR's augmentation (``views: scr``) takes images: models of [C, H, W] inputs."""
        if params is not None and params.views == "scr" and MODEL_INPUT_RANK.get(model, 3) != 3:
            raise FedForgetError(
                f"method 'scr' augments images (views: scr: resized crops, flips, colour jitter); model '{model}' "
                f"takes inputs of rank {MODEL_INPUT_RANK[model]}; allowed: a model of images [C, H, W], or "
                "params.views: dataset"
            )

    def __init__(self, params: Any, info: RunInfo) -> None:
        super().__init__(params, info)
        self.replay = Replay(info, params.buffer_size, MEMORY_STREAM, key=KEY)

    @classmethod
    def client_kept_bytes(cls, params: Any, shape: ClientShape) -> int | None:
        """Its buffer: ``buffer_size`` rows of (x, y, task); and its class report (prototypes),
        which the server keeps (``report_bytes``)."""
        report = report_bytes(shape)
        return None if report is None else buffer_bytes(params.buffer_size, shape) + report

    def model_init(self, model: nn.Module) -> None:
        """Add ``scr_head``: the projection g, dim_in -> dim_in -> proj_dim [C 'mlp']."""
        d = model.feature_dim
        model.scr_head = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, self.p.proj_dim))

    # ---------------------------------------------------------------- server side
    def server_collect(self, exchange: str, server: ServerContext, replies: dict[int, Any]) -> None:
        """The clients' class reports replace their older ones (``shared.keep_reports``)."""
        keep_reports(server.state.setdefault(PROTOS, {}), replies, server.round)

    def prototypes(self, server: ServerContext, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(mu [C, f], known [C]): the clients' prototypes averaged (``shared.class_means``)."""
        return class_means(server.state.get(PROTOS) or {}, True, device, average=True)

    def server_metrics(self, server: ServerContext, uploads: Sequence[Upload]) -> dict[str, float]:
        cm = self.prototypes(server, server.device)
        return {} if cm is None else {"proto_classes": float(cm[1].sum())}

    def eval_predict(self, server: ServerContext, model: nn.Module, x: torch.Tensor, task: int | None) -> torch.Tensor:  # fmt: skip
        """NCM scores on the server's model once prototypes exist; else the logits."""
        cm = self.prototypes(server, x.device) if model is server.model else None
        if cm is None or not bool(cm[1].any()):
            return model.logits(x, task)  # type: ignore[operator]
        return nme_scores(F.normalize(model.features(x).flatten(1), dim=1), *cm)

    # ---------------------------------------------------------------- client side
    def view(self, ctx: ClientContext, x: torch.Tensor, k: int) -> torch.Tensor:
        """The second view of a client's joined rows ``x`` at its local step ``k`` (``views``)."""
        if self.p.views == "dataset":
            return ctx.augment_rows(x, torch.arange(len(x), device=x.device), VIEW_STREAM, k)
        if x.dim() != 4:
            raise FedForgetError(
                f"method 'scr' augments images (views: scr); the inputs have shape {tuple(x.shape[1:])}; "
                "allowed: images [C, H, W], or params.views: dataset"
            )
        gen = torch.Generator().manual_seed(torch_seed(self.info.seed, VIEW_STREAM, ctx.round, ctx.cid, k))
        pipeline = getattr(getattr(ctx.data, "data", None), "inputs", None)
        return scr_augment(x, view_draws(len(x), gen), getattr(pipeline, "mean", None), getattr(pipeline, "std", None))

    def memory(self, ctx: ClientContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This step's memory batch (x_m, y_m) from the client's buffer; None while it is empty."""
        s = self.scratch(ctx)
        mem = self.replay.buffer.sample(ctx.state, self.p.memory_batch_size, s.sample_gen)
        s.joined = 0 if mem is None else len(mem["y"])
        s.with_memory += mem is not None
        return None if mem is None else (mem["x"], mem["y"])

    def client_begin(self, ctx: ClientContext) -> None:
        s = self.scratch(ctx)
        self.replay.begin(ctx, s)
        s.with_memory = 0

    def client_step(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Steps 1-5 above for a client alone (``client_live_terms``'s step on a stack of one):
        SupCon on the minibatch joined with the memory batch and its second view, then the
        minibatch offered to the buffer."""
        model, mem = ctx.model, self.memory(ctx)
        xs, ys = (x, y) if mem is None else (torch.cat([x, mem[0].to(x.dtype)]), torch.cat([y, mem[1]]))
        w = {n: p.unsqueeze(0) for n, p in model.named_parameters() if n.startswith("scr_head.")}
        h = torch.cat([model.features(xs).flatten(1), model.features(self.view(ctx, xs, ctx.steps)).flatten(1)])
        z = project(w, h.unsqueeze(0)).view(1, 2, len(ys), -1)  # [1, V, N, d]
        loss = supcon_loss(z, ys.unsqueeze(0), self.p.temperature)[0]
        loss.backward()
        self.replay.offer(ctx, self.scratch(ctx), x, y)
        return loss.detach()

    def client_live_terms(self, ctxs: Sequence[ClientContext]) -> JoinedLive:
        """``client_step`` for a stack of clients: each client's memory batch joins its
        minibatch (``JoinedLive``), its second view goes through the stack's weights
        (``features_logits``: its BatchNorm statistics see its own rows), SupCon over its real
        rows (``supcon_loss``) is its whole loss, and its real rows (those before its memory
        rows) are then offered to its buffer; the classifier's gradient is dropped (``outside``)."""
        scr = [self.scratch(c) for c in ctxs]

        def rows(lo: int, hi: int, k: int) -> list:
            return [self.memory(c) for c in ctxs[lo:hi]]

        def live(lo: int, hi: int, w: dict[str, torch.Tensor], step: StepBatch) -> LiveStep:
            mask = step.row_mask()
            widths = step.rows if step.rows is not None else [int(n) for n in mask.sum(1).tolist()]
            x2 = [self.view(c, step.x[j, : widths[j]], step.k) for j, c in enumerate(ctxs[lo:hi])]
            h2 = step.features_logits(w, padded(x2, widths) if len(x2) > 1 else x2[0].unsqueeze(0), widths)[0]
            z = torch.stack([project(w, step.features), project(w, h2)], 1)
            loss = supcon_loss(z, step.y, self.p.temperature, mask)
            for j, c in enumerate(ctxs[lo:hi]):
                real = widths[j] - scr[lo + j].joined
                self.replay.offer(c, scr[lo + j], step.x[j, :real], step.y[j, :real])
            return LiveStep(total=loss, gmap=outside)

        return JoinedLive(live, rows)

    def client_end(self, ctx: ClientContext) -> Upload:
        up = super().client_end(ctx)
        s = self.scratch(ctx)
        ctx.stats["buffer_size"] = float(self.replay.buffer.size(ctx.state))
        ctx.stats["memory_steps"] = s.with_memory / max(ctx.steps, 1)
        return up

    def client_reply(self, exchange: str, ctx: ClientContext) -> dict[str, torch.Tensor] | None:
        """ROUND_END: per class, the sum of phi = normalize(f(x)) over the client's buffer
        rows and their count, on the new global model in eval mode (``shared.embed_rows``,
        ``shared.class_report``); None while it is empty."""
        rows = self.replay.buffer.rows(ctx.state)
        if not rows:
            return None
        return class_report(embed_rows(ctx.model, rows["x"], True), rows["y"], self.info.num_classes)
