"""The paper-scale table configs (config/experiments/paper/, issue 17 item 4): every seed table
and figure has one; each validates in-process (``fedforget.parse.load_config``: schema,
registries, sizes, paper links); their paper links fill the paper-vs-ours tables (every
column we run is a column of the linked table, every method the paper reports there is run);
their experiment names are distinct from each other and from the embedded configs'; and two
representative ones, merged into one file, dry-run through Snakemake (one start: a dry run of
every config is benchmarks/dag_time.py's job, too slow for CI)."""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedforget.paper_tables import paper_columns, paper_method
from fedforget.parse import load_config
from fedforget.utils import paper_tables

REPO = Path(__file__).resolve().parents[1]
PAPER_DIR = REPO / "config" / "experiments" / "paper"
CONFIGS = sorted(PAPER_DIR.glob("*.yaml"))
PAPERS = ("fedproj", "fedsol", "fedgp", "fedprotip")

# issue 17 item 4: the seed tables and figures that need a config
REQUIRED = {
    "fedproj": ["table1", "table2", "table3b", "fig1", "fig3a"],
    "fedsol": ["table1", "table2", "table3", "table4", "table5", "fig2", "fig5", "fig6"],
    "fedgp": [f"table{i}" for i in range(1, 11)] + ["table15"],
    "fedprotip": ["table1", "table2", "table3", "table5"],
}


def left_out() -> set[tuple[str, str, str, str]]:
    """(paper, table, dataset, setting): the columns of a linked table that no config runs,
    as config/paper_tables.yaml lists them with the reason (docs/coverage.md shows it)."""
    items = yaml.safe_load((REPO / "config" / "paper_tables.yaml").read_text())
    return {
        (paper, key.removeprefix("table"), *column.split(" ", 1))
        for paper, entry in items.items()
        for key, item in entry["items"].items()
        for column in item.get("left_out") or {}
    }


def covered_items(path: Path) -> set[tuple[str, str]]:
    """(paper, item) pairs a file name covers: fedgp_table1_table11.yaml -> table1, table11."""
    paper, *items = path.stem.split("_")
    return {(paper, item) for item in items}


@pytest.fixture(scope="module")
def loaded(repo_root):
    """Every paper config validated once (paper_results resolves against the repository)."""
    cwd = os.getcwd()
    os.chdir(repo_root)
    try:
        return {p.name: load_config(p) for p in CONFIGS}
    finally:
        os.chdir(cwd)


def test_every_seed_table_and_figure_has_a_config():
    assert CONFIGS, f"no configs under {PAPER_DIR}"
    covered = set().union(*(covered_items(p) for p in CONFIGS))
    missing = sorted(
        (p, i) for p, items in REQUIRED.items() for i in items if (p, i) not in covered
    )
    assert not missing, f"seed tables / figures without a config in {PAPER_DIR}: {missing}"
    for p in CONFIGS:
        paper, *items = p.stem.split("_")
        assert (
            paper in PAPERS
            and items
            and all(re.fullmatch(r"(table|fig)\d+[a-z]?", i) for i in items)
        ), p.name


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_validates_and_documents_its_setting(loaded, path):
    """Validation passes (a bad method, model, size or paper link would raise); the header
    names the paper's setting with its source section and the deviations; the seeds are 3,
    or the paper's 5 for FedGP (its Sec. 5: five runs)."""
    wf = loaded[path.name]
    assert wf.runs()
    header = path.read_text().split("\ndata_dir:")[0]
    assert all(line.startswith("#") for line in header.strip().splitlines()), "header comment first"
    paper = path.stem.split("_")[0]
    assert f"[P, {paper}.md" in header, "the paper's setting and its section"
    assert "[D]" in header, "deviations (or the decisions where the paper is silent)"
    assert f"config/experiments/paper/{path.name}" in header, "how to run it"
    seeds = [0, 1, 2, 3, 4] if paper == "fedgp" else [0, 1, 2]
    assert all(e.seeds == seeds for e in wf.experiments), [e.seeds for e in wf.experiments]


def test_experiment_names_are_distinct(loaded, repo_root):
    """Distinct across the paper configs (so they merge into one DAG and their results never
    share a directory) and from the embedded configs' experiments."""
    names = [e.name for wf in loaded.values() for e in wf.experiments]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    embedded = {
        e["name"]
        for p in [
            repo_root / "config" / "config.yaml",
            *(repo_root / "config" / "experiments").glob("*.yaml"),
        ]
        for e in yaml.safe_load(p.read_text())["experiments"]
    }
    assert not set(names) & embedded


def test_paper_links_fill_the_paper_tables(loaded, repo_root):
    """Every column a linked experiment runs is a (dataset, setting) of its paper table(s) in
    config/paper_results.csv; every method the paper reports in that column is run by the
    config (under method_map; a config may split a column's methods over experiments, e.g.
    L2P on its ViT; a column of one of two linked tables only, e.g. FedProTIP Table 12's
    DomainNet, is checked against that table); and no column of a linked table is left out
    but those config/paper_tables.yaml's left_out names."""
    with (repo_root / "config" / "paper_results.csv").open(newline="", encoding="utf-8") as f:
        ref = list(csv.DictReader(f))
    linked, covered = set(), set()
    for name, wf in loaded.items():
        run: dict[tuple[str, str, str, str], set[str]] = {}  # paper column -> our methods there
        for e in wf.experiments:
            if not e.paper:
                continue
            tables = set(paper_tables(e.paper))
            cols = {  # table -> its (dataset, setting) columns
                t: {
                    (r["dataset"], r["setting"])
                    for r in ref
                    if r["paper"] == e.paper["name"] and r["table"] == t
                }
                for t in tables
            }
            ours = {
                (pd_, ps)
                for d in e.datasets
                for p in e.partitions
                for pd_, ps, _ in paper_columns(e.paper, d.label, p.setting)
            }
            assert ours <= set().union(*cols.values()), (
                name,
                e.name,
                sorted(ours - set().union(*cols.values())),
            )
            for t in tables:
                for c in ours & cols[t]:  # a second linked table may have some of the columns only
                    run.setdefault((e.paper["name"], t, *c), set()).update(
                        paper_method(e.paper, m.label).lower() for m in e.methods
                    )
            linked |= {(e.paper["name"], t) for t in tables}
        for col, methods in run.items():
            reported = {
                r["method"]
                for r in ref
                if (r["paper"], r["table"], r["dataset"], r["setting"]) == col
            }
            assert reported and {m for m in reported if m.lower() not in methods} == set(), (
                name,
                col,
            )
        covered |= set(run)
    every = {
        (r["paper"], r["table"], r["dataset"], r["setting"])
        for r in ref
        if (r["paper"], r["table"]) in linked
    }
    assert every - covered == left_out()


def test_two_representative_configs_dry_run(tmp_path, repo_root):
    """One Snakemake dry run over two configs merged into one file: FedProj Table 2 (text
    through a Hugging Face model, public/proxy datasets, setting_map) and FedGP Table 4 (a
    continual stream with asynchronous task boundaries): one training job per run, one paper
    table per linked experiment, the continual aggregation for the stream."""
    bin_dir = Path(sys.executable).parent
    if (
        shutil.which("snakemake", path=str(bin_dir) + os.pathsep + os.environ.get("PATH", ""))
        is None
    ):
        pytest.skip("snakemake is not installed (pip install -e .[workflow])")
    picked = [PAPER_DIR / "fedproj_table2.yaml", PAPER_DIR / "fedgp_table4.yaml"]
    experiments = [e for p in picked for e in yaml.safe_load(p.read_text())["experiments"]]
    merged = tmp_path / "two.yaml"
    merged.write_text(yaml.safe_dump({"experiments": experiments}, sort_keys=False))
    shutil.copytree(repo_root / "config", tmp_path / "config")
    env = {**os.environ, "PATH": str(bin_dir) + os.pathsep + os.environ.get("PATH", "")}
    cmd = ["snakemake", "-s", str(repo_root / "Snakefile"), "-n", "--cores", "1", "--quiet", "rules",
           "--configfile", str(merged)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    stats = out.split("Job stats:")[-1]
    jobs = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", stats, re.M)}
    runs = sum(
        len(e["datasets"]) * len(e["partitions"]) * len(e["methods"]) * len(e["seeds"])
        for e in experiments
    )
    assert jobs["train"] == runs == 72 + 25  # FedGP Table 4: class-IL runs only (task-IL: scored task-aware)
    assert jobs["paper_table"] == sum(1 for e in experiments if e.get("paper")) == 4
    assert jobs["aggregate_continual"] == 1 and jobs["aggregate"] == 3
    # the text sets and their public sets are prepared from their native files
    assert jobs["prepare_dataset"] == 7  # mnli, snli, sst2, sentiment140, marc, yelp; cifar100
