"""A run statistic against a setting swept over an experiment's methods (e.g. FedSOL Fig.
3: accuracy against the sampling ratio, the local epochs, the learning rate), one line per
group of runs (default: the method's name), mean ± std over seeds; the swept value is read
from each run's resolved config (run.json), so a sweep is written as methods with their own
``train`` override (or params) and any label; a partition's value (``partition.alpha``) is
swept over the experiment's partitions, one panel per dataset. Writes a .csv beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from ..plots import _plt, _save, axis_label, is_accuracy, setting_label
from ..utils import FedForgetError
from . import FIGURES, FigureInput, run_config

STATS = ("final", "best", "mean")  # the last round's value, the largest, the mean over rounds >= 1


def config_value(config: dict[str, Any], key: str) -> Any:
    """The value at dotted path ``key`` of a run's resolved config (``RunConfig.to_dict``),
    e.g. ``train.sample_rate``, ``train.optimizer.lr``, ``method.params.rho``; KeyError if absent."""
    value: Any = config
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(key)
        value = value[part]
    return value


@FIGURES.register("sweep")
def sweep(
    inp: FigureInput, out: Path, key: str = "train.sample_rate", column: str = "global_model_test_acc",
    stat: str = "final", group: str = "method.name", log_x: bool = False, title: str | None = None,
) -> list[Path]:
    if stat not in STATS:
        raise FedForgetError(f"figure 'sweep': stat={stat!r}; allowed: {', '.join(STATS)}")
    inp.require_columns("sweep", [column])
    runs = inp.runs[inp.runs["status"] == "completed"]
    keys = ["dataset", "setting", "method", "seed"]
    per_run = inp.per_run([column], stat)
    rows = []
    for _, r in runs.iterrows():
        cfg = run_config(r["run_dir"]).to_dict()
        try:
            x, g = config_value(cfg, key), config_value(cfg, group)
        except KeyError as e:
            raise FedForgetError(
                f"figure 'sweep': run {r['run_dir']} has no config value '{e.args[0]}' "
                "(a dotted path of run.json's config, e.g. train.sample_rate, method.params.rho)"
            ) from None
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise FedForgetError(f"figure 'sweep': {key} = {x!r} in run {r['run_dir']}; a number is needed on the x axis")
        rows.append({**{k: r[k] for k in keys}, "x": float(x), "group": str(g)})
    if not rows:
        raise FedForgetError("figure 'sweep': no completed run to draw")
    df = pd.DataFrame(rows).merge(per_run, on=keys)
    # a partition's value is swept (FedProTIP Fig. 5: alpha): the settings are the x axis, so
    # one panel per dataset holds them all [D]; otherwise one panel per dataset x setting
    across = key.split(".")[0] == "partition"
    by = ["dataset", "group", "x"] if across else ["dataset", "setting", "group", "x"]
    table = df.groupby(by)[column].agg(["mean", "std", "count"]).reset_index()
    out = Path(out)
    table.to_csv(out.with_suffix(".csv"), index=False)
    plt = _plt()
    panels = list(dict.fromkeys(zip(table["dataset"], [None] * len(table) if across else table["setting"])))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 3.6), squeeze=False)
    what = {"final": "final round", "best": "best round", "mean": "mean over rounds"}[stat]
    scale = 100 if is_accuracy(column) else 1  # accuracies drawn in %, as the learning curves
    for ax, (ds, st) in zip(axes[0], panels):
        sub = table[(table["dataset"] == ds) & (across or table["setting"] == st)]
        for g, s in sub.groupby("group", sort=False):
            ax.errorbar(s["x"], scale * s["mean"], yerr=scale * s["std"].fillna(0), marker="o", capsize=3, label=g)
        if log_x:
            ax.set_xscale("log")
        xs = sorted(set(sub["x"]))  # ticks at the swept values, written as in the config
        ax.set_xticks(xs, labels=[f"{v:g}" for v in xs])
        ax.minorticks_off()
        ax.set_xlabel(key)
        ax.set_ylabel(f"{axis_label(column)}\n({what})")
        ax.set_title(ds if across else f"{ds}, {setting_label(st)}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title or f"{axis_label(column)} against {key} (mean ± std over seeds)", fontsize=10)
    fig.tight_layout()
    _save(fig, out)
    plt.close(fig)
    return [out, out.with_suffix(".csv")]
