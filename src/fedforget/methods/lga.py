"""LGA: Local-Global Anti-forgetting (Dong, Li, Cong, Sun, Zhang, Van Gool: "No One Left
Behind: Real-World Federated Class-Incremental Learning", TPAMI 2023, the extension of GLFC;
code JiahuaDong/LGA: LGA.py, ProxyServer.py, myNetwork.py, fl_main.py, option.py), a baseline
of papers/fedprotip.md Tables 1-3. GLFC (``glfc.py``) with these changes; tags [P] paper
(its abstract: the full text was not at hand, so the equations follow the authors' code),
[C] authors' code, [D] ours.

1. Category-balanced gradient-adaptive compensation [P abstract; C
   ``efficient_old_class_weight``]: in task t (0-based) the gradient magnitudes are
   tempered, g_i = |G_i|^(t / (t + 1)) (t = 0: g = 1, so the first task is plain CE [C]), and
   normalised per group: the new classes, and for each old task j < t the rows of the old
   tasks up to j (``old_groups: cumulative`` [C]: the code's class mask is not reset between
   old tasks) or of task j alone (``task`` [D]); a row's weight is the sum of its groups'
   normalised values, clamped to [``weight_min``, ``weight_max``] = [0.5, 5] [C]; w = 1 on
   every row of a client whose memory holds no class yet (the code's ``learned_classes``
   empty: the first task, or a later one of a client with no rows in the earlier tasks) [C].
2. Category gradient-induced semantic distillation [P abstract; C ``_compute_loss``]: GLFC's
   relation distillation with each row weighted by the same w_i; loss lam L_GC + lam L_RD
   with lam = 1 [C ``--lam``] (``lambda_gc``, ``lambda_rd``), L_GC alone without an old model.
3. Self-supervised prototype augmentation on the proxy server [P abstract; C
   ``ProxyServer.f_monitor``]: the best old model is chosen by the accuracy of the global
   model's classifier on augmented features of the reconstructed samples instead of on the
   samples: for each sample, ``augment`` = 5 features f + e, e = radius * v_c^2 (.) n with
   n ~ N(0, I), v_c the per-dimension (unbiased) feature variance of its class on the
   monitor set [C: ``np.square(np.diagonal(cov))`` is the normal's scale], redrawn while
   ||e||^2 > 0.1 * sum(v_c^2) [C] (at most 100 draws per sample [D]; the code loops until
   it has 5); keyed (seed, round, 0xC4). The radius [C ``compute_radius``, PASS's]: sqrt(mean over the
   first task's classes of tr(Sigma_c) / d), Sigma_c the covariance of the final global
   model of task 0's features of the class's training rows; the code reads them on the
   server from the whole training set, here [D] each client sends per class (count, sum of
   features, sum of squared norms) at the end of task 0 and the server pools them. Before it
   is known (task 0): ``radius_init`` = 0.15 [C, network.radius]. The code has no other
   self-supervision (no rotation labels); none is added.
4. Proxy warm-up [C ``--proxy_init`` = 6]: in the first ``proxy_init`` rounds of each task
   the model's score is 0 (it becomes the best only while the best accuracy is 0).
Everything else is GLFC's: exemplar memory (augmented like the private rows where the dataset
declares an augmentation [C: LGA's ``iCIFAR100.getTrainData`` mixes the exemplar images into
``TrainData``, read through fl_main.py's ``train_transform``: RandomCrop 4, flip]), prototype gradients through the LeNet encoder
(perturbed by SGD on the local model), gradient inversion with L-BFGS (250 iterations [C]),
the old model of task t = the proxy's best model of task t - 1, and the trainers (the stacked
one included: the weights above per client of a stack, its task's exponent and groups). [C] the code resets the best
accuracy once (at task 1's start); ``best_per_task`` (default true [D]) resets it at every
task start.

Hyperparameters (defaults, source): GLFC's (memory_size 2000 [P; fedprotip.md E.3], loss,
perturbation, reconstruction, best_per_task, proxy) with ``lambda_gc`` = ``lambda_rd`` = 1.0
[C]; ``weight_min`` 0.5, ``weight_max`` 5.0, ``old_groups`` cumulative, ``proxy_init`` 6,
``radius_init`` 0.15, ``augment`` 5 [C]. Domain-incremental streams are refused [P
fedprotip.md Table 1]. State as GLFC's, plus server.state["lga_radius"]. Diagnostics
(``lga_<key>``): GLFC's, w_old (the mean weight of the old rows) and radius.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..utils import torch_seed
from .base import ClientContext, ServerContext, Upload
from .glfc import GLFC, GLFCParams
from .params import choice, integer, number, redefault
from .registry import METHODS
from .shared import group_normalise, head_scores, require

AUG_STREAM = 0xC4  # keyed randomness of the prototype augmentation
RADIUS = "lga_radius"  # server.state
OLD_GROUPS = ("cumulative", "task")
NOISE_BOUND = 0.1  # [C] ||e||^2 <= 0.1 * sum(v_c^2)
MAX_DRAWS = 100  # [D] draws per sample at most


def adaptive_weights(g: torch.Tensor, row_task: torch.Tensor, task: int | torch.Tensor, groups: str, lo: float,
                     hi: float, top: int | None = None, real: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """LGA's w_i: g^(t/(t+1)) normalised over the new rows and over each old task's group
    (cumulative: tasks <= j; task: task j), summed per row, clamped to [lo, hi] [C]. A
    stack's (g, row_task [G, N]): each client's own groups of its real rows (``real``),
    ``task`` [G, 1] (the highest ``top``) or one int."""
    g = g.pow(task / (task + 1))
    masks = [row_task >= task]
    for j in range(task if top is None else top):
        m = row_task <= j if groups == "cumulative" else row_task == j
        masks.append(m if isinstance(task, int) else m & (j < task))
    if real is not None:
        masks = [m & real for m in masks]
    return group_normalise(g, masks).clamp(lo, hi)


def pooled_radius(stats: Sequence[dict[str, torch.Tensor]]) -> float | None:
    """sqrt(mean_c tr(Sigma_c) / d) from per-client per-class sums {classes, n, sum, sq}
    (Sigma_c unbiased, classes with < 2 rows left out); None without such a class."""
    n: dict[int, float] = {}
    s: dict[int, torch.Tensor] = {}
    q: dict[int, float] = {}
    for st in stats:
        for i, c in enumerate(st["classes"].tolist()):
            n[c] = n.get(c, 0.0) + float(st["n"][i])
            s[c] = s.get(c, 0.0) + st["sum"][i].double()
            q[c] = q.get(c, 0.0) + float(st["sq"][i])
    traces = [
        (q[c] - float((s[c] * s[c]).sum()) / n[c]) / (n[c] - 1) for c in sorted(n) if n[c] >= 2
    ]
    if not traces:
        return None
    d = next(iter(s.values())).numel()
    return math.sqrt(max(sum(traces) / len(traces) / d, 0.0))


def augment_features(f: torch.Tensor, y: torch.Tensor, radius: float, k: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(augmented features, the row of ``f`` each comes from): up to ``k`` per row of ``f``
    [N, d], f + e with e = radius * v^2 (.) n, n ~ N(0, I) (v: the row's class's
    per-dimension unbiased variance in ``f``; 0 for a class of one row), redrawn while
    ||e||^2 > 0.1 sum(v^2), at most MAX_DRAWS rounds [C, D]."""
    scale = torch.zeros_like(f)
    for c in y.unique().tolist():
        rows = y == c
        if int(rows.sum()) >= 2:
            scale[rows] = f[rows].var(0, unbiased=True).pow(2)
    bound = NOISE_BOUND * scale.sum(1)
    got = torch.zeros(len(f), dtype=torch.long, device=f.device)
    feats, src = [], []
    for _ in range(MAX_DRAWS):
        need = (k - got).clamp_min(0)
        if int(need.sum()) == 0:
            break
        e = torch.randn((len(f), k, f.shape[1]), generator=generator, dtype=f.dtype).to(f.device)
        e = e * scale[:, None] * radius
        ok = (e * e).sum(2) <= bound[:, None]
        take = ok & (ok.cumsum(1) <= need[:, None])
        rows = torch.nonzero(take)[:, 0]
        feats.append(f[rows] + e[take])
        src.append(rows)
        got += take.sum(1)
    return torch.cat(feats), torch.cat(src)


@dataclass(frozen=True)
class LGAParams(GLFCParams):
    lambda_gc: float = redefault(GLFCParams, "lambda_gc", 1.0)  # [C --lam]
    lambda_rd: float = redefault(GLFCParams, "lambda_rd", 1.0)  # [C --lam]
    weight_min: float = number(0.5, minimum=0)  # [C]
    weight_max: float = number(5.0, minimum=0)  # [C]; at least weight_min
    old_groups: str = choice("cumulative", OLD_GROUPS)  # [C] | task [D]
    proxy_init: int = integer(6, minimum=0)  # [C]
    radius_init: float = number(0.15, minimum=0)  # [C]
    augment: int = integer(5, minimum=1)  # [C]

    def check(self) -> None:
        lo = self.weight_min
        require(
            self.weight_max >= lo, "weight_max", self.weight_max, f"a number >= weight_min ({lo})"
        )


@METHODS.register("lga")
class LGA(GLFC):
    name = "lga"
    Params = LGAParams
    report_w_old = True

    # ---------------------------------------------------------------- local losses
    def row_weights(self, g: torch.Tensor, row_task: torch.Tensor, task: int | torch.Tensor, top: int,
                    real: torch.Tensor | None = None, learned: bool | torch.Tensor = True) -> torch.Tensor:  # fmt: skip
        """``adaptive_weights``; w = 1 on every row of a client whose memory holds no class
        yet (the first task; a later task of a client with no rows in the earlier ones) [C:
        ``efficient_old_class_weight``'s ``w = 1`` while ``learned_classes`` is empty]."""
        p = self.p
        w = adaptive_weights(g, row_task, task, p.old_groups, p.weight_min, p.weight_max, top, real)
        if learned is True:
            return w
        ones = torch.ones_like(w) if real is None else real.to(w.dtype)
        return ones if learned is False else torch.where(learned, w, ones)

    def distill_weights(self, w: torch.Tensor) -> torch.Tensor:
        return w

    # ---------------------------------------------------------------- radius
    def client_reply(self, exchange: str, ctx: ClientContext) -> Any:
        """The memory (GLFC) and, after the first task, the per-class feature sums of the
        task's final global model for the augmentation radius."""
        self.update_memory(ctx)
        if ctx.task != 0:
            return None
        x, y = ctx.data.all()
        model = ctx.model
        was = model.training
        model.eval()
        with torch.no_grad():
            f = (
                torch.cat([model.features(x[s : s + 1024]) for s in range(0, len(x), 1024)])
                .flatten(1)
                .double()
            )
        model.train(was)
        classes = y.unique()
        onehot = (y[:, None] == classes[None]).double()  # [n, k]
        return {
            "classes": classes, "n": onehot.sum(0), "sum": onehot.T @ f, "sq": onehot.T @ (f * f).sum(1),
        }  # fmt: skip

    def server_collect(self, exchange: str, server: ServerContext, replies: dict[int, Any]) -> None:
        """The radius, once, from the first task end that brings task-0 sums (the first;
        with asynchronous boundaries, the one after the first clients left task 0)."""
        if RADIUS not in server.state and replies:
            r = pooled_radius([replies[c] for c in sorted(replies)])
            if r is not None:
                server.state[RADIUS] = r

    def server_metrics(self, server: ServerContext, uploads: Sequence[Upload]) -> dict[str, float]:
        out = super().server_metrics(server, uploads)
        out["radius"] = float(server.state.get(RADIUS, self.p.radius_init))
        return out

    # ---------------------------------------------------------------- proxy score
    @torch.no_grad()
    def monitor_accuracy(
        self, server: ServerContext, model: nn.Module, x: torch.Tensor, y: torch.Tensor
    ) -> float:
        """The classifier's accuracy on augmented features of the monitor set [C f_monitor];
        0 in the task's first ``proxy_init`` rounds [C]."""
        if (server.round - 1) % self.rounds_per_task < self.p.proxy_init:
            return 0.0
        was = model.training
        model.eval()
        t = min(server.task, self.tasks - 1)
        f = model.features(x).flatten(1)
        gen = torch.Generator().manual_seed(torch_seed(self.info.seed, server.round, AUG_STREAM))
        radius = float(server.state.get(RADIUS, self.p.radius_init))
        fa, rows = augment_features(f, y, radius, self.p.augment, gen)
        ya = y[rows]
        model.train(was)
        if len(ya) == 0:
            return 0.0
        rt = self.row_task(ya, t)
        logits = head_scores(model, fa, t)
        pred = logits.masked_fill(~self.allowed(rt, t), float("-inf")).argmax(1)
        return float((pred == ya).double().mean())
