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
from .clientdata import load_run_data
from .config import RunConfig
from .cudagraph import StepGraphs, graphs_enabled
from .evaluation import Evaluator
from .local import ClientSide, Diverged
from .methods import METHODS, RunInfo, ServerContext, make_params
from .metrics import weight_divergence
from .models import build_model
from .progress import RoundProgress, progress_mode
from .utils import FedForgetError, seed_sequence, torch_seed
from .vectorized import auto_prefers_sequential, why_not_vectorized

log = logging.getLogger(__name__)

# stream tags for keyed randomness
SAMPLE_STREAM, INIT_STREAM = 0x51, 0x53  # (0x52: the clients' shuffling, fedforget.local)

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


class Simulation(ClientSide):
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

        data = load_run_data(cfg, self.device, method_cls.trait("public_labels", params), verify)
        self.clients, self.scenario = data.clients, data.scenario
        # a streamed pool gathers minibatches on the host: no step can be captured
        self.step_graphs = StepGraphs() if graphs_enabled(self.device) and not self.clients.x.stream else None
        if self.device.type == "cuda":
            # [D] the same bits on every run and under CUDA graphs: cuDNN may otherwise pick
            # another convolution algorithm during graph capture (seen on an H100: eager and
            # replayed steps differed in the 8th digit of the loss)
            torch.backends.cudnn.deterministic = True
        self.num_classes, public = data.num_classes, data.public
        dev = self.device

        info = RunInfo(dev, data.num_classes, cfg.seed, cfg.partition.clients, t, self.scenario,
                       tuple(data.input_shape), data.class_names)  # fmt: skip
        self.method = method_cls(params, info)
        torch.manual_seed(torch_seed(cfg.seed, INIT_STREAM))
        self.model = self.build(data)
        server_model = self.build(data)
        self.global_params = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        server_model.load_state_dict(self.global_params)
        # the client model's tensors, for an in-place reload at each client (cheaper than
        # load_state_dict, which re-validates keys and shapes every time)
        self._model_tensors = dict(self.model.state_dict(keep_vars=True))
        self.server = ServerContext(0, self.global_params, server_model, dev, public)
        self.evaluator = Evaluator(
            data.test, self.scenario, self.method, self.server, t.eval_batch_size
        )
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
            raise FedForgetError(
                f"train.client_engine='vectorized' is not possible here: {why_not}"
            )
        if t.client_engine == "sequential":
            why_not = "train.client_engine = sequential"
        elif why_not is None and t.client_engine == "auto":
            why_not = t.engine_pairing or auto_prefers_sequential(self.model, dev)
        self.vectorized = why_not is None
        self.engine_info = {
            "client_engine": "vectorized" if self.vectorized else "sequential",
            "client_engine_reason": why_not
            or f"groups of at most {t.max_parallel_clients} clients",
        }
        self.snapshots: dict[int, dict[str, Any]] = {}
        self.on_snapshot: Callable[[int, dict[str, Any]], None] | None = None
        self.method.server_init(self.server)

    def build(self, data) -> torch.nn.Module:
        cfg = self.cfg
        model = build_model(
            cfg.dataset.model, data.input_shape, data.num_classes, cfg.dataset.model_options
        )
        if self.scenario.heads == "per_task":
            model.use_task_heads(self.scenario.task_classes)
        self.method.prepare_model(model)
        return model.to(self.device)

    def end_task(self, rnd: int, lr: float) -> None:
        """After the last round of the server's task: every client with data in it reports
        (synchronous boundaries; asynchronously, those that have moved on did), then the
        server's task end, then (methods with ``client_after_task``) the reporting clients'
        replies on the server's new broadcast."""
        task = self.server.task
        reports, self.task_reports = self.task_reports, {}
        if self.scenario.window is None:
            for cid in range(self.cfg.partition.clients):
                if self.clients.size(cid, task):
                    report = self.end_client_task(cid, task, rnd, lr)
                    if report is not None:
                        reports[cid] = report
        self.server_hook(self.method.server_task_end, reports)
        if reports and self.method.replies_after_task():  # a second message, on what the server made of the first
            self.server.broadcast = self.method.broadcast(self.server)
            replies = self.after_client_tasks(sorted(reports), task, rnd, lr)
            self.server_hook(self.method.server_after_task, replies)

    def server_hook(self, hook: Callable[..., None], *args: Any) -> None:
        """A server hook that may read the global model and replace the global weights:
        ``hook(server, *args)`` with ``server.model`` holding them, its weights kept."""
        self.model_with(self.global_params)
        hook(self.server, *args)
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
                    return "diverged", rows, str(e)
                emit(row)
                bar.update(row)
        finally:
            bar.close()
        return "completed", rows, ""

    def run_round(self, rnd: int, start: float) -> dict[str, Any]:
        t, cfg, sc = self.cfg.train, self.cfg, self.scenario
        t0 = time.perf_counter()
        lr = t.optimizer.lr * t.lr_decay ** (rnd - 1)
        sampled = sample_clients(cfg.seed, rnd, cfg.partition.clients, t.sample_rate)
        self.server.round = rnd
        if sc.starts_task(rnd):
            self.server.task = sc.task_of_round(rnd)
            self.server_hook(self.method.server_task_begin)
        self.server.broadcast = self.method.broadcast(self.server)
        # a client with no data in its task this round does not train (nor one whose rows
        # make no minibatch: a single row with drop_last, TrainSpec.epoch_rows)
        views = {c: v for c in sampled if t.epoch_rows(len(v := self.round_view(c, rnd)))}
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
        if not all(
            torch.isfinite(v).all()
            for v in self.server.global_params.values()
            if torch.is_floating_point(v)
        ):
            raise Diverged(f"global weights are not finite after aggregation in round {rnd}")
        self.global_params = self.server.global_params
        if sc.ends_task(rnd):
            self.end_task(rnd, lr)
        replies = self.end_client_rounds({u.cid: views[u.cid] for u in uploads}, rnd, lr)
        if replies:
            self.server_hook(self.method.server_round_end, replies)
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
        metrics, tasks = self.evaluator.global_model(
            model, self.scenario.task_of_round(rnd), self.num_classes, diagnostics
        )
        return metrics, [{"round": rnd, **r} for r in tasks]

    def model_with(self, params: dict[str, torch.Tensor]) -> torch.nn.Module:
        self.server.model.load_state_dict(params)
        return self.server.model
