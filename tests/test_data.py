"""Prepared datasets: byte-determinism, shapes vs the registry, checksums, public sets."""

from __future__ import annotations

import shutil
from dataclasses import replace

import numpy as np
import pytest

from fedforget.data import (
    DATASETS,
    dataset_id,
    load_dataset,
    load_public,
    prepare_dataset,
    prepare_public,
    public_id,
)
from fedforget.partition import PartitionSpec, make_partition
from fedforget.utils import FedForgetError, sha256_file

ALL = [("iris", {}), ("iris", {"pca": 2}), ("digits", {}), ("mnist1d", {})]
IDS = ["iris", "iris-pca2", "digits", "mnist1d"]


def _hashes(directory):
    return {p.name: sha256_file(p) for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.mark.parametrize("name,opts", ALL, ids=IDS)
def test_prepare_is_byte_deterministic(data_root, tmp_path, name, opts):
    did = dataset_id(name, opts)
    again = prepare_dataset(name, opts, tmp_path)
    assert again == tmp_path / did
    a, b = _hashes(data_root / did), _hashes(again)
    assert set(a) == {"x_train.npy", "y_train.npy", "x_test.npy", "y_test.npy", "meta.json"}
    assert a == b


@pytest.mark.parametrize("name,opts", ALL, ids=IDS)
def test_shapes_match_registry(data_root, name, opts):
    info = DATASETS.get(name)
    resolved = info.resolve(opts)
    d = load_dataset(dataset_id(name, opts), data_root)
    n_train, n_test = info.sizes(resolved)
    shape = tuple(info.input_shape(resolved))
    assert d.x_train.shape == (n_train, *shape)
    assert d.x_test.shape == (n_test, *shape)
    assert d.y_train.shape == (n_train,) and d.y_test.shape == (n_test,)
    assert d.x_train.dtype == np.float32 and d.y_train.dtype == np.int64
    assert d.x_train.dtype == d.x_test.dtype == np.dtype(info.input_dtype(resolved))
    # the size `fedforget validate` prints and `prepare` checks room for, before the build
    arrays = (d.x_train, d.y_train, d.x_test, d.y_test)
    assert sum(a.nbytes for a in arrays) == (n_train + n_test) * sum(info.row_bytes(resolved))
    assert d.input_shape == shape
    assert d.num_classes == info.num_classes == len(d.class_names)
    assert set(np.unique(d.y_train)) == set(range(info.num_classes))  # every class present
    assert set(np.unique(d.y_test)) <= set(range(info.num_classes))
    assert np.isfinite(d.x_train).all() and np.isfinite(d.x_test).all()
    assert d.meta["n_train"] == n_train and d.meta["input_shape"] == list(shape)


@pytest.mark.parametrize("opts", [{"num_samples": 205}, {"num_samples": 333, "train_split": 0.7}])
def test_mnist1d_sizes_with_options(tmp_path, opts):
    info = DATASETS.get("mnist1d")
    resolved = info.resolve(opts)
    p = prepare_dataset("mnist1d", opts, tmp_path)
    d = load_dataset(p.name, tmp_path)
    assert (len(d.y_train), len(d.y_test)) == info.sizes(resolved)
    assert p.name == dataset_id("mnist1d", opts) != "mnist1d"


def test_digits_range_and_shape(data_root):
    d = load_dataset("digits", data_root)
    assert d.x_train.shape[1:] == (1, 8, 8)
    for x in (d.x_train, d.x_test):
        assert x.min() >= 0.0 and x.max() <= 1.0
    assert d.x_train.max() == 1.0  # scaled by 16, not by something larger
    assert (len(d.y_train), len(d.y_test)) == (1347, 450)


def test_iris_standardised_and_pca(data_root):
    d = load_dataset("iris", data_root)
    assert d.x_train.shape == (120, 4)
    np.testing.assert_allclose(d.x_train.mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(d.x_train.std(0), 1, atol=1e-5)
    p = load_dataset("iris-pca2", data_root)
    assert p.x_train.shape == (120, 2) and p.x_test.shape == (30, 2)
    np.testing.assert_array_equal(p.y_train, d.y_train)  # same split, projected
    # principal components: uncorrelated, decreasing variance
    cov = np.cov(p.x_train.T)
    assert abs(cov[0, 1]) < 1e-4 and cov[0, 0] > cov[1, 1]
    # stratified split: 40/10 per class
    assert np.bincount(d.y_train).tolist() == [40, 40, 40]


def test_mnist1d_default_sizes(data_root):
    d = load_dataset("mnist1d", data_root)
    assert d.x_train.shape == (4000, 1, 40) and d.x_test.shape == (1000, 1, 40)


def test_mnist1d_prepare_leaves_global_numpy_rng_alone(tmp_path):
    np.random.seed(1234)
    before = np.random.get_state()
    prepare_dataset("mnist1d", {"num_samples": 200}, tmp_path)
    after = np.random.get_state()
    assert before[0] == after[0]
    np.testing.assert_array_equal(before[1], after[1])
    assert before[2:] == after[2:]
    np.random.seed(1234)
    expected = np.random.rand(3)
    np.random.seed(1234)
    prepare_dataset("mnist1d", {"num_samples": 200}, tmp_path / "b")
    np.testing.assert_array_equal(np.random.rand(3), expected)


def test_dataset_id_names_non_default_options():
    assert dataset_id("iris") == "iris"
    assert dataset_id("iris", {"pca": 0}) == "iris"
    assert dataset_id("iris", {"pca": 2}) == "iris-pca2"
    assert dataset_id("mnist1d", {"seed": 42}) == "mnist1d"
    assert dataset_id("mnist1d", {"seed": 7, "num_samples": 100}) == "mnist1d-num_samples100-seed7"


@pytest.fixture
def digits_copy(data_root, tmp_path):
    shutil.copytree(data_root / "digits", tmp_path / "digits")
    return tmp_path


def test_corrupt_array_names_file_and_hashes(digits_copy):
    path = digits_copy / "digits" / "x_train.npy"
    expected = sha256_file(path)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    actual = sha256_file(path)
    with pytest.raises(FedForgetError) as ei:
        load_dataset("digits", digits_copy)
    msg = str(ei.value)
    assert str(path) in msg and expected in msg and actual in msg
    # without verification the (silently corrupt) array still loads
    assert load_dataset("digits", digits_copy, verify=False).x_train.shape == (1347, 1, 8, 8)


def test_missing_array_file(digits_copy):
    (digits_copy / "digits" / "y_test.npy").unlink()
    with pytest.raises(FedForgetError, match="missing data file .*y_test.npy"):
        load_dataset("digits", digits_copy)


def test_missing_dataset_tells_to_prepare(tmp_path):
    with pytest.raises(FedForgetError) as ei:
        load_dataset("digits", tmp_path)
    msg = str(ei.value)
    assert "not prepared" in msg and "fedforget prepare --dataset digits" in msg
    with pytest.raises(FedForgetError, match="fedforget prepare --dataset mnist1d"):
        load_dataset("mnist1d-num_samples100", tmp_path)


def test_corrupt_meta_json(digits_copy):
    (digits_copy / "digits" / "meta.json").write_text("{not json")
    with pytest.raises(FedForgetError, match="corrupt metadata file"):
        load_dataset("digits", digits_copy)


HOLDOUT = {"source": "holdout", "fraction": 0.2, "seed": 3}


def test_holdout_public_set_disjoint_from_private_pool(digits_copy):
    root = digits_copy
    out = prepare_public(HOLDOUT, "digits", root)
    assert (
        out
        == root / "public" / public_id(HOLDOUT, "digits")
        == root / "public" / "digits-holdout0.2-s3"
    )
    data = load_dataset("digits", root)
    pub = load_public(HOLDOUT, "digits", root, with_labels=True)
    idx = pub.excluded_train_rows
    assert len(idx) == round(0.2 * 1347) == len(np.unique(idx))
    np.testing.assert_array_equal(pub.x, data.x_train[idx])
    np.testing.assert_array_equal(pub.y, data.y_train[idx])
    for spec in (
        PartitionSpec("iid", clients=5),
        PartitionSpec("dirichlet", clients=5, alpha=0.1, min_size=10),
        PartitionSpec("shards", clients=5, shards_per_client=2),
    ):
        a = make_partition(data.y_train, spec, excluded=idx)
        assert (a[idx] == -1).all()
        assert (np.delete(a, idx) >= 0).all()
        assert (a >= 0).sum() == 1347 - len(idx)


def test_holdout_is_seeded(digits_copy):
    a = prepare_public(HOLDOUT, "digits", digits_copy)
    b = prepare_public({**HOLDOUT, "seed": 4}, "digits", digits_copy)
    ia = np.load(a / "indices.npy")
    ib = np.load(b / "indices.npy")
    assert not np.array_equal(ia, ib)
    # same spec, another root: byte-identical files
    prepare_dataset("digits", {}, digits_copy / "other")
    again = prepare_public(HOLDOUT, "digits", digits_copy / "other")
    assert _hashes(again) == _hashes(a)
    np.testing.assert_array_equal(
        load_public(HOLDOUT, "digits", digits_copy, True).excluded_train_rows, ia
    )


def test_public_without_labels(digits_copy, data_root):
    prepare_public(HOLDOUT, "digits", digits_copy)
    pub = load_public(HOLDOUT, "digits", digits_copy, with_labels=False)
    assert pub.y is None and len(pub.x) == len(pub.excluded_train_rows) > 0
    other = load_public(
        {"source": "dataset", "dataset": "mnist1d"}, "digits", data_root, with_labels=False
    )
    assert other.y is None and other.x.shape == (4000, 1, 40)
    assert len(other.excluded_train_rows) == 0
    with_y = load_public(
        {"source": "dataset", "dataset": "mnist1d"}, "digits", data_root, with_labels=True
    )
    assert with_y.y is not None and len(with_y.y) == 4000
    assert load_public(None, "digits", data_root, with_labels=True) is None


def test_public_train_test_joins_the_other_datasets_two_splits(data_root):
    """``splits: train+test``: the other dataset's training rows, then its test rows (the
    FedProj code's ConcatDataset)."""
    other = load_dataset("mnist1d", data_root)
    spec = {"source": "dataset", "dataset": "mnist1d", "splits": "train+test"}
    pub = load_public(spec, "digits", data_root, with_labels=True)
    assert pub.id == "mnist1d+test" and len(pub.x) == len(other.y_train) + len(other.y_test)
    np.testing.assert_array_equal(pub.x, np.concatenate([other.x_train, other.x_test]))
    np.testing.assert_array_equal(pub.y, np.concatenate([other.y_train, other.y_test]))
    assert load_public(spec, "digits", data_root, with_labels=False).y is None


def test_corrupt_public_file(digits_copy):
    out = prepare_public(HOLDOUT, "digits", digits_copy)
    raw = bytearray((out / "y.npy").read_bytes())
    raw[-1] ^= 0x01
    (out / "y.npy").write_bytes(bytes(raw))
    with pytest.raises(FedForgetError, match=r"corrupt data file .*y\.npy: sha256 expected"):
        load_public(HOLDOUT, "digits", digits_copy, with_labels=False)


def test_missing_public_tells_to_prepare(tmp_path):
    with pytest.raises(FedForgetError, match="not prepared.*fedforget prepare"):
        load_public(HOLDOUT, "digits", tmp_path, with_labels=False)


def test_unknown_dataset_and_option_errors(tmp_path):
    with pytest.raises(
        FedForgetError, match=r"unknown dataset 'nope'; allowed: blobs, cifar10, cifar100, cinic10, digits, "
    ):
        prepare_dataset("nope", {}, tmp_path)
    with pytest.raises(FedForgetError, match=r"unknown option\(s\) \['foo'\]; allowed: pca"):
        prepare_dataset("iris", {"foo": 1}, tmp_path)
    with pytest.raises(FedForgetError, match=r"pca=9"):
        prepare_dataset("iris", {"pca": 9}, tmp_path)
    assert not any(tmp_path.iterdir())


# values of another type than an option's default: each must be refused, never cast
# (``int(1.5)`` builds another dataset than the id ``...-seed1.5`` names)
WRONG_TYPE = {
    int: [1.5, 2.0, True, "1", None, [], float("nan")],
    float: [True, "0.5", None, [], float("nan"), float("inf")],
    bool: [1, "true", None],
    str: [None, 1, []],
    list: ["clipart", None, [[1]], [], {}],
}


@pytest.mark.parametrize("name", DATASETS.names())
def test_every_option_refuses_a_value_of_another_type(name):
    """Every registered dataset's options, each given values of the wrong type: one
    FedForgetError naming the dataset, the option and the value (before this, blobs' and
    MNIST-1D's checks cast with int()/float(): None crashed with a TypeError, 1.5 and True
    were built as 1, and their seeds were not checked at all)."""
    info = DATASETS.get(name)
    info.resolve({})  # the defaults are valid
    for key, default in info.defaults.items():
        for bad in WRONG_TYPE[type(default)]:
            with pytest.raises(FedForgetError) as ei:
                info.resolve({key: bad})
            assert f"'{name}'" in str(ei.value) and f"{key}={bad!r}" in str(ei.value), str(ei.value)


@pytest.mark.parametrize(
    "name,key,bad",
    [("blobs", "seed", -1), ("blobs", "size", 0), ("blobs", "noise", -0.5), ("blobs", "num_train", 10**10),
     ("mnist1d", "seed", 2**32), ("mnist1d", "num_samples", 19), ("mnist1d", "train_split", 1.0),
     ("domainnet", "domains", ["clipart", "clipart"])],
)  # fmt: skip
def test_option_out_of_range_is_refused(name, key, bad):
    with pytest.raises(FedForgetError, match=f"'{name}': option {key}="):
        DATASETS.get(name).resolve({key: bad})


def test_blobs_shapes_balance_and_learnability(tmp_path):
    from fedforget.data import load_dataset

    prepare_dataset("blobs", {"num_train": 500, "num_test": 100, "size": 12}, tmp_path)
    d = load_dataset("blobs-num_test100-num_train500-size12", tmp_path)
    assert d.x_train.shape == (500, 1, 12, 12) and d.x_train.dtype == np.float32
    assert np.bincount(d.y_train).tolist() == [50] * 10
    # class prototypes are separable: nearest class mean of the training set beats chance by far
    means = np.stack([d.x_train[d.y_train == c].mean(0) for c in range(10)]).reshape(10, -1)
    dist = ((d.x_test.reshape(100, 1, -1) - means[None]) ** 2).sum(-1)
    assert (dist.argmin(1) == d.y_test).mean() > 0.9


def test_blobs_default_is_mnist_shaped():
    info = DATASETS.get("blobs")
    opts = info.resolve({})
    assert info.input_shape(opts) == (1, 28, 28) and info.sizes(opts) == (60000, 10000)


def _free(monkeypatch, free: int) -> None:
    """shutil.disk_usage reports ``free`` bytes free (on every file system)."""
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=free))


def test_a_dataset_beyond_memory_is_refused_before_it_is_built(tmp_path, monkeypatch):
    import fedforget.data.base as base

    info = DATASETS.get("blobs")
    opts = {"num_train": 1000, "num_test": 10, "uint8": True}
    row = sum(info.row_bytes(info.resolve(opts)))
    assert row == 28 * 28 + 8
    monkeypatch.setattr(base, "host_memory_limit", lambda: (1010 * row - 1, "a test limit"))
    built = []
    monkeypatch.setitem(DATASETS._items, "blobs", _spied(info, built))
    with pytest.raises(FedForgetError, match=r"dataset 'blobs' with options \{'num_train': 1000, .*: 1,000 train and 10 test "
                       r"rows of \[1, 28, 28\] uint8 need at least 781.2 KiB of memory to build in, more than a test limit"):  # fmt: skip
        prepare_dataset("blobs", opts, tmp_path)
    assert built == [] and not any(tmp_path.iterdir())
    monkeypatch.setattr(base, "host_memory_limit", lambda: (1010 * row, "a test limit"))
    prepare_dataset("blobs", opts, tmp_path)  # exactly what it needs
    assert len(built) == 1


def _spied(info, built):
    def build(**kw):
        built.append(kw)
        return info.build(**kw)

    return replace(info, build=build)


def test_a_dataset_beyond_the_free_disk_is_refused_and_a_rerun_counts_the_files_it_replaces(tmp_path, monkeypatch):
    info = DATASETS.get("digits")
    need = sum(info.sizes(info.resolve({}))) * sum(info.row_bytes(info.resolve({})))
    _free(monkeypatch, need - 1)
    with pytest.raises(FedForgetError, match=r"digits.*need at least 463.3 KiB of disk, more than .* has free \(463.3 KiB\)"):
        prepare_dataset("digits", {}, tmp_path / "data")
    assert not (tmp_path / "data").exists()
    _free(monkeypatch, need)
    out = prepare_dataset("digits", {}, tmp_path / "data")
    _free(monkeypatch, 0)  # the rerun replaces its own files
    assert prepare_dataset("digits", {}, tmp_path / "data") == out
    with pytest.raises(FedForgetError, match="of disk"):
        prepare_dataset("digits", {"subset": 5}, tmp_path / "data")  # a new id: new files


def test_a_build_that_gives_another_dtype_than_its_entry_says_is_refused(tmp_path, monkeypatch):
    info = DATASETS.get("blobs")
    monkeypatch.setitem(DATASETS._items, "blobs", replace(info, feature_dtype="int64"))
    with pytest.raises(FedForgetError, match=r"dataset 'blobs': its registry entry says inputs of int64, but its build gave "
                       r"x_train float32, x_test float32"):  # fmt: skip
        prepare_dataset("blobs", {"num_train": 20, "num_test": 10}, tmp_path)
