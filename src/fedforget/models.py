"""Model registry. Every model is ``body`` (input -> penultimate features) + ``head`` (a
linear classifier), so methods can use features (MOON, FedProj feature distillation),
perturb only the head (FedSOL) or swap heads per task (continual track)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .registry import Registry
from .utils import FedForgetError


class Classifier(nn.Module):
    def __init__(self, body: nn.Module, feature_dim: int, num_classes: int) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(feature_dim, num_classes)
        self.feature_dim = feature_dim

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def forward_with_features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.body(x)
        return z, self.head(z)


ModelBuilder = Callable[..., Classifier]
MODELS: Registry[ModelBuilder] = Registry("model")
# input ranks each model accepts (without batch dim), for config validation before any job
MODEL_INPUT_RANK: dict[str, int] = {}
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {}


def register(name: str, rank: int, **defaults: Any) -> Callable[[ModelBuilder], ModelBuilder]:
    def deco(fn: ModelBuilder) -> ModelBuilder:
        MODELS.register(name)(fn)
        MODEL_INPUT_RANK[name] = rank
        MODEL_DEFAULTS[name] = defaults
        return fn

    return deco


@register("mlp", rank=1, hidden=[64, 64])
def mlp(
    input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (64, 64)
) -> Classifier:
    """MLP with ReLU; ``hidden`` gives the hidden widths (two hidden layers = the 3-layer MLP
    of the FedProj Iris pilot)."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for h in hidden:
        layers += [nn.Linear(width, int(h)), nn.ReLU()]
        width = int(h)
    return Classifier(nn.Sequential(*layers), width, num_classes)


@register("cnn2d", rank=3, channels=[32, 64], hidden=128)
def cnn2d(
    input_shape: Sequence[int],
    num_classes: int,
    channels: Sequence[int] = (32, 64),
    hidden: int = 128,
) -> Classifier:
    """Small 2-D CNN for 8x8 digits: conv3x3-ReLU-conv3x3-ReLU-maxpool2-FC-ReLU-FC."""
    c, h, w = input_shape
    c1, c2 = channels
    body = nn.Sequential(
        nn.Conv2d(c, c1, 3, padding=1), nn.ReLU(),
        nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(c2 * (h // 2) * (w // 2), hidden), nn.ReLU(),
    )  # fmt: skip
    return Classifier(body, hidden, num_classes)


@register("cnn1d", rank=2, channels=[32, 64], hidden=128)
def cnn1d(
    input_shape: Sequence[int],
    num_classes: int,
    channels: Sequence[int] = (32, 64),
    hidden: int = 128,
) -> Classifier:
    """1-D CNN for MNIST-1D: conv5-ReLU-conv5(stride 2)-ReLU-conv3(stride 2)-ReLU-FC-ReLU-FC."""
    c, length = input_shape
    c1, c2 = channels
    body = nn.Sequential(
        nn.Conv1d(c, c1, 5, padding=2), nn.ReLU(),
        nn.Conv1d(c1, c2, 5, stride=2, padding=2), nn.ReLU(),
        nn.Conv1d(c2, c2, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(),
    )  # fmt: skip
    with torch.no_grad():
        flat = body(torch.zeros(1, c, length)).shape[1]
    return Classifier(nn.Sequential(body, nn.Linear(flat, hidden), nn.ReLU()), hidden, num_classes)


@register("cnn_mcmahan", rank=3, hidden=512)
def cnn_mcmahan(input_shape: Sequence[int], num_classes: int, hidden: int = 512) -> Classifier:
    """McMahan et al. (2017) CNN as in the FedSOL code: conv5x5(32, pad 2)-ReLU-pool-
    conv5x5(64, pad 2)-ReLU-pool-FC(hidden)-ReLU-FC; no BatchNorm, no dropout."""
    c, h, w = input_shape
    body = nn.Sequential(
        nn.Conv2d(c, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * (h // 4) * (w // 4), hidden), nn.ReLU(),
    )  # fmt: skip
    return Classifier(body, hidden, num_classes)


def check_model(
    name: str, input_shape: Sequence[int], options: Mapping[str, Any], key: str = "model"
) -> dict[str, Any]:
    """Validate a model choice against a dataset's input shape without building it."""
    MODELS.get(name, f"{key}.name")
    unknown = sorted(set(options) - set(MODEL_DEFAULTS[name]))
    if unknown:
        raise FedForgetError(
            f"{key}: unknown option(s) {unknown} for model '{name}'; allowed: {sorted(MODEL_DEFAULTS[name])}"
        )
    rank = MODEL_INPUT_RANK[name]
    if name != "mlp" and len(input_shape) != rank:
        raise FedForgetError(
            f"{key}.name='{name}' expects inputs of rank {rank} (without batch), but the dataset gives shape {list(input_shape)}"
        )
    if name == "cnn2d" or name == "cnn_mcmahan":
        div = 2 if name == "cnn2d" else 4
        if input_shape[1] < div or input_shape[2] < div:
            raise FedForgetError(
                f"{key}.name='{name}' needs images of at least {div}x{div}, got {list(input_shape)}"
            )
    return {**MODEL_DEFAULTS[name], **options}


def build_model(
    name: str,
    input_shape: Sequence[int],
    num_classes: int,
    options: Mapping[str, Any] | None = None,
) -> Classifier:
    opts = check_model(name, input_shape, dict(options or {}))
    return MODELS.get(name)(tuple(input_shape), num_classes, **opts)
