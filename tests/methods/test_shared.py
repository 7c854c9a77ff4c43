"""The methods' shared math (fedforget.methods.shared) on hand examples: the floor of the
unscored classes, the A-GEM-style projection, GPM's energy rank, the message sizes and the
parameter checks' messages."""

from __future__ import annotations

import pytest
import torch

from fedforget.methods.shared import (
    OUTSIDE_GAP,
    energy_rank,
    float32_mb,
    floor_unscored,
    project,
    require,
    state_mb,
)

SCORES = torch.tensor([[1.0, 5.0, 3.0], [4.0, 2.0, 8.0]])


def test_floor_unscored_one_mask_for_all_rows():
    # row 0: allowed {1, 3}, lowest 1 -> class 1 at 1 - 30; row 1: allowed {4, 8}, lowest 4
    out = floor_unscored(SCORES, torch.tensor([True, False, True]))
    assert OUTSIDE_GAP == 30.0
    assert torch.equal(out, torch.tensor([[1.0, -29.0, 3.0], [4.0, -26.0, 8.0]]))
    assert out.dtype == SCORES.dtype


def test_floor_unscored_per_row_mask_and_gap():
    allowed = torch.tensor([[True, True, False], [False, False, True]])
    out = floor_unscored(SCORES, allowed, gap=10.0)
    assert torch.equal(out, torch.tensor([[1.0, 5.0, -9.0], [-2.0, -2.0, 8.0]]))


def test_floor_unscored_keeps_the_argmax_among_allowed_classes():
    out = floor_unscored(SCORES, torch.tensor([True, False, False]))
    assert out.argmax(1).tolist() == [0, 0]
    assert torch.equal(out[:, 0], SCORES[:, 0])


def test_project_conflict_removes_the_reference_component():
    # g = (1, 1), g_ref = (-1, 0): <g, g_ref> = -1 < 0 -> g - (-1 / 1) g_ref = (0, 1)
    g = [torch.tensor([1.0]), torch.tensor([1.0])]  # one flat vector over two tensors
    ref = [torch.tensor([-1.0]), torch.tensor([0.0])]
    out, projected, cos = project(g, ref, eps=0.0)
    assert torch.equal(torch.cat(out), torch.tensor([0.0, 1.0]))
    assert float(torch.cat(out) @ torch.cat(ref)) == 0.0  # orthogonal to the reference
    assert bool(projected)
    assert float(cos) == pytest.approx(-(2**-0.5))


def test_project_no_conflict_leaves_the_gradient():
    g = [torch.tensor([1.0, 1.0])]
    ref = [torch.tensor([1.0, 0.0])]
    out, projected, cos = project(g, ref)
    assert torch.equal(out[0], g[0])
    assert not bool(projected)
    assert float(cos) == pytest.approx(2**-0.5)


def test_project_small_reference_is_ignored():
    g = [torch.tensor([1.0, 1.0])]
    out, projected, _ = project(g, [torch.tensor([-1e-4, 0.0])])  # ||g_ref||^2 <= norm_guard
    assert torch.equal(out[0], g[0]) and not bool(projected)


def test_energy_rank_hand_values():
    sq = torch.tensor([6.0, 3.0, 1.0], dtype=torch.float64)  # shares 0.6, 0.3, 0.1 of 10
    assert energy_rank(sq, 10.0, 0.0, 0.5) == 1
    assert energy_rank(sq, 10.0, 0.0, 0.85) == 2
    assert energy_rank(sq, 10.0, 0.0, 0.95) == 3
    assert energy_rank(sq, 10.0, 0.5, 0.85) == 1  # 0.5 already captured + 0.6
    assert energy_rank(sq, 10.0, 0.9, 0.85) == 0  # captured enough: nothing added
    assert energy_rank(sq, 0.0, 0.0, 0.5) == 0


def test_energy_rank_never_counts_numerical_zeros():
    sq = torch.tensor([6.0, 3.0, 1e-15], dtype=torch.float64)  # 1e-15 <= REL_TOL * 10
    assert energy_rank(sq, 10.0, 0.0, 0.95) == 2  # out of reach: every non-zero direction


def test_message_sizes():
    params = {"w": torch.zeros(2, 3), "b": torch.zeros(5, dtype=torch.float64), "n": torch.zeros(7, dtype=torch.long)}
    assert state_mb(params) == (6 * 4 + 5 * 8) / 1e6  # floating tensors only
    assert float32_mb([torch.zeros(2, 3), torch.zeros(5, dtype=torch.float64)]) == 11 * 4 / 1e6
    assert float32_mb([]) == 0.0


def test_require_message():
    with pytest.raises(ValueError, match=r"^mode='x'; allowed: a \| b$"):
        require(False, "mode", "x", "a | b")
    require(True, "mode", "a", "a | b")
