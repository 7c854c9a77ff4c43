"""Client partitioners: iid, dirichlet (label skew, bounded redraws), shards and classes
(an explicit clients x classes matrix of fractions).

Over the whole private pool (the default), or within each task (``per_task: true``; on a
stream whose every task holds every row, rotated or permuted, that is the pool): the scheme
is drawn on each task's rows apart, with its minimum (dirichlet's ``min_size``,
``min_per_class``) per client per task, so every
client holds rows of every task [P fedgp.md Sec. 5.1.1: "Once we define the data for each
task, we split it among K clients in a non-IID manner"; fedprotip.md App.: "each client
holds at least one sample from every class present in its assigned task", ``min_per_class:
1``]. Task t's draw is keyed by (partition seed, t). Drawn over the pool, a per-class scheme
restricted to a task's classes is also that scheme within the task, but a client may hold
nothing of a task (it then does not train while the task runs).

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
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from .data.base import domain_ids
from .data.tasks import row_tasks, task_rows
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
    shard_rule: str = "equal_size"  # shards: equal_size [P] | per_class [C] | sorted [C] (SHARD_RULES)
    # classes: [clients][classes] fractions; column c says how class c's samples are split
    class_fractions: list[list[float]] | None = None
    seed: int = 0
    per_task: bool = False  # draw within each task's rows (iid, dirichlet, shards), minimums per task
    min_per_class: int = 0  # dirichlet: every client holds at least this many rows of every class
    #   (per_task: of every class of each task) [P fedprotip.md: 1], the rest drawn as usual
    # per_task: which rows each task holds (``data.tasks.task_rows`` of the dataset's scenario),
    # bound per dataset when the runs are made (``for_dataset``), never written in a config
    tasks: dict | None = None

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
            if self.min_per_class:
                parts.append(f"mpc{self.min_per_class}")
        if self.scheme == "shards" and self.shard_rule != DEFAULT_SHARD_RULE:
            parts.append(self.shard_rule.replace("_", ""))
        if self.per_task:  # the task rows' digest: two streams of one pool, two partitions
            parts.append("pertask" + (f"-{_digest(self.tasks)}" if self.tasks else ""))
        parts.append(f"ps{self.seed}")
        return "_".join(parts)

    def for_dataset(self, scenario: dict | None) -> PartitionSpec:
        """This partition for a dataset with the resolved ``scenario``: per_task binds its
        task rows (``tasks``). [D] Where every task holds every row (no scenario, rotated,
        permuted) a per-task draw is the draw over the pool (every client then holds rows of
        every task), so per_task is dropped there: one experiment's partition may serve a
        split and a rotated stream, and the rotated one's partition is the pool's."""
        if not self.per_task:
            return self
        rows = task_rows(scenario)
        return replace(self, tasks=rows) if rows else replace(self, per_task=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        for scheme, keys in SCHEME_KEYS.items():  # the keys of the other schemes: not this partition's
            if scheme != self.scheme:
                for k in keys:
                    d.pop(k, None)
        # absent unless set: the partitions drawn before these keys keep their identity
        if not self.min_per_class:
            d.pop("min_per_class", None)
        if self.shard_rule == DEFAULT_SHARD_RULE:
            d.pop("shard_rule", None)
        if not self.per_task:
            d.pop("per_task"), d.pop("tasks")
        return d


def fractions_digest(matrix: list[list[float]] | None) -> str:
    """8 hex digits naming a class-fraction matrix (its canonical JSON, floats as floats)."""
    return _digest([[float(v) for v in row] for row in matrix or []])


def _digest(value: object) -> str:
    """8 hex digits of ``value``'s canonical JSON."""
    canon = json.dumps(value, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(canon.encode()).hexdigest()[:8]


PARTITIONERS: Registry[
    Callable[[np.ndarray, PartitionSpec, np.random.Generator], list[np.ndarray]]
] = Registry("partition scheme")


# the keys each scheme reads beside scheme, clients, seed and per_task: another scheme's key
# would be dropped from the partition's identity (PartitionSpec.to_dict) and do nothing
SCHEME_KEYS = {
    "iid": (),
    "dirichlet": ("alpha", "min_size", "max_redraws", "min_per_class"),
    "shards": ("shards_per_client", "shard_rule"),
    "classes": ("class_fractions",),
}


def check_scheme_keys(raw: dict, key: str = "partition") -> None:
    """A config's partition mapping ``raw`` sets no key its scheme does not read."""
    own = SCHEME_KEYS.get(raw.get("scheme", "iid"))
    if own is None:  # an unknown scheme: the schema says so
        return
    other = [k for keys in SCHEME_KEYS.values() for k in keys if k in raw and k not in own]
    if other:
        scheme = raw.get("scheme", "iid")
        owners = {k: s for s, keys in SCHEME_KEYS.items() for k in keys}
        raise FedForgetError(
            f"{key}.{other[0]} is for scheme {owners[other[0]]} (scheme is '{scheme}'), so it would do nothing; "
            f"allowed with '{scheme}': {', '.join(own) or 'none of ' + ', '.join(owners)} "
            f"(beside scheme, clients, seed, per_task)"
        )


def check_feasible(
    spec: PartitionSpec, n: int, key: str = "partition", num_classes: int | None = None
) -> None:
    """Errors that can be known from sizes alone, before any draw (``num_classes``, when
    known, also checks the width of a class-fraction matrix)."""
    if spec.clients < 1:
        raise FedForgetError(f"{key}.clients={spec.clients}; allowed: >= 1")
    if not isinstance(spec.min_per_class, int) or isinstance(spec.min_per_class, bool) or spec.min_per_class < 0:
        raise FedForgetError(f"{key}.min_per_class={spec.min_per_class!r}; allowed: an integer >= 0")
    if spec.min_per_class and spec.scheme != "dirichlet":
        raise FedForgetError(
            f"{key}.min_per_class={spec.min_per_class} is for scheme dirichlet (scheme is '{spec.scheme}')"
        )
    if spec.per_task and spec.scheme not in PER_TASK_SCHEMES:
        raise FedForgetError(
            f"{key}.per_task=true with scheme '{spec.scheme}'; allowed: {', '.join(PER_TASK_SCHEMES)} (a class-fraction "
            "matrix already splits each task's classes as written)"
        )
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
        if spec.shard_rule not in SHARD_RULES:
            raise FedForgetError(f"{key}.shard_rule={spec.shard_rule!r}; allowed: {', '.join(SHARD_RULES)}")
        if spec.shard_rule == "per_class" and num_classes is not None and not spec.per_task:
            check_per_class_shards(s, spec.clients, num_classes, key)
    if spec.scheme == "classes":
        check_class_fractions(spec.class_fractions, spec.clients, num_classes, f"{key}.class_fractions")


def check_per_class_shards(s: int, clients: int, classes: int, key: str) -> None:
    """shard_rule per_class cuts every class into floor(s * clients / classes) shards: at
    least one (at parse time over the dataset's classes, when drawn over those present)."""
    if s * clients < classes:
        raise FedForgetError(
            f"{key}: shard_rule=per_class cuts each of the {classes} classes into shards_per_client x clients / "
            f"classes = {s} x {clients} / {classes} < 1 shards; allowed: shards_per_client x clients >= "
            f"{classes}, or shard_rule: equal_size"
        )


# shards: how many shards each class is cut into
SHARD_RULES = ("equal_size", "per_class", "sorted")
DEFAULT_SHARD_RULE = "equal_size"

# PartitionSpec fields that are bound by the code, never written in a config
INTERNAL_KEYS = ("tasks",)

# the schemes a per-task partition draws within each task
PER_TASK_SCHEMES = ("iid", "dirichlet", "shards")

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
    n, k, m = len(y), spec.clients, spec.min_per_class
    labels = np.unique(y)
    members = [np.flatnonzero(y == c) for c in labels]
    clients = np.arange(k)
    # min_per_class m [P fedprotip.md]: m rows of each class to every client first (client j:
    # positions j*m .. (j+1)*m - 1 of the class's permutation), the rest drawn below
    reserved: list[np.ndarray] = []
    if m:
        for c, rows in zip(labels, members):
            if len(rows) < m * k:
                raise FedForgetError(
                    f"dirichlet partition infeasible: min_per_class={m} x clients={k} = {m * k} rows of every "
                    f"class, but class {int(c)} has {len(rows)}; allowed: min_per_class <= {len(rows) // k}"
                )
        reserved = [rng.permutation(rows)[: m * k] for rows in members]
        members = [np.setdiff1d(rows, r) for rows, r in zip(members, reserved)]
    best = -1  # the largest smallest client over the draws
    for _ in range(spec.max_redraws):
        sizes = np.full(k, m * len(members), dtype=np.int64)
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
            # client j: its piece of each class in class order (its reserved rows first), each
            # in permuted order
            if m:
                perms = [np.concatenate([r, p]) for r, p in zip(reserved, perms)]
                counts = [np.full(k, m) + c for c in counts]
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
    """FedSOL/McMahan shards: sort by label, cut every class into shards, give each client s
    of the s*K shards at random (each class's rows shuffled with the partition seed before
    the cut [D]). How many shards a class gets (``shard_rule``):

    - ``equal_size`` (default) [P fedsol.md Sec. 4.1: "Sharding sorts data by label and
      assigns equal-size shards to clients"]: in proportion to the class's size (largest
      remainder, at least one), so every shard holds one class and about N/(s*K) rows;
      s*K/C each where the classes are balanced.
    - ``per_class`` [C Lee-Gihun/FedSOL partition_strategy.py ``_sharding_partition``; METHODS.md
      "shards per class = s*K/C"]: floor(s*K/C) shards of every class, whatever its size (a
      small class's shards are smaller and reach as many clients as a large one's); where
      s*K/C is not an integer, s*K - C*floor(s*K/C) clients drawn at random get s - 1
      shards, as the code's padded draw leaves some short (an error where s = 1: a client
      would get none).
    - ``sorted`` [C McMahan et al.'s shards; the FedGP code's ``mnist_noniid``,
      shenghongdai/Fed-A-GEM utils/sampling.py]: the rows sorted by label are cut into s*K
      contiguous pieces of equal size, whatever the class boundaries, so a shard may straddle
      two classes (on MNIST with K = 10, s = 2: 9 of the 20 shards do, every client holds 6,000
      rows of 2-4 digits). The rows of a class are shuffled with the partition seed before the
      sort [D: the code's argsort leaves them in an order numpy picks].

    With fewer shards than classes (equal_size) the sorted order is cut into s*K contiguous
    pieces as well."""
    s, k = spec.shards_per_client, spec.clients
    classes, sizes = np.unique(y, return_counts=True)
    total = s * k
    if spec.shard_rule == "per_class":
        check_per_class_shards(s, k, len(classes), "shards partition")
        per_class = np.full(len(classes), total // len(classes))
    elif total >= len(classes) and spec.shard_rule != "sorted":
        per_class = _allocate(total, sizes)
    else:
        per_class = None
    if per_class is not None:
        pieces = []
        for c, m in zip(classes, per_class):
            pieces.extend(np.array_split(rng.permutation(np.flatnonzero(y == c)), m))
    else:
        order = rng.permutation(len(y))
        pieces = np.array_split(order[np.argsort(y[order], kind="stable")], total)
    if len(pieces) == total:
        owner = rng.permutation(total)
        return [np.concatenate([pieces[j] for j in owner[i * s : (i + 1) * s]]) for i in range(k)]
    # per_class with s*K/C not an integer: total - len(pieces) clients, drawn at random, get s - 1
    if s == 1:
        raise FedForgetError(
            f"shards partition: shard_rule=per_class makes {len(pieces)} shards for {k} clients of shards_per_client=1; "
            f"allowed: clients divisible by the {len(classes)} classes, or shard_rule: equal_size"
        )
    counts = np.full(k, s)
    counts[rng.choice(k, total - len(pieces), replace=False)] -= 1
    owner = rng.permutation(len(pieces))
    ends = np.cumsum(counts)
    return [np.concatenate([pieces[j] for j in owner[e - m : e]]) for e, m in zip(ends, counts)]


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
    num_classes: int | None = None,
    domain: np.ndarray | None = None,
) -> np.ndarray:
    """Assignment vector over the training split: client id per row, -1 for excluded rows
    (and, per_task, for rows in no task). A per-task partition needs the dataset's
    ``num_classes`` (and, for a domains scenario, each row's ``domain``)."""
    fn = PARTITIONERS.get(spec.scheme, f"{key}.scheme")
    pool = np.setdiff1d(np.arange(len(y_train)), excluded if excluded is not None else [])
    assignment = np.full(len(y_train), -1, dtype=np.int64)
    if not spec.per_task:
        pieces = [(pool, np.random.SeedSequence([int(spec.seed), _STREAM]), key)]
    else:
        if not spec.tasks or num_classes is None:
            raise FedForgetError(
                f"{key}.per_task=true needs the task rows of a dataset with a split or domains scenario "
                f"(tasks={spec.tasks!r}) and its number of classes"
            )
        task = row_tasks(spec.tasks, y_train, num_classes, domain)[pool]
        pieces = [
            (pool[task == t], np.random.SeedSequence([int(spec.seed), _STREAM, t]), f"{key} (task {t})")
            for t in range(int(spec.tasks["tasks"]))
        ]
    for rows, seq, where in pieces:
        check_feasible(spec, len(rows), where)
        try:
            parts = fn(y_train[rows], spec, np.random.default_rng(seq))
        except FedForgetError as e:
            if not spec.per_task:
                raise
            raise FedForgetError(f"{where}: {e}") from None  # which task could not be drawn
        for cid, part in enumerate(parts):
            assignment[rows[part]] = cid
    return assignment


def partition_dataset(data: Any, spec: PartitionSpec, excluded: np.ndarray | None = None) -> np.ndarray:
    """``make_partition`` of a loaded dataset (``data.load_dataset``): its training labels,
    number of classes and, for a multi-domain dataset, each row's domain."""
    return make_partition(
        data.y_train, spec, excluded, num_classes=data.num_classes, domain=domain_ids(data.meta, "train")
    )


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
    task_sizes: np.ndarray | None = None,
) -> Path:
    """assignment.npy, class_counts.csv and meta.json (per_task: ``task_sizes``, each
    client's rows per task [clients, tasks], recorded there too)."""
    out = Path(out)
    atomic_save_npy(out / "assignment.npy", assignment)
    counts = class_counts(assignment, y, spec.clients, num_classes)
    rows = ["client,class,count"] + [
        f"{i},{c},{counts[i, c]}" for i in range(spec.clients) for c in range(num_classes)
    ]
    atomic_write_text(out / "class_counts.csv", "\n".join(rows) + "\n")
    sizes = counts.sum(1)
    per_task = {} if task_sizes is None else {"task_sizes": task_sizes.tolist()}
    atomic_write_json(
        out / "meta.json",
        {
            **per_task,
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
