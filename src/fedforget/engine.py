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

from .checkpoint import (
    CheckpointCadence,
    check_client_engine,
    check_client_group,
    check_client_threads,
    checkpoint_of,
    format2_changes,
    restore,
    resume_threads,
)
from .config import RunConfig
from .cudagraph import StepGraphs, graphs_enabled
from .evaluation import Evaluator
from .memory import PhaseMemory, memory_limit
from .methods import METHODS, RunInfo, ServerContext, make_params
from .methods.base import AFTER_TASK, ROUND_END, TASK_END, ClientContext
from .metrics import (
    GEOMETRY_ROWS,
    GEOMETRY_STREAM,
    layer_lambda,
    projection_geometry,
    weight_divergence,
)
from .models import build_model, parameter_count
from .progress import RoundProgress, progress_mode
from .rundata import load_run_data
from .schedule import sample_clients
from .state import FedState, OnFed
from .trainers import Diverged, choose_trainer
from .utils import FedForgetError, Unchanged, byte_size, first_line, is_float_overflow, torch_seed
from .vectorized import frozen_tensors

log = logging.getLogger(__name__)

# stream tags for keyed randomness
INIT_STREAM = 0x53  # (0x51: the client schedule, fedforget.schedule; 0x52: the shuffling)

# metrics.csv columns written for every method; "test" is the test set of the tasks seen so
# far, the mean of their accuracies (the whole test set in a one-task run; per task: tasks.csv).
# Every value is a deterministic function of the config and seed (wall-clock times are kept
# apart, in TIMING_COLUMNS / timings.csv), so a rerun or a resumed run gives the same bytes.
BASE_COLUMNS = [
    "round",  # 0 = the initial global model, before any training
    "lr",  # local learning rate used in this round
    "n_sampled_clients",  # sampled clients that trained (a client without data in its task does not)
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


def resolve_device(name: str) -> torch.device:
    """``train.device`` on this machine (the schema allows auto, cpu, cuda[:N], mps); a device
    this machine lacks is refused, named, before the job trains (a node without it: another
    machine's config, or an index beyond its GPUs)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise FedForgetError(f"train.device='{name}' but no CUDA device is available")
        if dev.index is not None and dev.index >= n:
            raise FedForgetError(
                f"train.device='{name}' but this machine has {n} CUDA device(s); allowed: auto, cpu, cuda, "
                + ", ".join(f"cuda:{i}" for i in range(n))
            )
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise FedForgetError(f"train.device='{name}' but no MPS device is available")
    return dev


# a run holds at least this many float32 copies of the model's weights on its device: the
# clients' model, the server's, and the global weights (FedState)
WEIGHT_COPIES = 3
CLIENT_STATE_ROUNDS = 10_000  # the rounds whose training clients check_client_state_fits counts at most


def check_model_fits(cfg: RunConfig, device: torch.device) -> None:
    """[D] Refuse, before the data are loaded, a model whose weights cannot fit: its
    parameters counted without allocating them (``parameter_count``), at least
    ``WEIGHT_COPIES`` float32 copies of them on the device (and one in host memory, where
    every model is built) against its memory (``memory_limit``: a GPU's, or the host's, its
    control group's limit where smaller). A well-typed but huge option (``hidden: 10**7``)
    passed validation, then failed the job at the allocation, after the data had loaded, or
    was killed without a word at a SLURM job's memory limit. Only a certain failure is
    refused: the run needs more (activations, optimizer and method state, the data)."""
    ds = cfg.dataset
    n = parameter_count(ds.model, ds.input_shape, ds.num_classes, ds.model_options)
    if n is None:
        return
    need = [(device, WEIGHT_COPIES)] + ([(torch.device("cpu"), 1)] if device.type != "cpu" else [])
    for dev, copies in need:
        limit = memory_limit(dev)
        if limit is not None and copies * 4 * n > limit[0]:
            raise FedForgetError(
                f"dataset.model of '{ds.label}': '{ds.model}' with options {ds.model_options} has {n:,} parameters, "
                f"{byte_size(4 * n)} in float32; a run holds at least {copies} cop{'ies' if copies > 1 else 'y'} "
                f"of them ({byte_size(copies * 4 * n)}), more than {limit[1]} ({byte_size(limit[0])}): "
                "give the model smaller options"
            )


class Simulation:
    """One federated training run (one experiment x dataset x partition x method x seed)."""

    def __init__(
        self, cfg: RunConfig, device: torch.device | None = None, verify: bool = True
    ) -> None:
        self.cfg = cfg
        t = cfg.train
        self.device = device or resolve_device(t.device)
        self.memory = PhaseMemory(self.device, t.phase_memory)  # per phase (run.json; FedProTIP Fig. 7)
        if t.threads > 0:
            torch.set_num_threads(t.threads)
        method_cls = METHODS.get(cfg.method.name, "method.name")
        params = make_params(cfg.method.name, cfg.method.params, "method.params")
        check_model_fits(cfg, self.device)

        data = load_run_data(cfg, self.device, method_cls.trait("public_labels", params), verify)
        self.clients, self.scenario = data.clients, data.scenario
        if self.device.type == "cuda":
            # [D] the same bits on every run and under CUDA graphs: cuDNN may otherwise pick
            # another convolution algorithm during graph capture (seen on an H100: eager and
            # replayed steps differed in the 8th digit of the loss)
            torch.backends.cudnn.deterministic = True
        self.num_classes, public = data.num_classes, data.public
        dev = self.device

        pipe = self.clients.inputs
        info = RunInfo(dev, data.num_classes, cfg.seed, cfg.partition.clients, t, self.scenario,
                       tuple(data.input_shape), data.class_names,
                       None if pipe.mean is None or pipe.std is None else (tuple(pipe.mean), tuple(pipe.std)))  # fmt: skip
        self.method = method_cls(params, info)
        torch.manual_seed(torch_seed(cfg.seed, INIT_STREAM))
        self.model = self.build(data)
        # a frozen encoder's global tensors already checked finite, unchanged since
        self._finite = Unchanged(frozen_tensors(self.model))
        server_model = self.build(data)
        # the run's state (fedforget.state): global weights, the method's server and client
        # state, task progress, metrics so far; per-client state lives in host memory between
        # the client's rounds when training on a GPU, so device memory does not grow with the
        # number of clients
        self.fed = FedState(
            {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            device=dev, offload_clients=dev.type == "cuda",
        )  # fmt: skip
        server_model.load_state_dict(self.fed.global_params)
        self.server = ServerContext(0, self.fed.global_params, server_model, dev, public, fed=self.fed)
        self.evaluator = Evaluator(
            data.test, self.scenario, self.method, self.server, t.eval_batch_size
        )
        # the local trainer (fedforget.trainers): clients one after another, or stacked where
        # that computes the same thing; its batched steps in CUDA graphs on a GPU (a streamed
        # pool's minibatches, read ahead on the host, copied into the captured steps' inputs)
        trainer_cls, why = choose_trainer(method_cls, self.model, t, dev, params)
        graphs = StepGraphs() if graphs_enabled(dev) else None
        self.trainer = trainer_cls(
            model=self.model, method=self.method, clients=self.clients, fed=self.fed, server=self.server,
            evaluator=self.evaluator, train=t, seed=cfg.seed, device=dev, step_graphs=graphs,
        )  # fmt: skip
        self.engine_info = {
            "client_engine": trainer_cls.name, "client_engine_reason": why,
            "concurrent_clients": len(self.trainer.lanes),  # clients trained, or replying, at once
        }  # fmt: skip
        self.check_client_state_fits()
        self.snapshots: dict[int, dict[str, Any]] = {}
        self.checkpoints = CheckpointCadence(cfg.train.checkpoint_every, cfg.train.rounds)  # when run writes them
        self.on_snapshot: Callable[[int, dict[str, Any]], None] | None = None
        self.method.server_init(self.server)

    # the run's state, read through the names the engine and the tests use (one home: fed)
    # the run's state, held by ``self.fed`` (its one home)
    global_params = OnFed("global_params")
    client_state = OnFed("clients")
    client_task = OnFed("client_task")
    task_reports = OnFed("task_reports")

    def build(self, data) -> torch.nn.Module:
        cfg = self.cfg
        model = build_model(
            cfg.dataset.model, data.input_shape, data.num_classes, cfg.dataset.model_options
        )
        if self.scenario.heads == "per_task":
            model.use_task_heads(self.scenario.task_classes)
        self.method.model_init(model)
        return model.to(self.device)

    def check_finite(self, rnd: int) -> None:
        """Raise ``Diverged`` if a global weight is not finite after the round's aggregation;
        a frozen encoder's tensor checked before and unchanged since (the same object, not
        written into: kept by reference) is not checked again."""
        for name, v in self.server.global_params.items():
            if not torch.is_floating_point(v) or self._finite.holds(name, v):
                continue
            if not torch.isfinite(v).all():
                raise Diverged(f"global weights are not finite after aggregation in round {rnd}")
            self._finite.mark(name, v)

    def end_task(self, rnd: int, lr: float) -> None:
        """After the last round of the server's task, for a method with the TASK_END
        exchange: every client with data in the task replies (synchronous boundaries;
        asynchronously, those that have moved on did), the server collects; then, with
        AFTER_TASK, the clients that replied reply again on the server's new broadcast. Its
        memory is the phase task_end (only for a method that has the exchange)."""
        if TASK_END not in self.method.exchanges:
            return
        task = self.server.task
        with self.memory.phase("task_end"):
            reports, self.fed.task_reports = self.fed.task_reports, {}
            if self.scenario.window is None:  # every client holding the task (several at once: the trainer's)
                views = {cid: self.clients.task_view(cid, task) for cid in range(self.cfg.partition.clients)
                         if self.clients.size(cid, task)}  # fmt: skip
                # Summed shares folded as the replies come, unless earlier ones wait (asynchronous
                # ends): then the server adds them all, in the clients' order
                reports.update(self.trainer.client_pass(TASK_END, views, rnd, lr, fold=not reports))
            self.collect(TASK_END, reports)
            if reports and AFTER_TASK in self.method.exchanges:  # on what the server made of the first
                self.server.broadcast = self.method.server_broadcast(self.server)
                views = {cid: self.clients.task_view(cid, task) for cid in sorted(reports)}
                self.collect(AFTER_TASK, self.trainer.client_pass(AFTER_TASK, views, rnd, lr))

    def collect(self, exchange: str, replies: dict[int, Any]) -> None:
        """The server's step of an exchange, with ``server.model`` holding the global
        weights (it may read the global model and replace the global weights)."""
        self.model_with(self.global_params)
        self.method.server_collect(exchange, self.server, replies)

    def check_client_state_fits(self) -> None:
        """[D] Refuse, before round 1, a run whose clients' kept copies of the model cannot
        fit in host memory (``FedAvg.client_model_copies``: SCAFFOLD's c_i, FedCurv's three,
        ...; a client's state waits there between its rounds on a GPU too), against the
        host's memory or its control group's limit (``memory_limit``). Counted: float32
        copies of the model's trained parameters for each client that trains in the first
        ``CLIENT_STATE_ROUNDS`` rounds (sampled, with a minibatch in its round's data), beside
        the weights' own (``check_model_fits``): a lower bound, so only a certain failure is
        refused (replay buffers, exemplars and bases are not counted: ``client_kept_bytes``
        bounds them from above, for the job's resource ``client_state_mb``). Such a run
        otherwise failed once enough clients had trained, after hours, or was killed without
        a word at a SLURM job's memory limit."""
        copies = type(self.method).client_copies(self.method.p)
        limit = memory_limit(torch.device("cpu"))
        if not copies or limit is None:
            return
        t, cfg = self.cfg.train, self.cfg
        n = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        own = WEIGHT_COPIES if self.device.type == "cpu" else 1  # the weights' copies in host memory
        if 4 * n * (own + copies * cfg.partition.clients) <= limit[0]:
            return  # every client's copies fit: no need to find which train
        sees_all = type(self.method).trait("sees_all_tasks", self.method.p)
        trained: set[int] = set()
        for rnd in range(1, min(t.rounds, CLIENT_STATE_ROUNDS) + 1):
            for c in sample_clients(cfg.seed, rnd, cfg.partition.clients, t.sample_rate):
                if c not in trained and t.epoch_rows(len(self.clients.view(c, rnd, sees_all))):
                    trained.add(c)
            if len(trained) == cfg.partition.clients:
                break
        need = 4 * n * (own + copies * len(trained))
        if need > limit[0]:
            raise FedForgetError(
                f"method '{cfg.method.label}' keeps {copies} cop{'ies' if copies > 1 else 'y'} of the model's "
                f"{n:,} trained parameters ({byte_size(4 * n)} in float32) per client in host memory; the "
                f"{len(trained):,} clients that train in this run (of partition.clients {cfg.partition.clients:,}, "
                f"train.sample_rate {t.sample_rate}, train.rounds {t.rounds:,}) hold {byte_size(need)} with the "
                f"weights, more than {limit[1]} ({byte_size(limit[0])}): fewer clients, a smaller model, or more "
                "memory (a SLURM submission's mem_mb)"
            )

    def server_hook(self, hook: Callable[..., None], *args: Any) -> None:
        """A server hook that may read the global model and replace the global weights:
        ``hook(server, *args)`` with ``server.model`` holding them, its weights kept."""
        self.model_with(self.global_params)
        hook(self.server, *args)

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

        After each round r that train.checkpoint_every picks (``CheckpointCadence``: every
        n-th, or auto by the write's cost; never the last), ``on_checkpoint(checkpoint)``
        receives everything needed to continue (the run's ``FedState``,
        ``fedforget.checkpoint.checkpoint_of``);
        ``run(resume=that checkpoint)`` continues from round r + 1 and gives the same rows
        and weights as an uninterrupted run. ``on_row`` is called after the checkpoint, so a
        crash inside it loses nothing.

        For the rounds in train.save_client_models a snapshot {"round", "global_before",
        "global_after", "clients": {cid: local weights after local training}} (CPU tensors)
        goes to ``on_snapshot(round, snapshot)``, or is kept in ``self.snapshots``."""
        self.on_snapshot = on_snapshot
        t, cfg = self.cfg.train, self.cfg
        fed = self.fed
        start = time.perf_counter()

        group = t.max_parallel_clients if self.trainer.name == "vectorized" else None  # its sums' order
        cadence = self.checkpoints

        def emit(row: dict[str, Any]) -> None:
            fed.rows.append(row)
            fed.round = rnd = row["round"]
            if on_checkpoint and cadence.due(rnd):
                threads = self.trainer.client_threads()
                cadence.write(lambda: on_checkpoint(checkpoint_of(fed, cfg.hash, threads, self.trainer.name, group)))
            if on_row:
                on_row(row)

        if resume is not None:
            restore(fed, resume, cfg.hash, format2_changes(cfg))
            check_client_engine(resume, self.trainer.name)
            if group is not None:
                check_client_group(resume, group)
            threads = resume_threads(resume, t.threads)
            if threads is not None:
                log.info("resuming on the checkpoint's %d torch threads (CPU results depend on the count)", threads)
                torch.set_num_threads(threads)
            if self.device.type == "cpu":
                check_client_threads(resume, self.trainer.client_threads(), t.concurrent_clients)
            rows = fed.rows
            start -= rows[-1].get("elapsed_s") or 0.0
            first = fed.round + 1
            log.info("resuming %s seed %d after round %d", cfg.method.label, cfg.seed, first - 1)
        else:
            with self.memory.phase("evaluate"):
                metrics, tasks = self.global_metrics(0)
            emit({"round": 0, **metrics, "_tasks": tasks, "elapsed_s": time.perf_counter() - start})
            first = 1
        bar = RoundProgress(
            f"{cfg.method.label} seed{cfg.seed}",
            first,
            t.rounds,
            progress_mode(progress),
            t.log_every,
        )
        try:
            for rnd in range(first, t.rounds + 1):
                try:
                    row = self.run_round(rnd, start)
                except Diverged as e:
                    log.warning("run diverged: %s", e)
                    return "diverged", fed.rows, str(e)
                except (RuntimeError, OverflowError) as e:  # a number overflowed: it diverged too [D]
                    if not is_float_overflow(e):
                        raise
                    log.warning("run diverged: a number overflowed in round %d: %s", rnd, first_line(e))
                    return "diverged", fed.rows, f"a number overflowed in round {rnd} ({first_line(e)})"
                emit(row)
                bar.update(row)
        finally:
            bar.close()
        return "completed", fed.rows, ""

    def run_round(self, rnd: int, start: float) -> dict[str, Any]:
        t, cfg, sc = self.cfg.train, self.cfg, self.scenario
        t0 = time.perf_counter()
        lr = t.optimizer.lr * t.lr_decay ** (rnd - 1)
        sampled = sample_clients(cfg.seed, rnd, cfg.partition.clients, t.sample_rate)
        self.server.round = rnd
        if sc.starts_task(rnd):
            self.server.task = sc.task_of_round(rnd)
            self.server_hook(self.method.server_task_begin)
        # the server's model scores and trains the server's task's head (per-task heads: a
        # method's distillation, FedAvgM's and FedNova's trained parameters), every round: an
        # evaluation, or a resume, would otherwise have left another active [D]
        self.server.model.set_task(self.server.task)
        self.server.broadcast = self.method.server_broadcast(self.server)
        # a client with no data in its task this round does not train (nor one whose rows
        # make no minibatch: a single row with drop_last, TrainSpec.epoch_rows)
        views = {c: v for c in sampled if t.epoch_rows(len(v := self.trainer.round_view(c, rnd)))}
        broadcast_params = self.global_params
        with self.memory.phase("train"):
            uploads, losses, stats, local_accs, eval_time = self.trainer.train_round(rnd, lr, views)
        if uploads:
            # parameters no client trained in this task (per-task heads of other tasks) keep
            # their global values, bit for bit, whatever the method writes
            self.model.set_task(self.server.task)
            self.server.untrained = tuple(k for k, p in self.model.named_parameters() if not p.requires_grad)
            with self.memory.phase("aggregate"):
                self.method.server_aggregate(self.server, uploads)
            self.server.untrained = ()
        self.check_finite(rnd)
        geometry = {}
        if "projection_geometry" in t.diagnostics:  # before the task end changes the projection
            geometry = self.projection_geometry(rnd, broadcast_params, lr)
        if sc.ends_task(rnd):
            self.end_task(rnd, lr)
        if ROUND_END in self.method.exchanges:  # a second message per round, on the new weights
            trained = {u.cid for u in uploads}
            repliers = {
                c: views[c] if c in trained else self.trainer.round_view(c, rnd).empty()
                for c in sampled
                if c in trained or self.method.round_end_untrained
            }
            with self.memory.phase("round_end"):
                replies = self.trainer.client_pass(ROUND_END, repliers, rnd, lr)
                if replies:
                    self.collect(ROUND_END, replies)
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
        if rnd % t.eval_every == 0 or rnd == t.rounds or sc.ends_task(rnd):  # task ends: the accuracy matrix
            with self.memory.phase("evaluate"):
                metrics, row["_tasks"] = self.global_metrics(rnd)
            row.update(metrics)
        if "weight_divergence" in t.diagnostics and uploads:
            row.update(weight_divergence(broadcast_params, [u.params for u in uploads]))
        if "layer_lambda" in t.diagnostics and uploads:
            names = [n for n, p in self.model.named_parameters()
                     if p.requires_grad and all(n in u.params for u in uploads)]  # fmt: skip
            row.update(layer_lambda(broadcast_params, [u.params for u in uploads], names))
        row.update(geometry)
        if local_accs:
            row.update(
                local_models_global_test_acc_mean=float(np.mean(local_accs)),
                local_models_global_test_acc_min=float(np.min(local_accs)),
            )
        keys = sorted({k for s in stats for k in s})
        for k in keys:  # client-side diagnostics, averaged over the clients reporting them
            row[f"{cfg.method.name}_{k}"] = float(np.mean([s[k] for s in stats if k in s]))
        for k, v in self.method.server_metrics(self.server, uploads).items():
            row[f"{cfg.method.name}_{k}"] = v
        row.update(
            train_time_s=train_time,
            eval_time_s=eval_time + time.perf_counter() - te,
            elapsed_s=time.perf_counter() - start,
        )
        return row

    def projection_geometry(self, rnd: int, params: dict[str, torch.Tensor], lr: float) -> dict[str, float]:
        """The diagnostic ``projection_geometry`` (``metrics.projection_geometry``, FedProTIP
        Fig. 2) at the round's broadcast weights ``params``: P is the method's step map of
        this round for a client alone (its ``client_step_terms`` on the round's broadcast;
        ``shared_projection``: the same for every client), each task's gradient taken on
        ``GEOMETRY_ROWS`` rows of its training data pooled over every client, keyed by
        (seed, round, task)."""
        task = self.server.task
        model = self.model_with(params)
        model.set_task(task)
        ctx = ClientContext(
            cid=-1, round=rnd, model=model, optimizer=None, global_params=params, broadcast=self.server.broadcast,
            state={}, n_samples=0, lr=lr, local_epochs=self.cfg.train.local_epochs,
            batch_size=self.cfg.train.batch_size, task=task,
        )  # fmt: skip
        terms = self.method.client_step_terms([ctx])
        w = {n: p.detach().unsqueeze(0) for n, p in model.named_parameters() if p.requires_grad}
        step_map = None if terms is None else terms(0, 1, w)[2]
        batches = {}
        for tau in range(task + 1):
            pos = (self.clients.task == tau).nonzero().squeeze(1)
            gen = torch.Generator().manual_seed(torch_seed(self.cfg.seed, rnd, tau, GEOMETRY_STREAM))
            batches[tau] = self.clients.batch(pos[torch.randperm(len(pos), generator=gen)[:GEOMETRY_ROWS].to(pos.device)])
        return projection_geometry(model, batches, task, step_map)

    def global_metrics(self, rnd: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """The global model's metrics columns and per-task rows (``fedforget.evaluation``)."""
        model = self.model_with(self.global_params)
        model.set_task(self.server.task)
        diagnostics = self.cfg.train.diagnostics if rnd else ()  # round 0: accuracy and loss
        metrics, tasks = self.evaluator.global_model(
            model, self.scenario.task_of_round(rnd), self.num_classes, diagnostics
        )
        return metrics, [{"round": rnd, **r} for r in tasks]

    def model_with(self, params: dict[str, torch.Tensor]) -> torch.nn.Module:
        """``server.model`` holding ``params``, on the server's task (per-task heads)."""
        self.server.model.load_state_dict(params)
        self.server.model.set_task(self.server.task)
        return self.server.model
