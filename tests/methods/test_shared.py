"""The methods' shared math (fedforget.methods.shared) on hand examples: the floor of the
unscored classes, the A-GEM-style projection, GPM's energy rank, iCaRL's herding, the
message sizes and the parameter checks' messages."""

from __future__ import annotations

import pytest
import torch

from fedforget.methods.shared import (
    OUTSIDE_GAP,
    energy_rank,
    float32_mb,
    floor_unscored,
    herding,
    left_singular,
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


def test_left_singular_falls_back_to_the_svd_where_the_eigensolver_fails(monkeypatch):
    """U and s^2 of a [d, n] with n >= d come from eigh(a a^T); where the eigensolver does not
    converge (MKL did not on FOT's ResNet-18 sketches, 2026-12-05) the SVD of a gives the same
    subspaces and s^2 instead of an error."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 3, generator=g, dtype=torch.float64) @ torch.randn(3, 8, generator=g, dtype=torch.float64)
    u, s2 = left_singular(a)

    def fails(_):
        raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "eigh", fails)
    u2, s2b = left_singular(a)
    assert u2.shape == u.shape == (5, 5) and s2b.shape == s2.shape == (5,)
    assert torch.allclose(s2b, s2, atol=1e-9)
    assert torch.allclose(s2b[:3], torch.linalg.svdvals(a)[:3] ** 2)
    top, top2 = u[:, :3], u2[:, :3]  # the rank-3 range: the same projector either way
    assert torch.allclose(top @ top.T, top2 @ top2.T, atol=1e-9)


# ------------------------------------------------------------------ herding (iCaRL Alg. 4; iCaRL, GLFC, LGA)
def line(values, dtype=torch.float32):
    """1-D features embedded in 2-D rows (v, 0)."""
    v = torch.tensor(values, dtype=dtype)
    return torch.stack([v, torch.zeros_like(v)], 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_herding_picks_the_row_that_brings_the_running_mean_closest(dtype):
    """mean 5.1: 5.5 first (|5.5 - 5.1| = 0.4); then the v with (5.5 + v)/2 closest, v ~ 4.7:
    4 (not 6, though 6 is nearer the mean); then v ~ 5.8: 6; then v ~ 4.9: 0; then 10."""
    feats, one = line([0.0, 10.0, 4.0, 6.0, 5.5], dtype), torch.zeros(5, dtype=torch.long)
    idx, rank = herding(feats, one, [0], 5)
    assert idx.tolist() == [4, 2, 3, 0, 1] and rank.tolist() == [0, 1, 2, 3, 4]
    assert herding(feats, one, [0], 3)[0].tolist() == [4, 2, 3]
    assert herding(feats, one, [0], 9)[0].tolist() == [4, 2, 3, 0, 1]  # at most n, each row once
    # nearest to the mean would be 5.5, 6, 4, ...: herding is not that order
    assert (feats[:, 0] - 5.1).abs().argsort().tolist()[:3] == [4, 3, 2]


def test_herding_takes_every_class_at_once_in_the_order_given():
    f = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8], [1.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([0, 0, 0, 1, 1])
    # class 0: mean (0.533, 0.6): first the row nearest it (2), then the one that brings the
    # running mean closest to it (row 0: mean (0.8, 0.4), 0.33 away; row 1: (0.3, 0.9), 0.38);
    # class 1: its two rows at the same distance: the lower index first, no repeats
    idx, rank = herding(f, y, [0, 1], 2)
    assert idx.tolist() == [2, 0, 3, 4] and rank.tolist() == [0, 1, 0, 1]
    idx, rank = herding(f, y, [1, 0], 2)  # class after class, in the order given
    assert idx.tolist() == [3, 4, 2, 0] and rank.tolist() == [0, 1, 0, 1]
    idx, rank = herding(f, y, [0], 5)  # at most a class's rows
    assert idx.tolist() == [2, 0, 1] and rank.tolist() == [0, 1, 2]
    # m = 1: each class's row nearest its mean (GLFC's prototype); none for m = 0, no class
    assert herding(f, y, [0, 1], 1)[0].tolist() == [2, 3]
    assert herding(f, y, [0, 1], 0)[0].numel() == 0 and herding(f, y, [], 3)[0].numel() == 0


def test_herding_per_class_equals_all_classes_at_once():
    """Every class at once = each class alone (the padding rows of the short classes never
    picked), on random features with classes of 3 to 40 rows."""
    g = torch.Generator().manual_seed(0)
    y = torch.cat([torch.full((n,), c) for c, n in enumerate([40, 3, 17, 25])])[torch.randperm(85, generator=g)]
    f = torch.nn.functional.normalize(torch.randn(85, 6, generator=g, dtype=torch.float64), dim=1)
    idx, rank = herding(f, y, [0, 1, 2, 3], 20)
    alone = [herding(f, y, [c], 20) for c in range(4)]
    assert idx.tolist() == [i for a, _ in alone for i in a.tolist()]
    assert rank.tolist() == [r for _, a in alone for r in a.tolist()]
    assert len(set(idx.tolist())) == len(idx) and bool((y[idx[:20]] == 0).all())
