"""Streamed vs in-memory training pool (fedforget.inputs, train.data_storage): local-training
samples/s of the same FedAvg rounds on the same data, the pool held on the device or read
a minibatch at a time from a memory map of the prepared file (the path for data larger than
memory). Target (issue 17): streamed >= 0.9x in-memory on a CPU.

Data: ``blobs`` stored as uint8 images, CIFAR-shaped by default (3x32x32, 10 classes), so
the natural-dtype conversion, and with ``--augment`` the crop+flip augmentation, run as on
CIFAR. The file is in the page cache after the warm-up (as an epoch-after-epoch run sees
it); a cold first read depends on the disk and is not measured here. Rounds of the two
storages are interleaved (both see the same machine load); reported: median and min-max of
samples/s over the timed rounds, and their ratio.

    python benchmarks/streaming.py                       # CPU, sequential engine
    python benchmarks/streaming.py --engine vectorized --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from fedforget.config import DatasetSpec, MethodSpec, OptimizerSpec, RunConfig, TrainSpec
from fedforget.data import dataset_id, prepare_dataset
from fedforget.engine import Simulation
from fedforget.partition import PartitionSpec


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, typ, default in [
        ("num-train", int, 20000), ("size", int, 32), ("channels", int, 3), ("model", str, "cnn_mcmahan"),
        ("clients", int, 10), ("local-epochs", int, 1), ("batch-size", int, 32), ("rounds", int, 6),
        ("threads", int, 2), ("device", str, "cpu"), ("engine", str, "sequential"),
    ]:  # fmt: skip
        p.add_argument(f"--{name}", type=typ, default=default, help=f"default: {default}")
    p.add_argument("--augment", action="store_true", help="crop (pad 4) + flip on the device")
    p.add_argument("--json", metavar="PATH", help="also write the numbers to this file")
    return p.parse_args()


def config(a: argparse.Namespace, root: str, storage: str) -> RunConfig:
    opts = {"num_train": a.num_train, "num_test": 1000, "channels": a.channels, "size": a.size, "uint8": True}
    ds = DatasetSpec("blobs", opts, a.model, {}, None, "blobs", None,
                     {"kind": "crop_flip", "pad": 4} if a.augment else None)  # fmt: skip
    train = TrainSpec(
        rounds=10**6, local_epochs=a.local_epochs, batch_size=a.batch_size, sample_rate=1.0,
        optimizer=OptimizerSpec(lr=0.01), device=a.device, threads=a.threads, client_engine=a.engine,
        eval_local_models=False, eval_every=10**9, data_storage=storage,
    )  # fmt: skip
    part = PartitionSpec("dirichlet", clients=a.clients, alpha=0.5, min_size=10, seed=0)
    return RunConfig("bench", ds, part, MethodSpec("fedavg", {}, "fedavg"), 0, train, root, f"{root}/results")


def main() -> None:
    a = parse_args()
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    with tempfile.TemporaryDirectory() as root:
        opts = {"num_train": a.num_train, "num_test": 1000, "channels": a.channels, "size": a.size, "uint8": True}
        prepare_dataset("blobs", opts, root)
        sims = {s: Simulation(config(a, root, s), device=dev) for s in ("device", "stream")}
        assert sims["stream"].clients.x.stream and not sims["device"].clients.x.stream
        samples = a.local_epochs * len(sims["device"].clients.rows)
        rates: dict[str, list[float]] = {s: [] for s in sims}
        for rnd in range(1, a.rounds + 2):
            for s, sim in sims.items():
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                sim.run_round(rnd, t0)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                if rnd > 1:  # round 1: warm-up (page cache, allocator, kernels)
                    rates[s].append(samples / (time.perf_counter() - t0))
        same = all(torch.equal(v, sims["stream"].global_params[k]) for k, v in sims["device"].global_params.items())
    out = {
        "args": vars(a),
        "dataset": dataset_id("blobs", opts),
        "samples_per_round": samples,
        "same_weights": same,
        **{f"{s}_samples_per_s": {"median": statistics.median(r), "min": min(r), "max": max(r)} for s, r in rates.items()},
    }
    out["stream_over_device"] = out["stream_samples_per_s"]["median"] / out["device_samples_per_s"]["median"]
    for s in sims:
        r = out[f"{s}_samples_per_s"]
        print(f"{s:>7}: {r['median']:10.0f} samples/s (min {r['min']:.0f}, max {r['max']:.0f})")
    print(f"stream / device: {out['stream_over_device']:.3f}   identical weights after the run: {same}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
