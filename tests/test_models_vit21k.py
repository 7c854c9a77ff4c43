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
    for ok in (False, True, "imagenet1k", "imagenet21k", "augreg_in21k"):
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
    # augreg_in21k reads the timm checkpoint of the hub by default: offline and uncached, named
    with pytest.raises(FedForgetError, match=r"'timm/vit_base_patch16_224.augreg_in21k' is not in the Hugging Face cache"):
        build_model("vit", (3, 224, 224), 5, {"pretrained": "augreg_in21k"})


# ----------------------------------------------------------------------------- augreg_in21k


def tiny_timm_checkpoint(path, layers: int = 2, e: int = 16, p: int = 4, side: int = 8, mlp: int = 32) -> dict:
    """A random timm-layout ViT state dict (the names of timm's VisionTransformer, as
    vit_base_patch16_224.augreg_in21k's model.safetensors holds them, head included) saved
    as ``path``/model.safetensors; returns it."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    n = (side // p) ** 2 + 1

    def r(*shape):
        return 0.3 * torch.randn(*shape, generator=g)

    sd = {"cls_token": r(1, 1, e), "pos_embed": r(1, n, e), "patch_embed.proj.weight": r(e, 3, p, p),
          "patch_embed.proj.bias": r(e), "norm.weight": 1 + r(e), "norm.bias": r(e), "head.weight": r(7, e), "head.bias": r(7)}  # fmt: skip
    for i in range(layers):
        b = f"blocks.{i}."
        sd.update({b + "norm1.weight": 1 + r(e), b + "norm1.bias": r(e), b + "attn.qkv.weight": r(3 * e, e),
                   b + "attn.qkv.bias": r(3 * e), b + "attn.proj.weight": r(e, e), b + "attn.proj.bias": r(e),
                   b + "norm2.weight": 1 + r(e), b + "norm2.bias": r(e), b + "mlp.fc1.weight": r(mlp, e),
                   b + "mlp.fc1.bias": r(mlp), b + "mlp.fc2.weight": r(e, mlp), b + "mlp.fc2.bias": r(e)})  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path / "model.safetensors"))
    return sd


def timm_features(sd: dict, x: torch.Tensor, heads: int, layers: int) -> torch.Tensor:
    """The class token's final representation as timm's ViT (and FedProTIP's models/vit.py)
    computes it, written out: patch embedding, class token, position embedding, pre-norm
    blocks (qkv reshaped [B, N, 3, H, d], softmax(q k^T / sqrt(d)) v, proj; fc1, GELU, fc2),
    final norm, token 0."""
    import torch.nn.functional as F

    w = sd["patch_embed.proj.weight"]
    e, p = w.shape[0], w.shape[-1]
    t = F.conv2d(x, w, sd["patch_embed.proj.bias"], stride=p).flatten(2).transpose(1, 2)
    t = torch.cat([sd["cls_token"].expand(len(x), -1, -1), t], 1) + sd["pos_embed"]
    b, n, _ = t.shape
    for i in range(layers):
        k = f"blocks.{i}."
        h = F.layer_norm(t, (e,), sd[k + "norm1.weight"], sd[k + "norm1.bias"], 1e-6)
        qkv = F.linear(h, sd[k + "attn.qkv.weight"], sd[k + "attn.qkv.bias"]).reshape(b, n, 3, heads, e // heads)
        q, kk, v = qkv.permute(2, 0, 3, 1, 4)
        a = ((q @ kk.transpose(-2, -1)) * (e // heads) ** -0.5).softmax(-1)
        t = t + F.linear((a @ v).transpose(1, 2).reshape(b, n, e), sd[k + "attn.proj.weight"], sd[k + "attn.proj.bias"])
        h = F.layer_norm(t, (e,), sd[k + "norm2.weight"], sd[k + "norm2.bias"], 1e-6)
        h = F.gelu(F.linear(h, sd[k + "mlp.fc1.weight"], sd[k + "mlp.fc1.bias"]))
        t = t + F.linear(h, sd[k + "mlp.fc2.weight"], sd[k + "mlp.fc2.bias"])
    return F.layer_norm(t, (e,), sd["norm.weight"], sd["norm.bias"], 1e-6)[:, 0]


def test_augreg_checkpoint_gives_timms_features(tmp_path) -> None:
    """pretrained: augreg_in21k (FedProTIP Table 7's checkpoint) from a local timm
    model.safetensors: the features are timm's forward of the same weights; the head is
    dropped; a wrong shape, a missing file and a foreign parameter are named."""
    sd = tiny_timm_checkpoint(tmp_path / "augreg")
    opts = {**SHAPE, "pretrained": "augreg_in21k", "name_or_path": str(tmp_path / "augreg")}
    check_model("vit", (3, 8, 8), opts)
    model = build_model("vit", (3, 8, 8), 5, opts).eval()
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model.features(x), timm_features(sd, x, heads=2, layers=2), atol=1e-5, rtol=1e-5)
    with pytest.raises(FedForgetError, match=r"(?s)has the shape .*'mlp_dim': 32.* ask for .*'mlp_dim': 64"):
        build_model("vit", (3, 8, 8), 5, {**opts, "mlp_dim": 64})
    with pytest.raises(FedForgetError, match="does not hold a Hugging Face model.*no model.safetensors"):
        build_model("vit", (3, 8, 8), 5, {**opts, "name_or_path": str(tmp_path)})
    tiny_timm_checkpoint(tmp_path / "odd")
    from safetensors.torch import load_file, save_file

    odd = load_file(str(tmp_path / "odd" / "model.safetensors"))
    odd["fc_norm.weight"] = torch.ones(16)
    save_file(odd, str(tmp_path / "odd" / "model.safetensors"))
    with pytest.raises(FedForgetError, match=r"has parameters a ViT-B/16 has not: \['fc_norm.weight'\]"):
        build_model("vit", (3, 8, 8), 5, {**opts, "name_or_path": str(tmp_path / "odd")})
    # the hub's checkpoint by default, which is a B/16
    with pytest.raises(FedForgetError, match="pretrained='augreg_in21k' needs the ViT-B/16 shape"):
        check_model("vit", (3, 8, 8), {**SHAPE, "pretrained": "augreg_in21k"})
