"""The table of dataset sources: where each one comes from, its checksums, the native files
it is read from and what to tell a user who lacks them. Data only; the readers live in the
modules named after the datasets and look their entry up here at call time (so a test can
swap an entry with ``monkeypatch.setitem(SOURCES, ...)``).

Every file of a source lives under ``<root>/<source name>/`` (``root`` is the raw-data
directory the caller gives, e.g. ``data/raw``); an archive is unpacked beside it.

Checksums are the ones the datasets' own distributors or their long-standing loaders publish:
CIFAR, MNIST and SVHN from torchvision's ``datasets/{cifar,mnist,svhn}.py``; PathMNIST and
TissueMNIST from the MedMNIST package's ``medmnist/info.py`` (the same md5 for Zenodo records
5208230, 6496656 and 10519652); Tiny-ImageNet, CINIC-10 and ImageNet-R from the md5s that
common loaders (Avalanche, torchvision-style wrappers) agree on, as their distributors publish
none. DomainNet's authors publish no checksums: those entries are ``None``, a download logs the
sha256 it got so that it can be pinned here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

KIND_ARCHIVE = "archive"  # one file holding the dataset
KIND_FILES = "files"  # several files read as they are
KIND_TREE = "tree"  # a folder tree the user builds (no download)
KIND_HUB = "hub"  # a Hugging Face ``datasets`` hub dataset (or its save_to_disk copy)


@dataclass(frozen=True)
class RemoteFile:
    """One native file: its name under the source's directory, the URLs it may be fetched
    from (tried in order: mirrors), its checksum(s), and, for an archive, the folder it
    unpacks into (relative to the source's directory; ``"."`` is that directory itself) and
    the path that unpacking creates (so a tree unpacked by hand is recognised)."""

    filename: str
    urls: tuple[str, ...] = ()
    md5: str | None = None
    sha256: str | None = None
    extract_to: str | None = None  # None: read as it is
    creates: str | None = None  # relative to the source's directory


@dataclass(frozen=True)
class TextHub:
    """Where a text dataset lives on the Hugging Face hub, and how its rows become
    (text, label): ``text_fields`` (two fields with ``pair=True`` are a sentence pair given
    to the tokenizer as ``text`` and ``text_pair``; otherwise the non-empty fields are joined
    with a space), ``label_field``, and ``label_map`` from raw label values to class indices
    (rows whose raw label is not a key are dropped; None keeps labels ``0..C-1`` and drops
    negative ones, e.g. SNLI's -1 for no gold label)."""

    path: str
    config: str | None
    train_split: str
    test_split: str
    text_fields: tuple[str, ...]
    label_field: str
    pair: bool = False
    label_map: Mapping[int, int] | None = None
    revision: str | None = None


@dataclass(frozen=True)
class Source:
    """A dataset source: its name (the directory under the raw root), title, kind, native
    files, class names where fixed, and ``obtain``: how to get it by hand (used in errors)."""

    name: str
    title: str
    kind: str
    homepage: str
    files: tuple[RemoteFile, ...] = ()
    obtain: str = ""
    hub: TextHub | None = None
    class_names: tuple[str, ...] = ()
    notes: str = ""

    def file(self, filename: str) -> RemoteFile:
        for f in self.files:
            if f.filename == filename:
                return f
        allowed = ", ".join(f.filename for f in self.files) or "none"
        raise KeyError(f"source '{self.name}' has no file '{filename}'; files: {allowed}")


MNIST_MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)
DOMAINNET_BASE = "http://csr.bu.edu/ftp/visda/2019/multi-source/"
DOMAINNET_DOMAINS = ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")
# the cleaned DomainNet release: clipart and painting were re-released under groundtruth/
_DOMAINNET_ZIP = {
    "clipart": "groundtruth/clipart.zip",
    "infograph": "infograph.zip",
    "painting": "groundtruth/painting.zip",
    "quickdraw": "quickdraw.zip",
    "real": "real.zip",
    "sketch": "sketch.zip",
}

MEDMNIST_ZENODO = "https://zenodo.org/records/10519652/files/"

PATHMNIST_CLASSES = (
    "adipose",
    "background",
    "debris",
    "lymphocytes",
    "mucus",
    "smooth muscle",
    "normal colon mucosa",
    "cancer-associated stroma",
    "colorectal adenocarcinoma epithelium",
)
TISSUEMNIST_CLASSES = (
    "Collecting Duct, Connecting Tubule",
    "Distal Convoluted Tubule",
    "Glomerular endothelial cells",
    "Interstitial endothelial cells",
    "Leukocytes",
    "Podocytes",
    "Proximal Tubule Segments",
    "Thick Ascending Limb",
)
NLI_CLASSES = ("entailment", "neutral", "contradiction")
SENTIMENT_CLASSES = ("negative", "positive")
STAR_CLASSES = ("1 star", "2 stars", "3 stars", "4 stars", "5 stars")
YAHOO_CLASSES = (
    "Society & Culture",
    "Science & Mathematics",
    "Health",
    "Education & Reference",
    "Computers & Internet",
    "Sports",
    "Business & Finance",
    "Entertainment & Music",
    "Family & Relationships",
    "Politics & Government",
)

# ImageNet-100 as in CMC (Tian et al., 2019; github.com/HobbitLong/CMC, imagenet100.txt),
# the list later works (e.g. solo-learn) reuse; in that file's order. Class indices follow
# the sorted wnids, as an ImageFolder over the subset would give.
IMAGENET100_WNIDS = (
    "n02869837", "n01749939", "n02488291", "n02107142", "n13037406", "n02091831", "n04517823",
    "n04589890", "n03062245", "n01773797", "n01735189", "n07831146", "n07753275", "n03085013",
    "n04485082", "n02105505", "n01983481", "n02788148", "n03530642", "n04435653", "n02086910",
    "n02859443", "n13040303", "n03594734", "n02085620", "n02099849", "n01558993", "n04493381",
    "n02109047", "n04111531", "n02877765", "n04429376", "n02009229", "n01978455", "n02106550",
    "n01820546", "n01692333", "n07714571", "n02974003", "n02114855", "n03785016", "n03764736",
    "n03775546", "n02087046", "n07836838", "n04099969", "n04592741", "n03891251", "n02701002",
    "n03379051", "n02259212", "n07715103", "n03947888", "n04026417", "n02326432", "n03637318",
    "n01980166", "n02113799", "n02086240", "n03903868", "n02483362", "n04127249", "n02089973",
    "n03017168", "n02093428", "n02804414", "n02396427", "n04418357", "n02172182", "n01729322",
    "n02113978", "n03787032", "n02089867", "n02119022", "n03777754", "n04238763", "n02231487",
    "n03032252", "n02138441", "n02104029", "n03837869", "n03494278", "n04136333", "n03794056",
    "n03492542", "n02018207", "n04067472", "n03930630", "n03584829", "n02123045", "n04229816",
    "n02100583", "n03642806", "n04336792", "n03259280", "n02116738", "n02108089", "n03424325",
    "n01855672", "n02090622",
)  # fmt: skip


def _hub_obtain(hub: TextHub, name: str) -> str:
    args = ", ".join(repr(a) for a in (hub.path, hub.config) if a is not None)
    rev = f", revision={hub.revision!r}" if hub.revision else ""
    return (
        f"set `download: true` (loads the hub dataset {hub.path}"
        f"{' config ' + hub.config if hub.config else ''} and saves it there), or on a machine "
        f'with internet run `python -c "import datasets; datasets.load_dataset({args}{rev})'
        f".save_to_disk('{name}')\"` and copy the folder there"
    )


def _sources() -> dict[str, Source]:
    s: list[Source] = [
        Source(
            name="cifar10",
            title="CIFAR-10",
            kind=KIND_ARCHIVE,
            homepage="https://www.cs.toronto.edu/~kriz/cifar.html",
            files=(
                RemoteFile(
                    "cifar-10-python.tar.gz",
                    ("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",),
                    md5="c58f30108f718f92721af3b95e74349a",
                ),
            ),
        ),
        Source(
            name="cifar100",
            title="CIFAR-100",
            kind=KIND_ARCHIVE,
            homepage="https://www.cs.toronto.edu/~kriz/cifar.html",
            files=(
                RemoteFile(
                    "cifar-100-python.tar.gz",
                    ("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",),
                    md5="eb9058c3a382ffc7106e4002c42a8d85",
                ),
            ),
        ),
        Source(
            name="mnist",
            title="MNIST",
            kind=KIND_FILES,
            homepage="http://yann.lecun.com/exdb/mnist/",
            files=tuple(
                RemoteFile(fn, tuple(m + fn for m in MNIST_MIRRORS), md5=md5)
                for fn, md5 in (
                    ("train-images-idx3-ubyte.gz", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
                    ("train-labels-idx1-ubyte.gz", "d53e105ee54ea40749a09fcbcd1e9432"),
                    ("t10k-images-idx3-ubyte.gz", "9fb629c4189551a2d022fa330f9573f3"),
                    ("t10k-labels-idx1-ubyte.gz", "ec29112dd5afa0611ce80d1b7f02629c"),
                )
            ),
        ),
        Source(
            name="svhn",
            title="SVHN (cropped digits, format 2)",
            kind=KIND_FILES,
            homepage="http://ufldl.stanford.edu/housenumbers/",
            files=(
                RemoteFile(
                    "train_32x32.mat",
                    ("http://ufldl.stanford.edu/housenumbers/train_32x32.mat",),
                    md5="e26dedcc434d2e4c54c9b2d4a06d8373",
                ),
                RemoteFile(
                    "test_32x32.mat",
                    ("http://ufldl.stanford.edu/housenumbers/test_32x32.mat",),
                    md5="eb5a983be6a315427106f1b164d9cef3",
                ),
            ),
        ),
        Source(
            name="pathmnist",
            title="MedMNIST v2 PathMNIST (28x28 RGB)",
            kind=KIND_FILES,
            homepage="https://medmnist.com/",
            files=(
                RemoteFile(
                    "pathmnist.npz",
                    (MEDMNIST_ZENODO + "pathmnist.npz?download=1",),
                    md5="a8b06965200029087d5bd730944a56c1",
                ),
            ),
            class_names=PATHMNIST_CLASSES,
        ),
        Source(
            name="tissuemnist",
            title="MedMNIST v2 TissueMNIST (28x28 grayscale)",
            kind=KIND_FILES,
            homepage="https://medmnist.com/",
            files=(
                RemoteFile(
                    "tissuemnist.npz",
                    (MEDMNIST_ZENODO + "tissuemnist.npz?download=1",),
                    md5="ebe78ee8b05294063de985d821c1c34b",
                ),
            ),
            class_names=TISSUEMNIST_CLASSES,
        ),
        Source(
            name="cinic10",
            title="CINIC-10",
            kind=KIND_ARCHIVE,
            homepage="https://github.com/BayesWatch/cinic-10",
            files=(
                RemoteFile(
                    "CINIC-10.tar.gz",
                    ("https://datashare.ed.ac.uk/bitstream/handle/10283/3192/CINIC-10.tar.gz",),
                    md5="6ee4d0c996905fe93221de577967a372",  # third-party loaders; none published
                    extract_to="CINIC-10",  # the archive has no top folder
                    creates="CINIC-10",
                ),
            ),
        ),
        Source(
            name="tiny_imagenet",
            title="Tiny-ImageNet (200 classes, 64x64)",
            kind=KIND_ARCHIVE,
            homepage="http://cs231n.stanford.edu/",
            files=(
                RemoteFile(
                    "tiny-imagenet-200.zip",
                    ("http://cs231n.stanford.edu/tiny-imagenet-200.zip",),
                    md5="90528d7ca1a48142e341f4ef8d21d0de",  # third-party loaders; none published
                    extract_to=".",
                    creates="tiny-imagenet-200",
                ),
            ),
        ),
        Source(
            name="imagenet",
            title="ImageNet-1k (ILSVRC-2012) folder tree, read as ImageNet-100",
            kind=KIND_TREE,
            homepage="https://image-net.org/",
            obtain=(
                "ImageNet needs a (free, non-commercial) account: download "
                "ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar from "
                "https://image-net.org/download-images, unpack the training set into "
                "train/<wnid>/*.JPEG and the validation set into val/<wnid>/*.JPEG (e.g. with "
                "the valprep.sh script of github.com/soumith/imagenetloader.torch) in that "
                "folder; a words.txt or LOC_synset_mapping.txt there gives class names"
            ),
            notes=(
                "md5 of the official tars (torchvision's imagenet.py): train "
                "1d675b47d978889d74fa0da5fadfb00e, val 29b22e2961454d5413ddabcf34fc5622"
            ),
        ),
        Source(
            name="imagenet_r",
            title="ImageNet-R (renditions of 200 ImageNet classes)",
            kind=KIND_ARCHIVE,
            homepage="https://github.com/hendrycks/imagenet-r",
            files=(
                RemoteFile(
                    "imagenet-r.tar",
                    ("https://people.eecs.berkeley.edu/~hendrycks/imagenet-r.tar",),
                    md5="a61312130a589d0ca1a8fca1f2bd3337",  # third-party loaders; none published
                    extract_to=".",
                    creates="imagenet-r",
                ),
            ),
        ),
        Source(
            name="domainnet",
            title="DomainNet (cleaned release, 6 domains, 345 classes)",
            kind=KIND_ARCHIVE,
            homepage="http://ai.bu.edu/M3SDA/",
            files=tuple(
                RemoteFile(
                    f"{d}.zip",
                    (DOMAINNET_BASE + _DOMAINNET_ZIP[d],),
                    extract_to=".",
                    creates=d,
                )
                for d in DOMAINNET_DOMAINS
            )
            + tuple(
                RemoteFile(f"{d}_{split}.txt", (f"{DOMAINNET_BASE}domainnet/txt/{d}_{split}.txt",))
                for d in DOMAINNET_DOMAINS
                for split in ("train", "test")
            ),
            notes="no checksums are published; each download logs the sha256 it got",
        ),
    ]
    hubs = {
        "mnli": (
            "MultiNLI (GLUE MNLI; test = validation_matched)",
            "https://cims.nyu.edu/~sbowman/multinli/",
            TextHub("nyu-mll/glue", "mnli", "train", "validation_matched",
                    ("premise", "hypothesis"), "label", pair=True),
            NLI_CLASSES,
        ),
        "snli": (
            "SNLI (rows without a gold label, label -1, dropped)",
            "https://nlp.stanford.edu/projects/snli/",
            TextHub("stanfordnlp/snli", None, "train", "test", ("premise", "hypothesis"),
                    "label", pair=True),
            NLI_CLASSES,
        ),
        "sst2": (
            "SST-2 (GLUE; test = validation, as GLUE's test labels are hidden)",
            "https://nlp.stanford.edu/sentiment/",
            TextHub("nyu-mll/glue", "sst2", "train", "validation", ("sentence",), "label"),
            SENTIMENT_CLASSES,
        ),
        "sentiment140": (
            "Sentiment140 (polarity 0/4 -> negative/positive; the test split's neutral rows dropped)",
            "http://help.sentiment140.com/",
            # the hub's main branch is a loading script, which datasets>=4 no longer runs;
            # the hub's parquet conversion branch holds the same rows
            TextHub("stanfordnlp/sentiment140", "sentiment140", "train", "test", ("text",),
                    "sentiment", label_map={0: 0, 4: 1}, revision="refs/convert/parquet"),
            SENTIMENT_CLASSES,
        ),
        "marc": (
            "Multilingual Amazon Reviews Corpus, English, 5 star classes (MTEB's copy: the "
            "original amazon_reviews_multi was withdrawn)",
            "https://registry.opendata.aws/amazon-reviews-ml/",
            TextHub("mteb/AmazonReviewsClassification", "en", "train", "test", ("text",), "label"),
            STAR_CLASSES,
        ),
        "yelp": (
            "Yelp reviews, full (5 star classes: yelp_review_full, not the 2-class polarity set)",
            "https://www.yelp.com/dataset",
            TextHub("Yelp/yelp_review_full", None, "train", "test", ("text",), "label"),
            STAR_CLASSES,
        ),
        "yahoo": (
            "Yahoo! Answers topics (10 classes; title, question and best answer joined)",
            "https://webscope.sandbox.yahoo.com/",
            TextHub("community-datasets/yahoo_answers_topics", None, "train", "test",
                    ("question_title", "question_content", "best_answer"), "topic"),
            YAHOO_CLASSES,
        ),
    }  # fmt: skip
    for name, (title, homepage, hub, classes) in hubs.items():
        s.append(
            Source(
                name=name,
                title=title,
                kind=KIND_HUB,
                homepage=homepage,
                hub=hub,
                class_names=classes,
                obtain=_hub_obtain(hub, name),
            )
        )
    return {src.name: src for src in s}


SOURCES: dict[str, Source] = _sources()
