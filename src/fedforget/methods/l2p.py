"""FL+L2P: FedAvg whose clients train a prompt pool on a frozen pretrained Vision
Transformer, as in "Learning to Prompt for Continual Learning" (Wang, Zhang, Lee, Zhang, Sun,
Ren, Su, Perot, Dy, Pfister; CVPR 2022), the FL+CL baseline of FedGP (papers/fedgp.md
Sec. 5.1.1, Table 1 row FL+L2P; Table 18: its rounds per task). The authors' code:
google-research/l2p (JAX; the original L2P configs, e.g. configs/cifar100_gaussian_l2p.py)
and its PyTorch port JH-LEE-KR/l2p-pytorch (prompt.py, vision_transformer.py, engine.py).
Tags: [P] paper, [C] authors' code (read, not run), [D] our decision.

The model (``model_init``, on the ``vit`` model of ``fedforget.models``: torchvision's
VisionTransformer) [P Sec. 4, C]: the backbone (patch embedding, class token, position
embeddings, encoder, final LayerNorm) is frozen (requires_grad False: the engine keeps
its global values bit for bit); added are a pool of M prompts P_j in R^{L_p x D} and one
key k_j in R^D per prompt. Prompts, keys and the classifier head train, and they are the
part of the global weights that FedAvg averages (the frozen rest is identical everywhere).
``PromptedViT`` replaces the model's body, so every forward (training, evaluation, a
plug-in's buffer gradients) is the one prompted forward below:

1. query [P Sec. 4.2, C]: q(x) = the frozen ViT's [CLS] output without prompts (the
   final LayerNorm included: torchvision's encoder output, the code's ``pre_logits``),
   computed without gradient.
2. selection [P Eq. 3]: K_x = the N keys nearest to q(x), gamma(q, k) = 1 - cos(q, k),
   i.e. the top-N of cos(q(x), k_j). ``selection``: ``instance`` [P] one choice per input
   (Eq. 3 as written); ``batch`` [C: ``batchwise_prompt`` in both codes' L2P configs] the
   N prompts chosen most often in the batch (counts over every row's top-N; ties to the
   lower prompt id, as jnp.unique + lax.top_k), for every row, in training and at test
   time. The evaluator's test batches hold one task each, so ``batch`` lets a test batch
   vote its task's prompts: it inflates task-agnostic accuracy (google-research/l2p issue
   28), as FedProTIP's per-batch TIP does; so the default is the paper's, and the other
   mode's accuracy is reported too (``eval_counts``, column ``<mode>_selection`` of
   tasks.csv).
3. prompted forward [P Sec. 4.1 x_p = [P_s1; ...; P_sN; x_e]; C: google-research/l2p
   models/vit.py]: x_e = [CLS; patch embeddings] + position embeddings (the embedded input,
   after the embedding dropout); the N selected prompts, concatenated (N L_p tokens, no
   position embedding), are prepended to it, and the frozen encoder and LayerNorm run on
   the N L_p + 1 + patches tokens. [C: the PyTorch port instead puts the prompts after the
   [CLS] token and gives them the [CLS] position embedding.]
4. features [P: f_r^avg, C: ``vit_classifier`` / ``head_type`` = ``prompt``]: the mean of
   the encoder outputs at the N L_p prompt positions; the head maps them to logits (per-task
   heads: the task's head, as for any body).

Local loss, one minibatch (x, y) [P Eq. 5, C engine.py]::

    L = CE(mask(g(f_r^avg(x_p))), y) + pull_coeff * mean_b sum_{j in K_x_b} (1 - cos(q(x_b), k_j))

The pull (surrogate) term moves the selected keys towards the queries; its gradient reaches
the keys only (the query and the selection are constant). The code subtracts
pull_coeff * (sum of the cosines) / B: the same up to the constant pull_coeff * N. ``mask`` [C:
``train_mask``]: in split streams (class- and task-IL alike: task-IL trains as class-IL,
``Scenario.masked``) the logits outside the classes of the row's task are -inf during
training (the code masks those outside the current task; a row's task is its label's task,
the same under synchronous boundaries and right for the rows of older tasks in an
asynchronous window [D]); domain streams hold every class in every task (nothing to mask);
test time never masks beyond the scenario's own task-IL mask. Gradients of the trainable
parameters are clipped to a total norm of ``clip_norm`` after the backward [C:
grad_clip_max_norm / clip_grad 1.0] (``client_grad``; under FedGP, before its
projection).

Inputs with one channel (digits, MNIST) are repeated to the three the ViT's patch
embedding takes [C: the PyTorch port's 5-datasets loads MNIST as RGB], after the resize to
the ViT's image size (``models.ViTBody.pixels``, which the plain ``vit`` model shares).

Not in either public code's L2P configs, so not here: the optional frequency-penalised
selection (the paper's diversification with task boundaries, ``use_prompt_mask`` false in
the code), and the rehearsal-buffer variant of L2P.

Hyperparameters, defaults from the original L2P configs of google-research/l2p
(configs/cifar100_gaussian_l2p.py) and JH-LEE-KR/l2p-pytorch (configs/cifar100_l2p.py),
which agree on them; FedGP's appendix (A.9, Table 18) sets only L2P's rounds per task
(rotated MNIST 5, permuted MNIST 1, split CIFAR-10 / -100 20: the scenario's
rounds_per_task):
- ``pool_size`` M = 10, ``length`` L_p = 5, ``top_k`` N = 5 [C]; ``pull_coeff`` lambda = 0.1
  [C] (the later, DualPrompt-era google-research config cifar100_l2p.py has L_p 10, N 4,
  lambda 1.0).
- ``selection`` = instance [P] | batch [C] (see 2.).
- ``train_mask`` = true [C]; ``clip_norm`` = 1.0 [C] (0: off).
- ``init_scale`` = 0.01: prompts and keys ~ U[0, init_scale) [C: flax ``uniform()``, whose
  scale is 0.01; the PyTorch port's ``nn.init.uniform_`` draws U[0, 1)], from a generator
  keyed (seed, 0xA7), so every model built in a run gets the same pool.
- The rest is the experiment's train block: the codes train with Adam (lr 0.03, constant,
  batch 128), 5 epochs per task, on a ViT-B/16 pretrained on ImageNet-21k [C: the README's
  vit_models/imagenet21k/ViT-B_16.npz]: ``vit`` with ``pretrained: imagenet21k`` (the same
  weights as the hub's google/vit-base-patch16-224-in21k, ``models.vit``); ``pretrained:
  true`` keeps torchvision's ImageNet-1k ViT-B/16. [D] Inputs are normalised by the
  dataset's mean and std, not scaled to [0, 1] as in the code (``norm_01``).

Trainers [D]: a client alone runs ``step_loss`` and ``client_grad``. The stacked trainer runs
the prompted forward of a stack of clients through ``PromptedViT.stacked_body``: the frozen
ViT is one map for every client, so the embedding, the query and the prompted encoder run
once over the stack's rows (as one batch), each row with its own client's selected prompts
(prompts, keys and heads stacked per client; the backbone not stacked); the task loss is the
trainer's on those features (the train mask through ``label_classes``), the pull term (each
client's mean over its real rows, at the queries and selections of the same forward) is a
live loss and the clip of each client's whole gradient a gradient map (``client_live_terms``).
Equal within 1e-5 (tests/methods/test_l2p.py: class-IL, task-IL with per-task heads, FedGP
over L2P). ``selection: batch`` trains one client after another (a batch's vote would count
a stack's rows, padding included). On a CPU the frozen patch embedding does not send the
steps client by client (``vectorized``: only convolutions that train do).

Diagnostics (``l2p_<key>``): ``pull`` (mean over steps of the pull term before
pull_coeff), ``prompts_used`` (distinct prompts selected in the client's round), means over
the round's clients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..models import ViTBody
from ..utils import FedForgetError, torch_seed
from .base import (
    ClientContext,
    FedAvg,
    LiveStep,
    LiveTerms,
    RunInfo,
    ServerContext,
    StepBatch,
    Upload,
    masked_logits,
    task_cross_entropy,
)
from .params import boolean, choice, integer, number
from .registry import METHODS
from .shared import StepSums, client_norms, refuse_held, rows_mean

INIT_STREAM = 0xA7  # keyed randomness of the prompt pool's and the keys' initial values
SELECTIONS = ("instance", "batch")


def select(query: torch.Tensor, keys: torch.Tensor, top_k: int, batchwise: bool) -> torch.Tensor:
    """Indices [B, N] of the prompts each row uses: the ``top_k`` keys of highest cosine
    similarity to its query (Eq. 3); ``batchwise``: the ``top_k`` prompts chosen most often
    over the batch's rows (ties to the lower id), the same for every row. A stack's (query
    [G, B, D], keys [G, M, D]; per row only): each client's rows against its own keys."""
    cos = F.normalize(query, dim=-1) @ F.normalize(keys, dim=-1).transpose(-1, -2)  # [(G,) B, M]
    idx = cos.topk(top_k, dim=-1).indices
    if not batchwise:
        return idx
    counts = torch.bincount(idx.reshape(-1), minlength=keys.shape[0])
    major = torch.sort(counts, descending=True, stable=True).indices[:top_k]
    return major.expand(query.shape[0], top_k)


def pull_term(query: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """[B]: sum over each row's selected keys of gamma = 1 - cos(q, k) (Eq. 5's second term,
    before lambda). A stack's (query [G, B, D], keys [G, M, D], idx [G, B, N]): [G, B]."""
    q = F.normalize(query, dim=-1).unsqueeze(-2)  # [(G,) B, 1, D]
    k = F.normalize(keys, dim=-1)
    k = k[idx] if keys.dim() == 2 else k[torch.arange(len(k), device=k.device)[:, None, None], idx]  # [(G,) B, N, D]
    return (1 - (q * k).sum(-1)).sum(-1)


class PromptedViT(ViTBody):
    """A ``ViTBody`` with L2P's prompt pool: ``forward`` gives the prompted features
    [B, D] (the module docstring's steps 1-4), ``prompted`` them with the pull term and the
    selection. The ViT keeps its parameters' names (``vit.*``)."""

    def __init__(
        self, body: ViTBody, pool_size: int, length: int, top_k: int, batchwise: bool,
        init: torch.Tensor,
    ) -> None:  # fmt: skip
        super().__init__(body.vit, body.resize.size)
        d = self.vit.hidden_dim
        self.top_k, self.length, self.batchwise = top_k, length, batchwise
        # init: [M * (L_p + 1), D], the prompts' rows first, then the keys'
        self.prompt = nn.Parameter(init[: pool_size * length].reshape(pool_size, length, d).clone())
        self.prompt_key = nn.Parameter(init[pool_size * length :].clone())

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """x_e: [B, 1 + patches, D], [CLS] and patch embeddings plus positions (frozen)."""
        x = self.pixels(x)  # resized, grayscale as RGB (models.ViTBody)
        tokens = self.vit._process_input(x)
        cls = self.vit.class_token.expand(x.shape[0], -1, -1)
        enc = self.vit.encoder
        return enc.dropout(torch.cat([cls, tokens], dim=1) + enc.pos_embedding)

    def encode(self, seq: torch.Tensor) -> torch.Tensor:
        """The frozen encoder blocks and final LayerNorm on a token sequence."""
        return self.vit.encoder.ln(self.vit.encoder.layers(seq))

    def prompted(
        self, x: torch.Tensor, batchwise: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(features [B, D], pull term [B] (``pull_term``), selected prompt ids [B, N]);
        ``batchwise`` None: the configured selection."""
        with torch.no_grad():  # nothing below the prompts trains
            emb = self.embed(x)
            query = self.encode(emb)[:, 0]
        batch = self.batchwise if batchwise is None else batchwise
        idx = select(query, self.prompt_key, self.top_k, batch)
        prompts = self.prompt[idx].flatten(1, 2)  # [B, N * L_p, D]
        out = self.encode(torch.cat([prompts, emb], dim=1))
        return out[:, : prompts.shape[1]].mean(1), pull_term(query, self.prompt_key, idx), idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.prompted(x)[0]

    # the batched trainer (``fedforget.vectorized``: a module with ``stacked_body`` runs itself)
    def stacked_unsupported(self) -> str | None:
        """None: ``stacked_body`` runs this body (the frozen ViT's dropout off), else why not."""
        if self.batchwise:
            return "PromptedViT(selection batch)"
        for m in self.vit.modules():  # torch's dropout, an attention's own (its training forward draws)
            rate = m.p if isinstance(m, nn.Dropout) else getattr(m, "dropout", 0)
            if isinstance(rate, float | int) and rate > 0:
                return f"PromptedViT(dropout > 0: {type(m).__name__})"
        return None

    def stacked_body(self, p: dict[str, torch.Tensor], x: torch.Tensor, prefix: str) -> torch.Tensor:
        """``prompted``'s features [G, B, D] of G clients on their images [G, B, ...], each with
        its own prompts and keys (``p``: ``prompt`` [G, M, L_p, D], ``prompt_key`` [G, M, D]
        under ``prefix``): the frozen ViT is one map for every client, so the embedding, the
        query and the prompted encoder run once over the stack's rows, each row with its
        client's selected prompts. The step's queries and selections are kept for the method's
        live terms (``stacked_selection``: query [G, B, D], ids [G, B, N])."""
        g, b = x.shape[:2]
        pool, keys = p[prefix + "prompt"], p[prefix + "prompt_key"]
        with torch.no_grad():  # nothing below the prompts trains
            emb = self.embed(x.flatten(0, 1))
            query = self.encode(emb)[:, 0].view(g, b, -1)
        idx = select(query, keys, self.top_k, False)  # [G, B, N]
        prompts = pool[torch.arange(g, device=idx.device)[:, None, None], idx].flatten(2, 3)  # [G, B, N * L_p, D]
        out = self.encode(torch.cat([prompts.flatten(0, 1), emb], dim=1))
        self.stacked_selection = (query, idx)
        return out[:, : prompts.shape[2]].mean(1).view(g, b, -1)


@METHODS.register("l2p")
class L2P(FedAvg):
    name = "l2p"
    one_task_per_class = True  # its prompt keys' task of each training row comes from the row's class
    # [D] the prompted forward runs stacked (``PromptedViT.stacked_body``: the frozen ViT once over
    # the stack's rows, each row with its client's prompts), the pull term and the clip as live
    # terms (``client_live_terms``); per-row selection only (``trait``)
    live_terms = True
    live_heads = True  # the task loss is the trainer's, through the active head as alone
    own_upload = True
    needs_model = "vit"  # the one model it is defined on (model_init refuses others)

    @dataclass(frozen=True)
    class Params:
        pool_size: int = integer(10, minimum=1)  # M [C]
        length: int = integer(5, minimum=1)  # L_p, tokens per prompt [C]
        top_k: int = integer(5, minimum=1)  # N, prompts per input [C]; at most pool_size
        pull_coeff: float = number(0.1, minimum=0)  # lambda of the key-pull term [C]
        selection: str = choice("instance", SELECTIONS)  # instance [P Eq. 3] | batch [C batchwise_prompt]
        train_mask: bool = boolean(True)  # class-IL: CE over the row's task's classes [C]
        clip_norm: float = number(1.0, minimum=0)  # gradient-norm clip of the trainable parameters [C]; 0: off
        init_scale: float = number(0.01, exclusiveMinimum=0)  # prompts and keys ~ U[0, init_scale) [C, JAX]

        def check(self) -> None:
            if self.top_k > self.pool_size:
                raise ValueError(
                    f"top_k={self.top_k}; allowed: an integer in 1..pool_size={self.pool_size}"
                )

    def __init__(self, params: Any, info: RunInfo) -> None:
        super().__init__(params, info)
        sc = info.scenario
        # split streams (class- and task-IL, which trains as class-IL: Scenario.masked): row c
        # = the classes of class c's task (the train mask of a row with label c:
        # FedAvg.label_classes); None where nothing is masked (domain streams and one-task
        # runs hold every class)
        if params.train_mask and sc is not None and sc.kind == "split" and sc.tasks > 1:
            task_of = torch.full((sc.num_classes,), -1, dtype=torch.long)
            for t, cls in enumerate(sc.task_classes):
                task_of[cls] = t
            table = sc.class_mask(torch.device("cpu"))[task_of.clamp(min=0)]
            table[task_of < 0] = True  # classes in no task never come up
            self.label_classes = table.to(info.device)

    @classmethod
    def trait(cls, name: str, params: Any = None) -> bool:
        """``stacked``: with ``selection: instance``; a batch's vote (``batch``) counts each
        client's rows, which the stacked forward does not (one client after another)."""
        if name == "stacked":
            return params is not None and params.selection == "instance"
        return super().trait(name, params)

    @classmethod
    def check_model(cls, model: str, params: Any = None, options: dict[str, Any] | None = None) -> None:
        refuse_held(cls.name, options, "it trains prompts on a ViT frozen whole, whose stem and first blocks "
                    "freeze_stages would train in the first task")

    def model_init(self, model: nn.Module) -> None:
        """The prompt pool and keys on the model's ViT, which is frozen (module docstring)."""
        body = getattr(model, "body", None)
        if not isinstance(body, ViTBody):
            raise FedForgetError(
                f"method 'l2p' prompts a Vision Transformer: dataset.model.name must be '{self.needs_model}', "
                f"got a model with body {type(body).__name__}"
            )
        p, d = self.p, body.vit.hidden_dim
        gen = torch.Generator().manual_seed(torch_seed(self.info.seed, INIT_STREAM))
        init = torch.rand(p.pool_size * (p.length + 1), d, generator=gen) * p.init_scale
        body.requires_grad_(False)
        model.body = PromptedViT(body, p.pool_size, p.length, p.top_k, p.selection == "batch", init)

    # ---------------------------------------------------------------- client side
    def client_begin(self, ctx: ClientContext) -> None:
        s = self.scratch(ctx)
        s.pull_sum = torch.zeros((), device=self.info.device)
        s.used = torch.zeros(self.p.pool_size, dtype=torch.bool, device=self.info.device)

    def client_step(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One prompted forward: ``step_loss``, differentiated."""
        loss = self.step_loss(ctx, x, y)
        loss.backward()
        return loss

    def step_loss(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Eq. 5: the task CE on the prompted features' logits (over the classes of each row's task
        in class-IL split streams [C train_mask]: ``task_mask``) + pull_coeff * mean pull term."""
        z, pull, idx = ctx.model.body.prompted(x)
        loss = task_cross_entropy(ctx.model.head(z), y, self.task_mask(y))
        s = self.scratch(ctx)
        s.pull_sum += pull.detach().mean()
        s.used[idx.reshape(-1)] = True
        return loss + self.p.pull_coeff * pull.mean() if self.p.pull_coeff > 0 else loss

    def client_grad(self, ctx: ClientContext) -> None:
        """The trainable parameters' gradients clipped to total norm ``clip_norm`` [C]."""
        if self.p.clip_norm > 0:
            grads = [p for p in ctx.model.parameters() if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(grads, self.p.clip_norm, foreach=True)

    def client_live_terms(self, ctxs: Sequence[ClientContext]) -> LiveTerms:
        """Eq. 5 and the clip for a stack of clients: the task loss is the trainer's on the
        stacked prompted features (``PromptedViT.stacked_body``); the pull term of each
        client's keys at its rows' queries and selections (its mean over its real rows) is
        the live loss, and the clip of each client's gradient to norm ``clip_norm`` the
        gradient map: ``step_loss`` and ``client_grad`` of each client alone."""
        p, dev = self.p, self.info.device
        body = ctxs[0].model.body
        scratches = [self.scratch(c) for c in ctxs]
        sums = StepSums.shared(scratches, 1, dev, "stack")  # per client: the pull term's step means
        used = torch.zeros(len(ctxs), p.pool_size, device=dev)  # per client: times each prompt was chosen
        for i, s in enumerate(scratches):
            s.stack_used = used[i]

        def clip(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            g = list(grads.values())
            coef = (p.clip_norm / (client_norms(g) + 1e-6)).clamp(max=1.0)  # torch's clip_grad_norm_
            return {n: v * coef.view(-1, *[1] * (v.dim() - 1)) for n, v in grads.items()}

        def live(lo: int, hi: int, w: dict[str, torch.Tensor], step: StepBatch) -> LiveStep:
            query, idx = body.stacked_selection  # this step's (stacked_body)
            mask = step.row_mask()
            pull = rows_mean(pull_term(query, w["body.prompt_key"], idx), mask)
            sums[0, lo:hi] += pull.detach()
            used[lo:hi].scatter_add_(1, idx.flatten(1), mask.unsqueeze(-1).expand(idx.shape).flatten(1))
            return LiveStep(loss=p.pull_coeff * pull if p.pull_coeff > 0 else None, gmap=clip if p.clip_norm > 0 else None)

        return live

    def client_end(self, ctx: ClientContext) -> Upload:
        up = super().client_end(ctx)
        s = self.scratch(ctx)
        if getattr(s, "stack", None) is not None:  # trained in a stack: its sums
            s.pull_sum, s.used = s.stack.column()[0], s.stack_used > 0
        if ctx.steps:
            ctx.stats["pull"] = s.pull_sum.item() / ctx.steps
            ctx.stats["prompts_used"] = float(s.used.sum().item())
        return up

    # ---------------------------------------------------------------- evaluation
    def eval_counts(
        self, server: ServerContext, model: nn.Module, x: torch.Tensor, y: torch.Tensor, task: int
    ) -> dict[str, torch.Tensor]:
        """Rows of the test batch counted correct with the other selection mode than the
        configured one (``batch_selection`` or ``instance_selection``), scored as
        ``eval_predict`` scores (the task's head and classes where the scenario is task-aware)."""
        other = "instance" if self.p.selection == "batch" else "batch"
        sc = self.info.scenario
        aware = sc is not None and sc.task_aware
        z = model.body.prompted(x, batchwise=other == "batch")[0]
        scores = model.head_logits(z, task if aware else None)
        if sc is not None and sc.masked:
            scores = masked_logits(scores, sc.class_mask(x.device)[task])
        return {f"{other}_selection": (scores.argmax(1) == y).sum()}
