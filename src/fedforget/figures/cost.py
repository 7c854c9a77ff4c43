"""What the runs cost, per method (FedProTIP Fig. 6: training time and GPU memory; Fig. 7: memory per phase).

- ``run_cost``: each method's training time (hours: the run's ``elapsed_s`` at its last
  round, timings.csv, which a resumed run continues) and peak memory (run.json's
  ``peak_gpu_memory_mb`` where the runs trained on a GPU, else ``peak_rss_mb``, the peak
  resident memory of the process that ran the job), bars with ±1 std over seeds, one row
  of two panels per dataset x setting. Writes a .csv beside it. [D] The times are as the
  runs ran: runs that shared a GPU (``gpu_slots``) or a node took longer than alone, and a
  resumed run's memory is that of its last segment; compare runs made alike."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from ..memory import PHASES
from ..plots import _plt, _save, setting_label
from ..utils import FedForgetError
from . import FIGURES, FigureInput, method_bars

MEASURES = ("hours", "memory_gb")


def _cost(run_dir: Path) -> dict[str, float | None]:
    """One run's training hours and peak memory (GB) and which memory it is."""
    record = json.loads((run_dir / "run.json").read_text())
    timings = pd.read_csv(run_dir / "timings.csv")
    hours = float(timings["elapsed_s"].iloc[-1]) / 3600 if len(timings) else None
    gpu = record.get("peak_gpu_memory_mb")
    mem = gpu if gpu is not None else record.get("peak_rss_mb")
    return {"hours": hours, "memory_gb": None if mem is None else mem / 1024, "gpu": gpu is not None}


@FIGURES.register("run_cost")
def run_cost(inp: FigureInput, out: Path) -> list[Path]:
    runs = inp.runs[inp.runs["status"] == "completed"]
    if runs.empty:
        raise FedForgetError("figure 'run_cost': no completed run")
    rows = [{**r[["dataset", "setting", "method", "seed"]].to_dict(), **_cost(Path(r["run_dir"]))} for _, r in runs.iterrows()]
    per_run = pd.DataFrame(rows)
    gpu = bool(per_run["gpu"].any())
    if gpu and not per_run["gpu"].all():  # [D] GPU and host memory are not one quantity
        per_run.loc[~per_run["gpu"], "memory_gb"] = None
    long = per_run.melt(id_vars=["dataset", "setting", "method", "seed"], value_vars=list(MEASURES),
                        var_name="measure", value_name="value").dropna(subset=["value"])  # fmt: skip
    table = long.groupby(["dataset", "setting", "measure", "method"], sort=False)["value"].agg(["mean", "std", "count"]).reset_index()
    out = Path(out)
    table.to_csv(out.with_suffix(".csv"), index=False)
    plt = _plt()
    panels = list(dict.fromkeys(zip(table["dataset"], table["setting"])))
    methods = list(dict.fromkeys(runs["method"]))
    fig, axes = plt.subplots(len(panels), 2, figsize=(max(7.0, 0.9 * len(methods) + 3), 3.4 * len(panels)), squeeze=False)
    labels = {"hours": "training time (h)", "memory_gb": "peak GPU memory (GB)" if gpu else "peak host memory (GB)"}
    for row, (ds, st) in zip(axes, panels):
        for ax, measure in zip(row, MEASURES):
            sub = table[(table["dataset"] == ds) & (table["setting"] == st) & (table["measure"] == measure)]
            sub = sub.set_index("method").reindex([m for m in methods if m in set(sub["method"])])
            ax.bar(range(len(sub)), sub["mean"], yerr=sub["std"].fillna(0), capsize=2, color="tab:blue")
            ax.set_xticks(range(len(sub)))
            ax.set_xticklabels(sub.index, rotation=45, ha="right", fontsize=8)
            ax.set_ylabel(labels[measure])
            ax.set_title(f"{ds}, {setting_label(st)}", fontsize=9)
            ax.grid(alpha=0.3, axis="y")
    fig.suptitle("Training time and peak memory per method (FedProTIP Fig. 6), mean ± std over seeds", fontsize=10)
    fig.tight_layout()
    _save(fig, out)
    plt.close(fig)
    return [out, out.with_suffix(".csv")]


PHASE_LABELS = {"train": "local training", "aggregate": "aggregation", "task_end": "task end (bases)",
                "round_end": "round end", "evaluate": "evaluation"}  # fmt: skip


def _phase_peaks(run_dir: Path) -> tuple[dict[str, float], bool]:
    """One run's peak memory per phase (MB) and whether it is GPU memory."""
    record = json.loads((run_dir / "run.json").read_text())
    return dict(record.get("peak_memory_by_phase_mb") or {}), record.get("peak_gpu_memory_mb") is not None


@FIGURES.register("phase_memory")
def phase_memory(inp: FigureInput, out: Path) -> list[Path]:
    """FedProTIP Fig. 7: each method's peak memory in each phase of a round (run.json's
    ``peak_memory_by_phase_mb``: local training, aggregation, the task-end exchanges, the
    round-end exchange, evaluation; ``fedforget.memory``), in GB, mean ± std over seeds,
    bars grouped by phase, one panel per dataset x setting (``method_bars``). GPU memory where
    the runs trained on a GPU, else the process's resident memory (which holds the data and
    models throughout); runs of both kinds are not mixed [D]. Writes a .csv beside it."""
    runs = inp.runs[inp.runs["status"] == "completed"]
    rows, kinds = [], set()
    for _, r in runs.iterrows():
        peaks, gpu = _phase_peaks(Path(r["run_dir"]))
        kinds.add(gpu)
        rows += [{**r[["dataset", "setting", "method", "seed"]].to_dict(), "phase": k, "gb": v / 1024}
                 for k, v in peaks.items()]  # fmt: skip
    if not rows:
        raise FedForgetError(
            "figure 'phase_memory': no completed run records its peak memory per phase (run.json's "
            "peak_memory_by_phase_mb); set train.phase_memory: true before they train (a runtime setting: runs already "
            "finished keep their run.json)"
        )
    if len(kinds) > 1:
        raise FedForgetError("figure 'phase_memory': some runs trained on a GPU and some on a CPU; their memory is not one quantity")
    per_run = pd.DataFrame(rows)
    order = {p: i for i, p in enumerate(PHASES)}  # the phases in the order of a round, any other after
    per_run = per_run.sort_values("phase", key=lambda s: s.map(lambda p: order.get(p, len(order))), kind="stable")
    table = per_run.groupby(["dataset", "setting", "method", "phase"], sort=False)["gb"].agg(["mean", "std", "count"]).reset_index()
    return method_bars(table, "phase", Path(out), stacked=True, ticks=lambda phases: [PHASE_LABELS.get(p, p) for p in phases],
                       ylabel="peak GPU memory (GB)" if kinds.pop() else "peak process memory (GB)",
                       title="Peak memory per phase of a round (FedProTIP Fig. 7), mean ± std over seeds")  # fmt: skip
