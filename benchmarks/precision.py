"""bf16 against fp32 local training (issue 32, 4: ``train.precision``) on one shipped config:
the same runs at both precisions, their final and best global accuracy, per seed and as mean
and standard deviation. Prints numbers and writes JSON; not a test.

    python benchmarks/precision.py --config config/experiments/baselines_embedded.yaml \\
        --dataset digits --partition dirichlet-0.5 --method fedavg --json out.json

Speed is measured on a GPU (benchmarks/gpu.sh); the seconds here are the machine's, for
orientation only (on a CPU, bf16 is emulated or slow unless the CPU has bf16 units).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--dataset", required=True, help="dataset label in the config")
    ap.add_argument("--partition", required=True, help="start of the partition's slug, e.g. dirichlet-0.5")
    ap.add_argument("--method", required=True, help="method label in the config")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "fedforget-bench-data"))
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    import torch

    from fedforget.config import load_yaml
    from fedforget.data import prepare_dataset
    from fedforget.data.base import prepare_public
    from fedforget.engine import Simulation
    from fedforget.parse import parse_config

    torch.set_num_threads(args.threads)
    wf = parse_config(load_yaml(Path(args.config)))
    runs = [
        rc for rc in wf.runs()
        if rc.dataset.label == args.dataset and rc.method.label == args.method
        and rc.partition.slug.startswith(args.partition)
    ]  # fmt: skip
    if not runs:
        raise SystemExit(f"no run of {args.config} matches dataset {args.dataset}, partition {args.partition}*, method {args.method}")
    ds = runs[0].dataset
    prepare_dataset(ds.name, ds.options, args.data)
    if ds.public is not None:  # a holdout public set also shrinks the private pool
        prepare_public(ds.public, ds.id, args.data)
    out: dict[str, list[dict]] = {"fp32": [], "bf16": []}
    for rc in runs:
        for precision in out:
            run = replace(rc, data_dir=args.data, results_dir=os.path.join(args.data, "results"),
                          train=replace(rc.train, precision=precision, device=args.device, threads=args.threads))  # fmt: skip
            t0 = time.perf_counter()
            sim = Simulation(run)
            status, rows, msg = sim.run(progress=False)
            seconds = time.perf_counter() - t0
            accs = [r["global_model_test_acc"] for r in rows if r["round"] > 0 and r.get("global_model_test_acc") is not None]
            rec = {"seed": rc.seed, "status": status, "final_acc": accs[-1], "best_acc": max(accs), "seconds": seconds,
                   "engine": sim.engine_info["client_engine"]}  # fmt: skip
            out[precision].append(rec)
            print(f"seed {rc.seed} {precision}: final {100 * accs[-1]:.2f} %, best {100 * max(accs):.2f} %, {seconds:.1f} s ({rec['engine']})", flush=True)
    summary = {}
    for precision, recs in out.items():
        finals = [100 * r["final_acc"] for r in recs]
        summary[precision] = {"final_mean": statistics.mean(finals),
                              "final_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
                              "seconds_mean": statistics.mean(r["seconds"] for r in recs)}  # fmt: skip
        print(f"{precision}: final accuracy {summary[precision]['final_mean']:.2f} +- {summary[precision]['final_std']:.2f} "
              f"over seeds {[r['seed'] for r in recs]}")  # fmt: skip
    setting = (f"{args.config}: dataset {args.dataset}, partition {runs[0].partition.slug}, method {args.method}, "
               f"{runs[0].train.rounds} rounds x {runs[0].train.local_epochs} local epochs, seeds {[r.seed for r in runs]}, "
               f"{args.device}, {args.threads} threads")  # fmt: skip
    print(f"# {setting}")
    if args.json:
        Path(args.json).write_text(json.dumps({"setting": setting, "runs": out, "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
