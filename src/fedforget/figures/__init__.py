"""Experiment-specific figures (a paper's figure re-drawn from our runs).

An experiment lists them in its config::

    figures:
      - name: decision_boundaries        # a registered figure
        label: boundaries_r1_r20         # file name (default: name)
        options: {rounds: [1, 10, 20]}   # keyword arguments of the figure function

and the workflow draws each into ``results/<experiment>/figures/<label>.png`` after the
experiment's aggregation. A figure is a function registered in a module of this package::

    @FIGURES.register("decision_boundaries")
    def decision_boundaries(inp: FigureInput, out: Path, rounds: list[int] = (1, 10, 20)) -> list[Path]:
        ...  # write out (a .png); may write siblings with the same stem (.csv, .pdf)

It reads the experiment's summary (``inp.runs``: one row per run with its ``run_dir``;
``inp.metrics``: every run's metrics rows) and, if it needs them, files inside the run
directories (e.g. ``snapshots/`` written for ``train.save_client_models``). Its keyword
arguments are the options a config may set; unknown options, and values of another type
than the argument's annotation (int, float, str, bool, list[T], ``X | None``), are rejected at
config validation.
"""

from __future__ import annotations

import importlib
import inspect
import math
import pkgutil
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from ..plots import _plt, _save, measured, setting_label
from ..registry import Registry
from ..utils import FedForgetError
from ..validation import describe_allowed, strict_validator

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


def round_means(inp: FigureInput, figure: str, columns: dict[str, Any], key: str, round: int | None) -> pd.DataFrame:
    """The metrics ``columns`` (column -> its ``key`` value) of every run in one round
    (default each run's last round with a value), mean / std / count over seeds, long:
    dataset, setting, method, ``key``, mean, std, count, in the order of ``columns`` within
    each method. One error naming the figure where no run has them in that round."""
    runs = ["dataset", "setting", "method", "seed"]
    cols = list(columns)
    m = inp.metrics[inp.metrics[cols].notna().any(axis=1)]
    m = m[m["round"] == m.groupby(runs)["round"].transform("max")] if round is None else m[m["round"] == int(round)]
    if m.empty:
        raise FedForgetError(f"figure '{figure}': no run has {cols[0]} (or its siblings) in round {round}")
    long = m.melt(id_vars=runs, value_vars=cols, var_name=key, value_name="value").dropna(subset=["value"])
    long["position"] = long[key].map({c: i for i, c in enumerate(cols)})
    long[key] = long[key].map(columns)
    table = (long.groupby(["dataset", "setting", "method", "position", key], sort=False)["value"]
             .agg(["mean", "std", "count"]).reset_index())  # fmt: skip
    order = {meth: i for i, meth in enumerate(dict.fromkeys(table["method"]))}
    table = table.assign(_m=table["method"].map(order)).sort_values(["dataset", "setting", "_m", "position"], kind="stable")
    return table.drop(columns=["_m", "position"]).reset_index(drop=True)


def method_bars(table: pd.DataFrame, key: str, out: Path, *, ylabel: str, title: str, xlabel: str | None = None,
                ticks: Callable[[list], list[str]] = lambda keys: [str(k) for k in keys], stacked: bool = False) -> list[Path]:  # fmt: skip
    """``round_means``'s table as bars: one per (``key`` value, method) with ±1 std, one
    panel per dataset x setting (side by side, or one under another with ``stacked`` for
    many, rotated tick labels); writes ``out`` and the table beside it (.csv)."""
    out = Path(out)
    table.to_csv(out.with_suffix(".csv"), index=False)
    plt = _plt()
    panels = list(dict.fromkeys(zip(table["dataset"], table["setting"])))
    n_keys = len(set(table[key]))
    if stacked:
        fig, axes = plt.subplots(len(panels), 1, figsize=(max(6.0, 0.35 * n_keys + 2), 3.4 * len(panels)), squeeze=False)
        axes = axes[:, 0]
    else:
        fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.6), squeeze=False)
        axes = axes[0]
    for ax, (ds, st) in zip(axes, panels):
        sub = table[(table["dataset"] == ds) & (table["setting"] == st)]
        keys, methods = list(dict.fromkeys(sub[key])), list(dict.fromkeys(sub["method"]))
        width, x = 0.8 / len(methods), list(range(len(keys)))
        for i, meth in enumerate(methods):
            s = sub[sub["method"] == meth].set_index(key).reindex(keys)
            ax.bar([v + (i - (len(methods) - 1) / 2) * width for v in x], s["mean"], width,
                   yerr=s["std"].fillna(0), capsize=2, label=meth)  # fmt: skip
        ax.set_xticks(x)
        if stacked:
            ax.set_xticklabels(ticks(keys), rotation=60, ha="right", fontsize=7)
        else:
            ax.set_xticklabels(ticks(keys))
        if xlabel:
            ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ds}, {setting_label(st)}", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _save(fig, out)
    plt.close(fig)
    return [out, out.with_suffix(".csv")]


def run_config(run_dir: str | Path) -> RunConfig:
    """The resolved config of a finished run (its run.json)."""
    from ..config import load_run_config

    return load_run_config(Path(run_dir) / "run.json")


def figure_options(name: str) -> set[str]:
    """The options (keyword arguments) a figure accepts."""
    sig = inspect.signature(FIGURES.get(name))
    return {p for i, p in enumerate(sig.parameters) if i >= 2}


def _schema_of(hint: Any) -> dict[str, Any]:
    """The JSON-schema fragment of a figure option's annotation (int, float, str, bool, None,
    list[T], ``A | B``), validated as every config value is (``strict_validator``: an int is
    an int, not a bool or 2.0)."""
    simple = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string"}
    if hint in simple:
        return {"type": simple[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        # null first: describe_allowed then says "null or a list of items, each a string"
        return {"anyOf": [_schema_of(a) for a in sorted(args, key=lambda a: a is not type(None))]}
    if origin is list:
        return {"type": "array", "items": _schema_of(args[0])}
    raise TypeError(f"figure option annotation {hint!r} is not one check_figure reads")  # a figure's author's slip


def check_figure(name: str, options: dict[str, Any], key: str = "figures") -> None:
    """Config validation: the figure exists, takes these options, and each value has the type
    of the figure function's annotation (a wrong one failed only in the figure job, after
    training)."""
    fn = FIGURES.get(name, f"{key}.name")
    allowed = figure_options(name)
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise FedForgetError(
            f"{key}.options: unknown option(s) {unknown} for figure '{name}'; allowed: {sorted(allowed) or 'none'}"
        )
    hints = typing.get_type_hints(fn)
    for opt, value in options.items():
        if opt not in hints:  # a figure's author's slip (test_figures checks every registered figure)
            raise TypeError(f"figure '{name}': option {opt!r} has no annotation for check_figure to read")
        frag = _schema_of(hints[opt])
        if not strict_validator(frag).is_valid(value) or (isinstance(value, float) and not math.isfinite(value)):
            raise FedForgetError(
                f"{key}.options.{opt}={value!r} for figure '{name}'; allowed: {describe_allowed(frag)}"
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
