"""Paper vs ours in the paper's layout (fedforget.paper_tables, issue 17 item 5): hand-written
run directories in the runner's format -> ``aggregate`` (runs.csv) -> ``write_paper_tables``
beside a hand-written paper results file. Checks the numbers (ours in %, mean ± sample std
over completed seeds), the sign of the difference (ours − paper), "not run", the paper's '-'
and missing cells, failed seeds, continual metrics from two linked tables, and the CLI."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from fedforget.aggregate import aggregate
from fedforget.cli import main
from fedforget.paper_tables import CELL_COLUMNS, PAPER_OUTPUTS, write_paper_tables

PARTITION = {
    "scheme": "dirichlet",
    "clients": 3,
    "alpha": 0.5,
    "min_size": 10,
    "max_redraws": 1000,
    "seed": 0,
}
HEADER = "paper,table,dataset,setting,method,metric,value,std\n"


def write_run(
    d, method, seed, status="completed", final=None, dataset="digits", scenario=None, tasks_csv=None
):
    """A run directory as the runner writes it: run.json, metrics.csv, tasks.csv."""
    d.mkdir(parents=True)
    rounds = 2
    cfg = {"experiment": "e", "seed": seed, "method": {"label": method}, "dataset": {"label": dataset},
           "partition": PARTITION, "train": {"rounds": rounds}}  # fmt: skip
    if scenario:
        cfg["dataset"]["scenario"] = scenario
    done = status == "completed"
    rec = {"status": status, "config": cfg, "config_hash": f"h{seed}", "rounds_completed": rounds,
           "final_global_model_test_acc": final if done else None, "best_global_model_test_acc": final if done else None,
           "versions": {"torch": "x"}, "client_engine": "sequential"}  # fmt: skip
    (d / "run.json").write_text(json.dumps(rec))
    (d / "metrics.csv").write_text("round,global_model_test_acc\n0,0.1\n1,0.5\n2,0.6\n")
    (d / "tasks.csv").write_text(
        tasks_csv
        or "round,current_task,task,accuracy,loss\n0,0,0,0.1,1.0\n1,0,0,0.5,1.0\n2,0,0,0.6,1.0\n"
    )
    return d


def _cell(cells: pd.DataFrame, method: str, **where) -> pd.Series:
    hit = cells[cells["method"] == method]
    for k, v in where.items():
        hit = hit[hit[k] == v]
    assert len(hit) == 1, (method, where, hit)
    return hit.iloc[0]


@pytest.fixture
def one_task(tmp_path):
    """fedavg: 3 completed seeds (60, 62, 64 %); fedprox-mu0.01 (the paper's FedProx): one
    completed (70 %) and one diverged; SCAFFOLD: every seed diverged; FedDyn: still running;
    mine: a method the paper does not have."""
    root = tmp_path / "runs"
    dirs = [write_run(root / f"fedavg{s}", "fedavg", s, final=0.60 + 0.02 * s) for s in range(3)]
    dirs += [
        write_run(root / "prox0", "fedprox-mu0.01", 0, final=0.70),
        write_run(root / "prox1", "fedprox-mu0.01", 1, "diverged"),
    ]
    dirs += [write_run(root / f"scaffold{s}", "SCAFFOLD", s, "diverged") for s in range(2)]
    dirs += [write_run(root / f"feddyn{s}", "FedDyn", s, "running") for s in range(2)]
    dirs += [
        write_run(root / "mine0", "mine", 0, final=0.5),
        write_run(root / "mine1", "mine", 1, final=0.6),
    ]
    ref = tmp_path / "paper_results.csv"
    ref.write_text(
        HEADER
        + "P,2,CIFAR,dir-0.5,FedAvg,accuracy,65.00,1.0\n"
        + "P,2,CIFAR,dir-0.5,FedProx,accuracy,66.50,0.5\n"
        + "P,2,CIFAR,dir-0.5,FedNova,accuracy,10.00,failed\n"  # the paper's failed run; not in our config
        + "P,2,CIFAR,dir-0.5,SCAFFOLD,accuracy,-,\n"  # the paper's '-'
        + "P,2,CIFAR,dir-0.1,SCAFFOLD,accuracy,55.00,2.0\n"  # a column this experiment does not map to
        + "P,2,CIFAR,dir-0.5,FedAvg,runtime_h,3.5,\n"  # no counterpart: not compared
        + "P,2,CIFAR,dir-0.5,FedDyn,accuracy,61.00,\n"
        + "P,3,CIFAR,dir-0.5,FedAvg,accuracy,1.00,\n"  # another table of the paper
        + "Q,2,CIFAR,dir-0.5,FedAvg,accuracy,2.00,\n"  # another paper
    )
    paper = {"name": "P", "table": 2, "dataset_map": {"digits": "CIFAR"}, "setting_map": {"dirichlet-0.5": "dir-0.5"},
             "method_map": {"fedprox-mu0.01": "FedProx"}}  # fmt: skip
    out = tmp_path / "summary"
    aggregate(dirs, out, "e", paper, ref)
    files = write_paper_tables(out, "e", paper, ref)
    assert [f.name for f in files] == list(PAPER_OUTPUTS)
    return out, pd.read_csv(out / "paper.csv", keep_default_na=False, na_values=[""])


def test_cells_numbers_difference_and_status(one_task):
    out, cells = one_task
    assert list(cells.columns) == CELL_COLUMNS
    assert list(cells.columns[:10]) == ["method", "dataset", "setting", "metric", "paper_pct", "ours_mean_pct",
                                        "ours_std_pct", "n_seeds", "diff_pct_points", "status"]  # fmt: skip
    # every cell is the paper's column (dataset_map, setting_map), its only compared metric
    assert set(zip(cells["dataset"], cells["setting"], cells["metric"])) == {
        ("CIFAR", "dir-0.5", "accuracy")
    }
    assert set(cells["our_dataset"]) == {"digits"} and set(cells["our_setting"]) == {
        "dirichlet-0.5"
    }
    # the paper's methods in its order, then ours that the paper lacks
    assert list(cells["method"]) == [
        "fedavg",
        "fedprox-mu0.01",
        "FedNova",
        "SCAFFOLD",
        "FedDyn",
        "mine",
    ]

    a = _cell(cells, "fedavg")  # 60, 62, 64 % over three seeds: ours below the paper's 65
    assert a["ours_mean_pct"] == pytest.approx(62.0) and a["ours_std_pct"] == pytest.approx(2.0)
    assert (a["paper_pct"], a["paper_std_pct"], a["n_seeds"], a["status"]) == (65.0, 1.0, 3, "ok")
    assert a["diff_pct_points"] == pytest.approx(-3.0)  # ours − paper: negative, ours lower
    p = _cell(cells, "fedprox-mu0.01")  # one completed seed (70 %) above the paper's 66.5
    assert (
        p["paper_method"] == "FedProx"
        and p["ours_mean_pct"] == pytest.approx(70.0)
        and math.isnan(p["ours_std_pct"])
    )
    assert p["diff_pct_points"] == pytest.approx(3.5) and (p["n_seeds"], p["n_failed"]) == (1, 1)
    assert p["status"] == "failed seeds"
    n = _cell(cells, "FedNova")  # the paper's method, not in our config
    assert (
        n["status"] == "not run; failed in paper" and n["paper_pct"] == 10.0 and n["n_seeds"] == 0
    )
    assert math.isnan(n["ours_mean_pct"]) and math.isnan(n["diff_pct_points"])
    s = _cell(cells, "SCAFFOLD")  # every seed diverged; the paper's cell is '-'
    assert s["status"] == "failed; paper '-'" and math.isnan(s["paper_pct"]) and s["n_failed"] == 2
    d = _cell(cells, "FedDyn")  # runs not finished: not run
    assert d["status"] == "not run" and d["n_not_finished"] == 2 and d["paper_pct"] == 61.0
    m = _cell(cells, "mine")  # ours only: not in the paper's table
    assert m["table"] == "" or pd.isna(m["table"])
    assert (
        m["status"] == "not in paper"
        and m["ours_mean_pct"] == pytest.approx(55.0)
        and math.isnan(m["paper_pct"])
    )


def test_markdown_and_html_in_the_papers_layout(one_task):
    out, _ = one_task
    md = (out / "paper.md").read_text()
    assert md.startswith("# e: paper vs ours (P table 2)\n")
    assert "## P table 2: accuracy (%)" in md
    assert "| method |  | CIFAR dir-0.5 (ours: digits dirichlet-0.5) |" in md
    lines = md.splitlines()
    at = lines.index("| fedavg | paper | 65.00 ± 1.00 |")
    assert lines[at + 1 : at + 3] == ["|  | ours | 62.00 ± 2.00 |", "|  | Δ | -3.00 |"]
    at = lines.index("| fedprox-mu0.01 (paper: FedProx) | paper | 66.50 ± 0.50 |")
    assert lines[at + 1 : at + 3] == [
        "|  | ours | 70.00 (n = 1) (failed seeds) |",
        "|  | Δ | +3.50 |",
    ]
    at = lines.index("| FedNova | paper | 10.00 (failed) |")
    assert lines[at + 1] == "|  | ours | not run |" and not lines[at + 2].startswith("|  | Δ")
    at = lines.index("| SCAFFOLD | paper | - |")
    assert lines[at + 1] == "|  | ours | failed |"
    assert "| FedDyn | paper | 61.00 |" in md
    ours_only = md.split("## P not in the paper's table(s): accuracy (%)")[1]
    assert (
        "| mine | ours | 55.00 ± 7.07 |" in ours_only
        and "paper |" not in ours_only.split("\n\n")[1]
    )
    # the paper's column no dataset of ours maps to, and the metric not compared, are named
    assert "CIFAR dir-0.1" in md and "Not compared (no counterpart in our runs): runtime_h." in md
    assert "All numbers in %" in md and "Δ = ours − paper in percentage points" in md
    page = (out / "paper.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page
    for text in ("<td>65.00 ± 1.00</td>", "<td>62.00 ± 2.00</td>", "<td>-3.00</td>", "<td>not run</td>",
                 "<td>fedprox-mu0.01 (paper: FedProx)</td>", "CIFAR dir-0.5 (ours: digits dirichlet-0.5)"):  # fmt: skip
        assert text in page, text


def test_continual_metrics_of_two_linked_tables(tmp_path):
    """FedGP-style link (table: [1, 11, 16]): acc_T from table 1, Fgt_T from table 11, BWT and
    FWT from table 16, each its own grid; a[t][i] of two tasks x one round: a = [[0.8, 0.3],
    [0.6, 0.9 + 0.05 seed]], b = [0.1, 0.1], so ACC = 75.00 / 77.50 % (mean 76.25, std
    1.25·√2), Fgt_T = a[0][0] − a[1][0] = 20 %, BWT = a[1][0] − a[0][0] = −20 % and FWT =
    a[0][1] − b[1] = 20 % in both."""
    sc = {
        "kind": "split",
        "tasks": 2,
        "classes_per_task": 1,
        "incremental": "class",
        "rounds_per_task": 1,
    }
    dirs = []
    for seed in (0, 1):
        rows = [
            (0, 0, 0, 0.1),
            (0, 0, 1, 0.1),
            (1, 0, 0, 0.8),
            (1, 0, 1, 0.3),
            (2, 1, 0, 0.6),
            (2, 1, 1, 0.9 + 0.05 * seed),
        ]
        text = "round,current_task,task,accuracy,loss\n" + "".join(
            f"{r},{c},{t},{a!r},1.0\n" for r, c, t, a in rows
        )
        dirs.append(
            write_run(tmp_path / f"fl{seed}", "FL", seed, final=0.7, scenario=sc, tasks_csv=text)
        )
    ref = tmp_path / "paper_results.csv"
    ref.write_text(
        HEADER
        + "G,1,split-cifar10,class-il,FL,acc_T,70.00,1.0\n"
        + "G,1,split-cifar10,class-il,FL+FedGP,acc_T,80.00,\n"
        + "G,11,split-cifar10,class-il,FL,Fgt_T,25.00,2.0\n"
        + "G,11,split-cifar10,class-il,FL+FedGP,Fgt_T,10.00,\n"
        + "G,16,split-cifar10,class-il,FL,BWT,-25.00,\n"
        + "G,16,split-cifar10,class-il,FL,FWT,15.00,\n"
    )
    paper = {
        "name": "G",
        "table": [1, 11, 16],
        "dataset_map": {"digits": {"dataset": "split-cifar10", "setting": "class-il"}},
    }
    out = tmp_path / "summary"
    aggregate(dirs, out, "e", paper, ref)
    write_paper_tables(out, "e", paper, ref)
    cells = pd.read_csv(out / "paper.csv")
    assert list(zip(cells["table"], cells["method"], cells["metric"])) == [
        (1, "FL", "acc_T"), (1, "FL+FedGP", "acc_T"), (11, "FL", "Fgt_T"), (11, "FL+FedGP", "Fgt_T"),
        (16, "FL", "BWT"), (16, "FL", "FWT")]  # fmt: skip
    acc = _cell(cells, "FL", metric="acc_T")
    assert acc["ours_mean_pct"] == pytest.approx(76.25) and acc["ours_std_pct"] == pytest.approx(
        1.25 * math.sqrt(2)
    )
    assert acc["diff_pct_points"] == pytest.approx(6.25) and acc["our_column"] == "acc"
    fgt = _cell(cells, "FL", metric="Fgt_T")  # lower is better: ours forgets 5 points less
    assert fgt["ours_mean_pct"] == pytest.approx(20.0) and fgt["diff_pct_points"] == pytest.approx(
        -5.0
    )
    assert fgt["paper_std_pct"] == 2.0 and fgt["status"] == "ok" and fgt["our_column"] == "fgt"
    bwt, fwt = _cell(cells, "FL", metric="BWT"), _cell(cells, "FL", metric="FWT")
    assert bwt["our_column"] == "bwt" and bwt["ours_mean_pct"] == pytest.approx(-20.0)
    assert bwt["diff_pct_points"] == pytest.approx(5.0) and bwt["status"] == "ok"
    assert fwt["our_column"] == "fwt" and fwt["ours_mean_pct"] == pytest.approx(20.0)
    assert fwt["diff_pct_points"] == pytest.approx(5.0)
    continual = (out / "continual.md").read_text()  # the paper's BWT / FWT beside ours there too
    assert "(paper -25.00)" in continual and "(paper 15.00)" in continual
    assert (cells[cells["method"] == "FL+FedGP"]["status"] == "not run").all()
    md = (out / "paper.md").read_text()
    assert md.startswith("# e: paper vs ours (G tables 1, 11, 16)\n")
    assert "## G table 1: acc_T (%)" in md and "## G table 11: Fgt_T (%)" in md
    assert "| FL | paper | 25.00 ± 2.00 |\n|  | ours | 20.00 ± 0.00 |\n|  | Δ | -5.00 |" in md


def test_task_il_columns_from_the_class_il_runs_task_aware_scores(tmp_path):
    """FedGP's task-IL columns from its class-IL runs: a dataset_map value listing two paper
    columns, the second ``scored: task_aware``, compares that column with runs.csv's task-aware
    metrics (tasks.csv's ``task_aware``), the first with the runs' own. Two tasks x one round;
    accuracy a = [[0.8, 0.0], [0.3, 0.9]], task-aware a = [[0.9, 0.5], [0.85, 0.95]] with b =
    [0.5, 0.4]: task-aware ACC 90 %, Fgt_T 5 %, BWT -5 %, FWT 10 %, Acc_2 90 %."""
    sc = {"kind": "split", "tasks": 2, "classes_per_task": 1, "incremental": "class", "rounds_per_task": 1}
    rows = [(0, 0, 0, 0.1, 0.5), (0, 0, 1, 0.1, 0.4), (1, 0, 0, 0.8, 0.9), (1, 0, 1, 0.0, 0.5),
            (2, 1, 0, 0.3, 0.85), (2, 1, 1, 0.9, 0.95)]  # fmt: skip
    text = "round,current_task,task,accuracy,loss,task_aware\n" + "".join(
        f"{r},{c},{t},{a!r},1.0,{w!r}\n" for r, c, t, a, w in rows
    )
    dirs = [write_run(tmp_path / "fl0", "FL", 0, final=0.6, scenario=sc, tasks_csv=text)]
    ref = tmp_path / "paper_results.csv"
    ref.write_text(
        HEADER
        + "G,1,split-cifar10,class-il,FL,acc_T,50.00,\n"
        + "G,1,split-cifar10,task-il,FL,acc_T,88.00,\n"
        + "G,11,split-cifar10,task-il,FL,Fgt_T,7.00,\n"
        + "G,16,split-cifar10,task-il,FL,BWT,-6.00,\n"
        + "G,16,split-cifar10,task-il,FL,FWT,12.00,\n"
        + "G,fig5,split-cifar10,task-il,FL,Acc_2,91.00,\n"
    )
    cols = [{"dataset": "split-cifar10", "setting": "class-il"},
            {"dataset": "split-cifar10", "setting": "task-il", "scored": "task_aware"}]  # fmt: skip
    paper = {"name": "G", "table": [1, 11, 16, "fig5"], "dataset_map": {"digits": cols}}
    out = tmp_path / "summary"
    aggregate(dirs, out, "e", paper, ref)
    write_paper_tables(out, "e", paper, ref)
    runs = pd.read_csv(out / "runs.csv").iloc[0]
    assert runs["acc"] == pytest.approx(0.6) and runs["acc_task_aware"] == pytest.approx(0.9)
    assert runs["fgt_task_aware"] == pytest.approx(0.05) and runs["bwt_task_aware"] == pytest.approx(-0.05)
    assert runs["fwt_task_aware"] == pytest.approx(0.1)
    cells = pd.read_csv(out / "paper.csv")
    plain = _cell(cells, "FL", metric="acc_T", setting="class-il")
    assert plain["our_column"] == "acc" and plain["ours_mean_pct"] == pytest.approx(60.0)
    want = {"acc_T": ("acc_task_aware", 90.0), "Fgt_T": ("fgt_task_aware", 5.0), "BWT": ("bwt_task_aware", -5.0),
            "FWT": ("fwt_task_aware", 10.0), "Acc_2": ("avg_acc_after_task_2_task_aware", 90.0)}  # fmt: skip
    for metric, (column, value) in want.items():
        c = _cell(cells, "FL", metric=metric, setting="task-il")
        assert c["our_column"] == column and c["ours_mean_pct"] == pytest.approx(value), metric
        assert c["our_dataset"] == "digits" and c["our_setting"] == "dirichlet-0.5, scored task-aware"
    assert _cell(cells, "FL", metric="acc_T", setting="task-il")["diff_pct_points"] == pytest.approx(2.0)
    assert "split-cifar10 task-il (ours: digits dirichlet-0.5, scored task-aware)" in (out / "paper.md").read_text()
    continual = pd.read_csv(out / "continual.csv").iloc[0]  # the paper's task-IL numbers beside ours there too
    assert continual["paper_acc"] == 50.0 and continual["paper_acc_task_aware"] == 88.0
    assert continual["paper_fgt_task_aware"] == 7.0 and continual["fgt_task_aware_mean"] == pytest.approx(5.0)
    page = (out / "continual.html").read_text()  # and on the report's page (found in review)
    assert "Paper ACC task-aware (%)" in page and "88.00" in page and "Paper Forgetting Fgt_T task-aware (%)" in page
    md = (out / "continual.md").read_text()
    assert "## Forgetting Fgt_T (FedGP, after Chaudhry et al. 2018; lower is better), task-aware" in md


def test_per_task_metrics_acc_t_and_mb_by_part(tmp_path):
    """FedGP Fig. 5 quotes Acc_5: a paper metric Acc_<t> compares with runs.csv's
    avg_acc_after_task_<t>, the mean over the first t tasks after task t. Three tasks x one
    round: a = [[0.8, ., .], [0.6, 0.9, .], [0.5, 0.7, 0.3]], so Acc_1 = 80 %, Acc_2 = 75 %;
    Acc_4 names no task of the stream: not measured. FedProTIP Table 14's TIP_T2 compares
    with the Acc_2 of tasks.csv's task_id_batch. FedProTIP Table 9's MB_Base_T2 compares
    with comm_bases_mb_task_2 (the task-end row of task 2) in MB: not × 100, Δ in MB, three
    decimals."""
    sc = {"kind": "split", "tasks": 3, "classes_per_task": 1, "incremental": "task", "rounds_per_task": 1}
    a = [[0.8, 0.2, 0.1], [0.6, 0.9, 0.1], [0.5, 0.7, 0.3]]
    rows = [(0, 0, i, 0.1) for i in range(3)] + [(t + 1, t, i, a[t][i]) for t in range(3) for i in range(3)]
    tid = lambda i: 1.0 if i == 0 else 0.5  # noqa: E731  task_id_batch: task 1's routed right, the others half
    text = "round,current_task,task,accuracy,loss,task_id_batch\n" + "".join(
        f"{r},{c},{t},{v!r},1.0,{tid(t)}\n" for r, c, t, v in rows
    )
    dirs = [write_run(tmp_path / "fl0", "FL", 0, final=0.5, scenario=sc, tasks_csv=text)]
    (dirs[0] / "metrics.csv").write_text("round,global_model_test_acc,x_comm_task_mb,x_comm_bases_mb\n"
                                         "0,0.1,,\n1,0.5,10.0,9.5\n2,0.6,6.0,5.25\n3,0.7,1.0,0.5\n")  # fmt: skip
    ref = tmp_path / "paper_results.csv"
    ref.write_text(HEADER + "G,fig5,split-cifar100,task-il,FL,MB_Base_T2,5.646,\n"
                   + "G,fig5,split-cifar100,task-il,FL,MB_Base,5.0,\n"
                   + "G,fig5,split-cifar100,task-il,FL,TIP_T2,70.0,\n"
                   + "G,fig5,split-cifar100,task-il,FL,Acc_1,85.00,\n"
                   + "G,fig5,split-cifar100,task-il,FL,Acc_2,70.00,\n"
                   + "G,fig5,split-cifar100,task-il,FL,Acc_4,60.00,\n")  # fmt: skip
    paper = {"name": "G", "table": "fig5", "dataset_map": {"digits": {"dataset": "split-cifar100", "setting": "task-il"}}}
    out = tmp_path / "summary"
    aggregate(dirs, out, "e", paper, ref)
    write_paper_tables(out, "e", paper, ref)
    cells = pd.read_csv(out / "paper.csv")
    acc1, acc2, acc4 = (_cell(cells, "FL", metric=m) for m in ("Acc_1", "Acc_2", "Acc_4"))
    assert acc1["our_column"] == "avg_acc_after_task_1" and acc1["ours_mean_pct"] == pytest.approx(80.0)
    assert acc1["diff_pct_points"] == pytest.approx(-5.0) and acc1["status"] == "ok"
    assert acc2["ours_mean_pct"] == pytest.approx(75.0) and acc2["diff_pct_points"] == pytest.approx(5.0)
    assert acc4["status"] == "not measured"
    assert acc1["unit"] == "%"
    tip = _cell(cells, "FL", metric="TIP_T2")  # FedProTIP Table 14: after task 2, (1.0 + 0.5) / 2
    assert tip["our_column"] == "avg_acc_after_task_2_task_id_batch" and tip["ours_mean_pct"] == pytest.approx(75.0)
    mean = _cell(cells, "FL", metric="MB_Base")  # Table 19's MB per task: the mean over the tasks
    assert mean["our_column"] == "comm_bases_mb" and mean["ours_mean_pct"] == pytest.approx((9.5 + 5.25 + 0.5) / 3)
    mb = _cell(cells, "FL", metric="MB_Base_T2")
    assert mb["our_column"] == "comm_bases_mb_task_2" and mb["unit"] == "MB"
    assert mb["ours_mean_pct"] == pytest.approx(5.25) and mb["diff_pct_points"] == pytest.approx(5.25 - 5.646)
    md = (out / "paper.md").read_text()
    assert "## G table fig5: Acc_1 (%)" in md and "## G table fig5: MB_Base_T2 (MB)" in md
    assert "| FL | paper | 5.646 |\n|  | ours | 5.250 (n = 1) |\n|  | Δ | -0.396 |" in md


def test_cli_writes_the_tables_and_names_a_missing_summary(tmp_path, capsys):
    d = write_run(tmp_path / "runs" / "a0", "FedAvg", 0, final=0.5)
    ref = tmp_path / "paper_results.csv"
    ref.write_text(HEADER + "P,1,digits,dirichlet-0.5,FedAvg,accuracy,40.00,\n")
    out = tmp_path / "summary"
    aggregate([d], out, "e")
    link = json.dumps({"name": "P", "table": 1})
    argv = [
        "paper-table",
        "--summary",
        str(out),
        "--experiment",
        "e",
        "--paper",
        link,
        f"--paper-results={ref}",
    ]
    assert main(argv) == 0
    cell = pd.read_csv(out / "paper.csv").iloc[0]
    assert (cell["ours_mean_pct"], cell["diff_pct_points"], cell["n_seeds"]) == (50.0, 10.0, 1)
    assert (
        "| FedAvg | paper | 40.00 |\n|  | ours | 50.00 (n = 1) |\n|  | Δ | +10.00 |"
        in (out / "paper.md").read_text()
    )
    capsys.readouterr()
    missing = tmp_path / "missing"
    assert (
        main(
            [
                "paper-table",
                "--summary",
                str(missing),
                "--experiment",
                "e",
                "--paper",
                link,
                f"--paper-results={ref}",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        err.startswith("fedforget: error: ")
        and str(missing / "runs.csv") in err
        and len(err.strip().splitlines()) == 1
    )
    assert main([*argv[:-1], f"--paper-results={tmp_path / 'nope.csv'}"]) == 2
    assert "nope.csv" in capsys.readouterr().err


def test_a_note_on_the_papers_number_is_marked_and_printed(tmp_path):
    """A paper results row's note (optional column ``note``, issue 33: FedProTIP Table 11's
    DomainNet cells contradict its Tables 1 and 16) marks the paper's number "(note n)" in
    paper.md and paper.html, is printed under the grids, and is paper.csv's paper_note; a
    note shared by two cells has one number."""
    dirs = [write_run(tmp_path / f"a{s}", "A", s, final=0.5) for s in range(2)]
    dirs += [write_run(tmp_path / "b0", "B", 0, final=0.4)]
    swapped = "printed in the +TIP column; the columns look swapped, see Table 1"
    ref = tmp_path / "paper_results.csv"
    ref.write_text(
        "paper,table,dataset,setting,method,metric,value,std,note\n"
        f'P,11,digits,dirichlet-0.5,A,accuracy,28.85,,"{swapped}"\n'
        f'P,11,digits,dirichlet-0.5,B,accuracy,25.30,0.5,"{swapped}"\n'
        "P,11,digits,dirichlet-0.5,C,accuracy,20.00,,\n"
    )
    paper = {"name": "P", "table": 11}
    out = tmp_path / "summary"
    aggregate(dirs, out, "e", paper, ref)
    write_paper_tables(out, "e", paper, ref)
    cells = pd.read_csv(out / "paper.csv", keep_default_na=False)
    assert list(cells["paper_note"]) == [swapped, swapped, ""]
    md = (out / "paper.md").read_text()
    assert "| A | paper | 28.85 (note 1) |" in md and "| B | paper | 25.30 ± 0.50 (note 1) |" in md
    assert "| C | paper | 20.00 |" in md and "(note 2)" not in md
    assert (
        f"- Note 1 (P table 11, digits dirichlet-0.5, A, accuracy and 1 more cell): {swapped}" in md
    )
    page = (out / "paper.html").read_text()
    assert "<td>28.85 (note 1)</td>" in page and "<li>Note 1 (P table 11" in page
