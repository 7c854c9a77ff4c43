"""``train.eval_order``: each task's test rows in a keyed order (the FedProTIP code shuffles its
test loaders). The same rows, permuted by (seed, task); what a per-row model scores is
unchanged, what a batch-normalising model (norm: batch_stateless) scores is not; the default
keeps every run's hash."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fedforget.engine import Simulation
from fedforget.partition import PartitionSpec
from fedforget.utils import FedForgetError

from .conftest import SMALL_RESNET

SPLIT = {"kind": "split", "tasks": 2, "classes_per_task": 5, "rounds_per_task": 1}


def run(make_run_config, order, model="cnn2d", options=None, seed=0):
    rc = make_run_config(
        dataset="digits", model=model, model_options=options or {"channels": [4, 8], "hidden": 16}, scenario=SPLIT,
        partition=PartitionSpec("iid", clients=2, seed=0), rounds=2, batch_size=32, eval_batch_size=32,
        eval_local_models=False, seed=seed,
    )  # fmt: skip
    rc = replace(rc, train=replace(rc.train, eval_order=order))
    sim = Simulation(rc, device=torch.device("cpu"))
    status, rows, msg = sim.run(progress=False)
    assert status == "completed", msg
    return rc, sim, rows


def accuracies(rows):
    return [(t["task"], t["accuracy"]) for r in rows for t in r.get("_tasks", [])]


def test_shuffled_rows_are_a_keyed_permutation_and_per_row_scores_stay(make_run_config):
    rc_s, stored, rows_s = run(make_run_config, "stored")
    rc_p, shuffled, rows_p = run(make_run_config, "shuffled")
    assert rc_s.hash == replace(rc_s, train=replace(rc_s.train, eval_order="stored")).hash
    assert "eval_order" not in rc_s.to_dict()["train"] and rc_p.to_dict()["train"]["eval_order"] == "shuffled"
    for a, b in zip(stored.evaluator.test.rows, shuffled.evaluator.test.rows):
        assert not torch.equal(a, b) and torch.equal(a, b.sort().values)
    _, again, _ = run(make_run_config, "shuffled")
    _, other_seed, _ = run(make_run_config, "shuffled", seed=1)
    assert all(torch.equal(a, b) for a, b in zip(shuffled.evaluator.test.rows, again.evaluator.test.rows))
    assert not torch.equal(shuffled.evaluator.test.rows[0], other_seed.evaluator.test.rows[0])
    assert accuracies(rows_s) == accuracies(rows_p)  # a per-row model: the same counts
    assert all(torch.equal(v, shuffled.global_params[k]) for k, v in stored.global_params.items())


def test_a_batch_normalising_model_scores_otherwise(make_run_config):
    opts = {**SMALL_RESNET, "norm": "batch_stateless"}
    _, _, rows_s = run(make_run_config, "stored", "resnet8", opts)
    _, _, rows_p = run(make_run_config, "shuffled", "resnet8", opts)
    assert accuracies(rows_s) != accuracies(rows_p)


def test_an_unknown_order_is_refused():
    from fedforget.parse import parse_config

    raw = {"experiments": [{
        "name": "e", "datasets": [{"name": "iris", "model": "mlp"}], "partitions": [{"scheme": "iid", "clients": 2}],
        "methods": [{"name": "fedavg"}], "seeds": [0], "train": {"rounds": 1, "eval_order": "random"}}]}  # fmt: skip
    with pytest.raises(FedForgetError, match=r"eval_order.*'random'"):
        parse_config(raw)
