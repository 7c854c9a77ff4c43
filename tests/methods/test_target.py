"""TARGET and LANDER (methods/target.py, methods/lander.py, methods/synthesis.py): the
generator's loss falls against a fixed model, its terms (BN statistics, boundary, LTE
bounding) against hand values, the clients' KD on synthetic rows and LANDER's local loss
against hand values, replayed rows are rows of the server's synthetic pool (with a dataset
augmentation: their keyed crops, which the pool's teacher scores on the client; without:
the KD of the teacher's logits on the pool rows as made), the label embeddings are
MiniLM's, split-digits runs (class-IL, task-IL with per-task heads, domain-IL), exact
resume mid-task and at a task boundary, FedGP over TARGET."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedforget.config import TrainSpec
from fedforget.data.scenario import Scenario, resolve_scenario
from fedforget.engine import Simulation
from fedforget.inputs import REPLAY_AUGMENT_STREAM, crop_flip
from fedforget.methods import ClientContext, RunInfo, check_params, make_params
from fedforget.methods import target as target_module
from fedforget.methods.base import STEP_TERMS, ServerContext, frozen_copy
from fedforget.methods.distill import softened_kl
from fedforget.methods.lander import (
    LANDER,
    LTE,
    LanderSynthesizer,
    bounding_loss,
    embedding_dim,
    encode,
    label_embeddings,
    label_texts,
)
from fedforget.methods.synthesis import (
    BNStatsLoss,
    SynthesisResult,
    Synthesizer,
    boundary_loss,
    score_pool,
)
from fedforget.methods.target import (
    REPLAY_STREAM,
    TARGET,
    TEACHER,
    code_replay_rows,
    target_replay_rows,
)
from fedforget.models import Classifier
from fedforget.partition import PartitionSpec
from fedforget.utils import FedForgetError, torch_seed

from .conftest import (
    CPU,
    SMALL_CNN,
    SMALL_RESNET,
    SPLIT,
    checkpoint_keeper,
    digits_cfg,
    run,
    same,
    strip,
)

# tiny synthesis budgets (the defaults are the papers')
TINY = dict(
    syn_size=40,
    syn_batch=16,
    syn_rounds=3,
    g_steps=3,
    warmup=1,
    nz=8,
    ngf=4,
    student_steps=2,
    student_batch=8,
)
TINY_L = {**TINY, "warmup": 0}
AUG = {"kind": "crop_flip", "pad": 2}  # a dataset augmentation block
_P = 2_147_483_647  # LANDER: rounds 0..2 store, round 2 has the boundary term


def split_info(input_shape=(1, 4, 4), tasks=2):
    spec = resolve_scenario(
        {"kind": "split", "tasks": tasks, "classes_per_task": 2}, 4, input_shape, "s"
    )
    return RunInfo(CPU, 4, 0, 2, TrainSpec(), Scenario.build(spec, 4, input_shape, tasks), input_shape,
                   ("0", "1", "cat", "dog"))  # fmt: skip


def toy_teacher(seed=0, lte=False):
    """A fixed conv model on 1x4x4 inputs, 4 classes, whose BatchNorm statistics are those of
    its "training data" (squared uniform images): what a generator can match."""
    torch.manual_seed(seed)
    body = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3, momentum=None), nn.ReLU(),
                         nn.Flatten(), nn.Linear(48, 6), nn.ReLU())  # fmt: skip
    model = Classifier(body, 6, 4)
    if lte:
        model.lte_map = nn.Linear(6, 5)
    with torch.no_grad():
        model.train()(torch.rand(256, 1, 4, 4) ** 2)
    return frozen_copy(model)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run faster on one thread (as the runs' train.threads = 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def ctx_for(model, broadcast, task, cid=0, rnd=3, n=8, batch=4):
    return ClientContext(
        cid=cid, round=rnd, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), global_params={},
        broadcast=broadcast, state={}, n_samples=n, lr=0.1, local_epochs=1, batch_size=batch, task=task,
    )  # fmt: skip


def linear_teacher(bias, lte=0):
    """The weights of a Flatten-body classifier on 1x4x4 rows whose logits are ``bias`` on
    every row (and, with ``lte`` > 0, LTE features 0 of that width)."""
    model = Classifier(nn.Flatten(), 16, len(bias))
    with torch.no_grad():
        model.head.weight.zero_(), model.head.bias.copy_(bias)
    if lte:
        model.lte_map = nn.Linear(16, lte)
        nn.init.zeros_(model.lte_map.weight), nn.init.zeros_(model.lte_map.bias)
    return model.state_dict()


# ----------------------------------------------------------------------------- the generator


@pytest.mark.parametrize("variant", ["target", "lander"])
def test_the_generator_loss_falls_against_a_fixed_model(variant):
    """One synthesis round of 40 steps against a fixed BatchNorm model: L_gen (bn + CE,
    LANDER with its LTE term) goes down; the kept batch is the lowest-loss iterate."""
    info = split_info()
    classes = torch.arange(4)
    params = {
        **TINY,
        "syn_rounds": 1,
        "g_steps": 40,
        "adv": 0.0,
        "student_steps": 0,
        "lr_g": 0.01,
        "lr_z": 0.05,
    }
    if variant == "target":
        synth = Synthesizer(
            make_params("target", params), toy_teacher(), classes, info.input_shape, CPU, (0, 0)
        )
    else:
        lte = F.normalize(torch.randn(4, 5, generator=torch.Generator().manual_seed(1)), dim=1)
        p = make_params("lander", {**params, "warmup": 0, "bn": 1.0})
        synth = LanderSynthesizer(
            p, toy_teacher(lte=True), classes, info.input_shape, CPU, (0, 0), lte
        )
    res = synth.run()
    losses = res.losses[0]
    assert len(losses) == 40 and res.stats["bn_layers"] == 1.0
    assert sum(losses[-5:]) < 0.85 * sum(losses[:5]), losses
    assert res.x.shape == (16, 1, 4, 4) and set(res.y.tolist()) <= {0, 1, 2, 3}


def test_generated_images_are_normalised_as_the_data_pipeline_normalises_stored_images():
    """A pipeline normalising by mean 0.5, std 0.25 (reported by the clients at the task end):
    the pool holds (sigmoid - 0.5) / 0.25, in [-2, 2] and beyond [0, 1]."""
    p = make_params("target", {**TINY, "syn_rounds": 1, "adv": 0.0, "student_steps": 0})
    teacher = toy_teacher()
    plain = Synthesizer(p, teacher, torch.arange(4), (1, 4, 4), CPU, (0, 0)).run().x
    normed = (
        Synthesizer(p, teacher, torch.arange(4), (1, 4, 4), CPU, (0, 0), ((0.5,), (0.25,))).run().x
    )
    assert ((plain > 0) & (plain < 1)).all() and normed.min() >= -2 and normed.max() <= 2
    assert (normed.abs() > 1).any()


@pytest.mark.parametrize("init", ["model", "code"])
def test_the_student_is_reinitialised(init):
    """student_init: model (each module's reset_parameters) or code (the code's weight_init:
    BatchNorm weights N(1, 0.02), Linear / conv biases N(0, 1)); the teacher is untouched."""
    p = make_params("target", {**TINY, "student_init": init})
    teacher = toy_teacher()
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    student = Synthesizer(p, teacher, torch.arange(4), (1, 4, 4), CPU, (0, 0)).student
    bn, lin = student.body[1], student.body[4]
    assert all(torch.equal(v, teacher.state_dict()[k]) for k, v in before.items())
    assert all(q.requires_grad for q in student.parameters())
    assert not torch.equal(lin.weight, teacher.body[4].weight)
    if init == "model":
        assert torch.equal(bn.weight, torch.ones(3)) and lin.bias.abs().max() <= 48**-0.5
    else:
        assert not torch.equal(bn.weight, torch.ones(3)) and (bn.weight - 1).abs().max() < 0.1
        assert lin.bias.abs().max() > 48**-0.5  # N(0, 1)


def test_bn_statistics_loss_equals_the_hand_formula_with_momentum():
    bn = nn.BatchNorm2d(2).eval()
    with torch.no_grad():
        bn.running_mean.copy_(torch.tensor([1.0, -1.0]))
        bn.running_var.copy_(torch.tensor([2.0, 0.5]))
    loss = BNStatsLoss(bn, momentum=0.5)
    x = torch.tensor([[[[0.0, 2.0]], [[1.0, 1.0]]], [[[4.0, 2.0]], [[3.0, 3.0]]]])  # [2, 2, 1, 2]
    bn(x)
    # channel 0: mean 2, var 2; channel 1: mean 2, var 1
    hand = math.hypot(2 - 2, 0.5 - 1) + math.hypot(1 - 2, -1 - 2)
    assert abs(float(loss.loss(x)) - hand) < 1e-6
    loss.end_round()  # avg <- (mean 2 | 2, var 2 | 1)
    bn(x + 2.0)  # means 4 | 4, variances unchanged: mixed 3 | 3
    hand = math.hypot(2 - 2, 0.5 - 1) + math.hypot(1 - 3, -1 - 3)
    assert abs(float(loss.loss(x)) - hand) < 1e-6
    loss.close()
    assert not bn._forward_hooks


def test_bn_statistics_loss_stays_finite_where_a_variance_squared_overflows_float32():
    """A generator far from the data drove a deep layer's batch variance to 1e19 at smoke
    scale: squared, past float32's range, the loss was inf and TARGET's pool NaN (a diverged
    run). The norm is then taken in float64: finite, with a finite gradient."""
    bn = nn.BatchNorm1d(2).eval()
    loss = BNStatsLoss(bn, momentum=0.0)
    x = torch.tensor([[1e10, 1.0], [-1e10, 2.0]], requires_grad=True)  # channel 0: var 1e20, squared 1e40 > float32
    bn(x)
    value = loss.loss(x)
    assert torch.isfinite(value) and float(value.detach()) > 9e19
    value.backward()
    assert torch.isfinite(x.grad).all()
    loss.close()


def test_boundary_loss_is_minus_the_kl_on_agreeing_rows():
    s = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    t = torch.tensor([[2.0, 0.0], [3.0, 0.0]])  # row 0 agrees (class 0), row 1 does not
    pt, ps = torch.softmax(t[0], 0), torch.softmax(s[0], 0)
    kl = float((pt * (pt / ps).log()).sum())
    assert abs(float(boundary_loss(s, t)) - (-kl / 2)) < 1e-6


# ----------------------------------------------------------------------------- clients


def test_kd_on_a_synthetic_batch_equals_the_hand_value():
    """One pool row, old classes {0, 1}, teacher logits (2, 0 | 5, -1), a student scoring 0
    everywhere, tau = 2: KL(softmax(1, 0) || (1/2, 1/2)), times kd; the CE scores the row's
    task (classes 2, 3) alone."""
    info = split_info()
    method = TARGET(make_params("target", {"kd": 3.0, "temperature": 2.0}), info)
    model = Classifier(nn.Flatten(), 16, 4)
    nn.init.zeros_(model.head.weight), nn.init.zeros_(model.head.bias)
    teacher = linear_teacher(torch.tensor([2.0, 0.0, 5.0, -1.0]))  # these logits on any row
    pool = {"x": torch.rand(1, 1, 4, 4), "y": torch.tensor([1]), "task": 0, TEACHER: teacher}
    ctx = ctx_for(model, {"target_pool": pool}, task=1)
    method.client_begin(ctx)
    x, y = torch.rand(1, 1, 4, 4), torch.tensor([2])
    kd = float(method.client_loss(ctx, x, y, None, model(x))[STEP_TERMS].detach())  # its step term
    p = math.e / (1 + math.e)
    hand = 3.0 * (p * math.log(2 * p) + (1 - p) * math.log(2 * (1 - p)))
    assert abs(kd - hand) < 1e-6 and abs(hand - 0.332832) < 1e-6
    logits = torch.tensor([[1.0, 9.0, 0.5, -0.5]])
    ce = float(method.client_loss(ctx, x, y, None, logits)["task"])
    assert abs(ce - math.log(1 + math.exp(-1.0))) < 1e-6  # softmax over (0.5, -0.5) alone


def test_replay_draws_rows_of_the_pool():
    info = split_info()
    method = TARGET(make_params("target", {"replay_batch": 3}), info)
    pool = {
        "x": torch.rand(10, 1, 4, 4),
        "y": torch.zeros(10, dtype=torch.long),
        "task": 0,
        TEACHER: Classifier(nn.Flatten(), 16, 4).state_dict(),
    }
    ctx = ctx_for(Classifier(nn.Flatten(), 16, 4), {"target_pool": pool}, task=1)
    method.client_begin(ctx)
    rep = method.synthetic_batch(ctx)
    assert rep.idx.unique().numel() == 3 and torch.equal(rep.x, pool["x"][rep.idx])
    # auto size: floor(syn_size / steps per epoch), at most the pool
    method = TARGET(make_params("target", {"syn_size": 12}), info)
    assert method.replay_rows(ctx_for(ctx.model, {}, 1, n=8, batch=4), 10) == 6


def test_code_replay_rule_rows_per_step_follow_the_nominal_step_count():
    """replay_rule code [C get_syn_data_loader]: int(syn_size / iters), iters = ceil(dataset
    rows / (clients x tasks x batch)), at most the pool; FedProTIP's CIFAR-100 layout
    (50,000 rows, 5 clients, 10 tasks, batch 64, syn_size 8,000): iters 16, 500 rows."""
    assert code_replay_rows(0, 8000, 2560, 50_000, 5, 10, 64) == 500
    assert code_replay_rows(0, 8000, 300, 50_000, 5, 10, 64) == 300  # the whole pool
    assert code_replay_rows(7, 8000, 2560, 50_000, 5, 10, 64) == 7  # replay_batch fixes it
    assert code_replay_rows(0, 3, 2560, 50_000, 5, 10, 64) == 1  # at least one row
    # the default rule divides by the client's own steps: 1,000 rows -> 16 steps -> 500 rows
    assert target_replay_rows(0, 8000, 2560, 1000, 64) == 500
    assert target_replay_rows(0, 8000, 2560, 3000, 64) == 170  # 47 steps: more rows per epoch


def test_code_replay_rule_cuts_the_epoch_and_walks_one_shuffle_per_epoch():
    """Under the code's rule a client's epoch stops when the synthetic loader runs out
    (ctx.epoch_steps = min(private minibatches, ceil(pool / rows))), and an epoch's
    batches are one permutation of the pool taken in order, the last one short; the next
    epoch shuffles again."""
    info = split_info()  # 2 clients, 2 tasks, batch 64 (TrainSpec defaults)
    pool = {"x": torch.rand(10, 1, 4, 4), "y": torch.zeros(10, dtype=torch.long), "task": 0,
            TEACHER: Classifier(nn.Flatten(), 16, 4).state_dict()}  # fmt: skip
    method = TARGET(make_params("target", {"replay_rule": "code", "replay_batch": 4}), info)
    ctx = ctx_for(Classifier(nn.Flatten(), 16, 4), {"target_pool": pool}, task=1, n=40, batch=4)
    method.client_begin(ctx)
    assert ctx.epoch_steps == 3  # 10 private minibatches, ceil(10 / 4) = 3 synthetic ones
    epochs = []
    for _ in range(2):
        idx = []
        for _ in range(ctx.epoch_steps):
            idx.append(method.synthetic_batch(ctx).idx)
            ctx.steps += 1
        assert [len(i) for i in idx] == [4, 4, 2]
        assert sorted(torch.cat(idx).tolist()) == list(range(10))
        epochs.append(torch.cat(idx))
    assert not torch.equal(epochs[0], epochs[1])
    # the default rule leaves epochs whole
    ctx = ctx_for(ctx.model, {"target_pool": pool}, task=1, n=40, batch=4)
    TARGET(make_params("target", {"replay_batch": 4}), info).client_begin(ctx)
    assert ctx.epoch_steps is None


def test_code_replay_rule_trains_the_cut_epochs(make_run_config, monkeypatch):
    """In a split-digits run under the code's rule each client of a task with a pool trains
    epoch_steps x local_epochs steps (its epochs cut), and task 0 (no pool) whole epochs;
    the rule is recorded in the tables' method note."""
    ends = []
    original = TARGET.client_end

    def spy(self, ctx):
        ends.append((ctx.task, ctx.steps, ctx.epoch_steps, ctx.n_samples))
        return original(self, ctx)

    monkeypatch.setattr(TARGET, "client_end", spy)
    params = {**TINY, "replay_rule": "code", "syn_size": 40, "replay_batch": 16}
    _, rows = run(digits_cfg(make_run_config, "target", params, local_epochs=2))
    later = [e for e in ends if e[0] > 0]
    assert later and all(steps == cut * 2 for _, steps, cut, _ in later)
    assert any(cut < math.ceil(n / 32) for _, _, cut, n in later)  # some epoch was cut
    assert all(cut is None and steps == 2 * math.ceil(n / 32) for t, steps, cut, n in ends if t == 0)
    assert rows[-1]["target_epoch_steps"] >= 1
    assert "replay_rule=code" in TARGET.table_note({"replay_rule": "code"})
    assert "replay_rule=steps" in TARGET.table_note({}) and LANDER.table_note({}) == ""


def test_replayed_batches_come_from_the_servers_synthetic_pool(make_run_config, monkeypatch):
    """In a split-digits run every replayed batch is rows of the pool the server broadcast,
    the pool was made by the generator (sigmoid images, targets among the teacher's classes)
    and none of its rows is a training row."""
    seen = []
    original = TARGET.synthetic_rows

    def spy(self, ctx, k):
        idx, x = original(self, ctx, k)
        seen.append((ctx.task, ctx.broadcast["target_pool"], idx, x))
        return idx, x

    monkeypatch.setattr(TARGET, "synthetic_rows", spy)
    sim, rows = run(digits_cfg(make_run_config, "target", TINY))
    assert {t for t, _, _, _ in seen} == {1, 2}
    every = torch.arange(len(sim.clients.rows))
    real = sim.clients.batch(every)[0].flatten(1)  # every training row, as the model sees it
    for task, pool, idx, x in seen:
        assert pool["task"] == task - 1 and torch.equal(x, pool["x"][idx])
        assert set(pool["y"].tolist()) <= set(range(2 * task))  # classes of tasks 0 .. task - 1
        assert ((pool["x"] > 0) & (pool["x"] < 1)).all()
        assert torch.cdist(x.flatten(1), real).min() > 0
    assert seen[-1][1] is sim.server.state["target_pool"]
    assert rows[-1]["target_kd"] > 0 and rows[1]["target_bn_layers"] == 0.0  # cnn2d: no BatchNorm


@pytest.mark.parametrize("variant", ["target", "lander"])
def test_unaugmented_kd_equals_the_kd_on_the_teachers_precomputed_pool_logits(variant):
    """Without augmentation the replayed rows are the pool's rows, and the teacher's logits
    (LANDER: and LTE features) on them, computed each step on the client, equal those of
    scoring the whole pool once (the earlier precomputed form), so the KD terms agree."""
    info = split_info()
    cls = TARGET if variant == "target" else LANDER
    method = cls(make_params(variant, {"replay_batch": 8}), info)
    teacher = toy_teacher(0, lte=True)
    pool_x = torch.rand(40, 1, 4, 4) ** 2
    pool = {"x": pool_x, "y": torch.zeros(40, dtype=torch.long), "task": 0,
            TEACHER: teacher.state_dict()}  # fmt: skip
    student = toy_teacher(1, lte=True).train()
    ctx = ctx_for(student, {f"{variant}_pool": pool}, task=1)
    method.client_begin(ctx)
    old_logits, old_att = score_pool(teacher, pool_x, lambda m, z: m.lte_map(z))
    for _ in range(3):
        rep = method.synthetic_batch(ctx)
        assert torch.equal(rep.x, pool_x[rep.idx]) and not rep.t_logits.requires_grad
        old = torch.tensor([0, 1])
        precomputed = softened_kl(rep.logits[:, old], old_logits[rep.idx][:, old], 2.0)
        assert abs(float(method.kd_term(ctx, rep)) - float(precomputed)) < 1e-5
        if variant == "lander":
            assert torch.allclose(rep.t_feats, old_att[rep.idx], atol=1e-5)
        else:
            assert rep.t_feats is None
    assert not method.scratch(ctx).teacher.training


def test_augmented_replay_is_augment_rows_of_the_pool_scored_by_the_teacher(
    make_run_config, monkeypatch
):
    """With a dataset augmentation (digits, crop_flip): each replayed batch is crop_flip of
    the drawn pool rows keyed by (seed, stream 0xB1, round, client, step, pool index), and
    the teacher's logits are a direct forward of the pool's teacher on those augmented rows
    (not on the rows as made)."""
    seen, scored = [], []
    original = TARGET.synthetic_rows

    def spy(self, ctx, k):
        idx, x = original(self, ctx, k)
        pool = ctx.broadcast["target_pool"]
        salt = torch_seed(self.info.seed, REPLAY_AUGMENT_STREAM, REPLAY_STREAM, ctx.round, ctx.cid, k) % _P  # fmt: skip
        assert k == ctx.steps and torch.equal(x, crop_flip(pool["x"][idx], idx, salt, AUG["pad"]))
        teacher = frozen_copy(ctx.model)
        teacher.load_state_dict(pool[TEACHER])
        seen.append((x, pool["x"][idx], teacher(x), teacher(pool["x"][idx])))
        return idx, x

    def score_spy(model, x, map_features=None):
        out = score_pool(model, x, map_features)
        scored.append((x, out[0]))
        return out

    monkeypatch.setattr(TARGET, "synthetic_rows", spy)
    monkeypatch.setattr(target_module, "score_pool", score_spy)
    rc = digits_cfg(make_run_config, "target", TINY)
    sim, rows = run(replace(rc, dataset=replace(rc.dataset, augment=AUG)))
    assert len(seen) > 2 and rows[-1]["target_kd"] > 0
    assert all(
        not torch.equal(x, raw) and not torch.allclose(t, t_raw) for x, raw, t, t_raw in seen
    )
    # the teacher scored the augmented rows themselves, as a direct forward of its weights
    steps = [(x, t) for x, t in scored if any(x is aug for aug, *_ in seen)]
    assert len(steps) == len(seen)
    for (x, t_logits), (aug, _, direct, _) in zip(steps, seen):
        assert x is aug and torch.allclose(t_logits, direct, atol=1e-6)


def test_prediction_hides_classes_of_tasks_not_started():
    method = TARGET(make_params("target", {}), split_info())
    model = Classifier(nn.Flatten(), 16, 4)
    server = ServerContext(1, {}, model, CPU, None)
    x = torch.rand(3, 1, 4, 4)
    scores = method.eval_predict(server, model, x, None)
    raw = model.logits(x)
    assert torch.equal(scores[:, :2], raw[:, :2])
    assert torch.allclose(scores[:, 2:], raw[:, :2].min(1, keepdim=True).values.expand(3, 2) - 30.0)
    server.task = 1
    assert torch.equal(method.eval_predict(server, model, x, None), raw)


def test_models_of_token_ids_are_refused():
    method = TARGET(make_params("target", {}), split_info())
    with pytest.raises(FedForgetError, match="token ids"):
        method.model_init(Classifier(nn.Sequential(nn.Embedding(10, 4), nn.Flatten()), 8, 4))


# ----------------------------------------------------------------------------- LANDER


def test_label_embeddings_are_minilm_sentence_embeddings():
    texts = label_texts(["3", "cat", "aquarium_fish"], "a photo of a {}")
    assert texts == ["a photo of a digit 3", "a photo of a cat", "a photo of a aquarium fish"]
    first = encode(texts)
    assert first.shape == (3, embedding_dim()) == (3, 384) and first.dtype == torch.float32
    assert torch.allclose(first.norm(dim=1), torch.ones(3), atol=1e-5)
    assert torch.equal(label_embeddings(texts), first)  # computed again: the same numbers
    assert torch.equal(label_embeddings(texts), first)  # memoised
    digits = encode(label_texts(["4"], "a photo of a {}"))[0]
    # "digit 3" is nearer "digit 4" than "cat" is
    assert float(first[0] @ digits) > float(first[1] @ digits)


# the first ten CIFAR-100 class names
CIFAR100_SOME = ["apple", "aquarium_fish", "baby", "bear", "beaver", "bed", "bee", "beetle", "bicycle", "bottle"]


@pytest.mark.parametrize("names", [[str(i) for i in range(10)], CIFAR100_SOME])
def test_anchors_at_the_codes_scale_separate_the_classes(names):
    """Issue 36, 1: unit-norm anchors lie within r = 0.015 of every other class's (the
    bounding loss of a row at its own anchor is as small against any class's); at
    anchor_norm 9.7 a row at its own anchor is outside the radius of every other class, so
    the loss tells classes apart."""
    p = make_params("lander", {})
    unit = label_embeddings(label_texts(names, p.prompt))
    pair = lambda e: torch.stack([((e[i] - e[j]) ** 2).mean() for i in range(len(e)) for j in range(len(e)) if i != j])  # noqa: E731
    assert float(pair(unit).max()) < p.r  # inert: every anchor inside every class's bound
    anchors = p.anchor_norm * unit
    assert float(pair(anchors).min()) > p.r
    for c in range(len(names)):  # features exactly at class c's anchor
        a = anchors[c].expand(4, -1)
        losses = torch.stack([bounding_loss(a, anchors[k].expand(4, -1), p.r) for k in range(len(names))])
        assert float(losses[c]) == 0.0 and bool((losses[torch.arange(len(names)) != c] > 0).all())


@pytest.mark.parametrize("value", [0, -1.0])
def test_a_bad_anchor_norm_is_named(value):
    from fedforget.methods import check_params

    with pytest.raises(FedForgetError, match=f"anchor_norm={value}"):
        check_params("lander", {"anchor_norm": value})


def test_bounding_loss_on_a_hand_built_batch():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    anchors = torch.zeros(2, 2)
    assert abs(float(bounding_loss(a, anchors, 0.2)) - 0.3) < 1e-7  # mean square 0.5 - 0.2
    assert float(bounding_loss(a, anchors, 0.6)) == 0.0  # inside the radius


def test_lander_local_loss_equals_the_hand_formula():
    """Task 0 (no pool): CE over the task's classes + ltc * max(0, MSE(lte_map(z), e_y) - r);
    the cur / pre weights of a later task: alpha = log2(3), beta = sqrt(1/2)."""
    info = split_info()
    method = LANDER(make_params("lander", {"ltc": 2.0, "r": 0.01}), info)
    model = Classifier(nn.Flatten(), 16, 4)
    model.lte_map = nn.Linear(16, 3)
    lte = torch.eye(4, 3)
    ctx = ctx_for(model, {LTE: lte}, task=0)
    method.client_begin(ctx)
    x, y = torch.rand(2, 1, 4, 4), torch.tensor([0, 1])
    z, logits = model.forward_with_features(x)
    ce = F.cross_entropy(logits[:, :2], y)
    bound = torch.relu(((model.lte_map(z) - lte[y]) ** 2).mean() - 0.01)
    assert torch.allclose(method.batch_loss(ctx, x, y), ce + 2.0 * bound)
    teacher = linear_teacher(torch.zeros(4), lte=3)  # logits and LTE features 0 on any row
    pool = {
        "x": torch.rand(4, 1, 4, 4),
        "y": torch.zeros(4, dtype=torch.long),
        "task": 0,
        TEACHER: teacher,
    }
    ctx = ctx_for(model, {LTE: lte, "lander_pool": pool}, task=1, batch=4)  # replays all 4 rows
    method.client_begin(ctx)
    cur, pre = method.weights(ctx)
    alpha, beta = math.log2(3), math.sqrt(0.5)
    assert abs(cur - 0.2 * (1 + 1 / alpha) / beta) < 1e-12 and abs(pre - 0.4 * alpha * beta) < 1e-12
    # task 1: cur (CE + ltc B) + pre (kd KL(uniform || student on classes 0, 1) + MSE(a, 0))
    y = torch.tensor([2, 3])
    z, logits = model.forward_with_features(x)
    ce = F.cross_entropy(logits[:, 2:], y - 2)
    bound = torch.relu(((model.lte_map(z) - lte[y]) ** 2).mean() - 0.01)
    zs, ls = model.forward_with_features(pool["x"])
    logq = F.log_softmax(ls[:, :2] / 2.0, 1)
    kl = (0.5 * (math.log(0.5) - logq)).sum(1).mean()  # the teacher is uniform on classes 0, 1
    fkd = (model.lte_map(zs) ** 2).mean()
    hand = cur * (ce + 2.0 * bound) + pre * (kl + fkd)
    assert torch.allclose(method.batch_loss(ctx, x, y), hand, atol=1e-6)


# ----------------------------------------------------------------------------- runs


def resume_cfg(make_run_config, method, params):
    rc = digits_cfg(make_run_config, method, params, rounds=6, checkpoint_every=1, sample_rate=0.75)
    return replace(
        rc, dataset=replace(rc.dataset, scenario={**rc.dataset.scenario, "rounds_per_task": 2})
    )


@pytest.mark.parametrize("method,params", [("target", TINY), ("lander", TINY_L)])
def test_split_digits_run_resumes_exactly_mid_task_and_at_a_boundary(
    make_run_config, method, params
):
    """Class-IL split digits, 3 tasks x 2 rounds: pools made at the ends of tasks 0 and 1 and
    replayed after; resumed after round 3 (mid task 1) and round 4 (task 1's end, pool just
    made): the same rows, server state (pool, LTEs), client state and weights."""
    rc = resume_cfg(make_run_config, method, params)
    full = Simulation(rc, device=CPU)
    saved, keep = checkpoint_keeper()
    status, rows, msg = full.run(progress=False, on_checkpoint=keep)
    assert status == "completed", msg
    made = [r["round"] for r in rows if f"{method}_pool_rows" in r]
    assert made == [2, 4] and all(
        r[f"{method}_pool_rows"] > 0 for r in rows if f"{method}_pool_rows" in r
    )
    assert all(f"{method}_kd" in r for r in rows[3:]) and f"{method}_kd" not in rows[2]
    if method == "lander":  # the anchors are MiniLM's embeddings of the digits' texts
        texts = label_texts([str(i) for i in range(10)], "a photo of a {}")
        assert torch.equal(full.server.state[LTE], 9.7 * label_embeddings(texts))  # anchor_norm
        assert all("lander_bound" in r for r in rows[1:])
    for stop in (3, 4):
        sim = Simulation(rc, device=CPU)
        status, resumed, msg = sim.run(
            progress=False, resume=next(c for c in saved if c["round"] == stop)
        )
        assert status == "completed", msg
        assert strip(resumed) == strip(rows)
        assert same(sim.server.state, full.server.state) and same(
            sim.client_state, full.client_state
        )
        assert same(sim.global_params, full.global_params)


@pytest.mark.parametrize(
    "method,scenario",
    [("target", {**SPLIT, "incremental": "task", "heads": "per_task"}),
     ("lander", {"kind": "rotated", "tasks": 2, "rounds_per_task": 1})],
    ids=["target-task-il-heads", "lander-domain-il"],
)  # fmt: skip
def test_task_il_and_domain_il_streams(make_run_config, method, scenario):
    rc = make_run_config(
        dataset="digits", model="cnn2d", model_options=SMALL_CNN, method=method, scenario=scenario,
        params=TINY_L if method == "lander" else TINY, rounds=scenario["tasks"], batch_size=32, eval_every=3,
        partition=PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=10, seed=0), eval_local_models=False,
    )  # fmt: skip
    sim, rows = run(rc)
    pool = sim.server.state[f"{method}_pool"]
    assert pool["task"] == scenario["tasks"] - 2 and rows[-1][f"{method}_kd"] >= 0
    if scenario["kind"] == "rotated":  # every class is learned in every task
        assert len(pool["x"]) == TINY_L["syn_size"]
    assert pool[TEACHER].keys() == sim.global_params.keys()


def fixed_pool(self):
    """A synthesizer's ``run`` returning keyed rows with random targets among its classes: a
    pool independent of the teacher's weights (the BatchNorm cases below)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.rand(self.p.syn_size, *self.shape, generator=gen)
    y = self.classes[torch.randint(len(self.classes), (len(x),), generator=gen)]
    return SynthesisResult(x, y, [], {"bn_layers": 1.0})


def same_engines(out, assert_same_metrics, bn):
    """The two engines' runs ``out`` (run_engines) agree: metrics within 1e-5, the generator's
    losses relatively (~300 on resnet8, most of it its BatchNorm-statistics term: squared
    distances to the teacher's running statistics, which differ by rounding), the global
    weights within 1e-5 (1e-4 with BatchNorm, its running statistics included). Returns
    (sequential simulation, its rows, batched simulation)."""
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert vec.engine_info["client_engine"] == "vectorized"
    big = [k for k in rows_s[1] if "gen_loss" in k]
    for ra, rb in zip(rows_s, rows_v):
        for k in big:
            assert math.isclose(ra.pop(k, 0.0), rb.pop(k, 0.0), rel_tol=1e-4), k
    assert_same_metrics(rows_s, rows_v)
    for k, v in seq.global_params.items():
        torch.testing.assert_close(v.float(), vec.global_params[k].float(), atol=1e-4 if bn else 1e-5, rtol=1e-5, msg=k)
    return seq, rows_s, vec


@pytest.mark.parametrize(
    "model,rule,heads",
    [("mlp", "steps", "shared"),  # every step batched (stacked_forward), unequal synthetic rows
     ("cnn2d", "code", "shared"),  # epochs cut; wide steps client by client in replicas, tails batched
     ("mlp", "code", "per_task"),  # the old classes scored by their own (frozen) heads
     ("resnet8", "steps", "shared")],  # BatchNorm: each client's statistics see its own rows
)  # fmt: skip
def test_target_trains_stacked_as_sequential(make_run_config, run_engines, assert_same_metrics, monkeypatch,
                                             model, rule, heads):  # fmt: skip
    """Issue 32, 3: TARGET's KD on each client's synthetic batch (its own draws, crops and row
    count, through the step's weights; the pool's teacher over every client's rows at once),
    its CE over each row's task's classes and the code rule's cut epochs in the stacked
    trainer, within 1e-5 of the sequential one (metrics, the pools the server made from the
    weights, the weights). With BatchNorm the generator, trained against the teacher's
    running statistics, turns their rounding differences into other pools (its loss is
    chaotic in them): there the pool is fixed keyed rows, so the clients' steps are compared."""
    bn = model == "resnet8"
    if bn:
        monkeypatch.setattr(Synthesizer, "run", fixed_pool)  # drop_last: no 1-row batch through BatchNorm (as A-GEM's and DER's test)
    scenario = {**SPLIT, "incremental": "class", "heads": heads}
    rc = make_run_config(
        dataset="digits", model=model, model_options=SMALL_RESNET if bn else SMALL_CNN if model == "cnn2d" else None,
        method="target", scenario=scenario, params={**TINY, "replay_rule": rule, **({"replay_batch": 12} if rule == "code" else {})},
        rounds=2 if bn else 3, batch_size=32, local_epochs=1 if bn else 2, sample_rate=0.75, eval_local_models=False,
        eval_every=1, optimizer={"lr": 0.05, "momentum": 0.9}, device="cpu", drop_last=bn,
        partition=PartitionSpec("dirichlet", clients=5, alpha=0.5, min_size=5, seed=0),
    )  # fmt: skip
    seq, rows_s, vec = same_engines(run_engines(rc), assert_same_metrics, bn)
    assert rows_s[-1]["target_kd"] > 0 and (rule == "steps" or rows_s[-1]["target_epoch_steps"] >= 1)
    pool_s, pool_v = seq.server.state["target_pool"], vec.server.state["target_pool"]
    torch.testing.assert_close(pool_s["x"], pool_v["x"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "model,heads,boundaries",
    [("mlp", "shared", "sync"),  # every step batched (stacked_forward), the synthetic rows unequal
     ("cnn2d", "per_task", "sync"),  # client by client in replicas (live_alone), tails batched; old heads
     ("resnet8", "shared", "sync"),  # BatchNorm: each client's statistics see its own rows
     # asynchronous: a stack's clients on different tasks, each weighted cur / pre by its own
     # (the first client's weights were applied to all: 8.7e-4 apart, found in review)
     ("mlp", "shared", {"samples_per_window": 70, "window_rounds": 1})],
)  # fmt: skip
def test_lander_trains_stacked_as_sequential(make_run_config, run_engines, assert_same_metrics, monkeypatch, model, heads,
                                             boundaries):  # fmt: skip
    """LANDER's step as live terms of a stack (each client's bounding loss on the LTE map of
    the step's own features, its CE, and from task 1 the KD and LTE feature terms on its
    synthetic batch, weighted cur / pre) within 1e-5 of a client alone's ``client_loss``
    (metrics, diagnostics, weights), per-task heads included. With BatchNorm the pool is
    fixed keyed rows (see ``test_target_trains_stacked_as_sequential``)."""
    bn = model == "resnet8"
    if bn:
        monkeypatch.setattr(LanderSynthesizer, "run", fixed_pool)
    scenario = {**SPLIT, "incremental": "class", "heads": heads, "boundaries": boundaries}
    rc = make_run_config(
        dataset="digits", model=model, model_options=SMALL_RESNET if bn else SMALL_CNN if model == "cnn2d" else None,
        method="lander", scenario=scenario, params={**TINY_L, "replay_batch": 0},
        rounds=2 if bn else 3, batch_size=32, local_epochs=1 if bn else 2, sample_rate=0.75, eval_local_models=False,
        eval_every=1, optimizer={"lr": 0.05, "momentum": 0.9}, device="cpu", drop_last=bn,
        partition=PartitionSpec("dirichlet", clients=5, alpha=0.5, min_size=5, seed=0),
    )  # fmt: skip
    _, rows_s, _ = same_engines(run_engines(rc), assert_same_metrics, bn)
    assert rows_s[-1]["lander_kd"] > 0 and rows_s[-1]["lander_fkd"] > 0 and rows_s[-1]["lander_bound"] >= 0


@pytest.mark.parametrize("base", ["target", "lander"])
def test_fedgp_over_target_trains_stacked_as_sequential(make_run_config, run_engines, assert_same_metrics, base):
    """FedGP over TARGET stacks where TARGET does: TARGET's KD terms under FedGP's
    projection, and TARGET's CE over each row's task's classes (``label_classes``, which the
    plug-in takes from its base), within 1e-5 of one client after another; over LANDER, its
    projection follows LANDER's live step (``stacks_over_live``)."""
    rc = make_run_config(
        dataset="digits", model="mlp", method="fedgp", scenario={**SPLIT, "incremental": "class"},
        params={"base": base, "base_params": TINY}, rounds=3, batch_size=32, sample_rate=0.75,
        eval_local_models=False, eval_every=1, optimizer={"lr": 0.05}, device="cpu",
        partition=PartitionSpec("dirichlet", clients=5, alpha=0.5, min_size=5, seed=0),
    )  # fmt: skip
    out = run_engines(rc)
    (seq, rows_s), (vec, rows_v) = out["sequential"], out["vectorized"]
    assert seq.method.label_classes is seq.method.base.label_classes is not None
    assert vec.engine_info["client_engine"] == "vectorized"
    assert_same_metrics(rows_s, rows_v)
    assert rows_s[-1][f"fedgp_{base}_kd"] > 0 and rows_s[-1]["fedgp_proj_share"] > 0


def test_fedgp_over_target(make_run_config):
    sim, rows = run(digits_cfg(make_run_config, "fedgp", {"base": "target", "base_params": TINY}))
    assert "fedgp_target_pool_rows" in rows[1] and "fedgp_target_kd" in rows[-1]
    assert rows[-1]["fedgp_ref_clients"] > 0 and sim.server.state["target_pool"]["task"] == 1


# ----------------------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    "method,params,match",
    [("target", {"meta": "maml"}, "meta='maml'"), ("target", {"ce": "new"}, "ce='new'"),
     ("target", {"syn_batch": 1}, "syn_batch=1"), ("target", {"bn_momentum": 1.0}, "bn_momentum=1.0"),
     ("lander", {"prompt": "no slot"}, "prompt='no slot'"), ("lander", {"r": -1}, "r=-1"),
     ("lander", {"meta": "fomaml"}, "meta"), ("target", {"student_init": "xavier"}, "student_init='xavier'"),
     ("target", {"replay_rule": "nominal"}, "replay_rule='nominal'"), ("lander", {"replay_rule": "code"}, "replay_rule")],
)  # fmt: skip
def test_bad_params_name_the_value(method, params, match):
    with pytest.raises(FedForgetError, match=match):
        check_params(method, params)


def test_defaults_follow_the_papers_and_code():
    t, lan = check_params("target", {}), check_params("lander", {})
    assert (t["kd"], t["temperature"], t["syn_size"], t["syn_batch"], t["bn"]) == (
        25.0,
        2.0,
        8000,
        256,
        10.0,
    )
    assert (t["meta"], t["ce"], t["warmup"]) == ("fomaml", "task", 20)
    assert (lan["ltc"], lan["r"], lan["cur"], lan["pre"]) == (5.0, 0.015, 0.2, 0.4)
    assert (lan["syn_size"], lan["g_steps"], lan["bn"], lan["kd"]) == (10000, 40, 1.0, 1.0)


def test_fedprotip_configs_replay_target_as_its_code_whole_epochs():
    """FedProTIP's tables run TARGET as FedProTIP's client_target.py: one synthetic batch of
    ``replay_batch`` rows beside each private minibatch (replay_rule code), and a pool large
    enough that a client with its share of a task's rows trains every minibatch of an epoch
    (the code's zip of the two loaders stops at the private one); until 2026-12-06 a pool of
    2,560 rows at 500 a step cut a CIFAR-100 client's epoch after 6 of its 16 minibatches."""
    from pathlib import Path

    from fedforget.config import load_yaml
    from fedforget.data import DATASETS
    from fedforget.parse import parse_config

    paper = Path(__file__).resolve().parents[2] / "config" / "experiments" / "paper"
    seen = 0
    for path in sorted(paper.glob("fedprotip_*.yaml")):
        wf = parse_config(load_yaml(path))
        for ex in wf.experiments:
            for m in ex.methods:
                if m.name not in ("target", "target_lode"):
                    continue
                p = m.params
                assert p["replay_rule"] == "code" and p["replay_batch"] > 0, (path.name, m.label)
                pool = min(p["syn_size"], p["syn_rounds"] * p["syn_batch"])
                for d in ex.datasets:
                    info = DATASETS.get(d.name)
                    n = info.split_sizes(info.resolve(d.options))[0] // int(d.scenario["tasks"])
                    for part in ex.partitions:
                        t = TrainSpec.from_dict({**ex.train, **m.train})
                        steps = math.ceil(n / part.clients / t.batch_size)
                        assert math.ceil(pool / p["replay_batch"]) >= steps, (path.name, ex.name, m.label, part.slug)
                        seen += 1
    assert seen > 20
