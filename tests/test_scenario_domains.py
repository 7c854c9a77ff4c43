"""Scenario kind ``domains`` (data/scenario.py): a stream whose tasks are the domains of a
multi-domain dataset, on a tiny DomainNet written here in its native format (class folders
plus the official-style ``<domain>_{train,test}.txt`` lists, 345 classes, 8x8 JPEGs).
Checks the per-domain row counts in meta.json (and under ``subset``), each task's rows in
both splits, a short run with one accuracy-matrix column per domain, the validation errors,
and the smoke scale's first-domains cap."""

from __future__ import annotations

import copy
import io
import json

import numpy as np
import pytest
import torch

from fedforget.config import DatasetSpec, MethodSpec, OptimizerSpec, RunConfig, TrainSpec
from fedforget.data import DATASETS, dataset_id, load_dataset, prepare_dataset
from fedforget.data.base import domain_ids
from fedforget.data.scenario import Scenario, resolve_scenario
from fedforget.parse import parse_config
from fedforget.partition import PartitionSpec
from fedforget.rundata import load_run_data
from fedforget.runner import run_training
from fedforget.smoke import smoke_config
from fedforget.utils import FedForgetError

CLASSES = 345
# per domain: (extra train rows of classes 0..3, test rows of classes 0..n-1); every class
# has one training row in the first domain written (the reader needs all 345 labels)
LAYOUT = {"clipart": (3, 4), "real": (1, 2), "sketch": (2, 3)}
DOMAINS = ["real", "clipart", "sketch"]  # task order != alphabetical order


def _jpeg(seed: int) -> bytes:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def dn(tmp_path_factory):
    """(data root, raw root, {domain: (train labels, test labels)}) of the tiny DomainNet."""
    root = tmp_path_factory.mktemp("dn")
    base = root / "raw" / "domainnet"
    blobs = [_jpeg(s) for s in range(8)]
    labels = {}
    for d, (extra, n_test) in LAYOUT.items():
        train = list(range(CLASSES)) if d == "real" else []
        train += [c % 4 for c in range(extra)]
        test = list(range(n_test))
        lists = {"train": [], "test": []}
        for split, ys in (("train", train), ("test", test)):
            for i, c in enumerate(ys):
                p = base / d / f"class_{c:03d}" / f"{split}_{i}.jpg"
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(blobs[(i + len(d)) % len(blobs)])
                lists[split].append(f"{d}/class_{c:03d}/{p.name} {c}")
            (base / f"{d}_{split}.txt").write_text("\n".join(lists[split]) + "\n")
        labels[d] = (sorted(train), sorted(test))  # rows are sorted by path within a domain
    return root, root / "raw", labels


def _prepare(dn, **opts):
    root, raw, _ = dn
    opts = {"domains": DOMAINS, "size": 8, **opts}
    prepare_dataset("domainnet", opts, root, raw_dir=raw)
    return load_dataset(dataset_id("domainnet", opts), root)


def test_meta_records_rows_per_domain_and_rows_are_grouped_by_domain(dn):
    data = _prepare(dn)
    _, _, labels = dn
    rec = data.meta["domains"]
    assert rec["names"] == DOMAINS
    assert rec["train"] == [len(labels[d][0]) for d in DOMAINS]
    assert rec["test"] == [len(labels[d][1]) for d in DOMAINS]
    assert sum(rec["train"]) == data.meta["n_train"] == len(data.y_train)
    # rows domain by domain, in the option's order: the labels of each domain's block
    for split, y in (("train", data.y_train), ("test", data.y_test)):
        dom = domain_ids(data.meta, split)
        for i, d in enumerate(DOMAINS):
            k = 0 if split == "train" else 1
            assert np.sort(y[dom == i]).tolist() == labels[d][k]
    assert domain_ids({"files": {}}, "train") is None  # a dataset without domains


def test_subset_keeps_the_first_rows_of_each_class_in_each_domain(dn):
    data = _prepare(dn, subset=1)
    _, _, labels = dn
    rec = data.meta["domains"]
    want = {d: [len(set(labels[d][k])) for k in (0, 1)] for d in DOMAINS}
    assert rec["train"] == [want[d][0] for d in DOMAINS]  # every domain keeps its classes
    assert rec["test"] == [want[d][1] for d in DOMAINS]
    assert rec["train"][1] == 3 and rec["train"][0] == CLASSES  # clipart: classes 0, 1, 2
    # the bound used by validation: subset x classes x domains
    assert DATASETS.get("domainnet").split_sizes({"domains": DOMAINS, "size": 8, "subset": 1}) == (
        3 * CLASSES, 3 * CLASSES
    )


def test_train_per_domain_draws_the_same_rows_of_a_domain_in_any_order(dn):
    data = _prepare(dn, train_per_domain=2)
    assert data.meta["domains"]["train"] == [2, 2, 2] and data.meta["domains"]["test"] == [2, 4, 3]
    other = _prepare(dn, train_per_domain=2, domains=["sketch", "real"])
    np.testing.assert_array_equal(other.x_train[2:4], data.x_train[0:2])  # real's 2 rows
    np.testing.assert_array_equal(other.y_train[0:2], data.y_train[4:6])  # sketch's 2 rows
    assert DATASETS.get("domainnet").split_sizes(
        DATASETS.get("domainnet").resolve({"domains": DOMAINS, "train_per_domain": 10000})
    )[0] == 30000
    with pytest.raises(FedForgetError, match=r"train_per_domain=-1; allowed: an integer"):
        DATASETS.get("domainnet").resolve({"train_per_domain": -1})


def test_rows_of_task_are_each_domains_rows_in_train_and_test(dn):
    data = _prepare(dn)
    s = resolve_scenario({"kind": "domains", "tasks": 3}, CLASSES, (3, 8, 8), "scenario", tuple(DOMAINS))
    assert s["incremental"] == "domain"
    sc = Scenario.build(s, CLASSES, (3, 8, 8), 3)
    assert sc.task_classes == [list(range(CLASSES))] * 3 and not sc.transforms and not sc.masked
    for split, y in (("train", data.y_train), ("test", data.y_test)):
        counts = data.meta["domains"][split]
        starts = np.cumsum([0, *counts])
        dom = domain_ids(data.meta, split)
        for t in range(3):
            got = np.flatnonzero(sc.rows_of_task(y, t, dom))
            np.testing.assert_array_equal(got, np.arange(starts[t], starts[t + 1]))
    with pytest.raises(FedForgetError, match="no 'domains' record"):
        sc.rows_of_task(data.y_train, 0, None)


def _run_config(dn, tmp_path, partition, rounds_per_task=1, **scenario):
    root, _, _ = dn
    opts = {"domains": DOMAINS, "size": 8}
    s = resolve_scenario(
        {"kind": "domains", "tasks": 3, "rounds_per_task": rounds_per_task, **scenario},
        CLASSES, (3, 8, 8), "scenario", tuple(DOMAINS),
    )  # fmt: skip
    t = TrainSpec(
        rounds=3 * rounds_per_task, local_epochs=1, batch_size=16, sample_rate=1.0, threads=1,
        device="cpu", client_engine="sequential", optimizer=OptimizerSpec(lr=0.05),
    )  # fmt: skip
    return RunConfig(
        "t", DatasetSpec("domainnet", opts, "mlp", {}, None, dataset_id("domainnet", opts), s),
        partition, MethodSpec("fedavg", {}, "fedavg"), 0, t, str(root), str(tmp_path / "results"),
    )  # fmt: skip


def test_clients_hold_their_rows_of_each_domain_in_that_task(dn, tmp_path):
    data = _prepare(dn)
    rc = _run_config(dn, tmp_path, PartitionSpec("iid", clients=3, seed=0))
    rd = load_run_data(rc, torch.device("cpu"), public_labels=False)
    cd, dom = rd.clients, domain_ids(data.meta, "train")
    seen = []
    for k in range(3):
        for t in range(3):
            rows = cd.rows[cd.offsets[k][t] : cd.offsets[k][t + 1]].numpy()
            assert (dom[rows] == t).all() and (cd.task[cd.offsets[k][t] : cd.offsets[k][t + 1]] == t).all()
            seen += rows.tolist()
    assert sorted(seen) == list(range(len(data.y_train)))  # each row once, in its domain's task
    counts = data.meta["domains"]["test"]
    assert [len(r) for r in rd.test.rows] == counts
    assert [int(r[0]) for r in rd.test.rows] == np.cumsum([0, *counts[:-1]]).tolist()


def test_a_short_domains_run_has_one_accuracy_matrix_column_per_domain(dn, tmp_path):
    _prepare(dn)
    rc = _run_config(dn, tmp_path, PartitionSpec("iid", clients=2, seed=0))
    run_training(rc, tmp_path / "run", progress=False)
    lines = (tmp_path / "run" / "accuracy_matrix.csv").read_text().splitlines()
    assert lines[0] == "after_task,task,accuracy" and len(lines) == 1 + 3 * 3
    assert sorted({int(r.split(",")[1]) for r in lines[1:]}) == [0, 1, 2]
    tasks = (tmp_path / "run" / "tasks.csv").read_text().splitlines()[1:]
    assert {int(r.split(",")[2]) for r in tasks} == {0, 1, 2}


def _config(scenario, options=None, name="domainnet", methods=None):
    return {
        "data_dir": "data",
        "experiments": [{
            "name": "dn",
            "datasets": [{"name": name, "label": "dn", "model": "mlp", "options": {"domains": DOMAINS} if options is None else options,
                          "scenario": scenario}],
            "partitions": [{"scheme": "iid", "clients": 2}],
            "methods": methods or [{"name": "fedavg"}],
            "seeds": [0],
            "train": {"rounds": 6},
        }],
    }  # fmt: skip


def test_validation_needs_one_task_per_domain_and_a_dataset_with_domains():
    ok = parse_config(_config({"kind": "domains", "tasks": 3, "rounds_per_task": 2}))
    ds = ok.experiments[0].datasets[0]
    assert ds.scenario["kind"] == "domains" and ds.scenario["incremental"] == "domain"
    with pytest.raises(FedForgetError, match=r"scenario\.tasks=2 with kind 'domains'; allowed: 3 .*real, clipart, sketch"):
        parse_config(_config({"kind": "domains", "tasks": 2, "rounds_per_task": 3}))
    parse_config(_config({"kind": "domains", "tasks": 6, "rounds_per_task": 1}, options={}))  # default: all six
    with pytest.raises(FedForgetError, match=r"scenario\.kind='domains' needs a dataset with domains"):
        parse_config(_config({"kind": "domains", "tasks": 1}, options={}, name="cifar10"))
    with pytest.raises(FedForgetError, match=r"scenario\.incremental='class' for kind 'domains'"):
        parse_config(_config({"kind": "domains", "tasks": 3, "incremental": "class"}))
    with pytest.raises(FedForgetError, match="method 'glfc' needs a split"):
        parse_config(_config({"kind": "domains", "tasks": 3, "rounds_per_task": 2}, methods=[{"name": "glfc"}]))


def test_smoke_scale_keeps_the_first_domains_as_the_tasks():
    raw = _config({"kind": "domains", "tasks": 6, "rounds_per_task": 20}, options={"size": 224})
    raw["experiments"][0]["train"]["rounds"] = 120
    raw["experiments"][0]["datasets"][0]["label"] = "domainnet-6"
    out = smoke_config(copy.deepcopy(raw))
    d = out["experiments"][0]["datasets"][0]
    assert d["options"]["domains"] == ["clipart", "infograph"] and d["scenario"]["tasks"] == 2
    assert d["label"] == "domainnet-6" and out["experiments"][0]["train"]["rounds"] == 2
    raw["scale"] = "smoke"
    assert parse_config(raw).experiments[0].datasets[0].scenario["tasks"] == 2
    json.dumps(out)  # still a plain config
