"""Models: the ResNets' level representations (shapes, taken before the ReLU, the stem level
by hand), one-level models' forward_levels equals forward_with_features, gradient from
every level, ResNet-18's parameter count, config validation of the new models."""

from __future__ import annotations

import re

import pytest
import torch

from fedforget.models import (
    MODEL_DEFAULTS,
    MODEL_INPUT_RANK,
    build_model,
    check_model,
    parameter_count,
)
from fedforget.utils import FedForgetError

WIDTHS = [64, 64, 128, 256, 512]  # stem, stages 1-4


@pytest.mark.parametrize("name", ["resnet8", "resnet18"])
@pytest.mark.parametrize("shape", [(3, 32, 32), (1, 8, 8), (3, 9, 7)])
def test_resnet_levels_shapes_and_logits(name, shape):
    torch.manual_seed(0)
    model = build_model(name, shape, 10, {"norm": "group"})
    x = torch.randn(5, *shape)
    levels, logits = model.forward_levels(x)
    assert [tuple(z.shape) for z in levels] == [(5, w) for w in WIDTHS]
    assert logits.shape == (5, 10)
    torch.testing.assert_close(logits, model(x), rtol=0, atol=0)
    z, logits2 = model.forward_with_features(x)
    assert z.shape == (5, 512)
    torch.testing.assert_close(logits2, logits, rtol=0, atol=0)


@pytest.mark.parametrize("norm", ["batch", "batch_stateless", "group", "none"])
def test_resnet_levels_are_pooled_before_relu(norm):
    torch.manual_seed(1)
    model = build_model("resnet8", (3, 16, 16), 4, {"norm": norm})
    x = torch.randn(6, 3, 16, 16)
    levels, _ = model.forward_levels(x)
    body = model.body
    # by hand from the layers: stem conv-norm (level 0, before ReLU), ReLU, max-pool; each
    # stage's block conv-norm-ReLU-conv-norm + shortcut (level, before ReLU), then ReLU
    relu = torch.relu
    h = body.bn1(body.conv1(x))
    want = [h.mean(dim=(2, 3))]
    h = torch.nn.functional.max_pool2d(relu(h), 3, stride=2, padding=1)
    for (block,) in body.stages:
        pre = block.bn2(block.conv2(relu(block.bn1(block.conv1(h))))) + block.shortcut(h)
        want.append(pre.mean(dim=(2, 3)))
        h = relu(pre)
    for got, ref in zip(levels, want, strict=True):
        torch.testing.assert_close(got, ref)
    z = model.features(x)
    torch.testing.assert_close(z, h.mean(dim=(2, 3)))
    # so the penultimate features (pooled after the ReLU) are not level 4 (pooled before)
    assert (z >= 0).all() and (z >= torch.relu(levels[4]) - 1e-6).all()
    assert not torch.allclose(z, levels[4])


@pytest.mark.parametrize(
    "name,shape,opts",
    [("mlp", (4,), {"hidden": [5, 6]}), ("cnn2d", (1, 8, 8), {}), ("cnn1d", (1, 40), {}),
     ("cnn_mcmahan", (3, 8, 8), {"hidden": 16})],
)  # fmt: skip
def test_one_level_models_give_penultimate_features(name, shape, opts):
    torch.manual_seed(2)
    model = build_model(name, shape, 3, opts)
    x = torch.randn(7, *shape)
    levels, logits = model.forward_levels(x)
    z, ref = model.forward_with_features(x)
    assert len(levels) == 1
    assert torch.equal(levels[0], z) and torch.equal(logits, ref)


def test_gradient_reaches_every_stage_from_its_level():
    torch.manual_seed(3)
    model = build_model("resnet18", (1, 8, 8), 3, {"norm": "group"})
    levels, _ = model.forward_levels(torch.randn(4, 1, 8, 8))
    for i in range(5):
        model.zero_grad(set_to_none=True)
        levels[i].pow(2).sum().backward(retain_graph=True)
        stem = model.body.conv1.weight.grad
        assert stem is not None and stem.abs().sum() > 0
        # stage j's parameters get gradient from level i exactly when j <= i
        for j, stage in enumerate(model.body.stages, start=1):
            got = [p.grad is not None and p.grad.abs().sum() > 0 for p in stage.parameters()]
            assert all(got) if j <= i else not any(got), (i, j)
        assert model.head.weight.grad is None


def test_resnet18_parameter_count():
    # the CIFAR ResNet-18 with BatchNorm and 10 classes has 11,173,962 parameters
    model = build_model("resnet18", (3, 32, 32), 10)
    assert sum(p.numel() for p in model.parameters()) == 11_173_962
    # ResNet-8: stem 1,728 + BN 128; stage blocks 73,984 / 230,144 / 919,040 / 3,673,088
    # (convs, BNs, shortcut conv + BN); head 5,130
    model = build_model("resnet8", (3, 32, 32), 10)
    expected = 1_728 + 128 + 73_984 + 230_144 + 919_040 + 3_673_088 + 5_130
    assert sum(p.numel() for p in model.parameters()) == expected


def test_check_model_for_resnets():
    assert check_model("resnet8", (3, 32, 32), {}) == {"norm": "batch", "width": 64}
    assert check_model("resnet18", (1, 8, 8), {"norm": "group"}) == {"norm": "group", "width": 64, "maxpool": False}
    # maxpool (the FedProj code's ResNet-18): the stem pools 8x8 to 4x4; a non-bool is refused
    pooled = build_model("resnet18", (3, 8, 8), 10, {"maxpool": True, "width": 8})
    assert isinstance(pooled.body.pool, torch.nn.MaxPool2d) and pooled(torch.zeros(2, 3, 8, 8)).shape == (2, 10)
    assert isinstance(build_model("resnet18", (3, 8, 8), 10, {"width": 8}).body.pool, torch.nn.Identity)
    with pytest.raises(FedForgetError, match=r"model.options.maxpool='yes' for model 'resnet18'; allowed: true, false"):
        check_model("resnet18", (3, 32, 32), {"maxpool": "yes"})
    for bad in (3, 0, 8.0, True, "8"):  # GroupNorm(2, C): an even number of channels
        with pytest.raises(FedForgetError, match=rf"model.options.width={bad!r}; allowed: an even integer >= 2"):
            check_model("resnet8", (3, 32, 32), {"width": bad})
    # width w: the stem w, the stages w/2w/4w/8w, the head over 8w features
    small = build_model("resnet8", (1, 8, 8), 10, {"width": 8})
    assert small.body.conv1.out_channels == 8
    assert [s[0].conv1.out_channels for s in small.body.stages] == [8, 16, 32, 64]
    assert small.feature_dim == small.head.in_features == 64
    with pytest.raises(FedForgetError, match="rank 3"):
        check_model("resnet18", (4,), {})
    with pytest.raises(FedForgetError, match=r"norm='layer'.*batch, batch_stateless, group, none"):
        check_model("resnet8", (3, 32, 32), {"norm": "layer"})
    with pytest.raises(FedForgetError, match="unknown option"):
        check_model("resnet8", (3, 32, 32), {"depth": 8})


# values of another type than an option's default: each must be refused by check_model (a
# float cast to an int, a truthy string taken for true, or a crash when the job builds it)
WRONG_TYPE = {
    int: [1.5, 2.0, True, "1", None, [], float("nan")],
    bool: [1, "yes", None],
    str: [None, 1, []],
    list: [None, "zz", 5, [1.5, 2], [True, 2]],
    dict: ["zz", None, [], 1],
}
SHAPE_OF_RANK = {1: (4,), 2: (1, 40), 3: (3, 32, 32)}
VALID_BASE = {"hf": {"name_or_path": "distilbert-base-uncased"}}  # hf has no default encoder


@pytest.mark.parametrize("name", sorted(MODEL_DEFAULTS))
def test_every_model_option_refuses_a_value_of_another_type(name):
    """Every registered model's options, each given values of the wrong type: one
    FedForgetError naming the option, before any job builds the model (before this, vgg11's
    fc_dim, resnet18_imagenet's pretrained and input_size and vit's sizes took anything, or
    crashed with a TypeError, and resnet18_imagenet took pool 2.0)."""
    shape = (2, 128) if name == "hf" else SHAPE_OF_RANK[MODEL_INPUT_RANK[name]]
    base = VALID_BASE.get(name, {})
    check_model(name, shape, base)  # the defaults are valid
    for opt, default in MODEL_DEFAULTS[name].items():
        for bad in WRONG_TYPE[type(default)]:
            with pytest.raises(FedForgetError, match=re.escape(opt)):
                check_model(name, shape, {**base, opt: bad})


def test_mcmahan_padding_0_is_the_582k_mnist_cnn():
    from fedforget.models import build_model

    m = build_model("cnn_mcmahan", (1, 28, 28), 10, {"padding": 0})
    assert sum(p.numel() for p in m.parameters()) == 582026
    assert m(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    # the default (padding 2, the FedSOL code) is unchanged: 3x32x32 -> 64*8*8 features
    d = build_model("cnn_mcmahan", (3, 32, 32), 10, {})
    assert d.body[7].in_features == 64 * 8 * 8


# small valid inputs and options per model (vit: a 1-layer 8x8 ViT; slvit: 16x16 images)
COUNT_CASES = {
    "mlp": ((4,), {}), "cnn1d": ((1, 40), {}), "cnn1d-odd": ((1, 7), {}), "cnn2d": ((1, 8, 8), {}),
    "cnn_mcmahan": ((3, 32, 32), {}), "resnet8": ((3, 8, 8), {"width": 8}), "resnet18": ((3, 8, 8), {"width": 8}),
    "cnn_fedgp": ((1, 28, 28), {}), "vgg11": ((3, 32, 32), {"fc_dim": 16}), "resnet18_imagenet": ((3, 32, 32), {"pretrained": True}),
    "vit": ((3, 8, 8), {"image_size": 8, "patch_size": 4, "layers": 1, "heads": 2, "hidden_dim": 16, "mlp_dim": 32}),
    "slvit": ((3, 16, 16), {"dim": 16, "depth": 1, "heads": 2, "dim_head": 8, "mlp_dim": 16}),
}  # fmt: skip


def test_parameter_count_covers_every_model_but_hf():
    assert {k.split("-")[0] for k in COUNT_CASES} == set(MODEL_DEFAULTS) - {"hf"}
    assert parameter_count("hf", (2, 128), 2, {"name_or_path": "distilbert-base-uncased"}) is None


@pytest.mark.parametrize("case", sorted(COUNT_CASES))
def test_parameter_count_is_the_built_models_without_building_it(case):
    """``parameter_count`` (what ``fedforget validate`` prints and a job checks against its
    memory before loading data) is the built model's count, without pretrained weights
    loaded (resnet18_imagenet's pretrained: true would fetch them here, offline) and without
    touching the global random generator."""
    name = case.split("-")[0]
    shape, opts = COUNT_CASES[case]
    state = torch.random.get_rng_state()
    n = parameter_count(name, shape, 10, opts)
    assert torch.equal(state, torch.random.get_rng_state())
    built = build_model(name, shape, 10, {k: v for k, v in opts.items() if k != "pretrained"})
    assert n == sum(p.numel() for p in built.parameters())


def test_a_model_too_large_for_any_machine_is_counted_not_allocated():
    # cnn2d on 1x8x8: conv 1->32 (320), conv 32->64 (18,496), FC 64*4*4 -> h, head h -> 10
    h = 10**12
    assert parameter_count("cnn2d", (1, 8, 8), 10, {"hidden": h}) == 320 + 18_496 + (1024 * h + h) + (10 * h + 10)
