"""Client partitioners: iid, dirichlet (label skew, bounded redraws), shards and classes
(an explicit clients x classes matrix of fractions).

A partition assigns every row of the private training pool to exactly one client. It is
stored as ``assignment.npy`` (int64, one entry per row of the dataset's training split: the
client id, or -1 for rows that are not private, e.g. a held-out public slice), with
``meta.json`` (spec, sizes, sha256) and ``class_counts.csv`` (tidy: client, class, count).
Partition seeds are separate from training seeds.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .registry import Registry
from .utils import (
    FedForgetError,
    atomic_save_npy,
    atomic_write_json,
    atomic_write_text,
    sha256_file,
)

# numpy SeedSequence stream tag, so partition randomness never collides with other streams
_STREAM = 0x5A17


@dataclass(frozen=True)
class PartitionSpec:
    scheme: str = "iid"
    clients: int = 10
    alpha: float | None = None  # dirichlet concentration
    min_size: int = 10  # dirichlet: every client holds at least this many samples
    max_redraws: int = 1000  # dirichlet: bounded redraws, then a clear error
    shards_per_client: int | None = None  # shards
    # classes: [clients][classes] fractions; column c says how class c's samples are split
    class_fractions: list[list[float]] | None = None
    seed: int = 0

    @property
    def setting(self) -> str:
        """Short label as the papers write it: iid, dirichlet-0.1, shards-2."""
        if self.scheme == "dirichlet":
            return f"dirichlet-{float(self.alpha)!r}"  # shortest exact: distinct alphas, distinct paths
        if self.scheme == "shards":
            return f"shards-{self.shards_per_client}"
        if self.scheme == "classes":
            return f"classes-{fractions_digest(self.class_fractions)}"  # the matrix is in meta.json
        return self.scheme

    @property
    def slug(self) -> str:
        """Directory name keyed by every setting that changes the result."""
        parts = [self.setting, f"k{self.clients}"]
        if self.scheme == "dirichlet":
            parts.append(f"min{self.min_size}")
        parts.append(f"ps{self.seed}")
        return "_".join(parts)

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.scheme != "dirichlet":
            d.pop("alpha"), d.pop("min_size"), d.pop("max_redraws")
        if self.scheme != "shards":
            d.pop("shards_per_client")
        if self.scheme != "classes":
            d.pop("class_fractions")
        return d


def fractions_digest(matrix: list[list[float]] | None) -> str:
    """8 hex digits naming a class-fraction matrix (its canonical JSON, floats as floats)."""
    canon = json.dumps([[float(v) for v in row] for row in matrix or []], separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:8]


PARTITIONERS: Registry[
    Callable[[np.ndarray, PartitionSpec, np.random.Generator], list[np.ndarray]]
] = Registry("partition scheme")


def check_feasible(
    spec: PartitionSpec, n: int, key: str = "partition", num_classes: int | None = None
) -> None:
    """Errors that can be known from sizes alone, before any draw (``num_classes``, when
    known, also checks the width of a class-fraction matrix)."""
    if spec.clients < 1:
        raise FedForgetError(f"{key}.clients={spec.clients}; allowed: >= 1")
    if spec.clients > n:
        raise FedForgetError(
            f"{key}.clients={spec.clients} is more than the {n} training samples available"
        )
    if spec.scheme == "dirichlet":
        if spec.alpha is None or not spec.alpha > 0:
            raise FedForgetError(f"{key}.alpha={spec.alpha}; allowed: a number > 0")
        # the only size bound: a client below N/K may still receive a whole class, so
        # past it every draw that meets min_size has positive probability (see dirichlet)
        if spec.min_size * spec.clients > n:
            raise FedForgetError(
                f"{key}: min_size={spec.min_size} x clients={spec.clients} = {spec.min_size * spec.clients} "
                f"exceeds the {n} training samples available; allowed: min_size <= {n // spec.clients} "
                f"with {spec.clients} clients, or clients <= {n // spec.min_size} with min_size={spec.min_size}"
            )
    if spec.scheme == "shards":
        s = spec.shards_per_client
        if s is None or s < 1:
            raise FedForgetError(f"{key}.shards_per_client={s}; allowed: an integer >= 1")
        if s * spec.clients > n:
            raise FedForgetError(
                f"{key}: shards_per_client={s} x clients={spec.clients} = {s * spec.clients} shards "
                f"exceeds the {n} training samples available"
            )
    if spec.scheme == "classes":
        check_class_fractions(spec.class_fractions, spec.clients, num_classes, f"{key}.class_fractions")


# a class column's fractions must sum to 1 within this tolerance
FRACTION_TOL = 1e-6


def check_class_fractions(
    m: object, clients: int, num_classes: int | None, key: str = "partition.class_fractions"
) -> None:
    """A clients x classes matrix of fractions in [0, 1] whose every column sums to 1, and
    every row (client) with some positive fraction."""
    if not isinstance(m, (list, tuple)) or not m or not all(isinstance(r, (list, tuple)) for r in m):
        raise FedForgetError(f"{key}={m!r}; allowed: a list of {clients} rows (one per client) of class fractions")
    if len(m) != clients:
        raise FedForgetError(f"{key} has {len(m)} rows; allowed: one row per client ({clients})")
    widths = {len(r) for r in m}
    if len(widths) != 1:
        raise FedForgetError(f"{key}: rows have different lengths {sorted(widths)}; allowed: one column per class")
    width = widths.pop()
    if num_classes is not None and width != num_classes:
        raise FedForgetError(f"{key} has {width} columns; allowed: one per class of the dataset ({num_classes})")
    for i, row in enumerate(m):
        for c, v in enumerate(row):
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not ok or not 0 <= v <= 1:
                raise FedForgetError(f"{key}[{i}][{c}]={v!r}; allowed: a number in [0, 1]")
    for c in range(width):
        total = sum(float(r[c]) for r in m)
        if abs(total - 1.0) > FRACTION_TOL:
            raise FedForgetError(
                f"{key}: column {c} (class {c}) sums to {total:.6g}; allowed: every class column sums to 1"
            )
    for i, row in enumerate(m):
        if not any(v > 0 for v in row):
            raise FedForgetError(f"{key}[{i}] is all zeros; allowed: every client holds some class")


@PARTITIONERS.register("iid")
def iid(y: np.ndarray, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    return list(np.array_split(rng.permutation(len(y)), spec.clients))


@PARTITIONERS.register("dirichlet")
def dirichlet(y: np.ndarray, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    """Label skew (MOON/FedProj style): per class draw p ~ Dir(alpha) over clients, give no
    more to clients that already hold N/K samples, and redraw the whole partition until every
    client holds >= min_size, at most ``max_redraws`` times.

    A draw only counts samples per client (no per-client index lists), so a redraw costs a
    few array operations per class also at 1000s of clients; the index lists are built for
    the accepted draw only. The random stream (per class: permutation, then Dirichlet) is
    the same as when every draw built its lists, so a seed gives the same partition. Past
    ``check_feasible`` (min_size x clients <= N) a draw that meets min_size is possible (a
    client below N/K may still receive any part of a class), however unlikely, so the rest
    can only be found by drawing: ``max_redraws`` cheap draws, then an error that says which
    min_size the best draw met."""
    n, k = len(y), spec.clients
    members = [np.flatnonzero(y == c) for c in np.unique(y)]
    clients = np.arange(k)
    best = -1  # the largest smallest client over the draws
    for _ in range(spec.max_redraws):
        sizes = np.zeros(k, dtype=np.int64)
        perms, counts = [], []
        for rows in members:
            idx = rng.permutation(rows)
            p = rng.dirichlet(np.full(k, spec.alpha))
            p = np.where(sizes < n / k, p, 0.0)  # cap: clients at N/K get no more
            p = p / p.sum() if p.sum() > 0 else np.full(k, 1.0 / k)
            cuts = (np.cumsum(p) * len(idx)).astype(np.int64)[:-1]
            count = np.diff(cuts, prepend=0, append=len(idx))  # the sizes np.split(idx, cuts) gives
            sizes += count
            perms.append(idx)
            counts.append(count)
        smallest = int(sizes.min())
        best = max(best, smallest)
        if smallest >= spec.min_size:
            # client j: its piece of each class in class order, each in permuted order
            owner = np.concatenate([np.repeat(clients, c) for c in counts])
            order = np.concatenate(perms)[np.argsort(owner, kind="stable")]
            return np.split(order, np.cumsum(sizes)[:-1])
    held = (
        "in every draw some client held no sample"
        if best <= 0
        else f"the best draw's smallest client held {best} samples (min_size <= {best} is met with this alpha, clients and seed)"
    )
    raise FedForgetError(
        f"dirichlet partition infeasible: alpha={spec.alpha}, clients={k}, min_size={spec.min_size} "
        f"on {n} samples: after max_redraws={spec.max_redraws} redraws {held}; "
        f"raise alpha, lower min_size or clients, or raise max_redraws"
    )


@PARTITIONERS.register("shards")
def shards(y: np.ndarray, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    """FedSOL/McMahan shards: sort by label, cut into s*K shards (shards per class = s*K/C,
    in proportion to class sizes when that is not an integer, so every shard holds one
    class), give each client s shards at random. With fewer shards than classes the sorted
    order is cut into s*K contiguous pieces instead."""
    s, k = spec.shards_per_client, spec.clients
    classes, sizes = np.unique(y, return_counts=True)
    total = s * k
    if total >= len(classes):
        per_class = _allocate(total, sizes)
        pieces = []
        for c, m in zip(classes, per_class):
            pieces.extend(np.array_split(rng.permutation(np.flatnonzero(y == c)), m))
    else:
        order = rng.permutation(len(y))
        pieces = np.array_split(order[np.argsort(y[order], kind="stable")], total)
    owner = rng.permutation(total)
    return [np.concatenate([pieces[j] for j in owner[i * s : (i + 1) * s]]) for i in range(k)]


@PARTITIONERS.register("classes")
def classes(y: np.ndarray, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    """Explicit label skew: client k receives exactly ``class_counts_for(y, fractions)[k, c]``
    samples of class c (fraction * class size, rounded by largest remainder so that every
    sample of the class is assigned), drawn without replacement: class c's indices are
    permuted with the partition seed and cut into consecutive pieces of those sizes."""
    counts = class_counts_for(y, spec.class_fractions)
    if (counts.sum(1) == 0).any():
        empty = np.flatnonzero(counts.sum(1) == 0).tolist()
        raise FedForgetError(
            f"classes partition: client(s) {empty} receive no sample from these fractions on "
            f"{len(y)} samples; raise their fractions"
        )
    buckets: list[list[np.ndarray]] = [[] for _ in range(spec.clients)]
    for c in range(counts.shape[1]):
        idx = rng.permutation(np.flatnonzero(y == c))
        for k, part in enumerate(np.split(idx, np.cumsum(counts[:, c])[:-1])):
            buckets[k].append(part)
    return [np.concatenate(b) for b in buckets]


def class_counts_for(y: np.ndarray, fractions: list[list[float]]) -> np.ndarray:
    """[clients, classes] sample counts of the ``classes`` scheme: per class c of size n_c,
    floor(f_kc * n_c) each, then the n_c - sum left over go one each to the clients with the
    largest remainders f_kc * n_c - floor(.) (ties: lower client id). Classes are 0..C-1."""
    f = np.asarray(fractions, dtype=np.float64)
    labels = np.unique(y)
    if labels.size and (labels.min() < 0 or labels.max() >= f.shape[1]):
        raise FedForgetError(
            f"classes partition: labels {labels.tolist()} do not fit a matrix of {f.shape[1]} class columns"
        )
    sizes = np.bincount(y, minlength=f.shape[1])
    exact = f * sizes  # [K, C]
    counts = np.floor(exact + 1e-9).astype(np.int64)
    for c in range(f.shape[1]):
        short = int(sizes[c] - counts[:, c].sum())
        if short > 0:
            order = np.argsort(-(exact[:, c] - counts[:, c]), kind="stable")
            counts[order[:short], c] += 1
        elif short < 0:  # only through float slack in a column summing to 1 + tol
            order = np.argsort(exact[:, c] - counts[:, c], kind="stable")
            order = [k for k in order if counts[k, c] > 0][:-short]
            counts[order, c] -= 1
    return counts


def _allocate(total: int, sizes: np.ndarray) -> np.ndarray:
    """Split ``total`` shards over classes in proportion to their sizes (largest remainder),
    at least one shard per class and never more shards than samples."""
    exact = total * sizes / sizes.sum()
    alloc = np.clip(np.floor(exact).astype(np.int64), 1, sizes)
    while alloc.sum() < total:
        room = alloc < sizes
        alloc[np.argmax(np.where(room, exact - alloc, -np.inf))] += 1
    while alloc.sum() > total:
        alloc[np.argmax(np.where(alloc > 1, alloc - exact, -np.inf))] -= 1
    return alloc


def make_partition(
    y_train: np.ndarray,
    spec: PartitionSpec,
    excluded: np.ndarray | None = None,
    key: str = "partition",
) -> np.ndarray:
    """Assignment vector over the training split: client id per row, -1 for excluded rows."""
    fn = PARTITIONERS.get(spec.scheme, f"{key}.scheme")
    pool = np.setdiff1d(np.arange(len(y_train)), excluded if excluded is not None else [])
    check_feasible(spec, len(pool), key)
    rng = np.random.default_rng(np.random.SeedSequence([int(spec.seed), _STREAM]))
    parts = fn(y_train[pool], spec, rng)
    assignment = np.full(len(y_train), -1, dtype=np.int64)
    for cid, rows in enumerate(parts):
        assignment[pool[rows]] = cid
    return assignment


def client_indices(assignment: np.ndarray, clients: int) -> list[np.ndarray]:
    order = np.argsort(assignment, kind="stable")
    counts = np.bincount(assignment[assignment >= 0], minlength=clients)
    start = int((assignment < 0).sum())
    out, pos = [], start
    for c in counts:
        out.append(np.sort(order[pos : pos + c]))
        pos += c
    return out


def class_counts(
    assignment: np.ndarray, y: np.ndarray, clients: int, num_classes: int
) -> np.ndarray:
    """[clients, classes] matrix of sample counts."""
    mask = assignment >= 0
    flat = assignment[mask] * num_classes + y[mask]
    return np.bincount(flat, minlength=clients * num_classes).reshape(clients, num_classes)


def save_partition(
    out: str | Path,
    assignment: np.ndarray,
    spec: PartitionSpec,
    dataset_id: str,
    y: np.ndarray,
    num_classes: int,
    public_id: str | None,
) -> Path:
    out = Path(out)
    atomic_save_npy(out / "assignment.npy", assignment)
    counts = class_counts(assignment, y, spec.clients, num_classes)
    rows = ["client,class,count"] + [
        f"{i},{c},{counts[i, c]}" for i in range(spec.clients) for c in range(num_classes)
    ]
    atomic_write_text(out / "class_counts.csv", "\n".join(rows) + "\n")
    sizes = counts.sum(1)
    atomic_write_json(
        out / "meta.json",
        {
            "dataset": dataset_id,
            "public": public_id,
            "spec": spec.to_dict(),
            "setting": spec.setting,
            "slug": spec.slug,
            "n_assigned": int(sizes.sum()),
            "client_sizes": sizes.tolist(),
            "classes_per_client": (counts > 0).sum(1).tolist(),
            "sha256": {"assignment.npy": sha256_file(out / "assignment.npy")},
        },
    )
    return out


def redraw_hint(directory: Path) -> str:
    """How to get a partition back: draw it again (it is a function of its dataset, spec and
    seed, so the same bytes come back)."""
    return f"delete {directory} and rerun `snakemake` (or `fedforget partition`) to draw it again"


def recorded_sha256(meta: dict) -> str | None:
    """The sha256 of assignment.npy that meta.json records, None if it records none."""
    return (meta.get("sha256") or {}).get("assignment.npy")


def corrupt_partition(directory: str | Path) -> list[str]:
    """Problems with an existing partition directory, one line per file with the fix (the
    workflow's check at parse time, like ``data.base.corrupt_files`` for prepared data): an
    assignment.npy whose sha256 differs from the one its meta.json records (truncated or
    edited), or an unreadable meta.json. A missing directory or file is no problem here
    (the workflow draws it again). [D] A meta.json that records no sha256 is accepted
    unchecked, so that partitions written before their hash was recorded do not make the
    workflow stop, or draw them and retrain every run on them again. Every file is hashed
    at every start: an assignment is 8 bytes per training row (8 MB per million rows)."""
    directory = Path(directory)
    meta_path, path = directory / "meta.json", directory / "assignment.npy"
    if not meta_path.is_file():
        return []
    try:
        expected = recorded_sha256(json.loads(meta_path.read_text()))
    except (json.JSONDecodeError, AttributeError, TypeError) as e:
        return [f"partition file {meta_path} cannot be read ({e}); {redraw_hint(directory)}"]
    if expected is None or not path.is_file() or sha256_file(path) == expected:
        return []
    return [
        f"partition file {path} does not match the sha256 in {meta_path} (truncated or changed); "
        f"{redraw_hint(directory)}"
    ]


def load_partition(directory: str | Path) -> tuple[np.ndarray, dict]:
    directory = Path(directory)
    meta_path = directory / "meta.json"
    if not meta_path.exists():
        raise FedForgetError(
            f"partition missing: {meta_path} does not exist; run `fedforget partition`"
        )
    meta = json.loads(meta_path.read_text())
    path = directory / "assignment.npy"
    expected = recorded_sha256(meta)  # None: written before the hash was recorded (corrupt_partition)
    actual = sha256_file(path)
    if expected is not None and actual != expected:
        raise FedForgetError(
            f"corrupt partition file {path}: sha256 expected {expected}, got {actual}; {redraw_hint(directory)}"
        )
    return np.load(path, allow_pickle=False), meta
