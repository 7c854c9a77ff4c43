"""Experiment-specific figures (a paper's figure re-drawn from our runs).

An experiment lists them in its config::

    figures:
      - name: decision_boundaries        # a registered figure
        label: boundaries_r1_r20         # file name (default: name)
        options: {rounds: [1, 10, 20]}   # keyword arguments of the figure function

and the workflow draws each into ``results/<experiment>/figures/<label>.png`` after the
experiment's aggregation. A figure is a function registered in a module of this package::

    @FIGURES.register("decision_boundaries")
    def decision_boundaries(inp: FigureInput, out: Path, rounds=(1, 10, 20)) -> list[Path]:
        ...  # write out (a .png); may write siblings with the same stem (.csv, .pdf)

It reads the experiment's summary (``inp.runs``: one row per run with its ``run_dir``;
``inp.metrics``: every run's metrics rows) and, if it needs them, files inside the run
directories (e.g. ``snapshots/`` written for ``train.save_client_models``). Its keyword
arguments are the options a config may set; unknown options are rejected at config
validation.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from ..plots import measured
from ..registry import Registry
from ..utils import FedForgetError

if TYPE_CHECKING:  # pragma: no cover
    from ..config import RunConfig

FigureFn = Callable[..., list[Path]]
FIGURES: Registry[FigureFn] = Registry("figure")


@dataclass
class FigureInput:
    experiment: str
    summary_dir: Path
    runs: pd.DataFrame  # summary/runs.csv: one row per run (run_dir, dataset, setting, method, seed, status, ...)
    metrics: pd.DataFrame  # summary/metrics.parquet: every run's metrics rows, with the run keys

    @classmethod
    def load(cls, summary_dir: str | Path, experiment: str) -> FigureInput:
        d = Path(summary_dir)
        runs_csv, metrics_pq = d / "runs.csv", d / "metrics.parquet"
        for f in (runs_csv, metrics_pq):
            if not f.exists():
                raise FedForgetError(f"figure input {f} not found; run `fedforget aggregate` first")
        return cls(experiment, d, pd.read_csv(runs_csv), pd.read_parquet(metrics_pq))


    def per_run(self, columns: list[str], stat: str) -> pd.DataFrame:
        """One row per run (dataset, setting, method, seed) of a statistic of metrics
        ``columns`` over its rounds >= 1: ``mean``, ``final`` (the last round's value) or
        ``best`` (the largest)."""
        keys = ["dataset", "setting", "method", "seed"]
        m = self.metrics[self.metrics["round"] >= 1]
        if stat == "final":
            m = m[m["round"] == m.groupby(keys)["round"].transform("max")]
        return m.groupby(keys)[columns].agg("max" if stat == "best" else "mean").reset_index()

    def runs_of_one_setting(
        self, figure: str, seed: int, setting: str | None, methods: list[str] | None
    ) -> tuple[pd.DataFrame, list[str]]:
        """(the completed runs of ``seed`` on one dataset and ``setting`` (default: the first
        run's), the methods to draw in order: ``methods`` or every one of them): for a
        figure of one run per method. One error naming the figure where a run is missing."""
        runs = self.runs[(self.runs["seed"] == seed) & (self.runs["status"] == "completed")]
        if setting is not None:
            runs = runs[runs["setting"] == setting]
        if runs.empty:
            raise FedForgetError(
                f"figure '{figure}': no completed run with seed {seed}" + (f" and setting '{setting}'" if setting else "")
            )
        first = runs.iloc[0]
        runs = runs[(runs["dataset"] == first["dataset"]) & (runs["setting"] == first["setting"])]
        order = list(methods) if methods else list(dict.fromkeys(runs["method"]))
        missing = [m for m in order if m not in set(runs["method"])]
        if missing:
            raise FedForgetError(f"figure '{figure}': no run of method(s) {missing}; have {sorted(set(runs['method']))}")
        return runs, order

    def require_columns(self, figure: str, columns: list[str], hint: str = "") -> None:
        """One error naming the figure, the metrics columns that no run measured and
        (``hint``) what produces them. A column that is NaN in every row counts as missing:
        e.g. the local models' accuracy where every run says ``train.eval_local_models:
        false``; its figure would be empty axes [D]."""
        missing = [c for c in columns if not measured(self.metrics, c)]
        if missing:
            have = sorted(c for c in self.metrics.columns
                          if c not in ("dataset", "setting", "method", "seed") and measured(self.metrics, c))  # fmt: skip
            raise FedForgetError(
                f"figure '{figure}': column(s) {missing} have a value in no run's metrics.csv{hint}; have: {have}"
            )


def run_config(run_dir: str | Path) -> RunConfig:
    """The resolved config of a finished run (its run.json)."""
    from ..config import load_run_config

    return load_run_config(Path(run_dir) / "run.json")


def figure_options(name: str) -> set[str]:
    """The options (keyword arguments) a figure accepts."""
    sig = inspect.signature(FIGURES.get(name))
    return {p for i, p in enumerate(sig.parameters) if i >= 2}


def check_figure(name: str, options: dict[str, Any], key: str = "figures") -> None:
    """Config validation: the figure exists and takes these options."""
    FIGURES.get(name, f"{key}.name")
    allowed = figure_options(name)
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise FedForgetError(
            f"{key}.options: unknown option(s) {unknown} for figure '{name}'; allowed: {sorted(allowed) or 'none'}"
        )


def make_figure(
    name: str, summary_dir: str | Path, experiment: str, out: str | Path, options: dict[str, Any] | None = None
) -> list[Path]:
    check_figure(name, options or {})
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return FIGURES.get(name)(FigureInput.load(summary_dir, experiment), out, **(options or {}))


# import every figure module so that it registers itself
for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")
