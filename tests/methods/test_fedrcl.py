"""FedRCL: L_SCL and L_DIV on a hand example (both pair selections), against a loop
reference, the relaxation term vanishes when no same-class pair exceeds lambda; multi-level
RCL: the level mean by hand, one level = the single-level loss (also the client step,
bit-exactly), level selection and the gradient it sends to each stage; weight = 0 is
FedAvg, config validation, short runs (one-level MLP, five-level ResNet-8)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fedforget.methods import make_params
from fedforget.methods.base import ClientContext, RunInfo
from fedforget.methods.fedrcl import FedRCL, rcl_levels, rcl_terms, select_levels
from fedforget.models import build_model
from fedforget.parse import parse_config
from fedforget.utils import FedForgetError

from .conftest import run_method

CPU = torch.device("cpu")

# unit vectors z1 = (1, 0), z2 = (0.6, 0.8) with label 0, z3 = (0, 1) with label 1:
# sim12 = 0.6, sim13 = 0, sim23 = 0.8 (a cross-class pair above 0.7). tau = 1 below.
Z = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]])
Y = torch.tensor([0, 0, 1])
L = math.log1p


def test_all_pairs_hand_computed():
    # L_SCL: x1: P = {x2}, A = {x2, x3}: -log(e^.6 / (e^.6 + e^0)) = log(1 + e^-0.6)
    #        x2: P = {x1}, A = {x1, x3}: -log(e^.6 / (e^.6 + e^.8)) = log(1 + e^0.2)
    #        x3: P empty -> not averaged.
    # L_DIV, lambda = 0.5: the pair (x1, x2) is above it; x1 and x2 each get
    #        -log(e^1 / (e^1 + e^.6)) = log(1 + e^-0.4); x3 gets 0; mean over the 3 anchors.
    scl, div = rcl_terms(Z, Y, tau=1.0, threshold=0.5, pairs="all")
    assert float(scl) == pytest.approx((L(math.exp(-0.6)) + L(math.exp(0.2))) / 2, rel=1e-6)
    assert float(div) == pytest.approx(2 * L(math.exp(-0.4)) / 3, rel=1e-6)
    # tau = 0.5 doubles every exponent: x1's L_DIV = log(1 + e^{(0.6 - 1)/0.5}) = log(1 + e^-0.8)
    _, div = rcl_terms(Z, Y, tau=0.5, threshold=0.5, pairs="all")
    assert float(div) == pytest.approx(2 * L(math.exp(-0.8)) / 3, rel=1e-6)


def test_topk_pairs_hand_computed():
    # released config: hardest positive (self included), two hardest negatives.
    # L_SCL: x1: s_p = min(1, .6) = .6, negatives {x3: 0} -> log(1 + e^-0.6)
    #        x2: s_p = .6, negatives {x3: .8}           -> log(1 + e^0.2)
    #        x3: alone in its class, s_p = sim33 = 1, negatives {0, .8} -> log(1 + e^-1 + e^-0.2)
    # L_DIV, lambda = 0.5: x1, x2: least similar positive .6 >= .5 -> log(1 + e^{.6 - 1});
    #        x3: no positive -> v = -1 -> log(1 + e^{-1 - 1}) = log(1 + e^-2)
    scl, div = rcl_terms(Z, Y, tau=1.0, threshold=0.5, pairs="topk")
    want_scl = (L(math.exp(-0.6)) + L(math.exp(0.2)) + L(math.exp(-1) + math.exp(-0.2))) / 3
    assert float(scl) == pytest.approx(want_scl, rel=1e-6)
    assert float(div) == pytest.approx((2 * L(math.exp(-0.4)) + L(math.exp(-2))) / 3, rel=1e-6)


def loop_reference(z, y, tau, lam):
    """L_SCL and L_DIV with Python loops over anchors and pairs (float64)."""
    z = torch.nn.functional.normalize(z.double(), dim=1)
    n = len(y)
    sim = [[float(z[i] @ z[j]) for j in range(n)] for i in range(n)]
    scl, anchors, div = 0.0, 0, 0.0
    for i in range(n):
        others = [j for j in range(n) if j != i]
        pos = [j for j in others if y[j] == y[i]]
        denom = sum(math.exp(sim[i][a] / tau) for a in others)
        if pos:
            scl += -sum(math.log(math.exp(sim[i][p] / tau) / denom) for p in pos) / len(pos)
            anchors += 1
        hi = sum(math.exp(sim[i][j] / tau) for j in pos if sim[i][j] > lam)
        div += -math.log(math.exp(1 / tau) / (math.exp(1 / tau) + hi))
    return scl / max(anchors, 1), div / n


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_all_pairs_matches_loop_reference(seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(9, 6, generator=g).double()
    z[1] = z[0] + 0.1 * z[1]  # make sure some same-class pairs are very similar
    y = torch.tensor([0, 0, 1, 2, 1, 0, 2, 3, 1])
    scl, div = rcl_terms(z, y, tau=0.3, threshold=0.2, pairs="all")
    want_scl, want_div = loop_reference(z, y, 0.3, 0.2)
    assert float(scl) == pytest.approx(want_scl, rel=1e-9)
    assert float(div) == pytest.approx(want_div, rel=1e-9)
    assert want_div > 0


def test_relaxation_zero_when_no_positive_pair_exceeds_threshold():
    # lambda = 0.7: the only same-class pair has sim 0.6; the 0.8 pair is cross-class
    z = Z.clone().requires_grad_()
    scl, div = rcl_terms(z, Y, tau=1.0, threshold=0.7, pairs="all")
    assert div.item() == 0.0
    div.backward()
    assert torch.all(z.grad == 0)
    # released selection: v = -1 for every anchor, a constant log(1 + e^{-2/tau}) with no
    # gradient (about 4e-18 at the default tau = 0.05)
    z = Z.clone().requires_grad_()
    _, div = rcl_terms(z, Y, tau=1.0, threshold=0.7, pairs="topk")
    assert float(div.detach()) == pytest.approx(L(math.exp(-2)), rel=1e-6)
    div.backward()
    assert torch.all(z.grad.abs() < 1e-7)
    _, div = rcl_terms(Z, Y, tau=0.05, threshold=0.7, pairs="topk")
    assert abs(float(div)) < 1e-6
    # random features, nothing can exceed lambda = 1
    z = torch.randn(10, 4)
    y = torch.tensor([0, 1] * 5)
    assert rcl_terms(z, y, tau=0.05, threshold=1.0, pairs="all")[1].item() == 0.0


def test_penalty_pushes_a_too_similar_pair_apart():
    z = Z.clone().requires_grad_()
    _, div = rcl_terms(z, Y, tau=1.0, threshold=0.5, pairs="all")
    div.backward()
    with torch.no_grad():
        moved = z - 0.1 * z.grad
        s = torch.nn.functional.normalize(moved, dim=1)
    assert float(s[0] @ s[1]) < 0.6


def test_single_sample_batch_adds_nothing():
    for pairs in ("all", "topk"):
        scl, div = rcl_terms(torch.randn(1, 4), torch.tensor([2]), 0.05, 0.7, pairs)
        assert scl.item() == 0.0 and div.item() == 0.0


def test_zero_weight_is_fedavg_bit_exact(make_run_config):
    train = dict(rounds=2, local_epochs=2, sample_rate=0.5, optimizer={"lr": 0.1, "momentum": 0.9})
    ref, _ = run_method(make_run_config, "fedavg", {}, **train)
    sim, _ = run_method(make_run_config, "fedrcl", {"weight": 0.0}, **train)
    for k, v in ref.global_params.items():
        assert torch.equal(sim.global_params[k], v), k
    other, _ = run_method(make_run_config, "fedrcl", {}, **train)
    assert any(not torch.equal(other.global_params[k], v) for k, v in ref.global_params.items())


@pytest.mark.parametrize(
    "params,field",
    [({"weight": -1}, "weight"), ({"beta": float("nan")}, "beta"), ({"tau": 0}, "tau"),
     ({"threshold": 1.5}, "threshold"), ({"threshold": "high"}, "threshold"),
     ({"pairs": "hard"}, "pairs"), ({"lambda": 0.7}, "lambda"), ({"levels": "first"}, "levels"),
     ({"levels": []}, "levels"), ({"levels": [1, 1]}, "levels"), ({"levels": [-1]}, "levels"),
     ({"levels": [True]}, "levels"), ({"levels": 2}, "levels")],
)  # fmt: skip
def test_bad_params_rejected(minimal_config, params, field):
    minimal_config["experiments"][0]["methods"] = [{"name": "fedrcl", "params": params}]
    with pytest.raises(FedForgetError) as ei:
        parse_config(minimal_config)
    assert field in str(ei.value) and "fedrcl" in str(ei.value)


def test_defaults(minimal_config):
    minimal_config["experiments"][0]["methods"] = [{"name": "fedrcl"}]
    (rc,) = parse_config(minimal_config).runs()
    assert rc.method.params == {
        "weight": 1.0, "beta": 1.0, "tau": 0.05, "threshold": 0.7, "pairs": "all", "levels": "all"
    }  # fmt: skip


@pytest.mark.parametrize("pairs", ["all", "topk"])
def test_short_run_finite(make_run_config, pairs):
    _, rows = run_method(
        make_run_config, "fedrcl", {"pairs": pairs}, dataset="digits", rounds=3, batch_size=32
    )
    assert all(math.isfinite(r["global_model_test_acc"]) for r in rows)
    assert rows[-1]["global_model_test_acc"] > rows[0]["global_model_test_acc"]
    for key in ("fedrcl_l_scl", "fedrcl_l_div"):
        assert all(math.isfinite(r[key]) for r in rows[1:])


def test_all_pair_permutation_invariant():
    z, y = torch.randn(8, 5), torch.tensor([0, 0, 1, 1, 1, 2, 0, 2])
    base = rcl_terms(z, y, 0.1, 0.3, "all")
    for perm in itertools.islice(itertools.permutations(range(8)), 1, 4):
        p = torch.tensor(perm)
        got = rcl_terms(z[p], y[p], 0.1, 0.3, "all")
        torch.testing.assert_close(got[0], base[0])
        torch.testing.assert_close(got[1], base[1])


# ---------------------------------------------------------------- multi-level RCL


@pytest.mark.parametrize("pairs", ["all", "topk"])
def test_level_mean_by_hand(pairs):
    # three levels of different widths: the result is the mean of the per-level terms
    g = torch.Generator().manual_seed(4)
    y = torch.tensor([0, 1, 0, 2, 1, 0, 2, 2])
    levels = [torch.randn(8, d, generator=g).double() for d in (3, 5, 7)]
    levels[1][2] = levels[1][0] + 0.05 * levels[1][2]  # a near-duplicate same-class pair
    per = [rcl_terms(z, y, 0.2, 0.3, pairs) for z in levels]
    scl, div = rcl_levels(levels, y, 0.2, 0.3, pairs)
    assert float(scl) == pytest.approx(sum(float(t[0]) for t in per) / 3, rel=1e-12)
    assert float(div) == pytest.approx(sum(float(t[1]) for t in per) / 3, rel=1e-12)
    if pairs == "all":  # and against the loop reference
        ref = [loop_reference(z, y, 0.2, 0.3) for z in levels]
        assert float(scl) == pytest.approx(sum(r[0] for r in ref) / 3, rel=1e-9)
        assert float(div) == pytest.approx(sum(r[1] for r in ref) / 3, rel=1e-9)
    # the hand example twice, once scaled (cosines unchanged): the mean is the one-level value
    scl, div = rcl_levels([Z, 3 * Z], Y, 1.0, 0.5, "all")
    assert float(scl) == pytest.approx((L(math.exp(-0.6)) + L(math.exp(0.2))) / 2, rel=1e-6)
    assert float(div) == pytest.approx(2 * L(math.exp(-0.4)) / 3, rel=1e-6)


def test_one_level_is_the_single_level_loss():
    z, y = torch.randn(6, 4), torch.tensor([0, 0, 1, 1, 2, 0])
    for pairs in ("all", "topk"):
        one, ref = rcl_levels([z], y, 0.05, 0.2, pairs), rcl_terms(z, y, 0.05, 0.2, pairs)
        assert torch.equal(one[0], ref[0]) and torch.equal(one[1], ref[1])


def test_select_levels():
    levels = [torch.full((2, 1), float(i)) for i in range(5)]
    assert select_levels(levels, "all") is levels
    assert [float(t[0, 0]) for t in select_levels(levels, "last")] == [4.0]
    assert [float(t[0, 0]) for t in select_levels(levels, [3, 0])] == [3.0, 0.0]
    with pytest.raises(ValueError, match=r"levels=\[5\].*below 5"):
        select_levels(levels, [5])


def make_ctx(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = {k: v.clone() for k, v in model.state_dict().items()}
    return ClientContext(0, 1, model, opt, params, {}, {}, 8, 0.1, 1, 8)


def make_method(params):
    info = RunInfo(CPU, 3, 0, 4, None)
    return FedRCL(make_params("fedrcl", params), info)


@pytest.mark.parametrize("levels", ["all", "last", [0]])
def test_client_step_on_one_level_model_is_the_single_level_loss(levels):
    # the client step (forward_levels, CE + weight * (L_SCL + beta * L_DIV)) gives the same
    # loss and gradients, bit for bit, as the single-level formulation on the features of
    # forward_with_features
    torch.manual_seed(5)
    model = build_model("mlp", (4,), 3, {"hidden": [6]})
    x, y = torch.randn(8, 4), torch.tensor([0, 1, 2, 0, 1, 2, 0, 0])
    method = make_method(
        {"weight": 0.7, "beta": 2.0, "tau": 0.5, "threshold": 0.1, "levels": levels}
    )
    ctx = make_ctx(model)
    method.client_begin(ctx)
    loss = method.client_step(ctx, x, y)
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    z, logits = model.forward_with_features(x)
    scl, div = rcl_terms(z, y, 0.5, 0.1, "all")
    ref = torch.nn.functional.cross_entropy(logits, y) + 0.7 * (scl + 2.0 * div)
    ref.backward()
    assert torch.equal(loss, ref)
    for a, p in zip(got, model.parameters(), strict=True):
        assert torch.equal(a, p.grad)
    assert float(div.detach()) > 0  # the penalty is active in this example


def test_level_choice_decides_which_stages_get_rcl_gradient():
    torch.manual_seed(6)
    model = build_model("resnet8", (1, 8, 8), 3, {"norm": "group"})
    x, y = torch.randn(8, 1, 8, 8), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    stage_params = [list(s.parameters()) for s in model.body.stages]
    for which, reached in (("all", [1, 1, 1, 1]), ("last", [1, 1, 1, 1]), ([0], [0, 0, 0, 0]),
                           ([2], [1, 1, 0, 0]), ([1, 3], [1, 1, 1, 0])):  # fmt: skip
        model.zero_grad(set_to_none=True)
        levels, _ = model.forward_levels(x)
        scl, div = rcl_levels(select_levels(levels, which), y, 0.5, -1.0, "all")
        (scl + div).backward()
        assert model.body.conv1.weight.grad.abs().sum() > 0  # the stem always
        for ps, want in zip(stage_params, reached, strict=True):
            hit = [p.grad is not None and p.grad.abs().sum() > 0 for p in ps]
            assert all(hit) if want else not any(hit), (which, hit)
    # all five levels: every stage is reached, and the loss is the mean of the five terms
    levels, _ = model.forward_levels(x)
    per = [rcl_terms(z, y, 0.5, -1.0, "all") for z in levels]
    scl, _ = rcl_levels(levels, y, 0.5, -1.0, "all")
    assert float(scl.detach()) == pytest.approx(
        sum(float(t[0].detach()) for t in per) / 5, rel=1e-6
    )


def test_level_index_beyond_the_model_is_reported():
    model = build_model("mlp", (4,), 3, {"hidden": [6]})
    method = make_method({"levels": [1]})
    ctx = make_ctx(model)
    method.client_begin(ctx)
    with pytest.raises(ValueError, match="levels=.*below 1"):
        method.client_step(ctx, torch.randn(4, 4), torch.tensor([0, 0, 1, 2]))


# a ResNet-8 run per level (finite losses); the levels' math against the sequential trainer:
# tests/methods/test_batched_uploads.py, test_fedrcl_levels_of_a_resnet_stacked_equal_sequential
@pytest.mark.long
@pytest.mark.parametrize("levels", ["all", "last"])
def test_short_run_resnet8_levels(make_run_config, levels):
    _, rows = run_method(
        make_run_config, "fedrcl", {"levels": levels}, dataset="digits", model="resnet8",
        model_options={"norm": "group"}, rounds=2, batch_size=32, optimizer={"lr": 0.05},
    )  # fmt: skip
    assert all(math.isfinite(r["global_model_test_acc"]) for r in rows)
    for key in ("fedrcl_l_scl", "fedrcl_l_div"):
        assert all(math.isfinite(r[key]) for r in rows[1:])
