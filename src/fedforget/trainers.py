"""Local training, the client half of a federated round: ``LocalTrainer`` and its two
implementations, chosen in one place (``choose_trainer``) from what the method, the model
and the device allow:

- ``SequentialTrainer``: one client after another (``train_client``: the whole local step
  readable in one loop), any method;
- ``StackedTrainer``: a group of clients in one batched pass (``fedforget.vectorized``),
  FedAvg's local step with the method's per-step terms; equal to the sequential trainer
  within float summation order (tests/methods/test_batched_uploads.py).

Both share the client side of the protocol (``LocalTrainer``): a client's context and state
(``FedState.client``), its task entry, and the extra client passes the server asks for (the
task end, the after-task and round-end replies). ``Simulation`` (``fedforget.engine``) is the
server's loop over a trainer; the trainer holds what it needs, passed in explicitly. Both fold
the ``Summed`` shares of a round's uploads and of an exchange's replies into one running sum
as each client's message arrives, in the clients' order (``methods.base.fold_summed``).

Randomness is keyed: each client's shuffling by (seed, round, client), so a client's
minibatches do not depend on the order clients run in or on the trainer that runs them;
its dropout masks (``fedforget.dropout``) by (seed, round, client, step, layer), so a
stacked client draws the masks it draws alone.

Per-client buffers (issue 32): the stacked trainer keeps BatchNorm's running statistics per
client, stacked beside the weights ([G, ...]), updated by each client's own forward passes
(``vmap`` over ``functional_call`` with the client's statistics; a step of unequal batches
client by client), and a client's upload is its weights and statistics, as
``train_client``'s ``state_dict`` is (tests/test_vectorized.py).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from .clientdata import ClientData, TaskView
from .config import Experiment
from .cudagraph import StepGraphs
from .dropout import DropoutKey, client_key, key_tensor, keyed_modules, reply_key, set_dropout_key
from .evaluation import Evaluator
from .inputs import prefetched
from .methods import METHODS, ClientContext, FedAvg, ServerContext, Upload, make_params
from .methods.base import EXCHANGES, TASK_END, SummedTotal, fold_summed
from .models import TaskHeads
from .state import FedState
from .train_spec import OptimizerSpec, TrainSpec, client_threads
from .utils import FedForgetError, Unchanged, first_line, host_to_device, torch_seed
from .vectorized import (
    ClientJob,
    auto_prefers_sequential,
    evaluate_stacked,
    frozen_tensors,
    method_not_vectorized,
    reply_grads,
    stacked_replies_refused,
    train_clients_together,
    why_not_vectorized,
)

log = logging.getLogger(__name__)

SHUFFLE_STREAM = 0x52  # stream tag of the clients' shuffling
# the start of PyTorch's error for a BatchNorm layer given one value per channel in training
ONE_ROW_BATCHNORM = "Expected more than 1 value per channel when training"
PRECISIONS = ("fp32", "bf16")  # train.precision


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
    """A non-finite local loss or global weights: the run stops, its rows so far kept."""


class LocalLoss:
    """A client's mean local loss, left on the device until the round reads it
    (``read_losses``) [D]: reading it as each client ends would make the host wait for the
    client's last step before it sets up the next client, and the GPU idle meanwhile."""

    def __init__(self, cid: int, total: torch.Tensor, steps: int) -> None:
        self.cid, self.total, self.steps = cid, total, steps

    def value(self) -> float:
        return self.total.item() / max(self.steps, 1)


def read_losses(losses: list[float | LocalLoss], cids: list[int], rnd: int) -> list[float]:
    """The clients ``cids``' mean local losses in round ``rnd`` as numbers, in order; Diverged,
    naming the first client whose loss is not finite."""
    out = [x.value() if isinstance(x, LocalLoss) else x for x in losses]
    for cid, x in zip(cids, out, strict=True):
        if not math.isfinite(x):
            raise Diverged(f"client {cid} local loss is {x} in round {rnd}")
    return out


class LocalTrainer:
    """The client side of a round on one model object, reused for every client (its weights
    loaded from the global state, so memory does not grow with the number of clients). A
    subclass says how a group of clients trains (``train_group``) and how many form a group
    (``group_size``); everything else is shared."""

    name = ""  # the engine's name in run.json and the config (train.client_engine)
    group_size = 1

    def __init__(
        self, *, model: torch.nn.Module, method: FedAvg, clients: ClientData, fed: FedState,
        server: ServerContext, evaluator: Evaluator, train: TrainSpec, seed: int,
        device: torch.device, step_graphs: StepGraphs | None = None,
    ) -> None:  # fmt: skip
        self.model, self.method, self.clients = model, method, clients
        self.scenario = clients.scenario
        self.fed, self.server, self.evaluator = fed, server, evaluator
        self.train, self.seed, self.device = train, seed, device
        self.step_graphs = step_graphs
        # the client model's tensors, for an in-place reload at each client (cheaper than
        # load_state_dict, which re-validates keys and shapes every time)
        self._model_tensors = dict(model.state_dict(keep_vars=True))
        # a frozen encoder's tensors (the same global tensors every round): what load_params
        # last copied into each of them, and from which tensor; one the model still holds as
        # loaded, from a source unchanged since, is not copied again [D]. Only these: other
        # tensors change in ways no version counter sees (BatchNorm's running statistics,
        # fused optimizers)
        constant = frozen_tensors(model)
        self._loaded_from, self._loaded_into = Unchanged(constant), Unchanged(constant)
        self.dropout = keyed_modules(model)  # keyed dropout: masks keyed by (client, round, step)
        self.frozen_models: dict[str, torch.nn.Module] = {}  # a method's frozen copies of this model
        if train.precision not in PRECISIONS:
            raise FedForgetError(f"train.precision={train.precision!r}; allowed: {', '.join(PRECISIONS)}")
        n = train.concurrent_clients
        drawing = global_drawing_module(model)
        if n > 1 and drawing is not None:  # known before any training (at_once checks what is not)
            raise FedForgetError(
                f"train.concurrent_clients={n}: module {drawing} of the model draws from the global random "
                "generator in training (dropout that is not keyed), so clients at once would not draw what each "
                "draws alone; allowed with this model: concurrent_clients: 1"
            )
        # the lanes (train.concurrent_clients, ``at_once``): sequential trainers, each on its own
        # model (this one's, then copies: weights, buffers, dropout keys, a method's frozen
        # copies), everything else shared; this trainer alone where n is 1. No more lanes than
        # clients (at least 2): more would idle, each a copy of the model (10**12 copied it until
        # memory ran out) [D]; the threads are still shared out among n (``client_threads``)
        one = dataclasses.replace(train, concurrent_clients=1)
        self.lanes: list[LocalTrainer] = [self] if n == 1 else [
            SequentialTrainer(model=model if i == 0 else copy.deepcopy(model), method=method, clients=clients, fed=fed,
                              server=server, evaluator=evaluator, train=one, seed=seed, device=device)
            for i in range(min(n, max(2, len(clients.offsets))))
        ]  # fmt: skip
        self.stream = None  # this lane's CUDA stream (made at its first use on a lane)
        self.pool: ThreadPoolExecutor | None = None  # the lanes' threads, started once (idle between uses)
        self.sums: dict[tuple, SummedTotal] | None = None  # in train_round: the uploads' Summed totals

    def autocast(self) -> contextlib.AbstractContextManager:
        """The arithmetic of a local step's forward pass (``train.precision``): fp32 as it is,
        or bf16 autocast [D] (matrix products and convolutions in bfloat16; losses, softmax and
        reductions in fp32 by autocast's own lists) on fp32 weights, gradients and optimizer.
        Without its cast cache, so that a captured CUDA graph holds no cast weights."""
        if self.train.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=False)

    def client_threads(self) -> int:
        """The intra-op threads each client trains on, and replies on (CPU results depend on
        it): the process's, shared out among ``train.concurrent_clients`` lanes (at least one
        each) [D]."""
        return client_threads(torch.get_num_threads(), self.train.concurrent_clients)

    def train_group(
        self, views: dict[int, TaskView], rnd: int, lr: float
    ) -> tuple[list[Upload], list[float | LocalLoss], list[dict[str, float]]]:
        """The clients ``views`` (at most ``group_size``) trained in round ``rnd``: their
        uploads, mean losses (read, or left for the round to read) and diagnostics."""
        raise NotImplementedError

    def local_accuracies(self, uploads: list[Upload]) -> list[float]:
        """Each uploaded local model's accuracy on the test sets of the tasks seen so far."""
        raise NotImplementedError

    def client_context(self, cid: int, rnd: int, lr: float, view: TaskView) -> ClientContext:
        """Client ``cid``'s context on ``self.model`` (its state brought to the device)."""
        t = self.train
        self.model.set_task(view.task)
        opt = make_optimizer(self.model.parameters(), t.optimizer, lr)
        state = self.fed.client(cid)
        return ClientContext(
            cid=cid, round=rnd, model=self.model, optimizer=opt, global_params=self.fed.global_params,
            broadcast=self.server.broadcast, state=state, n_samples=len(view), lr=lr,
            local_epochs=t.local_epochs, batch_size=t.batch_size, task=view.task, data=view, frozen=self.frozen_models,
            as_loaded=self.as_loaded,
            minibatches=lambda epoch: map(view.batch, list(self.epoch_orders(cid, rnd, len(view)))[epoch]),
        )  # fmt: skip

    @property
    def widest_batch(self) -> int:
        """The most rows a minibatch can hold: ``train.batch_size``, or the largest client's
        positions where every client holds fewer (each epoch one minibatch of all its rows).
        [D] The stacked steps' row tables and the convolution warm-up are that wide, not
        ``batch_size`` wide: a batch size of 10**12 (full-batch training) allocated a table
        of 10**12 rows per client, and warmed 10**12 shapes."""
        return min(self.train.batch_size, max(self.clients.largest, 1))

    def one_row_batch(self, rnd: int, sizes: dict[int, int]) -> FedForgetError:
        """[D] BatchNorm cannot train on one value per channel, so a one-row minibatch through
        a layer whose maps are 1x1 (``resnet18_imagenet`` at 32 px) fails in PyTorch: the
        error names the clients whose epochs end in one row, and the knob."""
        bs = self.train.batch_size
        ones = {c: n for c, n in sizes.items() if self.train.epoch_rows(n) % bs == 1}
        held = ", ".join(f"client {c}: {n} rows" for c, n in ones.items()) or "a step of the method's own"
        return FedForgetError(
            f"round {rnd}: a minibatch of one row reached a BatchNorm layer, which cannot train on one value "
            f"per channel ({held}, train.batch_size {bs}); set train.drop_last: true (each epoch's short last "
            "minibatch skipped, as FedProTIP's paper configs do) or another train.batch_size"
        )

    def epoch_orders(self, cid: int, rnd: int, n: int, host: bool = False) -> Iterator[list[torch.Tensor]]:
        """Client ``cid``'s minibatches in round ``rnd`` over its ``n`` rows, epoch by epoch:
        each a list of position tensors (at most a batch each; ``TrainSpec.epoch_rows``), from
        its keyed shuffle, with each step's augmentation key added (``ClientData.draw_offset``);
        on the device, or in host memory with ``host`` (a streamed pool's read-ahead)."""
        t, bs = self.train, self.train.batch_size
        gen = torch.Generator().manual_seed(torch_seed(self.seed, rnd, cid, SHUFFLE_STREAM))
        end = t.epoch_rows(n)  # drop_last: full minibatches only (TrainSpec.epoch_rows)
        for epoch in range(t.local_epochs):
            # the epoch's order; its positions carry the step's augmentation key, if any
            perm = torch.randperm(n, generator=gen)
            if not host:  # without waiting for the steps queued on the device
                perm = host_to_device(perm, self.device)
            perm += self.clients.draw_offset(rnd, epoch, t.local_epochs)
            yield [perm[s : s + bs] for s in range(0, end, bs)]

    def round_view(self, cid: int, rnd: int) -> TaskView:
        """Client ``cid``'s data in round ``rnd`` (every task's for joint training)."""
        return self.clients.view(cid, rnd, type(self.method).trait("sees_all_tasks", self.method.p))

    def enter_task(self, ctx: ClientContext) -> None:
        """A client's first training on a task: under asynchronous boundaries the tasks it
        moves past end here, its previous one and those whose rows this window holds between
        it and the new one (a window that passes over a task), in order; each TASK_END
        report waits for the server's task end, one per client [D]: a later one replaces an
        earlier (warned, counted in ``FedState.reports_replaced``, run.json
        ``task_reports_replaced``). Before 2026-12-06 a passed-over task was not ended at
        all (found in review): a GLFC client kept no exemplars of it, a GPM client no bases."""
        prev = self.fed.client_task.get(ctx.cid)
        if prev == ctx.task:
            return
        if self.scenario.window is not None:
            ended = [] if prev is None else [prev]
            if TASK_END in self.method.exchanges and ctx.data is not None:
                v = ctx.data
                held = self.clients.task[v.start : v.stop].unique().tolist()
                ended += [t for t in held if t < ctx.task and (prev is None or t > prev)]
            for task in ended:
                report = self.end_client_task(ctx.cid, task, ctx.round, ctx.lr)
                if report is None:
                    continue
                if ctx.cid in self.fed.task_reports:  # [D] one report per client per server task end
                    log.warning(
                        "client %d ended two tasks before the server's task end (task %d now): its earlier report "
                        "is replaced", ctx.cid, task,
                    )  # fmt: skip
                    self.fed.reports_replaced[ctx.cid] = self.fed.reports_replaced.get(ctx.cid, 0) + 1
                self.fed.task_reports[ctx.cid] = report
            if ended:
                # the reply parked the client's state (host memory, on a GPU): ctx.state is that
                # very dict, back on the device for this training
                self.fed.client(ctx.cid)
                self.load_params(self.model, self.fed.global_params)
                self.model.set_task(ctx.task)
        self.fed.client_task[ctx.cid] = ctx.task

    def train_client(
        self, cid: int, rnd: int, lr: float, view: TaskView | None = None, read_loss: bool = True
    ) -> tuple[Upload, float | LocalLoss, dict[str, float]]:
        """Client ``cid``'s local training in round ``rnd`` on ``view`` (default: its data
        of the round). Without ``read_loss``, the mean loss may come back unread
        (``LocalLoss``: the round reads it): where the method's ``client_end`` is FedAvg's,
        which cannot fail on diverged weights."""
        view = view or self.round_view(cid, rnd)
        model = self.model
        self.load_params(model, self.fed.global_params)
        model.train()
        ctx = self.client_context(cid, rnd, lr, view)
        opt, method = ctx.optimizer, self.method
        self.enter_task(ctx)
        method.client_begin(ctx)
        loss_sum = torch.zeros((), device=self.device)
        host = client_key(self.seed, rnd, cid) if self.dropout else None
        key = key_tensor(host, self.device) if host is not None else None
        ahead = self.clients.x.read_ahead
        for chunks in self.epoch_orders(cid, rnd, len(view), host=ahead):
            chunks = chunks[: ctx.epoch_steps]  # a method may cut the epoch short
            # a streamed pool on a GPU: the next minibatches read on a background thread, from
            # positions in host memory (ClientData.batch: no wait on the device's steps)
            batches = prefetched(view.batch, chunks) if ahead else map(view.batch, chunks)
            for x, y in batches:
                if key is not None:  # this step's masks (fedforget.dropout)
                    set_dropout_key(self.dropout, DropoutKey(key, ctx.steps, host))
                opt.zero_grad(set_to_none=True)
                try:
                    with self.autocast():  # the step's forward passes (and their backward)
                        loss = method.client_step(ctx, x, y)
                except ValueError as e:
                    if ONE_ROW_BATCHNORM not in str(e):
                        raise
                    raise self.one_row_batch(rnd, {cid: len(view)}) from None
                method.client_grad(ctx)
                opt.step()
                loss_sum += loss.detach()
                ctx.steps += 1
        set_dropout_key(self.dropout, None)
        mean_loss: float | LocalLoss = LocalLoss(cid, loss_sum, ctx.steps)
        if read_loss or method.own_upload:  # the method's own client_end sees finite weights only
            (mean_loss,) = read_losses([mean_loss], [cid], rnd)
        upload = method.client_end(ctx)
        self.fed.park(ctx.cid)
        return upload, mean_loss, ctx.stats

    # ------------------------------------------------------------------ task boundaries
    def client_pass(
        self, exchange: str, views: dict[int, TaskView], rnd: int, lr: float, fold: bool = True
    ) -> dict[int, Any]:
        """The clients ``views``' ``client_reply`` in the exchange ``exchange``, each on that view of
        its data and the global weights, one after another (on several lanes, at once:
        ``at_once``); their replies in the order of ``views``, None left out. With ``fold``, their
        ``Summed`` shares are folded into one total as they arrive (``fold_summed``; on lanes, in
        the order of ``views`` once the lanes are done); without, a caller that adds replies of
        other rounds (asynchronous task ends) gets each client's share."""
        totals: dict[tuple, SummedTotal] = {}
        if len(self.lanes) > 1:

            def reply(lane: LocalTrainer, cid: int) -> Any:
                return lane.client_pass(exchange, {cid: views[cid]}, rnd, lr, fold=False).get(cid)

            replies = self.at_once(views, reply, f"the {exchange} reply")
            replies = {cid: replies[cid] for cid in views if replies[cid] is not None}
            for reply in replies.values() if fold else ():
                fold_summed(totals, reply)
            return replies
        replies = {}
        for cid, view in views.items():
            self.load_params(self.model, self.fed.global_params)
            ctx = self.client_context(cid, rnd, lr, view)
            if self.dropout:  # a reply's masks in training mode (fedforget.dropout.reply_key)
                host = self.reply_keys(exchange, rnd, [cid])[0]
                set_dropout_key(self.dropout, DropoutKey(key_tensor(host, self.device), 0, host))
            try:
                reply = self.method.client_reply(exchange, ctx)
            finally:
                set_dropout_key(self.dropout, None)
            self.fed.park(ctx.cid)
            if reply is not None:
                replies[cid] = reply
                if fold:
                    fold_summed(totals, reply)
        return replies

    def reply_keys(self, exchange: str, rnd: int, cids: list[int]) -> list[int]:
        """The clients' dropout keys of their replies in ``exchange`` of round ``rnd``."""
        return [reply_key(self.seed, rnd, cid, EXCHANGES.index(exchange)) for cid in cids]

    def at_once(
        self, views: dict[int, TaskView], work: Callable[[LocalTrainer, int], Any], what: str
    ) -> dict[int, Any]:
        """``work(lane, cid)`` for each client of ``views``, on the lanes at once: each lane
        takes the next client (the largest first) as it finishes one. Each client's result
        is what it computes alone: it starts from the global weights, its own state and keyed
        draws on its lane's model, so the lanes change no result on a GPU, and on a CPU the
        same as one after another on ``client_threads`` threads
        (tests/methods/test_concurrent_clients.py). The run's per-client entries then take
        the order of ``views``, as one after another would add them (``FedState.order_clients``).
        After an error the lanes take no more clients, and the error raised is that of the
        first client in the order of ``views`` among those that failed (one after another might
        have met an earlier client's first: the run fails, or diverges, either way). A draw
        from a global generator (which clients at once cannot share out as one after another
        would) is refused, naming ``what`` drew."""
        cids = list(views)
        order = iter(sorted(cids, key=lambda c: (-len(views[c]), cids.index(c))))
        done: dict[int, Any] = {}
        failed: dict[int, Exception] = {}
        lock = threading.Lock()
        before = {name: set(d) for name, d in self.fed.client_dicts().items()}
        main = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        drawn = global_draws(self.device)
        per = self.client_threads()

        def run(lane: LocalTrainer) -> None:
            # this thread's own intra-op count (OpenMP's and MKL's are per thread): a new thread
            # takes torch's count at its first large elementwise op only, and ran MKL's matrix
            # products before it on every core, some with other bits than on one thread (small
            # models: tests/methods/test_concurrent_clients.py) [D, found 2026-12-06]
            torch.set_num_threads(per)
            with lane.on_stream(main):
                while True:
                    with lock:
                        cid = None if failed else next(order, None)
                    if cid is None:
                        return
                    try:
                        done[cid] = work(lane, cid)
                    except Exception as e:  # the other lanes take no more clients; raised below
                        with lock:
                            failed[cid] = e

        threads = torch.get_num_threads()
        if self.pool is None:
            self.pool = ThreadPoolExecutor(len(self.lanes), thread_name_prefix="fedforget-lane")
        torch.set_num_threads(per)  # the process's count too: back afterwards
        try:
            list(self.pool.map(run, self.lanes[: len(cids)]))
        finally:
            torch.set_num_threads(threads)
        if failed:
            raise failed[min(failed, key=cids.index)]
        if not all(torch.equal(a, b) for a, b in zip(drawn, global_draws(self.device), strict=True)):
            raise FedForgetError(
                f"train.concurrent_clients={self.train.concurrent_clients}: {what} of method '{self.method.name}' on this "
                "model draws from the global random generator, so clients at once would not draw what each "
                "draws alone; allowed here: concurrent_clients: 1"
            )
        self.fed.order_clients(before, cids)
        return done

    @contextlib.contextmanager
    def on_stream(self, main: torch.cuda.Stream | None) -> Iterator[None]:
        """This lane's clients on a CUDA stream of its own, after what ``main`` has queued
        (the round's global weights); its work finished when the context ends, so the
        uploads are complete when the round reads them. A no-op on a CPU."""
        if main is None:
            yield
            return
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        self.stream.wait_stream(main)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            self.stream.synchronize()

    def end_client_task(self, cid: int, task: int, rnd: int, lr: float) -> Any:
        """Client ``cid``'s TASK_END reply for ``task`` on the global weights (None for a
        method without that exchange)."""
        if TASK_END not in self.method.exchanges:
            return None
        view = {cid: self.clients.task_view(cid, task)}
        return self.client_pass(TASK_END, view, rnd, lr, fold=False).get(cid)  # summed at the task end

    # ------------------------------------------------------------------ a round
    def train_round(self, rnd: int, lr: float, views: dict[int, TaskView]):
        """Local training of the clients ``views`` (each on its data of this round): their
        uploads, mean losses, diagnostics, local models' accuracies, evaluation time."""
        t = self.train
        uploads, losses, local_accs, stats = [], [], [], []
        eval_time = 0.0
        cids = list(views)
        step = self.group_size
        self.sums = {}  # the round's Summed totals (a stack folds each client's as it ends)
        try:
            for group in range(0, len(cids), step):
                part = {c: views[c] for c in cids[group : group + step]}
                ups, ls, st = self.train_group(part, rnd, lr)
                for up in ups:
                    fold_summed(self.sums, up)
                uploads += ups
                losses += ls
                stats += st
                if t.eval_local_models:
                    te = time.perf_counter()
                    local_accs += self.local_accuracies(ups)
                    eval_time += time.perf_counter() - te
        finally:
            self.sums = None
        return uploads, read_losses(losses, cids, rnd), stats, local_accs, eval_time

    def load_params(self, model: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
        """``params`` (a full state dict) into ``self.model``'s tensors, in place; a frozen
        encoder's tensor that already holds what it was last loaded from, that very source
        tensor unchanged since, is left as it is (the same values: ``Unchanged``)."""
        if params.keys() != self._model_tensors.keys():
            model.load_state_dict(params)  # raises, naming the mismatched keys
        todo = [k for k, t in self._model_tensors.items()
                if not (self._loaded_from.holds(k, params[k]) and self._loaded_into.holds(k, t))]  # fmt: skip
        if not todo:
            return
        with torch.no_grad():
            torch._foreach_copy_([self._model_tensors[k] for k in todo], [params[k] for k in todo])
        for k in todo:
            self._loaded_from.mark(k, params[k])
            self._loaded_into.mark(k, self._model_tensors[k])

    def as_loaded(self) -> dict[str, torch.Tensor]:
        """The frozen encoder's tensors that hold exactly what ``load_params`` last copied
        into them, each mapped to the tensor it came from (still unchanged): an upload shares
        these instead of copying them (``ClientContext.as_loaded``) [D]."""
        out = {}
        for k in self._loaded_from.names:
            src, t = self._loaded_from.get(k), self._model_tensors[k]
            if src is not None and self._loaded_into.holds(k, t):
                out[k] = src
        return out


def warm_conv_shapes(
    model: torch.nn.Module, row: torch.Tensor, sizes: range,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> int:  # fmt: skip
    """Run a forward and backward pass of a copy of ``model`` (eval mode: no dropout draws,
    no running statistics updated, no random numbers used) on ``b`` copies of the input
    ``row`` [1, ...] for each ``b`` in ``sizes``; returns the number of passes. The model,
    its gradients and every random generator are left as they were.

    [D] On a GPU, cuDNN picks and builds its convolution kernels for each input shape the
    first time the shape is met (PyTorch then caches the plan per shape; without benchmark
    mode the choice is its heuristics', so the same for a shape whenever it is made). One
    client after another, every client's last, partial minibatch is a new shape until each
    size has been met once: on an H200, ResNet-18's sequential round took 0.99 s against
    0.67 s for a plain loop over the same samples in full batches (issue 32; that the gap is
    this cost is inferred, not yet measured). Meeting every size up front, once per process,
    takes that cost out of the rounds; the arithmetic of later passes is unchanged."""
    twin = copy.deepcopy(model).eval()
    for q in twin.parameters():
        q.requires_grad_(True)  # weight-gradient kernels of frozen layers too
        q.grad = None
    passes = 0
    for b in sizes:
        x = row.expand(b, *row.shape[1:]).contiguous()
        with autocast():  # the step's precision (train.precision): its kernels
            out = twin(x)
        out.float().sum().backward()
        twin.zero_grad(set_to_none=True)
        passes += 1
    return passes


def conv_warmup_wanted(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether the sequential trainer meets every minibatch size up front (``warm_conv_shapes``):
    on a GPU, for a model with convolutions, unless FEDFORGET_WARM_SHAPES=0."""
    return (
        device.type == "cuda"
        and os.environ.get("FEDFORGET_WARM_SHAPES", "1") != "0"
        and any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in model.modules())
    )


def global_draws(device: torch.device) -> list[torch.Tensor]:
    """The global generators' states (torch's on the host and the device, numpy's): what a
    draw that is not keyed moves."""
    keys, pos = np.random.get_state()[1:3]
    out = [torch.get_rng_state(), torch.from_numpy(keys.copy()), torch.tensor([pos])]
    if device.type == "cuda":
        out.append(torch.cuda.get_rng_state(device))
    return out


def global_drawing_module(model: torch.nn.Module) -> str | None:
    """The class name of a module of ``model`` that draws from the global random generator in
    training (``global_draws``: a Hugging Face encoder that trains), or None: such a model
    cannot train clients at once (``train.concurrent_clients``)."""
    return next((type(m).__name__ for m in model.modules() if getattr(m, "global_draws", False)), None)


class SequentialTrainer(LocalTrainer):
    """One client after another (``LocalTrainer.train_client``): any method, optimizer and
    model. With ``train.concurrent_clients`` n > 1, n clients at a time (``at_once``): each
    of n lanes (trainers of its own kind, one on this trainer's model, the others on copies
    of it) takes the round's next client as it finishes one, on a thread of its own and, on a
    GPU, a CUDA stream of its own, so that one client's host work and waits overlap another's
    kernels (issue 32: the GPU kept busy where clients cannot be stacked); this trainer then
    hands out the clients and trains none itself."""

    name = "sequential"
    warmed = False  # every minibatch size met once (warm_conv_shapes), on a GPU

    def train_round(self, rnd: int, lr: float, views: dict[int, TaskView]):
        """``LocalTrainer.train_round``; with several lanes, the clients at once (``at_once``),
        each client's local model evaluated on its lane right after its training."""
        if len(self.lanes) == 1:
            return super().train_round(rnd, lr, views)

        def train(lane: SequentialTrainer, cid: int) -> tuple:
            ups, losses, stats = lane.train_group({cid: views[cid]}, rnd, lr)
            te, accs = time.perf_counter(), []
            if self.train.eval_local_models:  # its local model, before the lane moves on (the
                accs = lane.local_accuracies(ups)  # evaluator keeps nothing between calls)
            return ups, losses, stats, accs, time.perf_counter() - te

        done = self.at_once(views, train, "local training")
        cids = list(views)
        uploads, losses, stats, local_accs, eval_time = [], [], [], [], 0.0
        sums: dict[tuple, SummedTotal] = {}
        for cid in cids:
            ups, ls, st, accs, te = done[cid]
            for up in ups:  # Summed shares: in the clients' order, once the lanes are done
                fold_summed(sums, up)
            uploads += ups
            losses += ls
            stats += st
            local_accs += accs
            eval_time += te
        # the lanes evaluate at once: their seconds shared out, the round's wall time they took
        eval_time /= max(1, min(len(self.lanes), len(cids)))
        return uploads, read_losses(losses, cids, rnd), stats, local_accs, eval_time

    def train_group(self, views, rnd, lr):
        ((cid, view),) = views.items()
        if not self.warmed and len(view):  # (a client without rows this round has none to copy)
            self.warmed = True
            if conv_warmup_wanted(self.model, self.device):
                row = view.batch(torch.zeros(1, dtype=torch.long, device=self.device))[0]
                warm_conv_shapes(self.model, row, range(1, self.widest_batch + 1), self.autocast)
        up, loss, s = self.train_client(cid, rnd, lr, view, read_loss=False)
        return [up], [loss], [s]

    def local_accuracies(self, uploads: list[Upload]) -> list[float]:
        """Each uploaded local model's accuracy on the test sets of the tasks seen so far
        (the client model holds the last client's weights after its local training)."""
        return [self.evaluator.seen_accuracy(self.model, self.server.task) for _ in uploads]


class StackedTrainer(LocalTrainer):
    """Groups of up to ``train.max_parallel_clients`` clients in one batched pass
    (``fedforget.vectorized``): FedAvg's local SGD step for the stack, with the method's
    per-step terms (``client_step_terms``), then the method's own ``client_end`` per client
    on its trained weights. The replies of an exchange the method states for a stack
    (``stacked_replies``: FedGP's buffer gradients) go a group at a time
    (``client_pass``); with ``train.concurrent_clients`` the other exchanges' replies (task
    end, round end) run on lanes, several clients at once (``LocalTrainer.at_once``)."""

    name = "vectorized"

    def __init__(self, **parts) -> None:
        super().__init__(**parts)
        self.group_size = self.train.max_parallel_clients
        self.replies_alone = stacked_replies_refused(self.model)  # None: stacked replies run

    def client_pass(
        self, exchange: str, views: dict[int, TaskView], rnd: int, lr: float, fold: bool = True
    ) -> dict[int, Any]:
        """``LocalTrainer.client_pass``; for an exchange in the method's ``stacked_replies``
        (on a model ``stacked_replies_refused`` allows), groups of up to
        ``train.max_parallel_clients`` clients reply together: ``client_replies`` of their
        contexts, all on the global weights, loaded once, with ``vectorized.reply_grads``
        (the same replies as one after another up to float summation order)."""
        if exchange not in self.method.stacked_replies or self.replies_alone is not None or len(views) < 2:
            return super().client_pass(exchange, views, rnd, lr, fold)
        self.load_params(self.model, self.fed.global_params)
        cids, replies, totals = list(views), {}, {}
        for lo in range(0, len(cids), self.group_size):
            group = cids[lo : lo + self.group_size]
            ctxs = [self.client_context(cid, rnd, lr, views[cid]) for cid in group]
            grads = reply_grads(self.model, self.fed.global_params, self.reply_keys(exchange, rnd, group))
            try:
                out = self.method.client_replies(exchange, ctxs, grads)
            except torch.cuda.OutOfMemoryError as e:
                raise self.out_of_memory(e, rnd, len(group), f" in the {exchange} replies") from None
            for ctx, reply in zip(ctxs, out, strict=True):
                self.fed.park(ctx.cid)
                if reply is not None:
                    replies[ctx.cid] = reply
                    if fold:
                        fold_summed(totals, reply)
        return replies

    def out_of_memory(self, e: Exception, rnd: int, n: int, where: str) -> FedForgetError:
        """[D] A stack's memory grows with its clients: the error names the knob."""
        first = first_line(e)
        return FedForgetError(
            f"round {rnd}: the batched engine's group of {n} clients ran out of GPU memory{where} ({first}); "
            f"set train.max_parallel_clients below {n} (now {self.train.max_parallel_clients}), or "
            "train.client_engine: sequential (the same results up to float rounding)"
        )

    def train_group(self, views, rnd, lr):
        if isinstance(getattr(self.model, "head", None), TaskHeads):
            # per-task heads need synchronous boundaries: the round's clients share one task,
            # whose head the batched pass trains (fedforget.vectorized)
            (task,) = {v.task for v in views.values()}
            self.model.set_task(task)
        return self.train_clients_together(views, rnd, lr)

    def train_clients_together(
        self, views: dict[int, TaskView] | list[int], rnd: int, lr: float
    ) -> tuple[list[Upload], list[float], list[dict[str, float]]]:
        """The clients ``views`` trained in one batched pass (``fedforget.vectorized``): the
        same minibatches, steps and optimizer as ``train_client`` gives each of them. A
        method's own ``client_end`` (FedNova's step count, FedDF's public logits) then runs
        for each client on its trained weights, as in ``train_client``."""
        t = self.train
        if not isinstance(views, dict):  # client ids: their data of the round
            views = {c: self.round_view(c, rnd) for c in views}
        cids = list(views)
        jobs = [
            ClientJob(cid, views[cid].start, len(views[cid]),
                      torch.Generator().manual_seed(torch_seed(self.seed, rnd, cid, SHUFFLE_STREAM)),
                      [self.clients.draw_offset(rnd, e, t.local_epochs) for e in range(t.local_epochs)],
                      client_key(self.seed, rnd, cid))
            for cid in cids
        ]  # fmt: skip
        opt, method = t.optimizer, self.method
        # a method with per-step or live terms (FedProx, FedDyn, SCAFFOLD, FedGP; FedSAM,
        # FedSOL, FedNTD): its client_begin for every client on the global weights, then its
        # terms for the stack
        with_terms = method.step_terms or method.live_terms
        ctxs: dict[int, ClientContext] = {}
        # clients entering a task (an asynchronous boundary ends their previous one), and every
        # client of a method with step terms: on the global weights, loaded once (enter_task
        # leaves them loaded)
        setup = [c for c in cids if with_terms or self.fed.client_task.get(c) != views[c].task]
        if setup:
            self.load_params(self.model, self.fed.global_params)
        for cid in setup:
            ctxs[cid] = self.client_context(cid, rnd, lr, views[cid])
            self.enter_task(ctxs[cid])
            if with_terms:
                method.client_begin(ctxs[cid])
        for job in jobs:  # a method that cuts its epochs (TARGET's code rule) did so in client_begin
            ctx = ctxs.get(job.cid)
            job.epoch_steps = None if ctx is None else ctx.epoch_steps
        # the rows with the task loss's classes by label (FedAvg.task_mask; None: every class);
        # a bound method, equal from round to round, as the steps captured in CUDA graphs are keyed by it
        batch = self.masked_batch
        try:
            results = train_clients_together(
                self.model, self.fed.global_params, batch, jobs,
                lr=lr, momentum=opt.momentum, weight_decay=opt.weight_decay,
                epochs=t.local_epochs, batch_size=self.widest_batch,
                step_terms=(lambda order: method.client_step_terms([ctxs[cids[j]] for j in order])) if method.step_terms else None,
                live_terms=(lambda order: method.client_live_terms([ctxs[cids[j]] for j in order])) if method.live_terms else None,
                graphs=self.step_graphs, read_ahead=self.clients.x.read_ahead, epoch_rows=t.epoch_rows,
                autocast=self.autocast, sees_step=method.sees_step, step_rows=method.step_rows, optimizer=opt.name,
                betas=tuple(opt.betas),
                capturable_terms=type(method).trait("capturable_terms", method.p),
            )  # fmt: skip
        except torch.cuda.OutOfMemoryError as e:  # [D] the stack's memory grows with its clients: name the knob
            raise self.out_of_memory(e, rnd, len(jobs), "") from None
        except ValueError as e:
            if ONE_ROW_BATCHNORM not in str(e):
                raise
            raise self.one_row_batch(rnd, {c: len(views[c]) for c in cids}) from None
        # client_end per client: a method's own upload, or (step terms) a context whose state
        # goes back to host memory like train_client's
        per_client = with_terms or method.own_upload
        ups, stats = [], []
        for r in results:
            if not math.isfinite(r.mean_loss):
                raise Diverged(f"client {r.cid} local loss is {r.mean_loss} in round {rnd}")
            if not per_client:
                ups.append(Upload(r.cid, len(views[r.cid]), r.params, r.steps))
                stats.append({})
                if r.cid in ctxs:  # entered a task (its state on the device): back to host memory
                    self.fed.park(r.cid)
                continue
            self.load_params(self.model, r.params)
            # a method with terms began every client before the pass (its context, begun once as a
            # client alone's, holds what the steps left in its scratch); another gets a fresh one
            ctx = ctxs.get(r.cid) or self.client_context(r.cid, rnd, lr, views[r.cid])
            ctx.steps = r.steps
            ups.append(method.client_end(ctx))
            if self.sums is not None:  # in a round: its Summed shares into the round's totals now
                fold_summed(self.sums, ups[-1])
            stats.append(ctx.stats)
            self.fed.park(ctx.cid)
        return ups, [r.mean_loss for r in results], stats

    def masked_batch(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``ClientData.batch`` with the logit mask of the method's task loss
        (``FedAvg.task_mask``: the rows' ``label_classes``, TARGET's ``ce: task``; else None)."""
        x, y = self.clients.batch(pos)
        return x, y, self.method.task_mask(y)

    def local_accuracies(self, uploads: list[Upload]) -> list[float]:
        """The local models' accuracies, evaluated together where the evaluation is plain
        (one test set, no per-task routing), else one by one on the client model."""
        if self.evaluator.plain:
            test = self.evaluator.test
            return evaluate_stacked(
                self.model, [u.params for u in uploads], test.x, test.y, self.train.eval_batch_size
            )
        accs = []
        for u in uploads:
            self.load_params(self.model, u.params)
            accs.append(self.evaluator.seen_accuracy(self.model, self.server.task))
        return accs



TRAINERS: dict[str, type[LocalTrainer]] = {t.name: t for t in (SequentialTrainer, StackedTrainer)}


def choose_trainer(
    method_cls: type, model: torch.nn.Module, train: TrainSpec, device: torch.device, params: Any = None
) -> tuple[type[LocalTrainer], str]:
    """The one place a run's trainer is chosen: (trainer class, why). ``train.client_engine``
    ``sequential`` or ``vectorized`` asks for one (``vectorized`` where the method, model and
    optimizer do not allow it is refused, naming why); ``auto`` takes the stacked trainer
    where it is possible, unless the experiment pairs its methods on the sequential one
    (``engine_pairing``) or the model runs faster one client at a time on this device."""
    why_not = why_not_vectorized(method_cls, model, train.optimizer.name, train.drop_last, params)
    if train.client_engine == "vectorized" and why_not is not None:
        raise FedForgetError(f"train.client_engine='vectorized' is not possible here: {why_not}")
    if train.client_engine == "sequential":
        why_not = "train.client_engine = sequential"
    elif why_not is None and train.client_engine == "auto":
        why_not = train.engine_pairing or auto_prefers_sequential(model, device)
    if why_not is None:
        return StackedTrainer, f"groups of at most {train.max_parallel_clients} clients"
    return SequentialTrainer, why_not


def engine_pairing(experiment: Experiment) -> str:
    """Why every ``client_engine: auto`` job of ``experiment`` trains its clients one
    after another ("" if none must): methods compared in one table run on the same
    numerics, so if one method's local training cannot be batched (its hooks, optimizer
    or drop_last), the others do not take the batched engine either (it equals the
    sequential one only up to float summation order)."""
    for m in experiment.methods:
        t = experiment.train_for(m)
        why = method_not_vectorized(METHODS.get(m.name), t.optimizer.name, t.drop_last, make_params(m.name, m.params))
        if why is not None:
            return (
                f"auto, paired within experiment '{experiment.name}': {why} (method '{m.label}'), so every "
                "method of the experiment trains clients one after another (train.client_engine overrides)"
            )
    return ""
