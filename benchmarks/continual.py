"""What the continual track costs: a continual run's time per round against the same run as
one task, and the evaluation cost per task.

Setting (printed with every figure and written to ``--json``): FedAvg on a dataset split
by the partition (default digits + cnn2d, Dirichlet 0.5 over 10 clients, all sampled,
1 local epoch, batch 32, SGD lr 0.05), ``--rounds`` timed rounds after ``--warmup``
untimed ones, on ``--threads`` torch threads and ``--client-engine``. Scenarios compared:

- ``one-task``: no scenario (every client trains on all its rows every round);
- ``split``: 5 tasks x 2 classes (each client trains on its rows of the current task,
  about a fifth of them: a round is cheaper);
- ``split-all-rows``: the joint method on the same split (every client trains on all its
  rows, through the task machinery: the overhead of the (client, task) positions and
  per-row masks, against ``one-task``);
- ``permuted`` / ``rotated`` (images only): 5 domain tasks (every client's rows through a
  per-row transform after the gather).

Training time per round excludes evaluation (eval_local_models off, global evaluation
beyond the timed rounds). Evaluation cost: the time of one global-model evaluation of
every task (what each evaluated round adds), and per task, against one pass over the
whole test set. Medians with min-max over the timed rounds; scenarios interleaved round
by round so all see the same machine load.

    python benchmarks/continual.py
    python benchmarks/continual.py --dataset mnist1d --model cnn1d --json continual.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from fedforget.config import DatasetSpec, MethodSpec, OptimizerSpec, RunConfig, TrainSpec
from fedforget.data import DATASETS, prepare_dataset
from fedforget.data.scenario import resolve_scenario
from fedforget.engine import Simulation
from fedforget.partition import PartitionSpec


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", default="digits")
    p.add_argument("--model", default="cnn2d")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--rounds", type=int, default=10, help="timed rounds per scenario")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--client-engine", default="sequential", choices=["sequential", "vectorized", "auto"]
    )
    p.add_argument("--eval-repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    return p.parse_args()


def main() -> None:
    a = parse_args()
    torch.set_num_threads(a.threads)
    info = DATASETS.get(a.dataset)
    shape = tuple(info.input_shape(info.resolve({})))
    tasks, per_task = 5, a.rounds + a.warmup  # every timed round inside the first task
    scenarios = {
        "one-task": (None, "fedavg"),
        "split": ({"kind": "split", "tasks": tasks, "classes_per_task": 2}, "fedavg"),
        "split-all-rows": ({"kind": "split", "tasks": tasks, "classes_per_task": 2}, "joint"),
        "permuted": ({"kind": "permuted", "tasks": tasks}, "fedavg"),
    }
    if len(shape) == 3:
        scenarios["rotated"] = ({"kind": "rotated", "tasks": tasks}, "fedavg")
    setting = {
        "dataset": a.dataset, "model": a.model, "partition": f"dirichlet {a.alpha}", "clients": a.clients,
        "sample_rate": 1.0, "local_epochs": a.epochs, "batch_size": 32, "optimizer": "sgd lr 0.05",
        "threads": a.threads, "client_engine": a.client_engine, "timed_rounds": a.rounds, "warmup": a.warmup,
        "device": "cpu", "torch": torch.__version__,
    }  # fmt: skip
    print("setting:", json.dumps(setting))
    with tempfile.TemporaryDirectory() as tmp:
        prepare_dataset(a.dataset, {}, tmp)
        sims = {}
        for name, (scen, method) in scenarios.items():
            s = (
                resolve_scenario(
                    {**scen, "rounds_per_task": per_task}, info.num_classes, shape, name
                )
                if scen
                else None
            )
            rounds = tasks * per_task if s else per_task
            t = TrainSpec(
                rounds=rounds, local_epochs=a.epochs, batch_size=32, sample_rate=1.0, eval_local_models=False,
                eval_every=10**6, threads=a.threads, device="cpu", client_engine=a.client_engine,
                optimizer=OptimizerSpec(lr=0.05),
            )  # fmt: skip
            rc = RunConfig(
                "bench", DatasetSpec(a.dataset, {}, a.model, {}, None, a.dataset, s),
                PartitionSpec("dirichlet", clients=a.clients, alpha=a.alpha, min_size=10, seed=0),
                MethodSpec(method, {}, method), 0, t, tmp, f"{tmp}/results",
            )  # fmt: skip
            sims[name] = Simulation(rc)
        times: dict[str, list[float]] = {n: [] for n in sims}
        start = time.perf_counter()
        for rnd in range(1, a.warmup + a.rounds + 1):
            for name, sim in sims.items():
                t0 = time.perf_counter()
                sim.run_round(rnd, start)
                if rnd > a.warmup:
                    times[name].append(time.perf_counter() - t0)
        result = {"setting": setting, "train_s_per_round": {}, "eval": {}}
        base = statistics.median(times["one-task"])
        for name, ts in times.items():
            med = statistics.median(ts)
            result["train_s_per_round"][name] = {
                "median": med,
                "min": min(ts),
                "max": max(ts),
                "vs_one_task": med / base,
            }
            print(
                f"train  {name:15s} {med * 1e3:8.1f} ms/round (min {min(ts) * 1e3:.1f}, max {max(ts) * 1e3:.1f})  x{med / base:.2f} of one-task"
            )
        for name, sim in sims.items():
            ev = sim.evaluator
            model = sim.model_with(sim.global_params)
            per_task = []
            for t in range(sim.scenario.tasks):
                reps = []
                for _ in range(a.eval_repeats):
                    t0 = time.perf_counter()
                    ev.task(model, t)
                    reps.append(time.perf_counter() - t0)
                per_task.append(statistics.median(reps))
            total = sum(per_task)
            result["eval"][name] = {
                "per_task_s": per_task,
                "all_tasks_s": total,
                "test_rows_per_task": [len(r) for r in ev.test.rows],
            }
            print(f"eval   {name:15s} all {sim.scenario.tasks} tasks {total * 1e3:7.1f} ms; per task {statistics.median(per_task) * 1e3:6.2f} ms "
                  f"({statistics.median([len(r) for r in ev.test.rows]):.0f} rows)")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
