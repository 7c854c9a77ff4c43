"""Split streams whose neighbouring tasks share classes (``scenario.class_overlap``, FedProTIP
Table 15 [P, fedprotip.md App. D.6]): the paper's two CIFAR-100 layouts, a shared class's rows
in both tasks (training and test), per-task partitions drawing them with the first task,
the run identity of disjoint splits unchanged, and methods that map each class to one task
refused before any job."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from fedforget.config import DatasetSpec, MethodSpec, OptimizerSpec, RunConfig, TrainSpec
from fedforget.data import load_dataset
from fedforget.data.scenario import resolve_scenario
from fedforget.data.tasks import row_tasks, scenario_rng, split_classes, task_rows
from fedforget.engine import Simulation
from fedforget.parse import parse_config
from fedforget.partition import PartitionSpec, partition_dataset
from fedforget.utils import FedForgetError

# digits' 10 classes in 3 tasks of 4, neighbours sharing 1: {0-3}, {3-6}, {6-9}
OVERLAP = {"kind": "split", "tasks": 3, "classes_per_task": 4, "class_overlap": 1, "rounds_per_task": 1}


@pytest.mark.parametrize("tasks,per_task,k", [(11, 10, 1), (14, 9, 2)])
@pytest.mark.parametrize("order", ["natural", "shuffled"])
def test_the_papers_layouts_cover_every_class_and_neighbours_share_k(tasks, per_task, k, order):
    """CIFAR-100: 1 shared class gives 11 tasks of 10, 2 give 14 tasks of 9 (App. D.6)."""
    classes = split_classes(tasks, per_task, order, 100, scenario_rng(0), k)
    assert len(classes) == tasks and all(len(c) == per_task for c in classes)
    assert set().union(*map(set, classes)) == set(range(100))
    for a in range(tasks):
        for b in range(a + 1, tasks):
            assert len(set(classes[a]) & set(classes[b])) == (k if b == a + 1 else 0), (a, b)
    if order == "natural":
        assert classes[1][0] == per_task - k and classes[-1][-1] == 99
    assert resolve_scenario({"kind": "split", "tasks": tasks, "classes_per_task": per_task, "class_overlap": k,
                             "rounds_per_task": 1}, 100, (3, 32, 32), "s")["class_overlap"] == k  # fmt: skip


def test_bad_overlaps_are_named_and_zero_is_the_disjoint_split():
    raw = {"kind": "split", "tasks": 3, "classes_per_task": 4, "rounds_per_task": 1}
    for bad in (4, -1, 1.5, True):
        with pytest.raises(FedForgetError, match=rf"s.class_overlap={bad!r}; allowed: an integer 0..3"):
            resolve_scenario({**raw, "class_overlap": bad}, 10, (1, 8, 8), "s")
    with pytest.raises(FedForgetError, match=r"3 x 4 with 1 shared by neighbouring tasks hold 10 classes, which is more than the dataset's 9 classes"):
        resolve_scenario({**raw, "class_overlap": 1}, 9, (1, 8, 8), "s")
    with pytest.raises(FedForgetError, match=r"with 2 shared by neighbouring tasks hold 8 classes, which leaves 2 of the dataset's 10 classes in no task"):
        resolve_scenario({**raw, "class_overlap": 2}, 10, (1, 8, 8), "s")
    assert resolve_scenario({**raw, "class_overlap": 2, "leftover_classes": "drop"}, 10, (1, 8, 8), "s")["class_overlap"] == 2
    with pytest.raises(FedForgetError, match=r"s.class_overlap is only for kind 'split'"):
        resolve_scenario({"kind": "permuted", "tasks": 2, "rounds_per_task": 1, "class_overlap": 1}, 10, (1, 8, 8), "s")
    # 0 is the disjoint split itself: the same resolved block, so the same run identity
    plain = {**raw, "tasks": 2, "classes_per_task": 5}
    assert resolve_scenario({**plain, "class_overlap": 0}, 10, (1, 8, 8), "s") == resolve_scenario(plain, 10, (1, 8, 8), "s")
    assert "class_overlap" not in task_rows(resolve_scenario(plain, 10, (1, 8, 8), "s"))


def _run(data_root, tmp_path, method="fedavg", scenario=OVERLAP, partition=None) -> RunConfig:
    s = resolve_scenario(scenario, 10, (1, 8, 8), "scenario")
    t = TrainSpec(rounds=s["tasks"] * s["rounds_per_task"], local_epochs=1, batch_size=32, sample_rate=1.0, threads=1,
                  device="cpu", client_engine="sequential", optimizer=OptimizerSpec(lr=0.1, momentum=0.5))  # fmt: skip
    part = partition or PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=10, seed=0)
    return RunConfig("t", DatasetSpec("digits", {}, "cnn2d", {}, None, "digits", s), part,
                     MethodSpec(method, {}, method), 0, t, str(data_root), str(tmp_path / "results"))  # fmt: skip


def test_a_shared_class_is_in_both_tasks_training_and_test(data_root, tmp_path):
    sim = Simulation(_run(data_root, tmp_path))
    sc, cd = sim.scenario, sim.clients
    assert sc.task_classes == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    for k in range(4):
        rows = [cd.rows[cd.task_view(k, t).start : cd.task_view(k, t).stop] for t in range(3)]
        for t in range(3):
            assert set(cd.y[rows[t]].tolist()) <= set(sc.task_classes[t])
        shared = rows[0][cd.y[rows[0]] == 3]
        assert sorted(shared.tolist()) == sorted(rows[1][cd.y[rows[1]] == 3].tolist())  # the same rows, twice
    for t in range(3):
        yt = sim.evaluator.test.y[sim.evaluator.test.rows[t]]
        assert set(yt.tolist()) == set(sc.task_classes[t])
    status, rows, msg = sim.run(progress=False)
    assert status == "completed", msg
    assert len(rows[-1]["_tasks"]) == 3


def test_a_per_task_partition_draws_a_shared_class_with_its_first_task(data_root):
    """Every client holds at least one row of every class of each task, the shared ones too
    (drawn in the first task, held in the next as drawn)."""
    rows = task_rows(resolve_scenario(OVERLAP, 10, (1, 8, 8), "s"))
    y = load_dataset("digits", data_root).y_train
    task = row_tasks(rows, y, 10)
    assert set(np.unique(y[task == 0])) == {0, 1, 2, 3} and set(np.unique(y[task == 1])) == {4, 5, 6}
    spec = PartitionSpec("dirichlet", clients=5, alpha=0.3, min_size=2, min_per_class=1, seed=0, per_task=True, tasks=rows)
    assignment = partition_dataset(load_dataset("digits", data_root), spec)
    for k in range(5):
        held = set(np.unique(y[assignment == k]).tolist())
        for cls in split_classes(3, 4, "natural", 10, scenario_rng(0), 1):
            assert set(cls) <= held, (k, cls)
    assert replace(spec, tasks=task_rows(resolve_scenario({**OVERLAP, "class_overlap": 0, "tasks": 2, "classes_per_task": 5}, 10, (1, 8, 8), "s"))).slug != spec.slug


def test_methods_that_map_each_class_to_one_task_are_refused_before_any_job(minimal_config):
    minimal_config["experiments"][0]["datasets"][0].update(
        name="digits", model="cnn2d", scenario={**OVERLAP, "rounds_per_task": 2}
    )
    minimal_config["experiments"][0]["train"] = {"rounds": 6}
    minimal_config["experiments"][0]["methods"] = [{"name": "fedavg"}, {"name": "der"}, {"name": "fot"}, {"name": "icarl"}]
    with pytest.raises(FedForgetError) as e:
        parse_config(minimal_config)
    msg = str(e.value)
    assert "class_overlap=1: method 'der' maps each class to one task (one_task_per_class)" in msg
    assert "method 'icarl' maps each class" in msg and "'fedavg' maps" not in msg and "'fot' maps" not in msg
    minimal_config["experiments"][0]["methods"] = [{"name": "fedavg"}, {"name": "fot"}]
    assert len(parse_config(minimal_config).runs()) == 2
