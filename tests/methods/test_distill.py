"""The shared server distillation (fedforget.methods.distill): the KD loss (zero at equality, T^2
scaling by hand), distillation lowers KL(teacher || student), the extra-loss gradient is
added (FedProj's weight-divergence invariant), determinism, parameter checks."""

from __future__ import annotations

import math

import pytest
import torch

from fedforget.methods.distill import DistillParams, DistillSpec, distill, kd_loss, public_logits
from fedforget.methods.params import validate_params
from fedforget.models import build_model
from fedforget.utils import FedForgetError


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    return build_model("mlp", (4,), 3, {"hidden": [8]})


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


# ----------------------------------------------------------------------------- kd_loss


@pytest.mark.parametrize("temperature", [1.0, 3.0, 0.5])
def test_kd_loss_is_exactly_zero_when_student_equals_teacher(temperature):
    z = torch.randn(7, 5, generator=torch.Generator().manual_seed(1)) * 4
    s = z.clone().requires_grad_(True)
    loss = kd_loss(s, z, temperature)
    assert loss.item() == 0.0
    loss.backward()  # the gradient softmax(s/T) - exp(log_softmax(z/T)) is 0 up to rounding
    torch.testing.assert_close(s.grad, torch.zeros_like(s), atol=1e-7, rtol=0)


def test_kd_loss_temperature_scaling_by_hand():
    teacher = torch.tensor([[0.0, 0.0]])  # p = (1/2, 1/2) at any T
    student = torch.tensor([[0.0, 2 * math.log(3.0)]])
    # T = 2: student/T = (0, ln 3) -> q = (1/4, 3/4)
    #   KL(p||q) = 1/2 ln((1/2)/(1/4)) + 1/2 ln((1/2)/(3/4)) = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3)
    #   T^2 * KL = 4 * 1/2 ln(4/3) = 2 ln(4/3) = 0.575364...
    assert kd_loss(student, teacher, 2.0).item() == pytest.approx(2 * math.log(4 / 3), rel=1e-6)
    # T = 1: q = (1/10, 9/10); KL = 1/2 ln 5 + 1/2 ln(5/9) = 1/2 ln(25/9) = ln(5/3) = 0.510826...
    assert kd_loss(student, teacher, 1.0).item() == pytest.approx(math.log(5 / 3), rel=1e-6)
    # batchmean: two identical rows give the same value as one
    two = kd_loss(student.repeat(2, 1), teacher.repeat(2, 1), 2.0).item()
    assert two == pytest.approx(2 * math.log(4 / 3), rel=1e-6)


# ----------------------------------------------------------------------------- distill


def test_distillation_lowers_kl_to_a_fixed_teacher():
    model = tiny_model(0)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 4, generator=g)
    teacher = torch.randn(64, 3, generator=g) * 2
    with torch.no_grad():
        expected_before = kd_loss(model(x), teacher, 3.0).item()
    spec = DistillSpec(epochs=30, temperature=3.0, lr=1e-2, batch_size=16, seed=0)
    stats = distill(model, x, teacher, spec)
    assert stats.steps == 30 * 4
    assert stats.kl_before == pytest.approx(expected_before, rel=1e-5)
    assert stats.loss_before == pytest.approx(stats.kl_before, rel=1e-9)  # no other terms
    assert stats.kl_after < 0.8 * stats.kl_before  # random targets: a 3-class MLP fits some
    with torch.no_grad():
        assert kd_loss(model(x), teacher, 3.0).item() == pytest.approx(stats.kl_after, rel=1e-5)


def test_extra_loss_gradient_is_added_to_every_step():
    """FedProj's invariant: with the KD term at its minimum (teacher = the student's own
    logits, zero gradient), one full-batch SGD step on alpha * ||theta - anchor||^2 moves
    theta by -lr * 2 * alpha * (theta - anchor), which is non-zero when anchor != theta."""
    model = tiny_model(3)
    x = torch.randn(10, 4, generator=torch.Generator().manual_seed(4))
    teacher = public_logits(model, x)
    theta = params_of(model)
    anchor = [t + 0.5 for t in theta]
    alpha, lr = 0.3, 0.1

    def div(student):
        return alpha * sum((p - a).pow(2).sum() for p, a in zip(student.parameters(), anchor))

    spec = DistillSpec(epochs=1, temperature=3.0, optimizer="sgd", lr=lr, batch_size=10)
    stats = distill(model, x, teacher, spec, extra_loss=div)
    assert stats.steps == 1
    assert stats.kl_before == pytest.approx(0.0, abs=1e-7)
    assert stats.loss_before == pytest.approx(alpha * 0.25 * sum(t.numel() for t in theta))
    for t, a, new in zip(theta, anchor, model.parameters()):
        grad = 2 * alpha * (t - a)  # d/dtheta alpha ||theta - anchor||^2
        assert torch.count_nonzero(grad) == grad.numel()
        torch.testing.assert_close(new.detach(), t - lr * grad, atol=1e-6, rtol=0)


def test_teacher_callable_equals_teacher_tensor_and_batch_loss_is_added():
    g = torch.Generator().manual_seed(5)
    x, teacher = torch.randn(40, 4, generator=g), torch.randn(40, 3, generator=g)
    spec = DistillSpec(epochs=3, temperature=2.0, batch_size=16, seed=7)
    a, b = tiny_model(1), tiny_model(1)
    distill(a, x, teacher, spec)
    seen = []
    distill(b, x, lambda idx, xb: seen.append(len(idx)) or teacher[idx], spec)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert seen[:3] == [16, 16, 8]  # 40 rows in batches of 16: the last batch is kept
    # the same KD written as a batch_loss (no teacher) gives the same weights
    c = tiny_model(1)
    distill(c, x, None, spec, batch_loss=lambda idx, f, z: kd_loss(z, teacher[idx], 2.0))
    for p, q in zip(a.parameters(), c.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


def test_batch_order_is_keyed_by_seed():
    g = torch.Generator().manual_seed(6)
    x, teacher = torch.randn(40, 4, generator=g), torch.randn(40, 3, generator=g)

    def run(seed):
        m = tiny_model(2)
        torch.manual_seed(999)  # the global RNG must not matter
        distill(m, x, teacher, DistillSpec(epochs=2, batch_size=8, lr=1e-2, seed=seed))
        return params_of(m)

    a, b, c = run(11), run(11), run(12)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not all(torch.equal(p, q) for p, q in zip(a, c))


def test_zero_epochs_leaves_student_untouched_and_mode_is_restored():
    m = tiny_model(0)
    before = params_of(m)
    m.eval()
    x = torch.randn(8, 4)
    stats = distill(m, x, torch.randn(8, 3), DistillSpec(epochs=0, schedule="cosine"))
    assert stats.steps == 0 and stats.kl_before == stats.kl_after
    assert all(torch.equal(p, q) for p, q in zip(before, m.parameters()))
    assert not m.training


def test_cosine_schedule_and_clipping_run():
    m = tiny_model(0)
    x, t = torch.randn(20, 4), torch.randn(20, 3) * 5
    stats = distill(m, x, t, DistillSpec(epochs=4, batch_size=8, schedule="cosine", max_grad_norm=5.0, lr=1e-2))  # fmt: skip
    assert stats.steps == 12 and math.isfinite(stats.kl_after)
    assert stats.kl_after < stats.kl_before


def test_public_logits_batched_equals_full_and_restores_mode():
    m = tiny_model(0)
    m.train()
    x = torch.randn(23, 4)
    z = public_logits(m, x, batch_size=5)
    assert m.training
    torch.testing.assert_close(z, m(x).detach())
    assert not z.requires_grad


def test_distill_rejects_mismatched_teacher_and_empty_objective():
    m, x = tiny_model(0), torch.randn(8, 4)
    with pytest.raises(ValueError, match="7 rows, the public set 8"):
        distill(m, x, torch.randn(7, 3), DistillSpec(epochs=1))
    with pytest.raises(ValueError, match="nothing to minimise"):
        distill(m, x, None, DistillSpec(epochs=1))


@pytest.mark.parametrize(
    "field,value",
    [
        ("distill_epochs", -1),
        ("distill_epochs", 1.5),
        ("distill_optimizer", "rmsprop"),
        ("distill_lr", 0.0),
        ("distill_lr", float("nan")),
        ("distill_momentum", 1.0),
        ("distill_batch_size", 0),
        ("distill_schedule", "step"),
        ("distill_max_grad_norm", -1.0),
    ],
)
def test_distill_params_check_names_the_field(field, value):
    with pytest.raises(FedForgetError, match=rf"\(method 'x'\): {field}="):
        validate_params("x", DistillParams, {field: value})
    validate_params("x", DistillParams, {})
