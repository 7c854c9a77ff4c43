"""Text readers on tiny ``DatasetDict.save_to_disk`` folders written here, tokenized by a
word-level stand-in with the Hugging Face tokenizer call signature (no ``transformers``)."""

from __future__ import annotations

import datasets
import numpy as np
import pytest

from fedforget.data.sources import read_source, read_text, tokenize
from fedforget.data.sources.table import SOURCES
from fedforget.utils import FedForgetError

TEXT_SETS = ("mnli", "snli", "sst2", "sentiment140", "marc", "yelp", "yahoo")
PAD, UNK, CLS, SEP = 0, 1, 2, 3


class WordTokenizer:
    """Whitespace words -> ids from a fixed vocabulary; ``[CLS] a [SEP] (b [SEP])``, padded
    with 0 and truncated (longest first, roughly) to ``max_length`` like a HF tokenizer."""

    vocab = {w: i for i, w in enumerate("good bad movie a the cat sat on mat dog ok".split(), 4)}

    def _ids(self, text: str) -> list[int]:
        return [self.vocab.get(w, UNK) for w in text.lower().split()]

    def __call__(self, text, text_pair=None, padding=False, truncation=False, max_length=None):
        assert padding == "max_length" and truncation is True
        out = {"input_ids": [], "attention_mask": []}
        pairs = text_pair if text_pair is not None else [None] * len(text)
        for a, b in zip(text, pairs):
            ids = [CLS, *self._ids(a), SEP] + ([*self._ids(b), SEP] if b is not None else [])
            ids = ids[:max_length]
            out["input_ids"].append(ids + [PAD] * (max_length - len(ids)))
            out["attention_mask"].append([1] * len(ids) + [0] * (max_length - len(ids)))
        return out


def rows_for(name: str, n: int) -> tuple[dict, list[int]]:
    """Columns of a split of text source ``name`` (its real field names, plus one the reader
    ignores) and the class indices the reader should keep."""
    hub = SOURCES[name].hub
    k = len(SOURCES[name].class_names)
    raw = [i % k for i in range(n)]
    if hub.label_map:  # sentiment140: raw 0/4 (and 2, neutral: dropped)
        inverse = {v: r for r, v in hub.label_map.items()}
        raw = [inverse[i % 2] for i in range(n)] + [2]
    elif name == "snli":
        raw = raw + [-1]  # no gold label: dropped
    cols = {f: [f"the cat {f} good {i}" for i in range(len(raw))] for f in hub.text_fields}
    cols[hub.text_fields[-1]][0] = None  # an empty field is an empty string
    cols[hub.label_field] = raw
    cols["idx"] = list(range(len(raw)))
    if hub.label_map:
        keep = [hub.label_map[r] for r in raw if r in hub.label_map]
    else:
        keep = [r for r in raw if r >= 0]
    return cols, keep


def save_text_set(root, name: str, n_train=5, n_test=3):
    hub = SOURCES[name].hub
    dd, keep = {}, {}
    for split, n in ((hub.train_split, n_train), (hub.test_split, n_test)):
        cols, keep[split] = rows_for(name, n)
        dd[split] = datasets.Dataset.from_dict(cols)
    datasets.DatasetDict(dd).save_to_disk(str(root / name))
    return keep[hub.train_split], keep[hub.test_split]


@pytest.mark.parametrize("name", TEXT_SETS)
def test_text_sets_from_saved_folders(tmp_path, name):
    y_train, y_test = save_text_set(tmp_path, name)
    d = read_source(name, tmp_path, tokenizer=WordTokenizer(), max_length=12)
    assert d.x_train.dtype == np.int64 and d.x_train.shape == (len(y_train), 12)
    assert d.x_test.shape == (len(y_test), 12) and d.y_test.dtype == np.int64
    np.testing.assert_array_equal(d.y_train, y_train)
    np.testing.assert_array_equal(d.y_test, y_test)
    assert d.class_names == SOURCES[name].class_names
    mask = d.extra["attention_mask_train"]
    assert mask.dtype == np.int64 and mask.shape == d.x_train.shape
    np.testing.assert_array_equal(mask, (d.x_train != PAD).astype(np.int64))
    assert (d.x_train[:, 0] == CLS).all()
    again = read_text(name, tmp_path, WordTokenizer(), max_length=12)
    assert again.x_train.tobytes() == d.x_train.tobytes()
    assert again.extra["attention_mask_test"].tobytes() == d.extra["attention_mask_test"].tobytes()


def test_pairs_go_to_the_tokenizer_as_text_and_text_pair(tmp_path):
    datasets.DatasetDict(
        {
            s: datasets.Dataset.from_dict(
                {"premise": ["a cat sat"], "hypothesis": ["the dog"], "label": [2]}
            )
            for s in ("train", "test")
        }
    ).save_to_disk(str(tmp_path / "snli"))
    d = read_text("snli", tmp_path, WordTokenizer(), max_length=9)
    v = WordTokenizer.vocab
    assert d.x_train[0].tolist() == [
        CLS,
        v["a"],
        v["cat"],
        v["sat"],
        SEP,
        v["the"],
        v["dog"],
        SEP,
        PAD,
    ]
    assert d.class_names[d.y_train[0]] == "contradiction"
    assert read_text("snli", tmp_path, WordTokenizer(), max_length=3).x_test[0].tolist() == [
        CLS,
        v["a"],
        v["cat"],
    ]


def test_single_text_fields_are_joined(tmp_path):
    cols = {
        "question_title": ["good movie"],
        "question_content": [None],
        "best_answer": ["bad"],
        "topic": [5],
    }
    datasets.DatasetDict(
        {s: datasets.Dataset.from_dict(cols) for s in ("train", "test")}
    ).save_to_disk(str(tmp_path / "yahoo"))
    d = read_text("yahoo", tmp_path, WordTokenizer(), max_length=6)
    v = WordTokenizer.vocab
    assert d.x_train[0].tolist() == [CLS, v["good"], v["movie"], v["bad"], SEP, PAD]
    assert d.class_names[d.y_train[0]] == "Sports"


def test_missing_folder_says_how_to_get_it(tmp_path):
    with pytest.raises(FedForgetError) as e:
        read_text("mnli", tmp_path, WordTokenizer())
    msg = str(e.value)
    assert "dataset 'mnli'" in msg and str(tmp_path / "mnli") in msg and "is missing" in msg
    assert "train, validation_matched" in msg and "`download: true`" in msg
    assert "nyu-mll/glue" in msg and "save_to_disk" in msg


def test_a_folder_that_is_not_a_saved_dataset_is_refused(tmp_path):
    (tmp_path / "sst2").mkdir()
    (tmp_path / "sst2" / "train.csv").write_text("sentence,label\n")
    with pytest.raises(FedForgetError, match="is not a datasets.DatasetDict save_to_disk folder"):
        read_text("sst2", tmp_path, WordTokenizer(), download=True)


def test_download_loads_the_hub_once_and_saves_it(tmp_path, monkeypatch):
    calls = []
    fake = datasets.DatasetDict(
        {
            s: datasets.Dataset.from_dict({"sentence": ["good", "bad"], "label": [1, 0]})
            for s in ("train", "validation", "test")
        }
    )

    def load_dataset(path, name=None, revision=None):
        calls.append((path, name, revision))
        return fake

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    d = read_text("sst2", tmp_path, WordTokenizer(), max_length=4, download=True)
    assert calls == [("nyu-mll/glue", "sst2", None)]
    assert (tmp_path / "sst2" / "dataset_dict.json").is_file()
    assert sorted(datasets.load_from_disk(str(tmp_path / "sst2"))) == ["train", "validation"]
    read_text("sst2", tmp_path, WordTokenizer(), max_length=4, download=True)
    assert len(calls) == 1  # saved: no second hub load
    np.testing.assert_array_equal(d.y_test, [1, 0])


def test_unreachable_hub_is_a_user_error(tmp_path, monkeypatch):
    def load_dataset(*a, **k):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(FedForgetError) as e:
        read_text("yelp", tmp_path, WordTokenizer(), download=True)
    msg = str(e.value)
    assert "dataset 'yelp'" in msg and "Yelp/yelp_review_full" in msg and "offline" in msg
    assert not (tmp_path / "yelp").exists()


def test_wrong_split_column_and_tokenizer_errors(tmp_path):
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": ["x"], "label": [0]})}
    ).save_to_disk(str(tmp_path / "yelp"))
    with pytest.raises(FedForgetError, match="has no split 'test'; splits: train"):
        read_text("yelp", tmp_path, WordTokenizer())
    datasets.DatasetDict(
        {s: datasets.Dataset.from_dict({"body": ["x"], "label": [0]}) for s in ("train", "test")}
    ).save_to_disk(str(tmp_path / "marc"))
    with pytest.raises(FedForgetError, match="has no column 'text'; columns: body, label"):
        read_text("marc", tmp_path, WordTokenizer())

    def unpadded(text, text_pair=None, **kw):
        return {"input_ids": [[2, 3]] * len(text), "attention_mask": [[1, 1]] * len(text)}

    with pytest.raises(FedForgetError, match="must pad and truncate to max_length"):
        tokenize(unpadded, [["a", "b"]], 4, "x")
    datasets.DatasetDict(
        {s: datasets.Dataset.from_dict({"text": ["x"], "label": [7]}) for s in ("train", "test")}
    ).save_to_disk(str(tmp_path / "other" / "yelp"))
    with pytest.raises(FedForgetError, match="split 'train': label 7 out of range; allowed 0..4"):
        read_text("yelp", tmp_path / "other", WordTokenizer())
