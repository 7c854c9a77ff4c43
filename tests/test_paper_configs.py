"""Shipped paper configs through the real `snakemake` (issue 19): the FedProj pilot's table
carries the paper's numbers, a missing paper results file stops the workflow before any
job, and in FedSOL's Table 5 config rho = 0 equals FedAvg bit for bit (both run on the same
client engine: auto pairs an experiment's methods). Marked e2e."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml

from .test_workflow import REPO, snakemake

pytestmark = pytest.mark.e2e


@pytest.mark.long
def test_pilot_table_shows_the_papers_numbers(tmp_path: Path) -> None:
    shutil.copytree(REPO / "config", tmp_path / "config")
    pilot = yaml.safe_load((REPO / "config/experiments/fedproj_pilot_iris.yaml").read_text())
    pilot["experiments"][0]["seeds"] = [0]  # the shipped file with one seed of five: a short test
    (tmp_path / "pilot.yaml").write_text(yaml.safe_dump(pilot, sort_keys=False))
    table = "results/fedproj_pilot_iris/summary/table.md"
    snakemake(tmp_path, table, "--configfile", "pilot.yaml")
    text = (tmp_path / table).read_text()
    for method, paper in (("fedavg", "64.00"), ("feddf", "64.00"), ("fedproj", "93.33")):
        row = next(line for line in text.splitlines() if line.startswith(f"| {method} |"))
        assert f"(paper {paper})" in row, row

    # the paper link needs its file: without it, one error before any job
    (tmp_path / "config" / "paper_results.csv").unlink()
    proc = snakemake(tmp_path, table, "--configfile", "pilot.yaml", "--forceall", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "config/paper_results.csv" in out and "paper_results" in out
    assert "Building DAG" not in out


@pytest.mark.long  # make smoke; make test keeps the engine-level twin (methods/test_fedsol.py, rho 0 is FedAvg bit for bit)
def test_fedsol_rho0_equals_fedavg_bit_for_bit_under_snakemake(tmp_path: Path) -> None:
    shutil.copytree(REPO / "config", tmp_path / "config")
    cfg = yaml.safe_load((REPO / "config/experiments/fedsol_partial.yaml").read_text())
    cfg["experiments"][0]["train"]["rounds"] = 3  # the shipped file at 3 of its 20 rounds: a short test
    (tmp_path / "fedsol.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    base = Path("results/fedsol_partial/digits/dirichlet-0.1_k20_min10_ps0")
    runs = {m: base / m / "seed0" for m in ("fedavg", "rho0")}
    snakemake(tmp_path, *(str(d / "model.pt") for d in runs.values()), "--configfile", "fedsol.yaml")
    fedavg, rho0 = ((tmp_path / d) for d in runs.values())
    assert (fedavg / "model.pt").read_bytes() == (rho0 / "model.pt").read_bytes()
    a, b = pd.read_csv(fedavg / "metrics.csv"), pd.read_csv(rho0 / "metrics.csv")
    shared = [c for c in a.columns if c in b.columns]
    assert len(shared) >= 6 and a[shared].equals(b[shared])
