"""Several training jobs on one device at once (issue 32, 5: ``gpu_slots``): prints numbers,
not a test.

For N in ``--jobs`` (default 1 2 4) it starts N processes, each a training job of the same
setting (its own seed), as Snakemake runs N jobs with ``gpu_slots`` = N
(profiles/gpu). Each warms up (``--warmup`` rounds: kernels chosen, CUDA graphs captured),
waits until all are warm, then trains rounds for ``--seconds`` and reports the samples its
local training processed. Throughput of N jobs = the sum of their samples/s; gain = that /
the throughput of 1 job. Also per job: peak CUDA memory (``torch.cuda.max_memory_allocated``:
what a job needs on the GPU, per model) and peak resident memory.

Settings are benchmarks/simulation.py's presets (``mcmahan``: FedSOL's McMahan CNN, 100
clients, 10% per round, batch 50; ``resnet18``: CIFAR-shaped blobs (3x32x32), the
CIFAR-style ResNet-18 with BatchNorm, 100 clients, 10 per round, batch 64, the issue's
ResNet-18 setting; ...).

    python benchmarks/packing.py --preset mcmahan --device cuda --json out.json
    python benchmarks/packing.py --preset digits --device cpu --threads 1 --jobs 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import simulation  # noqa: E402  (benchmarks/simulation.py: presets, run configs, timed rounds)

PRESETS = simulation.PRESETS


def child(args) -> None:
    """One job: warm up, say so, wait for the start file, train for --seconds."""
    import torch

    torch.set_num_threads(args.threads)
    device, one = simulation.engine_round(args, args.mode)
    rnd = 1
    for _ in range(args.warmup):
        one(rnd)
        rnd += 1
    Path(args.ready).touch()
    while not Path(args.start).exists():
        time.sleep(0.01)
    samples, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        samples += one(rnd)[1]
        rnd += 1
    elapsed = time.perf_counter() - t0
    out = {"samples": samples, "seconds": elapsed, "rounds": rnd - 1 - args.warmup,
           "samples_per_s": samples / elapsed, "peak_rss_mb": simulation.peak_rss_mb()}  # fmt: skip
    if device.type == "cuda":
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    print("RESULT " + json.dumps(out), flush=True)


def run_jobs(args, n: int, tmp: Path) -> dict:
    """N jobs at once: their results and the sum of their throughputs."""
    start = tmp / f"start-{n}"
    procs = []
    for j in range(n):
        ready = tmp / f"ready-{n}-{j}"
        cmd = [sys.executable, __file__, "--child", "--ready", str(ready), "--start", str(start), *args.passthrough]
        procs.append((ready, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    while not all(r.exists() for r, _ in procs):
        if any(p.poll() is not None for _, p in procs):
            break
        time.sleep(0.05)
    start.touch()
    jobs, failed = [], []
    for _, p in procs:  # every job to its end, a failed one's siblings too (none left on the GPU)
        out, err = p.communicate()
        lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            failed.append(err[-3000:])
        else:
            jobs.append(json.loads(lines[-1][7:]))
    if failed:
        raise JobFailed(f"{len(failed)} of {n} jobs failed:\n{failed[0]}")
    return {"jobs": n, "samples_per_s": sum(j["samples_per_s"] for j in jobs), "per_job": jobs}


class JobFailed(Exception):
    """A job of a packed run ended without its result (e.g. out of GPU memory)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="mcmahan")
    ap.add_argument("--partition", choices=["iid", "dirichlet0.5"], default="dirichlet0.5")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--mode", choices=["sequential", "vectorized"], default="vectorized", help="each job's client engine")
    ap.add_argument("--method", default="fedavg")
    ap.add_argument("--jobs", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=20.0, help="timed training per job")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per job")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--train-rows", type=int, default=0,
                    help="a preset on blobs with this many training rows (simulation.py's --train-rows)")
    ap.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "fedforget-bench-data"))
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ready", help=argparse.SUPPRESS)
    ap.add_argument("--start", help=argparse.SUPPRESS)
    args = ap.parse_args()
    # what simulation.run_config reads
    args.rounds, args.repeats, args.eval, args.memory = 10**6, 1, "none", 0
    if args.child:
        return child(args)

    from fedforget.data import prepare_dataset

    p = simulation.preset(args)
    prepare_dataset(p["dataset"], p["options"], args.data)  # once, before any timing
    args.passthrough = [
        "--preset", args.preset, "--partition", args.partition, "--epochs", str(args.epochs), "--mode", args.mode,
        "--method", args.method, "--warmup", str(args.warmup), "--seconds", str(args.seconds),
        "--threads", str(args.threads), "--device", args.device, "--data", args.data,
        "--train-rows", str(args.train_rows),
    ]  # fmt: skip
    setting = (f"{args.preset} ({p['model']}), {args.method}, {args.mode} engine, {p['clients']} clients "
               f"({args.partition}), rate {p['rate']}, batch {p['batch']}, {args.epochs} local epoch(s), "
               f"{args.threads} thread(s) per job, {args.device}, {args.warmup} warm-up rounds, {args.seconds:g} s timed"
               + (f", {args.train_rows} training rows" if args.train_rows else ""))  # fmt: skip
    print(f"# {setting}")
    results, failed = [], None

    def write() -> None:  # after every count of jobs: a failed or cut run keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps({"setting": setting, "args": vars(args) | {"passthrough": None},
                                                   "results": results}, indent=1) + "\n")  # fmt: skip

    with tempfile.TemporaryDirectory() as tmp:
        for n in args.jobs:
            try:
                r = run_jobs(args, n, Path(tmp))
            except JobFailed as e:  # [D] kept, as the last entry; more jobs at once would fail as well
                results.append({"jobs": n, "error": str(e)})
                failed = f"{n} job(s): {e}"
                write()
                break
            r["gain"] = r["samples_per_s"] / results[0]["samples_per_s"] if results else 1.0
            results.append(r)
            mem = max(j.get("peak_cuda_mb", 0.0) for j in r["per_job"])
            print(f"{n} job(s): {r['samples_per_s']:9.0f} samples/s  gain {r['gain']:.2f}x"
                  + (f"  peak CUDA memory per job {mem:.0f} MiB" if mem else ""), flush=True)  # fmt: skip
            write()
    if failed:
        raise SystemExit(failed)


if __name__ == "__main__":
    main()
