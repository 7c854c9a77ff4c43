"""Fed+SCR (methods/scr.py): SupCon against the code's loss written out anchor by anchor, the
second view's crop, flip, colour jitter and grayscale against hand values, the step (no
update before the buffer holds a row; then the memory batch joined to the minibatch), NCM
over the clients' averaged prototypes against hand values (``shared.class_means`` with
``average``; the pooled mean iCaRL uses unchanged), a split-digits run that resumes exactly,
and the refused settings (images only for SCR's augmentation, before any job)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedforget.config import TrainSpec
from fedforget.engine import Simulation
from fedforget.methods import ClientContext, RunInfo, ServerContext, check_params, make_params
from fedforget.methods.scr import (
    KEY,
    PROTOS,
    SCR,
    gray,
    rgb_to_hsv,
    scr_augment,
    supcon_loss,
    view_draws,
)
from fedforget.methods.shared import class_means
from fedforget.models import Classifier
from fedforget.parse import parse_config
from fedforget.partition import PartitionSpec
from fedforget.utils import FedForgetError

from .conftest import (
    BN_SHORT,
    CPU,
    SMALL_CNN,
    SMALL_RESNET,
    SPLIT,
    checkpoint_keeper,
    close_buffers,
    digits_cfg,
    run,
    same,
    strip,
)

SMALL = {"buffer_size": 40, "memory_batch_size": 16}


def code_supcon(features, labels, temperature):
    """SCR's ``SupConLoss.forward`` (contrast_mode 'all') written out anchor by anchor:
    features [N, V, d]."""
    n, v = features.shape[:2]
    f = torch.cat(torch.unbind(features, 1))  # [V N, d], view-major
    lab = labels.repeat(v)
    total = 0.0
    for i in range(v * n):
        others = [a for a in range(v * n) if a != i]
        denom = sum(math.exp(float(f[i] @ f[a]) / temperature) for a in others)
        pos = [p for p in others if lab[p] == lab[i]]
        total += -sum(float(f[i] @ f[p]) / temperature - math.log(denom) for p in pos) / len(pos)
    return total / (v * n)


def test_supcon_equals_the_codes_loss_anchor_by_anchor():
    g = torch.Generator().manual_seed(0)
    feats = F.normalize(torch.randn(6, 2, 5, generator=g, dtype=torch.float64), dim=2)
    y = torch.tensor([0, 1, 0, 2, 1, 1])
    got = supcon_loss(feats.transpose(0, 1).unsqueeze(0), y.unsqueeze(0), 0.07)
    assert math.isclose(float(got[0]), code_supcon(feats, y, 0.07), rel_tol=1e-9)
    # a stack: each client over its own real rows (client 1: its first 4, padding after)
    stack = torch.stack([feats, feats.roll(1, 0)]).transpose(1, 2)  # [2, V, N, d]
    labels = torch.stack([y, y.roll(1)])
    mask = torch.tensor([[1.0] * 6, [1.0] * 4 + [0.0] * 2], dtype=torch.float64)
    both = supcon_loss(stack, labels, 0.07, mask)
    assert math.isclose(float(both[0]), float(got[0]), rel_tol=1e-9)
    assert math.isclose(float(both[1]), code_supcon(feats.roll(1, 0)[:4], y.roll(1)[:4], 0.07), rel_tol=1e-9)
    # rows of one class gathered on one point, the classes apart: a lower loss
    centres = F.normalize(torch.eye(3, 5, dtype=torch.float64), dim=1)
    tight = centres[y].unsqueeze(0).expand(2, -1, -1)
    assert float(supcon_loss(tight.unsqueeze(0), y.unsqueeze(0), 0.07)[0]) < float(got[0])


def draws(b, **at):
    """[b, 11] draws giving the identity view (full crop, no flip, no jitter, no grayscale),
    with the named columns changed."""
    u = torch.tensor([1.0, 0.5, 0.5, 0.5, 0.9, 0.9, 0.5, 0.5, 0.5, 0.5, 0.9], dtype=torch.float64).repeat(b, 1)
    names = ["area", "ratio", "cx", "cy", "flip", "jitter", "bright", "contrast", "sat", "hue", "gray"]
    for k, v in at.items():
        u[:, names.index(k)] = v
    return u


def test_the_view_is_the_identity_at_a_full_crop_and_flips_jitters_greys_by_its_draws():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(3, 3, 6, 6, generator=g)
    torch.testing.assert_close(scr_augment(x, draws(3)), x, atol=1e-6, rtol=0)
    torch.testing.assert_close(scr_augment(x, draws(3, flip=0.1)), x.flip(-1), atol=1e-6, rtol=0)
    # brightness 1.2 alone (contrast 1, saturation 1, hue 0): clamp(1.2 p), through the normalisation
    mean, std = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)
    m, s = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    out = scr_augment((x - m) / s, draws(3, jitter=0.1, bright=0.75), mean, std)
    torch.testing.assert_close(out * s + m, (1.2 * x).clamp(0, 1), atol=1e-5, rtol=0)
    # contrast 0.6: 0.6 (p - mean luma) + mean luma
    lum = gray(x).mean((2, 3), keepdim=True)
    out = scr_augment(x, draws(3, jitter=0.1, contrast=0.0))
    torch.testing.assert_close(out, (0.6 * (x - lum) + lum).clamp(0, 1), atol=1e-5, rtol=0)
    # hue + 0.1 turn
    out = scr_augment(x, draws(3, jitter=0.1, hue=1.0))
    hsv = rgb_to_hsv(x)
    torch.testing.assert_close(rgb_to_hsv(out)[:, 0], (hsv[:, 0] + 0.1) % 1.0, atol=1e-4, rtol=0)
    grey = scr_augment(x, draws(3, gray=0.1))
    torch.testing.assert_close(grey, gray(x).expand(-1, 3, -1, -1), atol=1e-6, rtol=0)
    # a crop of a quarter of the area (half of each side) in the top-left corner, resized back:
    # output pixel k samples the box at 0.5 (k + 0.5) - 0.5 pixels (bilinear; clamped to the
    # image); on an image linear in its coordinates, that sample is the linear function there
    x1 = torch.arange(16.0).view(1, 1, 4, 4) / 16
    out = scr_augment(x1, draws(1, area=(0.25 - 0.2) / 0.8, cx=0.0, cy=0.0))
    at = (0.5 * torch.arange(4.0) - 0.25).clamp(0, 3)
    torch.testing.assert_close(out[0, 0], (4 * at.view(4, 1) + at.view(1, 4)) / 16, atol=1e-6, rtol=0)
    # keyed: the same draws, the same view; one-channel images: brightness and contrast only
    u = view_draws(3, torch.Generator().manual_seed(5))
    torch.testing.assert_close(scr_augment(x, u), scr_augment(x, u.clone()))
    assert scr_augment(x[:, :1], u).shape == (3, 1, 6, 6)


def info(num_classes=4):
    return RunInfo(CPU, num_classes, 0, 2, TrainSpec(), None, (1, 2, 2))


def test_a_step_joins_the_memory_batch_and_never_trains_the_classifier():
    """The client's first step (an empty buffer) contrasts its minibatch alone [D]; its rows
    then enter the buffer, and the next step joins a memory batch of them; the classifier
    gets no gradient (SCR trains no classifier)."""
    torch.manual_seed(0)
    method = SCR(make_params("scr", {**SMALL, "memory_batch_size": 3}), info())
    model = Classifier(nn.Flatten(), 4, 4)
    method.model_init(model)
    ctx = ClientContext(cid=0, round=1, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        global_params={}, broadcast={}, state={}, n_samples=8, lr=0.1, local_epochs=1,
                        batch_size=4, task=0)  # fmt: skip
    method.client_begin(ctx)
    method.scratch(ctx).to_offer = 8  # (no data view in this hand-built context)
    x, y = torch.rand(4, 1, 2, 2), torch.tensor([0, 1, 0, 1])
    loss = method.client_step(ctx, x, y)
    assert float(loss) > 0 and method.scratch(ctx).joined == 0
    assert model.head.weight.grad is None and model.scr_head[0].weight.grad.abs().sum() > 0
    assert method.replay.buffer.size(ctx.state) == 4
    model.zero_grad(set_to_none=True)
    ctx.steps += 1
    method.client_step(ctx, x + 1, y)
    assert method.scratch(ctx).joined == 3 and method.scratch(ctx).with_memory == 1
    assert method.replay.buffer.size(ctx.state) == 8 and model.head.weight.grad is None


def test_ncm_averages_the_clients_prototypes():
    """Two clients: class 0 held by both (prototypes (1, 0) and (0, 1): the average's
    direction is (1, 1)); class 1 by client 1 only; class 2 by a stale report; class 3 by none."""
    f = lambda *v: torch.tensor(v)  # noqa: E731
    entries = {
        0: {"sums": f([3.0, 0], [0, 0], [0, 0], [0, 0]), "counts": f(3, 0, 0, 0), "round": 4},
        1: {"sums": f([0.0, 2], [4, -4], [0, 0], [0, 0]), "counts": f(1, 2, 0, 0), "round": 4},
        2: {"sums": f([5.0, 5], [0, 0], [0, 3], [0, 0]), "counts": f(1, 0, 1, 0), "round": 2},
    }
    means, known = class_means(entries, True, CPU, average=True)
    torch.testing.assert_close(means[:3], F.normalize(f([1.0, 1], [1, -1], [0, 1]), dim=1))
    assert known.tolist() == [True, True, True, False]
    pooled, _ = class_means(entries, True, CPU)  # iCaRL's: (3, 2) / 4 normalised
    torch.testing.assert_close(pooled[0], F.normalize(f(3.0, 2), dim=0))
    model = Classifier(nn.Flatten(), 2, 4)
    server = ServerContext(4, {}, model, CPU, None, {PROTOS: entries})
    method = SCR(make_params("scr", {}), info())
    x = f([2.0, 0], [0, -1])
    d = ((F.normalize(x, dim=1).unsqueeze(1) - means[:3].unsqueeze(0)) ** 2).sum(2)
    want = torch.cat([-d, (-d).min(1, keepdim=True).values - 30.0], 1)
    torch.testing.assert_close(method.eval_predict(server, model, x, None), want)
    assert method.eval_predict(server, Classifier(nn.Flatten(), 2, 4), x, None).shape == (2, 4)  # a local model: logits


def test_split_digits_run_trains_reports_and_resumes_exactly(make_run_config):
    """Class-IL split digits, 3 tasks x 2 rounds, 3 of 4 clients a round: buffers fill, every
    sampled client reports its prototypes after each aggregation, NCM scores the server's
    model; resumed after round 3 (mid task 1) and 4 (a task end): the same rows and state."""
    rc = digits_cfg(make_run_config, "scr", SMALL, rounds=6, checkpoint_every=1, sample_rate=0.75)
    rc = replace(rc, dataset=replace(rc.dataset, scenario={**rc.dataset.scenario, "rounds_per_task": 2}))
    full = Simulation(rc, device=CPU)
    saved, keep = checkpoint_keeper()
    status, rows, msg = full.run(progress=False, on_checkpoint=keep)
    assert status == "completed", msg
    assert all(r["scr_buffer_size"] > 0 and 0 < r["scr_memory_steps"] <= 1 for r in rows[1:])  # rows[0]: round 0
    assert rows[-1]["scr_proto_classes"] == 6 and rows[1]["scr_proto_classes"] == 2
    assert rows[-1]["global_model_test_acc"] > 1 / 6 + 0.1  # NCM over the seen classes beats chance
    assert set(full.server.state[PROTOS]) == set(full.client_state)
    assert all(len(st[KEY]["y"]) == SMALL["buffer_size"] for st in full.client_state.values())
    for stop in (3, 4):
        sim = Simulation(rc, device=CPU)
        status, resumed, msg = sim.run(progress=False, resume=next(c for c in saved if c["round"] == stop))
        assert status == "completed", msg
        assert strip(resumed) == strip(rows)
        assert same(sim.server.state, full.server.state) and same(sim.client_state, full.client_state)
        assert same(sim.global_params, full.global_params)


@pytest.mark.parametrize(
    "model,heads",
    [("cnn2d", "shared"),  # wide steps client by client in replicas, tails batched; SCR's views
     ("cnn2d", "per_task"),  # per-task heads (never read by SCR)
     ("resnet8", "shared")],  # BatchNorm: each client's statistics see its joined rows, then its view
)  # fmt: skip
def test_trains_stacked_as_sequential(make_run_config, run_engines, assert_same_metrics, model, heads):
    """Issue 32: SCR's step as live terms over each client's minibatch joined with its memory
    batch, its second view through the stack's weights, within 1e-5 of one client after
    another (metrics, prototypes, buffers, weights). [D] With BatchNorm at BN_SHORT's lr
    (conftest.BN_SHORT says why): at 0.05, on an AMD EPYC's kernels (2026-12-06), a test row
    was predicted otherwise after 2 rounds (6.1e-5 in the global accuracy, 0.500 against
    0.511 in the top prediction's share; CI's machine had passed it)."""
    bn = model == "resnet8"
    rc = make_run_config(
        dataset="digits", model=model, model_options=SMALL_RESNET if bn else SMALL_CNN, method="scr", params=SMALL,
        scenario={**SPLIT, "incremental": "class", "heads": heads}, rounds=2 if bn else 3, batch_size=32,
        local_epochs=1 if bn else 2, sample_rate=0.75, eval_local_models=False, eval_every=1,
        optimizer={"lr": BN_SHORT["optimizer"]["lr"] if bn else 0.05, "momentum": 0.9, "weight_decay": 1e-3}, drop_last=bn,
        partition=PartitionSpec("dirichlet", clients=5, alpha=0.5, min_size=5, seed=0),
    )  # fmt: skip
    out = run_engines(rc)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert vec.engine_info["client_engine"] == "vectorized"
    assert_same_metrics(rows_s, rows_v)
    assert rows_s[-1]["scr_memory_steps"] > 0
    for k, v in seq.global_params.items():
        torch.testing.assert_close(v.float(), vec.global_params[k].float(), atol=1e-4 if bn else 1e-5, rtol=1e-5, msg=k)
    close_buffers(seq, vec, key=KEY)
    for cid, rep in seq.server.state[PROTOS].items():
        torch.testing.assert_close(rep["sums"], vec.server.state[PROTOS][cid]["sums"], atol=1e-4, rtol=1e-4)


def test_the_views_are_keyed_so_another_view_rule_changes_the_run(make_run_config):
    _, rows_scr = run(digits_cfg(make_run_config, "scr", SMALL, rounds=2))
    _, rows_ds = run(digits_cfg(make_run_config, "scr", {**SMALL, "views": "dataset"}, rounds=2))
    assert strip(rows_scr, "scr") != strip(rows_ds, "scr")


@pytest.mark.parametrize(
    "params,match",
    [({"views": "none"}, "views='none'"), ({"temperature": 0}, "temperature=0"), ({"memory_batch_size": 0}, "memory_batch_size=0")],
)  # fmt: skip
def test_bad_params_name_the_value(params, match):
    with pytest.raises(FedForgetError, match=match):
        check_params("scr", params)


def test_scrs_augmentation_on_a_model_of_flat_inputs_is_refused_before_any_job():
    cfg = {
        "experiments": [{
            "name": "e", "datasets": [{"name": "digits", "model": "mlp"}],
            "partitions": [{"scheme": "iid", "clients": 2}],
            "methods": [{"name": "scr"}, {"name": "scr", "label": "scr-ds", "params": {"views": "dataset"}}],
            "seeds": [0], "train": {"rounds": 2},
        }],
    }  # fmt: skip
    with pytest.raises(FedForgetError, match=r"datasets\[0\]\.model \(method 'scr'\).*model 'mlp' takes inputs of rank 1") as e:
        parse_config(cfg)
    assert "scr-ds" not in str(e.value)


def test_defaults_follow_the_code():
    p = check_params("scr", {})
    assert (p["buffer_size"], p["memory_batch_size"], p["temperature"], p["proj_dim"], p["views"]) == (
        5000, 100, 0.07, 128, "scr",
    )  # fmt: skip
