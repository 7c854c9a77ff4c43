"""Collect finished runs into tidy tables: per experiment ``runs.csv`` (one row per run),
``metrics.parquet`` (every round of every run, long format), ``table.csv`` (mean and std
over seeds of final and best global-model test accuracy per dataset x partition x method,
beside the papers' numbers where the experiment links a paper table), ``table.md`` and
``table.html`` (the same table, rendered for the Snakemake report)."""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from .partition import PartitionSpec
from .utils import FedForgetError, atomic_write, atomic_write_text

FAILED = "failed"


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
    runs, frames = [], []
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
            "run_dir": str(d),
        })  # fmt: skip
        if df is not None:
            frames.append(df.assign(**keys))
    if not runs:
        raise FedForgetError("no runs to aggregate")
    metrics = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return pd.DataFrame(runs), metrics


def summarise(runs: pd.DataFrame) -> pd.DataFrame:
    """Mean and sample std (ddof=1) over completed seeds; a group with any failed
    (diverged/failed) run is reported as failed, the way FedSOL's Table 2 writes '10.00
    (Failed)'. The std of a single completed seed is undefined: NaN, not 0."""
    group = ["experiment", "dataset", "setting", "clients", "partition_seed", "method"]
    out = []
    for key, g in runs.groupby(group, sort=False):
        ok = g[g["status"] == "completed"]
        row = dict(zip(group, key))
        row.update(n_seeds=len(g), n_failed=int((g["status"] != "completed").sum()))
        for m in ("final", "best"):
            vals = ok[f"{m}_global_model_test_acc"].astype(float) * 100
            row[f"{m}_acc_mean"] = vals.mean() if len(vals) else math.nan
            row[f"{m}_acc_std"] = vals.std(ddof=1) if len(vals) > 1 else math.nan
        row["status"] = FAILED if row["n_failed"] else "ok"
        row["client_engine"] = "/".join(sorted(set(g["client_engine"].dropna()))) if "client_engine" in g else ""
        out.append(row)
    return mark_other_engines(pd.DataFrame(out))


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


def attach_paper(
    table: pd.DataFrame, paper: dict[str, Any] | None, paper_results: str | Path | None
) -> pd.DataFrame:
    """Add the paper's reported accuracy (and std) for matching dataset/setting/method rows."""
    table = table.assign(paper_acc=math.nan, paper_std=math.nan)
    if not paper:
        return table
    if not paper_results or not Path(paper_results).is_file():
        raise FedForgetError(
            f"the experiment links paper '{paper['name']}' table {paper['table']!r}, but the paper results "
            f"file {str(paper_results)!r} does not exist"
        )
    ref = pd.read_csv(paper_results)
    ref = ref[
        (ref["paper"] == paper["name"])
        & (ref["table"].astype(str) == str(paper["table"]))
        & (ref["metric"].isin(["accuracy", "acc_T", "ACC"]))
    ]
    dmap = paper.get("dataset_map", {})
    smap = paper.get("setting_map", {})
    for i, row in table.iterrows():
        hit = ref[
            (ref["dataset"] == dmap.get(row["dataset"], row["dataset"]))
            & (ref["setting"] == smap.get(row["setting"], row["setting"]))
            & (ref["method"].str.lower() == str(row["method"]).lower())
        ]
        if len(hit):
            table.loc[i, "paper_acc"] = float(hit["value"].iloc[0])
            table.loc[i, "paper_std"] = (
                float(hit["std"].iloc[0]) if pd.notna(hit["std"].iloc[0]) else math.nan
            )
    return table


def _cell(mean: float, std: float, status: str, n_ok: int | None = None) -> str:
    """'80.00 ± 10.00' over >= 2 completed seeds, '91.23 (n = 1)' over one (no std),
    'failed' when no seed completed; ' (failed seeds)' marks a group with some failed."""
    if math.isnan(mean):
        return "failed" if status == FAILED else ""
    if n_ok is None:  # infer: the std of one seed is NaN
        n_ok = 1 if math.isnan(std) else 2
    if n_ok == 1:
        return f"{mean:.2f} (n = 1, failed seeds)" if status == FAILED else f"{mean:.2f} (n = 1)"
    text = f"{mean:.2f} ± {std:.2f}"
    return text + " (failed seeds)" if status == FAILED else text


def _row_cell(r: pd.Series, metric: str) -> str:
    """A table row's cell for ``metric`` (final | best), marked when it ran on another engine."""
    cell = _cell(r[f"{metric}_acc_mean"], r[f"{metric}_acc_std"], r["status"], _n_ok(r))
    return cell + (f" † {r['client_engine']}" if r["other_engine"] else "")


def _engine_note(table: pd.DataFrame) -> str:
    return f" {ENGINE_NOTE}" if table["other_engine"].any() else ""


def _n_ok(row: pd.Series) -> int:
    return int(row["n_seeds"]) - int(row["n_failed"])


def _columns(table: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(f"{d} {s}" for d, s in zip(table["dataset"], table["setting"])))


FOOTNOTE = (
    "std is the sample standard deviation (ddof = 1) over completed seeds; 'n = 1': a single "
    "completed seed (no std); 'failed seeds': some seeds diverged or failed; 'failed': every seed did."
)
ENGINE_NOTE = (
    "'† engine': the cell's runs trained their clients on another client engine than the rest of "
    "its column (equal results up to float summation order; runs.csv, client_engine)."
)


def markdown(table: pd.DataFrame, experiment: str) -> str:
    cols = _columns(table)
    methods = list(dict.fromkeys(table["method"]))
    lines = [f"# {experiment}", ""]
    for metric, title in (("final", "Final-round"), ("best", "Best-round")):
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
    lines.append(f"Seeds per cell: {n}. {FOOTNOTE}{_engine_note(table)}")
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
    df = pd.DataFrame(rows)
    if len(df) and not df["Paper (%)"].astype(bool).any():
        df = df.drop(columns="Paper (%)")
    body = df.to_html(index=False, border=0, escape=True, na_rep="", classes="summary")
    title = html.escape(experiment, quote=False)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{title}: summary table</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        f"<h1>{title}</h1>\n"
        "<p>Final-round and best-round global-model accuracy on the full test set (%), mean ± std "
        "over seeds, per dataset x partition x method.</p>\n"
        f"{body}\n<p>{html.escape(FOOTNOTE + _engine_note(table), quote=False)}</p>\n</body>\n</html>\n"
    )


def aggregate(
    run_dirs: Iterable[str | Path],
    out_dir: str | Path,
    experiment: str,
    paper: dict[str, Any] | None = None,
    paper_results: str | Path | None = None,
) -> pd.DataFrame:
    out = Path(out_dir)
    runs, metrics = collect(run_dirs)
    table = attach_paper(summarise(runs), paper, paper_results)
    atomic_write_text(out / "runs.csv", runs.to_csv(index=False))
    atomic_write(out / "metrics.parquet", lambda tmp: metrics.to_parquet(tmp, index=False))
    atomic_write_text(out / "table.csv", table.to_csv(index=False))
    atomic_write_text(out / "table.md", markdown(table, experiment))
    atomic_write_text(out / "table.html", html_table(table, experiment))
    return table
