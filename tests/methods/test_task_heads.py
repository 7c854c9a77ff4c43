"""Per-task heads (``scenario.heads: per_task``) under every registered method that accepts
them: a split stream of 3 tasks runs to its end, and its results do not depend on when the
global model is evaluated. An evaluation sets the server model's task; until 2026-12-06 the
server model kept the task of the last evaluation (or task 0 after a resume) between
evaluations, so FedAvgM's server momentum, FedNova's normalisation and FedDF's, FedET's and
FedProj's distillation used the previous task's head with ``eval_every`` > 1 (found in
review), a resumed run had task 0's head active until its next evaluation, and SCAFFOLD
crashed (its control variate over every head)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fedforget.data.scenario import resolve_scenario
from fedforget.engine import Simulation
from fedforget.methods import METHODS, make_params
from fedforget.partition import PartitionSpec
from fedforget.utils import FedForgetError

from .conftest import PUBLIC, QUICK_PARAMS, SPLIT, TINY_VIT, needs_model, same, strip
from .test_concurrent_clients import TINY_TARGET

CPU = torch.device("cpu")
HEADS = {**SPLIT, "rounds_per_task": 2, "heads": "per_task"}  # a task end evaluates: 2 rounds a task
PARAMS = {**QUICK_PARAMS, "target": TINY_TARGET, "target_lode": TINY_TARGET, "lander": {**TINY_TARGET, "warmup": 0},
          "fedprotip": {"tip": "sample"}}  # fmt: skip


class Crash(Exception):
    pass


def _crash_at(rnd: int):
    def on_row(row):
        if row["round"] == rnd:
            raise Crash

    return on_row


def _accepts_task_heads(name: str) -> bool:
    try:
        METHODS.get(name).check_scenario(resolve_scenario(HEADS, 10, (64,), "scenario"), make_params(name, PARAMS.get(name) or {}))
    except FedForgetError:
        return False
    return True


ACCEPTING = [n for n in METHODS.names() if _accepts_task_heads(n)]


def test_the_methods_whose_state_is_laid_out_by_the_trained_parameters_refuse_task_heads():
    """SCAFFOLD's control variates and FedDyn's gradient state are one vector over the trained
    parameters, which per-task heads change at every task; refused, naming the key."""
    assert {"scaffold", "feddyn"}.isdisjoint(ACCEPTING) and "fedavg" in ACCEPTING
    scenario = resolve_scenario(HEADS, 10, (64,), "scenario")
    with pytest.raises(FedForgetError, match=r"method 'scaffold' is not defined for per-task heads.*allowed: scenario.heads shared"):
        METHODS.get("scaffold").check_scenario(scenario, make_params("scaffold", {}))
    with pytest.raises(FedForgetError, match=r"method 'feddyn' is not defined for per-task heads"):
        METHODS.get("fedsol").check_scenario(scenario, make_params("fedsol", {"base": "feddyn", "proximal": "base"}))


@pytest.mark.parametrize("method", ACCEPTING)
def test_task_heads_results_do_not_depend_on_when_the_model_is_evaluated(make_run_config, digits_public_root, method):
    """3 tasks of 2 rounds, 3 of 4 clients a round: evaluated every round, or at the task
    ends only, the same global weights (bit for bit) and the same last metrics row; and the
    second resumed inside a task equals it uninterrupted."""
    params = PARAMS.get(method)
    kw = {"model": "vit", "model_options": TINY_VIT} if needs_model(method, params) == "vit" else {"model": "mlp"}
    rc = make_run_config(
        dataset="digits", method=method, params=params, public=PUBLIC, scenario=HEADS,
        partition=PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=10, seed=0),
        rounds=6, sample_rate=0.75, batch_size=32, eval_local_models=False, **kw,
    )  # fmt: skip
    rc = replace(rc, data_dir=str(digits_public_root))
    runs = []
    for every in (1, 6):
        sim = Simulation(replace(rc, train=replace(rc.train, eval_every=every)), device=CPU)
        status, rows, msg = sim.run(progress=False)
        assert status == "completed", msg
        runs.append((sim, rows))
    (a, rows_a), (b, rows_b) = runs
    # the second resumed after round 3 (inside task 1): before 2026-12-06 its server model
    # then had task 0's head active and every head trainable
    saved = []
    with pytest.raises(Crash):
        Simulation(b.cfg, device=CPU).run(progress=False, on_row=_crash_at(3), on_checkpoint=saved.append)
    resumed = Simulation(b.cfg, device=CPU)
    status, rows_c, msg = resumed.run(progress=False, resume=saved[-1])
    assert status == "completed" and saved[-1]["round"] == 3, msg
    assert strip(rows_c) == strip(rows_b) and same(resumed.global_params, b.global_params)
    evaluated = [[r["round"] for r in rows if "global_model_test_acc" in r] for rows in (rows_a, rows_b)]
    assert evaluated == [[0, 1, 2, 3, 4, 5, 6], [0, 2, 4, 6]]  # not vacuous: one evaluated inside tasks
    assert strip(rows_a)[-1] == strip(rows_b)[-1]
    assert same(a.global_params, b.global_params)
