"""A frozen encoder's features kept per distinct input row [D] (issue 32).

FedGP Table 10 trains a linear head on a frozen DistilBERT: every local epoch of every round
ran the encoder over every client's rows again (5 epochs x 100 rounds: each training row
went through it 100 times, for the same output each time), and that table was estimated at
more GPU-hours than all the others together. ``FeatureCache`` computes a row's features the
first time the body meets the row, and reads them back every later time, in training, in
evaluation and in a method's own passes (a replay buffer's rows, a public set) alike: it sits
in the body's forward (``models.HFBody``), so no trainer or method knows of it.

- **Keys**: three universal hashes of the row's integers (token ids and attention mask), each
  sum_j x_j c_j mod p with p = 2^31 - 1 and coefficients c drawn once from a fixed seed: 93
  bits, so two distinct rows share a key with probability about 2^-93 (for the 1.4M rows of
  YahooQA, about 1e-16 that any pair does). Computed on the device, no per-row Python; a
  lookup is one ``searchsorted`` over the sorted keys.
- **Determinism**: the rows a call meets for the first time are computed in chunks of exactly
  ``CHUNK`` rows (32; the last padded with copies of its first row), so a row's features are a
  function of its content alone [D], not of which rows shared its batch: the same in either
  trainer, whatever order the clients train in, on lanes or not, and wherever the row is
  first met. (Without the cache a row's features came from the batch it was in; on this
  project's CPU a BERT's features were the same bits in batches of 1 to 64, tested; GPU
  kernels chosen per batch shape may round otherwise.)
- **Validity**: the cache keeps a copy of the encoder's weights and buffers its features were
  computed with. A body whose tensors changed (their version counters: a round's weights
  loaded into a client's copy) is compared with that copy (``torch.equal``) before it reads;
  other weights start the cache over. Copies of a model share one cache (``deepcopy`` returns
  it): the trainers' copies of one frozen encoder compute each row once between them. A lock
  serialises the cache's own work (clients on lanes, ``train.concurrent_clients``); on a GPU
  each insertion begins and ends with the device synchronised: the reads other lanes queued
  on their streams finish before the insertion frees the tables they read (the allocator
  would hand that memory to the inserting stream at once), and they read finished features
  after it (insertions happen only when rows are met for the first time).
- **Bypassed** (the body runs the encoder as without a cache): forward hooks on the encoder's
  modules (a method reading its activations), torch.func transforms, CUDA graph capture,
  ``torch.compile``. One table per device and autocast state (``train.precision``).
- **Memory**: rows x features x element size on the encoder's device (YahooQA's 1.4M training
  rows x 768 float32: 4.3 GB), grown by doubling, plus one copy of the encoder's weights.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

CHUNK = 32  # [D] the rows of every first computation (a fixed shape: see the module's doc; the papers' usual batch, or a divisor of it)
_P = (1 << 31) - 1  # the hashes' prime modulus
_HASH_SEED = 0x46454154  # the coefficients' generator seed (fixed: keys are a function of rows alone)


def row_keys(x: torch.Tensor, coef: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's key (62 bits: two hashes) and check (31 bits: a third) for integer rows
    ``x`` [B, ...] with ``coef`` [3, W] (W the row's element count): sum_j x_j c_j mod p,
    each product reduced mod p first so no sum overflows int64 (W < 2^31)."""
    flat = x.reshape(x.shape[0], -1).to(torch.int64).remainder(_P)  # [B, W], in [0, p)
    h = (flat.unsqueeze(1) * coef).remainder_(_P).sum(-1).remainder_(_P)  # [B, 3]
    return h[:, 0] * (1 << 31) + h[:, 1], h[:, 2]


@dataclass
class _Table:
    """The features of one device and autocast state: ``keys`` sorted, ``checks`` and
    ``slots`` (row of ``feats``) in the same order; ``feats`` the features in insertion
    order, ``n`` rows of its capacity used."""

    keys: torch.Tensor
    checks: torch.Tensor
    slots: torch.Tensor
    feats: torch.Tensor | None = None
    n: int = 0


@dataclass
class CacheUse:
    """What one body (a model copy) last checked against its cache: the cache's generation and
    its own tensors' version counters then."""

    generation: int = -1
    versions: tuple[int, ...] = ()


class FeatureCache:
    """Features of a frozen module per distinct input row; see the module's doc."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.generation = 0  # bumped whenever the cache starts over for other weights
        self.ref: list[torch.Tensor] | None = None  # the weights and buffers it holds features of
        self.tables: dict[tuple, _Table] = {}
        self.coefs: dict[tuple, torch.Tensor] = {}
        self.computed = 0  # rows computed (first meetings), for tests and benchmarks
        self.read = 0  # rows read back

    def __deepcopy__(self, memo: dict) -> FeatureCache:
        return self  # [D] shared by every copy of the model

    def __getstate__(self) -> dict:
        return {}  # a pickled model's copy starts with an empty cache

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    @staticmethod
    def bypassed(encoder: nn.Module) -> bool:
        """Whether ``encoder`` must run as it is: hooks on its modules, a torch.func
        transform, a CUDA graph being captured, or compilation."""
        if torch._C._functorch.peek_interpreter_stack() is not None or torch.compiler.is_compiling():
            return True
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return True
        g = nn.modules.module
        if g._global_forward_hooks or g._global_forward_pre_hooks:
            return True
        return any(m._forward_hooks or m._forward_pre_hooks for m in encoder.modules())

    def _valid(self, state: list[torch.Tensor], use: CacheUse) -> None:
        """Make the cache hold features of ``state`` (the body's encoder tensors)."""
        versions = tuple(t._version for t in state)
        if use.generation == self.generation and use.versions == versions:
            return
        ref = self.ref
        same = ref is not None and len(ref) == len(state) and all(
            a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
            for a, b in zip(ref, state)
        )
        if not same:  # other weights (or the first use): start over
            self.ref = [t.detach().clone() for t in state]
            self.tables.clear()
            self.generation += 1
        use.generation, use.versions = self.generation, versions

    def _coef(self, device: torch.device, width: int) -> torch.Tensor:
        k = (device, width)
        if k not in self.coefs:
            g = torch.Generator().manual_seed(_HASH_SEED)
            self.coefs[k] = torch.randint(1, _P, (3, width), generator=g, dtype=torch.int64).to(device)
        return self.coefs[k]

    def features(
        self,
        x: torch.Tensor,
        compute: Callable[[torch.Tensor], torch.Tensor],
        state: list[torch.Tensor],
        use: CacheUse,
    ) -> torch.Tensor:
        """``compute(x)`` row by row, each row's value computed once (in a chunk of ``CHUNK``
        rows) for the weights ``state`` and read back afterwards."""
        dev = x.device
        autocast = (torch.is_autocast_enabled(dev.type), torch.get_autocast_dtype(dev.type))
        with self.lock, torch.inference_mode(False), torch.no_grad():
            self._valid(state, use)
            key, check = row_keys(x, self._coef(dev, x[0].numel()))
            t = self.tables.get((dev, autocast))
            if t is None:
                empty = torch.empty(0, dtype=torch.int64, device=dev)
                t = self.tables[(dev, autocast)] = _Table(empty, empty, empty)
            if t.n:
                idx = torch.searchsorted(t.keys, key).clamp_(max=t.n - 1)
                hit = (t.keys[idx] == key) & (t.checks[idx] == check)
            else:
                idx, hit = None, torch.zeros_like(key, dtype=torch.bool)
            miss = (~hit).nonzero().squeeze(1)
            if miss.numel() == 0:  # every row met before
                self.read += len(x)
                return t.feats[t.slots[idx]]
            # the rows met for the first time, each once
            uniq, inv = torch.unique(torch.stack([key[miss], check[miss]], 1), dim=0, return_inverse=True)
            first = torch.full((len(uniq),), len(miss), dtype=torch.int64, device=dev)
            first.scatter_reduce_(0, inv, torch.arange(len(miss), device=dev), "amin")
            new = x[miss[first]]
            parts = []
            for lo in range(0, len(new), CHUNK):
                rows = new[lo : lo + CHUNK]
                pad = CHUNK - len(rows)
                if pad:
                    rows = torch.cat([rows, rows[:1].expand(pad, *rows.shape[1:])])
                parts.append(compute(rows)[: CHUNK - pad])
            f = torch.cat(parts)
            out = f.new_empty((len(x), *f.shape[1:]))
            out[miss] = f[inv]
            if len(miss) < len(x):  # the rows met before, read before the insertion reorders the keys
                seen = hit.nonzero().squeeze(1)
                out[seen] = t.feats[t.slots[idx[seen]]]
            self._insert(t, uniq[:, 0], uniq[:, 1], f)
            self.computed += len(new)
            self.read += len(x) - len(miss)
            return out

    @staticmethod
    def _insert(t: _Table, keys: torch.Tensor, checks: torch.Tensor, f: torch.Tensor) -> None:
        if f.is_cuda:  # [D] other lanes' reads of the tables, queued on their streams, finish before any goes
            torch.cuda.synchronize(f.device)
        k = len(f)
        if t.feats is None or t.n + k > len(t.feats):  # grow by doubling
            cap = max(2 * (t.n + k), 1024)
            feats = f.new_empty((cap, *f.shape[1:]))
            if t.feats is not None:
                feats[: t.n] = t.feats[: t.n]
            t.feats = feats
        t.feats[t.n : t.n + k] = f
        keys = torch.cat([t.keys, keys])
        order = torch.argsort(keys, stable=True)
        t.keys = keys[order]
        t.checks = torch.cat([t.checks, checks])[order]
        t.slots = torch.cat([t.slots, torch.arange(t.n, t.n + k, device=f.device)])[order]
        t.n += k
        if f.is_cuda:  # [D] and other lanes' streams read finished tensors
            torch.cuda.synchronize(f.device)
