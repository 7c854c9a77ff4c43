"""From stored rows to model inputs: where a run's training pool lives (on the device, or
streamed from a memory map), how stored dtypes become model inputs, and the papers' seeded
on-device augmentation.

Prepared data keep their natural dtype (``fedforget.data``): float32 features, uint8
images, int64 token ids. A minibatch is gathered in that dtype and converted on the device
(``InputPipeline.convert``): uint8 images to float32 in [0, 1], then normalised per channel
by the training split's mean and standard deviation (meta.json ``normalize``); float and
integer inputs pass through unchanged, so embedded data give exactly the inputs they gave
before natural dtypes.

Storage (``train.data_storage``, a runtime setting: it changes speed, never results):
``device`` holds the pool as one tensor on the training device (today's path); ``stream``
keeps it in a read-only memory map of the prepared ``.npy`` file and gathers each
minibatch's rows on the host (sorted, so the reads are sequential in the file), into pinned
memory, then copies it to the device without blocking; ``auto`` streams when the pool would
take more than half of the free device memory (on a CPU, of the available RAM). The rows
gathered are the same in both, so a streamed run gives the same bytes as an in-memory one.

Augmentation [P: the papers' CIFAR recipe, random crop with zero padding 4 then horizontal
flip with probability 1/2; C: torchvision's RandomCrop pads the raw image, before Normalize,
so the padding is black: ``InputPipeline.black``; resizing for pretrained backbones is the model's own first module,
``models.Resize``] is seeded by keys, not by a generator's state [D]: the crop offsets and
the flip of a training row depend only on (the run's seed, the row's position in the pool,
its occurrence = (round - 1) * epochs + epoch + 1), through a counter-based hash computed on
the device. Both client engines therefore augment every row identically, whatever order or
grouping clients train in, CUDA graphs replay it (the occurrence travels inside the
position tensor, ``encode``), and nothing needs checkpointing. Rows read outside local
training steps (test sets, method passes over a client's data) are not augmented.

Rows a method replays from its own store during a local step (iCaRL's and GLFC's exemplars:
model inputs already, kept in the client's state) go through the same ``crop_flip``
(``InputPipeline.replay_inputs``, reached as ``ClientContext.augment_rows``) where the
method's source augments them [D: the keying]: the hash's salt is keyed by (the run's seed,
REPLAY_AUGMENT_STREAM, the method's stream tag, round, client, local step) and each row's
draw is its index in the store, so every step sees a new crop of a row, a resumed run the
same ones, and the draws never coincide with the private rows' (another salt).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from .cudagraph import graphs_enabled
from .utils import FedForgetError, host_to_device, torch_seed

AUGMENTS = ("none", "crop_flip")
STORAGES = ("auto", "device", "stream")
AUGMENT_STREAM = 0xA6  # keyed randomness of the augmentation hash
REPLAY_AUGMENT_STREAM = 0xA8  # ... of replayed rows' augmentation (InputPipeline.replay_inputs)
_P = 2_147_483_647  # 2^31 - 1: the hash's modulus (every product stays below 2^62)
_MULT = (48_271, 69_621, 1_103_515_245 % _P, 16_807)


def check_augment(spec: dict | None, input_shape: Sequence[int], key: str) -> dict | None:
    """The resolved ``dataset.augment`` block ({kind, pad}), or None for none; raises
    FedForgetError naming the key and the allowed values."""
    if spec is None:
        return None
    spec = dict(spec)
    unknown = sorted(set(spec) - {"kind", "pad"})
    if unknown:
        raise FedForgetError(f"{key}: unknown key(s) {unknown}; allowed: kind, pad")
    if "kind" not in spec:  # an empty block would otherwise turn a crop on
        raise FedForgetError(f"{key}: no kind; allowed: kind: {' | '.join(AUGMENTS)} (absent block: none)")
    kind = spec["kind"]
    if kind not in AUGMENTS:
        raise FedForgetError(f"{key}.kind={kind!r}; allowed: {', '.join(AUGMENTS)}")
    if kind == "none":
        if "pad" in spec:
            raise FedForgetError(f"{key}.pad={spec['pad']!r} with kind 'none' would do nothing; allowed: pad with crop_flip")
        return None
    pad = spec.get("pad", 4)
    if not isinstance(pad, int) or isinstance(pad, bool) or pad < 0:
        raise FedForgetError(f"{key}.pad={pad!r}; allowed: an integer >= 0")
    if len(input_shape) != 3:
        raise FedForgetError(
            f"{key}.kind='crop_flip' needs images [C, H, W]; this dataset's inputs are {list(input_shape)}"
        )
    return {"kind": kind, "pad": pad}


def check_normalize(spec: dict | None, input_shape: Sequence[int], key: str, uint8: bool = True) -> dict | None:
    """The ``dataset.normalize`` block ({mean, std}: one number per channel, as the stored
    images scaled to [0, 1] are normalised in place of the training split's own statistics,
    e.g. the FedSOL code's 0.5 / 0.5 on MedMNIST), or None; raises FedForgetError naming the
    key and what is allowed. What the config schema and ``validation.check_numbers`` check
    before (numbers, finite, std > 0) is not checked again: here the dataset's side, images
    and one value per channel; ``uint8``: whether the dataset stores uint8 images (its
    ``DatasetInfo.uint8_images``). Values are kept as written (the run's hash)."""
    if spec is None:
        return None
    if len(input_shape) != 3:
        raise FedForgetError(f"{key} needs images [C, H, W]; this dataset's inputs are {list(input_shape)}")
    if not uint8:
        raise FedForgetError(f"{key} is for datasets stored as uint8 images; this one stores float inputs, used as they are")
    c = int(input_shape[0])
    for name in ("mean", "std"):
        if len(spec[name]) != c:
            bound = " > 0" if name == "std" else ""
            raise FedForgetError(
                f"{key}.{name}={spec[name]!r}; allowed: a list of {c} finite numbers{bound} (one per channel)"
            )
    return dict(spec)


def _mix(h: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """One round of the hash on int64 values in [0, 2^31): an affine map modulo the prime
    2^31 - 1 followed by an xor-shift (no product leaves int64)."""
    h = (h * a + b) % _P
    return h ^ (h >> 11)


def keyed_uniform_ints(draw: torch.Tensor, salt: int, n: int) -> list[torch.Tensor]:
    """``n`` pseudo-random int64 tensors in [0, 2^31) per element of ``draw`` (int64 >= 0),
    a pure function of (draw, salt): a counter-based hash, the same on every device."""
    lo, hi = draw % _P, draw // _P
    s = salt % _P
    h = _mix(_mix(lo, _MULT[0], s) + hi % _P, _MULT[1], (s * 7 + 1) % _P)
    out = []
    for i in range(n):
        h = _mix(h, _MULT[2 + i % 2], (s + 97 * (i + 1)) % _P)
        out.append(h)
    return out


def crop_flip(
    x: torch.Tensor, draw: torch.Tensor, salt: int, pad: int, fill: torch.Tensor | None = None
) -> torch.Tensor:
    """Random crop of each image of ``x`` [B, C, H, W] from its copy padded with ``fill``
    ([C, 1, 1]: the model input of a black pixel; None: 0), then a horizontal flip with
    probability 1/2; offsets and flips from ``keyed_uniform_ints``. The copy is padded by one
    pixel, whatever ``pad`` [D]: every source pixel in the padding reads that border (the same
    values; a pad of 10**12 tried to allocate a copy padded that much)."""
    b, c, h, w = x.shape
    dy, dx, flip = keyed_uniform_ints(draw, salt, 3)
    dy, dx, flip = dy % (2 * pad + 1), dx % (2 * pad + 1), (flip % 2).bool()
    rows = dy[:, None] - pad + torch.arange(h, device=x.device)  # [B, H] source rows (< 0 or >= h: padding)
    cols = dx[:, None] - pad + torch.arange(w, device=x.device)  # [B, W]
    cols = torch.where(flip[:, None], cols.flip(1), cols)  # a flipped crop reads its columns backwards
    if pad:
        xp = fill.to(x.dtype).expand(b, c, h + 2, w + 2).clone() if fill is not None else x.new_zeros(b, c, h + 2, w + 2)
        xp[:, :, 1 : h + 1, 1 : w + 1] = x
        x, rows, cols = xp, rows.clamp(-1, h) + 1, cols.clamp(-1, w) + 1
    bi = torch.arange(b, device=x.device)[:, None, None]
    out = x.permute(0, 2, 3, 1)[bi, rows[:, :, None], cols[:, None, :]]  # [B, H, W, C]
    return out.permute(0, 3, 1, 2)


@functools.cache
def _channel_tensors(mean: tuple, std: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """mean and std as [C, 1, 1] tensors on ``device``, made once (a step captured as a CUDA
    graph may copy nothing from the host)."""
    m = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1).to(device)
    s = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1).to(device)
    return m, s


@functools.cache
def _black(mean: tuple, std: tuple, device: torch.device) -> torch.Tensor:
    """-mean / std as [C, 1, 1] on ``device`` (``InputPipeline.black``), made once."""
    m, s = _channel_tensors(mean, std, device)
    return -m / s


@dataclass(frozen=True)
class InputPipeline:
    """Stored rows -> model inputs, on the device. ``scale``: uint8 inputs are divided by it
    (255) and normalised by ``mean``/``std`` (per channel); ``augment``: the resolved
    ``dataset.augment`` block or None; ``seed``: the run's seed (the augmentation key)."""

    scale: float | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    augment: dict | None = None
    seed: int = 0

    @classmethod
    def of(cls, meta: dict, augment: dict | None, seed: int, normalize: dict | None = None) -> InputPipeline:
        """The pipeline of a prepared dataset (``meta``: its uint8 images' scale and channel
        statistics), normalised by ``normalize`` ({mean, std}, ``dataset.normalize``) where
        given instead of those statistics."""
        norm = meta.get("normalize") or {}
        if normalize is not None:
            if not norm:
                raise FedForgetError(
                    f"dataset.normalize is for uint8 images; dataset '{meta.get('id', '?')}' stores other inputs"
                )
            norm = {**norm, "mean": normalize["mean"], "std": normalize["std"]}
        return cls(
            float(norm["scale"]) if norm else None,
            tuple(float(v) for v in norm["mean"]) if norm else None,
            tuple(float(v) for v in norm["std"]) if norm else None,
            augment,
            seed,
        )

    def convert(self, x: torch.Tensor) -> torch.Tensor:
        """Stored dtype -> model input: uint8 images [..., C, H, W] scaled and normalised per
        channel; anything else as is."""
        if x.dtype != torch.uint8:
            return x
        out = x.to(torch.float32) / self.scale if self.scale else x.to(torch.float32)
        if self.mean is not None:
            mean, std = _channel_tensors(self.mean, self.std, x.device)
            out = (out - mean) / std
        return out

    def black(self, device: torch.device) -> torch.Tensor | None:
        """The model input of a stored 0 (a black pixel) per channel, [C, 1, 1]: what a crop
        pads with, as torchvision's RandomCrop pads the raw image before its Normalize [C: the
        papers' code]; None where that is 0 (inputs not normalised)."""
        return None if self.mean is None else _black(self.mean, self.std, device)

    def train_inputs(self, x: torch.Tensor, draw: torch.Tensor | None) -> torch.Tensor:
        """Training rows ``x`` (stored dtype, [B, ...]) as the model sees them: converted,
        then augmented where ``draw`` (int64 [B], the rows' keys) is given."""
        x = self.convert(x)
        if self.augment is None or draw is None:
            return x
        salt = torch_seed(self.seed, AUGMENT_STREAM) % _P
        return crop_flip(x, draw, salt, self.augment["pad"], self.black(x.device))

    def replay_inputs(self, x: torch.Tensor, rows: torch.Tensor, *key: int) -> torch.Tensor:
        """Rows ``x`` [B, C, H, W] a method replays from its own store (model inputs, already
        converted) augmented as training rows are (``crop_flip``), the hash salted by (the
        run's seed, REPLAY_AUGMENT_STREAM, ``key``: the method's stream tag, round, client,
        local step) with each row's index in the store ``rows`` (int64 [B], >= 0) as its
        draw; ``x`` itself (the same object) without augmentation."""
        if self.augment is None:
            return x
        salt = torch_seed(self.seed, REPLAY_AUGMENT_STREAM, *key) % _P
        return crop_flip(x, rows.to(device=x.device, dtype=torch.long), salt, self.augment["pad"], self.black(x.device))


# ----------------------------------------------------------------------------- storage
def occurrence(rnd: int, epoch: int, epochs: int) -> int:
    """The augmentation occurrence of local epoch ``epoch`` (0-based) of round ``rnd``
    (1-based): 1, 2, ... (0 means: not a training step, no augmentation)."""
    return (rnd - 1) * epochs + epoch + 1


class Pool:
    """A run's training inputs in their stored dtype: in memory (a tensor on a GPU, a numpy
    array on a CPU), or (streamed) a read-only memory map read a minibatch at a time.
    ``take(rows)``: the rows ``rows`` (a long tensor of any shape, on the device) as a device
    tensor [*rows.shape, ...].

    On a CPU a minibatch is one numpy gather, single-threaded [D, measured on 2 cores shared
    with other work: torch's gather of 32 CIFAR-shaped uint8 rows took 5-16 ms spread over
    its intra-op threads, numpy's 30 us]; the copy is the same bytes either way."""

    def __init__(self, x: np.ndarray, device: torch.device, stream: bool) -> None:
        self.device, self.stream = device, stream
        self.shape, self.dtype = tuple(x.shape), x.dtype
        self.tensor: torch.Tensor | None = None
        if stream:
            self.host = x  # a memory map (np.load(mmap_mode="r")) or an array
        elif device.type == "cpu" and not graphs_enabled(device):
            self.host = x if x.flags.writeable else np.array(x)  # a memory map is read into memory
        else:  # a GPU's pool; on a CPU under the tape (fedforget.cudagraph), as on a GPU
            # (on a CPU a tensor shares the array's memory: a read-only memory map is read in)
            keep = device.type != "cpu" or x.flags.writeable
            self.tensor = torch.as_tensor(np.asarray(x) if keep else np.array(x), device=device)

    @property
    def read_ahead(self) -> bool:
        """Whether training reads this pool's minibatches ahead on a background thread: a
        streamed pool on a GPU [D]. On a CPU that thread takes cores from the step
        (benchmarks/streaming.py: streamed 0.85x in-memory with it, 0.97x inline); under the
        CPU stand-in of CUDA graphs (``fedforget.cudagraph``, tests) as on a GPU."""
        return self.stream and (self.device.type == "cuda" or graphs_enabled(self.device))

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: torch.Tensor) -> torch.Tensor:
        return self.take(rows)

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        if self.tensor is not None:
            return self.tensor.index_select(0, rows.reshape(-1)).view(*rows.shape, *self.shape[1:])
        flat = rows.reshape(-1).cpu().numpy()
        if self.device.type == "cpu":
            return torch.from_numpy(np.take(self.host, flat, axis=0)).view(*rows.shape, *self.shape[1:])
        uniq, inverse = np.unique(flat, return_inverse=True)  # sorted reads, each row once
        # both copies without blocking (utils.host_to_device): a blocking one waits for every
        # step queued on the device, and a read-ahead could not run ahead of them
        block = host_to_device(torch.from_numpy(np.take(self.host, uniq, axis=0)), self.device)
        order = host_to_device(torch.from_numpy(inverse.reshape(-1)), self.device)
        return block.index_select(0, order).view(*rows.shape, *self.shape[1:])


def choose_storage(setting: str, nbytes: int, device: torch.device) -> bool:
    """Whether to stream a pool of ``nbytes`` (``train.data_storage``; see the module
    docstring for ``auto``)."""
    if setting not in STORAGES:
        raise FedForgetError(f"train.data_storage={setting!r}; allowed: {', '.join(STORAGES)}")
    if setting != "auto":
        return setting == "stream"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return False
    return nbytes > free // 2


def prefetched(fetch, items: Sequence, ahead: int = 2) -> Iterator:
    """``fetch(item)`` for each of ``items`` in order, computed up to ``ahead`` items ahead
    on a background thread (a streamed pool's host reads overlap the device's steps), whose
    copies to a GPU go to the caller's CUDA stream, ahead of the steps that read them (a
    lane's own stream: ``train.concurrent_clients``)."""
    if not items:
        return
    stream = torch.cuda.current_stream() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    threads = torch.get_num_threads()  # the caller's: a thread's own count is set by it alone

    def on_stream(item):
        torch.set_num_threads(threads)  # (a lane's share; trainers.LocalTrainer.at_once)
        if stream is None:
            return fetch(item)
        with torch.cuda.stream(stream):
            return fetch(item)

    with ThreadPoolExecutor(1) as pool:
        futures = [pool.submit(on_stream, it) for it in items[:ahead]]
        for i in range(len(items)):
            if i + ahead < len(items):
                futures.append(pool.submit(on_stream, items[i + ahead]))
            yield futures[i].result()
            futures[i] = None  # type: ignore[call-overload]
