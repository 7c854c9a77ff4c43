"""Optional per-round analyses (train.diagnostics) and local-model snapshots."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fedforget.engine import Simulation
from fedforget.methods.base import flatten_state
from fedforget.metrics import classwise_accuracy, layer_lambda
from fedforget.parse import parse_config
from fedforget.runner import run_training
from fedforget.utils import FedForgetError


def test_weight_divergence_matches_hand_computation(make_run_config):
    cfg = make_run_config(rounds=2, diagnostics=("weight_divergence",), save_client_models=(2,))
    sim = Simulation(cfg)
    _, rows, _ = sim.run(progress=False)
    snap = sim.snapshots[2]
    g = flatten_state(snap["global_before"]).double()
    w = [flatten_state(p).double() for p in snap["clients"].values()]
    to_global = sum((wk - g).norm().item() for wk in w) / len(w)
    pairs = [(a - b).norm().item() for a, b in itertools.combinations(w, 2)]
    assert rows[2]["local_models_dist_to_global_mean"] == pytest.approx(to_global, rel=1e-9)
    assert rows[2]["local_models_pairwise_dist_mean"] == pytest.approx(sum(pairs) / len(pairs), rel=1e-9)
    assert rows[2]["local_models_dist_to_global_mean"] > 0
    # the snapshot's global_after is the model the round ended with
    assert all(torch.equal(snap["global_after"][k], sim.global_params[k].to(snap["global_after"][k].device))
               for k in sim.global_params)  # fmt: skip (snapshots live on the CPU)
    assert not all(torch.equal(snap["global_before"][k], snap["global_after"][k]) for k in sim.global_params)


def test_layer_lambda_by_hand():
    """FedSOL's Eq. 7 lambda per tensor, averaged over its elements, then over the clients."""
    g = {"w": torch.zeros(4), "b": torch.ones(2)}
    moved = {"w": torch.tensor([3.0, -4.0, 0.0, 0.0]), "b": torch.tensor([1.0, 3.0])}  # |d| = 3,4,0,0 and 0,2
    still = {"w": torch.zeros(4), "b": torch.ones(2)}  # not moved: lambda 0
    out = layer_lambda(g, [moved, still], ["w", "b"])
    assert out == {"layer_lambda:w": pytest.approx((0.6 + 0.8) / 4 / 2), "layer_lambda:b": pytest.approx((0 + 1.0) / 2 / 2)}


def test_layer_lambda_matches_the_saved_local_models(make_run_config):
    cfg = make_run_config(rounds=2, diagnostics=("layer_lambda",), save_client_models=(2,))
    sim = Simulation(cfg)
    _, rows, _ = sim.run(progress=False)
    snap = sim.snapshots[2]
    names = [n for n, p in sim.model.named_parameters() if p.requires_grad]
    assert {k for k in rows[2] if k.startswith("layer_lambda:")} == {f"layer_lambda:{n}" for n in names}
    for n in names:
        per_client = []
        for local in snap["clients"].values():
            d = (local[n].double() - snap["global_before"][n].double()).abs()
            per_client.append(float((d / d.norm()).mean()))
            # the mean of a unit vector's n entries lies in [1/n, 1/sqrt(n)]
            assert 1 / d.numel() - 1e-12 <= per_client[-1] <= d.numel() ** -0.5 + 1e-12
        assert rows[2][f"layer_lambda:{n}"] == pytest.approx(sum(per_client) / len(per_client), rel=1e-9)


def test_one_sampled_client_has_undefined_pairwise_divergence(make_run_config):
    cfg = make_run_config(rounds=1, sample_rate=0.25, diagnostics=("weight_divergence",))
    _, rows, _ = Simulation(cfg).run(progress=False)
    assert math.isnan(rows[1]["local_models_pairwise_dist_mean"])
    assert rows[1]["local_models_dist_to_global_mean"] > 0


def test_classwise_accuracy_columns_average_to_overall(make_run_config):
    cfg = make_run_config(rounds=2, diagnostics=("classwise_accuracy",))
    sim = Simulation(cfg)
    _, rows, _ = sim.run(progress=False)
    per_class = [rows[2][f"global_model_test_acc_class{c}"] for c in range(sim.num_classes)]
    counts = torch.bincount(sim.evaluator.test.y, minlength=sim.num_classes).tolist()
    overall = sum(a * n for a, n in zip(per_class, counts)) / sum(counts)
    assert overall == pytest.approx(rows[2]["global_model_test_acc"], abs=1e-12)


def test_classwise_accuracy_scores_per_task_heads_as_the_accuracy_does(make_run_config):
    """Per-task heads: each task's classes, weighted by their test rows, average to that
    task's accuracy (every class scored by its newest head, the method's prediction); it
    scored by the active head alone before 2026-12-06. The later heads silenced (logits -100),
    so that task 0's classes are predicted (the run itself forgets them)."""
    scenario = {"kind": "split", "tasks": 3, "classes_per_task": 2, "rounds_per_task": 1, "leftover_classes": "drop",
                "heads": "per_task"}  # fmt: skip
    sim = Simulation(make_run_config(dataset="digits", scenario=scenario, rounds=3))
    sim.run(progress=False)
    model = sim.model_with(sim.global_params)
    with torch.no_grad():
        for head in model.head.heads[1:]:
            head.weight.zero_()
            head.bias.fill_(-100.0)
    row, tasks = sim.evaluator.global_model(model, 2, sim.num_classes, ("classwise_accuracy",))
    counts = torch.bincount(sim.evaluator.test.y, minlength=sim.num_classes).tolist()
    for task in tasks:
        classes = sim.scenario.task_classes[task["task"]]
        got = sum(row[f"global_model_test_acc_class{c}"] * counts[c] for c in classes)
        assert got / sum(counts[c] for c in classes) == pytest.approx(task["accuracy"], abs=1e-12), task["task"]
    assert tasks[0]["accuracy"] > 0.5  # not vacuous: the first head scores


def test_classwise_accuracy_hand_example():
    class Fixed(torch.nn.Module):
        def forward(self, x):
            return x

    x = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [1.0, 0, 0], [0, 0, 1.0]])
    y = torch.tensor([0, 0, 1, 2])
    acc = classwise_accuracy(Fixed(), x, y, num_classes=4)
    assert acc[:3] == [0.5, 0.0, 1.0] and math.isnan(acc[3])


def test_no_diagnostics_no_extra_columns(make_run_config):
    _, rows, _ = Simulation(make_run_config(rounds=1)).run(progress=False)
    assert not any(k.startswith(("local_models_dist", "local_models_pairwise", "global_model_test_acc_class")) for k in rows[1])


def test_snapshots_written_by_runner(make_run_config, tmp_path):
    cfg = make_run_config(rounds=3, save_client_models=(1, 3))
    run_training(cfg, tmp_path / "run", progress=False)
    files = sorted(p.name for p in (tmp_path / "run" / "snapshots").iterdir())
    assert files == ["round0001.pt", "round0003.pt"]
    snap = torch.load(tmp_path / "run" / "snapshots" / "round0003.pt")
    assert snap["round"] == 3 and sorted(snap["clients"]) == [0, 1, 2, 3]
    final = torch.load(tmp_path / "run" / "model.pt")
    assert all(torch.equal(final[k], snap["global_after"][k]) for k in final)
    # a run of another config started over in the same directory keeps none of them
    other = make_run_config(rounds=3, save_client_models=(2,), seed=1)
    run_training(other, tmp_path / "run", progress=False)
    assert sorted(p.name for p in (tmp_path / "run" / "snapshots").iterdir()) == ["round0002.pt"]


def test_snapshot_round_beyond_rounds_rejected(minimal_config):
    raw = minimal_config
    raw["experiments"][0]["train"] = {**raw["experiments"][0].get("train", {}), "rounds": 3, "save_client_models": [5]}
    with pytest.raises(FedForgetError, match=r"save_client_models.*\[5\].*rounds=3"):
        parse_config(raw)


def test_unknown_diagnostic_rejected(minimal_config):
    raw = minimal_config
    raw["experiments"][0]["train"] = {**raw["experiments"][0].get("train", {}), "diagnostics": ["hessian"]}
    with pytest.raises(FedForgetError, match="hessian"):
        parse_config(raw)
