"""Per-task partitions (``per_task: true``) and dirichlet's ``min_per_class`` [P FedGP Sec.
5.1.1: each task's data split among the clients; FedProTIP App.: every client holds a sample
of every class of its task]: the scheme drawn on each task's rows apart, each task's minimum
met, the same bytes from the same seed, each task's draw its own stream; partitions drawn
over the pool keep their bytes and keys; bad settings named before any job."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from fedforget.data import load_dataset
from fedforget.data.tasks import row_tasks, task_rows
from fedforget.parse import parse_config
from fedforget.partition import PartitionSpec, class_counts, make_partition, partition_dataset
from fedforget.utils import FedForgetError

SPLIT = {"kind": "split", "tasks": 5, "classes_per_task": 2, "class_order": "natural", "seed": 0}


@pytest.fixture(scope="module")
def digits(data_root):
    return load_dataset("digits", data_root)


def per_task(spec: PartitionSpec, rows=SPLIT) -> PartitionSpec:
    return replace(spec, per_task=True, tasks=rows)


@pytest.mark.parametrize(
    "spec",
    [
        PartitionSpec("dirichlet", clients=10, alpha=0.1, min_size=3, seed=0),
        PartitionSpec("dirichlet", clients=10, alpha=0.3, min_size=2, min_per_class=1, seed=3),
        PartitionSpec("shards", clients=10, shards_per_client=2, seed=1),
        PartitionSpec("iid", clients=7, seed=2),
    ],
)
def test_every_client_holds_each_task_and_its_minimum(digits, spec):
    spec = per_task(spec)
    a = partition_dataset(digits, spec)
    task = row_tasks(SPLIT, digits.y_train, 10)
    assert (a >= 0).all()  # every class is in a task: every row is some client's
    sizes = class_counts(a, task, spec.clients, 5)  # [clients, tasks]
    assert sizes.min() >= max(spec.min_size if spec.scheme == "dirichlet" else 1, 1)
    if spec.min_per_class:
        assert class_counts(a, digits.y_train, spec.clients, 10).min() >= spec.min_per_class
    assert np.array_equal(a, partition_dataset(digits, spec))  # same seed, same bytes


def test_drawn_over_the_pool_a_client_may_miss_a_task_per_task_it_does_not(digits):
    """The issue's case: Dirichlet 0.3 over 10 clients of split digits (fedgp_table1)."""
    pool = PartitionSpec("dirichlet", clients=10, alpha=0.3, min_size=10, seed=0)
    task = row_tasks(SPLIT, digits.y_train, 10)
    sizes = {
        s.slug: class_counts(partition_dataset(digits, s), task, 10, 5).min()
        for s in (pool, per_task(replace(pool, min_size=2)))
    }
    assert sizes[pool.slug] == 0 and min(sizes.values()) == 0 and max(sizes.values()) >= 2


def test_each_task_is_its_own_stream(digits):
    """Task t's rows are drawn from (seed, t): a stream that drops its last task leaves
    the other tasks' assignments as they were."""
    spec = per_task(PartitionSpec("dirichlet", clients=5, alpha=0.5, min_size=2, seed=0))
    four = {**SPLIT, "tasks": 4}
    a5, a4 = partition_dataset(digits, spec), partition_dataset(digits, replace(spec, tasks=four))
    in4 = row_tasks(four, digits.y_train, 10) >= 0
    assert np.array_equal(a5[in4], a4[in4]) and (a4[~in4] == -1).all()


def test_domains_tasks_are_the_rows_domains():
    y = np.arange(12) % 3
    domain = np.repeat([0, 1], 6)
    rows = {"kind": "domains", "tasks": 2}
    spec = per_task(PartitionSpec("iid", clients=3), rows)
    a = make_partition(y, spec, num_classes=3, domain=domain)
    for t in (0, 1):
        assert sorted(np.bincount(a[domain == t], minlength=3)) == [2, 2, 2]


def test_pool_partitions_keep_their_bytes_and_keys(digits):
    """per_task false and min_per_class 0 are absent from the spec's record (config hashes
    and partition folders unchanged) and draw the same assignment as before them."""
    spec = PartitionSpec("dirichlet", clients=10, alpha=0.3, min_size=10, seed=0)
    assert set(spec.to_dict()) == {"scheme", "clients", "alpha", "min_size", "max_redraws", "seed"}
    assert spec.slug == "dirichlet-0.3_k10_min10_ps0"
    assert np.array_equal(partition_dataset(digits, spec), make_partition(digits.y_train, spec))
    pt = per_task(replace(spec, min_per_class=1))
    assert pt.to_dict()["tasks"] == SPLIT and pt.slug.startswith("dirichlet-0.3_k10_min10_mpc1_pertask-")
    assert pt.slug != per_task(spec, {**SPLIT, "class_order": "shuffled"}).slug


def test_task_rows_are_what_decides_a_tasks_rows():
    base = {**SPLIT, "incremental": "class", "rounds_per_task": 5, "heads": "shared", "boundaries": "sync"}
    assert task_rows(base) == task_rows({**base, "incremental": "task", "heads": "per_task"}) == SPLIT
    assert task_rows({**base, "kind": "rotated"}) is None and task_rows(None) is None


@pytest.mark.parametrize(
    "spec, match",
    [
        (PartitionSpec("dirichlet", clients=10, alpha=0.3, min_size=2, min_per_class=20), "class 0 has"),
        (PartitionSpec("dirichlet", clients=10, alpha=0.3, min_size=40), r"partition \(task 0\): .*min_size=40"),
        (PartitionSpec("shards", clients=10, shards_per_client=2, min_per_class=1), "min_per_class=1 is for scheme dirichlet"),
    ],
)
def test_infeasible_per_task_settings_name_the_task_or_value(digits, spec, match):
    with pytest.raises(FedForgetError, match=match):
        partition_dataset(digits, per_task(spec))


def _config(tmp_path, partition, scenario):
    return {
        "data_dir": "data", "results_dir": str(tmp_path / "results"),
        "experiments": [{
            "name": "e", "datasets": [{"name": "digits", "model": "mlp", "scenario": scenario}],
            "partitions": [partition], "methods": [{"name": "fedavg"}], "seeds": [0],
            "train": {"rounds": 2, "local_epochs": 1, "batch_size": 32},
        }],
    }  # fmt: skip


def test_config_binds_each_datasets_task_rows(tmp_path):
    part = {"scheme": "dirichlet", "alpha": 0.3, "clients": 4, "min_size": 2, "per_task": True}
    sc = {"kind": "split", "tasks": 2, "classes_per_task": 5, "rounds_per_task": 1}
    (rc,) = parse_config(_config(tmp_path, part, sc)).runs()
    assert rc.partition.tasks == {**SPLIT, "tasks": 2, "classes_per_task": 5}
    assert "pertask-" in str(rc.partition_dir)


def test_per_task_on_a_stream_whose_tasks_share_rows_is_the_pool(tmp_path):
    part = {"scheme": "iid", "clients": 4, "per_task": True}
    sc = {"kind": "rotated", "tasks": 2, "rounds_per_task": 1}
    (rc,) = parse_config(_config(tmp_path, part, sc)).runs()
    assert rc.partition == PartitionSpec("iid", clients=4)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_a_bad_min_per_class_is_named(value):
    from fedforget.partition import check_feasible

    with pytest.raises(FedForgetError, match=rf"p.min_per_class={value!r}; allowed: an integer >= 0"):
        check_feasible(PartitionSpec("dirichlet", clients=2, alpha=0.5, min_per_class=value), 100, "p")
