"""Where CPU results start to depend on the torch thread count: the first op of a run whose
output bytes differ between two thread counts.

One FedAvg round (sequential trainer) of ``benchmarks/fingerprints.py``'s tiny runs (digits +
a small CNN, or Iris + MLP, 4 clients, batch 8) is traced op by op (a TorchDispatchMode
records the SHA-256 prefix of every floating-point CPU output of every op, in call order) once per thread count,
each in its own process; the first op whose output differs is printed with the ops before it.
``--no-mkldnn`` runs with oneDNN's convolutions off (torch.backends.mkldnn.enabled = False)
to see what differs next.

    python benchmarks/thread_ops.py --dataset digits --threads 1 2
    python benchmarks/thread_ops.py --dataset digits --threads 1 2 --no-mkldnn
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def trace(dataset: str, threads: int, mkldnn: bool) -> list[list]:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import fingerprints as fp

    torch.backends.mkldnn.enabled = mkldnn
    fp.THREADS[0] = threads
    torch.set_num_threads(threads)
    log: list[list] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            for i, o in enumerate(outs):  # each output of the op (convolution_backward: input, weight, bias)
                if isinstance(o, torch.Tensor) and o.is_floating_point() and o.device.type == "cpu":
                    data = o.detach().contiguous().numpy().tobytes()
                    name = str(func) + (f"[{i}]" if len(outs) > 1 else "")
                    log.append([name, list(o.shape), hashlib.sha256(data).hexdigest()[:12]])
            return out

    with tempfile.TemporaryDirectory(prefix="fedforget-threads-") as tmp:
        root = Path(tmp)
        fp.prepare_dataset(dataset, {}, root)
        model, options = ("cnn2d", fp.SMALL_CNN) if dataset == "digits" else ("mlp", {})
        rc = fp.run_config(root, dataset=dataset, model=model, model_options=options, method="fedavg",
                           engine="sequential", public=None, scenario=None, rounds=1)  # fmt: skip
        sim = fp.Simulation(rc, device=fp.CPU)
        with Record():
            sim.run(progress=False)
    return log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", choices=["digits", "iris"], default="digits")
    ap.add_argument("--threads", type=int, nargs=2, default=[1, 2])
    ap.add_argument("--no-mkldnn", action="store_true")
    ap.add_argument("--context", type=int, default=4, help="ops printed before the first difference")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        json.dump(trace(a.dataset, a.child, not a.no_mkldnn), sys.stdout)
        return
    logs = []
    for n in a.threads:
        cmd = [sys.executable, __file__, "--dataset", a.dataset, "--child", str(n)] + (["--no-mkldnn"] if a.no_mkldnn else [])
        logs.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
    one, two = logs
    print(f"# {a.dataset}, one FedAvg round, threads {a.threads[0]} vs {a.threads[1]}, "
          f"oneDNN {'off' if a.no_mkldnn else 'on'}: {len(one)} / {len(two)} ops traced")  # fmt: skip
    first = next((i for i, (x, y) in enumerate(zip(one, two)) if x != y), None)
    if first is None:
        print("every op's output is the same bytes")
        return
    for i in range(max(0, first - a.context), first):
        print(f"  op {i}: {one[i][0]} {one[i][1]} same")
    print(f"  op {first}: {one[first][0]} {one[first][1]} DIFFERS ({one[first][2]} vs {two[first][2]})")


if __name__ == "__main__":
    main()
