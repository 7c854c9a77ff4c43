"""Text classification sets through Hugging Face ``datasets``: MNLI, SNLI, SST-2,
Sentiment140, MARC (English), Yelp (full, 5 classes) and Yahoo! Answers topics.

A set is read from ``<root>/<name>/``, a ``DatasetDict.save_to_disk`` folder (the offline
path); when that folder is missing and ``download`` is allowed, it is loaded from the hub
(see ``table.SOURCES[name].hub``) and saved there first, so later runs need no network.
Rows are tokenized by any callable with the Hugging Face tokenizer call signature
(``tokenizer(text, text_pair=None, padding="max_length", truncation=True,
max_length=L)`` returning ``input_ids`` and ``attention_mask``), e.g. a
``transformers.AutoTokenizer``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...utils import FedForgetError
from .fetch import get_source, source_dir
from .result import SourceArrays
from .table import KIND_HUB, TextHub

log = logging.getLogger(__name__)

Tokenizer = Callable[..., Mapping[str, Any]]
BATCH = 4096  # rows tokenized per call


def _splits(hub: TextHub) -> tuple[str, str]:
    return hub.train_split, hub.test_split


def _fetch_hub(name: str, hub: TextHub, folder: Path, obtain: str) -> None:
    import datasets

    log.info("dataset '%s': loading %s (%s) from the hub", name, hub.path, hub.config)
    try:
        dd = datasets.load_dataset(hub.path, hub.config, revision=hub.revision)
    except Exception as e:  # network, auth or format errors: all mean "get it by hand"
        raise FedForgetError(
            f"dataset '{name}': cannot load {hub.path} from the hub ({type(e).__name__}: {e}); "
            f"{obtain}"
        ) from None
    missing = [s for s in _splits(hub) if s not in dd]
    if missing:
        raise FedForgetError(
            f"dataset '{name}': the hub's {hub.path} has no split(s) {missing}; splits: "
            f"{', '.join(dd)}"
        )
    keep = datasets.DatasetDict({s: dd[s] for s in _splits(hub)})
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".partial", dir=folder.parent))
    try:
        keep.save_to_disk(str(tmp))
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_hub_splits(name: str, root: str | os.PathLike, download: bool = False) -> Any:
    """The ``DatasetDict`` of text source ``name`` from ``<root>/<name>``, fetched from the
    hub first when missing and ``download`` is allowed."""
    src = get_source(name)
    if src.kind != KIND_HUB or src.hub is None:
        raise FedForgetError(f"dataset '{name}' is not a text (hub) dataset")
    import datasets

    folder = source_dir(root, name)
    if folder.exists() and not (folder / "dataset_dict.json").is_file():
        raise FedForgetError(
            f"dataset '{name}': {folder} is not a datasets.DatasetDict save_to_disk folder (no "
            f"dataset_dict.json); delete it, then {src.obtain}"
        )
    if not folder.exists():
        if not download:
            raise FedForgetError(
                f"dataset '{name}': folder {folder} is missing (a datasets.DatasetDict "
                f"save_to_disk copy with splits {', '.join(_splits(src.hub))}); {src.obtain}"
            )
        _fetch_hub(name, src.hub, folder, src.obtain)
    try:
        return datasets.load_from_disk(str(folder))
    except (FileNotFoundError, ValueError, OSError) as e:
        raise FedForgetError(
            f"dataset '{name}': cannot load {folder} ({e}); delete it, then {src.obtain}"
        ) from None


def _column(ds: Any, field: str, name: str, split: str) -> Any:
    """One column as a pyarrow ChunkedArray (Column objects iterate row by row: slow)."""
    if field not in ds.column_names:
        raise FedForgetError(
            f"dataset '{name}': split '{split}' has no column '{field}'; columns: "
            f"{', '.join(ds.column_names)}"
        )
    return ds.with_format("arrow")[field]


def _labels(raw: Any, hub: TextHub, n_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows kept, their class indices)."""
    import pyarrow.compute as pc

    raw = np.asarray(pc.fill_null(raw, -1).to_numpy(), dtype=np.int64)
    if hub.label_map is not None:
        keep = np.isin(raw, np.fromiter(hub.label_map, dtype=np.int64))
        lookup = dict(hub.label_map)
        y = np.fromiter((lookup[int(v)] for v in raw[keep]), dtype=np.int64, count=int(keep.sum()))
    else:
        keep = raw >= 0
        y = raw[keep]
    if len(y) and y.max() >= n_classes:
        raise FedForgetError(f"label {int(y.max())} out of range; allowed 0..{n_classes - 1}")
    return np.flatnonzero(keep), y


def _texts(ds: Any, hub: TextHub, rows: np.ndarray, name: str, split: str) -> list[list[str]]:
    cols = [
        [t or "" for t in _column(ds, f, name, split).take(rows).to_pylist()]
        for f in hub.text_fields
    ]
    if hub.pair:
        return cols
    return [[" ".join(s.strip() for s in parts if s and s.strip()) for parts in zip(*cols)]]


def tokenize(
    tokenizer: Tokenizer, texts: Sequence[Sequence[str]], max_length: int, name: str = ""
) -> tuple[np.ndarray, np.ndarray]:
    """``texts`` (one list, or two for sentence pairs) -> (input_ids, attention_mask), int64
    ``[N, max_length]``, tokenized ``BATCH`` rows at a time."""
    n = len(texts[0])
    ids = np.zeros((n, max_length), dtype=np.int64)
    mask = np.zeros((n, max_length), dtype=np.int64)
    for start in range(0, n, BATCH):
        batch = [t[start : start + BATCH] for t in texts]
        enc = tokenizer(
            batch[0],
            batch[1] if len(batch) > 1 else None,
            padding="max_length",
            truncation=True,
            max_length=max_length,
        )
        b_ids = np.asarray(enc["input_ids"], dtype=np.int64)
        b_mask = np.asarray(enc["attention_mask"], dtype=np.int64)
        want = (len(batch[0]), max_length)
        if b_ids.shape != want or b_mask.shape != want:
            raise FedForgetError(
                f"dataset '{name}': the tokenizer returned input_ids {b_ids.shape} and "
                f"attention_mask {b_mask.shape}, expected {want}: it must pad and truncate "
                "to max_length"
            )
        ids[start : start + len(b_ids)] = b_ids
        mask[start : start + len(b_mask)] = b_mask
    return ids, mask


def read_text(
    name: str,
    root: str | os.PathLike,
    tokenizer: Tokenizer,
    max_length: int = 128,
    download: bool = False,
) -> SourceArrays:
    """A text set as token ids int64 ``[N, max_length]`` (``x``), attention masks in
    ``extra["attention_mask_train"]``/``extra["attention_mask_test"]``, labels int64. Rows
    without a usable label are dropped (SNLI's -1, Sentiment140's neutral test rows)."""
    if int(max_length) < 1:
        raise FedForgetError(f"dataset '{name}': max_length={max_length!r}; allowed: >= 1")
    src = get_source(name)
    dd = load_hub_splits(name, root, download)
    hub = src.hub
    assert hub is not None
    out: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for key, split in zip(("train", "test"), _splits(hub)):
        if split not in dd:
            raise FedForgetError(
                f"dataset '{name}': {source_dir(root, name)} has no split '{split}'; splits: "
                f"{', '.join(dd)}"
            )
        ds = dd[split]
        try:
            rows, y = _labels(_column(ds, hub.label_field, name, split), hub, len(src.class_names))
        except FedForgetError as e:
            raise FedForgetError(f"dataset '{name}' split '{split}': {e}") from None
        dropped = ds.num_rows - len(rows)
        if dropped:
            log.info("dataset '%s' split '%s': %d unlabelled rows dropped", name, split, dropped)
        ids, mask = tokenize(tokenizer, _texts(ds, hub, rows, name, split), int(max_length), name)
        out[key] = (ids, y, mask)
    return SourceArrays(
        out["train"][0], out["train"][1], out["test"][0], out["test"][1], src.class_names,
        {"attention_mask_train": out["train"][2], "attention_mask_test": out["test"][2]},
    )  # fmt: skip
