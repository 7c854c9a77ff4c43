"""What a checkpoint holds per method, and what writing it costs, projected to a paper setting.

A training job writes a checkpoint (the run's ``FedState``) when ``train.checkpoint_every``
says (default auto: ``benchmarks/checkpoint_cadence.py``). Its size is the global model, the
server's state and every client's state kept across rounds (SCAFFOLD's control variates, replay buffers, ...). This script
runs every registered method (default hyperparameters) on digits + cnn2d, iid over
``--clients`` clients, every client sampled every round (so each keeps its state), for
``--rounds`` rounds, with a held-out public set (methods that need one run too). Methods
defined on one model alone (L2P's ViT) are skipped. Then it measures the state
(``fedforget.state.model_copies``):

- ``model_copies_server``: the server state's tensors shaped as a model parameter (or as
  all of them flattened), in copies of the model (they grow with the model);
- ``model_copies_per_client``: the same for each client's state, the mean over clients;
- ``other_mb_per_client``: a client's other tensors (replay buffers, bases, ...: they grow
  with the data or the tasks, not with the model), MiB at this tiny setting.

The write rate is measured by writing a ``--mb`` MiB state with ``atomic_torch_save`` (as the
runner writes checkpoints, fsync included) ``--repeats`` times into ``--dir``; the median is
kept. Projection: a checkpoint of ``--project-params`` parameters (default CIFAR ResNet-18's
11,173,962) at ``--project-clients`` clients holds float32 model copies
``1 + server + clients x per-client`` (the other bytes left out: a lower bound), written at
the measured rate. A machine's disk, or a cluster's file system, writes at its own rate:
rerun there.

    python benchmarks/checkpoint_cost.py --json benchmarks/results/cpu-DATE/checkpoint_cost.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fedforget.config import DatasetSpec, MethodSpec, OptimizerSpec, RunConfig, TrainSpec
from fedforget.data import prepare_dataset, prepare_public
from fedforget.engine import Simulation
from fedforget.methods import METHODS
from fedforget.partition import PartitionSpec
from fedforget.state import model_copies
from fedforget.utils import atomic_torch_save, atomic_write_json

RESNET18_CIFAR = 11_173_962  # parameters (models.parameter_count of resnet18 on 3x32x32, 10 classes)


def write_rate(directory: str, mb: int, repeats: int) -> float:
    """MiB/s of atomic_torch_save (fsync included), the median of ``repeats`` writes."""
    state = {"x": torch.randn(mb * 2**18)}
    path = Path(directory) / "checkpoint_cost.pt"
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        atomic_torch_save(path, state)
        rates.append(mb / (time.perf_counter() - t))
    path.unlink()
    return statistics.median(rates)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--methods", nargs="+", help="default: every registered method")
    p.add_argument("--mb", type=int, default=512, help="MiB written per timed write (default 512)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the timed writes go (default: the temp dir)")
    p.add_argument("--project-params", type=int, default=RESNET18_CIFAR)
    p.add_argument("--project-clients", type=int, default=100)
    p.add_argument("--json", help="also write the numbers here")
    a = p.parse_args()
    torch.set_num_threads(2)
    rate = write_rate(a.dir, a.mb, a.repeats)
    model_mb = 4 * a.project_params / 2**20
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="checkpoint_cost-") as tmp:
        prepare_dataset("digits", {}, tmp)
        public = {"source": "holdout", "fraction": 0.1, "seed": 0}
        prepare_public(public, "digits", tmp)
        train = TrainSpec(rounds=a.rounds, local_epochs=1, batch_size=32, sample_rate=1.0,
                          optimizer=OptimizerSpec("sgd", lr=0.01), eval_every=10**9, eval_local_models=False,
                          device="cpu", threads=2, client_engine="sequential")  # fmt: skip
        ds = DatasetSpec("digits", {}, "cnn2d", {}, public, "digits")
        for name in a.methods or METHODS.names():
            if getattr(METHODS.get(name), "needs_model", None):
                rows[name] = {"skipped": f"defined on model '{METHODS.get(name).needs_model}' alone"}
                continue
            rc = RunConfig("checkpoint_cost", ds, PartitionSpec("iid", a.clients), MethodSpec(name, {}, name), 0,
                           train, tmp, tmp)  # fmt: skip
            sim = Simulation(rc)
            status, _, msg = sim.run(progress=False)
            server, _ = model_copies(sim.fed.server, sim.global_params)
            clients = [model_copies(s, sim.global_params) for s in sim.fed.clients.values()]
            per_client = statistics.fmean(m for m, _ in clients) if clients else 0.0
            copies = 1 + server + a.project_clients * per_client
            rows[name] = {
                "status": status, "message": msg,
                "model_copies_server": server,
                "model_copies_per_client": per_client,
                "other_mb_per_client": statistics.fmean(o for _, o in clients) / 2**20 if clients else 0.0,
                "projected_checkpoint_mb": copies * model_mb,
                "projected_write_s": copies * model_mb / rate,
            }  # fmt: skip
    result = {"setting": {"dataset": "digits", "model": "cnn2d", "partition": f"iid over {a.clients} clients",
                          "sample_rate": 1.0, "rounds": a.rounds, "threads": 2},
              "write_mb": a.mb, "write_repeats": a.repeats, "write_mib_per_s": rate,
              "project_params": a.project_params, "project_clients": a.project_clients,
              "project_model_mb": model_mb, "methods": rows}  # fmt: skip
    print(f"write rate: {rate:,.0f} MiB/s ({a.mb} MiB, median of {a.repeats}, {a.dir})")
    print(f"projection: {a.project_params:,} parameters ({model_mb:,.1f} MiB), {a.project_clients} clients")
    print(f"{'method':<12} {'server':>7} {'client':>7} {'other MiB':>10} {'ckpt MiB':>10} {'write s':>8}")
    for name, r in rows.items():
        if "skipped" in r:
            print(f"{name:<12} skipped: {r['skipped']}")
            continue
        print(f"{name:<12} {r['model_copies_server']:>7.2f} {r['model_copies_per_client']:>7.2f} "
              f"{r['other_mb_per_client']:>10.2f} {r['projected_checkpoint_mb']:>10,.0f} {r['projected_write_s']:>8.1f}")  # fmt: skip
    if a.json:
        atomic_write_json(a.json, result)


if __name__ == "__main__":
    main()
