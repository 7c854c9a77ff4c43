"""Config validation: a catalogue of bad configs, each rejected with a message naming the
offending key and value; the shipped config; RunConfig round trips; schema defaults."""

from __future__ import annotations

import copy
import json
from dataclasses import fields, replace
from pathlib import Path

import pytest
import yaml

from fedforget.config import (
    INTERNAL_TRAIN_KEYS,
    OptimizerSpec,
    RunConfig,
    TrainSpec,
    load_run_config,
    load_yaml,
    partition_dir,
    typed_overrides,
)
from fedforget.parse import load_config, parse_config
from fedforget.partition import INTERNAL_KEYS as PARTITION_INTERNAL_KEYS
from fedforget.partition import PartitionSpec
from fedforget.reference import BLOCKS, documented_schema, reference_markdown
from fedforget.smoke import DEFAULTS as SMOKE_DEFAULTS
from fedforget.utils import FedForgetError
from fedforget.validation import schema

REPO = Path(__file__).resolve().parents[1]


def ex(d):
    return d["experiments"][0]


def part(d):
    return ex(d)["partitions"][0]


def dset(d):
    return ex(d)["datasets"][0]


NAN, INF = float("nan"), float("inf")
# the allowed forms a wrong public block lists
PUBLIC_FORMS = ["null", "{source: holdout, fraction: a number in (0, 1)", "{source: dataset, dataset:"]

# (id, mutation of a minimal valid config, substrings the error message must contain)
BAD = [
    ("unknown-dataset", lambda d: dset(d).update(name="cifar99"),
     ["experiments[0].datasets[0].name", "unknown dataset 'cifar99'", "blobs, cifar10, cifar100, cinic10, digits"]),
    ("unknown-method", lambda d: ex(d)["methods"][0].update(name="fedmagic"),
     ["experiments[0].methods[0].name", "unknown method 'fedmagic'", "fedavg"]),
    ("unknown-model", lambda d: dset(d).update(model="resnet999"),
     ["experiments[0].datasets[0].model.name", "unknown model 'resnet999'", "mlp"]),
    ("unknown-model-option", lambda d: dset(d).update(model={"name": "mlp", "options": {"depth": 3}}),
     ["experiments[0].datasets[0].model", "'depth'", "hidden"]),
    ("unknown-scheme", lambda d: part(d).update(scheme="pathological"),
     ["experiments[0].partitions[0].scheme", "'pathological'", "dirichlet"]),
    ("alpha-zero", lambda d: part(d).update(scheme="dirichlet", alpha=0),
     ["experiments[0].partitions[0].alpha", "0 is less than or equal to the minimum of 0"]),
    ("alpha-negative", lambda d: part(d).update(scheme="dirichlet", alpha=-0.5),
     ["experiments[0].partitions[0].alpha", "-0.5"]),
    ("alpha-missing", lambda d: part(d).update(scheme="dirichlet"),
     ["experiments[0].partitions[0]", "'alpha' is a required property"]),
    ("per-class-shards-fewer-than-classes", lambda d: part(d).update(scheme="shards", shards_per_client=2, clients=1, shard_rule="per_class"),
     ["experiments[0].partitions[0]", "shard_rule=per_class cuts each of the 3 classes", "2 x 1 / 3 < 1 shards"]),
    ("bad-shard-rule", lambda d: part(d).update(scheme="shards", shards_per_client=2, shard_rule="even"),
     ["experiments[0].partitions[0].shard_rule", "'even'", "per_class"]),
    ("shards-missing", lambda d: part(d).update(scheme="shards"),
     ["experiments[0].partitions[0]", "'shards_per_client' is a required property"]),
    ("clients-zero", lambda d: part(d).update(clients=0),
     ["experiments[0].partitions[0].clients", "0 is less than the minimum of 1"]),
    ("clients-gt-samples", lambda d: part(d).update(clients=121),
     ["experiments[0].partitions[0].clients=121", "120 training samples", "'iris'"]),
    ("clients-gt-pool-after-holdout", lambda d: (dset(d).update(name="digits", public={"source": "holdout", "fraction": 0.5}),
                                                 part(d).update(clients=700)),
     ["clients=700", "673 training samples", "'digits'"]),
    ("shards-times-clients-gt-samples", lambda d: part(d).update(scheme="shards", shards_per_client=2, clients=61),
     ["experiments[0].partitions[0]", "shards_per_client=2", "clients=61", "122", "120"]),
    ("min-size-times-clients-gt-samples", lambda d: part(d).update(scheme="dirichlet", alpha=0.5, clients=20, min_size=10),
     ["experiments[0].partitions[0]", "min_size=10", "clients=20", "200", "120"]),
    ("duplicate-partition", lambda d: ex(d)["partitions"].append(dict(part(d))),
     ["experiments[0].partitions[1]", "duplicate partition", "iid_k3_ps0"]),
    ("sample-rate-zero", lambda d: ex(d).update(train={"sample_rate": 0}),
     ["experiments[0].train.sample_rate", "0 is less than or equal to the minimum of 0"]),
    ("sample-rate-1.5", lambda d: ex(d).update(train={"sample_rate": 1.5}),
     ["experiments[0].train.sample_rate", "1.5 is greater than the maximum of 1"]),
    ("no-lanes", lambda d: ex(d).update(train={"concurrent_clients": 0}),
     ["experiments[0].train.concurrent_clients", "0 is less than the minimum of 1"]),
    ("lr-zero", lambda d: ex(d).update(train={"optimizer": {"lr": 0}}),
     ["experiments[0].train.optimizer.lr", "0"]),
    ("lr-of-wrong-type", lambda d: ex(d).update(train={"optimizer": {"lr": "fast"}}),
     ["experiments[0].train.optimizer.lr", "'fast' is not of type 'number'; allowed: a finite number > 0"]),
    ("unknown-optimizer", lambda d: ex(d).update(train={"optimizer": {"name": "rmsprop"}}),
     ["experiments[0].train.optimizer.name", "'rmsprop'", "sgd"]),
    ("unknown-train-key", lambda d: ex(d).update(train={"epochs": 3}),
     ["experiments[0].train", "'epochs' was unexpected"]),
    ("misspelt-train-key", lambda d: ex(d).update(train={"local_epoch": 3}),
     ["experiments[0].train", "'local_epoch' was unexpected (did you mean 'local_epochs'?)", "allowed keys: rounds,"]),
    ("misspelt-top-level-key", lambda d: d.update(resuts_dir="x"),
     ["<top level>", "'resuts_dir' was unexpected (did you mean 'results_dir'?)", "allowed keys: data_dir"]),
    ("misspelt-hyperparameter", lambda d: ex(d)["methods"].append({"name": "fedprox", "params": {"muu": 1}}),
     ["experiments[0].methods[1].params", "['muu']", "(did you mean 'mu' for 'muu'?)"]),
    ("boundaries-field-out-of-range", lambda d: dset(d).update(name="digits", model="cnn2d", scenario={
        "kind": "split", "tasks": 2, "rounds_per_task": 1, "boundaries": {"samples_per_window": 0, "window_rounds": 1}}),
     ["experiments[0].datasets[0].scenario.boundaries", "samples_per_window=0; allowed: an integer >= 1"]),
    ("threads-beyond-any-machine", lambda d: ex(d).update(train={"threads": 100000}),  # (torch: a segfault)
     ["experiments[0].train.threads: 100000 is greater than the maximum of 1024"]),
    ("bad-device", lambda d: ex(d).update(train={"device": "gpu"}),
     ["experiments[0].train.device", "'gpu'"]),
    ("negative-seed", lambda d: ex(d).update(seeds=[0, -1]),
     ["experiments[0].seeds[1]", "-1 is less than the minimum of 0"]),
    ("duplicate-seeds", lambda d: ex(d).update(seeds=[0, 1, 1]),
     ["experiments[0].seeds", "duplicate seeds", "[0, 1, 1]"]),
    ("no-seeds", lambda d: ex(d).update(seeds=[]),
     ["experiments[0].seeds", "should be non-empty"]),
    ("duplicate-experiment-name", lambda d: d["experiments"].append(copy.deepcopy(ex(d))),
     ["experiments[1].name", "duplicate experiment name 'tiny'"]),
    ("bad-experiment-name", lambda d: ex(d).update(name="has space"),
     ["experiments[0].name", "'has space'"]),
    ("missing-partitions", lambda d: ex(d).pop("partitions"),
     ["experiments[0]", "'partitions' is a required property"]),
    ("missing-experiments", lambda d: d.pop("experiments"),
     ["'experiments' is a required property"]),
    ("unknown-top-level-key", lambda d: d.update(result_dir="x"),
     ["<top level>", "'result_dir' was unexpected"]),
    ("unknown-partition-key", lambda d: part(d).update(beta=0.3),
     ["experiments[0].partitions[0]", "'beta' was unexpected"]),
    ("fedavg-unknown-hyperparameter", lambda d: ex(d)["methods"][0].update(params={"mu": 0.01}),
     ["experiments[0].methods[0].params", "['mu']", "'fedavg'"]),
    ("duplicate-method-label", lambda d: ex(d)["methods"].append({"name": "fedavg"}),
     ["experiments[0].methods[1].label", "duplicate method label 'fedavg'"]),
    ("duplicate-dataset-label", lambda d: ex(d)["datasets"].append(dict(dset(d))),
     ["experiments[0].datasets[1].label", "duplicate dataset label 'iris'"]),
    ("cnn2d-on-mnist1d", lambda d: dset(d).update(name="mnist1d", model="cnn2d"),
     ["experiments[0].datasets[0].model", "cnn2d", "rank 3", "[1, 40]"]),
    ("cnn1d-on-digits", lambda d: dset(d).update(name="digits", model="cnn1d"),
     ["experiments[0].datasets[0].model", "cnn1d", "rank 2", "[1, 8, 8]"]),
    ("unknown-dataset-option", lambda d: dset(d).update(options={"pcaa": 2}),
     ["'iris'", "['pcaa']", "pca"]),
    ("bad-dataset-option-value", lambda d: dset(d).update(options={"pca": 9}),
     ["'iris'", "pca=9"]),
    ("public-shape-mismatch", lambda d: dset(d).update(name="digits", model="cnn2d", public={"source": "dataset", "dataset": "iris"}),
     ["experiments[0].datasets[0].public.dataset", "'iris'", "[4]", "[1, 8, 8]"]),
    ("public-unknown-dataset", lambda d: dset(d).update(public={"source": "dataset", "dataset": "nope"}),
     ["experiments[0].datasets[0].public.dataset", "unknown dataset 'nope'"]),
    # a key another scheme reads: dropped from the partition's identity, it would do nothing
    ("shard-rule-on-dirichlet", lambda d: part(d).update(scheme="dirichlet", alpha=0.5, shard_rule="per_class"),
     ["experiments[0].partitions[0].shard_rule is for scheme shards (scheme is 'dirichlet')",
      "allowed with 'dirichlet': alpha, min_size, max_redraws, min_per_class"]),
    ("alpha-on-shards", lambda d: part(d).update(scheme="shards", shards_per_client=2, alpha=0.1),
     ["experiments[0].partitions[0].alpha is for scheme dirichlet (scheme is 'shards')"]),
    ("min-size-on-iid", lambda d: part(d).update(min_size=5),
     ["experiments[0].partitions[0].min_size is for scheme dirichlet (scheme is 'iid')", "allowed with 'iid': none of"]),
    ("normalize-on-float-inputs", lambda d: dset(d).update(name="digits", model="cnn2d", normalize={"mean": [0.5], "std": [0.5]}),
     ["experiments[0].datasets[0].normalize is for datasets stored as uint8 images"]),
    ("normalize-mean-on-the-0-255-scale", lambda d: dset(d).update(name="blobs", options={"size": 8, "uint8": True}, model="cnn2d",
                                                                  normalize={"mean": [125.3], "std": [63.0]}),
     ["experiments[0].datasets[0].normalize.mean[0]: 125.3 is greater than the maximum of 1"]),
    # a scenario key its kind does not read (some entered the run's identity all the same)
    ("rotation-on-a-split", lambda d: dset(d).update(name="digits", model="cnn2d", scenario={
        "kind": "split", "tasks": 5, "classes_per_task": 2, "rounds_per_task": 1, "rotation": [0, 90]}),
     ["experiments[0].datasets[0].scenario.rotation is for kind rotated (kind is 'split')"]),
    ("seed-on-a-natural-split", lambda d: dset(d).update(name="digits", model="cnn2d", scenario={
        "kind": "split", "tasks": 5, "classes_per_task": 2, "rounds_per_task": 1, "seed": 3}),
     ["experiments[0].datasets[0].scenario.seed draws a shuffled split's class order", "with class_order natural"]),
    ("heads-on-kind-none", lambda d: dset(d).update(scenario={"kind": "none", "heads": "per_task"}),
     ["experiments[0].datasets[0].scenario.heads is for kind split | rotated | permuted | domains (kind is 'none')"]),
    # the small models' sizes: a wrong one failed only when the job built the model
    ("mlp-negative-width", lambda d: dset(d).update(model={"name": "mlp", "options": {"hidden": [-4]}}),
     ["experiments[0].datasets[0].model.options.hidden=[-4] for model 'mlp'; allowed: a list of integers >= 1"]),
    ("cnn2d-hidden-as-text", lambda d: dset(d).update(name="digits", model={"name": "cnn2d", "options": {"hidden": "128"}}),
     ["experiments[0].datasets[0].model.options.hidden='128' for model 'cnn2d'; allowed: an integer >= 1"]),
    ("cnn2d-zero-channels", lambda d: dset(d).update(name="digits", model={"name": "cnn2d", "options": {"channels": [0, -3]}}),
     ["options.channels=[0, -3] for model 'cnn2d'; allowed: a list of two integers >= 1"]),
    ("vectorized-engine-for-a-method-with-its-own-step", lambda d: ex(d).update(
        methods=[{"name": "fedproj", "params": {"local_lr_step": True}, "train": {"client_engine": "vectorized"}}],
        datasets=[{"name": "iris", "model": "mlp", "public": {"source": "holdout", "fraction": 0.2}}]),
     ["experiments[0].methods[0]: train.client_engine='vectorized' is not possible here:", "allowed: auto, sequential"]),
    ("another-methods-hyperparameter", lambda d: ex(d)["methods"][0].update(name="lander", params={"replay_rule": "code"}),
     ["unknown hyperparameter(s) ['replay_rule'] for method 'lander' ('replay_rule' is a hyperparameter of target, target_lode)"]),
    ("der-beta-without-plus", lambda d: ex(d)["methods"][0].update(name="der", params={"beta": 0.3}),
     ["experiments[0].methods[0].params (method 'der'): beta=0.3 without plus: true would do nothing"]),
    ("precision-mixed-in-one-experiment", lambda d: ex(d).update(methods=[{"name": "fedavg"}, {"name": "fedprox", "train": {"precision": "bf16"}}]),
     ["experiments[0].methods: train.precision differs between methods (fedavg: fp32, fedprox: bf16)", "allowed: one precision per experiment"]),
    ("per-class-shards-per-task-too-few", lambda d: (dset(d).update(name="digits", model="cnn2d", scenario={
        "kind": "split", "tasks": 5, "classes_per_task": 2, "rounds_per_task": 1}),
        part(d).update(scheme="shards", clients=1, shards_per_client=1, shard_rule="per_class", per_task=True), ex(d).update(train={"rounds": 5})),
     ["experiments[0].partitions[0] (dataset 'digits', per task): shard_rule=per_class cuts each of the 2 classes"]),
    ("augment-without-kind", lambda d: dset(d).update(name="digits", model="cnn2d", augment={}),
     ["experiments[0].datasets[0].augment: no kind; allowed: kind: none | crop_flip"]),
    ("augment-none-with-pad", lambda d: dset(d).update(name="digits", model="cnn2d", augment={"kind": "none", "pad": 8}),
     ["experiments[0].datasets[0].augment.pad=8 with kind 'none' would do nothing"]),
    # a field the named optimizer does not read (make_optimizer would drop it)
    ("momentum-with-adam", lambda d: ex(d).update(train={"optimizer": {"name": "adam", "lr": 0.001, "momentum": 0.9}}),
     ["experiments[0].train.optimizer.momentum: optimizer 'adam' does not read it", "allowed with 'adam': lr, betas, weight_decay"]),
    ("betas-with-sgd-in-a-method", lambda d: ex(d)["methods"][0].update(train={"optimizer": {"name": "sgd", "betas": [0.5, 0.9]}}),
     ["experiments[0].methods[0].train.optimizer.betas: optimizer 'sgd' does not read it"]),
    # JSON Schema's integer takes 20.0; a config's would name its run k20.0 / seed0.0
    ("clients-as-a-whole-float", lambda d: part(d).update(clients=3.0),
     ["experiments[0].partitions[0].clients: 3.0 is not of type 'integer'", "allowed: an integer >= 1"]),
    ("seed-as-a-whole-float", lambda d: ex(d).update(seeds=[0.0]),
     ["experiments[0].seeds[0]: 0.0 is not of type 'integer'"]),
    ("method-integer-as-a-whole-float", lambda d: ex(d)["methods"][0].update(name="der", params={"buffer_size": 50.0}),
     ["experiments[0].methods[0].params (method 'der'): buffer_size=50.0; allowed: an integer >= 0"]),
    ("stateless-batchnorm-eval-batch", lambda d: dset(d).update(name="digits", model={"name": "resnet8", "options": {"norm": "batch_stateless"}}),
     ["experiments[0].train.eval_batch_size=1024: ", "dataset 'digits''s model", "norm: batch_stateless",
      "allowed: train.batch_size ("]),
    ("public-train-test-of-the-private-set", lambda d: dset(d).update(public={"source": "dataset", "dataset": "iris", "splits": "train+test"}),
     ["experiments[0].datasets[0].public.splits", "'train+test' of 'iris'", "its test set in the public set"]),
    ("public-unknown-splits", lambda d: dset(d).update(public={"source": "dataset", "dataset": "iris", "splits": "test"}),
     ["experiments[0].datasets[0].public", "splits='test'; allowed: train | train+test"]),
    ("holdout-fraction-1", lambda d: dset(d).update(public={"source": "holdout", "fraction": 1.0}),
     ["experiments[0].datasets[0].public", "matches no allowed form"]),
    ("fedprox-negative-mu", lambda d: ex(d)["methods"][0].update(name="fedprox", params={"mu": -1}),
     ["experiments[0].methods[0].params", "'fedprox'", "mu=-1", ">= 0"]),
    ("fedsam-rho-string", lambda d: ex(d)["methods"][0].update(name="fedsam", params={"rho": "big"}),
     ["experiments[0].methods[0].params", "'fedsam'", "rho='big'"]),
    ("feddf-without-public-set", lambda d: ex(d)["methods"][0].update(name="feddf"),
     ["experiments[0].methods[0].name", "'feddf' needs a public set", "'iris'"]),
    ("fedsol-combined-scaffold-with-adam", lambda d: (ex(d)["methods"][0].update(name="fedsol", params={"base": "scaffold", "proximal": "base"}),
                                                      ex(d).update(train={"optimizer": {"name": "adam"}})),
     ["experiments[0].methods[0]", "scaffold", "adam"]),
    ("scaffold-with-adam", lambda d: (ex(d)["methods"][0].update(name="scaffold"), ex(d).update(train={"optimizer": {"name": "adam"}})),
     ["experiments[0].methods[0]", "scaffold", "adam"]),
    # NaN and +-inf (YAML .nan, .inf, -.inf) pass the schema's range checks: refused first, everywhere
    ("precision-fp16", lambda d: ex(d).update(train={"precision": "fp16"}),
     ["experiments[0].train.precision", "fp16", "fp32", "bf16"]),
    ("lr-nan", lambda d: ex(d).update(train={"optimizer": {"lr": NAN}}),
     ["experiments[0].train.optimizer.lr=nan", "allowed: a finite number > 0"]),
    ("sample-rate-nan", lambda d: ex(d).update(train={"sample_rate": NAN}),
     ["experiments[0].train.sample_rate=nan", "> 0 and <= 1"]),
    ("weight-decay-inf", lambda d: ex(d).update(train={"optimizer": {"weight_decay": INF}}),
     ["experiments[0].train.optimizer.weight_decay=inf", ">= 0"]),
    ("method-lr-decay-minus-inf", lambda d: ex(d)["methods"][0].update(train={"lr_decay": -INF}),
     ["experiments[0].methods[0].train.lr_decay=-inf"]),
    ("rounds-inf", lambda d: ex(d).update(train={"rounds": INF}),
     ["experiments[0].train.rounds=inf", "an integer >= 1"]),
    ("fedprox-mu-nan", lambda d: ex(d)["methods"][0].update(name="fedprox", params={"mu": NAN}),
     ["experiments[0].methods[0].params.mu=nan"]),
    ("dataset-option-nan", lambda d: dset(d).update(options={"pca": NAN}),
     ["experiments[0].datasets[0].options.pca=nan"]),
    ("model-option-inf", lambda d: dset(d).update(model={"name": "mlp", "options": {"hidden": [INF]}}),
     ["experiments[0].datasets[0].model.options.hidden[0]=inf"]),
    # integers beyond 64 bits passed a range without a maximum, then overflowed torch in the job
    ("param-beyond-64-bits", lambda d: ex(d)["methods"][0].update(name="der", params={"buffer_size": 2**64}),
     ["experiments[0].methods[0].params.buffer_size=18446744073709551616 (method 'der'): beyond a 64-bit integer",
      "allowed: an integer >= 0 and <= 9223372036854775807"]),  # its own range within 64 bits
    ("checkpoint-every-beyond-64-bits", lambda d: ex(d).update(train={"checkpoint_every": 2**64}),  # a oneOf's integer form
     ["experiments[0].train.checkpoint_every=18446744073709551616: beyond a 64-bit integer; allowed: an integer >= 1 and "
      "<= 9223372036854775807"]),
    ("base-param-beyond-64-bits", lambda d: ex(d)["methods"][0].update(name="fedgp", params={"base": "der", "base_params": {"buffer_size": 2**64}}),
     ["experiments[0].methods[0].params.base_params.buffer_size=18446744073709551616 (method 'fedgp'): beyond a 64-bit "
      "integer; allowed: an integer >= 0 and <= 9223372036854775807"]),  # the base method's range
    ("pad-and-eval-every-beyond-64-bits", lambda d: (ex(d).update(train={"eval_every": 2**70}),
                                                     dset(d).update(augment={"kind": "crop_flip", "pad": -(2**63) - 1})),
     ["experiments[0].datasets[0].augment.pad=-9223372036854775809: beyond a 64-bit integer",
      "experiments[0].train.eval_every=1180591620717411303424: beyond a 64-bit integer; allowed: an integer >= 1 and <= 9223372036854775807"]),
    # reals beyond float32 (the training arithmetic) passed a range without a maximum, then overflowed torch
    ("lr-and-mu-beyond-float32", lambda d: (ex(d).update(train={"optimizer": {"lr": 1e39}}),
                                            ex(d)["methods"].append({"name": "fedprox", "params": {"mu": -1e300}})),
     ["experiments[0].methods[1].params.mu=-1e+300 (method 'fedprox'): beyond float32's range (+-3.40282e+38); allowed: a finite number >= 0 and <= 3.40282e+38",
      "experiments[0].train.optimizer.lr=1e+39: beyond float32's range (+-3.40282e+38); allowed: a finite number > 0 and <= 3.40282e+38"]),
    ("alpha-nan", lambda d: part(d).update(scheme="dirichlet", alpha=NAN),
     ["experiments[0].partitions[0].alpha=nan", "> 0"]),
    ("class-fraction-nan", lambda d: part(d).update(scheme="classes", clients=1, class_fractions=[[NAN, 1, 1]]),
     ["experiments[0].partitions[0].class_fractions[0][0]=nan", ">= 0 and <= 1"]),
    ("public-fraction-nan", lambda d: dset(d).update(public={"source": "holdout", "fraction": NAN}),
     ["experiments[0].datasets[0].public.fraction=nan", "> 0 and < 1"]),
    ("every-non-finite-named-at-once", lambda d: (ex(d).update(train={"sample_rate": NAN, "optimizer": {"lr": -INF}}),
                                                  ex(d)["methods"][0].update(name="fedprox", params={"mu": INF})),
     ["experiments[0].train.sample_rate=nan", "experiments[0].train.optimizer.lr=-inf",
      "experiments[0].methods[0].params.mu=inf (method 'fedprox')"]),
    # a wrong public block: what is wrong with it, judged by its source, and the allowed forms
    ("public-holdout-without-fraction", lambda d: dset(d).update(public={"source": "holdout"}),
     ["experiments[0].datasets[0].public: {'source': 'holdout'} matches no allowed form",
      "'fraction' is a required property", *PUBLIC_FORMS]),
    ("public-unknown-source", lambda d: dset(d).update(public={"source": "web"}),
     ["experiments[0].datasets[0].public", "source: 'web' is not one of ['holdout', 'dataset']", *PUBLIC_FORMS]),
    ("public-dataset-without-dataset", lambda d: dset(d).update(public={"source": "dataset"}),
     ["experiments[0].datasets[0].public: {'source': 'dataset'}", "'dataset' is a required property", *PUBLIC_FORMS]),
    ("public-without-source", lambda d: dset(d).update(public={"fraction": 0.1}),
     ["experiments[0].datasets[0].public: {'fraction': 0.1}", "'source' is a required property", *PUBLIC_FORMS]),
    ("public-not-a-mapping", lambda d: dset(d).update(public=5),
     ["experiments[0].datasets[0].public: 5 matches no allowed form; allowed:", *PUBLIC_FORMS]),
    ("public-holdout-fraction-2", lambda d: dset(d).update(public={"source": "holdout", "fraction": 2}),
     ["experiments[0].datasets[0].public", "fraction=2; allowed: a finite number > 0 and < 1", *PUBLIC_FORMS]),
    ("public-unknown-key", lambda d: dset(d).update(public={"source": "dataset", "dataset": "iris", "extra": 1}),
     ["experiments[0].datasets[0].public", "'extra' was unexpected", *PUBLIC_FORMS]),
    # the model's string-or-object: judged as the object it is
    ("model-unknown-key", lambda d: dset(d).update(model={"name": "mlp", "hidden": 3}),
     ["experiments[0].datasets[0].model", "'hidden' was unexpected", "allowed: a string | {name, options}"]),
    ("model-not-string-or-object", lambda d: dset(d).update(model=5),
     ["experiments[0].datasets[0].model: 5 matches no allowed form; allowed: a string | {name, options}"]),
    # seeds beyond signed 64 bits trained, then failed the aggregation's parquet tables
    ("seed-beyond-64-bits", lambda d: ex(d).update(seeds=[2**64]),
     ["experiments[0].seeds[0]=18446744073709551616: beyond a 64-bit integer", "<= 9223372036854775807"]),
    ("partition-seed-beyond-64-bits", lambda d: part(d).update(seed=2**63),
     ["experiments[0].partitions[0].seed=9223372036854775808: beyond a 64-bit integer"]),
    ("public-seed-beyond-64-bits", lambda d: dset(d).update(public={"source": "holdout", "fraction": 0.1, "seed": 2**63}),
     ["experiments[0].datasets[0].public", "9223372036854775808"]),
    # a figure's round beyond the runs' rounds: refused before training, not by the figure job after it
    ("phase-memory-not-a-bool", lambda d: ex(d).update(train={"phase_memory": "yes"}),
     ["experiments[0].train.phase_memory", "'yes'"]),
    ("checkpoint-every-zero", lambda d: ex(d).update(train={"checkpoint_every": 0}),
     ["experiments[0].train.checkpoint_every: 0 matches no allowed form", "an integer >= 1", "auto"]),
    ("checkpoint-every-a-word", lambda d: ex(d).update(train={"checkpoint_every": "sometimes"}),
     ["experiments[0].train.checkpoint_every: 'sometimes'", "an integer >= 1", "auto"]),
    ("figure-round-beyond-rounds", lambda d: ex(d).update(figures=[{"name": "layer_lambda", "options": {"round": 999}}]),
     ["experiments[0].figures[0].options.round: 999 is beyond the rounds of method", "allowed: 1.."]),
]  # fmt: skip


@pytest.mark.parametrize("mutate,expected", [pytest.param(m, e, id=i) for i, m, e in BAD])
def test_bad_config_rejected_with_named_key(minimal_config, mutate, expected):
    parse_config(copy.deepcopy(minimal_config))  # the base is valid
    mutate(minimal_config)
    with pytest.raises(FedForgetError) as ei:
        parse_config(minimal_config)
    msg = str(ei.value)
    assert msg.startswith("invalid config:")
    for s in expected:
        assert s in msg, f"{s!r} not in {msg!r}"


@pytest.mark.parametrize("mutate,expected", [pytest.param(m, e, id=i) for i, m, e in BAD])
def test_bad_config_starts_no_job(minimal_config, mutate, expected, tmp_path, monkeypatch, capsys):
    """`fedforget run` (the whole pipeline without Snakemake) on each bad config: exit 2,
    one message naming the key and value, and nothing prepared, partitioned or trained."""
    from fedforget.cli import main

    mutate(minimal_config)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(minimal_config))
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--config", "config.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedforget: error: invalid config:")
    for s in expected:
        assert s in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_catalogue_is_large_enough():
    kinds = {i for i, _, _ in BAD}
    assert len(kinds) == len(BAD) >= 15
    # every kind of check the reliability issue names is in it
    for i in ("shards-times-clients-gt-samples", "alpha-zero", "min-size-times-clients-gt-samples",
              "sample-rate-zero", "fedprox-negative-mu", "public-unknown-dataset", "cnn1d-on-digits",
              "negative-seed", "duplicate-experiment-name"):  # fmt: skip
        assert i in kinds


def test_all_problems_reported_at_once(minimal_config):
    ex(minimal_config)["methods"][0]["name"] = "nope"
    ex(minimal_config)["seeds"] = [2, 2]
    part(minimal_config)["clients"] = 500
    with pytest.raises(FedForgetError) as ei:
        parse_config(minimal_config)
    msg = str(ei.value)
    assert "unknown method 'nope'" in msg and "duplicate seeds" in msg and "clients=500" in msg


def test_minimal_config_defaults(minimal_config):
    wf = parse_config(minimal_config)
    (rc,) = wf.runs()
    assert rc.train == TrainSpec()
    assert rc.partition == PartitionSpec("iid", clients=3)
    assert rc.dataset.label == "iris" and rc.dataset.options == {"pca": 0}
    assert rc.method.label == "fedavg" and rc.method.params == {}
    assert wf.data_dir == "data" and wf.results_dir == "results"


def test_shipped_config_parses_to_36_runs(repo_root):
    wf = load_config(repo_root / "config/config.yaml")
    runs = wf.runs()
    assert len(runs) == 36  # embedded: 2 datasets x 3 partitions x 3 seeds; continual: 2 x 3 methods x 3
    assert len({r.run_dir for r in runs}) == 36
    assert len({r.hash for r in runs}) == 36
    # 2 datasets x 3 partitions, shared by seeds; the continual streams share one digits partition
    assert len({r.partition_dir for r in runs}) == 7
    t = runs[0].train
    assert (t.rounds, t.local_epochs, t.sample_rate, t.lr_decay) == (30, 2, 0.5, 0.99)
    assert t.optimizer == OptimizerSpec("sgd", 0.05, 0.9, 0.0, (0.9, 0.999))
    assert set(wf.datasets_to_prepare()) == {"digits", "mnist1d"}
    assert set(wf.holdouts_to_prepare()) == {"digits-holdout0.1-s0", "mnist1d-holdout0.1-s0"}
    # the holdout is excluded from the pool, so partitions live under the pool id (the
    # continual experiment declares no public set: its pool is the whole dataset)
    assert all(r.partition_dir.parts[-2].endswith("-holdout0.1-s0") for r in runs if r.experiment == "embedded")
    assert {r.partition_dir.parts[-2] for r in runs if r.experiment == "continual"} == {"digits"}


@pytest.mark.parametrize(
    "name", ["config.yaml", *sorted(p.name for p in (REPO / "config" / "experiments").glob("*.yaml"))]
)
def test_every_shipped_config_is_valid(repo_root, monkeypatch, name):
    monkeypatch.chdir(repo_root)  # paper_results and data are relative to the working directory
    path = repo_root / "config" / ("" if name == "config.yaml" else "experiments") / name
    wf = load_config(path)
    assert wf.runs() and all(e.name for e in wf.experiments)


def test_pairing_puts_an_experiments_methods_on_one_engine(repo_root, monkeypatch):
    """client_engine auto: an experiment with a method whose local step cannot be batched
    (FedSOL over FedProx) trains every method sequentially, FedAvg too; one without such a method (the
    default config's embedded experiment: FedAvg only) pairs nothing, nor does its continual
    experiment now that DER's replay trains stacked (it paired FL and Joint with DER on the
    sequential trainer before)."""
    monkeypatch.chdir(repo_root)
    runs = load_config(repo_root / "config/experiments/fedsol_combined.yaml").runs()
    fedavg = [r for r in runs if r.method.name == "fedavg"]
    assert fedavg and all("paired within experiment 'fedsol_combined'" in r.train.engine_pairing for r in runs)
    # the paper's FedSOL trains stacked (client_live_terms): fedsol_partial pairs nothing
    partial = load_config(repo_root / "config/experiments/fedsol_partial.yaml").runs()
    assert all(r.train.engine_pairing == "" for r in partial)
    default = load_config(repo_root / "config/config.yaml").runs()
    assert all(r.train.engine_pairing == "" for r in default if r.experiment == "embedded")
    continual = [r for r in default if r.experiment == "continual"]
    assert {r.method.name for r in continual} >= {"der"} and all(r.train.engine_pairing == "" for r in continual)
    # a method that asks for an engine keeps it; the pairing hint does not enter the hash
    raw = load_yaml(repo_root / "config/experiments/fedsol_combined.yaml")
    raw["experiments"][0]["methods"][0]["train"] = {"client_engine": "vectorized"}
    own = [r for r in parse_config(raw).runs() if r.method.name == "fedavg"]
    assert all(r.train.engine_pairing == "" and r.train.client_engine == "vectorized" for r in own)
    unpaired = [replace(r, train=replace(r.train, engine_pairing="")) for r in fedavg]
    assert [r.hash for r in unpaired] == [r.hash for r in fedavg]


def test_run_config_round_trip_keeps_hash(repo_root, make_run_config):
    runs = load_config(repo_root / "config/config.yaml").runs()
    runs.append(make_run_config(partition=PartitionSpec("iid", clients=2)))
    runs.append(make_run_config(optimizer={"name": "adam", "lr": 0.001, "betas": (0.8, 0.9)}))
    for rc in runs:
        d = json.loads(json.dumps(rc.to_dict()))  # as stored in run.json
        back = RunConfig.from_dict(d)
        assert back.hash == rc.hash
        assert back == rc
        assert back.run_dir == rc.run_dir and back.partition_dir == rc.partition_dir


def test_public_splits_train_is_the_unset_run_and_train_test_another(minimal_config):
    """``splits: train`` is the default (the run keeps the identity it had before the key);
    ``train+test`` is another run."""
    def run(splits):
        d = copy.deepcopy(minimal_config)
        dset(d).update(name="digits", model="cnn2d", public={"source": "dataset", "dataset": "blobs", "options": {"size": 8}})
        if splits:
            dset(d)["public"]["splits"] = splits
        return parse_config(d).experiments[0].runs("data", "results")[0]

    unset, train, both = run(None), run("train"), run("train+test")
    assert train.hash == unset.hash and "splits" not in train.dataset.public
    assert both.hash != unset.hash and both.dataset.public["splits"] == "train+test"


def test_run_config_hash_changes_with_settings(make_run_config):
    base = make_run_config()
    assert make_run_config(seed=1).hash != base.hash
    assert make_run_config(rounds=3).hash != base.hash
    assert make_run_config(partition=PartitionSpec("iid", clients=4, seed=1)).hash != base.hash
    assert make_run_config().hash == base.hash


def test_load_run_config_accepts_run_json(tmp_path, make_run_config):
    rc = make_run_config()
    (tmp_path / "run.json").write_text(json.dumps({"status": "completed", "config": rc.to_dict()}))
    assert load_run_config(tmp_path / "run.json").hash == rc.hash
    (tmp_path / "bad.json").write_text(json.dumps({"experiment": "x"}))
    with pytest.raises(FedForgetError, match="missing or unexpected key"):
        load_run_config(tmp_path / "bad.json")


def test_partition_slug_and_path_differ_when_alpha_differs(repo_root):
    wf = load_config(repo_root / "config/config.yaml")
    ds = wf.experiments[0].datasets[0]
    a = PartitionSpec("dirichlet", clients=20, alpha=0.1, min_size=10)
    b = PartitionSpec("dirichlet", clients=20, alpha=0.5, min_size=10)
    assert a.slug != b.slug
    assert partition_dir("r", ds, a) != partition_dir("r", ds, b)


@pytest.mark.parametrize("alpha_a,alpha_b", [(0.1, 0.1000001), (0.123456, 0.1234564)])
def test_partition_slug_injective_in_alpha(alpha_a, alpha_b):
    a = PartitionSpec("dirichlet", clients=20, alpha=alpha_a, min_size=10)
    b = PartitionSpec("dirichlet", clients=20, alpha=alpha_b, min_size=10)
    assert a.slug != b.slug


def test_defaults_are_stated_once_in_the_code():
    """The schema states no default of train, optimizer, partitions and smoke (the code that
    reads them does: TrainSpec, OptimizerSpec, PartitionSpec, smoke.DEFAULTS); every key the
    schema lists there is a field of that code, and the documented schema fills each default
    from it."""
    s = schema()
    blocks = {b: (s["$defs"][b] if b in s["$defs"] else s["properties"][b])["properties"] for b in BLOCKS}
    for block, props in blocks.items():
        assert not [k for k, v in props.items() if "default" in v], block
    assert set(blocks["train"]) == {f.name for f in fields(TrainSpec)} - set(INTERNAL_TRAIN_KEYS)
    assert set(blocks["optimizer"]) == {f.name for f in fields(OptimizerSpec)}
    assert set(blocks["partition"]) == {f.name for f in fields(PartitionSpec)} - set(PARTITION_INTERNAL_KEYS)
    assert set(blocks["smoke"]) == set(SMOKE_DEFAULTS)
    doc = documented_schema()["$defs"]
    assert doc["train"]["properties"]["rounds"]["default"] == TrainSpec().rounds
    assert doc["optimizer"]["properties"]["betas"]["default"] == list(OptimizerSpec().betas)
    assert doc["partition"]["properties"]["min_size"]["default"] == PartitionSpec().min_size
    assert "default" not in doc["partition"]["properties"]["clients"]  # required: no default


def test_the_reference_is_generated():
    """docs/reference.md is what ``fedforget reference`` prints (regenerate it with
    ``fedforget reference > docs/reference.md``)."""
    path = Path(__file__).resolve().parents[1] / "docs" / "reference.md"
    assert path.read_text() == reference_markdown(), "docs/reference.md is stale: run fedforget reference > docs/reference.md"


def test_floats_without_a_dot_are_numbers_in_yaml_and_in_a_jobs_json(tmp_path, make_run_config):
    """YAML 1.2's floats (PyYAML reads YAML 1.1, where 5e-2 is a string): ``lr: 5e-2`` is a
    number, a quoted "5e-2" a string; a job's config.json, where JSON writes 5e-05, loads
    back to the same run (its hash); Snakemake's YAML 1.1 load is retyped from ours."""
    import json

    from fedforget.config import load_run_config, yaml12_floats

    (tmp_path / "c.yaml").write_text("a: 5e-2\nb: '5e-2'\nc: [1e5, -3e-05]\nd: 5\ne: v1e5\n")
    loaded = load_yaml(tmp_path / "c.yaml")
    assert loaded == {"a": 0.05, "b": "5e-2", "c": [100000.0, -3e-05], "d": 5, "e": "v1e5"}
    snake = yaml.safe_load((tmp_path / "c.yaml").read_text())
    assert snake["a"] == "5e-2" and yaml12_floats(snake, loaded) == loaded
    # two files merged as Snakemake merges them: each value read from its own text, the last file's
    later = {"a": "1e-3", "b": "5e-2"}  # Snakemake's merge of c.yaml and a file with a: 1e-3
    assert yaml12_floats(later, {**loaded, "a": 1e-3}) == {"a": 1e-3, "b": "5e-2"}
    held = {"x": {"lr": "5e-2"}}  # a nested --config value, which Snakemake leaves a string
    typed_overrides(held, {"x": {"lr": "5e-2"}})
    assert held == {"x": {"lr": 0.05}}
    rc = make_run_config(optimizer={"lr": 5e-05})
    (tmp_path / "config.json").write_text(json.dumps(rc.to_dict()))
    assert "5e-05" in (tmp_path / "config.json").read_text()
    back = load_run_config(tmp_path / "config.json")
    assert back == rc and back.hash == rc.hash


def test_load_yaml_errors(tmp_path):
    with pytest.raises(FedForgetError, match="config file not found"):
        load_yaml(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("experiments: [\n")
    with pytest.raises(FedForgetError, match="not valid YAML"):
        load_yaml(tmp_path / "bad.yaml")
    (tmp_path / "bad.yaml").write_text("a: 1\n b: 2\n")  # one line: the file, where, what
    with pytest.raises(FedForgetError) as e:
        load_yaml(tmp_path / "bad.yaml")
    assert str(e.value) == f"config file {tmp_path / 'bad.yaml'}, line 2, column 3 is not valid YAML: mapping values are not allowed here"
    (tmp_path / "list.yaml").write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(FedForgetError, match="mapping at the top level .*, got a list"):
        load_yaml(tmp_path / "list.yaml")
    (tmp_path / "empty.yaml").write_text("# nothing set\n")
    with pytest.raises(FedForgetError, match="empty.yaml is empty"):
        load_yaml(tmp_path / "empty.yaml")


def test_a_paper_map_key_that_is_no_label_of_the_config_is_refused(repo_root, monkeypatch, minimal_config):
    """A misspelt method, dataset or setting label in a paper link's maps left its row or
    column unlinked without a word; a key of another experiment's label (one link anchor
    shared by several) is allowed."""
    monkeypatch.chdir(repo_root)  # paper_results is relative to the working directory
    d = copy.deepcopy(minimal_config)
    ex(d)["paper"] = {"name": "fedsol", "table": 2, "method_map": {"fedavg": "FedAvg"},
                      "dataset_map": {"iris": "cifar10"}, "setting_map": {"iid": "lda0.1"}}  # fmt: skip
    parse_config(copy.deepcopy(d))
    ex(d)["paper"]["method_map"] = {"fedavgg": "FedAvg"}
    ex(d)["paper"]["dataset_map"] = {"iris": "cifar10", "other": "svhn"}
    with pytest.raises(FedForgetError) as e:
        parse_config(copy.deepcopy(d))
    msg = str(e.value)
    assert "experiments[0].paper.method_map: 'fedavgg' is no method label of this config (did you mean 'fedavg'?); allowed: fedavg" in msg
    assert "experiments[0].paper.dataset_map: 'other' is no dataset label of this config" in msg
    second = copy.deepcopy(ex(d))
    second.update(name="tiny2", datasets=[{"name": "iris", "model": "mlp", "label": "other"}])
    ex(d)["paper"]["method_map"] = {"fedavg": "FedAvg"}
    d["experiments"].append(second)
    second["paper"] = ex(d)["paper"]
    parse_config(d)


def test_load_yaml_refuses_a_repeated_key_but_keeps_merge_overrides(tmp_path):
    """A key written twice in one mapping is refused, naming both lines (YAML keeps the last
    silently); a merged anchor's key overridden after ``<<`` is YAML's override, allowed."""
    (tmp_path / "dup.yaml").write_text("train:\n  rounds: 30\n  local_epochs: 2\n  rounds: 3\n")
    with pytest.raises(FedForgetError) as e:
        load_yaml(tmp_path / "dup.yaml")
    assert "line 4" in str(e.value) and "key 'rounds' is given twice in one mapping (first at line 2)" in str(e.value)
    (tmp_path / "seq.yaml").write_text("experiments:\n  - {name: a, seeds: [0], name: b}\n")
    with pytest.raises(FedForgetError, match="key 'name' is given twice"):
        load_yaml(tmp_path / "seq.yaml")
    (tmp_path / "merge.yaml").write_text("base: &t {rounds: 3, local_epochs: 1}\ntrain: {<<: *t, rounds: 5}\n")
    assert load_yaml(tmp_path / "merge.yaml")["train"] == {"rounds": 5, "local_epochs": 1}


def test_epoch_rows_with_and_without_drop_last():
    """drop_last trains full minibatches only; fewer rows than a batch are the client's one
    batch, but a single row is none (BatchNorm cannot train on it: the client sits out)."""
    keep = TrainSpec(batch_size=4)
    drop = TrainSpec(batch_size=4, drop_last=True)
    ns = [0, 1, 2, 3, 4, 5, 9]
    assert [keep.epoch_rows(n) for n in ns] == ns
    assert [drop.epoch_rows(n) for n in ns] == [0, 0, 2, 3, 4, 4, 8]


def test_nested_command_line_values_get_their_yaml_types(minimal_config):
    """``snakemake --config scale=smoke "smoke={rounds: 1, ...}"``: Snakemake's own parser reads
    the nested value with YAML's BaseLoader (every scalar a string, which the schema rejects);
    typed_overrides gives those scalars their types, and only those."""
    snakemake_cli = pytest.importorskip("snakemake.cli")
    from snakemake.utils import update_config

    args = ["scale=smoke", "smoke={rounds: 1, local_epochs: 2, rows: 50, results_dir: out/7}"]
    over = snakemake_cli.parse_config(args)
    assert over["smoke"]["rounds"] == "1"  # what Snakemake hands over
    base = copy.deepcopy(minimal_config)
    base["experiments"][0]["label_note"] = "3"  # a quoted file value outside --config: untouched
    config = copy.deepcopy(base)
    update_config(config, over)
    with pytest.raises(FedForgetError, match=r"smoke\.rounds"):
        parse_config(copy.deepcopy(config))
    typed_overrides(config, over)
    assert config["smoke"] == {"rounds": 1, "local_epochs": 2, "rows": 50, "results_dir": "out/7"}
    assert config["experiments"][0]["label_note"] == "3"
    del config["experiments"][0]["label_note"]
    wf = parse_config(config)
    assert wf.results_dir == "out/7" and {rc.train.rounds for rc in wf.runs()} == {1}
    # a bad nested value is still refused, by name
    bad = copy.deepcopy(minimal_config)
    over = snakemake_cli.parse_config(["scale=smoke", "smoke={rounds: many}"])
    update_config(bad, over)
    typed_overrides(bad, over)
    with pytest.raises(FedForgetError, match=r"smoke\.rounds.*many"):
        parse_config(bad)
    # top level: Snakemake reads only True / False as booleans; the documented download=true too
    over = snakemake_cli.parse_config(["download=true", "only=tiny", "results_dir=false"])
    assert over["download"] == "true"
    config = copy.deepcopy(minimal_config)
    update_config(config, over)
    typed_overrides(config, over)
    assert config["download"] is True and config["only"] == "tiny" and config["results_dir"] is False


def test_no_variant_of_the_default_config_crashes_validation(tmp_path):
    """benchmarks/config_fuzz.py over config/config.yaml: every key path given each bad value
    (and deleted), every string swapped for each valid alternative, every bool flipped; each
    variant is accepted or refused with a FedForgetError, never another exception (the whole
    run over every shipped config: docs/benchmarks.md)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "fuzz.json"
    subprocess.run([sys.executable, str(root / "benchmarks" / "config_fuzz.py"), "--configs", "config/config.yaml",
                    "--jobs", "1", "--out", str(out)], check=True, capture_output=True, timeout=300)  # fmt: skip
    result = json.loads(out.read_text())
    assert result["variants"] > 1500 and result["crash_sites"] == {}
