"""Model 'vit' with ``pretrained: imagenet21k``: a Hugging Face ``ViTModel`` checkpoint (L2P's
ImageNet-21k ViT-B/16 on the hub, or a local save_pretrained directory) converted to
torchvision's layout. On a tiny random ViTModel saved here (offline): the class token's final
representation equals the checkpoint's own ``last_hidden_state[:, 0]``; option checks; the
offline and shape errors."""

from __future__ import annotations

import pytest
import torch

from fedforget.models import VIT_IN21K, build_model, check_model
from fedforget.utils import FedForgetError

transformers = pytest.importorskip("transformers")

SHAPE = {"image_size": 8, "patch_size": 4, "layers": 2, "heads": 2, "hidden_dim": 16, "mlp_dim": 32}


def tiny_hf_vit(eps: float = 0.1):
    """A random 2-layer ViTModel of SHAPE; every parameter perturbed (LayerNorms not 1 / 0)
    and a large LayerNorm eps, so a wrong mapping or eps shows in the outputs."""
    cfg = transformers.ViTConfig(
        image_size=8, patch_size=4, num_hidden_layers=2, num_attention_heads=2, hidden_size=16,
        intermediate_size=32, layer_norm_eps=eps,
    )  # fmt: skip
    torch.manual_seed(0)
    net = transformers.ViTModel(cfg).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return net


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("vit21k")
    net = tiny_hf_vit()
    net.save_pretrained(path)
    return net, str(path)


def test_converted_checkpoint_gives_the_checkpoints_features(saved) -> None:
    hf_net, path = saved
    model = build_model("vit", (3, 8, 8), 5, {**SHAPE, "pretrained": "imagenet21k", "name_or_path": path}).eval()
    assert all(m.eps == 0.1 for m in model.modules() if isinstance(m, torch.nn.LayerNorm))
    x = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        want = hf_net(pixel_values=x).last_hidden_state[:, 0]  # after the final layernorm
        got = model.features(x)
    assert got.shape == (4, 16)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # grayscale data: one channel repeated to RGB, as for the ImageNet-1k weights
    g = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(
            model.features(g), hf_net(pixel_values=g.expand(-1, 3, -1, -1)).last_hidden_state[:, 0],
            atol=1e-5, rtol=1e-5,
        )  # fmt: skip


def test_options_are_checked_before_any_job(saved) -> None:
    _, path = saved
    assert check_model("vit", (3, 8, 8), SHAPE)["name_or_path"] == VIT_IN21K
    for ok in (False, True, "imagenet1k", "imagenet21k"):
        check_model("vit", (3, 224, 224), {"pretrained": ok})
    with pytest.raises(FedForgetError, match=r"model\.options\.pretrained='imagenet22k'; allowed: .*imagenet21k"):
        check_model("vit", (3, 8, 8), {**SHAPE, "pretrained": "imagenet22k"})
    with pytest.raises(FedForgetError, match=r"model\.options\.pretrained=1; allowed"):
        check_model("vit", (3, 8, 8), {**SHAPE, "pretrained": 1})
    with pytest.raises(FedForgetError, match=r"model\.options\.name_or_path=''; allowed"):
        check_model("vit", (3, 8, 8), {**SHAPE, "pretrained": "imagenet21k", "name_or_path": ""})
    with pytest.raises(FedForgetError, match="pretrained='imagenet21k' needs the ViT-B/16 shape"):
        check_model("vit", (3, 8, 8), {**SHAPE, "pretrained": "imagenet21k"})  # the hub's B/16
    with pytest.raises(FedForgetError, match="pretrained=imagenet21k for model 'vit' needs 3-channel"):
        check_model("vit", (2, 8, 8), {**SHAPE, "pretrained": "imagenet21k", "name_or_path": path})
    check_model("vit", (3, 8, 8), {**SHAPE, "pretrained": "imagenet21k", "name_or_path": path})  # its own shape
    with pytest.raises(FedForgetError, match=r"(?s)checkpoint .* has the shape .*'hidden_dim': 16.* ask for .*'hidden_dim': 32"):
        build_model("vit", (3, 8, 8), 5, {**SHAPE, "hidden_dim": 32, "pretrained": "imagenet21k", "name_or_path": path})


def test_missing_weights_offline_name_them_and_how_to_get_them(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    opts = {**SHAPE, "pretrained": "imagenet21k", "name_or_path": "fedforget-test/no-such-vit"}
    with pytest.raises(
        FedForgetError,
        match=r"(?s)model 'vit': 'fedforget-test/no-such-vit' is not in the Hugging Face cache and downloads are off"
        r".*hf download fedforget-test/no-such-vit",
    ):
        build_model("vit", (3, 8, 8), 5, opts)
    with pytest.raises(FedForgetError, match="model 'vit': .* is no directory"):
        build_model("vit", (3, 8, 8), 5, {**opts, "name_or_path": str(tmp_path / "absent")})
    with pytest.raises(FedForgetError, match="does not hold a Hugging Face model"):
        build_model("vit", (3, 8, 8), 5, {**opts, "name_or_path": str(tmp_path)})
