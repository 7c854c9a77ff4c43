"""Evaluation and summary statistics."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


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
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int, batch_size: int = 1024
) -> list[float]:
    """Accuracy per true class (NaN for a class absent from y)."""
    was_training = model.training
    model.eval()
    preds = torch.cat(
        [model(x[s : s + batch_size]).argmax(1) for s in range(0, len(y), batch_size)]
    )
    model.train(was_training)
    hits = torch.bincount(y[preds == y], minlength=num_classes).double()
    totals = torch.bincount(y, minlength=num_classes).double()
    return [h / t if t > 0 else math.nan for h, t in zip(hits.tolist(), totals.tolist())]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof = 1; 0 for a single value), NaNs ignored."""
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not vals:
        return math.nan, math.nan
    m = sum(vals) / len(vals)
    if len(vals) == 1:
        return m, 0.0
    return m, math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))
