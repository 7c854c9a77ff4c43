"""docs/coverage.md, generated: every numbered table and figure of the four papers, with the
config that reproduces it, what of it the config leaves out, how many of the paper's numbers
config/paper_results.csv holds, how many of those our runs can fill, and why each gap is there.

Sources, so the page cannot drift from them:

* config/paper_tables.yaml: the papers' items (every numbered table and figure), how many
  numbers each prints (``cells``: numeric cells; '-', '★' and derived Δ cells not counted),
  the columns of a transcribed table that no config runs (``left_out``, with the reason) and
  a reason for every other gap (``reason``); hand-written, counted from the papers;
* config/paper_results.csv: the transcribed numbers (a row per cell);
* the configs under config/experiments/: a paper config covers the items its file name names
  (``fedgp_table1_table11.yaml``: Tables 1 and 11), any config the tables its experiments'
  ``paper:`` links name; a paper-scale config (config/experiments/paper/) is what "ours can
  fill" counts: a transcribed cell whose (dataset, setting) column, method and metric one of
  its runs produces (the column and method through the link's dataset_map / setting_map /
  method_map, as ``fedforget.paper_tables`` compares them; the metric a runs.csv column the
  method computes).

``python benchmarks/render_docs.py`` rewrites the page with the docs' numbers, ``--check``
reports it stale; tests/test_coverage.py fails when it is.
"""

from __future__ import annotations

import csv
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedforget.continual import ACC_AFTER_TASK, TASK_AWARE
from fedforget.paper_tables import paper_columns, paper_method, paper_metric_column, scored_column
from fedforget.parse import load_config
from fedforget.utils import paper_tables

ROOT = Path(__file__).resolve().parents[1]
TABLES = Path("config/paper_tables.yaml")
RESULTS = Path("config/paper_results.csv")
EXPERIMENTS = Path("config/experiments")
PAPER_DIR = EXPERIMENTS / "paper"
PAGE = Path("docs/coverage.md")
DASHES = ("", "-", "–", "—")

# a method's other inference modes (``eval_counts``: the tasks.csv columns that become
# runs.csv's acc_<mode> / ft_<mode>) that a paper metric ACC_<mode> / FT_<mode> can name;
# tests/methods/test_fedprotip.py checks FedProTIP's. Every method's continual runs also
# have the evaluator's task-aware accuracy (``continual.TASK_AWARE``)
EVAL_MODES = {
    "fedprotip": (
        "agnostic",
        "tip_sample",
        "tip_batch",
        "task_id_sample",
        "task_id_batch",
    )
}


# the communication parts a method's task-end metrics report (<method>_comm_<part>_mb: runs.csv's
# comm_<part>_mb_task_<t>, fedforget.aggregate.comm_parts); tests/test_coverage.py checks them
# against the entries methods/fot.py and methods/fedprotip.py write
COMM_PARTS = {"fot": ("model", "sketch"), "fedprotip": ("model", "bases", "refs")}


def item_key(table: str) -> str:
    """The paper_tables.yaml key of a paper_results.csv table: '3b' -> 'table3b', 'fig1' -> 'fig1'."""
    return table if table.startswith("fig") else f"table{table}"


def item_table(key: str) -> str:
    """paper_results.csv's table of an item key: 'table3b' -> '3b', 'fig1' -> 'fig1'."""
    return key.removeprefix("table")


def file_items(path: Path) -> set[tuple[str, str]]:
    """(paper, item) pairs a paper config's file name covers: fedgp_table1_table11 -> table1, table11."""
    paper, *items = path.stem.split("_")
    return {(paper, i) for i in items}


@contextmanager
def _cwd(path: Path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


@dataclass
class Run:
    """What one experiment's method runs on one column, as its paper link names them."""

    paper: str
    tables: frozenset[str]
    column: tuple[str, str]
    method: str  # the paper's name, lower case
    registered: str  # the method's registered name (fedforget methods)
    continual: bool
    scored: str | None = None  # the dataset_map entry's scores (paper_tables.SCORED), None: the runs' own


@dataclass
class Coverage:
    """Everything the page shows, read from the repository at ``root``."""

    items: dict[str, dict[str, Any]]  # paper -> its paper_tables.yaml entry
    rows: list[dict[str, str]]  # paper_results.csv
    configs: dict[tuple[str, str], list[Path]] = field(
        default_factory=dict
    )  # (paper, item) -> configs
    runs: list[Run] = field(default_factory=list)  # of the paper-scale configs


def load(root: Path = ROOT) -> Coverage:
    root = Path(root)
    items = yaml.safe_load((root / TABLES).read_text())
    with (root / RESULTS).open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    cov = Coverage(items, rows)
    paths = sorted((root / EXPERIMENTS).rglob("*.yaml"))
    with _cwd(root):  # the configs' paper_results path is relative to the repository
        for path in paths:
            rel = path.relative_to(root)
            scale_paper = rel.parent == PAPER_DIR
            linked = set(file_items(rel)) if scale_paper else set()
            wf = load_config(rel)
            for e in wf.experiments:
                if not e.paper:
                    continue
                tables = frozenset(paper_tables(e.paper))
                linked |= {(e.paper["name"], item_key(t)) for t in tables}
                if not scale_paper:
                    continue
                for d in e.datasets:
                    for p in e.partitions:
                        cov.runs += [
                            Run(e.paper["name"], tables, (pd_, ps), paper_method(e.paper, m.label).lower(), m.name,
                                d.scenario is not None, scored)
                            for pd_, ps, scored in paper_columns(e.paper, d.label, p.setting)
                            for m in e.methods
                        ]  # fmt: skip
            for key in linked:
                cov.configs.setdefault(key, []).append(rel)
    for paper, entry in items.items():
        for key, item in entry["items"].items():
            for extra in item.get("configs", []):
                cov.configs.setdefault((paper, key), []).append(Path(extra))
    return cov


def metric_computed(metric: str, registered: str, continual: bool, scored: str | None = None) -> bool:
    """Whether a run of method ``registered`` computes the runs.csv column a paper metric is
    compared with (``fedforget.paper_tables.paper_metric_column``; under a dataset_map
    entry's ``scored: task_aware``, the task-aware one: every continual metric and Acc_t)."""
    column = scored_column(paper_metric_column(metric), scored)  # acc_task_aware, fgt_task_aware, ...
    if column is None:
        return False
    if column == "final_global_model_test_acc":
        return True
    if column.startswith(ACC_AFTER_TASK):  # Acc_t (of an inference mode) after task t
        _, _, mode = column.removeprefix(ACC_AFTER_TASK).partition("_")
        return continual and (not mode or mode == TASK_AWARE or mode in EVAL_MODES.get(registered, ()))
    if column.startswith("comm_"):  # comm_<part>_mb_task_<t>: the parts the method reports
        return continual and column.split("_")[1] in COMM_PARTS.get(registered, ())
    kind, _, mode = column.partition("_")
    if not mode:  # acc, fgt, ft: the continual metrics
        return continual
    return continual and (mode == TASK_AWARE or mode in EVAL_MODES.get(registered, ()))


def numeric(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    return [r for r in rows if r["value"].strip() not in DASHES]


@dataclass
class ItemRow:
    paper: str
    key: str
    what: str
    configs: list[Path]
    missing: str
    transcribed: int
    cells: int
    fill: int | None  # None: no paper-scale config links the item
    reasons: list[str]
    results: bool


def item_rows(cov: Coverage) -> list[ItemRow]:
    out = []
    for paper, entry in cov.items.items():
        for key, item in entry["items"].items():
            table = item_table(key)
            mine = numeric([r for r in cov.rows if r["paper"] == paper and r["table"] == table])
            runs = [r for r in cov.runs if r.paper == paper and table in r.tables]
            fill = None
            missing = item.get("missing", "")
            if runs:
                fill = sum(
                    any(r.column == (c["dataset"], c["setting"]) and r.method == c["method"].lower()
                        and metric_computed(c["metric"], r.registered, r.continual, r.scored) for r in runs)
                    for c in mine
                )  # fmt: skip
                cols = dict.fromkeys((c["dataset"], c["setting"]) for c in mine)
                run_cols = {r.column for r in runs}
                gone = [f"{d} {s}" for d, s in cols if (d, s) not in run_cols]
                methods = dict.fromkeys(c["method"] for c in mine)
                run_methods = {r.method for r in runs if r.column in cols}
                absent = [m for m in methods if m.lower() not in run_methods]
                parts = ([f"columns: {'; '.join(gone)}"] if gone else []) + (
                    [f"methods: {', '.join(absent)}"] if absent else []
                )
                missing = ". ".join(parts + ([missing] if missing else []))
            reasons = [f"{col}: {why}" for col, why in (item.get("left_out") or {}).items()]
            if item.get("reason"):
                reasons.insert(0, item["reason"])
            out.append(ItemRow(
                paper, key, item["what"], cov.configs.get((paper, key), []), missing, len(mine),
                int(item.get("cells", 0)), fill, reasons, bool(item.get("results", True)),
            ))  # fmt: skip
    return out


def gaps(r: ItemRow) -> list[str]:
    """What the row lacks, in words (a row with any needs a reason)."""
    if not r.results:
        return ["no results"]
    out = []
    if not r.configs:
        out.append("no config")
    if r.transcribed < r.cells:
        out.append("not every cell transcribed")
    if r.fill is None and r.transcribed:
        out.append("no paper-scale link")
    if r.fill is not None and r.fill < r.transcribed:
        out.append("cells ours cannot fill")
    if r.missing:
        out.append("missing methods or columns")
    return out


def _name(key: str) -> str:
    m = re.fullmatch(r"(table|fig)(\d+)([a-z]?)", key)
    assert m, key
    return f"{'Table' if m[1] == 'table' else 'Figure'} {m[2]}{m[3]}"


def _configs(paths: list[Path]) -> str:
    if not paths:
        return "none"
    links = []
    for p in sorted(set(paths), key=lambda p: (p.parent != PAPER_DIR, str(p))):
        scale = "" if p.parent == PAPER_DIR else " (embedded scale)"
        links.append(f"[{p.name}](../{p.as_posix()}){scale}")
    return "<br>".join(links)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def markdown(root: Path = ROOT) -> str:
    cov = load(root)
    rows = item_rows(cov)
    lines = [
        "# Paper tables and figures: coverage",
        "",
        "Generated by `python benchmarks/render_docs.py` (`benchmarks/paper_coverage.py`) from",
        "`config/paper_tables.yaml` (every numbered table and figure of the papers, the numbers each",
        "prints, the reason for each gap), `config/paper_results.csv` (the papers' numbers) and the",
        "configs under `config/experiments/`; do not edit by hand. How to run a table:",
        "[paper_tables.md](paper_tables.md).",
        "",
        "- **config**: the paper-scale config that runs the item (`config/experiments/paper/`, named",
        "  after the items it covers or linking the table in an experiment's `paper:` block), or an",
        "  embedded-scale one that runs its layout on small data; none: nothing runs it.",
        "- **missing from the config**: the paper's columns (dataset and setting) and methods of a",
        "  transcribed table that no run of a paper-scale config produces.",
        "- **transcribed / in the paper**: the item's numbers in `config/paper_results.csv` / the",
        "  numbers the paper prints there (numeric cells: '-', '★' and the derived differences",
        "  the papers print beside a number are not counted); a figure's plotted values are not",
        "  printed, so it has none unless its text quotes some ('-': no numbers).",
        "- **ours can fill**: transcribed cells whose column, method and metric a run of a",
        "  paper-scale config produces, so that `summary/paper.md` can show ours beside them",
        "  ('-': no paper-scale config links the table).",
        "",
    ]
    total = {"cells": 0, "transcribed": 0, "fill": 0, "items": 0, "configs": 0}
    for paper, entry in cov.items.items():
        mine = [r for r in rows if r.paper == paper]
        cite = f"{entry['cite']}; " if entry.get("cite") else ""
        lines += [f"## {entry['title']}", "", f"Paper: {cite}cited in configs and docstrings as `{entry['source']}`.", ""]
        lines += [
            "| item | what | config | missing from the config | transcribed / in the paper | ours can fill | reason for the gaps |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in mine:
            counts = (
                f"{r.transcribed} / {r.cells}" if r.results and (r.cells or r.transcribed) else "-"
            )
            fill = "-" if r.fill is None or not r.results else str(r.fill)
            lines.append(
                f"| {_name(r.key)} | {_cell(r.what)} | {_configs(r.configs)} | {_cell(r.missing or '')} | "
                f"{counts} | {fill} | {_cell('; '.join(r.reasons))} |"
            )
        res = [r for r in mine if r.results]
        cells, tr = sum(r.cells for r in res), sum(r.transcribed for r in res)
        fill = sum(r.fill or 0 for r in res)
        with_config = sum(1 for r in res if any(p.parent == PAPER_DIR for p in r.configs))
        lines += [
            "",
            f"{len(res)} items with results ({len(mine) - len(res)} without), {with_config} of them with a "
            f"paper-scale config; {tr} of the {cells} numbers transcribed, {fill} of them fillable by our runs.",
            "",
        ]
        total["cells"] += cells
        total["transcribed"] += tr
        total["fill"] += fill
        total["items"] += len(res)
        total["configs"] += with_config
    lines += [
        "## All papers",
        "",
        f"{total['items']} items with results, {total['configs']} with a paper-scale config; "
        f"{total['transcribed']} of the {total['cells']} numbers transcribed, {total['fill']} fillable by our runs.",
    ]
    return "\n".join(lines) + "\n"


def check(root: Path = ROOT) -> list[str]:
    """Problems: the page differs from what the sources give."""
    page = Path(root) / PAGE
    if not page.is_file() or page.read_text() != markdown(root):
        return [f"{PAGE}: stale (python benchmarks/render_docs.py rewrites it)"]
    return []


def write(root: Path = ROOT) -> bool:
    """Rewrite the page; True when it changed."""
    page = Path(root) / PAGE
    text = markdown(root)
    if page.is_file() and page.read_text() == text:
        return False
    page.write_text(text)
    return True
