"""Seconds per reconstructed sample of GLFC's (and LGA's) proxy server, for every distinct
setting of the paper configs (issue 32, item 6): prints numbers, not a test.

At the first round of every task each sampled client sends one prototype gradient per class
of its task data, and the server inverts each into samples by L-BFGS on a gradient-matching
loss (``methods/glfc.py``: ``reconstruct``, ``recon_iters`` steps of up to ``recon_inner``
iterations on DLG's LeNet ``gradient_encoder``). One sample costs ``recon_iters`` x
``recon_inner`` closures of a tiny network at batch 1: bound by latency, not FLOPs, so
``benchmarks/paper_runtime.py`` times those reconstructions from this file
(``--recon-cost``) rather than by its FLOP model.

For each distinct (input shape, classes, recon_iters, recon_inner) of the runs of GLFC, LGA and
FedGP over either, ``--samples`` reconstructions of a gradient made from a random row, run
to the end, on ``--device``; ``--iters`` n stops each after n of its steps and scales the time
to ``recon_iters`` (``extrapolated`` in the row: a step may end before its ``recon_inner``
iterations once L-BFGS converges, so the scaled time is an upper bound).

    python benchmarks/recon_cost.py --json recon.json
    python benchmarks/recon_cost.py --device cuda --json recon.json
    python benchmarks/recon_cost.py --iters 25 --samples 1 --json recon.json     (a quick CPU look)
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from paper_runtime import REPO, config_runs, recon_key, recon_params

from fedforget.data import DATASETS
from fedforget.methods.glfc import encoder_gradient, gradient_encoder, reconstruct


def paper_settings() -> list[dict[str, Any]]:
    """The distinct reconstruction settings of config/experiments/paper/*.yaml, with the number
    of runs using each (most runs first)."""
    runs: collections.Counter = collections.Counter()
    extra: dict[tuple, dict[str, Any]] = {}
    for path in sorted((REPO / "config/experiments/paper").glob("*.yaml")):
        for rc in config_runs(path):
            p = recon_params(rc.method.name, dict(rc.method.params))
            if p is None:
                continue
            info = DATASETS.get(rc.dataset.name)
            shape = tuple(info.input_shape(info.resolve(rc.dataset.options)))
            key = recon_key(shape, info.num_classes, p.recon_iters, p.recon_inner)
            runs[key] += 1
            extra[key] = {"recon_lr": p.recon_lr}
    return [{"shape": list(k[0]), "classes": k[1], "recon_iters": k[2], "recon_inner": k[3], **extra[k], "paper_runs": n}
            for k, n in runs.most_common()]  # fmt: skip


def time_setting(s: dict[str, Any], samples: int, iters: int, device: torch.device) -> dict[str, Any]:
    shape, classes = tuple(s["shape"]), s["classes"]
    enc = gradient_encoder(shape, classes, 0).to(device)
    run_iters = min(iters, s["recon_iters"]) if iters else s["recon_iters"]
    seconds = []
    for i in range(samples + 1):  # the first untimed (allocations, kernels)
        gen = torch.Generator().manual_seed(i)
        x = torch.rand(1, *shape, generator=gen).to(device)
        y = torch.tensor([i % classes], device=device)
        grads = encoder_gradient(enc, x, y)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        reconstruct(enc, grads, int(y), shape, run_iters, s["recon_lr"], 1, gen, s["recon_inner"])
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            seconds.append((time.perf_counter() - t0) * s["recon_iters"] / run_iters)
    return {**s, "s_per_sample": statistics.median(seconds), "samples": samples, "iters_run": run_iters,
            "extrapolated": run_iters < s["recon_iters"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--samples", type=int, default=2, help="timed reconstructions per setting (after one untimed)")
    ap.add_argument("--iters", type=int, default=0, help="steps run per reconstruction, scaled to recon_iters (0: all)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = []
    for s in paper_settings():
        r = time_setting(s, a.samples, a.iters, device)
        rows.append(r)
        print(f"shape {tuple(r['shape'])} classes {r['classes']:>4} iters {r['recon_iters']} x {r['recon_inner']}: "
              f"{r['s_per_sample']:.2f} s per sample{' (extrapolated from ' + str(r['iters_run']) + ' steps)' if r['extrapolated'] else ''}"
              f"  [{r['paper_runs']} paper runs]")  # fmt: skip
    out = {"setting": {"device": name, "threads": a.threads, "torch": torch.__version__}, "rows": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
