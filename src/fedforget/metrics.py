"""Evaluation and summary statistics."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .methods.base import GradMap, flatten_state


def accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    """Share of rows whose arg-max logit is the label (ties go to the lowest index)."""
    return (logits.argmax(dim=1) == y).float().mean().item()


@torch.no_grad()
def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024
) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on (x, y), in eval mode, in batches."""
    was_training = model.training
    model.eval()
    correct = torch.zeros((), device=x.device)
    loss = torch.zeros((), device=x.device, dtype=torch.float64)
    for s in range(0, len(y), batch_size):
        logits = model(x[s : s + batch_size])
        yb = y[s : s + batch_size]
        correct += (logits.argmax(1) == yb).sum()
        loss += F.cross_entropy(logits, yb, reduction="sum").double()
    model.train(was_training)
    n = max(len(y), 1)
    return correct.item() / n, loss.item() / n


@torch.no_grad()
def classwise_accuracy(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int, batch_size: int = 1024,
    scores: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[float]:
    """Accuracy per true class (NaN for a class absent from y); ``scores``: the predicted
    scores of inputs (default ``model``'s forward; the evaluator passes the method's
    ``eval_predict``, which per-task heads and a method's own classifier change)."""
    scores = scores or model
    was_training = model.training
    model.eval()
    preds = torch.cat(
        [scores(x[s : s + batch_size]).argmax(1) for s in range(0, len(y), batch_size)]
    )
    model.train(was_training)
    hits = torch.bincount(y[preds == y], minlength=num_classes).double()
    totals = torch.bincount(y, minlength=num_classes).double()
    return [h / t if t > 0 else math.nan for h, t in zip(hits.tolist(), totals.tolist())]


# optional per-round analyses (train.diagnostics) and the columns they add
DIAGNOSTICS = {
    # ||w_k - w_g||_2 over all float weights, w_g the model broadcast this round, mean over
    # the sampled clients; and the mean over pairs i < j of ||w_i - w_j||_2 (FedSOL Fig. 5)
    "weight_divergence": ["local_models_dist_to_global_mean", "local_models_pairwise_dist_mean"],
    # the aggregated model's test accuracy per true class: global_model_test_acc_class<c>
    "classwise_accuracy": [],
    # FedSOL's Eq. 7 lambda of each local model per trainable parameter tensor, averaged over
    # the tensor's elements and the sampled clients: layer_lambda:<parameter name> (Fig. 4b)
    "layer_lambda": [],
    # FedProTIP's Assumptions 4-5 estimated at each round's broadcast weights W (Fig. 2): the
    # share of the current task's gradient energy its projection keeps, projection_rho =
    # ||P g_t||^2 / ||g_t||^2, and for each older task tau projection_beta_task<tau> =
    # ||P g_tau|| / ||g_tau||; projection_task = the current task t (projection_geometry)
    "projection_geometry": ["projection_task", "projection_rho"],
}
GEOMETRY_ROWS = 512  # [D] rows of each task's pooled training data behind its gradient
GEOMETRY_STREAM = 0x5B  # keyed randomness of those rows (0x51-0x55: schedule, shuffling, init, distillation, dropout)


def projection_geometry(
    model: nn.Module, batches: dict[int, tuple], task: int, step_map: GradMap | None
) -> dict[str, float]:
    """FedProTIP's rho_t and beta_tau^(t-1) (Assumptions 4 and 5 [P, fedprotip.md App. A.2],
    Fig. 2) at the weights ``model`` holds (a round's broadcast: the synchronization
    iterate), ``task`` = t the current task. ``batches[tau]`` = (x, y) of task
    tau's training rows; g_tau is the gradient of their mean cross-entropy in the trainable
    parameters (each row scored by its task's head where heads are per task; the model in
    eval mode: no dropout draws [D]); P is the method's map of a local step's gradient this
    round (``step_map``, a client alone: a stack of one; a parameter it holds counts 0;
    None: the identity). Returns projection_task, projection_rho = ||P g_t||^2 / ||g_t||^2
    and projection_beta_task<tau> = ||P g_tau|| / ||g_tau|| for tau < t (NaN where a
    gradient is 0)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    was_training = model.training
    model.eval()
    out: dict[str, float] = {"projection_task": float(task)}
    for tau, (x, y) in sorted(batches.items()):
        logits = model.row_logits(x, torch.full((len(y),), tau, device=y.device))
        loss = F.cross_entropy(logits.float(), y)
        gs = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        g = {n: (torch.zeros_like(p) if v is None else v).unsqueeze(0) for (n, p), v in zip(named, gs)}
        pg = g if step_map is None else step_map(dict(g))
        kept = sum(float(v.double().pow(2).sum()) for v in pg.values() if v is not None)
        whole = sum(float(v.double().pow(2).sum()) for v in g.values())
        ratio = kept / whole if whole > 0 else math.nan
        if tau == task:
            out["projection_rho"] = ratio
        else:
            out[f"projection_beta_task{tau}"] = math.sqrt(ratio)
    model.train(was_training)
    return out


def weight_divergence(global_params: dict, local_params: Sequence[dict]) -> dict[str, float]:
    w = torch.stack([flatten_state(p).double() for p in local_params])  # [m, P]
    to_global = (w - flatten_state(global_params).double()).norm(dim=1).mean().item()
    m = len(local_params)
    pair = math.nan
    if m > 1:
        d = torch.cdist(w.unsqueeze(0), w.unsqueeze(0), compute_mode="donot_use_mm_for_euclid_dist")[0]
        pair = (d.sum() / (m * (m - 1))).item()  # the diagonal is 0
    return {"local_models_dist_to_global_mean": to_global, "local_models_pairwise_dist_mean": pair}



@torch.no_grad()
def layer_lambda(global_params: dict, local_params: Sequence[dict], names: Sequence[str]) -> dict[str, float]:
    """FedSOL's Eq. 7 [P, fedsol.md Sec. 3.3] per parameter tensor m of each local model
    w_k: lambda^(m) = |w_k^(m) - w_g^(m)| / ||w_k^(m) - w_g^(m)||_2 (0 where w_k^(m) =
    w_g^(m)), averaged over the tensor's elements, then over the local models ("layer-wisely
    averaged lambda values across the local models", Fig. 4b). One column per name in
    ``names`` (the model's trainable parameters), ``layer_lambda:<name>``; computed in
    float64. The mean of a unit vector's entries is ||d||_1 / (n ||d||_2): between 1/n (one
    entry moved) and 1/sqrt(n) (all moved alike), so it also reads how evenly a layer moved."""
    values = []
    for name in names:  # [clients, elements] per tensor; the host reads every value once, at the end
        d = (torch.stack([local[name].double() for local in local_params]) - global_params[name].double()).abs().flatten(1)
        n = torch.linalg.vector_norm(d, dim=1)
        values.append(torch.where(n > 0, d.sum(1) / (n * d.shape[1]), 0.0).mean())
    return dict(zip((f"layer_lambda:{n}" for n in names), torch.stack(values).tolist())) if values else {}


@torch.no_grad()
def global_model_metrics(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int, batch_size: int, diagnostics: Sequence[str]
) -> dict[str, float]:
    """The global model's metrics.csv columns: test accuracy and loss, and per class with the
    classwise_accuracy diagnostic."""
    acc, loss = evaluate(model, x, y, batch_size)
    row = {"global_model_test_acc": acc, "global_model_test_loss": loss}
    if "classwise_accuracy" in diagnostics:
        accs = classwise_accuracy(model, x, y, num_classes, batch_size)
        row.update({f"global_model_test_acc_class{c}": a for c, a in enumerate(accs)})
    return row

