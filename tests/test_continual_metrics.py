"""Continual-learning metrics (fedforget.continual): each metric against a hand-computed
accuracy matrix, FedGP's Fgt_T and FedProTIP's FT on one matrix, the one-task case, and
the matrix built from tasks.csv rows (a run that stopped early: NaN from there)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from fedforget.continual import (
    acc_after_each_task,
    accuracy_matrix,
    accuracy_matrix_rows,
    continual_metrics,
    fgt_after_each_task,
    initial_accuracy,
    scenario_shape,
)
from fedforget.utils import FedForgetError

# a[t][i]: accuracy on task i (column) after training task t (row); T = 3
A = np.array([
    [0.9, 0.1, 0.2],
    [0.6, 0.8, 0.3],
    [0.5, 0.7, 0.9],
])  # fmt: skip
B = np.array([0.1, 0.05, 0.1])  # the initial model's accuracy per task


def test_acc_is_the_mean_of_the_last_row():
    # (0.5 + 0.7 + 0.9) / 3 = 2.1 / 3
    assert continual_metrics(A, B)["acc"] == pytest.approx(0.7)


def test_fedgp_forgetting_hand_computed():
    # Fgt_T = 1/(T-1) sum_{i=1}^{T-1} (max_{j=i..T} a_{j,i} - a_{T,i})   (1-based; FedGP's code)
    # i = 1: max(a11, a21, a31) - a31 = max(0.9, 0.6, 0.5) - 0.5 = 0.4
    # i = 2: max(a22, a32) - a32 = max(0.8, 0.7) - 0.7 = 0.1
    # Fgt_3 = (0.4 + 0.1) / 2 = 0.25
    assert continual_metrics(A, B)["fgt"] == pytest.approx(0.25)


def test_fedprotip_forgetting_hand_computed():
    # FT = 1/T sum_{t=1}^{T-1} (max_{i in t..T-1} acc_t^(i) - acc_t^(T))   (1-based)
    # t = 1: max(acc_1^(1), acc_1^(2)) - acc_1^(3) = max(0.9, 0.6) - 0.5 = 0.4
    # t = 2: max(acc_2^(2)) - acc_2^(3) = 0.8 - 0.7 = 0.1
    # FT = (0.4 + 0.1) / 3 = 0.1667 (1/T over T-1 terms, as eq. 16 writes)
    assert continual_metrics(A, B)["ft"] == pytest.approx(0.5 / 3)


def test_bwt_hand_computed():
    # BWT = 1/(T-1) sum_{i=1}^{T-1} (a_{T,i} - a_{i,i}) = ((0.5 - 0.9) + (0.7 - 0.8)) / 2 = -0.25
    assert continual_metrics(A, B)["bwt"] == pytest.approx(-0.25)


def test_fwt_hand_computed_and_nan_without_initial_accuracy():
    # FWT = 1/(T-1) sum_{i=2}^{T} (a_{i-1,i} - b_i) = ((0.1 - 0.05) + (0.3 - 0.1)) / 2 = 0.125
    assert continual_metrics(A, B)["fwt"] == pytest.approx(0.125)
    assert math.isnan(continual_metrics(A)["fwt"])


def test_fgt_and_ft_differ_where_a_task_ends_above_its_best():
    # a_{3,2} = 0.85: task 2 ends above its best before the last task. Fgt_T's max runs from
    # the task's own training through the last (FedGP's code: every term >= 0), FT's through
    # T-1 (eq. 16: a term may be negative); a score before the task's training counts in neither
    a = A.copy()
    a[2, 1] = 0.85
    a[0, 1] = 0.95  # task 2 before its training: no effect
    m = continual_metrics(a)
    # Fgt: i = 1: 0.9 - 0.5 = 0.4;  i = 2: max(0.8, 0.85) - 0.85 = 0;  (0.4 + 0) / 2 = 0.2
    assert m["fgt"] == pytest.approx(0.2)
    # FT: t = 1: 0.9 - 0.5 = 0.4;  t = 2: 0.8 - 0.85 = -0.05;  (0.4 - 0.05) / 3
    assert m["ft"] == pytest.approx(0.35 / 3)
    # and on A they differ by the averaging alone: FT = (T-1)/T Fgt_T
    plain = continual_metrics(A)
    assert plain["ft"] == pytest.approx(plain["fgt"] * 2 / 3)


def test_one_task_only_acc_is_defined():
    m = continual_metrics([[0.42]], [0.1])
    assert m["acc"] == pytest.approx(0.42)
    assert set(m) == {"acc", "fgt", "ft", "bwt", "fwt"}
    assert all(math.isnan(m[k]) for k in ("fgt", "ft", "bwt", "fwt"))


def test_metrics_are_plain_floats_and_nan_propagates():
    m = continual_metrics(A, B)
    assert all(type(v) is float for v in m.values())
    a = A.copy()
    a[1, 0] = np.nan  # a missing evaluation: the metrics that read it are NaN, not skipped
    m = continual_metrics(a, B)
    assert math.isnan(m["fgt"]) and math.isnan(m["ft"])
    assert m["acc"] == pytest.approx(0.7) and m["bwt"] == pytest.approx(-0.25)


def test_bad_shapes_are_rejected():
    with pytest.raises(
        FedForgetError, match=r"accuracy matrix of shape \[2, 3\]; allowed: \[T, T\]"
    ):
        continual_metrics(np.zeros((2, 3)))
    with pytest.raises(FedForgetError, match=r"initial accuracies of shape \[2\]; allowed: \[3\]"):
        continual_metrics(A, [0.1, 0.2])


def test_acc_after_each_task():
    # Acc_t = 1/t sum_{i<=t} a_{t,i}: 0.9;  (0.6 + 0.8) / 2 = 0.7;  (0.5 + 0.7 + 0.9) / 3 = 0.7
    np.testing.assert_allclose(acc_after_each_task(A), [0.9, 0.7, 0.7])


def test_fgt_after_each_task():
    # Fgt_t (FedGP's Fig. 5): Fgt of the first t tasks' matrix; none after the first task
    # t = 2: max(a11) - a21 = 0.9 - 0.6 = 0.3 (1 term);  t = 3: 0.25 (as Fgt_T above)
    out = fgt_after_each_task(A)
    assert math.isnan(out[0])
    np.testing.assert_allclose(out[1:], [0.3, 0.25])


# ----------------------------------------------------------------------------- from tasks.csv rows

T, R = 3, 2


def _rows(last_round: int = T * R) -> list[dict]:
    """tasks.csv rows of a run with T tasks x R rounds whose accuracy on task i at round r
    is A[t][i] at the last round t of each task, r/100 + i/1000 elsewhere, B[i] at round 0."""
    rows = []
    for r in range(last_round + 1):
        cur = min(max(r - 1, 0) // R, T - 1)
        for i in range(T):
            if r == 0:
                acc = B[i]
            elif r % R == 0:
                acc = A[r // R - 1, i]
            else:
                acc = r / 100 + i / 1000
            rows.append({"round": r, "current_task": cur, "task": i, "accuracy": acc, "loss": 1.0})
    return rows


def test_matrix_from_task_rows_dicts_and_dataframe():
    np.testing.assert_array_equal(accuracy_matrix(_rows(), T, R), A)
    df = pd.DataFrame(_rows())
    np.testing.assert_array_equal(accuracy_matrix(df, T, R), A)
    np.testing.assert_array_equal(initial_accuracy(df, T), B)
    # the rows give the metrics of the hand-computed matrix
    assert continual_metrics(
        accuracy_matrix(df, T, R), initial_accuracy(df, T)
    ) == continual_metrics(A, B)


def test_run_that_stopped_early_has_nan_from_there():
    # diverged in round 5 (of 6): rows up to round 4 = the last round of task 2 (1-based)
    a = accuracy_matrix(_rows(last_round=5), T, R)
    np.testing.assert_array_equal(a[:2], A[:2])
    assert np.isnan(a[2]).all()
    m = continual_metrics(a, B)
    assert all(math.isnan(m[k]) for k in ("acc", "fgt", "ft", "bwt"))
    assert m["fwt"] == pytest.approx(0.125)  # reads rows 1..T-1 only
    # no rows at all: all NaN (a run that failed before its first evaluation)
    assert np.isnan(accuracy_matrix([], T, R)).all() and np.isnan(initial_accuracy([], T)).all()


def test_empty_accuracy_cells_are_nan():
    rows = _rows()
    rows[-1]["accuracy"] = ""  # tasks.csv writes NaN as an empty field
    assert math.isnan(accuracy_matrix(rows, T, R)[2, 2])


def test_rows_of_another_scenario_are_rejected():
    with pytest.raises(FedForgetError, match=r"task=2; allowed: 0..1"):
        accuracy_matrix(_rows(), 2, R)
    with pytest.raises(FedForgetError, match=r"repeat round 1, task 0"):
        accuracy_matrix(_rows() + [_rows()[3]], T, R)
    with pytest.raises(FedForgetError, match=r"rounds_per_task=0; allowed: an integer >= 1"):
        accuracy_matrix(_rows(), T, 0)
    with pytest.raises(FedForgetError, match=r"lack column\(s\) \['accuracy'\]"):
        accuracy_matrix(pd.DataFrame(_rows()).drop(columns="accuracy"), T, R)


def test_accuracy_matrix_rows_layout():
    rows = accuracy_matrix_rows(_rows(last_round=5), T, R)
    assert len(rows) == T * T
    assert [(r["after_task"], r["task"]) for r in rows] == [
        (t, i) for t in range(T) for i in range(T)
    ]
    assert all(list(r) == ["after_task", "task", "accuracy"] for r in rows)
    assert [r["accuracy"] for r in rows[:6]] == A[:2].ravel().tolist()
    assert all(math.isnan(r["accuracy"]) for r in rows[6:])
    # plain Python values: the runner's CSV writer formats floats with repr
    assert all(type(r["after_task"]) is int and type(r["accuracy"]) is float for r in rows)
    assert repr(rows[0]["accuracy"]) == "0.9"


def test_scenario_shape():
    assert scenario_shape(None, 10) is None
    assert scenario_shape({"kind": "none", "tasks": 1}, 10) is None
    assert scenario_shape({"kind": "split", "tasks": 5, "rounds_per_task": 4}, 20) == (5, 4)
    assert scenario_shape({"kind": "split", "tasks": 5, "rounds_per_task": None}, 20) == (5, 20)
