"""accuracy / evaluate / classwise_accuracy on hand-computed logits."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedforget.metrics import accuracy, classwise_accuracy, evaluate


class FixedLogits(nn.Module):
    """Returns row ``x[i]`` of a fixed logit table: inputs are row indices."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("table", table)
        self.modes: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.modes.append(self.training)
        return self.table[x]


LOGITS = torch.tensor(
    [
        [2.0, 0.0, 0.0],  # pred 0, y 0: right
        [0.0, 1.0, 0.0],  # pred 1, y 0: wrong
        [0.0, 0.0, 3.0],  # pred 2, y 2: right
        [1.0, 2.0, 3.0],  # pred 2, y 1: wrong
        [0.5, 0.5, -1.0],  # tie 0/1 -> 0, y 0: right
    ]
)
Y = torch.tensor([0, 0, 2, 1, 0])


def hand_ce() -> float:
    total = 0.0
    for row, y in zip(LOGITS.tolist(), Y.tolist(), strict=True):
        lse = math.log(sum(math.exp(v) for v in row))
        total += lse - row[y]
    return total / len(Y)


def test_accuracy_hand_example_with_tie():
    assert accuracy(LOGITS, Y) == pytest.approx(3 / 5)
    # ties go to the lowest index
    assert accuracy(torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([0])) == 1.0
    assert accuracy(torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([1])) == 0.0


def test_evaluate_hand_computed():
    model = FixedLogits(LOGITS)
    acc, loss = evaluate(model, torch.arange(5), Y)
    assert acc == pytest.approx(3 / 5)
    assert loss == pytest.approx(hand_ce(), rel=1e-6)
    # hand value, independently: row 0 = log(e^2 + 2) - 2
    assert math.log(math.exp(2) + 2) - 2 == pytest.approx(0.2395447, abs=1e-6)


def test_evaluate_uses_eval_mode_and_restores_it():
    model = FixedLogits(LOGITS)
    model.train()
    evaluate(model, torch.arange(5), Y, batch_size=2)
    assert model.modes == [False, False, False]  # 3 batches, all in eval mode
    assert model.training
    model.eval()
    evaluate(model, torch.arange(5), Y)
    assert not model.training


def test_evaluate_does_not_build_graph():
    lin = nn.Linear(3, 2)
    _, loss = evaluate(lin, torch.randn(8, 3), torch.randint(0, 2, (8,)))
    assert isinstance(loss, float)
    assert lin.weight.grad is None


@pytest.mark.parametrize("batch_size", [1, 2, 7, 64, 103, 1024])
def test_evaluate_batch_size_invariant(batch_size):
    g = torch.Generator().manual_seed(0)
    table = torch.randn(103, 10, generator=g) * 3
    y = torch.randint(0, 10, (103,), generator=g)
    model = FixedLogits(table)
    ref_acc = int((table.argmax(1) == y).sum()) / 103  # exact count / n
    ref_loss = torch.nn.functional.cross_entropy(table.double(), y).item()
    acc, loss = evaluate(model, torch.arange(103), y, batch_size=batch_size)
    assert acc == ref_acc
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert len(model.modes) == math.ceil(103 / batch_size)


def test_classwise_accuracy_hand_example():
    model = FixedLogits(LOGITS)
    out = classwise_accuracy(model, torch.arange(5), Y, num_classes=4, batch_size=2)
    # class 0: rows 0,1,4 -> right, wrong, right; class 1: row 3 wrong; class 2: row 2 right; class 3 absent
    assert out[:3] == pytest.approx([2 / 3, 0.0, 1.0])
    assert math.isnan(out[3])
    assert len(out) == 4


def test_classwise_mean_weighted_by_support_equals_accuracy():
    g = torch.Generator().manual_seed(1)
    table = torch.randn(50, 5, generator=g)
    y = torch.randint(0, 5, (50,), generator=g)
    cw = classwise_accuracy(FixedLogits(table), torch.arange(50), y, 5)
    support = torch.bincount(y, minlength=5).tolist()
    weighted = sum(a * n for a, n in zip(cw, support, strict=True) if n) / 50
    assert weighted == pytest.approx(accuracy(table, y))
