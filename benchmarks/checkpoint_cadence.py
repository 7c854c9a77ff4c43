"""What checkpoints cost a run under each ``train.checkpoint_every``: never, every round, auto.

A job writes its checkpoint (``checkpoint.CheckpointCadence``) after every n-th round, or
with ``auto`` (the default) once the training since the last write lasts ten times that
write. This script trains the same run with each cadence through ``runner.run_training`` (the
job's own writes: atomic, fsync included) into ``--dir`` and reports each run's wall time,
the checkpoints it wrote, the seconds spent writing them, and the overhead against the run
that writes none (``checkpoint_every`` beyond its rounds). It also checks that the cadences
give the same metrics.csv and model.pt byte for byte (the cadence is no part of a run's
identity). Each cadence runs ``--repeats`` times, the cadences in turn, after a warm-up run;
the run of median wall time is kept.

Setting: digits, an MLP of ``--hidden`` widths (large enough that a checkpoint holding a
model copy per client costs more than a round), ``--clients`` clients iid, ``--sample-rate``
of them a round, 1 local epoch, batch 32, SGD lr 0.01, ``--rounds`` rounds, 2 threads, the
sequential engine, per method (default FedCurv: three model copies per client, SCAFFOLD:
one; ``benchmarks/checkpoint_cost.py``).

    python benchmarks/checkpoint_cadence.py --dir /work --json benchmarks/results/cpu-DATE/checkpoint_cadence.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from fedforget.config import DatasetSpec, MethodSpec, OptimizerSpec, RunConfig, TrainSpec
from fedforget.data import prepare_dataset
from fedforget.partition import PartitionSpec
from fedforget.runner import run_training
from fedforget.utils import atomic_write_json

NEVER = 10**9  # checkpoint_every beyond the rounds: no checkpoint


def config(a: argparse.Namespace, ds: DatasetSpec, method: str, every: int | str, tmp: str, rounds: int = 0) -> RunConfig:
    """The run of ``method`` with ``checkpoint_every: every`` (``rounds``: default ``--rounds``)."""
    train = TrainSpec(rounds=rounds or a.rounds, local_epochs=1, batch_size=32, sample_rate=a.sample_rate,
                      optimizer=OptimizerSpec("sgd", lr=0.01), eval_every=10, eval_local_models=False,
                      device="cpu", threads=2, client_engine="sequential", checkpoint_every=every)  # fmt: skip
    return RunConfig("checkpoint_cadence", ds, PartitionSpec("iid", a.clients), MethodSpec(method, {}, method), 0,
                     train, tmp, tmp)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", nargs="+", default=["fedcurv", "scaffold"])
    p.add_argument("--hidden", type=int, nargs="+", default=[1024, 1024])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--sample-rate", type=float, default=0.1)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the runs write (default: the temp dir)")
    p.add_argument("--json", help="also write the numbers here")
    a = p.parse_args()
    torch.set_num_threads(2)
    cadences: list[tuple[str, int | str]] = [("never", NEVER), ("every", 1), ("auto", "auto")]
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="checkpoint_cadence-", dir=a.dir) as tmp:
        prepare_dataset("digits", {}, tmp)
        ds = DatasetSpec("digits", {}, "mlp", {"hidden": a.hidden}, None, "digits")
        for method in a.methods:
            run_training(config(a, ds, method, NEVER, tmp, 2), Path(tmp) / "warm-up", progress=False)  # the process's first rounds
            recs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in cadences}
            ref: tuple[bytes, bytes] | None = None
            for i in range(a.repeats):  # the cadences in turn, so that drift and disk state hit each alike
                for label, every in cadences:
                    run_dir = Path(tmp) / f"{method}-{label}-{i}"
                    recs[label].append(run_training(config(a, ds, method, every, tmp), run_dir, progress=False))
                    got = ((run_dir / "metrics.csv").read_bytes(), (run_dir / "model.pt").read_bytes())
                    if ref is None:
                        ref = got
                    elif got != ref:
                        raise SystemExit(f"{method} with checkpoint_every {every!r}: results differ from 'never'")
                    shutil.rmtree(run_dir)
                    os.sync()  # the deleted run's blocks freed before the next run starts
            rows: dict[str, dict[str, Any]] = {}
            for label, every in cadences:
                walls = [r["wall_time_s"] for r in recs[label]]
                rec = recs[label][walls.index(statistics.median_low(walls))]
                rows[label] = {
                    "checkpoint_every": every, "status": rec["status"], "wall_time_s": rec["wall_time_s"],
                    "wall_times_s": walls, "checkpoints_written": rec["checkpoints_written"],
                    "checkpoint_write_s": rec["checkpoint_write_s"],
                    "write_s_each": rec["checkpoint_write_s"] / max(rec["checkpoints_written"], 1),
                }  # fmt: skip
            never = rows["never"]["wall_time_s"]
            for r in rows.values():
                r["overhead"] = r["wall_time_s"] / never - 1
                r["write_share"] = r["checkpoint_write_s"] / r["wall_time_s"]
            out[method] = {"results_identical": True, "cadences": rows}
    result = {
        "setting": {"dataset": "digits", "model": f"mlp hidden {a.hidden}", "partition": f"iid over {a.clients} clients",
                    "sample_rate": a.sample_rate, "rounds": a.rounds, "local_epochs": 1, "batch_size": 32,
                    "threads": 2, "engine": "sequential", "seed": 0, "repeats": a.repeats, "dir": a.dir},
        "methods": out,
    }  # fmt: skip
    print(f"{'method':<10} {'cadence':<12} {'wall s':>7} {'written':>8} {'write s':>8} {'each s':>7} {'overhead':>9}")
    for method, m in out.items():
        for label, r in m["cadences"].items():
            print(f"{method:<10} {label:<12} {r['wall_time_s']:>7.1f} {r['checkpoints_written']:>8d} "
                  f"{r['checkpoint_write_s']:>8.1f} {r['write_s_each']:>7.2f} {r['overhead']:>8.0%}")  # fmt: skip
    if a.json:
        atomic_write_json(a.json, result)


if __name__ == "__main__":
    main()
