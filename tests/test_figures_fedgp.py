"""FedGP Fig. 4 (the buffer's rows per task under the three buffer policies of Table 9):
FedGP records its buffer's per-task composition in task streams, it adds up to the buffer's
size, it differs between the policies as their rules say (the sliding window keeps only the
newest rows, reservoir sampling keeps every task), and the figure draws it."""

from __future__ import annotations

import pandas as pd
import pytest

from .conftest import run_experiment

TASKS = 3


@pytest.fixture(scope="module")
def policies(data_root, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fedgp_fig")
    experiment = {
        "name": "buffers",
        "datasets": [{"name": "digits", "model": "mlp",
                      "scenario": {"kind": "split", "tasks": TASKS, "classes_per_task": 3,
                                   "leftover_classes": "drop", "rounds_per_task": 1}}],
        "partitions": [{"scheme": "iid", "clients": 3, "seed": 0}],
        "methods": [{"name": "fedavg", "label": "FL"}] + [
            {"name": "fedgp", "label": p, "params": {"buffer_policy": p, "buffer_size": 20}}
            for p in ("sliding", "random", "reservoir")],
        "seeds": [0],
        "train": {"rounds": TASKS, "local_epochs": 1, "batch_size": 32, "threads": 1, "eval_local_models": False,
                  "optimizer": {"name": "sgd", "lr": 0.05}},
        "figures": [{"name": "buffer_tasks", "label": "fig4"}],
    }  # fmt: skip
    return run_experiment(experiment, data_root, tmp)


def test_the_buffer_composition_per_task_follows_each_policy(policies):
    metrics = pd.read_parquet(policies / "summary" / "metrics.parquet")
    cols = [f"fedgp_buffer_task{t}" for t in range(TASKS)]
    last = metrics[metrics["round"] == TASKS].set_index("method")
    assert last.loc[["sliding", "random", "reservoir"], cols].sum(axis=1).tolist() == pytest.approx([20.0] * 3)
    assert last.loc["FL", cols].isna().all()  # no buffer
    # every client offers far more than 20 rows per task: the window holds the newest task only,
    # the reservoir a share of every task
    assert last.loc["sliding", cols].tolist() == [0.0, 0.0, 20.0]
    assert (last.loc["reservoir", cols] > 0).all()
    table = pd.read_csv(policies / "figures" / "fig4.csv")
    assert set(table["method"]) == {"sliding", "random", "reservoir"} and sorted(set(table["task"])) == [0, 1, 2]
    assert (policies / "figures" / "fig4.png").read_bytes()[:4] == b"\x89PNG"
