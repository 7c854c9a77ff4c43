"""FedProj: the projection (Eq. 14) on hand-computed vectors and its invariants (no conflict
-> unchanged, conflict -> orthogonal to g_glob, idempotent, never longer; small-norm guard;
clamp), the memory loss and KD loss (0 when student = teacher, hand value), the teacher as
the uniform mean of client logits, L_div's gradient 2*alpha*(theta - theta_avg), the client
step against an independent computation, and runs: projection off + E_d = 0 is FedAvg
bit-exactly, no projection before a teacher exists, dropout/warm-up, the ce variant, the
feature-distillation option and config validation."""

from __future__ import annotations

import math

import pytest
import torch

from fedforget.config import TrainSpec
from fedforget.methods import ClientContext, RunInfo, ServerContext, Upload, make_params
from fedforget.methods.distill import kd_loss, softened_kl, softened_kl_stacked
from fedforget.methods.feddf import PUBLIC_LOGITS, PUBLIC_X
from fedforget.methods.fedproj import (
    PUBLIC_FEATURES,
    TEACHER,
    FedProj,
    memory_kl,
    weight_divergence,
)
from fedforget.methods.shared import project
from fedforget.models import build_model
from fedforget.parse import parse_config
from fedforget.utils import FedForgetError

from .conftest import CPU, PUBLIC, run


def flat(ts):
    return torch.cat([t.reshape(-1) for t in ts])


def method(params=None, rounds=5):
    info = RunInfo(CPU, 3, 0, 2, TrainSpec(rounds=rounds))
    return FedProj(make_params("fedproj", params or {}), info)


# ----------------------------------------------------------------------------- Eq. 14


def test_projection_hand_computed():
    # g_new = (1, -1 | 2), g_glob = (0, 2 | 0): <.,.> = -2, ||g_glob||^2 = 4, coef = -0.5
    g_new = [torch.tensor([1.0, -1.0]), torch.tensor([2.0])]
    g_glob = [torch.tensor([0.0, 2.0]), torch.tensor([0.0])]
    out, projected, cos = project(g_new, g_glob, eps=0.0)
    assert projected.item()
    assert flat(out).tolist() == [1.0, 0.0, 2.0]  # g_new + 0.5 * g_glob
    # cos = -2 / (sqrt(6) * 2)
    assert cos.item() == pytest.approx(-1 / math.sqrt(6), rel=1e-6)


def test_clamped_coefficient():
    # <g_new, g_glob> = -1 * 0.01 ... coef = -0.01 / 1e-4 = -100, clamped to -10
    g_new, g_glob = [torch.tensor([-1.0, 3.0])], [torch.tensor([0.01, 0.0])]
    out, _, _ = project(g_new, g_glob, eps=0.0, coef_clamp=10.0)
    torch.testing.assert_close(out[0], torch.tensor([-1.0 + 10 * 0.01, 3.0]))
    out, _, _ = project(g_new, g_glob, eps=0.0)  # unclamped: orthogonal
    torch.testing.assert_close(out[0], torch.tensor([0.0, 3.0]))


def random_pair(seed, conflict):
    g = torch.Generator().manual_seed(seed)
    a = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    b = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    d = (flat(a) @ flat(b)).item()
    if (d < 0) != conflict:
        b = [-t for t in b]
    return a, b


@pytest.mark.parametrize("seed", range(5))
def test_no_conflict_leaves_gradient_unchanged(seed):
    a, b = random_pair(seed, conflict=False)
    out, projected, _ = project(a, b)
    assert not projected.item()
    assert all(torch.equal(x, y) for x, y in zip(out, a))


@pytest.mark.parametrize("seed", range(5))
def test_conflict_orthogonal_idempotent_and_shorter(seed):
    a, b = random_pair(seed, conflict=True)
    out, projected, cos = project(a, b)
    assert projected.item() and cos.item() < 0
    g, gg = flat(out), flat(b)
    assert abs((g @ gg).item()) <= 1e-5 * g.norm().item() * gg.norm().item()
    assert g.norm() <= flat(a).norm()
    again, projected2, _ = project(out, b)  # idempotent: already (numerically) orthogonal
    torch.testing.assert_close(flat(again), g, atol=1e-6, rtol=0)


def test_small_norm_guard_and_zero_memory_gradient():
    a = [torch.tensor([1.0, 0.0])]
    tiny = [torch.tensor([-5e-4, 0.0])]  # ||g_glob||^2 = 2.5e-7 <= 1e-6: no projection
    out, projected, _ = project(a, tiny)
    assert not projected.item() and torch.equal(out[0], a[0])
    out, projected, cos = project(a, [torch.zeros(2)])
    assert not projected.item() and torch.equal(out[0], a[0]) and cos.item() == 0.0


# ----------------------------------------------------------------------------- losses


def test_memory_and_kd_losses_zero_when_student_is_teacher():
    z = torch.randn(6, 4, generator=torch.Generator().manual_seed(1)) * 4
    assert memory_kl(z, z.clone(), 3.0).item() == 0.0
    assert kd_loss(z, z.clone(), 3.0).item() == 0.0


def test_memory_kl_hand_value_has_no_t2_factor():
    teacher, student = torch.tensor([[3.0, 0.0]]), torch.tensor([[0.0, 0.0]])
    t = 3.0
    p = torch.softmax(teacher / t, 1)[0]  # (e/(e+1), 1/(e+1))
    expected = (p * (p.log() - math.log(0.5))).sum().item()
    assert memory_kl(student, teacher, t).item() == pytest.approx(expected, rel=1e-6)
    assert kd_loss(student, teacher, t).item() == pytest.approx(t * t * expected, rel=1e-6)


def test_teacher_is_uniform_mean_of_client_logits():
    a = Upload(0, 10, {}, 1, {PUBLIC_LOGITS: torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 9.0]])})
    b = Upload(1, 90, {}, 1, {PUBLIC_LOGITS: torch.tensor([[3.0, 2.0, 1.0], [2.0, 4.0, 3.0]])})
    # n_k = 10 and 90 must not weight it: ((1+3)/2, ...) = (2, 2, 2); ((0+2)/2, ...) = (1, 2, 6)
    expected = torch.tensor([[2.0, 2.0, 2.0], [1.0, 2.0, 6.0]])
    assert torch.equal(method().teacher_logits([a, b]), expected)


def test_weight_divergence_gradient_is_two_alpha_times_offset():
    torch.manual_seed(0)
    model = build_model("mlp", (2,), 3, {"hidden": [4, 4]})
    anchor = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    alpha = 0.3
    loss = weight_divergence(model, anchor, alpha)
    loss.backward()
    for n, p in model.named_parameters():
        expected = 2 * alpha * (p.detach() - anchor[n])
        assert expected.abs().max() > 0  # non-zero: the code's aliased anchor gives 0
        torch.testing.assert_close(p.grad, expected)
    total = sum(((p.detach() - anchor[n]) ** 2).sum() for n, p in model.named_parameters())
    assert loss.item() == pytest.approx(alpha * total.item(), rel=1e-6)


def test_stacked_memory_kl_is_each_clients_own():
    """softened_kl_stacked (the batched FedProj step's L_mem) equals softened_kl of each
    client's rows alone, to rounding."""
    gen = torch.Generator().manual_seed(0)
    s, t = torch.randn(3, 7, 5, generator=gen) * 2, torch.randn(3, 7, 5, generator=gen) * 2
    want = torch.stack([softened_kl(s[j], t[j], 3.0) for j in range(3)])
    torch.testing.assert_close(softened_kl_stacked(s, t, 3.0), want, rtol=1e-6, atol=1e-7)
    assert softened_kl_stacked(t, t, 3.0).abs().max() == 0


# ----------------------------------------------------------------------------- client step


def client(m, model, x_pub, teacher, rnd=2, cid=0):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bc = {PUBLIC_X: x_pub, TEACHER: teacher}
    return ClientContext(cid, rnd, model, opt, {}, bc, {}, 8, 0.1, 1, 8)


def test_client_step_projects_against_the_memory_gradient():
    torch.manual_seed(0)
    model = build_model("mlp", (2,), 3, {"hidden": [8]})
    x_pub = torch.randn(10, 2)
    x, y = torch.randn(8, 2), torch.randint(0, 3, (8,))
    m = method()  # memory batch 256 > 10: the whole public set, deterministic
    found = {"conflict": False, "agree": False}
    for trial in range(20):
        teacher = torch.randn(10, 3, generator=torch.Generator().manual_seed(trial)) * 3
        ctx = client(m, model, x_pub, teacher)
        m.client_begin(ctx)
        model.zero_grad(set_to_none=True)
        m.client_step(ctx, x, y)
        params = list(model.parameters())
        g_new = [p.grad.clone() for p in params]
        g_glob = torch.autograd.grad(memory_kl(model(x_pub), teacher, 3.0), params)
        m.client_grad(ctx)
        g = flat([p.grad for p in params])
        d = (flat(g_new) @ flat(g_glob)).item()
        if d < 0:
            found["conflict"] = True
            assert abs((g @ flat(g_glob)).item()) < 1e-5 * g.norm().item() * flat(g_glob).norm().item()
            expected, _, _ = project(g_new, list(g_glob))
            torch.testing.assert_close(g, flat(expected))
            assert m.scratch(ctx).sums.values()[0] == 1
        else:
            found["agree"] = True
            assert torch.equal(g, flat(g_new)) and m.scratch(ctx).sums.values()[0] == 0
        assert m.scratch(ctx).sums.values()[2] == 1
    assert all(found.values())  # both branches were exercised


def test_no_projection_without_teacher_or_inside_warmup_or_cooldown():
    model = build_model("mlp", (2,), 3, {"hidden": [4]})
    x_pub, z = torch.randn(5, 2), torch.randn(5, 3)
    assert not method().projection_active(client(None, model, x_pub, None, rnd=1))
    assert method().projection_active(client(None, model, x_pub, z, rnd=2))
    warm = method({"proj_warmup_rounds": 2})
    assert not warm.projection_active(client(None, model, x_pub, z, rnd=2))
    assert warm.projection_active(client(None, model, x_pub, z, rnd=3))
    cool = method({"proj_cooldown_rounds": 1}, rounds=5)
    assert cool.projection_active(client(None, model, x_pub, z, rnd=4))
    assert not cool.projection_active(client(None, model, x_pub, z, rnd=5))
    assert not method({"projection": False}).projection_active(client(None, model, x_pub, z))


def test_projection_dropout_rate_and_keyed_draws():
    model = build_model("mlp", (2,), 3, {"hidden": [4]})
    x_pub, z = torch.randn(5, 2), torch.randn(5, 3)
    m = method({"proj_dropout": 0.7}, rounds=500)
    draws = [m.projection_active(client(m, model, x_pub, z, rnd=r, cid=c)) for r in range(2, 202) for c in range(3)]
    rate = sum(draws) / len(draws)
    assert 0.24 < rate < 0.36  # 600 Bernoulli(0.3): sd ~ 0.019
    again = [m.projection_active(client(m, model, x_pub, z, rnd=r, cid=c)) for r in range(2, 202) for c in range(3)]
    assert draws == again  # keyed by (seed, round, client), not by call order
    assert not any(method({"proj_dropout": 1.0}).projection_active(client(m, model, x_pub, z, rnd=r)) for r in range(2, 30))


def test_local_lr_step_every_half_of_the_local_epochs():
    m = method({"local_lr_step": True})
    model = build_model("mlp", (2,), 3, {"hidden": [4]})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # 8 samples, batch 4: 2 steps per epoch; 4 epochs -> x0.1 before steps 4 (epoch 3)
    ctx = ClientContext(0, 1, model, opt, {}, {PUBLIC_X: torch.randn(3, 2), TEACHER: None}, {}, 8, 0.1, 4, 4)
    m.client_begin(ctx)
    lrs = []
    for _ in range(8):
        m.client_step(ctx, torch.randn(4, 2), torch.randint(0, 3, (4,)))
        lrs.append(opt.param_groups[0]["lr"])
        ctx.steps += 1
    assert lrs == pytest.approx([0.1] * 4 + [0.01] * 4)


# ----------------------------------------------------------------------------- runs


@pytest.fixture
def run_cfg(public_run_cfg):
    def make(method="fedproj", params=None, **train):
        return public_run_cfg(method, params, **train)

    return make


def same_run(a, b):
    (sa, ra), (sb, rb) = a, b
    for k, v in sb.global_params.items():
        assert torch.equal(sa.global_params[k], v), k
    assert [r["global_model_test_acc"] for r in ra] == [r["global_model_test_acc"] for r in rb]


@pytest.mark.parametrize("off", [{"projection": False}, {"proj_dropout": 1.0}])
def test_projection_off_and_no_distillation_is_fedavg_bit_exactly(run_cfg, off):
    same_run(run(run_cfg("fedproj", {**off, "distill_epochs": 0})), run(run_cfg("fedavg")))


def test_run_projects_after_round_one_and_reports_diagnostics(run_cfg):
    sim, rows = run(run_cfg("fedproj", {"distill_batch_size": 4}))
    assert sim.server.public.y is None  # the kl default never sees public labels
    assert rows[1]["fedproj_proj_share"] == 0.0  # round 1: no memory yet
    assert "fedproj_cos_before" not in rows[1] and "fedproj_mem_loss_before" not in rows[1]
    later = rows[2:]
    for r in later:
        assert 0.0 <= r["fedproj_proj_share"] <= 1.0
        assert -1.0 <= r["fedproj_cos_before"] <= 1.0
        assert r["fedproj_mem_loss_before"] >= 0 and r["fedproj_mem_loss_after"] >= 0
        assert r["fedproj_distill_steps"] == 3  # 12 public rows, batch 4, E_d = 1
        assert math.isfinite(r["local_models_global_test_acc_mean"])
    assert any(r["fedproj_proj_share"] > 0 for r in later)
    # memory = the uniform mean of the last round's uploaded public logits, kept in server.state
    assert sim.server.state["fedproj_teacher"].shape == (12, 3)


def test_ce_memory_variant_projects_from_round_one(run_cfg):
    sim, rows = run(run_cfg("fedproj", {"memory_loss": "ce", "distill_epochs": 0}))
    assert sim.server.public.y is not None
    assert "fedproj_cos_before" in rows[1] and "fedproj_mem_loss_before" in rows[1]
    kl_sim, kl_rows = run(run_cfg("fedproj", {"distill_epochs": 0}))
    assert rows[1]["global_model_test_acc"] != kl_rows[1]["global_model_test_acc"] or any(
        not torch.equal(v, kl_sim.global_params[k]) for k, v in sim.global_params.items()
    )


def test_alpha_and_feature_distillation_change_the_distilled_model(run_cfg):
    base = {"distill_lr": 1e-2, "distill_epochs": 3, "distill_batch_size": 4}
    s0, _ = run(run_cfg("fedproj", {**base, "alpha": 0.0}))
    s1, r1 = run(run_cfg("fedproj", {**base, "alpha": 5.0}))
    s2, _ = run(run_cfg("fedproj", {**base, "alpha": 0.0, "gamma2": 1e-2}))
    diff = lambda a, b: any(not torch.equal(v, b.global_params[k]) for k, v in a.global_params.items())  # noqa: E731
    assert diff(s0, s1) and diff(s0, s2)
    assert all(math.isfinite(r["fedproj_distill_loss_after"]) for r in r1[1:])


def test_weight_divergence_keeps_the_student_near_the_average():
    torch.manual_seed(0)
    model = build_model("mlp", (2,), 3, {"hidden": [8]})
    theta_avg = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x_pub = torch.randn(16, 2)
    teacher = torch.randn(16, 3, generator=torch.Generator().manual_seed(3)) * 3
    ups = [Upload(0, 1, {}, 1, {PUBLIC_LOGITS: teacher})]
    dist = {}
    for alpha in (0.0, 1.0):
        m = method({"alpha": alpha, "distill_lr": 1e-2, "distill_epochs": 20, "distill_batch_size": 8})
        pub = type("Pub", (), {"x": x_pub, "y": None})()
        server = ServerContext(1, dict(theta_avg), model, CPU, pub)
        m.distillation(server, ups)  # the step after FedAvg's average
        assert torch.equal(server.state[TEACHER], teacher)  # next round's memory
        dist[alpha] = sum(((server.global_params[k] - v) ** 2).sum() for k, v in theta_avg.items()).item()
        stats = server.state["distill_stats"]
        assert stats.kl_after < stats.kl_before
    assert 0 < dist[1.0] < 0.5 * dist[0.0]


def test_feature_upload_only_with_gamma2():
    torch.manual_seed(0)
    model = build_model("mlp", (2,), 3, {"hidden": [5]})
    x_pub = torch.randn(4, 2)
    for gamma2, has in ((0.0, False), (1e-4, True)):
        m = method({"gamma2": gamma2})
        ctx = client(m, model, x_pub, None)
        m.client_begin(ctx)
        up = m.client_end(ctx)
        assert (PUBLIC_FEATURES in up.extras) == has
        if has:
            torch.testing.assert_close(up.extras[PUBLIC_FEATURES], model.features(x_pub).detach())


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "field,value",
    [
        ("memory_loss", "mse"),
        ("memory_batch_size", 0),
        ("eps", -1.0),
        ("alpha", -0.1),
        ("proj_dropout", 1.5),
        ("proj_warmup_rounds", -1),
        ("projection", "yes"),
        ("temperature", 0),
        ("coef_clamp", float("nan")),
    ],
)
def test_bad_hyperparameters_are_rejected(minimal_config, field, value):
    ex = minimal_config["experiments"][0]
    ex["datasets"][0]["public"] = PUBLIC
    ex["methods"] = [{"name": "fedproj", "params": {field: value}}]
    with pytest.raises(FedForgetError, match=rf"{field}="):
        parse_config(minimal_config)


def test_defaults():
    p = make_params("fedproj", {})
    assert (p.temperature, p.memory_loss, p.memory_batch_size) == (3.0, "kl", 256)
    assert (p.distill_epochs, p.distill_optimizer, p.distill_lr, p.distill_batch_size) == (1, "adam", 1e-5, 256)
    assert (p.projection, p.proj_dropout, p.proj_warmup_rounds, p.coef_clamp, p.gamma2) == (True, 0.0, 0, 0.0, 0.0)
    assert p.alpha == 0.3 and p.norm_guard == 1e-6
