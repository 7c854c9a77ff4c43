"""Evaluation of the global (and local) models on every task's test set.

After every evaluated round the global model is scored on each task of the scenario (the
tasks not yet trained too, for forward transfer), through the method's ``eval_predict`` hook
(default: the logits; iCaRL's nearest-mean classifier or FedProTIP's task routing replace
it). Task-incremental scenarios give ``eval_predict`` the task id and mask the scores outside
the task's classes. The per-task rows (round, current task, task, accuracy, loss, and the
accuracies of the method's other inference modes, ``eval_counts``) are the run's
``tasks.csv``; at the last round of task t they are row t of the accuracy matrix
a[t][i] (``fedforget.continual``). A task stream evaluated without the task id (class- or
domain-incremental) also scores every method task-aware, as the FedProTIP paper's tables
and Fig. 3b do for every baseline: column ``task_aware`` (``TASK_AWARE``), the method's
``eval_predict`` given the true task, its scores outside the task's classes masked (the
task's head with per-task heads; a shared head's logits over the task's classes) [D: the
paper does not say how it scores its baselines task-aware; masking to the task's classes is
the task-incremental evaluation this module gives task-IL streams]. With a shared head on a
domain stream (every task holds every class) it equals ``accuracy``. The metrics row's ``global_model_test_acc`` / ``loss``
are the mean over the tasks seen so far (0..current): FedGP's Acc_t [P]; in a one-task
run, the accuracy on the whole test set, as before."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .clientdata import TestSets
from .continual import TASK_AWARE, TOP_SHARE
from .data.scenario import Scenario
from .methods import FedAvg, ServerContext
from .methods.base import masked_logits
from .metrics import classwise_accuracy
from .models import TaskHeads


class Evaluator:
    def __init__(
        self,
        test: TestSets,
        scenario: Scenario,
        method: FedAvg,
        server: ServerContext,
        batch_size: int,
    ) -> None:
        self.test, self.scenario, self.method, self.server = test, scenario, method, server
        self.batch_size = batch_size
        self.class_mask = scenario.class_mask(test.x.device) if scenario.masked else None
        # a stream scored without the task id is scored with it too (TASK_AWARE)
        self.aware_mask = (
            scenario.class_mask(test.x.device) if scenario.scores_task_aware else None
        )

    def task(self, model: nn.Module, t: int) -> tuple[float, float]:
        """(accuracy, mean cross-entropy of the scores) of ``model`` on task t's test rows."""
        acc, loss, _, _ = self.task_scores(model, t)
        return acc, loss

    @torch.no_grad()
    def task_scores(self, model: nn.Module, t: int) -> tuple[float, float, dict[str, float], float]:
        """``task``'s two, the other accuracies on task t (``TASK_AWARE`` where the stream is
        scored without the task id, then the method's ``eval_counts``) and the share of task
        t's test rows given its most predicted class (``COLLAPSE_SHARE``)."""
        counts = torch.zeros(self.scenario.num_classes, device=self.test.x.device)
        was_training = model.training
        model.eval()
        dev = self.test.x.device
        correct = torch.zeros((), device=dev)
        loss = torch.zeros((), device=dev, dtype=torch.float64)
        extra: dict[str, torch.Tensor] = {}
        if self.aware_mask is not None:
            extra[TASK_AWARE] = torch.zeros((), device=dev)
        given = t if self.scenario.task_aware else None
        # the task id changes the scores only through the method's own predict or per-task heads
        own = self.method.own_predict or isinstance(getattr(model, "head", None), TaskHeads)
        for x, y in self.test.batches(t, self.scenario, self.batch_size):
            scores = self.method.eval_predict(self.server, model, x, given)
            if self.class_mask is not None:
                scores = masked_logits(scores, self.class_mask[t])
            pred = scores.argmax(1)
            correct += (pred == y).sum()
            if self.aware_mask is not None:
                aware = self.method.eval_predict(self.server, model, x, t) if own else scores
                extra[TASK_AWARE] += (masked_logits(aware, self.aware_mask[t]).argmax(1) == y).sum()
            counts += torch.bincount(pred, minlength=len(counts))[: len(counts)]
            loss += F.cross_entropy(scores, y, reduction="sum").double()
            for k, v in self.method.eval_counts(self.server, model, x, y, t).items():
                extra[k] = extra.get(k, 0) + v
        model.train(was_training)
        n = max(len(self.test.rows[t]), 1)
        extras = {k: float(v) / n for k, v in extra.items()}
        return correct.item() / n, loss.item() / n, extras, float(counts.max()) / n

    def seen_accuracy(self, model: nn.Module, current: int) -> float:
        """Mean accuracy over tasks 0..current (a local model's score)."""
        accs = [self.task(model, t)[0] for t in range(current + 1)]
        return sum(accs) / len(accs)

    def global_model(
        self, model: nn.Module, current: int, num_classes: int, diagnostics: Sequence[str]
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """(metrics-row columns, per-task rows) of the global model ``model`` while the
        server trains task ``current``."""
        scored = [self.task_scores(model, t) for t in range(self.scenario.tasks)]
        res, extras = [(a, lo) for a, lo, _, _ in scored], [e for _, _, e, _ in scored]
        seen = res[: current + 1]
        row = {
            "global_model_test_acc": sum(a for a, _ in seen) / len(seen),
            "global_model_test_loss": sum(lo for _, lo in seen) / len(seen),
        }
        if self.scenario.tasks > 1:  # task streams: one-task runs keep their columns, bytes
            row[TOP_SHARE] = scored[current][3]
        if "classwise_accuracy" in diagnostics:  # the raw test set, every class
            # scored as the accuracy is, without the task id (it scored by the active head alone
            # before 2026-12-06: per-task heads' rows of other tasks by the wrong one)
            predict = lambda x: self.method.eval_predict(self.server, model, x, None)  # noqa: E731
            accs = classwise_accuracy(model, self.test.x, self.test.y, num_classes, self.batch_size, predict)
            row.update({f"global_model_test_acc_class{c}": a for c, a in enumerate(accs)})
        tasks = [
            {"current_task": current, "task": t, "accuracy": a, "loss": lo, **extras[t]}
            for t, (a, lo) in enumerate(res)
        ]
        return row, tasks

    @property
    def plain(self) -> bool:
        """One task, no mask, the default predict: a local model's score is its accuracy on
        the whole test set, which ``vectorized.evaluate_stacked`` takes for all at once."""
        return (
            self.scenario.tasks == 1 and self.class_mask is None
            and not self.method.own_predict and not self.scenario.transforms
        )  # fmt: skip
