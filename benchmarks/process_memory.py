"""Host memory one training process takes besides its per-client state: prints numbers, not a
test.

A packed SLURM submission (``slurm-packed``) runs several training jobs at once in one
``mem_mb``; each job is a process that holds, besides what its method keeps per client
(resource ``client_state_mb``), its own Python and torch, on a GPU the CUDA context and its
libraries, the model, optimizer and evaluation tensors, and on a CPU the activations. This
script measures that part: for each ``--presets`` x ``--methods`` it runs ``fedforget train``
as a job runs it (its own process, the run config of benchmarks/simulation.py's preset, the
TrainSpec defaults for engine choice and checkpoints) for ``--rounds`` rounds and reads the
process's peak resident memory over its whole life (``ru_maxrss``: the train command keeps
freed memory, so this is what the job's control group holds at its peak; the dataset is
memory-mapped, its pages cache the control group can drop). A small launcher process starts
each command and reads its peak: Linux carries into a started program's ``ru_maxrss`` the peak
of the process that started it, here this script's after preparing the data (up to 3.6 GB:
before 2026-12-08 the rows of ``cpu-2026-12-07-j/``, ``-k/``, ``-l/``, ``-m/`` read that
instead of the job's own where it was larger; fedforget.memory.process_peak_mb). ``process_mb`` = that
peak less the job's declared ``client_state_mb`` (a bound: FedAvg's is 0, so its row is the
process alone). Also the process that only imports torch and fedforget (``import_only``).
Each row records the data its process held (``train_rows``, ``test_rows``, ``input_shape``,
``input_dtype``, ``data_mb``): a process grows with them, and the presets' blobs are float32
unless ``--uint8`` (CIFAR's and MNIST's own storage). ``--eval-batch-sizes`` gives a row per
``train.eval_batch_size`` (on a CPU a large-map model's evaluation batch sets much of its process).

The largest ``process_mb`` of a device is what to give ``slurm-packed-process-mb``
(docs/cluster.md).

    python benchmarks/process_memory.py --device cpu --json benchmarks/results/cpu-DATE/process_memory.json
    python benchmarks/process_memory.py --device cuda --presets mcmahan resnet18 --json .../process_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import fields, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import simulation  # noqa: E402  (benchmarks/simulation.py: presets, run configs)

# started by this script, it starts the command from its own small address space and writes
# the command's peak (KiB) and exit status to its first argument
LAUNCHER = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[2:]); "
            "open(sys.argv[1], 'w').write(f'{resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss} {rc}')")


def peak_of(cmd: list[str], log: Path) -> tuple[float, float, int]:
    """(peak resident MiB over the command's own life, seconds, exit status)."""
    t0 = time.perf_counter()
    report = log.with_suffix(".peak")
    with log.open("w") as out:
        subprocess.run([sys.executable, "-c", LAUNCHER, str(report), *cmd], stdout=out, stderr=subprocess.STDOUT, check=True)
    kib, code = report.read_text().split()
    return int(kib) / 1024, time.perf_counter() - t0, int(code)


def run_config(args, preset: str, method: str):
    """simulation.py's run config of ``preset`` for ``method``, ``--rounds`` rounds, with the
    TrainSpec defaults a config's job has for the engine and checkpoints."""
    from fedforget.config import TrainSpec

    args.preset, args.method = preset, method
    rc = simulation.run_config(args, "auto")
    default = {f.name: f.default for f in fields(TrainSpec)}
    train = replace(rc.train, rounds=args.rounds, client_engine=default["client_engine"],
                    checkpoint_every=default["checkpoint_every"])  # fmt: skip
    return replace(rc, train=train)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["digits", "mcmahan", "resnet18"], choices=sorted(simulation.PRESETS))
    ap.add_argument("--methods", nargs="+", default=["fedavg"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads of each job (profiles/slurm: 1)")
    ap.add_argument("--train-rows", type=int, default=0, help="a preset on blobs with this many training rows")
    ap.add_argument("--uint8", action="store_true",
                    help="a preset on blobs with its images stored as uint8, as CIFAR's and MNIST's are (default: float32)")
    ap.add_argument("--eval-batch-sizes", type=int, nargs="+", default=[0],
                    help="a row per train.eval_batch_size (0: the config's default); on a CPU a large-map model's "
                         "evaluation batch sets much of its process")
    ap.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "fedforget-bench-data"))
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()
    # what simulation.run_config reads besides these
    args.repeats, args.warmup, args.eval, args.memory, args.epochs, args.partition = 1, 0, "local", 0, 1, "dirichlet0.5"
    presets, methods, rounds = args.presets, args.methods, args.rounds

    import torch

    from fedforget.data import DATASETS
    from fedforget.parse import client_state_mb

    rows = []
    setting = (f"fedforget train, {rounds} rounds, {args.threads} thread(s), {args.device}, Dirichlet 0.5, 1 local epoch, "
               f"local-model evaluation (the configs' default)" + (f", {args.train_rows} training rows" if args.train_rows else "") + (", uint8 images" if args.uint8 else ""))  # fmt: skip
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None

    def write() -> None:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            big = max((r["process_mb"] for r in rows if r.get("process_mb") is not None), default=None)
            Path(args.json).write_text(json.dumps({"setting": setting, "device": args.device, "gpu": gpu,
                                                   "torch": torch.__version__, "rows": rows, "process_mb_max": big},
                                                  indent=1) + "\n")  # fmt: skip

    with tempfile.TemporaryDirectory() as tmp:
        imp = [sys.executable, "-c", "import torch, fedforget.cli" + (", fedforget.engine; torch.zeros(1, device='cuda')" if gpu else "")]
        peak, secs, code = peak_of(imp, Path(tmp, "import.log"))
        rows.append({"preset": None, "method": "import_only", "peak_rss_mb": peak, "process_mb": None, "seconds": secs,
                     "exit": code})  # fmt: skip
        print(f"# {setting}\nimport only{' (+ a CUDA context)' if gpu else ''}: {peak:,.0f} MiB")
        for preset in presets:
            args.preset = preset
            simulation.prepare(args)
            for method, eval_batch in ((m, e) for m in methods for e in args.eval_batch_sizes):
                rcfg = run_config(args, preset, method)
                if eval_batch:
                    rcfg = replace(rcfg, train=replace(rcfg.train, eval_batch_size=eval_batch))
                state = client_state_mb(rcfg)
                name = f"{preset}-{method}-{rcfg.train.eval_batch_size}"
                out = Path(tmp, name)
                cmd = ["fedforget", "train", "--config-json", json.dumps(rcfg.to_dict()), "--out", str(out),
                       "--threads", str(args.threads)]  # fmt: skip
                peak, secs, code = peak_of(cmd, Path(tmp, f"{name}.log"))
                p = simulation.preset(args)
                info = DATASETS.get(rcfg.dataset.name)
                opts = info.resolve(rcfg.dataset.options)
                (n_train, n_test), dtype = info.split_sizes(opts), info.input_dtype(opts)
                row = {"preset": preset, "model": p["model"], "method": method, "clients": rcfg.partition.clients,
                       "train_rows": n_train, "test_rows": n_test, "input_shape": list(info.input_shape(opts)),
                       "input_dtype": dtype, "data_mb": info.prepared_bytes(opts) / 2**20,
                       "eval_batch_size": rcfg.train.eval_batch_size, "peak_rss_mb": peak, "client_state_mb": state,
                       "process_mb": peak - state, "seconds": secs, "exit": code}  # fmt: skip
                if code == 0:
                    rec = json.loads((out / "run.json").read_text())
                    row["engine"] = rec.get("client_engine")
                    row["peak_gpu_memory_mb"] = rec.get("peak_gpu_memory_mb")
                else:
                    row["process_mb"] = None
                    row["error"] = Path(tmp, f"{name}.log").read_text()[-2000:]
                rows.append(row)
                write()
                print(f"{preset} ({p['model']}, {n_train:,} + {n_test:,} rows of {dtype}, {row['data_mb']:,.0f} MiB), {method}, "
                      f"eval batch {rcfg.train.eval_batch_size:,}: "
                      f"peak {peak:,.0f} MiB, client_state_mb {state:,}, "
                      f"process {'failed' if code else f'{peak - state:,.0f} MiB'} ({secs:.0f} s)")  # fmt: skip
    write()


if __name__ == "__main__":
    main()
