"""Per-round curves of any metrics column (one panel per dataset x setting, one line per
method, band = ±1 std over seeds), e.g. a method's diagnostic or a diagnostics column."""

from __future__ import annotations

from pathlib import Path

from ..plots import learning_curves
from ..utils import FedForgetError
from . import FIGURES, FigureInput


@FIGURES.register("curves")
def curves(inp: FigureInput, out: Path, column: str = "global_model_test_acc", title: str | None = None) -> list[Path]:
    if column not in inp.metrics.columns:
        have = sorted(c for c in inp.metrics.columns if c not in ("dataset", "setting", "method", "seed"))
        raise FedForgetError(f"figure 'curves': column '{column}' is in no run's metrics.csv; have: {have}")
    return [learning_curves(inp.metrics, column, out, title)]
