"""Which training rows each task of a stream holds, without torch: what a per-task partition
(``fedforget.partition``, ``per_task``) is drawn from, and a split's classes per task, which
``scenario.Scenario`` also reads (one home for the class order). Kept apart from
``scenario`` so that loading a validated config (``fedforget.parsecache``) imports no torch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..utils import FedForgetError, seed_sequence

SCENARIO_STREAM = 0x5C3A  # numpy SeedSequence stream tag of scenario randomness

# the scenario keys that decide which rows each task holds, per kind with rows of their own
# (``task_rows``): a per-task partition is keyed by them
TASK_ROW_KEYS = {"split": ("kind", "tasks", "classes_per_task", "class_order", "seed"), "domains": ("kind", "tasks")}


def scenario_rng(seed: int) -> np.random.Generator:
    """The scenario's random stream (class order, angles, permutations), keyed by its seed."""
    return np.random.default_rng(seed_sequence(int(seed), SCENARIO_STREAM))


def covered_classes(tasks: int, classes_per_task: int, overlap: int = 0) -> int:
    """How many classes a split's tasks hold: c + (T - 1)(c - k) with k classes shared by
    neighbouring tasks (T x c without)."""
    return int(classes_per_task) + (int(tasks) - 1) * (int(classes_per_task) - int(overlap))


def split_classes(tasks: int, classes_per_task: int, class_order: str, num_classes: int,
                  rng: np.random.Generator, overlap: int = 0) -> list[list[int]]:  # fmt: skip
    """A split's classes of each task: ``class_order`` natural (0, 1, ...) or shuffled (a
    permutation drawn from ``rng``, the scenario's stream), cut into ``classes_per_task``;
    with ``overlap`` k, task t starts k classes before task t-1 ends (windows of c classes
    every c - k: neighbouring tasks share k)."""
    order = list(range(num_classes))
    if class_order == "shuffled":
        order = [int(c) for c in rng.permutation(num_classes)]
    c, step = int(classes_per_task), int(classes_per_task) - int(overlap)
    return [sorted(order[i * step : i * step + c]) for i in range(int(tasks))]


def task_rows(s: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The part of a resolved scenario that decides which training rows each task holds
    (split: the classes of each task; domains: the domain order), None where every task
    holds every row (none, rotated, permuted): a per-task partition is drawn from it."""
    if not s or s["kind"] not in TASK_ROW_KEYS:
        return None
    out = {k: s[k] for k in TASK_ROW_KEYS[s["kind"]]}
    if s.get("class_overlap"):  # only where set: partitions of disjoint splits keep their keys
        out["class_overlap"] = int(s["class_overlap"])
    return out


def row_tasks(
    rows: Mapping[str, Any], y: np.ndarray, num_classes: int, domain: np.ndarray | None = None
) -> np.ndarray:
    """int [N]: each row's task under ``rows`` (``task_rows``), -1 for a row in no task (a
    class left out of a split); for kind domains, a row's task is its ``domain``. A class
    shared by neighbouring tasks (``class_overlap``) counts in the first that holds it [D]:
    a per-task partition draws its rows there, and the next task's clients hold them as drawn."""
    out = np.full(len(y), -1, dtype=np.int64)
    if rows["kind"] == "domains":
        if domain is None or len(domain) != len(y):
            raise FedForgetError(
                "a per-task partition of a domains stream needs each row's domain: the prepared dataset's "
                "meta.json has no 'domains' record (prepared by an older fedforget); delete the prepared folder "
                "to prepare it again"
            )
        out[:] = np.asarray(domain)
        return out
    classes = split_classes(rows["tasks"], rows["classes_per_task"], rows["class_order"], num_classes,
                            scenario_rng(rows["seed"]), rows.get("class_overlap", 0))  # fmt: skip
    for t, cls in reversed(list(enumerate(classes))):  # the first task holding a class wins
        out[np.isin(y, cls)] = t
    return out
