"""Collect finished runs into tidy tables: per experiment ``runs.csv`` (one row per run),
``metrics.parquet`` (every round of every run, long format), ``table.csv`` (mean and std
over seeds of final and best global-model test accuracy per dataset x partition x method,
beside the papers' numbers where the experiment links a paper table), ``table.md`` and
``table.html`` (the same table, rendered for the Snakemake report).

Experiments with continual runs (a scenario of more than one task, ``fedforget.continual``)
also get ``tasks.parquet`` (every such run's tasks.csv with its run keys),
``accuracy_matrix.csv`` (each run's a[t][i] with its run keys), the columns scenario,
incremental, tasks, rounds_per_task, acc, fgt, ft, bwt, fwt and Acc_t after each task t,
avg_acc_after_task_<t>, in runs.csv (fractions; NaN for one-task and unfinished runs) and
``continual.csv`` / ``.md`` / ``.html`` (those metrics in %, mean ± std over completed seeds,
beside the paper's ACC and forgetting where the experiment links a paper table). The task-aware
accuracy of a stream evaluated without the task id (tasks.csv's ``task_aware``, every method:
``fedforget.evaluation``) and a method's other inference modes (``eval_counts``: FedProTIP's
TIP accuracies) add ``acc_<mode>`` and ``ft_<mode>`` (its tasks.csv column in place of the
accuracy; the task-aware scores every continual metric, ``fgt_task_aware``, ...:
``extra_kinds``) to runs.csv and continual.csv, and ``avg_acc_after_task_<t>_<mode>`` to runs.csv, NaN
for the other methods; one whose metrics hold ``<method>_comm_task_mb`` (FOT, FedProTIP) adds
``comm_task_mb`` (MB per client and task, mean over tasks) to runs.csv and continual tables,
and each task's MB by part, ``comm_<part>_mb_task_<t>``, to runs.csv. An experiment of one-task
runs writes exactly the files it wrote before continual runs existed [D]."""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from .continual import (
    ACC_AFTER_TASK,
    COLLAPSE_SHARE,
    CONTINUAL_OUTPUTS,
    TASK_AWARE,
    TASK_COLUMNS,
    TOP_SHARE,
    acc_after_each_task,
    accuracy_matrix,
    accuracy_matrix_rows,
    continual_metrics,
    initial_accuracy,
    scenario_shape,
)
from .continual import METRICS as CONTINUAL_METRICS
from .paper_tables import PAPER_METRICS as PAPER_COLUMNS
from .paper_tables import paper_columns
from .partition import PartitionSpec
from .utils import FedForgetError, atomic_write, atomic_write_text, paper_tables

FAILED = "failed"
UNFINISHED = "unfinished"  # a run.json still "running": a job that stopped, not a failed run
MARKS = {FAILED: "failed seeds", UNFINISHED: "unfinished seeds"}
GROUP = ["experiment", "dataset", "setting", "clients", "partition_seed", "method"]  # a table row


def read_run(run_dir: Path) -> tuple[dict[str, Any], pd.DataFrame | None]:
    path = run_dir / "run.json"
    if not path.exists():
        raise FedForgetError(f"run missing: {path} does not exist")
    rec = json.loads(path.read_text())
    metrics = run_dir / "metrics.csv"
    df = pd.read_csv(metrics) if metrics.exists() else None
    return rec, df


def collect(run_dirs: Iterable[str | Path]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(runs, metrics): one row per run, and every metrics row with its run's keys."""
    runs, metrics, _, _ = collect_all(run_dirs)
    return runs, metrics


def collect_all(
    run_dirs: Iterable[str | Path],
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame | None, pd.DataFrame | None]:
    """(runs, metrics, tasks, matrices): ``collect``'s two, and where some run is continual
    every continual run's tasks.csv rows and accuracy-matrix rows with its run keys (else
    None, None), runs then with the continual columns (``continual_run``)."""
    runs, frames, extra, task_frames, matrix_frames = [], [], [], [], []
    for d in run_dirs:
        d = Path(d)
        rec, df = read_run(d)
        c = rec["config"]
        part = c["partition"]
        keys = {
            "experiment": c["experiment"],
            "dataset": c["dataset"]["label"],
            "setting": PartitionSpec(**part).setting,
            "clients": part["clients"],
            "partition_seed": part["seed"],
            "method": c["method"]["label"],
            "seed": c["seed"],
        }
        final = rec.get("final_global_model_test_acc")
        runs.append({
            **keys,
            "status": rec["status"],
            "final_global_model_test_acc": final if rec["status"] == "completed" else math.nan,
            "best_global_model_test_acc": rec.get("best_global_model_test_acc") if rec["status"] == "completed" else math.nan,
            "rounds_completed": rec.get("rounds_completed"),
            "wall_time_s": rec.get("wall_time_s"),
            "config_hash": rec["config_hash"],
            "fedforget_version": rec.get("versions", {}).get("fedforget"),
            "torch_version": rec.get("versions", {}).get("torch"),
            "device": rec.get("device"),
            "client_engine": rec.get("client_engine"),
            "method_note": rec["method_note"] if "method_note" in rec else method_note(c["method"]),
            "run_dir": str(d),
        })  # fmt: skip
        if df is not None:
            frames.append(df.assign(**keys))
            if TOP_SHARE in df:  # a task stream: the round its global model collapsed, if any
                runs[-1]["collapsed_round"] = collapsed_round(df, c["dataset"].get("scenario"))
        info, tasks, matrix = continual_run(d, rec)
        comm = [c for c in (df.columns if df is not None else []) if c.endswith(COMM_SUFFIX)]
        if comm and tasks is not None:  # FOT's / FedProTIP's task-end rows
            done = rec["status"] == "completed"
            info[COMM] = float(df[comm[0]].dropna().mean()) if done else math.nan
            info.update(comm_parts(df, info["tasks"], info["rounds_per_task"], done))
        extra.append(info)
        if tasks is not None:
            task_frames.append(tasks.assign(**keys))
            matrix_frames.append(matrix.assign(**keys))
    if not runs:
        raise FedForgetError("no runs to aggregate")
    metrics = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    runs_df = pd.DataFrame(runs)
    if not runs_df["method_note"].astype(bool).any():  # no method states a variant: the columns as before
        runs_df = runs_df.drop(columns="method_note")
    relabel = distinct_settings(runs_df)
    runs_df, metrics = _relabel(runs_df, relabel), _relabel(metrics, relabel)
    task_frames = [_relabel(f, relabel) for f in task_frames]
    matrix_frames = [_relabel(f, relabel) for f in matrix_frames]
    if not matrix_frames:  # one-task runs only: the tables as before continual runs existed
        return runs_df, metrics, None, None
    at = runs_df.columns.get_loc("best_global_model_test_acc") + 1
    runs_df = pd.concat([runs_df.iloc[:, :at], pd.DataFrame(extra), runs_df.iloc[:, at:]], axis=1)
    tasks = pd.concat(task_frames, ignore_index=True)
    matrices = pd.concat(matrix_frames, ignore_index=True)
    return runs_df, metrics, tasks, matrices


def distinct_settings(runs: pd.DataFrame) -> dict[tuple, str]:
    """Setting labels that tell an experiment's partitions apart (issue 33): a dataset whose
    label (dirichlet-0.3) stands for partitions that differ in their client count or seed gets
    those in the label ("dirichlet-0.3 k=20 seed 1"), so no table column or figure merges two
    partitions; {(dataset, setting, clients, partition_seed): new label}, empty where every
    label is already distinct (every shipped config) [D]."""
    out: dict[tuple, str] = {}
    if runs.empty:
        return out
    parts = runs[["dataset", "setting", "clients", "partition_seed"]].drop_duplicates()
    for (_, setting), g in parts.groupby(["dataset", "setting"], sort=False):
        if len(g) < 2:
            continue
        by_clients, by_seed = g["clients"].nunique() > 1, g["partition_seed"].nunique() > 1
        for row in g.itertuples(index=False):
            label = setting + (f" k={row.clients}" if by_clients else "") + (f" seed {row.partition_seed}" if by_seed else "")
            out[(row.dataset, row.setting, row.clients, row.partition_seed)] = label
    return out


def _relabel(df: pd.DataFrame, relabel: dict[tuple, str]) -> pd.DataFrame:
    if not relabel or df.empty or "setting" not in df:
        return df
    keys = zip(df["dataset"], df["setting"], df["clients"], df["partition_seed"])
    return df.assign(setting=[relabel.get(k, s) for k, s in zip(keys, df["setting"])])


def continual_run(
    run_dir: Path, rec: dict[str, Any]
) -> tuple[dict[str, Any], pd.DataFrame | None, pd.DataFrame | None]:
    """(runs.csv's continual columns, tasks.csv rows, accuracy-matrix rows) of one run; the
    two frames are None for a one-task run. The metrics (``continual.continual_metrics``,
    and Acc_t after each task t, ``avg_acc_after_task_<t>``; of a method's other inference
    mode ``acc_<mode>``, ``ft_<mode>`` and ``avg_acc_after_task_<t>_<mode>``) are NaN unless
    the run completed, as its final accuracy is [D]; a run that stopped early keeps its
    matrix rows, NaN from where it stopped."""
    c = rec["config"]
    sc = c["dataset"].get("scenario") or {}
    rounds = c.get("train", {}).get("rounds")
    info: dict[str, Any] = {"scenario": sc.get("kind", "none"), "incremental": sc.get("incremental") or "class"}
    try:
        shape = scenario_shape(sc, rounds)
    except FedForgetError as e:
        raise FedForgetError(f"{run_dir / 'run.json'}: {e}") from None
    if shape is None:
        info.update(tasks=1, rounds_per_task=rounds, **dict.fromkeys(CONTINUAL_METRICS, math.nan))
        return info, None, None
    n, r = shape
    path = run_dir / "tasks.csv"
    tasks = pd.read_csv(path) if path.exists() else pd.DataFrame(columns=list(TASK_COLUMNS))
    try:
        a, b = accuracy_matrix(tasks, n, r), initial_accuracy(tasks, n)
        matrix = pd.DataFrame(accuracy_matrix_rows(tasks, n, r))
    except FedForgetError as e:
        raise FedForgetError(f"{path}: {e}") from None
    done = rec["status"] == "completed"
    metrics = continual_metrics(a, b) if done else dict.fromkeys(CONTINUAL_METRICS, math.nan)
    info.update(tasks=n, rounds_per_task=r, **metrics)
    info.update(_after_task(a, done))
    for col in [c for c in tasks.columns if c not in TASK_COLUMNS]:  # task_aware, the method's eval_counts
        scores = tasks.drop(columns="accuracy").rename(columns={col: "accuracy"})
        other = accuracy_matrix(scores, n, r)
        m = continual_metrics(other, initial_accuracy(scores, n)) if done else {}
        info.update({f"{k}_{col}": m.get(k, math.nan) for k in extra_kinds(col)})
        info.update(_after_task(other, done, f"_{col}"))  # its Acc_t (Table 14's TIP)
    return info, tasks, matrix


def _after_task(a: Any, done: bool, suffix: str = "") -> dict[str, float]:
    """runs.csv's ``avg_acc_after_task_<t><suffix>``, t = 1..T: Acc_t of the accuracy matrix
    ``a`` (``continual.acc_after_each_task``), NaN unless the run completed."""
    after = acc_after_each_task(a) if done else [math.nan] * len(a)
    return {f"{ACC_AFTER_TASK}{t}{suffix}": float(v) for t, v in enumerate(after, start=1)}


EXTRA_METRICS = ("acc", "ft")  # of a method's other inference modes (tasks.csv's extra columns)


def extra_kinds(col: str) -> tuple[str, ...]:
    """The continual metrics runs.csv has of tasks.csv's extra column ``col``: every one
    (``CONTINUAL_METRICS``) of the task-aware scores (FedGP's task-IL columns are its
    class-IL runs scored with the task id: ``paper_tables.SCORED``), ACC and FT
    (``EXTRA_METRICS``) of a method's other inference modes."""
    return CONTINUAL_METRICS if col == TASK_AWARE else EXTRA_METRICS
# MB one client sends per task (model + what the method adds: FOT's sketches, FedProTIP's bases
# and references), from the method's <method>_comm_task_mb column, mean over the run's tasks
COMM, COMM_SUFFIX = "comm_task_mb", "_comm_task_mb"


COMM_PART = re.compile(r"[a-z0-9]+_comm_([a-z]+)_mb")  # <method>_comm_<part>_mb of metrics.csv


def comm_parts(df: pd.DataFrame, tasks: int, rounds_per_task: int, done: bool) -> dict[str, float]:
    """runs.csv's ``comm_<part>_mb_task_<t>`` (t from 1): the MB one client sends in task t
    per part (``<method>_comm_<part>_mb`` of the task's last round: FOT's model and sketch,
    FedProTIP's model, bases and references; FedProTIP Table 9), and ``comm_<part>_mb``, their
    mean over the tasks (Table 19's MB per task); NaN unless the run completed, as
    ``comm_task_mb``."""
    out = {}
    for col in df.columns:
        m = COMM_PART.fullmatch(col)
        if not m or m.group(1) == "task":
            continue
        per_task = [math.nan] * tasks
        if done:
            for rnd, v in df.loc[df[col].notna(), ["round", col]].itertuples(index=False):
                t = (int(rnd) - 1) // rounds_per_task  # the task that ended at this round
                if 0 <= t < tasks:
                    per_task[t] = float(v)
        out.update({f"comm_{m.group(1)}_mb_task_{t}": v for t, v in enumerate(per_task, start=1)})
        seen = [v for v in per_task if not math.isnan(v)]
        out[f"comm_{m.group(1)}_mb"] = sum(seen) / len(seen) if seen else math.nan
    return out


def extra_metrics(runs: pd.DataFrame) -> list[str]:
    """runs.csv's ``acc_<mode>`` / ``ft_<mode>`` columns of the methods' other inference
    modes (``FedAvg.eval_counts``), in order of appearance."""
    known = set(CONTINUAL_METRICS)
    return [c for c in runs.columns if _is_extra(c) and c not in known]


def _is_extra(column: str) -> bool:
    """Whether ``column`` is an ``<metric>_<mode>`` of ``extra_kinds``."""
    kind, _, mode = column.partition("_")
    return bool(mode) and kind in extra_kinds(mode)


def _seed_counts(status: pd.Series) -> dict[str, int]:
    """Seeds that failed or diverged, and seeds whose run.json still says running (a job that
    stopped before its end: unfinished, as paper.csv counts them)."""
    status = status.astype(str)
    unfinished = int((status == "running").sum())
    return {"n_failed": int((status != "completed").sum()) - unfinished, "n_unfinished": unfinished}


def _without_unfinished(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` without its n_unfinished column where no seed is unfinished: the tables keep the
    bytes they had before the count."""
    return df.drop(columns="n_unfinished") if "n_unfinished" in df and not df["n_unfinished"].any() else df


def _group_status(row: dict[str, Any]) -> str:
    return FAILED if row["n_failed"] else (UNFINISHED if row["n_unfinished"] else "ok")


def summarise(runs: pd.DataFrame) -> pd.DataFrame:
    """Mean and sample std (ddof=1) over completed seeds; a group with any failed
    (diverged/failed) run is reported as failed, the way FedSOL's Table 2 writes '10.00
    (Failed)'. The std of a single completed seed is undefined: NaN, not 0."""
    out = []
    for key, g in runs.groupby(GROUP, sort=False):
        ok = g[g["status"] == "completed"]
        row = dict(zip(GROUP, key))
        row.update(n_seeds=len(g), **_seed_counts(g["status"]))
        for m in ("final", "best"):
            vals = ok[f"{m}_global_model_test_acc"].astype(float) * 100
            row[f"{m}_acc_mean"] = vals.mean() if len(vals) else math.nan
            row[f"{m}_acc_std"] = vals.std(ddof=1) if len(vals) > 1 else math.nan
        row["status"] = _group_status(row)
        # [D] a task stream's best round comes before its later tasks exist (its accuracy is
        # over the tasks seen so far): not a result of the stream; its ACC is the final round's
        if "tasks" in g and bool((g["tasks"].fillna(1) > 1).any()):
            row["best_acc_mean"] = row["best_acc_std"] = math.nan
            row["task_stream"] = True
        row.update(_group_marks(g))
        out.append(row)
    df = pd.DataFrame(out)
    if "task_stream" in df:  # one-task experiments keep table.csv's columns as before
        df["task_stream"] = df["task_stream"].astype("boolean").fillna(False).astype(bool)
    return mark_other_engines(_without_unfinished(df))


def _group_marks(g: pd.DataFrame) -> dict[str, Any]:
    """What a table row says of its runs ``g`` besides the numbers (summary and continual
    tables alike): the client engines, the runs whose model collapsed (task streams) and
    the methods' variant notes (where some method states one)."""
    out: dict[str, Any] = {
        "client_engine": "/".join(sorted(set(g["client_engine"].dropna()))) if "client_engine" in g else ""
    }
    if "collapsed_round" in g:
        out["n_collapsed"] = int(g["collapsed_round"].notna().sum())
    if "method_note" in g:
        out["method_note"] = " / ".join(dict.fromkeys(n for n in g["method_note"].fillna("") if n))
    return out


def _stream(r: pd.Series) -> bool:
    return bool(r.get("task_stream", False))


def mark_other_engines(table: pd.DataFrame) -> pd.DataFrame:
    """``other_engine``: the cell's runs trained on another client engine than most cells of
    its column (dataset x setting), so its numbers differ from theirs also by float summation
    order (client_engine auto pairs an experiment's methods; a method's own train override
    can still choose another engine)."""
    table = table.assign(other_engine=False)
    for _, col in table.groupby(["dataset", "setting"], sort=False):
        engines = col["client_engine"]
        known = engines[engines != ""]  # runs from before run.json recorded the engine
        common = known.mode().iloc[0] if len(known) else ""
        table.loc[col.index, "other_engine"] = (engines != "") & (engines != common)
    return table


def _paper_reference(paper: dict[str, Any], paper_results: str | Path | None) -> pd.DataFrame:
    """The rows of the paper results file for the linked paper table."""
    if not paper_results or not Path(paper_results).is_file():
        raise FedForgetError(
            f"the experiment links paper '{paper['name']}' table {paper['table']!r}, but the paper results "
            f"file {str(paper_results)!r} does not exist"
        )
    ref = pd.read_csv(paper_results)
    return ref[(ref["paper"] == paper["name"]) & (ref["table"].astype(str).isin(paper_tables(paper)))]


def _paper_number(
    ref: pd.DataFrame, paper: dict[str, Any], row: pd.Series, metrics: Iterable[str], scored: str | None = None
) -> tuple[float, float]:
    """(value, std) of the reference row for ``row``'s dataset / setting / method (the paper
    link's dataset_map, setting_map and method_map applied, the dataset_map entry whose
    ``scored`` is ``scored``: ``paper_tables.paper_columns``; methods case-insensitive) whose
    metric is one of ``metrics``; NaN, NaN when none. Where several linked tables print the
    cell (FedProTIP Tables 1 and 17), the first of the link's ``table`` list that does [D]:
    paper.csv shows each."""
    cols = [(d, s) for d, s, by in paper_columns(paper, str(row["dataset"]), str(row["setting"])) if by == scored]
    if not cols:
        return math.nan, math.nan
    dataset, setting = cols[0]
    hit = ref[
        (ref["metric"].isin(list(metrics)))
        & (ref["dataset"] == dataset)
        & (ref["setting"] == setting)
        & (ref["method"].str.lower() == str(paper.get("method_map", {}).get(row["method"], row["method"])).lower())
    ]
    if not len(hit):
        return math.nan, math.nan
    order = {t: i for i, t in enumerate(paper_tables(paper))}
    hit = hit.iloc[hit["table"].astype(str).map(order).argsort(kind="stable")]
    # a '-' cell or a std the paper writes as 'failed' (FedSOL Table 2) is no number: NaN
    return _number(hit["value"].iloc[0]), _number(hit["std"].iloc[0])


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def attach_paper(
    table: pd.DataFrame, paper: dict[str, Any] | None, paper_results: str | Path | None
) -> pd.DataFrame:
    """Add the paper's reported accuracy (and std) for matching dataset/setting/method rows."""
    table = table.assign(paper_acc=math.nan, paper_std=math.nan)
    if not paper:
        return table
    ref = _paper_reference(paper, paper_results)
    for i, row in table.iterrows():
        value, std = _paper_number(ref, paper, row, ["accuracy", "acc_T", "ACC"])
        if not math.isnan(value):
            table.loc[i, "paper_acc"] = value
            table.loc[i, "paper_std"] = std
    return table


def _cell(mean: float, std: float, status: str, n_ok: int | None = None) -> str:
    """'80.00 ± 10.00' over >= 2 completed seeds, '91.23 (n = 1)' over one (no std),
    'failed' when no seed completed; ' (failed seeds)' marks a group with some failed."""
    if math.isnan(mean):
        return status if status in MARKS else ""
    if n_ok is None:  # infer: the std of one seed is NaN
        n_ok = 1 if math.isnan(std) else 2
    mark = MARKS.get(status)
    if n_ok == 1:
        return f"{mean:.2f} (n = 1, {mark})" if mark else f"{mean:.2f} (n = 1)"
    text = f"{mean:.2f} ± {std:.2f}"
    return f"{text} ({mark})" if mark else text


def _row_cell(r: pd.Series, metric: str) -> str:
    """A table row's cell for ``metric`` (final | best), marked when it ran on another engine;
    a task stream's best round: '' (continual.md holds its ACC, forgetting and transfer)."""
    if metric == "best" and _stream(r):
        return ""
    cell = _cell(r[f"{metric}_acc_mean"], r[f"{metric}_acc_std"], r["status"], _n_ok(r)) + _collapse(r)
    return cell + (f" † {r['client_engine']}" if r["other_engine"] else "")


def _engine_note(table: pd.DataFrame) -> str:
    return (f" {ENGINE_NOTE}" if table["other_engine"].any() else "") + _method_notes(table)


def collapsed_round(metrics: pd.DataFrame, scenario: dict[str, Any] | None) -> float:
    """The first round (>= 1) whose global model gave COLLAPSE_SHARE of the current task's
    test rows one class, NaN if none (or where a task has a single class)."""
    if scenario and scenario.get("kind") == "split" and int(scenario.get("classes_per_task") or 2) < 2:
        return math.nan
    share = metrics[TOP_SHARE]
    hit = metrics.loc[(metrics["round"] >= 1) & (share >= COLLAPSE_SHARE), "round"]
    return float(hit.iloc[0]) if len(hit) else math.nan


def _collapse(r: pd.Series) -> str:
    """' (collapsed: k of n seeds)' for a cell with runs whose model collapsed."""
    k = int(r.get("n_collapsed", 0) or 0)
    return f" (collapsed: {k} of {int(r['n_seeds'])} seeds)" if k else ""


def method_note(method: dict[str, Any]) -> str:
    """Which paper-or-code variant of the method a run ran (``FedAvg.table_note`` of its
    recorded ``{name, params}``); '' for a method with no such switch, or one no longer
    registered. A run's run.json records it (``method_note``; this is for runs from before):
    only then are the methods, and torch, imported."""
    from .methods import METHODS

    if method.get("name") not in METHODS.names():
        return ""
    return METHODS.get(method["name"]).table_note(method.get("params") or {})


def _method_notes(table: pd.DataFrame) -> str:
    """' Method variants: LABEL: note; ...' for the rows whose method states one."""
    if "method_note" not in table:
        return ""
    notes = {m: n for m, n in zip(table["method"], table["method_note"].fillna("")) if n}
    return (" Method variants: " + "; ".join(f"{m}: {n}" for m, n in notes.items()) + ".") if notes else ""


def _n_ok(row: pd.Series) -> int:
    return int(row["n_seeds"]) - int(row["n_failed"]) - int(row.get("n_unfinished", 0) or 0)


def _columns(table: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(f"{d} {s}" for d, s in zip(table["dataset"], table["setting"])))


FOOTNOTE = (
    "std is the sample standard deviation (ddof = 1) over completed seeds; 'n = 1': a single "
    "completed seed (no std); 'failed seeds': some seeds diverged or failed; 'failed': every seed did."
)
STREAM_NOTE = (
    "Task streams: the final round's accuracy is over every task (ACC after the last task); their "
    "best round is not shown, as it comes before the later tasks exist (continual.md: ACC, "
    "forgetting, transfer)."
)
ENGINE_NOTE = (
    "'† engine': the cell's runs trained their clients on another client engine than the rest of "
    "its column (equal results up to float summation order; runs.csv, client_engine)."
)


def markdown(table: pd.DataFrame, experiment: str) -> str:
    cols = _columns(table)
    methods = list(dict.fromkeys(table["method"]))
    lines = [f"# {experiment}", ""]
    streams = "task_stream" in table and bool(table["task_stream"].any())
    metrics = [("final", "Final-round"), ("best", "Best-round")]
    if streams and bool(table["task_stream"].all()):
        metrics = metrics[:1]  # every row a task stream: no best round to show
    for metric, title in metrics:
        lines += [
            f"## {title} global-model accuracy on the full test set (%), mean ± std over seeds",
            "",
        ]
        lines += ["| method | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        for m in methods:
            cells = []
            for c in cols:
                r = table[(table["method"] == m) & (table["dataset"] + " " + table["setting"] == c)]
                if not len(r):
                    cells.append("")
                    continue
                r = r.iloc[0]
                cell = _row_cell(r, metric)
                if metric == "final" and not math.isnan(r["paper_acc"]):
                    cell += f" (paper {r['paper_acc']:.2f})"
                cells.append(cell)
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
    n = table["n_seeds"].max()
    lines.append(f"Seeds per cell: {n}. {FOOTNOTE}{_engine_note(table)}" + (f" {STREAM_NOTE}" if streams else ""))
    return "\n".join(lines) + "\n"


_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 1.5rem;
       color: #1e293b; background: #fff; }
h1 { font-size: 1.3rem; margin: 0 0 .3rem; }
p { font-size: .85rem; color: #475569; max-width: 60rem; }
table { border-collapse: collapse; font-size: .85rem; margin: .8rem 0; }
th, td { padding: .3rem .6rem; border-bottom: 1px solid #e2e8f0; text-align: left; }
thead th { background: #f1f5f9; border-bottom: 2px solid #94a3b8; vertical-align: bottom; }
td { white-space: nowrap; }
td:nth-child(n+5), td:nth-child(3), th:nth-child(n+5), th:nth-child(3) {
    text-align: right; font-variant-numeric: tabular-nums; }
tbody tr:hover { background: #f8fafc; }
.scroll { overflow-x: auto; max-width: 100%; }
"""


def _paper(row: pd.Series) -> str:
    acc, std = row.get("paper_acc", math.nan), row.get("paper_std", math.nan)
    if pd.isna(acc):
        return ""
    return f"{acc:.2f}" + ("" if pd.isna(std) else f" ± {std:.2f}")


def html_table(table: pd.DataFrame, experiment: str) -> str:
    """table.csv as a self-contained HTML page (inline CSS, no scripts): one row per dataset
    x partition x method, final- and best-round accuracy (%) as in table.md, seeds, failed
    seeds and the paper's number where the experiment links a paper table."""
    rows = []
    for _, r in table.iterrows():
        rows.append({
            "Dataset": r["dataset"],
            "Partition": r["setting"],
            "Clients": int(r["clients"]),
            "Method": r["method"],
            "Final round (%)": _row_cell(r, "final"),
            "Best round (%)": _row_cell(r, "best"),
            "Seeds": int(r["n_seeds"]),
            "Failed seeds": int(r["n_failed"]),
            "Paper (%)": _paper(r),
        })  # fmt: skip
    df = _drop_empty(pd.DataFrame(rows), ["Paper (%)", "Best round (%)"])
    intro = (
        "<p>Final-round and best-round global-model accuracy on the full test set (%), mean ± std "
        "over seeds, per dataset x partition x method.</p>\n"
    )
    streams = "task_stream" in table and bool(table["task_stream"].any())
    note = FOOTNOTE + _engine_note(table) + (f" {STREAM_NOTE}" if streams else "")
    return _html_page(experiment, "summary table", intro, df, note)


def _drop_empty(df: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """Without those of ``columns`` that no row fills (the paper columns of an experiment
    that links no paper)."""
    return df.drop(columns=[c for c in columns if len(df) and not df[c].astype(bool).any()])


def _html_page(experiment: str, what: str, intro: str, df: pd.DataFrame, note: str) -> str:
    body = df.to_html(index=False, border=0, escape=True, na_rep="", classes="summary")
    body = f'<div class="scroll">{body}</div>'  # a wide table scrolls inside its pane
    title = html.escape(experiment, quote=False)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{title}: {what}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        f"<h1>{title}</h1>\n{intro}"
        f"{body}\n<p>{html.escape(note, quote=False)}</p>\n</body>\n</html>\n"
    )


# ----------------------------------------------------------------------------- continual table

# the continual metrics' column names in words (continual.html), in continual.METRICS order
CONTINUAL_NAMES = {
    "acc": "ACC",
    "fgt": "Forgetting Fgt_T",
    "ft": "Forgetting FT",
    "bwt": "BWT",
    "fwt": "FWT",
}
CONTINUAL_TITLES = {
    "acc": "ACC: mean accuracy over all tasks after the last task",
    "fgt": "Forgetting Fgt_T (FedGP, after Chaudhry et al. 2018; lower is better)",
    "ft": "Forgetting FT (FedProTIP eq. 16; lower is better)",
    "bwt": "Backward transfer BWT (Lopez-Paz & Ranzato 2017)",
    "fwt": "Forward transfer FWT (Lopez-Paz & Ranzato 2017)",
}
# the paper results' metric names that stand for each continual metric (paper_results.csv,
# column metric), from the one paper-name -> runs.csv-column table of fedforget.paper_tables
PAPER_METRICS = {m: tuple(p for p, col in PAPER_COLUMNS.items() if col == m) for m in CONTINUAL_METRICS}
CONTINUAL_NOTE = (
    "a[t][i]: global-model accuracy on task i's test set at the last round of task t; b[i]: "
    "the initial model's; T tasks, numbered 1..T here (from 0 in accuracy_matrix.csv and tasks.csv). "
    "ACC = mean_i a[T][i]. Fgt_T = 1/(T-1) sum_{i<T} (max_{i<=j<=T} a[j][i] - a[T][i]) (FedGP's code; "
    "every term >= 0). FT = 1/T sum_{t<T} (max_{t<=i<T} a[i][t] - a[T][t]) (FedProTIP eq. 16: "
    "1/T over T-1 terms). BWT = 1/(T-1) sum_{i<T} (a[T][i] - a[i][i]). "
    "FWT = 1/(T-1) sum_{i>1} (a[i-1][i] - b[i]). One-task runs have none of these."
)


def summarise_continual(runs: pd.DataFrame) -> pd.DataFrame:
    """The continual runs' (tasks > 1) metrics in %: mean and sample std (ddof = 1) over the
    completed seeds that have the metric, per dataset x setting x method, with the
    scenario; the failed-run rule of ``summarise``."""
    cont = runs[runs["tasks"] > 1] if "tasks" in runs else runs.iloc[0:0]
    out = []
    for key, g in cont.groupby(GROUP, sort=False):
        ok = g[g["status"] == "completed"]
        row = dict(zip(GROUP, key))
        row.update(
            scenario="/".join(dict.fromkeys(g["scenario"].astype(str))),
            incremental="/".join(dict.fromkeys(g["incremental"].astype(str))),
            tasks=int(g["tasks"].iloc[0]),
            rounds_per_task=int(g["rounds_per_task"].iloc[0]),
            n_seeds=len(g),
            **_seed_counts(g["status"]),
        )
        for m in [*CONTINUAL_METRICS, *extra_metrics(runs), *([COMM] if COMM in runs else [])]:
            vals = ok[m].astype(float).dropna() * (1 if m == COMM else 100)
            row[f"{m}_mean"] = vals.mean() if len(vals) else math.nan
            row[f"{m}_std"] = vals.std(ddof=1) if len(vals) > 1 else math.nan
        row["status"] = _group_status(row)
        row.update(_group_marks(g))
        out.append(row)
    return mark_other_engines(_without_unfinished(pd.DataFrame(out))) if out else pd.DataFrame(out)


def _paper_metric_name(metric: str) -> str:
    """The paper results' metric name of ``acc_<mode>`` / ``ft_<mode>``: ACC_<mode> / FT_<mode>."""
    kind, mode = metric.split("_", 1)
    return f"{kind.upper()}_{mode}"


def attach_paper_continual(
    table: pd.DataFrame, paper: dict[str, Any] | None, paper_results: str | Path | None
) -> pd.DataFrame:
    """Add ``paper_<m>`` and ``paper_<m>_std`` for every continual metric m (acc, fgt, ft,
    bwt, fwt: ``CONTINUAL_METRICS``): the linked paper
    table's number of the metric names in PAPER_METRICS for the matching dataset / setting /
    method (as ``attach_paper`` matches), NaN where the paper reports none; and for each
    other inference mode's ``acc_<mode>`` / ``ft_<mode>``, the paper's ACC_<mode> / FT_<mode>;
    for a task-aware metric (``acc_task_aware``, ``fgt_task_aware``, ...) with none, the
    paper's number of the metric in the column a dataset_map entry ``scored: task_aware``
    maps the row to (FedGP's task-IL: ``paper_tables.SCORED``)."""
    # a method's other inference modes: acc_<mode> / ft_<mode> beside the paper's ACC_<mode> / FT_<mode>
    names_of = {m: [(names, None)] for m, names in PAPER_METRICS.items()}
    for m in _extra_columns(table):
        kind, mode = m.split("_", 1)
        names_of[m] = [((_paper_metric_name(m),), None)] + (
            [(PAPER_METRICS[kind], mode)] if mode == TASK_AWARE and PAPER_METRICS.get(kind) else []
        )
    table = table.assign(**{f"paper_{m}{s}": math.nan for m in names_of for s in ("", "_std")})
    if not paper:
        return table
    ref = _paper_reference(paper, paper_results)
    for i, row in table.iterrows():
        for m, alternatives in names_of.items():
            for names, scored in alternatives:
                value, std = _paper_number(ref, paper, row, names, scored)
                if not math.isnan(value):
                    break
            table.loc[i, f"paper_{m}"], table.loc[i, f"paper_{m}_std"] = value, std
    return table


def _continual_cell(r: pd.Series, metric: str) -> str:
    mean = r[f"{metric}_mean"]  # an empty cell (no such score) carries no collapse mark
    cell = _cell(mean, r[f"{metric}_std"], r["status"]) + ("" if math.isnan(mean) else _collapse(r))
    return cell + (f" † {r['client_engine']}" if r["other_engine"] else "")


def _paper_metric(r: pd.Series, metric: str) -> str:
    value, std = r.get(f"paper_{metric}", math.nan), r.get(f"paper_{metric}_std", math.nan)
    if pd.isna(value):
        return ""
    return f"{value:.2f}" + ("" if pd.isna(std) else f" ± {std:.2f}")


def _scenarios(table: pd.DataFrame) -> list[str]:
    """'digits iid: split, 3 tasks x 2 rounds, class-incremental' per column."""
    out = {}
    for _, r in table.iterrows():
        out.setdefault(
            f"{r['dataset']} {r['setting']}",
            f"{r['scenario']}, {r['tasks']} tasks x {r['rounds_per_task']} rounds, {r['incremental']}-incremental",
        )
    return [f"{k}: {v}" for k, v in out.items()]


def _mb_cell(r: pd.Series) -> str:
    """'mean ± std' of a continual row's MB per client and task ('' where none, no std for one seed)."""
    mean, std = r[f"{COMM}_mean"], r[f"{COMM}_std"]
    return "" if pd.isna(mean) else f"{mean:.4f}" + ("" if pd.isna(std) else f" ± {std:.4f}")


def _extra_columns(table: pd.DataFrame) -> list[str]:
    """continual.csv's metrics of the methods' other inference modes (``acc_<mode>``, ...)."""
    return [
        c[: -len("_mean")] for c in table.columns
        if c.endswith("_mean") and _is_extra(c[: -len("_mean")]) and c[: -len("_mean")] not in CONTINUAL_METRICS
    ]  # fmt: skip


def _extra_title(metric: str) -> str:
    """The title of an ``<m>_<mode>`` column: the task-aware scores' (task-IL scoring of the
    stream: FedGP's task-IL columns) or a method's other inference mode's."""
    kind, mode = metric.split("_", 1)
    if mode == TASK_AWARE:
        return f"{CONTINUAL_TITLES[kind]}, task-aware (the true task given: task-IL scoring of these runs)"
    return f"{kind} of the inference mode {mode} (the method's other scores, tasks.csv)"


def _extra_name(metric: str) -> str:
    """continual.html's column name of an ``<m>_<mode>`` column: 'Forgetting Fgt_T task-aware'."""
    kind, mode = metric.split("_", 1)
    return f"{CONTINUAL_NAMES[kind]} task-aware" if mode == TASK_AWARE else metric


def continual_markdown(table: pd.DataFrame, experiment: str) -> str:
    """continual.md: one table per metric (methods x dataset-setting columns), the paper's
    number beside ACC, forgetting and transfer where the experiment links a paper table."""
    cols = _columns(table)
    methods = list(dict.fromkeys(table["method"]))
    lines = [f"# {experiment}: continual metrics", "", "Scenarios: " + "; ".join(_scenarios(table)) + ".", ""]
    for m in [*CONTINUAL_METRICS, *_extra_columns(table)]:
        title = CONTINUAL_TITLES.get(m) or _extra_title(m)
        lines += [f"## {title} (%), mean ± std over seeds", ""]
        lines += ["| method | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        for method in methods:
            if m not in CONTINUAL_METRICS and table.loc[table["method"] == method, f"{m}_mean"].isna().all():
                continue  # a method without this inference mode
            cells = []
            for c in cols:
                r = table[(table["method"] == method) & (table["dataset"] + " " + table["setting"] == c)]
                if not len(r):
                    cells.append("")
                    continue
                r = r.iloc[0]
                paper = r.get(f"paper_{m}", math.nan)
                cells.append(_continual_cell(r, m) + ("" if pd.isna(paper) else f" (paper {paper:.2f})"))
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")
    if f"{COMM}_mean" in table:
        lines += ["## Communication per client and task (MB: one model upload and the method's task-end messages, mean over tasks), mean ± std over seeds", ""]
        lines += ["| method | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        for method in methods:
            mine = table[table["method"] == method]
            if mine[f"{COMM}_mean"].isna().all():
                continue
            cells = []
            for c in cols:
                r = mine[mine["dataset"] + " " + mine["setting"] == c]
                cells.append(_mb_cell(r.iloc[0]) if len(r) else "")
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append(f"Seeds per cell: {table['n_seeds'].max()}. {FOOTNOTE}{_engine_note(table)}")
    lines += ["", CONTINUAL_NOTE]
    return "\n".join(lines) + "\n"


def continual_html(table: pd.DataFrame, experiment: str) -> str:
    """continual.csv as a self-contained HTML page: one row per dataset x partition x
    method, the five metrics (%), seeds, failed seeds and the paper's ACC / forgetting
    where the experiment links a paper table."""
    rows, extras = [], _extra_columns(table)
    for _, r in table.iterrows():
        row = {"Dataset": r["dataset"], "Partition": r["setting"], "Clients": int(r["clients"]), "Method": r["method"]}
        row.update({f"{CONTINUAL_NAMES[m]} (%)": _continual_cell(r, m) for m in CONTINUAL_METRICS})
        row.update({f"{_extra_name(m)} (%)": _continual_cell(r, m) for m in extras})
        if f"{COMM}_mean" in table:
            row["MB per client and task"] = _mb_cell(r)
        row.update({"Seeds": int(r["n_seeds"]), "Failed seeds": int(r["n_failed"])})
        row.update({f"Paper {CONTINUAL_NAMES[m]} (%)": _paper_metric(r, m) for m in PAPER_METRICS})
        # the paper's numbers of the other scores (FedGP's task-IL, FedProTIP's task-aware ACC)
        row.update({f"Paper {_extra_name(m)} (%)": _paper_metric(r, m) for m in extras})
        rows.append(row)
    paper_cols = [f"Paper {CONTINUAL_NAMES[m]} (%)" for m in PAPER_METRICS] + [f"Paper {_extra_name(m)} (%)" for m in extras]
    df = _drop_empty(pd.DataFrame(rows), paper_cols)
    scenarios = "; ".join(html.escape(s, quote=False) for s in _scenarios(table))
    intro = (
        "<p>Continual metrics of the global model (%), mean ± std over seeds, per dataset x "
        f"partition x method. Scenarios: {scenarios}.</p>\n"
    )
    note = f"{FOOTNOTE}{_engine_note(table)} {CONTINUAL_NOTE}"
    return _html_page(experiment, "continual metrics", intro, df, note)


def aggregate(
    run_dirs: Iterable[str | Path],
    out_dir: str | Path,
    experiment: str,
    paper: dict[str, Any] | None = None,
    paper_results: str | Path | None = None,
) -> pd.DataFrame:
    out = Path(out_dir)
    runs, metrics, tasks, matrices = collect_all(run_dirs)
    table = attach_paper(summarise(runs), paper, paper_results)
    atomic_write_text(out / "runs.csv", runs.to_csv(index=False))
    atomic_write(out / "metrics.parquet", lambda tmp: metrics.to_parquet(tmp, index=False))
    atomic_write_text(out / "table.csv", table.to_csv(index=False))
    atomic_write_text(out / "table.md", markdown(table, experiment))
    atomic_write_text(out / "table.html", html_table(table, experiment))
    if tasks is None or matrices is None:
        for f in CONTINUAL_OUTPUTS:  # left by an earlier, continual version of the experiment
            (out / f).unlink(missing_ok=True)
        return table
    keys = [*GROUP, "seed"]
    matrices = matrices[keys + [c for c in matrices.columns if c not in keys]]
    ctable = attach_paper_continual(summarise_continual(runs), paper, paper_results)
    atomic_write(out / "tasks.parquet", lambda tmp: tasks.to_parquet(tmp, index=False))
    atomic_write_text(out / "accuracy_matrix.csv", matrices.to_csv(index=False))
    atomic_write_text(out / "continual.csv", ctable.to_csv(index=False))
    atomic_write_text(out / "continual.md", continual_markdown(ctable, experiment))
    atomic_write_text(out / "continual.html", continual_html(ctable, experiment))
    return table
