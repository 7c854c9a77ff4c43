"""Keyed dropout (issue 32): masks that are a pure function of who draws them, so a client
draws the same masks whether it trains alone (the sequential trainer) or in a stack with
other clients (``fedforget.vectorized``: one ``stacked_forward`` or ``vmap`` pass for all),
on any device, and under CUDA graphs.

torch's dropout draws from a generator whose state depends on every draw before it; a
stack of clients cannot reproduce one client's draws from it (``vmap(randomness=
"different")`` splits the generator its own way). Here [D] a dropout module's mask is
drawn by the counter-based hash of the augmentation (``inputs.keyed_uniform_ints``, the
same integers on every device) from:

- the client's key of the round, ``client_key``: ``torch_seed(seed, round, client,
  DROPOUT_STREAM)`` (63 bits);
- its local step (0, 1, ... over its epochs: the trainers' ``ctx.steps`` and stacked step);
- the module's index among the model's keyed dropout modules (module order), and its
  forward call within the step (a method that runs the model twice in one step, as
  FedSOL's perturbed pass, draws fresh masks for each);
- the element's index in the client's activation, row-major over [B, ...] (one draw per
  (row, channel) for ``channelwise``, as ``nn.Dropout2d``), so the padding rows the
  stacked trainer appends after a client's real rows leave the real rows' draws alone.

An element is kept when its draw (uniform on [0, 2^31)) is at least p 2^31, and a kept
value is scaled by 1/(1 - p), as torch's dropout does. Outside a keyed step (no key set:
a method's own passes in train mode outside the local steps) the module is torch's
dropout on torch's generator, as ``nn.Dropout``/``nn.Dropout2d`` are; in eval mode it is
the identity.

The models that declared torch's dropout (``cnn_fedgp``) use this since issue 32: their
results changed once (other masks than torch's generator gave), and their clients can now
train stacked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .inputs import keyed_uniform_ints
from .utils import on_device, torch_seed

DROPOUT_STREAM = 0x55  # keyed randomness of dropout masks (0x51-0x54: schedule, shuffling, init, distillation)
_RANGE = 1 << 31  # keyed_uniform_ints draws integers in [0, 2^31)


@dataclass
class DropoutKey:
    """What a keyed module draws its masks from in a step: the clients' keys of the round
    (int64: one client's, 0-dim, or a stack's, [G]) and the local step (an int, or an int64
    0-dim tensor that a captured CUDA graph reads)."""

    clients: torch.Tensor
    step: int | torch.Tensor


class KeyedDropout(nn.Module):
    """``nn.Dropout`` (``channelwise=False``) or ``nn.Dropout2d`` (``channelwise=True``)
    with keyed masks (module docstring). ``key`` is set by the trainer for each local step
    (``set_dropout_key``); ``layer`` is the module's index among the model's keyed modules."""

    def __init__(self, p: float = 0.5, channelwise: bool = False) -> None:
        super().__init__()
        if not 0 <= p <= 1:
            raise ValueError(f"dropout probability p={p}; allowed: 0 <= p <= 1")
        self.p, self.channelwise = float(p), channelwise
        self.key: DropoutKey | None = None
        self.layer = 0
        self.calls = 0  # forward calls since the key was set

    def extra_repr(self) -> str:
        return f"p={self.p}, channelwise={self.channelwise}"

    def mask_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of one client's mask for an activation of ``shape`` [B, ...]."""
        if self.channelwise:
            return (*shape[:2], *[1] * (len(shape) - 2))
        return tuple(shape)

    def draw(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """This call's mask ([*key.clients.shape, *mask_shape(shape)]: 0 or 1/(1 - p)) for
        activations of ``shape`` [B, ...] per client; counts the call."""
        assert self.key is not None
        salt = 1 + (self.layer << 12) + self.calls
        self.calls += 1
        return keep_mask(self.key, salt, self.mask_shape(shape), self.p, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if self.key is None:  # outside a keyed step: torch's dropout
            return (F.dropout2d if self.channelwise else F.dropout)(x, self.p, True)
        return x * self.draw(x.shape, x.dtype)


def keep_mask(key: DropoutKey, salt: int, shape: Sequence[int], p: float, dtype: torch.dtype) -> torch.Tensor:
    """Dropout's scaled keep mask [*key.clients.shape, *shape] (values 0 and 1/(1 - p)): one
    draw per element, each client's from its key, the step and ``salt``."""
    clients = key.clients
    if p >= 1:
        return torch.zeros((*clients.shape, *shape), dtype=dtype, device=clients.device)
    n = math.prod(shape)
    per_call = keyed_uniform_ints(clients, salt, 1)[0]  # [*K]: the client's salt of this module call
    step = on_device(key.step, clients.device, torch.int64)  # (the batched steps': a tensor CUDA graphs read)
    per_step = keyed_uniform_ints(step, per_call, 1)[0]  # [*K]: ... of this step
    idx = torch.arange(n, device=clients.device).view(*shape)
    draws = keyed_uniform_ints(idx, per_step.view(*per_step.shape, *[1] * len(shape)), 1)[0]
    return (draws >= round(p * _RANGE)).to(dtype) * (1.0 / (1.0 - p))


def keyed_modules(model: nn.Module) -> list[KeyedDropout]:
    """The keyed dropout modules of ``model`` with p > 0, in module order."""
    return [m for m in model.modules() if isinstance(m, KeyedDropout) and m.p > 0]


def set_dropout_key(modules: Sequence[KeyedDropout], key: DropoutKey | None) -> None:
    """The key of a local step for every module (None: torch's dropout again); numbers
    the modules and restarts their call counts."""
    for i, m in enumerate(modules):
        m.key, m.layer, m.calls = key, i, 0


def client_key(seed: int, rnd: int, cid: int) -> int:
    """Client ``cid``'s dropout key of round ``rnd`` (63 bits)."""
    return torch_seed(seed, rnd, cid, DROPOUT_STREAM)
