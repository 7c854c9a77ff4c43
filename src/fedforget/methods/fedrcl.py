"""FedRCL: relaxed contrastive learning for federated learning.

Paper: Seonguk Seo, Jinkyu Kim, Geeho Kim, Bohyung Han, "Relaxed Contrastive Learning for
Federated Learning", CVPR 2024 (arXiv 2401.04928). Code: github.com/skynbe/FedRCL.

Each client adds to its cross-entropy a supervised contrastive loss (SCL) on its minibatch
representations plus a divergence penalty on same-class pairs that are already more similar
than a threshold lambda (the "relaxation", against the representation collapse SCL causes),
at several depths of the network (multi-level). The server is FedAvg. For an anchor x of
the minibatch, with sim(x, x') the cosine similarity of the representations at one level,
P(x) the other samples with the same label and A(x) all other samples:

    L_SCL(x) = -1/|P(x)| * sum_{x_p in P(x)} log( exp(sim(x, x_p)/tau) / sum_{x_a in A(x)} exp(sim(x, x_a)/tau) )
    L_DIV(x) = -log( exp(1/tau) / (exp(1/tau) + sum_{x_j in P(x), sim(x, x_j) > lambda} exp(sim(x, x_j)/tau)) )
    L_RCL^l  = mean_x L_SCL(x) + beta * mean_x L_DIV(x)          at level l
    L        = L_CE + weight * mean_{l in levels} L_RCL^l        (multi-level RCL)

mean_x L_SCL runs over the anchors with |P(x)| >= 1, mean_x L_DIV over all anchors (it is 0
for an anchor with no same-class sample above lambda). ``rcl_terms`` computes both for one
level, ``rcl_levels`` averages them over levels.

Levels (``levels``): ``Classifier.forward_levels`` gives the representations, shallow to
deep. The ResNets (``resnet8``, ``resnet18`` in models.py) give five: the stem and the four
stages, each taken before its ReLU and average-pooled to [B, C], exactly as the code takes
its branch levels; every other model gives one, its penultimate features (after the body's
ReLU, hence non-negative: cosines in [0, 1]). ``levels: all`` (default, the paper's and the
code's branch_level [0, 1, 2, 3, 4]) averages over all of them, ``last`` uses only the
deepest, a list of indices uses those. On a one-level model every choice is the
single-level loss of earlier versions of this module, computed bit-identically.

What was verified, and from where
- Released code, read through the code index (skynbe/FedRCL at commit ea3cf19):
  * configs/client/fedrcl.yaml: rcl_loss with temp 0.05, topk_pos 1, topk_neg 2, pairs
    "scl" (loss_type supervised, weight 1) and "penalty" (loss_type unsupervised,
    neg_sample_type intra_class_thresholding, threshold 0.7, weight 1), branch_level
    [0, 1, 2, 3, 4], feature_relu False; ce weight 1, prox and feature-align weights 0.
  * clients/rcl_client.py (RCLClient._algorithm_rcl): for every level l in branch_level the
    level's feature map is average-pooled (adaptive_avg_pool2d to 1x1), each pair's loss is
    averaged over the minibatch, and each pair's losses are then averaged over the levels;
    the total is ce + 1 * scl + 1 * penalty. The model is called with no_relu = not
    feature_relu = True.
  * models/resnet_base.py of the same framework (ResNet_base.forward with no_relu, read in
    a copy of the framework; the skynbe repository as stored lacks the models/ files):
    layer0 = bn1(conv1(x)) before ReLU; layer1..layer4 = the output of each stage's last
    block before its final ReLU; the classifier input is the pooled ReLU of layer4.
  * utils/loss.py (CLLoss, MultiLabelCrossEntropyLoss): the ``topk`` formulas below,
    checked line by line (positives: the least similar same-label sample, the anchor
    itself included; negatives: the two most similar other-label samples, missing ones
    -inf and ignored; penalty: positive = sim(x, x), negative = the least similar other
    same-label sample if that is >= threshold, else -1; per-anchor losses averaged).
- Paper text: only the abstract and introduction could be read (stored arXiv HTML of
  2401.04928v1/v2, CVF open-access page; queries on "relaxed contrastive loss", "divergence
  penalty", "L_RCL", "threshold lambda beta" found no copy of Section 4). A paper summary
  (sciencestack.ai, 2401.04928) confirms "a multi-level extension that promotes diversity
  across intermediate representations". The printed equations were therefore not checked:
  - L_SCL above is the supervised contrastive loss of Khosla et al. (2020), which the
    abstract says the paper derives; whether the printed form carries 1/|P(x)| is not
    certain.
  - L_DIV: the authors say (github.com/skynbe/FedRCL/issues/1) that the paper prints the
    penalty in a simplified form (readers describe a beta-weighted exp/log term of the
    above-threshold positive similarities and query its sign) and that they implement it
    "using the form of contrastive learning, identical to the unsupervised CL loss except
    that the similarity for the positive pair is set to a constant 1", with the
    above-threshold same-class samples as negatives; L_DIV above is that form.
- ``pairs`` chooses the pairs:
  * ``all`` (default): every pair, as written above (the paper's SCL; the authors'
    description of the penalty).
  * ``topk``: the released code's selection, reproduced exactly:
        L_SCL(x) = -log( exp(s_p/tau) / (exp(s_p/tau) + sum_{n in N_2(x)} exp(s_n/tau)) ),
            s_p = min over same-label samples of sim(x, .) (x itself included, so s_p = 1
            when x is alone in its class), N_2(x) = the (at most) two other-label samples
            most similar to x;
        L_DIV(x) = -log( exp(sim(x, x)/tau) / (exp(sim(x, x)/tau) + exp(v/tau)) ),
            v = min_{x_j in P(x)} sim(x, x_j) if that is >= lambda, else -1 (also -1 when
            P(x) is empty), so only the least similar positive is penalised, and only when
            every positive of x is above lambda;
    both averaged over all anchors.
- Hyperparameters (released config): tau = 0.05, lambda (``threshold``) = 0.7, beta = 1 (the
  penalty's weight), SCL weight 1 (``weight`` multiplies the level mean of L_RCL; 1 = the
  released config, 0 = FedAvg), levels = all five.

Deviations from the code, and notes
- The code's ResNet-18 uses GroupNorm(2, C) by default: ``model: {name: resnet18, options:
  {norm: group}}`` reproduces it; our default normalisation is BatchNorm.
- Not copied from the code's client loop (training-framework details, not the method): the
  gradient-norm clipping at 10, mixed precision, the per-epoch local lr decay and the
  class-balanced sampler option.
- weight = 0 is FedAvg exactly (the base forward and loss are used). A minibatch of one
  sample has no pairs and adds nothing.
- Diagnostics ``l_scl`` and ``l_div``: per client, the means over its steps of the level
  means; metrics columns ``fedrcl_l_scl``, ``fedrcl_l_div``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import ClientContext, FedAvg, LiveStep, LiveTerms, Upload, task_cross_entropy
from .params import choice, number, one_of
from .registry import METHODS
from .shared import StepSums

PAIRS = ("all", "topk")
TOPK_NEG = 2  # released config: two hardest other-label samples per anchor in L_SCL


def rcl_terms(
    z: torch.Tensor, y: torch.Tensor, tau: float, threshold: float, pairs: str = "all"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean_x L_SCL(x), mean_x L_DIV(x)) on representations z [B, d] with labels y [B]; in
    fp32 whatever the step's precision [D: under bf16 one client after another computed the
    similarities in autocast's bf16 and the stacked trainer in fp32]."""
    b, dtype = len(y), torch.promote_types(z.dtype, torch.float32)
    if b < 2:  # no pairs
        zero = torch.zeros((), device=z.device, dtype=dtype)
        return zero, zero
    with torch.autocast(z.device.type, enabled=False):
        zn = F.normalize(z.to(dtype), dim=1)
        s = zn @ zn.T  # sim(x_i, x_j)
    eye = torch.eye(b, dtype=torch.bool, device=z.device)
    same = y[:, None] == y[None, :]
    inf = float("inf")
    if pairs == "all":
        pos = same & ~eye  # P(x_i)
        logits = (s / tau).masked_fill(eye, -inf)  # A(x_i): everything but x_i
        log_prob = logits - logits.logsumexp(dim=1, keepdim=True)
        n_pos = pos.sum(dim=1)
        scl = -log_prob.masked_fill(~pos, 0.0).sum(dim=1) / n_pos.clamp_min(1)
        l_scl = scl.sum() / (n_pos > 0).sum().clamp_min(1)
        above = (s / tau).masked_fill(~(pos & (s > threshold)), -inf)
        one = torch.full((b, 1), 1.0 / tau, device=z.device, dtype=s.dtype)  # sim(x, x) = 1
        l_div = (torch.cat([one, above], dim=1).logsumexp(dim=1) - one[:, 0]).mean()
        return l_scl, l_div
    if pairs == "topk":
        s_pos = s.masked_fill(~same, inf).min(dim=1).values
        s_neg = s.masked_fill(same, -inf).topk(min(TOPK_NEG, b), dim=1).values
        logits = torch.cat([s_pos[:, None], s_neg], dim=1) / tau
        l_scl = (logits.logsumexp(dim=1) - logits[:, 0]).mean()
        within = s.masked_fill(~same | eye, inf).min(dim=1).values  # least similar positive
        keep = torch.isfinite(within) & (within >= threshold)
        v = torch.where(keep, within, torch.full_like(within, -1.0))
        logits = torch.stack([s.diagonal(), v], dim=1) / tau
        l_div = (logits.logsumexp(dim=1) - logits[:, 0]).mean()
        return l_scl, l_div
    raise ValueError(f"pairs={pairs!r}; allowed: {', '.join(PAIRS)}")


def rcl_levels(
    levels: list[torch.Tensor], y: torch.Tensor, tau: float, threshold: float, pairs: str = "all"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-level RCL: (mean over levels of mean_x L_SCL, mean over levels of mean_x
    L_DIV) for the level representations [B, d_l] of one minibatch."""
    terms = [rcl_terms(z, y, tau, threshold, pairs) for z in levels]
    if len(terms) == 1:  # one level: exactly the single-level terms
        return terms[0]
    scl, div = zip(*terms)
    return torch.stack(scl).mean(), torch.stack(div).mean()


def select_levels(levels: list[torch.Tensor], which: str | list[int]) -> list[torch.Tensor]:
    """The levels named by ``which`` (all | last | list of indices, shallow = 0)."""
    if which == "all":
        return levels
    if which == "last":
        return levels[-1:]
    if max(which) >= len(levels):
        raise ValueError(
            f"levels={which!r}; allowed: indices below {len(levels)}, the number of levels this model has"
        )
    return [levels[i] for i in which]


@dataclass(frozen=True)
class FedRCLParams:
    weight: float = number(1.0, minimum=0)  # multiplies the level mean of L_RCL = L_SCL + beta * L_DIV; 0 = FedAvg
    beta: float = number(1.0, minimum=0)  # weight of the divergence penalty L_DIV
    tau: float = number(0.05, exclusiveMinimum=0)  # temperature
    threshold: float = number(0.7, minimum=-1, maximum=1)  # lambda (a cosine): same-class pairs above it are penalised
    pairs: str = choice("all", PAIRS)  # all pairs | topk (the released code's hardest-pair selection)
    levels: str | list[int] = one_of(  # all | last | indices into Classifier.forward_levels
        "all", {"enum": ["all", "last"]},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1, "uniqueItems": True},
    )


@METHODS.register("fedrcl")
class FedRCL(FedAvg):
    """FedAvg whose local loss adds weight * (level mean of L_SCL + beta * L_DIV)."""

    name = "fedrcl"
    own_upload = True
    # the stacked trainer gives the step's levels: the ResNets' stages (StepBatch.levels), or
    # the penultimate features of a one-level model (StepBatch.features)
    live_terms = True
    step_rows = True  # each client's real rows cut out of the stack (host counts: capturable)
    Params = FedRCLParams

    def client_begin(self, ctx: ClientContext) -> None:
        s = self.scratch(ctx)
        s.sums = StepSums.own(3, self.info.device)  # L_SCL, L_DIV, steps

    def client_live_terms(self, ctxs: Sequence[ClientContext]) -> LiveTerms | None:
        """weight * L_RCL of each client of a stack, on its real rows of the step's own levels
        (``StepBatch.levels``: a ResNet's stages; else one level, the penultimate features),
        by ``rcl_levels`` client by client as each client alone computes it (``client_step``);
        summed per client in one tensor for the diagnostics."""
        p = self.p
        if p.weight == 0 or not ctxs:
            return None
        sums = StepSums.shared([self.scratch(c) for c in ctxs], 3, self.info.device)

        def live(lo: int, hi: int, w, step) -> LiveStep:
            rows = step.rows
            levels = step.levels if step.levels is not None else [step.features]
            terms = [rcl_levels(select_levels([v[j, :n] for v in levels], p.levels), step.y[j, :n], p.tau, p.threshold, p.pairs)
                     for j, n in enumerate(rows)]  # fmt: skip
            scl, div = (torch.stack(t) for t in zip(*terms))
            sums[0, lo:hi] += scl.detach()
            sums[1, lo:hi] += div.detach()
            sums[2, lo:hi] += 1
            return LiveStep(loss=p.weight * (scl + p.beta * div))

        return live

    def client_step(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        p = self.p
        if p.weight == 0:
            return super().client_step(ctx, x, y)  # FedAvg exactly
        levels, logits = ctx.model.forward_levels(x)
        # multi-level RCL: L_SCL and L_DIV averaged over the chosen levels
        l_scl, l_div = rcl_levels(select_levels(levels, p.levels), y, p.tau, p.threshold, p.pairs)
        self.scratch(ctx).sums.add(l_scl.detach(), l_div.detach(), 1)
        # L = L_CE + weight * L_RCL
        loss = task_cross_entropy(logits, y) + p.weight * (l_scl + p.beta * l_div)
        loss.backward()
        return loss

    def client_end(self, ctx: ClientContext) -> Upload:
        if self.p.weight > 0:
            col = self.scratch(ctx).sums.column()
            scl, div = (col[:2] / col[2].clamp_min(1)).tolist()
            ctx.stats["l_scl"], ctx.stats["l_div"] = scl, div
        return super().client_end(ctx)
