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
value is scaled by 1/(1 - p), as torch's dropout does. A client's reply in an exchange
(``client_reply``: FedGP's buffer gradient runs in training mode) draws from its own key,
``reply_key``, at step 0, set by the trainer around it. Outside a keyed step or reply (no
key set: a method's own passes in train mode elsewhere, the server's) the module is torch's
dropout on torch's generator, as ``nn.Dropout``/``nn.Dropout2d`` are; in eval mode it is
the identity.

The models that declared torch's dropout (``cnn_fedgp``) use this since issue 32: their
results changed once (other masks than torch's generator gave), and their clients can now
train stacked. A module written with torch's dropout calls (a Hugging Face encoder) has its
calls routed to keyed masks (``KeyedCalls``: one client after another, from a generator of
the device seeded per call, not the hash) since the sixth session of 2026-12-02: its results
changed once too, and its clients can train at once on lanes, and (a BERT, since the fourth
session of 2026-12-03) stacked, each client's masks drawn from its own seeds over its real
rows (``KeyedCalls.draw_stack``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .inputs import keyed_uniform_ints
from .utils import host_to_device, on_device, torch_seed

DROPOUT_STREAM = 0x55  # keyed randomness of dropout masks (0x51-0x54: schedule, shuffling, init, distillation)
_RANGE = 1 << 31  # keyed_uniform_ints draws integers in [0, 2^31)


@dataclass
class DropoutKey:
    """What a keyed module draws its masks from in a step: the clients' keys of the round
    (int64: one client's, 0-dim, or a stack's, [G]) and the local step (an int, or an int64
    0-dim tensor that a captured CUDA graph reads); ``host``: one client's key as a Python
    int too, where the trainer has it (one client after another: ``KeyedCalls``' seeds);
    ``hosts``: a stack's clients' keys as Python ints, with an int step (a training encoder
    stacked: ``KeyedCalls.draw_stack``), and ``rows`` each client's real rows in the stack's
    current pass (the first ``rows[j]`` of its B; None: all B), set by the trainer per pass."""

    clients: torch.Tensor
    step: int | torch.Tensor
    host: int | None = None
    hosts: tuple[int, ...] | None = None
    rows: Sequence[int] | None = None


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

    def draw(self, shape: Sequence[int], dtype: torch.dtype, p: float | None = None) -> torch.Tensor:
        """This call's mask ([*key.clients.shape, *mask_shape(shape)]: 0 or 1/(1 - p)) for
        activations of ``shape`` [B, ...] per client, at rate ``p`` (default: the module's);
        counts the call."""
        assert self.key is not None
        return keep_mask(self.key, self.next_salt(), self.mask_shape(shape), self.p if p is None else p, dtype)

    def next_salt(self) -> int:
        """This call's salt: the module's index and its call count in the step; counts the call."""
        salt = 1 + (self.layer << 12) + self.calls
        self.calls += 1
        return salt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if self.key is None:  # outside a keyed step: torch's dropout
            return (F.dropout2d if self.channelwise else F.dropout)(x, self.p, True)
        return x * self.draw(x.shape, x.dtype)


class KeyedCalls(KeyedDropout):
    """The keyed draws of a module written with torch's dropout calls [D]: a Hugging Face
    encoder, whose ``nn.Dropout`` modules and attention call ``F.dropout`` (its eager
    attention) or ``F.scaled_dot_product_attention`` with ``dropout_p`` (its sdpa attention).
    Inside ``routed()``, in a keyed step, each such call in training draws a mask keyed by
    the client, the step and the call's number in the step (so the masks are the module's
    whatever else the step draws), and attention with dropout is computed by its
    definition: softmax(q k^T scale + mask), times the keyed mask, times v (torch's fused
    kernels draw from the global generator). Outside a keyed step, or with dropout off,
    every call is torch's own. Draws of any other kind (``torch.bernoulli``, ``torch.rand``)
    stay torch's: ``draws_globally`` tells whether a module makes any.

    [D] Where the key has the client's key on the host (``DropoutKey.host``: one client after
    another, lanes included), a call's mask is ``torch.rand`` of a generator on the
    activation's device seeded by ``torch_seed(host, step, call salt, DROPOUT_STREAM)``: the
    same masks for a client alone or on a lane, on one kind of device (a CPU's and a GPU's
    generators differ). The counter-based hash of ``keep_mask`` (the same on every device)
    costs some twenty int64 operations per element, which for a transformer's attention
    masks ([B, heads, L, L] per layer) is more arithmetic than the layer's own; without a
    host key the hash is used."""

    def __init__(self) -> None:
        super().__init__(p=1.0)  # a stand-in > 0 (keyed_modules lists the module); each call has its own rate

    def extra_repr(self) -> str:
        return "F.dropout and attention dropout"

    def draw(self, shape: Sequence[int], dtype: torch.dtype, p: float | None = None) -> torch.Tensor:
        key = self.key
        assert key is not None and p is not None
        if key.host is None or not isinstance(key.step, int):
            return super().draw(shape, dtype, p)
        return host_mask(key.host, key.step, self.next_salt(), shape, p, dtype, key.clients.device)

    def draw_stack(self, shape: Sequence[int], p: float) -> torch.Tensor:
        """One call's keep masks (bool [G, B, ...]; scale kept elements by ``keep_scale(p)``)
        for a stack's activations of ``shape`` [G, B, ...] (``fedforget.vectorized``: a
        training encoder's clients stacked): client j's is what it draws alone (``draw``
        with its host key, ``DropoutKey.hosts[j]``) over its real rows (``DropoutKey.rows``),
        False on its padding rows; counts the call once."""
        key = self.key
        if key is None or key.hosts is None or not isinstance(key.step, int):
            raise RuntimeError("a stacked encoder step without its clients' host keys (train_clients_together sets them)")
        salt, dev = self.next_salt(), key.clients.device
        out = torch.zeros(tuple(shape), dtype=torch.bool, device=dev)
        rows = [shape[1]] * shape[0] if key.rows is None else key.rows
        for j, (host, r) in enumerate(zip(key.hosts, rows, strict=True)):
            if r:
                out[j, :r] = host_keep(host, key.step, salt, (r, *shape[2:]), p, dev)
        return out

    def routed(self) -> _Routed:
        return _Routed(self)


class _Routed(TorchFunctionMode):
    """``KeyedCalls.routed``: torch's dropout calls to the module's keyed draws."""

    def __init__(self, calls: KeyedCalls) -> None:
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.calls.key is not None:  # (the handler runs with this mode off: torch's own below)
            if func is F.dropout:
                return self.dropout(func, *args, **kwargs)
            if func is F.scaled_dot_product_attention:
                return self.attention(func, *args, **kwargs)
        return func(*args, **kwargs)

    def dropout(self, func, x, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return func(x, p, training, inplace)
        mask = self.calls.draw(x.shape, x.dtype, p)
        return x.mul_(mask) if inplace else x * mask

    def attention(self, func, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if dropout_p == 0:
            return func(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)  # fmt: skip
        if enable_gqa:  # key/value heads shared by groups of query heads
            k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
            v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
        w = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(q.size(-1)) if scale is None else scale)
        if is_causal:
            w = w.masked_fill(~torch.ones(w.shape[-2:], dtype=torch.bool, device=w.device).tril(), float("-inf"))
        if attn_mask is not None:
            w = w.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else w + attn_mask
        return self.dropout(F.dropout, w.softmax(-1), dropout_p) @ v


def draws_globally(module: nn.Module, run: Callable[[], object]) -> bool:
    """Whether ``run()`` (a forward pass of ``module`` in training, its keyed modules keyed)
    draws from torch's global generators (the host's, and the GPU's where ``module`` is on
    one) [D]; the generators and the module's mode are put back, and no gradient is taken."""
    keyed = keyed_modules(module)
    dev = next(module.parameters()).device
    cuda = dev.type == "cuda"

    def states() -> list[torch.Tensor]:
        return [torch.get_rng_state(), *([torch.cuda.get_rng_state(dev)] if cuda else [])]

    before, mode = states(), module.training
    set_dropout_key(keyed, DropoutKey(key_tensor(0, dev), 0, host=0))
    try:
        module.train()
        with torch.no_grad():
            run()
        return not all(torch.equal(a, b) for a, b in zip(before, states(), strict=True))
    finally:
        set_dropout_key(keyed, None)
        module.train(mode)
        torch.set_rng_state(before[0])
        if cuda:
            torch.cuda.set_rng_state(before[1], dev)


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


def host_mask(
    host: int, step: int, salt: int, shape: Sequence[int], p: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``KeyedCalls``' scaled keep mask of ``shape`` (values 0 and 1/(1 - p)) for the client
    of host key ``host``: ``host_keep``'s elements scaled (``scaled_mask``)."""
    return scaled_mask(host_keep(host, step, salt, shape, p, device), p, dtype)


def host_keep(host: int, step: int, salt: int, shape: Sequence[int], p: float, device: torch.device) -> torch.Tensor:
    """Which elements of ``shape`` a client of host key ``host`` keeps (bool): a draw of
    ``torch.rand`` at least p, from a generator on ``device`` seeded by ``torch_seed(host,
    step, salt, DROPOUT_STREAM)``; none at p >= 1."""
    if p >= 1:
        return torch.zeros(tuple(shape), dtype=torch.bool, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(torch_seed(host, step, salt, DROPOUT_STREAM))
    return torch.rand(tuple(shape), generator=gen, device=device) >= p


def scaled_mask(keep: torch.Tensor, p: float, dtype: torch.dtype) -> torch.Tensor:
    """Dropout's mask of keep decisions ``keep`` (bool) at rate ``p`` in ``dtype``: 0 where
    dropped, ``keep_scale(p)`` (rounded to ``dtype``) where kept."""
    return keep.to(dtype).mul_(keep_scale(p))


def keep_scale(p: float) -> float:
    """Dropout's scale of a kept element at rate ``p``: 1/(1 - p) (0 at p >= 1: nothing kept)."""
    return 0.0 if p >= 1 else 1.0 / (1.0 - p)


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


def key_tensor(keys: int | Sequence[int], device: torch.device) -> torch.Tensor:
    """Host keys (``client_key``, ``reply_key``: one client's, or a stack's in a list) as the
    int64 tensor (0-dim, or [G]) that the masks read on ``device`` [D], in one form for both
    trainers: copied without waiting for the device's queued steps (``host_to_device``)."""
    return host_to_device(torch.tensor(keys, dtype=torch.int64), device)


def reply_key(seed: int, rnd: int, cid: int, exchange: int) -> int:
    """Client ``cid``'s dropout key for its reply in round ``rnd``'s exchange number
    ``exchange`` (its index in ``methods.base.EXCHANGES``), drawn at step 0 [D]: a reply's
    pass in training mode (FedGP's buffer gradient) draws keyed masks, the same whether the
    client replies alone, on a lane or in a stack (since the first session of 2026-12-04;
    before, torch's generator)."""
    return torch_seed(seed, rnd, cid, DROPOUT_STREAM, 1 + exchange)
