"""Where the batched client engine pays off on a CPU, and what checkpoints cost: prints
numbers, not a test. These are the measurements behind ``client_engine: auto``
(``fedforget.vectorized.auto_prefers_sequential``).

1. ``jobs``: whole training jobs of the default config (config/config.yaml, seed 0: digits
   and mnist1d, Dirichlet 0.1, 1 thread, as Snakemake runs them), in one process, timed
   with ``run_training``: sequential vs vectorized client engine for each dataset (A/B,
   twice), and a checkpoint after every round vs never (digits).
   Needs the default config's data prepared (`fedforget prepare --config config/config.yaml`).
2. ``step``: one local step (forward + backward of each client's own mean loss) of 10
   clients x 4 or 32 samples, for each embedded model and the McMahan CNN: ``stacked_forward``
   (the batched engine's path), ``vmap`` over ``functional_call`` (its fallback), the
   clients one after another (the sequential engine's ``nn.Module`` calls) on 2 intra-op
   threads, and the clients one after another on 2 worker threads of one intra-op thread
   each, half the clients each (the batched engine's client-by-client steps on a CPU).
3. ``eval``: test accuracy of 10 local models on a 1000-sample test set, batched
   (``evaluate_stacked(batched=True)``) vs one model after another.
4. ``conv``: one Conv2d layer's forward + weight gradient for 10 clients x 50 samples:
   batched under vmap, as im2col + batched matmul, and as a loop over clients, for the
   layer shapes of the McMahan CNN and of cnn2d.

    python benchmarks/engine_choice.py jobs
    python benchmarks/engine_choice.py step
    python benchmarks/engine_choice.py eval
    python benchmarks/engine_choice.py conv
"""

from __future__ import annotations

import copy
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch
import torch.nn.functional as F


def jobs() -> None:
    from fedforget.parse import load_config
    from fedforget.runner import run_training

    wf = load_config("config/config.yaml")
    rcs = [rc for rc in wf.runs() if rc.seed == 0]
    digits, mnist1d = rcs[0], rcs[3]  # dirichlet-0.1 of each dataset
    plan = [(rc, 1, eng) for rc in (digits, mnist1d) for eng in ("sequential", "vectorized", "vectorized", "sequential")]
    plan += [(digits, 1000, "sequential"), (digits, 1, "sequential"), (digits, 1000, "sequential")]
    with tempfile.TemporaryDirectory() as tmp:
        for i, (rc, every, eng) in enumerate(plan):
            r = replace(rc, train=replace(rc.train, checkpoint_every=every, threads=1, client_engine=eng))
            t = time.perf_counter()
            rec = run_training(r, f"{tmp}/{i}", progress=False)
            print(f"{rc.dataset.label:8s} {rc.partition.slug:32s} checkpoint_every={every:<5d} "
                  f"client_engine={eng:10s} -> {rec['client_engine']:10s} {time.perf_counter() - t:6.2f} s")  # fmt: skip


MODELS = [("mlp", (1, 8, 8), {}), ("cnn2d", (1, 8, 8), {}), ("cnn1d", (1, 40), {}),
          ("cnn_mcmahan", (1, 28, 28), {"padding": 0})]  # fmt: skip


def _median_ms(fn, reps: int = 10, rounds: int = 5) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t) / reps * 1e3)
    return sorted(times)[len(times) // 2]


def time_step(model, g: int, b: int, shape) -> dict[str, float]:
    """ms per local step of g clients x b samples: stacked_forward, vmap, a loop."""
    from torch.func import functional_call, grad, vmap

    from fedforget.vectorized import stacked_forward

    p = {k: v.detach().unsqueeze(0).repeat(g, *[1] * v.dim()) for k, v in model.named_parameters()}
    x, y = torch.randn(g, b, *shape), torch.randint(0, 10, (g, b))

    def stacked():
        leaves = {k: v.detach().requires_grad_() for k, v in p.items()}
        logits = stacked_forward(model, leaves, x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(g, b).mean(1)
        torch.autograd.grad(loss.sum(), list(leaves.values()))

    vm = vmap(grad(lambda pp, xb, yb: F.cross_entropy(functional_call(model, pp, (xb,)), yb)))

    def loop():
        for i in range(g):
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[i]), y[i]).backward()

    replicas = [copy.deepcopy(model) for _ in range(2)]

    def work(j: int) -> None:
        torch.set_num_threads(1)
        for i in range(j, g, 2):
            replicas[j].zero_grad(set_to_none=True)
            F.cross_entropy(replicas[j](x[i]), y[i]).backward()

    with ThreadPoolExecutor(2) as pool:

        def two_workers():
            try:
                list(pool.map(work, range(2)))
            finally:
                torch.set_num_threads(2)

        return {"stacked": _median_ms(stacked), "vmap": _median_ms(lambda: vm(p, x, y)), "loop": _median_ms(loop),
                "loop, 2 workers x 1 thread": _median_ms(two_workers)}  # fmt: skip


def step() -> None:
    from fedforget.models import build_model

    torch.set_num_threads(2)
    for name, shape, opts in MODELS:
        model = build_model(name, shape, 10, opts)
        for b in (4, 32):
            res = time_step(model, 10, b, shape)
            print(f"step {name:11s} 10 clients x {b:2d}: " + ", ".join(f"{k} {v:6.2f} ms" for k, v in res.items()))


def time_eval(model, shape) -> dict[str, float]:
    """ms to evaluate 10 local models on 1000 samples, batched and one by one."""
    from fedforget.vectorized import evaluate_stacked

    sets = [{k: v.detach().clone() for k, v in model.state_dict().items()} for _ in range(10)]
    x, y = torch.randn(1000, *shape), torch.randint(0, 10, (1000,))
    return {f"batched={b}": _median_ms(lambda b=b: evaluate_stacked(model, sets, x, y, 1024, batched=b), 1, 3)
            for b in (True, False)}  # fmt: skip


def evaluation() -> None:
    from fedforget.models import build_model

    torch.set_num_threads(1)
    for name, shape, opts in MODELS:
        res = time_eval(build_model(name, shape, 10, opts), shape)
        print(f"eval {name:11s} 10 models x 1000 samples, 1 thread: " + ", ".join(f"{k} {v:6.1f} ms" for k, v in res.items()))


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
    {"jobs": jobs, "step": step, "eval": evaluation, "conv": conv}[sys.argv[1] if len(sys.argv) > 1 else "jobs"]()
