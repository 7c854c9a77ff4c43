"""Task-IL is class-IL scored with the task id, under every registered method that accepts a
split stream: a task-incremental run trains what the class-incremental run trains, bit for
bit (weights, local losses, method state), and its per-task accuracies are the class-IL
run's task-aware ones (tasks.csv's ``task_aware``). The FedGP configs rely on it: their
task-IL paper columns are the class-IL runs' task-aware metrics (a dataset_map entry with
``scored: task_aware``), not a second training run [P fedgp.md Sec. 5: the task id is given
at inference; C Fed-A-GEM models/test.py scores one model both ways]."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fedforget.continual import TASK_AWARE
from fedforget.data.scenario import resolve_scenario
from fedforget.engine import Simulation
from fedforget.methods import METHODS, make_params
from fedforget.partition import PartitionSpec
from fedforget.utils import FedForgetError

from .conftest import PUBLIC, SPLIT, TINY_VIT, needs_model, same, strip
from .test_task_heads import PARAMS

CPU = torch.device("cpu")
STREAM = {**SPLIT, "rounds_per_task": 2}


def _accepts_task_il(name: str) -> bool:
    scenario = resolve_scenario({**STREAM, "incremental": "task"}, 10, (64,), "scenario")
    try:
        METHODS.get(name).check_scenario(scenario, make_params(name, PARAMS.get(name) or {}))
    except FedForgetError:
        return False
    return True


ACCEPTING = [n for n in METHODS.names() if _accepts_task_il(n)]


def test_most_methods_accept_task_il():
    assert {"fedavg", "fedgp", "agem", "der", "icarl", "glfc", "gpm"} <= set(ACCEPTING)


@pytest.mark.parametrize("method", ACCEPTING)
def test_a_task_il_run_is_the_class_il_run_scored_with_the_task_id(make_run_config, digits_public_root, method):
    params = PARAMS.get(method)
    kw = {"model": "vit", "model_options": TINY_VIT} if needs_model(method, params) == "vit" else {"model": "mlp"}
    runs = {}
    for incremental in ("class", "task"):
        rc = make_run_config(
            dataset="digits", method=method, params=params, public=PUBLIC, scenario={**STREAM, "incremental": incremental},
            partition=PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=10, seed=0),
            rounds=6, sample_rate=0.75, batch_size=32, eval_local_models=False, **kw,
        )  # fmt: skip
        sim = Simulation(replace(rc, data_dir=str(digits_public_root)), device=CPU)
        status, rows, msg = sim.run(progress=False)
        assert status == "completed", msg
        runs[incremental] = (sim, rows)
    (c, rows_c), (t, rows_t) = runs["class"], runs["task"]
    assert same(c.global_params, t.global_params)
    assert same(c.fed.clients, t.fed.clients) and same(c.fed.server, t.fed.server)
    loss = "sampled_clients_local_train_loss_mean"
    assert [r.get(loss) for r in rows_c] == [r.get(loss) for r in rows_t]
    tasks_c = [x for r in rows_c for x in r.get("_tasks", [])]
    tasks_t = [x for r in rows_t for x in r.get("_tasks", [])]
    assert [(x["round"], x["task"]) for x in tasks_c] == [(x["round"], x["task"]) for x in tasks_t]
    assert [x[TASK_AWARE] for x in tasks_c] == [x["accuracy"] for x in tasks_t]
    assert TASK_AWARE not in tasks_t[0]  # a stream scored with the task id has no second score
    assert strip(rows_c) != strip(rows_t)  # not vacuous: the scores differ where the id helps
