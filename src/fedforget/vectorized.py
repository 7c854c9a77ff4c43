"""Clients trained together: one batched forward/backward for all sampled clients per step.

The sampled clients' weights are stacked along a leading client dimension and trained with
``torch.func.vmap`` over ``functional_call`` (each client its own weights, its own data);
the local optimizer (SGD with momentum and weight decay, as ``torch.optim.SGD``) runs on the
stacked tensors. Each client keeps its own numerics:

- the same minibatches as when it trains alone (``Simulation.train_client``): its shuffling
  generator is keyed by (seed, round, client), so its permutation of each epoch is the same;
- its own batch sizes, the last batch of an epoch included: batches are padded to the batch
  size and the padded rows are masked out of the loss (sum of the real rows' losses divided
  by their number = the mean the sequential loop takes);
- its own number of steps: clients are ordered by step count (descending), so those still
  training at step k are a prefix of the stack and the finished ones are sliced off (their
  weights and momentum stop moving, and cost nothing).

The results match the sequential loop up to floating-point summation order (a test checks
1e-5 on a tiny config). The engine uses this path only where it computes the same thing:
the method's client-side hooks are FedAvg's (``client_side_is_fedavg``), the model has no
buffers (BatchNorm running statistics are per-client state that ``vmap`` cannot update in
place), the optimizer is SGD and no per-step diagnostics are asked for. Otherwise it falls
back to one client after another; ``run.json`` records which path ran.

Memory: the stack holds (weights + momentum + gradient) for the clients of one group; the
engine splits a round's clients into groups of at most ``train.max_parallel_clients``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from .methods.base import FedAvg

CLIENT_HOOKS = ("client_begin", "task_loss", "extra_loss", "local_loss", "backward", "transform_grad", "client_end")


def client_side_is_fedavg(method_cls: type) -> bool:
    """True if the method trains clients exactly as FedAvg does (server hooks may differ)."""
    return all(getattr(method_cls, h) is getattr(FedAvg, h) for h in CLIENT_HOOKS)


def why_not_vectorized(method_cls: type, model: nn.Module, optimizer_name: str) -> str | None:
    """None if clients can be trained together, else the reason (recorded in run.json)."""
    if not client_side_is_fedavg(method_cls):
        hooks = [h for h in CLIENT_HOOKS if getattr(method_cls, h) is not getattr(FedAvg, h)]
        return f"method '{method_cls.name}' overrides client hooks {hooks}"
    if any(True for _ in model.buffers()):
        return "the model has buffers (e.g. BatchNorm running statistics)"
    if optimizer_name != "sgd":
        return f"optimizer '{optimizer_name}' (the batched path implements SGD)"
    return None


@dataclass
class ClientJob:
    cid: int
    start: int  # the client's rows are start:start+n of the engine's data (sorted by client)
    n: int
    generator: torch.Generator  # the client's shuffling generator, keyed as in train_client


@dataclass
class ClientResult:
    cid: int
    params: dict[str, torch.Tensor]  # state dict after local training
    mean_loss: float  # mean minibatch loss over its steps
    steps: int


def _batch_table(jobs: Sequence[ClientJob], epochs: int, bs: int, device: torch.device):
    """Per client, the rows of each step's minibatch in the engine's data, padded with -1:
    [M, T, bs], T = the largest step count."""
    tables, steps = [], []
    for job in jobs:
        n = job.n
        spe = math.ceil(n / bs)
        pad = spe * bs - n
        rows = []
        for _ in range(epochs):
            perm = torch.randperm(n, generator=job.generator) + job.start
            if pad:
                perm = torch.cat([perm, torch.full((pad,), -1, dtype=perm.dtype)])
            rows.append(perm.view(spe, bs))
        tables.append(torch.cat(rows))
        steps.append(spe * epochs)
    t_max = max(steps)
    out = torch.full((len(jobs), t_max, bs), -1, dtype=torch.long)
    for j, tab in enumerate(tables):
        out[j, : len(tab)] = tab
    return out.to(device), steps


def train_clients_together(
    model: nn.Module,
    global_params: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    jobs: Sequence[ClientJob],
    *,
    lr: float,
    momentum: float,
    weight_decay: float,
    epochs: int,
    batch_size: int,
) -> list[ClientResult]:
    """Local SGD of every job from ``global_params``, all clients in one batched step;
    ``x``, ``y`` are the engine's training data, sorted by client (``ClientJob.start``).
    Results come back in the order of ``jobs``."""
    device = x.device
    order = sorted(range(len(jobs)), key=lambda j: -jobs[j].n)  # most steps first
    jobs_sorted = [jobs[j] for j in order]
    m = len(jobs_sorted)
    table, steps = _batch_table(jobs_sorted, epochs, batch_size, device)

    names = [k for k, _ in model.named_parameters()]
    params = {k: global_params[k].unsqueeze(0).repeat(m, *[1] * global_params[k].dim()) for k in names}
    bufs = {k: torch.zeros_like(v) for k, v in params.items()} if momentum else None
    loss_sum = torch.zeros(m, device=device)

    def client_loss(p, xb, yb, mask):
        logits = functional_call(model, p, (xb,))
        per = F.cross_entropy(logits, yb, reduction="none") * mask
        return per.sum() / mask.sum()

    step_fn = vmap(grad_and_value(client_loss))
    steps_t = torch.tensor(steps)
    was_training = model.training
    model.train()
    for k in range(table.shape[1]):
        active = int((steps_t > k).sum())  # a prefix: clients sorted by step count
        idx = table[:active, k]  # [a, bs]
        mask = (idx >= 0).to(x.dtype)
        safe = idx.clamp(min=0)
        xb, yb = x[safe], y[safe]  # [a, bs, ...]: one gather for all clients
        p_act = {n: v[:active] for n, v in params.items()}
        grads, losses = step_fn(p_act, xb, yb, mask)
        loss_sum[:active] += losses.detach()
        with torch.no_grad():
            for n in names:  # torch.optim.SGD: d = g + wd*p; buf = mom*buf + d; p -= lr*buf
                p, g = p_act[n], grads[n]
                if weight_decay:
                    g = g.add(p, alpha=weight_decay)
                if bufs is not None:
                    b = bufs[n][:active]
                    b.mul_(momentum).add_(g)
                    g = b
                p.add_(g, alpha=-lr)
    model.train(was_training)

    state_keys = list(global_params)
    results: list[ClientResult | None] = [None] * m
    for j, job in enumerate(jobs_sorted):
        state = {k: (params[k][j] if k in params else global_params[k].clone()) for k in state_keys}
        results[order[j]] = ClientResult(job.cid, state, loss_sum[j].item() / steps[j], steps[j])
    return results  # type: ignore[return-value]


@torch.no_grad()
def evaluate_stacked(
    model: nn.Module,
    stacked: Sequence[dict[str, torch.Tensor]],
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int = 1024,
) -> list[float]:
    """Test accuracy of several weight sets of one architecture, in one batched pass per
    test batch (the local models after local training)."""
    names = [k for k, _ in model.named_parameters()]
    p = {k: torch.stack([s[k] for s in stacked]) for k in names}
    fwd = vmap(lambda pp, xb: functional_call(model, pp, (xb,)), in_dims=(0, None))
    was_training = model.training
    model.eval()
    correct = torch.zeros(len(stacked), device=x.device)
    for s in range(0, len(y), batch_size):
        logits = fwd(p, x[s : s + batch_size])  # [M, b, C]
        correct += (logits.argmax(-1) == y[s : s + batch_size]).sum(1)
    model.train(was_training)
    return (correct / max(len(y), 1)).tolist()
