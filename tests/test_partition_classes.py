"""The ``classes`` partition scheme (an explicit clients x classes matrix of fractions):
disjoint, complete, exact hand-computed counts per client per class, seed determinism,
spec labels, and bad matrices rejected at config validation with a clear message."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedforget.config import RunConfig
from fedforget.parse import parse_config
from fedforget.partition import (
    PartitionSpec,
    class_counts,
    class_counts_for,
    client_indices,
    make_partition,
)
from fedforget.utils import FedForgetError

# the FedProj pilot split: each client holds mostly one class
PILOT = [[0.8, 0.1, 0.1], [0.1, 0.8, 0.1], [0.1, 0.1, 0.8]]


def spec(m=PILOT, seed=0, clients=None):
    return PartitionSpec("classes", clients=clients or len(m), class_fractions=m, seed=seed)


def labels(sizes):
    """Class c repeated sizes[c] times, shuffled (row order must not matter)."""
    y = np.concatenate([np.full(n, c, dtype=np.int64) for c, n in enumerate(sizes)])
    return np.random.default_rng(7).permutation(y)


def test_counts_are_exact_fractions_of_each_class():
    y = labels([40, 40, 40])
    a = make_partition(y, spec())
    # 0.8 * 40 = 32 and 0.1 * 40 = 4 exactly
    expected = np.array([[32, 4, 4], [4, 32, 4], [4, 4, 32]])
    assert np.array_equal(class_counts(a, y, 3, 3), expected)


def test_largest_remainder_rounding_assigns_every_sample():
    # class sizes 37, 41, 42 (as iris' 120 training rows minus a 12-row public slice can be)
    y = labels([37, 41, 42])
    counts = class_counts_for(y, PILOT)
    # class 0: 29.6, 3.7, 3.7 -> floors 29, 3, 3 (sum 35); 2 left go to the largest remainders:
    # client 1 (0.7) and client 2 (0.7, tie -> lower id first after client 1), not client 0 (0.6)
    assert counts[:, 0].tolist() == [29, 4, 4]
    # class 1: 4.1, 32.8, 4.1 -> 4, 32, 4 (sum 40); 1 left -> client 1 (remainder 0.8)
    assert counts[:, 1].tolist() == [4, 33, 4]
    # class 2: 4.2, 4.2, 33.6 -> 4, 4, 33 (sum 41); 1 left -> client 2 (0.6 > 0.2)
    assert counts[:, 2].tolist() == [4, 4, 34]
    assert counts.sum(0).tolist() == [37, 41, 42]
    a = make_partition(y, spec())
    assert np.array_equal(class_counts(a, y, 3, 3), counts)


def test_disjoint_union_and_excluded_rows():
    y = labels([30, 50, 20, 10])
    m = [[0.5, 0.0, 0.25, 1.0], [0.5, 0.2, 0.75, 0.0], [0.0, 0.8, 0.0, 0.0]]
    excluded = np.arange(0, 110, 11)  # a "public" slice
    a = make_partition(y, spec(m), excluded)
    assert (a[excluded] == -1).all()
    pool = np.setdiff1d(np.arange(len(y)), excluded)
    assert (a[pool] >= 0).all()  # every pool row assigned
    parts = client_indices(a, 3)
    allrows = np.concatenate(parts)
    assert len(allrows) == len(np.unique(allrows)) == len(pool)  # disjoint, union = pool
    got = class_counts(a, y, 3, 4)
    assert np.array_equal(got, class_counts_for(y[pool], m))
    assert got[2].tolist()[0] == 0 and got[0, 1] == 0  # zero fractions give zero samples


def test_same_seed_same_partition_other_seed_other_rows():
    y = labels([40, 40, 40])
    a0, a0b, a1 = (make_partition(y, spec(seed=s)) for s in (0, 0, 1))
    assert np.array_equal(a0, a0b)
    assert not np.array_equal(a0, a1)
    # the counts are fixed by the matrix, not the seed
    assert np.array_equal(class_counts(a0, y, 3, 3), class_counts(a1, y, 3, 3))


def test_spec_labels_and_dict_round_trip():
    s = spec()
    assert s.setting.startswith("classes-") and len(s.setting) == len("classes-") + 8
    assert s.slug == f"{s.setting}_k3_ps0"
    assert spec([[0.7, 0.1, 0.1], [0.2, 0.8, 0.1], [0.1, 0.1, 0.8]]).setting != s.setting
    assert spec(seed=1).slug != s.slug
    d = s.to_dict()
    assert d["class_fractions"] == PILOT and "alpha" not in d and "shards_per_client" not in d
    assert PartitionSpec(**d) == s
    # other schemes keep no class_fractions key (their existing paths and hashes are unchanged)
    assert "class_fractions" not in PartitionSpec("iid", clients=3).to_dict()


def test_config_accepts_the_scheme_and_keeps_the_matrix(minimal_config):
    minimal_config["experiments"][0]["partitions"] = [
        {"scheme": "classes", "clients": 3, "class_fractions": PILOT, "seed": 2}
    ]
    wf = parse_config(minimal_config)
    part = wf.experiments[0].partitions[0]
    assert part.class_fractions == PILOT and part.seed == 2
    rc = wf.runs()[0]  # a run config survives its JSON round trip (job config.json)
    assert RunConfig.from_dict(json.loads(json.dumps(rc.to_dict()))).partition == part


@pytest.mark.parametrize(
    "matrix,clients,match",
    [
        (PILOT, 4, r"class_fractions has 3 rows; allowed: one row per client \(4\)"),
        ([[0.8, 0.2], [0.2, 0.8], [0.0, 0.0]], 3, r"has 2 columns; allowed: one per class of the dataset \(3\)"),
        ([[0.8, 0.1, 0.1], [0.1, 0.8], [0.1, 0.1, 0.8]], 3, r"rows have different lengths"),
        ([[0.8, 0.1, 0.1], [0.1, 0.8, 0.1], [0.2, 0.1, 0.8]], 3, r"column 0 \(class 0\) sums to 1\.1"),
        ([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], 3, r"class_fractions\[1\] is all zeros"),
    ],
)
def test_bad_matrices_rejected_at_validation(minimal_config, matrix, clients, match):
    minimal_config["experiments"][0]["partitions"] = [
        {"scheme": "classes", "clients": clients, "class_fractions": matrix}
    ]
    with pytest.raises(FedForgetError, match=match):
        parse_config(minimal_config)


@pytest.mark.parametrize(
    "part,match",
    [
        ({"scheme": "classes", "clients": 3}, r"class_fractions"),  # required by the schema
        ({"scheme": "classes", "clients": 3, "class_fractions": [[1.5, 0, 0]] * 3}, r"1\.5"),
    ],
)
def test_schema_rejects_missing_or_out_of_range_matrix(minimal_config, part, match):
    minimal_config["experiments"][0]["partitions"] = [part]
    with pytest.raises(FedForgetError, match=match):
        parse_config(minimal_config)


def test_client_without_any_sample_is_an_error_naming_it():
    y = labels([40, 40, 2])  # client 2 gets 0.2 * 2 = 0.4 -> 0 samples of class 2
    m = [[0.5, 0.5, 0.4], [0.5, 0.5, 0.4], [0.0, 0.0, 0.2]]
    with pytest.raises(FedForgetError, match=r"client\(s\) \[2\] receive no sample"):
        make_partition(y, spec(m))
