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

from fedforget.data import dataset_id, prepare_dataset, prepare_public
from fedforget.engine import Simulation
from fedforget.methods import METHODS
from fedforget.models import build_model, check_model
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
    with pytest.raises(FedForgetError, match="ViT-B/16 shape"):
        check_model("vit", (3, 32, 32), {"pretrained": True, "layers": 2})
    with pytest.raises(FedForgetError, match="multiple of patch_size"):
        check_model("vit", (3, 32, 32), {**SMALL_VIT, "patch_size": 5})


def test_vit_resizes_inputs_and_returns_the_class_token_features() -> None:
    torch.manual_seed(0)
    model = build_model("vit", (3, 16, 16), 5, SMALL_VIT)
    z, logits = model.forward_with_features(torch.randn(3, 3, 16, 16))
    assert z.shape == (3, 32) and logits.shape == (3, 5)


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
          ("cnn_fedgp", MNIST_LIKE, {})]  # fmt: skip
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
