"""DomainNet (cleaned release) from ``<domain>.zip`` and the official split lists
``<domain>_{train,test}.txt``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ...utils import FedForgetError
from .fetch import require_file, require_unpacked, source_dir
from .folders import decode_splits
from .result import SourceArrays
from .table import DOMAINNET_DOMAINS

_SAMPLE_STREAM = 0xD0D1  # SeedSequence tag of the per-domain training sample


def _read_split_list(path: Path) -> list[tuple[str, int]]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.rsplit(None, 1)
        if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
            raise FedForgetError(
                f"dataset 'domainnet': {path} line {n}: {line!r}; expected '<path> <label>'"
            )
        rows.append((parts[0], int(parts[1])))
    return sorted(rows)


def read_domainnet(
    root: str | os.PathLike,
    out_dir: str | os.PathLike,
    domains: Sequence[str] = DOMAINNET_DOMAINS,
    size: int = 224,
    download: bool = False,
    workers: int = 1,
    train_per_domain: int = 0,
) -> SourceArrays:
    """DomainNet (cleaned release): the official train/test lists of each of ``domains``
    (``<domain>_train.txt``, lines ``<domain>/<class>/<file>.jpg <label>``), rows sorted
    by path within a domain, domains in the given order. Images uint8 [N, 3, size, size]
    (about 410k train / 176k test for all six domains: ~88 GB at size 224, so pick a
    smaller size or fewer domains where disk is short). ``extra["domain_train"]`` and
    ``extra["domain_test"]`` give each row's index into ``extra["domain_names"]``.
    ``train_per_domain`` k > 0: k training rows of each domain drawn without replacement
    (all of a smaller domain), kept in path order [P: fedprotip.md App. E.1 "we sample 10k
    images per domain"]; the draw is seeded by the domain's name alone [D], so a domain
    gives the same rows in any selection or order of domains; the test lists stay whole."""
    domains = tuple(domains)
    bad = [d for d in domains if d not in DOMAINNET_DOMAINS]
    if bad or not domains or len(set(domains)) != len(domains):
        raise FedForgetError(
            f"dataset 'domainnet': option domains={list(domains)!r}; allowed: a non-empty "
            f"list without repeats of {', '.join(DOMAINNET_DOMAINS)}"
        )
    base = source_dir(root, "domainnet")
    files: dict[str, list[Path]] = {"train": [], "test": []}
    labels: dict[str, list[int]] = {"train": [], "test": []}
    dom: dict[str, list[int]] = {"train": [], "test": []}
    class_of: dict[int, str] = {}
    for di, domain in enumerate(domains):
        require_unpacked("domainnet", f"{domain}.zip", root, download)
        for split in ("train", "test"):
            listing = require_file("domainnet", f"{domain}_{split}.txt", root, download)
            entries = _read_split_list(listing)
            kept = np.ones(len(entries), dtype=bool)  # every entry names its class; kept ones are read
            if split == "train" and 0 < train_per_domain < len(entries):
                rng = np.random.default_rng(
                    np.random.SeedSequence([DOMAINNET_DOMAINS.index(domain), _SAMPLE_STREAM])
                )
                kept[:] = False
                kept[rng.choice(len(entries), train_per_domain, replace=False)] = True
            for (rel, label), keep in zip(entries, kept):
                parts = Path(rel).parts
                if len(parts) != 3 or parts[0] != domain or label < 0:
                    raise FedForgetError(
                        f"dataset 'domainnet': {listing}: entry {rel!r} {label}; expected "
                        f"'{domain}/<class>/<file> <label >= 0>'"
                    )
                if class_of.setdefault(label, parts[1]) != parts[1]:
                    raise FedForgetError(
                        f"dataset 'domainnet': label {label} is class '{class_of[label]}' "
                        f"elsewhere but '{parts[1]}' in {listing}"
                    )
                path = base / rel
                if not keep:
                    continue
                if not path.is_file():
                    raise FedForgetError(
                        f"dataset 'domainnet': {path} (listed in {listing}) is missing; "
                        f"delete {base / domain} and {base / ('.' + domain + '.zip.unpacked')} "
                        "to unpack the archive again"
                    )
                files[split].append(path)
                labels[split].append(label)
                dom[split].append(di)
    missing = sorted(set(range(len(class_of))) - set(class_of))
    if missing or not class_of:
        raise FedForgetError(
            f"dataset 'domainnet': labels {missing[:10]} appear in none of the lists of "
            f"{list(domains)}; the labels must run 0..K-1"
        )
    x = decode_splits(files, size, out_dir, workers)
    return SourceArrays(
        x["train"], np.asarray(labels["train"], dtype=np.int64),
        x["test"], np.asarray(labels["test"], dtype=np.int64),
        tuple(class_of[i] for i in range(len(class_of))),
        {
            "domain_train": np.asarray(dom["train"], dtype=np.int64),
            "domain_test": np.asarray(dom["test"], dtype=np.int64),
            "domain_names": domains,
        },
    )  # fmt: skip
