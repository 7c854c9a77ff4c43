"""Where the batched client engine pays off on a CPU, and what checkpoints cost: prints
numbers, not a test.

1. ``jobs``: whole training jobs of the default config (config/config.yaml, seed 0: digits
   and mnist1d, Dirichlet 0.1, 1 thread, as Snakemake runs them), in one process, timed
   with ``run_training``: sequential vs vectorized client engine (mnist1d; digits' cnn2d
   is sequential under auto) and checkpoint after every round vs never (digits).
   Needs the default config's data prepared (`fedforget prepare --config config/config.yaml`).
2. ``conv``: one Conv2d layer's forward + weight gradient for 10 clients x 50 samples:
   batched under vmap (what the vectorized engine does), as im2col + batched matmul, and
   as a loop over clients, for the layer shapes of the McMahan CNN and of cnn2d.

    python benchmarks/engine_choice.py jobs
    python benchmarks/engine_choice.py conv
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import replace

import torch
import torch.nn.functional as F


def jobs() -> None:
    from fedforget.config import load_config
    from fedforget.runner import run_training

    wf = load_config("config/config.yaml")
    rcs = [rc for rc in wf.runs() if rc.seed == 0]
    digits, mnist1d = rcs[0], rcs[3]  # dirichlet-0.1 of each dataset
    plan = [(digits, 1000, "auto"), (digits, 1, "auto"), (digits, 1000, "auto"),
            (mnist1d, 1, "sequential"), (mnist1d, 1, "vectorized"),
            (mnist1d, 1, "sequential"), (mnist1d, 1, "vectorized")]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for i, (rc, every, eng) in enumerate(plan):
            r = replace(rc, train=replace(rc.train, checkpoint_every=every, threads=1, client_engine=eng))
            t = time.perf_counter()
            rec = run_training(r, f"{tmp}/{i}", progress=False)
            print(f"{rc.dataset.label:8s} {rc.partition.slug:32s} checkpoint_every={every:<5d} "
                  f"client_engine={eng:10s} -> {rec['client_engine']:10s} {time.perf_counter() - t:6.2f} s")  # fmt: skip


def conv_unfold(x, w, b, pad):
    """conv2d as im2col + matmul (batched over clients when vmapped)."""
    _, _, h, wd = x.shape
    o, _, k, _ = w.shape
    out = w.reshape(o, -1) @ F.unfold(x, k, padding=pad)
    return out.reshape(x.shape[0], o, h + 2 * pad - k + 1, wd + 2 * pad - k + 1) + b.view(1, o, 1, 1)


def time_layer(cin: int, cout: int, hw: int, k: int, pad: int, m: int = 10, bs: int = 50) -> dict[str, float]:
    from torch.func import grad, vmap

    x = torch.randn(m, bs, cin, hw, hw)
    w = torch.randn(m, cout, cin, k, k)
    b = torch.randn(m, cout)

    def loss_conv(w, b, x):
        return F.conv2d(x, w, b, padding=pad).square().mean()

    def loss_unfold(w, b, x):
        return conv_unfold(x, w, b, pad).square().mean()

    batched_conv = vmap(grad(loss_conv, argnums=(0, 1)))
    batched_unfold = vmap(grad(loss_unfold, argnums=(0, 1)))
    per_client = grad(loss_conv, argnums=(0, 1))

    def loop():
        for c in range(m):
            per_client(w[c], b[c], x[c])

    res = {}
    for name, fn in (("vmap conv", lambda: batched_conv(w, b, x)),
                     ("vmap im2col", lambda: batched_unfold(w, b, x)), ("loop", loop)):  # fmt: skip
        fn()
        t = time.perf_counter()
        for _ in range(5):
            fn()
        res[name] = (time.perf_counter() - t) / 5 * 1e3
    return res


def conv() -> None:
    torch.set_num_threads(1)
    for cin, cout, hw, k, pad in ((1, 32, 28, 5, 0), (32, 64, 12, 5, 0), (1, 32, 8, 3, 1), (32, 64, 8, 3, 1)):
        res = time_layer(cin, cout, hw, k, pad)
        print(f"conv {cin}->{cout} {k}x{k} on {hw}x{hw}, 10 clients x 50: " + ", ".join(f"{n} {v:.1f} ms" for n, v in res.items()))


if __name__ == "__main__":
    {"jobs": jobs, "conv": conv}[sys.argv[1] if len(sys.argv) > 1 else "jobs"]()
