"""The federated simulation engine: FedAvg's round loop with the method hooks of
``fedforget.methods.base``.

Design notes
- Data live as tensors on the training device; a client's data in a task are one range of
  positions, a minibatch one gather (``fedforget.clientdata``). No DataLoader, no
  per-sample Python. Tasks: the scenario (``fedforget.data.scenario``) maps each round to
  the server's task and each client to its task; a non-continual run is its one-task case,
  through the same loop. Evaluation per task: ``fedforget.evaluation``; checkpoints:
  ``fedforget.checkpoint``; diagnostics: ``fedforget.metrics``.
- One model object is reused for every client (weights loaded from the global state), so
  memory does not grow with the number of clients.
- Randomness is keyed, not sequential: the client schedule by (seed, round), each client's
  shuffling by (seed, round, client), model init by seed. Every method therefore sees the
  same clients in the same rounds, and results do not depend on the order clients run in.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .checkpoint import capture, restore
from .clientdata import TaskView, load_run_data
from .config import OptimizerSpec, RunConfig
from .evaluation import Evaluator
from .methods import METHODS, ClientContext, FedAvg, RunInfo, ServerContext, Upload, make_params
from .methods.base import to_device
from .metrics import weight_divergence
from .models import build_model
from .progress import RoundProgress, progress_mode
from .utils import FedForgetError, seed_sequence, torch_seed
from .vectorized import (
    ClientJob,
    auto_prefers_sequential,
    evaluate_stacked,
    has_step_terms,
    train_clients_together,
    why_not_vectorized,
)

log = logging.getLogger(__name__)

# stream tags for keyed randomness
SAMPLE_STREAM, SHUFFLE_STREAM, INIT_STREAM = 0x51, 0x52, 0x53

# metrics.csv columns written for every method; "test" is always the full global test set.
# Every value is a deterministic function of the config and seed (wall-clock times are kept
# apart, in TIMING_COLUMNS / timings.csv), so a rerun or a resumed run gives the same bytes.
BASE_COLUMNS = [
    "round",  # 0 = the initial global model, before any training
    "lr",  # local learning rate used in this round
    "n_sampled_clients",
    "sampled_clients_local_train_loss_mean",  # mean over sampled clients of their mean minibatch loss
    "global_model_test_acc",  # aggregated model, full test set
    "global_model_test_loss",
    "local_models_global_test_acc_mean",  # each sampled client's model after local training, full test set
    "local_models_global_test_acc_min",
]
TIMING_COLUMNS = [
    "round",
    "train_time_s",  # local training + aggregation of this round
    "eval_time_s",
    "elapsed_s",  # since the run started (a resumed run continues the count)
]

def sample_clients(seed: int, rnd: int, clients: int, rate: float) -> list[int]:
    """Clients sampled in round ``rnd`` (1-based): max(1, round(rate*K)) without
    replacement, from a generator keyed by (seed, round) only."""
    m = max(1, int(round(rate * clients)))
    if m >= clients:
        return list(range(clients))
    rng = np.random.default_rng(seed_sequence(seed, rnd, SAMPLE_STREAM))
    return sorted(int(c) for c in rng.choice(clients, size=m, replace=False))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise FedForgetError(f"train.device='{name}' but no CUDA device is available")
    return dev


def make_optimizer(params, spec: OptimizerSpec, lr: float) -> torch.optim.Optimizer:
    """The local optimizer. ``foreach=True`` (PyTorch's default only on a GPU): one multi-
    tensor kernel per update step instead of one per parameter tensor, the same numbers bit
    for bit (tests/test_engine.py), less per-step overhead on a CPU with small models."""
    if spec.name == "sgd":
        return torch.optim.SGD(
            params, lr=lr, momentum=spec.momentum, weight_decay=spec.weight_decay, foreach=True
        )
    if spec.name == "adam":
        return torch.optim.Adam(
            params, lr=lr, betas=tuple(spec.betas), weight_decay=spec.weight_decay, foreach=True
        )
    raise FedForgetError(f"train.optimizer.name='{spec.name}'; allowed: sgd, adam")


class Diverged(Exception):
    pass


class Simulation:
    """One federated training run (one experiment x dataset x partition x method x seed)."""

    def __init__(
        self, cfg: RunConfig, device: torch.device | None = None, verify: bool = True
    ) -> None:
        self.cfg = cfg
        t = cfg.train
        self.device = device or resolve_device(t.device)
        if t.threads > 0:
            torch.set_num_threads(t.threads)
        method_cls = METHODS.get(cfg.method.name, "method.name")
        params = make_params(cfg.method.name, cfg.method.params, "method.params")

        data = load_run_data(cfg, self.device, method_cls.public_labels, verify)
        self.clients, self.scenario = data.clients, data.scenario
        self.num_classes, public = data.num_classes, data.public
        dev = self.device

        torch.manual_seed(torch_seed(cfg.seed, INIT_STREAM))
        self.model = self.build(data)
        server_model = self.build(data)
        self.global_params = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        server_model.load_state_dict(self.global_params)
        # the client model's tensors, for an in-place reload at each client (cheaper than
        # load_state_dict, which re-validates keys and shapes every time)
        self._model_tensors = dict(self.model.state_dict(keep_vars=True))
        info = RunInfo(dev, data.num_classes, cfg.seed, cfg.partition.clients, t, self.scenario)
        self.method = method_cls(params, info)
        self.server = ServerContext(0, self.global_params, server_model, dev, public)
        self.evaluator = Evaluator(data.test, self.scenario, self.method, self.server, t.eval_batch_size)
        self.client_state: dict[int, dict[str, Any]] = {}
        # the task each client last trained on, and (asynchronous boundaries) what clients
        # that moved on sent at their task's end, until the server's task ends
        self.client_task: dict[int, int] = {}
        self.task_reports: dict[int, Any] = {}
        # per-client method state (SCAFFOLD's c_i, FedDyn's gradient, MOON's previous model)
        # lives in host memory between the client's rounds when training on a GPU, so device
        # memory does not grow with the number of clients
        self.offload_client_state = dev.type == "cuda"
        # clients trained together where that computes the same thing (fedforget.vectorized)
        why_not = why_not_vectorized(method_cls, self.model, t.optimizer.name, t.drop_last)
        if t.client_engine == "vectorized" and why_not is not None:
            raise FedForgetError(f"train.client_engine='vectorized' is not possible here: {why_not}")
        if t.client_engine == "sequential":
            why_not = "train.client_engine = sequential"
        elif why_not is None and t.client_engine == "auto":
            why_not = t.engine_pairing or auto_prefers_sequential(self.model, dev)
        self.vectorized = why_not is None
        self.engine_info = {
            "client_engine": "vectorized" if self.vectorized else "sequential",
            "client_engine_reason": why_not or f"groups of at most {t.max_parallel_clients} clients",
        }
        self.snapshots: dict[int, dict[str, Any]] = {}
        self.on_snapshot: Callable[[int, dict[str, Any]], None] | None = None
        self.method.server_init(self.server)

    def build(self, data) -> torch.nn.Module:
        cfg = self.cfg
        model = build_model(cfg.dataset.model, data.input_shape, data.num_classes, cfg.dataset.model_options)
        if self.scenario.heads == "per_task":
            model.use_task_heads(self.scenario.task_classes)
        return model.to(self.device)

    # ------------------------------------------------------------------ one client
    def client_context(self, cid: int, rnd: int, lr: float, view: TaskView) -> ClientContext:
        """Client ``cid``'s context on ``self.model`` (its state brought to the device)."""
        t = self.cfg.train
        self.model.set_task(view.task)
        opt = make_optimizer(self.model.parameters(), t.optimizer, lr)
        state = self.client_state.setdefault(cid, {})
        if self.offload_client_state:
            state.update(to_device(state, self.device))
        return ClientContext(
            cid=cid, round=rnd, model=self.model, optimizer=opt, global_params=self.global_params,
            broadcast=self.server.broadcast, state=state, n_samples=len(view), lr=lr,
            local_epochs=t.local_epochs, batch_size=t.batch_size, task=view.task, data=view,
        )  # fmt: skip

    def offload(self, ctx: ClientContext) -> None:
        """The client's state back to host memory until it is sampled again (on a GPU)."""
        if self.offload_client_state:
            ctx.state.update(to_device(ctx.state, torch.device("cpu")))

    def enter_task(self, ctx: ClientContext) -> None:
        """The client's task hooks when it trains on a task for the first time: asynchronous
        boundaries end its previous task here (its report waits for the server's task end)."""
        prev = self.client_task.get(ctx.cid)
        if prev == ctx.task:
            return
        if prev is not None and self.scenario.window is not None:
            report = self.end_client_task(ctx.cid, prev, ctx.round, ctx.lr)
            if report is not None:
                self.task_reports[ctx.cid] = report
            self.load_params(self.model, self.global_params)
            self.model.set_task(ctx.task)
        self.client_task[ctx.cid] = ctx.task
        self.method.client_task_begin(ctx)

    def train_client(
        self, cid: int, rnd: int, lr: float, view: TaskView | None = None
    ) -> tuple[Upload, float, dict[str, float]]:
        """Client ``cid``'s local training in round ``rnd`` on ``view`` (default: its data
        of the round)."""
        t = self.cfg.train
        view = view or self.clients.view(cid, rnd)
        model = self.model
        self.load_params(model, self.global_params)
        model.train()
        ctx = self.client_context(cid, rnd, lr, view)
        opt, method = ctx.optimizer, self.method
        self.enter_task(ctx)
        method.client_begin(ctx)
        n, bs = len(view), t.batch_size
        gen = torch.Generator().manual_seed(torch_seed(self.cfg.seed, rnd, cid, SHUFFLE_STREAM))
        loss_sum = torch.zeros((), device=self.device)
        # drop_last: no trailing partial batch (BatchNorm cannot train on one sample), except
        # for a client with fewer samples than one batch, which keeps its one batch
        end = (n // bs) * bs if t.drop_last and n >= bs else n
        for _ in range(t.local_epochs):
            perm = torch.randperm(n, generator=gen).to(self.device)
            for s in range(0, end, bs):
                x, y, ctx.logit_mask = view.batch(perm[s : s + bs])
                opt.zero_grad(set_to_none=True)
                loss = method.backward(ctx, x, y)
                method.transform_grad(ctx)
                opt.step()
                loss_sum += loss.detach()
                ctx.steps += 1
        mean_loss = loss_sum.item() / max(ctx.steps, 1)
        if not math.isfinite(mean_loss):
            raise Diverged(f"client {cid} local loss is {mean_loss} in round {rnd}")
        ctx.logit_mask = None
        upload = method.client_end(ctx)
        self.offload(ctx)
        return upload, mean_loss, ctx.stats

    def train_clients_together(
        self, views: dict[int, TaskView] | list[int], rnd: int, lr: float
    ) -> tuple[list[Upload], list[float], list[dict[str, float]]]:
        """The clients ``views`` trained in one batched pass (``fedforget.vectorized``): the
        same minibatches, steps and optimizer as ``train_client`` gives each of them. A
        method's own ``client_end`` (FedNova's step count, FedDF's public logits) then runs
        for each client on its trained weights, as in ``train_client``."""
        t = self.cfg.train
        if not isinstance(views, dict):  # client ids: their data of the round
            views = {c: self.clients.view(c, rnd) for c in views}
        cids = list(views)
        jobs = [
            ClientJob(cid, views[cid].start, len(views[cid]),
                      torch.Generator().manual_seed(torch_seed(self.cfg.seed, rnd, cid, SHUFFLE_STREAM)))
            for cid in cids
        ]  # fmt: skip
        opt, method = t.optimizer, self.method
        # a method with per-step terms (FedProx, FedDyn, SCAFFOLD): its client_begin for
        # every client on the global weights, then its terms for the stack
        with_terms = has_step_terms(type(method))
        ctxs: dict[int, ClientContext] = {}
        for cid in cids:  # clients entering a task (their hooks run on the global weights)
            if with_terms or self.client_task.get(cid) != views[cid].task:
                self.load_params(self.model, self.global_params)
                ctxs[cid] = self.client_context(cid, rnd, lr, views[cid])
                self.enter_task(ctxs[cid])
                if with_terms:
                    method.client_begin(ctxs[cid])
        results = train_clients_together(
            self.model, self.global_params, self.clients.batch, jobs,
            lr=lr, momentum=opt.momentum, weight_decay=opt.weight_decay,
            epochs=t.local_epochs, batch_size=t.batch_size,
            step_terms=(lambda order: method.stacked_step_terms([ctxs[cids[j]] for j in order])) if with_terms else None,
        )  # fmt: skip
        # client_end per client: a method's own upload, or (step terms) a context whose state
        # goes back to host memory like train_client's
        per_client = with_terms or type(method).client_end is not FedAvg.client_end
        ups, stats = [], []
        for r in results:
            if not math.isfinite(r.mean_loss):
                raise Diverged(f"client {r.cid} local loss is {r.mean_loss} in round {rnd}")
            if not per_client:
                ups.append(Upload(r.cid, len(views[r.cid]), r.params, r.steps))
                stats.append({})
                continue
            self.load_params(self.model, r.params)
            ctx = ctxs.get(r.cid) or self.client_context(r.cid, rnd, lr, views[r.cid])
            if with_terms:  # set up again, on the trained weights, for client_end
                method.client_begin(ctx)
            ctx.steps = r.steps
            ups.append(method.client_end(ctx))
            stats.append(ctx.stats)
            self.offload(ctx)
        return ups, [r.mean_loss for r in results], stats

    # ------------------------------------------------------------------ task boundaries
    def end_client_task(self, cid: int, task: int, rnd: int, lr: float) -> Any:
        """Client ``cid``'s ``client_task_end`` for ``task`` on the global weights (None
        where the method does not override it)."""
        if type(self.method).client_task_end is FedAvg.client_task_end:
            return None
        self.load_params(self.model, self.global_params)
        ctx = self.client_context(cid, rnd, lr, self.clients.task_view(cid, task))
        report = self.method.client_task_end(ctx)
        self.offload(ctx)
        return report

    def end_task(self, rnd: int, lr: float) -> None:
        """After the last round of the server's task: every client with data in it reports
        (synchronous boundaries; asynchronously, those that have moved on did), then the
        server's task end."""
        task = self.server.task
        reports, self.task_reports = self.task_reports, {}
        if self.scenario.window is None:
            for cid in range(self.cfg.partition.clients):
                if self.clients.size(cid, task):
                    report = self.end_client_task(cid, task, rnd, lr)
                    if report is not None:
                        reports[cid] = report
        self.model_with(self.global_params)
        self.method.server_task_end(self.server, reports)
        self.global_params = self.server.global_params

    # ------------------------------------------------------------------ all rounds
    def run(
        self,
        on_row: Callable[[dict[str, Any]], None] | None = None,
        progress: bool | None = None,
        on_snapshot: Callable[[int, dict[str, Any]], None] | None = None,
        on_checkpoint: Callable[[dict[str, Any]], None] | None = None,
        resume: dict[str, Any] | None = None,
    ) -> tuple[str, list[dict[str, Any]], str]:
        """Run every round; return (status, metrics rows, message). status is "completed"
        or "diverged" (non-finite loss or weights; the rows so far are kept).

        After every round r with r % train.checkpoint_every == 0 (and r < rounds),
        ``on_checkpoint(capture(self, rows))`` receives everything needed to continue;
        ``run(resume=that checkpoint)`` continues from round r + 1 and gives the same rows
        and weights as an uninterrupted run. ``on_row`` is called after the checkpoint, so a
        crash inside it loses nothing.

        For the rounds in train.save_client_models a snapshot {"round", "global_before",
        "global_after", "clients": {cid: local weights after local training}} (CPU tensors)
        goes to ``on_snapshot(round, snapshot)``, or is kept in ``self.snapshots``."""
        self.on_snapshot = on_snapshot
        t, cfg = self.cfg.train, self.cfg
        rows: list[dict[str, Any]] = []
        start = time.perf_counter()

        def emit(row: dict[str, Any]) -> None:
            rows.append(row)
            rnd = row["round"]
            if on_checkpoint and 0 < rnd < t.rounds and rnd % t.checkpoint_every == 0:
                on_checkpoint(capture(self, rows))
            if on_row:
                on_row(row)

        if resume is not None:
            restore(self, resume)
            rows = [dict(r) for r in resume["rows"]]
            start -= rows[-1].get("elapsed_s") or 0.0
            first = resume["round"] + 1
            log.info("resuming %s seed %d after round %d", cfg.method.label, cfg.seed, first - 1)
        else:
            metrics, tasks = self.global_metrics(0)
            emit({"round": 0, **metrics, "_tasks": tasks, "elapsed_s": time.perf_counter() - start})
            first = 1
        bar = RoundProgress(
            f"{cfg.method.label} seed{cfg.seed}", first, t.rounds, progress_mode(progress), t.log_every
        )
        try:
            for rnd in range(first, t.rounds + 1):
                try:
                    row = self.run_round(rnd, start)
                except Diverged as e:
                    log.warning("run diverged: %s", e)
                    return "diverged", rows, str(e)
                emit(row)
                bar.update(row)
        finally:
            bar.close()
        return "completed", rows, ""

    def train_round(self, rnd: int, lr: float, views: dict[int, TaskView]):
        """Local training of the clients ``views`` (each on its data of this round): their
        uploads, mean losses, diagnostics, local models' accuracies, evaluation time."""
        t = self.cfg.train
        uploads, losses, local_accs, stats = [], [], [], []
        eval_time = 0.0
        cids = list(views)
        step = t.max_parallel_clients if self.vectorized else 1
        for group in range(0, len(cids), step):
            part = {c: views[c] for c in cids[group : group + step]}
            if self.vectorized:
                ups, ls, st = self.train_clients_together(part, rnd, lr)
            else:
                (cid, view), = part.items()
                up, loss, s = self.train_client(cid, rnd, lr, view)
                ups, ls, st = [up], [loss], [s]
            uploads += ups
            losses += ls
            stats += st
            if t.eval_local_models:
                te = time.perf_counter()
                if self.vectorized and self.evaluator.plain:
                    test = self.evaluator.test
                    local_accs += evaluate_stacked(self.model, [u.params for u in ups], test.x, test.y, t.eval_batch_size)
                else:
                    for u in ups:
                        if self.vectorized:
                            self.load_params(self.model, u.params)
                        local_accs.append(self.evaluator.seen_accuracy(self.model, self.server.task))
                eval_time += time.perf_counter() - te
        return uploads, losses, stats, local_accs, eval_time

    def run_round(self, rnd: int, start: float) -> dict[str, Any]:
        t, cfg, sc = self.cfg.train, self.cfg, self.scenario
        t0 = time.perf_counter()
        lr = t.optimizer.lr * t.lr_decay ** (rnd - 1)
        sampled = sample_clients(cfg.seed, rnd, cfg.partition.clients, t.sample_rate)
        self.server.round = rnd
        if sc.starts_task(rnd):
            self.server.task = sc.task_of_round(rnd)
            self.model_with(self.global_params)
            self.method.server_task_begin(self.server)
            self.global_params = self.server.global_params
        self.server.broadcast = self.method.broadcast(self.server)
        # a client with no data in its task this round does not train
        views = {c: v for c in sampled if len(v := self.clients.view(c, rnd))}
        broadcast_params = self.global_params
        uploads, losses, stats, local_accs, eval_time = self.train_round(rnd, lr, views)
        if uploads:
            aggregated = self.method.aggregate(self.server, uploads)
            # parameters no client trained in this task (per-task heads of other tasks) keep
            # their global values, bit for bit
            self.model.set_task(self.server.task)
            for k, p in self.model.named_parameters():
                if not p.requires_grad:
                    aggregated[k] = broadcast_params[k]
            self.server.global_params = aggregated
            self.method.after_aggregate(self.server, uploads)  # may replace server.global_params
        if not all(torch.isfinite(v).all() for v in self.server.global_params.values() if torch.is_floating_point(v)):
            raise Diverged(f"global weights are not finite after aggregation in round {rnd}")
        self.global_params = self.server.global_params
        if sc.ends_task(rnd):
            self.end_task(rnd, lr)
        train_time = time.perf_counter() - t0 - eval_time
        if rnd in t.save_client_models:
            cpu = lambda p: {k: v.detach().cpu().clone() for k, v in p.items()}  # noqa: E731
            snap = {
                "round": rnd,
                "global_before": cpu(broadcast_params),
                "global_after": cpu(self.global_params),
                "clients": {u.cid: cpu(u.params) for u in uploads},
            }
            if self.on_snapshot is not None:
                self.on_snapshot(rnd, snap)
            else:
                self.snapshots[rnd] = snap

        row: dict[str, Any] = {
            "round": rnd, "lr": lr, "n_sampled_clients": len(uploads),
            "sampled_clients_local_train_loss_mean": float(np.mean(losses)) if losses else math.nan,
        }  # fmt: skip
        te = time.perf_counter()
        if rnd % t.eval_every == 0 or rnd == t.rounds:
            metrics, row["_tasks"] = self.global_metrics(rnd)
            row.update(metrics)
        if "weight_divergence" in t.diagnostics and uploads:
            row.update(weight_divergence(broadcast_params, [u.params for u in uploads]))
        if local_accs:
            row.update(
                local_models_global_test_acc_mean=float(np.mean(local_accs)),
                local_models_global_test_acc_min=float(np.min(local_accs)),
            )
        keys = sorted({k for s in stats for k in s})
        for k in keys:  # client-side diagnostics, averaged over the clients reporting them
            row[f"{cfg.method.name}_{k}"] = float(np.mean([s[k] for s in stats if k in s]))
        for k, v in self.method.round_metrics(self.server, uploads).items():
            row[f"{cfg.method.name}_{k}"] = v
        row.update(
            train_time_s=train_time,
            eval_time_s=eval_time + time.perf_counter() - te,
            elapsed_s=time.perf_counter() - start,
        )
        return row

    def global_metrics(self, rnd: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """The global model's metrics columns and per-task rows (``fedforget.evaluation``)."""
        model = self.model_with(self.global_params)
        model.set_task(self.server.task)
        diagnostics = self.cfg.train.diagnostics if rnd else ()  # round 0: accuracy and loss
        metrics, tasks = self.evaluator.global_model(model, self.scenario.task_of_round(rnd), self.num_classes, diagnostics)
        return metrics, [{"round": rnd, **r} for r in tasks]

    def load_params(self, model: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
        """``params`` (a full state dict) into ``self.model``'s tensors, in place."""
        if params.keys() != self._model_tensors.keys():
            model.load_state_dict(params)  # raises, naming the mismatched keys
        with torch.no_grad():
            torch._foreach_copy_(list(self._model_tensors.values()), [params[k] for k in self._model_tensors])

    def model_with(self, params: dict[str, torch.Tensor]) -> torch.nn.Module:
        self.server.model.load_state_dict(params)
        return self.server.model
