"""FedAvg's weighted average, and the over-seeds summary tables (aggregate.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

from fedforget.aggregate import attach_paper, collect, html_table, markdown, summarise
from fedforget.methods import weighted_average

# ----------------------------------------------------------------------------- weighted_average


def _state(scale: float, steps: int = 0) -> dict[str, torch.Tensor]:
    return {
        "w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]) * scale,
        "b": torch.tensor([scale, -scale]),
        "num_batches_tracked": torch.tensor(steps, dtype=torch.int64),
    }


def test_weighted_average_two_clients_hand_computed():
    a, b = _state(1.0, steps=5), _state(5.0, steps=9)
    out = weighted_average([a, b], [1, 3])
    # 0.25 * theta_a + 0.75 * theta_b = (0.25 + 3.75) * base = 4 * base
    torch.testing.assert_close(out["w"], torch.tensor([[4.0, 8.0], [12.0, 16.0]]))
    torch.testing.assert_close(out["b"], torch.tensor([4.0, -4.0]))
    assert out["w"].dtype == torch.float32


def test_weighted_average_weights_are_normalised():
    a, b = _state(1.0), _state(5.0)
    ref = weighted_average([a, b], [1, 3])
    for scale in (0.001, 10, 1e6):
        out = weighted_average([a, b], [1 * scale, 3 * scale])
        for k in ref:
            torch.testing.assert_close(out[k], ref[k])
    # equal weights -> plain mean
    out = weighted_average([a, b], [7, 7])
    torch.testing.assert_close(out["w"], (a["w"] + b["w"]) / 2)


def test_identical_clients_average_to_themselves():
    g = torch.Generator().manual_seed(0)
    s = {"w": torch.randn(5, 7, generator=g), "b": torch.randn(7, generator=g)}
    out = weighted_average([s, s, s], [3, 100, 17])
    for k in s:
        torch.testing.assert_close(out[k], s[k], rtol=1e-6, atol=1e-6)


def test_single_client_is_exact_copy():
    s = _state(3.3)
    out = weighted_average([s], [42])
    for k in s:
        assert torch.equal(out[k], s[k])


def test_integer_buffers_kept_and_inputs_untouched():
    a, b = _state(1.0, steps=5), _state(5.0, steps=9)
    before = {k: {n: v.clone() for n, v in s.items()} for k, s in (("a", a), ("b", b))}
    out = weighted_average([a, b], [1, 3])
    assert out["num_batches_tracked"].dtype == torch.int64
    assert int(out["num_batches_tracked"]) == 5  # the first client's value
    for name, s in (("a", a), ("b", b)):
        for k, v in s.items():
            assert torch.equal(v, before[name][k]), f"input {name}.{k} was modified"
    # the output does not alias an input
    out["w"].add_(1.0)
    assert torch.equal(a["w"], before["a"]["w"])


# ----------------------------------------------------------------------------- summary tables


def _runs() -> pd.DataFrame:
    keys = {"experiment": "e", "clients": 10, "partition_seed": 0}
    rows = []
    # group A: three completed seeds
    for seed, final, best in ((0, 0.8, 0.85), (1, 0.9, 0.95), (2, 0.7, 0.90)):
        rows.append({**keys, "dataset": "digits", "setting": "iid", "method": "fedavg", "seed": seed,
                     "status": "completed", "final_global_model_test_acc": final, "best_global_model_test_acc": best})  # fmt: skip
    # group B: two completed, one diverged
    for seed, final, status in (
        (0, 0.5, "completed"),
        (1, 0.6, "completed"),
        (2, math.nan, "diverged"),
    ):
        rows.append({**keys, "dataset": "digits", "setting": "dirichlet-0.1", "method": "fedavg", "seed": seed,
                     "status": status, "final_global_model_test_acc": final, "best_global_model_test_acc": final})  # fmt: skip
    # group C: every seed diverged
    for seed in (0, 1):
        rows.append({**keys, "dataset": "digits", "setting": "dirichlet-0.1", "method": "fedprox", "seed": seed,
                     "status": "diverged", "final_global_model_test_acc": math.nan, "best_global_model_test_acc": math.nan})  # fmt: skip
    return pd.DataFrame(rows)


def _row(table, setting, method):
    r = table[(table["setting"] == setting) & (table["method"] == method)]
    assert len(r) == 1
    return r.iloc[0]


def test_summarise_mean_and_sample_std_in_percent():
    t = summarise(_runs())
    assert len(t) == 3
    a = _row(t, "iid", "fedavg")
    assert a["final_acc_mean"] == pytest.approx(80.0)
    assert a["final_acc_std"] == pytest.approx(10.0)  # ddof = 1 (ddof = 0 would give 8.165)
    assert a["best_acc_mean"] == pytest.approx(90.0)
    assert a["best_acc_std"] == pytest.approx(5.0)
    assert a["n_seeds"] == 3 and a["n_failed"] == 0 and a["status"] == "ok"


def test_summarise_diverged_seed_marks_group_failed():
    t = summarise(_runs())
    b = _row(t, "dirichlet-0.1", "fedavg")
    assert b["status"] == "failed"
    assert b["n_failed"] == 1 and b["n_seeds"] == 3
    assert b["final_acc_mean"] == pytest.approx(55.0)
    assert b["final_acc_std"] == pytest.approx(math.sqrt(50.0))
    c = _row(t, "dirichlet-0.1", "fedprox")
    assert c["status"] == "failed" and c["n_failed"] == 2
    assert math.isnan(c["final_acc_mean"])


def test_summarise_single_seed_std_is_nan_not_zero():
    runs = _runs().iloc[:1]
    t = summarise(runs)
    assert math.isnan(t.iloc[0]["final_acc_std"]) and math.isnan(t.iloc[0]["best_acc_std"])
    assert t.iloc[0]["final_acc_mean"] == pytest.approx(80.0)
    # table.csv writes the undefined std as an empty field, not 0.0
    cells = t.to_csv(index=False).splitlines()[1].split(",")
    assert cells[t.columns.get_loc("final_acc_std")] == ""


def _one_seed_runs() -> pd.DataFrame:
    """Group A: one seed, completed. Group B: three seeds, two diverged, one completed."""
    keys = {"experiment": "e", "clients": 10, "partition_seed": 0, "dataset": "digits", "method": "fedavg"}  # fmt: skip
    rows = [{**keys, "setting": "iid", "seed": 0, "status": "completed",
             "final_global_model_test_acc": 0.91234, "best_global_model_test_acc": 0.95}]  # fmt: skip
    for seed, status, acc in ((0, "diverged", math.nan), (1, "completed", 0.4), (2, "failed", math.nan)):  # fmt: skip
        rows.append({**keys, "setting": "dirichlet-0.1", "seed": seed, "status": status,
                     "final_global_model_test_acc": acc, "best_global_model_test_acc": acc})  # fmt: skip
    return pd.DataFrame(rows)


def test_one_completed_seed_shows_n_1_and_no_std():
    t = attach_paper(summarise(_one_seed_runs()), None, None)
    b = _row(t, "dirichlet-0.1", "fedavg")
    assert b["n_seeds"] == 3 and b["n_failed"] == 2 and b["status"] == "failed"
    assert b["final_acc_mean"] == pytest.approx(40.0) and math.isnan(b["final_acc_std"])
    md = markdown(t, "e")
    assert "± 0.00" not in md and "± nan" not in md
    row = [line for line in md.splitlines() if line.startswith("| fedavg |")][0]
    assert "| 91.23 (n = 1) |" in row  # one seed, none failed
    assert "| 40.00 (n = 1, failed seeds) |" in row  # one completed, two failed
    page = html_table(t, "e")
    assert "<td>91.23 (n = 1)</td>" in page and "<td>40.00 (n = 1, failed seeds)</td>" in page
    assert "± 0.00" not in page and "nan" not in page.lower()


def test_html_table_has_the_markdown_cells_seeds_and_paper(tmp_path):
    ref = tmp_path / "paper.csv"
    ref.write_text(
        "paper,table,dataset,setting,method,metric,value,std\nP,2,digits,iid,FedAvg,accuracy,77.5,1.5\n"
    )
    t = attach_paper(summarise(_runs()), {"name": "P", "table": 2}, ref)
    page = html_table(t, "e <x>")
    assert page.startswith("<!DOCTYPE html>") and '<meta charset="utf-8">' in page
    assert "<style>" in page and "<script" not in page and "<h1>e &lt;x&gt;</h1>" in page
    for text in ("80.00 ± 10.00", "90.00 ± 5.00", "55.00 ± 7.07 (failed seeds)", "<td>failed</td>",
                 "<th>Seeds</th>", "<th>Failed seeds</th>", "<th>Paper (%)</th>", "<td>77.50 ± 1.50</td>"):  # fmt: skip
        assert text in page, text
    assert page.count("<tr") == 1 + 3  # header + one row per dataset x partition x method
    # no paper linked: no paper column
    assert "Paper (%)" not in html_table(attach_paper(summarise(_runs()), None, None), "e")


def test_markdown_reports_values_and_failures():
    t = attach_paper(summarise(_runs()), None, None)
    md = markdown(t, "e")
    assert md.startswith("# e\n")
    assert "80.00 ± 10.00" in md
    assert "55.00 ± 7.07 (failed seeds)" in md
    assert "failed" in md
    fedprox_lines = [line for line in md.splitlines() if line.startswith("| fedprox |")]
    assert len(fedprox_lines) == 2  # final and best tables
    assert all("| failed |" in line for line in fedprox_lines)
    header = [line for line in md.splitlines() if line.startswith("| method |")][0]
    assert "digits iid" in header and "digits dirichlet-0.1" in header
    assert "ddof = 1" in md


def test_attach_paper_matches_rows(tmp_path):
    ref = tmp_path / "paper.csv"
    ref.write_text(
        "paper,table,dataset,setting,method,metric,value,std\n"
        "P,2,DIGITS,iid,FedAvg,accuracy,77.5,1.5\n"
        "P,2,DIGITS,iid,FedAvg,loss,0.5,\n"
        "Q,2,DIGITS,iid,FedAvg,accuracy,11.0,\n"
    )
    t = attach_paper(
        summarise(_runs()), {"name": "P", "table": 2, "dataset_map": {"digits": "DIGITS"}}, ref
    )
    a = _row(t, "iid", "fedavg")
    assert a["paper_acc"] == 77.5 and a["paper_std"] == 1.5
    assert math.isnan(_row(t, "dirichlet-0.1", "fedavg")["paper_acc"])
    assert "(paper 77.50)" in markdown(t, "e")


def _fake_run(d, seed, status, final, best):
    d.mkdir(parents=True)
    cfg = {
        "experiment": "e", "seed": seed, "method": {"label": "fedavg"}, "dataset": {"label": "iris"},
        "partition": {"scheme": "dirichlet", "clients": 3, "alpha": 0.5, "min_size": 10, "max_redraws": 1000, "seed": 0},
    }  # fmt: skip
    rec = {"status": status, "config": cfg, "config_hash": f"h{seed}", "final_global_model_test_acc": final,
           "best_global_model_test_acc": best, "rounds_completed": 2, "versions": {"torch": "x"}}  # fmt: skip
    (d / "run.json").write_text(json.dumps(rec))
    (d / "metrics.csv").write_text("round,global_model_test_acc\n0,0.1\n1,0.5\n")


def test_collect_reads_runs_and_ignores_accuracy_of_failed(tmp_path):
    _fake_run(tmp_path / "s0", 0, "completed", 0.9, 0.95)
    _fake_run(tmp_path / "s1", 1, "diverged", None, 0.4)
    runs, metrics = collect([tmp_path / "s0", tmp_path / "s1"])
    assert runs["setting"].tolist() == ["dirichlet-0.5", "dirichlet-0.5"]
    assert runs.loc[0, "final_global_model_test_acc"] == 0.9
    assert math.isnan(runs.loc[1, "best_global_model_test_acc"])
    assert len(metrics) == 4 and set(metrics["seed"]) == {0, 1}
    t = summarise(runs)
    assert t.iloc[0]["status"] == "failed" and t.iloc[0]["final_acc_mean"] == pytest.approx(90.0)


def test_partitions_that_differ_only_in_seed_or_clients_get_their_own_columns(tmp_path):
    """Two dirichlet-0.5 partitions of one dataset, seeds 0 and 1, and a third with 5 clients
    (issue 33, 3): each its own setting label, table.md column and table row; none dropped."""
    from fedforget.aggregate import aggregate

    dirs = []
    for i, (clients, pseed, acc) in enumerate([(3, 0, 0.9), (3, 1, 0.7), (5, 0, 0.5)]):
        d = tmp_path / f"r{i}"
        _fake_run(d, 0, "completed", acc, acc)
        rec = json.loads((d / "run.json").read_text())
        rec["config"]["partition"].update(clients=clients, seed=pseed)
        (d / "run.json").write_text(json.dumps(rec))
        dirs.append(d)
    table = aggregate(dirs, tmp_path / "summary", "e")
    assert sorted(table["setting"]) == ["dirichlet-0.5 k=3 seed 0", "dirichlet-0.5 k=3 seed 1", "dirichlet-0.5 k=5 seed 0"]
    md = (tmp_path / "summary" / "table.md").read_text()
    for cell in ("90.00 (n = 1)", "70.00 (n = 1)", "50.00 (n = 1)"):
        assert cell in md
    runs = pd.read_csv(tmp_path / "summary" / "runs.csv")
    assert runs["setting"].nunique() == 3


def test_paper_setting_map_links_our_setting_to_the_papers(tmp_path):
    from fedforget.aggregate import attach_paper

    ref = tmp_path / "paper.csv"
    ref.write_text("paper,table,dataset,setting,method,metric,value,std\n"
                   "p,fig1,iris-pca2,3 non-IID clients,FedProj,accuracy,93.33,\n")  # fmt: skip
    table = pd.DataFrame({"dataset": ["iris-pca2"], "setting": ["classes-122a07f5"], "method": ["fedproj"]})
    plain = attach_paper(table, {"name": "p", "table": "fig1"}, ref)
    assert math.isnan(plain["paper_acc"].iloc[0])
    mapped = attach_paper(table, {"name": "p", "table": "fig1", "setting_map": {"classes-122a07f5": "3 non-IID clients"}}, ref)
    assert mapped["paper_acc"].iloc[0] == 93.33


def test_paper_link_with_several_tables_a_stream_label_and_a_method_map(tmp_path):
    """A task stream's label maps to the paper's dataset and setting; method_map renames
    our labels; ``table: [1, 11]`` reads both tables (accuracy and forgetting); a bad
    dataset_map value is refused when the config is checked, naming it."""
    from fedforget.aggregate import attach_paper_continual
    from fedforget.parse import check_paper_link
    from fedforget.utils import FedForgetError

    ref = tmp_path / "paper.csv"
    ref.write_text("paper,table,dataset,setting,method,metric,value,std\n"
                   "p,1,split-cifar10,task-il,FL+FedGP,acc_T,80.83,2.0\n"
                   "p,11,split-cifar10,task-il,FL+FedGP,Fgt_T,4.49,1.9\n"
                   "p,7,split-cifar10,task-il,Project (>90),acc_T,70.0,\n")  # fmt: skip
    table = pd.DataFrame({"dataset": ["digits-task-il", "digits-task-il"], "setting": ["dirichlet-0.3"] * 2,
                          "method": ["FL+FedGP", "gp"]})  # fmt: skip
    link = {"name": "p", "table": [1, 11], "dataset_map": {"digits-task-il": {"dataset": "split-cifar10", "setting": "task-il"}}}
    out = attach_paper_continual(table, link, ref)
    assert (out.loc[0, "paper_acc"], out.loc[0, "paper_acc_std"], out.loc[0, "paper_fgt"]) == (80.83, 2.0, 4.49)
    assert math.isnan(out.loc[1, "paper_acc"])  # table 7 is not linked
    out = attach_paper_continual(table, {**link, "table": [7], "method_map": {"gp": "Project (>90)"}}, ref)
    assert out.loc[1, "paper_acc"] == 70.0 and math.isnan(out.loc[0, "paper_acc"])
    check_paper_link(link, str(ref), "experiments[0].paper")
    with pytest.raises(FedForgetError, match=r"paper 'p' table '12' has no rows"):
        check_paper_link({**link, "table": [1, 12]}, str(ref), "experiments[0].paper")
    with pytest.raises(FedForgetError, match=r"dataset_map.digits-task-il=\{'setting': 'x'\}"):
        check_paper_link({**link, "dataset_map": {"digits-task-il": {"setting": "x"}}}, str(ref), "experiments[0].paper")
    # a list of paper columns, one scored task-aware (FedGP's task-IL from the class-IL runs)
    cols = [{"dataset": "split-cifar10", "setting": "class-il"}, {"dataset": "split-cifar10", "setting": "task-il", "scored": "task_aware"}]
    check_paper_link({**link, "dataset_map": {"digits": cols}}, str(ref), "experiments[0].paper", {"digits": True})
    with pytest.raises(FedForgetError, match=r"dataset_map.digits.scored='aware'; allowed: \['task_aware'\]"):
        check_paper_link({**link, "dataset_map": {"digits": [{**cols[1], "scored": "aware"}]}}, str(ref), "experiments[0].paper")
    with pytest.raises(FedForgetError, match=r"dataset_map.digits-task-il.scored='task_aware': dataset 'digits-task-il' has no task-aware"):
        check_paper_link({**link, "dataset_map": {"digits-task-il": cols}}, str(ref), "experiments[0].paper", {"digits-task-il": False})
    with pytest.raises(FedForgetError, match=r"dataset_map.digits=\[\]"):
        check_paper_link({**link, "dataset_map": {"digits": []}}, str(ref), "experiments[0].paper")


def test_cells_on_another_client_engine_are_marked():
    """A cell whose runs trained on another client engine than most of its column is
    marked in table.md and table.html; one engine throughout marks nothing."""
    runs = _runs().assign(client_engine="sequential")
    table = summarise(runs)
    assert not table["other_engine"].any() and "†" not in markdown(attach_paper(table, None, None), "e")
    runs.loc[(runs["setting"] == "dirichlet-0.1") & (runs["method"] == "fedavg"), "client_engine"] = "vectorized"
    runs = pd.concat([runs, runs[runs["method"] == "fedprox"].assign(method="moon", client_engine="sequential")])
    table = attach_paper(summarise(runs), None, None)
    assert list(table[table["other_engine"]]["method"]) == ["fedavg"]
    assert _row(table, "dirichlet-0.1", "fedavg")["client_engine"] == "vectorized"
    md = markdown(table, "e")
    assert "± 7.07 (failed seeds) † vectorized" in md and md.count("† vectorized") == 2 and "another client engine" in md  # final and best
    assert "† vectorized" in html_table(table, "e")


# ----------------------------------------------------------------------------- continual runs

# a[t][i] of the continual fake runs (seed s adds 0.02 s to every entry) and b[i] (round 0)
A = [[0.9, 0.1, 0.2], [0.6, 0.8, 0.3], [0.5, 0.7, 0.9]]
B = [0.1, 0.05, 0.1]
T, R = 3, 2
PARTITION = {"scheme": "dirichlet", "clients": 3, "alpha": 0.5, "min_size": 10, "max_redraws": 1000, "seed": 0}


def _task_rows(seed: int, last_round: int, tasks: int = T, rounds_per_task: int = R) -> str:
    """tasks.csv of a run whose accuracy on task i is A[t][i] + 0.02 seed at the last round of
    task t, B[i] at round 0 and 0.5 elsewhere; rows up to ``last_round``."""
    lines = ["round,current_task,task,accuracy,loss"]
    for r in range(last_round + 1):
        cur = min(max(r - 1, 0) // rounds_per_task, tasks - 1)
        for i in range(tasks):
            if r == 0:
                acc = B[i] if tasks == T else 0.1
            elif r % rounds_per_task == 0 and tasks == T:
                acc = A[r // rounds_per_task - 1][i] + 0.02 * seed
            else:
                acc = 0.5
            lines.append(f"{r},{cur},{i},{acc!r},1.0")
    return "\n".join(lines) + "\n"


def write_run(d, method, seed, status="completed", dataset="digits", scenario=None, last_round=None, final=0.8):
    """A finished run directory as the runner writes it: run.json, metrics.csv, tasks.csv
    (every run has one; a one-task run's holds task 0 only)."""
    d.mkdir(parents=True)
    rounds = T * R if scenario else 2
    cfg = {"experiment": "e", "seed": seed, "method": {"label": method}, "dataset": {"label": dataset},
           "partition": PARTITION, "train": {"rounds": rounds}}  # fmt: skip
    if scenario:
        cfg["dataset"]["scenario"] = scenario
    ok = status == "completed"
    rec = {"status": status, "config": cfg, "config_hash": f"h{seed}", "final_global_model_test_acc": final + seed / 10 if ok else None,
           "best_global_model_test_acc": final + 0.05 + seed / 10 if ok else None, "rounds_completed": rounds,
           "versions": {"torch": "x"}, "client_engine": "sequential"}  # fmt: skip
    (d / "run.json").write_text(json.dumps(rec))
    (d / "metrics.csv").write_text("round,global_model_test_acc\n0,0.1\n1,0.5\n2,0.7\n")
    if scenario:
        (d / "tasks.csv").write_text(_task_rows(seed, rounds if last_round is None else last_round))
    else:
        (d / "tasks.csv").write_text(_task_rows(seed, rounds, tasks=1, rounds_per_task=rounds))
    return d


SCENARIO = {"kind": "split", "tasks": T, "classes_per_task": 2, "incremental": "class", "rounds_per_task": R}


def write_continual_experiment(root):
    """Two methods x two completed seeds and a diverged third (rows up to round 3) of a split
    scenario, and a one-task run of another dataset in the same experiment."""
    dirs = []
    for m in ("fedavg", "fedprotip"):
        for seed in (0, 1):
            dirs.append(write_run(root / m / f"s{seed}", m, seed, scenario=SCENARIO))
        dirs.append(write_run(root / m / "s2", m, 2, "diverged", scenario=SCENARIO, last_round=3))
    dirs.append(write_run(root / "plain" / "s0", "fedavg", 0, dataset="iris"))
    return dirs


ONE_TASK_FILES = {"table.csv", "table.md", "table.html", "runs.csv", "metrics.parquet"}

# table.csv and table.md of the one-task runs below as the code before continual runs wrote
# them (commit 7cc0342): a one-task experiment's summary must not change
ONE_TASK_TABLE_CSV = """\
experiment,dataset,setting,clients,partition_seed,method,n_seeds,n_failed,final_acc_mean,final_acc_std,best_acc_mean,best_acc_std,status,client_engine,other_engine,paper_acc,paper_std
e,digits,dirichlet-0.5,3,0,fedavg,3,1,85.0,7.0710678118654755,90.0,7.071067811865465,failed,sequential,False,,
e,digits,dirichlet-0.5,3,0,fedprox,3,1,85.0,7.0710678118654755,90.0,7.071067811865465,failed,sequential,False,,
"""
ONE_TASK_TABLE_MD = """\
# e

## Final-round global-model accuracy on the full test set (%), mean ± std over seeds

| method | digits dirichlet-0.5 |
|---|---|
| fedavg | 85.00 ± 7.07 (failed seeds) |
| fedprox | 85.00 ± 7.07 (failed seeds) |

## Best-round global-model accuracy on the full test set (%), mean ± std over seeds

| method | digits dirichlet-0.5 |
|---|---|
| fedavg | 90.00 ± 7.07 (failed seeds) |
| fedprox | 90.00 ± 7.07 (failed seeds) |

Seeds per cell: 3. std is the sample standard deviation (ddof = 1) over completed seeds; 'n = 1': a single completed seed (no std); 'failed seeds': some seeds diverged or failed; 'failed': every seed did.
"""
ONE_TASK_RUNS_COLUMNS = (
    "experiment,dataset,setting,clients,partition_seed,method,seed,status,final_global_model_test_acc,"
    "best_global_model_test_acc,rounds_completed,wall_time_s,config_hash,fedforget_version,torch_version,"
    "device,client_engine,run_dir"
)


def test_one_task_experiment_summary_is_what_it_was_before_continual_runs(tmp_path):
    """Runs without a scenario (each with its task-0 tasks.csv, as the runner now writes):
    exactly the five summary files, with the bytes the pre-continual code wrote; continual
    files left by an earlier continual version of the experiment are removed."""
    from fedforget.aggregate import CONTINUAL_OUTPUTS, aggregate

    dirs = [write_run(tmp_path / m / f"s{s}", m, s, st)
            for m in ("fedavg", "fedprox") for s, st in ((0, "completed"), (1, "completed"), (2, "diverged"))]  # fmt: skip
    out = tmp_path / "summary"
    out.mkdir()
    for f in CONTINUAL_OUTPUTS:
        (out / f).write_text("stale")
    aggregate(dirs, out, "e")
    assert {f.name for f in out.iterdir()} == ONE_TASK_FILES
    assert (out / "table.csv").read_text() == ONE_TASK_TABLE_CSV
    assert (out / "table.md").read_text() == ONE_TASK_TABLE_MD
    assert (out / "runs.csv").read_text().splitlines()[0] == ONE_TASK_RUNS_COLUMNS
    assert "ontinual" not in (out / "table.html").read_text()
    metrics = pd.read_parquet(out / "metrics.parquet")
    assert list(metrics.columns) == ["round", "global_model_test_acc", "experiment", "dataset", "setting",
                                     "clients", "partition_seed", "method", "seed"]  # fmt: skip


def test_the_largest_seed_a_config_allows_is_stored(tmp_path):
    """A run seed and a partition seed at the schema's maximum (2**63 - 1) aggregate into
    metrics.parquet and runs.csv; the schema stops there because the tables store seeds as
    signed 64-bit integers (a seed of 2**64 trained, then failed the aggregation)."""
    from fedforget.aggregate import aggregate
    from fedforget.validation import schema

    top = schema()["$defs"]["seed"]["maximum"]
    assert top == 2**63 - 1
    d = write_run(tmp_path / "fedavg" / "s", "fedavg", top)
    cfg = json.loads((d / "run.json").read_text())
    cfg["config"]["partition"] = {**PARTITION, "seed": top}
    (d / "run.json").write_text(json.dumps(cfg))
    out = tmp_path / "summary"
    out.mkdir()
    aggregate([d], out, "e")
    metrics = pd.read_parquet(out / "metrics.parquet")
    assert set(metrics["seed"]) == {top} and set(metrics["partition_seed"]) == {top}
    assert str(top) in (out / "runs.csv").read_text()


def test_continual_runs_csv_tasks_and_matrices(tmp_path):
    from fedforget.aggregate import CONTINUAL_OUTPUTS, aggregate
    from fedforget.continual import continual_metrics

    out = tmp_path / "summary"
    aggregate(write_continual_experiment(tmp_path / "runs"), out, "e")
    assert {f.name for f in out.iterdir()} == ONE_TASK_FILES | set(CONTINUAL_OUTPUTS)
    runs = pd.read_csv(out / "runs.csv")
    cols = list(runs.columns)
    at = cols.index("best_global_model_test_acc") + 1
    assert cols[at : at + 9] == ["scenario", "incremental", "tasks", "rounds_per_task", "acc", "fgt", "ft", "bwt", "fwt"]
    want = continual_metrics(A, B)
    r = runs[(runs["method"] == "fedavg") & (runs["seed"] == 0) & (runs["dataset"] == "digits")].iloc[0]
    assert (r["scenario"], r["incremental"], r["tasks"], r["rounds_per_task"]) == ("split", "class", 3, 2)
    for m, v in want.items():
        assert r[m] == pytest.approx(v), m
    r1 = runs[(runs["method"] == "fedavg") & (runs["seed"] == 1)].iloc[0]
    assert r1["acc"] == pytest.approx(0.72) and r1["fgt"] == pytest.approx(0.25)  # every entry + 0.02
    # Acc_t after each task t (FedGP Fig. 5's Acc_5 compares with these), by hand from A
    after = [f"avg_acc_after_task_{t}" for t in (1, 2, 3)]
    assert [r[c] for c in after] == pytest.approx([0.9, (0.6 + 0.8) / 2, (0.5 + 0.7 + 0.9) / 3])
    assert r1[after[1]] == pytest.approx(0.72)  # (0.62 + 0.82) / 2
    diverged = runs[runs["status"] == "diverged"]
    assert len(diverged) == 2 and diverged[["acc", "fgt", "ft", "bwt", "fwt", *after]].isna().all().all()
    plain = runs[runs["dataset"] == "iris"].iloc[0]
    assert plain["tasks"] == 1 and plain["scenario"] == "none"
    assert pd.isna(plain[["acc", "fgt", "ft", "bwt", "fwt", *after]]).all()

    tasks = pd.read_parquet(out / "tasks.parquet")
    assert set(tasks["dataset"]) == {"digits"}  # the one-task run's tasks.csv is not collected
    assert len(tasks) == 4 * (T * R + 1) * T + 2 * 4 * T  # four full runs, two up to round 3
    assert {"round", "current_task", "task", "accuracy", "loss", "method", "seed"} <= set(tasks.columns)

    mat = pd.read_csv(out / "accuracy_matrix.csv")
    assert list(mat.columns) == ["experiment", "dataset", "setting", "clients", "partition_seed", "method", "seed",
                                 "after_task", "task", "accuracy"]  # fmt: skip
    assert len(mat) == 6 * T * T
    s0 = mat[(mat["method"] == "fedavg") & (mat["seed"] == 0)]
    assert s0["accuracy"].to_numpy().reshape(T, T).tolist() == A
    s2 = mat[(mat["method"] == "fedavg") & (mat["seed"] == 2)].sort_values(["after_task", "task"])
    assert s2["accuracy"].notna().tolist() == [True] * T + [False] * (2 * T)  # stopped in task 2 (0-based 1)


def test_other_inference_modes_of_a_method_become_acc_and_ft_columns(tmp_path):
    """A method's extra tasks.csv column (``eval_counts``, e.g. FedProTIP's task_aware) gives
    runs.csv acc_<mode> / ft_<mode> from its own accuracy matrix (NaN for methods without
    it), and continual.csv / .md their mean ± std over seeds; likewise the MB per client and
    task of a method with communication columns, and its MB per task by part."""
    from fedforget.aggregate import aggregate
    from fedforget.continual import continual_metrics

    dirs = write_continual_experiment(tmp_path / "runs")
    for d in dirs:
        if "fedprotip" in str(d):  # task_aware: 0.5 + 0.1 task in every round
            df = pd.read_csv(d / "tasks.csv")
            df["task_aware"] = 0.5 + 0.1 * df["task"]
            (d / "tasks.csv").write_text(df.to_csv(index=False))
            (d / "metrics.csv").write_text("round,global_model_test_acc,fedprotip_comm_task_mb,fedprotip_comm_bases_mb\n"
                                           "0,0.1,,\n1,0.4,,\n2,0.5,0.5,0.25\n4,0.6,1.5,0.125\n6,0.7,1.0,0.0\n")  # fmt: skip
    out = tmp_path / "summary"
    aggregate(dirs, out, "e")
    runs = pd.read_csv(out / "runs.csv")
    aware = np.array([[0.5, 0.6, 0.7]] * T)  # every round: 0.5 + 0.1 task
    want = continual_metrics(aware)
    ok = runs[(runs["method"] == "fedprotip") & (runs["status"] == "completed")]
    assert ok["acc_task_aware"].tolist() == pytest.approx([want["acc"]] * 2)
    assert ok["ft_task_aware"].tolist() == pytest.approx([want["ft"]] * 2)
    # and its Acc_t after each task (FedProTIP Table 14 reads task_id_batch's): 0.5, 0.55, 0.6
    after = [f"avg_acc_after_task_{t}_task_aware" for t in (1, 2, 3)]
    assert ok[after].values.ravel().tolist() == pytest.approx([0.5, 0.55, 0.6] * 2)
    assert runs[runs["method"] == "fedavg"][["acc_task_aware", "ft_task_aware"]].isna().all().all()
    assert runs[runs["status"] == "diverged"]["acc_task_aware"].isna().all()
    table = pd.read_csv(out / "continual.csv")
    row = table[table["method"] == "fedprotip"].iloc[0]
    assert row["acc_task_aware_mean"] == pytest.approx(60.0) and row["acc_task_aware_std"] == pytest.approx(0.0)
    md = (out / "continual.md").read_text()
    assert "## ACC: mean accuracy over all tasks after the last task, task-aware" in md
    assert "## Forgetting FT (FedProTIP eq. 16; lower is better), task-aware" in md
    assert "## Forward transfer FWT (Lopez-Paz & Ranzato 2017), task-aware" in md  # every metric of the task-aware scores
    section = md.split("## ACC: mean accuracy over all tasks after the last task, task-aware")[1].split("##")[0]
    assert "| fedprotip | 60.00 ± 0.00 (failed seeds) |" in section and "fedavg" not in section
    # MB per client and task: the mean of the run's <method>_comm_task_mb (task-end rows)
    assert ok["comm_task_mb"].tolist() == [1.0, 1.0] and runs[runs["method"] == "fedavg"]["comm_task_mb"].isna().all()
    # and each task's MB by part, from the row of the task's last round (tasks end at rounds 2, 4, 6)
    parts = [f"comm_bases_mb_task_{t}" for t in (1, 2, 3)]
    assert ok[parts].values.tolist() == [[0.25, 0.125, 0.0]] * 2
    assert runs[(runs["method"] == "fedavg") | (runs["status"] == "diverged")][parts].isna().all().all()
    comm = md.split("## Communication per client and task")[1].split("##")[0]
    assert "| fedprotip | 1.0000 ± 0.0000 |" in comm and "fedavg" not in comm
    assert "MB per client and task" in (out / "continual.html").read_text()
    assert "ACC task-aware (%)" in (out / "continual.html").read_text()


def test_task_streams_show_no_best_round(tmp_path):
    """A task stream's best round comes before its later tasks exist (issue 35, 4): table.csv
    leaves it empty for those rows, table.md and table.html show none for them and say why; a
    one-task row of the same experiment keeps its best round; wide tables scroll."""
    from fedforget.aggregate import STREAM_NOTE, aggregate

    out = tmp_path / "summary"
    aggregate(write_continual_experiment(tmp_path / "runs"), out, "e")
    table = pd.read_csv(out / "table.csv")
    stream, plain = table[table["dataset"] == "digits"], table[table["dataset"] == "iris"]
    assert stream["task_stream"].all() and stream["best_acc_mean"].isna().all()
    assert not plain["task_stream"].any() and plain["best_acc_mean"].notna().all()
    md = (out / "table.md").read_text()
    best = md.split("## Best-round")[1]
    assert STREAM_NOTE in md and "100.00" not in best
    html_text = (out / "table.html").read_text()
    assert '<div class="scroll">' in html_text and "overflow-x: auto" in html_text
    assert '<div class="scroll">' in (out / "continual.html").read_text()


def test_continual_table_over_seeds_with_paper_numbers(tmp_path):
    from fedforget.aggregate import aggregate

    ref = tmp_path / "paper.csv"
    ref.write_text(
        "paper,table,dataset,setting,method,metric,value,std\n"
        "P,1,DIGITS,dirichlet-0.5,FedProTIP,ACC,87.94,\n"
        "P,1,DIGITS,dirichlet-0.5,FedProTIP,FT,1.30,\n"
        "P,1,DIGITS,dirichlet-0.5,FedAvg,acc_T,18.92,1.5\n"
        "P,1,DIGITS,dirichlet-0.5,FedAvg,loss,0.5,\n"
        "P,2,DIGITS,dirichlet-0.5,FedAvg,FT,63.2,\n"  # another table of the paper
    )
    paper = {"name": "P", "table": 1, "dataset_map": {"digits": "DIGITS"}}
    out = tmp_path / "summary"
    aggregate(write_continual_experiment(tmp_path / "runs"), out, "e", paper, ref)
    t = pd.read_csv(out / "continual.csv")
    assert list(t["method"]) == ["fedavg", "fedprotip"]  # continual groups only (no iris row)
    a = t[t["method"] == "fedavg"].iloc[0]
    # two completed seeds: ACC 70 and 72 (%), the diverged third counted as failed
    assert a["acc_mean"] == pytest.approx(71.0) and a["acc_std"] == pytest.approx(math.sqrt(2))
    assert a["fgt_mean"] == pytest.approx(25.0) and a["ft_mean"] == pytest.approx(50 / 3)
    assert a["bwt_mean"] == pytest.approx(-25.0) and a["fwt_mean"] == pytest.approx((12.5 + 14.5) / 2)  # seed 1: a + 0.02, b fixed
    assert (a["n_seeds"], a["n_failed"], a["status"]) == (3, 1, "failed")
    assert (a["tasks"], a["rounds_per_task"], a["scenario"]) == (3, 2, "split")
    assert a["paper_acc"] == 18.92 and a["paper_acc_std"] == 1.5 and pd.isna(a["paper_ft"])
    p = t[t["method"] == "fedprotip"].iloc[0]
    assert p["paper_acc"] == 87.94 and p["paper_ft"] == 1.3 and pd.isna(p["paper_fgt"])
    md = (out / "continual.md").read_text()
    assert md.startswith("# e: continual metrics\n")
    assert "digits dirichlet-0.5: split, 3 tasks x 2 rounds, class-incremental" in md
    fedprotip = [line for line in md.splitlines() if line.startswith("| fedprotip |")]
    assert len(fedprotip) == 5  # ACC, Fgt_T, FT, BWT, FWT
    assert "71.00 ± 1.41 (failed seeds) (paper 18.92)" in md
    assert fedprotip[0].endswith("(paper 87.94) |") and fedprotip[2].endswith("(paper 1.30) |")
    assert "paper" not in fedprotip[1] + fedprotip[3] + fedprotip[4]
    page = (out / "continual.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page
    for text in ("<th>ACC (%)</th>", "<th>Forgetting Fgt_T (%)</th>", "<th>Forgetting FT (%)</th>",
                 "<th>Paper ACC (%)</th>", "<th>Paper Forgetting FT (%)</th>", "<td>87.94</td>", "<td>18.92 ± 1.50</td>"):  # fmt: skip
        assert text in page, text
    assert "Paper Forgetting Fgt_T" not in page  # no Fgt_T number in the paper results: no column
    # the summary table beside it is unchanged in kind: ACC-like paper numbers beside final accuracy
    assert pd.read_csv(out / "table.csv").set_index("method").loc["fedprotip", "paper_acc"] == 87.94


def test_continual_group_with_every_seed_failed(tmp_path):
    from fedforget.aggregate import aggregate

    dirs = [write_run(tmp_path / f"s{s}", "fedavg", s, "diverged", scenario=SCENARIO, last_round=3) for s in (0, 1)]
    aggregate(dirs, tmp_path / "summary", "e")
    t = pd.read_csv(tmp_path / "summary" / "continual.csv")
    assert t.iloc[0]["status"] == "failed" and pd.isna(t.iloc[0]["acc_mean"])
    md = (tmp_path / "summary" / "continual.md").read_text()
    assert md.count("| fedavg | failed |") == 5


def test_tables_say_which_gpm_rank_rule_ran(tmp_path):
    """GPM's rows (also under FedGP) name the task-0 rank rule in the tables' notes; a
    method without such a switch adds nothing (issue 36, 4)."""
    from fedforget.aggregate import aggregate, method_note

    assert method_note({"name": "gpm", "params": {}}).startswith("GPM task0_rank=paper")
    assert method_note({"name": "gpm", "params": {"task0_rank": "code"}}).startswith("GPM task0_rank=code")
    assert method_note({"name": "fedgp", "params": {"base": "gpm", "base_params": {"task0_rank": "code"}}}).startswith(
        "GPM task0_rank=code"
    )
    assert method_note({"name": "fedavg", "params": {}}) == method_note({"name": "gone", "params": {}}) == ""
    dirs = []
    for label, name in (("FL", "fedavg"), ("FL+GPM", "gpm")):
        d = write_run(tmp_path / label, label, 0)
        rec = json.loads((d / "run.json").read_text())
        rec["config"]["method"]["name"] = name
        (d / "run.json").write_text(json.dumps(rec))
        dirs.append(d)
    aggregate(dirs, tmp_path / "summary", "e")
    md = (tmp_path / "summary" / "table.md").read_text()
    assert "Method variants: FL+GPM: GPM task0_rank=paper" in md and "FL:" not in md.split("Method variants")[1]
    assert "FL+GPM: GPM task0_rank=paper" in (tmp_path / "summary" / "table.html").read_text()


def test_a_collapsed_model_is_marked_in_its_cells(tmp_path):
    """Issue 36, 2: a task-stream run whose global model gave 95 % of the current task's test
    rows one class (global_model_test_top_pred_share) is counted in its cells, continual and
    summary tables alike; a run without the column (older, one-task) marks nothing."""
    from fedforget.aggregate import aggregate

    dirs = write_continual_experiment(tmp_path / "runs")
    for d in dirs:
        if "plain" in str(d):
            continue
        share = "0.99" if d.name == "s0" and "fedprotip" in str(d) else "0.5"
        (d / "metrics.csv").write_text(
            f"round,global_model_test_acc,global_model_test_top_pred_share\n0,0.1,1.0\n1,0.5,{share}\n2,0.7,0.5\n"
        )
    out = tmp_path / "summary"
    aggregate(dirs, out, "e")
    runs = pd.read_csv(out / "runs.csv")
    hit = runs[runs["collapsed_round"].notna()]
    assert hit[["method", "seed", "collapsed_round"]].values.tolist() == [["fedprotip", 0, 1.0]]  # round 0 ignored
    md = (out / "continual.md").read_text()
    assert "(collapsed: 1 of 3 seeds)" in md.split("| fedprotip |")[1].split("\n")[0]
    assert "collapsed" not in md.split("| fedavg |")[1].split("\n")[0]
    assert "(collapsed: 1 of 3 seeds)" in (out / "table.md").read_text()
    assert "collapsed" not in (out / "continual.html").read_text().split("fedavg")[1].split("</tr>")[0]


def test_a_run_left_running_is_unfinished_not_failed(tmp_path):
    """A run.json still 'running' (a job that stopped before its end) is an unfinished seed,
    as paper.csv counts it, not a failed one; with none, table.csv has no such column."""
    from fedforget.aggregate import aggregate

    dirs = [write_run(tmp_path / f"s{s}", "fedavg", s, st) for s, st in ((0, "completed"), (1, "completed"), (2, "running"))]
    out = tmp_path / "summary"
    aggregate(dirs, out, "e")
    t = pd.read_csv(out / "table.csv")
    assert (t["n_failed"].iloc[0], t["n_unfinished"].iloc[0], t["status"].iloc[0]) == (0, 1, "unfinished")
    assert "± 7.07 (unfinished seeds)" in (out / "table.md").read_text()


def test_a_cell_two_linked_tables_print_comes_from_the_first_in_the_link():
    """table.csv's paper number where two linked tables print the cell: the first of the
    link's ``table`` list, whatever the order of the results file's rows."""
    from fedforget.aggregate import _paper_number

    ref = pd.DataFrame({"paper": ["p", "p"], "table": [17, 1], "dataset": ["c"] * 2, "setting": ["iid"] * 2,
                        "method": ["M"] * 2, "metric": ["FT"] * 2, "value": ["0.34", "1.30"], "std": ["0.59", ""]})  # fmt: skip
    row = pd.Series({"dataset": "c", "setting": "iid", "method": "M"})
    assert _paper_number(ref, {"name": "p", "table": [1, 17]}, row, ["FT"])[0] == 1.30
    assert _paper_number(ref, {"name": "p", "table": [17, 1]}, row, ["FT"]) == (0.34, 0.59)


def test_an_empty_continual_cell_carries_no_collapse_mark():
    """A column the runs have no score for (e.g. the task-aware scores of a task-IL stream)
    reads empty, not '(collapsed: ...)' alone."""
    from fedforget.aggregate import _continual_cell

    r = pd.Series({"acc_mean": math.nan, "acc_std": math.nan, "status": "ok", "n_collapsed": 3, "n_seeds": 3,
                   "other_engine": False, "client_engine": "sequential"})  # fmt: skip
    assert _continual_cell(r, "acc") == ""
    scored = r.copy()
    scored["acc_mean"], scored["acc_std"] = 50.0, 1.0
    assert _continual_cell(scored, "acc") == "50.00 ± 1.00 (collapsed: 3 of 3 seeds)"


def test_evaluation_reports_the_top_predicted_share_of_task_streams(data_root, tmp_path):
    """A model that predicts class 0 for every row: share 1 on the current task."""
    import torch

    from fedforget.clientdata import TestSets
    from fedforget.data.scenario import Scenario
    from fedforget.evaluation import TOP_SHARE, Evaluator
    from fedforget.methods.base import ServerContext

    sc = Scenario.build({"kind": "split", "tasks": 2, "classes_per_task": 2, "class_order": "natural",
                         "incremental": "class", "rounds_per_task": 1, "heads": "shared", "boundaries": "sync",
                         "seed": 0, "rotation": [0, 180]}, 4, (3,), 2)  # fmt: skip
    y = torch.tensor([0, 1, 0, 1, 2, 3, 2, 3])
    test = TestSets(torch.rand(8, 3), y, [torch.arange(4), torch.arange(4, 8)])

    class Zero(torch.nn.Module):
        def logits(self, x, task=None):
            return torch.tensor([[1.0, 0.0, 0.0, 0.0]]).expand(len(x), 4)

    server = ServerContext(0, {}, Zero(), torch.device("cpu"), None)
    ev = Evaluator(test, sc, _fedavg(), server, 4)
    row, _ = ev.global_model(Zero(), 1, 4, ())
    assert row[TOP_SHARE] == 1.0
    one = Scenario.build(None, 4, (3,), 2)
    test1 = TestSets(torch.rand(8, 3), y, [torch.arange(8)])
    row1, _ = Evaluator(test1, one, _fedavg(), server, 4).global_model(Zero(), 0, 4, ())
    assert TOP_SHARE not in row1  # one-task runs keep their columns


def _fedavg():
    """FedAvg's hooks without a run (its evaluation hooks read nothing of the run)."""
    from fedforget.methods import FedAvg

    return FedAvg.__new__(FedAvg)
