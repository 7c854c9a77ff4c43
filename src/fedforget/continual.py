"""Continual-learning metrics from a run's per-task accuracies (its ``tasks.csv``).

A continual run evaluates the global model on every task of its scenario after every
evaluated round (``fedforget.evaluation``): rows ``round, current_task, task, accuracy,
loss``, tasks 0-based, accuracy in [0, 1], round 0 the initial model. Task t (0-based)
trains in rounds t*R+1 .. (t+1)*R, so its last round is (t+1)*R [P, fedgp.md Sec. 5: R
rounds per task].

- The accuracy matrix a[t][i] is the accuracy on task i at the last round of task t [P,
  fedgp.md Sec. 5, a_{t,i}; fedprotip.md eq. 16, acc_i^(t)]; NaN where that round has no
  row (a diverged run stops early; a round skipped by ``train.eval_every``) [D].
- b[i] is the accuracy on task i of the initial model (round 0), the reference of forward
  transfer [P, Lopez-Paz & Ranzato 2017, b_i].
- ``continual_metrics``: ACC, Fgt_T, FT, BWT, FWT as fractions (the tables show %). Each is
  written once, in the papers' 1-based notation in its docstring; the code is 0-based. A
  NaN entry the metric reads makes the metric NaN (no silent skipping) [D].

Pure numpy: the runner calls ``accuracy_matrix_rows`` for a run's ``accuracy_matrix.csv``,
the aggregation the rest, neither needs torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .utils import FedForgetError

# the metrics column of a task stream's evaluations (``fedforget.evaluation``): the share of
# the current task's test rows that the global model gives its most predicted class. A model
# that predicts one class for nearly all of a task of several classes has collapsed (issue 36:
# TARGET at 10x its code's learning rate) [D]; the tables mark a cell with a run that reached
# COLLAPSE_SHARE (``fedforget.aggregate``). Where a task has one class (classes_per_task 1) no
# run counts.
TOP_SHARE = "global_model_test_top_pred_share"
COLLAPSE_SHARE = 0.95

TASK_COLUMNS = ("round", "current_task", "task", "accuracy", "loss")  # tasks.csv
# tasks.csv's task-aware accuracy of every method on a stream evaluated without the task id
# (``fedforget.evaluation``); runs.csv's acc_task_aware / ft_task_aware
TASK_AWARE = "task_aware"
MATRIX_COLUMNS = ("after_task", "task", "accuracy")  # accuracy_matrix.csv
# runs.csv's Acc_t of a completed continual run, t = 1..T (``acc_after_each_task``; FedGP
# Fig. 5's quoted Acc_5 is compared with avg_acc_after_task_5), and of each other inference
# mode of tasks.csv, avg_acc_after_task_<t>_<mode> (FedProTIP Table 14: its task-identity
# accuracy after each task); not acc_*: those are the metrics of a method's other modes
ACC_AFTER_TASK = "avg_acc_after_task_"
METRICS = ("acc", "fgt", "ft", "bwt", "fwt")  # continual_metrics' keys
# the summary files of an experiment with continual runs only (rule aggregate_continual's,
# written by fedforget.aggregate; here so that the workflow's parse imports no torch)
CONTINUAL_OUTPUTS = (
    "tasks.parquet", "accuracy_matrix.csv", "continual.csv", "continual.md", "continual.html",
)  # fmt: skip


def scenario_shape(
    scenario: Mapping[str, Any] | None, rounds: int | None = None
) -> tuple[int, int] | None:
    """(tasks T, rounds_per_task R) of a resolved scenario (``config.dataset.scenario`` of a
    run.json), or None for a one-task run (no scenario, or ``tasks: 1``). R defaults to the
    run's ``train.rounds`` (``rounds``) as in ``Scenario.build`` [C]."""
    if not scenario or int(scenario.get("tasks") or 1) <= 1:
        return None
    tasks = int(scenario["tasks"])
    r = scenario.get("rounds_per_task") or rounds
    if r is None:
        raise FedForgetError(
            "dataset.scenario.rounds_per_task is not set and train.rounds is unknown; allowed: an integer >= 1"
        )
    return tasks, int(r)


def _check_shape(tasks: int, rounds_per_task: int | None = None) -> None:
    if not isinstance(tasks, (int, np.integer)) or isinstance(tasks, bool) or tasks < 1:
        raise FedForgetError(f"tasks={tasks!r}; allowed: an integer >= 1")
    if rounds_per_task is not None and (
        not isinstance(rounds_per_task, (int, np.integer))
        or isinstance(rounds_per_task, bool)
        or rounds_per_task < 1
    ):
        raise FedForgetError(f"rounds_per_task={rounds_per_task!r}; allowed: an integer >= 1")


def _records(task_rows: Any) -> list[Mapping[str, Any]]:
    """Rows as mappings, from a DataFrame (tasks.csv read by pandas) or an iterable of dicts."""
    if hasattr(task_rows, "to_dict") and hasattr(task_rows, "columns"):
        missing = [c for c in ("round", "task", "accuracy") if c not in task_rows.columns]
        if missing:
            raise FedForgetError(
                f"task rows lack column(s) {missing}; have {list(task_rows.columns)}; tasks.csv has {list(TASK_COLUMNS)}"
            )
        return task_rows.to_dict("records")
    return list(task_rows)


def _accuracy(v: Any) -> float:
    """A row's accuracy as a float; an empty cell (None, '', NaN) is NaN."""
    if v is None or v == "":
        return math.nan
    return float(v)


def _by_round(task_rows: Any, tasks: int) -> dict[int, dict[int, float]]:
    """{round: {task: accuracy}}; a task outside 0..T-1 or a repeated (round, task) is an
    error (the rows are not this scenario's)."""
    out: dict[int, dict[int, float]] = {}
    for r in _records(task_rows):
        try:
            rnd, task = int(r["round"]), int(r["task"])
        except KeyError as e:
            raise FedForgetError(
                f"task row {dict(r)} lacks column {e}; tasks.csv has {list(TASK_COLUMNS)}"
            ) from None
        if not 0 <= task < tasks:
            raise FedForgetError(
                f"task row of round {rnd} has task={task}; allowed: 0..{tasks - 1} (the scenario has {tasks} tasks)"
            )
        seen = out.setdefault(rnd, {})
        if task in seen:
            raise FedForgetError(
                f"task rows repeat round {rnd}, task {task}; allowed: one row per (round, task)"
            )
        seen[task] = _accuracy(r["accuracy"])
    return out


def accuracy_matrix(task_rows: Any, tasks: int, rounds_per_task: int) -> np.ndarray:
    """a [T, T]: a[t][i] = accuracy on task i at round (t+1)*R, the last round of task t
    (0-based); NaN where that round or task has no row (a run that stopped early).
    ``task_rows``: tasks.csv rows (a DataFrame or dicts with round, task, accuracy)."""
    _check_shape(tasks, rounds_per_task)
    by_round = _by_round(task_rows, tasks)
    a = np.full((tasks, tasks), np.nan)
    for t in range(tasks):
        for i, acc in by_round.get((t + 1) * rounds_per_task, {}).items():
            a[t, i] = acc
    return a


def initial_accuracy(task_rows: Any, tasks: int) -> np.ndarray:
    """b [T]: accuracy on each task of the initial model (round 0 rows), the reference of
    forward transfer [P, Lopez-Paz & Ranzato 2017]; NaN where missing."""
    _check_shape(tasks)
    b = np.full(tasks, np.nan)
    for i, acc in _by_round(task_rows, tasks).get(0, {}).items():
        b[i] = acc
    return b


def accuracy_matrix_rows(task_rows: Any, tasks: int, rounds_per_task: int) -> list[dict[str, Any]]:
    """accuracy_matrix.csv rows: ``after_task, task, accuracy`` for every (t, i), T*T rows
    in that order (after_task-major), accuracy NaN where missing. Plain Python values (the
    runner's CSV writer formats floats with repr)."""
    a = accuracy_matrix(task_rows, tasks, rounds_per_task)
    return [
        {"after_task": t, "task": i, "accuracy": float(a[t, i])}
        for t in range(tasks)
        for i in range(tasks)
    ]


def acc_after_each_task(a: Any) -> np.ndarray:
    """[T]: Acc_t = 1/t sum_{i=1}^t a_{t,i} [P, fedgp.md Sec. 5], the mean accuracy over the
    tasks learned so far after task t (0-based here: mean of a[t][0..t])."""
    a = _matrix(a)
    return np.array([a[t, : t + 1].mean() for t in range(len(a))])


def fgt_after_each_task(a: Any) -> np.ndarray:
    """[T]: Fgt_t, the average forgetting after task t [P, fedgp.md Sec. 5 and Fig. 5]: Fgt_T
    of ``continual_metrics`` on the matrix of the first t tasks (0-based: a[:t+1, :t+1]); NaN
    after the first task (nothing learned before it)."""
    a = _matrix(a)
    return np.array([math.nan] + [continual_metrics(a[: t + 1, : t + 1])["fgt"] for t in range(1, len(a))])


def _matrix(a: Any) -> np.ndarray:
    a = np.asarray(a, dtype=float)
    if a.ndim != 2 or a.shape[0] != a.shape[1] or a.shape[0] < 1:
        raise FedForgetError(
            f"accuracy matrix of shape {list(a.shape)}; allowed: [T, T] with T >= 1"
        )
    return a


def continual_metrics(a: Any, b: Any = None) -> dict[str, float]:
    """ACC, Fgt_T, FT, BWT and FWT (fractions) of the accuracy matrix ``a`` [T, T] and the
    initial accuracies ``b`` [T] (FWT is NaN without ``b``). With T = 1 only ``acc`` is
    defined; the others are NaN. In the papers' 1-based notation, a_{j,i} = a[j-1][i-1]:

    - ``acc``, ACC = 1/T sum_{i=1}^T a_{T,i} [P, fedgp.md Sec. 5 Acc_T; fedprotip.md eq. 16
      ACC]: mean accuracy over all tasks after the last.
    - ``fgt``, Fgt_T = 1/(T-1) sum_{i=1}^{T-1} (max_{j=i..T} a_{j,i} - a_{T,i}) [C: FedGP's
      code (Fed-A-GEM booster.py, mammoth's forgetting): each task's best accuracy from its
      own training through the last task, so every term is >= 0; the numbers FedGP's tables
      print]. The paper's text (fedgp.md Sec. 5, after Chaudhry et al. 2018) writes the max
      over j = 1..T-1: every evaluation before T, those before task i was trained included,
      the last excluded, so a task that ends above its earlier best gives a negative term;
      the two differ only there and where a task scored higher before its training than at
      any point after it.
    - ``ft``, FT = 1/T sum_{t=1}^{T-1} (max_{i in t..T-1} acc_t^(i) - acc_t^(T)) [P,
      fedprotip.md eq. 16]: the max only from task t's own training on, and 1/T over T-1
      terms, as the paper writes; so FT <= (T-1)/T Fgt_T, equal up to that factor when no
      task ends above its best before the last task.
    - ``bwt``, BWT = 1/(T-1) sum_{i=1}^{T-1} (a_{T,i} - a_{i,i}) [P, Lopez-Paz & Ranzato
      2017; fedgp.md App. A.7]: negative is forgetting.
    - ``fwt``, FWT = 1/(T-1) sum_{i=2}^{T} (a_{i-1,i} - b_i) [P, Lopez-Paz & Ranzato 2017;
      fedgp.md App. A.7]: accuracy on task i just before training it, over the initial
      model's.
    """
    a = _matrix(a)
    n = len(a)
    out = dict.fromkeys(METRICS, math.nan)
    out["acc"] = float(a[n - 1].mean())
    if n == 1:
        return out
    last, before = a[n - 1], a[: n - 1]  # a_{T,.}; rows j = 1..T-1
    out["fgt"] = float(np.mean([a[i:, i].max() - last[i] for i in range(n - 1)]))
    out["ft"] = float(np.sum([before[t:, t].max() - last[t] for t in range(n - 1)]) / n)
    out["bwt"] = float(np.mean([last[i] - a[i, i] for i in range(n - 1)]))
    if b is not None:
        b = np.asarray(b, dtype=float)
        if b.shape != (n,):
            raise FedForgetError(
                f"initial accuracies of shape {list(b.shape)}; allowed: [{n}] (one per task)"
            )
        out["fwt"] = float(np.mean([a[i - 1, i] - b[i] for i in range(1, n)]))
    return out
