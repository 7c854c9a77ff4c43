"""Paper vs ours in the paper's layout (issue 17, item 5): for an experiment that links a paper
table (config ``paper: {name, table, dataset_map, setting_map, method_map}``), the linked
table(s) of the papers' numbers (``config/paper_results.csv``) beside ours, cell by cell:
the paper's value, our mean ± sample std (ddof = 1) over the completed seeds, and the
difference ours − paper.

Layout [D], one section per linked paper table, one grid per metric of that table:

* columns: the paper's (dataset, setting) columns that this experiment's datasets x settings
  map to (dataset_map, setting_map; a dataset_map value ``{dataset, setting}`` names both;
  a list of them maps one of ours to several paper columns, and an entry's ``scored:
  task_aware`` compares that column with the runs' task-aware metrics, ``SCORED``),
  in the paper's order, then our columns that map to no column of any linked table; the
  paper's other columns are listed below the grid (another experiment may run them);
* rows: the paper's methods that have a number in those columns or that one of ours maps to
  (method_map, compared case-insensitively), labelled as our config labels them (the paper's
  name beside it where it differs); a paper method none of ours maps to keeps its row, its
  cells "not run". Our methods that match no method of any linked table form a last section;
* metrics: the paper's, each beside the runs.csv column it stands for (``PAPER_METRICS``);
  a paper metric with no counterpart (FedProTIP's runtime in hours) is not compared, and the
  page says so.

Units [D]: the papers report percentages; ours are the fractions of runs.csv × 100, so every
``*_pct`` column of paper.csv is in %, and ``diff_pct_points = ours_mean_pct − paper_pct`` is
in percentage points (for the forgetting measures Fgt_T and FT lower is better: a positive
difference forgets more). The exception, paper.csv's ``unit`` "MB": the communication metrics
``MB_<part>_T<t>`` (FedProTIP Table 9: what one client sends in task t, part Model, Act, Base
or Ref) and ``MB_<part>`` (its mean over the tasks: Table 19's bases), compared with runs.csv's
``comm_<part>_mb_task_<t>`` / ``comm_<part>_mb`` as they are, in MB, the difference in MB.

Notes [D]: a paper results row may carry a ``note`` (config/paper_results.csv, optional column):
a remark on the paper's number itself (a cell that contradicts another table of the paper, a
cell printed once for several rows). The cell's paper number is then marked "(note n)" and
the note printed under the grids; paper.csv has it in ``paper_note``.

Written per experiment into its summary directory (``PAPER_OUTPUTS``) from the summary's
runs.csv, by ``fedforget paper-table`` (rule paper_table) or ``write_paper_tables``:
``paper.csv``, one row per cell (``CELL_COLUMNS``), ``paper.md`` and ``paper.html`` (the
report's page)."""

from __future__ import annotations

import html
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from .continual import ACC_AFTER_TASK, TASK_AWARE
from .utils import FedForgetError, atomic_write_text, paper_tables

PAPER_OUTPUTS = ("paper.csv", "paper.md", "paper.html")

# a paper metric -> the runs.csv column it is compared with (fractions there, % here); ACC_<mode>
# / FT_<mode> compare with acc_<mode> / ft_<mode>, a method's other inference modes
PAPER_METRICS = {
    "accuracy": "final_global_model_test_acc",  # [D] the final round's, as table.csv's paper column
    "acc_T": "acc",  # FedGP
    "ACC": "acc",  # FedProTIP
    "Fgt_T": "fgt",  # FedGP
    "FT": "ft",  # FedProTIP eq. 16
    "BWT": "bwt",  # FedGP App. A.7 (Table 16)
    "FWT": "fwt",  # FedGP App. A.7 (Table 16)
}
MODE_METRICS = ("ACC", "FT")
# a dataset_map entry's ``scored``: which of the runs' scores its paper column compares with.
# task_aware: the task-aware metrics (acc_task_aware, fgt_task_aware, ...; tasks.csv's
# ``task_aware``) of a stream scored without the task id. A task-IL run trains what the
# class-IL run trains, bit for bit (tests/methods/test_task_il.py), and scores what that
# run's task-aware column scores, so FedGP's task-IL columns are its class-IL runs scored
# with the task id [P fedgp.md Sec. 5: the task id given at inference; C Fed-A-GEM
# models/test.py scores one model both ways], not a second training run [D]
SCORED = (TASK_AWARE,)
# MB_<part>_T<t>: FedProTIP Table 9's parts -> the runs' (aggregate.comm_parts; FOT's sketch is
# the paper's activations, Act)
COMM_METRIC = re.compile(r"MB_(Model|Act|Base|Ref)(?:_T([1-9]\d*))?")  # no _T<t>: the mean over tasks
COMM_PARTS = {"Model": "model", "Act": "sketch", "Base": "bases", "Ref": "refs"}

# paper.csv's columns: the cell, the two numbers and their difference first, then where they come from
CELL_COLUMNS = [
    "method", "dataset", "setting", "metric", "paper_pct", "ours_mean_pct", "ours_std_pct", "n_seeds",
    "diff_pct_points", "status", "table", "paper_method", "our_dataset", "our_setting", "clients",
    "partition_seed", "our_column", "paper_std_pct", "n_failed", "n_not_finished", "paper_note", "unit",
]  # fmt: skip

# status words: "ok" when both numbers exist, else the reasons joined by "; "
NOT_RUN = "not run"  # no run of this method on this column in the experiment, or none finished
FAILED = "failed"  # every finished seed diverged or failed
FAILED_SEEDS = "failed seeds"  # a mean over the completed seeds; others diverged or failed
UNFINISHED_SEEDS = "unfinished seeds"  # a mean over the completed seeds; others still running
NOT_MEASURED = "not measured"  # the runs completed but do not have this metric
NOT_IN_PAPER = "not in paper"  # the paper results have no row for the cell
PAPER_DASH = "paper '-'"  # the paper's cell is '-' (or empty)
PAPER_FAILED = "failed in paper"  # the paper reports the run as failed (std 'failed')
DASHES = ("", "-", "–", "—")

NOTE = (
    "All numbers in %: the papers report percentages; ours are the fractions of runs.csv × 100. "
    "Per method: the paper's number (± its std where the paper gives one), ours (mean ± sample "
    "std, ddof = 1, over the completed seeds; 'n = 1': one completed seed, no std; the papers do not "
    "say which std they print, and the FedGP code's is np.std, ddof = 0, smaller by sqrt((n - 1) / n)) and "
    "Δ = ours − paper in percentage points. 'accuracy': the final-round global-model accuracy on "
    "the full test set; ACC / acc_T: mean accuracy over all tasks after the last task; Acc_t: "
    "mean accuracy over the first t tasks after task t; Fgt_T / "
    "FT: forgetting (lower is better, so a positive Δ forgets more); BWT / FWT: backward and "
    "forward transfer (FedGP App. A.7; higher is better). 'not run': the experiment "
    "has no finished run of that method on that column (another experiment may have it); "
    "'failed': every seed diverged or failed; 'failed seeds' / 'unfinished seeds': the mean is "
    "over the completed seeds only; 'not measured': our runs do not compute that metric; "
    "'not in paper': the paper has no number there; '-': the paper's cell is '-'; '(note n)': "
    "a remark on the paper's number, below the tables. MB_<part>_T<t> (communication, FedProTIP "
    "Table 9: what one client sends in task t): in MB, Δ in MB. TIP_T<t> (FedProTIP Table 14): "
    "the task-identity accuracy after task t over the tasks seen, per-batch routing."
)


def paper_metric_column(metric: str) -> str | None:
    """The runs.csv column a paper metric is compared with, or None (not compared); Acc_<t>
    (FedGP Fig. 5: Acc_t, the mean accuracy over the first t tasks after task t) compares
    with avg_acc_after_task_<t>; TIP_T<t> (FedProTIP Table 14: the share of test batches of
    the tasks seen that TIP routes to their own task, after task t, as the authors' code
    counts it) with that mean of the per-batch routing, avg_acc_after_task_<t>_task_id_batch."""
    if metric in PAPER_METRICS:
        return PAPER_METRICS[metric]
    if re.fullmatch(r"Acc_[1-9]\d*", metric):
        return f"{ACC_AFTER_TASK}{metric[4:]}"
    comm = COMM_METRIC.fullmatch(metric)
    if comm:
        part = f"comm_{COMM_PARTS[comm.group(1)]}_mb"
        return f"{part}_task_{comm.group(2)}" if comm.group(2) else part
    tip = re.fullmatch(r"TIP_T([1-9]\d*)", metric)
    if tip:  # FedProTIP Table 14 [C: one task prediction per test batch, over the tasks seen]
        return f"{ACC_AFTER_TASK}{tip.group(1)}_task_id_batch"
    kind, _, mode = metric.partition("_")
    return f"{kind.lower()}_{mode}" if kind in MODE_METRICS and mode else None


def metric_unit(metric: str) -> str:
    """'MB' for the communication metrics (``COMM_METRIC``), '%' for every other."""
    return "MB" if COMM_METRIC.fullmatch(metric) else "%"


def paper_columns(paper: dict[str, Any], dataset: str, setting: str) -> list[tuple[str, str, str | None]]:
    """The paper's (dataset, setting, scored) columns of our dataset label and partition
    setting, through the link's setting_map and dataset_map (a dataset_map value names the
    paper's dataset, or {dataset, setting, scored}, or a list of those); ``scored`` None: the
    runs' own metrics, else which of their scores (``SCORED``); as ``aggregate.attach_paper``
    matches them."""
    d = (paper.get("dataset_map") or {}).get(dataset, dataset)
    s = (paper.get("setting_map") or {}).get(setting, setting)
    out = []
    for v in d if isinstance(d, list) else [d]:
        if isinstance(v, dict):
            out.append((str(v["dataset"]), str(v.get("setting", s)), v.get("scored")))
        else:
            out.append((str(v), str(s), None))
    return out


def scored_column(column: str | None, scored: str | None) -> str | None:
    """The runs.csv column of a paper metric's ``column`` under a dataset_map entry's
    ``scored``: acc -> acc_task_aware, avg_acc_after_task_<t> -> avg_acc_after_task_<t>_task_aware
    (``aggregate``'s names of the task-aware metrics)."""
    return column if column is None or scored is None else f"{column}_{scored}"


def paper_method(paper: dict[str, Any], label: str) -> str:
    """The paper's name of our method label (method_map; itself when unmapped)."""
    return str((paper.get("method_map") or {}).get(label, label))


def _number(text: Any) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def read_paper_results(paper: dict[str, Any], path: str | Path | None) -> pd.DataFrame:
    """The paper results rows of the linked paper table(s), as text (a '-' cell stays '-')."""
    if not path or not Path(path).is_file():
        raise FedForgetError(
            f"the experiment links paper '{paper['name']}' table {paper['table']!r}, but the paper results "
            f"file {str(path)!r} does not exist (top-level key paper_results)"
        )
    ref = pd.read_csv(path, dtype=str, keep_default_na=False)
    need = ["paper", "table", "dataset", "setting", "method", "metric", "value", "std"]
    missing = [c for c in need if c not in ref.columns]
    if missing:
        raise FedForgetError(
            f"{path}: no column(s) {missing}; a paper results file has the columns {need}"
        )
    ref = ref[(ref["paper"] == paper["name"]) & ref["table"].isin(paper_tables(paper))]
    if "note" not in ref.columns:  # optional: a remark on the paper's number
        ref = ref.assign(note="")
    return ref.reset_index(drop=True)


@dataclass(frozen=True)
class OurColumn:
    """One of our dataset x partition columns and a paper column it maps to (with the scores
    it compares with: ``scored``, None for the runs' own)."""

    dataset: str
    setting: str
    clients: int
    partition_seed: int
    paper: tuple[str, str]
    scored: str | None = None

    def setting_label(self, several: bool) -> str:
        """The setting, with clients and partition seed where two columns share it, and the
        scores compared where not the runs' own ('scored task-aware')."""
        return (
            self.setting
            + (f", {self.clients} clients, partition seed {self.partition_seed}" if several else "")
            + (f", scored {self.scored.replace('_', '-')}" if self.scored else "")
        )


def _our_columns(runs: pd.DataFrame, paper: dict[str, Any]) -> list[OurColumn]:
    keys = dict.fromkeys(
        zip(runs["dataset"], runs["setting"], runs["clients"], runs["partition_seed"])
    )
    return [
        OurColumn(str(d), str(s), int(k), int(p), (pd_, ps), scored)
        for d, s, k, p in keys
        for pd_, ps, scored in paper_columns(paper, str(d), str(s))
    ]


def our_cell(runs: pd.DataFrame | None, column: str | None, scale: float = 100) -> dict[str, Any]:
    """Mean and sample std (ddof = 1) of ``column`` × ``scale`` (fractions to %; 1 for MB)
    over the completed seeds of one method x column's runs (runs.csv rows; None: none in the
    experiment), with the seed counts and our side of the status."""
    out: dict[str, Any] = {"ours_mean_pct": math.nan, "ours_std_pct": math.nan, "n_seeds": 0,
                           "n_failed": 0, "n_not_finished": 0, "ours": NOT_RUN}  # fmt: skip
    if runs is None or not len(runs):
        return out
    status = runs["status"].astype(str)
    done = runs[status == "completed"]
    out["n_not_finished"] = int((status == "running").sum())
    out["n_failed"] = len(runs) - len(done) - out["n_not_finished"]
    if not len(done):
        out["ours"] = FAILED if out["n_failed"] else NOT_RUN
        return out
    vals = done[column].astype(float).dropna() * scale if column in done else pd.Series(dtype=float)
    if not len(vals):
        out["ours"] = NOT_MEASURED
        return out
    out.update(ours_mean_pct=float(vals.mean()), n_seeds=len(vals))
    out["ours_std_pct"] = float(vals.std(ddof=1)) if len(vals) > 1 else math.nan
    why = [
        w
        for w, n in ((FAILED_SEEDS, out["n_failed"]), (UNFINISHED_SEEDS, out["n_not_finished"]))
        if n
    ]
    out["ours"] = "; ".join(why) or "ok"
    return out


def _paper_cell(
    ref: pd.DataFrame, method: str | None, col: tuple[str, str], metric: str
) -> dict[str, Any]:
    """The paper's value and std (%) of one cell, its note, and the paper's side of the status."""
    hit = pd.DataFrame()
    if method is not None:
        hit = ref[(ref["dataset"] == col[0]) & (ref["setting"] == col[1]) & (ref["metric"] == metric)
                  & (ref["method"].str.lower() == method.lower())]  # fmt: skip
    none = {"paper_pct": math.nan, "paper_std_pct": math.nan, "paper_note": ""}
    if not len(hit):
        return {**none, "paper": NOT_IN_PAPER}
    value, std = hit["value"].iloc[0].strip(), hit["std"].iloc[0].strip()
    note = str(hit["note"].iloc[0]).strip() if "note" in hit else ""
    if value in DASHES:
        return {**none, "paper_note": note, "paper": PAPER_DASH}
    return {"paper_pct": _number(value), "paper_std_pct": _number(std), "paper_note": note,
            "paper": PAPER_FAILED if std.lower() == "failed" else "ok"}  # fmt: skip


def compare(
    runs: pd.DataFrame, paper: dict[str, Any], ref: pd.DataFrame
) -> tuple[pd.DataFrame, list[str]]:
    """(cells, notes): every cell of the linked table(s) in this experiment's columns (paper.csv,
    ``CELL_COLUMNS``, in layout order: table, method, column, metric), and the notes the
    pages print under the grids (the paper's columns not mapped, metrics not compared)."""
    notes = []
    runs = runs.astype({"method": str, "dataset": str, "setting": str})
    ref = ref.assign(our_column=ref["metric"].map(paper_metric_column))
    skipped = list(dict.fromkeys(ref.loc[ref["our_column"].isna(), "metric"]))
    if skipped:
        notes.append(f"Not compared (no counterpart in our runs): {', '.join(skipped)}.")
    ref = ref[ref["our_column"].notna()]
    cols = _our_columns(runs, paper)
    several = len({(c.dataset, c.setting) for c in cols}) < len(
        {(c.dataset, c.setting, c.clients, c.partition_seed) for c in cols}
    )
    linked_cols = set(zip(ref["dataset"], ref["setting"]))
    extra = [c for c in cols if c.paper not in linked_cols]  # ours without a paper column
    labels = list(dict.fromkeys(runs["method"]))
    linked_methods = set(ref["method"].str.lower())
    groups = {
        k: g
        for k, g in runs.groupby(
            ["method", "dataset", "setting", "clients", "partition_seed"], sort=False
        )
    }

    def cells(
        table: str,
        rows: list[tuple[str | None, str | None]],
        grid: list[OurColumn],
        metrics: list[str],
        tref: pd.DataFrame,
    ):
        for label, pm in rows:
            for c in grid:
                g = (
                    groups.get((label, c.dataset, c.setting, c.clients, c.partition_seed))
                    if label
                    else None
                )
                for metric in metrics:
                    column, unit = scored_column(paper_metric_column(metric), c.scored), metric_unit(metric)
                    ours = our_cell(g, column, 1 if unit == "MB" else 100)
                    theirs = _paper_cell(tref, pm, c.paper, metric)
                    diff = ours["ours_mean_pct"] - theirs["paper_pct"]
                    why = [w for w in (ours.pop("ours"), theirs.pop("paper")) if w != "ok"]
                    yield {
                        "method": label if label is not None else pm, "dataset": c.paper[0], "setting": c.paper[1],
                        "metric": metric, **theirs, **ours, "diff_pct_points": diff, "status": "; ".join(why) or "ok",
                        "table": table, "paper_method": pm or "", "our_dataset": c.dataset, "our_setting": c.setting_label(several),
                        "clients": c.clients, "partition_seed": c.partition_seed, "our_column": column, "unit": unit,
                    }  # fmt: skip

    out: list[dict[str, Any]] = []
    for table in paper_tables(paper):
        tref = ref[ref["table"] == table]
        if not len(tref):
            continue
        pcols = list(dict.fromkeys(zip(tref["dataset"], tref["setting"])))
        grid = [c for pc in pcols for c in cols if c.paper == pc] + extra
        unmapped = [f"{d} {s}" for d, s in pcols if all(c.paper != (d, s) for c in cols)]
        if unmapped:
            notes.append(f"{paper['name']} table {table}: columns of the paper that no dataset x partition of this "
                         f"experiment maps to (dataset_map, setting_map): {'; '.join(unmapped)}.")  # fmt: skip
        shown = {c.paper for c in grid}
        rows: list[tuple[str | None, str | None]] = []
        for pm in dict.fromkeys(tref["method"]):
            ours = [m for m in labels if paper_method(paper, m).lower() == pm.lower()]
            mine = tref[tref["method"] == pm]
            in_grid = any(pc in shown for pc in zip(mine["dataset"], mine["setting"]))
            if ours or in_grid:
                rows += [(m, pm) for m in ours] or [(None, pm)]
        out += cells(table, rows, grid, list(dict.fromkeys(tref["metric"])), tref)
    alone = [m for m in labels if paper_method(paper, m).lower() not in linked_methods]
    if alone:
        out += cells(
            "", [(m, None) for m in alone], cols, list(dict.fromkeys(ref["metric"])), ref.iloc[0:0]
        )
    return pd.DataFrame(out, columns=CELL_COLUMNS), notes


# ----------------------------------------------------------------------------- rendering


def _num(v: float, std: float = math.nan, digits: int = 2) -> str:
    return f"{v:.{digits}f}" + ("" if math.isnan(std) else f" ± {std:.{digits}f}")


def _digits(r: pd.Series) -> int:
    """Decimals of a cell: 2 for %, 3 for MB (Table 9 prints 46.686 MB)."""
    return 3 if r.get("unit") == "MB" else 2


def note_numbers(cells: pd.DataFrame) -> dict[str, int]:
    """{note: its number on the page}: the paper notes of ``cells`` in order, from 1."""
    notes = cells["paper_note"].fillna("").astype(str) if "paper_note" in cells else []
    return {n: i for i, n in enumerate(dict.fromkeys(n for n in notes if n.strip()), start=1)}


def paper_text(r: pd.Series, numbers: dict[str, int] | None = None) -> str:
    note = str(r.get("paper_note", "") or "")
    mark = f" (note {numbers[note]})" if numbers and note in numbers else ""
    if pd.isna(r["paper_pct"]):
        return ("-" if PAPER_DASH in r["status"] else NOT_IN_PAPER) + mark
    return (
        _num(r["paper_pct"], r["paper_std_pct"], _digits(r))
        + (" (failed)" if PAPER_FAILED in r["status"] else "")
        + mark
    )


def ours_text(r: pd.Series) -> str:
    if pd.isna(r["ours_mean_pct"]):
        return next(w for w in (FAILED, NOT_MEASURED, NOT_RUN) if w in r["status"].split("; "))
    text = (
        _num(r["ours_mean_pct"], r["ours_std_pct"], _digits(r))
        if r["n_seeds"] > 1
        else f"{r['ours_mean_pct']:.{_digits(r)}f} (n = 1)"
    )
    why = [w for w in (FAILED_SEEDS, UNFINISHED_SEEDS) if w in r["status"].split("; ")]
    return text + (f" ({', '.join(why)})" if why else "")


def diff_text(r: pd.Series) -> str:
    return "" if pd.isna(r["diff_pct_points"]) else f"{r['diff_pct_points']:+.{_digits(r)}f}"


def _grids(cells: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(title, grid) per table x metric: rows per method (paper, ours, Δ; ours only in the
    section of methods the paper's tables do not have), a column per paper column; a paper
    number with a note is marked with the note's number (``note_numbers``)."""
    numbers = note_numbers(cells)

    def paper_cell(r: pd.Series) -> str:
        return paper_text(r, numbers)

    out = []
    for table in dict.fromkeys(cells["table"]):
        sec = cells[cells["table"] == table]
        for metric in dict.fromkeys(sec["metric"]):
            g = sec[sec["metric"] == metric]
            keys = list(
                dict.fromkeys(zip(g["dataset"], g["setting"], g["our_dataset"], g["our_setting"]))
            )
            heads = [_column_head(k, table) for k in keys]
            rows = []
            for method, pm in dict.fromkeys(zip(g["method"], g["paper_method"])):
                mine = g[(g["method"] == method) & (g["paper_method"] == pm)]
                by = {
                    (r["dataset"], r["setting"], r["our_dataset"], r["our_setting"]): r
                    for _, r in mine.iterrows()
                }
                name = (
                    method if not pm or pm.lower() == method.lower() else f"{method} (paper: {pm})"
                )
                kinds = (
                    (("paper", paper_cell), ("ours", ours_text), ("Δ", diff_text))
                    if table
                    else (("ours", ours_text),)
                )
                lines = [
                    [kind] + [fmt(by[k]) if k in by else "" for k in keys] for kind, fmt in kinds
                ]
                lines = [
                    line for line in lines if line[0] != "Δ" or any(line[1:])
                ]  # no Δ row without a Δ
                rows += [[name if i == 0 else "", *line] for i, line in enumerate(lines)]
            frame = pd.DataFrame(rows, columns=["method", "", *heads])
            paper_name = "not in the paper's table(s)" if not table else f"table {table}"
            out.append((f"{paper_name}: {metric} ({metric_unit(metric)})", frame))
    return out


def _column_head(key: tuple[str, str, str, str], table: str) -> str:
    """'split-cifar10 class-il (ours: digits-class-il dirichlet-0.5)': the paper's column and,
    where they differ, our dataset and setting it stands for."""
    dataset, setting, ours_d, ours_s = key
    if not table:
        return f"{ours_d} {ours_s}"
    ours = " ".join(o for o, t in ((ours_d, dataset), (ours_s, setting)) if o != t)
    return f"{dataset} {setting}" + (f" (ours: {ours})" if ours else "")


def note_lines(cells: pd.DataFrame, paper: dict[str, Any]) -> list[str]:
    """'Note n (fedprotip table 11, domainnet-6 dirichlet-0.5, FedProTIP eps=0.7, ACC): ...'
    per note of the page, where it first appears."""
    out = []
    for note, n in note_numbers(cells).items():
        r = cells[cells["paper_note"].fillna("").astype(str) == note].iloc[0]
        method = r["paper_method"] or r["method"]
        where = f"{paper['name']} table {r['table']}, {r['dataset']} {r['setting']}, {method}, {r['metric']}"
        more = int((cells["paper_note"].fillna("").astype(str) == note).sum()) - 1
        if more:
            where += f" and {more} more cell{'s' if more > 1 else ''}"
        out.append(f"Note {n} ({where}): {note}")
    return out


def _title(experiment: str, paper: dict[str, Any]) -> str:
    tables = paper_tables(paper)
    return f"{experiment}: paper vs ours ({paper['name']} table{'s' if len(tables) > 1 else ''} {', '.join(tables)})"


def paper_markdown(
    cells: pd.DataFrame, notes: list[str], experiment: str, paper: dict[str, Any]
) -> str:
    lines = [f"# {_title(experiment, paper)}", ""]
    if not len(cells):
        lines += ["No cell of the linked table(s) in this experiment's columns.", ""]
    for title, g in _grids(cells):
        lines += [f"## {paper['name']} {title}", ""]
        esc = [str(c).replace("|", "\\|") for c in g.columns]
        lines += ["| " + " | ".join(esc) + " |", "|---" * len(esc) + "|"]
        lines += [
            "| " + " | ".join(str(v).replace("|", "\\|") for v in row) + " |"
            for row in g.itertuples(index=False)
        ]
        lines.append("")
    remarks = note_lines(cells, paper)
    if remarks:
        lines += ["Notes on the paper's numbers:", "", *(f"- {n}" for n in remarks), ""]
    lines += [*notes, "", NOTE] if notes else [NOTE]
    return "\n".join(lines) + "\n"


_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 1.5rem;
       color: #1e293b; background: #fff; }
h1 { font-size: 1.3rem; margin: 0 0 .3rem; } h2 { font-size: 1.05rem; margin: 1.2rem 0 .2rem; }
p { font-size: .85rem; color: #475569; max-width: 60rem; }
table { border-collapse: collapse; font-size: .85rem; margin: .5rem 0; }
th, td { padding: .25rem .6rem; text-align: left; }
thead th { background: #f1f5f9; border-bottom: 2px solid #94a3b8; vertical-align: bottom; }
td { white-space: nowrap; }
td:nth-child(n+3) { text-align: right; font-variant-numeric: tabular-nums; }
td:nth-child(2) { color: #64748b; }
"""


def paper_html(
    cells: pd.DataFrame, notes: list[str], experiment: str, paper: dict[str, Any]
) -> str:
    """paper.md as a self-contained HTML page (inline CSS, no scripts) for the report."""
    title = html.escape(_title(experiment, paper), quote=False)
    body = []
    for name, g in _grids(cells):
        body.append(f"<h2>{html.escape(paper['name'] + ' ' + name, quote=False)}</h2>")
        body.append(g.to_html(index=False, border=0, escape=True, classes="paper"))
    if not len(cells):
        body.append("<p>No cell of the linked table(s) in this experiment's columns.</p>")
    remarks = note_lines(cells, paper)
    if remarks:
        body.append("<p>Notes on the paper's numbers:</p>\n<ul>")
        body += [f"<li>{html.escape(n, quote=False)}</li>" for n in remarks]
        body.append("</ul>")
    body += [f"<p>{html.escape(n, quote=False)}</p>" for n in [*notes, NOTE]]
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{title}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n<h1>{title}</h1>\n"
        + "\n".join(body) + "\n</body>\n</html>\n"
    )  # fmt: skip


def write_paper_tables(
    summary_dir: str | Path,
    experiment: str,
    paper: dict[str, Any] | None,
    paper_results: str | Path | None,
) -> list[Path]:
    """paper.csv, paper.md and paper.html of an experiment from its summary's runs.csv
    (``fedforget aggregate``'s) and the paper results file."""
    if not paper:
        raise FedForgetError(
            f"experiment '{experiment}' links no paper table (config key paper); nothing to compare"
        )
    out = Path(summary_dir)
    path = out / "runs.csv"
    if not path.is_file():
        raise FedForgetError(
            f"{path} does not exist: aggregate the experiment first (fedforget aggregate, or snakemake)"
        )
    runs = pd.read_csv(path)
    cells, notes = compare(runs, paper, read_paper_results(paper, paper_results))
    files = [out / f for f in PAPER_OUTPUTS]
    atomic_write_text(files[0], cells.to_csv(index=False))
    atomic_write_text(files[1], paper_markdown(cells, notes, experiment, paper))
    atomic_write_text(files[2], paper_html(cells, notes, experiment, paper))
    return files
