"""One paper configuration at reduced rounds on CIFAR-shaped data, on a GPU: time per
round, GPU utilisation and peak memory, and the full table's runtime estimated from them.

The setting is FedSOL's Table 1 on CIFAR-10 [P, fedsol.md Sec. 5 and METHODS.md]: the McMahan
CNN, 100 clients of a Dirichlet(0.1) split, 10 sampled per round, 5 local epochs, batch 50,
SGD lr 0.01 momentum 0.9 weight decay 1e-5, lr x0.99 per round, 300 rounds. The data are
``blobs`` stored as uint8 3x32x32 images, 50,000 / 10,000 like CIFAR-10 (the lent machine
reaches no network; the time per round depends on the shapes and the split, not on the
pixels), converted and normalised on the device as a prepared CIFAR-10 would be.
``--augment`` adds the papers' crop+flip.

Per method: ``--warmup`` rounds untimed, then ``--rounds`` timed rounds (evaluation of the
global model on the 10,000 test rows every round, as the paper's curves need); GPU
utilisation is ``nvidia-smi``'s utilization.gpu sampled every 100 ms during the timed rounds
(mean); peak memory is ``torch.cuda.max_memory_allocated`` over the run.

    python benchmarks/paper_gpu.py --json out.json                # fedavg and fedsol
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import threading
import time

import torch

from fedforget.config import DatasetSpec, MethodSpec, OptimizerSpec, RunConfig, TrainSpec
from fedforget.data import prepare_dataset
from fedforget.engine import Simulation
from fedforget.partition import PartitionSpec

PAPER_ROUNDS = 300  # FedSOL Table 1, CIFAR-10
# FedSOL Table 1 (config/paper_results.csv): 5 rows (FedAvg, the KL and FedProx proximal
# losses, each as a base and projected) on CIFAR-10 LDA 0.1, 3 seeds [D: the project's count]
TABLE_RUNS = {"methods": 5, "settings": 1, "seeds": 3}


class GpuSampler(threading.Thread):
    """utilization.gpu of GPU 0 every ``period`` seconds, through nvidia-smi."""

    def __init__(self, period: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.period, self.samples, self.stop = period, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", "0"],
                    capture_output=True, text=True, timeout=5,
                ).stdout.strip()  # fmt: skip
                self.samples.append(float(out))
            except (OSError, ValueError, subprocess.SubprocessError):
                pass
            self.stop.wait(self.period)


def config(a: argparse.Namespace, root: str, method: str, params: dict) -> RunConfig:
    opts = {"num_train": 50000, "num_test": 10000, "channels": 3, "size": 32, "uint8": True}
    ds = DatasetSpec("blobs", opts, "cnn_mcmahan", {}, None, "cifar-shaped", None,
                     {"kind": "crop_flip", "pad": 4} if a.augment else None)  # fmt: skip
    train = TrainSpec(
        rounds=10**6, local_epochs=5, batch_size=50, sample_rate=0.1, lr_decay=0.99,
        optimizer=OptimizerSpec(lr=0.01, momentum=0.9, weight_decay=1e-5), device="cuda",
        eval_local_models=False, eval_every=1, checkpoint_every=10**9, client_engine=a.engine,
    )  # fmt: skip
    part = PartitionSpec("dirichlet", clients=100, alpha=0.1, min_size=10, seed=0)
    return RunConfig("bench", ds, part, MethodSpec(method, params, method), 0, train, root, f"{root}/results")


def measure(a: argparse.Namespace, root: str, method: str, params: dict) -> dict:
    torch.cuda.reset_peak_memory_stats()
    sim = Simulation(config(a, root, method, params), device=torch.device("cuda"))
    t0 = time.perf_counter()
    for rnd in range(1, a.warmup + 1):
        sim.run_round(rnd, t0)
    torch.cuda.synchronize()
    sampler = GpuSampler()
    sampler.start()
    times = []
    for rnd in range(a.warmup + 1, a.warmup + a.rounds + 1):
        s = time.perf_counter()
        row = sim.run_round(rnd, t0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - s)
    sampler.stop.set()
    sampler.join()
    per_round = statistics.median(times)
    runs = TABLE_RUNS["methods"] * TABLE_RUNS["settings"] * TABLE_RUNS["seeds"]
    return {
        "method": method, "params": params, "engine": sim.engine_info["client_engine"],
        "s_per_round": {"median": per_round, "min": min(times), "max": max(times)},
        "gpu_util_mean_pct": statistics.mean(sampler.samples) if sampler.samples else None,
        "gpu_util_samples": len(sampler.samples),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "last_test_acc": row.get("global_model_test_acc"),
        "one_run_h_estimate": per_round * PAPER_ROUNDS / 3600,
        "table_gpu_h_estimate": per_round * PAPER_ROUNDS * runs / 3600,
        "table_runs": runs,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--engine", default="auto")
    p.add_argument("--augment", action="store_true")
    p.add_argument("--methods", default="fedavg,fedsol")
    p.add_argument("--json")
    a = p.parse_args()
    params = {"fedavg": {}, "fedsol": {"rho": 1.5, "perturb": "head"}}
    out = {"args": vars(a), "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "results": []}
    with tempfile.TemporaryDirectory() as root:
        prepare_dataset("blobs", {"num_train": 50000, "num_test": 10000, "channels": 3, "size": 32, "uint8": True}, root)
        for m in a.methods.split(","):
            r = measure(a, root, m, params.get(m, {}))
            out["results"].append(r)
            print(
                f"{m:>8} ({r['engine']}): {r['s_per_round']['median']:.3f} s/round "
                f"(min {r['s_per_round']['min']:.3f}, max {r['s_per_round']['max']:.3f}), "
                f"GPU util {r['gpu_util_mean_pct']}%, peak {r['peak_memory_gib']:.2f} GiB; "
                f"300 rounds ~{r['one_run_h_estimate']:.2f} h, table ({r['table_runs']} runs) ~{r['table_gpu_h_estimate']:.1f} GPU-h"
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
