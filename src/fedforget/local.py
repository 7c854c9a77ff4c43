"""The client side of a federated round: local training of the sampled clients, one after
another (``train_client``) or together in one batched pass (``train_clients_together``,
``fedforget.vectorized``), and the clients' task hooks. ``Simulation``
(``fedforget.engine``) is the server's loop over it.

Randomness is keyed: each client's shuffling by (seed, round, client), so a client's
minibatches do not depend on the order clients run in or on the engine that runs them.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from .clientdata import TaskView
from .config import OptimizerSpec
from .inputs import prefetched
from .methods import ClientContext, FedAvg, Upload
from .methods.base import to_device
from .utils import FedForgetError, torch_seed
from .vectorized import ClientJob, evaluate_stacked, has_step_terms, train_clients_together

log = logging.getLogger(__name__)

SHUFFLE_STREAM = 0x52  # stream tag of the clients' shuffling


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


class ClientSide:
    """Local training on ``self.model`` (one model object reused for every client, its
    weights loaded from the global state, so memory does not grow with the clients). The
    attributes it uses are set by ``Simulation.__init__``."""

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

    def round_view(self, cid: int, rnd: int) -> TaskView:
        """Client ``cid``'s data in round ``rnd`` (every task's for joint training)."""
        return self.clients.view(cid, rnd, type(self.method).trait("sees_all_tasks", self.method.p))

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
                if ctx.cid in self.task_reports:  # [D] one report per client per server task end
                    log.warning(
                        "client %d ended two tasks before the server's task end: its earlier report is replaced",
                        ctx.cid,
                    )
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
        view = view or self.round_view(cid, rnd)
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
        end = t.epoch_rows(n)  # drop_last: full minibatches only (TrainSpec.epoch_rows)
        for epoch in range(t.local_epochs):
            # the epoch's order; its positions carry the step's augmentation key, if any
            perm = torch.randperm(n, generator=gen).to(self.device)
            perm += self.clients.draw_offset(rnd, epoch, t.local_epochs)
            chunks = [perm[s : s + bs] for s in range(0, end, bs)]
            # a streamed pool on a GPU: the next minibatches read on a background thread
            batches = prefetched(view.batch, chunks) if self.clients.x.read_ahead else map(view.batch, chunks)
            for x, y, ctx.logit_mask in batches:
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
            views = {c: self.round_view(c, rnd) for c in views}
        cids = list(views)
        jobs = [
            ClientJob(cid, views[cid].start, len(views[cid]),
                      torch.Generator().manual_seed(torch_seed(self.cfg.seed, rnd, cid, SHUFFLE_STREAM)),
                      [self.clients.draw_offset(rnd, e, t.local_epochs) for e in range(t.local_epochs)])
            for cid in cids
        ]  # fmt: skip
        opt, method = t.optimizer, self.method
        # a method with per-step terms (FedProx, FedDyn, SCAFFOLD): its client_begin for
        # every client on the global weights, then its terms for the stack
        with_terms = has_step_terms(type(method))
        ctxs: dict[int, ClientContext] = {}
        # clients entering a task, and every client of a method with step terms: their hooks
        # on the global weights, loaded once (enter_task leaves them loaded)
        setup = [c for c in cids if with_terms or self.client_task.get(c) != views[c].task]
        if setup:
            self.load_params(self.model, self.global_params)
        for cid in setup:
            ctxs[cid] = self.client_context(cid, rnd, lr, views[cid])
            self.enter_task(ctxs[cid])
            if with_terms:
                method.client_begin(ctxs[cid])
        results = train_clients_together(
            self.model, self.global_params, self.clients.batch, jobs,
            lr=lr, momentum=opt.momentum, weight_decay=opt.weight_decay,
            epochs=t.local_epochs, batch_size=t.batch_size,
            step_terms=(lambda order: method.stacked_step_terms([ctxs[cids[j]] for j in order])) if with_terms else None,
            graphs=self.step_graphs, read_ahead=self.clients.x.read_ahead,
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
    def client_pass(self, hook: Callable[[ClientContext], Any], views: dict[int, TaskView], rnd: int, lr: float) -> dict[int, Any]:  # fmt: skip
        """``hook(ctx)`` of each client in ``views`` (on that view of its data) on the global
        weights, one after another; their replies, None left out."""
        replies = {}
        for cid, view in views.items():
            self.load_params(self.model, self.global_params)
            ctx = self.client_context(cid, rnd, lr, view)
            reply = hook(ctx)
            self.offload(ctx)
            if reply is not None:
                replies[cid] = reply
        return replies

    def end_client_task(self, cid: int, task: int, rnd: int, lr: float) -> Any:
        """Client ``cid``'s ``client_task_end`` for ``task`` on the global weights (None
        where the method does not override it)."""
        if type(self.method).client_task_end is FedAvg.client_task_end:
            return None
        view = {cid: self.clients.task_view(cid, task)}
        return self.client_pass(self.method.client_task_end, view, rnd, lr).get(cid)

    def after_client_tasks(self, cids: list[int], task: int, rnd: int, lr: float) -> dict[int, Any]:
        """The after-task pass: ``client_after_task`` of each client in ``cids`` (those that
        reported to the task end) on its data of ``task``, the global weights and the
        server's new broadcast; their replies (None left out)."""
        views = {cid: self.clients.task_view(cid, task) for cid in cids}
        return self.client_pass(self.method.client_after_task, views, rnd, lr)

    def end_client_rounds(self, views: dict[int, TaskView], rnd: int, lr: float) -> dict[int, Any]:
        """The round-end pass: ``client_round_end`` of each client in ``views`` (those that
        trained this round, on their data of the round) on the new global weights; their
        replies (None left out). Empty, and nothing run, for methods without the hook."""
        if not self.method.replies_each_round():
            return {}
        return self.client_pass(self.method.client_round_end, views, rnd, lr)

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
                ((cid, view),) = part.items()
                up, loss, s = self.train_client(cid, rnd, lr, view)
                ups, ls, st = [up], [loss], [s]
            uploads += ups
            losses += ls
            stats += st
            if t.eval_local_models:
                te = time.perf_counter()
                if self.vectorized and self.evaluator.plain:
                    test = self.evaluator.test
                    local_accs += evaluate_stacked(
                        self.model, [u.params for u in ups], test.x, test.y, t.eval_batch_size
                    )
                else:
                    for u in ups:
                        if self.vectorized:
                            self.load_params(self.model, u.params)
                        local_accs.append(
                            self.evaluator.seen_accuracy(self.model, self.server.task)
                        )
                eval_time += time.perf_counter() - te
        return uploads, losses, stats, local_accs, eval_time

    def load_params(self, model: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
        """``params`` (a full state dict) into ``self.model``'s tensors, in place."""
        if params.keys() != self._model_tensors.keys():
            model.load_state_dict(params)  # raises, naming the mismatched keys
        with torch.no_grad():
            torch._foreach_copy_(
                list(self._model_tensors.values()), [params[k] for k in self._model_tensors]
            )
