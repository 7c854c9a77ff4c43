"""Where a round's time goes: prints numbers, not a test.

Runs rounds of one mode of ``benchmarks/simulation.py`` (same presets and modes: central,
sequential, vectorized) in this process, then:

- the median seconds per round over ``--rounds`` timed rounds (after ``--warmup``);
- on a GPU, how busy the GPU was: the time covered by its kernels and copies (the union of
  their intervals, so that kernels overlapping on several streams count once; before
  2026-12-04 their summed time, which could pass 100 %) over the wall time of the profiled
  rounds (well under 1 means the host side, Python and kernel launches, is the limit, not
  the GPU's arithmetic); their summed time beside it;
- ``torch.profiler``'s table of the operators that took the most time.

``--cudnn-benchmark`` turns on cuDNN's autotuner (``torch.backends.cudnn.benchmark``) to see
what it would gain; fedforget leaves it off (its algorithm choice is timed, so it can differ
between runs).

    python benchmarks/profile_round.py --preset mcmahan --mode vectorized --device cuda
    python benchmarks/profile_round.py --preset digits --mode sequential --epochs 2
    python benchmarks/profile_round.py --preset resnet18 --device cuda --method der --tasks 5 --warmup 5 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import simulation as sim  # noqa: E402  (benchmarks/simulation.py)

# the CUDA runtime/driver calls that launch one kernel each (a CUDA graph's replay is one
# cudaGraphLaunch for all the kernels it holds)
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def covered(intervals) -> float:
    """The length of the union of ``intervals`` ((start, end) pairs): the time at least one
    of them runs."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(sim.PRESETS), default="mcmahan")
    ap.add_argument("--mode", choices=["central", "sequential", "vectorized"], default="vectorized")
    ap.add_argument("--partition", choices=["iid", "dirichlet0.5"], default="dirichlet0.5")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--eval", choices=["none", "global"], default="none")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (then as many profiled)")
    ap.add_argument("--rows", type=int, default=25, help="operators in the table")
    ap.add_argument("--method", default="fedavg", help="the engine's method")
    ap.add_argument("--params", default=None, help="its hyperparameters, JSON (default: its defaults)")
    ap.add_argument("--tasks", type=int, default=1, help="a class-incremental split: task 0 in the warm-up, "
                    "the timed and profiled rounds in task 1 (2 x --rounds < --warmup)")  # fmt: skip
    ap.add_argument("--heads", choices=["shared", "per_task"], default="shared")
    ap.add_argument("--cudnn-benchmark", action="store_true")
    ap.add_argument("--train-rows", type=int, default=0,
                    help="a preset on blobs with this many training rows (simulation.py's --train-rows)")
    ap.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "fedforget-bench-data"))
    args = ap.parse_args()
    args.memory = 0  # simulation.run_config reads these
    # [D] the run is configured for rounds x repeats + warmup + 1 rounds: 2 (timed, then profiled)
    # keeps its final round, where the engine evaluates the global model, out of the profile
    args.repeats = 2
    if args.tasks > 1 and 2 * args.rounds >= args.warmup:  # task 1 holds warmup rounds, its last a task end
        ap.error(f"--tasks {args.tasks}: the {args.rounds} timed and {args.rounds} profiled rounds must end within "
                 f"task 1, before its task end: 2 x --rounds < --warmup ({args.warmup})")  # fmt: skip

    import torch
    from torch.profiler import ProfilerActivity, profile

    from fedforget.data import prepare_dataset

    p = sim.preset(args)
    prepare_dataset(p["dataset"], p["options"], args.data)
    torch.set_num_threads(args.threads)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    device, one = sim.mode_round(args, args.mode)
    rnd = 0
    for _ in range(args.warmup):
        rnd += 1
        one(rnd)
    times = []
    for _ in range(args.rounds):
        rnd += 1
        times.append(one(rnd)[0])
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(args.rounds):
            rnd += 1
            one(rnd)
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    print(f"# {args.preset} ({args.partition}), {args.method} {args.params or ''}, tasks {args.tasks}, {args.mode}, {args.epochs} local epochs, eval {args.eval}, {device}, "
          f"{args.threads} threads, cudnn.benchmark={args.cudnn_benchmark}"
          + (f", {args.train_rows} training rows" if args.train_rows else ""))  # fmt: skip
    print(f"s/round (median of {args.rounds}): {statistics.median(times):.4f}  (min {min(times):.4f})")
    if cuda:
        def on_gpu(e) -> bool:  # a kernel's or a copy's event (averaged, or each one)
            return str(getattr(e, "device_type", "")).endswith("CUDA")

        kernel_us = sum(getattr(e, "self_device_time_total", 0) for e in events if on_gpu(e))
        busy_us = covered((e.time_range.start, e.time_range.end) for e in prof.events() if on_gpu(e))
        launches = sum(e.count for e in events if e.key in LAUNCHES)
        graphs = sum(e.count for e in events if e.key in ("cudaGraphLaunch", "cuGraphLaunch"))
        print(f"GPU kernels {kernel_us / 1e6:.4f} s summed, of {wall:.4f} s wall over {args.rounds} profiled rounds "
              f"(GPU busy {busy_us / 1e6 / wall:.0%}: the union of their intervals; summed {kernel_us / 1e6 / wall:.0%}); "
              f"kernel launches per round {launches / args.rounds:.0f}, "
              f"graph launches per round {graphs / args.rounds:.0f}")  # fmt: skip
    key = "device_time_total" if cuda else "cpu_time_total"
    print(events.table(sort_by=key, row_limit=args.rows))
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
