"""The papers' other models (issue 17, item 3): FedSOL's VGG-11 and FedGP's MNIST CNN as
their code builds them (parameter counts by hand), torchvision's ImageNet ResNet-18 and a
Vision Transformer with pretrained weights read from the torch hub cache in torchvision's
own format (written here; offline and uncached: one error naming the file), config checks,
and the methods that use a model's head or features (FedSOL, MOON, FedProj) running on each."""

from __future__ import annotations

from dataclasses import replace
from urllib.error import URLError

import pytest
import torch
from torch import nn

from fedforget.data import dataset_id, prepare_dataset, prepare_public
from fedforget.engine import Simulation
from fedforget.methods import METHODS
from fedforget.models import build_model, check_model, eval_by_batch
from fedforget.partition import PartitionSpec
from fedforget.utils import FedForgetError
from fedforget.vectorized import stacked_supported, why_not_vectorized

SMALL_VIT = {"image_size": 32, "patch_size": 8, "layers": 2, "heads": 2, "hidden_dim": 32, "mlp_dim": 64}


def n_params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def test_parameter_counts_as_the_papers_code_builds_them() -> None:
    # VGG-11 (FedSOL): convs 1,792 + 73,856 + 295,168 + 590,080 + 1,180,160 + 3 x 2,359,808;
    # FC 2 x 262,656; head 5,130
    assert n_params(build_model("vgg11", (3, 32, 32), 10)) == 9_750_922
    # FedGP's CNN: conv 260 + 5,020, FC 320*50+50 = 16,050, head 510
    assert n_params(build_model("cnn_fedgp", (1, 28, 28), 10)) == 21_840
    # SL-ViT (FedSOL Table 3, its code's shape on 3x32x32, patch 8): SPT LayerNorm(960) 1,920
    # + Linear(960, 192) 184,512; class token 192 + position embedding 17 x 192 = 3,264; per
    # block LayerNorm 384 + temperature 1 + qkv 192 x 2,304 = 442,368 + out 768 x 192 + 192 =
    # 147,648 + LayerNorm 384 + MLP 2 x 37,056 = 664,897, 9 blocks; LayerNorm 384 + head 1,930
    assert n_params(build_model("slvit", (3, 32, 32), 10)) == 1_920 + 184_512 + 192 + 3_264 + 9 * 664_897 + 384 + 1_930
    # torchvision's ResNet-18 is 11,689,512 with its 1000-class fc (513,000) + our 10-class head
    assert n_params(build_model("resnet18_imagenet", (3, 32, 32), 10)) == 11_689_512 - 513_000 + 5_130


def test_vgg11_and_the_fedgp_cnn_with_its_keyed_dropout_are_batched() -> None:
    vgg = build_model("vgg11", (3, 32, 32), 10)
    assert stacked_supported(vgg) is None
    fedavg = METHODS.get("fedavg")
    for opts in ({}, {"dropout": False}):  # keyed dropout: tests/test_dropout.py
        cnn = build_model("cnn_fedgp", (1, 28, 28), 10, opts)
        assert stacked_supported(cnn) is None and why_not_vectorized(fedavg, cnn, "sgd") is None


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty torch hub cache that cannot download (as offline here)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))

    def offline(url, dst, *a, **k):
        raise URLError("no network in this test")

    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    return tmp_path / "torch" / "hub" / "checkpoints"


def test_pretrained_resnet18_reads_torchvision_weights_from_the_hub_cache(hub) -> None:
    from torchvision.models import ResNet18_Weights, resnet18

    torch.manual_seed(3)
    ref = resnet18(weights=None)
    hub.mkdir(parents=True)
    torch.save(ref.state_dict(), hub / ResNet18_Weights.IMAGENET1K_V1.url.rsplit("/", 1)[-1])
    model = build_model("resnet18_imagenet", (3, 32, 32), 7, {"pretrained": True, "input_size": 64})
    assert torch.equal(model.body[1].weight, ref.conv1.weight)  # body[0] resizes
    assert torch.equal(model.body[6][1].conv2.weight, ref.layer2[1].conv2.weight)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_resnet18_imagenet_takes_the_fedprotip_codes_stem_and_pool(hub) -> None:
    """stem cifar (3x3 stride 1, no max-pool), stem random (the 7x7 stem newly initialised)
    and pool 2 (2048 features) are the FedProTIP code's variant: every other pretrained weight
    is loaded, the stem's convolution is not (the code pops conv1.weight); the defaults build
    torchvision's network with its bits (the same RNG draws)."""
    from torchvision.models import ResNet18_Weights, resnet18

    torch.manual_seed(3)
    ref = resnet18(weights=None)
    hub.mkdir(parents=True)
    torch.save(ref.state_dict(), hub / ResNet18_Weights.IMAGENET1K_V1.url.rsplit("/", 1)[-1])
    torch.manual_seed(5)
    plain = resnet18(weights=None).state_dict()
    torch.manual_seed(5)
    default = build_model("resnet18_imagenet", (3, 32, 32), 10)
    assert all(torch.equal(a, b) for a, b in zip(default.body.state_dict().values(), list(plain.values())[:-2]))
    x = torch.randn(2, 3, 32, 32)
    cifar = build_model("resnet18_imagenet", (3, 32, 32), 10, {"pretrained": True, "stem": "cifar", "pool": 2})
    conv1, pooling = cifar.body[0], cifar.body[3]
    assert conv1.kernel_size == (3, 3) and conv1.stride == (1, 1) and isinstance(pooling, nn.Identity)
    assert not torch.equal(conv1.weight[..., :3, :3], ref.conv1.weight[..., :3, :3])
    assert torch.equal(cifar.body[5][0].conv1.weight, ref.layer2[0].conv1.weight)  # the rest: pretrained
    assert torch.equal(cifar.body[1].weight, ref.bn1.weight)  # the stem's BatchNorm too
    assert cifar.features(x).shape == (2, 2048) and cifar(x).shape == (2, 10)
    assert cifar.body[:8](x).shape == (2, 512, 4, 4)  # layer4 at 4x4 from 32 px (torchvision's: 1x1)
    rand = build_model("resnet18_imagenet", (3, 64, 64), 10, {"pretrained": True, "stem": "random", "maxpool": False})
    assert rand.body[0].kernel_size == (7, 7) and not torch.equal(rand.body[0].weight, ref.conv1.weight)
    assert isinstance(rand.body[3], nn.Identity) and rand.features(torch.randn(2, 3, 64, 64)).shape == (2, 512)


def test_resnet18_imagenet_batch_stateless_keeps_the_pretrained_affine_weights(hub) -> None:
    """norm batch_stateless (the FedProTIP code's track_rs off: FedProTIP and FOT on
    DomainNet): every BatchNorm loses its running statistics and keeps the pretrained affine
    weights; evaluation normalises each batch by its own statistics, as training does (a row's
    scores depend on its batch); any other norm is refused."""
    from torchvision.models import ResNet18_Weights, resnet18

    torch.manual_seed(3)
    ref = resnet18(weights=None)
    with torch.no_grad():
        ref.layer3[0].bn1.weight.uniform_()  # not the initial ones
    hub.mkdir(parents=True)
    torch.save(ref.state_dict(), hub / ResNet18_Weights.IMAGENET1K_V1.url.rsplit("/", 1)[-1])
    opts = {"pretrained": True, "stem": "random", "maxpool": False, "pool": 2, "norm": "batch_stateless"}
    model = build_model("resnet18_imagenet", (3, 32, 32), 10, opts)
    assert not [k for k in model.state_dict() if "running" in k or "num_batches" in k]
    assert torch.equal(model.body[6][0].bn1.weight, ref.layer3[0].bn1.weight)
    x = torch.randn(4, 3, 32, 32)
    train_out = model.train()(x)
    model.eval()
    torch.testing.assert_close(model(x), train_out, rtol=0, atol=0)
    assert not torch.allclose(model(x[:2]), train_out[:2])
    assert eval_by_batch("resnet18_imagenet", opts) and not eval_by_batch("resnet18_imagenet", {})
    with pytest.raises(FedForgetError, match=r"options.norm='group' for model 'resnet18_imagenet'; allowed: batch, batch_stateless"):
        check_model("resnet18_imagenet", (3, 32, 32), {"norm": "group"})


def test_missing_pretrained_weights_offline_name_the_file(hub) -> None:
    with pytest.raises(FedForgetError, match=r"resnet18-f37072fd\.pth") as e:
        build_model("resnet18_imagenet", (3, 32, 32), 10, {"pretrained": True})
    assert str(hub) in str(e.value)
    with pytest.raises(FedForgetError, match=r"vit_b_16-c867db91\.pth"):
        build_model("vit", (3, 32, 32), 10, {"pretrained": True})


def test_model_checks_before_any_job() -> None:
    with pytest.raises(FedForgetError, match="vgg11.*at least 32x32"):
        check_model("vgg11", (1, 28, 28), {})
    with pytest.raises(FedForgetError, match="pretrained=true .* 3-channel"):
        check_model("resnet18_imagenet", (1, 28, 28), {"pretrained": True})
    with pytest.raises(FedForgetError, match=r"options.stem='imagenet' for model 'resnet18_imagenet'; allowed: pretrained, random, cifar"):
        check_model("resnet18_imagenet", (3, 32, 32), {"stem": "imagenet"})
    with pytest.raises(FedForgetError, match=r"maxpool=True with stem 'cifar'"):
        check_model("resnet18_imagenet", (3, 32, 32), {"stem": "cifar", "maxpool": True})
    with pytest.raises(FedForgetError, match=r"options.pool=4 for model 'resnet18_imagenet'; allowed: 1, 2"):
        check_model("resnet18_imagenet", (3, 32, 32), {"pool": 4})
    with pytest.raises(FedForgetError, match="ViT-B/16 shape"):
        check_model("vit", (3, 32, 32), {"pretrained": True, "layers": 2})
    with pytest.raises(FedForgetError, match="multiple of patch_size"):
        check_model("vit", (3, 32, 32), {**SMALL_VIT, "patch_size": 5})


SMALL_SLVIT = {"dim": 32, "depth": 2, "heads": 2, "dim_head": 16, "mlp_dim": 32}


def test_slvit_tokens_attention_and_shapes() -> None:
    """SL-ViT's two parts by their equations (Lee, Lee and Song 2021; FedSOL's code): the
    shifted patch tokens are patches of the image and of its four one-pixel shifts, in
    (row, column, channel) order; locality self-attention is softmax(exp(T) q k^T) v with
    the diagonal masked (no token attends to itself). Patch size min(side / 4, 16); one
    channel repeated to three; checks before any job."""
    torch.manual_seed(0)
    model = build_model("slvit", (3, 32, 32), 10, SMALL_SLVIT)
    assert model.body.tokens.patch_size == 8 and model.body.pos.shape == (1, 17, 32)
    assert build_model("slvit", (3, 28, 28), 9, SMALL_SLVIT).body.tokens.patch_size == 7

    spt = model.body.tokens
    x = torch.randn(2, 3, 32, 32)
    got = spt.norm.forward  # the tokens before their LayerNorm: capture them
    seen = []
    spt.norm.forward = lambda t: seen.append(t) or got(t)
    spt(x)
    spt.norm.forward = got
    right = torch.zeros_like(x)
    right[..., 1:] = x[..., :-1]  # shifted right by one pixel, zero-filled
    up = torch.zeros_like(x)
    up[..., :-1, :] = x[..., 1:, :]  # shifted up by one pixel
    # token 1 is the patch at row 0, column 1 (rows 0-7, columns 8-15): 8 x 8 pixels of 15
    # channels, the image's 3, then the shifts right, left, down, up
    tok = seen[0][:, 1].reshape(2, 8, 8, 15)
    assert torch.allclose(tok[..., 0:3], x[:, :, 0:8, 8:16].permute(0, 2, 3, 1))
    assert torch.allclose(tok[..., 3:6], right[:, :, 0:8, 8:16].permute(0, 2, 3, 1))
    assert torch.allclose(tok[..., 12:15], up[:, :, 0:8, 8:16].permute(0, 2, 3, 1))

    lsa = model.body.blocks[0][1]
    t = torch.randn(2, 5, 32)
    q, k, v = lsa.qkv(t).chunk(3, -1)
    split = lambda a: a.reshape(2, 5, 2, 16).transpose(1, 2)  # noqa: E731
    scores = split(q) @ split(k).transpose(-1, -2) * lsa.temperature.exp()
    scores = scores - torch.diag(torch.full((5,), float("inf")))
    ref = lsa.out((scores.softmax(-1) @ split(v)).transpose(1, 2).reshape(2, 5, 32))
    assert torch.allclose(lsa(t), ref, atol=1e-6)
    assert torch.isclose(lsa.temperature.exp(), torch.tensor(16**-0.5))

    gray = build_model("slvit", (1, 28, 28), 10, SMALL_SLVIT)
    g = torch.randn(2, 1, 28, 28)
    assert torch.equal(gray(g), gray(g.expand(-1, 3, -1, -1)))
    assert why_not_vectorized(METHODS.get("fedavg"), model, "sgd") is None  # batched through vmap
    with pytest.raises(FedForgetError, match="slvit' needs square images whose side the patch size 7 divides"):
        check_model("slvit", (3, 30, 30), {})
    with pytest.raises(FedForgetError, match="integers >= 1"):
        check_model("slvit", (3, 32, 32), {"depth": 0})


def test_vgg11_upsamples_28x28_inputs_as_the_fedsol_code() -> None:
    """PathMNIST's 28x28 images reach FedSOL's VGG-11 upsampled to 32 by nearest neighbour
    (the code's forward: ``F.upsample(x, size=32)``): ``input_size: 32``."""
    torch.manual_seed(0)
    model = build_model("vgg11", (3, 28, 28), 9, {"input_size": 32})
    x = torch.randn(2, 3, 28, 28)
    near = x[..., (torch.arange(32) * 28) // 32, :][..., (torch.arange(32) * 28) // 32]
    assert torch.equal(model.body[0](x), near)
    assert torch.equal(model(x), model.head(model.body[1:](near)))
    with pytest.raises(FedForgetError, match=r"input_size: 32"):
        check_model("vgg11", (3, 28, 28), {})
    with pytest.raises(FedForgetError, match=r"input_size=-1"):
        check_model("vgg11", (3, 28, 28), {"input_size": -1})


def test_vit_resizes_inputs_and_returns_the_class_token_features() -> None:
    torch.manual_seed(0)
    model = build_model("vit", (3, 16, 16), 5, SMALL_VIT)
    z, logits = model.forward_with_features(torch.randn(3, 3, 16, 16))
    assert z.shape == (3, 32) and logits.shape == (3, 5)


def test_vit_attention_takes_multiheadattentions_path_bit_for_bit() -> None:
    """The 'vit' model's SelfAttention (projections as module calls, for the activation-based
    methods) against torchvision's own ViT with nn.MultiheadAttention, same weights: the
    training forward and every gradient bit for bit; evaluation without gradients, where MHA
    takes its fused kernel, equal up to float32 rounding (1e-5: on one CI machine two of 128
    outputs were 1.4e-6 apart, on this one none above 1e-6)."""
    from torchvision.models.vision_transformer import VisionTransformer

    from fedforget.models import SelfAttention

    torch.manual_seed(0)
    model = build_model("vit", (3, 16, 16), 5, {**SMALL_VIT, "image_size": 16})
    shape = (16, SMALL_VIT["patch_size"], SMALL_VIT["layers"], SMALL_VIT["heads"], SMALL_VIT["hidden_dim"], SMALL_VIT["mlp_dim"])
    ref = VisionTransformer(*shape)
    ref.heads = torch.nn.Identity()
    mine = model.body.vit
    assert all(isinstance(b.self_attention, SelfAttention) for b in mine.encoder.layers)
    state = {}
    for k, v in mine.state_dict().items():  # SelfAttention's names back to MHA's
        state[k.replace("self_attention.in_proj.", "self_attention.in_proj_")] = v
    ref.load_state_dict(state, strict=True)
    x = torch.randn(4, 3, 16, 16)
    a, b = mine(x), ref(x)
    assert torch.equal(a, b)
    ga = torch.autograd.grad(a.square().sum(), list(mine.parameters()))
    gb = torch.autograd.grad(b.square().sum(), list(ref.parameters()))
    assert all(torch.equal(u, v) for u, v in zip(ga, gb, strict=True))
    mine.eval(), ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(mine(x), ref(x), atol=1e-5, rtol=1e-5)
    # the converted weights are the MHA's, in its dtype
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).double()
    sa = SelfAttention.of(mha)
    assert sa.in_proj.weight.dtype == torch.float64 and torch.equal(sa.in_proj.weight, mha.in_proj_weight)
    with pytest.raises(FedForgetError, match="self-attention of a"):
        sa(torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(2, 3, 8, dtype=torch.float64))


IMAGES = {"num_train": 48, "num_test": 20, "channels": 3, "size": 32}
MNIST_LIKE = {"num_train": 48, "num_test": 20}
PUBLIC = {"source": "holdout", "fraction": 0.25, "seed": 0}


@pytest.fixture(scope="module")
def blobs_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("blobs")
    for opts in (IMAGES, MNIST_LIKE):
        prepare_dataset("blobs", opts, root)
        prepare_public(PUBLIC, dataset_id("blobs", opts), root)
    return root


MODELS = [("vgg11", IMAGES, {}), ("resnet18_imagenet", IMAGES, {}), ("vit", IMAGES, SMALL_VIT),
          ("slvit", IMAGES, SMALL_SLVIT), ("cnn_fedgp", MNIST_LIKE, {})]  # fmt: skip
USERS = [("fedsol", {"perturb": "head"}), ("moon", {}), ("fedproj", {"memory_batch_size": 8})]


@pytest.mark.parametrize("method,params", USERS, ids=[m for m, _ in USERS])
@pytest.mark.parametrize("model,data,opts", MODELS, ids=[m for m, _, _ in MODELS])
def test_head_and_feature_methods_run_on_each_model(
    make_run_config, blobs_root, model, data, opts, method, params
) -> None:
    """FedSOL perturbs the head, MOON contrasts features, FedProj distils on the public set
    through the features and logits: one round of two clients on each model."""
    rc = make_run_config(dataset="blobs", options=data, model=model, model_options=opts, method=method,
                         params=params, public=PUBLIC, rounds=1, batch_size=16, device="cpu", optimizer={"lr": 0.01},
                         partition=PartitionSpec("iid", clients=2, seed=0))  # fmt: skip
    sim = Simulation(replace(rc, data_dir=str(blobs_root)))
    status, rows, msg = sim.run(progress=False)
    assert status == "completed", msg
    assert 0 <= rows[-1]["global_model_test_acc"] <= 100


def test_slvit_trains_batched_as_sequentially(make_run_config, run_engines, assert_same_metrics, blobs_root) -> None:
    """SL-ViT (FedSOL Table 3) in the batched engine (stacked_forward since 2026-12-02: each
    client's LayerNorms, matmuls and attention temperature; vmap before) equals the
    sequential trainer within 1e-5: uneven clients, momentum, 2 rounds."""
    rc = make_run_config(dataset="blobs", options=IMAGES, model="slvit", model_options=SMALL_SLVIT, rounds=2,
                         batch_size=16, optimizer={"lr": 0.05, "momentum": 0.9}, device="cpu",
                         partition=PartitionSpec("dirichlet", clients=3, alpha=0.5, min_size=4, seed=0))  # fmt: skip
    out = run_engines(replace(rc, data_dir=str(blobs_root)))
    assert_same_metrics(out["sequential"][1], out["vectorized"][1])


@pytest.mark.parametrize("method,params", [("fedavg", {}), ("fedsol", {"perturb": "all"})])
def test_vit_trains_batched_as_sequentially(make_run_config, run_engines, assert_same_metrics, blobs_root, method,
                                            params) -> None:  # fmt: skip
    """torchvision's ViT (FedProTIP Table 7) in the batched engine (stacked_forward since
    2026-12-03: each client's patch embedding, class token, position embedding, LayerNorms,
    attention projections and MLPs; vmap before, which ``auto`` refused on a GPU) equals the
    sequential trainer within 1e-5: uneven clients, momentum, 2 rounds; FedSOL's second pass
    at perturbed weights (every parameter) through it too."""
    rc = make_run_config(dataset="blobs", options=IMAGES, model="vit", model_options=SMALL_VIT, rounds=2, method=method,
                         params=params, batch_size=16, optimizer={"lr": 0.05, "momentum": 0.9}, device="cpu",
                         partition=PartitionSpec("dirichlet", clients=3, alpha=0.5, min_size=4, seed=0))  # fmt: skip
    out = run_engines(replace(rc, data_dir=str(blobs_root)))
    assert stacked_supported(out["vectorized"][0].model) is None
    assert_same_metrics(out["sequential"][1], out["vectorized"][1])


@pytest.mark.parametrize("method", ["fedprox", "feddyn", "fedcurv", "scaffold"])
def test_step_terms_over_a_scalar_parameter(make_run_config, run_engines, assert_same_metrics, blobs_root, method) -> None:
    """The per-step terms sum each client's stacked parameters, SL-ViT's 0-d attention
    temperature included ([G] stacked: FedProx failed on it), alike in both trainers."""
    rc = make_run_config(dataset="blobs", options=IMAGES, model="slvit", model_options=SMALL_SLVIT, rounds=2,
                         batch_size=16, device="cpu", method=method,
                         partition=PartitionSpec("iid", clients=2, seed=0))  # fmt: skip
    out = run_engines(replace(rc, data_dir=str(blobs_root)))
    assert_same_metrics(out["sequential"][1], out["vectorized"][1])
