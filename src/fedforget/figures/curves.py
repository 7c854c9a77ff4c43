"""Per-round curves of any metrics column (one panel per dataset x setting, one line per
method, band = ±1 std over seeds), e.g. a method's diagnostic or a diagnostics column."""

from __future__ import annotations

from pathlib import Path

from ..plots import learning_curves
from . import FIGURES, FigureInput


@FIGURES.register("curves")
def curves(inp: FigureInput, out: Path, column: str = "global_model_test_acc", title: str | None = None) -> list[Path]:
    inp.require_columns("curves", [column])
    return [learning_curves(inp.metrics, column, out, title)]
